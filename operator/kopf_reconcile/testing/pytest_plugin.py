"""pytest fixtures for users' own tests: an embedded Kubernetes API and embedded PostgreSQL.

Registered through the ``pytest11`` entry point, so installing
``kopf-reconcile[testing]`` makes them available without a conftest.

PostgreSQL comes two ways. ``embedded_postgres`` is a server of the test's
own: the one to stop and start in outage tests. ``embedded_postgres_dsn`` is
a fresh, empty database on ``embedded_postgres_server``, one server shared by
the whole session: creating a database takes milliseconds where starting a
server takes most of a second, so most tests want this one.

The async fixtures need pytest-asyncio (``pip install kopf-reconcile[testing]``
brings it). Without it the plugin still loads, so a project's other tests run,
and a test asking for one of those fixtures fails with a message saying so.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import pytest

if TYPE_CHECKING:
    from kopf_reconcile.testing.emulated_apiserver import EmbeddedCluster
    from kopf_reconcile.testing.postgres import EmbeddedPostgres

NEEDS_PYTEST_ASYNCIO = (
    "the {name} fixture of kopf-reconcile is async and needs pytest-asyncio, which is not "
    "installed: pip install 'kopf-reconcile[testing]' (or pytest-asyncio)"
)


def _async_fixture(fn: Callable[..., Any]) -> Any:
    """pytest-asyncio's fixture decorator, or, without it, a fixture that says it is missing."""
    try:
        import pytest_asyncio
    except ImportError:

        def missing() -> None:
            pytest.fail(NEEDS_PYTEST_ASYNCIO.format(name=fn.__name__), pytrace=False)

        return pytest.fixture(name=fn.__name__)(missing)
    return pytest_asyncio.fixture(fn)


@_async_fixture
async def embedded_cluster() -> AsyncIterator[EmbeddedCluster]:
    """A fresh embedded Kubernetes API on 127.0.0.1 for one test."""
    from kopf_reconcile.testing.emulated_apiserver import EmbeddedCluster

    async with EmbeddedCluster() as cluster:
        yield cluster


@_async_fixture
async def embedded_postgres() -> AsyncIterator[EmbeddedPostgres]:
    """A fresh real PostgreSQL server in a temporary directory for one test."""
    from kopf_reconcile.testing.postgres import EmbeddedPostgres

    async with EmbeddedPostgres() as server:
        yield server


@pytest.fixture(scope="session")
def embedded_postgres_server() -> Iterator[EmbeddedPostgres]:
    """One real PostgreSQL server for the whole session; never stop it in a test.

    A plain (not async) fixture: the server is a separate process, so it is
    started and removed on a private event loop (never made the current one)
    and serves the event loops of every test.
    """
    from kopf_reconcile.testing.postgres import EmbeddedPostgres

    server = EmbeddedPostgres()
    control = asyncio.new_event_loop()
    try:
        control.run_until_complete(server.start())
        yield server
    finally:
        try:
            control.run_until_complete(server.close())
        finally:
            control.close()


@_async_fixture
async def embedded_postgres_dsn(embedded_postgres_server: EmbeddedPostgres) -> AsyncIterator[str]:
    """The DSN of a fresh, empty database on the shared server, dropped after the test."""
    import asyncpg

    dsn = await embedded_postgres_server.create_database()
    yield dsn
    name = unquote(urlsplit(dsn).path.lstrip("/"))
    connection = await asyncpg.connect(embedded_postgres_server.dsn)
    try:
        # FORCE: connections the test left open would otherwise block the drop.
        await connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await connection.close()
