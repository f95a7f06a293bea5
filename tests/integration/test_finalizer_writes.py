"""The shim's finalizer writes on both API tiers: refused before sending without a live lease,
never overwriting a finalizer another writer added meanwhile, never added twice."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

import kopf_reconcile as kr
from kopf_reconcile.fencing.writer import ReconcileLease, bind_lease, unbind_lease
from kopf_reconcile.integration.finalizers import FinalizerWriter

NAME = "example.com/cleanup"


async def configmap(kube: Any, namespace: str, name: str, **metadata: Any) -> dict[str, Any]:
    body = {"metadata": {"name": name, **metadata}}
    async with kube.http_session() as http:
        path = f"/api/v1/namespaces/{namespace}/configmaps"
        async with http.post(path, json=body) as response:
            assert response.status == 201, await response.text()
            created: dict[str, Any] = await response.json()
            return created


async def release(kube: Any, namespace: str, name: str) -> None:
    """Strip every finalizer (a shared real cluster keeps the test's namespaces)."""
    path = f"/api/v1/namespaces/{namespace}/configmaps/{name}"
    headers = {"Content-Type": "application/merge-patch+json"}
    body = {"metadata": {"finalizers": None}}
    async with kube.http_session() as http, http.patch(path, json=body, headers=headers) as r:
        assert r.status == 200, await r.text()


async def finalizers(kube: Any, namespace: str, name: str) -> list[str]:
    path = f"/api/v1/namespaces/{namespace}/configmaps/{name}"
    async with kube.http_session() as http, http.get(path) as response:
        body = await response.json()
    return list(body["metadata"].get("finalizers") or [])


async def test_removing_a_finalizer_is_refused_before_sending_when_the_lease_is_not_live(
    kube: Any, kube_namespace: str
) -> None:
    created = await configmap(kube, kube_namespace, "guarded", finalizers=["other/keep", NAME])
    async with kube.api_client() as api:
        writer = FinalizerWriter(NAME, "", "v1", "configmaps", api=api)
        token = bind_lease(ReconcileLease(7, lambda epoch: False))  # lost since dispatch
        try:
            with pytest.raises(kr.StaleEpochError, match="epoch 7"):
                await writer.remove(created)
        finally:
            unbind_lease(token)
        assert await finalizers(kube, kube_namespace, "guarded") == ["other/keep", NAME]

        token = bind_lease(ReconcileLease(7, lambda epoch: epoch == 7))
        try:
            await writer.remove(created)
        finally:
            unbind_lease(token)
        assert await finalizers(kube, kube_namespace, "guarded") == ["other/keep"]
        # Removed by index, tested there first: a stale body removes nothing else.
        with pytest.raises(ApiException) as refused:
            await writer.remove(created)
        assert refused.value.status == 422
        assert await finalizers(kube, kube_namespace, "guarded") == ["other/keep"]
    await release(kube, kube_namespace, "guarded")


async def test_adding_over_a_stale_body_keeps_the_other_finalizers_and_adds_once(
    kube: Any, kube_namespace: str
) -> None:
    stale = await configmap(kube, kube_namespace, "contended")
    async with kube.http_session() as http:
        path = f"/api/v1/namespaces/{kube_namespace}/configmaps/contended"
        patch = [{"op": "add", "path": "/metadata/finalizers", "value": ["other/keep"]}]
        headers = {"Content-Type": "application/json-patch+json"}
        async with http.patch(path, json=patch, headers=headers) as response:
            assert response.status == 200, await response.text()
    async with kube.api_client() as api:
        writer = FinalizerWriter(NAME, "", "v1", "configmaps", api=api)
        await writer.add(stale)  # read before the other finalizer was added: read again
        assert await finalizers(kube, kube_namespace, "contended") == ["other/keep", NAME]
        await writer.add(stale)  # there already: not twice
        assert await finalizers(kube, kube_namespace, "contended") == ["other/keep", NAME]
    await release(kube, kube_namespace, "contended")


async def test_adding_to_an_object_deleted_since_the_body_was_read_is_refused(
    kube: Any, kube_namespace: str
) -> None:
    stale = await configmap(kube, kube_namespace, "going", finalizers=["other/keep"])
    async with kube.http_session() as http:
        path = f"/api/v1/namespaces/{kube_namespace}/configmaps/going"
        async with http.delete(path) as response:
            assert response.status == 200, await response.text()
    async with kube.api_client() as api:
        writer = FinalizerWriter(NAME, "", "v1", "configmaps", api=api)
        with pytest.raises(ApiException):
            await writer.add(stale)  # the next reconcile sees it deleting, from the cache
    assert await finalizers(kube, kube_namespace, "going") == ["other/keep"]
    await release(kube, kube_namespace, "going")


async def test_two_adds_over_one_stale_body_leave_one_finalizer(
    kube: Any, kube_namespace: str
) -> None:
    # A successor whose cache lags adds over the body its predecessor added over.
    stale = await configmap(kube, kube_namespace, "twice", finalizers=["other/keep"])
    async with kube.api_client() as api:
        for _ in range(2):
            await FinalizerWriter(NAME, "", "v1", "configmaps", api=api).add(stale)
    assert await finalizers(kube, kube_namespace, "twice") == ["other/keep", NAME]
    await release(kube, kube_namespace, "twice")


async def test_a_removal_takes_every_copy_of_the_finalizer(kube: Any, kube_namespace: str) -> None:
    twice = [NAME, "other/keep", NAME]
    created = await configmap(kube, kube_namespace, "copies", finalizers=twice)
    async with kube.api_client() as api:
        await FinalizerWriter(NAME, "", "v1", "configmaps", api=api).remove(created)
    assert await finalizers(kube, kube_namespace, "copies") == ["other/keep"]
    await release(kube, kube_namespace, "copies")
