"""The verbs of the Kubernetes API on stored objects: create, get, list, update, patch,
apply, delete.

This is where kube-apiserver's generic registry semantics live, independent of HTTP:
server-set metadata (``uid``, ``creationTimestamp``, ``resourceVersion``, ``generation``),
optimistic concurrency (409 on a stale ``resourceVersion``; 422 for a PUT without one where
the kind requires it), no-op writes that keep the ``resourceVersion`` and emit no event, the
``status`` subresource, server-side apply, graceful deletion with finalizers
(``deletionTimestamp`` first, removal when the last finalizer goes), the namespace admission
(no new content in a missing or terminating namespace). What controllers do next to it
(namespace reaping, CRD cleanup, Event expiry) is :mod:`.controllers`.

(Over 400 lines on purpose: the verbs share the write path of kube-apiserver's generic
registry store, metadata, preconditions and admission, and read as one unit.)
"""

from __future__ import annotations

import copy
import dataclasses
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

from kopf_reconcile.testing.emulated_apiserver import (
    admission_config,
    applying,
    crds,
    errors,
    patching,
    validation,
)
from kopf_reconcile.testing.emulated_apiserver.admission import (
    BINDINGS_KEY,
    POLICIES_KEY,
    Admission,
    AdmissionRequest,
    Outcome,
)
from kopf_reconcile.testing.emulated_apiserver.controllers import (
    NAMESPACE_NAME_LABEL,
    NAMESPACES_KEY,
    Controllers,
)
from kopf_reconcile.testing.emulated_apiserver.resources import (
    ResourceRegistry,
    ResourceType,
)
from kopf_reconcile.testing.emulated_apiserver.store import Object, Store

if TYPE_CHECKING:
    from kopf_reconcile.testing.emulated_apiserver.identity import UserInfo

#: Namespaces that exist in every kube-apiserver from its start.
SYSTEM_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
#: Namespaces kube-apiserver refuses to delete (403).
IMMORTAL_NAMESPACES = frozenset({"default", "kube-system", "kube-public"})


_NAME_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # what generateName suffixes are made of

#: Metadata only the server sets; whatever a client sends for them on create is dropped.
_SERVER_OWNED_ON_CREATE = (
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "selfLink",
)
#: Metadata an update cannot change: the stored values are kept.
_KEPT_ON_UPDATE = (
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
)

#: How unknown fields in a request are treated (the ``fieldValidation`` query parameter).
FieldValidation = Literal["Ignore", "Warn", "Strict"]
FIELD_VALIDATIONS: tuple[FieldValidation, ...] = ("Ignore", "Warn", "Strict")

_PATCHERS: dict[str, Callable[[Any, Any], Any]] = {
    patching.MERGE_PATCH: patching.merge_patch,
    patching.JSON_PATCH: patching.json_patch,
    patching.STRATEGIC_MERGE_PATCH: patching.strategic_merge_patch,
}

Clock = Callable[[], datetime]


@dataclass
class WriteOptions:
    """How one write request is carried out: ``dryRun``, ``fieldValidation``, and the warnings
    it produced (sent back as ``Warning`` headers)."""

    dry_run: bool = False
    field_validation: FieldValidation = "Ignore"
    warnings: list[str] = field(default_factory=list)
    #: Who writes (after impersonation); None: the cluster itself, not subject to admission.
    user: UserInfo | None = None
    #: Audit annotations admission adds (see :mod:`.audit`).
    annotations: dict[str, str] = field(default_factory=dict)


def _utcnow() -> datetime:
    return datetime.now(UTC)


