"""A reconciler of the ConfigMaps labelled ``role=owner``, owning Secrets, watching Leases.

Each reconcile prints ``reconcile <entity id> children=<names of its cached Secrets>``. A
Lease annotated ``owner=<name>`` reconciles that ConfigMap (``watches=`` with ``map_to``).
"""

from __future__ import annotations

from typing import Any

import kopf_reconcile as kr


def owner_of(body: Any) -> list[str]:
    metadata = body["metadata"]
    return [f"{metadata['namespace']}/{metadata['annotations']['owner']}"]


@kr.reconciler(
    "", "v1", "configmaps",
    tenancy=kr.Tenancy.TENANT_SCOPED, labels={"role": "owner"},
    owns=[("", "v1", "secrets")],
    watches=[kr.Watches("coordination.k8s.io", "v1", "leases", map_to=owner_of)],
)  # fmt: skip
async def reconcile_owner(req: kr.Request) -> None:
    children = ",".join(sorted(c["metadata"]["name"] for c in kr.owned(req)))
    print(f"reconcile {req.entity_id} children={children}", flush=True)
