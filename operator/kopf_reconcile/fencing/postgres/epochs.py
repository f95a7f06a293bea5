"""Epochs and the scope fence: which epoch leads each scope, recorded before it writes.

:meth:`~EpochRecording.record_epoch` raises the epoch of the scope's row in
``<table>_epochs``, after every write in flight (writes share-lock that row, see
:mod:`~kopf_reconcile.fencing.postgres.documents`): from then on no write below it is
accepted for any entity of the scope. The first lease to record names the scope's epoch
sequence; another reconciler's lease is refused. A shard scope's recording verifies, in
the same transaction, the layout its base scope records (it share-locks the base scope's
row), so a replica of another layout never starts leading a shard. Each epoch that led
is kept a day in ``<table>_leaders`` (:meth:`~EpochRecording.leadership_changes`).
"""

from __future__ import annotations

import functools

import asyncpg

from kopf_reconcile.api import ConfigError
from kopf_reconcile.fencing.postgres.base import RepositoryBase, check_epoch
from kopf_reconcile.fencing.postgres.layout import reconciler_of, reshard_hint, shard_scope_lease
from kopf_reconcile.fencing.protocol import ShardLayoutError, StaleEpochError
from kopf_reconcile.sharding import ShardAssignment

__all__ = ["LEADER_HISTORY", "EpochRecording"]

LEADER_HISTORY = "1 day"  # how long the leadership changes of a scope are kept


