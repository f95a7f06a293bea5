"""The leader-election seam: what a Loop needs from a lease store.

Leader election is *not* fencing. A lease narrows the window in which two
replicas both believe they lead (one dispatcher in steady state, in-flight
work cancelled the instant the lease is lost), but a process paused past its
TTL can still wake up and act. Cross-replica correctness comes from the
monotonic :attr:`LeaseToken.epoch`, fed into every fenced write and checked by
the database (see :mod:`kopf_reconcile.fencing`).

Adapters implement :class:`LeaderElector`; the Loop depends only on this module.
Besides the three lease calls, the Loop relies on capabilities an adapter
declares by implementing a protocol below, never on attributes it happens to
find: :class:`ElectorWithTTL` (required: the renew deadline is derived from
the TTL, so a leader steps down before its lease can expire for others),
:class:`FloorAwareElector` (a lease record that can be lost never restarts
its epoch below one already used) and :class:`ReleaseAwareElector`
(followers learn of a release at once instead of at their next retry).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

from kopf_reconcile.api import ConfigError, Duration, seconds


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


class LeaseEpochExhausted(LeaseError):
    """No new epoch fits in the lease store: a record of epochs is at the store's bound.

    Epochs grow by one per change of holder, so no fleet reaches the bound (2**31 - 1
    for a Kubernetes Lease, 2**63 - 1 for a PostgreSQL row) by handovers; a record
    that high was written by hand or restored from elsewhere. No replica can lead
    until it is repaired: the message says which record (the lease, the fenced
    store's epochs) and how.
    """


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


#: The shortest lease TTL: lease stores carry whole milliseconds at least.
MIN_LEASE_TTL = 0.001


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
        if ttl < MIN_LEASE_TTL:
            raise ConfigError(f"lease ttl must be >= {MIN_LEASE_TTL} seconds (1 ms), got {value!r}")
        object.__setattr__(self, "seconds", ttl)

    @property
    def milliseconds(self) -> int:
        """The window in whole milliseconds (never 0)."""
        return max(1, int(self.seconds * 1000))


@dataclasses.dataclass(frozen=True)
class LeaseRecord:
    """One lease as its store shows it, for people and tools (``kopf-reconcile leases``).

    ``holder_id`` is ``""`` for a released lease; ``namespace`` is ``None`` for a store
    without namespaces (a PostgreSQL table). Times are aware datetimes, ``None`` when
    the store does not say (``expires_at`` of a released lease).
    """

    namespace: str | None
    reconciler_id: str
    holder_id: str
    epoch: int
    acquired_at: datetime.datetime | None
    renewed_at: datetime.datetime | None
    expires_at: datetime.datetime | None

    def held_at(self, now: datetime.datetime) -> bool:
        """Whether a holder has it at ``now``: named, and not expired by then (a store that
        gives no expiry is taken at its word)."""
        return bool(self.holder_id) and (self.expires_at is None or self.expires_at > now)


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


@runtime_checkable
class LeaseLister(Protocol):
    """An elector that can show the leases of its store (the CLI's ``leases`` listing)."""

    async def list_leases(self) -> list[LeaseRecord]:
        """Every kopf-reconcile lease of the store this elector uses, sorted."""
        ...


#: An async source of the highest epoch any process used for one reconciler
#: (a fenced store's ``highest_epoch``).
EpochFloor = Callable[[], Awaitable[int]]


@runtime_checkable
class ElectorWithTTL(Protocol):
    """An elector that declares how long its leases last without renewal.

    Required by the Loop: its renew deadline (2/3 of the TTL) must end before
    the lease can expire for the other replicas. A float or a timedelta is
    coerced to :class:`LeaseTTL`.
    """

    @property
    def ttl(self) -> LeaseTTL | float | datetime.timedelta: ...


@runtime_checkable
class FloorAwareElector(Protocol):
    """An elector whose new lease records start above an epoch floor, per reconciler id.

    A lease record can be lost (a Kubernetes Lease deleted, a row deleted); a
    recreated one must not restart its epoch below one already used. The Loop
    registers its fenced store's ``highest_epoch`` for its own reconciler id
    when it starts and removes exactly that registration when it stops, so one
    elector serves any number of Loops.
    """

    def use_epoch_floor(self, reconciler_id: str, source: EpochFloor) -> None:
        """New epochs of ``reconciler_id`` start above ``await source()``."""
        ...

    def drop_epoch_floor(self, reconciler_id: str, source: EpochFloor) -> None:
        """Forget ``source`` for ``reconciler_id`` if it is the one registered."""
        ...


@runtime_checkable
class ReleaseAwareElector(Protocol):
    """An elector that can tell a follower the moment a lease may have become free."""

    async def wait_for_release(self, reconciler_id: str) -> None:
        """Return when the lease of ``reconciler_id`` was released, deleted or changed hands.

        May return early (a spurious wake-up costs one acquire attempt); the
        caller bounds the wait with its own retry period. Errors propagate.
        """
        ...
