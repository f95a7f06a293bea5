"""The Kubernetes API client of a reconcile, fenced by the epoch of its lease.

Inside a reconcile, :func:`fenced_client` returns a :class:`FencedClient` bound to the lease
the reconcile was dispatched under, as :func:`~kopf_reconcile.fenced_writer` is for the
fenced store::

    client = kr.fenced_client()
    page = await client.get(CONFIGMAPS, "home", namespace="web")  # the cache, else the API
    await client.apply(CONFIGMAPS, {...}, owner=website)  # server-side apply, owned
    await client.patch_status(WEBSITES, "home", {"phase": "Ready"}, namespace="web")
    await client.set_condition(WEBSITES, website, {"type": "Ready", "status": "True"})
    await client.delete(CONFIGMAPS, "old", namespace="web")

Every write (create, patch, server-side apply, delete, the status subresource) is fenced
twice, as a :class:`~kopf_reconcile.FencedWriter` write is:

* **before it is sent**: refused with :class:`~kopf_reconcile.StaleEpochError` when the
  lease is not live here (and, as every await of a reconcile, cancelled in flight when the
  Loop loses the lease and cancels its reconciles);
* **by the API server**: the write impersonates the operator's own identity with the
  Lease, holder and epoch as user extras (:mod:`.fence_lease`), and the admission policy
  of :mod:`.fence_policy` refuses it once the Lease has changed hands. Its 403 is raised as
  a :class:`~kopf_reconcile.StaleEpochError` too, so the Loop steps down and the object is
  reconciled again by the leader.

Each outcome is counted in ``kopf_reconcile_api_writes_total{outcome}``. Without a leader
(single-process mode), or with ``KOPF_RECONCILE_API_FENCE=off``, writes go out as the
operator itself, without extras: no server-side fence, the local check still applies.

Reads need no fence: :meth:`FencedClient.get` and :meth:`FencedClient.list` answer from
the reconciler's cache for its own resource and the children it owns (``owns=``) and ask
the API server otherwise (or when the cache does not hold the object). Server-side apply
uses the reconciler id as its field manager. One connection pool serves the process
(:func:`~kopf_reconcile.integration.api_client.shared_api_client`).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import re
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

from kubernetes_asyncio.client.exceptions import ApiException
from multidict import CIMultiDict

from kopf_reconcile.api import ConfigError
from kopf_reconcile.cache import Body, ObjectCache
from kopf_reconcile.fencing.protocol import StaleEpochError
from kopf_reconcile.fencing.writer import ReconcileLease, reconcile_lease
from kopf_reconcile.integration.api_client import ApiClientSource, request
from kopf_reconcile.integration.conditions import set_status_condition
from kopf_reconcile.integration.fence_lease import LeaseFence
from kopf_reconcile.integration.fence_policy import FENCE_MARKER

__all__ = [
    "ClientContext",
    "FencedClient",
    "Resource",
    "ResourceRef",
    "fenced_client",
    "owner_reference",
    "serving_client",
]

HTTP_FORBIDDEN, HTTP_NOT_FOUND = 403, 404
# A refusal showing an older epoch than the write's is the API server's lag, not staleness:
# retried up to this many times, 20 ms apart at first and doubling (about 1.3 s in all).
_LAG_RETRIES, _LAG_DELAY = 6, 0.02
_SHOWN_EPOCH = re.compile(r"which is now at epoch (\d+)")
_JSON_PATCH = "application/json-patch+json"
_MERGE_PATCH = "application/merge-patch+json"
_APPLY_PATCH = "application/apply-patch+yaml"


class ResourceRef(Protocol):
    """A resource by its API group, version and plural (``kr.Resource``, ``kr.Owns``, ...)."""

    @property
    def group(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def plural(self) -> str: ...


class Resource:
    """A resource to read and write: ``Resource("", "v1", "configmaps")``."""

    __slots__ = ("group", "plural", "version")

    def __init__(self, group: str, version: str, plural: str) -> None:
        for option, value in (("version", version), ("plural", plural)):
            if not isinstance(value, str) or not value:
                raise ConfigError(f"Resource needs a non-empty {option}, got {value!r}")
        if not isinstance(group, str):
            raise ConfigError(f"Resource group must be a string ('' for core), got {group!r}")
        self.group, self.version, self.plural = group, version, plural

    def __repr__(self) -> str:
        return f"Resource({self.group!r}, {self.version!r}, {self.plural!r})"


def owner_reference(owner: Mapping[str, Any], *, controller: bool = True) -> dict[str, Any]:
    """A (controller) owner reference to ``owner``, as controller-runtime sets it."""
    metadata = owner.get("metadata") or {}
    missing = [k for k in ("apiVersion", "kind") if not owner.get(k)]
    missing += [f"metadata.{k}" for k in ("name", "uid") if not metadata.get(k)]
    if missing:
        raise ConfigError(f"an owner needs {', '.join(missing)}; got {dict(owner)!r:.200}")
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": metadata["name"],
        "uid": metadata["uid"],
        "controller": controller,
        "blockOwnerDeletion": True,
    }


class ClientContext:
    """What one reconciler's clients share: the connection, the fence, caches, its id."""

    def __init__(
        self,
        client: ApiClientSource,
        *,
        field_manager: str,
        fence: LeaseFence | None = None,
        caches: Mapping[tuple[str, str], ObjectCache] | None = None,
    ) -> None:
        self.client = client
        self.field_manager = field_manager
        self.fence = fence
        self.caches = dict(caches or {})


