"""The watch's view of the objects: the latest body per entity, and the requests it triggers.

An :class:`ObjectCache` is fed by a watch (the kopf shim's ``on.event`` handler):
every event stores the object's latest body under its entity id (or drops it
when the object is gone) and then asks the Loop to reconcile that entity. So a
reconcile always reads a body at least as new as the event that triggered it,
and the cache holds exactly the live objects: it is bounded by the live object
set, nothing stays behind a deletion.

The cache is also the Loop's :class:`~kopf_reconcile.triggers.Trigger`: while
the Loop runs it, :meth:`ObjectCache.update` and :meth:`ObjectCache.remove`
hand requests to the Loop with its backpressure (a full intake makes the watch
wait; nothing is dropped). Requests made before a Loop runs it wait for one.
Once the Loop stops it (or its owner calls :meth:`ObjectCache.close`), requests
are dropped instead, so the watch never waits for a Loop that is gone; bodies
are still stored. A resync-all asks it to re-emit every cached entity, which it
does from its own task, never from the worker that asked.

Inside a reconcile, :func:`cached` returns the body of the entity being
reconciled (a private copy), or ``None`` when the object no longer exists.

Incarnations. An object deleted and created again under the same name is a
new object (a new ``metadata.uid``), and the watch may deliver the old one's
late events (kopf handles each uid in its own worker) after the new one's.
``creationTimestamp`` has whole seconds, so both may carry the same one.
The cache therefore keeps the latest body of each uid under an entity id (its
incarnations): an event updates only its own uid's body, a DELETED removes
only its own uid's body (and events of a uid known to be deleted are ignored
from then on), so an entity holds only incarnations not yet seen deleted.
The *current* incarnation, the one :meth:`ObjectCache.get` returns, is the one
with the later ``creationTimestamp``; on a tie, the uid the cache first saw
later (its events are processed after the older object's were). Deleting the
current incarnation falls back to another one still live. A body without a
uid cannot be told apart from an incarnation: it replaces them all, and any
deletion of the entity removes it.

What is kept. Before a body is stored, the cache's *transform* trims it: by
default :func:`strip_managed_fields` drops ``metadata.managedFields`` and the
``kubectl.kubernetes.io/last-applied-configuration`` annotation, which no
reconciler reads and which often outweigh the rest of the object (as
controller-runtime users do with a cache transform). ``transform=None`` keeps
bodies whole; any other callable replaces the default. A transform must not
change its argument (the watch owns it): it returns a new body or the same one.
The cache then keeps each body serialised (``pickle``, a few hundred bytes for a
small custom resource instead of a few kilobytes of nested dicts, and the watch's
own dicts are not kept alive); :meth:`ObjectCache.get` makes its private copy from
those bytes, faster than a deep copy of the dicts. A body that cannot be pickled
(a transform returning some other mapping type) is kept as it is and deep-copied.

Own events. With ``skip_same_generation``, an update whose ``metadata.generation``
equals the one of the body already cached for that object stores the new body
but requests nothing (controller-runtime's ``GenerationChangedPredicate``): a
reconciler that patches only its object's status does not trigger itself again.
Creations, deletions, bodies without a generation and resyncs always request.

Deletions and selection. Only what the cache holds can be gone for the
reconciler: the deletion of an object it never held (say, one outside a label
selection) requests nothing. An object that leaves the selection is forgotten
with :meth:`ObjectCache.forget`, one incarnation at a time and without being
marked deleted, since it may match again. A deletion the watch missed while it
had to list again is reported by the kopf shim as a DELETED (see
:mod:`kopf_reconcile.integration.relisting`).
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import dataclasses
import itertools
import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from kopf_reconcile.api import Request
from kopf_reconcile.triggers import Emit, resync_emit

__all__ = ["LAST_APPLIED", "ObjectCache", "Transform", "cached", "strip_managed_fields"]

Body = dict[str, Any]
Transform = Callable[[Mapping[str, Any]], Mapping[str, Any]]

LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def strip_managed_fields(body: Mapping[str, Any]) -> Mapping[str, Any]:
    """The default cache transform: ``body`` without managedFields and the last-applied copy.

    ``body`` itself is never changed: when there is something to drop, the result is a
    shallow copy with new ``metadata`` (and ``annotations``) mappings; otherwise it is
    ``body``.
    """
    metadata = body.get("metadata")
    if not isinstance(metadata, Mapping):
        return body
    annotations = metadata.get("annotations")
    has_last_applied = isinstance(annotations, Mapping) and LAST_APPLIED in annotations
    if "managedFields" not in metadata and not has_last_applied:
        return body
    trimmed = {k: v for k, v in metadata.items() if k != "managedFields"}
    if has_last_applied:
        assert isinstance(annotations, Mapping)
        trimmed["annotations"] = {k: v for k, v in annotations.items() if k != LAST_APPLIED}
    return {**body, "metadata": trimmed}


# Deleted uids remembered to ignore their late events: a window, not a history.
GONE_MEMORY = 4096

_current: contextvars.ContextVar[ObjectCache | None] = contextvars.ContextVar(
    "kopf_reconcile_object_cache", default=None
)


@dataclasses.dataclass(slots=True)
class _Incarnation:
    stored: bytes | Mapping[str, Any]  # the pickled body (else the body: see compact_body)
    seen: int  # when the cache first saw this uid under its entity: breaks creation-time ties
    created: str  # metadata.creationTimestamp: the later one is the current incarnation
    generation: object  # metadata.generation (None without one)

    @classmethod
    def of(cls, body: Mapping[str, Any], seen: int) -> _Incarnation:
        return cls(compact_body(body), seen, _created(body), _generation(body))

    def body(self) -> Body:
        """A private copy of the body."""
        return restored_body(self.stored)


def compact_body(body: Mapping[str, Any]) -> bytes | Mapping[str, Any]:
    """``body`` pickled (compact, and a fresh copy on every load), else ``body`` itself."""
    if type(body) is dict:
        try:
            return pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError, RecursionError):
            pass
    return body


def restored_body(kept: bytes | Mapping[str, Any]) -> Body:
    """A private copy of a body :func:`compact_body` kept."""
    if isinstance(kept, bytes):
        loaded: Body = pickle.loads(kept)
        return loaded
    return copy.deepcopy(dict(kept))


class ObjectCache:
    """Latest object bodies by entity id; the trigger that turns watch events into requests."""

    def __init__(self, *, transform: Transform | None = strip_managed_fields) -> None:
        """``transform``: applied to each body before it is stored (None: keep it whole)."""
        self._transform = transform
        # entity id -> uid (None: a body without one) -> the latest body of that uid
        self._entities: dict[str, dict[str | None, _Incarnation]] = {}
        self._seen = itertools.count()
        self._gone: OrderedDict[str, None] = OrderedDict()
        self._emit: Emit | None = None
        self._closed = False  # the Loop stopped: requests are dropped, not left waiting
        self._wake = asyncio.Event()  # set while a Loop runs this trigger, and once closed
        self._resync = asyncio.Event()

    def __len__(self) -> int:
        return len(self._entities)

    def __contains__(self, entity_id: object) -> bool:
        return entity_id in self._entities

    def entities(self) -> list[str]:
        """The entity ids held now (a snapshot)."""
        return list(self._entities)

    def get(self, entity_id: str) -> Body | None:
        """A private copy of the latest body of ``entity_id``, or None if it does not exist."""
        incarnations = self._entities.get(entity_id)
        if not incarnations:
            return None
        # Usually one incarnation; two only between a recreation and the old one's DELETED.
        current = max(incarnations.values(), key=lambda i: (i.created, i.seen))
        return current.body()

    # -- the watch side ----------------------------------------------------------------

    async def update(
        self, entity_id: str, body: Mapping[str, Any], *, skip_same_generation: bool = False
    ) -> None:
        """The object exists with this body: store it, then request a reconcile.

        ``skip_same_generation``: request nothing when the body cached for this object
        has the same ``metadata.generation`` (an update of status or metadata only).
        """
        if self.keep(entity_id, body, skip_same_generation=skip_same_generation):
            await self._request(entity_id)

    def keep(
        self, entity_id: str, body: Mapping[str, Any], *, skip_same_generation: bool = False
    ) -> bool:
        """Store the body as :meth:`update` does, requesting nothing; whether to request."""
        uid = _uid(body)
        if uid is not None and uid in self._gone:
            return True  # a late event of a deleted incarnation: stored no more
        if self._transform is not None:
            body = self._transform(body)
        incarnations = self._entities.get(entity_id)
        if incarnations is None or uid is None or None in incarnations:
            incarnations = self._entities[entity_id] = {}
        known = incarnations.get(uid)
        seen = next(self._seen) if known is None else known.seen
        stored = incarnations[uid] = _Incarnation.of(body, seen)
        # Unless the reconciler has seen this generation already.
        return not (
            skip_same_generation
            and known is not None
            and stored.generation is not None
            and stored.generation == known.generation
        )

    def holds(self, entity_id: str, uid: str) -> bool:
        """Whether the incarnation ``uid`` of ``entity_id`` is cached (not seen deleted)."""
        incarnations = self._entities.get(entity_id)
        return incarnations is not None and uid in incarnations

    async def request(self, entity_id: str) -> None:
        """Request a reconcile of ``entity_id`` (a change of something it depends on)."""
        await self._request(entity_id)

    async def remove(self, entity_id: str, body: Mapping[str, Any] | None = None) -> None:
        """The object is gone: forget it, then request a reconcile if it was cached.

        With ``body`` (a DELETED event), only that incarnation is forgotten, and its
        late events are ignored from now on. The deletion of an object the cache never
        held (one the reconciler never selected) requests nothing: there is nothing
        the reconciler has seen to clean up.
        """
        if self.drop(entity_id, body):
            await self._request(entity_id)

    def drop(self, entity_id: str, body: Mapping[str, Any] | None = None) -> bool:
        """Forget the object as :meth:`remove` does, requesting nothing; whether it was held."""
        uid = _uid(body)
        if uid is not None:
            self._gone[uid] = None
            while len(self._gone) > GONE_MEMORY:
                self._gone.popitem(last=False)
        return self._forget(entity_id, uid)

    async def forget(self, entity_id: str, body: Mapping[str, Any]) -> None:
        """The object left the selection: forget this incarnation, request a reconcile if held.

        Unlike :meth:`remove`, its uid is not marked gone (it may match again), and only
        its own incarnation goes: a late event of an old uid that no longer matches
        leaves a newer incarnation of the entity in place.
        """
        if self._forget(entity_id, _uid(body)):
            await self._request(entity_id)

    def release(self, entity_id: str, body: Mapping[str, Any]) -> None:
        """The object is no longer watched here (another replica's shard): forget this
        incarnation, requesting nothing and marking nothing gone (it may come back)."""
        self._forget(entity_id, _uid(body))

    def _forget(self, entity_id: str, uid: str | None) -> bool:
        """Drop ``uid``'s incarnation (None: all of them); whether anything was dropped."""
        incarnations = self._entities.get(entity_id)
        if incarnations is None:
            return False
        if uid is None:
            del self._entities[entity_id]
            return True
        # A body without a uid cannot be told apart from this incarnation: it goes too.
        dropped = [incarnations.pop(key) for key in (uid, None) if key in incarnations]
        if not incarnations:
            del self._entities[entity_id]  # nothing stays behind a deletion
        return bool(dropped)

    def request_resync(self) -> None:
        """Re-emit every cached entity soon (from the trigger's task; returns at once)."""
        self._resync.set()

    # -- the Loop side -------------------------------------------------------------------

    async def run(self, emit: Emit) -> None:
        """The Trigger protocol: accept the Loop's emit, serve resyncs until cancelled."""
        if self._emit is not None:
            raise RuntimeError("this ObjectCache already feeds a running Loop")
        self._emit = emit
        self._closed = False  # a Loop feeds on it (again)
        self._wake.set()
        emit_resync = resync_emit(emit)  # behind fresh events, never starved by them
        try:
            while True:
                await self._resync.wait()
                self._resync.clear()
                for entity_id in list(self._entities):
                    await emit_resync(Request(entity_id))
        except asyncio.CancelledError:
            self.close()  # a Loop cancels its triggers only when it stops (crashes restart)
            raise
        finally:
            self._emit = None
            if not self._closed:
                self._wake.clear()  # crashed: the Loop restarts it, requests wait meanwhile

    def close(self) -> None:
        """Drop requests from now on instead of waiting for a Loop, until a Loop runs it again.

        The Loop stopping this trigger closes it; the owner of both closes it too when
        the trigger may not be running then (restarting after a crash).
        """
        self._closed = True
        self._wake.set()

    async def _request(self, entity_id: str) -> None:
        # Before a Loop runs this trigger (or while it restarts it) requests wait for it.
        # Once the Loop stops they are dropped: nothing here would reconcile them, and
        # whoever reconciles next re-observes every object (a new leader's resync-all; on
        # a restart, the watch's initial listing).
        while not self._closed:
            emit = self._emit
            if emit is not None:
                await emit(Request(entity_id))
                return
            await self._wake.wait()

    def __repr__(self) -> str:
        return f"<ObjectCache {len(self._entities)} objects>"


def _uid(body: Mapping[str, Any] | None) -> str | None:
    uid = ((body or {}).get("metadata") or {}).get("uid")
    return uid if isinstance(uid, str) and uid else None


def _generation(body: Mapping[str, Any]) -> object:
    return (body.get("metadata") or {}).get("generation")


def _created(body: Mapping[str, Any]) -> str:
    # RFC 3339 in UTC with whole seconds, as the API server writes it: sorts as text.
    return str((body.get("metadata") or {}).get("creationTimestamp") or "")


def cached(req: Request) -> Body | None:
    """The latest body the watch delivered for ``req``'s entity, or None once it is deleted.

    Only meaningful inside a reconcile registered with ``@kopf_reconcile.reconciler``;
    anywhere else it raises :class:`LookupError` (None would mean "deleted").
    """
    cache = _current.get()
    if cache is None:
        raise LookupError(
            "kopf_reconcile.cached() works only inside a reconcile of a @kopf_reconcile.reconciler"
        )
    return cache.get(req.entity_id)


@contextmanager
def serving(cache: ObjectCache) -> Iterator[None]:
    """Make ``cache`` the one :func:`cached` reads, for the duration of one reconcile."""
    token = _current.set(cache)
    try:
        yield
    finally:
        _current.reset(token)
