"""The fenced write: a JSON document or the user's SQL, applied only at a current epoch.

A write carrying ``epoch`` is applied only when ``epoch >= last_epoch`` of
its entity **and** ``epoch >=`` the epoch recorded for its scope, and then
advances ``last_epoch``. So a zombie leader that wakes up after one or more
handovers is rejected by the database itself, for every entity of the scope,
including entities the new leader has not written yet.

Ordering. Every write takes a shared lock on its scope's row in
``<table>_epochs`` (``SELECT … FOR SHARE``) and keeps it until it commits;
recording an epoch updates that row, which waits for every write holding the
lock. A write that started before the recording commits first (it was
legitimate: the new leader had not led yet); a write that comes after waits
for the recording, then reads the new epoch (PostgreSQL re-reads a row it
waited to lock, in READ COMMITTED) and is rejected if it is older. No older
write can commit after a newer epoch is recorded.

Two kinds of mutation are fenced:

* a JSON document (a mapping): stored as the entity's state in ONE statement
  (``WITH led AS (… FOR SHARE) INSERT … SELECT … WHERE epoch >= led
  ON CONFLICT … DO UPDATE … WHERE last_epoch <= epoch RETURNING``), accepted
  if and only if a row comes back;
* an ``async def (connection) -> None`` callable, for the user's own tables:
  in one transaction the same statement checks and advances the fence (and
  keeps the fence row and the scope lock), then the callable runs on that
  connection. A stale epoch never runs the callable, and an error in it rolls
  everything back, fence included.

A stale epoch is answered with ``False``; a lost connection, a timeout or any
other database error propagates as an exception (a transient error for the
Loop), never as a silent accept or reject. Cancelling a call cancels its
statement on the server and rolls back its transaction; like a lost reply, a
cancelled document write may still have been applied if the server finished
it first — it then carried a current epoch, so fencing still holds.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
from collections.abc import Mapping
from typing import Any

from kopf_reconcile.fencing.postgres.base import Rejected, RepositoryBase, check_epoch

__all__ = ["FencedDocuments"]

_STILL_VALID = "SELECT 1"  # fails (InFailedSQLTransactionError) in an aborted transaction
# Compact, and strict: PostgreSQL's jsonb rejects NaN and Infinity.
_JSON = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


class FencedDocuments(RepositoryBase):
    """Fenced writes (:meth:`apply_fenced`) and the reads of what they stored."""

    @functools.cached_property
    def _cas_sql(self) -> str:
        # The fence check and advance. The CTE share-locks the scope's epoch row
        # until commit (ordering this write with any recording of a new epoch) and
        # reads the epoch that led the scope: below it, no row is proposed at all.
        # A new entity is then inserted; an existing row is updated only when its
        # epoch is not higher than ours. A callable mutation passes a NULL state,
        # which keeps the stored one.
        return f"""
            WITH led AS (SELECT epoch FROM {self._epochs} WHERE scope = $1 FOR SHARE)
            INSERT INTO {self._table} AS fence
                (scope, entity_id, tenant, last_epoch, state, updated_at)
            SELECT $1, $2, $3, $4, $5::jsonb, now()
             WHERE $4 >= coalesce((SELECT epoch FROM led), 0)
            ON CONFLICT (scope, entity_id) DO UPDATE
               SET last_epoch = EXCLUDED.last_epoch,
                   state = COALESCE(EXCLUDED.state, fence.state),
                   updated_at = EXCLUDED.updated_at
             WHERE fence.last_epoch <= $4
            RETURNING true
        """

    @functools.cached_property
    def _state_sql(self) -> str:
        return f"SELECT state::text FROM {self._table} WHERE scope = $1 AND entity_id = $2"

    @functools.cached_property
    def _epoch_sql(self) -> str:
        return f"SELECT last_epoch FROM {self._table} WHERE scope = $1 AND entity_id = $2"

    # -- the fenced write ------------------------------------------------------

    async def apply_fenced(self, entity_id: str, epoch: int, mutation: object) -> bool:
        """Apply ``mutation`` if ``epoch`` is current for the entity and its scope.

        ``False`` when the entity or the scope has seen a higher epoch.
        """
        tenant = self._tenant_of(entity_id)
        check_epoch(epoch)
        if isinstance(mutation, Mapping):
            document = _json_document(entity_id, mutation)
            async with asyncio.timeout(self._write_timeout):
                pool = await self._ready_pool()
                accepted = await pool.fetchval(
                    self._cas_sql, self._scope, entity_id, tenant, epoch, document
                )
            return accepted is not None
        if callable(mutation):
            async with asyncio.timeout(self._write_timeout):
                return await self._apply_callable(entity_id, tenant, epoch, mutation)
        raise TypeError(
            f"unsupported fenced mutation type {type(mutation).__qualname__} for entity "
            f"{entity_id!r}: expected a JSON document (a mapping) or an "
            f"async callable taking an asyncpg connection"
        )

    async def _apply_callable(self, entity_id: str, tenant: str, epoch: int, mutation: Any) -> bool:
        pool = await self._ready_pool()
        try:
            async with pool.acquire() as connection, connection.transaction():
                await self._bound_transaction(connection)
                accepted = await connection.fetchval(
                    self._cas_sql, self._scope, entity_id, tenant, epoch, None
                )
                if accepted is None:
                    raise Rejected
                outcome = mutation(connection)
                if not inspect.isawaitable(outcome):
                    raise TypeError(
                        f"fenced mutation {mutation!r} for entity {entity_id!r} returned "
                        f"{type(outcome).__qualname__}, not an awaitable: it must be an "
                        f"async callable taking an asyncpg connection"
                    )
                await outcome
                # A mutation that caught an SQL error left the transaction aborted, and
                # COMMIT would then roll back without a word: make that an error here.
                await connection.execute(_STILL_VALID)
        except Rejected:
            return False
        return True

    # -- readers -------------------------------------------------------------

    async def get_state(self, entity_id: str) -> dict[str, Any] | None:
        """The entity's last accepted document, or ``None`` (no row, or no document yet)."""
        pool = await self._database.pool()
        text = await pool.fetchval(self._state_sql, self._scope, entity_id)
        return None if text is None else dict(json.loads(text))

    async def last_epoch(self, entity_id: str) -> int | None:
        """The highest epoch that wrote to the entity, or ``None`` if none ever did."""
        pool = await self._database.pool()
        epoch = await pool.fetchval(self._epoch_sql, self._scope, entity_id)
        return None if epoch is None else int(epoch)


def _json_document(entity_id: str, document: Mapping[Any, Any]) -> str:
    try:
        return _JSON.encode(document if isinstance(document, dict) else dict(document))
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"fenced document for entity {entity_id!r} is not JSON-serialisable: {exc}"
        ) from exc
