"""The Loop's share of the safety promise, with in-process lease and fence stores.

- A lease is never released while a reconcile it guards still runs (a sync
  reconciler in its thread, an async one slow to honour cancellation): the
  Loop waits for it while the lease can still be held, or lets it lapse.
- Every capability the Loop relies on is a declared protocol: an elector
  that does not declare its TTL, or a repository that cannot record epochs,
  is a ConfigError; a float or timedelta TTL is coerced, never guessed.
- One elector serves any number of Loops, but never two Loops on one id.
- Whatever a reconciler raises, workers and entity state stay consistent.
- A follower's triggers never block on the intake capacity.

Each test failed before the change it pins down.
"""

from __future__ import annotations

import asyncio
import datetime
import threading
import time
from collections.abc import Awaitable, Callable

import pytest

import kopf_reconcile as kr
from kopf_reconcile.loop import Loop
from kopf_reconcile.testing.memory import (
    MemoryFencedRepository,
    MemoryLeaseElector,
    MemoryLeaseStore,
)
from support import eventually

RID = "devices"


def leader_loop(
    reconcile: object,
    elector: object,
    *,
    repo: object = None,
    renew: float = 0.05,
    stop_timeout: float = 30.0,
    reconciler_id: str = RID,
    intake_capacity: int = 100_000,
) -> Loop:
    builder = (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)  # type: ignore[arg-type]
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_reconciler_id(reconciler_id)
        .with_leader(elector)  # type: ignore[arg-type]
        .with_renew_interval(renew)
        .with_stop_timeout(stop_timeout)
        .with_intake_capacity(intake_capacity)
    )
    if repo is not None:
        builder.with_fenced_repo(repo)  # type: ignore[arg-type]
    return builder.build()


class Overlap:
    """Counts reconciles of each entity running at once, across Loops and threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.active: dict[str, int] = {}
        self.most = 0

    def enter(self, entity: str) -> None:
        with self._lock:
            self.active[entity] = self.active.get(entity, 0) + 1
            self.most = max(self.most, self.active[entity])

    def leave(self, entity: str) -> None:
        with self._lock:
            self.active[entity] -= 1


class Blocking:
    """A sync reconciler whose reconcile of ``x`` blocks its thread until let go."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.let_go = threading.Event()

    def __call__(self, req: kr.Request) -> None:
        if req.entity_id == "x":
            self.entered.set()
            self.let_go.wait(10)


# -- the lease is never released while guarded work runs ----------------------------------


@pytest.mark.parametrize("how", ["stop", "failed renewals"])
async def test_a_peer_never_takes_over_while_a_sync_reconcile_still_runs(how: str) -> None:
    store = MemoryLeaseStore()
    # Renewals failing from now, the old leader steps down at 4 s and its lease
    # can be held until 6 s: its thread ends in between.
    first = MemoryLeaseElector(store, kr.LeaseTTL(6))
    second = MemoryLeaseElector(store, kr.LeaseTTL(6))
    overlap = Overlap()
    entered = threading.Event()
    let_go = threading.Event()
    in_second: list[str] = []

    def slow(req: kr.Request) -> None:  # a sync reconciler: its thread cannot be interrupted
        if req.entity_id != "x":
            return
        overlap.enter("x")
        entered.set()
        let_go.wait(10)
        overlap.leave("x")

    async def fast(req: kr.Request) -> None:
        if req.entity_id == "x":
            overlap.enter("x")
            in_second.append("x")
            await asyncio.sleep(0.01)
            overlap.leave("x")

    old = leader_loop(slow, first, stop_timeout=0.05)
    new = leader_loop(fast, second)
    await old.start()
    await eventually(lambda: old.stats().is_leader)
    await new.start()
    try:
        await old.enqueue(kr.Request("x"))
        await asyncio.to_thread(entered.wait, 5)
        if how == "stop":
            stopping = asyncio.create_task(old.stop())
        else:
            first.hang_renewals = True
            await eventually(lambda: not old.stats().is_leader, timeout=10)
        await new.enqueue(kr.Request("x"))
        # The old leader's thread runs on for a while, well inside its lease: before
        # the fix the lease was released about a second after the cancellation.
        await asyncio.sleep(1.5)
        assert not new.stats().is_leader
        let_go.set()
        await eventually(lambda: new.stats().is_leader, timeout=10)
        await eventually(lambda: in_second == ["x"], timeout=5)
        if how == "stop":
            await stopping
        assert overlap.most == 1, "two replicas were inside one entity's reconcile at once"
    finally:
        let_go.set()
        await old.stop()
        await new.stop()


