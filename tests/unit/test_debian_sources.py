"""The image build finds Debian's archive in the machine's own apt source entries.

Only entries for the Debian release the image is made of qualify; everything
else apt reads (other vendors' archives, disabled stanzas, deb-src lines,
comments) must be left out, and the keyring kept.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "debian.py"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"


@pytest.fixture
def setup_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The setup script as a module, reading apt source entries from ``tmp_path``."""
    spec = importlib.util.spec_from_file_location("debian_setup", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    (tmp_path / "sources.list.d").mkdir()
    monkeypatch.setattr(module, "SYSTEM_SOURCE_LIST", tmp_path / "sources.list")
    monkeypatch.setattr(module, "SYSTEM_SOURCE_PARTS", tmp_path / "sources.list.d")
    return module


def test_deb822_entries_of_the_debian_release_only(
    setup_script: ModuleType, tmp_path: Path
) -> None:
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\n"
        "# a comment between fields\n"
        "URIs: http://archive.example/debian\n"
        "Suites: bookworm bookworm-updates\n"
        "Components: main contrib\n"
        f"Signed-By: {KEYRING}\n"
        "\n"
        "Types: deb\n"
        "URIs: http://archive.example/debian-security\n"
        "Suites: bookworm-security\n"
        "Components: main\n"
        f"Signed-By: {KEYRING}\n"
        "\n"
        "Types: deb\n"
        "URIs: http://archive.example/disabled\n"
        "Suites: bookworm\n"
        "Components: main\n"
        "Enabled: no\n"
    )
    (tmp_path / "sources.list.d" / "vendor.sources").write_text(
        "Types: deb\nURIs: http://vendor.example/apt\nSuites: nodistro\nComponents: main\n"
    )
    (tmp_path / "sources.list.d" / "ignored.sources.disabled").write_text(
        "Types: deb\nURIs: http://ignored.example\nSuites: bookworm\nComponents: main\n"
    )

    entries = setup_script.debian_entries("bookworm")

    assert [(e.uris, e.suites, e.components, e.signed_by) for e in entries] == [
        (("http://archive.example/debian",), ("bookworm", "bookworm-updates"), ("main",), KEYRING),
        (("http://archive.example/debian-security",), ("bookworm-security",), ("main",), KEYRING),
    ]


def test_one_line_entries_keep_their_keyring(setup_script: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "sources.list").write_text(
        "# deb http://commented.example/debian bookworm main\n"
        f"deb [arch=amd64 signed-by={KEYRING}] http://archive.example/debian bookworm main\n"
        "deb-src http://archive.example/debian bookworm main\n"
        "deb http://vendor.example/apt cloud-sdk-bookworm main\n"
        "deb http://archive.example/debian bookworm contrib\n"
    )

    entries = setup_script.debian_entries("bookworm")

    assert [(e.uris, e.suites, e.components, e.signed_by) for e in entries] == [
        (("http://archive.example/debian",), ("bookworm",), ("main",), KEYRING)
    ]


def test_no_debian_entry_is_a_clear_error(setup_script: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "sources.list").write_text("deb http://vendor.example/apt nodistro main\n")

    with pytest.raises(setup_script.SetupError, match="no apt source entry for Debian bookworm"):
        setup_script.debian_entries("bookworm")
