"""The simulated lease store and fenced database, with the history a checker reads.

Both keep the semantics of the real stores, judged by *their own* clock (the
virtual loop's), never by a replica's belief:

* :class:`LeaseStore` — one record per reconciler id: holder, epoch, expiry,
  version. Taking it over is a compare-and-swap on the version; the epoch
  grows on every change of holder and is kept on renewal; a release empties
  the holder and wakes followers; a record can be *deleted* (its epoch
  counter is lost, as with a Lease deleted by hand), so electors seed a new
  one from an epoch floor, as the real ones do.
* :class:`FenceStore` — per entity the highest epoch applied and the state;
  per scope the highest epoch that led it and the lease that numbers it. A
  write applies only when its epoch is not below either (the scope-wide fence).
  A sharded reconciler's base scope is "numbered" by its layout
  (``<id>/shards=N``), and a shard's epoch is recorded only while the base scope
  still names the layout its replica runs, as the real store's layout check.

Every change is appended to a history (:class:`Granted`, :class:`Led`,
:class:`Applied`) in the order it took effect; the checker reads nothing else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
from collections.abc import Awaitable, Callable

from kopf_reconcile.api import ConfigError
from kopf_reconcile.control.epochs import EpochFloor, EpochMemory
from kopf_reconcile.fencing.protocol import ShardLayoutError, StaleEpochError
from kopf_reconcile.leader.protocol import (
    LeaseContended,
    LeaseLost,
    LeaseRecord,
    LeaseToken,
    LeaseTTL,
)
from kopf_reconcile.tenancy import Tenancy

__all__ = ["Applied", "FenceStore", "Granted", "LeaseStore", "Led", "Record"]

Clock = Callable[[], float]
#: A replica's store-call boundary (the nemesis sits there): ``await io(operation, effect)``.
IO = Callable[[str, Callable[[], object]], Awaitable[object]]


@dataclasses.dataclass(frozen=True)
class Granted:
    """A lease granted (acquired or re-acquired) to ``holder`` at ``epoch``."""

    t: float
    reconciler_id: str
    holder: str
    epoch: int


@dataclasses.dataclass(frozen=True)
class Led:
    """The scope's led epoch was raised to ``epoch`` (a leader recorded it)."""

    t: float
    scope: str
    epoch: int


@dataclasses.dataclass(frozen=True)
class Applied:
    """A fenced write the database applied, and which replica sent it."""

    t: float
    scope: str
    entity_id: str
    epoch: int
    state: object
    writer: str


@dataclasses.dataclass
class Record:
    holder: str = ""
    epoch: int = 0
    expires: float = 0.0
    version: int = 0


