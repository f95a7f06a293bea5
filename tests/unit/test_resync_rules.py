"""What a resync may not override: a dead letter and a backoff wait for a change.

A resync (periodic, or a new leader's resync-all) re-observes entities nothing is
known to have changed. A dead-lettered entity stays dead and one waiting out a
backoff keeps waiting for its retry; a fresh trigger (a change) or a redrive revives
or runs them at once. A new leader makes the durable dead letters it loads, before
it dispatches, its queue's dead set, so its own resync-all does not retry them either;
only an entity a fresh trigger queued is spared (a timer or an interrupted run is no
change).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import random
import threading

import pytest

import kopf_reconcile as kr
from kopf_reconcile import dead_letters
from kopf_reconcile.dead_letters import DurableDeadLetters
from kopf_reconcile.dispatch_queue import DispatchQueue
from kopf_reconcile.fencing.protocol import DeadLetter
from kopf_reconcile.testing.memory import (
    MemoryFencedRepository,
    MemoryLeaseElector,
    MemoryLeaseStore,
)
from kopf_reconcile.triggers import Emit, resync_emit
from kopf_reconcile.workqueue import WorkQueue
from support import eventually


class MaxJitter(random.Random):
    """Full jitter that always draws the upper bound, so delays are exact."""

    def uniform(self, a: float, b: float) -> float:
        return b


def make() -> WorkQueue:
    return WorkQueue(backoff_base=1.0, backoff_max=100.0, rng=MaxJitter())


def dead_lettered(q: WorkQueue, entity: str) -> None:
    q.add(entity, 0)
    q.get()
    q.done_permanent(entity, 0)


# -- the work queue -------------------------------------------------------------------


def test_a_resync_leaves_a_dead_letter_dead_and_a_fresh_trigger_revives_it() -> None:
    q = make()
    dead_lettered(q, "a")
    assert q.add("a", 1, resync=True) is False
    assert q.is_dead("a") and not q.is_ready("a")
    assert q.add("a", 2) is True  # a change (or a redrive)
    assert not q.is_dead("a") and q.get()[0] == "a"


def test_a_timer_does_not_revive_a_dead_letter() -> None:
    q = make()
    dead_lettered(q, "a")
    assert q.add_after("a", 1, 0) is None
    assert q.pop_due(10) == 0 and q.is_dead("a")


def test_a_resync_does_not_cut_a_backoff_short() -> None:
    q = make()
    q.add("a", 0)
    q.get()
    assert q.done_error("a", 0) == 1.0
    assert q.add("a", 0.5, resync=True) is False
    assert not q.is_ready("a") and q.due_of("a") == 1.0 and q.failures_of("a") == 1
    q.pop_due(1.0)  # the retry re-observes it
    assert q.get()[0] == "a"


def test_a_resync_still_supersedes_a_plain_requeue_timer() -> None:
    q = make()
    q.add("a", 0)
    q.get()
    q.done_success("a", 0, 3600)  # the default requeue: a resync is what it waits for
    assert q.add("a", 1, resync=True) is True
    assert q.is_resync("a") and q.due_of("a") is None


def test_a_resync_during_a_failing_run_keeps_the_backoff_and_the_dead_letter() -> None:
    q = make()
    for entity in ("err", "perm"):
        q.add(entity, 0)
        q.get()
        q.add(entity, 0.1, resync=True)
    q.done_error("err", 0.2)
    q.done_permanent("perm", 0.2)
    assert q.ready_count == 0
    assert q.due_of("err") == 1.2 and q.is_dead("perm")


def test_a_fresh_trigger_during_a_failing_run_reruns_it_at_once() -> None:
    q = make()
    for entity in ("err", "perm"):
        q.add(entity, 0)
        q.get()
        q.add(entity, 0.1, resync=True)
        q.add(entity, 0.1)  # a change arrived too
    q.done_error("err", 0.2)
    q.done_permanent("perm", 0.2)
    assert q.is_ready("err") and q.is_ready("perm") and not q.is_dead("perm")


def test_bury_takes_an_entity_out_of_the_resync_lane_and_its_timers() -> None:
    q = make()
    q.add("running", 0)
    assert q.get()[0] == "running"
    q.add("fresh", 0)
    q.add("resync", 0, resync=True)
    q.add_after("timer", 5, 0)
    assert q.bury("resync") and q.bury("timer") and q.bury("idle")
    assert not q.bury("fresh") and not q.bury("running")  # may carry a change: they run
    assert q.is_dead("resync") and q.is_dead("timer") and q.is_dead("idle")
    assert not q.is_ready("resync") and q.due_of("timer") is None
    assert q.resync_count == 0 and q.footprint()["resync_lane"] == 0
    assert q.is_ready("fresh") and not q.is_dead("fresh")


def test_bury_does_not_spare_a_timer_or_an_interrupted_run() -> None:
    def timer(q: WorkQueue) -> None:  # a requeue timer came due (a follower's, set as leader)
        q.done_success("e", 0, 5.0)
        q.pop_due(5.0)

    def interrupted(q: WorkQueue) -> None:  # cancelled at a step-down: ready again
        q.done_requeue("e", 1)

    def backoff(q: WorkQueue) -> None:  # its retry came due
        q.pop_due(q.done_error("e", 0))

    def rerun(q: WorkQueue) -> None:  # a resync during the run asked for a re-run
        q.add("e", 0.5, resync=True)
        q.done_success("e", 1, None)

    for became_ready in (timer, interrupted, backoff, rerun):
        q = make()
        q.add("e", 0)
        q.get()
        became_ready(q)
        assert q.is_ready("e") and not q.is_resync("e"), became_ready.__name__
        assert q.bury("e"), became_ready.__name__
        assert q.is_dead("e") and q.ready_count == 0 and q.footprint()["unchanged"] == 0


def test_bury_spares_what_a_fresh_trigger_queued_whatever_else_did() -> None:
    q = make()
    q.add("a", 0)
    q.get()
    q.done_success("a", 0, 5.0)
    q.pop_due(5.0)  # ready by a timer ...
    q.add("a", 5)  # ... and then changed
    assert not q.bury("a") and q.is_ready("a")
    q = make()
    q.add("b", 0)
    q.get()
    q.add("b", 0.5)  # changed during its run ...
    q.done_requeue("b", 1)  # ... which was interrupted
    assert not q.bury("b") and q.is_ready("b") and q.dead_count == 0


def test_an_entity_buried_while_it_runs_is_dead_if_the_run_is_interrupted() -> None:
    q = make()
    for entity in ("cancelled", "changed", "succeeded"):
        q.add(entity, 0)
        q.get()
        assert not q.bury(entity)  # a run of a previous term, still ending
    q.add("changed", 1)  # a change meanwhile: it runs again
    q.done_requeue("cancelled", 2)
    q.done_requeue("changed", 2)
    q.done_success("succeeded", 2, None)  # settled by its own outcome
    assert q.is_dead("cancelled") and not q.is_ready("cancelled")
    assert q.is_ready("changed") and not q.is_dead("changed")
    assert not q.is_dead("succeeded")
    assert q.footprint()["buried_running"] == 0


def test_replace_dead_revives_what_the_store_no_longer_has() -> None:
    q = make()
    dead_lettered(q, "healed")  # a peer redrove it since, and it succeeded: not in the store
    dead_lettered(q, "still")
    q.add("x", 1, resync=True)
    q.add("y", 1)
    q.get()  # y
    q.done_requeue("y", 2)
    assert q.replace_dead(["still", "x", "y", "new"]) == 2  # x and y left the lanes
    assert not q.is_dead("healed") and not q.is_ready("healed")
    assert q.add("healed", 3, resync=True)  # the resync-all re-observes it
    assert all(q.is_dead(e) for e in ("still", "x", "y", "new"))
    assert q.dead_count == 4 and q.resync_count == 1 and q.ready_count == 1


async def test_bury_wakes_the_emitters_it_makes_room_for() -> None:
    queue = DispatchQueue(
        backoff_base=1, backoff_max=10, rng=random.Random(0), capacity=2, concurrency=1
    )
    queue.open()
    queue.add("d1", resync=True)
    queue.add("d2", resync=True)  # the intake is full
    waiting = asyncio.create_task(queue.put("healthy", resync=True))
    await asyncio.sleep(0)
    assert not waiting.done()
    queue.replace_dead(["d1"])
    await asyncio.wait_for(waiting, 1)
    assert queue.work_queue.is_ready("healthy")
    waiting = asyncio.create_task(queue.put("other", resync=True))
    await asyncio.sleep(0)
    assert not waiting.done()
    queue.replace_dead(["d1", "d2"])
    await asyncio.wait_for(waiting, 1)
    queue.close()


# -- the Loop -------------------------------------------------------------------------


class Resyncs:
    """A trigger that emits re-observations (the resync lane) when asked."""

    def __init__(self) -> None:
        self.requests: asyncio.Queue[str] = asyncio.Queue()

    async def run(self, emit: Emit) -> None:
        resync = resync_emit(emit)
        while True:
            await resync(kr.Request(await self.requests.get()))


async def test_a_periodic_resync_does_not_retry_a_dead_letter() -> None:
    runs: list[str] = []

    async def reconcile(req: kr.Request) -> None:
        runs.append(req.entity_id)
        if req.entity_id == "poison":
            raise kr.PermanentError("cannot ever work")

    resyncs = Resyncs()
    builder = kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT).with_trigger(resyncs)
    async with builder.build() as loop:
        await loop.enqueue(kr.Request("poison"))
        await eventually(lambda: loop.stats().dead_letters == 1)
        for _ in range(3):  # resync periods go by
            resyncs.requests.put_nowait("poison")
            resyncs.requests.put_nowait("healthy")
        # One worker, one FIFO lane: a revived poison would have run before healthy.
        await eventually(lambda: runs.count("healthy") >= 1)
        assert runs.count("poison") == 1 and loop.stats().dead_letters == 1
        await loop.enqueue(kr.Request("poison"))  # a change: retried
        await eventually(lambda: runs.count("poison") == 2)


def letter(entity_id: str) -> DeadLetter:
    now = datetime.datetime.now(datetime.UTC)
    return DeadLetter("rid", entity_id, "broken", now, now, 1, 1)


async def test_a_new_leader_keeps_the_loaded_dead_letters_dead() -> None:
    queue = DispatchQueue(
        backoff_base=1, backoff_max=10, rng=random.Random(0), capacity=100, concurrency=1
    )
    # What a follower kept: a resync entry and a fresh trigger (a change it saw).
    queue.add("old/resynced", resync=True)
    queue.add("old/changed")
    store = SlowDeadLetterRepo("old/resynced", "old/changed", "old/idle")
    durable = DurableDeadLetters(
        store,
        name="t",
        epoch=lambda: 2,
        redrive=queue.add,
        replace_dead=queue.replace_dead,
        interval=60,
    )
    opened = asyncio.Event()
    durable.lead(opened.set)
    await opened.wait()
    assert store.loads == 1  # loaded before dispatch
    work = queue.work_queue
    assert work.is_dead("old/resynced") and work.is_dead("old/idle")
    assert not work.is_ready("old/resynced")
    queue.add("old/idle", resync=True)  # the new leader's resync-all
    assert not work.is_ready("old/idle")
    assert work.is_ready("old/changed") and not work.is_dead("old/changed")
    durable.lose()
    queue.add("old/idle")  # a redrive (or a change) revives it
    assert work.is_ready("old/idle") and not work.is_dead("old/idle")
    queue.close()


async def test_a_new_leader_forgets_local_dead_letters_the_store_no_longer_has() -> None:
    queue = DispatchQueue(
        backoff_base=1, backoff_max=10, rng=random.Random(0), capacity=100, concurrency=1
    )
    queue.open()
    queue.add("x")
    queue.take()
    queue.done_permanent("x")  # this Loop led and dead-lettered x, then lost the lease
    queue.close_dispatch()
    store = SlowDeadLetterRepo("y")  # a peer redrove x, which succeeded: cleared
    durable = DurableDeadLetters(
        store,
        name="t",
        epoch=lambda: 3,
        redrive=queue.add,
        replace_dead=queue.replace_dead,
        interval=60,
    )
    durable.known.add("x")  # what the previous term knew
    opened = asyncio.Event()
    durable.lead(opened.set)  # it leads again
    await opened.wait()
    work = queue.work_queue
    assert not work.is_dead("x") and work.is_dead("y") and durable.known == {"y"}
    queue.add("x", resync=True)  # its resync-all re-observes x
    assert work.is_ready("x") and queue.dead_count == 1
    durable.lose()
    queue.close()


class SlowDeadLetterRepo(MemoryFencedRepository):
    """A fenced repository with durable dead letters whose listing takes ``latency``
    seconds (a database round trip), or fails with ``error``."""

    def __init__(self, *entity_ids: str, latency: float = 0.0) -> None:
        super().__init__()
        self.letters = {e: letter(e) for e in entity_ids}
        self.latency = latency
        self.error: Exception | None = None
        self.loads = 0

    async def record_dead_letter(self, entity_id: str, epoch: int, reason: str) -> bool:
        self.letters[entity_id] = letter(entity_id)
        return True

    async def clear_dead_letter(self, entity_id: str, epoch: int) -> bool:
        self.letters.pop(entity_id, None)
        return True

    async def dead_letters(self) -> list[DeadLetter]:
        self.loads += 1
        await asyncio.sleep(self.latency)
        if self.error is not None:
            raise self.error
        return list(self.letters.values())

    async def take_redrives(self, epoch: int) -> list[str]:
        return []


def fan_out_loop(repo: SlowDeadLetterRepo, runs: list[str]) -> kr.Loop:
    """A leading Loop whose resync-all re-observes ``poison`` and ``healthy``."""
    resyncs = Resyncs()

    async def reconcile(req: kr.Request) -> None:
        if req.entity_id == "":  # the resync-all
            for entity in ("poison", "healthy"):
                resyncs.requests.put_nowait(entity)
            return
        runs.append(req.entity_id)
        if req.entity_id == "poison":
            raise kr.PermanentError("still broken")

    return (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(resyncs)
        .with_leader(MemoryLeaseElector(MemoryLeaseStore(), kr.LeaseTTL(1)))
        .with_fenced_repo(repo)
        .with_reconciler_id("rid")
        .with_renew_interval(0.1)
        .with_redrive_interval(0.05)
        .build()
    )


async def test_a_new_leader_loads_its_dead_letters_before_it_dispatches() -> None:
    runs: list[str] = []
    repo = SlowDeadLetterRepo("poison", latency=0.05)  # the store answers in 50 ms
    async with fan_out_loop(repo, runs) as loop:
        await eventually(lambda: "healthy" in runs)  # poison, if it ran, ran first
        assert runs == ["healthy"], "a dead letter ran without a change"
        assert loop.stats().is_leader and loop.stats().dead_letters == 1


async def test_a_new_leader_whose_store_does_not_answer_leads_without_its_dead_letters(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(dead_letters, "LOAD_TIMEOUT", 0.05)
    runs: list[str] = []
    # The store hangs; its letter of "elsewhere" is one the resync-all never touches.
    repo = SlowDeadLetterRepo("poison", "elsewhere", latency=2)  # 40 load timeouts: it hangs
    with caplog.at_level(logging.WARNING, logger="kopf_reconcile.dead_letters"):
        async with fan_out_loop(repo, runs) as loop:
            await eventually(lambda: "healthy" in runs and "poison" in runs)  # retried once
            assert "retried once" in caplog.text
            repo.latency = 0  # the store answers again: its letters are loaded late
            await eventually(lambda: repo.loads >= 2 and loop.stats().dead_letters == 2)
            assert runs.count("poison") == 1


class GatedDeadLetterRepo(SlowDeadLetterRepo):
    """Its listing answers only once ``answer`` is set (a store that is slow just now)."""

    def __init__(self, *entity_ids: str) -> None:
        super().__init__(*entity_ids)
        self.answer = asyncio.Event()
        self.answer.set()

    async def dead_letters(self) -> list[DeadLetter]:
        await self.answer.wait()
        return await super().dead_letters()


async def test_a_hand_off_that_gives_up_during_the_load_does_not_dispatch_before_it() -> None:
    runs: list[str] = []
    release = threading.Event()

    def reconcile(req: kr.Request) -> None:  # sync: a thread, which cancelling cannot stop
        runs.append(req.entity_id)
        if req.entity_id == "slow":
            release.wait(10)
        if req.entity_id == "poison":
            raise kr.PermanentError("still broken")

    resyncs, leases, repo = Resyncs(), MemoryLeaseStore(), GatedDeadLetterRepo()
    loop = (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(resyncs)
        .with_leader(MemoryLeaseElector(leases, kr.LeaseTTL(1)))
        .with_fenced_repo(repo)
        .with_reconciler_id("rid")
        .with_renew_interval(0.1)
        .with_redrive_interval(0.05)
        .build()
    )
    try:
        async with loop:
            await eventually(lambda: loop.stats().is_leader)
            await loop.enqueue(kr.Request("slow"))
            await eventually(lambda: "slow" in runs)
            repo.letters["poison"] = letter("poison")  # dead-lettered by a peer meanwhile
            repo.answer.clear()  # the next term's load waits
            leases.expire("rid")  # the lease is lost while slow's thread runs on
            await eventually(lambda: loop.stats().is_leader and loop.stats().epoch >= 2)
            resyncs.requests.put_nowait("poison")  # a periodic resync re-observes it
            resyncs.requests.put_nowait("healthy")
            await loop.hand_off(grace=0.05)  # gives up: slow still runs
            assert loop._queue is not None and not loop._queue.dispatching  # not before the load
            release.set()
            repo.answer.set()  # the load ends: now dispatch
            # One worker, one FIFO lane: a poison run would come before healthy's.
            await eventually(lambda: "healthy" in runs)
            assert "poison" not in runs, runs
            assert loop.stats().is_leader
    finally:
        release.set()
