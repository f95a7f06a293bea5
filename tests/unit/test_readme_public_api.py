"""Every name README's "Public API" section lists exists, with that spelling.

The section lists what the design's public-API table cannot (names added later): a
``Builder.with_*`` method, a ``kr.<name>`` export, or ``@kr.reconciler(..., option=)``
keyword arguments. Renaming one fails here until the README follows.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import kopf_reconcile as kr

README = Path(__file__).resolve().parents[2] / "README.md"


def listed_names() -> list[str]:
    """The first column of the section's table, without its backticks."""
    text = README.read_text()
    section = re.search(r"^## Public API\n(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
    assert section, "README has a '## Public API' section"
    rows = re.findall(r"^\| `([^`]+)` \|", section.group(1), re.MULTILINE)
    assert rows, "its table lists names"
    return rows


def test_every_listed_name_exists() -> None:
    options = set(inspect.signature(kr.reconciler).parameters)
    for listed in listed_names():
        if listed.startswith("@kr.reconciler("):
            named = re.findall(r"(\w+)=", listed)
            assert named, listed
            assert set(named) <= options, (listed, set(named) - options)
        elif listed.startswith("Builder."):
            method = re.match(r"Builder\.(\w+)", listed)
            assert method and callable(getattr(kr.Builder, method.group(1), None)), listed
        else:
            export = re.match(r"kr\.(\w+)", listed)
            assert export, (
                f"{listed!r}: list names as kr.<name>, Builder.<method> or @kr.reconciler"
            )
            assert export.group(1) in kr.__all__ and hasattr(kr, export.group(1)), listed


def test_the_newer_public_names_are_listed() -> None:
    listed = " ".join(listed_names())
    for name in (
        "Builder.with_shards", "shards=", "shard_by_namespace=", "cache_transform=",
        "generation_changed=", "events=", "kr.ShardableRepository", "kr.DeadLetterStore",
        "kr.event(", "kr.EventSink", "Builder.with_events", "Builder.with_redrive_interval",
    ):  # fmt: skip
        assert name in listed, name
