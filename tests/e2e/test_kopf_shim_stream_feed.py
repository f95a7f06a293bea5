"""The shim takes its events straight from kopf's watch stream.

With no other kopf handler of the resource, kopf sees none of the events (no per-object
worker or memory); with another handler of it, that handler sees every event and the
reconciler still sees each change once, never twice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import kopf
import pytest
import yaml
from kopf._core.reactor import inventory
from operator_e2e import kopf_running

import kopf_reconcile as kr
from kopf_reconcile.integration import kopf_shim
from kopf_reconcile.testing.memory import MemoryLeaseElector, MemoryLeaseStore
from support import eventually

ROOT = Path(__file__).parents[2]
CONFIGMAPS = "/api/v1/namespaces/default/configmaps"
MERGE = {"Content-Type": "application/merge-patch+json"}


pytestmark = pytest.mark.usefixtures("no_environment")


@pytest.mark.parametrize("other_handler", [False, True], ids=["alone", "beside-kopf-handler"])
async def test_events_reach_the_reconciler_from_the_watch_stream(
    cluster_url: str,
    cluster_http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
    other_handler: bool,
) -> None:
    registry = kopf.OperatorRegistry()
    seen: list[tuple[str, str | None]] = []  # (entity, data.k) per reconcile
    kopf_saw: list[str] = []  # names the plain kopf handler saw
    remembered: list[str] = []  # uids kopf kept a per-object memory of

    recall = inventory.ResourceMemories.recall

    async def remembering(self: Any, raw_body: Any, **kwargs: Any) -> Any:
        remembered.append(raw_body["metadata"]["uid"])
        return await recall(self, raw_body, **kwargs)

    monkeypatch.setattr(inventory.ResourceMemories, "recall", remembering)

    @kr.reconciler(
        "", "v1", "configmaps",
        tenancy=kr.Tenancy.TENANT_SCOPED,
        reconciler_id="configmaps-stream-feed",
        leader=lambda: MemoryLeaseElector(MemoryLeaseStore()),
        fenced=None,
        metrics=None,
        events=False,
        registry=registry,
    )  # fmt: skip
    async def reconcile_stream_feed(req: kr.Request) -> None:
        body = kr.cached(req)
        seen.append((req.entity_id, None if body is None else body["data"]["k"]))

    if other_handler:

        @kopf.on.event("", "v1", "configmaps", registry=registry)
        def plain(name: str, **_: Any) -> None:
            kopf_saw.append(name)

    async with kopf_running(registry, cluster_url, namespaces=["default"]):
        await eventually(
            lambda: all(s.get("leader") for s in kopf_shim.status(registry).values()), timeout=10
        )
        body = {"metadata": {"name": "fed"}, "data": {"k": "v1"}}
        async with cluster_http.post(CONFIGMAPS, json=body) as response:
            assert response.status == 201, await response.text()
        await eventually(lambda: ("default/fed", "v1") in seen, timeout=10)
        patch = {"data": {"k": "v2"}}
        async with cluster_http.patch(f"{CONFIGMAPS}/fed", json=patch, headers=MERGE) as response:
            assert response.status == 200
        await eventually(lambda: ("default/fed", "v2") in seen, timeout=10)
        async with cluster_http.delete(f"{CONFIGMAPS}/fed") as response:
            assert response.status == 200
        await eventually(lambda: ("default/fed", None) in seen, timeout=10)
        # A later object reconciled: a second delivery of the first, if any, came before.
        later = {"metadata": {"name": "later"}, "data": {"k": "v"}}
        async with cluster_http.post(CONFIGMAPS, json=later) as r:
            assert r.status == 201, await r.text()
        await eventually(lambda: any(e == "default/later" for e, _ in seen), timeout=10)
        if other_handler:  # kopf's own handler saw every event (its workers run apart)
            await eventually(lambda: kopf_saw.count("fed") >= 3, timeout=10)

    # One reconcile per change: no event reached the reconciler twice.
    assert [s for s in seen if s[0] == "default/fed"] == [
        ("default/fed", "v1"),
        ("default/fed", "v2"),
        ("default/fed", None),
    ]
    if other_handler:
        assert kopf_saw.count("fed") >= 3  # kopf's own handler saw every event
        assert remembered
    else:
        assert not remembered  # kopf never saw an object: no per-object memory, no worker


async def test_a_namespace_created_later_is_watched_beside_a_namespaces_reconciler(
    cluster_url: str, cluster_http: aiohttp.ClientSession
) -> None:
    # kopf's namespace observer reads the namespaces stream the shim would feed from:
    # it must still see a namespace matching the glob that appears after start.
    async with cluster_http.post("/api/v1/namespaces", json={"metadata": {"name": "team-a"}}) as r:
        assert r.status == 201, await r.text()
    registry = kopf.OperatorRegistry()
    seen: list[str] = []

    @kr.reconciler(
        "", "v1", "namespaces",
        tenancy=kr.Tenancy.SINGLE_TENANT, reconciler_id="namespaces-beside-glob",
        leader=None, fenced=None, metrics=None, events=False, registry=registry,
    )  # fmt: skip
    async def reconcile_namespace(req: kr.Request) -> None:
        seen.append(f"namespace {req.entity_id}")

    @kr.reconciler(
        "", "v1", "configmaps",
        tenancy=kr.Tenancy.TENANT_SCOPED, reconciler_id="configmaps-in-glob",
        leader=None, fenced=None, metrics=None, events=False, registry=registry,
    )  # fmt: skip
    async def reconcile_configmap(req: kr.Request) -> None:
        seen.append(f"configmap {req.entity_id}")

    async with kopf_running(registry, cluster_url, namespaces=["team-*"]):
        await eventually(lambda: "namespace team-a" in seen, timeout=10)
        team_b = {"metadata": {"name": "team-b"}}
        async with cluster_http.post("/api/v1/namespaces", json=team_b) as r:
            assert r.status == 201, await r.text()
        await eventually(lambda: "namespace team-b" in seen, timeout=10)
        body = {"metadata": {"name": "c2"}}
        async with cluster_http.post("/api/v1/namespaces/team-b/configmaps", json=body) as r:
            assert r.status == 201, await r.text()
        await eventually(lambda: "configmap team-b/c2" in seen, timeout=10)


async def test_a_crd_created_later_is_watched_beside_a_crd_reconciler(
    cluster_url: str, cluster_http: aiohttp.ClientSession
) -> None:
    # kopf's resource observer reads the CRD stream: a CRD created after start must
    # still start the watch of its resource.
    crd = yaml.safe_load((ROOT / "crds" / "devices.yaml").read_text())
    registry = kopf.OperatorRegistry()
    seen: list[str] = []

    @kr.reconciler(
        "apiextensions.k8s.io", "v1", "customresourcedefinitions",
        tenancy=kr.Tenancy.SINGLE_TENANT, reconciler_id="crds-beside-observer",
        leader=None, fenced=None, metrics=None, events=False, registry=registry,
    )  # fmt: skip
    async def reconcile_crd(req: kr.Request) -> None:
        seen.append(f"crd {req.entity_id}")

    @kr.reconciler(
        "example.com", "v1", "devices",
        tenancy=kr.Tenancy.TENANT_SCOPED, reconciler_id="devices-appearing-later",
        leader=None, fenced=None, metrics=None, events=False, registry=registry,
    )  # fmt: skip
    async def reconcile_device(req: kr.Request) -> None:
        seen.append(f"device {req.entity_id}")

    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    async with kopf_running(registry, cluster_url, clusterwide=True):
        # The CRD stream is live once a first CRD is reconciled: the Devices' comes later.
        probe = {
            **crd,
            "metadata": {"name": "probes.example.org"},
            "spec": {
                **crd["spec"],
                "group": "example.org",
                "names": {"plural": "probes", "singular": "probe", "kind": "Probe"},
            },
        }
        async with cluster_http.post(crds, json=probe) as r:
            assert r.status == 201, await r.text()
        await eventually(lambda: "crd probes.example.org" in seen, timeout=10)
        async with cluster_http.post(crds, json=crd) as r:
            assert r.status == 201, await r.text()
        name = crd["metadata"]["name"]
        await eventually(lambda: f"crd {name}" in seen, timeout=10)
        body = {
            "apiVersion": "example.com/v1",
            "kind": crd["spec"]["names"]["kind"],
            "metadata": {"name": "d1"},
            "spec": {"desired": "on"},
        }
        devices = "/apis/example.com/v1/namespaces/default/devices"

        async def created() -> bool:
            async with cluster_http.post(devices, json=body) as r:
                return r.status in (201, 409)

        await eventually(created, timeout=10, message="the Devices resource is served")
        await eventually(lambda: "device default/d1" in seen, timeout=10)
