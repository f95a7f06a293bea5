"""Explore many seeded schedules: ``python -m kopf_reconcile.testing.simulation --seeds N``.

Prints a progress line now and then, every broken run with its seed and
schedule, and a summary; exits 1 when any invariant broke.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

from kopf_reconcile.testing.simulation import simulate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kopf_reconcile.testing.simulation")
    parser.add_argument("--seeds", type=int, default=1000, help="how many schedules")
    parser.add_argument("--start", type=int, default=0, help="the first seed")
    parser.add_argument("--stop-at-first", action="store_true", help="stop at the first break")
    args = parser.parse_args(argv)
    started = time.monotonic()
    broken: collections.Counter[str] = collections.Counter()
    writes = leaderships = 0
    virtual = 0.0
    for done, seed in enumerate(range(args.start, args.start + args.seeds), start=1):
        outcome = simulate(seed)
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
        f"{elapsed:.1f}s; {virtual:.0f} virtual seconds; {writes} writes applied; "
        f"{leaderships} leaderships; broken: {dict(broken) or 'none'}"
    )
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
