"""Minimal OpenAPI v3 documents, enough for kubectl to find kinds and to apply objects.

kubectl asks ``/openapi/v3`` for an index of group-versions, then one document per
group-version, and uses them to validate manifests client-side and to compute patches.
The documents here declare each served kind (``x-kubernetes-group-version-kind``) with a
schema that accepts any fields (a CRD version's ``openAPIV3Schema`` for custom kinds), so
kubectl's client-side checks pass and the server's own validation decides.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kopf_reconcile.testing.cluster.resources import ResourceRegistry, ResourceType


def _path_of(resource: ResourceType) -> str:
    return (
        f"apis/{resource.group}/{resource.version}" if resource.group else f"api/{resource.version}"
    )


def _schema_name(resource: ResourceType) -> str:
    group = resource.group or "core"
    return f"{'.'.join(reversed(group.split('.')))}.{resource.version}.{resource.kind}"


def group_version_document(registry: ResourceRegistry, path: str) -> dict[str, Any] | None:
    resources = [r for r in registry if _path_of(r) == path]
    if not resources:
        return None
    schemas: dict[str, Any] = {}
    for resource in resources:
        schema: dict[str, Any] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        if resource.schema is not None:
            schema = {**resource.schema.openapi_schema}
        schema["x-kubernetes-group-version-kind"] = [
            {"group": resource.group, "version": resource.version, "kind": resource.kind}
        ]
        schemas[_schema_name(resource)] = schema
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.20.2"},
        "paths": {},
        "components": {"schemas": schemas},
    }


def index(registry: ResourceRegistry) -> dict[str, Any]:
    paths: dict[str, Any] = {}
    for path in sorted({_path_of(r) for r in registry}):
        document = group_version_document(registry, path)
        digest = (
            hashlib.sha512(json.dumps(document, sort_keys=True).encode()).hexdigest()[:64].upper()
        )
        paths[path] = {"serverRelativeURL": f"/openapi/v3/{path}?hash={digest}"}
    return {"paths": paths}
