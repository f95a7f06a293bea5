"""Embedded-only behaviour: the history window, bookmarks, fault injection, watch cuts."""

from __future__ import annotations

import asyncio
import json

from kopf_reconcile.testing.cluster import EmbeddedCluster

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
        async with http.get(LEASES, params=params) as response:
            async with asyncio.timeout(5):
                while embedded_cluster.cut_watches(r".*/leases") == 0:
                    await asyncio.sleep(0.01)
                try:
                    await response.content.read()
                    ended = "cleanly"
                except Exception:
                    ended = "abruptly"
    assert ended == "abruptly"
    assert embedded_cluster.sizes()["watchers"] == 0
