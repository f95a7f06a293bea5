"""Events about entities: what a reconcile went through, aggregated and rate-limited.

A Loop given an :class:`EventSink` records, on the entity a reconcile was about:

* ``Warning ReconcileError`` when a reconcile fails (the message is the error's);
* ``Warning DeadLettered`` when the entity is dead-lettered (the message is the reason);
* ``Normal Reconciled`` when a reconcile succeeds after one of those (a recovery);

and a reconciler records its own with :func:`event` (``kr.event(req, "Normal",
"Configured", "...")``). The kopf shim's sink posts them as Kubernetes Events on the
object (:mod:`kopf_reconcile.integration.events`); any other sink can take them.

The :class:`EventRecorder` between the Loop and the sink does what client-go's event
correlator and spam filter do:

* **aggregation**: one event per (entity, type, reason), posted once and then updated
  with a count, the latest message and the last time, never one per retry;
* **rate limit**: a token bucket per entity (``burst`` posts, then one per ``refill``
  seconds; client-go's defaults: 25, then one per 5 minutes); what arrives meanwhile
  is counted and goes out with the next post of its event;
* **in the background**: :meth:`EventRecorder.record` never waits and never raises.
  Posts run as tasks, one at a time per event; a sink error is logged and dropped.
  What a reconcile does never depends on an event being posted.

Memory is bounded: at most ``max_events`` aggregates and buckets are kept (least
recently used first out), as client-go's correlator keeps an LRU cache of 4096.

Only the leader records: the Loop records from its workers (which run only while it
leads) and :func:`event` is a no-op while the Loop does not lead; posts still pending
when leadership is lost are cancelled (:meth:`EventRecorder.drop_pending`).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import datetime
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from kopf_reconcile.api import Request

__all__ = [
    "NORMAL",
    "WARNING",
    "EventRecord",
    "EventRecorder",
    "EventSink",
    "LoopEvents",
    "bind_events",
    "event",
]

logger = logging.getLogger("kopf_reconcile.events")

NORMAL = "Normal"
WARNING = "Warning"
_TYPES = (NORMAL, WARNING)

DEFAULT_BURST = 25  # client-go's spam filter: 25 events per object at once...
DEFAULT_REFILL = 300.0  # ... then one per 5 minutes
DEFAULT_MAX_EVENTS = 4096  # aggregates (and buckets) kept, least recently used first out
MAX_MESSAGE = 1024  # characters of a message (events.k8s.io's limit)

RECONCILE_ERROR = "ReconcileError"
DEAD_LETTERED = "DeadLettered"
RECONCILED = "Reconciled"


@dataclasses.dataclass(frozen=True)
class EventRecord:
    """One aggregated event as the sink posts it: ``count`` occurrences since ``first_seen``."""

    entity_id: str
    type: str  # "Normal" or "Warning"
    reason: str
    message: str  # the latest occurrence's
    count: int
    first_seen: datetime.datetime  # aware, UTC
    last_seen: datetime.datetime


@runtime_checkable
class EventSink(Protocol):
    """Where aggregated events go (the kopf shim's posts Kubernetes Events)."""

    async def post(self, record: EventRecord, previous: object | None) -> object | None:
        """Create the event (``previous`` is None) or update it (``previous`` is what the
        last post of this aggregate returned). Return what identifies the posted event,
        or None when nothing was posted (say, the entity is unknown). May raise: the
        recorder logs the error and drops that post."""
        ...


@dataclasses.dataclass
class _Aggregate:
    type: str
    reason: str
    message: str
    count: int
    first_seen: datetime.datetime
    last_seen: datetime.datetime
    posted_count: int = 0
    handle: object | None = None
    task: asyncio.Task[None] | None = None


@dataclasses.dataclass
class _Bucket:
    tokens: float
    updated: float


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class EventRecorder:
    """Aggregates, rate-limits and posts events to an :class:`EventSink` in the background."""

    def __init__(
        self,
        sink: EventSink,
        *,
        burst: int = DEFAULT_BURST,
        refill: float = DEFAULT_REFILL,
        max_events: int = DEFAULT_MAX_EVENTS,
        clock: Callable[[], float] | None = None,
        wall_clock: Callable[[], datetime.datetime] = _utcnow,
    ) -> None:
        """Create it inside the running event loop (its posts are tasks of that loop)."""
        self._sink = sink
        self._burst = burst
        self._refill = refill
        self._max = max_events
        self._event_loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._clock = clock or self._event_loop.time
        self._wall_clock = wall_clock
        self._aggregates: OrderedDict[tuple[str, str, str], _Aggregate] = OrderedDict()
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._closed = False

    @property
    def pending(self) -> int:
        """Posts running or waiting for the rate limit (for tests and probes)."""
        return sum(1 for a in self._aggregates.values() if a.task is not None)

    def record(self, entity_id: str, type: str, reason: str, message: str) -> None:
        """Count one occurrence; its post goes out in the background. Never waits, never raises.

        Safe from any thread (a sync reconciler runs in a worker thread).
        """
        if self._closed:
            return
        if threading.get_ident() != self._thread:
            self._event_loop.call_soon_threadsafe(self.record, entity_id, type, reason, message)
            return
        message = message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 1] + "…"
        key = (entity_id, type, reason)
        now = self._wall_clock()
        aggregate = self._aggregates.get(key)
        if aggregate is None:
            aggregate = _Aggregate(type, reason, message, 0, now, now)
            self._aggregates[key] = aggregate
            self._evict()
        else:
            self._aggregates.move_to_end(key)
        aggregate.count += 1
        aggregate.message = message
        aggregate.last_seen = now
        if aggregate.task is None:
            aggregate.task = self._event_loop.create_task(
                self._flush(key, aggregate), name=f"event {reason} of {entity_id}"
            )

    def drop_pending(self) -> None:
        """Cancel the posts not done yet (leadership was lost); counts are kept."""
        for aggregate in self._aggregates.values():
            if aggregate.task is not None:
                aggregate.task.cancel()
                aggregate.task = None

    async def close(self, timeout: float = 1.0) -> None:
        """Let running posts finish for up to ``timeout`` seconds, cancel the rest."""
        self._closed = True
        tasks = [a.task for a in self._aggregates.values() if a.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    # -- internals ---------------------------------------------------------------------

    def _evict(self) -> None:
        while len(self._aggregates) > self._max:
            _, old = self._aggregates.popitem(last=False)
            if old.task is not None:
                old.task.cancel()

    def _take_token(self, entity_id: str) -> float:
        """0 when a post may go now (a token taken), else how long until one is there."""
        now = self._clock()
        bucket = self._buckets.get(entity_id)
        if bucket is None:
            bucket = self._buckets[entity_id] = _Bucket(float(self._burst), now)
            while len(self._buckets) > self._max:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(entity_id)
            bucket.tokens = min(
                float(self._burst), bucket.tokens + (now - bucket.updated) / self._refill
            )
            bucket.updated = now
        if bucket.tokens >= 1:
            bucket.tokens -= 1
            return 0.0
        return (1 - bucket.tokens) * self._refill

    async def _flush(self, key: tuple[str, str, str], aggregate: _Aggregate) -> None:
        entity_id = key[0]
        try:
            while aggregate.posted_count < aggregate.count:
                wait = self._take_token(entity_id)
                if wait:
                    await asyncio.sleep(wait)
                    continue
                record = EventRecord(
                    entity_id=entity_id,
                    type=aggregate.type,
                    reason=aggregate.reason,
                    message=aggregate.message,
                    count=aggregate.count,
                    first_seen=aggregate.first_seen,
                    last_seen=aggregate.last_seen,
                )
                try:
                    aggregate.handle = await self._sink.post(record, aggregate.handle)
                except Exception as exc:
                    logger.warning(
                        "event %s %s on %r not posted (dropped): %r",
                        record.type,
                        record.reason,
                        entity_id,
                        exc,
                    )
                aggregate.posted_count = record.count
        finally:
            if aggregate.task is asyncio.current_task():
                aggregate.task = None


class LoopEvents:
    """What a Loop records: failures, dead letters, recoveries; and :func:`event`'s target."""

    def __init__(self, recorder: EventRecorder, leading: Callable[[], bool]) -> None:
        self.recorder = recorder
        self._leading = leading
        self._failing: set[str] = set()  # entities whose last outcome was recorded as a failure

    def record(self, entity_id: str, type: str, reason: str, message: str) -> bool:
        if not self._leading():
            return False
        self.recorder.record(entity_id, type, reason, message)
        return True

    def failed(self, entity_id: str, exc: BaseException) -> None:
        if entity_id:
            self._failing.add(entity_id)
            self.record(entity_id, WARNING, RECONCILE_ERROR, str(exc) or repr(exc))

    def dead_lettered(self, entity_id: str, reason: str) -> None:
        if entity_id:
            self._failing.add(entity_id)
            self.record(entity_id, WARNING, DEAD_LETTERED, reason)

    def succeeded(self, entity_id: str) -> None:
        if entity_id in self._failing:
            self._failing.discard(entity_id)
            self.record(entity_id, NORMAL, RECONCILED, "reconciled after a failure")


_current: contextvars.ContextVar[LoopEvents | None] = contextvars.ContextVar(
    "kopf_reconcile_events", default=None
)


def bind_events(events: LoopEvents | None) -> None:
    """Make ``events`` the target of :func:`event` in this task (a Loop's worker)."""
    _current.set(events)


def event(req: Request | str, type: str, reason: str, message: str) -> bool:
    """Record an event on the entity of ``req`` from inside a reconcile.

    ``type`` is ``"Normal"`` or ``"Warning"``; ``reason`` a short UpperCamelCase word
    (``"Configured"``); ``message`` what a person should read (at most 1024
    characters are kept). The event is aggregated and posted in the background like
    the Loop's own. Returns False (and records nothing) outside a reconcile, when the
    Loop has no event sink, or when it no longer leads.
    """
    entity_id = req.entity_id if isinstance(req, Request) else req
    if not isinstance(entity_id, str):
        raise TypeError(f"req must be a Request or an entity id, got {req!r}")
    if type not in _TYPES:
        raise ValueError(f"event type must be 'Normal' or 'Warning', got {type!r}")
    if not isinstance(reason, str) or not reason or not reason.isalnum():
        raise ValueError(f"event reason must be a non-empty alphanumeric word, got {reason!r}")
    if not isinstance(message, str):
        raise TypeError(f"event message must be a string, got {message!r}")
    events = _current.get()
    if events is None or not entity_id:
        return False
    return events.record(entity_id, type, reason, message)
