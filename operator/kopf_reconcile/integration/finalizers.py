"""Finalizers: cleanup that a deletion cannot skip.

With ``finalizer=True`` (or a finalizer name) on ``@kr.reconciler``, the kopf shim

* **adds** the finalizer to an object before the first reconcile of it (a JSON patch,
  conditional on the object's uid, and on its ``resourceVersion`` when it has no
  finalizers yet, so no other writer's finalizer is ever overwritten). Until that write
  succeeds the reconciler is not called: whatever it creates for the object is covered
  by the finalizer. Only objects the reconciler selects are reconciled, so objects it
  never selected never get the finalizer; an object already being deleted cannot get a
  new finalizer (the API server refuses it) and is reconciled without one;
* lets a **deleting** object (``metadata.deletionTimestamp`` set, the finalizer still
  there) reach the reconciler like any other change: :func:`is_deleting` tells it apart;
* **removes** the finalizer only after the reconciler returned without an error and
  without asking to be called again (``None`` or a ``Result`` without
  ``requeue_after``): a ``requeue_after`` means "not finished", an error is retried with
  backoff, and a :class:`~kopf_reconcile.PermanentError` dead-letters the object (its
  Warning Event, its row in ``kopf-reconcile dead-letters``) and keeps the finalizer
  until a fresh trigger (a change of the object, a redrive) succeeds. The removal is a
  fenced API write: it is refused before it is sent, as a
  :class:`~kopf_reconcile.FencedWriter` write is, when the lease the reconcile was
  dispatched under is no longer held (a :class:`~kopf_reconcile.StaleEpochError`: the
  Loop steps down, and the next leader's resync reconciles the object again). The patch
  removes the finalizer at the index where it was seen, tested there and on the uid.

Once the last finalizer is gone the API server deletes the object; its DELETED event
reaches the reconciler once more with ``kr.cached(req) is None``: cleanup must be
idempotent (it is anyway: a reconcile may run again after a failover).

An object outside the reconciler's selection that carries the finalizer (it left the
selection, or the selection changed in the code) is gone for the reconciler: it is
reconciled as gone, and once that returns without error the finalizer is removed from
it, so a finalizer never blocks a deletion after the reconciler's cleanup.

The default name is ``<group>/<reconciler id>`` (``kopf-reconcile/<reconciler id>`` for the
core group). After removing the option, strip the finalizers it added (the operator no
longer does), for example::

    kubectl get websites -A -o name | xargs -r -n1 kubectl patch --type=json \\
      -p '[{"op": "remove", "path": "/metadata/finalizers/0"}]'

(that removes the first finalizer: check ``-o jsonpath='{.metadata.finalizers}'`` first
when objects carry other finalizers too).

RBAC: ``get`` and ``patch`` on the reconciled resource itself (the chart's
``watch[].finalizer``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from kopf_reconcile.api import ConfigError, Result
from kopf_reconcile.fencing.writer import reconcile_lease
from kopf_reconcile.integration.api_client import LazyApiClient, SharedApiClient, request
from kopf_reconcile.integration.fenced_client import (
    ClientContext,
    FencedClient,
    Resource,
    fenced_client,
)

__all__ = ["FinalizerWriter", "Finalizing", "finalizer_name", "has_finalizer", "is_deleting"]

logger = logging.getLogger("kopf_reconcile.finalizers")

HTTP_NOT_FOUND, HTTP_CONFLICT, HTTP_UNPROCESSABLE = 404, 409, 422
# A qualified name: an optional DNS-subdomain prefix and '/', then a name of 63 at most.
_QUALIFIED = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)


def is_deleting(body: Mapping[str, Any] | None) -> bool:
    """Whether the object is gone (``None``) or being deleted (``deletionTimestamp`` set).

    Inside a reconcile: ``if kr.is_deleting(kr.cached(req)): ...clean up...``.
    """
    if body is None:
        return True
    return bool((body.get("metadata") or {}).get("deletionTimestamp"))


def has_finalizer(body: Mapping[str, Any], name: str) -> bool:
    return name in ((body.get("metadata") or {}).get("finalizers") or ())


def finalizer_name(option: object, group: str, reconciler_id: str) -> str | None:
    """The decorator's ``finalizer=`` as a finalizer name (None: no finalizer)."""
    if option is None or option is False:
        return None
    if option is True:
        return f"{group or 'kopf-reconcile'}/{reconciler_id}"
    if not isinstance(option, str) or len(option) > 316 or not _QUALIFIED.match(option):
        raise ConfigError(
            "finalizer must be True, False, None or a qualified name such as "
            f"'example.com/cleanup' (an optional DNS prefix, '/', a name of at most 63 "
            f"characters), got {option!r}"
        )
    return option


