"""A shard's hand-off and acquire gate, on one Loop over an in-memory lease store.

- ``Loop.hand_off`` stops dispatch at once, lets the reconcile in flight finish (not
  cancelled) while the lease is still held, and releases only after it ended.
- A reconcile that outlives the grace, async or in a thread, is never cancelled by a
  hand-off: the hand-off is abandoned, the lease kept and dispatch resumed (a thread
  cannot be stopped, and the next holder would reconcile beside it).
- ``may_acquire`` withholds every acquire attempt while it says no.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

import kopf_reconcile as kr
from kopf_reconcile.config import LoopConfig
from kopf_reconcile.loop import Loop
from kopf_reconcile.testing.memory import MemoryLeaseElector, MemoryLeaseStore
from support import eventually

RID = "shard-under-test"


def make_loop(reconcile: object, store: MemoryLeaseStore, **options: object) -> Loop:
    config = LoopConfig(
        reconciler=reconcile,
        tenancy=kr.Tenancy.SINGLE_TENANT,
        triggers=[kr.ChannelTrigger(asyncio.Queue())],
        leader=MemoryLeaseElector(store, ttl=kr.LeaseTTL(3)),
        reconciler_id=RID,
        renew_interval=0.05,
        concurrency=2,
    )
    config.validate()
    return Loop(config, **options)  # type: ignore[arg-type]


async def test_a_hand_off_lets_the_reconcile_in_flight_finish_then_releases() -> None:
    store = MemoryLeaseStore()
    inside, finish = asyncio.Event(), asyncio.Event()
    done: list[str] = []

    async def reconcile(req: kr.Request) -> None:
        if req.entity_id == "x":
            inside.set()
            await finish.wait()
        if req.entity_id:
            done.append(req.entity_id)

    loop = make_loop(reconcile, store)
    async with loop:
        await eventually(lambda: loop.stats().is_leader)
        await loop.enqueue(kr.Request("x"))
        await asyncio.wait_for(inside.wait(), 5)
        handing = asyncio.create_task(loop.hand_off(grace=10))
        await asyncio.sleep(0.3)
        await loop.enqueue(kr.Request("y"))
        await asyncio.sleep(0.3)
        assert store.holder(RID) is not None  # still held (and renewed): x still runs
        assert loop.stats().is_leader
        assert "y" not in done  # dispatch stopped at once
        finish.set()
        await asyncio.wait_for(handing, 5)
        await eventually(lambda: store.holder(RID) is None, message="released after x ended")
        assert done == ["x"]  # x finished, it was not cancelled; y waits for the next holder


@pytest.mark.parametrize("in_thread", [False, True], ids=["async", "sync"])
async def test_a_reconcile_past_the_grace_keeps_the_lease_and_is_not_cancelled(
    in_thread: bool,
) -> None:
    store = MemoryLeaseStore()
    inside, release = threading.Event(), threading.Event()
    released, cancelled, done = asyncio.Event(), asyncio.Event(), []

    def blocking(req: kr.Request) -> None:
        if req.entity_id == "stuck":
            inside.set()
            release.wait(10)
        done.append(req.entity_id)

    async def waiting(req: kr.Request) -> None:
        if req.entity_id == "stuck":
            inside.set()
            try:
                await released.wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise
        done.append(req.entity_id)

    loop = make_loop(blocking if in_thread else waiting, store)
    async with loop:
        await eventually(lambda: loop.stats().is_leader)
        holder = store.holder(RID)
        await loop.enqueue(kr.Request("stuck"))
        await eventually(inside.is_set, message="inside the reconcile")
        await loop.hand_off(grace=0.2)
        assert loop.stats().is_leader and store.holder(RID) == holder  # kept, not released
        assert not cancelled.is_set()
        await loop.enqueue(kr.Request("other"))  # dispatch resumed
        await eventually(lambda: "other" in done, message="dispatch resumes")
        release.set()
        released.set()
        await eventually(lambda: "stuck" in done, message="the long reconcile ends")
        await loop.hand_off(grace=5)  # nothing runs now: this one hands the lease off
        await eventually(lambda: store.holder(RID) != holder, message="released")


async def test_may_acquire_withholds_every_attempt_until_it_allows() -> None:
    store = MemoryLeaseStore()
    allowed = False
    loop = make_loop(lambda req: None, store, may_acquire=lambda: allowed)
    async with loop:
        await asyncio.sleep(0.4)
        assert store.holder(RID) is None and not loop.stats().is_leader
        allowed = True
        await eventually(lambda: loop.stats().is_leader, message="leads once allowed")
