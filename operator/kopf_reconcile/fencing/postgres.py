"""Monotonic-epoch fenced writes to PostgreSQL.

:class:`PostgresFencedRepository` keeps one fence row per entity, keyed by
``(scope, entity_id)``, recording the highest epoch that ever wrote to that
entity (``last_epoch``), the entity's tenant, its state document and when it
last changed. A write carrying ``epoch`` is applied only when
``last_epoch <= epoch``, and then advances ``last_epoch`` to ``epoch``: a
zombie leader that wakes up after one or more handovers carries a lower epoch
than the highest one seen and every late write of it is rejected by the
database itself, whatever the zombie believes about its lease.

Two kinds of mutation are fenced:

* a JSON document (a mapping): stored as the entity's state in ONE statement,
  ``INSERT … ON CONFLICT … DO UPDATE … WHERE last_epoch <= epoch RETURNING``,
  accepted if and only if a row comes back;
* an ``async def (connection) -> None`` callable, for the user's own tables:
  in one transaction the same statement checks and advances the fence (and
  keeps the fence row locked), then the callable runs on that connection. A
  stale epoch never runs the callable, and an error in it rolls everything
  back, fence included.

A stale epoch is answered with ``False``; a lost connection, a timeout or any
other database error propagates as an exception (a transient error for the
Loop), never as a silent accept or reject. Cancelling a call cancels its
statement on the server and rolls back its transaction; like a lost reply, a
cancelled document write may still have been applied if the server finished
it first — it then carried a current epoch, so fencing still holds.

Scope: a repository given to a Loop is bound to it (:meth:`bind_loop`) and
scopes its rows by the Loop's reconciler id unless ``scope=`` was given, so
two reconcilers sharing a table never fence each other; used alone, the scope
is ``"default"``. The tenant stored with each row comes from the Loop's
:class:`~kopf_reconcile.tenancy.Tenancy` (``_notenant`` when single-tenant).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from typing import Any

import asyncpg

from kopf_reconcile._cogs.closing import AsyncClosing
from kopf_reconcile._cogs.pg import Database, qualified_table
from kopf_reconcile.config import ConfigError
from kopf_reconcile.tenancy import Tenancy

__all__ = ["DEFAULT_FENCE_TABLE", "DEFAULT_SCOPE", "PostgresFencedRepository"]

DEFAULT_FENCE_TABLE = "kopf_reconcile_fence"
DEFAULT_SCOPE = "default"
_MAX_EPOCH = 2**63 - 1  # bigint
# Compact, and strict: PostgreSQL's jsonb rejects NaN and Infinity.
_JSON = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


class _Rejected(Exception):
    """Raised inside the transaction of a callable mutation to roll it back."""


class PostgresFencedRepository(AsyncClosing):
    """A :class:`~kopf_reconcile.fencing.protocol.FencedRepository` on PostgreSQL (asyncpg)."""

    def __init__(
        self,
        dsn_or_pool: str | asyncpg.Pool,
        table: str = DEFAULT_FENCE_TABLE,
        scope: str | None = None,
    ) -> None:
        """Rows live in ``table``; ``scope`` defaults to the bound Loop's reconciler id."""
        if scope is not None and (not isinstance(scope, str) or not scope):
            raise ConfigError(f"scope must be a non-empty string or None, got {scope!r}")
        self._table = qualified_table("table", table)
        self._explicit_scope = scope
        self._scope = scope if scope is not None else DEFAULT_SCOPE
        self._tenancy = Tenancy.SINGLE_TENANT
        self._bound_to: tuple[str, Tenancy] | None = None
        # The epochs that led each scope, recorded before they write (see record_epoch).
        self._epochs = qualified_table("table", f"{table}_epochs")
        self._database = Database(
            dsn_or_pool,
            table=self._table,
            schema=[_schema(self._table), _epochs_schema(self._epochs)],
        )
        # The fence check and advance: inserting a new entity always succeeds; an
        # existing row is updated only when its epoch is not higher than ours. A
        # callable mutation passes a NULL state, which keeps the stored one.
        self._cas_sql = f"""
            INSERT INTO {self._table} AS fence
                (scope, entity_id, tenant, last_epoch, state, updated_at)
            VALUES ($1, $2, $3, $4, $5::jsonb, now())
            ON CONFLICT (scope, entity_id) DO UPDATE
               SET last_epoch = EXCLUDED.last_epoch,
                   state = COALESCE(EXCLUDED.state, fence.state),
                   updated_at = EXCLUDED.updated_at
             WHERE fence.last_epoch <= $4
            RETURNING true
        """
        self._state_sql = (
            f"SELECT state::text FROM {self._table} WHERE scope = $1 AND entity_id = $2"
        )
        self._epoch_sql = (
            f"SELECT last_epoch FROM {self._table} WHERE scope = $1 AND entity_id = $2"
        )
        self._highest_sql = f"""
            SELECT GREATEST(
                (SELECT coalesce(max(last_epoch), 0) FROM {self._table} WHERE scope = $1),
                (SELECT coalesce(max(epoch), 0) FROM {self._epochs} WHERE scope = $1))
        """
        self._record_sql = f"""
            INSERT INTO {self._epochs} AS led (scope, epoch) VALUES ($1, $2)
            ON CONFLICT (scope) DO UPDATE SET epoch = GREATEST(led.epoch, EXCLUDED.epoch)
        """

    # -- configuration ---------------------------------------------------------

    def bind_loop(self, *, reconciler_id: str, tenancy: Tenancy) -> None:
        """Called by the Loop this repository is given to: adopt its scope and tenancy.

        Binding again to the same reconciler is a no-op; sharing one repository
        between Loops is refused unless an explicit ``scope`` makes it safe.
        """
        if not isinstance(reconciler_id, str) or not reconciler_id:
            raise ConfigError(f"reconciler_id must be a non-empty string, got {reconciler_id!r}")
        if not isinstance(tenancy, Tenancy):
            raise ConfigError(f"tenancy must be a Tenancy, got {tenancy!r}")
        if self._bound_to is not None and self._bound_to != (reconciler_id, tenancy):
            bound_id, bound_tenancy = self._bound_to
            if self._explicit_scope is None or bound_tenancy is not tenancy:
                raise ConfigError(
                    f"this PostgresFencedRepository is already bound to reconciler "
                    f"{bound_id!r} ({bound_tenancy.value}); cannot bind it to {reconciler_id!r} "
                    f"({tenancy.value}): give each Loop its own repository"
                )
        self._bound_to = (reconciler_id, tenancy)
        self._tenancy = tenancy
        if self._explicit_scope is None:
            self._scope = reconciler_id

    @property
    def scope(self) -> str:
        """The scope rows are keyed by (with the entity id)."""
        return self._scope

    @property
    def table(self) -> str:
        """The quoted, possibly schema-qualified table name."""
        return self._table

    async def migrate(self) -> None:
        """Create the table if it does not exist (idempotent, safe across processes)."""
        await self._database.migrate()

    # -- the fenced write ------------------------------------------------------

    async def apply_fenced(self, entity_id: str, epoch: int, mutation: object) -> bool:
        """Apply ``mutation`` if ``epoch >= last_epoch`` of the entity; ``False`` if stale."""
        tenant = self._tenant_of(entity_id)
        _check_epoch(epoch)
        if isinstance(mutation, Mapping):
            document = _json_document(entity_id, mutation)
            pool = await self._database.pool()
            accepted = await pool.fetchval(
                self._cas_sql, self._scope, entity_id, tenant, epoch, document
            )
            return accepted is not None
        if callable(mutation):
            return await self._apply_callable(entity_id, tenant, epoch, mutation)
        raise TypeError(
            f"unsupported fenced mutation type {type(mutation).__qualname__} for entity "
            f"{entity_id!r}: expected a JSON document (a mapping) or an "
            f"async callable taking an asyncpg connection"
        )

    async def _apply_callable(self, entity_id: str, tenant: str, epoch: int, mutation: Any) -> bool:
        pool = await self._database.pool()
        try:
            async with pool.acquire() as connection, connection.transaction():
                accepted = await connection.fetchval(
                    self._cas_sql, self._scope, entity_id, tenant, epoch, None
                )
                if accepted is None:
                    raise _Rejected
                outcome = mutation(connection)
                if not inspect.isawaitable(outcome):
                    raise TypeError(
                        f"fenced mutation {mutation!r} for entity {entity_id!r} returned "
                        f"{type(outcome).__qualname__}, not an awaitable: it must be an "
                        f"async callable taking an asyncpg connection"
                    )
                await outcome
        except _Rejected:
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

    async def record_epoch(self, epoch: int) -> None:
        """Record that ``epoch`` leads this scope, before it writes anything.

        :meth:`highest_epoch` then covers it, so an elector whose lease record was
        deleted never hands the same epoch to a second leader. Kept per scope in
        the table ``<table>_epochs``, and only ever raised.
        """
        _check_epoch(epoch)
        pool = await self._database.pool()
        await pool.execute(self._record_sql, self._scope, epoch)

    async def highest_epoch(self) -> int:
        """The highest epoch recorded in this scope (0 if none).

        An elector whose own epoch counter can be lost (a deleted Kubernetes
        Lease) seeds a new counter from this so epochs never go backwards. It
        scans the scope's rows: call it when a lease is created, not per write.
        """
        pool = await self._database.pool()
        return int(await pool.fetchval(self._highest_sql, self._scope))

    # -- lifecycle -------------------------------------------------------------

    async def close(self) -> None:
        """Close the pool if it was created from a DSN (a borrowed pool stays open)."""
        await self._database.close()

    def __repr__(self) -> str:
        return (
            f"<PostgresFencedRepository table={self._table} scope={self._scope!r} "
            f"at {self._database.describe()}>"
        )

    def _tenant_of(self, entity_id: str) -> str:
        if not isinstance(entity_id, str):
            raise TypeError(f"entity_id must be a str, got {type(entity_id).__qualname__}")
        if not entity_id:
            raise ValueError("entity_id must not be empty")
        return self._tenancy.tenant_of(entity_id)


