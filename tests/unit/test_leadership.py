"""The Loop's lease control plane, against the in-process lease store."""

from __future__ import annotations

import asyncio
import time

import pytest

import kopf_reconcile as kr
from kopf_reconcile.loop import Loop
from kopf_reconcile.testing.memory import MemoryLeaseElector, MemoryLeaseStore
from support import eventually

RID = "devices"


def leader_loop(
    reconcile: object,
    elector: MemoryLeaseElector,
    source: asyncio.Queue[kr.Request] | None = None,
    renew: float = 0.05,
) -> Loop:
    return (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)  # type: ignore[arg-type]
        .with_trigger(kr.ChannelTrigger(source or asyncio.Queue()))
        .with_leader(elector)
        .with_reconciler_id(RID)
        .with_renew_interval(renew)
        .with_concurrency(2)
        .build()
    )


async def test_only_the_lease_holder_dispatches_and_followers_keep_queuing() -> None:
    store = MemoryLeaseStore()
    calls: dict[str, list[str]] = {"a": [], "b": []}

    def reconciler(who: str) -> object:
        async def reconcile(req: kr.Request) -> None:
            calls[who].append(req.entity_id)

        return reconcile

    ea, eb = MemoryLeaseElector(store, kr.LeaseTTL(1)), MemoryLeaseElector(store, kr.LeaseTTL(1))
    a = leader_loop(reconciler("a"), ea)
    async with a:
        await eventually(lambda: a.stats().is_leader)
        b = leader_loop(reconciler("b"), eb)
        async with b:
            for i in range(5):
                await a.enqueue(kr.Request(f"e{i}"))
                await b.enqueue(kr.Request(f"e{i}"))
            await eventually(lambda: len(calls["a"]) == 6)  # 5 entities + resync-all
            await asyncio.sleep(0.2)  # several renew periods
            assert calls["b"] == []
            assert not b.stats().is_leader
            assert b.stats().queued == 5  # deduplicated, kept for a failover
            assert store.holder(RID) == ea.holder_id
    assert ea.releases == 1


async def test_graceful_stop_releases_and_a_follower_takes_over_with_the_queue() -> None:
    store = MemoryLeaseStore()
    seen_by_b: list[str] = []

    async def quiet(req: kr.Request) -> None:
        return None

    async def record(req: kr.Request) -> None:
        seen_by_b.append(req.entity_id)

    ea, eb = MemoryLeaseElector(store, kr.LeaseTTL(60)), MemoryLeaseElector(store, kr.LeaseTTL(60))
    a = leader_loop(quiet, ea)
    await a.start()
    await eventually(lambda: a.stats().is_leader)
    first_epoch = a.stats().epoch
    b = leader_loop(record, eb)
    async with b:
        await b.enqueue(kr.Request("queued-while-following"))
        await a.stop()
        # TTL is 60 s: only the release explains a prompt takeover.
        await eventually(lambda: b.stats().is_leader, timeout=5)
        assert b.stats().epoch == first_epoch + 1
        await eventually(lambda: sorted(seen_by_b) == ["", "queued-while-following"])


async def test_lost_lease_cancels_in_flight_reconciles_at_once() -> None:
    store = MemoryLeaseStore()
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def reconcile(req: kr.Request) -> None:
        if req.entity_id == "slow":
            started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise

    metrics = kr.register_metrics(__import__("prometheus_client").CollectorRegistry())
    ea = MemoryLeaseElector(store, kr.LeaseTTL(1))
    loop = (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_leader(ea)
        .with_reconciler_id(RID)
        .with_renew_interval(0.05)
        .with_metrics(metrics)
        .with_name("devices")
        .build()
    )
    assert metrics.leader is not None
    async with loop:
        await eventually(lambda: loop.stats().is_leader)
        assert metrics.leader.labels("devices", "")._value.get() == 1
        await loop.enqueue(kr.Request("slow"))
        await started.wait()
        # Another holder takes the lease over (as after an expiry elsewhere).
        store.expire(RID)
        await MemoryLeaseElector(store, kr.LeaseTTL(60)).acquire_lease(RID)
        await asyncio.wait_for(cancelled.wait(), 2)
        assert not loop.stats().is_leader
        assert metrics.leader.labels("devices", "")._value.get() == 0
        assert loop.stats().queued >= 1  # the interrupted entity is kept, not lost


class RecordingElector(MemoryLeaseElector):
    """Records, at each release (done when stepping down), how long the lease had left."""

    margins: list[float]

    async def release_lease(self, token: kr.LeaseToken) -> None:
        lease = self.store.leases[token.reconciler_id]
        self.margins.append(lease.expires - time.monotonic())
        await super().release_lease(token)


