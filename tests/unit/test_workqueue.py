"""The work queue's rules, one test each, plus a hypothesis state machine."""

from __future__ import annotations

import random
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kopf_reconcile.workqueue import WorkQueue


class MaxJitter(random.Random):
    """Full jitter that always draws the upper bound, so delays are exact."""

    def uniform(self, a: float, b: float) -> float:
        return b


def make(base: float = 1.0, maximum: float = 100.0) -> WorkQueue:
    return WorkQueue(backoff_base=base, backoff_max=maximum, rng=MaxJitter())


def test_trigger_of_queued_entity_is_a_no_op() -> None:
    q = make()
    assert q.add("a", 0)
    assert not q.add("a", 0)
    assert q.ready_count == 1


def test_entity_is_never_handed_out_twice_while_processing() -> None:
    q = make()
    q.add("a", 0)
    assert q.get()[0] == "a"
    q.add("a", 1)  # trigger while processing: dirty, not ready
    assert q.ready_count == 0
    with pytest.raises(IndexError):
        q.get()


def test_many_triggers_while_processing_coalesce_into_exactly_one_rerun() -> None:
    q = make()
    q.add("a", 0)
    q.get()
    for t in range(50):
        q.add("a", t)
    q.done_success("a", 60, None)
    assert q.ready_count == 1
    assert q.get()[0] == "a"
    q.done_success("a", 61, None)
    assert q.ready_count == 0
    assert q.footprint() == dict.fromkeys(q.footprint(), 0)


def test_earliest_delay_wins() -> None:
    q = make()
    q.add_after("a", 10, 0)
    q.add_after("a", 5, 0)
    q.add_after("a", 20, 0)
    assert q.due_of("a") == 5
    assert q.pop_due(4.9) == 0
    assert q.pop_due(5) == 1
    assert q.get()[0] == "a"


def test_immediate_trigger_supersedes_pending_delay() -> None:
    q = make()
    q.add_after("a", 10, 0)
    q.add("a", 1)
    assert q.due_of("a") is None
    assert q.get()[0] == "a"
    q.done_success("a", 2, None)
    assert q.pop_due(100) == 0  # the superseded timer does not fire


def test_backoff_grows_exponentially_and_is_capped() -> None:
    q = make(base=1, maximum=8)
    q.add("a", 0)
    now = 0.0
    delays: list[float] = []
    for _ in range(6):
        q.pop_due(now)
        q.get()
        delays.append(q.done_error("a", now))
        now += delays[-1]
    assert delays == [1, 2, 4, 8, 8, 8]


def test_backoff_is_full_jitter_within_the_cap() -> None:
    q = WorkQueue(backoff_base=1, backoff_max=100, rng=random.Random(7))
    q.add("a", 0)
    q.get()
    first = q.done_error("a", 0)
    assert 0 <= first <= 1


def test_success_forgets_the_failure_counter() -> None:
    q = make()
    q.add("a", 0)
    q.get()
    q.done_error("a", 0)
    q.pop_due(1)
    q.get()
    q.done_error("a", 1)
    assert q.failures_of("a") == 2
    q.pop_due(3)
    q.get()
    q.done_success("a", 3, None)
    assert q.failures_of("a") == 0
    q.add("a", 4)
    q.get()
    assert q.done_error("a", 4) == 1  # starts from base again


def test_fresh_trigger_during_backoff_runs_at_once_without_extra_exponent() -> None:
    q = make(base=10, maximum=1000)
    q.add("a", 0)
    q.get()
    assert q.done_error("a", 0) == 10  # window [0, 10)
    # An event storm inside the window: each trigger runs at once and fails.
    for t in (1, 2, 3, 4):
        q.add("a", t)
        assert q.get()[0] == "a"
        q.done_error("a", t)
        assert q.due_of("a") == 10  # same window end
        assert q.failures_of("a") == 1  # exponent bumped once, not per trigger
    # After the window, the next failure bumps the exponent.
    q.pop_due(10)
    q.get()
    assert q.done_error("a", 10) == 20
    assert q.failures_of("a") == 2


def test_permanent_failure_leaves_every_timer_until_a_fresh_trigger() -> None:
    q = make()
    q.add_after("a", 5, 0)
    q.add("a", 0)
    q.get()
    q.done_error("a", 0)
    q.pop_due(1)
    q.get()
    q.done_permanent("a", 1)
    assert q.is_dead("a")
    assert q.due_of("a") is None
    assert q.failures_of("a") == 0
    assert q.pop_due(10_000) == 0
    assert q.add("a", 2)  # a fresh trigger schedules it again
    assert not q.is_dead("a")