def _schema(table: str) -> str:
    return f"""
        CREATE TABLE IF NOT EXISTS {table} (
            scope      text        NOT NULL,
            entity_id  text        NOT NULL,
            tenant     text        NOT NULL,
            last_epoch bigint      NOT NULL CHECK (last_epoch >= 0),
            state      jsonb,
            updated_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (scope, entity_id)
        )
    """


def _epochs_schema(table: str) -> str:
    return f"""
        CREATE TABLE IF NOT EXISTS {table} (
            scope text   PRIMARY KEY,
            epoch bigint NOT NULL CHECK (epoch >= 0)
        )
    """


def _check_epoch(epoch: object) -> None:
    # bool is an int subclass; True as an epoch is a bug, not epoch 1.
    if isinstance(epoch, bool) or not isinstance(epoch, int):
        raise TypeError(f"epoch must be an int, got {type(epoch).__qualname__} {epoch!r}")
    if not 0 <= epoch <= _MAX_EPOCH:
        raise ValueError(f"epoch must be between 0 and {_MAX_EPOCH}, got {epoch}")


def _json_document(entity_id: str, document: Mapping[Any, Any]) -> str:
    try:
        return _JSON.encode(document if isinstance(document, dict) else dict(document))
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"fenced document for entity {entity_id!r} is not JSON-serialisable: {exc}"
        ) from exc
