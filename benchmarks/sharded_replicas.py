"""Sharded replicas: each operator replica's memory and list CPU, 4 shards by namespace with
one replica each, against one unsharded replica.

A reconciler sharded by namespace watches only the shards its replica leads (the kopf shim
sends a KEP-5866 ``shardSelector`` of their namespace ranges). This runs real
``kopf-reconcile run`` replicas (:class:`~kopf_reconcile.testing.OperatorProcess`, PostgreSQL
leases) of a reconciler that does nothing, on the real kube-apiserver v1.37 tier, over
``--objects`` ConfigMaps (about 1 KB each) spread evenly over 4 namespaces, one per shard,
each replica watching every namespace (``--all-namespaces``: one stream, one list), on a
fresh API server per size:

* unsharded: one replica reconciles (and caches) every object (the baseline);
* shard k of 4: the other three shard leases are held elsewhere (as by three other
  replicas), so the replica leads shard k alone, lists it, and caches its objects;
* empty: the same replicas before the objects exist, whose figures are subtracted from the
  others' (a replica's own startup: Python, kopf, the shim; one unsharded, one leading one
  shard of four, through the same leadership steps).

Each figure is taken once the replica's probe shows it leads what it should and caches every
object of it, and its listing has ended: its peak RSS (``VmHWM``, from ``/proc``; less the
empty replica's) and the CPU seconds its listings took (the shim logs each listing's objects,
wall and CPU seconds); each is the median of ``--runs`` replicas (3) run one after another.
Both run with the ``ShardedListAndWatch`` gate on (the server filters) and off (the server
sends everything; the replica drops the other shards' objects itself). Target: with the
gate, every shard's replica at most 1/4 + 10 % of the unsharded one (ratio <=
0.35) in RSS and list CPU; without it, reported. A ``RESULT`` line per figure is read by
``scripts/bench.py``.

    python benchmarks/sharded_replicas.py [--objects 10000 30000] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import re
import secrets
import statistics
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.leader.postgres import PostgresLeaseElector
from kopf_reconcile.sharding import ShardAssignment, shard_id
from kopf_reconcile.testing import OperatorProcess, eventually, install_fence
from kopf_reconcile.testing.postgres import EmbeddedPostgres
from kopf_reconcile.testing.real_apiserver import RealCluster
from results import result

SHARDS = 4
ASSIGNMENT = ShardAssignment(SHARDS, by_namespace=True)
HANDLERS = Path(__file__).parent / "operators" / "namespace_sharded.py"
PAYLOAD = "x" * 900  # about 1 KB per object, as a small custom resource with a status


def shard_namespaces(prefix: str) -> list[str]:
    """One namespace per shard, ``<prefix>-<i>`` (``namespaces[k]`` is in shard ``k``)."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < SHARDS:
        found.setdefault(ASSIGNMENT.shard_of(f"{prefix}-{i}/x"), f"{prefix}-{i}")
        i += 1
    return [found[k] for k in range(SHARDS)]


