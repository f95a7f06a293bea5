"""``python -m kopf_reconcile.testing.chaos``: process chaos for one or both electors.

Exit status 0 when every invariant held in every run, 1 when one broke (the
summary says which, with the seed that replays the schedule), 2 when the run
could not be set up.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from kopf_reconcile.testing.chaos.harness import ELECTORS, TIERS, ChaosError, Options, run
from kopf_reconcile.testing.real_apiserver import RealClusterError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kopf_reconcile.testing.chaos", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--seed", type=int, default=1, help="the nemesis' schedule (default 1)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of chaos per elector")
    parser.add_argument("--replicas", type=int, default=3, help="operator processes (default 3)")
    parser.add_argument(
        "--elector", choices=[*ELECTORS, "both"], default="both", help="lease store (default both)"
    )
    parser.add_argument(
        "--tier",
        choices=TIERS,
        default="embedded",
        help="the embedded API server (default), or the real kube-apiserver with etcd",
    )
    parser.add_argument("--devices", type=int, default=200, help="Devices (default 200)")
    parser.add_argument(
        "--rate", type=float, default=10.0, help="spec changes per second (default 10)"
    )
    parser.add_argument(
        "--shards",
        type=int,
        default=1,
        help="shards of the Devices (default 1: unsharded); > 1 adds joins and leaves",
    )
    parser.add_argument(
        "--by-namespace",
        action="store_true",
        help="with --shards: the Devices in one namespace per shard, sharded by namespace "
        "(each replica watches only the shards it leads)",
    )
    parser.add_argument("--ttl", type=int, default=3, help="lease TTL, whole seconds (default 3)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory and logs")
    parser.add_argument("--handlers", type=Path, help="the operator (default: the example)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    electors = ELECTORS if args.elector == "both" else (args.elector,)
    reports = []
    for elector in electors:
        options = Options(
            seed=args.seed,
            duration=args.duration,
            replicas=args.replicas,
            elector=elector,
            tier=args.tier,
            devices=args.devices,
            changes_per_second=args.rate,
            ttl=args.ttl,
            renew_interval=round(args.ttl / 10, 3),
            keep=args.keep,
            handlers=args.handlers,
            shards=args.shards,
            by_namespace=args.by_namespace,
        )
        try:
            report = asyncio.run(run(options, out=lambda line: print(line, flush=True)))
        except (ChaosError, RealClusterError) as exc:
            print(f"chaos: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # everything it started is stopped by then
            print("chaos: interrupted", file=sys.stderr)
            return 130
        print()
        print(report.table(), flush=True)
        print()
        reports.append(report)
    for report in reports:
        if not report.ok():
            o = report.options
            print(
                f"invariant broken with {o.elector} leases: replay the schedule with "
                f"--seed {o.seed} --elector {o.elector} --tier {o.tier}"
                + (f" --shards {o.shards}" if o.shards > 1 else "")
                + (" --by-namespace" if o.by_namespace else "")
            )
    return 0 if all(r.ok() for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
