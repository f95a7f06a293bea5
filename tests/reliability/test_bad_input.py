"""Bad input and misuse, in one process: what a misbehaving reconciler gets from the Loop.

Each test is a row of the "Bad input and misuse" table in docs/reliability.md. A
reconciler that returns the wrong type, raises anything, hangs, blocks the event
loop or leaks tasks fails only its own entity, with an error that names the entity
and the problem; every other entity keeps being served, ``stop()`` ends, and no
write of a lease that may be someone else's is accepted. The leases and fenced
writes here are the in-memory stores (``kopf_reconcile.testing.memory``), which
keep the real stores' semantics (expiry on the monotonic clock, a scope-wide
fence recorded before a leader dispatches).

Rows of the table that need a kopf operator, a Kubernetes API or PostgreSQL are
in ``test_bad_objects.py`` and ``test_bad_environment.py``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import kopf_reconcile as kr
from kopf_reconcile.integration.settings import Settings
from kopf_reconcile.loop import Loop
from kopf_reconcile.testing.memory import (
    MemoryFencedRepository,
    MemoryLeaseElector,
    MemoryLeaseStore,
)
from support import eventually

RID = "devices"
OTHERS = [f"other-{i}" for i in range(5)]


def single(reconcile: object, *, concurrency: int = 2) -> Loop:
    """A single-process Loop (always leader) with a fast backoff."""
    return (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)  # type: ignore[arg-type]
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_concurrency(concurrency)
        .with_backoff(0.001, 0.01)
        .without_default_requeue()
        .build()
    )


def led(
    reconcile: object,
    elector: MemoryLeaseElector,
    repo: MemoryFencedRepository,
    *,
    concurrency: int = 2,
) -> Loop:
    """A Loop that leads through ``elector`` and writes through ``repo``."""
    return (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)  # type: ignore[arg-type]
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_leader(elector)
        .with_fenced_repo(repo)
        .with_reconciler_id(RID)
        .with_renew_interval(0.05)
        .with_concurrency(concurrency)
        .with_backoff(0.001, 0.01)
        .with_stop_timeout(0.5)
        .without_default_requeue()
        .build()
    )


def errors(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)


# -- the wrong return type ---------------------------------------------------------------------


async def _a_coroutine() -> None:
    return None


@pytest.mark.parametrize(
    "returned",
    [
        42,
        "ok",
        True,
        {"requeue_after": 5},
        kr.Request("x"),
        pytest.param("coroutine", id="an-unawaited-coroutine"),
    ],
    ids=repr,
)
@pytest.mark.filterwarnings("ignore:coroutine '_a_coroutine' was never awaited")
async def test_a_wrong_return_type_dead_letters_that_entity_only(
    returned: object, caplog: pytest.LogCaptureFixture
) -> None:
    served: list[str] = []

    async def reconcile_thing(req: kr.Request) -> object:
        if req.entity_id == "bad":
            return _a_coroutine() if returned == "coroutine" else returned
        served.append(req.entity_id)
        return None

    async with single(reconcile_thing) as loop:
        await loop.enqueue(kr.Request("bad"))
        for entity in OTHERS:
            await loop.enqueue(kr.Request(entity))
        await eventually(lambda: loop.stats().dead_letters == 1 and len(served) == len(OTHERS))
    message = errors(caplog)
    assert "'bad' of reconcile_thing dead-lettered" in message, message
    assert "it must return kopf_reconcile.Result or None" in message


# -- every kind of exception ---------------------------------------------------------------------


class CustomError(Exception):
    pass


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("bad value"),
        KeyError("spec"),
        TypeError("'NoneType' object is not subscriptable"),
        OSError(5, "I/O error"),
        TimeoutError(),
        RecursionError("maximum recursion depth exceeded"),
        MemoryError(),
        CustomError("custom"),
        ExceptionGroup("two at once", [ValueError("a"), KeyError("b")]),
        BaseExceptionGroup("with a base exception", [GeneratorExit(), ValueError("c")]),
    ],
    ids=lambda exc: type(exc).__name__,
)
async def test_an_exception_fails_that_entity_with_backoff_and_keeps_serving(
    exc: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[str] = []

    async def reconcile_thing(req: kr.Request) -> None:
        calls.append(req.entity_id)
        if req.entity_id == "bad" and calls.count("bad") <= 2:
            raise exc

    async with single(reconcile_thing, concurrency=1) as loop:
        await loop.enqueue(kr.Request("bad"))
        for entity in OTHERS:
            await loop.enqueue(kr.Request(entity))
        # Retried (a transient failure) until it succeeds; the one worker serves the rest.
        await eventually(lambda: calls.count("bad") == 3, message="retried after failures")
        await eventually(lambda: all(e in calls for e in OTHERS), message="others served")
        await eventually(lambda: loop.stats().in_flight == 0)
    message = errors(caplog)
    assert "reconcile of 'bad' by reconcile_thing failed; retrying in" in message, message
    assert type(exc).__name__ in message


@pytest.mark.parametrize(
    "exc", [KeyboardInterrupt(), SystemExit(3)], ids=lambda e: type(e).__name__
)
def test_keyboard_interrupt_and_system_exit_are_recorded_then_end_the_event_loop(
    exc: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    # Documented (docs/safety.md, G1): recorded as a failure of the entity, then
    # re-raised so the process ends as Python intends. asyncio lets them out of the
    # event loop, so the loop runs on a thread of its own here.
    state: dict[str, Any] = {}

    async def reconcile_thing(req: kr.Request) -> None:
        raise exc

    async def main() -> None:
        loop = single(reconcile_thing, concurrency=1)
        state["loop"] = loop
        await loop.start()
        await loop.enqueue(kr.Request("bad"))
        await asyncio.sleep(10)  # ended by the exception long before

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as raised:  # what the process would end with
            state["raised"] = raised

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive()
    assert state.get("raised") is exc
    stats = state["loop"].stats()
    assert stats.in_flight == 0  # the entity's state is consistent: it is not "running"
    assert "reconcile of 'bad' by reconcile_thing failed" in errors(caplog)


# -- hanging forever -----------------------------------------------------------------------------


async def test_a_reconcile_that_hangs_forever_holds_one_worker_only_and_stop_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    served: list[str] = []
    hung = asyncio.Event()

    async def reconcile_thing(req: kr.Request) -> None:
        if req.entity_id == "hangs":
            hung.set()
            await asyncio.Event().wait()
        served.append(req.entity_id)

    loop = single(reconcile_thing, concurrency=2)
    await loop.start()
    await loop.enqueue(kr.Request("hangs"))
    await hung.wait()
    for entity in OTHERS:
        await loop.enqueue(kr.Request(entity))
    await eventually(lambda: len(served) == len(OTHERS), message="the other worker serves")
    await asyncio.wait_for(loop.stop(timeout=0.1), 10)
    assert "reconciles still running 0.1s after stop, cancelling: ['hangs']" in errors(caplog)


async def test_a_sync_reconcile_that_hangs_cannot_be_interrupted_yet_stop_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    served: list[str] = []
    release = threading.Event()
    hung = threading.Event()

    def reconcile_thing(req: kr.Request) -> None:
        if req.entity_id == "hangs":
            hung.set()
            release.wait(30)  # "forever", but the test frees its thread at the end
        served.append(req.entity_id)

    loop = single(reconcile_thing, concurrency=2)
    await loop.start()
    try:
        await loop.enqueue(kr.Request("hangs"))
        await asyncio.to_thread(hung.wait, 10)
        for entity in OTHERS:
            await loop.enqueue(kr.Request(entity))
        await eventually(lambda: len(served) == len(OTHERS), message="the other worker serves")
        await asyncio.wait_for(loop.stop(timeout=0.1), 10)
        assert "ignore cancellation (sync reconcilers cannot be interrupted): ['hangs']" in (
            errors(caplog)
        )
    finally:
        release.set()


# -- blocking the event loop -------------------------------------------------------------------


async def test_blocking_the_event_loop_past_the_lease_steps_down_and_its_write_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ttl = 1.2  # short, yet a renew deadline (0.8 s) no busy machine misses by itself
    leases = MemoryLeaseStore()
    repo = MemoryFencedRepository()
    outcomes: dict[str, object] = {}
    loops: dict[str, Loop] = {}
    blocked_once = threading.Event()

    def replica(name: str) -> Callable[[kr.Request], Awaitable[None]]:
        async def reconcile_thing(req: kr.Request) -> None:
            if req.entity_id == "":
                return
            writer = kr.fenced_writer()
            assert writer is not None
            if name == "a" and not blocked_once.is_set():
                blocked_once.set()
                time.sleep(ttl * 1.5)  # noqa: ASYNC251 - the misuse under test: nothing else runs
                try:
                    await writer.write(req.entity_id, {"by": name})
                except kr.StaleEpochError as exc:
                    outcomes["a"] = exc
                    raise
                outcomes["a"] = "accepted"
                return
            # The new leader only ever runs once the blocked one has stepped down.
            outcomes.setdefault("a leading when b wrote", loops["a"].stats().is_leader)
            await writer.write(req.entity_id, {"by": name})

        return reconcile_thing

    a_elector = MemoryLeaseElector(leases, ttl=kr.LeaseTTL(ttl), holder_id="a")
    b_elector = MemoryLeaseElector(leases, ttl=kr.LeaseTTL(ttl), holder_id="b")
    loops["a"] = led(replica("a"), a_elector, repo)
    loops["b"] = led(replica("b"), b_elector, repo)
    async with loops["a"]:
        await eventually(lambda: loops["a"].stats().is_leader)
        async with loops["b"]:
            await loops["a"].enqueue(kr.Request("x"))
            await loops["b"].enqueue(kr.Request("x"))
            await eventually(lambda: loops["b"].stats().is_leader, timeout=10)
            await eventually(lambda: repo.states.get("x") == {"by": "b"}, timeout=10)
            assert not loops["a"].stats().is_leader
    assert isinstance(outcomes["a"], kr.StaleEpochError), outcomes
    assert outcomes["a leading when b wrote"] is False
    # The store never accepted a write of the blocked leader's epoch once b had led.
    assert [(e, epoch) for e, epoch, _ in repo.applied] == [("x", 2)]
    assert repo.recorded_epoch == 2
    assert "was fenced" in caplog.text or "steps down" in caplog.text


# -- leaked tasks --------------------------------------------------------------------------------


async def test_a_task_leaked_by_a_reconcile_cannot_write_once_the_lease_is_gone() -> None:
    leases = MemoryLeaseStore()
    repo = MemoryFencedRepository()
    leaked: list[asyncio.Task[None]] = []
    go = asyncio.Event()
    outcome: list[object] = []

    async def late_write() -> None:
        await go.wait()
        writer = kr.fenced_writer()  # inherited from the reconcile that created this task
        assert writer is not None
        try:
            await writer.write("x", {"late": True})
        except kr.StaleEpochError as exc:
            outcome.append(exc)
        else:
            outcome.append("accepted")

    async def reconcile_thing(req: kr.Request) -> None:
        if req.entity_id == "x":
            leaked.append(asyncio.create_task(late_write()))  # never awaited: leaked

    elector = MemoryLeaseElector(leases, ttl=kr.LeaseTTL(2))
    loop = led(reconcile_thing, elector, repo)
    async with loop:
        await eventually(lambda: loop.stats().is_leader)
        await loop.enqueue(kr.Request("x"))
        await eventually(lambda: bool(leaked))
        await eventually(lambda: loop.stats().in_flight == 0)
    # stop() ended although the task still runs, and released the lease.
    assert not leaked[0].done()
    assert leases.holder(RID) is None
    go.set()
    await asyncio.wait_for(leaked[0], 5)
    assert isinstance(outcome[0], kr.StaleEpochError), outcome
    assert repo.applied == []


# -- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pod_name", ["pod with spaces", "pöd-ünïcode", "x" * 1000, "-", "\x1b[2Jpod"], ids=repr
)
def test_pod_name_is_free_text_and_every_holder_identity_is_still_unique(pod_name: str) -> None:
    # POD_NAME is only the base of the lease holder identity (free text in a Lease and
    # in a lease row); a random suffix makes each elector's identity unique anyway.
    # What a Lease holder wrote is escaped before it reaches a terminal
    # (test_lease_signals.py::test_leases_escapes_what_a_lease_holder_wrote).
    settings = Settings.load({"POD_NAME": pod_name})
    first, second = settings.new_holder_id(), settings.new_holder_id()
    assert first.startswith(f"{pod_name}-") and second.startswith(f"{pod_name}-")
    assert first != second
