"""Takeover with a full cache: a fresh change during a new leader's resync-all.

A Loop fed by an object cache of N objects (10,000 by default) runs the resync-all a new
leader runs: every cached object is reconciled again. Each reconcile reads its object
from the cache and waits 1 ms (its I/O), 8 at a time. Measured in one run, for two
queues:

* **lanes** (this project): the resync's fan-out waits in the resync lane, a watch event
  goes first (at most 8 fresh entities between two resync ones);
* **fifo** (the baseline, one lane as before): the same requests in one FIFO lane, so a
  fresh change waits behind whatever the resync has queued and for room in the intake.

Figures: the latency of a fresh change (from the watch event to the end of its
reconcile) on an idle Loop and during the resync (changes made every 20 ms while it
runs), and the time the resync takes alone and with those changes. Targets (issue 16):
fresh latency during the resync <= 5x its idle latency; the resync with changes within
10 % of its time alone. A final ``RESULT`` line per figure is read by
``scripts/bench.py``. ``--plot PATH`` draws the first run's resync with changes, for
both queues, as a PNG: the queue depth and each fresh change's latency over time
(matplotlib, from the ``bench`` extra).

    python benchmarks/takeover.py [--objects N] [--runs R] [--intake N] [--plot PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

import kopf_reconcile as kr
from kopf_reconcile.api import RESYNC_ALL
from kopf_reconcile.cache import ObjectCache, serving
from kopf_reconcile.triggers import Emit
from results import result

WORK = 0.001  # seconds of simulated I/O per reconcile
CONCURRENCY = 8
CHANGE_EVERY = 0.02  # seconds between two fresh changes during the resync
SAMPLE_EVERY = 0.01  # seconds between two samples of the queue depth (for the plot)
LAST = "bench/fresh-last"  # created after the others: taken once they all were


class Fifo:
    """The baseline: the cache's resync fan-out in the fresh lane (one lane, as before)."""

    def __init__(self, cache: ObjectCache) -> None:
        self.cache = cache

    async def run(self, emit: Emit) -> None:
        async def plain(request: kr.Request) -> None:
            await emit(request)

        await self.cache.run(plain)  # a plain callable: no resync lane to use


def device(name: str, generation: int) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "bench",
            "uid": f"uid-{name}",
            "generation": generation,
            "labels": {"app": "devices"},
        },
        "spec": {"desired": "on", "generation": generation},
    }


@dataclasses.dataclass
class Timeline:
    """One resync with changes, over time (seconds from its start): for the plot."""

    depth: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    latency: list[tuple[float, float]] = dataclasses.field(default_factory=list)


class Bench:
    def __init__(self, objects: int, lanes: bool, intake: int) -> None:
        self.objects = objects
        self.cache = ObjectCache()
        self.waiting: dict[str, asyncio.Future[float]] = {}  # changed entity -> its reconcile
        self.resync_left = 0
        self.resync_done = asyncio.Event()
        self.resyncing = False
        trigger = self.cache if lanes else Fifo(self.cache)
        builder = (
            kr.Builder(self.reconcile, kr.Tenancy.TENANT_SCOPED)
            .with_trigger(trigger)
            .with_concurrency(CONCURRENCY)
            .without_default_requeue()
        )
        if intake:
            builder.with_intake_capacity(intake)
        self.loop = builder.build()
        self.generation = 1

    async def reconcile(self, req: kr.Request) -> None:
        if req.entity_id == RESYNC_ALL:
            self.cache.request_resync()
            return
        with serving(self.cache):
            kr.cached(req)
        await asyncio.sleep(WORK)
        waiter = self.waiting.pop(req.entity_id, None)
        if waiter is not None:
            waiter.set_result(time.perf_counter())
        if self.resyncing and not req.entity_id.startswith("bench/fresh"):
            self.resync_left -= 1
            if self.resync_left <= 0:
                self.resync_done.set()

    async def fill(self) -> None:
        for i in range(self.objects):
            await self.cache.update(f"bench/o{i:05d}", device(f"o{i:05d}", 1))
        settled = self.waiting[LAST] = asyncio.get_running_loop().create_future()
        await self.cache.update(LAST, device(LAST.partition("/")[2], 1))
        await settled  # the last one created is reconciled: the initial listing is done

    async def change(self, i: int) -> float:
        """A fresh change to an object; its latency until reconciled (seconds)."""
        self.generation += 1
        entity = f"bench/fresh{i}"
        done = self.waiting[entity] = asyncio.get_running_loop().create_future()
        started = time.perf_counter()
        await self.cache.update(entity, device(f"fresh{i}", self.generation))
        return await done - started

    async def resync(
        self, with_changes: bool, timeline: Timeline | None = None
    ) -> tuple[float, list[float]]:
        """Run a resync-all; its duration and the latencies of changes made meanwhile."""
        self.resync_left = self.objects
        self.resync_done.clear()
        self.resyncing = True
        latencies: list[float] = []
        started = time.perf_counter()
        await self.loop.enqueue(kr.Request(RESYNC_ALL))

        async def changes() -> None:
            i = 0
            while True:
                await asyncio.sleep(CHANGE_EVERY)
                if self.resync_done.is_set():
                    return
                made = time.perf_counter() - started
                latencies.append(await self.change(i))
                if timeline is not None:
                    timeline.latency.append((made, latencies[-1]))
                i += 1

        async def sample() -> None:
            assert timeline is not None
            while True:
                timeline.depth.append((time.perf_counter() - started, self.loop.stats().queued))
                await asyncio.sleep(SAMPLE_EVERY)

        changing = asyncio.create_task(changes()) if with_changes else None
        sampling = asyncio.create_task(sample()) if timeline is not None else None
        await self.resync_done.wait()
        if sampling is not None:
            sampling.cancel()
        elapsed = time.perf_counter() - started
        self.resyncing = False
        if changing is not None:
            await changing  # a change made during the resync is measured to its end
        return elapsed, latencies


