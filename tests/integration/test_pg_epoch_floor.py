"""A lease row created anew never restarts the epoch below one already used.

The lease row of :class:`PostgresLeaseElector` can disappear (deleted by hand,
table dropped and recreated). The epochs already written to the fenced store
must still be fenced off: a new row starts above the highest epoch the
elector has seen and above its epoch floor source (the fenced repository's
``highest_epoch``, which a Loop registers by itself).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest
import pytest_asyncio

import kopf_reconcile as kr
from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.leader.postgres import PostgresLeaseElector
from kopf_reconcile.leader.protocol import LeaseEpochExhausted
from support import eventually, fenced_loop

RECONCILER = "devices"
TTL = kr.LeaseTTL(60)


async def execute(dsn: str, sql: str) -> None:
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute(sql)
    finally:
        await connection.close()


async def delete_lease_row(dsn: str) -> None:
    await execute(dsn, f"DELETE FROM kopf_reconcile_lease WHERE reconciler_id = '{RECONCILER}'")


@pytest_asyncio.fixture
async def repo(embedded_postgres_dsn: str) -> AsyncIterator[PostgresFencedRepository]:
    """A fenced store in the lease's scope that has already seen epoch 7."""
    async with PostgresFencedRepository(embedded_postgres_dsn, scope=RECONCILER) as repo:
        assert await repo.apply_fenced("dev-1", 7, {"v": 1})
        assert await repo.apply_fenced("dev-2", 3, {"v": 1})
        yield repo


async def test_a_new_row_starts_above_the_floor(
    embedded_postgres_dsn: str, repo: PostgresFencedRepository
) -> None:
    async with PostgresLeaseElector(embedded_postgres_dsn, ttl=TTL) as elector:
        elector.use_epoch_floor(RECONCILER, repo.highest_epoch)
        assert (await elector.acquire_lease(RECONCILER)).epoch == 8

    await delete_lease_row(embedded_postgres_dsn)
    assert await repo.apply_fenced("dev-1", 8, {"v": 2})  # the store moved on meanwhile
    async with PostgresLeaseElector(embedded_postgres_dsn, ttl=TTL) as newcomer:
        newcomer.use_epoch_floor(RECONCILER, repo.highest_epoch)
        token = await newcomer.acquire_lease(RECONCILER)
        assert token.epoch == 9
        assert await repo.apply_fenced("dev-1", token.epoch, {"v": 3})
        assert not await repo.apply_fenced("dev-1", 8, {"v": "zombie"})


async def test_a_recreated_table_starts_above_the_floor(
    embedded_postgres_dsn: str, repo: PostgresFencedRepository
) -> None:
    async with PostgresLeaseElector(embedded_postgres_dsn, ttl=TTL) as elector:
        await elector.acquire_lease(RECONCILER)
    await execute(embedded_postgres_dsn, "DROP TABLE kopf_reconcile_lease")
    async with PostgresLeaseElector(embedded_postgres_dsn, ttl=TTL) as newcomer:
        newcomer.use_epoch_floor(RECONCILER, repo.highest_epoch)
        assert (await newcomer.acquire_lease(RECONCILER)).epoch == 8


async def test_without_a_floor_the_elector_remembers_the_epochs_it_saw(
    embedded_postgres_dsn: str,
) -> None:
    async with (
        PostgresLeaseElector(embedded_postgres_dsn, ttl=TTL) as a,
        PostgresLeaseElector(embedded_postgres_dsn, ttl=TTL) as b,
    ):
        token = await a.acquire_lease(RECONCILER)
        await a.release_lease(token)
        token = await b.acquire_lease(RECONCILER)
        assert token.epoch == 2
        with pytest.raises(kr.LeaseContended):
            await a.acquire_lease(RECONCILER)  # a now knows epoch 2 was used

        await delete_lease_row(embedded_postgres_dsn)
        assert (await a.acquire_lease(RECONCILER)).epoch == 3
    # The residual risk the floor exists for: nobody remembers, the row restarts at 1.
    await delete_lease_row(embedded_postgres_dsn)
    async with PostgresLeaseElector(embedded_postgres_dsn, ttl=TTL) as forgetful:
        assert (await forgetful.acquire_lease(RECONCILER)).epoch == 1