_current: contextvars.ContextVar[ClientContext | None] = contextvars.ContextVar(
    "kopf_reconcile_client_context", default=None
)


@contextmanager
def serving_client(context: ClientContext) -> Iterator[None]:
    """Make ``context`` the one :func:`fenced_client` uses, for the duration of a reconcile."""
    token = _current.set(context)
    try:
        yield
    finally:
        _current.reset(token)


def fenced_client() -> FencedClient:
    """The Kubernetes API client of the reconcile running, bound to its lease's epoch."""
    context = _current.get()
    if context is None:
        raise LookupError(
            "kopf_reconcile.fenced_client() works only inside a reconcile of a "
            "@kopf_reconcile.reconciler"
        )
    return FencedClient(context, reconcile_lease())


class FencedClient:
    """Reads (cached) and fenced writes of one reconcile; see the module's documentation."""

    __slots__ = ("_context", "_lease")

    def __init__(self, context: ClientContext, lease: ReconcileLease | None) -> None:
        self._context = context
        self._lease = lease

    @property
    def epoch(self) -> int | None:
        """The epoch every write carries (None without a leader)."""
        return None if self._lease is None or self._lease.lease_id is None else self._lease.epoch

    # -- reads -------------------------------------------------------------------------

    async def get(
        self, resource: ResourceRef, name: str, *, namespace: str | None = None
    ) -> Body | None:
        """The object (a private copy), or None when it does not exist."""
        cache = self._context.caches.get((resource.group, resource.plural))
        if cache is not None:
            found = cache.get(f"{namespace}/{name}" if namespace else name)
            if found is not None:
                return found
        try:
            path = _path(resource, namespace, name)
            body: Body = await request(self._context.client, "GET", path)
        except ApiException as exc:
            if exc.status == HTTP_NOT_FOUND:
                return None
            raise
        return body

    async def list(
        self,
        resource: ResourceRef,
        *,
        namespace: str | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> list[Body]:
        """The objects (in ``namespace``, with ``labels``): the cache's, else the API's."""
        cache = self._context.caches.get((resource.group, resource.plural))
        if cache is not None:
            bodies = (cache.get(entity) for entity in cache.entities())
            return [b for b in bodies if b is not None and _selected(b, namespace, labels)]
        selector = ",".join(f"{k}={v}" for k, v in (labels or {}).items())
        query = [("labelSelector", selector)] if selector else []
        found = await request(self._context.client, "GET", _path(resource, namespace), query=query)
        kind = (found.get("kind") or "").removesuffix("List")
        api_version = found.get("apiVersion")
        return [{"apiVersion": api_version, "kind": kind, **item} for item in found["items"]]

    # -- writes ------------------------------------------------------------------------

    async def create(
        self,
        resource: ResourceRef,
        body: Mapping[str, Any],
        *,
        owner: Mapping[str, Any] | None = None,
    ) -> Body:
        """Create ``body`` (owned by ``owner``, a controller reference, when given)."""
        body = _owned(body, owner)
        namespace = (body.get("metadata") or {}).get("namespace")
        return await self._write("POST", _path(resource, namespace), body=body)

    async def patch(
        self,
        resource: ResourceRef,
        name: str,
        patch: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        namespace: str | None = None,
        subresource: str | None = None,
    ) -> Body:
        """A JSON merge patch (a mapping) or a JSON patch (a list of operations)."""
        content_type = _MERGE_PATCH if isinstance(patch, Mapping) else _JSON_PATCH
        body = dict(patch) if isinstance(patch, Mapping) else [dict(op) for op in patch]
        path = _path(resource, namespace, name, subresource)
        return await self._write("PATCH", path, body=body, content_type=content_type)

    async def apply(
        self,
        resource: ResourceRef,
        body: Mapping[str, Any],
        *,
        owner: Mapping[str, Any] | None = None,
        subresource: str | None = None,
        force: bool = True,
    ) -> Body:
        """Server-side apply of ``body``, with the reconciler id as the field manager."""
        body = _owned(body, owner)
        metadata = body.get("metadata") or {}
        name = metadata.get("name")
        if not name:
            raise ConfigError(f"apply needs metadata.name; got {dict(body)!r:.200}")
        query = [("fieldManager", self._context.field_manager)]
        query += [("force", "true")] if force else []
        path = _path(resource, metadata.get("namespace"), name, subresource)
        return await self._write("PATCH", path, body=body, content_type=_APPLY_PATCH, query=query)

    async def delete(
        self,
        resource: ResourceRef,
        name: str,
        *,
        namespace: str | None = None,
        uid: str | None = None,
        propagation: str | None = None,
    ) -> bool:
        """Delete the object (only that incarnation, given its ``uid``); False if it was gone."""
        options: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if uid is not None:
            options["preconditions"] = {"uid": uid}
        if propagation is not None:
            options["propagationPolicy"] = propagation
        try:
            await self._write("DELETE", _path(resource, namespace, name), body=options)
        except ApiException as exc:
            if exc.status == HTTP_NOT_FOUND:
                return False
            raise
        return True

    async def patch_status(
        self,
        resource: ResourceRef,
        name: str,
        status: Mapping[str, Any],
        *,
        namespace: str | None = None,
    ) -> Body:
        """Merge ``status`` into the object's status, through the status subresource."""
        return await self.patch(
            resource, name, {"status": dict(status)}, namespace=namespace, subresource="status"
        )

    async def set_condition(
        self, resource: ResourceRef, body: Mapping[str, Any], condition: Mapping[str, Any]
    ) -> Body:
        """Set one of ``body``'s status conditions (see :func:`set_status_condition`).

        ``observedGeneration`` defaults to the body's ``metadata.generation``. The patch is
        conditional on the body's ``resourceVersion``: a newer object gives 409 Conflict,
        and the reconcile is retried over it.
        """
        metadata = body.get("metadata") or {}
        conditions, changed = set_status_condition(
            (body.get("status") or {}).get("conditions"),
            condition,
            generation=metadata.get("generation"),
        )
        if not changed:
            return dict(body)
        patch = {
            "metadata": {"resourceVersion": metadata.get("resourceVersion")},
            "status": {"conditions": conditions},
        }
        return await self.patch(
            resource,
            metadata["name"],
            patch,
            namespace=metadata.get("namespace"),
            subresource="status",
        )

    async def _write(
        self,
        method: str,
        path: str,
        *,
        body: object,
        content_type: str = "application/json",
        query: Sequence[tuple[str, str]] | None = None,
    ) -> Body:
        lease, fence = self._lease, self._context.fence
        count = lease.count_api_write if lease is not None else _uncounted

        def check_live() -> None:
            if lease is not None and not lease.is_live():
                count("refused_locally")
                raise StaleEpochError(
                    f"{method} {path} refused locally: the lease of epoch {lease.epoch} is no "
                    "longer held by this process"
                )

        check_live()  # before anything is written (a mirrored epoch included)
        headers: CIMultiDict[str] | None = None
        if fence is not None and lease is not None and lease.lease_id is not None:
            try:
                headers = await fence.headers(lease)
            except StaleEpochError:
                count("refused_by_server")  # the mirror shows a newer term: the fence's verdict
                raise
        for attempt in range(_LAG_RETRIES + 1):
            check_live()  # and right before sending
            try:
                answer = await request(
                    self._context.client,
                    method,
                    path,
                    body=body,
                    query=None if query is None else [*query],
                    headers=headers,
                    content_type=content_type,
                )
            except ApiException as exc:
                if exc.status == HTTP_FORBIDDEN and FENCE_MARKER in str(exc.body or ""):
                    message = _message(exc)
                    if lease is not None and attempt < _LAG_RETRIES and _lags(message, lease):
                        # The server's view of the Lease is older than ours (its informer
                        # lags a takeover by milliseconds): not stale, ask again shortly.
                        await asyncio.sleep(_LAG_DELAY * 2**attempt)
                        continue
                    count("refused_by_server")
                    raise StaleEpochError(f"{method} {path}: {message}") from None
                count("error")
                raise
            except BaseException:
                count("error")
                raise
            count("accepted")
            return answer if isinstance(answer, dict) else {}
        raise AssertionError("unreachable")  # the last attempt returns or raises

    def __repr__(self) -> str:
        return f"<FencedClient epoch={self.epoch} manager={self._context.field_manager}>"


def _uncounted(outcome: str) -> None:
    pass


def _lags(message: str, lease: ReconcileLease) -> bool:
    """Whether a fence refusal shows the Lease at an epoch below this write's: the API
    server's copy of it is older than the lease this process holds."""
    shown = _SHOWN_EPOCH.search(message)
    return shown is not None and int(shown.group(1)) < lease.epoch


def _path(
    resource: ResourceRef,
    namespace: str | None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    group, version = resource.group, resource.version
    parts = [f"/apis/{group}/{version}" if group else f"/api/{version}"]
    if namespace:
        parts.append(f"namespaces/{urllib.parse.quote(namespace, safe='')}")
    parts.append(resource.plural)
    if name is not None:
        parts.append(urllib.parse.quote(name, safe=""))
    if subresource:
        parts.append(subresource)
    return "/".join(parts)


def _owned(body: Mapping[str, Any], owner: Mapping[str, Any] | None) -> dict[str, Any]:
    copied = dict(body)
    if owner is None:
        return copied
    metadata = dict(copied.get("metadata") or {})
    owner_namespace = (owner.get("metadata") or {}).get("namespace")
    if owner_namespace and not metadata.get("namespace"):
        metadata["namespace"] = owner_namespace
    reference = owner_reference(owner)
    kept = metadata.get("ownerReferences") or ()
    references = [r for r in kept if r.get("uid") != reference["uid"]]
    metadata["ownerReferences"] = [*references, reference]
    copied["metadata"] = metadata
    return copied


def _selected(body: Body, namespace: str | None, labels: Mapping[str, str] | None) -> bool:
    metadata = body.get("metadata") or {}
    if namespace is not None and metadata.get("namespace") != namespace:
        return False
    have = metadata.get("labels") or {}
    return all(have.get(k) == v for k, v in (labels or {}).items())


def _message(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body or b"").get("message") or exc.body)
    except (TypeError, ValueError, AttributeError):
        return str(exc.body)
