"""Shards by namespace as ``kopf-reconcile run`` replicas see them, on both API tiers.

A reconciler in 4 shards by namespace ranges; the ConfigMaps live in 4 namespaces, one per
shard. One replica leads every shard and holds every object. A second replica joins:
the shards are shared, and each replica's cache holds the objects of the shards it leads
and no others (its watch carries only those, selected by the API server: no object of
another shard ever reached it). The second replica is SIGKILLed; an object of its shards
changes and another is created while no replica watches them; the first replica takes
its shards over, lists them, and reconciles both.

Without the ``ShardedListAndWatch`` gate the server sends every object: the replicas drop
the other shards' objects themselves (and say so once), and hold the same.

With ``watch_all_shards=True`` every replica holds every object, as when unsharded; with a
plain kopf handler of the resource too, the watch is not narrowed and everything is
reconciled all the same.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from operator_e2e import MERGE, OPERATORS, Operator, Operators

from kopf_reconcile.sharding import ShardAssignment
from kopf_reconcile.testing import install_fence
from kopf_reconcile.testing.real_apiserver import RealCluster
from support import eventually, start_tier

pytestmark = pytest.mark.slow

HANDLERS = OPERATORS / "namespace_sharded.py"
SHARDS = ShardAssignment(4, by_namespace=True)
PER_NAMESPACE = 3


async def shard_namespaces(http: aiohttp.ClientSession, prefix: str) -> list[str]:
    """One new namespace per shard (``namespaces[k]`` falls in shard ``k``)."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < SHARDS.shards:
        name = f"{prefix}-{i}"
        found.setdefault(SHARDS.shard_of(f"{name}/x"), name)
        i += 1
    namespaces = [found[k] for k in range(SHARDS.shards)]
    for name in namespaces:
        body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
        async with http.post("/api/v1/namespaces", json=body) as response:
            assert response.status == 201, await response.text()
    return namespaces


async def create(http: aiohttp.ClientSession, namespace: str, name: str) -> str:
    body = {"metadata": {"name": name, "labels": {"app": "ns-sharded"}}, "data": {"v": "1"}}
    async with http.post(f"/api/v1/namespaces/{namespace}/configmaps", json=body) as response:
        assert response.status == 201, await response.text()
    return f"{namespace}/{name}"


async def shard_objects(
    http: aiohttp.ClientSession, prefix: str, per_namespace: int
) -> tuple[list[str], list[str]]:
    """A namespace per shard (:func:`shard_namespaces`) with ``per_namespace`` ConfigMaps
    ``cm-<i>`` each: the namespaces and the objects' entity ids."""
    namespaces = await shard_namespaces(http, prefix)
    entities = [
        await create(http, ns, f"cm-{i}") for ns in namespaces for i in range(per_namespace)
    ]
    return namespaces, entities


async def report(operator: Operator, rid: str) -> dict[str, Any]:
    status, text = await operator.get("/healthz")
    assert status == 200, text
    found: dict[str, Any] = json.loads(text)["reconcilers"].get(rid, {})
    return found


async def start(
    operators: Operators, namespaces: list[str], env: dict[str, str], name: str
) -> Operator:
    flags = [f"--namespace={namespace}" for namespace in namespaces]
    return await operators.start(*flags, handlers=HANDLERS, env=env, name=name)


@pytest.fixture
def env(embedded_postgres_dsn: str) -> dict[str, str]:
    return {
        "KOPF_RECONCILE_DATABASE_URL": embedded_postgres_dsn,
        "KOPF_RECONCILE_LEADER": "postgres",
        "KOPF_RECONCILE_LEASE_TTL": "2",
        "KOPF_RECONCILE_RENEW_INTERVAL": "0.3",
        "SHARDED_RECONCILER_ID": f"ns-sharded-{secrets.token_hex(3)}",
    }


async def test_each_replica_watches_only_the_shards_it_leads(
    operators: Operators, http: aiohttp.ClientSession, kube_namespace: str, env: dict[str, str]
) -> None:
    await shards_follow_leadership(operators, http, kube_namespace, env, server_filters=True)


@pytest_asyncio.fixture
async def gate_off() -> AsyncIterator[RealCluster]:
    """A real API server without the gate (its defaults), with the fence installed as the
    chart does. (The embedded API without the gate is the unit tests' scripted server.)"""
    cluster = await start_tier(
        RealCluster(feature_flags=[]),
        "real kube-apiserver tier without feature gates",
        "KOPF_RECONCILE_SKIP_REAL_APISERVER",
    )
    try:
        async with cluster.http_session() as http:
            await install_fence(http, "default")
        yield cluster
    finally:
        await cluster.stop()


