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

    for _ in range(2):  # deleting a terminating namespace again answers it again
        response = await http.delete(f"/api/v1/namespaces/{name}")
        assert response.status == 200
        terminating = await response.json()
        assert terminating["metadata"]["deletionTimestamp"]
        assert terminating["status"]["phase"] == "Terminating"
        assert terminating["spec"]["finalizers"] == ["kubernetes"]

    # While it terminates (forever on a bare kube-apiserver, a moment on the embedded
    # cluster), nothing new may be created in it, however it is created...
    creates = [
        http.post(leases_in(name), json={"metadata": {"name": "late"}}),
        http.put(f"{leases_in(name)}/late", json={"metadata": {"name": "late"}}),
        http.post(f"/api/v1/namespaces/{name}/configmaps", json={"metadata": {"name": "late"}}),
    ]
    for create in creates:
        response = await create
        assert response.status == 403
        status = await response.json()
        assert status["reason"] == "Forbidden"
        assert status["message"].endswith(
            f'"late" is forbidden: unable to create new content in namespace {name} '
            "because it is being terminated"
        )
        assert status["details"]["causes"] == [
            {
                "reason": "NamespaceTerminating",
                "message": f"namespace {name} is being terminated",
                "field": "metadata.namespace",
            }
        ]
    # ...while what is there may still change.
    patch = {"metadata": {"labels": {"a": "b"}}}
    assert (await http.patch(f"{leases_in(name)}/l", json=patch, headers=MERGE)).status == 200


async def test_system_namespaces_cannot_be_deleted(http: aiohttp.ClientSession) -> None:
    for name in ("default", "kube-system", "kube-public"):
        response = await http.delete(f"/api/v1/namespaces/{name}", params={"dryRun": "All"})
        assert response.status == 403
        assert await response.json() == {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": f'namespaces "{name}" is forbidden: this namespace may not be deleted',
            "reason": "Forbidden",
            "details": {"name": name, "kind": "namespaces"},
            "code": 403,
        }


async def test_namespace_finalizers_are_not_updated(
    http: aiohttp.ClientSession, unique: Callable[[str], str]
) -> None:
    name = unique("ns")
    await http.post("/api/v1/namespaces", json={"metadata": {"name": name}})
    body = {"metadata": {"name": name, "labels": {"a": "b"}}, "spec": {"finalizers": []}}
    replaced = await (await http.put(f"/api/v1/namespaces/{name}", json=body)).json()
    # The name label is set on every write, whatever the body says.
    assert replaced["metadata"]["labels"] == {"a": "b", "kubernetes.io/metadata.name": name}
    assert replaced["spec"]["finalizers"] == ["kubernetes"]  # only /finalize changes them
    await http.delete(f"/api/v1/namespaces/{name}")


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


@pytest.mark.parametrize("involved", [{"kind": "Lease", "name": "l"}, None, "other"])
async def test_events_must_be_about_their_own_namespace(
    http: aiohttp.ClientSession, kube_namespace: str, involved: Any
) -> None:
    # An event without an involvedObject.namespace may only live in "default".
    event: dict[str, Any] = {"metadata": {"generateName": "e."}, "reason": "Tested"}
    if involved == "other":
        involved = {"kind": "Lease", "name": "l", "namespace": "other"}
    if involved is not None:
        event["involvedObject"] = involved
    response = await http.post(f"/api/v1/namespaces/{kube_namespace}/events", json=event)
    assert response.status == 422
    status = await response.json()
    assert status["reason"] == "Invalid"
    assert status["details"]["kind"] == "Event"
    wrong = "other" if involved and "namespace" in involved else ""
    assert status["details"]["causes"] == [
        {
            "reason": "FieldValueInvalid",
            "message": f'Invalid value: "{wrong}": does not match event.namespace',
            "field": "involvedObject.namespace",
        }
    ]


async def test_events_without_a_namespace_of_their_object_live_in_default(
    http: aiohttp.ClientSession, unique: Callable[[str], str]
) -> None:
    name = unique("event")
    event = {"metadata": {"name": name}, "reason": "Tested", "involvedObject": {"kind": "Node"}}
    url = "/api/v1/namespaces/default/events"
    assert (await http.post(url, json=event)).status == 201
    await http.delete(f"{url}/{name}")


async def test_new_style_events_need_their_reporter(
    http: aiohttp.ClientSession, kube_namespace: str
) -> None:
    involved = {"kind": "Lease", "name": "l", "namespace": kube_namespace}
    event = {
        "metadata": {"generateName": "e."},
        "involvedObject": involved,
        "reason": "Tested",
        "eventTime": "2024-01-02T03:04:05.000006Z",
    }
    url = f"/api/v1/namespaces/{kube_namespace}/events"
    response = await http.post(url, json=event)
    assert response.status == 422
    fields = [cause["field"] for cause in (await response.json())["details"]["causes"]]
    assert fields == [
        "reportingComponent",
        "reportingComponent",
        "reportingComponent",
        "reportingInstance",
        "action",
    ]
    reported = {**event, "reportingComponent": "tests", "reportingInstance": "i", "action": "Do"}
    assert (await http.post(url, json=reported)).status == 201


async def test_events_as_kopf_posts_them(http: aiohttp.ClientSession, kube_namespace: str) -> None:
    # kopf 1.45's body: a new-style Event, its times from Python's isoformat().
    event = {
        "metadata": {"namespace": kube_namespace, "generateName": "kopf-event-"},
        "action": "Action?",
        "type": "Normal",
        "reason": "Logging",
        "message": "Handler succeeded.",
        "reportingComponent": "kopf",
        "reportingInstance": "dev",
        "source": {"component": "kopf"},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "name": "c",
            "uid": "00000000-0000-0000-0000-000000000001",
            "namespace": kube_namespace,
        },
        "firstTimestamp": "2024-01-02T03:04:05.123456+00:00",
        "lastTimestamp": "2024-01-02T05:04:05.5+02:00",
        "eventTime": "2024-01-02T05:04:05.123456+02:00",
    }
    url = f"/api/v1/namespaces/{kube_namespace}/events"
    response = await http.post(url, json=event)
    assert response.status == 201
    created = await response.json()
    assert created["firstTimestamp"] == "2024-01-02T03:04:05Z"  # metav1.Time: whole seconds
    assert created["lastTimestamp"] == "2024-01-02T03:04:05Z"
    assert created["eventTime"] == "2024-01-02T03:04:05.123456Z"  # MicroTime, in UTC

    # isoformat() drops the fraction when the microseconds are 0: a MicroTime needs six digits.
    response = await http.post(url, json={**event, "eventTime": "2024-01-02T05:04:05+02:00"})
    assert response.status == 400
    response = await http.post(url, json={**event, "firstTimestamp": "yesterday"})
    assert response.status == 400


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
    body: Any = {"metadata": {"name": "watched"}, "spec": {"holderIdentity": "a"}}  # sent as is

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
