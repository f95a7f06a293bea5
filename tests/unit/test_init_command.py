"""``kopf-reconcile init``: names checked with clear errors, every template filled in, and
the folder it writes into empty."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

import kopf_reconcile as kr
from kopf_reconcile.integration.cli.init import FILES, Project, scaffold


@pytest.mark.parametrize(
    ("name", "kind", "plural"),
    [("websites", "Website", "websites"), ("web-apps", "WebApp", "webapps"), ("s", "S", "ss")],
)
def test_the_kind_comes_from_the_name(name: str, kind: str, plural: str) -> None:
    project = Project.of(name)
    assert (project.kind, project.plural) == (kind, plural)


@pytest.mark.parametrize(
    ("arguments", "complaint"),
    [
        ({"name": "Websites"}, "NAME must be a lowercase DNS label"),
        ({"name": "w" * 41}, "at most 40 characters"),
        ({"name": "websites", "kind": "website"}, "--kind must be UpperCamelCase"),
        ({"name": "websites", "plural": "Websites"}, "--plural must be a lowercase DNS label"),
        ({"name": "websites", "group": "example"}, "--group must be a DNS subdomain"),
        ({"name": "websites", "version": "1"}, "--version must look like v1"),
    ],
)
def test_bad_names_are_refused_naming_the_option(arguments: dict[str, str], complaint: str) -> None:
    name = arguments.pop("name")
    with pytest.raises(kr.ConfigError, match=complaint):
        Project.of(name, **arguments)


def test_every_template_is_filled_in(tmp_path: Path) -> None:
    project = Project.of("websites", group="web.example.org", version="v1beta1")
    written = scaffold(project, tmp_path / "new")
    assert len(written) == len(FILES)
    for path in written:
        assert "${" not in path.read_text(), path
    ast.parse((tmp_path / "new" / "handlers.py").read_text())
    ast.parse((tmp_path / "new" / "tests" / "test_handlers.py").read_text())
    crd = yaml.safe_load((tmp_path / "new" / "crds" / "websites.yaml").read_text())
    assert crd["metadata"]["name"] == "websites.web.example.org"
    assert crd["spec"]["versions"][0]["name"] == "v1beta1"
    handlers = (tmp_path / "new" / "handlers.py").read_text()
    assert f'reconciler_id="{project.reconciler_id}"' in handlers
    assert project.reconciler_id == "websites.web.example.org-reconcile-website"


def test_only_an_empty_folder_is_written(tmp_path: Path) -> None:
    (tmp_path / ".git").mkdir()  # a fresh repository is still empty
    scaffold(Project.of("websites"), tmp_path)
    with pytest.raises(kr.ConfigError, match="is not empty"):
        scaffold(Project.of("websites"), tmp_path)
    file = tmp_path / "handlers.py"
    with pytest.raises(kr.ConfigError, match="is a file, not a folder"):
        scaffold(Project.of("websites"), file)


#: The pytest plugin that provides each option a scaffold's pytest configuration may set.
PLUGIN_OF_OPTION = {"asyncio_": "pytest-asyncio", "timeout": "pytest-timeout"}


def test_every_pytest_option_of_the_scaffold_comes_with_the_testing_extra(tmp_path: Path) -> None:
    # A plain `pip install 'kopf-reconcile[testing]' pytest` must run the project's tests
    # without an unknown-option warning: each plugin its options need is in the extra.
    import tomllib

    scaffold(Project.of("websites"), tmp_path)
    options = tomllib.loads((tmp_path / "pyproject.toml").read_text())["tool"]["pytest"]
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    testing = " ".join(project["project"]["optional-dependencies"]["testing"])
    core = {"testpaths"}
    for option in set(options["ini_options"]) - core:
        plugin = next(
            (p for prefix, p in PLUGIN_OF_OPTION.items() if option.startswith(prefix)), None
        )
        assert plugin is not None, f"the scaffold sets {option!r}: which plugin provides it?"
        assert plugin in testing, f"the scaffold sets {option!r}, but [testing] lacks {plugin}"
