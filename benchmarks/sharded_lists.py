"""Sharded lists: per-replica memory and list CPU, 4 shards with server-side selection vs one
replica listing everything.

A replica that caches the objects it reconciles holds, after its initial list, every object
the list returned. Without server-side selection every replica of a sharded reconciler lists
(and decodes) every object, however many shards there are; with KEP-5866's sharded list
(kube-apiserver 1.36+, feature gate ``ShardedListAndWatch``) a replica holding one shard of
four asks for a quarter of the hash space, and the server sends only that quarter.

This creates ``--objects`` ConfigMaps (about 1 KB each) on the real kube-apiserver tier
(gate on; the embedded API, which serves the selector too, when the real tier is not built
or with ``--tier embedded``), then
runs one process per "replica", each listing in pages of 500 as kopf does and keeping every
body it keeps as a cache would:

* unsharded: the whole list (the baseline);
* shard k of 4, server-side: ``shardSelector`` of the k-th quarter of the uid hash space
  (:func:`kopf_reconcile.sharding.shard_selector`), the server filtering;
* shard k of 4, client-side (where the server does not filter): the whole list, keeping
  only the objects of its quarter. (``benchmarks/sharded_replicas.py`` measures the same
  for real operator replicas sharded by namespace, whose watches send such selectors.)

Each process reports its RSS growth (peak RSS after the list minus its RSS before) and the
CPU seconds the list took it. Target (issue 29): every server-side replica at most 1/4 + 10 %
of the unsharded one (ratio <= 0.35); the fallback is reported without one. A final
``RESULT`` line per figure is read by ``scripts/bench.py``.

    python benchmarks/sharded_lists.py [--objects N] [--tier auto|real|embedded]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

from kopf_reconcile.sharding import UID_FIELD, hash_range, range_of, shard_selector
from results import result

SHARDS = 4
NAMESPACE = "default"
PAGE = 500
PAYLOAD = "x" * 900  # about 1 KB per object, as a small custom resource with a status


def rss_kib(field: str = "VmRSS") -> int:
    """This process's RSS (``VmHWM``: its peak), KiB. Not ``ru_maxrss``: Linux carries that
    over an exec from the parent, whose RSS would then count as this process's peak."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    return 0


async def replica(url: str, token: str, ca: str, selector: str, keep_range: int) -> None:
    """One replica's initial list; prints its figures as JSON (run in a child process)."""
    import aiohttp

    from kopf_reconcile.testing.real_apiserver import token_http_session

    before = rss_kib()
    started = resource.getrusage(resource.RUSAGE_SELF)
    kept: dict[str, Any] = {}
    session = (
        token_http_session(url, token, Path(ca)) if token else aiohttp.ClientSession(base_url=url)
    )
    shard_info = None
    async with session:
        params = {"limit": str(PAGE)}
        if selector:
            params["shardSelector"] = selector
        while True:
            async with session.get(
                f"/api/v1/namespaces/{NAMESPACE}/configmaps", params=params
            ) as r:
                page = json.loads(await r.read())
            shard_info = page["metadata"].get("shardInfo", shard_info)
            for item in page["items"]:
                uid = item["metadata"]["uid"]
                if keep_range < 0 or range_of(uid, SHARDS) == keep_range:
                    kept[uid] = item
            token_next = page["metadata"].get("continue")
            if not token_next:
                break
            params = {**params, "continue": token_next}
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (used.ru_utime - started.ru_utime) + (used.ru_stime - started.ru_stime)
    peak = rss_kib("VmHWM")
    print(
        json.dumps(
            {
                "kept": len(kept),
                "rss_kib": max(0, peak - before),
                "cpu_s": cpu,
                "filtered_by_server": shard_info is not None,
            }
        )
    )


