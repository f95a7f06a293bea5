"""PostgresFencedRepository on a real PostgreSQL: the epoch CAS, SQL mutations, schema, outages.

Every test gets a database of its own on the session's PostgreSQL server.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest
import pytest_asyncio

from kopf_reconcile.api import ConfigError
from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.fencing.protocol import FencedRepository
from kopf_reconcile.tenancy import MalformedEntityId, Tenancy
from kopf_reconcile.testing import EmbeddedPostgres, audit

# What a lost or refused connection looks like from asyncpg.
CONNECTION_ERRORS = (
    OSError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.OperatorInterventionError,
)
FENCE = "kopf_reconcile_fence"


@pytest_asyncio.fixture
async def repo(dsn: str) -> AsyncIterator[PostgresFencedRepository]:
    async with PostgresFencedRepository(dsn) as repository:
        yield repository


async def fetch(dsn: str, sql: str, *args: object) -> list[asyncpg.Record]:
    connection = await asyncpg.connect(dsn)
    try:
        return list(await connection.fetch(sql, *args))
    finally:
        await connection.close()


async def fence_rows(dsn: str) -> list[dict[str, Any]]:
    rows = await fetch(dsn, f"SELECT * FROM {FENCE} ORDER BY scope, entity_id")
    return [dict(row) for row in rows]


async def eventually(attempt: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    """Poll until ``attempt()`` is true; connection errors count as "not yet"."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            if await attempt():
                return
        except CONNECTION_ERRORS:
            pass
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.02)


def test_it_is_a_fenced_repository() -> None:
    assert isinstance(PostgresFencedRepository("postgresql://localhost/db"), FencedRepository)


# -- the compare-and-swap -------------------------------------------------------


@pytest.mark.parametrize(
    ("epoch", "accepted", "last_epoch"),
    [
        pytest.param(0, False, 5, id="far-older-rejected"),
        pytest.param(4, False, 5, id="older-rejected"),
        pytest.param(5, True, 5, id="equal-accepted"),
        pytest.param(6, True, 6, id="newer-accepted-and-advances"),
    ],
)
async def test_a_write_applies_only_when_its_epoch_is_not_older(
    repo: PostgresFencedRepository, dsn: str, epoch: int, accepted: bool, last_epoch: int
) -> None:
    assert await repo.apply_fenced("device-1", 5, {"written_by": 5}) is True
    before = await fence_rows(dsn)

    assert await repo.apply_fenced("device-1", epoch, {"written_by": epoch}) is accepted

    assert await repo.last_epoch("device-1") == last_epoch
    if accepted:
        assert await repo.get_state("device-1") == {"written_by": epoch}
    else:
        assert await fence_rows(dsn) == before  # not a single column touched


async def test_a_new_entity_is_accepted_at_any_epoch_and_keyed_by_scope(
    repo: PostgresFencedRepository, dsn: str
) -> None:
    assert await repo.get_state("fresh") is None
    assert await repo.last_epoch("fresh") is None
    assert await repo.apply_fenced("fresh", 0, {"n": 1}) is True
    [row] = await fence_rows(dsn)
    assert (row["scope"], row["entity_id"], row["tenant"], row["last_epoch"]) == (
        "default",
        "fresh",
        "_notenant",
        0,
    )
    assert row["updated_at"].tzinfo is not None