async def test_a_reconcile_that_outlives_its_lease_lets_the_lease_lapse_unreleased() -> None:
    store = MemoryLeaseStore()
    elector = MemoryLeaseElector(store, kr.LeaseTTL(0.6))
    stuck = Blocking()
    entered, let_go = stuck.entered, stuck.let_go
    loop = leader_loop(stuck, elector, stop_timeout=0.05)
    await loop.start()
    try:
        await eventually(lambda: loop.stats().is_leader)
        await loop.enqueue(kr.Request("x"))
        await asyncio.to_thread(entered.wait, 5)
        await loop.stop()  # returns once the lease could have expired; the thread runs on
        assert elector.releases == 0
        assert loop.stats().in_flight == 1
    finally:
        let_go.set()
    await eventually(lambda: loop.stats().in_flight == 0)


async def test_stop_releases_at_once_when_nothing_runs() -> None:
    store = MemoryLeaseStore()
    elector = MemoryLeaseElector(store, kr.LeaseTTL(15))

    async def reconcile(req: kr.Request) -> None:
        return None

    loop = leader_loop(reconcile, elector)
    async with loop:
        await eventually(lambda: loop.stats().is_leader)
    assert elector.releases == 1
    assert store.holder(RID) is None


# -- capabilities are declared, never guessed -------------------------------------------------


class TTLessElector:
    """A third-party elector that does not declare its TTL."""

    def __init__(self, store: MemoryLeaseStore) -> None:
        self._inner = MemoryLeaseElector(store, kr.LeaseTTL(3))

    async def acquire_lease(self, reconciler_id: str) -> kr.LeaseToken:
        return await self._inner.acquire_lease(reconciler_id)

    async def renew_lease(self, token: kr.LeaseToken) -> None:
        await self._inner.renew_lease(token)

    async def release_lease(self, token: kr.LeaseToken) -> None:
        await self._inner.release_lease(token)


class PlainTTLElector(TTLessElector):
    """An elector that declares its TTL as plain seconds (coerced by the Loop)."""

    def __init__(self, store: MemoryLeaseStore, ttl: float | datetime.timedelta) -> None:
        super().__init__(store)
        self._inner = MemoryLeaseElector(store, kr.LeaseTTL(ttl))
        self.store = store
        self.ttl = ttl
        self.margins: list[float] = []

    @property
    def hang_renewals(self) -> bool:
        return self._inner.hang_renewals

    @hang_renewals.setter
    def hang_renewals(self, value: bool) -> None:
        self._inner.hang_renewals = value

    async def release_lease(self, token: kr.LeaseToken) -> None:
        lease = self.store.leases[token.reconciler_id]
        self.margins.append(lease.expires - time.monotonic())
        await super().release_lease(token)


async def noop(req: kr.Request) -> None:
    return None


def test_an_elector_without_a_declared_ttl_is_refused() -> None:
    with pytest.raises(kr.ConfigError, match="does not declare its lease ttl"):
        leader_loop(noop, TTLessElector(MemoryLeaseStore()))


@pytest.mark.parametrize("ttl", [0.6, datetime.timedelta(seconds=0.6)], ids=["float", "timedelta"])
async def test_a_plain_ttl_is_coerced_and_hung_renewals_step_down_before_it(
    ttl: float | datetime.timedelta,
) -> None:
    store = MemoryLeaseStore()
    elector = PlainTTLElector(store, ttl)
    loop = leader_loop(noop, elector, renew=0.05)
    async with loop:
        await eventually(lambda: loop.stats().is_leader)
        elector.hang_renewals = True
        await eventually(lambda: bool(elector.margins), timeout=5)
        # Stepped down (and released) while the lease had not expired for others.
        assert elector.margins[0] > 0, elector.margins


def test_an_invalid_declared_ttl_is_a_config_error() -> None:
    elector = PlainTTLElector(MemoryLeaseStore(), 1)
    elector.ttl = "soon"  # type: ignore[assignment]
    with pytest.raises(kr.ConfigError, match="invalid ttl"):
        leader_loop(noop, elector)


class PerEntityOnlyRepository:
    """A repository that fences per entity only: it cannot record a leader's epoch."""

    async def apply_fenced(self, entity_id: str, epoch: int, mutation: object) -> bool:
        return True


def test_a_repository_that_cannot_record_epochs_is_refused_with_a_leader() -> None:
    elector = MemoryLeaseElector(MemoryLeaseStore(), kr.LeaseTTL(3))
    with pytest.raises(kr.ConfigError, match="cannot record the epoch"):
        leader_loop(noop, elector, repo=PerEntityOnlyRepository())


