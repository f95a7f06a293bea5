"""What the demo shows: a live view that refreshes in place, or plain lines.

On a terminal the replica table is redrawn in place (ANSI cursor movement);
when stdout is not a terminal (CI, a pipe, a file) the same figures are
printed as plain lines, at most every two seconds and only when they changed.
Notes (a scene's headline, an event) are printed once and stay.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TextIO

from kopf_reconcile.demo.stack import Replica
from kopf_reconcile.integration.tables import format_table

PLAIN_INTERVAL = 2.0
REPLICA_HEADER = ("replica", "pid", "state", "role", "epoch", "reconciled", "accepted", "stale")
SHARDED_HEADER = (*REPLICA_HEADER, "shards held (epoch)")


def held_shards(shards: dict[int, int]) -> str:
    """``0(2) 3(1)``: the shards a replica leads, each with its epoch."""
    return " ".join(f"{k}({epoch})" for k, epoch in sorted(shards.items())) or "-"


def replica_rows(replicas: Sequence[Replica], sharded: bool = False) -> list[tuple[object, ...]]:
    rows: list[tuple[object, ...]] = []
    for r in replicas:
        s = r.last
        role = "LEADER" if s.leader and r.state == "running" else "follower"
        if sharded and s.leader and r.state == "running":
            role = f"leads {len(s.shards)}"
        if r.state != "running":
            role = "-"
        row: tuple[object, ...] = (
            r.name,
            r.pid,
            r.state,
            role,
            s.epoch,
            s.reconciled,
            s.accepted,
            s.stale,
        )
        if sharded:
            row = (*row, held_shards(s.shards) if r.state == "running" else "-")
        rows.append(row)
    return rows


class View:
    """The live block (status line + replica table) and the notes above it."""

    def __init__(self, stream: TextIO | None = None, *, sharded: bool = False) -> None:
        self.stream = stream or sys.stdout
        self.sharded = sharded  # a column of the shards each replica leads
        self.live = self.stream.isatty()
        self.started = time.monotonic()
        self._drawn = 0
        self._last_plain = ""
        self._last_plain_at = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def note(self, text: str) -> None:
        self._erase()
        print(f"[{self.elapsed():5.1f}s] {text}", file=self.stream, flush=True)

    def update(self, status: str, replicas: Sequence[Replica]) -> None:
        if self.live:
            self._erase()
            lines = [f"  {status}", *("  " + line for line in self._table(replicas))]
            print("\n".join(lines), file=self.stream, flush=True)
            self._drawn = len(lines)
            return
        compact = " | ".join(
            f"{r.name} {row[3]} epoch={row[4]} reconciled={row[5]} accepted={row[6]} "
            f"stale={row[7]}" + (f" shards={row[8]}" if self.sharded else "")
            for r, row in zip(replicas, replica_rows(replicas, self.sharded), strict=True)
        )
        text = f"{status} | {compact}"
        now = time.monotonic()
        if text != self._last_plain and now - self._last_plain_at >= PLAIN_INTERVAL:
            print(f"[{self.elapsed():5.1f}s]   {text}", file=self.stream, flush=True)
            self._last_plain, self._last_plain_at = text, now

    def block(self, title: str, lines: Sequence[str]) -> None:
        """A block of text that stays (command output, the summary)."""
        self._erase()
        print(f"\n{title}", file=self.stream)
        for line in lines:
            print(f"  {line}", file=self.stream)
        self.stream.flush()

    def _table(self, replicas: Sequence[Replica]) -> list[str]:
        header = SHARDED_HEADER if self.sharded else REPLICA_HEADER
        return format_table(header, replica_rows(replicas, self.sharded))

    def _erase(self) -> None:
        if self.live and self._drawn:
            self.stream.write(f"\x1b[{self._drawn}F\x1b[J")
            self._drawn = 0
