"""A Loop writing through PostgresFencedRepository survives a PostgreSQL outage.

N entities are reconciled by a leader (the in-memory elector: the subject is
the database) that writes each entity's desired state through its
FencedWriter, reading the stored state first as a convergent reconciler does.
PostgreSQL is stopped while some entities are done, some are in the middle of
a reconcile and the rest are queued. Every reconcile then fails with a
connection error: a transient error, retried with backoff — not a dead
letter, not a fenced write, and the lease (and so the epoch) is kept. Once
PostgreSQL is back, every entity converges, and the audit triggers show each
entity's desired state applied exactly once, at the leader's epoch, recorded
as leading the scope before the first write, and no stale write.
"""

from __future__ import annotations

import asyncio
import collections
import json
import statistics

import asyncpg
import prometheus_client

import kopf_reconcile as kr
from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.testing import EmbeddedPostgres, audit
from kopf_reconcile.testing.memory import MemoryLeaseElector, MemoryLeaseStore
from support import eventually

CONTROLLER = "devices"
ENTITIES = [f"dev-{n:02d}" for n in range(20)]
DONE_BEFORE = 8  # entities that converge before the outage
CONCURRENCY = 4
BACKOFF_BASE, BACKOFF_MAX = 0.02, 0.5
FAILURES_DURING_OUTAGE = 6  # per entity


def desired_state(entity: str) -> dict[str, object]:
    return {"entity": entity, "version": 1}


async def stored_states(dsn: str) -> dict[str, object]:
    connection = await asyncpg.connect(dsn)
    try:
        rows = await connection.fetch("SELECT entity_id, state::text FROM kopf_reconcile_fence")
    finally:
        await connection.close()
    return {row["entity_id"]: json.loads(row["state"]) for row in rows}


async def test_reconciles_back_off_during_an_outage_and_converge_after_it(
    embedded_postgres: EmbeddedPostgres,
) -> None:
    dsn = embedded_postgres.dsn
    registry = prometheus_client.CollectorRegistry()

    def sample(metric: str, **labels: str) -> float:
        # Counters of an unsharded Loop carry shard="".
        value = registry.get_sample_value(f"kopf_reconcile_{metric}", {**labels, "shard": ""})
        assert value is not None, (metric, labels)
        return value

    failed_at: collections.defaultdict[str, list[float]] = collections.defaultdict(list)
    outage_began = asyncio.Event()  # entities after DONE_BEFORE wait for it before writing
    held = set(ENTITIES[DONE_BEFORE:])

    async with PostgresFencedRepository(dsn) as repo:

        async def reconcile(request: kr.Request) -> None:
            entity = request.entity_id
            if not entity:
                return  # resync-all: the test enqueues every entity itself
            try:
                desired = desired_state(entity)
                if await repo.get_state(entity) == desired:
                    return  # applied already (perhaps by a run whose reply was lost)
                if entity in held:
                    await outage_began.wait()
                writer = kr.fenced_writer()
                assert writer is not None
                await writer.write(entity, desired)
            except Exception:
                failed_at[entity].append(asyncio.get_running_loop().time())
                raise

        loop = (
            kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)
            .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
            .with_leader(MemoryLeaseElector(MemoryLeaseStore(), kr.LeaseTTL(5)))
            .with_fenced_repo(repo)
            .with_name(CONTROLLER)
            .with_concurrency(CONCURRENCY)
            .with_backoff(BACKOFF_BASE, BACKOFF_MAX)
            .with_renew_interval(0.1)
            .with_metrics(kr.register_metrics(registry))
            .build()
        )
        await repo.migrate()
        await audit.install(dsn)
        async with loop:
            await eventually(lambda: loop.stats().is_leader, message="the loop leads")
            epoch = loop.stats().epoch
            for entity in ENTITIES:
                await loop.enqueue(kr.Request(entity))

            async def some_done_some_in_flight() -> bool:
                done = len(await stored_states(dsn)) == DONE_BEFORE
                return done and loop.stats().in_flight == CONCURRENCY

            await eventually(some_done_some_in_flight, message="reconciles waiting to write")
            await embedded_postgres.stop()
            outage_began.set()

            await eventually(
                lambda: all(len(failed_at[e]) >= FAILURES_DURING_OUTAGE for e in held),
                message=f"every pending entity failed {FAILURES_DURING_OUTAGE} times",
            )
            errors = sample("reconcile_total", controller=CONTROLLER, result="error")
            assert errors >= FAILURES_DURING_OUTAGE * len(held)
            assert sample("workqueue_retries_total", name=CONTROLLER) == errors
            assert sample("fenced_writes_total", controller=CONTROLLER, outcome="error") > 0
            for result in ("permanent", "fenced"):
                assert sample("reconcile_total", controller=CONTROLLER, result=result) == 0
            stats = loop.stats()
            assert (stats.dead_letters, stats.is_leader, stats.epoch) == (0, True, epoch)
            # Backing off: the retry after an entity's 5th failure comes after a delay drawn
            # from [0, base·2⁴] = [0, 0.32 s], 0.16 s on average; retrying at once would
            # take a few milliseconds per entity waiting for a worker.
            gaps = [failed_at[e][5] - failed_at[e][4] for e in held]
            assert statistics.mean(gaps) > BACKOFF_BASE * 2**4 / 4, gaps

            await embedded_postgres.start()
            expected = {entity: desired_state(entity) for entity in ENTITIES}

            async def converged() -> bool:
                return await stored_states(dsn) == expected

            await eventually(converged, message="every entity converges after the outage")
            assert loop.stats().dead_letters == 0

    scope = loop.reconciler_id
    writes = await audit.applied_writes(dsn, scope=scope)
    assert writes == {entity: [(epoch, desired_state(entity))] for entity in ENTITIES}
    history = await audit.history(dsn, scope=scope)
    audit.assert_no_stale_writes(history)
    led = next(e.seq for e in history if isinstance(e, audit.Led) and e.epoch == epoch)
    assert all(led < e.seq for e in history if isinstance(e, audit.Applied))
