"""Events about entities: aggregated, rate-limited, posted in the background, leader only."""

from __future__ import annotations

import asyncio

import pytest

import kopf_reconcile as kr
from kopf_reconcile.events import EventRecord, EventRecorder
from support import eventually


class Sink:
    """Records every post; a post can be held (``gate``) or made to fail (``fail``)."""

    def __init__(self) -> None:
        self.posts: list[tuple[EventRecord, object | None]] = []
        self.gate: asyncio.Event | None = None
        self.fail = False

    async def post(self, record: EventRecord, previous: object | None) -> object | None:
        if self.gate is not None:
            await self.gate.wait()
        self.posts.append((record, previous))
        if self.fail:
            raise RuntimeError("the API server said no")
        return ("handle", record.entity_id, record.reason)

    def reasons(self, entity: str) -> list[tuple[str, str, int]]:
        return [(r.type, r.reason, r.count) for r, _ in self.posts if r.entity_id == entity]


def build(reconcile: object, sink: Sink, queue: asyncio.Queue[kr.Request]) -> kr.Loop:
    return (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)  # type: ignore[arg-type]
        .with_trigger(kr.ChannelTrigger(queue))
        .with_backoff(0.001, 0.002)
        .with_events(sink)
        .build()
    )


async def test_one_event_per_entity_and_reason_updated_with_a_count() -> None:
    sink = Sink()
    recorder = EventRecorder(sink)
    sink.gate = asyncio.Event()
    recorder.record("ns/a", "Warning", "ReconcileError", "boom 0")
    await asyncio.sleep(0)  # its post is in flight (held by the gate)
    for attempt in range(1, 5):
        recorder.record("ns/a", "Warning", "ReconcileError", f"boom {attempt}")
    recorder.record("ns/b", "Warning", "ReconcileError", "other")
    sink.gate.set()
    await eventually(lambda: recorder.pending == 0)
    posts_a = [(r, prev) for r, prev in sink.posts if r.entity_id == "ns/a"]
    # The first post went out with one occurrence; the four that came while it was in
    # flight went out together, as an update of the same event.
    assert [(r.count, prev) for r, prev in posts_a] == [
        (1, None),
        (5, ("handle", "ns/a", "ReconcileError")),
    ]
    assert posts_a[-1][0].message == "boom 4"
    assert posts_a[-1][0].first_seen <= posts_a[-1][0].last_seen
    assert sink.reasons("ns/b") == [("Warning", "ReconcileError", 1)]


async def test_posts_are_rate_limited_per_entity_and_the_rest_is_counted() -> None:
    sink = Sink()
    now = [0.0]
    recorder = EventRecorder(sink, burst=2, refill=60.0, clock=lambda: now[0])
    for attempt in range(10):
        recorder.record("ns/a", "Warning", "ReconcileError", f"boom {attempt}")
        await eventually(lambda: recorder.pending == 0 or len(sink.posts) >= 2)
    assert len(sink.posts) == 2  # the burst; the next post waits for a token
    assert recorder.pending == 1
    await recorder.close(timeout=0.05)  # cancelled while it waits
    assert len(sink.posts) == 2


async def test_a_sink_error_is_logged_and_dropped(caplog: pytest.LogCaptureFixture) -> None:
    sink = Sink()
    sink.fail = True
    recorder = EventRecorder(sink)
    recorder.record("ns/a", "Warning", "DeadLettered", "gone for good")
    await eventually(lambda: recorder.pending == 0)
    assert "not posted (dropped)" in caplog.text and "the API server said no" in caplog.text


