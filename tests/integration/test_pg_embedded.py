"""EmbeddedPostgres: a real server, reachable from other processes, stoppable and removable."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import asyncpg
import pytest

from kopf_reconcile.testing import EmbeddedPostgres

CONNECTION_ERRORS = (OSError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError)


def postmaster_pid(data_dir: Path) -> int:
    return int((data_dir / "postmaster.pid").read_text().splitlines()[0])


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A stopped server may linger as a zombie until reaped; it is not serving then.
    status = Path(f"/proc/{pid}/status")
    return not status.exists() or "zombie" not in status.read_text()


async def query(dsn: str, sql: str) -> object:
    connection = await asyncpg.connect(dsn)
    try:
        return await connection.fetchval(sql)
    finally:
        await connection.close()


async def test_plugin_fixture_serves_a_real_server(embedded_postgres: EmbeddedPostgres) -> None:
    version = await query(embedded_postgres.dsn, "SHOW server_version_num")
    assert isinstance(version, str) and int(version) >= 130000
    # Unix socket only: nothing listens on TCP.
    assert await query(embedded_postgres.dsn, "SHOW listen_addresses") == ""


async def test_dsn_works_from_another_process(embedded_postgres: EmbeddedPostgres) -> None:
    await query(embedded_postgres.dsn, "CREATE TABLE handed_over (value text)")
    script = (
        "import asyncio, sys, asyncpg\n"
        "async def main():\n"
        "    connection = await asyncpg.connect(sys.argv[1])\n"
        "    await connection.execute(\"INSERT INTO handed_over VALUES ('child')\")\n"
        "    await connection.close()\n"
        "asyncio.run(main())\n"
    )
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, embedded_postgres.dsn, stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await child.communicate()
    assert child.returncode == 0, stderr.decode()
    assert await query(embedded_postgres.dsn, "SELECT value FROM handed_over") == "child"


async def test_stop_and_start_keep_the_dsn_and_the_data() -> None:
    async with EmbeddedPostgres() as server:
        dsn = server.dsn
        await query(dsn, "CREATE TABLE survivor AS SELECT 42 AS answer")
        first_pid = postmaster_pid(server.data_dir)

        await server.stop()
        assert not server.running
        with pytest.raises(CONNECTION_ERRORS):
            await query(dsn, "SELECT 1")
        await server.stop()  # idempotent

        await server.start()
        assert server.running and server.dsn == dsn
        assert await query(dsn, "SELECT answer FROM survivor") == 42
        assert postmaster_pid(server.data_dir) != first_pid


async def test_close_stops_its_server_and_removes_its_directory() -> None:
    server = EmbeddedPostgres()
    async with server:
        root = server.data_dir.parent
        pid = postmaster_pid(server.data_dir)
        assert process_exists(pid)
    assert not root.exists()
    assert not process_exists(pid)
    await server.close()  # idempotent


async def test_databases_created_on_one_server_are_isolated(
    embedded_postgres: EmbeddedPostgres,
) -> None:
    first = await embedded_postgres.create_database()
    second = await embedded_postgres.create_database()
    assert first != second
    await query(first, "CREATE TABLE only_in_first AS SELECT 1 AS one")
    assert await query(first, "SELECT one FROM only_in_first") == 1
    with pytest.raises(asyncpg.UndefinedTableError):
        await query(second, "SELECT one FROM only_in_first")
