"""Sharded list and watch (KEP-5866, feature gate ``ShardedListAndWatch``, on in both tiers).

``shardSelector=shardRange(object.metadata.uid|namespace, '<start>', '<end>') [|| ...]``
selects the objects whose field's 64-bit FNV-1a hash lies in ``[start, end)``; a list
echoes the selector, in canonical form, as ``metadata.shardInfo.selector`` (a list without
one has no ``shardInfo``, nor has a list of custom resources, filtered all the same); a
watch sends only matching objects; a bad selector is a 500 whose message says why, worded
as v1.37 words it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from widget_kind import Widgets

from kopf_reconcile.sharding import UID_FIELD, fnv1a_64, hash_range, range_of, shard_selector

pytestmark = pytest.mark.feature("ShardedListAndWatch")

HALF = "0x8000000000000000"
LOW = f"shardRange(object.metadata.uid, '0x0000000000000000', '{HALF}')"
QUARTERS = [f"0x{k * 2**62:016x}" for k in range(4)] + ["0x10000000000000000"]


def hashed(value: str) -> int:
    return fnv1a_64(value.encode())


async def config_maps(
    http: aiohttp.ClientSession, namespace: str, count: int, prefix: str
) -> dict[str, str]:
    """``count`` ConfigMaps created in ``namespace``: name -> uid."""
    made = {}
    for i in range(count):
        body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{prefix}-{i}"}}
        async with http.post(f"/api/v1/namespaces/{namespace}/configmaps", json=body) as r:
            assert r.status == 201, await r.text()
            created = await r.json()
        made[created["metadata"]["name"]] = created["metadata"]["uid"]
    return made


async def listed(http: aiohttp.ClientSession, url: str, **params: str) -> dict[str, Any]:
    async with http.get(url, params=params) as response:
        assert response.status == 200, await response.text()
        document: dict[str, Any] = await response.json()
        return document


def names(document: dict[str, Any]) -> list[str]:
    return sorted(item["metadata"]["name"] for item in document["items"])


async def test_a_uid_range_lists_exactly_the_objects_hashed_into_it(
    http: aiohttp.ClientSession, kube_namespace: str
) -> None:
    uids = await config_maps(http, kube_namespace, 12, "cm")
    url = f"/api/v1/namespaces/{kube_namespace}/configmaps"
    full = await listed(http, url)
    assert "shardInfo" not in full["metadata"] and names(full) == sorted(uids)
    # An empty parameter filters nothing and echoes nothing.
    assert "shardInfo" not in (await listed(http, url, shardSelector=""))["metadata"]
    for version in ("", "0"):  # from storage and from the watch cache
        low = await listed(http, url, shardSelector=LOW, resourceVersion=version)
        assert names(low) == sorted(n for n, u in uids.items() if hashed(u) < 2**63)
        assert low["metadata"]["shardInfo"] == {"selector": LOW}
    # Four contiguous ranges: each object in exactly one; bounds written without spaces come
    # back in canonical form.
    seen: list[str] = []
    for k in range(4):
        compact = f"shardRange(object.metadata.uid,'{QUARTERS[k]}','{QUARTERS[k + 1]}')"
        part = await listed(http, url, shardSelector=compact)
        canonical = f"shardRange(object.metadata.uid, '{QUARTERS[k]}', '{QUARTERS[k + 1]}')"
        assert part["metadata"]["shardInfo"] == {"selector": canonical}
        assert all(hashed(uids[n]) * 4 // 2**64 == k for n in names(part))
        seen += names(part)
    assert sorted(seen) == sorted(uids)
    # Ranges joined by ||: a union, echoed joined by " || ".
    union = f"{LOW} || shardRange(object.metadata.uid, '{HALF}', '0x10000000000000000')"
    both = await listed(http, url, shardSelector=union)
    assert names(both) == sorted(uids) and both["metadata"]["shardInfo"] == {"selector": union}


async def test_a_namespace_range_selects_whole_namespaces(
    http: aiohttp.ClientSession, kube: Any, unique: Callable[[str], str]
) -> None:
    spaces = [unique("shards") for _ in range(6)]
    for space in spaces:
        body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": space}}
        async with http.post("/api/v1/namespaces", json=body) as response:
            assert response.status == 201, await response.text()
        await config_maps(http, space, 2, "cm")
    low = f"shardRange(object.metadata.namespace, '0x0000000000000000', '{HALF}')"
    document = await listed(http, "/api/v1/configmaps", shardSelector=low)
    found = {item["metadata"]["namespace"] for item in document["items"]} & set(spaces)
    assert found == {s for s in spaces if hashed(s) < 2**63}
    assert document["metadata"]["shardInfo"] == {"selector": low}


async def test_custom_resources_are_filtered_but_their_lists_carry_no_shard_info(
    http: aiohttp.ClientSession, widgets: Widgets
) -> None:
    uids = {}
    for i in range(8):
        async with http.post(widgets.url, json=widgets.body(f"w-{i}", size=i + 1)) as response:
            assert response.status == 201, await response.text()
            uids[f"w-{i}"] = (await response.json())["metadata"]["uid"]
    low = await listed(http, widgets.url, shardSelector=LOW)
    assert names(low) == sorted(n for n, u in uids.items() if hashed(u) < 2**63)
    # Filtered, but not said: v1.37's lists of custom resources (unstructured) carry no
    # shardInfo, so a client cannot tell this list from an unfiltered one by its metadata.
    assert "shardInfo" not in low["metadata"]


async def test_a_watch_sends_only_the_objects_of_its_range(
    http: aiohttp.ClientSession, kube_namespace: str
) -> None:
    url = f"/api/v1/namespaces/{kube_namespace}/configmaps"
    start = (await listed(http, url))["metadata"]["resourceVersion"]
    uids = await config_maps(http, kube_namespace, 12, "w")
    expected = sorted(n for n, u in uids.items() if hashed(u) < 2**63)
    params = {"watch": "true", "resourceVersion": start, "shardSelector": LOW}
    received: list[str] = []
    async with asyncio.timeout(10), http.get(url, params=params) as response:
        assert response.status == 200
        async for line in response.content:
            if line.strip():
                event = json.loads(line)
                assert event["type"] == "ADDED", event
                received.append(event["object"]["metadata"]["name"])
                if len(received) == len(expected):
                    break
    assert sorted(received) == expected


async def test_a_bad_selector_is_refused_with_the_reason(
    http: aiohttp.ClientSession, kube_namespace: str
) -> None:
    url = f"/api/v1/namespaces/{kube_namespace}/configmaps"
    uid = "object.metadata.uid"
    refused = {
        " ": "empty shard selector is not allowed; omit the parameter for unfiltered lists",
        f"shardRange({uid}, '0x0', '{HALF}')": "hexStart must be a 0x-prefixed 16-digit hex "
        'value, got "0x0" (did you mean "0x0000000000000000"?)',
        f"shardRange(object.metadata.name, '0x0000000000000000', '{HALF}')": (
            'unsupported field path "object.metadata.name"; supported: object.metadata.uid, '
            "object.metadata.namespace"
        ),
        f"shardRange({uid}, '{HALF}', '0x0000000000000000')": (
            f"shard range start {HALF} must be less than end 0x0000000000000000"
        ),
        f"{LOW} || shardRange(object.metadata.namespace, '0x0000000000000000', '{HALF}')": (
            'all shard ranges must use the same field, got "object.metadata.uid" and '
            '"object.metadata.namespace"'
        ),
        f"shardRange({uid}, '0X0000000000000000', '{HALF}')": (
            "hexStart must have '0x' prefix, got \"0X0000000000000000\""
        ),
        f"shardRange({uid}, '0x0000000000000000')": "shardRange() requires exactly 3 arguments, "
        "got 2",
        f"{LOW} && {LOW}": 'unsupported function "_&&_"; only shardRange() and || are allowed',
    }
    for selector, reason in refused.items():
        for watch in ("false", "true"):
            params = {"shardSelector": selector, "watch": watch}
            async with http.get(url, params=params) as response:
                status = await response.json()
            assert response.status == 500, (selector, status)
            assert status["message"] == f"invalid shard selector: {reason}", status
            assert status.get("reason", "") == "" and status["code"] == 500


async def test_the_library_selectors_select_what_its_ranges_assign(
    http: aiohttp.ClientSession, kube_namespace: str
) -> None:
    # kopf_reconcile.sharding writes selectors in the server's canonical form (its echo is
    # the same string) and assigns each value to the range the server selects it in.
    uids = await config_maps(http, kube_namespace, 16, "lib")
    url = f"/api/v1/namespaces/{kube_namespace}/configmaps"
    for shards in (1, 3, 4, 7):
        for k in range(shards):
            selector = shard_selector(UID_FIELD, [hash_range(k, shards)])
            document = await listed(http, url, shardSelector=selector)
            assert document["metadata"]["shardInfo"] == {"selector": selector}
            assert names(document) == sorted(n for n, u in uids.items() if range_of(u, shards) == k)
