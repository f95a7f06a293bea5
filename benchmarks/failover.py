"""Failover time: from losing the leader to the first reconcile by the new one.

For each elector — Kubernetes Leases on the embedded cluster (run as a process of
its own) and PostgreSQL rows on an embedded PostgreSQL — and for each run, two
replica processes (``tests/reliability/replica.py``) contend for one lease:

* SIGKILL: the leader is killed at a random point of its renewal cycle; measured
  until the other replica starts its first reconcile. Nothing can detect a dead
  leader before its lease lapses, so the baseline is the TTL itself: the ratio to
  the TTL is printed, and the goal is at most TTL + one acquire retry period.
* graceful stop: a fresh replica joins as the follower, the leader gets SIGTERM
  (its Loop stops and releases the lease); measured until the follower starts its
  first reconcile. Goal: under 1 s, whatever the TTL.
* graceful stop at the default settings (TTL 15 s, renew every 2 s), measured the
  same way with two fresh replicas per run, the stop falling at a random point of
  the follower's retry cycle. Without a wake-up on release the follower would
  only notice at its next retry (up to 2.4 s); the goal is under 1 s.

Times are ``time.monotonic()`` stamps, shared by all processes on the machine.
Run: ``.venv/bin/python benchmarks/failover.py [--runs N] [--ttl S] [--renew S]
[--default-runs N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from results import result

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reliability"))

from fleet import ELECTORS, Event, Replica, first_event, lease_store, replicas

from kopf_reconcile.control.holding import ACQUIRE_RETRY_JITTER
from kopf_reconcile.leader.timing import DEFAULT_LEASE_TTL, DEFAULT_RETRY_PERIOD

STARTUP = 30.0
RELEASE_GOAL = 1.0


def is_reconcile_after(moment: float) -> Callable[[Event], bool]:
    return lambda event: event["event"] == "reconcile" and event["t"] > moment


async def one_run(
    store: list[str], options: list[str], ttl: float, renew: float, rng: random.Random
) -> tuple[float, float]:
    """Seconds to the new leader's first reconcile: after a SIGKILL, after a graceful stop."""
    async with replicas(store, 2, *options) as group:
        leader, _ = await first_event(group, lambda e: e["event"] == "leader", STARTUP)
        await leader.wait_for(lambda e: e["event"] == "reconcile", STARTUP)
        [follower] = [replica for replica in group if replica is not leader]
        await asyncio.sleep(rng.uniform(2 * renew, 3 * renew))  # a random renewal phase
        killed_at = time.monotonic()
        await leader.kill()
        took_over = await follower.wait_for(is_reconcile_after(killed_at), 3 * ttl + STARTUP)
        after_kill = took_over["t"] - killed_at

        newcomer = await Replica.start("newcomer", store, *options)
        try:
            await newcomer.wait_for(lambda e: e["event"] == "follower", STARTUP)
            await asyncio.sleep(2 * renew)
            stopped_at = time.monotonic()
            follower.signal(signal.SIGTERM)
            took_over = await newcomer.wait_for(is_reconcile_after(stopped_at), 3 * ttl + STARTUP)
            after_stop = took_over["t"] - stopped_at
        finally:
            await newcomer.kill()
    return after_kill, after_stop


async def graceful_run(store: list[str], ttl: float, renew: float, rng: random.Random) -> float:
    """Seconds from SIGTERM to the leader until the follower's first reconcile."""
    options = ["--ttl", str(ttl), "--renew", str(renew), "--no-work"]
    async with replicas(store, 2, *options) as group:
        leader, _ = await first_event(group, lambda e: e["event"] == "leader", STARTUP)
        await leader.wait_for(lambda e: e["event"] == "reconcile", STARTUP)
        [follower] = [replica for replica in group if replica is not leader]
        # Anywhere in the follower's retry cycle (its first attempt came at start-up).
        await asyncio.sleep(rng.uniform(renew, 2 * renew * ACQUIRE_RETRY_JITTER))
        stopped_at = time.monotonic()
        leader.signal(signal.SIGTERM)
        took_over = await follower.wait_for(is_reconcile_after(stopped_at), 3 * ttl + STARTUP)
        return float(took_over["t"] - stopped_at)


def summary(label: str, times: list[float], ttl: float, goal: float, elector: str = "") -> str:
    """The printed line; also a ``RESULT`` line for scripts/bench.py (the TTL as baseline)."""
    result(
        "failover",
        f"{elector}: {label} to the first reconcile of the new leader, TTL {ttl:g}s",
        ours=times,
        baseline=[ttl],
        unit="s",
        ratio="ours/baseline",
        target=("<=", goal),
        target_applies_to="ours_max",
    )
    median, worst = statistics.median(times), max(times)
    verdict = "goal met" if worst <= goal else "GOAL MISSED"
    return (
        f"  {label:<15} median {median:6.3f}s  max {worst:6.3f}s  "
        f"median/TTL {median / ttl:5.2f}  max/TTL {worst / ttl:5.2f}  "
        f"(goal <= {goal:.2f}s: {verdict})"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--ttl", type=float, default=2.0, help="lease TTL (whole seconds)")
    parser.add_argument("--renew", type=float, default=0.2, help="renew interval in seconds")
    parser.add_argument("--electors", default=",".join(ELECTORS))
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--default-runs",
        type=int,
        default=5,
        help="graceful handovers per elector at the default TTL and renew interval (0: none)",
    )
    args = parser.parse_args()
    rng = random.Random(args.seed)
    options = ["--ttl", str(args.ttl), "--renew", str(args.renew), "--no-work"]
    retry = args.renew * ACQUIRE_RETRY_JITTER
    print(
        f"failover: {args.runs} runs per elector, TTL {args.ttl}s, renew every {args.renew}s "
        f"(acquire retry up to {retry:.2f}s); baseline: the TTL"
    )
    for elector in args.electors.split(","):
        kills, stops = [], []
        async with lease_store(elector) as store:
            for _ in range(args.runs):
                after_kill, after_stop = await one_run(store, options, args.ttl, args.renew, rng)
                kills.append(after_kill)
                stops.append(after_stop)
        print(f"{elector}:")
        print(summary("SIGKILL", kills, args.ttl, args.ttl + retry, elector))
        print(summary("graceful stop", stops, args.ttl, RELEASE_GOAL, elector))
    if args.default_runs <= 0:
        return
    ttl, renew = DEFAULT_LEASE_TTL.seconds, DEFAULT_RETRY_PERIOD
    print(
        f"graceful stop at the defaults: {args.default_runs} runs per elector, TTL {ttl:g}s, "
        f"renew every {renew:g}s (acquire retry up to {renew * ACQUIRE_RETRY_JITTER:.2f}s)"
    )
    for elector in args.electors.split(","):
        async with lease_store(elector) as store:
            times = [await graceful_run(store, ttl, renew, rng) for _ in range(args.default_runs)]
        print(f"{elector}:")
        print(summary("graceful stop at the defaults", times, ttl, RELEASE_GOAL, elector))


if __name__ == "__main__":
    asyncio.run(main())
