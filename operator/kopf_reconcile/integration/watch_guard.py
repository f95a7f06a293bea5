"""A leader whose watch stays broken hands its leases to a replica that can see.

A leader reconciles from its cache, and its cache from its watches: when a watch
is forbidden or failing, the leader keeps its lease and works from a stale view
while ``/readyz`` says 503. :class:`BrokenWatchGuard` follows the watch probe:

* once the watch has been broken for ``bound`` seconds (one lease TTL: the time a
  failover would take anyway), every Loop of this replica stands aside for
  ``hold_off`` seconds (one TTL plus one renew interval): a leader steps down
  and releases its lease once its reconciles ended, and no Loop tries to acquire
  one, so any healthy candidate, which tries every renew interval, takes it;
* after the hold-off this replica may acquire again: if it then leads, no healthy
  candidate wanted the lease (it is the only candidate, or every candidate is
  broken), and leading from a stale view beats not leading at all. It keeps the
  lease until its watch has recovered and broken anew: no step-down every TTL.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Protocol

__all__ = ["BrokenWatchGuard", "Candidate"]

logger = logging.getLogger("kopf_reconcile.watch_guard")

#: Seconds between two looks at the watch probe.
CHECK_INTERVAL = 1.0


class Candidate(Protocol):
    """What may lead: a Loop (or a ShardedLoop, for each shard)."""

    def stand_aside(self, reason: str, seconds: float) -> None: ...


class BrokenWatchGuard:
    """Makes this replica's Loops stand aside once ``problem()`` stayed set for ``bound``."""

    def __init__(
        self,
        problem: Callable[[], str | None],
        candidates: Callable[[], Iterable[Candidate]],
        *,
        bound: float,
        hold_off: float,
    ) -> None:
        self._problem = problem
        self._candidates = candidates
        self._bound = bound
        self._hold_off = hold_off
        self._broken_since: float | None = None
        self._stood_aside = False

    def check(self, now: float) -> None:
        """Look at the watch probe at ``now`` (a monotonic clock) and act on it."""
        problem = self._problem()
        if problem is None:
            self._broken_since = None
            self._stood_aside = False
            return
        if self._broken_since is None:
            self._broken_since = now
        if self._stood_aside or now - self._broken_since < self._bound:
            return
        self._stood_aside = True
        reason = f"the watch stayed broken for {self._bound:g}s ({problem})"
        candidates = list(self._candidates())
        if candidates:
            logger.warning(
                "standing aside for %gs so that a replica whose watch works leads: %s",
                self._hold_off,
                reason,
            )
        for candidate in candidates:
            candidate.stand_aside(reason, self._hold_off)

    async def run(self) -> None:
        """Check every CHECK_INTERVAL seconds until cancelled."""
        clock = asyncio.get_running_loop().time
        while True:
            self.check(clock())
            await asyncio.sleep(CHECK_INTERVAL)
