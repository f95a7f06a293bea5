"""docs/api.md, the public API reference, against the package.

Every name it lists exists with that spelling (a ``kr.<name>`` export, a ``Builder`` or
``Loop`` method, an ``@kr.reconciler(..., option=)`` keyword, a ``kopf_reconcile.testing``
class or a pytest fixture of the plugin), and everything public is listed: every name of
``kr.__all__``, every ``Builder`` method, every ``@kr.reconciler`` option, every fixture.
Renaming or adding one fails here until the reference follows. The README's "Public API"
section points to it, and no document points outside the repository.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import kopf_reconcile as kr
import kopf_reconcile.testing
from kopf_reconcile.testing import pytest_plugin

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "api.md"
README = ROOT / "README.md"


def listed_names() -> list[str]:
    """The first column of every table of docs/api.md, without its backticks."""
    rows = re.findall(r"^\| `([^`]+)` \|", API.read_text(), re.MULTILINE)
    assert rows, "docs/api.md has tables of names"
    return rows


def reconciler_options(listed: str) -> set[str]:
    return set(re.findall(r"(\w+)=", listed))


def fixtures() -> set[str]:
    return {
        name
        for name, value in vars(pytest_plugin).items()
        if type(value).__name__ == "FixtureFunctionDefinition"
        or hasattr(value, "_pytestfixturefunction")
    }


def test_every_listed_name_exists() -> None:
    options = set(inspect.signature(kr.reconciler).parameters)
    for listed in listed_names():
        if listed.startswith("@kr.reconciler("):
            named = reconciler_options(listed)
            assert named, listed
            assert named <= options, (listed, named - options)
        elif match := re.match(r"(Builder|Loop)\.(\w+)", listed):
            owner = getattr(kr, match.group(1))
            assert hasattr(owner, match.group(2)), listed
        elif match := re.match(r"kopf_reconcile\.testing\.(\w+)$", listed):
            assert match.group(1) in kopf_reconcile.testing.__all__, listed
        elif match := re.match(r"fixture (\w+)$", listed):
            assert match.group(1) in fixtures(), listed
        else:
            export = re.match(r"kr\.(\w+)", listed)
            assert export, (
                f"{listed!r}: list names as kr.<name>, Builder.<method>, @kr.reconciler(..., "
                "option=), kopf_reconcile.testing.<name> or fixture <name>"
            )
            assert export.group(1) in kr.__all__ and hasattr(kr, export.group(1)), listed


def test_everything_public_is_listed() -> None:
    listed = listed_names()
    exports = {m.group(1) for name in listed if (m := re.match(r"kr\.(\w+)", name))}
    assert set(kr.__all__) - {"reconciler"} <= exports, set(kr.__all__) - exports
    methods = {m.group(1) for name in listed if (m := re.match(r"Builder\.(\w+)", name))}
    public_methods = {name for name in vars(kr.Builder) if not name.startswith("_")}
    assert public_methods <= methods, public_methods - methods
    options = set().union(
        *(reconciler_options(name) for name in listed if name.startswith("@kr.reconciler("))
    )
    parameters = set(inspect.signature(kr.reconciler).parameters) - {"group", "version", "plural"}
    assert parameters <= options, parameters - options
    listed_fixtures = {m.group(1) for name in listed if (m := re.match(r"fixture (\w+)$", name))}
    assert fixtures() == listed_fixtures, fixtures() ^ listed_fixtures


def test_the_readme_points_to_the_reference() -> None:
    section = re.search(
        r"^## Public API\n(.*?)(?=^## )", README.read_text(), re.MULTILINE | re.DOTALL
    )
    assert section, "README has a '## Public API' section"
    assert "(docs/api.md)" in section.group(1)


DOCUMENTS = sorted(
    [README, *ROOT.glob("docs/*.md"), *ROOT.glob("charts/*/README.md"), *ROOT.glob("**/README.md")]
)


@pytest.mark.parametrize(
    "document",
    sorted({d for d in DOCUMENTS if ".venv" not in d.parts and "build" not in d.parts}),
    ids=lambda d: str(d.relative_to(ROOT)),
)
def test_no_document_points_outside_the_repository(document: Path) -> None:
    """Links are to files of the repository (or to the web), and each one exists."""
    text = document.read_text()
    assert "DESIGN.md" not in text
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        assert (document.parent / target).exists(), f"{document.name} links {target}"
