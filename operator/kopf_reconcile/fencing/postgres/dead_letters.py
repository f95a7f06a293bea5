"""Dead letters and redrive requests, fenced as document writes are.

A dead letter is recorded and cleared by the scope's leader only, under the same fence as
a document write (below the scope's epoch, nothing changes): the
:class:`~kopf_reconcile.fencing.protocol.DeadLetterStore` protocol, used by the Loop's
:mod:`~kopf_reconcile.dead_letters`. A redrive request (``kopf-reconcile redrive``) is
taken by the scope's leader only, and the take is fenced too. The listing and the
requests serve ``kopf-reconcile dead-letters`` and ``kopf-reconcile redrive``.
"""

from __future__ import annotations

import asyncio
import functools

import asyncpg

from kopf_reconcile.fencing.postgres.base import Rejected, RepositoryBase, check_epoch
from kopf_reconcile.fencing.postgres.layout import OF_RECONCILER
from kopf_reconcile.fencing.protocol import DeadLetter

__all__ = ["MAX_REASON", "REDRIVE_ATTEMPTS", "DeadLetters"]

REDRIVE_ATTEMPTS = 5  # a redrive request whose dead letters a reshard moved is made again
MAX_REASON = 4096  # characters of a dead letter's reason kept


class DeadLetters(RepositoryBase):
    """Durable dead letters of each scope, and the requests to redrive them."""

    @functools.cached_property
    def _led(self) -> str:
        return f"WITH led AS (SELECT epoch FROM {self._epochs} WHERE scope = $1 FOR SHARE)"

    @functools.cached_property
    def _dead_record_sql(self) -> str:
        led = self._led
        # Dead letters are fenced as writes are: below the scope's epoch, nothing changes.
        return f"""
            {led}
            INSERT INTO {self._dead} AS dead
                (scope, entity_id, tenant, reason, first_at, last_at, attempts, epoch)
            SELECT $1, $2, $3, $4, now(), now(), 1, $5
             WHERE $5 >= coalesce((SELECT epoch FROM led), 0)
            ON CONFLICT (scope, entity_id) DO UPDATE
               SET reason = EXCLUDED.reason, last_at = EXCLUDED.last_at,
                   attempts = dead.attempts + 1, epoch = EXCLUDED.epoch
             WHERE dead.epoch <= $5
            RETURNING true
        """

    @functools.cached_property
    def _dead_clear_sql(self) -> str:
        led = self._led
        return f"""
            {led}, cleared AS (
                DELETE FROM {self._dead} WHERE scope = $1 AND entity_id = $2
                   AND $3 >= coalesce((SELECT epoch FROM led), 0) RETURNING 1)
            SELECT $3 >= coalesce((SELECT epoch FROM led), 0)
        """

    @functools.cached_property
    def _take_redrives_sql(self) -> str:
        led = self._led
        return f"""
            {led}
            DELETE FROM {self._redrives}
             WHERE scope = $1 AND $2 >= coalesce((SELECT epoch FROM led), 0)
            RETURNING entity_id
        """

    @functools.cached_property
    def _dead_list_sql(self) -> str:
        return f"""
            SELECT scope, entity_id, reason, first_at, last_at, attempts, epoch
              FROM {self._dead}
             WHERE ($1::text IS NULL OR {OF_RECONCILER.format(scope="scope", given="$1")})
               AND ($2::text IS NULL OR starts_with(entity_id, $2 || '/'))
             ORDER BY scope, entity_id
        """

    @functools.cached_property
    def _redrive_where(self) -> str:
        # A redrive request first share-locks the epochs rows of the scopes it writes to,
        # in scope order (the order of a reshard's exclusive locks: no deadlock), so a
        # reshard moving those scopes' rows commits before it or after it. Then, in a new
        # snapshot, it requests the dead letters of the scopes it locked, in key order (as
        # any other request: no deadlock), and tells the caller every dead letter it saw:
        # one in a scope it did not lock moved meanwhile, and the request is made again.
        # An existing request is left as it is (not locked: a take can delete it).
        return (
            "($1::text IS NULL OR entity_id = $1) AND ($2::text IS NULL OR "
            f"{OF_RECONCILER.format(scope='scope', given='$2')})"
        )

    @functools.cached_property
    def _redrive_lock_sql(self) -> str:
        where = self._redrive_where
        return f"""
            SELECT scope FROM {self._epochs}
             WHERE scope IN (SELECT scope FROM {self._dead} WHERE {where})
             ORDER BY scope FOR SHARE
        """

    @functools.cached_property
    def _redrive_sql(self) -> str:
        where = self._redrive_where
        return f"""
            WITH wanted AS (SELECT scope, entity_id FROM {self._dead} WHERE {where}),
                 requested AS (
                    INSERT INTO {self._redrives} (scope, entity_id)
                    SELECT scope, entity_id FROM wanted WHERE scope = ANY($3::text[])
                     ORDER BY scope, entity_id
                    ON CONFLICT (scope, entity_id) DO NOTHING)
            SELECT scope, entity_id FROM wanted
        """

    # -- dead letters (the DeadLetterStore protocol) ------------------------------

    async def record_dead_letter(self, entity_id: str, epoch: int, reason: str) -> bool:
        """Record (or count once more) a dead letter; ``False`` for a stale epoch."""
        tenant = self._tenant_of(entity_id)
        check_epoch(epoch)
        reason = reason if len(reason) <= MAX_REASON else reason[: MAX_REASON - 1] + "…"
        async with asyncio.timeout(self._write_timeout):
            pool = await self._ready_pool()
            done = await pool.fetchval(
                self._dead_record_sql, self._scope, entity_id, tenant, reason, epoch
            )
        return done is not None

    async def clear_dead_letter(self, entity_id: str, epoch: int) -> bool:
        """Forget the dead letter of ``entity_id`` (it succeeded); ``False`` for a stale epoch."""
        self._tenant_of(entity_id)
        check_epoch(epoch)
        async with asyncio.timeout(self._write_timeout):
            pool = await self._ready_pool()
            return bool(await pool.fetchval(self._dead_clear_sql, self._scope, entity_id, epoch))

    async def dead_letters(self) -> list[DeadLetter]:
        """This scope's dead letters."""
        await self._ready_pool()  # the tables, as a writer needs them
        return await self.list_dead_letters(scope=self._scope)

    async def take_redrives(self, epoch: int) -> list[str]:
        """Consume this scope's redrive requests; nothing for a stale epoch."""
        check_epoch(epoch)
        async with asyncio.timeout(self._write_timeout):
            pool = await self._ready_pool()
            rows = await pool.fetch(self._take_redrives_sql, self._scope, epoch)
        return sorted(row["entity_id"] for row in rows)

    # -- for operators of the operator (kopf-reconcile dead-letters, redrive, status) --

    async def list_dead_letters(
        self, *, scope: str | None = None, namespace: str | None = None
    ) -> list[DeadLetter]:
        """Dead letters of every scope (or of ``scope`` and its shard scopes
        ``<scope>-shard-<k>``), of one namespace's entities if given.

        Creates nothing: without the tables there is no dead letter.
        """
        pool = await self._database.existing_pool()
        try:
            rows = await pool.fetch(self._dead_list_sql, scope, namespace)
        except asyncpg.UndefinedTableError:
            return []
        return [
            DeadLetter(
                reconciler_id=row["scope"],
                entity_id=row["entity_id"],
                reason=row["reason"],
                first_at=row["first_at"],
                last_at=row["last_at"],
                attempts=int(row["attempts"]),
                epoch=int(row["epoch"]),
            )
            for row in rows
        ]

    async def request_redrive(
        self, entity_id: str | None = None, *, scope: str | None = None
    ) -> list[str]:
        """Ask the leaders to retry dead-lettered entities: ``entity_id``, or all of them
        (of ``scope`` and its shard scopes ``<scope>-shard-<k>`` if given). The entities
        asked for; the leaders take the requests.

        Each request lands in the scope its dead letter is in when the request commits:
        it share-locks the epochs rows of those scopes first (a reshard, which locks them
        exclusively, moves the rows before or after it, never meanwhile). Waits for a
        reshard in progress, up to ``lock_timeout``.
        """
        pool = await self._database.existing_pool()
        try:
            for _ in range(REDRIVE_ATTEMPTS):
                try:
                    async with pool.acquire() as connection, connection.transaction():
                        await self._bound_transaction(connection)
                        locked = [
                            row["scope"]
                            for row in await connection.fetch(
                                self._redrive_lock_sql, entity_id, scope
                            )
                        ]
                        rows = await connection.fetch(self._redrive_sql, entity_id, scope, locked)
                        moved = {row["scope"] for row in rows} - set(locked)
                        if moved:
                            raise Rejected
                    return sorted(row["entity_id"] for row in rows)
                except Rejected:
                    # Dead letters moved by a reshard after their scopes were read (or in
                    # a scope with no epochs row yet): rolled back; again, locking theirs.
                    await pool.execute(self._scope_rows_sql, sorted(moved))
        except asyncpg.UndefinedTableError:
            return []
        raise RuntimeError(
            f"redrive request not made: the dead letters kept moving between scopes "
            f"({REDRIVE_ATTEMPTS} attempts; is a reshard running again and again?)"
        )
