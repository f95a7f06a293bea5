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
wait; nothing is dropped). A resync-all asks it to re-emit every cached entity,
which it does from its own task, never from the worker that asked.

Inside a reconcile, :func:`cached` returns the body of the entity being
reconciled (a private copy), or ``None`` when the object no longer exists.

Incarnations. An object deleted and created again under the same name is a
new object (a new ``metadata.uid``), and the watch may deliver the old one's
late events (kopf handles each uid in its own worker) after the new one's.
The cache therefore keys its decisions on uids: a DELETED removes the body
only if it is that object's, events of a uid known to be deleted are ignored,
and of two live-looking incarnations the one created later wins.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from kopf_reconcile.api import Request
from kopf_reconcile.triggers import Emit

__all__ = ["ObjectCache", "cached"]

Body = dict[str, Any]

# Deleted uids remembered to ignore their late events: a window, not a history.
GONE_MEMORY = 4096

_current: contextvars.ContextVar[ObjectCache | None] = contextvars.ContextVar(
    "kopf_reconcile_object_cache", default=None
)


class ObjectCache:
    """Latest object bodies by entity id; the trigger that turns watch events into requests."""

    def __init__(self) -> None:
        self._bodies: dict[str, Mapping[str, Any]] = {}
        self._gone: OrderedDict[str, None] = OrderedDict()
        self._emit: Emit | None = None
        self._feeding = asyncio.Event()  # set while a Loop runs this trigger
        self._resync = asyncio.Event()

    def __len__(self) -> int:
        return len(self._bodies)

    def __contains__(self, entity_id: object) -> bool:
        return entity_id in self._bodies

    def get(self, entity_id: str) -> Body | None:
        """A private copy of the latest body of ``entity_id``, or None if it does not exist."""
        body = self._bodies.get(entity_id)
        return None if body is None else copy.deepcopy(dict(body))

    # -- the watch side ----------------------------------------------------------------

    async def update(self, entity_id: str, body: Mapping[str, Any]) -> None:
        """The object exists with this body: store it, then request a reconcile."""
        if self._is_current(entity_id, body):
            self._bodies[entity_id] = body
        await self._request(entity_id)

    async def remove(self, entity_id: str, body: Mapping[str, Any] | None = None) -> None:
        """The object is gone: forget it, then request a reconcile.

        With ``body`` (a DELETED event), only that incarnation is forgotten, and its
        late events are ignored from now on.
        """
        uid = _uid(body)
        if uid is not None:
            self._gone[uid] = None
            while len(self._gone) > GONE_MEMORY:
                self._gone.popitem(last=False)
        current = self._bodies.get(entity_id)
        if current is not None and (uid is None or _uid(current) in (None, uid)):
            del self._bodies[entity_id]
        await self._request(entity_id)

    def _is_current(self, entity_id: str, body: Mapping[str, Any]) -> bool:
        """Whether ``body`` is (still) the live object under ``entity_id``."""
        uid = _uid(body)
        if uid is not None and uid in self._gone:
            return False  # a late event of a deleted incarnation
        current = self._bodies.get(entity_id)
        if current is None or uid is None or _uid(current) in (None, uid):
            return True
        # Two incarnations under one name: the one created later is the live one.
        return _created(body) >= _created(current)

    def request_resync(self) -> None:
        """Re-emit every cached entity soon (from the trigger's task; returns at once)."""
        self._resync.set()

    # -- the Loop side -------------------------------------------------------------------

    async def run(self, emit: Emit) -> None:
        """The Trigger protocol: accept the Loop's emit, serve resyncs until cancelled."""
        if self._emit is not None:
            raise RuntimeError("this ObjectCache already feeds a running Loop")
        self._emit = emit
        self._feeding.set()
        try:
            while True:
                await self._resync.wait()
                self._resync.clear()
                for entity_id in list(self._bodies):
                    await emit(Request(entity_id))
        finally:
            self._emit = None
            self._feeding.clear()

    async def _request(self, entity_id: str) -> None:
        # Events that arrive before the Loop runs (or while it restarts the trigger) wait.
        while self._emit is None:
            await self._feeding.wait()
        await self._emit(Request(entity_id))

    def __repr__(self) -> str:
        return f"<ObjectCache {len(self._bodies)} objects>"


def _uid(body: Mapping[str, Any] | None) -> str | None:
    uid = ((body or {}).get("metadata") or {}).get("uid")
    return uid if isinstance(uid, str) and uid else None


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
