"""Embedded-only behaviour: the history window, bookmarks, fault injection, watch cuts."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from kopf_reconcile.testing.emulated_apiserver import EmbeddedCluster
from support import eventually

LEASES = "/apis/coordination.k8s.io/v1/namespaces/default/leases"


async def test_resume_beyond_the_history_window_is_expired() -> None:
    async with EmbeddedCluster(history_size=5) as cluster, cluster.http_session() as http:
        first = await (await http.post(LEASES, json={"metadata": {"name": "first"}})).json()
        for index in range(6):  # one more than the window holds
            await http.post(LEASES, json={"metadata": {"name": f"l{index}"}})
        params = {"watch": "true", "resourceVersion": first["metadata"]["resourceVersion"]}
        async with asyncio.timeout(5), http.get(LEASES, params=params) as response:
            event = json.loads(await response.content.readline())
        assert event["type"] == "ERROR"
        assert event["object"]["code"] == 410
        assert event["object"]["reason"] == "Expired"
        assert cluster.sizes()["history"] == 5


async def test_bookmarks_carry_the_current_version() -> None:
    async with EmbeddedCluster(bookmark_interval=0.05) as cluster, cluster.http_session() as http:
        created = await (await http.post(LEASES, json={"metadata": {"name": "a"}})).json()
        params = {
            "watch": "true",
            "allowWatchBookmarks": "true",
            "resourceVersion": created["metadata"]["resourceVersion"],
        }
        async with asyncio.timeout(5), http.get(LEASES, params=params) as response:
            event = json.loads(await response.content.readline())
        assert event["type"] == "BOOKMARK"
        assert event["object"]["kind"] == "Lease"
        assert (
            event["object"]["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
        )


async def test_injected_fault_fails_the_next_matching_requests(
    embedded_cluster: EmbeddedCluster,
) -> None:
    fault = embedded_cluster.inject_fault("GET", r".*/leases/.*", status=503, times=2)
    async with embedded_cluster.http_session() as http:
        await http.post(LEASES, json={"metadata": {"name": "a"}})
        statuses = [(await http.get(f"{LEASES}/a")).status for _ in range(3)]
        listed = await http.get(LEASES)
    assert statuses == [503, 503, 200]
    assert listed.status == 200
    assert fault.fired == 2
    assert embedded_cluster.sizes()["faults"] == 0


async def test_cut_watch_drops_the_connection(embedded_cluster: EmbeddedCluster) -> None:
    async with embedded_cluster.http_session() as http:
        params = {"watch": "true", "resourceVersion": "0"}
        async with http.get("/api/v1/namespaces", params=params) as other:
            async with http.get(LEASES, params=params) as response:
                await eventually(lambda: embedded_cluster.sizes()["streams"] == 2)
                assert embedded_cluster.cut_watches(r".*/leases") == 1
                with pytest.raises(aiohttp.ClientPayloadError):
                    await response.content.read()
            assert embedded_cluster.sizes()["streams"] == 1  # the namespaces watch goes on
            assert json.loads(await other.content.readline())["type"] == "ADDED"
    await eventually(lambda: embedded_cluster.sizes()["watchers"] == 0)


async def test_injected_delay_then_pass_through(embedded_cluster: EmbeddedCluster) -> None:
    fault = embedded_cluster.inject_fault(
        "*", r"/api/v1/namespaces/default", delay=0.05, times=None
    )
    async with embedded_cluster.http_session() as http:
        for _ in range(3):
            assert (await http.get("/api/v1/namespaces/default")).status == 200
    assert fault.fired == 3
    assert embedded_cluster.sizes()["faults"] == 1  # times=None: until cleared
    embedded_cluster.clear_faults()
    assert embedded_cluster.sizes()["faults"] == 0


async def test_injected_fault_body_is_a_status(embedded_cluster: EmbeddedCluster) -> None:
    embedded_cluster.inject_fault("PUT", r".*/leases/.*", status=409)
    async with embedded_cluster.http_session() as http:
        response = await http.put(f"{LEASES}/a", json={"metadata": {"name": "a"}})
        status = await response.json()
    assert response.status == 409
    assert status["kind"] == "Status"
    assert status["reason"] == "Conflict"
    assert status["code"] == 409


async def test_field_validation_strict_and_warn(embedded_cluster: EmbeddedCluster) -> None:
    # kubectl relies on it here, see openapi.py.
    body = {"metadata": {"name": "a", "bogus": 1}, "spec": {"holderIdentity": "x", "junk": 2}}
    async with embedded_cluster.http_session() as http:
        response = await http.post(LEASES, params={"fieldValidation": "Strict"}, json=body)
        assert response.status == 400
        message = (await response.json())["message"]
        assert 'unknown field "metadata.bogus"' in message
        assert 'unknown field "spec.junk"' in message

        response = await http.post(LEASES, params={"fieldValidation": "Warn"}, json=body)
        assert response.status == 201
        assert sorted(response.headers.getall("Warning")) == [
            '299 - "unknown field \\"metadata.bogus\\""',
            '299 - "unknown field \\"spec.junk\\""',
        ]
        assert (await response.json())["spec"] == {"holderIdentity": "x"}


async def test_deleted_namespace_is_emptied_after_the_controller_delay() -> None:
    # A real server needs kube-controller-manager for this; the embedded cluster does it itself.
    async with (
        EmbeddedCluster(namespace_termination_delay=0.2) as cluster,
        cluster.http_session() as http,
    ):
        await http.post("/api/v1/namespaces", json={"metadata": {"name": "doomed"}})
        url = "/apis/coordination.k8s.io/v1/namespaces/doomed/leases"
        await http.post(url, json={"metadata": {"name": "plain"}})
        await http.post(
            url, json={"metadata": {"name": "held", "finalizers": ["example.com/hold"]}}
        )
        await http.delete("/api/v1/namespaces/doomed")
        assert (await http.get(f"{url}/plain")).status == 200  # the controller has not run yet

        async def plain_gone() -> bool:
            return (await http.get(f"{url}/plain")).status == 404

        await eventually(plain_gone, message="the namespace controller deleted the content")
        held = await (await http.get(f"{url}/held")).json()
        assert held["metadata"]["deletionTimestamp"]
        assert (await http.get("/api/v1/namespaces/doomed")).status == 200

        patch = {"metadata": {"finalizers": None}}
        headers = {"Content-Type": "application/merge-patch+json"}
        assert (await http.patch(f"{url}/held", json=patch, headers=headers)).status == 200
        assert (await http.get("/api/v1/namespaces/doomed")).status == 404


async def test_namespace_termination_delay_zero_empties_at_once() -> None:
    async with (
        EmbeddedCluster(namespace_termination_delay=0) as cluster,
        cluster.http_session() as http,
    ):
        await http.post("/api/v1/namespaces", json={"metadata": {"name": "doomed"}})
        url = "/apis/coordination.k8s.io/v1/namespaces/doomed/leases"
        await http.post(url, json={"metadata": {"name": "plain"}})
        deleted = await http.delete("/api/v1/namespaces/doomed")
        assert (await deleted.json())["status"]["phase"] == "Terminating"
        assert (await http.get("/api/v1/namespaces/doomed")).status == 404


async def test_a_fresh_cluster_replays_from_its_first_version() -> None:
    # As a fresh kube-apiserver does (its watch cache holds every change since it started).
    async with EmbeddedCluster() as cluster, cluster.http_session() as http:
        params = {"watch": "true", "resourceVersion": "1"}
        received: list[dict[str, Any]] = []
        async with asyncio.timeout(5), http.get("/api/v1/namespaces", params=params) as response:
            while len(received) < 3:
                received.append(json.loads(await response.content.readline()))
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in received] == [
        ("ADDED", "kube-system"),
        ("ADDED", "kube-public"),
        ("ADDED", "kube-node-lease"),
    ]


async def test_reads_older_than_the_history_window_are_expired() -> None:
    async with EmbeddedCluster(history_size=5) as cluster, cluster.http_session() as http:
        first = await (await http.post(LEASES, json={"metadata": {"name": "first"}})).json()
        await http.post(LEASES, json={"metadata": {"name": "second"}})
        page = await (await http.get(LEASES, params={"limit": "1"})).json()
        for index in range(6):  # one more than the window holds
            await http.post(LEASES, json={"metadata": {"name": f"l{index}"}})

        exact = {"resourceVersion": first["metadata"]["resourceVersion"], "limit": "10"}
        response = await http.get(LEASES, params=exact)
        assert response.status == 410
        status = await response.json()
        assert status["reason"] == "Expired"
        assert status["message"] == "The resourceVersion for the provided list is too old."

        response = await http.get(
            LEASES, params={"limit": "1", "continue": page["metadata"]["continue"]}
        )
        assert response.status == 410
        assert (await response.json())["message"].startswith(
            "The provided continue parameter is too old"
        )