def peak_rss(pid: int) -> int:
    """Peak RSS (``VmHWM``, KiB) of process ``pid``."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


# What the shim logs at the end of each listing of a watch stream.
LISTED = re.compile(r"listed configmaps: [0-9,]+ objects in [0-9.]+ s, ([0-9.]+) s of CPU")


async def fill(cluster: Any, namespaces: list[str], objects: int) -> None:
    async with cluster.http_session() as http:
        semaphore = asyncio.Semaphore(32)

        async def create(i: int) -> None:
            namespace = namespaces[i % len(namespaces)]
            body = {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": f"cm-{i:06d}"},
                "data": {"payload": PAYLOAD, "index": str(i)},
            }
            url = f"/api/v1/namespaces/{namespace}/configmaps"
            async with semaphore, http.post(url, json=body) as r:
                if r.status != 201:
                    raise RuntimeError(await r.text())

        for namespace in namespaces:
            body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
            async with http.post("/api/v1/namespaces", json=body) as r:
                if r.status != 201:
                    raise RuntimeError(await r.text())
        await asyncio.gather(*(create(i) for i in range(objects)))


async def counts(cluster: Any) -> tuple[int, list[int]]:
    """How many ConfigMaps the cluster holds, in all and per shard (the API server keeps one
    or two of its own in kube-system)."""
    async with cluster.http_session() as http, http.get("/api/v1/configmaps") as r:
        items = (await r.json())["items"]
    per_shard = [0] * SHARDS
    for item in items:
        per_shard[ASSIGNMENT.shard_of(f"{item['metadata']['namespace']}/x")] += 1
    return len(items), per_shard


async def replica(
    cluster: Any, postgres: EmbeddedPostgres, *, shards: int, lead: int | None, expected: int
) -> tuple[int, float]:
    """Run one replica until it leads ``lead`` (every shard when None) and caches
    ``expected`` objects; its figures then. Each has a database of its own: the leases
    and epochs of the replicas before it would make its lease listings longer."""
    rid = f"bench-{secrets.token_hex(3)}"
    dsn = await postgres.create_database()
    async with PostgresFencedRepository(dsn) as repository:
        await repository.migrate()
    elsewhere = PostgresLeaseElector(dsn, holder_id="another-replica", ttl=600)
    try:
        if lead is not None:  # the other shards are led by other replicas
            for k in range(shards):
                if k != lead:
                    await elsewhere.acquire_lease(shard_id(rid, k))
        env = {
            "BENCH_RECONCILER_ID": rid,
            "BENCH_SHARDS": str(shards),
            "KOPF_RECONCILE_LEADER": "postgres",
            "KOPF_RECONCILE_API_FENCE": "off",
        }
        operator = OperatorProcess(
            HANDLERS, kubeconfig=cluster.kubeconfig, database_url=dsn, namespace=None, env=env
        )
        async with operator, aiohttp.ClientSession() as http:

            async def settled() -> bool:
                async with http.get(f"{operator.url}/healthz") as r:
                    report = json.loads(await r.text())["reconcilers"].get(rid, {})
                led = sorted(int(k) for k in report.get("shards", {}))
                wanted = led == [lead] if lead is not None else report.get("leader") is True
                listed = LISTED.search(operator.output) is not None  # its listing ended
                return bool(wanted and listed and report.get("cached_objects") == expected)

            await eventually(settled, timeout=300, message=f"replica {rid} settled")
            assert operator.pid is not None
            peak = peak_rss(operator.pid)
            # Every listing it made until then (a narrowed replica lists once it leads).
            listings = [m.group(0) for m in LISTED.finditer(operator.output)]
            print(f"    {rid} (lead {lead}): " + "; ".join(listings), flush=True)
            cpu = sum(float(m.group(1)) for m in LISTED.finditer(operator.output))
            return peak, cpu
    finally:
        await elsewhere.close()


async def median_of(
    runs: int, measure: Callable[[], Awaitable[tuple[int, float]]]
) -> tuple[int, float]:
    """The median peak RSS and the median CPU seconds of ``runs`` replicas run one by one."""
    figures = [await measure() for _ in range(runs)]
    return (
        int(statistics.median(f[0] for f in figures)),
        float(statistics.median(f[1] for f in figures)),
    )


async def measure_size(gate: bool, size: int, runs: int, postgres: EmbeddedPostgres) -> None:
    flags: list[str] | None = (
        None if gate else []
    )  # the tests' gates, or the server's defaults (gate off)
    async with RealCluster(feature_flags=flags) as cluster:
        async with cluster.http_session() as http:
            await install_fence(http, "default")
        # The empty replicas go through the same startup and leadership as the others.
        total, per_shard = await counts(cluster)
        empty_sharded = await median_of(
            runs, lambda: replica(cluster, postgres, shards=SHARDS, lead=0, expected=per_shard[0])
        )
        empty_unsharded = await median_of(
            runs, lambda: replica(cluster, postgres, shards=1, lead=None, expected=total)
        )
        await fill(cluster, shard_namespaces("bench"), size)
        total, per_shard = await counts(cluster)
        unsharded = await median_of(
            runs, lambda: replica(cluster, postgres, shards=1, lead=None, expected=total)
        )
        sharded = [
            await median_of(
                runs,
                functools.partial(
                    replica, cluster, postgres, shards=SHARDS, lead=k, expected=per_shard[k]
                ),
            )
            for k in range(SHARDS)
        ]
    report(gate, size, (empty_unsharded, unsharded), (empty_sharded, sharded))


def report(
    gate: bool,
    size: int,
    unsharded: tuple[tuple[int, float], tuple[int, float]],
    sharded: tuple[tuple[int, float], list[tuple[int, float]]],
) -> None:
    mode = "server-side selection (gate on)" if gate else "the server not filtering (gate off)"
    print(
        f"sharded replicas: {size:,} ConfigMaps (~1 KB) in 4 namespaces, 4 shards by "
        f"namespace, replicas watching all namespaces, {mode}"
    )
    (empty, whole), (empty_shard, parts) = unsharded, sharded
    for name, (rss, _) in (("unsharded", empty), ("one-shard", empty_shard)):
        print(f"  empty {name} replica: peak RSS {rss:,} KiB (subtracted)")

    def growth(figures: tuple[int, float], base: tuple[int, float]) -> tuple[int, float]:
        return max(0, figures[0] - base[0]), figures[1]  # the listings' CPU is its own

    baseline = growth(whole, empty)
    ours = [growth(part, empty_shard) for part in parts]
    print(f"  unsharded replica  RSS +{baseline[0]:,} KiB, list CPU {baseline[1]:.2f} s")
    for k, (rss, cpu) in enumerate(ours):
        print(f"  shard {k} replica    RSS +{rss:,} KiB, list CPU {cpu:.2f} s")
    figure = f"({size:,} objects, 4 shards by namespace, {mode}, real tier)"
    target = ("<=", 0.35) if gate else None
    for index, name, unit in ((0, "peak RSS growth", "KiB"), (1, "list CPU", "s")):
        result(
            "sharded_replicas",
            f"{name} per operator replica, the largest of 4 one-shard replicas vs an "
            f"unsharded replica {figure}",
            ours=[float(max(g[index] for g in ours))],
            baseline=[float(baseline[index])],
            unit=unit,
            ratio="ours/baseline",
            target=target,
        )


async def measure(sizes: list[int], runs: int) -> None:
    async with EmbeddedPostgres() as postgres:
        for gate in (True, False):
            for size in sizes:
                await measure_size(gate, size, runs, postgres)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, nargs="+", default=[10_000, 30_000])
    parser.add_argument("--runs", type=int, default=3, help="replicas per figure (medians)")
    args = parser.parse_args()
    asyncio.run(measure(args.objects, args.runs))


if __name__ == "__main__":
    main()
