"""Kubernetes Events on reconciled objects: the kopf shim's event sink.

:class:`KubernetesEventSink` posts each aggregated event of a Loop
(:mod:`kopf_reconcile.events`) as a core/v1 ``Event`` in the object's namespace
(``default`` for a cluster-scoped object), whose ``involvedObject`` is the object as
the watch last saw it (its apiVersion, kind, name, namespace and uid, from the shim's
cache): ``kubectl describe`` and ``kubectl get events`` show it. The first occurrence
creates the Event; the next ones PATCH its ``count``, ``message`` and
``lastTimestamp`` (a JSON merge patch), as client-go's event recorder does. The object
itself is never written. An Event that expired meanwhile (the API server keeps them an
hour by default) is created again.

Across leaders. Before creating an Event, the sink looks for one it (this component)
already posted for the same object (uid), type and reason: one list with a field
selector, once per aggregate. Found, that Event is counted on, so a failover (the new
leader's aggregates start empty) or an evicted aggregate adds to the count shown by
``kubectl describe`` rather than a second Event.

What it needs from RBAC: ``create``, ``patch`` and ``list`` on ``events`` (core group)
in the namespaces of the objects it reconciles. The chart grants exactly that.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import socket
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes_asyncio.client import ApiClient, CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from kopf_reconcile.events import EventRecord
from kopf_reconcile.integration.api_client import LazyApiClient, SharedApiClient

__all__ = ["DEFAULT_COMPONENT", "KubernetesEventSink"]

logger = logging.getLogger("kopf_reconcile.events")

DEFAULT_COMPONENT = "kopf-reconcile"
HTTP_NOT_FOUND = 404
_MAX_NAME = 253
_MERGE_PATCH = "application/merge-patch+json"

Lookup = Callable[[str], Mapping[str, Any] | None]


def _time(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class KubernetesEventSink:
    """Posts aggregated events as core/v1 Events on the objects ``lookup`` returns."""

    def __init__(
        self,
        lookup: Lookup,
        *,
        component: str = DEFAULT_COMPONENT,
        instance: str | None = None,
        api: ApiClient | None = None,
        kubeconfig: str | None = None,
        shared: SharedApiClient | None = None,
    ) -> None:
        """``lookup(entity_id)`` is the object's latest body (or None: nothing is posted).

        ``api`` is borrowed; without it a client is made on first use, by the rules of
        :class:`~kopf_reconcile.KubernetesLeaseElector` (``kubeconfig``, in-cluster, default).
        """
        self._lookup = lookup
        self._component = component
        self._instance = instance or socket.gethostname()
        # A handle on the process's shared client (closing it lets go), else one of its own.
        self._client: LazyApiClient | SharedApiClient = shared or LazyApiClient(api, kubeconfig)

    async def post(self, record: EventRecord, previous: object | None) -> object | None:
        core: Any = CoreV1Api(await self._client.get())  # dict bodies: untyped calls
        if isinstance(previous, tuple):
            namespace, name, base = previous
            if await self._update(core, namespace, name, base, record):
                return previous
        body = self._lookup(record.entity_id)
        if body is None:
            return None  # gone: there is no object to attach it to
        metadata = body.get("metadata") or {}
        namespace = metadata.get("namespace") or "default"
        # The same object's Event of the same reason, posted by a previous leader (or
        # by this process before its aggregate was evicted): counted on, not duplicated.
        found = await self._existing(core, namespace, metadata.get("uid"), record)
        if found is not None:
            name, base = found
            if await self._update(core, namespace, name, base, record):
                return (namespace, name, base)
        object_name = str(metadata.get("name") or record.entity_id)
        name = f"{object_name[: _MAX_NAME - 17]}.{secrets.token_hex(8)}"
        involved = {
            "apiVersion": body.get("apiVersion"),
            "kind": body.get("kind"),
            "name": object_name,
            "namespace": metadata.get("namespace"),
            "uid": metadata.get("uid"),
            "resourceVersion": metadata.get("resourceVersion"),
        }
        event: Any = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "involvedObject": {k: v for k, v in involved.items() if v},
            "type": record.type,
            "reason": record.reason,
            "message": record.message,
            "count": record.count,
            "firstTimestamp": _time(record.first_seen),
            "lastTimestamp": _time(record.last_seen),
            "source": {"component": self._component, "host": self._instance},
            "reportingComponent": self._component,
            "reportingInstance": self._instance,
        }
        await core.create_namespaced_event(namespace, event)
        return (namespace, name, 0)

    async def _update(
        self, core: Any, namespace: str, name: str, base: int, record: EventRecord
    ) -> bool:
        """Patch the Event's count (``base`` + this aggregate's), message and last time;
        False when it is gone (Events expire)."""
        patch = {
            "count": base + record.count,
            "message": record.message,
            "lastTimestamp": _time(record.last_seen),
        }
        try:
            await core.patch_namespaced_event(name, namespace, patch, _content_type=_MERGE_PATCH)
        except ApiException as exc:
            if exc.status != HTTP_NOT_FOUND:
                raise
            return False
        return True

    async def _existing(
        self, core: Any, namespace: str, uid: object, record: EventRecord
    ) -> tuple[str, int] | None:
        """The name and count of this component's latest Event of that object and reason."""
        if not uid:
            return None
        selector = (
            f"involvedObject.uid={uid},reason={record.reason},type={record.type},"
            f"source={self._component}"
        )
        listing = await core.list_namespaced_event(namespace, field_selector=selector)
        if not listing.items:
            return None
        latest = max(
            listing.items,
            key=lambda e: (e.last_timestamp is not None, e.last_timestamp, e.metadata.name),
        )
        return latest.metadata.name, int(latest.count or 1)

    async def close(self) -> None:
        """Close the client if it was made here."""
        await self._client.close()

    def __repr__(self) -> str:
        return f"<KubernetesEventSink component={self._component!r} at {self._instance!r}>"
