"""The kopf internals the shim relies on still have the shape it expects.

A kopf release that moves or reshapes one of them fails here, by name, rather than
leaving the shim to do without it at run time (integration/kopf_internals.py).
"""

from __future__ import annotations

import inspect
from importlib import metadata

import kopf
import pytest
from kopf._cogs.clients import watching

from kopf_reconcile.integration import kopf_internals, kopf_shim


def test_every_kopf_internal_the_shim_uses_has_its_expected_shape() -> None:
    assert kopf_internals.shape_problems() == []


def test_the_wrapped_watch_stream_takes_exactly_the_parameters_the_wrapper_passes_on() -> None:
    original = getattr(watching.infinite_watch, "_kopf_original", watching.infinite_watch)
    parameters = inspect.signature(original).parameters
    assert tuple(parameters) == kopf_internals.INFINITE_WATCH_PARAMETERS
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters.values())
    assert watching.Bookmark.LISTED is kopf_internals.infinite_watch()[1]  # type: ignore[index]


def test_a_changed_watch_stream_is_reported_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    async def reshaped(*, settings: object, resource: object, namespaces: object) -> None:
        return None

    monkeypatch.setattr(watching, "infinite_watch", reshaped)
    problems = kopf_internals.shape_problems()
    assert len(problems) == 1 and "infinite_watch" in problems[0]


def test_a_missing_registry_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kopf_internals, "RESOURCE_REGISTRIES", ("_indexing", "_gone"))
    assert kopf_internals.resource_handlers(kopf.OperatorRegistry()) is None
    assert any("_gone" in p for p in kopf_internals.shape_problems())


def test_the_installed_kopf_is_one_the_project_admits() -> None:
    # pytest depends on packaging: it is there wherever the suite runs.
    from packaging.requirements import Requirement

    kopf_requirements = [
        Requirement(r)
        for r in metadata.requires("kopf-reconcile") or []
        if Requirement(r).name == "kopf"
    ]
    assert len(kopf_requirements) == 1
    admitted = kopf_requirements[0].specifier
    assert admitted.contains(metadata.version("kopf"))
    assert not admitted.contains("1.46.0")  # an upper bound: a release not run against is refused
    assert not admitted.contains("1.45.1")


def test_the_shim_reaches_kopf_internals_through_one_module_only() -> None:
    source = inspect.getsource(kopf_shim)
    assert "kopf._" not in source.replace("``kopf._cogs.clients.watching.infinite_watch``", "")
    assert "_activities" not in source and "get_all_handlers" not in source
