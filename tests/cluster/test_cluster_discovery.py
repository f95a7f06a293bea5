"""Discovery: what clients (kopf, kubectl, kubernetes-asyncio) read before anything else."""

from __future__ import annotations

from typing import Any

import aiohttp
from kubernetes_asyncio import client


async def test_version_reports_a_kubernetes_release(http: aiohttp.ClientSession) -> None:
    response = await http.get("/version")
    assert response.status == 200
    version = await response.json()
    assert version["major"] == "1"
    assert int(version["minor"].rstrip("+")) >= 20
    assert version["gitVersion"].startswith("v1.")


async def test_core_api_versions(http: aiohttp.ClientSession) -> None:
    response = await http.get("/api")
    document = await response.json()
    assert document["kind"] == "APIVersions"
    assert document["versions"] == ["v1"]


async def test_groups_include_leases_and_crds(http: aiohttp.ClientSession) -> None:
    document = await (await http.get("/apis")).json()
    assert document["kind"] == "APIGroupList"
    groups = {group["name"]: group for group in document["groups"]}
    assert {"groupVersion": "coordination.k8s.io/v1", "version": "v1"} in groups[
        "coordination.k8s.io"
    ]["versions"]
    assert groups["apiextensions.k8s.io"]["preferredVersion"]["version"] == "v1"


async def test_group_document(http: aiohttp.ClientSession) -> None:
    document = await (await http.get("/apis/coordination.k8s.io")).json()
    assert document["kind"] == "APIGroup"
    assert document["name"] == "coordination.k8s.io"


async def test_resource_lists(http: aiohttp.ClientSession) -> None:
    leases = await (await http.get("/apis/coordination.k8s.io/v1")).json()
    assert leases["kind"] == "APIResourceList"
    assert leases["groupVersion"] == "coordination.k8s.io/v1"
    lease = next(r for r in leases["resources"] if r["name"] == "leases")
    assert lease["kind"] == "Lease"
    assert lease["namespaced"] is True
    assert {"create", "get", "list", "watch", "update", "patch", "delete"} <= set(lease["verbs"])

    core = await (await http.get("/api/v1")).json()
    names = {r["name"]: r for r in core["resources"]}
    assert names["namespaces"]["namespaced"] is False
    assert names["events"]["namespaced"] is True
    assert "namespaces/status" in names

    crds = await (await http.get("/apis/apiextensions.k8s.io/v1")).json()
    crd = next(r for r in crds["resources"] if r["name"] == "customresourcedefinitions")
    assert crd["namespaced"] is False
    assert "watch" in crd["verbs"]


async def test_unknown_resource_is_not_found(http: aiohttp.ClientSession) -> None:
    for path in (
        "/apis/coordination.k8s.io/v1/namespaces/default/nonexistents",
        "/apis/coordination.k8s.io/v9/leases",
        "/api/v9/namespaces",
        "/api/v9",
    ):
        response = await http.get(path)
        assert response.status == 404
        status = await response.json()  # a known group: a Status
        assert status["message"] == "the server could not find the requested resource"
        assert status["reason"] == "NotFound"


async def test_unknown_group_is_no_api_path(http: aiohttp.ClientSession) -> None:
    for method in ("GET", "POST"):
        for path in ("/apis/nope.example.com/v1/things", "/apis/nope.example.com"):
            response = await http.request(method, path, json={})
            assert response.status == 404
            assert response.content_type == "text/plain"
            assert await response.text() == "404 page not found\n"


async def test_leases_are_served_as_v1_only(
    http: aiohttp.ClientSession, kube_namespace: str
) -> None:
    group = await (await http.get("/apis/coordination.k8s.io")).json()
    assert group["preferredVersion"]["version"] == "v1"
    resources = await (await http.get("/apis/coordination.k8s.io/v1")).json()
    lease = next(r for r in resources["resources"] if r["name"] == "leases")
    assert lease["storageVersionHash"] == "gqkMMb/YqFM="  # stored as coordination.k8s.io/v1

    url = f"/apis/coordination.k8s.io/v1beta1/namespaces/{kube_namespace}/leases"
    async with http.post(url, json={"metadata": {"name": "old"}}) as response:
        assert response.status == 404  # v1beta1 Leases were removed in v1.22


async def test_built_in_kinds_have_their_singular_name(http: aiohttp.ClientSession) -> None:
    for path in ("/api/v1", "/apis/coordination.k8s.io/v1", "/apis/apiextensions.k8s.io/v1"):
        resources = (await (await http.get(path)).json())["resources"]
        kinds = {r["name"]: r for r in resources}
        for name in ("namespaces", "configmaps", "secrets", "events", "leases"):
            if name in kinds:
                assert kinds[name]["singularName"] == kinds[name]["kind"].lower()
        assert {r["singularName"] for r in resources if "/" in r["name"]} <= {""}


async def test_system_namespaces_exist(api_client: Any) -> None:
    core = client.CoreV1Api(api_client)
    namespaces = await core.list_namespace()
    names = {ns.metadata.name for ns in namespaces.items}
    assert {"default", "kube-system"} <= names
    default = await core.read_namespace("default")
    assert default.status.phase == "Active"
