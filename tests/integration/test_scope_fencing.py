"""Scope-wide fencing on a real PostgreSQL, and electors shared by several Loops.

- Once a leader has recorded epoch N in a scope, no write below N is accepted
  for any entity of the scope, including entities the new leader never wrote
  (documents and SQL mutations alike).
- Recording an epoch and writes in flight are ordered: an older write already
  in its transaction commits before the recording, never after; a write that
  waits for a recording reads the new epoch.
- A writer paused inside its transaction holds the new leader up for a bounded
  time only, and its transaction is aborted.
- One elector serves several Loops: each reconciler's epoch floor comes from
  its own fenced scope, and a Loop that stops unregisters only its own.

Each test failed before the change it pins down.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import pytest
import pytest_asyncio

import kopf_reconcile as kr
from conftest import LeaseBackend
from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.leader.postgres import PostgresLeaseElector
from support import eventually, fenced_loop

SCOPE = "devices"
FAST = {"lock_timeout": 0.3, "idle_in_transaction_timeout": 0.6, "statement_timeout": 5}


async def execute(dsn: str, sql: str, *args: object) -> Any:
    connection = await asyncpg.connect(dsn)
    try:
        return await connection.fetchval(sql, *args)
    finally:
        await connection.close()


def inserting(epoch: int) -> Callable[[asyncpg.Connection], Awaitable[None]]:
    async def mutation(connection: asyncpg.Connection) -> None:
        await connection.execute("INSERT INTO widgets (epoch) VALUES ($1)", epoch)

    return mutation


@pytest_asyncio.fixture
async def widgets(dsn: str) -> str:
    await execute(dsn, "CREATE TABLE widgets (epoch bigint NOT NULL)")
    return dsn


# -- scope-wide -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["document", "sql"])
async def test_a_write_below_the_led_epoch_is_rejected_for_an_entity_never_written(
    widgets: str, kind: str
) -> None:
    async with PostgresFencedRepository(widgets, scope=SCOPE) as repo:
        assert await repo.apply_fenced("written-by-old", 1, {"v": "old"})
        await repo.record_epoch(2, "leader")  # the new leader leads; it writes nothing yet
        mutation: object = {"v": "zombie"} if kind == "document" else inserting(1)
        assert await repo.apply_fenced("never-written", 1, mutation) is False
        assert await repo.apply_fenced("written-by-old", 1, mutation) is False
        assert await repo.last_epoch("never-written") is None
        assert await execute(widgets, "SELECT count(*) FROM widgets") == 0
        # The current epoch, and later ones, still write.
        assert await repo.apply_fenced("never-written", 2, {"v": "new"})
        assert await repo.apply_fenced("never-written", 3, {"v": "newer"})


async def test_recording_below_the_led_epoch_is_refused(dsn: str) -> None:
    async with PostgresFencedRepository(dsn, scope=SCOPE) as repo:
        await repo.record_epoch(5, "leader")
        await repo.record_epoch(5, "leader")  # the same leader confirming again
        with pytest.raises(kr.StaleEpochError, match="already led at epoch 5"):
            await repo.record_epoch(4, "leader")
        assert await repo.highest_epoch() == 5


async def test_one_epoch_leads_for_one_holder_only(dsn: str) -> None:
    """A lease record lost and recreated may hand epoch 9 to two holders: one leads."""
    async with PostgresFencedRepository(dsn, scope=SCOPE) as repo:
        await repo.record_epoch(9, "first")
        await repo.record_epoch(9, "first")  # the same holder, confirming again
        with pytest.raises(kr.StaleEpochError, match="already led by 'first'"):
            await repo.record_epoch(9, "second")
        await repo.record_epoch(10, "second")  # a higher epoch is another leadership


async def test_a_write_in_flight_commits_before_the_new_epoch_is_recorded(widgets: str) -> None:
    entered = asyncio.Event()
    let_go = asyncio.Event()

    async def slow(connection: asyncpg.Connection) -> None:
        await connection.execute("INSERT INTO widgets (epoch) VALUES (1)")
        entered.set()
        await let_go.wait()

    async with (
        PostgresFencedRepository(widgets, scope=SCOPE) as old,
        PostgresFencedRepository(widgets, scope=SCOPE) as new,
    ):
        writing = asyncio.create_task(old.apply_fenced("x", 1, slow))
        await entered.wait()
        recording = asyncio.create_task(new.record_epoch(2, "leader"))

        async def recording_waits_for_a_lock() -> bool:
            waiting = await execute(
                widgets,
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND query LIKE '%_epochs%'",
            )
            return bool(waiting)

        await eventually(recording_waits_for_a_lock, message="the recording waits for the write")
        assert not recording.done()
        let_go.set()
        assert await writing is True  # it started before the recording: legitimate
        await recording
        # From now on an old write is rejected, on any entity.
        assert await old.apply_fenced("y", 1, inserting(1)) is False
        assert await execute(widgets, "SELECT count(*) FROM widgets") == 1


async def test_a_write_waiting_for_a_recording_reads_the_new_epoch(dsn: str) -> None:
    async with PostgresFencedRepository(dsn, scope=SCOPE) as repo:
        await repo.record_epoch(1, "leader")
        # A recording of epoch 2 in progress, holding the scope's epoch row.
        recorder = await asyncpg.connect(dsn)
        try:
            transaction = recorder.transaction()
            await transaction.start()
            await recorder.execute(
                "UPDATE kopf_reconcile_fence_epochs SET epoch = 2 WHERE scope = $1", SCOPE
            )
            writing = asyncio.create_task(repo.apply_fenced("x", 1, {"v": "late"}))

            async def write_waits() -> bool:
                waiting = await execute(
                    dsn, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                )
                return bool(waiting)

            await eventually(write_waits, message="the write waits for the recording")
            await transaction.commit()
        finally:
            await recorder.close()
        assert await writing is False
        assert await repo.last_epoch("x") is None


async def test_a_scope_numbered_by_another_lease_is_refused(dsn: str) -> None:
    async with (
        PostgresFencedRepository(dsn, scope="shared") as devices,
        PostgresFencedRepository(dsn, scope="shared") as gadgets,
    ):
        devices.bind_loop(reconciler_id="devices", tenancy=kr.Tenancy.SINGLE_TENANT)
        gadgets.bind_loop(reconciler_id="gadgets", tenancy=kr.Tenancy.SINGLE_TENANT)
        await devices.record_epoch(3, "leader")
        with pytest.raises(kr.ConfigError, match="numbered by the lease of reconciler 'devices'"):
            await gadgets.record_epoch(9, "leader")
        assert await devices.highest_epoch() == 3


# -- bounded waits behind a paused writer -------------------------------------------------------


@pytest.mark.parametrize("pool", ["owned", "borrowed"])
async def test_a_writer_paused_in_its_transaction_does_not_hold_up_the_new_leader(
    widgets: str, pool: str
) -> None:
    borrowed = await asyncpg.create_pool(widgets, min_size=1, max_size=4)
    source: Any = widgets if pool == "owned" else borrowed
    entered = asyncio.Event()
    paused = asyncio.Event()  # never set: the client went silent mid-transaction

    async def stuck(connection: asyncpg.Connection) -> None:
        await connection.execute("INSERT INTO widgets (epoch) VALUES (1)")
        entered.set()
        await paused.wait()

    try:
        async with (
            PostgresFencedRepository(source, scope=SCOPE, **FAST) as old,  # type: ignore[arg-type]
            PostgresFencedRepository(source, scope=SCOPE, **FAST) as new,  # type: ignore[arg-type]
        ):
            await old.record_epoch(1, "leader")
            zombie = asyncio.create_task(old.apply_fenced("x", 1, stuck))
            await entered.wait()

            async def new_leader_records() -> bool:
                try:
                    await new.record_epoch(2, "leader")
                except (asyncpg.LockNotAvailableError, asyncpg.QueryCanceledError):
                    return False  # still behind the paused writer: the Loop retries
                return True

            await eventually(new_leader_records, timeout=15, interval=0.1)
            async with asyncio.timeout(15):
                assert await new.apply_fenced("x", 2, {"v": "new"})
            paused.set()
            with pytest.raises(
                (asyncpg.PostgresError, asyncpg.InterfaceError, ConnectionError, OSError)
            ):
                await zombie  # its transaction was aborted by the server
            assert await new.get_state("x") == {"v": "new"}
            assert await execute(widgets, "SELECT count(*) FROM widgets") == 0
    finally:
        await borrowed.close()


async def test_a_fenced_write_is_bounded_by_the_write_timeout(dsn: str) -> None:
    async def hangs(connection: asyncpg.Connection) -> None:
        await asyncio.Event().wait()

    async with PostgresFencedRepository(dsn, scope=SCOPE, write_timeout=0.3) as repo:
        with pytest.raises(TimeoutError):
            await repo.apply_fenced("x", 1, hangs)
        assert await repo.last_epoch("x") is None  # rolled back


@pytest.mark.parametrize(
    "option", ["lock_timeout", "statement_timeout", "idle_in_transaction_timeout", "write_timeout"]
)
@pytest.mark.parametrize("value", [0, -1, "5s", float("nan")])
def test_a_bad_timeout_is_a_config_error_naming_it(option: str, value: object) -> None:
    with pytest.raises(kr.ConfigError, match=option):
        PostgresFencedRepository("postgresql://localhost/db", **{option: value})  # type: ignore[arg-type]


def test_timeouts_accept_a_timedelta() -> None:
    PostgresFencedRepository(
        "postgresql://localhost/db", lock_timeout=datetime.timedelta(milliseconds=250)
    )


# -- one elector, several Loops -----------------------------------------------------------------


async def idle(req: kr.Request) -> None:
    return None


async def test_an_elector_shared_by_two_loops_floors_each_from_its_own_scope(
    dsn: str, lease_backend: LeaseBackend
) -> None:
    elector = lease_backend.make(ttl=3)
    async with (
        PostgresFencedRepository(dsn) as repo_a,
        PostgresFencedRepository(dsn) as repo_b,
    ):
        # Reconciler A's scope was led at epoch 7 by a process long gone; its lease is gone.
        repo_a.bind_loop(reconciler_id="reconciler-a", tenancy=kr.Tenancy.SINGLE_TENANT)
        await repo_a.record_epoch(7, "leader")
        a = fenced_loop(idle, elector, repo_a, "reconciler-a")
        b = fenced_loop(idle, elector, repo_b, "reconciler-b")
        await a.start()
        await b.start()  # registers B's floor after A's, before A's first acquire
        try:
            await eventually(lambda: a.stats().is_leader and b.stats().is_leader, timeout=15)
            first = a.stats().epoch
            assert first > 7, f"A leads at epoch {first}, below the 7 its scope has seen"
            # B stops and closes its repository: A's takeovers must not depend on it.
            await b.stop()
            await repo_b.close()
            await lease_backend.delete("reconciler-a")
            await eventually(lambda: not a.stats().is_leader, timeout=15)
            await eventually(lambda: a.stats().is_leader, timeout=15)
            assert a.stats().epoch > first
        finally:
            await b.stop()
            await a.stop()


async def test_a_mutation_that_swallows_an_sql_error_is_not_reported_applied(widgets: str) -> None:
    async def swallows(connection: asyncpg.Connection) -> None:
        await connection.execute("INSERT INTO widgets (epoch) VALUES (1)")
        # Caught: the transaction is aborted now, and COMMIT would roll back silently.
        with contextlib.suppress(asyncpg.NotNullViolationError):
            await connection.execute("INSERT INTO widgets (epoch) VALUES (NULL)")

    async with PostgresFencedRepository(widgets, scope=SCOPE) as repo:
        with pytest.raises(asyncpg.InFailedSQLTransactionError):
            await repo.apply_fenced("x", 1, swallows)
        assert await repo.last_epoch("x") is None
        assert await execute(widgets, "SELECT count(*) FROM widgets") == 0


async def test_a_starting_replica_never_stalls_the_writes_of_other_scopes(widgets: str) -> None:
    entered = asyncio.Event()
    let_go = asyncio.Event()

    async def long(connection: asyncpg.Connection) -> None:
        entered.set()
        await let_go.wait()

    async with PostgresFencedRepository(widgets, scope="a") as running:
        writing = asyncio.create_task(running.apply_fenced("x", 1, long))
        await entered.wait()
        try:
            # A replica starting meanwhile creates (checks) the schema, then writes.
            async with PostgresFencedRepository(widgets, scope="b") as starting:
                async with asyncio.timeout(3):
                    await starting.migrate()
                    assert await starting.apply_fenced("y", 1, {"v": 1})
        finally:
            let_go.set()
            assert await writing


async def test_a_scope_owned_by_another_lease_stops_the_loop_trying(dsn: str) -> None:
    attempts: list[str] = []

    class Counting(PostgresLeaseElector):
        async def acquire_lease(self, reconciler_id: str) -> kr.LeaseToken:
            attempts.append(reconciler_id)
            return await super().acquire_lease(reconciler_id)

    async with (
        PostgresFencedRepository(dsn, scope="shared") as owner,
        PostgresFencedRepository(dsn, scope="shared") as intruder,
        Counting(dsn, ttl=3) as elector,
    ):
        owner.bind_loop(reconciler_id="devices", tenancy=kr.Tenancy.SINGLE_TENANT)
        await owner.record_epoch(1, "leader")
        loop = fenced_loop(idle, elector, intruder, "gadgets")
        async with loop:
            await eventually(lambda: bool(attempts))
            await asyncio.sleep(1.0)  # five retry periods of 0.1 s
            assert len(attempts) == 1, attempts
            assert not loop.stats().is_leader
