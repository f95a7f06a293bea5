"""ObjectCache: the latest body per entity, bounded by the live objects, feeding a Loop."""

from __future__ import annotations

import asyncio

import pytest

import kopf_reconcile as kr
from kopf_reconcile.cache import ObjectCache, serving
from support import eventually


def body(name: str, desired: str = "on") -> dict[str, object]:
    return {"metadata": {"name": name, "namespace": "ns"}, "spec": {"desired": desired}}


class Recorder:
    """A Trigger consumer: collects the requests a cache emits."""

    def __init__(self) -> None:
        self.requests: list[str] = []

    async def emit(self, request: kr.Request) -> None:
        self.requests.append(request.entity_id)


async def test_events_before_the_loop_runs_wait_for_it() -> None:
    cache, recorder = ObjectCache(), Recorder()
    update = asyncio.create_task(cache.update("ns/a", body("a")))
    await asyncio.sleep(0.01)
    assert not update.done()  # no Loop yet: the watch waits, nothing is dropped
    assert "ns/a" in cache
    feeding = asyncio.create_task(cache.run(recorder.emit))
    await update
    assert recorder.requests == ["ns/a"]
    feeding.cancel()
    await asyncio.gather(feeding, return_exceptions=True)


async def test_update_then_remove_keeps_only_live_objects() -> None:
    cache, recorder = ObjectCache(), Recorder()
    feeding = asyncio.create_task(cache.run(recorder.emit))
    for i in range(1000):
        await cache.update(f"ns/d{i}", body(f"d{i}"))
    for i in range(1000):
        await cache.remove(f"ns/d{i}")
    assert len(cache) == 0
    assert cache.get("ns/d1") is None
    assert len(recorder.requests) == 2000  # every event, deletion included, is a request
    feeding.cancel()
    await asyncio.gather(feeding, return_exceptions=True)


async def test_get_returns_a_private_copy_of_the_latest_body() -> None:
    cache, recorder = ObjectCache(), Recorder()
    feeding = asyncio.create_task(cache.run(recorder.emit))
    await cache.update("ns/a", body("a", "on"))
    await cache.update("ns/a", body("a", "off"))
    copy = cache.get("ns/a")
    assert copy is not None
    assert copy["spec"] == {"desired": "off"}
    copy["spec"]["desired"] = "tampered"
    assert cache.get("ns/a") == body("a", "off")
    feeding.cancel()
    await asyncio.gather(feeding, return_exceptions=True)


async def test_resync_re_emits_every_cached_entity_from_the_trigger_task() -> None:
    cache, recorder = ObjectCache(), Recorder()
    feeding = asyncio.create_task(cache.run(recorder.emit))
    await cache.update("ns/a", body("a"))
    await cache.update("ns/b", body("b"))
    recorder.requests.clear()
    cache.request_resync()  # returns at once: the emits happen in the trigger's task
    assert recorder.requests == []
    await eventually(lambda: sorted(recorder.requests) == ["ns/a", "ns/b"], timeout=2)
    feeding.cancel()
    await asyncio.gather(feeding, return_exceptions=True)


async def test_one_cache_feeds_one_loop() -> None:
    cache, recorder = ObjectCache(), Recorder()
    feeding = asyncio.create_task(cache.run(recorder.emit))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="already feeds"):
        await cache.run(recorder.emit)
    feeding.cancel()
    await asyncio.gather(feeding, return_exceptions=True)


def test_cached_outside_a_reconcile_is_an_error_not_none() -> None:
    with pytest.raises(LookupError, match="only inside a reconcile"):
        kr.cached(kr.Request("ns/a"))


async def test_cached_inside_a_loop_sees_the_body_and_then_none() -> None:
    """Through a real Loop: the reconcile reads the body that triggered it, None after removal."""
    cache = ObjectCache()
    seen: list[object] = []

    async def reconcile(req: kr.Request) -> None:
        seen.append(kr.cached(req))

    async def in_serving(req: kr.Request) -> None:
        with serving(cache):
            await reconcile(req)

    loop = kr.Builder(in_serving, kr.Tenancy.TENANT_SCOPED).with_trigger(cache).build()
    async with loop:
        await cache.update("ns/a", body("a", "on"))
        await eventually(lambda: len(seen) == 1, timeout=2)
        await cache.remove("ns/a")
        await eventually(lambda: len(seen) == 2, timeout=2)
    assert seen == [body("a", "on"), None]


async def test_backpressure_reaches_the_watch() -> None:
    """A full Loop intake makes update() wait instead of dropping the event."""
    cache = ObjectCache()
    release = asyncio.Event()

    async def slow(req: kr.Request) -> None:
        await release.wait()

    loop = (
        kr.Builder(slow, kr.Tenancy.TENANT_SCOPED)
        .with_trigger(cache)
        .with_intake_capacity(2)
        .without_default_requeue()
        .build()
    )
    async with loop:
        for name in ("a", "b", "c"):  # "a" is taken by the worker; "b" and "c" fill the intake
            await cache.update(f"ns/{name}", body(name))
        await eventually(lambda: loop.stats().in_flight == 1 and loop.stats().queued == 2)
        blocked = asyncio.create_task(cache.update("ns/d", body("d")))
        await asyncio.sleep(0.05)
        assert not blocked.done()
        release.set()
        await asyncio.wait_for(blocked, 2)
