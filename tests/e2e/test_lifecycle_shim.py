"""Children and finalizers through the kopf shim in the test's process (kopf's real operator,
an embedded cluster as a process of its own, see test_kopf_shim.py): what the reconciler
sees, and what the shim writes to the objects."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import kopf
import pytest
from operator_e2e import kopf_running, read_object

import kopf_reconcile as kr
from kopf_reconcile.integration import kopf_shim
from kopf_reconcile.testing.emulated_apiserver.kubeconfig import write_kubeconfig
from support import eventually

CONFIGMAPS = "/api/v1/namespaces/default/configmaps"
SECRETS = "/api/v1/namespaces/default/secrets"
LEASES = "/apis/coordination.k8s.io/v1/namespaces/default/leases"
FINALIZER = "example.com/cleanup"

pytestmark = pytest.mark.usefixtures("no_environment")


@pytest.fixture
def kubeconfig(cluster_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The shim's own API writes (finalizers) reach the embedded cluster."""
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig", cluster_url)))
    yield


async def create(http: aiohttp.ClientSession, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(path, json=body) as response:
        assert response.status == 201, await response.text()
        created: dict[str, Any] = await response.json()
        return created


async def delete(http: aiohttp.ClientSession, path: str) -> None:
    async with http.delete(path) as response:
        assert response.status == 200, await response.text()


def child(name: str, owner: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    reference = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
    }
    return {"metadata": {"name": name, "labels": labels, "ownerReferences": [reference]}}


async def test_child_and_watched_events_reconcile_their_owner_and_owned_reads_the_children(
    cluster_url: str, cluster_http: aiohttp.ClientSession
) -> None:
    """Owners are ConfigMaps labelled role=owner; children are Secrets they control;
    Leases name an owner in their "owner" annotation (a watch with map_to)."""
    registry = kopf.OperatorRegistry()
    calls: dict[str, list[list[str]]] = {}

    def pointed(body: Any) -> list[str]:
        return [f"default/{body['metadata']['annotations']['owner']}"]

    @kr.reconciler(
        "", "v1", "configmaps",
        tenancy=kr.Tenancy.TENANT_SCOPED,
        labels={"role": "owner"},
        owns=[kr.Owns("", "v1", "secrets", labels={"managed": "yes"})],
        watches=[kr.Watches("coordination.k8s.io", "v1", "leases", map_to=pointed)],
        leader=None, fenced=None, metrics=None, events=False,
        registry=registry,
    )  # fmt: skip
    async def reconcile_owner(req: kr.Request) -> None:
        calls.setdefault(req.entity_id, []).append(
            sorted(c["metadata"]["name"] for c in kr.owned(req))
        )

    def count(entity: str) -> int:
        return len(calls.get(entity, []))

    async with kopf_running(registry, cluster_url, namespaces=["default"]):
        await eventually(
            lambda: kopf_shim.status(registry)["configmaps-reconcile-owner"].get("leader") is True
        )
        owner = await create(
            cluster_http, CONFIGMAPS, {"metadata": {"name": "site", "labels": {"role": "owner"}}}
        )
        await eventually(lambda: count("default/site") >= 1)

        # A child's creation reconciles its owner, which then reads it from the cache.
        before = count("default/site")
        await create(cluster_http, SECRETS, child("page", owner, {"managed": "yes"}))
        await eventually(lambda: calls["default/site"][-1] == ["page"])
        assert count("default/site") > before

        # A child outside the label selection is neither cached nor a trigger.
        before = count("default/site")
        await create(cluster_http, SECRETS, child("stray", owner, {"managed": "no"}))
        # ... its deletion, neither: then a selected child's deletion is the next trigger.
        await delete(cluster_http, f"{SECRETS}/stray")
        await delete(cluster_http, f"{SECRETS}/page")
        await eventually(lambda: calls["default/site"][-1] == [])
        assert count("default/site") == before + 1

        # A child controlled by an object the reconciler does not hold triggers nothing.
        other = await create(cluster_http, CONFIGMAPS, {"metadata": {"name": "other"}})
        await create(cluster_http, SECRETS, child("orphan", other, {"managed": "yes"}))
        assert count("default/other") == 0

        # A watched object reconciles what map_to returns, if the reconciler holds it.
        before = count("default/site")
        for target in ("nothing", "site"):
            lease = {"metadata": {"name": f"points-{target}", "annotations": {"owner": target}}}
            await create(cluster_http, LEASES, lease)
        await eventually(lambda: count("default/site") == before + 1)
        assert count("default/nothing") == 0
    assert count("default/other") == 0


async def test_a_finalizer_is_added_before_the_first_reconcile_and_removed_after_cleanup(
    cluster_url: str, cluster_http: aiohttp.ClientSession, kubeconfig: None
) -> None:
    registry = kopf.OperatorRegistry()
    seen: list[tuple[str, bool, list[str]]] = []
    failing: set[str] = set()

    @kr.reconciler(
        "", "v1", "configmaps",
        tenancy=kr.Tenancy.TENANT_SCOPED,
        labels={"app": "site"},
        finalizer=FINALIZER,
        leader=None, fenced=None, metrics=None,
        registry=registry,
    )  # fmt: skip
    async def reconcile_site(req: kr.Request) -> kr.Result | None:
        body = kr.cached(req)
        stored = await read_object(cluster_http, f"{CONFIGMAPS}/{req.entity_id.split('/')[1]}")
        finalizers = list(((stored or {}).get("metadata") or {}).get("finalizers") or [])
        seen.append((req.entity_id, kr.is_deleting(body), finalizers))
        if kr.is_deleting(body) and req.entity_id in failing:
            if "permanent" in req.entity_id:
                raise kr.PermanentError("cannot clean up")
            if "later" in req.entity_id:
                return kr.Result(requeue_after=3600)  # not finished: call me again
            raise RuntimeError("cleanup failed")
        return None

    async with kopf_running(registry, cluster_url, namespaces=["default"]):
        for name in ("plain", "flaky", "permanent", "later"):
            labels = {"app": "site"}
            await create(cluster_http, CONFIGMAPS, {"metadata": {"name": name, "labels": labels}})
        await create(cluster_http, CONFIGMAPS, {"metadata": {"name": "unselected"}})
        await eventually(
            lambda: (
                {e for e, _, _ in seen}
                >= {f"default/{n}" for n in ("plain", "flaky", "permanent", "later")}
            )
        )

        # The finalizer is on the object when the reconciler first runs.
        first = {entity: finalizers for entity, _, finalizers in reversed(seen)}
        assert all(f == [FINALIZER] for f in first.values()), seen
        assert (await read_object(cluster_http, f"{CONFIGMAPS}/unselected"))["metadata"].get(
            "finalizers"
        ) is None  # type: ignore[index]

        # Deleting: the reconciler sees it; success removes the finalizer, the object goes.
        await delete(cluster_http, f"{CONFIGMAPS}/plain")
        await eventually(lambda: _gone(cluster_http, "plain"))
        assert ("default/plain", True, [FINALIZER]) in seen

        # An error, PermanentError or requeue_after keeps the finalizer.
        failing.update({"default/flaky", "default/permanent", "default/later"})
        for name in ("flaky", "permanent", "later"):
            await delete(cluster_http, f"{CONFIGMAPS}/{name}")
        await eventually(lambda: sum(1 for e, d, _ in seen if e == "default/flaky" and d) >= 2)
        await eventually(lambda: ("default/permanent", True, [FINALIZER]) in seen)
        await eventually(lambda: ("default/later", True, [FINALIZER]) in seen)
        status = kopf_shim.status(registry)["configmaps-reconcile-site"]
        await eventually(
            lambda: kopf_shim.status(registry)["configmaps-reconcile-site"]["dead_letters"] == 1
        )
        for name in ("flaky", "permanent", "later"):
            stored = await read_object(cluster_http, f"{CONFIGMAPS}/{name}")
            assert stored is not None and stored["metadata"]["finalizers"] == [FINALIZER], status
        events = await read_object(cluster_http, "/api/v1/namespaces/default/events")
        assert any(
            e["reason"] == "DeadLettered" and e["involvedObject"]["name"] == "permanent"
            for e in (events or {})["items"]
        )

        # Once the cleanup succeeds (the retry of the failed one), the finalizer goes.
        failing.discard("default/flaky")
        await eventually(lambda: _gone(cluster_http, "flaky"), timeout=30)


async def _gone(http: aiohttp.ClientSession, name: str) -> bool:
    return await read_object(http, f"{CONFIGMAPS}/{name}") is None
