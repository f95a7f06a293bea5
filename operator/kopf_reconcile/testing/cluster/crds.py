"""CustomResourceDefinitions: their validation, their status, and the resource types they serve.

Applying a CRD makes its served versions available at once (the embedded cluster has no
controller delay): the stored object carries the ``NamesAccepted`` and ``Established``
conditions kube-apiserver's controllers would set, ``acceptedNames`` and ``storedVersions``.
Deleting a CRD marks it ``Terminating``; its objects are deleted (honouring their
finalizers) and the CRD disappears with the last of them.
"""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

from kopf_reconcile.testing.cluster.errors import FieldError
from kopf_reconcile.testing.cluster.resources import PrinterColumn, ResourceType, StorageKey
from kopf_reconcile.testing.cluster.schema import StructuralSchema
from kopf_reconcile.testing.cluster.validation import format_time

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


def _condition(previous: list[Object], type_: str, reason: str, message: str) -> Object:
    old = next((c for c in previous if c.get("type") == type_ and c.get("status") == "True"), None)
    since = old["lastTransitionTime"] if old else format_time(datetime.now(UTC))
    return {
        "type": type_,
        "status": "True",
        "lastTransitionTime": since,
        "reason": reason,
        "message": message,
    }


def with_status(crd: Object) -> Object:
    """The CRD with the status its controllers would give it once names are accepted."""
    result = copy.deepcopy(crd)
    spec = result.get("spec") or {}
    spec["names"] = _accepted_names(spec)
    status = result.get("status") or {}
    previous = status.get("conditions") or []
    conditions = [
        _condition(previous, "NamesAccepted", "NoConflicts", "no conflicts found"),
        _condition(
            previous, "Established", "InitialNamesAccepted", "the initial names have been accepted"
        ),
    ]
    if result["metadata"].get("deletionTimestamp"):
        conditions.append(
            _condition(
                previous,
                "Terminating",
                "InstanceDeletionInProgress",
                "CustomResource deletion is in progress",
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


def terminating(crd: Object) -> Object:
    """The CRD once its deletion started (``deletionTimestamp`` is set by the caller)."""
    return with_status(crd)


def resource_types(crd: Object) -> tuple[ResourceType, ...]:
    """The resource types a CRD serves: one per served version."""
    spec = crd["spec"]
    names = _accepted_names(spec)
    versions = spec.get("versions") or []
    storage = next((v["name"] for v in versions if v.get("storage")), "")
    served: list[ResourceType] = []
    for version in versions:
        if not version.get("served", True):
            continue
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        served.append(
            ResourceType(
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
        )
    return tuple(served)
