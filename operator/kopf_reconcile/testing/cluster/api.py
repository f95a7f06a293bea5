"""The verbs of the Kubernetes API on stored objects: create, get, list, update, patch, delete.

This is where kube-apiserver's generic registry semantics live, independent of HTTP:
server-set metadata (``uid``, ``creationTimestamp``, ``resourceVersion``, ``generation``),
optimistic concurrency (409 on a stale ``resourceVersion``), no-op writes that keep the
``resourceVersion`` and emit no event, the ``status`` subresource, graceful deletion with
finalizers (``deletionTimestamp`` first, removal when the last finalizer goes), and the
lifecycle of namespaces and CRDs (their contents are deleted before they disappear).
"""

from __future__ import annotations

import copy
import random
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from kopf_reconcile.testing.cluster import crds, errors, patching, validation
from kopf_reconcile.testing.cluster.resources import ResourceRegistry, ResourceType
from kopf_reconcile.testing.cluster.store import Object, Store

#: Namespaces that exist in every kube-apiserver from its start.
SYSTEM_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")

_NAME_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # as the apiserver's generateName uses

Clock = Callable[[], datetime]


def _utcnow() -> datetime:
    return datetime.now(UTC)


class ResourceAPI:
    """The API verbs over a store and a registry of served resource types."""

    def __init__(
        self, store: Store, registry: ResourceRegistry, *, max_events: int, clock: Clock = _utcnow
    ) -> None:
        self.store = store
        self.registry = registry
        self._max_events = max_events
        self._clock = clock
        for name in SYSTEM_NAMESPACES:
            self.create(self._namespaces, "", {"metadata": {"name": name}})
        store.mark_history_start()

    @property
    def _namespaces(self) -> ResourceType:
        resource = self.registry.get("", "v1", "namespaces")
        assert resource is not None
        return resource

    # Reading.

    def get(self, resource: ResourceType, namespace: str, name: str) -> Object:
        obj = self.store.get(resource.storage_key, namespace, name)
        if obj is None:
            raise errors.not_found(resource.target(name))
        return obj

    def list(self, resource: ResourceType, namespace: str | None) -> tuple[list[Object], int]:
        return self.store.items(resource.storage_key, namespace), self.store.revision

    # Creating.

    def create(
        self, resource: ResourceType, namespace: str, body: Any, *, dry_run: bool = False
    ) -> Object:
        obj = validation.decode(resource, body)
        meta = obj["metadata"]
        if resource.namespaced:
            if meta.get("namespace", namespace) != namespace:
                raise errors.bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        if not meta.get("name") and meta.get("generateName"):
            suffix = "".join(random.choices(_NAME_SUFFIX_ALPHABET, k=5))
            meta["name"] = meta["generateName"] + suffix
        name = meta.get("name", "")
        target = resource.target(name)
        problems = validation.validate_metadata(resource, obj)
        if not problems:
            obj = self._prepare_create(resource, obj)
            problems = self._validate(resource, obj)
        if problems:
            raise errors.invalid(target, problems)
        if resource.namespaced:
            self._check_namespace_accepts(target, namespace)
        if self.store.get(resource.storage_key, namespace if resource.namespaced else "", name):
            raise errors.already_exists(target)
        if dry_run:
            return {**obj, "metadata": {**obj["metadata"], "resourceVersion": ""}}
        stored = self.store.put(resource.storage_key, obj, None)
        self._after_write(resource, stored)
        return stored

    def _prepare_create(self, resource: ResourceType, obj: Object) -> Object:
        meta = obj["metadata"]
        for server_owned in (
            "uid",
            "resourceVersion",
            "generation",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "selfLink",
            "managedFields",
        ):
            meta.pop(server_owned, None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = validation.format_time(self._clock())
        if resource.tracks_generation or resource.custom:
            meta["generation"] = 1
        if resource.custom and resource.status_subresource:
            obj.pop("status", None)
        if resource.custom and resource.schema is not None:
            obj = resource.schema.prune_and_default(obj)
        if resource.kind == "Namespace" and not resource.group:
            obj["spec"] = {"finalizers": ["kubernetes"], **(obj.get("spec") or {})}
            obj["status"] = {"phase": "Active"}
        if resource.storage_key == crds.CRD_KEY:
            obj = crds.with_status(obj)
        return obj

    def _validate(self, resource: ResourceType, obj: Object) -> list[errors.FieldError]:
        if resource.custom:
            return [] if resource.schema is None else resource.schema.validate(obj)
        if resource.storage_key == crds.CRD_KEY:
            return crds.validate(obj)
        return validation.validate_builtin(resource, obj)

    def _check_namespace_accepts(self, target: errors.Target, namespace: str) -> None:
        ns = self.store.get(self._namespaces.storage_key, "", namespace)
        if ns is None:
            raise errors.not_found(self._namespaces.target(namespace))
        if ns["metadata"].get("deletionTimestamp"):
            raise errors.forbidden(
                target,
                f"unable to create new content in namespace {namespace} because it is being terminated",
            )

    # Updating.

    def replace(
        self,
        resource: ResourceType,
        namespace: str,
        name: str,
        body: Any,
        *,
        subresource: str = "",
        dry_run: bool = False,
    ) -> Object:
        return self._update(
            resource, namespace, name, lambda _: body, subresource=subresource, dry_run=dry_run
        )

    def patch(
        self,
        resource: ResourceType,
        namespace: str,
        name: str,
        content_type: str,
        patch: Any,
        *,
        subresource: str = "",
        dry_run: bool = False,
    ) -> Object:
        apply: Callable[[Object], Any]
        if content_type == patching.MERGE_PATCH:
            apply = lambda current: patching.merge_patch(current, patch)  # noqa: E731
        elif content_type == patching.JSON_PATCH:
            apply = lambda current: patching.json_patch(current, patch)  # noqa: E731
        elif content_type == patching.STRATEGIC_MERGE_PATCH and not resource.custom:
            apply = lambda current: patching.strategic_merge_patch(current, patch)  # noqa: E731
        else:
            accepted = [patching.JSON_PATCH, patching.MERGE_PATCH]
            if not resource.custom:
                accepted.append(patching.STRATEGIC_MERGE_PATCH)
            raise errors.unsupported_patch_type(accepted)
        return self._update(
            resource, namespace, name, apply, subresource=subresource, dry_run=dry_run
        )

    def _update(
        self,
        resource: ResourceType,
        namespace: str,
        name: str,
        compute: Callable[[Object], Any],
        *,
        subresource: str,
        dry_run: bool,
    ) -> Object:
        target = resource.target(name)
        current = self.get(resource, namespace, name)
        obj = validation.decode(resource, compute(copy.deepcopy(current)))
        meta = obj["metadata"]
        if meta.get("name", name) != name:
            raise errors.bad_request(
                f"the name of the object ({meta['name']}) does not match the name on the URL ({name})"
            )
        if resource.namespaced and meta.get("namespace", namespace) != namespace:
            raise errors.bad_request(
                "the namespace of the provided object does not match the namespace sent on the request"
            )
        requested_version = meta.get("resourceVersion")
        if requested_version and requested_version != current["metadata"]["resourceVersion"]:
            raise errors.stale_resource_version(target)
        obj = self._prepare_update(resource, obj, current, subresource)
        problems = validation.validate_metadata(resource, obj) + self._validate(resource, obj)
        if problems:
            raise errors.invalid(target, problems)
        if _same(obj, current):
            return current  # kube-apiserver skips no-op writes: same resourceVersion, no event
        if dry_run:
            return obj
        if obj["metadata"].get("deletionTimestamp") and not obj["metadata"].get("finalizers"):
            gone = self.store.remove(resource.storage_key, obj)
            self._after_removal(resource, gone)
            return gone
        stored = self.store.put(resource.storage_key, obj, current)
        self._after_write(resource, stored)
        return stored

    def _prepare_update(
        self, resource: ResourceType, obj: Object, current: Object, subresource: str
    ) -> Object:
        old_meta = current["metadata"]
        meta = obj["metadata"]
        meta["name"] = old_meta["name"]
        if resource.namespaced:
            meta["namespace"] = old_meta["namespace"]
        for kept in (
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
        ):
            if kept in old_meta:
                meta[kept] = old_meta[kept]
            else:
                meta.pop(kept, None)
        meta.pop("managedFields", None)
        meta.pop("selfLink", None)
        meta["resourceVersion"] = old_meta["resourceVersion"]
        if subresource == "status":
            # Only the status changes through the status subresource; the rest is kept.
            obj = (
                {**copy.deepcopy(current), "status": obj["status"]}
                if "status" in obj
                else {k: v for k, v in copy.deepcopy(current).items() if k != "status"}
            )
        elif resource.status_subresource:
            # ...and the main resource ignores status changes when a status subresource exists.
            obj = {k: v for k, v in obj.items() if k != "status"}
            if "status" in current:
                obj["status"] = copy.deepcopy(current["status"])
        if resource.custom and resource.schema is not None:
            obj = resource.schema.prune_and_default(obj)
        if resource.storage_key == crds.CRD_KEY:
            obj = crds.with_status(obj)
        if "generation" in obj["metadata"] and _spec_changed(resource, obj, current):
            obj["metadata"]["generation"] = current["metadata"]["generation"] + 1
        return obj

    # Deleting.

    def delete(
        self,
        resource: ResourceType,
        namespace: str,
        name: str,
        preconditions: dict[str, Any] | None = None,
        *,
        dry_run: bool = False,
    ) -> tuple[Object, bool]:
        """Delete an object, or start its graceful deletion.

        Returns the object's last state and whether it is gone (False: it waits for finalizers).
        """
        target = resource.target(name)
        current = self.get(resource, namespace, name)
        meta = current["metadata"]
        for field, value in (preconditions or {}).items():
            actual = meta.get("uid" if field == "uid" else "resourceVersion")
            if value is not None and value != actual:
                label = "UID" if field == "uid" else "ResourceVersion"
                raise errors.conflict(
                    target,
                    f"Precondition failed: {label} in precondition: {value}, {label} in object meta: {actual}",
                )
        if dry_run:
            return current, not self._needs_finalization(resource, current)
        if meta.get("deletionTimestamp"):
            return current, False
        if not self._needs_finalization(resource, current):
            gone = self.store.remove(resource.storage_key, current)
            self._after_removal(resource, gone)
            return gone, True
        terminating = copy.deepcopy(current)
        terminating["metadata"]["deletionTimestamp"] = validation.format_time(self._clock())
        terminating["metadata"]["deletionGracePeriodSeconds"] = 0
        if "generation" in terminating["metadata"]:
            terminating["metadata"]["generation"] += 1
        if resource.kind == "Namespace" and not resource.group:
            terminating["status"] = {**terminating.get("status", {}), "phase": "Terminating"}
        if resource.storage_key == crds.CRD_KEY:
            terminating = crds.terminating(terminating)
        stored = self.store.put(resource.storage_key, terminating, current)
        self._after_write(resource, stored)
        return stored, False

    def _needs_finalization(self, resource: ResourceType, obj: Object) -> bool:
        if obj["metadata"].get("finalizers"):
            return True
        if resource.kind == "Namespace" and not resource.group:
            return True  # the namespace controller empties it first
        return resource.storage_key == crds.CRD_KEY  # the CRD finalizer deletes its objects first

    # Consequences of writes: the controllers kube-apiserver runs next to its registry.

    def _after_write(self, resource: ResourceType, stored: Object) -> None:
        key = resource.storage_key
        if key == crds.CRD_KEY:
            name = stored["metadata"]["name"]
            if stored["metadata"].get("deletionTimestamp"):
                self._finalize_crd(stored)
            else:
                self.registry.define(name, crds.resource_types(stored))
        elif (
            resource.kind == "Namespace"
            and not resource.group
            and stored["metadata"].get("deletionTimestamp")
        ):
            self._finalize_namespace(stored["metadata"]["name"])
        elif resource.kind == "Event" and not resource.group:
            self._evict_old_events(resource)

    def _after_removal(self, resource: ResourceType, gone: Object) -> None:
        if resource.storage_key == crds.CRD_KEY:
            self.registry.undefine(gone["metadata"]["name"])
            return
        namespace = gone["metadata"].get("namespace")
        if namespace:
            self._reap_namespace(namespace)
        if resource.custom:
            self._reap_crd(resource)

    def _finalize_namespace(self, namespace: str) -> None:
        for resource in self._storage_types():
            if resource.namespaced:
                for obj in self.store.items(resource.storage_key, namespace):
                    if not obj["metadata"].get("deletionTimestamp"):
                        self.delete(resource, namespace, obj["metadata"]["name"])
        self._reap_namespace(namespace)

    def _reap_namespace(self, namespace: str) -> None:
        ns = self.store.get(self._namespaces.storage_key, "", namespace)
        if (
            ns is not None
            and ns["metadata"].get("deletionTimestamp")
            and self.store.namespace_is_empty(namespace)
        ):
            if not ns["metadata"].get("finalizers"):
                self.store.remove(self._namespaces.storage_key, ns)

    def _finalize_crd(self, crd: Object) -> None:
        for resource in crds.resource_types(crd)[:1]:
            for obj in self.store.items(resource.storage_key):
                if not obj["metadata"].get("deletionTimestamp"):
                    self.delete(
                        resource, obj["metadata"].get("namespace", ""), obj["metadata"]["name"]
                    )
            self._reap_crd(resource)

    def _reap_crd(self, resource: ResourceType) -> None:
        crd_name = f"{resource.plural}.{resource.group}"
        crd = self.store.get(crds.CRD_KEY, "", crd_name)
        if crd is None or not crd["metadata"].get("deletionTimestamp"):
            return
        if not self.store.items(resource.storage_key) and not crd["metadata"].get("finalizers"):
            gone = self.store.remove(crds.CRD_KEY, crd)
            self.registry.undefine(gone["metadata"]["name"])

    def _evict_old_events(self, resource: ResourceType) -> None:
        # Events expire in kube-apiserver (1 h TTL); a count bound keeps memory flat here.
        while self.store.count(resource.storage_key) > self._max_events:
            oldest = self.store.oldest(resource.storage_key)
            if oldest is None:
                break
            self.store.remove(resource.storage_key, oldest)

    def _storage_types(self) -> list[ResourceType]:
        """One served type per stored resource (the first version of each)."""
        seen: dict[tuple[str, str], ResourceType] = {}
        for resource in self.registry:
            seen.setdefault(resource.storage_key, resource)
        return list(seen.values())


def _same(new: Object, old: Object) -> bool:
    return new == old


def _spec_changed(resource: ResourceType, new: Object, old: Object) -> bool:
    if not resource.custom:
        return new.get("spec") != old.get("spec")
    ignored = {"metadata", "status"} if resource.status_subresource else {"metadata"}
    return {k: v for k, v in new.items() if k not in ignored} != {
        k: v for k, v in old.items() if k not in ignored
    }