def test_trigger_during_permanent_failure_reruns_once() -> None:
    q = make()
    q.add("a", 0)
    q.get()
    q.add("a", 0.5)
    q.done_permanent("a", 1)
    assert not q.is_dead("a")
    assert q.get()[0] == "a"


def test_requeue_after_interruption_keeps_the_backoff_counter() -> None:
    q = make()
    q.add("a", 0)
    q.get()
    q.done_error("a", 0)
    q.pop_due(1)
    q.get()
    q.done_requeue("a", 1)
    assert q.ready_count == 1
    assert q.failures_of("a") == 1


def test_superseded_timers_do_not_accumulate() -> None:
    q = make()
    for i in range(10_000):
        q.add_after("a", 1000 - i * 0.01, 0)
    assert q.footprint()["heap"] <= 2 * 1024 + 1
    q.add("a", 0)
    q.get()
    for i in range(10_000):
        q.done_success("a", i, 100)  # each success re-arms a later timer
        q.add("a", i)
        q.get()
    assert q.footprint()["heap"] <= 2 * 1024 + 1


def test_hundred_thousand_entities_through_failure_then_success_leave_nothing() -> None:
    q = make(base=0.001, maximum=0.01)
    n = 100_000
    for i in range(n):
        q.add(f"e{i}", 0)
    now = 0.0
    while q.ready_count:
        entity, _ = q.get()
        q.done_error(entity, now)
    assert q.footprint()["backoff"] == n
    now = 1.0
    assert q.pop_due(now) == n
    while q.ready_count:
        entity, _ = q.get()
        q.done_success(entity, now, None)
    assert q.footprint() == dict.fromkeys(q.footprint(), 0)


