"""Default reconciler ids across operators: real ``kopf-reconcile run`` processes, Kubernetes
Leases, on both API tiers.

Two operators in one namespace whose reconcilers share a function name but reconcile
different resources each lead their own Lease; a reconciler whose name says only that it
reconciles is refused when a leader is configured, instead of silently sharing a Lease
with every other such operator.
"""

from __future__ import annotations

import aiohttp
import pytest
from operator_e2e import OPERATORS, Devices, Operators

pytestmark = pytest.mark.slow

INVENTORY = OPERATORS / "inventory.py"
LEASE_TIMEOUT = 45  # a Lease held by a stranger would only free up after the TTL (15 s)


async def lease_names(http: aiohttp.ClientSession, namespace: str) -> set[str]:
    async with http.get(f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases") as r:
        assert r.status == 200, await r.text()
        return {item["metadata"]["name"] for item in (await r.json())["items"]}


async def test_operators_of_two_resources_with_one_function_name_each_lead_their_own_lease(
    operators: Operators, devices: Devices, http: aiohttp.ClientSession
) -> None:
    namespace = devices.namespace
    leader = {"KOPF_RECONCILE_LEADER": "kubernetes", "POD_NAMESPACE": namespace}
    configmaps_operator = await operators.start(
        handlers=INVENTORY, env={**leader, "INVENTORY_RESOURCE": "configmaps"}, name="configmaps"
    )
    devices_operator = await operators.start(
        handlers=INVENTORY, env={**leader, "INVENTORY_RESOURCE": "devices"}, name="devices"
    )
    body = {"metadata": {"name": "shelf"}, "data": {"k": "v"}}
    async with http.post(f"/api/v1/namespaces/{namespace}/configmaps", json=body) as response:
        assert response.status == 201, await response.text()
    await devices.create("lamp", "on")

    # Both reconcile: neither waits forever as the follower of the other's Lease.
    await configmaps_operator.printed(
        "reconciled configmaps", f"{namespace}/shelf", timeout=LEASE_TIMEOUT
    )
    await devices_operator.printed("reconciled devices", f"{namespace}/lamp", timeout=LEASE_TIMEOUT)
    assert {
        "configmaps-reconcile-inventory",
        "devices.example.com-reconcile-inventory",
    } <= await lease_names(http, namespace)


async def test_a_reconciler_named_only_reconcile_needs_a_reconciler_id_with_a_leader(
    operators: Operators, kube_namespace: str
) -> None:
    status, output = await operators.run_to_exit(
        handlers=OPERATORS / "generic.py",
        env={"KOPF_RECONCILE_LEADER": "kubernetes", "POD_NAMESPACE": kube_namespace},
    )
    assert status == 2, output
    assert "configuration error" in output and "needs reconciler_id=" in output, output
    assert "'configmaps-reconcile'" in output, output  # the Lease it would have shared
