"""In-process implementations of the lease and fencing protocols, for unit tests.

They follow the same contracts as the PostgreSQL and Kubernetes adapters
(monotonic epochs, compare-and-swap ownership, expiry on a monotonic clock)
but keep their state in one Python object, so several Loops in one event
loop can contend for a lease. Failure injection (``fail_renewals``,
``hang_renewals``) drives the Loop's step-down paths. Use the real adapters
with ``EmbeddedCluster`` / ``EmbeddedPostgres`` for anything that crosses a
process boundary.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import itertools
import time

from kopf_reconcile.fencing.protocol import StaleEpochError
from kopf_reconcile.leader.protocol import LeaseContended, LeaseLost, LeaseToken, LeaseTTL

_holder_ids = itertools.count(1)


@dataclasses.dataclass
class _Lease:
    holder: str = ""
    epoch: int = 0
    expires: float = 0.0  # monotonic


class MemoryLeaseStore:
    """The shared state several :class:`MemoryLeaseElector` instances contend on."""

    def __init__(self) -> None:
        self.leases: dict[str, _Lease] = {}

    def holder(self, reconciler_id: str) -> str | None:
        lease = self.leases.get(reconciler_id)
        if lease is None or not lease.holder or lease.expires <= time.monotonic():
            return None
        return lease.holder

    def expire(self, reconciler_id: str) -> None:
        """Make the current lease lapse at once (as if its holder stopped renewing)."""
        self.leases[reconciler_id].expires = 0.0


class MemoryLeaseElector:
    """A :class:`~kopf_reconcile.LeaderElector` over a :class:`MemoryLeaseStore`."""

    def __init__(
        self, store: MemoryLeaseStore, ttl: LeaseTTL = LeaseTTL(15), holder_id: str | None = None
    ) -> None:
        self.store = store
        self.ttl = ttl
        self.lease_seconds = ttl.seconds  # what the store grants (``ttl`` is what is declared)
        self.holder_id = holder_id or f"memory-{next(_holder_ids)}"
        self.fail_renewals = 0  # the next N renewals raise a transient error
        self.hang_renewals = False  # renewals never answer
        self.releases = 0

    async def acquire_lease(self, reconciler_id: str) -> LeaseToken:
        await asyncio.sleep(0)
        lease = self.store.leases.setdefault(reconciler_id, _Lease())
        now = time.monotonic()
        if lease.holder and lease.holder != self.holder_id and lease.expires > now:
            raise LeaseContended(
                f"lease {reconciler_id} is held by {lease.holder}", retry_after=lease.expires - now
            )
        if lease.holder != self.holder_id or lease.expires <= now:
            lease.epoch += 1
        lease.holder = self.holder_id
        lease.expires = now + self.lease_seconds
        return self._token(reconciler_id, lease)

    async def renew_lease(self, token: LeaseToken) -> None:
        if self.hang_renewals:
            await asyncio.Event().wait()
        await asyncio.sleep(0)
        if self.fail_renewals > 0:
            self.fail_renewals -= 1
            raise ConnectionError("injected renewal failure")
        lease = self.store.leases.get(token.reconciler_id)
        now = time.monotonic()
        if (
            lease is None
            or lease.holder != self.holder_id
            or lease.epoch != token.epoch
            or lease.expires <= now
        ):
            raise LeaseLost(f"lease {token.reconciler_id} is no longer held by {self.holder_id}")
        lease.expires = now + self.lease_seconds

    async def release_lease(self, token: LeaseToken) -> None:
        self.releases += 1
        lease = self.store.leases.get(token.reconciler_id)
        if lease is not None and lease.holder == self.holder_id and lease.epoch == token.epoch:
            lease.holder = ""
            lease.expires = 0.0

    def _token(self, reconciler_id: str, lease: _Lease) -> LeaseToken:
        now = datetime.datetime.now(datetime.UTC)
        return LeaseToken(
            reconciler_id=reconciler_id,
            holder_id=self.holder_id,
            epoch=lease.epoch,
            acquired_at=now,
            expires_at=now + datetime.timedelta(seconds=self.ttl.seconds),
        )


class MemoryFencedRepository:
    """A :class:`~kopf_reconcile.FencedRepository` keeping the state in a dict.

    Fenced per entity and scope-wide, as the PostgreSQL repository: once an epoch is
    recorded, no write below it is accepted for any entity.

    ``applied`` is an audit log of every accepted write: ``(entity_id, epoch, mutation)``.
    """

    def __init__(self) -> None:
        self.last_epochs: dict[str, int] = {}
        self.states: dict[str, object] = {}
        self.applied: list[tuple[str, int, object]] = []
        self.recorded_epoch = 0  # the highest epoch that led (see record_epoch)
        self.recorded_holder = ""  # and who led at it

    async def apply_fenced(self, entity_id: str, epoch: int, mutation: object) -> bool:
        await asyncio.sleep(0)
        if epoch < self.last_epochs.get(entity_id, -1) or epoch < self.recorded_epoch:
            return False
        self.last_epochs[entity_id] = epoch
        self.states[entity_id] = mutation
        self.applied.append((entity_id, epoch, mutation))
        return True

    async def record_epoch(self, epoch: int, holder: str) -> None:
        await asyncio.sleep(0)
        if self.recorded_epoch > epoch:
            raise StaleEpochError(f"epoch {epoch} is below the recorded {self.recorded_epoch}")
        if self.recorded_epoch == epoch and self.recorded_holder not in ("", holder):
            raise StaleEpochError(f"epoch {epoch} was led by {self.recorded_holder}")
        self.recorded_epoch = epoch
        self.recorded_holder = holder

    async def highest_epoch(self) -> int:
        return max([*self.last_epochs.values(), self.recorded_epoch])