class WorkQueueMachine(RuleBasedStateMachine):
    """Random interleavings of triggers (fresh and resync), timers and worker outcomes.

    The model keeps what a resync may not override: a dead letter (only a fresh trigger
    revives it) and a backoff (only a fresh trigger cuts it short); and which ready
    entities a fresh trigger put there (the only ones a loaded dead letter spares: a
    timer, a resync or an interrupted run is no change).
    """

    entities = st.sampled_from([f"e{i}" for i in range(5)])
    BURST = 2

    def __init__(self) -> None:
        super().__init__()
        self.q = WorkQueue(
            backoff_base=0.5, backoff_max=4, rng=random.Random(1), fresh_burst=self.BURST
        )
        self.now = 0.0
        self.processing: set[str] = set()
        self.pending: set[str] = set()  # triggered, not yet picked up by a run
        self.dirty: dict[str, bool] = {}  # processing and triggered -> by a fresh trigger
        self.dead: set[str] = set()  # dead-lettered, no fresh trigger since
        self.backing_off: set[str] = set()  # waiting for a retry after a failure
        self.fresh_run = 0  # fresh hand-outs in a row while resync entities waited
        self.resync_order: list[str] = []  # the resync lane as the model sees it (FIFO)
        self.changed: set[str] = set()  # ready because of a fresh trigger (the fresh lane)
        self.buried_running: set[str] = set()  # buried while processing

    @rule(entity=entities)
    def trigger(self, entity: str) -> None:
        was_resync = self.q.is_resync(entity)
        self.q.add(entity, self.now)
        self.pending.add(entity)
        self.dead.discard(entity)  # a fresh trigger revives a dead letter ...
        self.backing_off.discard(entity)  # ... and cuts a backoff short
        if entity in self.processing:
            self.dirty[entity] = True
        else:
            self.changed.add(entity)
        if was_resync:  # a fresh trigger moves it to the fresh lane
            assert self.q.is_ready(entity) and not self.q.is_resync(entity)
            self.resync_order.remove(entity)

    @rule(entity=entities)
    def trigger_resync(self, entity: str) -> None:
        was_ready = self.q.is_ready(entity)
        was_resync = self.q.is_resync(entity)
        due = self.q.due_of(entity)
        became_ready = self.q.add(entity, self.now, resync=True)
        if entity in self.dead or entity in self.backing_off:
            # Nothing changed: the dead letter stays, the backoff's retry stays pending.
            assert not became_ready and not self.q.is_ready(entity)
            assert self.q.is_dead(entity) == (entity in self.dead)
            assert self.q.due_of(entity) == due
            return
        self.pending.add(entity)
        if entity in self.processing:
            self.dirty.setdefault(entity, False)
        elif was_ready:  # already ready: stays in its lane, once
            assert self.q.is_resync(entity) == was_resync
        else:
            assert self.q.is_resync(entity)
            self.resync_order.append(entity)

    @rule(entity=entities, delay=st.floats(0.01, 5) | st.floats(55, 200))  # near and far
    def trigger_later(self, entity: str, delay: float) -> None:
        set_at = self.q.add_after(entity, delay, self.now)
        if entity in self.dead:
            assert set_at is None and self.q.is_dead(entity), "a timer revived a dead letter"

    @rule(step=st.floats(0, 3) | st.floats(50, 150))
    def time_passes(self, step: float) -> None:
        self.now += step
        for entity in self.processing:
            due = self.q.due_of(entity)
            if due is not None and due <= self.now:
                self.dirty.setdefault(entity, False)
        self.q.pop_due(self.now)  # due entities join the fresh lane
        for entity in list(self.backing_off):
            if self.q.is_ready(entity):  # its retry came
                self.backing_off.discard(entity)

    def _expect_buried(self, entity: str, buried: bool) -> None:
        if entity in self.processing:
            assert not buried
            if not self.dirty.get(entity):
                self.buried_running.add(entity)  # dead if the run ends interrupted
            return
        if entity in self.changed:
            assert not buried, "a dead letter overrode a fresh trigger"
            assert self.q.is_ready(entity) and not self.q.is_dead(entity)
            return
        assert buried or entity in self.dead, "a timer or an interrupted run spared a dead letter"
        assert self.q.is_dead(entity) and not self.q.is_ready(entity)
        self.dead.add(entity)
        self.backing_off.discard(entity)
        self.pending.discard(entity)  # a resync, a timer: no change, it waits with the letter
        if entity in self.resync_order:
            self.resync_order.remove(entity)

    @rule(entity=entities)
    def bury(self, entity: str) -> None:
        """A dead letter loaded from a durable store."""
        self._expect_buried(entity, self.q.bury(entity))

    @rule(letters=st.sets(entities))
    def replace_dead(self, letters: set[str]) -> None:
        """A new leader's dead letters replace the dead set (the store cleared the others)."""
        ready_before = self.q.ready_count
        freed = self.q.replace_dead(letters)
        assert freed == ready_before - self.q.ready_count
        for entity in self.dead - letters:
            assert not self.q.is_dead(entity) and not self.q.is_ready(entity)
        self.dead &= letters
        self.buried_running &= letters
        for entity in sorted(letters):
            self._expect_buried(entity, self.q.is_dead(entity) and entity not in self.dead)

    @precondition(lambda self: self.q.ready_count > 0)
    @rule()
    def worker_takes(self) -> None:
        fresh_ready = self.q.ready_count - self.q.resync_count
        resync_waiting = self.q.resync_count
        entity, _ = self.q.get()
        assert entity not in self.processing, "two concurrent reconciles of one entity"
        assert entity not in self.dead, "a dead letter ran without a fresh trigger"
        assert entity not in self.backing_off, "a retry ran before its backoff"
        took_resync = bool(self.resync_order) and entity == self.resync_order[0]
        if entity in self.resync_order:
            assert took_resync, "the resync lane is not FIFO"
            self.resync_order.pop(0)
        if took_resync:
            if fresh_ready:  # a fresh entity was passed over: only after a full burst
                assert self.fresh_run == self.BURST, "a resync entity went before fresh ones"
            self.fresh_run = 0
        elif resync_waiting:
            assert self.fresh_run < self.BURST, "the resync lane is starved"
            self.fresh_run += 1
        else:
            self.fresh_run = 0
        self.processing.add(entity)
        self.pending.discard(entity)
        self.changed.discard(entity)

    @precondition(lambda self: bool(self.processing))
    @rule(
        data=st.data(),
        outcome=st.sampled_from(["success", "requeue", "error", "permanent", "interrupted"]),
    )
    def worker_finishes(self, data: st.DataObject, outcome: str) -> None:
        entity = data.draw(st.sampled_from(sorted(self.processing)))
        self.processing.remove(entity)
        dirty = self.dirty.pop(entity, None)
        if outcome == "success":
            self.q.done_success(entity, self.now, None)
        elif outcome == "requeue":
            self.q.done_success(entity, self.now, 1.0)
        elif outcome == "error":
            self.q.done_error(entity, self.now)
        elif outcome == "permanent":
            self.q.done_permanent(entity, self.now)
        else:
            self.q.done_requeue(entity, self.now)
        if entity in self.buried_running:
            self.buried_running.remove(entity)
            if outcome == "interrupted" and not dirty:
                # Buried while it ran, and no change since: dead, not re-run.
                assert self.q.is_dead(entity) and not self.q.is_ready(entity)
                self.pending.discard(entity)
                self.dead.add(entity)
                return
        if dirty:
            self.changed.add(entity)  # the re-run a fresh trigger asked for
        if outcome in ("error", "permanent") and not dirty:
            # Only a fresh trigger during the run overrides its backoff or dead letter.
            assert not self.q.is_ready(entity), "a resync or a timer overrode the outcome"
            self.pending.discard(entity)
            if outcome == "error":
                self.backing_off.add(entity)
            else:
                self.dead.add(entity)
        elif dirty is not None or outcome == "interrupted":
            assert self.q.is_ready(entity), "a trigger during processing was lost"
        if entity in self.pending:
            assert self.q.is_ready(entity), "a trigger during processing was lost"

    @invariant()
    def changed_entities_wait_in_the_fresh_lane(self) -> None:
        for entity in self.changed:
            assert self.q.is_ready(entity) and not self.q.is_resync(entity)

    @invariant()
    def the_model_lane_matches(self) -> None:
        assert self.q.resync_count == len(self.resync_order)
        assert all(self.q.is_resync(e) for e in self.resync_order)

    @invariant()
    def no_trigger_is_lost(self) -> None:
        for entity in self.pending:
            assert self.q.is_ready(entity) or self.q.is_processing(entity)

    @invariant()
    def dead_letters_and_backoffs_hold(self) -> None:
        for entity in [f"e{i}" for i in range(5)]:
            assert self.q.is_dead(entity) == (entity in self.dead), entity
        for entity in self.dead:
            assert not self.q.is_ready(entity) and self.q.due_of(entity) is None
        for entity in self.backing_off:
            assert not self.q.is_ready(entity) and self.q.due_of(entity) is not None

    @invariant()
    def ready_and_processing_are_disjoint_and_unique(self) -> None:
        fp = self.q.footprint()
        assert fp["ready"] == fp["ready_since"]
        assert fp["processing"] == len(self.processing)
        for entity in self.processing:
            assert not self.q.is_ready(entity)

    def teardown(self) -> None:
        # Everything succeeds from now on: the queue must drain to nothing.
        for entity in list(self.processing):
            self.q.done_success(entity, self.now, None)
        for _ in range(100):
            self.now += 10
            self.q.pop_due(self.now)
            while self.q.ready_count:
                entity, _ = self.q.get()
                self.q.done_success(entity, self.now, None)
            if not self.q.delayed_count:
                break
        assert self.q.next_due() is None  # (which also drops superseded heap entries)
        fp = self.q.footprint()
        del fp["dead"]  # dead letters wait for a fresh trigger by design
        assert fp == dict.fromkeys(fp, 0), fp


