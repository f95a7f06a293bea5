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
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from kopf_reconcile.api import Request
from kopf_reconcile.triggers import Emit

__all__ = ["ObjectCache", "cached"]

Body = dict[str, Any]

_current: contextvars.ContextVar[ObjectCache | None] = contextvars.ContextVar(
    "kopf_reconcile_object_cache", default=None
)


class ObjectCache:
    """Latest object bodies by entity id; the trigger that turns watch events into requests."""

    def __init__(self) -> None:
        self._bodies: dict[str, Mapping[str, Any]] = {}
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
        self._bodies[entity_id] = body
        await self._request(entity_id)

    async def remove(self, entity_id: str) -> None:
        """The object is gone: forget it, then request a reconcile (which sees None)."""
        self._bodies.pop(entity_id, None)
        await self._request(entity_id)

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
