"""A reconciler of ConfigMaps named only ``reconcile``: its default lease name says nothing
about which operator it belongs to."""

from __future__ import annotations

import kopf_reconcile as kr


@kr.reconciler("", "v1", "configmaps", tenancy=kr.Tenancy.TENANT_SCOPED)
async def reconcile(req: kr.Request) -> None:
    print(f"reconciled {req.entity_id}", flush=True)