TestWorkQueueMachine = WorkQueueMachine.TestCase
TestWorkQueueMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_timers_superseded_by_fresh_triggers_do_not_linger() -> None:
    q = make(base=3600, maximum=3600)  # long backoff: the timers would fire only in an hour
    n = 100_000
    for i in range(n):
        q.add(f"e{i}", 0)
    while q.ready_count:
        entity, _ = q.get()
        q.done_error(entity, 0)
    assert q.footprint()["heap"] + q.footprint()["far"] == n
    for i in range(n):  # fresh triggers supersede every backoff, then everything succeeds
        q.add(f"e{i}", 1)
    while q.ready_count:
        entity, _ = q.get()
        q.done_success(entity, 1, None)
    footprint = q.footprint()
    assert footprint["heap"] <= 1024, footprint
    del footprint["heap"]
    assert footprint == dict.fromkeys(footprint, 0), footprint


def test_far_timers_wait_outside_the_heap_and_fire_on_time() -> None:
    q = make()
    for i in range(1000):
        q.add_after(f"e{i}", 3600 + i, 0)  # default requeues: hours ahead
    assert q.footprint()["heap"] == 0 and q.footprint()["far"] == 1000
    assert q.next_due() == 3600
    for i in range(500):
        q.add(f"e{i}", 1)  # superseded by triggers: nothing stays behind
    while q.ready_count:
        q.done_success(q.get()[0], 1, None)
    assert q.footprint()["far"] == 500 and q.next_due() is not None
    assert q.next_due() <= 4100  # a lower bound: it may wake early, never late
    assert q.pop_due(4099.9) == 0
    assert q.pop_due(4100) == 1 and q.get()[0] == "e500"
    assert q.footprint()["heap"] <= 60 + 1  # only what is within the horizon entered it
    assert q.pop_due(5000) == 499
    assert q.footprint()["far"] == 0