class ResourceAPI:
    """The API verbs over a store and a registry of served resource types."""

    def __init__(
        self,
        store: Store,
        registry: ResourceRegistry,
        *,
        max_events: int,
        namespace_termination_delay: float,
        clock: Clock = _utcnow,
    ) -> None:
        self.store = store
        self.registry = registry
        self._clock = clock
        self.admission = Admission(self)
        self.controllers = Controllers(
            self, max_events=max_events, namespace_termination_delay=namespace_termination_delay
        )
        namespaces = self._namespaces()
        for name in SYSTEM_NAMESPACES:
            self.create(namespaces, "", {"metadata": {"name": name}})

    def close(self) -> None:
        """Cancel the pending work of the namespace controller (at shutdown)."""
        self.controllers.close()

    def _namespaces(self) -> ResourceType:
        resource = self.registry.get("", "v1", "namespaces")
        assert resource is not None, "namespaces are built in"
        return resource

    # Reading.

    def get(self, resource: ResourceType, namespace: str, name: str) -> Object:
        obj = self.store.get(resource.storage_key, namespace, name)
        if obj is None:
            raise errors.not_found(resource.target(name))
        return obj

    def list_objects(
        self, resource: ResourceType, namespace: str | None
    ) -> tuple[list[Object], int]:
        """The objects (of one namespace, or all) and the revision the list is consistent at."""
        return self.store.items(resource.storage_key, namespace), self.store.revision

    # Creating.

    def create(
        self,
        resource: ResourceType,
        namespace: str,
        body: Any,
        options: WriteOptions | None = None,
    ) -> Object:
        options = options or WriteOptions()
        obj = self._decode(resource, body, options)
        meta = obj["metadata"]
        if resource.namespaced:
            # Admission comes before everything but decoding, as kube-apiserver's
            # NamespaceLifecycle plugin does: the target has no generated name yet.
            admitted = resource.target(meta.get("name") or meta.get("generateName", ""))
            self._check_namespace_accepts(admitted, namespace)
            if meta.get("namespace", namespace) != namespace:
                raise errors.bad_request(
                    "the namespace of the provided object does not match the namespace sent "
                    "on the request"
                )
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        if not meta.get("name") and meta.get("generateName"):
            suffix = "".join(random.choices(_NAME_SUFFIX_ALPHABET, k=5))
            meta["name"] = meta["generateName"] + suffix
        target = resource.target(meta.get("name", ""))
        problems = validation.validate_metadata(resource, obj)
        if not problems:
            obj = self._prepare_create(resource, obj)
            problems = self._validate(resource, obj)
        if problems:
            raise errors.invalid(target, problems)
        self._admit("CREATE", resource, "", namespace, meta["name"], obj, None, options)
        if self.store.get(resource.storage_key, meta.get("namespace", ""), meta["name"]):
            raise errors.already_exists(target)
        if options.dry_run:
            return obj
        stored = self.store.put(resource.storage_key, obj, None)
        self.controllers.after_write(resource, stored)
        return stored

    def _prepare_create(self, resource: ResourceType, obj: Object) -> Object:
        meta = obj["metadata"]
        for server_owned in _SERVER_OWNED_ON_CREATE:
            meta.pop(server_owned, None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = validation.format_time(self._clock())
        managed = applying.sent_on_create(meta.pop("managedFields", None))
        if managed:
            meta["managedFields"] = managed
        if resource.tracks_generation:
            meta["generation"] = 1
        if resource.custom and resource.status_subresource:
            obj.pop("status", None)
        if resource.storage_key == NAMESPACES_KEY:
            obj["spec"] = {"finalizers": ["kubernetes"], **(obj.get("spec") or {})}
            obj["status"] = {"phase": "Active"}
            _label_namespace_with_its_name(obj)
        if resource.storage_key == crds.CRD_KEY:
            obj = crds.with_defaults_and_status(obj, self._clock())
        return obj

    def _decode(self, resource: ResourceType, body: Any, options: WriteOptions) -> Object:
        """Decode (and for custom resources prune and default) a body; check unknown fields."""
        obj = validation.decode(resource, body)
        if resource.schema is not None:
            obj = resource.schema.prune_and_default(obj)
        if options.field_validation != "Ignore":
            unknown = [f'unknown field "{path}"' for path in validation.dropped_fields(body, obj)]
            if unknown and options.field_validation == "Strict":
                target = resource.target(obj["metadata"].get("name", ""))
                detail = "strict decoding error: " + ", ".join(unknown)
                raise errors.undecodable(target, resource.version, detail)
            options.warnings.extend(unknown)
        return obj

    def _validate(self, resource: ResourceType, obj: Object) -> list[errors.FieldError]:
        if resource.custom:
            return [] if resource.schema is None else resource.schema.validate(obj)
        if resource.storage_key == crds.CRD_KEY:
            return crds.validate(obj)
        if resource.storage_key in (POLICIES_KEY, BINDINGS_KEY):
            return admission_config.validate(resource, obj)
        return validation.validate_builtin(resource, obj)

    def _check_namespace_accepts(self, target: errors.Target, namespace: str) -> None:
        ns = self.store.get(NAMESPACES_KEY, "", namespace)
        if ns is None:
            raise errors.not_found(self._namespaces().target(namespace))
        if ns["metadata"].get("deletionTimestamp"):
            cause = {
                "reason": "NamespaceTerminating",
                "message": f"namespace {namespace} is being terminated",
                "field": "metadata.namespace",
            }
            raise errors.forbidden(
                target,
                f"unable to create new content in namespace {namespace} "
                "because it is being terminated",
                [cause],
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
        options: WriteOptions | None = None,
    ) -> tuple[Object, bool]:
        """PUT: the new state, and whether it was created (Leases and Events allow that)."""
        options = options or WriteOptions()
        current = self.store.get(resource.storage_key, namespace, name)
        exists = current is not None
        # A uid in the body is a precondition (it must name the stored object), as in
        # kube-apiserver, so a PUT meant for a deleted object cannot recreate it.
        sent_uid = (body.get("metadata") or {}).get("uid") if isinstance(body, dict) else None
        stored_uid = current["metadata"]["uid"] if current is not None else ""
        if sent_uid and sent_uid != stored_uid:
            raise errors.conflict(
                resource.target(name),
                f"Precondition failed: UID in precondition: {sent_uid}, "
                f"UID in object meta: {stored_uid}",
            )
        if not exists and resource.create_on_update and not subresource:
            if isinstance(body, dict) and (body.get("metadata") or {}).get("name", name) != name:
                raise errors.bad_request(_name_mismatch(body["metadata"]["name"], name))
            return self.create(resource, namespace, body, options), True
        updated = self._update(
            resource,
            namespace,
            name,
            lambda _: body,
            subresource=subresource,
            options=options,
            require_version=not resource.unconditional_update,
        )
        return updated, False

    def patch(
        self,
        resource: ResourceType,
        namespace: str,
        name: str,
        content_type: str,
        patch: Any,
        *,
        subresource: str = "",
        options: WriteOptions | None = None,
    ) -> Object:
        patcher = _PATCHERS.get(content_type)
        # Strategic merge needs Go struct tags: custom resources refuse it (kubectl falls back).
        if patcher is None or (resource.custom and content_type == patching.STRATEGIC_MERGE_PATCH):
            accepted = [patching.JSON_PATCH, patching.MERGE_PATCH]
            if not resource.custom:
                accepted.append(patching.STRATEGIC_MERGE_PATCH)
            accepted.append(patching.APPLY_PATCH)
            raise errors.unsupported_patch_type(accepted)

        def apply(current: Object) -> Any:
            try:
                return patcher(current, patch)
            except patching.PatchFailed:
                raise errors.patch_rejected() from None

        return self._update(
            resource,
            namespace,
            name,
            apply,
            subresource=subresource,
            options=options or WriteOptions(),
        )

    def apply(
        self,
        resource: ResourceType,
        namespace: str,
        name: str,
        config: Any,
        *,
        manager: str,
        force: bool,
        subresource: str = "",
        options: WriteOptions | None = None,
    ) -> tuple[Object, bool]:
        """Server-side apply: the new state, and whether it was created (see :mod:`.applying`)."""
        options = options or WriteOptions()
        config = self._apply_configuration(resource, namespace, name, config)
        decoded = self._decode(resource, config, options)
        owned = {
            path
            for path, _ in applying.applied_fields(config)
            if applying.present(decoded, path) and _applies_to(resource, subresource, path)
        }
        time = validation.format_time(self._clock())
        # Unknown fields were reported above; the writes below see them again.
        options = dataclasses.replace(options, field_validation="Ignore")
        current = self.store.get(resource.storage_key, namespace, name)
        if current is None:
            if subresource:
                raise errors.not_found(resource.target(name))
            if not (config.get("metadata") or {}).get("name"):
                raise errors.bad_request(
                    f"the name of the object ({name} based on URL) was undeterminable: "
                    "name must be provided"
                )
            entry = applying.apply_entry(manager, resource.api_version, owned, time)
            metadata = {**config["metadata"], "managedFields": [entry] if owned else None}
            return self.create(resource, namespace, {**config, "metadata": metadata}, options), True
        merged = applying.applied(
            current,
            config,
            owned,
            manager=manager,
            force=force,
            api_version=resource.api_version,
            time=time,
        )
        updated = self._update(
            resource,
            namespace,
            name,
            lambda _: merged,
            subresource=subresource,
            options=options,
            applied=True,
        )
        return updated, False

    def _apply_configuration(
        self, resource: ResourceType, namespace: str, name: str, config: Any
    ) -> Object:
        """Check an apply configuration's identity as kube-apiserver does, before anything."""
        if not isinstance(config, dict):
            raise errors.bad_request(
                "error decoding patch: error unmarshaling JSON: while decoding JSON: json: "
                f"cannot unmarshal {_json_type_name(config)} into Go value of type "
                "map[string]interface {}"
            )
        version = config.get("apiVersion") or ""
        kind = config.get("kind") or ""
        if version != resource.api_version or kind != resource.kind:
            raise errors.bad_request(f"invalid object type: {version}, Kind={kind}")
        metadata = config.get("metadata") or {}
        if not isinstance(metadata, dict):
            return config  # decoding answers 400 for it
        if metadata.get("name", name) != name:
            raise errors.bad_request(_name_mismatch(metadata["name"], name))
        sent_namespace = metadata.get("namespace")
        if resource.namespaced and sent_namespace and sent_namespace != namespace:
            raise errors.bad_request(
                f"the namespace of the object ({sent_namespace}) does not match the namespace "
                f"on the request ({namespace})"
            )
        return config

    def _update(
        self,
        resource: ResourceType,
        namespace: str,
        name: str,
        compute: Callable[[Object], Any],
        *,
        subresource: str,
        options: WriteOptions,
        require_version: bool = False,
        applied: bool = False,
    ) -> Object:
        """Write a new state computed from the current one.

        ``require_version``: the body must name the resourceVersion it updates (a PUT of a
        kind that forbids unconditional updates). ``applied``: the state comes from a
        server-side apply, its managedFields already final.
        """
        target = resource.target(name)
        current = self.get(resource, namespace, name)
        obj = self._decode(resource, compute(copy.deepcopy(current)), options)
        meta = obj["metadata"]
        if meta.get("name", name) != name:
            raise errors.bad_request(_name_mismatch(meta["name"], name))
        if resource.namespaced and meta.get("namespace", namespace) != namespace:
            raise errors.bad_request(
                "the namespace of the provided object does not match the namespace sent "
                "on the request"
            )
        requested_version = meta.get("resourceVersion")
        if require_version and not requested_version:
            raise errors.resource_version_required(target)
        if requested_version and requested_version != current["metadata"]["resourceVersion"]:
            raise errors.stale_resource_version(target)
        if meta.get("uid", current["metadata"]["uid"]) != current["metadata"]["uid"]:
            immutable = errors.FieldError.invalid("metadata.uid", meta["uid"], "field is immutable")
            raise errors.invalid(target, [immutable])
        sent_managed = meta.get("managedFields")
        obj = self._prepare_update(resource, obj, current, subresource)
        managed = sent_managed if applied else applying.after_update(sent_managed, current, obj)
        if managed:
            obj["metadata"]["managedFields"] = managed
        else:
            obj["metadata"].pop("managedFields", None)
        problems = (
            validation.validate_metadata_update(obj, current)
            + validation.validate_metadata(resource, obj)
            + self._validate(resource, obj)
        )
        if problems:
            raise errors.invalid(target, problems)
        self._admit("UPDATE", resource, subresource, namespace, name, obj, current, options)
        if obj == current:
            return current  # kube-apiserver skips no-op writes: same resourceVersion, no event
        if options.dry_run:
            return obj
        if (
            obj["metadata"].get("deletionTimestamp")
            and not obj["metadata"].get("finalizers")
            and not self._finalized_by_controller(resource)
        ):
            # The write that removes the last finalizer is never stored: the object is
            # deleted as last stored, so the DELETED event still lists the finalizers (as
            # etcd's delete reports it). The writer gets the state it asked for, at the
            # last stored resourceVersion, as kube-apiserver answers.
            gone = self.store.remove(resource.storage_key, current)
            self.controllers.after_removal(resource, gone)
            return obj
        stored = self.store.put(resource.storage_key, obj, current)
        self.controllers.after_write(resource, stored)
        return stored

    def _prepare_update(
        self, resource: ResourceType, obj: Object, current: Object, subresource: str
    ) -> Object:
        old_meta = current["metadata"]
        meta = obj["metadata"]
        meta["name"] = old_meta["name"]
        if resource.namespaced:
            meta["namespace"] = old_meta["namespace"]
        for kept in _KEPT_ON_UPDATE:
            if kept in old_meta:
                meta[kept] = old_meta[kept]
            else:
                meta.pop(kept, None)
        meta.pop("selfLink", None)
        meta["resourceVersion"] = old_meta["resourceVersion"]
        if resource.storage_key == NAMESPACES_KEY:
            _label_namespace_with_its_name(obj)
            if "spec" in current:
                # spec.finalizers change only through /finalize, as in kube-apiserver.
                obj["spec"] = copy.deepcopy(current["spec"])
        if subresource == "status":
            # Through the status subresource only the status changes; the rest is kept.
            obj = _with_status_of(current, obj)
        elif resource.status_subresource:
            # ...and the main resource ignores status changes when that subresource exists.
            obj = _with_status_of(obj, current)
        if resource.schema is not None:
            obj = resource.schema.prune_and_default(obj)  # defaults again on the merged object
        if resource.storage_key == crds.CRD_KEY:
            obj = crds.with_defaults_and_status(obj, self._clock())
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
        options: WriteOptions | None = None,
    ) -> tuple[Object, bool]:
        """Delete an object, or start its graceful deletion.

        Returns its last state and whether it is gone (False: it waits for finalizers).
        """
        target = resource.target(name)
        if resource.storage_key == NAMESPACES_KEY and name in IMMORTAL_NAMESPACES:
            raise errors.forbidden(target, "this namespace may not be deleted")
        current = self.get(resource, namespace, name)
        meta = current["metadata"]
        for key, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
            expected = (preconditions or {}).get(key)
            if expected is not None and expected != meta.get(key):
                raise errors.conflict(
                    target,
                    f"Precondition failed: {label} in precondition: {expected}, "
                    f"{label} in object meta: {meta.get(key)}",
                )
        options = options or WriteOptions(dry_run=dry_run)
        dry_run = dry_run or options.dry_run
        self._admit("DELETE", resource, "", namespace, name, None, current, options)
        finalized = self._needs_finalization(resource, current)
        if dry_run or meta.get("deletionTimestamp"):
            return current, False if meta.get("deletionTimestamp") else not finalized
        if not finalized:
            gone = self.store.remove(resource.storage_key, current)
            self.controllers.after_removal(resource, gone)
            return gone, True
        terminating = copy.deepcopy(current)
        terminating_meta = terminating["metadata"]
        terminating_meta["deletionTimestamp"] = validation.format_time(self._clock())
        if resource.storage_key == NAMESPACES_KEY:
            terminating["status"] = {**terminating.get("status", {}), "phase": "Terminating"}
        else:
            terminating_meta["deletionGracePeriodSeconds"] = 0
        if "generation" in terminating_meta:
            terminating_meta["generation"] += 1
        if resource.storage_key == crds.CRD_KEY:
            terminating = crds.with_defaults_and_status(terminating, self._clock())
        stored = self.store.put(resource.storage_key, terminating, current)
        self.controllers.after_write(resource, stored)
        if resource.storage_key == NAMESPACES_KEY:
            self.controllers.terminate_namespace_later(stored)
        return stored, False

    def _admit(  # noqa: PLR0917 (the attributes of one admission request)
        self,
        operation: str,
        resource: ResourceType,
        subresource: str,
        namespace: str,
        name: str,
        obj: Object | None,
        old: Object | None,
        options: WriteOptions,
    ) -> None:
        """Admission policies (:mod:`.admission`) on a write a user makes."""
        if options.user is None:
            return
        request = AdmissionRequest(
            operation,
            resource,
            subresource,
            namespace if resource.namespaced else "",
            name,
            obj,
            old,
            options.user,
            options.dry_run,
        )
        self.admission.validate(request, Outcome(options.warnings, options.annotations))

    def _needs_finalization(self, resource: ResourceType, obj: Object) -> bool:
        return bool(obj["metadata"].get("finalizers")) or self._finalized_by_controller(resource)

    def _finalized_by_controller(self, resource: ResourceType) -> bool:
        # A namespace is emptied by its controller, a CRD's objects by the CRD finalizer:
        # deleting either only marks it, and it goes once its content has gone.
        return resource.storage_key in (NAMESPACES_KEY, crds.CRD_KEY)


