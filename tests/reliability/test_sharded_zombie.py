"""A zombie shard holder's late write is rejected in its shard's scope: real processes.

Two replica processes (``replica.py --shards 2``) share a sharded reconciler on a real
lease store (PostgreSQL rows, or Kubernetes Leases on the embedded cluster as a process
of its own) and write through ``PostgresFencedRepository`` to an embedded PostgreSQL.
The shards split between them. The holder of the shard of ``work``, A, is paused
(SIGSTOP) inside a fenced write: after its writer checked the lease locally, before the
SQL goes out. Past A's leases, B takes that shard over (its balance now counts one live
replica) at a higher epoch of that shard's lease and writes. When A resumes, its write
goes out with the old epoch: the shard's scope rejects it, the row keeps B's state, and
the audit shows no write applied below an epoch that had led that scope.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio
from fleet import ELECTORS, Event, first_event, lease_store, replicas
from test_zombie import is_stopped

from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.sharding import ShardAssignment, shard_id
from kopf_reconcile.testing import audit
from support import eventually

pytestmark = pytest.mark.slow

RECONCILER = "devices"
WORK = "work"
SHARDS = 2
TTL, RENEW = 2.0, 0.2
OPTIONS = ("--ttl", str(TTL), "--renew", str(RENEW), "--shards", str(SHARDS))
# A's leases (shard and membership) lapse a TTL after their last renewal; B's balance
# then counts one live replica and takes the shard within a few retry periods.
TAKEOVER_BOUND = 3 * TTL + 5.0
STARTUP = 30.0


@pytest_asyncio.fixture(params=ELECTORS)
async def lease_args(request: pytest.FixtureRequest) -> AsyncIterator[list[str]]:
    async with lease_store(request.param) as replica_args:
        yield replica_args


def wrote(above: int = 0) -> Callable[[Event], bool]:
    return lambda e: e["event"] == "wrote" and e["epoch"] > above


async def test_a_paused_shard_holders_late_write_is_rejected_in_the_shards_scope(
    lease_args: list[str], embedded_postgres_dsn: str
) -> None:
    dsn = embedded_postgres_dsn
    scope = shard_id(RECONCILER, ShardAssignment(SHARDS).shard_of(WORK))
    async with PostgresFencedRepository(dsn, scope=scope) as fence:
        await fence.migrate()
        await audit.install(dsn)
        async with replicas(lease_args, 2, *OPTIONS, "--fence-dsn", dsn) as group:
            a, writing = await first_event(group, wrote(), STARTUP)
            [b] = [replica for replica in group if replica is not a]
            epoch = writing["epoch"]
            # The shards split: B leads the other one.
            await b.wait_for(lambda e: e["event"] == "shards" and len(e["held"]) == 1, STARTUP)

            a.signal(signal.SIGUSR1)  # pause inside the next write
            pausing = await a.wait_for(lambda e: e["event"] == "pausing", 5)
            try:
                await eventually(lambda: is_stopped(a.pid), message="A stops inside its write")
                assert pausing["epoch"] == epoch
                took_over = await b.wait_for(wrote(above=epoch), TAKEOVER_BOUND)
                assert await fence.last_epoch(WORK) == took_over["epoch"]
                rejected_before = len(await audit.rejected_writes(dsn))
                resumed_from = len(a.events)
            finally:
                a.signal(signal.SIGCONT)

            # The late write reaches the database, which rejects it in the shard's scope
            # (A's Loop may cancel the reconcile first: the database is the guard).
            async def late_write_rejected() -> bool:
                return len(await audit.rejected_writes(dsn)) > rejected_before

            await eventually(late_write_rejected, message="the late write reached the database")
            answers = [e for e in a.events[resumed_from:] if e["event"] == "answered"]
            assert all(not answer["accepted"] for answer in answers), answers
            assert not [e for e in a.events[resumed_from:] if e["event"] == "wrote"]
            state = await fence.get_state(WORK)
            assert state is not None and state["epoch"] >= took_over["epoch"]

    history = await audit.history(dsn, scope=scope)
    audit.assert_no_stale_writes(history)
    applied = await audit.applied_writes(dsn, scope=scope)
    assert (epoch, pausing["mutation"]) not in applied[WORK]
