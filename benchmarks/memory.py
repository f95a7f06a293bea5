"""Memory of per-entity state: 100,000 entities in backoff, then after they all succeed.

A Loop's per-entity state must be bounded by the live entities and vanish
after success. This measures the Python heap (tracemalloc) and the process
RSS at three points of one run: an idle Loop, 100k entities failing and
waiting in backoff, and after every entity succeeded (without a default
requeue, so nothing should stay behind). The baseline is the cost of the
100k entity-id strings alone, held in a dict, measured in the same run.

    python benchmarks/memory.py [--entities N]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import tracemalloc
from pathlib import Path

import kopf_reconcile as kr
from results import result

PAGE = 4096


def rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


def heap() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


async def measure(n: int) -> dict[str, tuple[int, int]]:
    failing = True
    done = 0
    finished = asyncio.Event()

    async def reconcile(req: kr.Request) -> None:
        nonlocal done
        if failing:
            raise RuntimeError("transient")
        done += 1
        if done == n:
            finished.set()

    loop = (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_concurrency(8)
        .with_backoff(3600, 3600)  # failed entities wait in backoff for the whole measurement
        .without_default_requeue()
        .build()
    )
    points: dict[str, tuple[int, int]] = {}
    ids = [f"default/device-{i:06d}" for i in range(n)]  # before the first point: not counted
    async with loop:
        points["idle loop"] = (heap(), rss())
        for entity in ids:
            await loop.enqueue(kr.Request(entity))
        while loop._queue.work_queue.delayed_count < n:  # noqa: ASYNC110 - polling the loop's state
            await asyncio.sleep(0.05)
        points[f"{n:,} in backoff"] = (heap(), rss())
        failing = False
        for entity in ids:  # a fresh trigger runs at once, superseding the backoff
            await loop.enqueue(kr.Request(entity))
        await finished.wait()
        while loop.stats().in_flight:  # noqa: ASYNC110 - polling the loop's state
            await asyncio.sleep(0.01)
        points["after success"] = (heap(), rss())
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entities", type=int, default=100_000)
    args = parser.parse_args()
    n = args.entities
    logging.getLogger("kopf_reconcile.loop").disabled = True  # 100k error lines are noise here
    tracemalloc.start()
    before = heap()
    baseline_ids = {f"default/device-{i:06d}": None for i in range(n)}
    id_cost = heap() - before
    del baseline_ids
    points = asyncio.run(measure(n))
    idle_heap = points["idle loop"][0]
    print(f"memory: {n:,} entities; baseline: their ids in a dict = {id_cost / n:.0f} B/entity")
    print(f"{'point':>20}  {'heap MiB':>9}  {'heap B/entity':>13}  {'x ids':>6}  {'RSS MiB':>8}")
    for name, (h, r) in points.items():
        per = (h - idle_heap) / n
        print(f"{name:>20}  {h / 2**20:>9.1f}  {per:>13.0f}  {per / id_cost * n:>5.1f}x"
              f"  {r / 2**20:>8.1f}")  # fmt: skip
    backoff_per = (points[f"{n:,} in backoff"][0] - idle_heap) / n
    after_per = (points["after success"][0] - idle_heap) / n
    print(
        f"summary: {backoff_per:.0f} B/entity in backoff ({backoff_per / id_cost * n:.1f}x the "
        f"ids alone); {after_per:.1f} B/entity left after success (RSS does not shrink: freed "
        "memory stays with the allocator)"
    )
    for figure, value, target in (
        (f"heap per entity, {n:,} entities in backoff, vs their ids alone", backoff_per, None),
        (f"heap per entity left after {n:,} entities succeeded, vs their ids", after_per, 0.05),
    ):
        result(
            "memory",
            figure,
            ours=[value],
            baseline=[id_cost / n],
            unit="B",
            ratio="ours/baseline",
            target=None if target is None else ("<=", target),
        )


if __name__ == "__main__":
    main()
