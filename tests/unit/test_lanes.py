"""Priority lanes on the event loop: a fresh change is not stuck behind a resync-all, and
the resync still completes."""

from __future__ import annotations

import asyncio
import random

import kopf_reconcile as kr
from kopf_reconcile.api import RESYNC_ALL
from kopf_reconcile.cache import ObjectCache, serving
from kopf_reconcile.dispatch_queue import DispatchQueue
from kopf_reconcile.triggers import Emitter, resync_emit
from support import eventually


def body(name: str, generation: int = 1) -> dict[str, object]:
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}", "generation": generation}
    }


async def test_a_fresh_put_does_not_wait_for_room_taken_by_resync_entities() -> None:
    queue = DispatchQueue(
        backoff_base=0.01, backoff_max=1, rng=random.Random(1), capacity=10, concurrency=1
    )
    queue.open()
    for i in range(10):
        await queue.put(f"r{i}", resync=True)
    blocked = asyncio.create_task(queue.put("r-late", resync=True))
    await asyncio.sleep(0.01)
    assert not blocked.done()  # the resync lane waits for room
    await asyncio.wait_for(queue.put("fresh"), 1)  # a fresh change does not
    assert queue.take()[0] == "fresh"
    assert queue.take()[0] == "r0"
    await asyncio.wait_for(blocked, 1)  # room again for the resync
    queue.close()


async def test_an_emitter_woken_for_room_then_cancelled_passes_the_room_on() -> None:
    queue = DispatchQueue(
        backoff_base=0.01, backoff_max=1, rng=random.Random(1), capacity=1, concurrency=1
    )
    queue.open()
    queue.add("a")  # the intake is full
    first = asyncio.create_task(queue.put("b"))
    second = asyncio.create_task(queue.put("c"))
    await asyncio.sleep(0)
    assert not first.done() and not second.done()
    queue.take()  # room for one: the first waiter is woken...
    first.cancel()  # ...and gives up before it runs (an enqueue under a timeout)
    await asyncio.wait_for(second, 1)  # the next one gets the room
    assert queue.work_queue.is_ready("c") and not queue.work_queue.is_ready("b")
    queue.close()


def test_an_emitter_offers_the_resync_lane_and_plain_emits_fall_back() -> None:
    async def fresh(req: kr.Request) -> None: ...

    async def resync(req: kr.Request) -> None: ...

    emitter = Emitter(fresh, resync)
    assert resync_emit(emitter) is resync
    assert resync_emit(fresh) is fresh


async def test_a_change_during_a_resync_all_goes_before_the_resync_items() -> None:
    n = 300
    cache = ObjectCache()
    order: list[str] = []
    gate = asyncio.Event()

    async def reconcile(req: kr.Request) -> None:
        if req.entity_id == RESYNC_ALL:
            cache.request_resync()
            return
        with serving(cache):
            order.append(req.entity_id)
        await gate.wait()
        await asyncio.sleep(0)

    loop = (
        kr.Builder(reconcile, kr.Tenancy.TENANT_SCOPED)
        .with_trigger(cache)
        .without_default_requeue()
        .with_intake_capacity(50)  # the resync fills the intake: backpressure on its fan-out
        .build()
    )
    gate.set()
    async with loop:
        for i in range(n):
            await cache.update(f"ns/o{i}", body(f"o{i}"))
        await eventually(lambda: len(order) == n)
        order.clear()
        gate.clear()
        await loop.enqueue(kr.Request(RESYNC_ALL))
        await eventually(lambda: len(order) == 1)  # the resync is under way, its intake full
        # A user's change and a creation: the watch is not held back by the resync's
        # backpressure (without lanes they wait for room behind it).
        await asyncio.wait_for(cache.update("ns/o250", body("o250", generation=2)), 5)
        await asyncio.wait_for(cache.update("ns/new", body("new")), 5)
        gate.set()
        await eventually(lambda: len(order) >= n + 1)
        assert order.index("ns/o250") <= 2 and order.index("ns/new") <= 3, order[:10]
        assert sorted(set(order)) == sorted({f"ns/o{i}" for i in range(n)} | {"ns/new"})
