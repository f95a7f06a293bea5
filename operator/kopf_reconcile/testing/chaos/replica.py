"""An operator replica that also reports its leadership, stamped on the shared monotonic clock.

``python -m kopf_reconcile.testing.chaos.replica EVENTS -- run handlers.py ...`` is
exactly ``kopf-reconcile run handlers.py ...`` (the same ``cli.main``, in the same
process), plus one probe: every time a lease holder of this process starts or
stops leading, one JSON line is appended to ``EVENTS`` and flushed at once::

    {"event": "lead", "t": 1234.5, "pid": 42, "reconciler": "...", "holder": "...", "epoch": 3}
    {"event": "lose", "t": 1236.0, "pid": 42, "reconciler": "...", "holder": "...", "epoch": 3}

A hand-off (a shard given up for balance) is reported to ``EVENTS`` too, when it
begins and when it ends (``handoff`` and ``handed_off``), so the harness can strike
while one is under way. Every reconcile is reported to ``EVENTS.spans``, kept apart
because it grows much faster::

    {"event": "enter", "t": 1235.0, "pid": 42, "reconciler": "...", "entity": "default/d-1"}
    {"event": "exit", "t": 1235.1, "pid": 42, "reconciler": "...", "entity": "default/d-1"}

``t`` is ``time.monotonic()``: ``CLOCK_MONOTONIC`` is one clock for every process
of a machine, so the chaos harness can lay the intervals of all replicas side by
side and count how many believed they led at once. The stamps are conservative:
``lead`` is stamped just *before* the holder starts leading, ``lose`` just *after*
it has given up (a step-down, a stop, an abandoned stop), so a reported interval
always covers the real one; likewise ``enter`` is stamped before the reconcile
starts and ``exit`` after it ended. A process killed while leading writes no
``lose`` (nor ``exit``); the harness ends its interval at the moment it sent the
SIGKILL.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import IO, Any

from kopf_reconcile.api import RESYNC_ALL
from kopf_reconcile.control.holding import LeadershipChange, LeaseHolder
from kopf_reconcile.integration import cli
from kopf_reconcile.loop import Loop

_lock = threading.Lock()


def install_probe(stream: IO[str], spans: IO[str] | None = None) -> None:
    """Report every leadership change of this process's lease holders to ``stream``
    (:meth:`LeaseHolder.observe`).

    With ``spans``, also every reconcile's start and end (one ``Loop._process`` each),
    and hand-offs to ``stream``.
    """

    def emit(event: str, into: IO[str] = stream, **fields: Any) -> None:
        line = json.dumps({"event": event, "t": time.monotonic(), "pid": os.getpid(), **fields})
        with _lock:
            into.write(line + "\n")
            into.flush()

    def report(change: LeadershipChange) -> None:
        if change.leading:
            emit(
                "lead",
                reconciler=change.reconciler_id,
                holder=change.holder_id,
                epoch=change.epoch,
            )
        else:
            emit("lose", reconciler=change.reconciler_id, epoch=change.epoch)

    LeaseHolder.observe(report)
    if spans is not None:
        _probe_reconciles(emit, spans)


def _probe_reconciles(emit: Any, spans: IO[str]) -> None:
    process = Loop._process
    hand_off = Loop.hand_off

    async def probed_process(self: Loop, queue: Any, entity: str, since: float, task: Any) -> None:
        if entity == RESYNC_ALL:  # re-observes everything, reconciles nothing itself
            await process(self, queue, entity, since, task)
            return
        emit("enter", spans, reconciler=self.reconciler_id, entity=entity)
        try:
            await process(self, queue, entity, since, task)
        finally:
            emit("exit", spans, reconciler=self.reconciler_id, entity=entity)

    async def probed_hand_off(self: Loop, grace: float) -> None:
        emit("handoff", reconciler=self.reconciler_id)
        try:
            await hand_off(self, grace)
        finally:
            emit("handed_off", reconciler=self.reconciler_id)

    setattr(Loop, "_process", probed_process)  # noqa: B010
    setattr(Loop, "hand_off", probed_hand_off)  # noqa: B010


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] != "--":
        print("usage: python -m kopf_reconcile.testing.chaos.replica EVENTS -- run ...")
        return 2
    with (
        open(argv[0], "a", encoding="utf-8") as stream,
        open(argv[0] + ".spans", "a", encoding="utf-8") as spans,
    ):
        install_probe(stream, spans)
        return cli.main(argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
