"""``kopf-reconcile init NAME``: a new operator project in an empty folder.

It writes, from the templates in ``init_templates/`` (package data):

* ``handlers.py``: one reconciler of the project's kind, with the Kubernetes API client it
  patches the status with;
* ``crds/<plural>.yaml``: the kind's CustomResourceDefinition;
* ``tests/test_handlers.py``: the operator run against the pytest fixtures of
  :mod:`kopf_reconcile.testing` (an embedded Kubernetes API and a real PostgreSQL);
* ``pyproject.toml`` (pytest's settings), ``chart-values.yaml`` (values of the chart),
  ``Dockerfile`` (the project's image with the handlers), ``README.md``, ``.gitignore``,
  ``.dockerignore``.

The project's tests pass as written. The kind defaults from NAME (``websites``: kind
``Website``, plural ``websites``, group ``example.com``); ``--kind``, ``--plural``,
``--group`` and ``--version`` choose them.
"""

from __future__ import annotations

import argparse
import re
import string
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from kopf_reconcile.api import ConfigError
from kopf_reconcile.integration.naming import derived_reconciler_id

__all__ = ["Project", "add_parser", "scaffold"]

TEMPLATES = "init_templates"
# Template (relative to TEMPLATES) -> the file it becomes; {plural} is the project's.
FILES = {
    "handlers.py.tmpl": "handlers.py",
    "crds/CRD.yaml.tmpl": "crds/{plural}.yaml",
    "tests/test_handlers.py.tmpl": "tests/test_handlers.py",
    "pyproject.toml.tmpl": "pyproject.toml",
    "chart-values.yaml.tmpl": "chart-values.yaml",
    "Dockerfile.tmpl": "Dockerfile",
    "README.md.tmpl": "README.md",
    "gitignore.tmpl": ".gitignore",
    "dockerignore.tmpl": ".dockerignore",
}
LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
GROUP = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+$")
KIND = re.compile(r"^[A-Z][A-Za-z0-9]*$")
VERSION = re.compile(r"^v[1-9][0-9]*((alpha|beta)[1-9][0-9]*)?$")
MAX_NAME = 40  # it prefixes the chart's object names (at most 63 characters)


@dataclass(frozen=True)
class Project:
    """What a new operator project is about: its name and its kind."""

    name: str
    kind: str
    plural: str
    group: str = "example.com"
    version: str = "v1"

    @classmethod
    def of(
        cls,
        name: str,
        *,
        kind: str | None = None,
        plural: str | None = None,
        group: str = "example.com",
        version: str = "v1",
    ) -> Project:
        """The project, with the kind derived from ``name`` where not given; checked."""
        if not LABEL.match(name) or len(name) > MAX_NAME:
            raise ConfigError(
                f"init: NAME must be a lowercase DNS label of at most {MAX_NAME} characters "
                f"(letters, digits, '-'; it names the chart's objects and the image), got {name!r}"
            )
        if kind is None:
            words = name.split("-")
            words[-1] = (
                words[-1][:-1] if len(words[-1]) > 1 and words[-1].endswith("s") else words[-1]
            )
            kind = "".join(word.capitalize() for word in words if word)
            if not KIND.match(kind):
                raise ConfigError(f"init: no kind can be made of NAME {name!r}: give --kind")
        if not KIND.match(kind):
            raise ConfigError(f"init: --kind must be UpperCamelCase (Website), got {kind!r}")
        plural = f"{kind.lower()}s" if plural is None else plural
        if not LABEL.match(plural):
            raise ConfigError(f"init: --plural must be a lowercase DNS label, got {plural!r}")
        if not GROUP.match(group):
            raise ConfigError(
                f"init: --group must be a DNS subdomain with a dot (example.com), got {group!r}"
            )
        if not VERSION.match(version):
            raise ConfigError(f"init: --version must look like v1, v1beta1, got {version!r}")
        return cls(name=name, kind=kind, plural=plural, group=group, version=version)

    @property
    def singular(self) -> str:
        return self.kind.lower()

    @property
    def function(self) -> str:
        return self.singular

    @property
    def reconciler_id(self) -> str:
        return derived_reconciler_id(self.group, self.plural, f"reconcile_{self.function}")

    def substitutions(self) -> dict[str, str]:
        return {
            "name": self.name,
            "kind": self.kind,
            "plural": self.plural,
            "singular": self.singular,
            "group": self.group,
            "version": self.version,
            "function": self.function,
            "reconciler_id": self.reconciler_id,
            "constant": self.plural.upper().replace("-", "_"),  # the resource, in handlers.py
            "kopf_reconcile_version": _own_version(),
        }


def _own_version() -> str:
    try:
        return metadata.version("kopf-reconcile")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a bare checkout
        return "0.1.0"


def scaffold(project: Project, directory: Path) -> list[Path]:
    """Write the project's files into ``directory`` (created; it must be empty); their paths."""
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"init: {str(directory)!r} is a file, not a folder")
    present = (
        sorted(p.name for p in directory.iterdir() if p.name != ".git")
        if directory.exists()
        else []
    )
    if present:
        raise ConfigError(
            f"init: {str(directory)!r} is not empty ({', '.join(present[:5])}"
            f"{', ...' if len(present) > 5 else ''}): start a project in an empty folder"
        )
    values = project.substitutions()
    templates = resources.files(__package__).joinpath(TEMPLATES)
    written: list[Path] = []
    for template, target in FILES.items():
        text = templates.joinpath(template).read_text(encoding="utf-8")
        path = directory / target.format(plural=project.plural)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(string.Template(text).substitute(values), encoding="utf-8")
        written.append(path)
    return written


def add_parser(commands: Any) -> None:
    """``init``, on the CLI's subcommands."""
    parser = commands.add_parser(
        "init",
        help="start a new operator project in an empty folder",
        description=(
            "Write a new operator project: handlers.py with one reconciler, its CRD, a test "
            "on the embedded Kubernetes API and PostgreSQL, chart values and a Dockerfile. "
            "Its tests pass as written (pytest)."
        ),
    )
    parser.add_argument("name", metavar="NAME", help="the operator's name (a DNS label: websites)")
    parser.add_argument(
        "--directory", type=Path, default=Path(), help="where (default: here; must be empty)"
    )
    parser.add_argument("--kind", help="the kind it reconciles (default from NAME: Website)")
    parser.add_argument("--plural", help="the kind's plural (default: the kind, lower, + s)")
    parser.add_argument("--group", default="example.com", help="API group (default example.com)")
    parser.add_argument("--version", default="v1", help="API version (default v1)")
    parser.set_defaults(command=run)


def run(args: argparse.Namespace) -> int:
    project = Project.of(
        args.name, kind=args.kind, plural=args.plural, group=args.group, version=args.version
    )
    written = scaffold(project, args.directory)
    where = args.directory.resolve()
    print(
        f"{project.name}: a {project.kind} operator ({project.plural}.{project.group}) in {where}"
    )
    for path in written:
        print(f"  {path.relative_to(args.directory)}")
    print(
        "next:\n"
        "  pytest                                    # its test: embedded API and PostgreSQL\n"
        "  kopf-reconcile dev handlers.py --reload   # run it on your machine\n"
        "  README.md                                 # build the image, install the chart"
    )
    return 0
