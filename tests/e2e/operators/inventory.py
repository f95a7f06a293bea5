"""A reconciler called ``reconcile_inventory`` of the resource named by ``INVENTORY_RESOURCE``.

Two operators made from this file (one for ConfigMaps, one for Devices) share a function
name, as two teams' operators easily do; each prints one line per reconcile.
"""

from __future__ import annotations

import os

import kopf_reconcile as kr

RESOURCES = {"configmaps": ("", "v1", "configmaps"), "devices": ("example.com", "v1", "devices")}
GROUP, VERSION, PLURAL = RESOURCES[os.environ["INVENTORY_RESOURCE"]]


@kr.reconciler(GROUP, VERSION, PLURAL, tenancy=kr.Tenancy.TENANT_SCOPED)
async def reconcile_inventory(req: kr.Request) -> None:
    print(f"reconciled {PLURAL} {req.entity_id}", flush=True)
