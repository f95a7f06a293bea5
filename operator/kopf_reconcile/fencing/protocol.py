"""The fencing seam: an epoch-aware repository.

A :class:`FencedRepository` applies a write only when its epoch is current.
Per entity it records the highest epoch that ever wrote and accepts a write
when ``epoch >= last_epoch`` (monotonic fencing, not equality: a late write
may arrive after several handovers and only "older than the highest seen"
rejects it). A stale epoch is answered with ``False``, not an exception, so a
zombie leader's write is rejected structurally.

With leader election the Loop also needs the fence to be *scope-wide*: once a
leader has led at epoch N in a scope, no write below N may be accepted for
any entity of that scope, including entities the new leader has not written
yet. That is the :class:`EpochRecordingRepository` capability: the Loop
records its epoch before it dispatches, the store orders that recording after
every write already in flight, and every later write below it is rejected.
A Loop with a leader refuses a repository without it (a
:class:`~kopf_reconcile.ConfigError`): per-entity fencing alone would let a
paused old leader write to an entity the new leader has not touched.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Protocol, runtime_checkable

from kopf_reconcile.api import ConfigError
from kopf_reconcile.tenancy import Tenancy


class StaleEpochError(Exception):
    """A fenced write was rejected: this process's epoch is no longer current."""


class ShardLayoutError(ConfigError):
    """The base scope records another shard layout than the one this replica runs.

    Unlike other configuration errors it can end without a restart: ``kopf-reconcile
    reshard`` changes the recorded layout, so a sharded Loop retries later (with backoff)
    instead of giving up, and never leads a shard meanwhile.
    """


@runtime_checkable
class FencedRepository(Protocol):
    """Consumer-side persistence that applies a mutation only for a current epoch."""

    async def apply_fenced(self, entity_id: str, epoch: int, mutation: object) -> bool:
        """Apply ``mutation`` if ``epoch`` is current for its entity and scope; else ``False``."""
        ...


@runtime_checkable
class EpochRecordingRepository(Protocol):
    """A repository that fences a whole scope from the epoch a leader records."""

    async def record_epoch(self, epoch: int, holder: str) -> None:
        """Record that ``holder`` leads the scope at ``epoch``, after every write in flight.

        From then on a write below ``epoch`` is rejected for every entity of the
        scope. Raises :class:`StaleEpochError` when the scope has already been led
        at a higher epoch, or at this epoch by another holder (a lease record lost
        and recreated can hand one epoch to two holders: only the first to record
        it may lead).
        """
        ...

    async def highest_epoch(self) -> int:
        """The highest epoch recorded or written in the scope (0 if none)."""
        ...


@runtime_checkable
class LoopBoundRepository(Protocol):
    """A repository that takes its scope and tenancy from the Loop it is given to."""

    def bind_loop(self, *, reconciler_id: str, tenancy: Tenancy) -> None:
        """Adopt the Loop's reconciler id as scope (unless explicit) and its tenancy."""
        ...


@dataclasses.dataclass(frozen=True)
class DeadLetter:
    """An entity a leader gave up on, as a durable store keeps it."""

    reconciler_id: str  # the scope of the store: by default the reconciler id
    entity_id: str
    reason: str  # the latest dead letter's
    first_at: datetime.datetime  # the first dead letter since the entity last succeeded
    last_at: datetime.datetime
    attempts: int  # dead letters since the entity last succeeded
    epoch: int  # the epoch of the leader that wrote the latest one


@runtime_checkable
class DeadLetterStore(Protocol):
    """A repository that keeps a scope's dead letters across failovers and restarts.

    Every write is fenced as a fenced write is: below the scope's recorded epoch it
    changes nothing and answers False (a deposed leader cannot write one).
    """

    async def record_dead_letter(self, entity_id: str, epoch: int, reason: str) -> bool:
        """Record (or count once more) the dead letter of ``entity_id``."""
        ...

    async def clear_dead_letter(self, entity_id: str, epoch: int) -> bool:
        """Forget the dead letter of ``entity_id`` (it succeeded)."""
        ...

    async def dead_letters(self) -> list[DeadLetter]:
        """The scope's dead letters."""
        ...

    async def take_redrives(self, epoch: int) -> list[str]:
        """The entities someone asked to retry (consumed: each request is handed out once).

        Fenced too: a deposed leader gets nothing and leaves the requests to the leader.
        """
        ...


@runtime_checkable
class ShardableRepository(Protocol):
    """A repository that can fence each shard of a sharded reconciler in a scope of its own.

    A reconciler with ``shards=N`` (N > 1) leads each shard under its own lease, whose
    epochs are unrelated to the other shards': each shard therefore needs its own
    fencing scope, ``<scope>-shard-<k>``, on the same store.
    """

    def for_shard(self, shard: int) -> FencedRepository:
        """A repository on the same store for shard ``shard`` (not yet bound to a Loop).

        Bound to the shard's Loop, its scope is that Loop's reconciler id
        (``<reconciler id>-shard-<k>``), or ``<explicit scope>-shard-<k>``. Its
        ``record_epoch`` verifies, atomically with the recording, that the base scope
        still records the layout given to this repository's ``record_shard_count``
        (:class:`ShardLayoutError` otherwise): after the layout changes, a replica of the
        old one can never start leading a shard again.
        """
        ...

    async def record_shard_count(self, shards: int, *, by_namespace: bool = False) -> None:
        """Record in this (unsharded) scope that its entities live in ``shards`` shard scopes.

        Raises :class:`ShardLayoutError` (a :class:`~kopf_reconcile.ConfigError`) when the
        scope was led unsharded, or recorded with another shard count (or
        ``by_namespace``): an entity would then be fenced in two scopes by two unrelated
        leases. Once recorded, an unsharded leader of the scope is refused too. The layout
        given here is the one this repository's shards check when they record an epoch.
        """
        ...