async def test_concurrent_writers_never_apply_an_older_epoch_after_a_newer_one(dsn: str) -> None:
    epochs = [1, 2, 3, 4, 5, 6]
    writes_per_writer = 3
    entities = [f"race-{n}" for n in range(40)]
    shuffle = random.Random(20260130).shuffle

    pool = await asyncpg.create_pool(dsn, min_size=len(epochs), max_size=len(epochs))
    repo = PostgresFencedRepository(pool)
    try:
        await repo.migrate()
        # The audit trail: every write the database actually applied, in order.
        await audit.install(dsn)

        async def writer(entity: str, epoch: int) -> list[tuple[int, int]]:
            accepted = []
            for n in range(writes_per_writer):
                if await repo.apply_fenced(entity, epoch, {"epoch": epoch, "n": n}):
                    accepted.append((epoch, n))
            return accepted

        applied: dict[str, set[tuple[int, int]]] = {}
        for entity in entities:
            shuffle(epochs)
            outcomes = await asyncio.gather(*(writer(entity, epoch) for epoch in epochs))
            applied[entity] = {write for accepted in outcomes for write in accepted}

        audit.assert_no_stale_writes(await audit.history(dsn))
        trails = await audit.applied_writes(dsn)
        for entity in entities:
            trail = trails[entity]
            # Exactly the writes reported as accepted were applied, each once.
            recorded = [(epoch, state["n"]) for epoch, state in trail]
            assert len(recorded) == len(set(recorded)) and set(recorded) == applied[entity]
            # The highest epoch is never rejected, and its last write is what remains.
            highest = max(epochs)
            assert {n for epoch, n in applied[entity] if epoch == highest} == set(
                range(writes_per_writer)
            )
            assert await repo.last_epoch(entity) == highest
            assert await repo.get_state(entity) == {"epoch": highest, "n": writes_per_writer - 1}
    finally:
        await repo.close()
        await pool.close()


# -- SQL mutations ------------------------------------------------------------------


async def test_sql_mutation_runs_in_the_fence_transaction_only_for_a_current_epoch(
    repo: PostgresFencedRepository, dsn: str
) -> None:
    await fetch(dsn, "CREATE TABLE widgets (name text PRIMARY KEY, epoch bigint)")
    called_with: list[int] = []

    def add_widget(epoch: int) -> Callable[[asyncpg.Connection], Awaitable[None]]:
        async def mutation(connection: asyncpg.Connection) -> None:
            called_with.append(epoch)
            assert connection.is_in_transaction()
            await connection.execute("INSERT INTO widgets VALUES ($1, $2)", f"w{epoch}", epoch)

        return mutation

    assert await repo.apply_fenced("device", 3, {"document": "kept"}) is True
    assert await repo.apply_fenced("device", 3, add_widget(3)) is True
    assert await repo.apply_fenced("device", 2, add_widget(2)) is False

    assert called_with == [3]  # the stale mutation never ran
    assert [tuple(row) for row in await fetch(dsn, "SELECT * FROM widgets")] == [("w3", 3)]
    assert await repo.last_epoch("device") == 3
    assert await repo.get_state("device") == {"document": "kept"}  # SQL leaves the state alone


async def test_a_failing_sql_mutation_rolls_back_its_writes_and_the_fence(
    repo: PostgresFencedRepository, dsn: str
) -> None:
    await fetch(dsn, "CREATE TABLE widgets (name text PRIMARY KEY)")
    assert await repo.apply_fenced("device", 3, {"v": 3}) is True

    async def half_done(connection: asyncpg.Connection) -> None:
        await connection.execute("INSERT INTO widgets VALUES ('half')")
        raise RuntimeError("the user's SQL failed")

    with pytest.raises(RuntimeError, match="the user's SQL failed"):
        await repo.apply_fenced("device", 4, half_done)

    assert await fetch(dsn, "SELECT * FROM widgets") == []
    assert await repo.last_epoch("device") == 3


async def test_a_cancelled_sql_mutation_rolls_back_and_frees_its_connection(
    repo: PostgresFencedRepository, dsn: str
) -> None:
    await fetch(dsn, "CREATE TABLE widgets (name text PRIMARY KEY)")
    inside = asyncio.Event()

    async def stuck(connection: asyncpg.Connection) -> None:
        await connection.execute("INSERT INTO widgets VALUES ('stuck')")
        inside.set()
        await asyncio.Event().wait()

    write = asyncio.create_task(repo.apply_fenced("device", 7, stuck))
    await inside.wait()
    write.cancel()
    with pytest.raises(asyncio.CancelledError):
        await write

    assert await fetch(dsn, "SELECT * FROM widgets") == []
    assert await repo.last_epoch("device") is None
    assert await repo.apply_fenced("device", 7, {"after": "cancel"}) is True


