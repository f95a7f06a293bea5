"""How the embedded API server shapes its answers: JSON documents, Status errors, objects
as the requested version serves them, list items, deletion statuses and warnings.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from kopf_reconcile.testing.emulated_apiserver import errors
from kopf_reconcile.testing.emulated_apiserver.registry import WriteOptions
from kopf_reconcile.testing.emulated_apiserver.resources import ResourceType
from kopf_reconcile.testing.emulated_apiserver.store import Object


def dumps(document: Any) -> bytes:
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()


def json_response(document: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=dumps(document), content_type="application/json")


def error_response(error: errors.ApiError) -> web.Response:
    return json_response(error.status(), error.code)


def written(
    resource: ResourceType, obj: Object, options: WriteOptions, status: int = 200
) -> web.Response:
    return with_warnings(json_response(as_served(resource, obj), status), options)


def with_warnings(response: web.Response, options: WriteOptions) -> web.Response:
    """The response with a ``Warning`` header per warning the request produced."""
    for warning in options.warnings:
        response.headers.add("Warning", f"299 - {json.dumps(warning)}")
    return response


def as_served(resource: ResourceType, obj: Object) -> Object:
    """An object as this version serves it (``None`` conversion between CRD versions)."""
    if obj.get("apiVersion") == resource.api_version:
        return obj
    return {**obj, "apiVersion": resource.api_version}


def as_list_item(resource: ResourceType, obj: Object) -> Object:
    """List items of built-in kinds carry no kind/apiVersion (typed lists); custom ones do."""
    if resource.custom:
        return as_served(resource, obj)
    return {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}


def deleted_status(resource: ResourceType, obj: Object) -> dict[str, Any]:
    details: dict[str, Any] = {"name": obj["metadata"]["name"]}
    if resource.group:
        details["group"] = resource.group
    details["kind"] = resource.plural
    details["uid"] = obj["metadata"].get("uid", "")
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "details": details,
    }
