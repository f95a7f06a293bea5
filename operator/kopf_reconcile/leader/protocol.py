"""The leader-election seam: what a Loop needs from a lease store.

Leader election is *not* fencing. A lease narrows the window in which two
replicas both believe they lead (one dispatcher in steady state, in-flight
work cancelled the instant the lease is lost), but a process paused past its
TTL can still wake up and act. Cross-replica correctness comes from the
monotonic :attr:`LeaseToken.epoch`, fed into every fenced write and checked by
the database (see :mod:`kopf_reconcile.fencing`).

Adapters implement :class:`LeaderElector`; the Loop depends only on this module.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Protocol, runtime_checkable

from kopf_reconcile.config import ConfigError, Duration, seconds


class LeaseError(Exception):
    """Base class of lease failures."""


class LeaseContended(LeaseError):
    """Another holder owns a live lease; acquisition failed (retry later).

    ``retry_after``, when the elector knows it, is how many seconds remain until
    the lease expires unless renewed: the next attempt is worth making then, not
    a whole retry period later.
    """

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class LeaseLost(LeaseError):
    """This holder no longer owns the lease (expired, released or taken over)."""


@dataclasses.dataclass(frozen=True)
class LeaseToken:
    """Proof of leadership minted by an elector and threaded back into renew/release.

    ``epoch`` is the monotonic fencing token: the store increments it on every
    change of holder and keeps it across renewals.
    """

    reconciler_id: str
    holder_id: str
    epoch: int
    acquired_at: datetime.datetime
    expires_at: datetime.datetime


@dataclasses.dataclass(frozen=True, init=False)
class LeaseTTL:
    """A validated lease window; sub-millisecond values are rejected.

    Lease stores carry the window in whole milliseconds (or seconds); a finer
    value would truncate to 0 and yield a lease that expires as it is written,
    letting every replica lead at once.
    """

    seconds: float

    def __init__(self, value: Duration) -> None:
        ttl = seconds("lease ttl", value)
        if ttl < 0.001:
            raise ConfigError(f"lease ttl must be >= 0.001 seconds (1 ms), got {value!r}")
        object.__setattr__(self, "seconds", ttl)

    @property
    def milliseconds(self) -> int:
        """The window in whole milliseconds (never 0)."""
        return max(1, int(self.seconds * 1000))


@runtime_checkable
class LeaderElector(Protocol):
    """A lease store. One lease per reconciler id; any acquire error is fail-closed."""

    async def acquire_lease(self, reconciler_id: str) -> LeaseToken:
        """Become the holder or raise (:class:`LeaseContended` when another holds it)."""
        ...

    async def renew_lease(self, token: LeaseToken) -> None:
        """Extend the lease, keeping the epoch; :class:`LeaseLost` when not the holder."""
        ...

    async def release_lease(self, token: LeaseToken) -> None:
        """Give the lease up so a peer takes over at once. Idempotent."""
        ...
