"""Leader election on a PostgreSQL row: a durable lease with a monotonic epoch.

(Over 400 lines on purpose: its SQL statements, the epoch floor and the release
notifications share one table's invariants.)

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
  The same statement notifies ``<table>_released`` (``pg_notify``), so the
  notification goes out exactly when the release commits, and followers
  waiting in :meth:`PostgresLeaseElector.wait_for_release` (LISTEN, on a
  connection of their own, outside the pool) try at once instead of at their
  next retry.

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

import asyncio
import collections
import datetime
import hashlib
import logging

import asyncpg

from kopf_reconcile.api import ConfigError, Duration
from kopf_reconcile.closing import AsyncClosing
from kopf_reconcile.control.epochs import EpochFloor, EpochMemory
from kopf_reconcile.database import Database, is_postgres_url, qualified_table, redact_dsn
from kopf_reconcile.leader.identity import checked_holder_id
from kopf_reconcile.leader.protocol import (
    LeaseContended,
    LeaseEpochExhausted,
    LeaseLost,
    LeaseRecord,
    LeaseToken,
    LeaseTTL,
)
from kopf_reconcile.leader.timing import DEFAULT_LEASE_TTL, loop_time

__all__ = ["DEFAULT_LEASE_TABLE", "DEFAULT_LEASE_TTL", "PostgresLeaseElector"]

DEFAULT_LEASE_TABLE = "kopf_reconcile_lease"
MAX_EPOCH = 2**63 - 1  # bigint
_FREE = ""  # holder_id of a released lease
# A notification's payload is at most 8000 bytes: it carries the reconciler id cut to
# this many characters (two ids alike that far only cost each other a spurious wake-up).
_PAYLOAD_CHARS = 1000
_MAX_CHANNEL = 63  # NAMEDATALEN - 1
# Opening the listening connection gives up after this long (and then backs off).
LISTEN_CONNECT_TIMEOUT = 5.0

logger = logging.getLogger("kopf_reconcile.leader")


class PostgresLeaseElector(AsyncClosing):
    """A :class:`~kopf_reconcile.leader.protocol.LeaderElector` on a PostgreSQL table.

    Followers wait for releases on a connection of their own (see
    :meth:`wait_for_release`), made from ``listen_dsn`` or else from the DSN
    the elector was given. With a borrowed pool and no ``listen_dsn`` there is
    none: followers then retry every renew interval. ``listen_dsn`` is also the
    way around a pooler in transaction mode (PgBouncer), where LISTEN does not
    work: point it at the server itself.
    """

    def __init__(
        self,
        dsn_or_pool: str | asyncpg.Pool,
        ttl: LeaseTTL | Duration = DEFAULT_LEASE_TTL,
        holder_id: str | None = None,
        table: str = DEFAULT_LEASE_TABLE,
        listen_dsn: str | None = None,
    ) -> None:
        """``holder_id`` defaults to ``POD_NAME`` (or the host name) plus a random suffix."""
        if listen_dsn is not None and not (
            isinstance(listen_dsn, str) and is_postgres_url(listen_dsn)
        ):
            shown = redact_dsn(listen_dsn) if isinstance(listen_dsn, str) else listen_dsn
            raise ConfigError(
                f"listen_dsn must be a PostgreSQL DSN (postgresql://...) or None, got {shown!r}"
            )
        self._ttl = ttl if isinstance(ttl, LeaseTTL) else LeaseTTL(ttl)
        self._holder_id = checked_holder_id(holder_id)
        self._table = qualified_table("table", table)
        self._database = Database(dsn_or_pool, table=self._table, schema=[_schema(self._table)])
        self._epochs = EpochMemory()
        # Releases, heard on one listening connection per elector (see wait_for_release).
        self._channel = _channel(self._table)
        self._listen_dsn = (
            listen_dsn
            if listen_dsn is not None
            else (dsn_or_pool if isinstance(dsn_or_pool, str) else None)
        )
        self._listener: asyncpg.Connection | None = None
        self._listening = asyncio.Lock()
        self._generation = 0  # how many times a listening connection was opened
        self._heard: collections.Counter[str] = collections.Counter()  # releases per payload
        self._heard_at_read: dict[str, tuple[int, int]] = {}  # generation and count per id
        self._followed: set[str] = set()  # payloads of the leases this elector followed
        self._wakeup = asyncio.Event()  # replaced (after being set) on every change
        self._listen_backoff_until = 0.0
        self._closed = False
        # Take the row when it is free, expired, or already ours; a change of
        # holder bumps the epoch. $3 is the TTL in milliseconds.
        # ``taken`` tells a change of holder (the floor is then consulted) from a
        # holder finding its own lease again.
        self._take_sql = f"""
            WITH before AS (
                SELECT holder_id FROM {self._table} WHERE reconciler_id = $1 FOR UPDATE
            )
            UPDATE {self._table} AS lease
               SET epoch = CASE WHEN lease.holder_id = $2 THEN epoch ELSE epoch + 1 END,
                   holder_id = $2,
                   acquired_at = now(),
                   renewed_at = now(),
                   expires_at = now() + $3::bigint * interval '1 millisecond'
              FROM before
             WHERE lease.reconciler_id = $1
               AND (lease.holder_id = $2 OR lease.holder_id = '{_FREE}'
                    OR lease.expires_at <= now())
            RETURNING epoch, acquired_at, expires_at, before.holder_id <> $2 AS taken
        """
        # A change of holder found below the floor: raise the epoch while it is still ours.
        self._raise_sql = f"""
            UPDATE {self._table} SET epoch = $4
             WHERE reconciler_id = $1 AND holder_id = $2 AND epoch = $3
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
        # Release and notify in one statement: the notification goes out when, and
        # only if, the release commits. $4 is the channel.
        self._release_sql = f"""
            WITH released AS (
                UPDATE {self._table}
                   SET holder_id = '{_FREE}', expires_at = now()
                 WHERE reconciler_id = $1 AND holder_id = $2 AND epoch = $3
                RETURNING reconciler_id
            )
            SELECT pg_notify($4, left(reconciler_id, {_PAYLOAD_CHARS})) FROM released
        """
        self._list_sql = f"""
            SELECT reconciler_id, holder_id, epoch, acquired_at, renewed_at, expires_at
              FROM {self._table} ORDER BY reconciler_id
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

    def use_epoch_floor(self, reconciler_id: str, source: EpochFloor) -> None:
        """Start new lease rows above ``await source()``, the highest epoch any process used.

        The source is awaited only when the row must be created; if it fails,
        acquiring fails (the Loop retries) rather than risking a lower epoch.
        """
        self._epochs.use_floor(reconciler_id, source)

    def drop_epoch_floor(self, reconciler_id: str, source: EpochFloor) -> None:
        """Forget ``source`` as the floor of ``reconciler_id`` if it is the one registered."""
        self._epochs.drop_floor(reconciler_id, source)

    async def migrate(self) -> None:
        """Create the lease table if it does not exist (idempotent, safe across processes)."""
        await self._database.migrate()

    @property
    def table(self) -> str:
        """The quoted, schema-qualifiable name of the lease table."""
        return self._table

    async def list_leases(self) -> list[LeaseRecord]:
        """Every lease row, by reconciler id; none when the table does not exist yet."""
        pool = await self._database.existing_pool()
        try:
            rows = await pool.fetch(self._list_sql)
        except asyncpg.UndefinedTableError:
            return []
        return [
            LeaseRecord(
                namespace=None,
                reconciler_id=row["reconciler_id"],
                holder_id=row["holder_id"] or "",
                epoch=row["epoch"],
                acquired_at=row["acquired_at"],
                renewed_at=row["renewed_at"],
                expires_at=row["expires_at"],
            )
            for row in rows
        ]

    async def acquire_lease(self, reconciler_id: str) -> LeaseToken:
        """Become the holder, or raise :class:`LeaseContended` naming the current one."""
        if not isinstance(reconciler_id, str) or not reconciler_id:
            raise ValueError(f"reconciler_id must be a non-empty string, got {reconciler_id!r}")
        pool = await self._database.pool()
        ttl = self._ttl.milliseconds
        try:
            row = await pool.fetchrow(self._take_sql, reconciler_id, self._holder_id, ttl)
        except asyncpg.NumericValueOutOfRangeError:  # epoch + 1 past bigint: a tampered row
            raise LeaseEpochExhausted(self._exhausted(reconciler_id, "its row")) from None
        if row is None:
            # Followed before the first read: a release heard in between is counted.
            self._followed.add(_payload(reconciler_id))
            heard, current = await self._read_heard(pool, reconciler_id)
            if current is not None and not self._is_listening():
                # Contended: listen from now on, and read again, so that a release after
                # the read is either heard or already counted (see wait_for_release).
                await self._listen()
                heard, current = await self._read_heard(pool, reconciler_id)
            if current is not None:
                self._heard_at_read[reconciler_id] = heard
                self._epochs.saw(reconciler_id, int(current["epoch"]))
                remaining = (current["expires_at"] - current["now"]).total_seconds()
                raise LeaseContended(_describe(reconciler_id, current), retry_after=remaining)
            seed = await self._seed_epoch(reconciler_id)
            row = await pool.fetchrow(self._create_sql, reconciler_id, self._holder_id, ttl, seed)
            if row is None:
                raise LeaseContended(
                    f"lease {reconciler_id!r} was created by another process meanwhile",
                    retry_after=self._ttl.seconds,  # the caller may wait for its release
                )
        elif row["taken"]:
            row = await self._above_the_floor(pool, reconciler_id, row)
        epoch = int(row["epoch"])
        self._epochs.saw(reconciler_id, epoch)
        return LeaseToken(
            reconciler_id=reconciler_id,
            holder_id=self._holder_id,
            epoch=epoch,
            acquired_at=row["acquired_at"],
            expires_at=row["expires_at"],
        )

    async def _above_the_floor(
        self, pool: asyncpg.Pool, reconciler_id: str, row: asyncpg.Record
    ) -> asyncpg.Record:
        """A row just taken over, with its epoch raised above the floor if it was below.

        A row edited by hand, or restored, may carry an epoch below what the fenced
        scope has led; the Loop would refuse to lead at it, and a step of one per
        attempt could take hours to climb back.
        """
        epoch = int(row["epoch"])
        wanted = await self._seed_epoch(reconciler_id, epoch - 1)
        if wanted <= epoch:
            return row
        raised = await pool.fetchrow(self._raise_sql, reconciler_id, self._holder_id, epoch, wanted)
        if raised is None:
            raise LeaseContended(
                f"lease {reconciler_id!r} was taken by another process while its epoch was "
                f"raised from {epoch} to the floor",
                retry_after=self._ttl.seconds,
            )
        return raised

    async def _seed_epoch(self, reconciler_id: str, current: int = 0) -> int:
        """The epoch of a change of holder: above ``current``, every epoch seen and the floor.

        It must fit in a bigint. An epoch this process remembers but that neither a
        row nor the floor shows any more (a row edited to the bound, then deleted to
        repair it) is forgotten rather than blocking every takeover until each
        replica restarts.
        """
        epoch = await self._epochs.next_epoch(reconciler_id, current)
        if epoch <= MAX_EPOCH:
            return epoch
        epoch = await self._epochs.next_epoch(reconciler_id, current, with_seen=False)
        if epoch <= MAX_EPOCH:
            self._epochs.forget_seen(reconciler_id)
            return epoch
        raise LeaseEpochExhausted(self._exhausted(reconciler_id, "the fenced store's epochs"))

    def _exhausted(self, reconciler_id: str, record: str) -> str:
        return (
            f"lease {reconciler_id!r} in {self._table} cannot take a new epoch: {record} "
            f"reached {MAX_EPOCH}, the largest a bigint holds. No fleet gets there by "
            f"handovers: it was written by hand. Repair, with every replica stopped: lower "
            f"the fenced store's epochs for this scope if they are that high, then "
            f"DELETE FROM {self._table} WHERE reconciler_id = '{reconciler_id}'"
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
        """Give the lease up so the next acquirer takes over now, and tell followers. Idempotent."""
        pool = await self._database.pool()
        await pool.execute(
            self._release_sql, token.reconciler_id, token.holder_id, token.epoch, self._channel
        )

    async def wait_for_release(self, reconciler_id: str) -> None:
        """Return when a holder releases the lease of ``reconciler_id`` (or may have).

        :meth:`release_lease` notifies a channel of the lease table in the very
        statement that releases. Followers hear it on one listening connection
        per elector, opened by the first contended :meth:`acquire_lease` (which
        then reads the row again, listening), kept, re-opened by the next one
        after it is lost, and closed by :meth:`close`. A contended acquire
        remembers how many releases of the lease had been heard when it read
        the row, so this returns at once when one was heard since, or when the
        connection was lost or re-opened since (a release may have gone
        unheard); otherwise when one is heard. Expiries and deleted rows are
        not notified: the caller's retry period covers them.

        The connection is never taken from the pool: a follower waits for as
        long as another replica leads, and a pool connection held that long
        could starve the renewals of leases this elector holds and the fenced
        writes sharing a (possibly small, borrowed) pool. Without a connection
        (a borrowed pool and no ``listen_dsn``, or opening one failed: it is
        retried one lease duration later), this waits out the lease duration.
        """
        listener = self._listener
        if listener is None or listener.is_closed():
            if self._may_listen():
                return  # lost since the read: the next acquire listens again
            await asyncio.sleep(self._ttl.seconds)
            return
        remembered = self._heard_at_read.get(reconciler_id)
        if remembered is None or remembered[0] != self._generation:
            return  # read before this connection listened: a release may have gone unheard
        payload = _payload(reconciler_id)
        while (
            self._listener is listener
            and self._is_listening()
            and self._heard[payload] == remembered[1]
        ):
            await self._wakeup.wait()

    async def close(self) -> None:
        """Close the listening connection, and the pool if it was created from a DSN."""
        self._closed = True
        listener, self._listener = self._listener, None
        self._wake()
        if listener is not None:
            try:
                await asyncio.wait_for(listener.close(), LISTEN_CONNECT_TIMEOUT)
            except Exception:  # closing is best effort; the socket goes either way
                listener.terminate()
        await self._database.close()

    # -- the listening connection ------------------------------------------------------

    async def _read_heard(
        self, pool: asyncpg.Pool, reconciler_id: str
    ) -> tuple[tuple[int, int], asyncpg.Record | None]:
        """The row, and what had been heard before reading it (connection, releases)."""
        heard = (self._generation, self._heard[_payload(reconciler_id)])
        return heard, await pool.fetchrow(self._read_sql, reconciler_id)

    def _is_listening(self) -> bool:
        return self._listener is not None and not self._listener.is_closed()

    def _may_listen(self) -> bool:
        return (
            self._listen_dsn is not None
            and not self._closed
            and loop_time() >= self._listen_backoff_until
        )

    async def _listen(self) -> None:
        """Open the listening connection unless it is open; a failure is logged, never raised."""
        if self._is_listening() or not self._may_listen():
            return
        async with self._listening:
            if self._is_listening() or not self._may_listen():
                return
            dsn = self._listen_dsn
            if dsn is None:  # _may_listen said no already; this narrows the type
                return
            connection: asyncpg.Connection | None = None
            try:
                # Well inside an acquire's deadline: an endpoint that hangs must not make
                # every contended acquire time out.
                timeout = min(LISTEN_CONNECT_TIMEOUT, self._ttl.seconds / 4)
                connection = await asyncpg.connect(dsn, timeout=timeout)
                await connection.add_listener(self._channel, self._heard_release)
            except BaseException as exc:
                if connection is not None:
                    connection.terminate()
                if not isinstance(exc, Exception):
                    raise  # cancelled (one caller's deadline): let it through, nothing left open
                self._listen_backoff_until = loop_time() + self._ttl.seconds
                logger.warning(
                    "cannot listen for lease releases on channel %r at %s (%r); for %.0f s "
                    "followers only retry every renew interval",
                    self._channel,
                    redact_dsn(dsn),
                    exc,
                    self._ttl.seconds,
                )
                return
            connection.add_termination_listener(self._lost)
            self._generation += 1
            self._listener = connection
            if self._closed:  # closed while connecting
                self._listener = None
                connection.terminate()

    def _heard_release(
        self, connection: asyncpg.Connection, pid: int, channel: str, payload: str
    ) -> None:
        # Only the leases this elector followed: anyone may NOTIFY the channel, and a
        # counter per unknown payload would grow without bound.
        if payload in self._followed:
            self._heard[payload] += 1
            self._wake()

    def _lost(self, connection: asyncpg.Connection) -> None:
        if connection is self._listener:
            self._listener = None
            self._wake()

    def _wake(self) -> None:
        """Wake every waiter; the next ones wait on a fresh event."""
        wakeup, self._wakeup = self._wakeup, asyncio.Event()
        wakeup.set()

    def __repr__(self) -> str:
        return (
            f"<PostgresLeaseElector holder={self._holder_id!r} table={self._table} "
            f"ttl={self._ttl.seconds}s at {self._database.describe()}>"
        )


def _channel(table: str) -> str:
    """The notification channel of a (quoted) lease table: ``<table>_released``, or a digest."""
    plain = table.replace('"', "")
    channel = f"{plain}_released"
    if len(channel.encode()) <= _MAX_CHANNEL:
        return channel
    return f"kopf_reconcile_released_{hashlib.sha256(plain.encode()).hexdigest()[:16]}"


def _payload(reconciler_id: str) -> str:
    """What a release of ``reconciler_id`` notifies (the SQL's ``left(reconciler_id, N)``)."""
    return reconciler_id[:_PAYLOAD_CHARS]


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