async def test_a_write_waiting_for_the_fence_row_lock_can_be_cancelled(
    repo: PostgresFencedRepository, dsn: str
) -> None:
    assert await repo.apply_fenced("device", 1, {"v": 1}) is True
    blocker = await asyncpg.connect(dsn)
    observer = await asyncpg.connect(dsn)

    async def lock_waiters() -> int:
        return int(
            await observer.fetchval(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
        )

    try:
        async with blocker.transaction():
            await blocker.execute(f"SELECT 1 FROM {FENCE} WHERE entity_id = 'device' FOR UPDATE")
            write = asyncio.create_task(repo.apply_fenced("device", 2, {"v": 2}))
            await eventually(lambda: _equals(lock_waiters(), 1))

            write.cancel()
            # The cancelled write returns while the lock is still held ...
            done, _ = await asyncio.wait({write}, timeout=10)
            assert done == {write} and write.cancelled()
            # ... and the server stopped waiting too.
            await eventually(lambda: _equals(lock_waiters(), 0))
    finally:
        await blocker.close()
        await observer.close()


async def _equals(value: Awaitable[object], expected: object) -> bool:
    return await value == expected


# -- the boundary ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "mutation",
    [["a", "list"], "a string", 42, None, b"bytes"],
    ids=["list", "str", "int", "None", "bytes"],
)
async def test_an_unsupported_mutation_is_a_type_error_naming_the_type(
    repo: PostgresFencedRepository, mutation: object
) -> None:
    with pytest.raises(TypeError, match=type(mutation).__qualname__):
        await repo.apply_fenced("device", 1, mutation)
    assert await repo.last_epoch("device") is None


@pytest.mark.parametrize(
    "document",
    [{"a set": {1, 2}}, {"nan": math.nan}],
    ids=["not-serialisable", "nan"],
)
async def test_a_document_that_is_not_json_is_a_type_error(
    repo: PostgresFencedRepository, document: dict[str, Any]
) -> None:
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        await repo.apply_fenced("device", 1, document)


async def test_a_sync_callable_is_a_type_error_and_rolls_back_the_fence(
    repo: PostgresFencedRepository,
) -> None:
    with pytest.raises(TypeError, match="not an awaitable"):
        await repo.apply_fenced("device", 1, lambda connection: None)
    assert await repo.last_epoch("device") is None


@pytest.mark.parametrize(
    ("epoch", "error"),
    [(True, TypeError), (1.0, TypeError), ("1", TypeError), (-1, ValueError), (2**63, ValueError)],
    ids=["bool", "float", "str", "negative", "beyond-bigint"],
)
async def test_an_invalid_epoch_is_refused(
    repo: PostgresFencedRepository, epoch: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match="epoch"):
        await repo.apply_fenced("device", epoch, {"v": 1})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "table",
    ["", "has space", 'x"; DROP TABLE y; --', "1starts_with_digit", "a.b.c", "t" * 64, 42],
)
def test_an_invalid_table_name_is_a_config_error(table: object) -> None:
    with pytest.raises(ConfigError, match="table"):
        PostgresFencedRepository("postgresql://localhost/db", table=table)  # type: ignore[arg-type]


async def test_a_schema_qualified_table_is_created_and_used(dsn: str) -> None:
    await fetch(dsn, "CREATE SCHEMA fencing")
    async with PostgresFencedRepository(dsn, table="fencing.fence_rows") as repo:
        assert await repo.apply_fenced("device", 1, {"v": 1}) is True
    [row] = await fetch(dsn, "SELECT entity_id FROM fencing.fence_rows")
    assert row["entity_id"] == "device"


# -- scope and tenancy ------------------------------------------------------------------


async def test_scope_and_tenant_come_from_the_bound_loop(dsn: str) -> None:
    async with (
        PostgresFencedRepository(dsn) as devices,
        PostgresFencedRepository(dsn) as gadgets,
    ):
        devices.bind_loop(reconciler_id="devices", tenancy=Tenancy.SINGLE_TENANT)
        gadgets.bind_loop(reconciler_id="gadgets", tenancy=Tenancy.TENANT_SCOPED)
        assert await devices.apply_fenced("team-a/x", 5, {"by": "devices"}) is True
        # Another reconciler's rows do not fence this one.
        assert await gadgets.apply_fenced("team-a/x", 1, {"by": "gadgets"}) is True
        assert await devices.get_state("team-a/x") == {"by": "devices"}
        assert await gadgets.last_epoch("team-a/x") == 1

        with pytest.raises(MalformedEntityId):
            await gadgets.apply_fenced("no-tenant-here", 1, {"v": 1})

    rows = [(r["scope"], r["entity_id"], r["tenant"]) for r in await fence_rows(dsn)]
    assert rows == [("devices", "team-a/x", "_notenant"), ("gadgets", "team-a/x", "team-a")]


