"""Who was inside a reconcile of which entity, from the replicas' own reports.

Each replica process reports every reconcile it starts and ends (see
:mod:`.replica`), stamped with ``time.monotonic()``. :func:`spans` turns that
into one span per reconcile; :func:`overlaps` finds two processes inside one
reconciler's (one shard's) reconcile of one entity at once: the overlap a
hand-off that releases a shard under running reconciles, or two holders of one
shard, would produce, even where each leadership report looks clean.

A span's effective end is its leadership's (:func:`.leadership.effective_end`):
a process paused inside a reconcile for at least the renew deadline is inside
nothing from one renew deadline after the pause began (its own lease checks
fail from then on; fencing, checked separately, stops its writes). A process
killed inside a reconcile is inside nothing from the SIGKILL on.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable

from kopf_reconcile.testing.chaos.leadership import ProcessHistory, effective_end, read_events

__all__ = ["Span", "overlaps", "spans"]


@dataclasses.dataclass(frozen=True)
class Span:
    """One reconcile of ``entity`` by ``reconciler`` in one process (monotonic seconds)."""

    replica: str
    reconciler: str
    entity: str
    start: float
    end: float  # math.inf: still inside when the analysis ran
    effective_end: float


def spans(history: ProcessHistory, renew_deadline: float, grace: float) -> list[Span]:
    """Every reconcile one process reported, each with its effective end."""
    path = history.events.with_name(history.events.name + ".spans")
    end_of_process = history.killed_at if history.killed_at is not None else math.inf
    found: list[Span] = []
    open_at: dict[tuple[str, str], float] = {}

    def close(key: tuple[str, str], start: float, end: float) -> None:
        effective = effective_end(start, end, history.pauses, renew_deadline, grace)
        found.append(Span(history.replica, key[0], key[1], start, end, effective))

    for event in read_events(path):
        key = (str(event.get("reconciler")), str(event.get("entity")))
        if event["event"] == "enter":
            if key in open_at:  # never expected: one Loop runs one reconcile of an entity
                close(key, open_at[key], float(event["t"]))
            open_at[key] = float(event["t"])
        elif event["event"] == "exit" and key in open_at:
            close(key, open_at.pop(key), float(event["t"]))
    for key, start in open_at.items():
        close(key, start, end_of_process)
    return found


def overlaps(items: Iterable[Span], origin: float) -> list[str]:
    """Two processes inside one reconciler's reconcile of one entity at once, in words."""
    by_entity: dict[tuple[str, str], list[Span]] = defaultdict(list)
    for span in items:
        if span.effective_end > span.start:
            by_entity[(span.reconciler, span.entity)].append(span)
    found = []
    for (reconciler, entity), group in sorted(by_entity.items()):
        group.sort(key=lambda s: s.start)
        for i, first in enumerate(group):
            for second in group[i + 1 :]:
                if second.start >= first.effective_end:
                    break
                if second.replica != first.replica:
                    found.append(
                        f"{first.replica} and {second.replica} both inside {reconciler} of "
                        f"{entity} at {second.start - origin:.2f}s"
                    )
    return found