class LeaseStore:
    """Lease records judged by the store's clock, with a history of grants."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.records: dict[str, Record] = {}
        self.history: list[Granted] = []
        self._released: dict[str, asyncio.Event] = {}

    def released(self, reconciler_id: str) -> asyncio.Event:
        """Set (and replaced) whenever the lease is released, deleted or changes hands."""
        return self._released.setdefault(reconciler_id, asyncio.Event())

    def _wake(self, reconciler_id: str) -> None:
        self._released.pop(reconciler_id, asyncio.Event()).set()

    def take(self, reconciler_id: str, holder: str, ttl: float, seed: int) -> Record:
        """Acquire for ``holder`` (compare-and-swap), or raise :class:`LeaseContended`."""
        now = self.clock()
        record = self.records.get(reconciler_id)
        if record is None:
            record = self.records[reconciler_id] = Record(epoch=seed - 1)
        if record.holder and record.holder != holder and record.expires > now:
            raise LeaseContended(
                f"{reconciler_id} is held by {record.holder}", retry_after=record.expires - now
            )
        if record.holder != holder:
            record.epoch = max(record.epoch + 1, seed)
            self._wake(reconciler_id)
        record.holder = holder
        record.expires = now + ttl
        record.version += 1
        self.history.append(Granted(now, reconciler_id, holder, record.epoch))
        return dataclasses.replace(record)

    def renew(self, reconciler_id: str, holder: str, epoch: int, ttl: float) -> None:
        now = self.clock()
        record = self.records.get(reconciler_id)
        if (
            record is None
            or record.holder != holder
            or record.epoch != epoch
            or record.expires <= now
        ):
            raise LeaseLost(f"{reconciler_id} is no longer held by {holder} at epoch {epoch}")
        record.expires = now + ttl
        record.version += 1

    def release(self, reconciler_id: str, holder: str, epoch: int) -> None:
        record = self.records.get(reconciler_id)
        if record is not None and record.holder == holder and record.epoch == epoch:
            record.holder = ""
            record.expires = self.clock()
            record.version += 1
            self._wake(reconciler_id)

    def delete(self, reconciler_id: str) -> None:
        """Lose the record and its epoch counter (a Lease or row deleted by hand)."""
        if self.records.pop(reconciler_id, None) is not None:
            self._wake(reconciler_id)

    def epoch_of(self, reconciler_id: str) -> int:
        record = self.records.get(reconciler_id)
        return 0 if record is None else record.epoch


class StoreElector:
    """A replica's elector over a :class:`LeaseStore`; every store call goes through ``io``."""

    def __init__(
        self,
        store: LeaseStore,
        holder_id: str,
        ttl: float,
        io: IO,
    ) -> None:
        self.store = store
        self.holder_id = holder_id
        self.ttl = LeaseTTL(ttl)
        self._io = io
        self._epochs = EpochMemory()

    def use_epoch_floor(self, reconciler_id: str, source: EpochFloor) -> None:
        self._epochs.use_floor(reconciler_id, source)

    def drop_epoch_floor(self, reconciler_id: str, source: EpochFloor) -> None:
        self._epochs.drop_floor(reconciler_id, source)

    async def acquire_lease(self, reconciler_id: str) -> LeaseToken:
        seed = await self._epochs.next_epoch(reconciler_id, self.store.epoch_of(reconciler_id))
        record = await self._io(
            "acquire",
            lambda: self.store.take(reconciler_id, self.holder_id, self.ttl.seconds, seed),
        )
        assert isinstance(record, Record)
        self._epochs.saw(reconciler_id, record.epoch)
        now = datetime.datetime.now(datetime.UTC)
        return LeaseToken(reconciler_id, self.holder_id, record.epoch, now, now)

    async def renew_lease(self, token: LeaseToken) -> None:
        await self._io(
            "renew",
            lambda: self.store.renew(
                token.reconciler_id, token.holder_id, token.epoch, self.ttl.seconds
            ),
        )

    async def release_lease(self, token: LeaseToken) -> None:
        await self._io(
            "release",
            lambda: self.store.release(token.reconciler_id, token.holder_id, token.epoch),
        )

    async def wait_for_release(self, reconciler_id: str) -> None:
        await self.store.released(reconciler_id).wait()

    async def list_leases(self) -> list[LeaseRecord]:
        """The records, expiring when the store's clock says (shown on this wall clock)."""
        records = await self._io("list", lambda: dict(self.store.records))
        assert isinstance(records, dict)
        wall = datetime.datetime.now(datetime.UTC)
        now = self.store.clock()
        return [
            LeaseRecord(
                namespace=None,
                reconciler_id=rid,
                holder_id=record.holder,
                epoch=record.epoch,
                acquired_at=None,
                renewed_at=None,
                expires_at=wall + datetime.timedelta(seconds=record.expires - now),
            )
            for rid, record in sorted(records.items())
        ]


