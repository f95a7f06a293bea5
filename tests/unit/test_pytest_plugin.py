"""The pytest plugin kopf-reconcile registers loads in a project without pytest-asyncio."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

# As after `pip install kopf-reconcile pytest`: importing pytest_asyncio fails (a package
# that says so shadows the installed one); its own plugin and kmock's (a test dependency of
# this project that imports it too) are not loaded.
ABSENT = "raise ModuleNotFoundError(\"No module named 'pytest_asyncio'\", name='pytest_asyncio')\n"
PLUGINS_OFF = ("-p", "no:asyncio", "-p", "no:kmock", "-p", "no:cacheprovider")


def run_pytest(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    shadow = folder / "shadow" / "pytest_asyncio"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(ABSENT)
    return subprocess.run(
        [sys.executable, "-m", "pytest", *PLUGINS_OFF, *args],
        cwd=folder,
        env={**os.environ, "PYTHONPATH": str(shadow.parent)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_plain_install_runs_the_projects_tests(tmp_path: Path) -> None:
    (tmp_path / "test_plain.py").write_text("def test_plain():\n    assert True\n")
    result = run_pytest(tmp_path, "test_plain.py")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


def test_an_async_fixture_without_pytest_asyncio_says_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "test_cluster.py").write_text(
        textwrap.dedent(
            """
            def test_uses_the_cluster(embedded_cluster):
                pass
            """
        )
    )
    result = run_pytest(tmp_path, "test_cluster.py")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "embedded_cluster fixture of kopf-reconcile is async and needs pytest-asyncio" in (
        result.stdout
    )
    assert "kopf-reconcile[testing]" in result.stdout