def test_the_loop_discovers_no_capability_by_getattr() -> None:
    import inspect

    from kopf_reconcile import loop as loop_module

    assert "getattr(" not in inspect.getsource(loop_module)


async def test_two_loops_cannot_lead_one_reconciler_id_through_one_elector() -> None:
    elector = MemoryLeaseElector(MemoryLeaseStore(), kr.LeaseTTL(3))
    first = leader_loop(noop, elector)
    second = leader_loop(noop, elector)
    other_id = leader_loop(noop, elector, reconciler_id="gadgets")
    async with first, other_id:
        with pytest.raises(kr.ConfigError, match="already led through elector"):
            await second.start()
    async with leader_loop(noop, elector):  # free again once the first stopped
        pass


async def test_a_lower_epoch_than_the_scope_has_led_never_leads() -> None:
    store = MemoryLeaseStore()
    repo = MemoryFencedRepository()
    repo.recorded_epoch = 7  # the scope was led at 7; this lease store restarts at 1
    elector = MemoryLeaseElector(store, kr.LeaseTTL(3))
    led_at: list[int] = []

    async def reconcile(req: kr.Request) -> None:
        writer = kr.fenced_writer()
        assert writer is not None
        led_at.append(writer.epoch)

    loop = leader_loop(reconcile, elector, repo=repo)
    async with loop:
        await eventually(lambda: bool(led_at), timeout=5)
    assert min(led_at) >= 7, led_at


# -- whatever a reconciler raises ---------------------------------------------------------------


def raising(exc: BaseException) -> Callable[[], Awaitable[None]]:
    async def raise_it() -> None:
        raise exc

    return raise_it


async def await_a_helper_someone_cancelled() -> None:
    helper = asyncio.ensure_future(asyncio.sleep(10))
    helper.cancel()
    await helper  # CancelledError, but not this worker's cancellation


@pytest.mark.parametrize(
    "fail",
    [
        raising(BaseExceptionGroup("a task group in user code", [ValueError(), GeneratorExit()])),
        raising(GeneratorExit()),
        raising(type("CustomBaseException", (BaseException,), {})()),
        await_a_helper_someone_cancelled,
    ],
    ids=["BaseExceptionGroup", "GeneratorExit", "custom", "CancelledError-of-a-helper"],
)
async def test_whatever_a_reconciler_raises_fails_it_and_keeps_the_worker(
    fail: Callable[[], Awaitable[None]],
) -> None:
    calls: list[str] = []

    async def reconcile(req: kr.Request) -> None:
        calls.append(req.entity_id)
        if calls.count(req.entity_id) == 1 and req.entity_id == "x":
            await fail()

    requests: asyncio.Queue[kr.Request] = asyncio.Queue()
    loop = (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(requests))
        .with_backoff(0.001, 0.01)
        .build()
    )
    async with loop:
        await requests.put(kr.Request("x"))
        await eventually(lambda: calls.count("x") == 2, message="x retried after the failure")
        await requests.put(kr.Request("y"))
        await eventually(lambda: "y" in calls, message="the single worker still serves")
        await eventually(lambda: loop.stats().in_flight == 0)


# -- followers ------------------------------------------------------------------------------------


async def test_a_followers_triggers_never_block_on_the_intake_capacity() -> None:
    store = MemoryLeaseStore()
    leader = leader_loop(noop, MemoryLeaseElector(store, kr.LeaseTTL(15)))
    follower = leader_loop(noop, MemoryLeaseElector(store, kr.LeaseTTL(15)), intake_capacity=10)
    async with leader:
        await eventually(lambda: leader.stats().is_leader)
        async with follower:
            async with asyncio.timeout(5):
                for i in range(100):
                    await follower.enqueue(kr.Request(f"entity-{i}"))
            assert follower.stats().queued == 100
            assert not follower.stats().is_leader


async def test_a_cancelled_stop_stops_renewing_and_lets_the_lease_lapse() -> None:
    store = MemoryLeaseStore()
    first = MemoryLeaseElector(store, kr.LeaseTTL(1.5))
    let_go = asyncio.Event()

    async def slow(req: kr.Request) -> None:
        if req.entity_id == "x":
            await let_go.wait()

    old = leader_loop(slow, first, stop_timeout=10)
    new = leader_loop(noop, MemoryLeaseElector(store, kr.LeaseTTL(1.5)))
    await old.start()
    try:
        await eventually(lambda: old.stats().is_leader)
        await old.enqueue(kr.Request("x"))
        await eventually(lambda: old.stats().in_flight == 1)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):  # a bounded shutdown gives up on the drain
                await old.stop()
        assert not old.stats().is_leader
        assert first.releases == 0  # not released while "x" may still be running
        async with new:
            # The lease lapses (the old holder renews no more) and the peer takes over.
            await eventually(lambda: new.stats().is_leader, timeout=10)
    finally:
        let_go.set()
        await old.stop()


