"""Explore many seeded schedules: ``python -m kopf_reconcile.testing.simulation --seeds N``.

``--shards K`` runs the writer reconciler in K shards (one lease and fencing scope each,
handed off between replicas as they join, crash and rebalance); ``--replicas R`` sets how
many replicas the nemesis works on.

Prints a progress line now and then, every broken run with its seed and
schedule, and a summary; exits 1 when any invariant broke.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

from kopf_reconcile.testing.simulation import Settings, simulate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kopf_reconcile.testing.simulation")
    parser.add_argument("--seeds", type=int, default=1000, help="how many schedules")
    parser.add_argument("--start", type=int, default=0, help="the first seed")
    parser.add_argument("--stop-at-first", action="store_true", help="stop at the first break")
    parser.add_argument("--shards", type=int, default=1, help="shards of the writer reconciler")
    parser.add_argument("--replicas", type=int, default=Settings.replicas, help="replicas")
    args = parser.parse_args(argv)
    if args.shards < 1 or args.replicas < 1 or args.seeds < 1:
        parser.error("--seeds, --shards and --replicas must be at least 1")
    settings = Settings(shards=args.shards, replicas=args.replicas)
    started = time.monotonic()
    broken: collections.Counter[str] = collections.Counter()
    writes = leaderships = 0
    virtual = 0.0
    for done, seed in enumerate(range(args.start, args.start + args.seeds), start=1):
        outcome = simulate(seed, settings)
        writes += outcome.writes
        leaderships += outcome.leaderships
        virtual += outcome.virtual_seconds
        if not outcome.held:
            print(outcome.report(), flush=True)
            broken.update(violation.split(":")[0] for violation in outcome.violations)
            if args.stop_at_first:
                print(f"broken after {done} schedule(s)")
                return 1
        if done % 500 == 0:
            print(f"  {done}/{args.seeds} schedules, {time.monotonic() - started:.0f}s", flush=True)
    elapsed = time.monotonic() - started
    print(
        f"{args.seeds} schedules (seeds {args.start}..{args.start + args.seeds - 1}) in "
        f"{elapsed:.1f}s; {args.shards} shard(s), {args.replicas} replicas; "
        f"{virtual:.0f} virtual seconds; {writes} writes applied; "
        f"{leaderships} leaderships; broken: {dict(broken) or 'none'}"
    )
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
