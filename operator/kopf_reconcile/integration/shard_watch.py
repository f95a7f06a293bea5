"""A sharded reconciler's watch that follows its leadership: only the shards it leads.

Sharding splits the reconciles; it splits the watch only when the API server can tell a
shard's objects apart. With ``shard_by_namespace=True`` a shard is a contiguous range of
the FNV-1a 64 hash of the namespace (:mod:`kopf_reconcile.sharding`), which a KEP-5866
``shardSelector`` (Kubernetes 1.36+, feature gate ``ShardedListAndWatch``) selects
exactly. Then the watch stream of the reconciled resource carries the objects of the
shards this replica leads, and no others:

* :class:`ShardWatch` follows the replica's leadership of the reconciler's shard leases
  (:meth:`~kopf_reconcile.control.holding.LeaseHolder.observe`), and tells which shards
  each stream *covers*: those of its last complete listing. The stream stops at every
  change of the led shards and starts again with the new selector: a cold list of the
  shards led from then on (that list is the price of the memory saved: a new holder
  lists its shard before it reconciles it).
* :func:`narrowed_stream` is that stream. An object the server sends outside the
  selection (a server without the gate ignores the selector, and a list of custom
  resources does not say whether it filtered) is dropped on the client: the stream
  carries exactly the selection either way, so memory shrinks only where the server
  filters, and correctness never depends on it. When a complete listing arrives, an
  object it lacks that is still selected was deleted (reported, as after a relist); one
  no longer selected is *released*: forgotten by the cache without a reconcile, since it
  still exists, in a shard this replica stopped leading.
* A reconcile of an entity waits until every stream of its reconciler covers the
  entity's shard (:meth:`ShardWatch.until_covered`): right after a takeover the cache
  holds none of the shard's objects until its listing completes, and an entity absent
  for that reason must never be reconciled as deleted.

Only streams that feed nothing but such reconcilers (no other kopf handler of the
resource, no ``shard_selectors`` of the user's for it) of a namespaced resource are
narrowed; every other stream carries everything, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from typing import Any

from kopf_reconcile.control.holding import LeadershipChange, LeaseHolder
from kopf_reconcile.integration.relisting import ListingClock, ListingTracker
from kopf_reconcile.sharding import ShardAssignment, shard_id

__all__ = ["ShardWatch", "narrowed_stream"]

logger = logging.getLogger("kopf_reconcile.kopf")

# After the led shards change, how long more changes are awaited before the stream starts
# again: a replica taking several shards at once lists them once, not once per shard.
SETTLE_SECONDS = 0.2

Event = Mapping[str, Any]


class ShardWatch:
    """The shards one reconciler leads in this replica, and what its streams cover."""

    def __init__(self, reconciler_id: str, assignment: ShardAssignment) -> None:
        if not assignment.server_selectable:
            raise ValueError(f"the API server cannot select the shards of {assignment!r}")
        self.assignment = assignment
        self.reconciler_id = reconciler_id
        self._leases = {shard_id(reconciler_id, k): k for k in range(assignment.shards)}
        self._led: frozenset[int] = frozenset()
        self._covered: dict[object, frozenset[int]] = {}  # stream -> what its listing holds
        self._changed = asyncio.Event()  # set (and replaced) at every change
        self._unobserve: Callable[[], None] | None = None

    def follow_leadership(self) -> ShardWatch:
        """Follow this process's lease holders from now on (until :meth:`close`)."""
        if self._unobserve is None:
            self._unobserve = LeaseHolder.observe(self.observe)
        return self

    def close(self) -> None:
        if self._unobserve is not None:
            self._unobserve()
            self._unobserve = None

    def observe(self, change: LeadershipChange) -> None:
        """A lease holder of this process started or stopped leading (a LeadershipObserver)."""
        k = self._leases.get(change.reconciler_id)
        if k is None:
            return
        led = self._led | {k} if change.leading else self._led - {k}
        if led != self._led:
            self._led = led
            self._notify()

    def led(self) -> frozenset[int]:
        return self._led

    def selects(self, led: frozenset[int], body: object) -> bool:
        """Whether ``body``'s namespace falls in one of the ``led`` shards."""
        metadata = body.get("metadata") if isinstance(body, Mapping) else None
        namespace = metadata.get("namespace") if isinstance(metadata, Mapping) else None
        if not isinstance(namespace, str):
            return False
        return self.assignment.shard_of_namespace(namespace) in led

    def covers(self, shard: int) -> bool:
        """Whether every stream of the reconciler has listed ``shard`` completely."""
        return bool(self._covered) and all(shard in c for c in self._covered.values())

    async def until_covered(self, shard: int) -> None:
        while not self.covers(shard):
            await self.changed()

    def changed(self) -> Coroutine[Any, Any, bool]:
        """What returns at the next change of the led shards or of a stream's coverage
        after this call (the event is bound now, not when the coroutine first runs)."""
        return self._changed.wait()

    def stream_covers(self, stream: object, shards: frozenset[int] | None) -> None:
        """``stream`` now holds ``shards`` completely (``None``: the stream ended)."""
        if shards is None:
            self._covered.pop(stream, None)
        else:
            self._covered[stream] = shards
        self._notify()

    def covered_by(self, stream: object) -> frozenset[int]:
        return self._covered.get(stream, frozenset())

    def _notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()


