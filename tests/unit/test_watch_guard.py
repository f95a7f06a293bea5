"""A leader whose watch stays broken past one TTL stands aside so a healthy replica leads;
the only candidate leads again after the hold-off and is not made to step down again."""

from __future__ import annotations

import asyncio

import kopf_reconcile as kr
from kopf_reconcile.config import LoopConfig
from kopf_reconcile.integration.settings import Settings
from kopf_reconcile.integration.watch_guard import BrokenWatchGuard
from kopf_reconcile.loop import Loop
from kopf_reconcile.testing.memory import MemoryLeaseElector, MemoryLeaseStore
from support import eventually

RID = "guarded"
BOUND, HOLD_OFF = 30.0, 35.0


class Recorded:
    def __init__(self) -> None:
        self.asides: list[tuple[str, float]] = []

    def stand_aside(self, reason: str, seconds: float) -> None:
        self.asides.append((reason, seconds))


def test_the_guard_acts_once_the_watch_stayed_broken_for_the_bound() -> None:
    problem: list[str | None] = ["the watch of devices is forbidden (403)"]
    candidate = Recorded()
    guard = BrokenWatchGuard(
        lambda: problem[0], lambda: [candidate], bound=BOUND, hold_off=HOLD_OFF
    )
    guard.check(100.0)
    guard.check(100.0 + BOUND - 1)
    assert candidate.asides == []
    guard.check(100.0 + BOUND)
    assert len(candidate.asides) == 1
    reason, seconds = candidate.asides[0]
    assert seconds == HOLD_OFF and "forbidden (403)" in reason
    # Still broken after the hold-off: this replica was the only candidate; it keeps leading.
    guard.check(100.0 + BOUND + HOLD_OFF + BOUND)
    assert len(candidate.asides) == 1
    # Recovered, then broken anew: the bound counts again from the new break.
    problem[0] = None
    guard.check(500.0)
    problem[0] = "the watch of devices answered 500"
    guard.check(501.0)
    guard.check(501.0 + BOUND - 1)
    assert len(candidate.asides) == 1
    guard.check(501.0 + BOUND)
    assert len(candidate.asides) == 2


def test_a_recovery_within_the_bound_resets_it() -> None:
    problem: list[str | None] = ["broken"]
    candidate = Recorded()
    guard = BrokenWatchGuard(
        lambda: problem[0], lambda: [candidate], bound=BOUND, hold_off=HOLD_OFF
    )
    guard.check(0.0)
    problem[0] = None
    guard.check(BOUND - 1)
    problem[0] = "broken"
    guard.check(BOUND + 1)
    assert candidate.asides == []


def test_the_bound_is_one_ttl_and_the_hold_off_a_ttl_and_a_renew_interval() -> None:
    settings = Settings.load(
        {"KOPF_RECONCILE_LEASE_TTL": "15", "KOPF_RECONCILE_RENEW_INTERVAL": "2"}
    )
    candidate = Recorded()
    guard = settings.broken_watch_guard(lambda: "broken", lambda: [candidate])
    guard.check(0.0)
    guard.check(14.9)
    assert candidate.asides == []
    guard.check(15.0)
    assert candidate.asides[0][1] == 17.0


def make_loop(store: MemoryLeaseStore) -> Loop:
    config = LoopConfig(
        reconciler=lambda request: None,
        tenancy=kr.Tenancy.SINGLE_TENANT,
        triggers=[kr.ChannelTrigger(asyncio.Queue())],
        leader=MemoryLeaseElector(store, ttl=kr.LeaseTTL(3)),
        reconciler_id=RID,
        renew_interval=0.05,
    )
    config.validate()
    return Loop(config)


async def test_a_leader_standing_aside_lets_a_healthy_replica_lead() -> None:
    store = MemoryLeaseStore()
    broken, healthy = make_loop(store), make_loop(store)
    async with broken:
        await eventually(lambda: broken.stats().is_leader, message="the first Loop leads")
        async with healthy:
            broken.stand_aside("the watch stayed broken", seconds=60)
            await eventually(lambda: healthy.stats().is_leader, message="the healthy one leads")
            assert not broken.stats().is_leader


async def test_the_only_candidate_leads_again_after_the_hold_off() -> None:
    store = MemoryLeaseStore()
    alone = make_loop(store)
    async with alone:
        await eventually(lambda: alone.stats().is_leader, message="it leads")
        epoch = alone.stats().epoch
        alone.stand_aside("the watch stayed broken", seconds=0.3)
        await eventually(lambda: not alone.stats().is_leader, message="it steps down")
        await eventually(
            lambda: alone.stats().is_leader and alone.stats().epoch > epoch,
            message="it leads again, in a new term",
        )


class SlowAcquire(MemoryLeaseElector):
    """Takes the lease at once but answers late (a slow round trip)."""

    async def acquire_lease(self, reconciler_id: str) -> kr.LeaseToken:
        token = await super().acquire_lease(reconciler_id)
        await asyncio.sleep(0.3)
        return token


async def test_a_stand_aside_during_an_acquire_is_not_lost() -> None:
    store = MemoryLeaseStore()
    config = LoopConfig(
        reconciler=lambda req: None,
        tenancy=kr.Tenancy.SINGLE_TENANT,
        triggers=[kr.ChannelTrigger(asyncio.Queue())],
        leader=SlowAcquire(store, ttl=kr.LeaseTTL(3)),
        reconciler_id=RID,
        renew_interval=0.05,
    )
    config.validate()
    loop = Loop(config)
    async with loop:
        await eventually(lambda: store.holder(RID) is not None, message="the acquire is in flight")
        assert not loop.stats().is_leader
        loop.stand_aside("the watch stayed broken", seconds=60)
        # The acquire answers now: the Loop must give the lease back, not lead the hold-off.
        await eventually(lambda: store.holder(RID) in (None, ""), message="the lease is given back")
        assert not loop.stats().is_leader