async def test_the_loop_records_failures_dead_letters_and_recovery() -> None:
    sink = Sink()
    queue: asyncio.Queue[kr.Request] = asyncio.Queue()
    failures = {"ns/flaky": 3}

    async def reconcile(req: kr.Request) -> None:
        if req.entity_id == "ns/broken":
            raise kr.PermanentError("spec.desired is 'sideways'")
        if failures.get(req.entity_id, 0) > 0:
            failures[req.entity_id] -= 1
            raise RuntimeError("device unreachable")
        kr.event(req, "Normal", "Configured", "power is on")

    async with build(reconcile, sink, queue) as loop:
        await queue.put(kr.Request("ns/flaky"))
        await queue.put(kr.Request("ns/broken"))
        await queue.put(kr.Request("ns/fine"))
        await eventually(
            lambda: ("Normal", "Reconciled", 1) in sink.reasons("ns/flaky"),
            message="the recovery of ns/flaky",
        )
        await eventually(lambda: bool(sink.reasons("ns/broken")))
        assert loop.stats().dead_letters == 1
    flaky = sink.reasons("ns/flaky")
    errors = [count for kind, reason, count in flaky if reason == "ReconcileError"]
    assert errors and errors[-1] == 3 and all(kind == "Warning" for kind, *_ in flaky[:-2])
    assert ("Normal", "Configured", 1) in flaky
    assert sink.reasons("ns/broken") == [("Warning", "DeadLettered", 1)]
    broken = next(r for r, _ in sink.posts if r.entity_id == "ns/broken")
    assert broken.message == "spec.desired is 'sideways'"  # the error, not its repr
    # No recovery event for an entity that never failed.
    assert sink.reasons("ns/fine") == [("Normal", "Configured", 1)]


async def test_an_event_never_delays_a_reconcile() -> None:
    sink = Sink()
    sink.gate = asyncio.Event()  # every post hangs
    queue: asyncio.Queue[kr.Request] = asyncio.Queue()
    done: list[str] = []

    async def reconcile(req: kr.Request) -> None:
        kr.event(req, "Warning", "Slow", "posting hangs")
        done.append(req.entity_id)

    async with build(reconcile, sink, queue):
        for n in range(20):
            await queue.put(kr.Request(f"ns/{n}"))
        await eventually(lambda: len(done) == 20, timeout=5)
    assert not sink.posts  # all still hanging when the Loop stopped, then cancelled


async def test_event_outside_a_reconcile_records_nothing_and_checks_its_arguments() -> None:
    assert kr.event(kr.Request("ns/a"), "Normal", "Configured", "x") is False
    with pytest.raises(ValueError, match="Normal"):
        kr.event(kr.Request("ns/a"), "Info", "Configured", "x")
    with pytest.raises(ValueError, match="reason"):
        kr.event(kr.Request("ns/a"), "Normal", "not a word", "x")


async def test_a_follower_records_no_event() -> None:
    sink = Sink()
    recorded: list[bool] = []

    class NeverLeads:
        ttl = kr.LeaseTTL(15)

        async def acquire_lease(self, reconciler_id: str) -> kr.LeaseToken:
            raise kr.LeaseContended("held by another replica")

        async def renew_lease(self, token: kr.LeaseToken) -> None:
            raise kr.LeaseLost("never held")

        async def release_lease(self, token: kr.LeaseToken) -> None:
            return None

    from kopf_reconcile.events import LoopEvents

    events = LoopEvents(EventRecorder(sink), leading=lambda: False)
    recorded.append(events.record("ns/a", "Warning", "ReconcileError", "x"))
    events.failed("ns/a", RuntimeError("x"))
    loop = (
        kr.Builder(lambda req: None, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_leader(NeverLeads())
        .with_events(sink)
        .build()
    )
    async with loop:
        await asyncio.sleep(0.05)
        assert not loop.stats().is_leader
    assert recorded == [False] and not sink.posts


def test_with_events_refuses_what_is_not_a_sink() -> None:
    with pytest.raises(kr.ConfigError, match="EventSink"):
        (
            kr.Builder(lambda req: None, kr.Tenancy.SINGLE_TENANT)
            .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
            .with_events(object())  # type: ignore[arg-type]
            .build()
        )


async def test_a_sync_reconciler_records_from_its_thread() -> None:
    sink = Sink()
    queue: asyncio.Queue[kr.Request] = asyncio.Queue()

    def reconcile(req: kr.Request) -> None:  # runs in a worker thread
        kr.event(req, "Normal", "Configured", "from a thread")

    async with build(reconcile, sink, queue):
        await queue.put(kr.Request("ns/a"))
        await eventually(lambda: bool(sink.posts), message="the event of a sync reconciler")
    assert sink.reasons("ns/a") == [("Normal", "Configured", 1)]
