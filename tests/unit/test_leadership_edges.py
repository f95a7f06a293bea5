"""Edges of the lease control plane: stalls, hung calls, cancellations that misbehave.

Each test pins down a way an old leader could act after its lease is gone, or a
way to break "one reconcile per entity at a time"; each failed before its fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

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
    elector: MemoryLeaseElector,
    concurrency: int = 1,
    repo: MemoryFencedRepository | None = None,
) -> Loop:
    builder = (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)  # type: ignore[arg-type]
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_reconciler_id(RID)
        .with_concurrency(concurrency)
        .with_leader(elector)
        .with_renew_interval(0.05)
    )
    if repo is not None:
        builder.with_fenced_repo(repo)
    return builder.build()


async def test_sync_reconciler_never_runs_twice_at_once_across_step_down() -> None:
    store = MemoryLeaseStore()
    elector = MemoryLeaseElector(store, kr.LeaseTTL(1))
    lock = threading.Lock()
    active = {"x": 0}
    max_active = {"x": 0}
    calls = []
    release = threading.Event()

    def reconcile(req: kr.Request) -> None:
        if req.entity_id != "x":
            return None
        with lock:
            active["x"] += 1
            max_active["x"] = max(max_active["x"], active["x"])
            calls.append(time.monotonic())
            first = len(calls) == 1
        try:
            if first:
                release.wait(5)  # a slow, uninterruptible sync reconcile
        finally:
            with lock:
                active["x"] -= 1
        return None

    loop = leader_loop(reconcile, elector)
    try:
        await loop.start()
        await eventually(lambda: loop.stats().is_leader)
        await loop.enqueue(kr.Request("x"))
        await eventually(lambda: active["x"] == 1)
        store.expire(RID)  # next renewal: LeaseLost -> step down -> cancel in-flight
        # step down, then re-acquire at once (lease expired -> epoch + 1) and dispatch again
        await eventually(lambda: loop.stats().is_leader and loop.stats().epoch == 2, timeout=3)
        await asyncio.sleep(0.5)
        assert max_active["x"] == 1, (
            f"entity x reconciled {max_active['x']} times at once (calls={len(calls)})"
        )
    finally:
        release.set()
        await loop.stop(timeout=2)


async def test_cancellation_reaches_the_worker_even_if_cleanup_raises() -> None:
    store = MemoryLeaseStore()
    elector = MemoryLeaseElector(store, kr.LeaseTTL(1))
    running: set[str] = set()
    max_running = 0
    gate = asyncio.Event()

    async def reconcile(req: kr.Request) -> None:
        nonlocal max_running
        if req.entity_id == "":
            return None
        running.add(req.entity_id)
        max_running = max(max_running, len(running))
        try:
            if req.entity_id == "victim":
                try:
                    await asyncio.sleep(3600)
                finally:
                    # e.g. closing a connection fails during cancellation
                    raise ConnectionResetError("cleanup failed")
            await gate.wait()
        finally:
            running.discard(req.entity_id)

    loop = leader_loop(reconcile, elector, concurrency=1)
    try:
        await loop.start()
        await eventually(lambda: loop.stats().is_leader)
        await loop.enqueue(kr.Request("victim"))
        await eventually(lambda: "victim" in running)
        store.expire(RID)  # -> LeaseLost -> step down -> cancel in-flight
        await eventually(lambda: loop.stats().epoch == 2 and loop.stats().is_leader, timeout=5)
        workers = len(loop._workers)
        await loop.enqueue(kr.Request("a"))
        await loop.enqueue(kr.Request("b"))
        await asyncio.sleep(0.3)
        assert workers == 1 and max_running <= 1, (
            f"concurrency 1, but {workers} worker tasks and {max_running} reconciles at once"
        )
    finally:
        gate.set()
        await loop.stop(timeout=2)


async def test_no_reconcile_starts_once_the_lease_deadline_has_passed() -> None:
    store = MemoryLeaseStore()
    elector = MemoryLeaseElector(store, kr.LeaseTTL(1))  # renew deadline 0.67 s
    started_with_dead_lease: list[str] = []
    loop = None

    async def reconcile(req: kr.Request) -> None:
        assert loop is not None
        if not loop._lease_is_live(loop.stats().epoch):
            started_with_dead_lease.append(req.entity_id)

    loop = leader_loop(reconcile, elector)
    async with loop:
        await eventually(lambda: loop.stats().is_leader)
        await asyncio.sleep(0.1)
        await loop.enqueue(kr.Request("x"))  # wakes a worker...
        time.sleep(1.2)  # noqa: ASYNC251 - the event loop stalls (a GC pause) past the TTL
        await eventually(
            lambda: (not loop.stats().is_leader) or bool(started_with_dead_lease), timeout=3
        )
        await asyncio.sleep(0.1)
    assert started_with_dead_lease == [], (
        f"reconciles dispatched after the lease deadline: {started_with_dead_lease}; "
        f"lease holder by then: {store.holder(RID)}"
    )


class FirstAcquireHangs(MemoryLeaseElector):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.acquires = 0

    async def acquire_lease(self, reconciler_id: str) -> kr.LeaseToken:
        self.acquires += 1
        if self.acquires == 1:
            await asyncio.Event().wait()  # the request never answers
        return await super().acquire_lease(reconciler_id)


async def test_a_hanging_acquire_is_abandoned_and_retried() -> None:
    store = MemoryLeaseStore()
    elector = FirstAcquireHangs(store, kr.LeaseTTL(1))  # renew deadline 0.67 s

    async def reconcile(req: kr.Request) -> None:
        return None

    loop = leader_loop(reconcile, elector)
    async with loop:
        await eventually(lambda: loop.stats().is_leader, timeout=5)
    assert elector.acquires >= 2  # the hung attempt was abandoned, a later one succeeded


class SlowReleaseAnswer(MemoryLeaseElector):
    """The server applies the release at once; its answer takes a while to come back."""

    async def release_lease(self, token: kr.LeaseToken) -> None:
        await super().release_lease(token)
        await asyncio.sleep(0.5)


async def test_no_local_write_passes_once_stop_has_released_the_lease() -> None:
    store = MemoryLeaseStore()
    repo = MemoryFencedRepository()
    ea = SlowReleaseAnswer(store, kr.LeaseTTL(2))
    eb = MemoryLeaseElector(store, kr.LeaseTTL(2))
    outcome: list[str] = []

    async def stubborn(req: kr.Request) -> None:
        if req.entity_id != "x":
            return None
        writer = kr.fenced_writer()
        assert writer is not None
        with contextlib.suppress(asyncio.CancelledError):  # does not honour cancellation
            await asyncio.sleep(3600)
        while store.holder(RID) == ea.holder_id:  # noqa: ASYNC110 - writes once it was handed back
            await asyncio.sleep(0.01)
        try:
            await writer.write("x", {"by": "old leader"})
            outcome.append("accepted")
        except kr.StaleEpochError:
            outcome.append("rejected")

    async def quiet(req: kr.Request) -> None:
        return None

    a = leader_loop(stubborn, ea, repo=repo)
    await a.start()
    await eventually(lambda: a.stats().is_leader)
    await a.enqueue(kr.Request("x"))
    await eventually(lambda: a.stats().in_flight == 1)
    b = leader_loop(quiet, eb, repo=repo)
    async with b:
        await a.stop(timeout=0.05)
        await eventually(lambda: outcome != [])
        assert outcome == ["rejected"], (
            f"a write at epoch {a.stats().epoch} passed the local lease check after stop() "
            f"released the lease (repo: {repo.applied})"
        )


class RecordingAttempts(MemoryLeaseElector):
    def __init__(self, store: MemoryLeaseStore, ttl: kr.LeaseTTL) -> None:
        super().__init__(store, ttl)
        self.attempts: list[float] = []

    async def acquire_lease(self, reconciler_id: str) -> kr.LeaseToken:
        self.attempts.append(time.monotonic())
        return await super().acquire_lease(reconciler_id)


async def test_a_contended_acquire_is_retried_as_the_holders_lease_runs_out() -> None:
    store = MemoryLeaseStore()
    holder = MemoryLeaseElector(store, kr.LeaseTTL(0.3))
    await holder.acquire_lease(RID)  # held elsewhere, never renewed: expires in 0.3 s
    expires = store.leases[RID].expires
    elector = RecordingAttempts(store, kr.LeaseTTL(60))

    async def reconcile(req: kr.Request) -> None:
        return None

    loop = (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_reconciler_id(RID)
        .with_leader(elector)
        .with_renew_interval(20)  # a whole retry period would be 20-24 s
        .build()
    )
    async with loop:
        await eventually(lambda: loop.stats().is_leader, timeout=5)
    assert len(elector.attempts) == 2
    assert elector.attempts[0] < expires <= elector.attempts[1]  # no spinning before it


async def test_reconciles_outliving_a_step_down_count_against_the_concurrency() -> None:
    store = MemoryLeaseStore()
    elector = MemoryLeaseElector(store, kr.LeaseTTL(1))
    release = threading.Event()
    lock = threading.Lock()
    running = 0
    most = 0

    def reconcile(req: kr.Request) -> None:
        nonlocal running, most
        if req.entity_id == "":
            return
        with lock:
            running += 1
            most = max(most, running)
        try:
            if req.entity_id == "stuck":
                release.wait(5)  # uninterruptible
            else:
                time.sleep(0.05)
        finally:
            with lock:
                running -= 1

    loop = leader_loop(reconcile, elector, concurrency=2)
    try:
        await loop.start()
        await eventually(lambda: loop.stats().is_leader)
        await loop.enqueue(kr.Request("stuck"))
        await eventually(lambda: running == 1)
        store.expire(RID)  # step down; "stuck" keeps its thread and its slot
        await eventually(lambda: loop.stats().is_leader and loop.stats().epoch == 2, timeout=5)
        for i in range(6):
            await loop.enqueue(kr.Request(f"e{i}"))
        await eventually(lambda: loop.stats().queued == 0 and running == 1, timeout=5)
        assert most == 2  # one new worker beside the straggler, never two
        release.set()
        await eventually(lambda: running == 0)
        await eventually(lambda: len(loop._workers) == 2)  # its slot came back
    finally:
        release.set()
        await loop.stop(timeout=2)
