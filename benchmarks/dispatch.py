"""Dispatch overhead: the Loop vs a bare asyncio.Queue with N workers (the asyncio limit).

Both sides run a no-op reconcile for 100,000 requests over 10,000 entities,
fed in 10 rounds (each round names every entity once and waits until it is
drained, so neither side can coalesce: both do exactly 100,000 reconciles).
The Loop runs with its defaults (default requeue timer per success, metrics
off; a second row adds metrics). Prints reconciles/s for both and the ratio,
measured in the same run. No target: what a user pays for dispatch is the Loop's share of
the CPU per reconcile of a real operator (``benchmarks/kopf_e2e.py`` samples it: target
under 2 %), reported next to these figures; a pure-Python Loop cannot come near a bare
queue's per-item cost, and a no-op reconcile shows nothing else. A final ``RESULT`` line
per concurrency (every run's rate) is read by ``scripts/bench.py``.

    python benchmarks/dispatch.py [--entities N] [--rounds R] [--repeat K]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import time
from collections.abc import Callable, Coroutine

import prometheus_client

import kopf_reconcile as kr
from results import result


async def bare(entities: list[str], rounds: int, concurrency: int) -> float:
    queue: asyncio.Queue[str] = asyncio.Queue()

    async def noop(entity: str) -> None:
        return None

    async def worker() -> None:
        while True:
            entity = await queue.get()
            await noop(entity)
            queue.task_done()

    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    started = time.perf_counter()
    for _ in range(rounds):
        for entity in entities:
            queue.put_nowait(entity)
        await queue.join()
    elapsed = time.perf_counter() - started
    for task in workers:
        task.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    return len(entities) * rounds / elapsed


async def through_loop(entities: list[str], rounds: int, concurrency: int, metrics: bool) -> float:
    done = 0
    drained = asyncio.Event()
    target = len(entities)

    async def noop(req: kr.Request) -> None:
        nonlocal done
        done += 1
        if done == target:
            drained.set()

    builder = (
        kr.Builder(noop, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_concurrency(concurrency)
    )
    if metrics:
        builder.with_metrics(kr.register_metrics(prometheus_client.CollectorRegistry()))
    loop = builder.build()
    async with loop:
        started = time.perf_counter()
        for _ in range(rounds):
            done = 0
            drained.clear()
            for entity in entities:
                await loop.enqueue(kr.Request(entity))
            await drained.wait()
        elapsed = time.perf_counter() - started
    return len(entities) * rounds / elapsed


def runs_of(
    repeat: int, run: Callable[..., Coroutine[None, None, float]], *args: object
) -> list[float]:
    return [asyncio.run(run(*args)) for _ in range(repeat)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entities", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell; the best counts")
    args = parser.parse_args()
    entities = [f"default/device-{i}" for i in range(args.entities)]
    total = args.entities * args.rounds
    print(f"dispatch: {total:,} no-op reconciles over {args.entities:,} entities")
    print(f"best of {args.repeat} runs per cell; ratio = loop / bare, measured in this run")
    header = ("concurrency", "bare/s", "loop/s", "ratio", "+metrics/s", "ratio")
    print("{:>11}  {:>10}  {:>10}  {:>6}  {:>10}  {:>6}".format(*header))
    ratios: list[float] = []
    figures: list[Callable[[], None]] = []  # printed after the table
    for concurrency in (1, 8, 64):
        base_runs = runs_of(args.repeat, bare, entities, args.rounds, concurrency)
        plain_runs = runs_of(args.repeat, through_loop, entities, args.rounds, concurrency, False)
        metered = max(runs_of(args.repeat, through_loop, entities, args.rounds, concurrency, True))
        base, plain = max(base_runs), max(plain_runs)
        ratios.append(plain / base)
        figures.append(
            functools.partial(
                result,
                "dispatch",
                f"no-op reconciles/s at concurrency {concurrency}, Loop vs bare asyncio.Queue",
                ours=plain_runs,
                baseline=base_runs,
                unit="/s",
                ratio="ours/baseline",
                target=None,
                extra={"with metrics (best run) / bare": metered / base},
            )
        )
        print(
            f"{concurrency:>11}  {base:>10,.0f}  {plain:>10,.0f}  {plain / base:>5.2f}x"
            f"  {metered:>10,.0f}  {metered / base:>5.2f}x"
        )
    print(
        f"summary: worst ratio {min(ratios):.2f}x, median {statistics.median(ratios):.2f}x "
        "(no target: the Loop's share of a real reconcile's CPU is judged in kopf_e2e)"
    )
    for figure in figures:
        figure()


if __name__ == "__main__":
    main()