def run_replica(cluster: Any, selector: str, keep_range: int) -> dict[str, Any]:
    token = getattr(cluster, "admin_token", "")
    ca = str(cluster.ca_file) if token else ""
    argv = [
        sys.executable,
        __file__,
        "--replica",
        cluster.url,
        token,
        ca,
        selector,
        str(keep_range),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=600)
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


async def fill(cluster: Any, objects: int) -> None:
    async with cluster.http_session() as http:
        semaphore = asyncio.Semaphore(32)

        async def create(i: int) -> None:
            body = {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": f"cm-{i:06d}", "labels": {"bench": "sharded-lists"}},
                "data": {"payload": PAYLOAD, "index": str(i)},
            }
            url = f"/api/v1/namespaces/{NAMESPACE}/configmaps"
            async with semaphore, http.post(url, json=body) as r:
                if r.status != 201:
                    raise RuntimeError(await r.text())

        await asyncio.gather(*(create(i) for i in range(objects)))


async def measure(tier: str, objects: int) -> None:
    if tier == "real":
        from kopf_reconcile.testing.real_apiserver import RealCluster

        context: Any = RealCluster()
    else:
        from kopf_reconcile.testing import EmbeddedCluster

        context = EmbeddedCluster()
    async with context as cluster:
        await fill(cluster, objects)
        unsharded = await asyncio.to_thread(run_replica, cluster, "", -1)
        server, client = [], []
        for k in range(SHARDS):
            selector = shard_selector(UID_FIELD, [hash_range(k, SHARDS)])
            server.append(await asyncio.to_thread(run_replica, cluster, selector, -1))
            client.append(await asyncio.to_thread(run_replica, cluster, "", k))
    assert sum(s["kept"] for s in server) == objects == unsharded["kept"]
    assert sum(c["kept"] for c in client) == objects
    print(f"sharded lists: {objects:,} ConfigMaps (~1 KB), {SHARDS} shards, {tier} API server")
    print(
        f"  unsharded replica       RSS +{unsharded['rss_kib']:,} KiB, "
        f"list CPU {unsharded['cpu_s']:.2f} s"
    )
    for k in range(SHARDS):
        s, c = server[k], client[k]
        print(
            f"  shard {k}: server-side   RSS +{s['rss_kib']:,} KiB, list CPU {s['cpu_s']:.2f} s "
            f"({s['kept']:,} objects, shardInfo echoed: {s['filtered_by_server']})"
        )
        print(f"  shard {k}: client-side   RSS +{c['rss_kib']:,} KiB, list CPU {c['cpu_s']:.2f} s")
    figure = f"({objects:,} objects, {SHARDS} shards, {tier} tier)"
    modes: list[tuple[str, list[dict[str, Any]], tuple[str, float] | None]] = [
        ("with server-side selection", server, ("<=", 0.35)),
        ("filtering client-side (where the server does not filter)", client, None),
    ]
    for name, key, unit in (("peak RSS growth", "rss_kib", "KiB"), ("list CPU", "cpu_s", "s")):
        for mode, replicas, target in modes:
            result(
                "sharded_lists",
                f"{name} per replica, the largest of {SHARDS} shards {mode} vs an unsharded "
                f"replica {figure}",
                ours=[float(max(r[key] for r in replicas))],
                baseline=[float(unsharded[key])],
                unit=unit,
                ratio="ours/baseline",
                target=target,
            )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--replica":
        url, token, ca, selector, keep = sys.argv[2:7]
        asyncio.run(replica(url, token, ca, selector, int(keep)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=10_000)
    parser.add_argument(
        "--tier",
        choices=("auto", "real", "embedded"),
        default="auto",
        help="auto: the real tier when its binaries are built, else the embedded API",
    )
    args = parser.parse_args()
    tier = args.tier
    if tier == "auto":
        from kopf_reconcile.testing.real_apiserver import apiserver_binary

        tier = "real" if os.access(apiserver_binary(), os.X_OK) else "embedded"
    asyncio.run(measure(tier, args.objects))


if __name__ == "__main__":
    main()
