"""``kopf-reconcile demo``: the whole story on an embedded cluster and an embedded PostgreSQL.

Three replicas of the example operator run as separate processes; the demo
creates Devices, kills the leader, pauses the next one past its lease and
resumes it, and checks that every Device converged with no stale write
accepted and no update lost (see :mod:`kopf_reconcile.demo.story`). With
``--shards N`` the replicas share N shards instead, and the SIGKILL of one moves
only its shards (see :mod:`kopf_reconcile.demo.sharded`). It exits 0 only if
every invariant held, and cleans up every process and temporary directory, also
on failure or Ctrl-C.
"""

from __future__ import annotations

import asyncio
import sys

from kopf_reconcile.api import ConfigError
from kopf_reconcile.demo import sharded
from kopf_reconcile.demo.stack import DemoError
from kopf_reconcile.demo.story import Demo, Options
from kopf_reconcile.demo.view import View

__all__ = ["Options", "run"]


def run(options: Options) -> int:
    """Run the demo; returns the process exit code."""
    view = View(sharded=options.shards > 1)
    try:
        demo = sharded.ShardedDemo(options, view) if options.shards > 1 else Demo(options, view)
    except ConfigError as exc:
        print(f"kopf-reconcile demo: {exc}", file=sys.stderr)
        return 2
    shards = f", {options.shards} shards" if options.shards > 1 else ""
    view.note(
        f"kopf-reconcile demo: {options.objects} Devices, {options.replicas} replicas{shards} "
        f"(workdir {demo.stack.workdir})"
    )
    try:
        summary = asyncio.run(demo.run())
    except KeyboardInterrupt:
        view.note("interrupted: every process and temporary directory was cleaned up")
        return 130
    except DemoError as exc:
        view.note(f"FAILED: {exc}")
        return 1
    view.block("Summary", demo.summary_lines(summary))
    return 0 if demo.ok() else 1
