"""Relists: an object a fresh listing no longer holds was deleted while the watch was away.

A watch resumes from the last ``resourceVersion`` it saw. When the API server no
longer has the changes since then (410 Gone: etcd compacted them, or the watch
cache moved on), the client lists the objects again and watches from the
listing's version. A deletion that happened in between never produces a
DELETED event: without more, the object would stay in every cache fed by the
watch, and its reconciler would never hear that it is gone.

client-go's informers close that gap in ``DeltaFIFO.Replace``: every object they
knew that the new listing lacks is reported deleted, with the last state they
saw. :class:`ListingTracker` does the same for one watch stream. It learns the
live objects from the stream itself (listed objects, ADDED and MODIFIED; a
DELETED forgets), collects the uids of a listing while it is delivered, and
when the stream says the listing is complete it returns one DELETED event, with
the last body seen, for each known object the listing did not hold. The
stream's consumer delivers those like any other event, in the stream's order:
so each one reaches an object's handlers after every event of that object that
came before it.

Objects are told apart by ``metadata.uid``: an object deleted and created again
under the same name during the gap is a new uid in the listing, and the old uid
is reported deleted. Only a complete listing sweeps; one cut short (the
connection broke mid-way) is merged with the next listing, which can only keep
more objects, never report a live one deleted.

Memory. The tracker holds every live object of its stream, so it keeps each last
body pickled (a few hundred bytes for a small custom resource, instead of the
watch's nested dicts, which it would otherwise keep alive next to every cache).
When the stream's only consumers need no more than the object's identity (the kopf
shim's reconcilers, which forget a deleted object by its uid), ``whole_bodies=False``
keeps just that: apiVersion, kind, name, namespace and uid.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from kopf_reconcile.cache import compact_body, restored_body

__all__ = ["ListingClock", "ListingTracker"]

Event = Mapping[str, Any]


class ListingTracker:
    """The live objects of one watch stream, and what a completed listing no longer holds."""

    def __init__(self, *, whole_bodies: bool = True) -> None:
        """``whole_bodies=False``: report a deletion with the object's identity only."""
        # uid -> the last body the stream carried (see _kept)
        self._live: dict[str, object] = {}
        self._listing: set[str] | None = None  # uids of the listing being delivered
        self._whole_bodies = whole_bodies

    def __len__(self) -> int:
        return len(self._live)

    def observe(self, event: Event) -> None:
        """One event of the stream; type None marks an object of a listing (kopf's convention)."""
        body = event.get("object")
        uid = _uid(body)
        if uid is None or not isinstance(body, Mapping):
            return  # not an object (a bookmark, an error): nothing to track
        kind = event.get("type")
        if kind is None:
            if self._listing is None:
                self._listing = set()
            self._listing.add(uid)
            self._live[uid] = self._kept(body)
        elif kind in ("ADDED", "MODIFIED"):
            self._live[uid] = self._kept(body)
        elif kind == "DELETED":
            self._live.pop(uid, None)

    def listed(self) -> list[dict[str, Any]]:
        """The listing is complete: a DELETED event for each known object it did not hold."""
        listing = self._listing if self._listing is not None else set()  # an empty listing
        self._listing = None
        missing = [uid for uid in self._live if uid not in listing]
        return [{"type": "DELETED", "object": _restored(self._live.pop(uid))} for uid in missing]

    def restart_listing(self) -> None:
        """A new stream lists from the start: what a listing cut short held is not kept for it
        (an object of it deleted meanwhile would otherwise count as listed)."""
        self._listing = None

    def listed_within(
        self, selected: Callable[[Mapping[str, Any]], bool]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """As :meth:`listed`, for a stream whose selection just changed: a known object
        ``selected`` rejects is *released* (returned apart, with its last body: it left
        the selection, it was not deleted), whether the listing held it or not."""
        listing = self._listing if self._listing is not None else set()
        self._listing = None
        deleted, released = [], []
        for uid in list(self._live):
            body = _restored(self._live[uid])
            if not selected(body):
                released.append(body)
            elif uid not in listing:
                deleted.append({"type": "DELETED", "object": body})
            else:
                continue
            del self._live[uid]
        return deleted, released

    def _kept(self, body: Mapping[str, Any]) -> object:
        if not self._whole_bodies:
            metadata = body.get("metadata")
            assert isinstance(metadata, Mapping)  # it has a uid
            return _Identity(
                body.get("apiVersion"),
                body.get("kind"),
                metadata.get("name"),
                metadata.get("namespace"),
                metadata.get("uid"),
            )
        return compact_body(body)


class _Identity(NamedTuple):
    """What a tracker without whole bodies keeps of an object."""

    api_version: Any
    kind: Any
    name: Any
    namespace: Any
    uid: Any


def _restored(kept: object) -> dict[str, Any]:
    if isinstance(kept, _Identity):
        api_version, kind, name, namespace, uid = kept
        metadata = {"name": name, "uid": uid}
        if namespace is not None:
            metadata["namespace"] = namespace
        return {"apiVersion": api_version, "kind": kind, "metadata": metadata}
    assert isinstance(kept, bytes | Mapping)
    return restored_body(kept)


def _uid(body: object) -> str | None:
    if not isinstance(body, Mapping):
        return None
    metadata = body.get("metadata")
    uid = metadata.get("uid") if isinstance(metadata, Mapping) else None
    return uid if isinstance(uid, str) and uid else None


class ListingClock:
    """What a listing of one stream cost: its objects, and the wall and CPU seconds from
    its start (the stream's start, else its first object) to its end, for one log line."""

    def __init__(self) -> None:
        self._started: tuple[float, float] | None = None
        self._objects = 0

    def start(self) -> None:
        self._started = (time.monotonic(), time.process_time())
        self._objects = 0

    def observe(self, event: Event) -> None:
        if event.get("type") is None and isinstance(event.get("object"), Mapping):
            if self._started is None:
                self.start()
            self._objects += 1

    def listed(self) -> str:
        """``<N> objects in <s> s, <s> s of CPU`` since the start; the clock stops."""
        wall, cpu = self._started or (time.monotonic(), time.process_time())
        self._started = None
        return (
            f"{self._objects:,} objects in {time.monotonic() - wall:.2f} s, "
            f"{time.process_time() - cpu:.2f} s of CPU"
        )
