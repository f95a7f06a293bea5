"""``kopf-reconcile demo``: the whole story (what ``make demo`` runs) on an embedded cluster
and an embedded PostgreSQL; the demo is loaded inside the command only."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["add_parser"]


def add_parser(commands: Any) -> None:
    """``demo``, on the CLI's subcommands."""
    demo = commands.add_parser(
        "demo",
        help="the whole story on an embedded cluster and an embedded PostgreSQL",
        description=(
            "Start an embedded Kubernetes API, an embedded PostgreSQL and REPLICAS processes of "
            "the example operator; create Devices; SIGKILL the leader; SIGSTOP the next one past "
            "its lease and resume it; verify that every Device converged with no stale write "
            "accepted and no update lost. Exits 0 only if every invariant held."
        ),
    )
    demo.add_argument("--objects", type=int, default=200, help="Devices to create (default 200)")
    demo.add_argument(
        "--replicas", type=int, default=3, help="operator processes (>= 3, default 3)"
    )
    demo.add_argument("--ttl", type=int, default=3, help="lease TTL in seconds (default 3)")
    demo.add_argument(
        "--work-delay", type=float, default=0.2,
        help="simulated device I/O per reconcile, seconds (default 0.2)",
    )  # fmt: skip
    demo.add_argument("--handlers", type=Path, help="default: operator/examples/devices.py")
    demo.add_argument(
        "--shards", type=int, default=1,
        help="shard the Devices (default 1: one leader); with N > 1 the replicas share N "
        "shards and a SIGKILL moves only the killed replica's",
    )  # fmt: skip
    demo.add_argument(
        "--keep", action="store_true", help="keep the temporary directory (logs, kubeconfig)"
    )
    demo.set_defaults(command=_demo)


def _demo(args: argparse.Namespace) -> int:
    from kopf_reconcile import demo

    options = demo.Options(
        objects=args.objects,
        replicas=args.replicas,
        keep=args.keep,
        ttl=args.ttl,
        work_delay=args.work_delay,
        handlers=args.handlers,
        shards=args.shards,
    )
    return demo.run(options)


# -- run ---------------------------------------------------------------------------------
