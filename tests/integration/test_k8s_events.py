"""Kubernetes Events on reconciled objects, on the embedded cluster and the real API server."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf_reconcile as kr
from kopf_reconcile.events import EventRecorder
from kopf_reconcile.integration.events import KubernetesEventSink
from support import eventually


async def events_of(kube: Any, namespace: str, name: str) -> list[dict[str, Any]]:
    async with (
        kube.http_session() as http,
        http.get(f"/api/v1/namespaces/{namespace}/events") as response,
    ):
        assert response.status == 200, await response.text()
        items = (await response.json())["items"]
    return [e for e in items if e["involvedObject"].get("name") == name]


async def test_failures_dead_letters_and_recovery_become_aggregated_events(
    kube: Any, kube_namespace: str, api: Any
) -> None:
    ns = kube_namespace
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "device-1"}}
    async with (
        kube.http_session() as http,
        http.post(f"/api/v1/namespaces/{ns}/configmaps", json=body) as response,
    ):
        assert response.status == 201, await response.text()
        created = await response.json()
    objects = {f"{ns}/device-1": created}
    failures = [3]

    async def reconcile(req: kr.Request) -> None:
        if req.entity_id == f"{ns}/gone":
            raise kr.PermanentError("no such device")
        if failures[0]:
            failures[0] -= 1
            raise RuntimeError(f"device unreachable ({failures[0]} more)")
        kr.event(req, "Normal", "Configured", "power is on")

    queue: asyncio.Queue[kr.Request] = asyncio.Queue()
    sink = KubernetesEventSink(objects.get, instance="replica-0", api=api)
    loop = (
        kr.Builder(reconcile, kr.Tenancy.TENANT_SCOPED)
        .with_trigger(kr.ChannelTrigger(queue))
        .with_backoff(0.01, 0.05)
        .with_events(sink)
        .build()
    )
    async with loop:
        await queue.put(kr.Request(f"{ns}/device-1"))
        await queue.put(kr.Request(f"{ns}/gone"))  # not in the cache: nothing to attach to

        async def recovered() -> bool:
            reasons = {e["reason"] for e in await events_of(kube, ns, "device-1")}
            return {"ReconcileError", "Reconciled", "Configured"} <= reasons

        await eventually(recovered, timeout=20, message="the events of device-1")

        async def counted() -> bool:
            events = await events_of(kube, ns, "device-1")
            errors = [e for e in events if e["reason"] == "ReconcileError"]
            return len(errors) == 1 and errors[0]["count"] == 3

        # One Event for the three failures, updated (PATCH) with a count, not three Events.
        await eventually(counted, timeout=20, message="one ReconcileError Event, count 3")
    events = {e["reason"]: e for e in await events_of(kube, ns, "device-1")}
    error = events["ReconcileError"]
    assert error["type"] == "Warning"
    assert error["message"] == "device unreachable (0 more)"
    assert error["involvedObject"]["uid"] == created["metadata"]["uid"]
    assert error["involvedObject"]["kind"] == "ConfigMap"
    assert error["source"]["component"] == "kopf-reconcile"
    assert events["Reconciled"]["type"] == "Normal" and events["Reconciled"]["count"] == 1
    # The object itself was never written.
    async with (
        kube.http_session() as http,
        http.get(f"/api/v1/namespaces/{ns}/configmaps/device-1") as response,
    ):
        assert (await response.json())["metadata"]["resourceVersion"] == created["metadata"][
            "resourceVersion"
        ]


async def test_a_new_leader_counts_on_the_event_of_the_previous_one(
    kube: Any, kube_namespace: str, api: Any
) -> None:
    ns = kube_namespace
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "device-2"}}
    async with (
        kube.http_session() as http,
        http.post(f"/api/v1/namespaces/{ns}/configmaps", json=body) as response,
    ):
        assert response.status == 201, await response.text()
        created = await response.json()
    entity = f"{ns}/device-2"
    objects = {entity: created}
    # Two leaders, one after the other: each its own recorder and sink, as two processes.
    for leader, occurrences in (("replica-0", 3), ("replica-1", 2)):
        recorder = EventRecorder(KubernetesEventSink(objects.get, instance=leader, api=api))
        for n in range(occurrences):
            recorder.record(entity, "Warning", "DeadLettered", f"{leader}: bad spec {n}")
            await eventually(lambda r=recorder: r.pending == 0)  # type: ignore[misc]
        await recorder.close()
    found = [e for e in await events_of(kube, ns, "device-2") if e["reason"] == "DeadLettered"]
    assert [(e["count"], e["message"]) for e in found] == [(5, "replica-1: bad spec 1")]
