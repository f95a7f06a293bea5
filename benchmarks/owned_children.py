"""Owned-resource watches: what 10,000 children cost, next to the owners' own events.

A reconciler with ``owns=`` caches its children (with the cache transform) and turns each
child event into a request for its owner. This feeds, in process and without a cluster,
``--children`` child ConfigMaps (each with a controller owner reference to one of
``--owners`` Websites, one listing event each, as a watch's initial listing delivers
them) through the shim's :class:`~kopf_reconcile.integration.related.RelatedObjects` into
a running Loop with a no-op reconciler, and compares it with the baseline: the same
number of events of the reconciled resource itself (``ObjectCache.update``), also into a
Loop. Figures: CPU seconds per event until the Loop is idle, and heap bytes per cached
object. A second line: ``--children`` other ConfigMaps without the children's label cost
neither memory nor requests. A final ``RESULT`` line is read by ``scripts/bench.py``.

    python benchmarks/owned_children.py [--children N] [--owners N]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time
import tracemalloc
from typing import Any

import kopf_reconcile as kr
from kopf_reconcile.cache import ObjectCache
from kopf_reconcile.integration.related import RelatedObjects, parse_related
from results import result

LABELS = {"app.kubernetes.io/managed-by": "websites"}
CHILDREN = ("", "configmaps")


def website(i: int) -> dict[str, Any]:
    return {
        "apiVersion": "example.com/v1",
        "kind": "Website",
        "metadata": {
            "name": f"site-{i:05d}",
            "namespace": "default",
            "uid": f"6f1c2a9e-0000-4000-8000-{i:012d}",
            "resourceVersion": str(100_000 + i),
            "generation": 1,
            "creationTimestamp": "2026-12-01T04:00:00Z",
        },
        "spec": {"content": f"<h1>site {i}</h1>"},
    }


def page(i: int, owner: int, labels: dict[str, str]) -> str:
    body = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": f"page-{i:05d}",
            "namespace": "default",
            "uid": f"0c5e7d1a-0000-4000-8000-{i:012d}",
            "resourceVersion": str(200_000 + i),
            "creationTimestamp": "2026-12-01T04:00:00Z",
            "labels": labels,
            "ownerReferences": [
                {
                    "apiVersion": "example.com/v1",
                    "kind": "Website",
                    "name": f"site-{owner:05d}",
                    "uid": f"6f1c2a9e-0000-4000-8000-{owner:012d}",
                    "controller": True,
                }
            ],
        },
        "data": {"index.html": f"<h1>site {owner}</h1>"},
    }
    return json.dumps(body)


async def noop(req: kr.Request) -> None:
    return None


async def run(
    children: int, owners: int, *, as_children: bool, labels: dict[str, str]
) -> tuple[float, float]:
    """CPU seconds per event until the Loop is idle, and heap bytes per cached object."""
    cache = ObjectCache()
    related = RelatedObjects(
        parse_related(
            [kr.Owns("", "v1", "configmaps", labels=LABELS)], None, ("example.com", "websites")
        ),
        None,
    )
    loop = (
        kr.Builder(noop, kr.Tenancy.TENANT_SCOPED).with_trigger(cache).with_concurrency(8).build()
    )
    async with loop:
        for i in range(owners):
            await cache.update(f"default/site-{i:05d}", website(i))
        await idle(loop)
        texts = [page(i, i % owners, labels) for i in range(children)]
        gc.collect()
        memory = tracemalloc.get_traced_memory()[0]
        started = time.process_time()
        for i, text in enumerate(texts):
            body = json.loads(text)
            if as_children:
                await related.on_event(CHILDREN, {"type": None, "object": body}, cache)
            else:  # the baseline: as many events of the reconciled resource itself
                await cache.update(f"default/page-{i:05d}", body)
        await idle(loop)
        cpu = time.process_time() - started
        del texts
        gc.collect()
        held = max(0, tracemalloc.get_traced_memory()[0] - memory)  # (never below: noise)
    return cpu / children, held / children


async def idle(loop: kr.Loop) -> None:
    """Until nothing is queued or running (the Loop's figures: polled, it has no event)."""
    while True:
        stats = loop.stats()
        if not stats.queued and not stats.in_flight:
            return
        await asyncio.sleep(0.001)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--children", type=int, default=10_000)
    parser.add_argument("--owners", type=int, default=1_000)
    args = parser.parse_args()
    n, owners = args.children, args.owners
    tracemalloc.start()
    own_cpu, own_bytes = asyncio.run(run(n, owners, as_children=False, labels=LABELS))
    child_cpu, child_bytes = asyncio.run(run(n, owners, as_children=True, labels=LABELS))
    other_cpu, other_bytes = asyncio.run(run(n, owners, as_children=True, labels={}))
    print(f"owned-resource watches: {n:,} child ConfigMaps of {owners:,} Websites (one event each)")
    for what, cpu, held in (
        ("the reconciled resource's own events", own_cpu, own_bytes),
        ("child events (owns=)", child_cpu, child_bytes),
        ("other ConfigMaps (label not matching)", other_cpu, other_bytes),
    ):
        print(f"  {what:<38} {cpu * 1e6:>8.1f} us/event {held:>7,.0f} B/object")
    ratio = child_cpu / own_cpu
    print(f"summary: a child event costs {ratio:.2f}x an event of the reconciled resource")
    result(
        "owned_children",
        f"CPU per child event until reconciled, owns= vs the reconciled resource's own events "
        f"({n:,} children of {owners:,} owners)",
        ours=[child_cpu * 1e6],
        baseline=[own_cpu * 1e6],
        unit="us",
        ratio="ours/baseline",
        target=None,
        extra={
            "child_bytes": child_bytes,
            "own_bytes": own_bytes,
            "unselected_us": other_cpu * 1e6,
            "unselected_bytes": other_bytes,
        },
    )


if __name__ == "__main__":
    main()