@pytest.mark.real_apiserver
async def test_without_the_gate_each_replica_filters_its_shards_itself(
    gate_off: RealCluster, env: dict[str, str]
) -> None:
    operators = Operators(gate_off.kubeconfig, "default")
    try:
        async with gate_off.http_session() as http:
            prefix = f"test-{secrets.token_hex(4)}"
            await shards_follow_leadership(operators, http, prefix, env, server_filters=False)
    finally:
        await operators.stop_all()


async def shards_follow_leadership(
    operators: Operators,
    http: aiohttp.ClientSession,
    prefix: str,
    env: dict[str, str],
    *,
    server_filters: bool,
) -> None:
    rid = env["SHARDED_RECONCILER_ID"]
    namespaces, entities = await shard_objects(http, prefix, PER_NAMESPACE)
    first = await start(operators, namespaces, env, "first")

    async def holds(operator: Operator, shards: int, objects: int) -> bool:
        found = await report(operator, rid)
        return len(found.get("shards", {})) == shards and found.get("cached_objects") == objects

    await eventually(lambda: holds(first, 4, len(entities)), timeout=60, message="one leads all")
    for entity in entities:
        await first.printed(f"reconcile {entity} live", timeout=30)

    second = await start(operators, namespaces, env, "second")

    async def shared() -> bool:
        a, b = await report(first, rid), await report(second, rid)
        led = [sorted(int(k) for k in r.get("shards", {})) for r in (a, b)]
        return (
            len(led[0]) == len(led[1]) == 2
            # Each holds exactly its own shards' objects: nothing of the others' shards.
            and a.get("cached_objects") == PER_NAMESPACE * 2
            and b.get("cached_objects") == PER_NAMESPACE * 2
        )

    await eventually(shared, timeout=90, message="two shards each, each cache its own")
    theirs = sorted(int(k) for k in (await report(second, rid))["shards"])
    said = [bool(operator.lines("does not filter by shard")) for operator in (first, second)]
    if server_filters:  # no object of another shard ever came
        assert not any(said), first.text + second.text
    else:
        assert all(said), first.text + second.text

    second.kill()
    await second.stop()
    changed = f"{namespaces[theirs[0]]}/cm-0"
    before = len(first.lines(f"reconcile {changed} live"))
    path = f"/api/v1/namespaces/{namespaces[theirs[0]]}/configmaps/cm-0"
    async with http.patch(path, json={"data": {"v": "2"}}, headers=MERGE) as response:
        assert response.status == 200, await response.text()
    created = await create(http, namespaces[theirs[1]], "born-unwatched")

    await eventually(
        lambda: holds(first, 4, len(entities) + 1), timeout=60, message="taken over, listed"
    )
    await first.printed(f"reconcile {created} live", timeout=30)
    await eventually(
        lambda: len(first.lines(f"reconcile {changed} live")) > before,
        timeout=30,
        message="the change made while nobody watched, reconciled",
    )
    assert not first.lines(" gone"), first.text  # nothing unlisted was taken for deleted


@pytest.mark.parametrize("kube", ["embedded"], indirect=True)
async def test_with_watch_all_shards_every_replica_holds_every_object(
    operators: Operators, http: aiohttp.ClientSession, kube_namespace: str, env: dict[str, str]
) -> None:
    rid = env["SHARDED_RECONCILER_ID"]
    namespaces, entities = await shard_objects(http, kube_namespace, 2)
    env = {**env, "WATCH_ALL_SHARDS": "1"}
    replicas = [await start(operators, namespaces, env, name) for name in ("first", "second")]

    async def all_held() -> bool:
        found = [await report(r, rid) for r in replicas]
        return sum(len(f.get("shards", {})) for f in found) == 4 and all(
            f.get("cached_objects") == len(entities) for f in found
        )

    await eventually(all_held, timeout=90, message="every replica holds every object")


@pytest.mark.parametrize("kube", ["embedded"], indirect=True)
async def test_with_another_kopf_handler_the_watch_is_whole_and_everything_reconciled(
    operators: Operators, http: aiohttp.ClientSession, kube_namespace: str, env: dict[str, str]
) -> None:
    rid = env["SHARDED_RECONCILER_ID"]
    namespaces, entities = await shard_objects(http, kube_namespace, 1)
    operator = await start(operators, namespaces, {**env, "ALSO_KOPF_HANDLER": "1"}, "first")

    async def leads_and_holds() -> bool:
        found = await report(operator, rid)
        return len(found.get("shards", {})) == 4 and found.get("cached_objects") == 4

    await eventually(leads_and_holds, timeout=60, message="leads every shard, holds all")
    await operator.printed("audit ", timeout=30)  # kopf's own handler saw the objects
    for entity in entities:
        await operator.printed(f"reconcile {entity} live", timeout=30)
    assert not operator.lines("carries shards"), operator.text  # never narrowed
