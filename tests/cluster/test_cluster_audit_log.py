"""The audit log: one JSON line per write, Lease writes with their response, no reads."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

MERGE = {"Content-Type": "application/merge-patch+json"}


def events_about(path: Path, name: str) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines()
    events = [json.loads(line) for line in lines if line]
    return [e for e in events if (e.get("objectRef") or {}).get("name") == name]


async def test_writes_are_audited(
    http: aiohttp.ClientSession,
    kube_audit_log: Path,
    kube_namespace: str,
    unique: Callable[[str], str],
) -> None:
    ns, name = kube_namespace, unique("audited")
    leases = f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name}}
    async with http.post(leases, json={**lease, "spec": {"holderIdentity": "a"}}) as response:
        assert response.status == 201
    async with http.get(f"{leases}/{name}") as response:
        assert response.status == 200
    headers = {**MERGE, "Impersonate-User": "admin", "Impersonate-Group": "system:masters"}
    headers["Impersonate-Extra-Kopf-Reconcile.io%2fEpoch"] = "4"
    patch = json.dumps({"spec": {"holderIdentity": "b", "leaseTransitions": 4}})
    async with http.patch(f"{leases}/{name}", data=patch, headers=headers) as response:
        assert response.status == 200
    configmaps = f"/api/v1/namespaces/{ns}/configmaps"
    async with http.delete(f"{configmaps}/{name}") as response:
        assert response.status == 404
    events = events_about(kube_audit_log, name)
    assert [(e["verb"], e["level"], e["responseStatus"]["code"]) for e in events] == [
        ("create", "RequestResponse", 201),
        ("patch", "RequestResponse", 200),
        ("delete", "Metadata", 404),
    ]
    create, renew, missing = events
    assert create["kind"] == "Event"
    assert create["apiVersion"] == "audit.k8s.io/v1"
    assert create["stage"] == "ResponseComplete"
    assert create["requestURI"] == leases
    assert create["user"]["username"] == "admin"
    assert "impersonatedUser" not in create
    assert create["objectRef"] == {
        "resource": "leases",
        "namespace": ns,
        "name": name,
        "apiGroup": "coordination.k8s.io",
        "apiVersion": "v1",
    }
    assert create["annotations"]["authorization.k8s.io/decision"] == "allow"
    assert renew["responseObject"]["spec"] == {"holderIdentity": "b", "leaseTransitions": 4}
    assert renew["impersonatedUser"] == {
        "username": "admin",
        "groups": ["system:masters", "system:authenticated"],
        "extra": {"kopf-reconcile.io/epoch": ["4"]},
    }
    assert len(renew["stageTimestamp"]) == len("2026-01-02T03:04:05.123456Z")
    assert renew["requestReceivedTimestamp"] <= renew["stageTimestamp"]
    assert missing["responseStatus"]["message"] == f'configmaps "{name}" not found'
    assert "responseObject" not in missing