async def narrowed_stream(
    open_stream: Callable[[str], AsyncGenerator[Any, None]],
    watches: list[ShardWatch],
    *,
    resource: str,
    listed_marker: object,
    tracker: ListingTracker,
    feed: Callable[[Event], Awaitable[None]],
    release: Callable[[Mapping[str, Any]], Awaitable[None]],
) -> AsyncIterator[Any]:
    """kopf's stream of one resource, narrowed to the shards ``watches`` lead, for ever.

    ``open_stream(selector)`` starts kopf's stream with that ``shardSelector``. Every
    event within the selection is tracked and fed; nothing but the listing marker (and
    what is not an event) goes on to kopf, whose only handlers of the resource are the
    fed reconcilers'.
    """
    stream_key = object()
    try:
        while True:
            led = {w: w.led() for w in watches}
            for w in watches:  # what stays covered while the new selection is listed
                w.stream_covers(stream_key, w.covered_by(stream_key) & led[w])
            changed = asyncio.ensure_future(_any_change(watches, led))
            try:
                selectors = [w.assignment.selector(led[w]) for w in watches]
                selector = " || ".join(s for s in selectors if s)
                if not selector:  # nothing led: no stream; forget what was watched
                    await _sweep(tracker, _nothing, feed, release)
                    for w in watches:
                        w.stream_covers(stream_key, frozenset())
                    await changed
                    continue

                selected = functools.partial(_selected, led)
                logger.info(
                    "the watch of %s carries shards %s (shardSelector %s)",
                    resource,
                    ", ".join(f"{sorted(led[w])} of {w.reconciler_id}" for w in watches),
                    selector,
                )
                # A listing cut short by the change is not merged with this stream's: it
                # lists its own selection from the start, and only that listing sweeps.
                tracker.restart_listing()
                async with contextlib.aclosing(open_stream(selector)) as stream:
                    passed: asyncio.Queue[Any] = asyncio.Queue()
                    covered = functools.partial(_all_cover, watches, stream_key, led)
                    pump = asyncio.ensure_future(
                        _pump(
                            stream,
                            passed,
                            resource=resource,
                            listed_marker=listed_marker,
                            selected=selected,
                            covered=covered,
                            tracker=tracker,
                            feed=feed,
                            release=release,
                        )
                    )
                    try:
                        async for item in _passed(passed, pump, changed):
                            yield item
                    finally:
                        pump.cancel()
                        await asyncio.gather(pump, return_exceptions=True)
            finally:
                changed.cancel()
    finally:
        for w in watches:
            w.stream_covers(stream_key, None)


def _selected(led: dict[ShardWatch, frozenset[int]], body: object) -> bool:
    return any(w.selects(shards, body) for w, shards in led.items())


def _nothing(body: object) -> bool:
    return False


async def _sweep(
    tracker: ListingTracker,
    selected: Callable[[object], bool],
    feed: Callable[[Event], Awaitable[None]],
    release: Callable[[Mapping[str, Any]], Awaitable[None]],
) -> None:
    """A listing is complete (or nothing is selected): report the deleted, release the rest."""
    deleted, released = tracker.listed_within(selected)
    for body in released:
        await release(body)
    for event in deleted:
        await feed(event)


async def _any_change(watches: list[ShardWatch], led: dict[ShardWatch, frozenset[int]]) -> None:
    """Returns once a reconciler's led shards differ from ``led``, still after a moment
    for more changes (a shard lost and regained at once restarts nothing)."""
    while True:
        while all(w.led() == led[w] for w in watches):
            waits = [asyncio.ensure_future(w.changed()) for w in watches]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
        await asyncio.sleep(SETTLE_SECONDS)
        if any(w.led() != led[w] for w in watches):
            return


_ENDED = object()  # the stream ended (what follows the last item a pump passes on)


async def _pump(
    stream: AsyncIterator[Any],
    passed: asyncio.Queue[Any],
    *,
    resource: str,
    listed_marker: object,
    selected: Callable[[object], bool],
    covered: Callable[[], None],
    tracker: ListingTracker,
    feed: Callable[[Event], Awaitable[None]],
    release: Callable[[Mapping[str, Any]], Awaitable[None]],
) -> None:
    """Feed ``stream``'s events within the selection (one task for the whole stream, not
    one per event); pass what goes on to kopf (the listing marker, once the listing is
    swept and covered; what is not an event) into ``passed``."""
    foreign = False
    clock = ListingClock()
    clock.start()
    async for item in stream:
        if item is listed_marker:
            logger.info("listed %s: %s", resource, clock.listed())
            await _sweep(tracker, selected, feed, release)
            covered()
            passed.put_nowait(item)
        elif isinstance(item, Mapping):
            clock.observe(item)
            if not selected(item.get("object")):
                if not foreign and item.get("type") != "BOOKMARK":
                    foreign = True
                    logger.info(
                        "the API server does not filter by shard: objects of other shards "
                        "are dropped here"
                    )
                continue
            tracker.observe(item)
            await feed(item)
        else:
            passed.put_nowait(item)
    passed.put_nowait(_ENDED)


async def _passed(
    passed: asyncio.Queue[Any], pump: asyncio.Future[None], stop: asyncio.Future[None]
) -> AsyncIterator[Any]:
    """What the pump passes on, until its stream ends (its error raised) or ``stop`` is done."""
    while True:
        getter = asyncio.ensure_future(passed.get())
        try:
            await asyncio.wait({getter, pump, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()
        if getter.done() and not getter.cancelled():
            item = getter.result()
            if item is _ENDED:
                return
            yield item
        elif pump.done():
            pump.result()  # what the stream raised, if it did; else _ENDED is queued
        else:
            return  # stopped


def _all_cover(
    watches: list[ShardWatch], stream: object, led: dict[ShardWatch, frozenset[int]]
) -> None:
    for w in watches:
        w.stream_covers(stream, led[w])
