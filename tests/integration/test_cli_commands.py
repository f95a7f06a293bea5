"""``kopf-reconcile migrate`` and ``leases`` as an administrator runs them: the database URL
from a file or the environment (a password on the command line is warned about), and
failures as one line naming the problem, never a traceback."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BIN = Path(sys.executable).parent
PASSWORD = "Pg-s3cret-71c0"
# Nothing listens on port 1: connecting fails at once.
UNREACHABLE = f"postgresql://app:{PASSWORD}@127.0.0.1:1/app"

pytestmark = pytest.mark.skipif(
    not (BIN / "kopf-reconcile").exists(), reason="the package's script"
)


async def command(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    environment = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KOPF_RECONCILE_", "POD_", "KUBERNETES_"))
    }
    result = await asyncio.to_thread(
        subprocess.run,
        [str(BIN / "kopf-reconcile"), *args],
        capture_output=True, text=True, timeout=60, env={**environment, **(env or {})},
        check=False,
    )  # fmt: skip
    return result.returncode, result.stdout, result.stderr


async def test_migrate_reads_the_url_from_a_file(
    embedded_postgres_dsn: str, tmp_path: Path
) -> None:
    secret = tmp_path / "database-url"
    secret.write_text(embedded_postgres_dsn + "\n")
    status, out, err = await command("migrate", f"--database-url-file={secret}")
    assert status == 0, err
    assert "schema ready" in out
    assert "warning" not in err


async def test_a_password_on_the_command_line_is_warned_about_and_failures_are_one_line() -> None:
    status, out, err = await command("migrate", f"--database-url={UNREACHABLE}")
    assert status == 1
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    assert "password in --database-url is visible" in lines[0]
    assert lines[1].startswith("kopf-reconcile migrate: cannot create the tables at ")
    assert "127.0.0.1:1" in lines[1]
    assert PASSWORD not in out + err
    assert "Traceback" not in err


async def test_the_environment_variable_is_not_warned_about() -> None:
    status, _, err = await command("migrate", env={"KOPF_RECONCILE_DATABASE_URL": UNREACHABLE})
    assert status == 1
    assert len(err.strip().splitlines()) == 1, err
    assert "warning" not in err and "Traceback" not in err
    assert PASSWORD not in err


async def test_leases_failures_are_one_line(tmp_path: Path) -> None:
    secret = tmp_path / "database-url"
    secret.write_text(UNREACHABLE)
    missing = tmp_path / "no-kubeconfig"
    status, _, err = await command(
        "leases", f"--kubeconfig={missing}", f"--database-url-file={secret}"
    )
    assert status == 1
    lines = err.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["Kubernetes Leases", "PostgreSQL leases"]
    assert "Traceback" not in err and PASSWORD not in err


async def test_an_unreadable_url_file_is_a_configuration_error(tmp_path: Path) -> None:
    status, _, err = await command("leases", f"--database-url-file={tmp_path / 'absent'}")
    assert status == 2
    assert err.startswith("kopf-reconcile: configuration error: --database-url-file ")


async def without_a_reader(*args: str) -> tuple[int, str]:
    """``kopf-reconcile ARGS`` writing into a pipe whose reader has already gone (as ``| head
    -1`` leaves it): exit status and stderr."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        process = await asyncio.create_subprocess_exec(
            str(BIN / "kopf-reconcile"),
            *args,
            stdout=write_end,
            stderr=asyncio.subprocess.PIPE,
            env={k: v for k, v in os.environ.items() if not k.startswith("KOPF_RECONCILE_")},
        )
    finally:
        os.close(write_end)
    _, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, err.decode()


async def test_a_reader_that_leaves_early_gets_no_traceback(embedded_cluster: Any) -> None:
    code, err = await without_a_reader(
        "leases", f"--kubeconfig={embedded_cluster.kubeconfig}", "-n", "default"
    )
    assert (code, err) == (141, "")  # 128 + SIGPIPE, as a process the signal ends
