"""Minimal OpenAPI v3 documents: what kubectl needs to apply objects with plain defaults.

kubectl reads ``/openapi/v3`` (an index of group-versions) and one document per
group-version. From the PATCH operation of a kind's path it learns two things:

* the ``fieldValidation`` parameter is listed, so kubectl leaves validation to the server
  (``fieldValidation=Strict``) instead of downloading ``/openapi/v2`` (served as protobuf
  by kube-apiserver, not here) for client-side validation;
* ``application/strategic-merge-patch+json`` is *not* among the request bodies, so kubectl
  computes strategic merge patches for built-in kinds from its own Go types and plain
  merge patches for custom resources, exactly as with a server it has no schema for;
  ``application/apply-patch+yaml`` is (``kubectl apply --server-side``).

Component schemas carry each kind's ``x-kubernetes-group-version-kind`` (a CRD version's
``openAPIV3Schema`` for custom kinds; any object for built-ins).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kopf_reconcile.testing.emulated_apiserver.discovery import EMULATED_VERSION
from kopf_reconcile.testing.emulated_apiserver.patching import APPLY_PATCH, JSON_PATCH, MERGE_PATCH
from kopf_reconcile.testing.emulated_apiserver.resources import ResourceRegistry, ResourceType


def _path_of(resource: ResourceType) -> str:
    return (
        f"apis/{resource.group}/{resource.version}" if resource.group else f"api/{resource.version}"
    )


def _schema_name(resource: ResourceType) -> str:
    group = resource.group or "core"
    return f"{'.'.join(reversed(group.split('.')))}.{resource.version}.{resource.kind}"


def _object_path(resource: ResourceType) -> str:
    root = f"/{_path_of(resource)}"
    if resource.namespaced:
        return f"{root}/namespaces/{{namespace}}/{resource.plural}/{{name}}"
    return f"{root}/{resource.plural}/{{name}}"


def _patch_path(resource: ResourceType, schema_ref: dict[str, str]) -> dict[str, Any]:
    gvk = {"group": resource.group, "version": resource.version, "kind": resource.kind}
    parameters = [
        {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}},
        {"name": "dryRun", "in": "query", "schema": {"type": "string"}},
        {"name": "fieldManager", "in": "query", "schema": {"type": "string"}},
        {"name": "fieldValidation", "in": "query", "schema": {"type": "string"}},
        {"name": "force", "in": "query", "schema": {"type": "boolean"}},
    ]
    if resource.namespaced:
        parameters.insert(
            1, {"name": "namespace", "in": "path", "required": True, "schema": {"type": "string"}}
        )
    body = {"schema": {"type": "object"}}
    return {
        "patch": {
            "operationId": f"patch{resource.kind}",
            "x-kubernetes-action": "patch",
            "x-kubernetes-group-version-kind": gvk,
            "parameters": parameters,  # kubectl reads them from the operation itself
            "requestBody": {
                "content": {JSON_PATCH: body, MERGE_PATCH: body, APPLY_PATCH: body},
                "required": True,
            },
            "responses": {
                "200": {
                    "description": "OK",
                    "content": {"application/json": {"schema": schema_ref}},
                }
            },
        },
    }


def group_version_document(registry: ResourceRegistry, path: str) -> dict[str, Any] | None:
    resources = [r for r in registry if _path_of(r) == path]
    if not resources:
        return None
    schemas: dict[str, Any] = {}
    paths: dict[str, Any] = {}
    for resource in resources:
        schema: dict[str, Any] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        if resource.schema is not None:
            schema = dict(resource.schema.openapi_schema)
        schema["x-kubernetes-group-version-kind"] = [
            {"group": resource.group, "version": resource.version, "kind": resource.kind}
        ]
        name = _schema_name(resource)
        schemas[name] = schema
        paths[_object_path(resource)] = _patch_path(
            resource, {"$ref": f"#/components/schemas/{name}"}
        )
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": EMULATED_VERSION},
        "paths": paths,
        "components": {"schemas": schemas},
    }


def index(registry: ResourceRegistry) -> dict[str, Any]:
    """``/openapi/v3``: each group-version's document, with a hash that changes with it."""
    paths: dict[str, Any] = {}
    for path in sorted({_path_of(r) for r in registry}):
        document = group_version_document(registry, path)
        digest = hashlib.sha512(json.dumps(document, sort_keys=True).encode()).hexdigest()
        paths[path] = {"serverRelativeURL": f"/openapi/v3/{path}?hash={digest[:128].upper()}"}
    return {"paths": paths}