class SlowElector(MemoryLeaseElector):
    """Acquires slowly: most of the renew deadline is gone before the lease is confirmed."""

    delay = 0.0

    async def acquire_lease(self, reconciler_id: str) -> kr.LeaseToken:
        await asyncio.sleep(self.delay)
        return await super().acquire_lease(reconciler_id)


class SlowRecorder(MemoryFencedRepository):
    delay = 0.0

    async def record_epoch(self, epoch: int, holder: str) -> None:
        await asyncio.sleep(self.delay)
        await super().record_epoch(epoch, holder)


async def test_the_deadline_of_a_new_leader_counts_from_its_confirming_renewal() -> None:
    # TTL 1.5 s: renew deadline 1 s; acquiring takes 0.6 s and recording 0.6 s more.
    elector = SlowElector(MemoryLeaseStore(), kr.LeaseTTL(1.5))
    elector.delay = 0.6
    repo = SlowRecorder()
    repo.delay = 0.6
    reconciled: list[str] = []

    async def reconcile(req: kr.Request) -> None:
        reconciled.append(req.entity_id)

    loop = leader_loop(reconcile, elector, repo=repo, renew=0.2)
    async with loop:
        await eventually(lambda: loop.stats().is_leader, timeout=10)
        await loop.enqueue(kr.Request("x"))
        await eventually(lambda: "x" in reconciled, timeout=5)
        assert elector.releases == 0, "it stepped down at once: its deadline had passed"


async def test_a_successor_on_the_same_elector_waits_for_the_threads_of_a_cancelled_stop() -> None:
    store = MemoryLeaseStore()
    elector = MemoryLeaseElector(store, kr.LeaseTTL(3))
    slow = Blocking()
    entered, let_go = slow.entered, slow.let_go
    first = leader_loop(slow, elector, stop_timeout=0.05)
    await first.start()
    try:
        await eventually(lambda: first.stats().is_leader)
        await first.enqueue(kr.Request("x"))
        await asyncio.to_thread(entered.wait, 5)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await first.stop()
        # Same elector, same id: it would find the lease "still ours" and enter "x" at once.
        with pytest.raises(kr.ConfigError, match="its reconciles still run"):
            await leader_loop(noop, elector).start()
    finally:
        let_go.set()
    await eventually(lambda: first.stats().in_flight == 0)
    async with leader_loop(noop, elector) as successor:  # the thread has ended: it may lead
        await eventually(lambda: successor.stats().is_leader)


class NoisyElector(MemoryLeaseElector):
    """Its release notifications arrive all the time (anyone may send them), none real."""

    attempts = 0

    async def acquire_lease(self, reconciler_id: str) -> kr.LeaseToken:
        NoisyElector.attempts += 1
        return await super().acquire_lease(reconciler_id)

    async def wait_for_release(self, reconciler_id: str) -> None:
        await asyncio.sleep(0)


async def test_spurious_release_wakeups_space_out_the_acquire_attempts() -> None:
    store = MemoryLeaseStore()
    holder = leader_loop(noop, MemoryLeaseElector(store, kr.LeaseTTL(15)), renew=1.0)
    follower = leader_loop(noop, NoisyElector(store, kr.LeaseTTL(15)), renew=1.0)
    async with holder:
        await eventually(lambda: holder.stats().is_leader)
        NoisyElector.attempts = 0
        async with follower:
            await asyncio.sleep(2.0)
    # Without spacing: one attempt per 10 ms (about 200); doubling gaps up to the 1 s retry.
    assert NoisyElector.attempts < 30, NoisyElector.attempts


async def test_a_start_refused_by_its_repository_leaves_no_claim_behind() -> None:
    from kopf_reconcile.fencing.postgres import PostgresFencedRepository

    elector = MemoryLeaseElector(MemoryLeaseStore(), kr.LeaseTTL(3))
    taken = PostgresFencedRepository("postgresql://nobody@127.0.0.1:1/x")  # never connects
    taken.bind_loop(reconciler_id="somebody-else", tenancy=kr.Tenancy.SINGLE_TENANT)
    refused = leader_loop(noop, elector, repo=taken)  # kept alive, as a caller would
    with pytest.raises(kr.ConfigError, match="already bound"):
        await refused.start()
    async with leader_loop(noop, elector, repo=MemoryFencedRepository()) as corrected:
        await eventually(lambda: corrected.stats().is_leader)
