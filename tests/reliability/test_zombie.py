"""A zombie leader's late write is rejected by the database: real processes, real PostgreSQL.

Two replica processes (``replica.py``) contend for one lease — a Kubernetes Lease on
the embedded cluster running as a process of its own, or a PostgreSQL lease row —
and write through ``PostgresFencedRepository`` to an embedded PostgreSQL. The
leader, A, is paused (SIGSTOP) in the middle of a fenced write: after its writer
checked the lease locally, before the SQL goes out. Past A's lease, B takes over
with the next epoch and writes. When A resumes (SIGCONT), its write goes out with
the old epoch before anything else in A can run; the database receives it and
rejects it, the row keeps B's state, and A steps down. (A's Loop also sees at
once that its renew deadline passed during the pause and cancels the reconcile,
usually before the database's answer arrives: which of the two A notices first
does not matter, the database is the guard.) Audit triggers record every fenced
write statement, every write applied and every epoch recorded as leading the
scope: exactly one write, A's, reached the database and applied nothing; B's
epoch was recorded before B wrote; and no write was applied below an epoch that
had led the scope (or below one its entity had seen). Without the epoch
condition in the repository's SQL this test fails: the row ends up holding A's
late write.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio
from fleet import ELECTORS, Event, first_event, lease_store, replicas

from kopf_reconcile.control.holding import ACQUIRE_RETRY_JITTER
from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.testing import audit
from support import eventually

pytestmark = pytest.mark.slow

RECONCILER = "devices"  # the replicas' reconciler id: the scope of their fence rows
WORK = "work"  # the entity the leader keeps writing
TTL = 2.0  # whole seconds: Kubernetes Leases carry the duration in seconds
RENEW = 0.2
OPTIONS = ("--ttl", str(TTL), "--renew", str(RENEW))
# The lease lapses one TTL after the last renewal; B tries again within a retry period.
TAKEOVER_BOUND = TTL + 2 * RENEW * ACQUIRE_RETRY_JITTER + 1.5
STARTUP = 30.0


@pytest_asyncio.fixture(params=ELECTORS)
async def lease_args(request: pytest.FixtureRequest) -> AsyncIterator[list[str]]:
    async with lease_store(request.param) as replica_args:
        yield replica_args


def is_stopped(pid: int) -> bool:
    """Whether the process is stopped by a signal (state ``T`` in ``/proc/PID/stat``)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rpartition(")")[2].split()[0] == "T"


def event_is(name: str, **fields: object) -> Callable[[Event], bool]:
    def matches(event: Event) -> bool:
        return event["event"] == name and all(event[k] == v for k, v in fields.items())

    return matches


async def test_a_paused_leaders_late_write_is_rejected_by_the_database(
    lease_args: list[str], embedded_postgres_dsn: str
) -> None:
    fence_dsn = embedded_postgres_dsn
    async with PostgresFencedRepository(fence_dsn, scope=RECONCILER) as fence:
        await fence.migrate()
        await audit.install(fence_dsn)
        async with replicas(lease_args, 2, *OPTIONS, "--fence-dsn", fence_dsn) as group:
            a, leading = await first_event(group, event_is("leader"), STARTUP)
            [b] = [replica for replica in group if replica is not a]
            epoch = leading["epoch"]
            await a.wait_for(event_is("wrote", epoch=epoch), STARTUP)

            a.signal(signal.SIGUSR1)  # pause inside the next write
            pausing = await a.wait_for(event_is("pausing"), 5)
            try:
                await eventually(lambda: is_stopped(a.pid), message="A stops inside its write")
                assert pausing["epoch"] == epoch
                took_over = await b.wait_for(event_is("leader", epoch=epoch + 1), TAKEOVER_BOUND)
                await b.wait_for(event_is("wrote", epoch=epoch + 1), 5)
                assert await fence.last_epoch(WORK) == epoch + 1
                rejected_before = len(await audit.rejected_writes(fence_dsn))
                resumed_from = len(a.events)
            finally:
                a.signal(signal.SIGCONT)

            # The late write reaches the database, which rejects it; A steps down.
            await a.wait_for(event_is("follower"), 5, after=resumed_from)
            late = (epoch, pausing["mutation"])

            async def late_write_rejected() -> bool:
                return len(await audit.rejected_writes(fence_dsn)) > rejected_before

            await eventually(late_write_rejected, message="the late write reached the database")
            answers = [e for e in a.events[resumed_from:] if e["event"] == "answered"]
            assert all(not answer["accepted"] for answer in answers), answers
            assert not [e for e in a.events[resumed_from:] if e["event"] == "wrote"]
            state = await fence.get_state(WORK)
            assert state is not None and state["epoch"] == epoch + 1
            assert await fence.last_epoch(WORK) == epoch + 1
            assert b.leading and b.leadership() == took_over  # never interrupted

    # Only A was ever behind: the one rejection is its late write. Rejected at the
    # entity's row, the audit also has the row it proposed; rejected for the
    # scope's epoch, it proposed none.
    [rejected] = (await audit.rejected_writes(fence_dsn))[rejected_before:]
    assert rejected.epoch is None or (rejected.epoch, rejected.state) == late, rejected
    history = await audit.history(fence_dsn, scope=RECONCILER)
    audit.assert_no_stale_writes(history)
    led = next(e.seq for e in history if isinstance(e, audit.Led) and e.epoch == epoch + 1)
    first = next(e.seq for e in history if isinstance(e, audit.Applied) and e.epoch == epoch + 1)
    assert led < first, "B wrote before its epoch was recorded as leading the scope"
    applied = await audit.applied_writes(fence_dsn, scope=RECONCILER)
    assert late not in applied[WORK]
    assert {e for e, _ in applied[WORK]} == {epoch, epoch + 1}
