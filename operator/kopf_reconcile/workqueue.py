"""The work queue: which entity runs next, and when.

Pure data structure (no asyncio, no clock: callers pass ``now``, a monotonic
time in seconds). It follows client-go's workqueue model:

* **ready**: entities runnable now, each at most once, in two FIFO lanes: the
  **fresh** lane (triggers, timers, re-runs) and the **resync** lane
  (re-observations of entities nothing changed, such as a new leader's
  resync-all). Fresh entities go first, but at most ``fresh_burst`` of them in a
  row while resync entities wait, so a resync is never starved. A fresh trigger
  for an entity waiting in the resync lane moves it to the fresh lane; a resync
  trigger for an entity already ready changes nothing;
* **processing**: entities being reconciled; never handed out twice, so at
  most one reconcile per entity runs at a time across all workers;
* **dirty**: entities triggered while processing; each gets exactly one
  re-run after the current one ends, however many triggers arrived (unless the
  run ended in a backoff or a dead letter and no fresh trigger came: see below);
* **delayed**: entities with a pending time (requeue, backoff); per entity
  only the earliest pending time is kept, and an immediate trigger
  supersedes it. Times within a horizon (a minute) wait in a heap; later ones
  (default requeues: hours) in a set that enters the heap once within the
  horizon, so the usual fate of a long requeue, being superseded by a trigger
  first, costs no heap entry.

Transient failures back off per entity: ``base·2ⁿ`` capped at ``max``, with
full jitter. A fresh trigger during a backoff window runs at once (it may
carry the fix), but failures inside one window bump the exponent once, not
per trigger, so an event storm cannot make backoff super-exponential. The
counter is forgotten on success, on permanent failure and with the queue.

Fresh and resync triggers differ in what they may override. A fresh trigger
(something changed, or an explicit redrive) supersedes a backoff and revives a
dead-lettered entity. A resync trigger (nothing is known to have changed) does
neither: an entity waiting out a backoff already has a retry pending, which
re-observes it, and a dead letter waits for a change or a redrive, as a
controller-runtime resync never forgets a rate limiter's state either; nor does
a timer revive a dead letter. Otherwise a resync every period would retry every
poison entity. Likewise a resync trigger during a run that then fails or is
dead-lettered leaves the backoff or the dead letter in place (a fresh trigger
during such a run re-runs it at once).

:meth:`WorkQueue.bury` marks dead an entity dead-lettered elsewhere (a previous
leader's durable dead letters), and :meth:`WorkQueue.replace_dead` replaces the
whole dead set by such letters. An entity ready because of a fresh trigger, or
being processed with a fresh trigger pending, is spared: the trigger may be a
change the dead letter predates. The fresh lane also holds entities that no
fresh trigger put there (a timer came due, a resync trigger or a timer during a
run asked for a re-run, a run was interrupted): the queue remembers which, and
those are buried like resync entries. An entity buried while it is processed is
dead when that run ends interrupted with no fresh trigger since (a run that ends
with an outcome of its own, such as a success, settles it as any run does).

Per-entity state is bounded by the entities that are live in it: an entity
that succeeded without a requeue leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Iterable

from kopf_reconcile.backoff import exponential_cap, full_jitter

# While resync entities wait, at most this many fresh ones are handed out between two of
# them: a fresh change never waits behind a whole resync, and however many fresh changes
# arrive, the resync keeps at least 1/(1 + FRESH_BURST) of the hand-outs.
FRESH_BURST = 8

# Rebuild the heap once stale entries outnumber live ones by this factor, so
# superseded timers cannot accumulate (amortised O(1) per push).
_COMPACT_FACTOR = 2
_COMPACT_MIN = 1024

# Pending times further ahead than this (seconds) wait outside the heap; the set they
# wait in is scanned at most once per horizon, when its earliest time comes near.
_FAR_HORIZON = 60.0


@dataclasses.dataclass(slots=True)
class _Backoff:
    failures: int  # exponent of the next window
    window_end: float  # retries inside [start, window_end) do not bump the exponent


class WorkQueue:
    """Deduplicating, delay-aware, per-entity-serialising work queue."""

    def __init__(
        self,
        *,
        backoff_base: float,
        backoff_max: float,
        rng: random.Random,
        fresh_burst: int = FRESH_BURST,
    ) -> None:
        if fresh_burst < 1:
            raise ValueError(f"fresh_burst must be >= 1, got {fresh_burst!r}")
        self._backoff_base = backoff_base
        self._backoff_max = backoff_max
        self._rng = rng
        self._fresh_burst = fresh_burst
        self._fresh_run = 0  # fresh entities handed out in a row while resync ones waited
        self._ready: deque[str] = deque()  # the fresh lane
        # The resync lane: (ticket, entity) entries; an entry whose ticket is not the
        # entity's in _in_resync is stale (the entity moved to the fresh lane or was
        # forgotten) and is skipped when reached.
        self._resync: deque[tuple[int, str]] = deque()
        self._in_resync: dict[str, int] = {}
        self._tickets = itertools.count()
        self._resync_stale = 0
        self._ready_since: dict[str, float] = {}
        self._processing: set[str] = set()
        # Triggered while processing -> whether a fresh trigger was among them (which
        # overrides the backoff or dead letter the run may end in).
        self._dirty: dict[str, bool] = {}
        self._due: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []
        # Entities whose pending time is beyond the horizon (in _due, not in the heap),
        # and a lower bound of those times (superseded ones may leave it too low).
        self._far: set[str] = set()
        self._far_next = math.inf
        self._backoff: dict[str, _Backoff] = {}
        self._dead: set[str] = set()
        # Ready in the fresh lane with no fresh trigger since (a timer, a re-run a resync
        # or a timer asked for, an interrupted run): :meth:`bury` does not spare them.
        self._unchanged: set[str] = set()
        # Buried while processing: dead if the run ends interrupted, no fresh trigger since.
        self._buried_running: set[str] = set()

    # -- observation ---------------------------------------------------------

    @property
    def ready_count(self) -> int:
        return len(self._ready_since)

    @property
    def resync_count(self) -> int:
        """Ready entities waiting in the resync lane (included in ``ready_count``)."""
        return len(self._in_resync)

    @property
    def delayed_count(self) -> int:
        return len(self._due)

    @property
    def processing_count(self) -> int:
        return len(self._processing)

    @property
    def dead_count(self) -> int:
        return len(self._dead)

    def is_ready(self, entity: str) -> bool:
        return entity in self._ready_since

    def is_resync(self, entity: str) -> bool:
        """Whether ``entity`` is ready in the resync lane."""
        return entity in self._in_resync

    def is_processing(self, entity: str) -> bool:
        return entity in self._processing

    def is_dead(self, entity: str) -> bool:
        return entity in self._dead

    def due_of(self, entity: str) -> float | None:
        return self._due.get(entity)

    def failures_of(self, entity: str) -> int:
        state = self._backoff.get(entity)
        return state.failures if state else 0

    def footprint(self) -> dict[str, int]:
        """Sizes of every internal structure (for boundedness tests and debugging)."""
        return {
            "ready": len(self._ready) + len(self._in_resync),
            "ready_since": len(self._ready_since),
            "resync_lane": len(self._resync),
            "processing": len(self._processing),
            "dirty": len(self._dirty),
            "due": len(self._due),
            "heap": len(self._heap),
            "far": len(self._far),
            "backoff": len(self._backoff),
            "dead": len(self._dead),
            "unchanged": len(self._unchanged),
            "buried_running": len(self._buried_running),
        }

    # -- triggers ------------------------------------------------------------

    def add(self, entity: str, now: float, *, resync: bool = False) -> bool:
        """A trigger: run as soon as possible. True if the entity became ready.

        ``resync``: a re-observation of an entity nothing is known to have changed (the
        resync lane); a fresh trigger for an entity waiting there moves it to the fresh
        lane. Either kind marks an entity being processed dirty (its re-run is fresh).
        A resync trigger leaves a dead-lettered entity dead and one waiting out a
        backoff waiting (its pending retry re-observes it); a fresh one revives the
        first and runs the second at once.
        """
        if not resync:
            self._dead.discard(entity)
        elif entity in self._dead or (entity in self._backoff and entity in self._due):
            return False
        self._drop_due(entity)  # an immediate trigger supersedes any pending delay
        if entity in self._processing:
            if not resync:
                self._dirty[entity] = True
            elif entity not in self._dirty:
                self._dirty[entity] = False
            return False
        if entity in self._ready_since:
            if not resync:
                if entity in self._in_resync:
                    self._leave_resync_lane(entity)
                    self._ready.append(entity)
                elif self._unchanged:
                    self._unchanged.discard(entity)  # now a fresh trigger put it there
            return False
        if resync:
            ticket = next(self._tickets)
            self._resync.append((ticket, entity))
            self._in_resync[entity] = ticket
        else:
            self._ready.append(entity)
        self._ready_since[entity] = now
        return True

    def add_after(self, entity: str, delay: float, now: float) -> float | None:
        """Run no later than ``now + delay``; the earliest pending time wins.

        Returns the new pending time if this call set one (the caller re-arms its timer).
        A dead-lettered entity gets no timer: it waits for a fresh trigger.
        """
        if entity in self._ready_since or entity in self._dirty or entity in self._dead:
            return None  # already due sooner than any delay, or dead
        due = now + delay
        current = self._due.get(entity)
        if current is not None and current <= due:
            return None
        self._due[entity] = due
        if delay > _FAR_HORIZON:
            self._far.add(entity)
            self._far_next = min(self._far_next, due)
        else:
            if current is not None:
                self._far.discard(entity)
            heapq.heappush(self._heap, (due, entity))
            self._compact()
        return due

    def next_due(self) -> float | None:
        """The earliest pending time (or a little earlier: a far timer was superseded), or None."""
        heap = self._heap
        while heap and self._due.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)  # superseded
        near = heap[0][0] if heap else math.inf
        if self._far and self._far_next < near:
            return self._far_next
        return near if heap else None

    def pop_due(self, now: float) -> int:
        """Move every entity whose time has come to ready; returns how many became ready."""
        became_ready = 0
        if self._far and now >= self._far_next:
            self._bring_near(now)
        heap = self._heap
        while heap and heap[0][0] <= now:
            due, entity = heapq.heappop(heap)
            if self._due.get(entity) != due:
                continue  # superseded
            del self._due[entity]
            if entity in self._processing:
                self._dirty.setdefault(entity, False)  # a timer is no change
            elif entity not in self._ready_since:
                self._push_ready(entity, now)
                self._unchanged.add(entity)  # a timer is no change
                became_ready += 1
        return became_ready

    # -- workers -------------------------------------------------------------

    def get(self) -> tuple[str, float]:
        """Hand out the next ready entity (and when it became ready). Raises IndexError if none."""
        entity = self._next_ready()
        since = self._ready_since.pop(entity)
        self._processing.add(entity)
        return entity, since

    def done_success(self, entity: str, now: float, requeue_after: float | None) -> float | None:
        """The reconcile succeeded; requeue after ``requeue_after`` seconds, or never (None).

        Returns the pending time it set, if any.
        """
        self._backoff.pop(entity, None)
        self._finish(entity, now)
        if requeue_after is None:
            return None
        return self.add_after(entity, requeue_after, now)

    def done_error(self, entity: str, now: float) -> float:
        """A transient failure: schedule a retry with backoff; returns the delay chosen."""
        state = self._backoff.get(entity)
        if state is not None and now < state.window_end:
            due = state.window_end  # a fresh-triggered run failed again in the same window
        else:
            failures = state.failures if state else 0
            cap = exponential_cap(self._backoff_base, self._backoff_max, failures)
            due = now + full_jitter(self._rng, cap)
            self._backoff[entity] = _Backoff(failures + 1, due)
        self._finish(entity, now, settled=True)
        self.add_after(entity, due - now, now)
        return due - now

    def done_permanent(self, entity: str, now: float) -> None:
        """Retrying cannot help: forget the entity's timers until a fresh trigger."""
        self._backoff.pop(entity, None)
        self._drop_due(entity)
        self._dead.add(entity)
        self._finish(entity, now, settled=True)

    def done_requeue(self, entity: str, now: float) -> None:
        """The run was interrupted (cancelled, fenced): run again, without a backoff bump.

        The re-run is no change (see :meth:`bury`), unless a fresh trigger came meanwhile.
        """
        self._finish(entity, now, interrupted=True)
        if entity not in self._ready_since and entity not in self._dead:
            self._drop_due(entity)
            self._push_ready(entity, now)
            self._unchanged.add(entity)

    def bury(self, entity: str) -> bool:
        """Mark dead an entity dead-lettered elsewhere (a previous leader's durable store).

        Like :meth:`done_permanent`, it takes the entity out of the ready lanes and
        drops its timers and its backoff, until a fresh trigger. An entity that a fresh
        trigger made ready is left alone: the trigger may be a change the dead letter
        predates. One being processed is dead if its run ends interrupted (a run that
        ended otherwise settles it); a fresh trigger meanwhile spares it.
        Returns whether the entity is dead now. O(ready) when the entity waits in the
        fresh lane: bury many at once with :meth:`replace_dead`.
        """
        if not self._buryable(entity):
            return False
        if entity in self._ready_since and entity not in self._in_resync:
            self._ready.remove(entity)
        self._inter(entity)
        return True

    def replace_dead(self, entities: Iterable[str]) -> int:
        """Make the dead set the given dead letters (a durable store's, as a leader loads them).

        Each of ``entities`` is buried (see :meth:`bury`); an entity dead here but not
        among them is dead no longer (the store cleared it: another leader saw it
        succeed) and runs at its next trigger of either kind. Returns how many ready
        entities left the lanes (room for as many triggers). O(ready) at most once.
        """
        wanted = set(entities)
        self._dead &= wanted
        self._buried_running &= wanted
        ready_before = len(self._ready_since)
        out_of_fresh: set[str] = set()
        for entity in wanted:
            if entity in self._dead or not self._buryable(entity):
                continue
            if entity in self._ready_since and entity not in self._in_resync:
                out_of_fresh.add(entity)
            self._inter(entity)
        if out_of_fresh:
            self._ready = deque(e for e in self._ready if e not in out_of_fresh)
        return ready_before - len(self._ready_since)

    def forget(self, entity: str) -> None:
        """Drop every trace of an entity that is not being processed."""
        if entity in self._processing:
            raise ValueError(f"entity {entity!r} is being processed")
        if entity in self._ready_since:
            del self._ready_since[entity]
            if entity in self._in_resync:
                self._leave_resync_lane(entity)
            else:
                self._ready.remove(entity)
        self._drop_due(entity)
        self._backoff.pop(entity, None)
        self._dead.discard(entity)
        self._unchanged.discard(entity)

    def trim(self) -> None:
        """Give back the capacity of emptied tables (CPython dicts and sets never shrink).

        Cheap; call it when the queue goes idle, so memory follows the live entities
        rather than their peak.
        """
        if not self._ready_since:
            self._ready_since = {}
        if not self._in_resync:
            self._in_resync = {}
            self._resync = deque()
            self._resync_stale = 0
        if not self._due:
            self._due = {}
            self._heap = []
            self._far = set()
            self._far_next = math.inf
        if not self._backoff:
            self._backoff = {}
        if not self._processing:
            self._processing = set()
        if not self._dirty:
            self._dirty = {}
        if not self._dead:
            self._dead = set()
        if not self._unchanged:
            self._unchanged = set()

    # -- internals -----------------------------------------------------------

    def _next_ready(self) -> str:
        """Pop the next ready entity: fresh first, a resync one after ``fresh_burst`` fresh."""
        fresh, waiting = self._ready, self._in_resync
        if fresh and (not waiting or self._fresh_run < self._fresh_burst):
            self._fresh_run = self._fresh_run + 1 if waiting else 0
            entity = fresh.popleft()
            if self._unchanged:
                self._unchanged.discard(entity)
            return entity
        if not waiting:
            raise IndexError("no entity is ready")
        lane = self._resync
        while True:
            ticket, entity = lane.popleft()
            if waiting.get(entity) == ticket:
                self._fresh_run = 0
                self._leave_resync_lane(entity, stale=False)
                return entity
            self._resync_stale -= 1

    def _leave_resync_lane(self, entity: str, *, stale: bool = True) -> None:
        """``entity`` is no longer ready in the resync lane; ``stale``: its entry stays there."""
        del self._in_resync[entity]
        if not self._in_resync:
            self._resync.clear()  # only stale entries are left
            self._resync_stale = 0
        elif stale:
            self._resync_stale += 1
            if self._resync_stale > _COMPACT_MIN and self._resync_stale > len(self._in_resync):
                self._compact_resync_lane()

    def _compact_resync_lane(self) -> None:
        """Drop stale entries (amortised O(1) per entry that became stale)."""
        live = self._in_resync
        self._resync = deque(entry for entry in self._resync if live.get(entry[1]) == entry[0])
        self._resync_stale = 0

    def _buryable(self, entity: str) -> bool:
        """Whether :meth:`bury` may mark ``entity`` dead now (else it is spared, or, being
        processed, marked to be dead if its run ends interrupted)."""
        if entity in self._processing:
            if not self._dirty.get(entity):
                self._buried_running.add(entity)
            return False
        return (
            entity not in self._ready_since
            or entity in self._in_resync
            or entity in self._unchanged
        )

    def _inter(self, entity: str) -> None:
        """Mark dead a buryable entity, leaving it in the fresh deque (the caller's part)."""
        if self._ready_since.pop(entity, None) is not None:
            if entity in self._in_resync:
                self._leave_resync_lane(entity)
            else:
                self._unchanged.discard(entity)
        self._drop_due(entity)
        self._backoff.pop(entity, None)
        self._dead.add(entity)

    def _finish(
        self, entity: str, now: float, *, settled: bool = False, interrupted: bool = False
    ) -> None:
        """The run of ``entity`` ended; its re-run, if it was triggered meanwhile.

        ``settled``: the run ended in a backoff or a dead letter, which only a fresh
        trigger overrides (a resync or a timer waits for the retry, or for a change).
        ``interrupted``: it ended without an outcome (the caller queues the re-run).
        """
        self._processing.remove(entity)
        fresh = self._dirty.pop(entity, None)
        if self._buried_running and entity in self._buried_running:
            self._buried_running.remove(entity)
            if interrupted and not fresh:
                self._inter(entity)  # buried while it ran, and no fresh trigger since
                return
        if fresh is not None and (fresh or not settled):
            self._dead.discard(entity)
            self._drop_due(entity)  # the re-run supersedes the timer just set
            self._push_ready(entity, now)
            if not fresh:
                self._unchanged.add(entity)

    def _drop_due(self, entity: str) -> None:
        if self._due.pop(entity, None) is not None:
            if entity in self._far:
                self._far.remove(entity)
            else:
                self._compact()

    def _compact(self) -> None:
        """Rebuild the heap once superseded timers outnumber live ones (amortised O(1))."""
        heap, far = self._heap, self._far
        if len(heap) > _COMPACT_MIN and len(heap) > _COMPACT_FACTOR * (len(self._due) - len(far)):
            self._heap = [(when, key) for key, when in self._due.items() if key not in far]
            heapq.heapify(self._heap)

    def _bring_near(self, now: float) -> None:
        """Move the far timers now within the horizon into the heap (O(far), once per horizon:
        the ones left are due beyond it, and so is every one added since)."""
        horizon = now + _FAR_HORIZON
        due, far, heap = self._due, self._far, self._heap
        for entity in [entity for entity in far if due[entity] <= horizon]:
            far.remove(entity)
            heapq.heappush(heap, (due[entity], entity))
        self._far_next = min((due[entity] for entity in far), default=math.inf)

    def _push_ready(self, entity: str, now: float) -> None:
        self._ready.append(entity)
        self._ready_since[entity] = now
