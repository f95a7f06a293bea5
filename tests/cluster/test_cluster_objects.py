"""Generic object semantics on built-in kinds: namespaces, generateName, dry runs, delete
preconditions, pagination, Events, and kubernetes-asyncio's watch helper."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client, watch

MERGE = {"Content-Type": "application/merge-patch+json"}


def leases_in(namespace: str) -> str:
    return f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"


async def test_namespace_lifecycle(
    http: aiohttp.ClientSession, unique: Callable[[str], str]
) -> None:
    name = unique("ns")
    created = await (
        await http.post("/api/v1/namespaces", json={"metadata": {"name": name}})
    ).json()
    assert created["status"]["phase"] == "Active"
    assert created["spec"]["finalizers"] == ["kubernetes"]
    assert (await http.post(leases_in(name), json={"metadata": {"name": "l"}})).status == 201

    response = await http.delete(f"/api/v1/namespaces/{name}")
    assert response.status == 200
    terminating = await response.json()
    assert terminating["metadata"]["deletionTimestamp"]
    assert terminating["status"]["phase"] == "Terminating"

    # No new content in a terminating namespace (until it is gone: then 404).
    response = await http.post(leases_in(name), json={"metadata": {"name": "late"}})
    assert response.status in (403, 404)
    if response.status == 403:
        assert (await response.json())["reason"] == "Forbidden"


async def test_generate_name(http: aiohttp.ClientSession, kube_namespace: str) -> None:
    response = await http.post(
        leases_in(kube_namespace), json={"metadata": {"generateName": "gen-"}}
    )
    assert response.status == 201
    name = (await response.json())["metadata"]["name"]
    assert name.startswith("gen-")
    assert len(name) == len("gen-") + 5


async def test_dry_run_writes_nothing(http: aiohttp.ClientSession, kube_namespace: str) -> None:
    url = leases_in(kube_namespace)
    response = await http.post(url, params={"dryRun": "All"}, json={"metadata": {"name": "dry"}})
    assert response.status == 201
    assert (await http.get(f"{url}/dry")).status == 404

    await http.post(url, json={"metadata": {"name": "wet"}, "spec": {"holderIdentity": "a"}})
    patch = {"spec": {"holderIdentity": "b"}}
    response = await http.patch(f"{url}/wet", params={"dryRun": "All"}, json=patch, headers=MERGE)
    assert (await response.json())["spec"]["holderIdentity"] == "b"
    assert (await (await http.get(f"{url}/wet")).json())["spec"]["holderIdentity"] == "a"
    assert (await http.delete(f"{url}/wet", params={"dryRun": "All"})).status == 200
    assert (await http.get(f"{url}/wet")).status == 200


async def test_delete_preconditions(http: aiohttp.ClientSession, kube_namespace: str) -> None:
    url = leases_in(kube_namespace)
    created = await (await http.post(url, json={"metadata": {"name": "pre"}})).json()
    stale = {"preconditions": {"resourceVersion": "1"}}
    response = await http.delete(f"{url}/pre", json=stale)
    assert response.status == 409
    assert (await response.json())["reason"] == "Conflict"
    fresh = {"preconditions": {"uid": created["metadata"]["uid"]}}
    assert (await http.delete(f"{url}/pre", json=fresh)).status == 200


async def test_put_creates_a_missing_lease(
    http: aiohttp.ClientSession, kube_namespace: str
) -> None:
    url = f"{leases_in(kube_namespace)}/put-made"
    response = await http.put(
        url, json={"metadata": {"name": "put-made"}, "spec": {"holderIdentity": "a"}}
    )
    assert response.status == 201
    assert (await http.get(url)).status == 200


async def test_namespaces_do_not_create_on_put(
    http: aiohttp.ClientSession, unique: Callable[[str], str]
) -> None:
    name = unique("ns")
    response = await http.put(f"/api/v1/namespaces/{name}", json={"metadata": {"name": name}})
    assert response.status == 404


async def test_pagination(http: aiohttp.ClientSession, kube_namespace: str) -> None:
    url = leases_in(kube_namespace)
    names = {f"page-{index}" for index in range(5)}
    for name in names:
        await http.post(url, json={"metadata": {"name": name}})
    seen: list[str] = []
    params = {"limit": "2"}
    for _ in range(10):
        page = await (await http.get(url, params=params)).json()
        assert len(page["items"]) <= 2
        seen.extend(item["metadata"]["name"] for item in page["items"])
        token = page["metadata"].get("continue")
        if not token:
            break
        params = {"limit": "2", "continue": token}
    assert sorted(seen) == sorted(names)


async def test_events_are_accepted(http: aiohttp.ClientSession, kube_namespace: str) -> None:
    event = {
        "metadata": {"generateName": "lease."},
        "involvedObject": {"kind": "Lease", "name": "l", "namespace": kube_namespace},
        "reason": "Acquired",
        "message": "became the leader",
        "type": "Normal",
        "source": {"component": "tests"},
    }
    url = f"/api/v1/namespaces/{kube_namespace}/events"
    assert (await http.post(url, json=event)).status == 201
    listed = await (await http.get(url, params={"fieldSelector": "reason=Acquired"})).json()
    assert listed["kind"] == "EventList"
    assert [item["message"] for item in listed["items"]] == ["became the leader"]


async def test_config_maps_drop_unknown_fields(
    http: aiohttp.ClientSession, kube_namespace: str
) -> None:
    url = f"/api/v1/namespaces/{kube_namespace}/configmaps"
    body = {"metadata": {"name": "cm"}, "data": {"a": "1"}, "status": {"x": 1}}
    created = await (await http.post(url, json=body)).json()
    assert "status" not in created
    response = await http.post(url, json={"metadata": {"name": "bad"}, "data": {"a": 1}})
    assert response.status == 400


async def test_watch_through_kubernetes_asyncio(api_client: Any, kube_namespace: str) -> None:
    coordination = client.CoordinationV1Api(api_client)
    listing = await coordination.list_namespaced_lease(kube_namespace)
    version = listing.metadata.resource_version
    body = {"metadata": {"name": "watched"}, "spec": {"holderIdentity": "a"}}

    async def write() -> None:
        await coordination.create_namespaced_lease(kube_namespace, body)
        await coordination.patch_namespaced_lease(
            "watched", kube_namespace, {"spec": {"holderIdentity": "b"}}
        )
        await coordination.delete_namespaced_lease("watched", kube_namespace)

    seen: list[tuple[str, str | None]] = []
    writer = asyncio.create_task(write())
    async with asyncio.timeout(15), watch.Watch() as stream:
        async for event in stream.stream(
            coordination.list_namespaced_lease,
            kube_namespace,
            resource_version=version,
            timeout_seconds=10,
        ):
            seen.append((event["type"], event["object"].spec.holder_identity))
            if event["type"] == "DELETED":
                break
    await writer
    assert seen == [("ADDED", "a"), ("MODIFIED", "b"), ("DELETED", "b")]


@pytest.mark.parametrize("selector", ["metadata.name=a", "metadata.namespace!=other"])
async def test_field_selectors_on_list(
    http: aiohttp.ClientSession, kube_namespace: str, selector: str
) -> None:
    url = leases_in(kube_namespace)
    for name in ("a", "b"):
        await http.post(url, json={"metadata": {"name": name}})
    listed = await (await http.get(url, params={"fieldSelector": selector})).json()
    names = sorted(item["metadata"]["name"] for item in listed["items"])
    assert names == (["a"] if selector == "metadata.name=a" else ["a", "b"])
