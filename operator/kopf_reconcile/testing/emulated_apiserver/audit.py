"""An audit log as kube-apiserver writes it with the real tier's policy (JSON lines).

One ``audit.k8s.io/v1`` Event a line, written when its request completes (stage
``ResponseComplete`` only), by the policy of the real tier
(:data:`kopf_reconcile.testing.real_apiserver.AUDIT_POLICY`): reads (``get``, ``list``,
``watch``) are not logged; writes of Leases at level ``RequestResponse`` (with the
``responseObject``); every other write at ``Metadata``. Each Event has ``kind``,
``apiVersion``, ``level``, ``auditID`` (also the ``Audit-Id`` response header),
``stage``, ``requestURI``, ``verb``, ``user`` (authenticated), ``impersonatedUser``,
``objectRef``, ``responseStatus`` (``code``, and the Status of a failure or deletion),
``responseObject`` (Leases), ``requestReceivedTimestamp``, ``stageTimestamp`` (RFC 3339
with microseconds) and ``annotations`` (``authorization.k8s.io/decision: allow``,
``authorization.k8s.io/reason``, and admission's). ``sourceIPs``, ``userAgent`` and
``requestObject`` are left out.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from aiohttp import web

from kopf_reconcile.testing.emulated_apiserver.identity import UserInfo

Object = dict[str, Any]

_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
AUDITED_GROUP_RESOURCES = {("coordination.k8s.io", "leases")}


@dataclass
class AuditContext:
    """What one request's Event gathers while it is served."""

    audit_id: str
    received: datetime
    user: UserInfo | None = None
    impersonated: UserInfo | None = None
    annotations: dict[str, str] = field(default_factory=dict)


#: Where a request keeps its AuditContext (its user and annotations travel in it).
AUDIT_CONTEXT = web.RequestKey("audit_context", AuditContext)


def begin() -> AuditContext:
    return AuditContext(str(uuid.uuid4()), datetime.now(UTC))


class AuditLog:
    """Appends Events to a file, one JSON document a line, flushed as written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] = path.open("a", encoding="utf-8")

    def close(self) -> None:
        self._file.close()

    def record(self, request: web.Request, context: AuditContext, response: web.Response) -> None:
        verb = _VERBS.get(request.method)
        if verb is None:
            return  # reads are not logged
        ref = _object_ref(request.path)
        if verb == "delete" and not ref.get("name"):
            verb = "deletecollection"
        body = _json(response.body)
        if verb == "create" and "name" not in ref and isinstance(body, dict):
            name = (body.get("metadata") or {}).get("name") or (body.get("details") or {}).get(
                "name"
            )
            if name and body.get("kind") != "Status":
                ref["name"] = name
        detailed = (ref.get("apiGroup", ""), ref.get("resource", "")) in AUDITED_GROUP_RESOURCES
        if ref.get("subresource"):
            detailed = False
        event: Object = {
            "kind": "Event",
            "apiVersion": "audit.k8s.io/v1",
            "level": "RequestResponse" if detailed else "Metadata",
            "auditID": context.audit_id,
            "stage": "ResponseComplete",
            "requestURI": str(request.rel_url),
            "verb": verb,
            "user": context.user.as_json() if context.user else {},
        }
        if context.impersonated is not None:
            event["impersonatedUser"] = context.impersonated.as_json()
        if ref:
            event["objectRef"] = ref
        if isinstance(body, dict) and body.get("kind") == "Status":
            status = {k: v for k, v in body.items() if k not in ("kind", "apiVersion")}
        else:
            status = {"metadata": {}, "code": response.status}
        event["responseStatus"] = status
        if detailed and body is not None:
            event["responseObject"] = body
        event["requestReceivedTimestamp"] = _micro(context.received)
        event["stageTimestamp"] = _micro(datetime.now(UTC))
        event["annotations"] = {
            "authorization.k8s.io/decision": "allow",
            "authorization.k8s.io/reason": "",
            **context.annotations,
        }
        self._file.write(json.dumps(event, separators=(",", ":"), ensure_ascii=False) + "\n")
        self._file.flush()


def _json(body: Any) -> Any:
    if not isinstance(body, bytes | bytearray):
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


def _micro(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _object_ref(path: str) -> Object:
    """``objectRef`` from an API path: resource, namespace, name, group, version, subresource."""
    segments = [s for s in path.split("/") if s]
    if segments[:1] == ["api"] and len(segments) >= 2:
        group, version, rest = "", segments[1], segments[2:]
    elif segments[:1] == ["apis"] and len(segments) >= 3:
        group, version, rest = segments[1], segments[2], segments[3:]
    else:
        return {}
    namespace = ""
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    ref: Object = {"resource": rest[0]} if rest else {}
    if namespace:
        ref["namespace"] = namespace
    if len(rest) >= 2:
        ref["name"] = rest[1]
    if group:
        ref["apiGroup"] = group
    ref["apiVersion"] = version
    if len(rest) >= 3:
        ref["subresource"] = rest[2]
    return ref
