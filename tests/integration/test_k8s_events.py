"""Kubernetes Events on reconciled objects, on the embedded cluster and the real API server."""

from __future__ import annotations

import asyncio
import secrets
import sys
from pathlib import Path
from typing import Any

import kopf_reconcile as kr
from kopf_reconcile.events import EventRecorder
from kopf_reconcile.integration.events import KubernetesEventSink
from support import CRDS, eventually, gadget_crd, install_crd

BIN = Path(sys.executable).parent  # kubectl, from `make tools`


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


async def test_a_cluster_scoped_objects_events_go_to_default_where_describe_finds_them(
    kube: Any, api: Any
) -> None:
    # Events of a cluster-scoped object live in ``default``, as client-go's recorder
    # puts them, with no namespace in ``involvedObject``; ``kubectl describe``
    # searches every namespace for them.
    group = f"g{secrets.token_hex(4)}.example.com"
    name = f"gadget-{secrets.token_hex(4)}"
    async with kube.http_session() as http:
        await install_crd(http, gadget_crd(group, scope="Cluster"))
        body = {"apiVersion": f"{group}/v1", "kind": "Gadget", "metadata": {"name": name}}
        try:
            async with http.post(f"/apis/{group}/v1/gadgets", json=body) as response:
                assert response.status == 201, await response.text()
                gadget = await response.json()
            recorder = EventRecorder(
                KubernetesEventSink({name: gadget}.get, instance="replica-0", api=api)
            )
            for n in range(2):
                recorder.record(name, "Warning", "DeadLettered", f"bad spec {n}")
                await eventually(lambda: recorder.pending == 0)
            await recorder.close()
            [event] = await events_of(kube, "default", name)
            assert (event["reason"], event["count"]) == ("DeadLettered", 2)
            assert event["message"] == "bad spec 1"
            assert event["involvedObject"]["kind"] == "Gadget"
            assert "namespace" not in event["involvedObject"]
            assert event["involvedObject"]["uid"] == gadget["metadata"]["uid"]
            assert (BIN / "kubectl").exists(), "kubectl comes from `make tools` (make test runs it)"
            describe = await asyncio.create_subprocess_exec(
                str(BIN / "kubectl"),
                f"--kubeconfig={kube.kubeconfig}",
                "describe",
                f"gadgets.{group}",
                name,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await describe.communicate()
            assert describe.returncode == 0, err.decode()
            assert "DeadLettered" in out.decode() and "bad spec 1" in out.decode(), out.decode()
        finally:
            async with http.delete(f"{CRDS}/gadgets.{group}") as response:
                assert response.status in (200, 202), await response.text()
