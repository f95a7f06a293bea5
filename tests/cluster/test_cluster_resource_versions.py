"""Reads at a resourceVersion: waiting for a future one (then 504), exact lists of a past
state, pages of one snapshot, watches that replay from an early version, bad versions."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp


def leases_in(namespace: str) -> str:
    return f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"


def names(document: dict[str, Any]) -> list[str]:
    return [item["metadata"]["name"] for item in document["items"]]


async def create(http: aiohttp.ClientSession, url: str, name: str) -> dict[str, Any]:
    response = await http.post(url, json={"metadata": {"name": name}})
    assert response.status == 201
    created: dict[str, Any] = await response.json()
    return created


async def test_read_at_a_future_version_times_out(
    http: aiohttp.ClientSession, kube_namespace: str
) -> None:
    url = leases_in(kube_namespace)
    await create(http, url, "present")
    listing = await (await http.get(url)).json()
    future = str(int(listing["metadata"]["resourceVersion"]) + 1_000_000)
    # Both wait (3 s) for the version to come, then give up with a retriable Timeout.
    responses = await asyncio.gather(
        http.get(url, params={"resourceVersion": future}),
        http.get(f"{url}/present", params={"resourceVersion": future}),
    )
    for response in responses:
        assert response.status == 504
        status = await response.json()
        assert status["reason"] == "Timeout"
        assert status["message"].startswith(f"Timeout: Too large resource version: {future}, ")
        assert status["details"] == {
            "causes": [
                {"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}
            ],
            "retryAfterSeconds": 1,
        }


async def test_read_at_a_future_version_waits_for_it(
    http: aiohttp.ClientSession, kube_namespace: str
) -> None:
    url = leases_in(kube_namespace)
    listing = await (await http.get(url)).json()
    next_version = str(int(listing["metadata"]["resourceVersion"]) + 1)
    reading = asyncio.create_task(http.get(url, params={"resourceVersion": next_version}))
    await asyncio.sleep(0.2)
    await create(http, url, "awaited")
    response = await reading
    assert response.status == 200
    # The server's own writes (its identity lease) may reach the version first: the answer
    # is never older than the version asked for, whichever write made it.
    read = await response.json()
    assert int(read["metadata"]["resourceVersion"]) >= int(next_version)


async def test_exact_list_reads_a_past_state(
    http: aiohttp.ClientSession, kube_namespace: str
) -> None:
    url = leases_in(kube_namespace)
    past = (await create(http, url, "a"))["metadata"]["resourceVersion"]
    await create(http, url, "b")
    await http.delete(f"{url}/a")

    exact = await (
        await http.get(url, params={"resourceVersion": past, "resourceVersionMatch": "Exact"})
    ).json()
    assert names(exact) == ["a"]
    assert exact["metadata"]["resourceVersion"] == past
    # A limit with a resourceVersion and no match rule reads exactly too (the legacy form).
    legacy = await (await http.get(url, params={"resourceVersion": past, "limit": "5"})).json()
    assert names(legacy) == ["a"]
    # Without a match rule and a limit, any state not older than the version will do.
    assert names(await (await http.get(url, params={"resourceVersion": past})).json()) == ["b"]

    response = await http.get(url, params={"resourceVersion": "0", "resourceVersionMatch": "Exact"})
    assert response.status == 422
    assert (await response.json())["details"]["causes"][0]["message"] == (
        'Forbidden: resourceVersionMatch "exact" is forbidden for resourceVersion "0"'
    )


async def test_pages_come_from_one_snapshot(
    http: aiohttp.ClientSession, kube_namespace: str
) -> None:
    url = leases_in(kube_namespace)
    for name in ("a", "b", "c"):
        await create(http, url, name)
    first = await (await http.get(url, params={"limit": "2"})).json()
    assert names(first) == ["a", "b"]
    assert first["metadata"]["remainingItemCount"] == 1
    await http.delete(f"{url}/c")
    await create(http, url, "d")

    token = first["metadata"]["continue"]
    second = await (await http.get(url, params={"limit": "2", "continue": token})).json()
    assert names(second) == ["c"]  # as it was when the first page was read
    assert second["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    assert "continue" not in second["metadata"]

    response = await http.get(url, params={"continue": token, "resourceVersion": "1"})
    assert response.status == 400
    assert (await response.json())["message"] == (
        "specifying resource version is not allowed when using continue"
    )


async def test_watch_replays_everything_after_an_early_version(
    http: aiohttp.ClientSession, kube_namespace: str
) -> None:
    url = leases_in(kube_namespace)
    start = (await create(http, url, "busy"))["metadata"]["resourceVersion"]
    merge = {"Content-Type": "application/merge-patch+json"}
    for index in range(20):
        patch = {"spec": {"leaseTransitions": index}}
        await http.patch(f"{url}/busy", json=patch, headers=merge)

    transitions: list[int] = []
    params = {"watch": "true", "resourceVersion": start}
    async with asyncio.timeout(10), http.get(url, params=params) as response:
        while len(transitions) < 20:
            event = json.loads(await response.content.readline())
            assert event["type"] == "MODIFIED"
            transitions.append(event["object"]["spec"]["leaseTransitions"])
    assert transitions == list(range(20))


async def test_a_resource_version_must_be_a_number(
    http: aiohttp.ClientSession, kube_namespace: str
) -> None:
    url = leases_in(kube_namespace)
    invalid = (
        'resourceVersion: Invalid value: "abc": strconv.ParseUint: parsing "abc": invalid syntax'
    )
    response = await http.get(url, params={"resourceVersion": "abc"})
    assert response.status == 400
    assert await response.json() == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": f"invalid resource version: {invalid}",
        "reason": "BadRequest",
        "code": 400,
    }
    for path, params in ((url, {"watch": "true"}), (f"{url}/missing", {})):
        response = await http.get(path, params={**params, "resourceVersion": "abc"})
        assert response.status == 500
        assert await response.json() == {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": invalid,
            "code": 500,
        }
