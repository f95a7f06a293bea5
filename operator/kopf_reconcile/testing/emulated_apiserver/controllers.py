"""What kube-apiserver's and kube-controller-manager's controllers do after a write.

The embedded cluster has no controller manager, so the consequences of writes that a
real cluster's controllers bring about are emulated here, next to the registry:

* the **namespace controller**: a deleted namespace stays ``Terminating`` for a moment
  (creates in it refused), then is emptied and removed once its finalizers are gone;
* the **CRD finalizer**: a deleted CustomResourceDefinition takes its objects along and
  goes when the last one has; its resource types stop being served;
* **Event expiry**: core Events expire (kube-apiserver gives them a 1 h TTL); a count
  bound keeps the memory of a long run flat.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from kopf_reconcile.testing.emulated_apiserver import crds
from kopf_reconcile.testing.emulated_apiserver.resources import ResourceType, StorageKey
from kopf_reconcile.testing.emulated_apiserver.store import Object

if TYPE_CHECKING:
    from kopf_reconcile.testing.emulated_apiserver.registry import ResourceAPI

NAMESPACES_KEY: StorageKey = ("", "namespaces")
#: The label kube-apiserver sets on every namespace to its name.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
EVENTS_KEY: StorageKey = ("", "events")


class Controllers:
    """The housekeeping of one :class:`~.registry.ResourceAPI` after its writes."""

    def __init__(
        self, api: ResourceAPI, *, max_events: int, namespace_termination_delay: float
    ) -> None:
        self._api = api
        self._max_events = max_events
        self._namespace_termination_delay = namespace_termination_delay
        self._timers: set[asyncio.TimerHandle] = set()
        self._emptied_namespaces: set[str] = set()  # terminating ones the controller emptied

    def close(self) -> None:
        """Cancel the pending work of the namespace controller (at shutdown)."""
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()

    def after_write(self, resource: ResourceType, stored: Object) -> None:
        key = resource.storage_key
        terminating = bool(stored["metadata"].get("deletionTimestamp"))
        if key == crds.CRD_KEY and terminating:
            self._finalize_crd(stored)
        elif key == crds.CRD_KEY:
            self._api.registry.define(stored["metadata"]["name"], crds.resource_types(stored))
        elif key == NAMESPACES_KEY and terminating:
            self._reap_namespace(stored["metadata"]["name"])  # its own finalizers may be gone
        elif key == EVENTS_KEY:
            self._evict_old_events()

    def after_removal(self, resource: ResourceType, gone: Object) -> None:
        if resource.storage_key == crds.CRD_KEY:
            self._api.registry.undefine(gone["metadata"]["name"])
            return
        namespace = gone["metadata"].get("namespace")
        if namespace:
            self._reap_namespace(namespace)
        if resource.custom:
            self._reap_crd(resource)

    def terminate_namespace_later(self, namespace: Object) -> None:
        """Empty a deleted namespace after the delay a namespace controller takes.

        Until then it stays ``Terminating`` with its content in place: creates in it are
        refused (403), updates of its objects go through, as in a real cluster.
        """
        name, uid = namespace["metadata"]["name"], namespace["metadata"]["uid"]
        if self._namespace_termination_delay <= 0:
            self._empty_namespace(name, uid)
            return

        def empty() -> None:
            self._timers.discard(timer)
            self._empty_namespace(name, uid)

        loop = asyncio.get_running_loop()
        timer = loop.call_later(self._namespace_termination_delay, empty)
        self._timers.add(timer)

    def _empty_namespace(self, namespace: str, uid: str) -> None:
        ns = self._api.store.get(NAMESPACES_KEY, "", namespace)
        if ns is None or ns["metadata"]["uid"] != uid:
            return
        self._emptied_namespaces.add(namespace)
        for resource in self._one_type_per_storage():
            if resource.namespaced:
                for obj in self._api.store.items(resource.storage_key, namespace):
                    if not obj["metadata"].get("deletionTimestamp"):
                        self._api.delete(resource, namespace, obj["metadata"]["name"])
        self._reap_namespace(namespace)

    def _reap_namespace(self, namespace: str) -> None:
        """Remove a terminating namespace once its controller has emptied it."""
        ns = self._api.store.get(NAMESPACES_KEY, "", namespace)
        if (
            ns is not None
            and namespace in self._emptied_namespaces
            and ns["metadata"].get("deletionTimestamp")
            and not ns["metadata"].get("finalizers")
            and self._api.store.namespace_is_empty(namespace)
        ):
            self._api.store.remove(NAMESPACES_KEY, ns)
            self._emptied_namespaces.discard(namespace)

    def _finalize_crd(self, crd: Object) -> None:
        resource = crds.storage_type(crd)
        for obj in self._api.store.items(resource.storage_key):
            meta = obj["metadata"]
            if not meta.get("deletionTimestamp"):
                self._api.delete(resource, meta.get("namespace", ""), meta["name"])
        self._reap_crd_named(crd["metadata"]["name"])

    def _reap_crd(self, resource: ResourceType) -> None:
        self._reap_crd_named(f"{resource.plural}.{resource.group}")

    def _reap_crd_named(self, crd_name: str) -> None:
        crd = self._api.store.get(crds.CRD_KEY, "", crd_name)
        if crd is None or not crd["metadata"].get("deletionTimestamp"):
            return
        if crd["metadata"].get("finalizers") or self._api.store.count(
            crds.storage_type(crd).storage_key
        ):
            return
        gone = self._api.store.remove(crds.CRD_KEY, crd)
        self._api.registry.undefine(gone["metadata"]["name"])

    def _evict_old_events(self) -> None:
        # Events expire in kube-apiserver (1 h TTL); a count bound keeps memory flat here.
        while self._api.store.count(EVENTS_KEY) > self._max_events:
            oldest = self._api.store.oldest(EVENTS_KEY)
            if oldest is None:
                break
            self._api.store.remove(EVENTS_KEY, oldest)

    def _one_type_per_storage(self) -> list[ResourceType]:
        seen: dict[StorageKey, ResourceType] = {}
        for resource in self._api.registry:
            seen.setdefault(resource.storage_key, resource)
        return list(seen.values())
