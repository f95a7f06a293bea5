"""CustomResourceDefinitions: their validation, their status, and the resource types they serve.

Applying a CRD makes its served versions available at once (the embedded cluster has no
controller delay): the stored object carries the ``NamesAccepted`` and ``Established``
conditions kube-apiserver's controllers would set, ``acceptedNames`` and ``storedVersions``.
Deleting a CRD marks it ``Terminating``; its objects are deleted (honouring their
finalizers) and the CRD disappears with the last of them, as with kube-apiserver's
``customresourcecleanup.apiextensions.k8s.io`` finalizer.
"""

from __future__ import annotations

import copy
from datetime import datetime
from typing import Any

from kopf_reconcile.testing.emulated_apiserver.errors import FieldError
from kopf_reconcile.testing.emulated_apiserver.resources import (
    PrinterColumn,
    ResourceType,
    StorageKey,
)
from kopf_reconcile.testing.emulated_apiserver.schema import StructuralSchema
from kopf_reconcile.testing.emulated_apiserver.validation import format_time

Object = dict[str, Any]

CRD_KEY: StorageKey = ("apiextensions.k8s.io", "customresourcedefinitions")

_SCOPES = ("Cluster", "Namespaced")


def validate(crd: Object) -> list[FieldError]:
    """The checks of kube-apiserver's CRD validation that clients run into in practice."""
    spec = crd.get("spec")
    if not isinstance(spec, dict):
        return [FieldError.required("spec")]
    problems: list[FieldError] = []
    group = spec.get("group") or ""
    names = spec.get("names") or {}
    plural, kind = names.get("plural") or "", names.get("kind") or ""
    if not group:
        problems.append(FieldError.required("spec.group"))
    elif "." not in group:
        problems.append(
            FieldError.invalid("spec.group", group, "should be a domain with at least one dot")
        )
    if not plural:
        problems.append(FieldError.required("spec.names.plural"))
    if not kind:
        problems.append(FieldError.required("spec.names.kind"))
    name = crd["metadata"].get("name", "")
    if plural and group and name != f"{plural}.{group}":
        problems.append(
            FieldError.invalid("metadata.name", name, 'must be spec.names.plural+"."+spec.group')
        )
    if spec.get("scope") not in _SCOPES:
        problems.append(FieldError.not_supported("spec.scope", spec.get("scope"), _SCOPES))
    versions = spec.get("versions") or []
    if not versions:
        problems.append(
            FieldError.invalid(
                "spec.versions", versions, "must have exactly one version marked as storage version"
            )
        )
        return problems
    if sum(1 for v in versions if v.get("storage")) != 1:
        problems.append(
            FieldError.invalid(
                "spec.versions", versions, "must have exactly one version marked as storage version"
            )
        )
    for index, version in enumerate(versions):
        field = f"spec.versions[{index}]"
        if not version.get("name"):
            problems.append(FieldError.required(f"{field}.name"))
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        if not isinstance(schema, dict):
            problems.append(
                FieldError.required(f"{field}.schema.openAPIV3Schema", "schemas are required")
            )
        elif schema.get("type") != "object":
            problems.append(
                FieldError.invalid(
                    f"{field}.schema.openAPIV3Schema.type",
                    schema.get("type"),
                    "must be object at the root",
                )
            )
    return problems


def _accepted_names(spec: Object) -> Object:
    names = dict(spec.get("names") or {})
    kind = names.get("kind", "")
    names.setdefault("singular", kind.lower())
    names.setdefault("listKind", f"{kind}List")
    return names


def _condition(previous: list[Object], type_: str, reason: str, message: str, now: str) -> Object:
    old = next((c for c in previous if c.get("type") == type_ and c.get("status") == "True"), None)
    since = old["lastTransitionTime"] if old else now
    return {
        "type": type_,
        "status": "True",
        "lastTransitionTime": since,
        "reason": reason,
        "message": message,
    }


def with_defaults_and_status(crd: Object, now: datetime) -> Object:
    """The CRD with its defaulted spec and the status its controllers would give it."""
    result = copy.deepcopy(crd)
    spec = result.setdefault("spec", {})
    spec["names"] = _accepted_names(spec)
    spec.setdefault("conversion", {"strategy": "None"})
    status = result.get("status") or {}
    previous = status.get("conditions") or []
    moment = format_time(now)
    conditions = [
        _condition(previous, "NamesAccepted", "NoConflicts", "no conflicts found", moment),
        _condition(
            previous,
            "Established",
            "InitialNamesAccepted",
            "the initial names have been accepted",
            moment,
        ),
    ]
    if result["metadata"].get("deletionTimestamp"):
        conditions.append(
            _condition(
                previous,
                "Terminating",
                "InstanceDeletionInProgress",
                "CustomResource deletion is in progress",
                moment,
            )
        )
    stored = list(status.get("storedVersions") or [])
    for version in spec.get("versions") or []:
        if version.get("storage") and version.get("name") not in stored:
            stored.append(version["name"])
    result["status"] = {
        "conditions": conditions,
        "acceptedNames": spec["names"],
        "storedVersions": stored,
    }
    return result


def _version_type(spec: Object, version: Object, storage: str) -> ResourceType:
    names = _accepted_names(spec)
    schema = (version.get("schema") or {}).get("openAPIV3Schema")
    return ResourceType(
        group=spec["group"],
        version=version["name"],
        plural=names["plural"],
        singular=names["singular"],
        kind=names["kind"],
        namespaced=spec.get("scope") == "Namespaced",
        short_names=tuple(names.get("shortNames") or ()),
        categories=tuple(names.get("categories") or ()),
        status_subresource="status" in (version.get("subresources") or {}),
        tracks_generation=True,
        custom=True,
        schema=StructuralSchema(schema) if isinstance(schema, dict) else None,
        printer_columns=tuple(
            PrinterColumn(
                name=column.get("name", ""),
                type=column.get("type", "string"),
                json_path=column.get("jsonPath", ""),
                description=column.get("description", ""),
                priority=int(column.get("priority", 0)),
                format=column.get("format", ""),
            )
            for column in version.get("additionalPrinterColumns") or ()
        ),
        storage_version=storage,
    )


def _storage_version(spec: Object) -> Object:
    return next(v for v in spec["versions"] if v.get("storage"))


def resource_types(crd: Object) -> tuple[ResourceType, ...]:
    """The resource types a CRD serves: one per served version."""
    spec = crd["spec"]
    storage = _storage_version(spec)["name"]
    return tuple(
        _version_type(spec, version, storage)
        for version in spec["versions"]
        if version.get("served")
    )


def storage_type(crd: Object) -> ResourceType:
    """The type of a CRD's storage version, served or not (what its objects are kept as)."""
    spec = crd["spec"]
    storage = _storage_version(spec)
    return _version_type(spec, storage, storage["name"])