async def test_an_unavailable_floor_fails_the_acquisition_and_creates_nothing(
    embedded_postgres_dsn: str,
) -> None:
    async def unavailable() -> int:
        raise ConnectionError("the fenced store is down")

    async def not_an_int() -> int:
        return "7"  # type: ignore[return-value]

    async with PostgresLeaseElector(embedded_postgres_dsn, ttl=TTL) as elector:
        elector.use_epoch_floor(RECONCILER, unavailable)
        with pytest.raises(ConnectionError):
            await elector.acquire_lease(RECONCILER)
        elector.drop_epoch_floor(RECONCILER, unavailable)
        elector.use_epoch_floor(RECONCILER, not_an_int)
        with pytest.raises(TypeError, match="not an int"):
            await elector.acquire_lease(RECONCILER)
        await elector.migrate()
    connection = await asyncpg.connect(embedded_postgres_dsn)
    try:
        assert await connection.fetchval("SELECT count(*) FROM kopf_reconcile_lease") == 0
    finally:
        await connection.close()
    with pytest.raises(kr.ConfigError, match="async callable"):
        elector.use_epoch_floor(RECONCILER, 7)  # type: ignore[arg-type]


async def test_a_loop_registers_its_fenced_store_as_the_floor(
    embedded_postgres_dsn: str, repo: PostgresFencedRepository
) -> None:
    written: list[int] = []

    async def reconcile(request: kr.Request) -> None:
        writer = kr.fenced_writer()
        assert writer is not None
        if request.entity_id:
            await writer.write(request.entity_id, {"v": "loop"})
            written.append(writer.epoch)

    async with (
        PostgresLeaseElector(embedded_postgres_dsn, ttl=TTL) as elector,
        PostgresFencedRepository(embedded_postgres_dsn) as loop_repo,
    ):
        loop = fenced_loop(reconcile, elector, loop_repo, RECONCILER)
        async with loop:
            await loop.enqueue(kr.Request("dev-1"))
            await eventually(lambda: written == [8])
            assert loop.stats().epoch == 8
        assert await repo.get_state("dev-1") == {"v": "loop"}


async def test_a_recreated_row_never_reuses_an_epoch_held_before_any_write(
    embedded_postgres_dsn: str,
) -> None:
    async def idle(req: kr.Request) -> None:
        return None

    dsn = embedded_postgres_dsn
    async with (
        PostgresLeaseElector(dsn, ttl=TTL) as elector_a,
        PostgresLeaseElector(dsn, ttl=TTL) as elector_b,
        PostgresFencedRepository(dsn) as repo_a,
        PostgresFencedRepository(dsn) as repo_b,
    ):
        a = fenced_loop(idle, elector_a, repo_a, RECONCILER)
        async with a:
            await eventually(lambda: a.stats().is_leader)
            held = a.stats().epoch  # A leads but has written nothing at this epoch yet
            await delete_lease_row(dsn)  # the lease record disappears
            b = fenced_loop(idle, elector_b, repo_b, RECONCILER)
            async with b:
                await eventually(lambda: b.stats().is_leader)
                assert b.stats().epoch > held  # never the epoch A still holds
                await eventually(lambda: not a.stats().is_leader)  # and A learns it lost


async def test_a_row_edited_to_the_bigint_bound_is_refused_and_deleting_it_repairs(
    embedded_postgres_dsn: str,
) -> None:
    bound = 2**63 - 1
    async with (
        PostgresLeaseElector(embedded_postgres_dsn, ttl=TTL) as holder,
        PostgresLeaseElector(embedded_postgres_dsn, ttl=TTL) as survivor,
    ):
        await holder.acquire_lease(RECONCILER)
        await execute(embedded_postgres_dsn, f"UPDATE kopf_reconcile_lease SET epoch = {bound}")
        with pytest.raises(kr.LeaseContended):  # the survivor sees, and remembers, the epoch
            await survivor.acquire_lease(RECONCILER)
        await execute(embedded_postgres_dsn, "UPDATE kopf_reconcile_lease SET expires_at = now()")
        with pytest.raises(LeaseEpochExhausted, match="DELETE FROM"):
            await survivor.acquire_lease(RECONCILER)
        await delete_lease_row(embedded_postgres_dsn)  # the repair the message names
        assert (await survivor.acquire_lease(RECONCILER)).epoch == 1


async def test_a_row_below_the_floor_is_raised_above_it_on_takeover(
    embedded_postgres_dsn: str, repo: PostgresFencedRepository
) -> None:
    """A lease row restored at epoch 1 while the scope has seen 7: the next holder leads at 8."""
    async with PostgresLeaseElector(embedded_postgres_dsn, ttl=TTL) as old:
        await old.release_lease(await old.acquire_lease(RECONCILER))
    await execute(embedded_postgres_dsn, "UPDATE kopf_reconcile_lease SET epoch = 1")
    async with PostgresLeaseElector(embedded_postgres_dsn, ttl=TTL) as newcomer:
        newcomer.use_epoch_floor(RECONCILER, repo.highest_epoch)
        token = await newcomer.acquire_lease(RECONCILER)
        assert token.epoch == 8
        await newcomer.renew_lease(token)  # the raised epoch is the one the row holds
