"""The object store: live objects, the cluster-wide resourceVersion, and a bounded change history.

Like etcd behind kube-apiserver, every write takes the next value of one cluster-wide
revision counter, which becomes the object's ``metadata.resourceVersion``. Each write is
also appended to a history of changes that watches replay from a given resourceVersion
(from the very first write, as a fresh etcd does) and that exact reads of a past revision
rewind (a list at ``resourceVersionMatch=Exact``, a ``continue`` token's snapshot). The
history is a window of the last ``history_size`` changes: a revision older than the window
is told it expired (410), as a compacted etcd does. Memory is therefore bounded by the live
objects plus the window, however many requests are served.

Stored objects are never mutated: every write stores a new dict, so the history and open
watches can hold references without copying.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from kopf_reconcile.testing.emulated_apiserver import errors
from kopf_reconcile.testing.emulated_apiserver.resources import StorageKey

Object = dict[str, Any]
ChangeType = Literal["ADDED", "MODIFIED", "DELETED"]
Predicate = Callable[[Object], bool]


@dataclass(frozen=True, slots=True)
class Change:
    """One committed write: the state after it (for a deletion, the last state) and before it."""

    revision: int
    key: StorageKey
    type: ChangeType
    object: Object
    previous: Object | None


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """An event as one watcher sees it (selectors can turn a modification into ADDED/DELETED)."""

    type: ChangeType
    object: Object


class Watcher:
    """One open watch: the changes of one resource that pass its filter, queued until sent.

    The queue is bounded: a client that does not read its stream is cut off (kube-apiserver
    also terminates watchers that fall too far behind), which keeps memory bounded.
    """

    def __init__(self, key: StorageKey, matches: Predicate, limit: int, after: int) -> None:
        self.key = key
        self._matches = matches
        self._limit = limit
        self._after = after  # changes up to this revision were asked not to be sent
        self._pending: deque[WatchEvent] = deque()
        self._wakeup = asyncio.Event()
        self.closed = False

    def offer(self, change: Change) -> None:
        if self.closed or change.revision <= self._after:
            return
        event = self.as_seen(change)
        if event is None:
            return
        if len(self._pending) >= self._limit:
            self.close()
            return
        self._pending.append(event)
        self._wakeup.set()

    def as_seen(self, change: Change) -> WatchEvent | None:
        now_matches = self._matches(change.object)
        if change.type != "MODIFIED" or change.previous is None:
            return WatchEvent(change.type, change.object) if now_matches else None
        before_matched = self._matches(change.previous)
        if before_matched and now_matches:
            return WatchEvent("MODIFIED", change.object)
        if now_matches:
            return WatchEvent("ADDED", change.object)
        if before_matched:
            return WatchEvent("DELETED", change.object)
        return None

    def close(self) -> None:
        self.closed = True
        self._wakeup.set()

    async def wait(self) -> None:
        """Wait until there are events to send or the watcher is closed."""
        await self._wakeup.wait()

    def drain(self) -> list[WatchEvent]:
        events = list(self._pending)
        self._pending.clear()
        if not self.closed:
            self._wakeup.clear()
        return events

    @property
    def backlog(self) -> int:
        return len(self._pending)


class Store:
    """Live objects keyed by resource, namespace and name; revisions; history; watchers."""

    def __init__(self, *, history_size: int, watch_queue_size: int) -> None:
        if history_size < 1 or watch_queue_size < 1:
            raise ValueError("history_size and watch_queue_size must be positive")
        self.revision = 0
        self._objects: dict[StorageKey, dict[tuple[str, str], Object]] = {}
        self._history: deque[Change] = deque(maxlen=history_size)
        self._history_floor = 0  # the oldest revision a watch may still resume from
        self._watchers: dict[StorageKey, set[Watcher]] = {}
        self._watch_queue_size = watch_queue_size
        self._advanced: asyncio.Event | None = None  # set by the next write, for waiters

    # Reading.

    def get(self, key: StorageKey, namespace: str, name: str) -> Object | None:
        bucket = self._objects.get(key)
        return None if bucket is None else bucket.get((namespace, name))

    def items(self, key: StorageKey, namespace: str | None = None) -> list[Object]:
        """Objects of a resource (optionally of one namespace), ordered by namespace and name."""
        bucket = self._objects.get(key, {})
        keys = (
            sorted(bucket) if namespace is None else sorted(k for k in bucket if k[0] == namespace)
        )
        return [bucket[k] for k in keys]

    def count(self, key: StorageKey) -> int:
        return len(self._objects.get(key, {}))

    def oldest(self, key: StorageKey) -> Object | None:
        """The object of a resource created longest ago (dicts keep insertion order)."""
        bucket = self._objects.get(key)
        return next(iter(bucket.values())) if bucket else None

    def namespace_is_empty(self, namespace: str) -> bool:
        return not any(k[0] == namespace for bucket in self._objects.values() for k in bucket)

    def items_at(
        self, key: StorageKey, namespace: str | None, revision: int
    ) -> list[Object] | None:
        """The objects of a resource as they were at ``revision``; None if the window lost it.

        The current objects with every recorded change after ``revision`` undone, newest
        first: what etcd answers for a read at that revision.
        """
        if revision < self._history_floor or revision > self.revision:
            return None
        state = dict(self._objects.get(key, {}))
        for change in reversed(self._history):
            if change.revision <= revision:
                break
            if change.key != key:
                continue
            meta = change.object["metadata"]
            where = (meta.get("namespace", ""), meta["name"])
            if change.previous is None:
                state.pop(where, None)
            else:
                state[where] = change.previous
        return [state[k] for k in sorted(state) if namespace is None or k[0] == namespace]

    async def wait_for_revision(self, revision: int, timeout: float) -> bool:
        """Wait until the store has reached ``revision``; False if it has not after ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.revision < revision:
            if self._advanced is None:
                self._advanced = asyncio.Event()
            try:
                async with asyncio.timeout_at(deadline):
                    await self._advanced.wait()
            except TimeoutError:
                return self.revision >= revision
        return True

    # Writing: each write takes the next revision and is recorded for watches.

    def put(self, key: StorageKey, obj: Object, previous: Object | None) -> Object:
        """Store a new state of an object (its metadata complete but for resourceVersion)."""
        self.revision += 1
        stored = _with_resource_version(obj, self.revision)
        meta = stored["metadata"]
        self._objects.setdefault(key, {})[(meta.get("namespace", ""), meta["name"])] = stored
        self._record(
            Change(self.revision, key, "MODIFIED" if previous else "ADDED", stored, previous)
        )
        return stored

    def remove(self, key: StorageKey, obj: Object) -> Object:
        """Delete an object; the deletion event carries its last state at the new revision."""
        meta = obj["metadata"]
        bucket = self._objects.get(key, {})
        bucket.pop((meta.get("namespace", ""), meta["name"]), None)
        if not bucket:
            self._objects.pop(key, None)
        self.revision += 1
        gone = _with_resource_version(obj, self.revision)
        self._record(Change(self.revision, key, "DELETED", gone, obj))
        return gone

    def _record(self, change: Change) -> None:
        if len(self._history) == self._history.maxlen:
            self._history_floor = self._history[0].revision
        self._history.append(change)
        if self._advanced is not None:
            self._advanced.set()
            self._advanced = None
        for watcher in tuple(self._watchers.get(change.key, ())):
            watcher.offer(change)
            if watcher.closed:
                self.unwatch(watcher)

    # Watching.

    def watch(
        self, key: StorageKey, matches: Predicate, since: int | None
    ) -> tuple[list[WatchEvent], Watcher]:
        """Open a watcher; with ``since``, also return the recorded changes after that revision.

        Without ``since``, the caller sends the current objects as ADDED instead. Nothing awaits
        between reading the history and registering, so no change can fall in between.
        """
        replay: list[WatchEvent] = []
        watcher = Watcher(key, matches, self._watch_queue_size, since or 0)
        if since is not None:
            if since < self._history_floor:
                raise errors.expired(f"too old resource version: {since} ({self._history_floor})")
            for change in self._changes_after(since):
                if change.key == key:
                    seen = watcher.as_seen(change)
                    if seen is not None:
                        replay.append(seen)
        self._watchers.setdefault(key, set()).add(watcher)
        return replay, watcher

    def _changes_after(self, revision: int) -> Iterable[Change]:
        # The history is ordered by revision; skip from the right end, most watches are recent.
        start = len(self._history)
        while start > 0 and self._history[start - 1].revision > revision:
            start -= 1
        for index in range(start, len(self._history)):
            yield self._history[index]

    def unwatch(self, watcher: Watcher) -> None:
        watcher.close()
        watchers = self._watchers.get(watcher.key)
        if watchers is not None:
            watchers.discard(watcher)
            if not watchers:
                del self._watchers[watcher.key]

    def watchers(self) -> list[Watcher]:
        return [watcher for watchers in self._watchers.values() for watcher in watchers]

    # Introspection for boundedness checks.

    def sizes(self) -> dict[str, int]:
        return {
            "objects": sum(len(bucket) for bucket in self._objects.values()),
            "history": len(self._history),
            "watchers": sum(len(watchers) for watchers in self._watchers.values()),
            "watch_backlog": sum(w.backlog for w in self.watchers()),
        }


def _with_resource_version(obj: Object, revision: int) -> Object:
    return {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(revision)}}