@pytest.mark.parametrize("failure", ["errors", "hang"])
async def test_failing_renewals_step_down_before_the_ttl_lets_another_acquire(
    failure: str,
) -> None:
    store = MemoryLeaseStore()
    elector = RecordingElector(store, kr.LeaseTTL(0.6))
    elector.margins = []

    async def reconcile(req: kr.Request) -> None:
        return None

    loop = leader_loop(reconcile, elector, renew=0.05)
    async with loop:
        await eventually(lambda: loop.stats().is_leader)
        if failure == "errors":
            elector.fail_renewals = 10**6
        else:
            elector.hang_renewals = True
        await eventually(lambda: bool(elector.margins), timeout=5)
        # It stepped down while the lease had not yet expired for others.
        assert elector.margins[0] > 0, elector.margins
        # The API heals: it leads and renews again.
        elector.fail_renewals = 0
        elector.hang_renewals = False
        await eventually(lambda: loop.stats().is_leader, timeout=5)
        stepped_down = len(elector.margins)
        await asyncio.sleep(0.6)  # longer than the renew deadline: renewals succeed now
        assert len(elector.margins) == stepped_down
        assert loop.stats().is_leader


async def test_new_leader_runs_a_resync_all_and_epoch_increases() -> None:
    store = MemoryLeaseStore()
    epochs: list[int] = []
    resyncs: list[int] = []

    async def reconcile(req: kr.Request) -> None:
        if req.entity_id == "":
            resyncs.append(1)

    for _ in range(3):
        loop = leader_loop(reconcile, MemoryLeaseElector(store, kr.LeaseTTL(5)))
        async with loop:
            await eventually(lambda: loop.stats().is_leader)  # noqa: B023 - awaited at once
            epochs.append(loop.stats().epoch)
            await eventually(lambda: len(resyncs) == len(epochs))
    assert epochs == sorted(set(epochs)) and len(epochs) == 3


async def test_single_process_mode_is_always_leader_with_epoch_zero() -> None:
    async def reconcile(req: kr.Request) -> None:
        return None

    loop = (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .build()
    )
    async with loop:
        assert loop.stats().is_leader and loop.stats().epoch == 0


class SlowAcquire(MemoryLeaseElector):
    """Takes the lease at once but answers late (a slow API server)."""

    async def acquire_lease(self, reconciler_id: str) -> kr.LeaseToken:
        token = await super().acquire_lease(reconciler_id)
        await asyncio.sleep(0.3)
        return token


async def test_stop_during_an_acquire_leaves_no_lease_behind() -> None:
    store = MemoryLeaseStore()
    elector = SlowAcquire(store, kr.LeaseTTL(60))

    async def reconcile(req: kr.Request) -> None:
        return None

    loop = leader_loop(reconcile, elector)
    await loop.start()
    await eventually(lambda: store.holder(RID) == elector.holder_id)
    await loop.stop()
    assert store.holder(RID) is None  # handed back, not held for the 60 s TTL
    assert not loop.stats().is_leader


async def test_leadership_observers_are_told_of_leading_and_of_losing() -> None:
    from kopf_reconcile.control.holding import LeadershipChange, LeaseHolder

    store = MemoryLeaseStore()
    seen: list[LeadershipChange] = []
    leading_when_told: list[bool] = []

    async def quiet(req: kr.Request) -> None:
        return None

    elector = MemoryLeaseElector(store, kr.LeaseTTL(60))
    loop = leader_loop(quiet, elector)

    def observe(change: LeadershipChange) -> None:
        seen.append(change)
        leading_when_told.append(loop.stats().is_leader)

    forget = LeaseHolder.observe(observe)
    try:
        async with loop:
            await eventually(lambda: loop.stats().is_leader)
            epoch = loop.stats().epoch
            assert seen == [LeadershipChange(True, RID, epoch, elector.holder_id)]
            # The lease is taken over elsewhere: this holder steps down.
            store.expire(RID)
            await MemoryLeaseElector(store, kr.LeaseTTL(60)).acquire_lease(RID)
            await eventually(lambda: len(seen) == 2)
            assert seen[1] == LeadershipChange(False, RID, epoch, elector.holder_id)
            store.expire(RID)  # the other holder's lease runs out: it leads again
            await eventually(lambda: len(seen) == 3)
            assert seen[2] == LeadershipChange(True, RID, epoch + 2, elector.holder_id)
        # Stopping while leading is a loss too, told once the lease is given up.
        assert [change.leading for change in seen] == [True, False, True, False]
        # Told just before it leads, and just after it stopped.
        assert leading_when_told == [False, False, False, False]
    finally:
        forget()
    assert LeaseHolder._observers == []


async def test_a_failing_leadership_observer_changes_nothing_of_the_lease() -> None:
    from kopf_reconcile.control.holding import LeadershipChange, LeaseHolder

    def broken(change: LeadershipChange) -> None:
        raise RuntimeError("observer failed")

    async def quiet(req: kr.Request) -> None:
        return None

    forget = LeaseHolder.observe(broken)
    try:
        loop = leader_loop(quiet, MemoryLeaseElector(MemoryLeaseStore(), kr.LeaseTTL(60)))
        async with loop:
            await eventually(lambda: loop.stats().is_leader)
    finally:
        forget()
