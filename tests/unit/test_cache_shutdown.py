"""Events that reach the cache while or after its Loop stops never make the watch wait forever.

Those before the Loop starts still wait for it and are delivered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import kopf
import pytest

import kopf_reconcile as kr
from kopf_reconcile.cache import ObjectCache
from kopf_reconcile.integration import kopf_shim
from kopf_reconcile.integration import settings as process_settings
from kopf_reconcile.integration.settings import Settings
from kopf_reconcile.triggers import Emit
from support import eventually

# How long an event may take before it counts as hung: a deadline, not a speed target.
HANG = 5.0


def body(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"}, "spec": {}}


class WatchedCache(ObjectCache):
    """An ObjectCache that tells when the Loop has stopped running it."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.trigger_ended = asyncio.Event()

    async def run(self, emit: Emit) -> None:
        try:
            await super().run(emit)
        finally:
            self.trigger_ended.set()


class Blocking:
    """A reconcile that holds ``ns/a`` until released, so that stopping must drain it."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.seen: list[str] = []

    async def __call__(self, req: kr.Request) -> None:
        self.seen.append(req.entity_id)
        if req.entity_id == "ns/a":
            self.started.set()
            await self.release.wait()


async def finishes(task: asyncio.Task[None]) -> bool:
    """Whether ``task`` completes before the hang deadline (it is cancelled if not)."""
    done, _ = await asyncio.wait({task}, timeout=HANG)
    if task not in done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return task in done


async def test_an_event_while_the_loop_stops_is_dropped_not_left_waiting() -> None:
    cache, reconcile = WatchedCache(), Blocking()
    loop = kr.Builder(reconcile, kr.Tenancy.TENANT_SCOPED).with_trigger(cache).build()
    await loop.start()
    stopping: asyncio.Task[None] | None = None
    try:
        await cache.update("ns/a", body("a"))
        await asyncio.wait_for(reconcile.started.wait(), HANG)
        stopping = asyncio.create_task(loop.stop())
        await asyncio.wait_for(cache.trigger_ended.wait(), HANG)
        assert not stopping.done()  # still draining the reconcile of ns/a
        late = asyncio.create_task(cache.update("ns/b", body("b")))
        assert await finishes(late), "an event during Loop.stop() waits forever for a Loop"
        assert cache.get("ns/b") == body("b")  # stored all the same
    finally:
        reconcile.release.set()
        await (stopping if stopping is not None else loop.stop())
    assert "ns/b" not in reconcile.seen


async def test_an_event_after_the_loop_stopped_is_dropped_not_left_waiting() -> None:
    cache, reconcile = WatchedCache(), Blocking()
    reconcile.release.set()
    async with kr.Builder(reconcile, kr.Tenancy.TENANT_SCOPED).with_trigger(cache).build():
        await cache.update("ns/a", body("a"))
        await asyncio.wait_for(reconcile.started.wait(), HANG)
    late = asyncio.create_task(cache.update("ns/b", body("b")))
    assert await finishes(late), "an event after Loop.stop() waits forever for a Loop"
    deleted = asyncio.create_task(cache.remove("ns/a", body("a")))
    assert await finishes(deleted), "a DELETED after Loop.stop() waits forever for a Loop"
    assert cache.get("ns/b") == body("b") and cache.get("ns/a") is None


async def test_events_before_the_loop_starts_still_wait_and_are_delivered() -> None:
    cache, reconcile = WatchedCache(), Blocking()
    reconcile.release.set()
    early = asyncio.create_task(cache.update("ns/early", body("early")))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not early.done()  # no Loop yet: the watch waits, nothing is dropped
    async with kr.Builder(reconcile, kr.Tenancy.TENANT_SCOPED).with_trigger(cache).build():
        await asyncio.wait_for(early, HANG)
        await eventually(lambda: "ns/early" in reconcile.seen, timeout=HANG)


async def test_a_cache_closed_by_its_owner_drops_events_until_a_loop_runs_it_again() -> None:
    cache, reconcile = WatchedCache(), Blocking()
    reconcile.release.set()
    cache.close()  # e.g. its Loop's trigger was restarting after a crash when it stopped
    assert await finishes(asyncio.create_task(cache.update("ns/x", body("x"))))
    assert cache.get("ns/x") == body("x")  # bodies are kept for reconciles still draining
    async with kr.Builder(reconcile, kr.Tenancy.TENANT_SCOPED).with_trigger(cache).build():
        await asyncio.wait_for(cache.update("ns/a", body("a")), HANG)
        await asyncio.wait_for(reconcile.started.wait(), HANG)
    assert "ns/x" not in reconcile.seen


# -- through the kopf shim: an event reaches on_event while the cleanup handler stops the Loop


@pytest.fixture
def shim_settings() -> Iterator[None]:
    """The shim reads process settings at startup; none from the environment here."""
    process_settings.install(Settings.load({}))
    yield
    process_settings.install(None)


async def test_kopf_shim_event_during_cleanup_does_not_hang(
    shim_settings: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kopf_shim, "ObjectCache", WatchedCache)
    registry = kopf.OperatorRegistry()
    reconcile = Blocking()

    @kr.reconciler(
        "",
        "v1",
        "configmaps",
        tenancy=kr.Tenancy.TENANT_SCOPED,
        leader=None,
        fenced=None,
        metrics=None,
        reconciler_id="shutdown-test",
        registry=registry,
    )
    async def devices(req: kr.Request) -> None:
        await reconcile(req)

    registration = next(r for r in kopf_shim._registrations if r.registry is registry)
    await registration.startup(settings=kopf.OperatorSettings())
    cache = registration.cache
    assert isinstance(cache, WatchedCache)
    cleanup: asyncio.Task[None] | None = None
    try:
        await registration.on_event(event={"type": "ADDED", "object": body("a")})
        await asyncio.wait_for(reconcile.started.wait(), HANG)
        cleanup = asyncio.create_task(registration.cleanup())
        await asyncio.wait_for(cache.trigger_ended.wait(), HANG)
        assert not cleanup.done()  # the Loop drains the reconcile of ns/a
        assert registration.cache is cache  # not cleared yet: the event reaches the cache
        late = asyncio.create_task(
            registration.on_event(event={"type": "MODIFIED", "object": body("b")})
        )
        assert await finishes(late), "kopf's event handler waits forever during cleanup"
    finally:
        reconcile.release.set()
        await (cleanup if cleanup is not None else registration.cleanup())
    assert registration.status() == {"running": False}
