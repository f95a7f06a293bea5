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
  re-run after the current one ends, however many triggers arrived;
* **delayed**: entities with a pending time (requeue, backoff); per entity
  only the earliest pending time is kept, and an immediate trigger
  supersedes it.

Transient failures back off per entity: ``base·2ⁿ`` capped at ``max``, with
full jitter. A fresh trigger during a backoff window runs at once (it may
carry the fix), but failures inside one window bump the exponent once, not
per trigger, so an event storm cannot make backoff super-exponential. The
counter is forgotten on success, on permanent failure and with the queue.

Per-entity state is bounded by the entities that are live in it: an entity
that succeeded without a requeue leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import random
from collections import deque

from kopf_reconcile.backoff import exponential_cap, full_jitter

# While resync entities wait, at most this many fresh ones are handed out between two of
# them: a fresh change never waits behind a whole resync, and however many fresh changes
# arrive, the resync keeps at least 1/(1 + FRESH_BURST) of the hand-outs.
FRESH_BURST = 8

# Rebuild the heap once stale entries outnumber live ones by this factor, so
# superseded timers cannot accumulate (amortised O(1) per push).
_COMPACT_FACTOR = 2
_COMPACT_MIN = 1024


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
        self._dirty: set[str] = set()
        self._due: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []
        self._backoff: dict[str, _Backoff] = {}
        self._dead: set[str] = set()

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
            "backoff": len(self._backoff),
            "dead": len(self._dead),
        }

    # -- triggers ------------------------------------------------------------

    def add(self, entity: str, now: float, *, resync: bool = False) -> bool:
        """A trigger: run as soon as possible. True if the entity became ready.

        ``resync``: a re-observation of an entity nothing is known to have changed (the
        resync lane); a fresh trigger for an entity waiting there moves it to the fresh
        lane. Either kind marks an entity being processed dirty (its re-run is fresh).
        """
        self._dead.discard(entity)
        self._drop_due(entity)  # an immediate trigger supersedes any pending delay
        if entity in self._processing:
            self._dirty.add(entity)
            return False
        if entity in self._ready_since:
            if not resync and entity in self._in_resync:
                self._leave_resync_lane(entity)
                self._ready.append(entity)
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
        """
        if entity in self._ready_since or entity in self._dirty:
            return None  # already due sooner than any delay
        due = now + delay
        current = self._due.get(entity)
        if current is not None and current <= due:
            return None
        self._due[entity] = due
        heapq.heappush(self._heap, (due, entity))
        self._compact()
        return due

    def next_due(self) -> float | None:
        """The earliest pending time, or None."""
        heap = self._heap
        while heap and self._due.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)  # superseded
        return heap[0][0] if heap else None

    def pop_due(self, now: float) -> int:
        """Move every entity whose time has come to ready; returns how many became ready."""
        became_ready = 0
        heap = self._heap
        while heap and heap[0][0] <= now:
            due, entity = heapq.heappop(heap)
            if self._due.get(entity) != due:
                continue  # superseded
            del self._due[entity]
            if entity in self._processing:
                self._dirty.add(entity)
            elif entity not in self._ready_since:
                self._push_ready(entity, now)
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
        self._finish(entity, now)
        self.add_after(entity, due - now, now)
        return due - now

    def done_permanent(self, entity: str, now: float) -> None:
        """Retrying cannot help: forget the entity's timers until a fresh trigger."""
        self._backoff.pop(entity, None)
        self._drop_due(entity)
        self._dead.add(entity)
        self._finish(entity, now)

    def done_requeue(self, entity: str, now: float) -> None:
        """The run was interrupted (cancelled, fenced): run again, without a backoff bump."""
        self._finish(entity, now)
        if entity not in self._ready_since:
            self._drop_due(entity)
            self._push_ready(entity, now)

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
        if not self._backoff:
            self._backoff = {}
        if not self._processing:
            self._processing = set()
        if not self._dirty:
            self._dirty = set()
        if not self._dead:
            self._dead = set()

    # -- internals -----------------------------------------------------------

    def _next_ready(self) -> str:
        """Pop the next ready entity: fresh first, a resync one after ``fresh_burst`` fresh."""
        fresh, waiting = self._ready, self._in_resync
        if fresh and (not waiting or self._fresh_run < self._fresh_burst):
            self._fresh_run = self._fresh_run + 1 if waiting else 0
            return fresh.popleft()
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

    def _finish(self, entity: str, now: float) -> None:
        self._processing.remove(entity)
        if entity in self._dirty:
            self._dirty.remove(entity)
            self._dead.discard(entity)
            self._drop_due(entity)  # the re-run supersedes the timer just set
            self._push_ready(entity, now)

    def _drop_due(self, entity: str) -> None:
        if self._due.pop(entity, None) is not None:
            self._compact()

    def _compact(self) -> None:
        """Rebuild the heap once superseded timers outnumber live ones (amortised O(1))."""
        if len(self._heap) > _COMPACT_MIN and len(self._heap) > _COMPACT_FACTOR * len(self._due):
            self._heap = [(when, key) for key, when in self._due.items()]
            heapq.heapify(self._heap)

    def _push_ready(self, entity: str, now: float) -> None:
        self._ready.append(entity)
        self._ready_since[entity] = now
