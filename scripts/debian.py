"""Debian's packages and archive, as the build scripts use them.

The machine's own apt configuration is read, never changed: packages are
installed with ``apt-get`` (``apt-get update`` once, only when one is
missing), and the archive that ``debootstrap`` makes the image's base from is
the one the machine's own apt source entries name.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

SYSTEM_SOURCE_LIST = Path("/etc/apt/sources.list")
SYSTEM_SOURCE_PARTS = Path("/etc/apt/sources.list.d")


class SetupError(Exception):
    """A build or setup step cannot be done; the message says why and what to do."""


@dataclass(frozen=True)
class SourceEntry:
    """One apt source entry: where a Debian archive is and what to take from it."""

    uris: tuple[str, ...]
    suites: tuple[str, ...]
    components: tuple[str, ...]
    signed_by: str | None


def run(
    argv: Sequence[str | Path], *, cwd: Path | None = None, env: dict[str, str] | None = None
) -> None:
    print("+", " ".join(str(arg) for arg in argv), flush=True)
    result = subprocess.run([str(arg) for arg in argv], cwd=cwd, env=env, check=False)
    if result.returncode != 0:
        raise SetupError(f"command failed with exit code {result.returncode}: {argv[0]}")


def as_root(argv: Sequence[str | Path]) -> list[str | Path]:
    """Package installation needs root; use sudo when not running as root."""
    if os.geteuid() == 0:
        return list(argv)
    if shutil.which("sudo") is None:
        raise SetupError("installing Debian packages needs root (or sudo)")
    return ["sudo", *argv]


# --- packages ----------------------------------------------------------------


def missing_packages(packages: Sequence[str]) -> list[str]:
    missing = []
    for package in packages:
        query = subprocess.run(
            ["dpkg-query", "-W", "-f=${db:Status-Status}", package],
            capture_output=True,
            text=True,
            check=False,
        )
        if query.stdout.strip() != "installed":
            missing.append(package)
    return missing


def install_packages(packages: Sequence[str]) -> None:
    missing = missing_packages(packages)
    if not missing:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(as_root(["apt-get", "update", "-q"]), env=env)
    run(as_root(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]), env=env)


# --- the archive -------------------------------------------------------------


def deb822_stanzas(text: str) -> Iterator[dict[str, str]]:
    """Fields of each stanza of a deb822 ``.sources`` file (continuation lines folded)."""
    fields: dict[str, str] = {}
    key = None
    for line in [*text.splitlines(), ""]:
        if line.startswith("#"):
            continue
        if not line.strip():
            if fields:
                yield fields
            fields, key = {}, None
        elif line[0].isspace() and key is not None:
            fields[key] += " " + line.strip()
        elif ":" in line:
            key, value = line.split(":", 1)
            key = key.strip().lower()
            fields[key] = value.strip()


def one_line_entries(text: str) -> Iterator[SourceEntry]:
    """Entries of a one-line ``sources.list``: ``deb [options] uri suite components...``."""
    for raw_line in text.splitlines():
        line = raw_line.split("#", 1)[0].strip()
        match = re.fullmatch(r"(\S+)\s+(?:\[([^\]]*)\]\s+)?(\S+)\s+(\S+)\s*(.*)", line)
        if not match or match[1] != "deb":
            continue
        options = dict(opt.split("=", 1) for opt in (match[2] or "").split() if "=" in opt)
        yield SourceEntry(
            uris=(match[3],),
            suites=(match[4],),
            components=tuple(match[5].split()),
            signed_by=options.get("signed-by"),
        )


def system_entries() -> Iterator[SourceEntry]:
    """The binary-package entries apt itself reads (files apt ignores are ignored too)."""
    one_line_files = [SYSTEM_SOURCE_LIST, *sorted(SYSTEM_SOURCE_PARTS.glob("*.list"))]
    for path in one_line_files:
        if path.is_file():
            yield from one_line_entries(path.read_text())
    for path in sorted(SYSTEM_SOURCE_PARTS.glob("*.sources")):
        for fields in deb822_stanzas(path.read_text()):
            if "deb" not in fields.get("types", "").split():
                continue
            if fields.get("enabled", "yes").lower() == "no":
                continue
            yield SourceEntry(
                uris=tuple(fields.get("uris", "").split()),
                suites=tuple(fields.get("suites", "").split()),
                components=tuple(fields.get("components", "").split()),
                signed_by=fields.get("signed-by"),
            )


def debian_entries(codename: str) -> list[SourceEntry]:
    """The machine's entries for Debian ``codename`` (component main), suites narrowed to it."""
    entries = []
    for entry in system_entries():
        suites = tuple(
            suite for suite in entry.suites if suite == codename or suite.startswith(f"{codename}-")
        )
        if suites and entry.uris and "main" in entry.components:
            entries.append(SourceEntry(entry.uris, suites, ("main",), entry.signed_by))
    if not entries:
        raise SetupError(
            f"no apt source entry for Debian {codename} (component main) found in "
            f"{SYSTEM_SOURCE_LIST} or {SYSTEM_SOURCE_PARTS}"
        )
    return entries
