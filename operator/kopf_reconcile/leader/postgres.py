"""Leader election on a PostgreSQL row: a durable lease with a monotonic epoch.

:class:`PostgresLeaseElector` keeps one row per reconciler id: who holds the
lease, its epoch, when it was acquired and renewed, and when it expires.
Every write is a single compare-and-swap statement, so two processes can
never both succeed:

* acquire takes the row over when it is free (released) or expired, or
  extends it when the caller already holds it; when there is no row yet, it
  inserts one (``ON CONFLICT DO NOTHING``: of two processes creating it at
  once, one wins and the other is told the lease is contended). The epoch
  grows by one on every change of holder; re-acquiring by the same holder
  keeps it. The elector never deletes rows, so the epoch never resets — this
  is the strong-fencing elector: the epoch is durable in the same database as
  the fenced rows.
* renew extends the expiry only while the caller still holds an unexpired
  lease at the same epoch; otherwise :class:`~kopf_reconcile.leader.protocol.LeaseLost`.
* release empties the holder and expires the lease now, so the next acquirer
  takes over at once (with the next epoch) instead of after the TTL. It is
  idempotent, and releasing a lease that was already lost is not an error.

A row can still disappear (deleted by hand, table dropped and recreated). A
new row therefore never starts below an epoch already used: it starts one
above the highest epoch this elector has seen for the reconciler and the
highest any process used, as reported by the source registered with
:meth:`PostgresLeaseElector.use_epoch_floor` (a Loop registers its fenced
repository's ``highest_epoch``). Without such a source, a row deleted while
no running elector remembers its last epoch restarts at 1.

Expiry is judged by the database clock, the one clock every contender
shares; no two machines' clocks are ever compared. Each statement reads it
once (``now()``, the start of the statement), so a statement that waited for
a row lock judges expiry as of before the wait, which errs on the side of
"still held". The TTL travels as whole milliseconds.

Holder ids must be unique per process: a reused identity would let a
restarted process "re-acquire" its predecessor's lease at the same epoch. The
default is ``POD_NAME`` (or the host name) plus a random suffix minted once
per elector instance.
"""

from __future__ import annotations

import datetime

import asyncpg

from kopf_reconcile._cogs.closing import AsyncClosing
from kopf_reconcile._cogs.identity import unique_holder_id
from kopf_reconcile._cogs.pg import Database, qualified_table
from kopf_reconcile.config import ConfigError, Duration
from kopf_reconcile.leader.epochs import EpochFloor, EpochMemory
from kopf_reconcile.leader.protocol import LeaseContended, LeaseLost, LeaseToken, LeaseTTL

__all__ = ["DEFAULT_LEASE_TABLE", "DEFAULT_LEASE_TTL", "PostgresLeaseElector"]

DEFAULT_LEASE_TABLE = "kopf_reconcile_lease"
DEFAULT_LEASE_TTL = LeaseTTL(15)  # client-go's LeaseDuration default
_FREE = ""  # holder_id of a released lease


