"""Boundedness: after 100,000 requests nothing inside the cluster has grown but the live objects.

Asserted on counts and sizes (never on time): the change history is capped at its window,
watchers and streams leave with their clients, exhausted faults are dropped, old Events
are evicted, and the number of live Python objects does not grow between 20,000 and 100,000
operations. Most of the load goes straight to the API verbs (the HTTP layer adds
no per-request state; a share of real HTTP requests checks that too).
"""

from __future__ import annotations

import gc
from typing import Any

from kopf_reconcile.testing.emulated_apiserver import EmbeddedCluster

LEASES = "/apis/coordination.k8s.io/v1/namespaces/default/leases"
HISTORY = 2_000
MAX_EVENTS = 500
OPERATIONS = 100_000
CHECKPOINT = 20_000


def churn(cluster: EmbeddedCluster, start: int, stop: int) -> None:
    """Lease renewals and replacements, short-lived Leases, Events: 5 operations a round."""
    api = cluster.api
    leases = cluster.registry.get("coordination.k8s.io", "v1", "leases")
    events = cluster.registry.get("", "v1", "events")
    assert leases is not None and events is not None
    for index in range(start, stop, 5):
        renew = {"spec": {"renewTime": f"2024-01-01T00:00:00.{index % 10**6:06d}Z"}}
        api.patch(leases, "default", "steady", "application/merge-patch+json", renew)
        current = api.get(leases, "default", "steady")
        api.replace(
            leases,
            "default",
            "steady",
            {**current, "spec": {**current["spec"], "leaseTransitions": index}},
        )
        api.create(leases, "default", {"metadata": {"name": f"brief-{index}"}})
        api.delete(leases, "default", f"brief-{index}")
        event = {
            "metadata": {"name": f"event-{index}"},
            "involvedObject": {"kind": "Lease"},
            "reason": "R",
        }
        api.create(events, "default", event)


def footprint(cluster: EmbeddedCluster) -> dict[str, Any]:
    return {**cluster.sizes(), "types": sum(1 for _ in cluster.registry)}


async def test_hundred_thousand_operations_leave_nothing_behind() -> None:
    async with EmbeddedCluster(history_size=HISTORY, max_events=MAX_EVENTS) as cluster:
        leases = cluster.registry.get("coordination.k8s.io", "v1", "leases")
        assert leases is not None
        cluster.api.create(leases, "default", {"metadata": {"name": "steady"}, "spec": {}})
        _, watcher = cluster.store.watch(leases.storage_key, lambda obj: True, None)

        churn(cluster, 0, CHECKPOINT)
        watcher.drain()
        gc.collect()
        early_sizes, early_objects = footprint(cluster), len(gc.get_objects())
        for start in range(CHECKPOINT, OPERATIONS, CHECKPOINT):
            churn(cluster, start, start + CHECKPOINT)
            watcher.drain()  # a client that keeps up with its watch
        gc.collect()
        late_sizes, late_objects = footprint(cluster), len(gc.get_objects())

        assert early_sizes == late_sizes
        assert late_sizes["history"] == HISTORY
        assert late_sizes["objects"] == 4 + 1 + MAX_EVENTS  # namespaces, the steady Lease, Events
        # Python objects alive (the live Leases/Events and the history window are the same
        # size at both points; a leak of even one object per request would add ~80,000).
        assert abs(late_objects - early_objects) < 1_000, (early_objects, late_objects)
        assert cluster.store.revision > OPERATIONS  # every write took a revision


async def test_http_requests_watches_and_faults_leave_nothing_behind() -> None:
    async with EmbeddedCluster(history_size=HISTORY) as cluster, cluster.http_session() as http:
        await http.post(LEASES, json={"metadata": {"name": "steady"}})
        baseline = footprint(cluster)
        for round_ in range(200):
            params = {"watch": "true", "resourceVersion": "0", "timeoutSeconds": "1"}
            async with http.get(LEASES, params=params) as watch:
                await watch.content.readline()  # the steady Lease, then hang up
            cluster.inject_fault("GET", f"{LEASES}/steady", status=503)
            assert (await http.get(f"{LEASES}/steady")).status == 503
            for _ in range(5):
                patch = {"metadata": {"labels": {"round": str(round_)}}}
                headers = {"Content-Type": "application/merge-patch+json"}
                assert (
                    await http.patch(f"{LEASES}/steady", json=patch, headers=headers)
                ).status == 200
        await _until_watches_closed(cluster)
        after = footprint(cluster)
        assert {**after, "history": 0} == {**baseline, "history": 0}
        assert after["streams"] == 0 and after["watchers"] == 0 and after["faults"] == 0


async def _until_watches_closed(cluster: EmbeddedCluster) -> None:
    from support import eventually

    await eventually(lambda: cluster.sizes()["streams"] == 0, message="server-side watches end")