async def one_run(
    objects: int, lanes: bool, intake: int, timeline: Timeline | None = None
) -> dict[str, float]:
    bench = Bench(objects, lanes, intake)
    async with bench.loop:
        await bench.fill()
        idle = [await bench.change(i) for i in range(20)]
        alone, _ = await bench.resync(with_changes=False)
        with_changes, during = await bench.resync(with_changes=True, timeline=timeline)
    return {
        "idle_latency": statistics.median(idle),
        "resync_latency": statistics.median(during),
        "resync_latency_max": max(during),
        "resync_alone": alone,
        "resync_with_changes": with_changes,
    }


def plot(timelines: dict[str, Timeline], objects: int, path: Path) -> None:
    """Queue depth and fresh-change latency during the resync, both queues, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render to the file only
    from matplotlib import pyplot

    figure, (depth_axes, latency_axes) = pyplot.subplots(2, 1, figsize=(8, 6), sharex=True)
    colors = {"lanes": "tab:blue", "fifo": "tab:red"}
    labels = {"lanes": "fresh and resync lanes", "fifo": "one FIFO lane (before)"}
    for name, timeline in timelines.items():
        depth_axes.plot(*zip(*timeline.depth, strict=True), color=colors[name], label=labels[name])
        latency_axes.plot(
            *zip(*((t, latency * 1e3) for t, latency in timeline.latency), strict=True),
            "o",
            markersize=3,
            color=colors[name],
            label=labels[name],
        )
    depth_axes.set_ylabel("queued entities")
    depth_axes.set_title(f"Takeover: resync-all of {objects:,} cached objects with fresh changes")
    depth_axes.legend()
    latency_axes.set_yscale("log")
    latency_axes.set_ylabel("fresh-change latency (ms)")
    latency_axes.set_xlabel("seconds since the resync began (a change: when it was made)")
    latency_axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--intake", type=int, default=0, help="intake capacity (0: the Loop's default, 100,000)"
    )
    parser.add_argument("--plot", type=Path, help="write the first run's timelines as a PNG")
    args = parser.parse_args()
    print(
        f"takeover: {args.objects:,} cached objects, resync-all with {CONCURRENCY} workers, "
        f"{WORK * 1000:g} ms per reconcile, intake {args.intake or 'default'}; a change every "
        f"{CHANGE_EVERY * 1000:g} ms during the resync; {args.runs} runs per queue"
    )
    runs: dict[str, list[dict[str, float]]] = {"lanes": [], "fifo": []}
    timelines = {name: Timeline() for name in runs} if args.plot else {}
    for n in range(args.runs):
        for name, outcomes in runs.items():
            timeline = timelines.get(name) if n == 0 else None
            run = one_run(args.objects, name == "lanes", args.intake, timeline)
            outcomes.append(asyncio.run(run))
    if args.plot:
        plot(timelines, args.objects, args.plot)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    header = (
        "queue",
        "idle ms",
        "during ms",
        "max ms",
        "ratio",
        "alone s",
        "w/ changes s",
        "ratio",
    )
    print("{:>6}  {:>8}  {:>9}  {:>8}  {:>7}  {:>8}  {:>12}  {:>6}".format(*header))
    for name in runs:
        latency_ratio = med(name, "resync_latency") / med(name, "idle_latency")
        slowdown = med(name, "resync_with_changes") / med(name, "resync_alone")
        print(
            f"{name:>6}  {med(name, 'idle_latency') * 1e3:>8.2f}  "
            f"{med(name, 'resync_latency') * 1e3:>9.2f}  "
            f"{med(name, 'resync_latency_max') * 1e3:>8.1f}"
            f"  {latency_ratio:>6.1f}x  {med(name, 'resync_alone'):>8.2f}  "
            f"{med(name, 'resync_with_changes'):>12.2f}  {slowdown:>5.2f}x"
        )
    lanes = runs["lanes"]
    print(
        "summary: with lanes a fresh change during the resync takes "
        f"{med('lanes', 'resync_latency') / med('lanes', 'idle_latency'):.1f}x its idle latency "
        f"(target <= 5x; one lane: "
        f"{med('fifo', 'resync_latency') / med('fifo', 'idle_latency'):.0f}x), and the resync "
        f"takes {med('lanes', 'resync_with_changes') / med('lanes', 'resync_alone'):.2f}x its "
        "time alone (target <= 1.10x)"
    )
    result(
        "takeover",
        "fresh-change latency during a resync-all (lanes) vs on an idle Loop",
        ours=[r["resync_latency"] * 1e3 for r in lanes],
        baseline=[r["idle_latency"] * 1e3 for r in lanes],
        unit="ms",
        ratio="ours/baseline",
        target=("<=", 5.0),
        extra={"one lane (before)": med("fifo", "resync_latency") / med("fifo", "idle_latency")},
    )
    result(
        "takeover",
        "resync-all duration with fresh changes (lanes) vs alone",
        ours=[r["resync_with_changes"] for r in lanes],
        baseline=[r["resync_alone"] for r in lanes],
        unit="s",
        ratio="ours/baseline",
        target=("<=", 1.10),
    )


if __name__ == "__main__":
    main()
