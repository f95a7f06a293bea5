"""Pool ownership and DSN redaction shared by the PostgreSQL adapters."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from kopf_reconcile.api import ConfigError
from kopf_reconcile.database import redact_dsn
from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.leader.postgres import PostgresLeaseElector


async def sessions_on(dsn: str) -> int:
    """Client sessions on the test's database, not counting the one asking."""
    connection = await asyncpg.connect(dsn)
    try:
        return int(
            await connection.fetchval(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        )
    finally:
        await connection.close()


async def test_a_pool_made_from_a_dsn_is_created_lazily_and_closed_by_close(dsn: str) -> None:
    repo = PostgresFencedRepository(dsn)
    assert await sessions_on(dsn) == 0  # nothing connects before first use
    assert await repo.apply_fenced("device", 1, {"v": 1}) is True
    assert await sessions_on(dsn) >= 1

    await repo.close()
    await repo.close()  # idempotent
    # A backend leaves pg_stat_activity shortly after its client disconnects.
    deadline = asyncio.get_running_loop().time() + 10
    while await sessions_on(dsn) != 0:
        assert asyncio.get_running_loop().time() < deadline, "the pool's sessions stayed open"
        await asyncio.sleep(0.02)
    with pytest.raises(RuntimeError, match="closed"):
        await repo.apply_fenced("device", 1, {"v": 1})


async def test_a_borrowed_pool_is_never_closed(dsn: str) -> None:
    async with asyncpg.create_pool(dsn, min_size=1, max_size=2) as pool:
        async with PostgresFencedRepository(pool) as repo:
            assert await repo.apply_fenced("device", 1, {"v": 1}) is True
        assert not pool.is_closing()
        assert await pool.fetchval("SELECT last_epoch FROM kopf_reconcile_fence") == 1


async def test_concurrent_first_uses_share_one_pool(dsn: str) -> None:
    async with PostgresLeaseElector(dsn) as elector:
        await asyncio.gather(*(elector.acquire_lease(f"r{n}") for n in range(20)))
        assert await sessions_on(dsn) <= 10  # one pool of at most 10, not one per caller


@pytest.mark.parametrize(
    ("dsn", "redacted"),
    [
        ("postgresql://admin:hunter2@db:5432/app", "postgresql://admin:***@db:5432/app"),
        ("postgresql://admin@db/app?password=hunter2", "postgresql://admin@db/app?password=***"),
        (
            "postgres://a:hunter2@h1,h2/app?sslmode=require&sslpassword=hunter2",
            "postgres://a:***@h1,h2/app?sslmode=require&sslpassword=***",
        ),
        ("host=db user=admin password=hunter2", "host=db user=admin password=***"),
        (
            "postgresql://postgres@/app?host=/tmp/socket",
            "postgresql://postgres@/app?host=/tmp/socket",
        ),
    ],
)
def test_redact_dsn_hides_passwords_and_keeps_the_rest(dsn: str, redacted: str) -> None:
    assert redact_dsn(dsn) == redacted


@pytest.mark.parametrize(
    "dsn_or_pool",
    ["host=db password=hunter2", "mysql://u:hunter2@db/x", "", None, 5432],
)
def test_anything_but_a_postgres_dsn_or_pool_is_a_config_error(dsn_or_pool: object) -> None:
    with pytest.raises(ConfigError, match="dsn_or_pool") as error:
        PostgresFencedRepository(dsn_or_pool)
    assert "hunter2" not in str(error.value)