class EpochRecording(RepositoryBase):
    """The ``EpochRecordingRepository`` protocol: :meth:`record_epoch`, :meth:`highest_epoch`."""

    @functools.cached_property
    def _record_sql(self) -> str:
        # Raising the scope's epoch takes its row exclusively: it waits for every
        # write holding the share lock. The first lease to record names the scope's
        # epoch sequence; another lease is refused by the caller.
        # The holder that led at the current epoch is kept: a lease record lost and
        # recreated can hand one epoch to two holders, and only the first may lead.
        # $5 is, for a shard, its lease qualified by its layout (shard_scope_lease): a
        # reshard names it in every shard scope, and it is kept as it is. A client that
        # sends the plain lease only (a release without the layout check) is refused there.
        return f"""
            INSERT INTO {self._epochs} AS led (scope, epoch, lease, holder)
            VALUES ($1, $2, $3, $4)
            ON CONFLICT (scope) DO UPDATE
               SET epoch = GREATEST(led.epoch, EXCLUDED.epoch),
                   lease = CASE WHEN led.lease = $5::text THEN led.lease
                                ELSE EXCLUDED.lease END,
                   holder = CASE WHEN EXCLUDED.epoch > led.epoch OR led.holder IS NULL
                                 THEN EXCLUDED.holder ELSE led.holder END
             WHERE led.lease IS NULL OR led.lease = EXCLUDED.lease OR led.lease = $5::text
            RETURNING epoch, holder
        """

    @functools.cached_property
    def _scope_lease_sql(self) -> str:
        return f"SELECT lease FROM {self._epochs} WHERE scope = $1"

    @functools.cached_property
    def _base_layout_sql(self) -> str:
        return f"SELECT lease FROM {self._epochs} WHERE scope = $1 FOR SHARE"

    @functools.cached_property
    def _led_before_sql(self) -> str:
        return f"SELECT epoch FROM {self._epochs} WHERE scope = $1"

    @functools.cached_property
    def _led_sql(self) -> str:
        return f"""
            INSERT INTO {self._leaders} (scope, epoch, holder, previous) VALUES ($1, $2, $3, $4)
            ON CONFLICT (scope, epoch) DO NOTHING
        """

    @functools.cached_property
    def _prune_leaders_sql(self) -> str:
        return (
            f"DELETE FROM {self._leaders} WHERE scope = $1 "
            f"AND led_at < now() - interval '{LEADER_HISTORY}'"
        )

    @functools.cached_property
    def _changes_sql(self) -> str:
        return f"""
            SELECT scope, count(*) FROM {self._leaders}
             WHERE led_at > now() - make_interval(secs => $1) AND previous > 0
             GROUP BY scope
        """

    @functools.cached_property
    def _highest_sql(self) -> str:
        return f"""
            SELECT GREATEST(
                (SELECT coalesce(max(last_epoch), 0) FROM {self._table} WHERE scope = $1),
                (SELECT coalesce(max(epoch), 0) FROM {self._epochs} WHERE scope = $1))
        """

    async def record_epoch(self, epoch: int, holder: str) -> None:
        """Record that ``holder`` leads this scope at ``epoch``, after every write in flight.

        From then on no write below ``epoch`` is accepted for any entity of the
        scope; :meth:`highest_epoch` covers it too, so an elector whose lease
        record was deleted seeds a new one above it. Raises
        :class:`StaleEpochError` when the scope was already led at a higher epoch,
        or at this epoch by another holder, and
        :class:`~kopf_reconcile.ConfigError` when the scope's epochs come from
        another reconciler's lease.
        """
        check_epoch(epoch)
        lease = self._bound_to[0] if self._bound_to is not None else self._scope
        layout = None if self._layout_check is None else self._layout_check.current
        if self._layout_check is not None and layout is None:
            raise ShardLayoutError(
                f"fenced scope {self._scope!r} is a shard's, and the layout its replica runs "
                "was not recorded (record_shard_count of the base repository): without it, "
                "this shard's epoch cannot be checked against the base scope's layout"
            )
        pool = await self._ready_pool()
        async with pool.acquire() as connection, connection.transaction():
            await self._bound_transaction(connection)
            if layout is not None:
                # Share-locked until this epoch is recorded: a reshard (which locks the row
                # exclusively) commits either before this check or after this recording.
                recorded = await connection.fetchval(self._base_layout_sql, layout.base_scope)
                if recorded != layout.lease:
                    raise ShardLayoutError(
                        f"fenced scope {self._scope!r} cannot be led at epoch {epoch}: its base "
                        f"scope {layout.base_scope!r} records the layout {recorded!r}, and this "
                        f"replica runs {layout.lease!r}. "
                        f"{reshard_hint(layout.base_scope, layout.assignment)}"
                    )
            before = await connection.fetchval(self._led_before_sql, self._scope)
            qualified = None if layout is None else shard_scope_lease(lease, layout.assignment)
            row = await connection.fetchrow(
                self._record_sql, self._scope, epoch, lease, holder, qualified
            )
            owner = (
                None
                if row is not None
                else await connection.fetchval(self._scope_lease_sql, self._scope)
            )
            if row is not None and int(row["epoch"]) == epoch and row["holder"] == holder:
                # The scope's leadership history (for `kopf-reconcile status`).
                await connection.execute(self._led_sql, self._scope, epoch, holder, before or 0)
                await connection.execute(self._prune_leaders_sql, self._scope)
        if row is None and layout is None and reconciler_of(owner, sharded=True) == lease:
            # An unsharded leader of a scope recorded as sharded: the layout changed (or
            # will, once this replica's rollout is done); a reshard to 1 shard ends it.
            raise ShardLayoutError(
                f"fenced scope {self._scope!r} of {self._table} records the shard layout "
                f"{owner!r}, and this replica runs it unsharded (lease {lease!r}). "
                f"{reshard_hint(self._scope, ShardAssignment(1))}"
            )
        if row is None:
            raise ConfigError(
                f"fenced scope {self._scope!r} of {self._table} is numbered by the lease of "
                f"reconciler {owner!r}, not {lease!r}: two leases' epochs would fence each "
                f"other; give this reconciler its own scope"
            )
        if int(row["epoch"]) > epoch:
            raise StaleEpochError(
                f"epoch {epoch} cannot lead fenced scope {self._scope!r}: it was already led "
                f"at epoch {row['epoch']}"
            )
        if row["holder"] != holder:
            raise StaleEpochError(
                f"epoch {epoch} of fenced scope {self._scope!r} was already led by "
                f"{row['holder']!r}, not {holder!r}: its lease record was lost and recreated"
            )

    async def highest_epoch(self) -> int:
        """The highest epoch recorded or written in this scope (0 if none).

        An elector whose own epoch counter can be lost (a deleted Kubernetes
        Lease) seeds a new counter from this so epochs never go backwards. It
        scans the scope's rows: call it when a lease is created, not per write.
        """
        pool = await self._database.pool()
        return int(await pool.fetchval(self._highest_sql, self._scope))

    async def leadership_changes(self, within: float = 3600.0) -> dict[str, int]:
        """Per scope, failovers within the last ``within`` seconds (database clock): epochs
        that started leading after another one had (a scope's first leader is none)."""
        pool = await self._database.existing_pool()
        try:
            rows = await pool.fetch(self._changes_sql, float(within))
        except asyncpg.UndefinedTableError:
            return {}
        return {row["scope"]: int(row["count"]) for row in rows}
