"""The invariants of a simulated run, judged from the stores' history and the spans alone.

The checker never reads the implementation's state (a Loop's beliefs, a
holder's epoch): only what the stores recorded, in the order it took effect,
and when each replica was inside a reconcile.

* no write applied below the highest epoch already led in its scope, nor below
  an epoch already applied to its entity;
* no epoch under which two replicas wrote (a lease store may hand one epoch
  to two holders when its record is deleted, but only one may lead with it);
* never two replicas inside a reconcile of one entity at once — except where
  one was paused meanwhile (a pause longer than the lease breaks the clock
  assumption the lease rests on; fencing, checked above, still holds);
* after the nemesis stopped, every entity converged to its last desired value;
* nothing left running after the replicas stopped (tasks, threads).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from kopf_reconcile.testing.simulation.stores import Applied, FenceStore, Led
from kopf_reconcile.testing.simulation.world import WRITER, Span

__all__ = ["check"]


def stale_writes(history: Iterable[Applied | Led]) -> list[str]:
    led: dict[str, int] = defaultdict(int)
    last: dict[tuple[str, str], int] = {}
    found = []
    for event in history:
        if isinstance(event, Led):
            led[event.scope] = max(led[event.scope], event.epoch)
            continue
        key = (event.scope, event.entity_id)
        if event.epoch < led[event.scope] or event.epoch < last.get(key, -1):
            found.append(
                f"t={event.t:.3f}: a write to {event.entity_id} at epoch {event.epoch} was "
                f"applied after {event.scope} was led at {led[event.scope]}"
            )
        last[key] = max(last.get(key, -1), event.epoch)
    return found


def shared_epochs(history: Iterable[Applied | Led]) -> list[str]:
    """Epochs under which two replicas wrote: the split brain fencing cannot see."""
    writers: dict[tuple[str, int], set[str]] = defaultdict(set)
    for event in history:
        if isinstance(event, Applied):
            writers[(event.scope, event.epoch)].add(event.writer)
    return [
        f"epoch {epoch} of {scope} wrote from {sorted(names)}"
        for (scope, epoch), names in writers.items()
        if len(names) > 1
    ]


def overlaps(spans: Iterable[Span], end_of_time: float) -> list[str]:
    by_entity: dict[tuple[str, str], list[Span]] = defaultdict(list)
    for span in spans:
        if not span.exempt:
            by_entity[(span.reconciler, span.entity)].append(span)
    found = []
    for (reconciler, entity), group in by_entity.items():
        group.sort(key=lambda s: s.start)
        for i, first in enumerate(group):
            first_end = end_of_time if first.end is None else first.end
            for second in group[i + 1 :]:
                if second.start >= first_end:
                    break
                if second.replica != first.replica:
                    found.append(
                        f"{first.replica} and {second.replica} were both inside {reconciler} "
                        f"of {entity} at t={second.start:.3f}"
                    )
    return found


def divergent(fence: FenceStore, desired: dict[str, tuple[int, int]]) -> list[str]:
    found = []
    for entity, (version, value) in desired.items():
        state = fence.state_in_any(WRITER, entity)  # its shard's scope when sharded
        if state != {"version": version, "value": value}:
            found.append(f"{entity} ended as {state}, desired version {version} value {value}")
    return found


def check(
    *,
    fence: FenceStore,
    spans: list[Span],
    desired: dict[str, tuple[int, int]],
    end_of_time: float,
    leftovers: list[str],
) -> list[str]:
    """Every invariant broken, in words (empty: the run held)."""
    return [
        *(f"stale write: {v}" for v in stale_writes(fence.history)),
        *(f"shared epoch: {v}" for v in shared_epochs(fence.history)),
        *(f"overlap: {v}" for v in overlaps(spans, end_of_time)),
        *(f"lost update: {v}" for v in divergent(fence, desired)),
        *(f"left running: {v}" for v in leftovers),
    ]
