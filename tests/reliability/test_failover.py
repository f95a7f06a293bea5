"""Failover between OS processes, each running a Loop on a real lease store.

Each test runs once per elector: Kubernetes Leases on the embedded cluster running
as a process of its own, and PostgreSQL rows on an embedded PostgreSQL server.
Replicas (``replica.py``) report their leadership and work as JSON lines; the
leader is killed (SIGKILL) or paused past its lease (SIGSTOP, then SIGCONT).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from fleet import ELECTORS, Event, Replica, first_event, lease_store, replicas

from kopf_reconcile.control.holding import ACQUIRE_RETRY_JITTER

pytestmark = pytest.mark.slow

TTL = 2.0
RENEW = 0.2
RETRY = RENEW * ACQUIRE_RETRY_JITTER  # the longest pause between two acquire attempts
# A follower sees the leader's last renewal within one retry period; the lease lapses
# one TTL after that; the next acquire attempt comes within another retry period.
# SCHEDULING allows for process scheduling on a busy machine.
SCHEDULING = 1.5
TAKEOVER_BOUND = TTL + 2 * RETRY + SCHEDULING
OPTIONS = ("--ttl", str(TTL), "--renew", str(RENEW))
STARTUP = 30.0


@pytest_asyncio.fixture(params=ELECTORS)
async def store(request: pytest.FixtureRequest) -> AsyncIterator[list[str]]:
    async with lease_store(request.param) as replica_args:
        yield replica_args


def is_leader(event: Event) -> bool:
    return event["event"] == "leader"


def is_write(event: Event) -> bool:
    return event["event"] == "wrote"


async def working_leader(group: list[Replica]) -> tuple[Replica, int]:
    """The replica that leads, once it makes fenced writes; and its epoch."""
    leader, event = await first_event(group, is_leader, STARTUP)
    await leader.wait_for(is_write, STARTUP)
    return leader, event["epoch"]


async def test_sigkill_of_the_leader_hands_over_within_the_ttl_and_a_retry(
    store: list[str],
) -> None:
    async with replicas(store, 3, *OPTIONS) as group:
        leader, epoch = await working_leader(group)
        survivors = [replica for replica in group if replica is not leader]
        await asyncio.sleep(3 * RENEW)  # a few renewals, seen by the followers
        assert not any(replica.leading for replica in survivors)
        killed_at = time.monotonic()
        await leader.kill()

        successor, took_over = await first_event(
            survivors, lambda e: is_leader(e) and e["t"] > killed_at, TAKEOVER_BOUND
        )
        assert took_over["epoch"] == epoch + 1
        await successor.wait_for(lambda e: is_write(e) and e["epoch"] == epoch + 1, STARTUP)
        await asyncio.sleep(5 * RENEW)  # several renewals later: still exactly one leader
        leaders_since = {
            replica.name
            for replica in survivors
            for event in replica.events
            if is_leader(event) and event["t"] > killed_at
        }
        assert leaders_since == {successor.name}
        assert [replica.name for replica in survivors if replica.leading] == [successor.name]


async def test_a_paused_leader_is_replaced_and_on_resume_stops_before_doing_anything_else(
    store: list[str],
) -> None:
    async with replicas(store, 2, *OPTIONS) as group:
        paused, epoch = await working_leader(group)
        [other] = [replica for replica in group if replica is not paused]
        paused.signal(signal.SIGSTOP)
        try:
            took_over = await other.wait_for(
                lambda e: is_leader(e) and e["epoch"] > epoch, TAKEOVER_BOUND
            )
            await other.wait_for(lambda e: is_write(e) and e["epoch"] == took_over["epoch"], 5)
            resumed_from = len(paused.events)  # all it wrote before the pause has been read
        finally:
            paused.signal(signal.SIGCONT)

        await paused.wait_for(lambda e: e["event"] == "follower", TTL, after=resumed_from)
        await asyncio.sleep(5 * RENEW)  # it stays a follower, doing nothing
        since_resume = [(e["event"], e.get("entity")) for e in paused.events[resumed_from:]]
        # Its in-flight reconciles end before anything else happens: the waiting one is
        # cancelled; the writing one is cancelled, or its next write is refused by the
        # writer's own lease check (when its timer fires before the control plane's).
        # Nothing is written and nothing new is started.
        assert since_resume[0][0] in ("cancelled", "refused", "follower"), since_resume
        assert ("cancelled", "wait") in since_resume, since_resume
        assert {("cancelled", "work"), ("refused", "work")} & set(since_resume), since_resume
        assert not {"wrote", "reconcile"} & {kind for kind, _ in since_resume}, since_resume
        assert not paused.leading
        assert other.leading
        assert other.leadership() == took_over  # never interrupted