class FenceStore:
    """The fenced database: per-entity and scope-wide epoch checks, with a history."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.rows: dict[tuple[str, str], tuple[int, object]] = {}
        self.led: dict[str, tuple[int, str]] = {}
        self.led_by: dict[str, str] = {}
        self.history: list[Applied | Led] = []

    def apply(self, scope: str, entity_id: str, epoch: int, state: object, writer: str) -> bool:
        led_epoch = self.led.get(scope, (0, ""))[0]
        last_epoch = self.rows.get((scope, entity_id), (-1, None))[0]
        if epoch < led_epoch or epoch < last_epoch:
            return False
        self.rows[(scope, entity_id)] = (epoch, state)
        self.history.append(Applied(self.clock(), scope, entity_id, epoch, state, writer))
        return True

    def record(
        self, scope: str, epoch: int, lease: str, holder: str, layout: tuple[str, str] | None = None
    ) -> None:
        """Record ``epoch`` as leading ``scope``; ``layout``: (base scope, layout it must name)."""
        if layout is not None:
            base, expected = layout
            named = self.led.get(base, (0, ""))[1]
            if named != expected:
                raise ShardLayoutError(f"{base} records the layout {named!r}, not {expected!r}")
        led_epoch, owner = self.led.get(scope, (0, lease))
        if owner != lease:
            error = ShardLayoutError if "/shards=" in owner + lease else ConfigError
            raise error(f"scope {scope} is numbered by {owner}, not {lease}")
        if led_epoch > epoch:
            raise StaleEpochError(f"{scope} was led at {led_epoch}; {epoch} cannot lead")
        led_by = self.led_by.get(scope, holder)
        if led_epoch == epoch and led_by != holder:
            raise StaleEpochError(f"{scope} was led at {epoch} by {led_by}, not {holder}")
        self.led[scope] = (epoch, lease)
        self.led_by[scope] = holder
        self.history.append(Led(self.clock(), scope, epoch))

    def highest(self, scope: str) -> int:
        written = [epoch for (s, _), (epoch, _) in self.rows.items() if s == scope]
        return max([self.led.get(scope, (0, ""))[0], *written])

    def state(self, scope: str, entity_id: str) -> object:
        return self.rows.get((scope, entity_id), (0, None))[1]

    def state_in_any(self, base: str, entity_id: str) -> object:
        """The entity's state in scope ``base`` or in one of its shard scopes."""
        for (scope, entity), (_, state) in self.rows.items():
            if entity == entity_id and (scope == base or scope.startswith(f"{base}-shard-")):
                return state
        return None


@dataclasses.dataclass
class _LayoutCell:
    """The layout a sharded repository recorded, shared with its shard repositories."""

    current: tuple[str, str] | None = None  # (base scope, layout)


class StoreRepository:
    """A replica's fenced repository over a :class:`FenceStore`; calls go through ``io``."""

    def __init__(
        self,
        store: FenceStore,
        writer: str,
        io: IO,
        write_timeout: float,
    ) -> None:
        self.store = store
        self.writer = writer
        self._io = io
        self._write_timeout = write_timeout
        self.scope = "default"
        self._lease = "default"
        # The layout this repository's shards run (record_shard_count), and in a shard's
        # repository the base repository's, which its record_epoch verifies.
        self._layout = _LayoutCell()
        self._layout_check: _LayoutCell | None = None

    def bind_loop(self, *, reconciler_id: str, tenancy: Tenancy) -> None:
        self.scope = self._lease = reconciler_id

    async def apply_fenced(self, entity_id: str, epoch: int, mutation: object) -> bool:
        async with asyncio.timeout(self._write_timeout):  # as the real repository's
            accepted = await self._io(
                "write",
                lambda: self.store.apply(self.scope, entity_id, epoch, mutation, self.writer),
            )
        return bool(accepted)

    async def record_epoch(self, epoch: int, holder: str) -> None:
        check = self._layout_check
        if check is not None and check.current is None:
            raise ShardLayoutError(f"{self.scope} is a shard's, and its layout was not recorded")
        layout = None if check is None else check.current
        await self._io(
            "record", lambda: self.store.record(self.scope, epoch, self._lease, holder, layout)
        )

    async def highest_epoch(self) -> int:
        highest = await self._io("floor", lambda: self.store.highest(self.scope))
        assert isinstance(highest, int)
        return highest

    def for_shard(self, shard: int) -> StoreRepository:
        """Shard ``shard``'s repository: the same store; its scope comes from its Loop."""
        sibling = StoreRepository(self.store, self.writer, self._io, self._write_timeout)
        sibling._layout_check = self._layout
        return sibling

    async def record_shard_count(self, shards: int, *, by_namespace: bool = False) -> None:
        """Record the layout in this scope, as the real store does (its lease names it)."""
        layout = f"{self._lease}/shards={shards}" + ("/namespace-ranges" if by_namespace else "")
        self._layout.current = (self.scope, layout)
        await self._io("record", lambda: self.store.record(self.scope, 0, layout, "shards"))