def test_an_earlier_near_time_supersedes_a_far_one() -> None:
    q = make()
    q.add_after("a", 3600, 0)
    q.add_after("a", 5, 0)
    assert q.due_of("a") == 5 and q.footprint()["far"] == 0
    assert q.next_due() == 5 and q.pop_due(5) == 1


def test_trim_gives_back_the_capacity_of_emptied_tables() -> None:
    q = make()
    empty = sys.getsizeof({})
    for i in range(10_000):
        q.add(f"e{i}", 0)
    while q.ready_count:
        entity, _ = q.get()
        q.done_error(entity, 0)
    q.pop_due(10_000)
    while q.ready_count:
        entity, _ = q.get()
        q.done_success(entity, 10_000, None)
    assert sys.getsizeof(q._backoff) > 100 * empty  # emptied, but CPython keeps the table
    q.trim()
    for table in (q._ready_since, q._due, q._backoff):
        assert sys.getsizeof(table) == empty


# -- lanes: fresh work before a resync, without starving it ---------------------------------


def test_a_fresh_trigger_goes_before_a_queued_resync() -> None:
    q = make()
    for i in range(1000):
        q.add(f"r{i}", 0, resync=True)
    q.add("fresh", 1)
    assert q.get()[0] == "fresh"
    assert q.ready_count == 1000 and q.resync_count == 1000


def test_a_fresh_trigger_upgrades_an_entity_waiting_in_the_resync_lane() -> None:
    q = make()
    for i in range(10):
        q.add(f"e{i}", 0, resync=True)
    assert q.add("e7", 1) is False  # already ready: not a second entry
    assert not q.is_resync("e7") and q.is_ready("e7")
    assert q.get() == ("e7", 0)  # keeps the time it became ready
    order = [q.get()[0] for _ in range(q.ready_count)]
    assert order == [f"e{i}" for i in range(10) if i != 7]
    assert q.footprint()["resync_lane"] == 0


def test_a_resync_trigger_never_downgrades_a_fresh_entity() -> None:
    q = make()
    q.add("r", 0, resync=True)
    q.add("f", 0)
    q.add("f", 1, resync=True)
    assert not q.is_resync("f")
    assert q.get()[0] == "f"


def test_a_stream_of_fresh_triggers_cannot_starve_the_resync_lane() -> None:
    q = WorkQueue(backoff_base=1, backoff_max=1, rng=MaxJitter(), fresh_burst=4)
    for i in range(100):
        q.add(f"r{i}", 0, resync=True)
    taken: list[str] = []
    n = 0
    while q.resync_count:
        for _ in range(3):  # fresh work arrives faster than it is served
            q.add(f"f{n}", 0)
            n += 1
        entity, _ = q.get()
        taken.append(entity)
        q.done_success(entity, 0, None)
    # Exactly one resync entity after every four fresh ones.
    assert len(taken) == 500
    assert [e for e in taken[4::5]] == [f"r{i}" for i in range(100)]


def test_a_resync_trigger_during_a_reconcile_marks_it_dirty() -> None:
    q = make()
    q.add("e", 0)
    q.get()
    q.add("e", 0, resync=True)
    q.done_success("e", 1, None)
    assert q.is_ready("e")


def test_stale_resync_entries_are_compacted() -> None:
    q = make()
    n = 50_000
    for i in range(n):
        q.add(f"e{i}", 0, resync=True)
    for i in range(n - 10):
        q.add(f"e{i}", 1)  # upgraded: their resync entries are stale
    assert q.footprint()["resync_lane"] <= 2 * 10 + 1100
    while q.ready_count:
        entity, _ = q.get()
        q.done_success(entity, 2, None)
    assert q.footprint() == dict.fromkeys(q.footprint(), 0)


def test_forgetting_an_entity_of_the_resync_lane() -> None:
    q = make()
    q.add("a", 0, resync=True)
    q.add("b", 0, resync=True)
    q.forget("a")
    assert q.ready_count == 1 and q.get()[0] == "b"
    assert q.footprint()["resync_lane"] == 0
