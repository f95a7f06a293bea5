"""The epochs an elector must never go below: those it saw, and those anyone used.

A lease store's epoch counter can be lost (a Kubernetes Lease deleted and
recreated restarts ``leaseTransitions``; a lease row can be deleted). A new
counter must start above every epoch already handed out, or a paused former
leader would pass the fence again. :class:`EpochMemory` keeps the highest
epoch this process saw per lease, and asks an optional *floor* source — the
fenced store's ``highest_epoch``, which the Loop registers and keeps current
by recording each epoch before it leads — for the highest any process used.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from kopf_reconcile.config import ConfigError

#: An async source of the highest epoch ever used (e.g. a fenced store's ``highest_epoch``).
EpochFloor = Callable[[], Awaitable[int]]


class EpochMemory:
    """Highest epochs known per reconciler id; computes the epoch of a change of holder."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}
        self._floor: EpochFloor | None = None

    def use_floor(self, source: EpochFloor) -> None:
        if not callable(source):
            raise ConfigError(f"the epoch floor source must be an async callable, got {source!r}")
        self._floor = source

    def saw(self, reconciler_id: str, epoch: int) -> None:
        self._seen[reconciler_id] = max(self._seen.get(reconciler_id, 0), epoch)

    async def next_epoch(self, reconciler_id: str, current: int = 0) -> int:
        """One above ``current``, every epoch seen here and the floor (awaited now).

        If the floor source fails, this raises: acquiring fails (the Loop retries)
        rather than risking an epoch already used.
        """
        floor = 0
        if self._floor is not None:
            floor = await self._floor()
            if isinstance(floor, bool) or not isinstance(floor, int):
                raise TypeError(f"the epoch floor source returned {floor!r}, not an int")
        return max(current, self._seen.get(reconciler_id, 0), floor) + 1