def test_binding_to_a_second_loop_is_refused_even_with_an_explicit_scope() -> None:
    repo = PostgresFencedRepository("postgresql://localhost/db")
    repo.bind_loop(reconciler_id="devices", tenancy=Tenancy.SINGLE_TENANT)
    repo.bind_loop(reconciler_id="devices", tenancy=Tenancy.SINGLE_TENANT)  # same loop again
    assert repo.scope == "devices"
    with pytest.raises(ConfigError, match="already bound"):
        repo.bind_loop(reconciler_id="gadgets", tenancy=Tenancy.SINGLE_TENANT)

    # Two leases would number one scope's epochs: they would fence each other.
    shared = PostgresFencedRepository("postgresql://localhost/db", scope="shared")
    shared.bind_loop(reconciler_id="devices", tenancy=Tenancy.SINGLE_TENANT)
    assert shared.scope == "shared"
    with pytest.raises(ConfigError, match="already bound"):
        shared.bind_loop(reconciler_id="gadgets", tenancy=Tenancy.SINGLE_TENANT)
    with pytest.raises(ConfigError, match="already bound"):
        shared.bind_loop(reconciler_id="devices", tenancy=Tenancy.TENANT_SCOPED)


async def test_highest_epoch_is_the_maximum_within_the_scope(dsn: str) -> None:
    async with (
        PostgresFencedRepository(dsn, scope="a") as scope_a,
        PostgresFencedRepository(dsn, scope="b") as scope_b,
    ):
        assert await scope_a.highest_epoch() == 0
        assert await scope_a.apply_fenced("x", 3, {"v": 1}) is True
        assert await scope_a.apply_fenced("y", 7, {"v": 1}) is True
        assert await scope_a.apply_fenced("x", 4, {"v": 1}) is True
        assert await scope_b.apply_fenced("x", 9, {"v": 1}) is True
        assert await scope_a.highest_epoch() == 7
        assert await scope_b.highest_epoch() == 9


# -- schema and outages -------------------------------------------------------------------


async def test_schema_creation_is_idempotent_and_safe_when_concurrent(dsn: str) -> None:
    for attempt in range(5):
        # Separate pools: separate sessions, as separate processes would have.
        repos = [PostgresFencedRepository(dsn, table=f"fence_{attempt}") for _ in range(8)]
        try:
            await asyncio.gather(*(repo.migrate() for repo in repos))
            await repos[0].migrate()
            assert await repos[1].apply_fenced("device", 1, {"v": 1}) is True
        finally:
            await asyncio.gather(*(repo.close() for repo in repos))


async def test_writes_fail_loudly_while_postgres_is_down_and_resume_after(
    embedded_postgres: EmbeddedPostgres,
) -> None:
    async with PostgresFencedRepository(embedded_postgres.dsn) as repo:
        assert await repo.apply_fenced("device", 1, {"v": 1}) is True
        await embedded_postgres.stop()

        for epoch in (0, 2):  # neither a silent reject nor a silent accept
            with pytest.raises(CONNECTION_ERRORS):
                await repo.apply_fenced("device", epoch, {"v": epoch})
        with pytest.raises(CONNECTION_ERRORS):
            await repo.last_epoch("device")

        await embedded_postgres.start()
        # Pooled connections died with the server; the pool replaces them as they fail.
        await eventually(lambda: repo.apply_fenced("device", 2, {"v": 2}))
        assert await repo.last_epoch("device") == 2
        assert await repo.get_state("device") == {"v": 2}
        assert await repo.apply_fenced("device", 1, {"v": 1}) is False
