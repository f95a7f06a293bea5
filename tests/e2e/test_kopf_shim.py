"""The kopf shim in the test's process: kopf's real operator with two reconcilers side by
side, each with its own lease; selection; requeues only while the object lives.

The embedded cluster runs as a process of its own: in the test's event loop, its
long-lived watch handlers would count as tasks of the operator, which kopf cancels
(and waits for) when it stops.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf
import pytest
from operator_e2e import kopf_running
from prometheus_client import CollectorRegistry

import kopf_reconcile as kr
from kopf_reconcile.integration import kopf_shim
from kopf_reconcile.testing.memory import MemoryLeaseElector, MemoryLeaseStore
from support import eventually

CONFIGMAPS = "/api/v1/namespaces/default/configmaps"
MERGE = {"Content-Type": "application/merge-patch+json"}
# The default reconciler ids (lease names) of the two reconcilers below: resource, function.
TEAM_A = "configmaps-reconcile-team-a"
OTHERS = "configmaps-reconcile-others"


@dataclass
class Seen:
    """What one reconciler observed: per entity, the bodies ``cached`` returned (None: gone)."""

    calls: dict[str, list[dict[str, Any] | None]] = field(default_factory=dict)

    def record(self, req: kr.Request) -> None:
        self.calls.setdefault(req.entity_id, []).append(kr.cached(req))

    def last(self, entity_id: str) -> object:
        return self.calls.get(entity_id, ["never called"])[-1]

    def count(self, entity_id: str) -> int:
        return len(self.calls.get(entity_id, []))


# The reconcilers here take their adapters from arguments, never from the environment.
pytestmark = pytest.mark.usefixtures("no_environment")


async def configmap(http: aiohttp.ClientSession, name: str, labels: dict[str, str]) -> None:
    body = {"metadata": {"name": name, "labels": labels}, "data": {"k": "v"}}
    async with http.post(CONFIGMAPS, json=body) as response:
        assert response.status == 201, await response.text()


async def test_two_reconcilers_side_by_side_each_with_its_own_lease(
    cluster_url: str, cluster_http: aiohttp.ClientSession
) -> None:
    registry = kopf.OperatorRegistry()
    leases = MemoryLeaseStore()
    prometheus = CollectorRegistry()
    metrics = kr.register_metrics(prometheus)
    team_a, others = Seen(), Seen()

    @kr.reconciler(
        "", "v1", "configmaps",
        tenancy=kr.Tenancy.TENANT_SCOPED,
        labels={"team": "a"},
        interval=0.3,  # live objects are looked at again this often
        leader=lambda: MemoryLeaseElector(leases),
        fenced=None,
        metrics=metrics,
        registry=registry,
    )  # fmt: skip
    async def reconcile_team_a(req: kr.Request) -> None:
        team_a.record(req)

    @kr.reconciler(
        "", "v1", "configmaps",
        tenancy=kr.Tenancy.SINGLE_TENANT,
        field_selector="metadata.name!=ignored",
        leader=lambda: MemoryLeaseElector(leases),
        fenced=None,
        metrics=metrics,
        registry=registry,
    )  # fmt: skip
    def reconcile_others(req: kr.Request) -> kr.Result:  # a sync reconciler runs in a thread
        others.record(req)
        return kr.Result()

    with pytest.raises(kr.ConfigError, match="already registered"):
        kr.reconciler("", "v1", "configmaps", tenancy=kr.Tenancy.SINGLE_TENANT, registry=registry)(
            reconcile_team_a
        )

    async with kopf_running(registry, cluster_url, namespaces=["default"]):
        await eventually(
            lambda: all(s.get("leader") for s in kopf_shim.status(registry).values()), timeout=10
        )
        assert leases.holder(TEAM_A) is not None
        assert leases.holder(OTHERS) is not None
        assert leases.holder(TEAM_A) != leases.holder(OTHERS)

        await configmap(cluster_http, "a1", {"team": "a"})
        await configmap(cluster_http, "b1", {"team": "b"})
        await configmap(cluster_http, "ignored", {"team": "a"})
        await eventually(lambda: isinstance(team_a.last("default/a1"), dict), timeout=10)
        await eventually(lambda: isinstance(others.last("default/b1"), dict), timeout=10)
        await eventually(lambda: isinstance(team_a.last("default/ignored"), dict), timeout=10)
        assert team_a.count("default/b1") == 0  # label selection
        assert others.count("default/ignored") == 0  # field selection
        assert others.calls["default/a1"][-1]["metadata"]["labels"] == {"team": "a"}  # type: ignore[index]

        # A live object is looked at again after the interval, without any event.
        calls = team_a.count("default/a1")
        await eventually(lambda: team_a.count("default/a1") >= calls + 2, timeout=5)

        # Deleted: the reconciler runs once more and cached() is None; then never again.
        async with cluster_http.delete(f"{CONFIGMAPS}/a1") as response:
            assert response.status == 200
        await eventually(lambda: team_a.last("default/a1") is None, timeout=10)
        calls = team_a.count("default/a1")
        await asyncio.sleep(1.0)  # more than three intervals
        assert team_a.count("default/a1") == calls

        # Leaving the selection looks like a deletion to the reconciler.
        patch = {"metadata": {"labels": {"team": "c"}}}
        ignored = f"{CONFIGMAPS}/ignored"
        async with cluster_http.patch(ignored, json=patch, headers=MERGE) as response:
            assert response.status == 200
        await eventually(lambda: team_a.last("default/ignored") is None, timeout=10)

        def reconciles(result: str) -> float | None:
            labels = {"controller": TEAM_A, "shard": "", "result": result}
            return prometheus.get_sample_value("kopf_reconcile_reconcile_total", labels)

        assert (reconciles("success") or 0) >= 3
        assert reconciles("requeue_after") == 0  # resyncs are not requeues

        status = kopf_shim.status(registry)
        assert status[TEAM_A]["cached_objects"] == 0
        assert status[OTHERS]["cached_objects"] == 1  # b1: a1 is gone, one ignored
        assert status[TEAM_A]["epoch"] == 1

    # Cleanup stopped both Loops and released both leases.
    assert leases.holder(TEAM_A) is None
    assert leases.holder(OTHERS) is None
    assert kopf_shim.status(registry) == {
        TEAM_A: {"running": False},
        OTHERS: {"running": False},
    }
    async with cluster_http.get(CONFIGMAPS) as response:
        items = (await response.json())["items"]
    assert all(not (i["metadata"].get("annotations") or {}) for i in items)
    assert all(not i["metadata"].get("finalizers") for i in items)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tenancy": "tenant"}, "tenancy must be Tenancy.SINGLE_TENANT"),
        ({"concurrency": 0}, "concurrency must be an integer >= 1"),
        ({"interval": -1}, "interval must be > 0 seconds"),
        ({"backoff": (1, 2, 3)}, "backoff must be a (base, max) pair"),
        ({"labels": {"team": 1}}, "labels must be a mapping"),
        ({"field_selector": "metadata.name"}, "field_selector term 'metadata.name' is not"),
        ({"reconciler_id": "Not_A_Name"}, "reconciler_id must be a valid Kubernetes object name"),
    ],
)
def test_bad_arguments_fail_at_decoration(options: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {"tenancy": kr.Tenancy.SINGLE_TENANT, **options}
    with pytest.raises(kr.ConfigError) as raised:
        kr.reconciler("", "v1", "configmaps", registry=kopf.OperatorRegistry(), **arguments)(
            lambda req: None
        )
    assert message in str(raised.value)
