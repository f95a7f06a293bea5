"""The sealed, epoch-bound write surface of one reconcile.

The Loop mints one :class:`FencedWriter` per reconcile, bound to the epoch of
the lease it holds, and exposes it through :func:`fenced_writer` (a context
variable, so it follows the reconcile into its own tasks and threads).
Users cannot construct one with an epoch of their choosing: direct
construction raises :class:`TypeError`. (Python cannot make this airtight —
a determined caller can reach private names, or call a repository's
``apply_fenced`` directly — the seal prevents accidents, the database's epoch
check prevents split-brain.)

:meth:`FencedWriter.write` checks twice: first the loop's live lease, locally
(fast fail: a paused process that woke up past its lease does not even try),
then the repository's monotonic epoch check, atomically in the database (the
real guard).

Writes the framework makes for a reconcile elsewhere (a finalizer's removal through
the Kubernetes API) get the same local check from :func:`reconcile_lease`: the lease
and epoch the running reconcile was dispatched under, bound by the Loop in each worker
(a worker lives within one term) whether or not a fenced repository is configured.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable

from kopf_reconcile.fencing.protocol import FencedRepository, StaleEpochError

_SEAL = object()

_current: contextvars.ContextVar[FencedWriter | None] = contextvars.ContextVar(
    "kopf_reconcile_fenced_writer", default=None
)


class FencedWriter:
    """Writes through a :class:`FencedRepository` with the epoch of the lease held."""

    __slots__ = ("_epoch", "_lease_is_live", "_on_outcome", "_repository")

    def __init__(
        self,
        *args: object,
        _seal: object = None,
        repository: FencedRepository | None = None,
        epoch: int = -1,
        lease_is_live: Callable[[int], bool] | None = None,
        on_outcome: Callable[[str], None] | None = None,
    ) -> None:
        if _seal is not _SEAL or args or repository is None or lease_is_live is None:
            raise TypeError(
                "FencedWriter cannot be constructed directly: the Loop mints one per "
                "reconcile; use kopf_reconcile.fenced_writer() inside a reconcile"
            )
        self._repository = repository
        self._epoch = epoch
        self._lease_is_live = lease_is_live
        self._on_outcome = on_outcome or (lambda outcome: None)

    @property
    def epoch(self) -> int:
        """The fencing epoch every write of this reconcile carries."""
        return self._epoch

    async def write(self, entity_id: str, mutation: object) -> None:
        """Apply ``mutation`` for ``entity_id`` if this epoch is still current.

        Raises :class:`StaleEpochError` when the lease was lost or the epoch
        changed since the reconcile started (checked locally first), or when
        the repository has seen a higher epoch for the entity.
        """
        if not self._lease_is_live(self._epoch):
            self._on_outcome("stale")
            raise StaleEpochError(
                f"write to {entity_id!r} refused locally: the lease of epoch {self._epoch} "
                "is no longer held by this process"
            )
        try:
            accepted = await self._repository.apply_fenced(entity_id, self._epoch, mutation)
        except BaseException:
            self._on_outcome("error")
            raise
        if not accepted:
            self._on_outcome("stale")
            raise StaleEpochError(
                f"write to {entity_id!r} rejected: epoch {self._epoch} is older than the "
                "highest epoch the repository has seen for it"
            )
        self._on_outcome("accepted")

    def __repr__(self) -> str:
        return f"<FencedWriter epoch={self._epoch}>"


def mint_writer(
    repository: FencedRepository,
    epoch: int,
    lease_is_live: Callable[[int], bool],
    on_outcome: Callable[[str], None],
) -> FencedWriter:
    """Create a writer (the Loop's privilege)."""
    return FencedWriter(
        _seal=_SEAL,
        repository=repository,
        epoch=epoch,
        lease_is_live=lease_is_live,
        on_outcome=on_outcome,
    )


class ReconcileLease:
    """The lease a reconcile was dispatched under: its epoch, and whether it is still held.

    ``lease_id`` names the lease as the elector knows it (the reconciler id, or a shard's
    ``<id>-shard-<k>``) and ``holder`` the holder identity that took it (both ``None``
    without a leader); the Kubernetes API client sends them with each write, so the API
    server can refuse a write whose lease has changed hands since.
    ``count_api_write`` counts the outcome of each of those writes for the Loop's metrics.
    """

    __slots__ = ("_is_live", "count_api_write", "epoch", "holder", "lease_id")

    def __init__(
        self,
        epoch: int,
        is_live: Callable[[int], bool],
        *,
        lease_id: str | None = None,
        holder: str | None = None,
        count_api_write: Callable[[str], None] | None = None,
    ) -> None:
        self.epoch = epoch
        self._is_live = is_live
        self.lease_id = lease_id
        self.holder = holder
        self.count_api_write = count_api_write or (lambda outcome: None)

    def is_live(self) -> bool:
        """Whether this process still holds the lease, at this epoch (always True unled)."""
        return self._is_live(self.epoch)

    def __repr__(self) -> str:
        return f"<ReconcileLease {self.lease_id} epoch={self.epoch} holder={self.holder}>"


_lease: contextvars.ContextVar[ReconcileLease | None] = contextvars.ContextVar(
    "kopf_reconcile_reconcile_lease", default=None
)


def reconcile_lease() -> ReconcileLease | None:
    """The lease of the reconcile running in this context; None outside one."""
    return _lease.get()


def bind_lease(lease: ReconcileLease) -> contextvars.Token[ReconcileLease | None]:
    """Make ``lease`` the current one (the Loop does this in each worker)."""
    return _lease.set(lease)


def unbind_lease(token: contextvars.Token[ReconcileLease | None]) -> None:
    _lease.reset(token)


def fenced_writer() -> FencedWriter | None:
    """The writer of the reconcile running in this context; None outside one or unfenced."""
    return _current.get()


def bind_writer(writer: FencedWriter | None) -> contextvars.Token[FencedWriter | None]:
    """Make ``writer`` the current one (the Loop does this around each reconcile)."""
    return _current.set(writer)


def unbind_writer(token: contextvars.Token[FencedWriter | None]) -> None:
    _current.reset(token)