def _uid(body: Mapping[str, Any]) -> object:
    return (body.get("metadata") or {}).get("uid")


def finished(outcome: object) -> bool:
    """Whether a reconcile's outcome says the cleanup is done (no error, no requeue)."""
    return outcome is None or (isinstance(outcome, Result) and not outcome.requeue_after)


class FinalizerWriter:
    """Adds and removes one finalizer on the objects of one resource, fenced by the lease."""

    def __init__(
        self,
        name: str,
        group: str,
        version: str,
        plural: str,
        *,
        api: ApiClient | None = None,
        kubeconfig: str | None = None,
        shared: SharedApiClient | None = None,
    ) -> None:
        self.name = name
        prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
        self._prefix = prefix
        self._plural = plural
        self._resource = Resource(group, version, plural)
        # A handle on the process's shared client (closing it lets go), else one of its own.
        self._client: LazyApiClient | SharedApiClient = shared or LazyApiClient(api, kubeconfig)

    async def add(self, body: Mapping[str, Any]) -> None:
        """Add the finalizer (before the object's first reconcile).

        When the body is older than the object (the patch's test fails), the object is
        read once and the finalizer added over what it holds now (or nothing is done, if
        it is there already): a busy object does not make the first reconcile fail.
        """
        try:
            await self._patch(body, self._adding(body), "add")
        except ApiException as exc:
            if exc.status not in (HTTP_CONFLICT, HTTP_UNPROCESSABLE):
                raise
            fresh = await self._read(body)
            if fresh is None or _uid(fresh) != _uid(body) or is_deleting(fresh):
                raise  # gone or going: the next reconcile reads that from the cache
            if not has_finalizer(fresh, self.name):
                await self._patch(fresh, self._adding(fresh), "add")

    def _adding(self, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The JSON patch that adds the finalizer to ``body`` as it was read."""
        metadata = body.get("metadata") or {}
        uid_test = {"op": "test", "path": "/metadata/uid", "value": metadata.get("uid")}
        if metadata.get("finalizers"):
            # Over the list as seen: a stale body (a lagging cache after a failover) must not
            # add the finalizer a second time.
            seen = list(metadata["finalizers"])
            return [
                uid_test,
                {"op": "test", "path": "/metadata/finalizers", "value": seen},
                {"op": "add", "path": "/metadata/finalizers/-", "value": self.name},
            ]
        # No list yet: the list is created, only over the version seen.
        return [
            uid_test,
            {
                "op": "test",
                "path": "/metadata/resourceVersion",
                "value": metadata.get("resourceVersion"),
            },
            {"op": "add", "path": "/metadata/finalizers", "value": [self.name]},
        ]

    async def remove(self, body: Mapping[str, Any]) -> None:
        """Remove the finalizer (after a successful cleanup), at every index it was seen."""
        metadata = body.get("metadata") or {}
        finalizers = list(metadata.get("finalizers") or ())
        patch: list[dict[str, Any]] = [
            {"op": "test", "path": "/metadata/uid", "value": metadata.get("uid")}
        ]
        # Highest index first, so each removal leaves the lower ones where they were seen.
        for index in reversed([i for i, name in enumerate(finalizers) if name == self.name]):
            path = f"/metadata/finalizers/{index}"
            patch += [{"op": "test", "path": path, "value": self.name}]
            patch += [{"op": "remove", "path": path}]
        await self._patch(body, patch, "remove")

    async def _patch(self, body: Mapping[str, Any], patch: list[dict[str, Any]], verb: str) -> None:
        """Through the reconcile's fenced client: refused locally once the lease is not live,
        and by the API server's fence once it changed hands."""
        metadata = body.get("metadata") or {}
        namespace, name = metadata.get("namespace"), metadata.get("name")
        try:
            client = fenced_client()
        except LookupError:  # outside a reconciler's reconcile: the local check only
            client = FencedClient(
                ClientContext(self._client, field_manager=self.name), reconcile_lease()
            )
        try:
            await client.patch(self._resource, str(name), patch, namespace=namespace)
        except ApiException as exc:
            if exc.status == HTTP_NOT_FOUND and verb == "remove":
                return  # gone already: nothing is left to hold
            raise
        logger.debug("finalizer %s: %s on %s/%s", self.name, verb, namespace, name)

    async def _read(self, body: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """The object as the API server holds it now; None when it is gone."""
        try:
            found: Mapping[str, Any] = await request(self._client, "GET", self._path(body))
        except ApiException as exc:
            if exc.status == HTTP_NOT_FOUND:
                return None
            raise
        return found

    def _path(self, body: Mapping[str, Any]) -> str:
        metadata = body.get("metadata") or {}
        namespace, name = metadata.get("namespace"), metadata.get("name")
        where = f"{self._prefix}/namespaces/{namespace}" if namespace else self._prefix
        return f"{where}/{self._plural}/{name}"

    async def close(self) -> None:
        """Close the client if it was made here."""
        await self._client.close()

    def __repr__(self) -> str:
        return f"<FinalizerWriter {self.name!r} on {self._plural}>"


class Finalizing:
    """The finalizer steps of one reconciler: around its reconciles, and from its watch."""

    def __init__(self, writer: FinalizerWriter) -> None:
        self.writer = writer
        # Uids whose finalizer this replica added and the cache has not shown yet (a
        # reconcile in between must not add it again): dropped on the echo or deletion.
        self._adding: set[str] = set()
        # Objects outside the selection that still carry the finalizer, by entity id:
        # their identity (name, namespace, uid, finalizers), to release them.
        self._released: dict[str, dict[str, Any]] = {}

    def observe(
        self, entity_id: str, body: Mapping[str, Any], *, deleted: bool, selected: bool
    ) -> bool:
        """Take one watch event into account; True when the object is outside the selection
        and still carries the finalizer (a reconcile, as gone, releases it)."""
        uid = _uid(body)
        if deleted or has_finalizer(body, self.writer.name):
            # The add's echo (or the end): from now on a body without the finalizer means
            # another writer took it away, and the next reconcile adds it again.
            self._adding.discard(uid)
        if deleted or selected or not has_finalizer(body, self.writer.name):
            self._released.pop(entity_id, None)
            return False
        metadata = body.get("metadata") or {}
        kept = ("name", "namespace", "uid", "finalizers")
        self._released[entity_id] = {"metadata": {k: metadata.get(k) for k in kept}}
        return True

    async def reconcile(
        self, body: Mapping[str, Any] | None, entity_id: str, call: Callable[[], Awaitable[object]]
    ) -> object:
        """``call`` (the reconciler), with the finalizer added before and removed after."""
        name = self.writer.name
        uid = None if body is None else _uid(body)
        if body is not None and has_finalizer(body, name):
            self._adding.discard(uid)  # the cache shows it now
        elif body is not None and not is_deleting(body) and uid not in self._adding:
            # Marked before the write, so that its echo, whenever it comes, unmarks it.
            if isinstance(uid, str):
                self._adding.add(uid)
            try:
                await self.writer.add(body)  # before anything the reconciler creates
            except BaseException:
                self._adding.discard(uid)
                raise
        released = self._released.get(entity_id) if body is None else None
        outcome = await call()
        if not finished(outcome):
            return outcome
        if body is not None and is_deleting(body) and has_finalizer(body, name):
            await self.writer.remove(body)
        elif released is not None:  # gone for the reconciler, yet it still exists
            await self.writer.remove(released)
            if self._released.get(entity_id) is released:
                del self._released[entity_id]
        return outcome