def _applies_to(resource: ResourceType, subresource: str, path: applying.FieldPath) -> bool:
    """Whether an applied field belongs to the (sub)resource applied to: with a status
    subresource, the main resource owns everything but the status, and the status only it."""
    if not resource.status_subresource:
        return True
    return (path[0] == "status") == (subresource == "status")


def _name_mismatch(body_name: str, url_name: str) -> str:
    return f"the name of the object ({body_name}) does not match the name on the URL ({url_name})"


def _with_status_of(base: Object, source: Object) -> Object:
    """``base`` with the ``status`` of ``source`` (or without one if ``source`` has none)."""
    result = {k: v for k, v in copy.deepcopy(base).items() if k != "status"}
    if "status" in source:
        result["status"] = copy.deepcopy(source["status"])
    return result


def _spec_changed(resource: ResourceType, new: Object, old: Object) -> bool:
    if not resource.custom:
        return new.get("spec") != old.get("spec")
    ignored = {"metadata", "status"} if resource.status_subresource else {"metadata"}
    return {k: v for k, v in new.items() if k not in ignored} != {
        k: v for k, v in old.items() if k not in ignored
    }


def _label_namespace_with_its_name(namespace: Object) -> None:
    """Every namespace carries ``kubernetes.io/metadata.name: <name>``, whatever a write says
    (kube-apiserver sets it on every create and update since v1.22)."""
    meta = namespace["metadata"]
    meta["labels"] = {**(meta.get("labels") or {}), NAMESPACE_NAME_LABEL: meta["name"]}


def _json_type_name(value: Any) -> str:
    """The JSON type of a decoded value, as Go's encoding/json names it in errors."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, list):
        return "array"
    return "string" if isinstance(value, str) else "null"
