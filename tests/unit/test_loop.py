"""The Loop in single-process mode: dispatch, coalescing, outcomes, lifecycle."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import AsyncIterator

import pytest

import kopf_reconcile as kr
from kopf_reconcile.loop import Loop
from support import eventually


def build(reconciler: object, *triggers: kr.Trigger, **options: object) -> Loop:
    builder = kr.Builder(reconciler, options.pop("tenancy", kr.Tenancy.SINGLE_TENANT))  # type: ignore[arg-type]
    for trigger in triggers or (kr.ChannelTrigger(asyncio.Queue()),):
        builder.with_trigger(trigger)
    for option, value in options.items():
        getattr(builder, f"with_{option}")(*value if isinstance(value, tuple) else (value,))
    return builder.build()


async def test_at_most_one_reconcile_per_entity_and_coalescing() -> None:
    running: Counter[str] = Counter()
    overlaps: list[str] = []
    runs: Counter[str] = Counter()
    gate = asyncio.Event()

    async def reconcile(req: kr.Request) -> None:
        running[req.entity_id] += 1
        if running[req.entity_id] > 1:
            overlaps.append(req.entity_id)
        runs[req.entity_id] += 1
        if runs[req.entity_id] == 1:
            await gate.wait()
        running[req.entity_id] -= 1

    loop = build(reconcile, concurrency=8)
    async with loop:
        await loop.enqueue(kr.Request("a"))
        await eventually(lambda: runs["a"] == 1)
        for _ in range(20):  # a storm of triggers while "a" is being reconciled
            await loop.enqueue(kr.Request("a"))
        await asyncio.sleep(0.05)  # eight idle workers had every chance to overlap
        assert runs["a"] == 1
        gate.set()
        await eventually(lambda: runs["a"] == 2 and loop.stats().in_flight == 0)
        await asyncio.sleep(0.05)
    assert overlaps == []
    assert runs["a"] == 2  # exactly one re-run, however many triggers arrived


async def test_transient_errors_back_off_then_succeed() -> None:
    attempts: list[float] = []

    async def reconcile(req: kr.Request) -> kr.Result:
        attempts.append(asyncio.get_running_loop().time())
        if len(attempts) < 4:
            raise RuntimeError("not yet")
        return kr.Result()

    loop = build(reconcile, backoff=(0.01, 1))
    async with loop:
        await loop.enqueue(kr.Request("a"))
        await eventually(lambda: len(attempts) == 4)
    assert loop.stats().dead_letters == 0


async def test_requeue_after_reobserves() -> None:
    runs: list[str] = []

    async def reconcile(req: kr.Request) -> kr.Result:
        runs.append(req.entity_id)
        return kr.Result(requeue_after=0.02)

    async with build(reconcile) as loop:
        await loop.enqueue(kr.Request("a"))
        await eventually(lambda: len(runs) >= 3)


async def test_default_requeue_is_jittered_around_the_interval() -> None:
    async def reconcile(req: kr.Request) -> None:
        return None

    loop = build(reconcile, concurrency=4, interval=100.0)
    async with loop:
        for i in range(200):
            await loop.enqueue(kr.Request(f"e{i}"))
        await eventually(lambda: loop._queue.work_queue.delayed_count == 200)
        now = asyncio.get_running_loop().time()
        offsets = [(loop._queue.work_queue.due_of(f"e{i}") or 0) - now for i in range(200)]
    assert all(89 <= o <= 110.1 for o in offsets), offsets
    assert max(offsets) - min(offsets) > 5  # spread, not a thundering herd


async def test_without_default_requeue_nothing_stays_behind() -> None:
    async def reconcile(req: kr.Request) -> None:
        return None

    builder = kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)
    loop = builder.with_trigger(kr.ChannelTrigger(asyncio.Queue())).without_default_requeue()
    async with loop.build() as running:
        await running.enqueue(kr.Request("a"))
        await eventually(lambda: running.stats().in_flight == 0 and running.stats().queued == 0)
        assert running._queue.work_queue.footprint() == dict.fromkeys(
            running._queue.work_queue.footprint(), 0
        )


async def test_permanent_error_dead_letters_until_a_fresh_trigger() -> None:
    runs: list[str] = []

    async def reconcile(req: kr.Request) -> None:
        runs.append(req.entity_id)
        raise kr.PermanentError("cannot ever work")

    loop = build(reconcile, backoff=(0.001, 0.01))
    async with loop:
        await loop.enqueue(kr.Request("a"))
        await eventually(lambda: loop.stats().dead_letters == 1)
        await asyncio.sleep(0.05)
        assert runs == ["a"]  # no retries
        await loop.enqueue(kr.Request("a"))
        await eventually(lambda: runs == ["a", "a"])


async def test_unexpected_return_value_is_logged_and_dead_lettered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def reconcile_thing(req: kr.Request) -> object:
        return 42

    loop = build(reconcile_thing)
    async with loop:
        await loop.enqueue(kr.Request("thing-1"))
        await eventually(lambda: loop.stats().dead_letters == 1)
    message = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
    assert "reconcile_thing" in message and "thing-1" in message and "42" in message


async def test_sync_reconciler_runs_in_a_worker_thread() -> None:
    threads: list[str] = []

    def reconcile(req: kr.Request) -> kr.Result:
        threads.append(threading.current_thread().name)
        return kr.Result()

    async with build(reconcile) as loop:
        await loop.enqueue(kr.Request("a"))
        await eventually(lambda: len(threads) == 1)
    assert threads[0] != threading.main_thread().name


async def test_reconciler_object_with_reconcile_method() -> None:
    class Devices:
        def __init__(self) -> None:
            self.seen: list[str] = []

        async def reconcile(self, req: kr.Request) -> kr.Result:
            self.seen.append(req.entity_id)
            return kr.Result()

    devices = Devices()
    assert isinstance(devices, kr.Reconciler)
    loop = build(devices)
    assert loop.name == "Devices"
    async with loop:
        await loop.enqueue(kr.Request("x"))
        await eventually(lambda: devices.seen == ["x"])


async def test_tenant_scoped_rejects_malformed_ids_without_reconciling(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[str] = []

    async def reconcile(req: kr.Request) -> None:
        seen.append(req.entity_id)

    loop = build(reconcile, tenancy=kr.Tenancy.TENANT_SCOPED)
    async with loop:
        for entity in ("no-tenant", "/x", "t/", "acme/dev-1", ""):
            await loop.enqueue(kr.Request(entity))
        await eventually(lambda: len(seen) == 2 and loop.stats().dead_letters == 3)
    assert sorted(seen) == ["", "acme/dev-1"]  # resync-all passes, well-formed passes
    assert "'no-tenant' is not '<tenant>/<id>'" in caplog.text


async def test_stop_drains_in_flight_reconciles() -> None:
    finished: list[str] = []
    started = asyncio.Event()

    async def reconcile(req: kr.Request) -> None:
        started.set()
        await asyncio.sleep(0.1)
        finished.append(req.entity_id)

    loop = build(reconcile)
    await loop.start()
    await loop.enqueue(kr.Request("a"))
    await started.wait()
    await loop.stop(timeout=5)
    assert finished == ["a"]


async def test_stop_cancels_a_hanging_reconcile_and_reports_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cancelled = asyncio.Event()
    started = asyncio.Event()

    async def reconcile(req: kr.Request) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    loop = build(reconcile)
    await loop.start()
    await loop.enqueue(kr.Request("stuck"))
    await started.wait()
    await loop.stop(timeout=0.05)
    assert cancelled.is_set()
    assert "still running" in caplog.text and "stuck" in caplog.text


async def test_a_swallowed_cancellation_still_ends_the_reconcile() -> None:
    started = asyncio.Event()
    registry = kr.register_metrics(__import__("prometheus_client").CollectorRegistry())
    assert registry.reconcile_total is not None

    async def reconcile(req: kr.Request) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return None  # misbehaving: swallows the cancellation

    loop = build(reconcile, metrics=registry, name="swallower")
    await loop.start()
    await loop.enqueue(kr.Request("a"))
    await started.wait()
    await loop.stop(timeout=0.05)
    value = registry.reconcile_total.labels("swallower", "", "canceled")._value.get()
    assert value == 1
    assert loop._queue.work_queue.failures_of("a") == 0


async def test_crashing_trigger_is_restarted(caplog: pytest.LogCaptureFixture) -> None:
    class Flaky:
        calls = 0

        async def run(self, emit: kr.triggers.Emit) -> None:
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise RuntimeError("source unavailable")
            await emit(kr.Request("from-flaky"))
            await asyncio.Event().wait()

    seen: list[str] = []

    async def reconcile(req: kr.Request) -> None:
        seen.append(req.entity_id)

    async with build(reconcile, Flaky()):
        await eventually(lambda: seen == ["from-flaky"])
    assert "crashed; restarting" in caplog.text


async def test_emit_of_a_non_request_is_a_clear_error(caplog: pytest.LogCaptureFixture) -> None:
    async def bad_source() -> AsyncIterator[object]:
        yield "not-a-request"

    async def reconcile(req: kr.Request) -> None:
        pass

    async with build(reconcile, kr.ChannelTrigger(bad_source())):  # type: ignore[arg-type]
        await eventually(lambda: "expected kopf_reconcile.Request" in caplog.text)


async def test_ticker_emits_resync_all() -> None:
    seen: list[str] = []

    async def reconcile(req: kr.Request) -> None:
        seen.append(req.entity_id)

    async with build(reconcile, kr.TickerTrigger(0.01)):
        await eventually(lambda: len(seen) >= 2)
    assert set(seen) == {""}


async def test_channel_trigger_from_async_iterable() -> None:
    async def source() -> AsyncIterator[kr.Request]:
        for i in range(3):
            yield kr.Request(f"e{i}")

    seen: list[str] = []

    async def reconcile(req: kr.Request) -> None:
        seen.append(req.entity_id)

    async with build(reconcile, kr.ChannelTrigger(source())):
        await eventually(lambda: sorted(seen) == ["e0", "e1", "e2"])


async def test_emit_applies_backpressure_and_never_drops() -> None:
    gate = asyncio.Event()
    seen: list[str] = []

    async def reconcile(req: kr.Request) -> None:
        await gate.wait()
        seen.append(req.entity_id)

    loop = build(reconcile, intake_capacity=2)
    async with loop:
        await loop.enqueue(kr.Request("e0"))  # taken by the single worker
        await eventually(lambda: loop.stats().in_flight == 1)
        await loop.enqueue(kr.Request("e1"))
        await loop.enqueue(kr.Request("e2"))  # intake now full
        blocked = asyncio.create_task(loop.enqueue(kr.Request("e3")))
        await asyncio.sleep(0.05)
        assert not blocked.done()
        await asyncio.wait_for(loop.enqueue(kr.Request("e1")), 1)  # a duplicate never blocks
        gate.set()
        await asyncio.wait_for(blocked, 5)
        await eventually(lambda: sorted(seen) == ["e0", "e1", "e2", "e3"])


async def test_start_returns_promptly_and_twice_is_an_error() -> None:
    async def reconcile(req: kr.Request) -> None:
        await asyncio.sleep(10)

    loop = build(reconcile)
    await asyncio.wait_for(loop.start(), 1)
    with pytest.raises(RuntimeError, match="already started"):
        await loop.start()
    await loop.stop(timeout=0)


async def test_stats_snapshot() -> None:
    gate = asyncio.Event()

    async def reconcile(req: kr.Request) -> None:
        await gate.wait()

    loop = build(reconcile)
    async with loop:
        await loop.enqueue(kr.Request("a"))
        await loop.enqueue(kr.Request("b"))
        await eventually(lambda: loop.stats().in_flight == 1)
        assert loop.stats() == kr.LoopStats(
            queued=1, in_flight=1, dead_letters=0, is_leader=True, epoch=0
        )
        gate.set()


async def test_hundred_thousand_entities_leave_no_state_after_failure_then_success() -> None:
    failed: set[str] = set()
    succeeded = 0
    n = 100_000

    async def reconcile(req: kr.Request) -> None:
        nonlocal succeeded
        if req.entity_id not in failed:
            failed.add(req.entity_id)
            raise RuntimeError("transient")
        succeeded += 1

    builder = kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)
    builder.with_trigger(kr.ChannelTrigger(asyncio.Queue())).with_concurrency(8)
    builder.with_backoff(0.001, 0.01).without_default_requeue()
    loop = builder.build()
    logging.getLogger("kopf_reconcile.loop").disabled = True  # 100k error lines are noise here
    try:
        async with loop:
            for i in range(n):
                await loop.enqueue(kr.Request(f"e{i}"))
            await eventually(lambda: succeeded == n, timeout=60)
            footprint = loop._queue.work_queue.footprint()
    finally:
        logging.getLogger("kopf_reconcile.loop").disabled = False
    assert footprint == dict.fromkeys(footprint, 0), footprint
    assert loop._running == {}
