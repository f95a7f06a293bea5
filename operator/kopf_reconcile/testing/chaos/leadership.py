"""How many replicas led one reconciler at once, from their own reports.

Each replica process reports when it starts and stops leading (see
:mod:`.replica`), stamped with ``time.monotonic()``, which all processes of a
machine share; the harness stamps on the same clock when it SIGKILLs, SIGSTOPs
and SIGCONTs a process. :func:`intervals` turns that into one interval per
leadership, :func:`max_overlap` counts the most intervals open at one instant.

Two counts are reported:

*believed*
    every interval as the replica believed it: a process that was SIGSTOPped
    while leading believes it still leads until it runs again and notices its
    renew deadline passed. Two believed leaders at once are expected after
    such a pause (that is the zombie fencing must stop: safety.md, G2).
*effective*
    the same, except that a leadership whose process was paused for at least
    the renew deadline counts as ended one renew deadline after the pause
    began: its last successful renewal was sent before the pause, so from then
    on its own lease checks fail (a worker refuses to start a reconcile past
    the renew deadline, a fenced write past it is refused), whenever it gets to
    notice (or, if the pause came between winning the lease and leading, as
    never having led). Nothing else is excused: a replica partitioned from the
    API, or starved of CPU, must step down on its own clock before another can
    take over (safety.md, G1 and assumption A1). The effective count must never
    exceed 1.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Leadership:
    """One leadership of one process: from ``start`` to ``end`` (monotonic seconds)."""

    replica: str
    pid: int
    holder: str
    epoch: int
    start: float
    end: float  # math.inf: still leading when the analysis ran
    effective_end: float

    def describe(self, origin: float) -> str:
        end = "open" if math.isinf(self.end) else f"{self.end - origin:.2f}s"
        start = f"{self.start - origin:.2f}s"
        return f"{self.replica} (pid {self.pid}) epoch {self.epoch} from {start} to {end}"


@dataclasses.dataclass
class ProcessHistory:
    """What the harness knows of one replica process besides its own reports."""

    replica: str
    events: Path
    pauses: list[tuple[float, float | None]] = dataclasses.field(default_factory=list)
    killed_at: float | None = None  # SIGKILL sent, or the exit noticed
    pid: int = 0


def read_events(path: Path) -> list[dict[str, Any]]:
    """The JSON lines a replica wrote; a line cut short by a SIGKILL is skipped."""
    if not path.exists():
        return []
    events = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def intervals(
    history: ProcessHistory, reconciler: str, renew_deadline: float, grace: float
) -> list[Leadership]:
    """The leaderships of one process for ``reconciler``, each with its effective end.

    ``renew_deadline`` is the Loop's (2/3 of the lease TTL); see :func:`effective_end`.
    """
    result: list[Leadership] = []
    open_lead: dict[str, Any] | None = None
    end_of_process = history.killed_at if history.killed_at is not None else math.inf

    def close(lead: dict[str, Any], end: float) -> None:
        result.append(
            Leadership(
                replica=history.replica,
                pid=int(lead["pid"]),
                holder=str(lead.get("holder", "")),
                epoch=int(lead["epoch"]),
                start=float(lead["t"]),
                end=end,
                effective_end=effective_end(
                    float(lead["t"]), end, history.pauses, renew_deadline, grace
                ),
            )
        )

    for event in read_events(history.events):
        if event.get("reconciler") != reconciler:
            continue
        if event["event"] == "lead":
            if open_lead is not None:  # never expected: a lead without a lose
                close(open_lead, float(event["t"]))
            open_lead = event
        elif event["event"] == "lose" and open_lead is not None:
            close(open_lead, float(event["t"]))
            open_lead = None
    if open_lead is not None:
        close(open_lead, end_of_process)
    return result


def effective_end(
    start: float,
    end: float,
    pauses: Sequence[tuple[float, float | None]],
    renew_deadline: float,
    grace: float,
) -> float:
    """Where a leadership ended for the others, given the pauses of its process.

    A pause of at least ``renew_deadline`` that began while leading ends the
    leadership ``renew_deadline`` after it began, at the latest: the last
    successful renewal was sent before the pause, so from then on the holder's
    own lease checks fail (no reconcile starts, no fenced write goes out),
    whatever it believes after waking and however long the machine takes to
    let it notice. A shorter pause excuses nothing.

    A pause may also have begun before the leadership did: a process stopped
    after the lease store granted it the lease and before it started leading
    wakes up, leads on a lease long expired, and notices at once; a leadership
    that began and ended within ``grace`` seconds after such a pause never led.
    """
    effective = end
    for paused, resumed in sorted(pauses):
        if paused >= effective:
            break
        long_pause = resumed is None or resumed - paused >= renew_deadline
        if not long_pause:
            continue
        if paused >= start:
            effective = min(effective, paused + renew_deadline)
        elif resumed is not None and start - resumed <= grace and end <= resumed + grace:
            effective = start
    return effective


def max_overlap(leaderships: Iterable[Leadership], effective: bool) -> tuple[int, list[Leadership]]:
    """The most leaderships open at one instant, and the ones open then (first such instant)."""
    points: list[tuple[float, int, int]] = []
    items = list(leaderships)
    for index, item in enumerate(items):
        end = item.effective_end if effective else item.end
        if end <= item.start:
            continue
        points.append((item.start, 1, index))
        points.append((end, -1, index))
    # At one instant, ends before starts: touching intervals do not overlap.
    points.sort(key=lambda p: (p[0], p[1]))
    best, current, open_now, witnesses = 0, 0, set[int](), list[Leadership]()
    for _, delta, index in points:
        current += delta
        if delta > 0:
            open_now.add(index)
        else:
            open_now.discard(index)
        if current > best:
            best = current
            witnesses = [items[i] for i in sorted(open_now)]
    return best, witnesses


def epochs_led_twice(leaderships: Iterable[Leadership]) -> dict[int, set[str]]:
    """Epochs that more than one holder reported leading at (must be empty)."""
    holders: dict[int, set[str]] = {}
    for item in leaderships:
        holders.setdefault(item.epoch, set()).add(item.holder or f"pid {item.pid}")
    return {epoch: names for epoch, names in holders.items() if len(names) > 1}
