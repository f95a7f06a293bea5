"""Without the ``ShardedListAndWatch`` gate (off by default through v1.37), a server ignores
``shardSelector``: it lists and watches everything, answers no ``shardInfo``, and does not
even read the parameter. That is what a client must detect to filter on its own side.

The real tier here is a second kube-apiserver with the tests' feature flags replaced by none
(the server's defaults); the embedded API is started with ``sharded_list_and_watch=False``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from kopf_reconcile.sharding import UID_FIELD, hash_range, shard_selector
from kopf_reconcile.testing import EmbeddedCluster
from kopf_reconcile.testing.real_apiserver import RealCluster
from support import start_tier


@pytest_asyncio.fixture(params=["embedded", pytest.param("real", marks=pytest.mark.real_apiserver)])
async def gate_off(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    if request.param == "embedded":
        async with EmbeddedCluster(sharded_list_and_watch=False) as cluster:
            yield cluster
        return
    cluster = await start_tier(
        RealCluster(feature_flags=[]),
        "real kube-apiserver tier without feature gates",
        "KOPF_RECONCILE_SKIP_REAL_APISERVER",
    )
    try:
        yield cluster
    finally:
        await cluster.stop()


async def test_without_the_gate_the_selector_is_ignored(gate_off: Any) -> None:
    url = "/api/v1/namespaces/default/configmaps"
    async with gate_off.http_session() as http:
        made = []
        for i in range(8):
            body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"cm-{i}"}}
            async with http.post(url, json=body) as response:
                assert response.status == 201, await response.text()
                made.append(f"cm-{i}")
        selector = shard_selector(UID_FIELD, [hash_range(0, 8)])
        for given in (selector, "not a selector at all"):
            async with http.get(url, params={"shardSelector": given}) as response:
                assert response.status == 200, await response.text()
                document = await response.json()
            assert "shardInfo" not in document["metadata"]
            assert made == sorted(
                i["metadata"]["name"] for i in document["items"] if i["metadata"]["name"] in made
            )
        params = {"watch": "true", "shardSelector": selector, "resourceVersion": "0"}
        seen = set()
        async with http.get(url, params=params) as response:
            assert response.status == 200
            async for line in response.content:
                if line.strip():
                    seen.add(json.loads(line)["object"]["metadata"]["name"])
                    if seen >= set(made):
                        break
        assert seen >= set(made)
