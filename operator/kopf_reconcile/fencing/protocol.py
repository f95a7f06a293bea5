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

from typing import Protocol, runtime_checkable

from kopf_reconcile.tenancy import Tenancy


class StaleEpochError(Exception):
    """A fenced write was rejected: this process's epoch is no longer current."""


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
