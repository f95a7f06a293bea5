"""Watch: resume from a resourceVersion, selectors, timeouts.

(410 Expired needs a resourceVersion older than what the server retains; a real
kube-apiserver's watch cache grows too large to provoke that in a test, so it is covered
in ``test_cluster_embedded.py`` with a small history window.)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp

LEASES = "/apis/coordination.k8s.io/v1/namespaces/default/leases"


def lease_body(
    name: str, labels: dict[str, str] | None = None, holder: str = "a"
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if labels:
        metadata["labels"] = labels
    return {"metadata": metadata, "spec": {"holderIdentity": holder}}


async def events(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    async for line in response.content:
        if line.strip():
            yield json.loads(line)


async def collect(
    http: aiohttp.ClientSession, url: str, params: dict[str, str], count: int
) -> list[dict[str, Any]]:
    """The first ``count`` events of a watch (fails the test if they do not come in time)."""
    received: list[dict[str, Any]] = []
    async with asyncio.timeout(10):
        async with http.get(url, params={"watch": "true", **params}) as response:
            assert response.status == 200
            async for event in events(response):
                received.append(event)
                if len(received) == count:
                    break
    return received


async def test_watch_from_a_version_sends_only_later_events(
    http: aiohttp.ClientSession, unique: Callable[[str], str]
) -> None:
    name = unique("lease")
    first = await (await http.post(LEASES, json=lease_body(name))).json()
    version = first["metadata"]["resourceVersion"]
    headers = {"Content-Type": "application/merge-patch+json"}
    await http.patch(f"{LEASES}/{name}", json={"spec": {"holderIdentity": "b"}}, headers=headers)
    await http.delete(f"{LEASES}/{name}")

    params = {"resourceVersion": version, "fieldSelector": f"metadata.name={name}"}
    received = await collect(http, LEASES, params, 2)
    assert [e["type"] for e in received] == ["MODIFIED", "DELETED"]
    assert received[0]["object"]["spec"]["holderIdentity"] == "b"
    assert received[0]["object"]["kind"] == "Lease"
    assert received[0]["object"]["apiVersion"] == "coordination.k8s.io/v1"
    versions = [int(e["object"]["metadata"]["resourceVersion"]) for e in received]
    assert int(version) < versions[0] < versions[1]


async def test_watch_without_version_starts_with_current_state(
    http: aiohttp.ClientSession, unique: Callable[[str], str]
) -> None:
    name = unique("lease")
    await http.post(LEASES, json=lease_body(name))
    received = await collect(http, LEASES, {"fieldSelector": f"metadata.name={name}"}, 1)
    assert received[0]["type"] == "ADDED"
    assert received[0]["object"]["metadata"]["name"] == name


async def test_watch_receives_live_events(
    http: aiohttp.ClientSession, unique: Callable[[str], str]
) -> None:
    name = unique("lease")
    listing = await (await http.get(LEASES)).json()
    params = {
        "resourceVersion": listing["metadata"]["resourceVersion"],
        "fieldSelector": f"metadata.name={name}",
    }
    watching = asyncio.create_task(collect(http, LEASES, params, 2))
    await asyncio.sleep(0)
    await http.post(LEASES, json=lease_body(name))
    headers = {"Content-Type": "application/merge-patch+json"}
    await http.patch(f"{LEASES}/{name}", json={"spec": {"holderIdentity": "b"}}, headers=headers)
    received = await watching
    assert [e["type"] for e in received] == ["ADDED", "MODIFIED"]


async def test_label_selector_turns_label_changes_into_added_and_deleted(
    http: aiohttp.ClientSession, unique: Callable[[str], str]
) -> None:
    name = unique("lease")
    label = unique("tier")
    listing = await (await http.get(LEASES)).json()
    params = {
        "resourceVersion": listing["metadata"]["resourceVersion"],
        "labelSelector": f"tier={label}",
    }
    headers = {"Content-Type": "application/merge-patch+json"}
    await http.post(LEASES, json=lease_body(unique("other"), labels={"tier": "other"}))
    await http.post(LEASES, json=lease_body(name))
    await http.patch(
        f"{LEASES}/{name}", json={"metadata": {"labels": {"tier": label}}}, headers=headers
    )
    await http.patch(f"{LEASES}/{name}", json={"spec": {"holderIdentity": "b"}}, headers=headers)
    await http.patch(
        f"{LEASES}/{name}", json={"metadata": {"labels": {"tier": "x"}}}, headers=headers
    )
    received = await collect(http, LEASES, params, 3)
    assert [e["type"] for e in received] == ["ADDED", "MODIFIED", "DELETED"]
    assert all(e["object"]["metadata"]["name"] == name for e in received)


async def test_label_selector_on_list(
    http: aiohttp.ClientSession, unique: Callable[[str], str]
) -> None:
    label = unique("app")
    names = [unique("lease") for _ in range(3)]
    for index, name in enumerate(names):
        await http.post(LEASES, json=lease_body(name, labels={"app": label, "idx": str(index)}))

    def listed(document: dict[str, Any]) -> set[str]:
        return {item["metadata"]["name"] for item in document["items"]}

    everything = await (await http.get(LEASES, params={"labelSelector": f"app={label}"})).json()
    assert listed(everything) == set(names)
    some = await (
        await http.get(LEASES, params={"labelSelector": f"app={label},idx in (0,2)"})
    ).json()
    assert listed(some) == {names[0], names[2]}
    others = await (await http.get(LEASES, params={"labelSelector": f"app={label},idx!=0"})).json()
    assert listed(others) == {names[1], names[2]}


async def test_timeout_seconds_ends_the_stream(http: aiohttp.ClientSession) -> None:
    listing = await (await http.get(LEASES)).json()
    params = {
        "watch": "true",
        "timeoutSeconds": "1",
        "resourceVersion": listing["metadata"]["resourceVersion"],
    }
    async with asyncio.timeout(10):
        async with http.get(LEASES, params=params) as response:
            assert response.status == 200
            remaining = [event async for event in events(response) if event["type"] != "BOOKMARK"]
    assert remaining == []


async def test_watch_list_sends_the_state_then_a_bookmark_then_changes(
    http: aiohttp.ClientSession, unique: Callable[[str], str]
) -> None:
    label = {"watch-list": unique("run")}
    names = [unique("lease") for _ in range(2)]
    for name in names:
        await http.post(LEASES, json=lease_body(name, labels=label))
    selector = {"labelSelector": ",".join(f"{k}={v}" for k, v in label.items())}
    params = {
        **selector,
        "sendInitialEvents": "true",
        "resourceVersionMatch": "NotOlderThan",
        "allowWatchBookmarks": "true",
    }
    received: list[dict[str, Any]] = []
    async with asyncio.timeout(10):
        async with http.get(LEASES, params={"watch": "true", **params}) as response:
            assert response.status == 200
            async for event in events(response):
                received.append(event)
                if event["type"] == "BOOKMARK" and event["object"]["metadata"].get("annotations"):
                    late = unique("lease")
                    await http.post(LEASES, json=lease_body(late, labels=label))
                if event["type"] == "ADDED" and len(received) > 3:
                    break
    initial = [e["object"]["metadata"]["name"] for e in received[:2]]
    assert sorted(initial) == sorted(names) and {e["type"] for e in received[:2]} == {"ADDED"}
    end = received[2]
    assert end["type"] == "BOOKMARK"
    assert end["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
    assert int(end["object"]["metadata"]["resourceVersion"]) >= max(
        int(e["object"]["metadata"]["resourceVersion"]) for e in received[:2]
    )
    changes = [e for e in received[3:] if e["type"] != "BOOKMARK"]
    assert [e["object"]["metadata"]["name"] for e in changes] == [late]

    # false: only the changes after the version (none here), never the state.
    params["sendInitialEvents"] = "false"
    params["timeoutSeconds"] = "1"
    async with http.get(LEASES, params={"watch": "true", **params}) as response:
        assert response.status == 200
        assert [e async for e in events(response) if e["type"] != "BOOKMARK"] == []


async def test_watch_list_options_are_checked(http: aiohttp.ClientSession) -> None:
    async def causes(params: dict[str, str]) -> list[tuple[str, str]]:
        async with http.get(LEASES, params=params) as response:
            assert response.status == 422
            status = await response.json()
        assert status["details"]["kind"] == "ListOptions"
        return [(c["field"], c["message"]) for c in status["details"]["causes"]]

    assert await causes({"sendInitialEvents": "true"}) == [
        ("sendInitialEvents", "Forbidden: sendInitialEvents is forbidden for list")
    ]
    assert await causes({"watch": "true", "sendInitialEvents": "true"}) == [
        (
            "resourceVersionMatch",
            "Forbidden: sendInitialEvents requires setting resourceVersionMatch to NotOlderThan",
        )
    ]
    watch_exact = {"watch": "true", "resourceVersionMatch": "Exact", "resourceVersion": "1"}
    assert await causes(watch_exact) == [
        (
            "resourceVersionMatch",
            "Forbidden: resourceVersionMatch is forbidden for watch unless sendInitialEvents "
            "is provided",
        ),
        (
            "resourceVersionMatch",
            'Unsupported value: "Exact": supported values: "NotOlderThan"',
        ),
    ]