class PostgresLeaseElector(AsyncClosing):
    """A :class:`~kopf_reconcile.leader.protocol.LeaderElector` on a PostgreSQL table."""

    def __init__(
        self,
        dsn_or_pool: str | asyncpg.Pool,
        ttl: LeaseTTL | Duration = DEFAULT_LEASE_TTL,
        holder_id: str | None = None,
        table: str = DEFAULT_LEASE_TABLE,
    ) -> None:
        """``holder_id`` defaults to ``POD_NAME`` (or the host name) plus a random suffix."""
        if holder_id is not None and (not isinstance(holder_id, str) or not holder_id):
            raise ConfigError(f"holder_id must be a non-empty string or None, got {holder_id!r}")
        self._ttl = ttl if isinstance(ttl, LeaseTTL) else LeaseTTL(ttl)
        self._holder_id = holder_id if holder_id is not None else unique_holder_id()
        self._table = qualified_table("table", table)
        self._database = Database(dsn_or_pool, table=self._table, schema=[_schema(self._table)])
        self._epochs = EpochMemory()
        # Take the row when it is free, expired, or already ours; a change of
        # holder bumps the epoch. $3 is the TTL in milliseconds.
        self._take_sql = f"""
            UPDATE {self._table}
               SET epoch = CASE WHEN holder_id = $2 THEN epoch ELSE epoch + 1 END,
                   holder_id = $2,
                   acquired_at = now(),
                   renewed_at = now(),
                   expires_at = now() + $3::bigint * interval '1 millisecond'
             WHERE reconciler_id = $1
               AND (holder_id = $2 OR holder_id = '{_FREE}' OR expires_at <= now())
            RETURNING epoch, acquired_at, expires_at
        """
        # No row yet: create it at the seed epoch $4, unless another process just did.
        self._create_sql = f"""
            INSERT INTO {self._table}
                (reconciler_id, holder_id, epoch, acquired_at, renewed_at, expires_at)
            VALUES ($1, $2, $4, now(), now(), now() + $3::bigint * interval '1 millisecond')
            ON CONFLICT (reconciler_id) DO NOTHING
            RETURNING epoch, acquired_at, expires_at
        """
        self._renew_sql = f"""
            UPDATE {self._table}
               SET renewed_at = now(),
                   expires_at = now() + $4::bigint * interval '1 millisecond'
             WHERE reconciler_id = $1 AND holder_id = $2 AND epoch = $3
               AND expires_at > now()
            RETURNING expires_at
        """
        self._release_sql = f"""
            UPDATE {self._table}
               SET holder_id = '{_FREE}', expires_at = now()
             WHERE reconciler_id = $1 AND holder_id = $2 AND epoch = $3
        """
        self._read_sql = f"""
            SELECT holder_id, epoch, expires_at, now() AS now
              FROM {self._table} WHERE reconciler_id = $1
        """

    @property
    def holder_id(self) -> str:
        """This elector's identity in the lease table."""
        return self._holder_id

    @property
    def ttl(self) -> LeaseTTL:
        """How long a lease lasts without renewal."""
        return self._ttl

    def use_epoch_floor(self, source: EpochFloor) -> None:
        """Start new lease rows above ``await source()``, the highest epoch any process used.

        The source is awaited only when the row must be created; if it fails,
        acquiring fails (the Loop retries) rather than risking a lower epoch.
        """
        self._epochs.use_floor(source)

    async def migrate(self) -> None:
        """Create the lease table if it does not exist (idempotent, safe across processes)."""
        await self._database.migrate()

    async def acquire_lease(self, reconciler_id: str) -> LeaseToken:
        """Become the holder, or raise :class:`LeaseContended` naming the current one."""
        if not isinstance(reconciler_id, str) or not reconciler_id:
            raise ValueError(f"reconciler_id must be a non-empty string, got {reconciler_id!r}")
        pool = await self._database.pool()
        ttl = self._ttl.milliseconds
        row = await pool.fetchrow(self._take_sql, reconciler_id, self._holder_id, ttl)
        if row is None:
            current = await pool.fetchrow(self._read_sql, reconciler_id)
            if current is not None:
                self._epochs.saw(reconciler_id, int(current["epoch"]))
                remaining = (current["expires_at"] - current["now"]).total_seconds()
                raise LeaseContended(_describe(reconciler_id, current), retry_after=remaining)
            seed = await self._epochs.next_epoch(reconciler_id)
            row = await pool.fetchrow(self._create_sql, reconciler_id, self._holder_id, ttl, seed)
            if row is None:
                raise LeaseContended(
                    f"lease {reconciler_id!r} was created by another process meanwhile"
                )
        epoch = int(row["epoch"])
        self._epochs.saw(reconciler_id, epoch)
        return LeaseToken(
            reconciler_id=reconciler_id,
            holder_id=self._holder_id,
            epoch=epoch,
            acquired_at=row["acquired_at"],
            expires_at=row["expires_at"],
        )

    async def renew_lease(self, token: LeaseToken) -> None:
        """Extend the lease, keeping its epoch; :class:`LeaseLost` if it is not ours any more."""
        pool = await self._database.pool()
        expires_at = await pool.fetchval(
            self._renew_sql,
            token.reconciler_id,
            token.holder_id,
            token.epoch,
            self._ttl.milliseconds,
        )
        if expires_at is None:
            current = await pool.fetchrow(self._read_sql, token.reconciler_id)
            raise LeaseLost(
                f"{token.holder_id!r} no longer holds epoch {token.epoch}: "
                f"{_describe(token.reconciler_id, current)}"
            )

    async def release_lease(self, token: LeaseToken) -> None:
        """Give the lease up so the next acquirer takes over now. Idempotent."""
        pool = await self._database.pool()
        await pool.execute(self._release_sql, token.reconciler_id, token.holder_id, token.epoch)

    async def close(self) -> None:
        """Close the pool if it was created from a DSN (a borrowed pool stays open)."""
        await self._database.close()

    def __repr__(self) -> str:
        return (
            f"<PostgresLeaseElector holder={self._holder_id!r} table={self._table} "
            f"ttl={self._ttl.seconds}s at {self._database.describe()}>"
        )


def _describe(reconciler_id: str, row: asyncpg.Record | None) -> str:
    """A lease row's state in words, for contention and loss messages."""
    if row is None:
        return f"lease {reconciler_id!r} does not exist"
    expires_at: datetime.datetime = row["expires_at"]
    now: datetime.datetime = row["now"]
    if row["holder_id"] == _FREE:
        return f"lease {reconciler_id!r} is free (released) at epoch {row['epoch']}"
    if expires_at <= now:
        return (
            f"lease {reconciler_id!r} held by {row['holder_id']!r} "
            f"expired at {expires_at.isoformat()}"
        )
    return (
        f"lease {reconciler_id!r} is held by {row['holder_id']!r} at epoch "
        f"{row['epoch']} until {expires_at.isoformat()} "
        f"({(expires_at - now).total_seconds():.3f}s from now, database clock)"
    )


def _schema(table: str) -> str:
    return f"""
        CREATE TABLE IF NOT EXISTS {table} (
            reconciler_id text        PRIMARY KEY,
            holder_id     text        NOT NULL,
            epoch         bigint      NOT NULL CHECK (epoch >= 1),
            acquired_at   timestamptz NOT NULL,
            renewed_at    timestamptz NOT NULL,
            expires_at    timestamptz NOT NULL
        )
    """
