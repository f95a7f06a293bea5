"""The epochs an elector must never go below: those it saw, and those anyone used.

A lease store's epoch counter can be lost (a Kubernetes Lease deleted and
recreated restarts ``leaseTransitions``; a lease row can be deleted). A new
counter must start above every epoch already handed out, or a paused former
leader would pass the fence again. :class:`EpochMemory` keeps the highest
epoch this process saw per lease, and asks an optional *floor* source — the
fenced store's ``highest_epoch``, which the Loop registers and keeps current
by recording each epoch before it leads — for the highest any process used.

Floors are per reconciler id: one elector may serve several Loops, each with
its own fenced scope, and a Loop that stops removes only its own source.
"""

from __future__ import annotations

from kopf_reconcile.api import ConfigError
from kopf_reconcile.leader.protocol import EpochFloor

__all__ = ["EpochFloor", "EpochMemory"]


class EpochMemory:
    """Highest epochs known per reconciler id; computes the epoch of a change of holder."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}
        self._floors: dict[str, EpochFloor] = {}

    def use_floor(self, reconciler_id: str, source: EpochFloor) -> None:
        if not isinstance(reconciler_id, str) or not reconciler_id:
            raise ConfigError(f"reconciler_id must be a non-empty string, got {reconciler_id!r}")
        if not callable(source):
            raise ConfigError(f"the epoch floor source must be an async callable, got {source!r}")
        current = self._floors.get(reconciler_id)
        if current is not None and current != source:
            raise ConfigError(
                f"reconciler {reconciler_id!r} already has an epoch floor source ({current!r}); "
                f"two Loops with one reconciler id cannot share an elector"
            )
        self._floors[reconciler_id] = source

    def drop_floor(self, reconciler_id: str, source: EpochFloor) -> None:
        if self._floors.get(reconciler_id) == source:
            del self._floors[reconciler_id]

    def saw(self, reconciler_id: str, epoch: int) -> None:
        self._seen[reconciler_id] = max(self._seen.get(reconciler_id, 0), epoch)

    def forget_seen(self, reconciler_id: str) -> None:
        """Forget the epochs seen for one lease (its floor stays): see the Kubernetes elector."""
        self._seen.pop(reconciler_id, None)

    async def next_epoch(
        self, reconciler_id: str, current: int = 0, *, with_seen: bool = True
    ) -> int:
        """One above ``current``, every epoch seen here (unless not ``with_seen``) and the floor.

        The floor is awaited now. If its source fails, this raises: acquiring
        fails (the Loop retries) rather than risking an epoch already used.
        """
        seen = self._seen.get(reconciler_id, 0) if with_seen else 0
        floor = 0
        source = self._floors.get(reconciler_id)
        if source is not None:
            floor = await source()
            if isinstance(floor, bool) or not isinstance(floor, int):
                raise TypeError(f"the epoch floor source returned {floor!r}, not an int")
        return max(current, seen, floor) + 1
