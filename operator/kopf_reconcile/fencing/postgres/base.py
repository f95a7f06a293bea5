"""What every concern of the PostgreSQL fenced repository shares: its tables and pool,
its scope, and the bounds of its transactions.

Bounded waits. A writer paused inside a callable mutation (a stopped process,
a hung ``await``) keeps its transaction, its row lock and its scope lock.
So every transaction of this repository (SQL mutations, epoch recordings)
runs with ``lock_timeout`` (how long a statement waits for a lock),
``statement_timeout`` and ``idle_in_transaction_session_timeout`` (the server
aborts a transaction whose client went silent, and with it the paused
writer's late commit): a pool made from a DSN gets them on every connection,
a borrowed pool per transaction. A document write on a borrowed pool is one
statement, which a paused client cannot hold open: it finishes on the server
as soon as the locks it waits for are free (their holders are bounded as
above). The whole :meth:`apply_fenced` call is bounded by ``write_timeout``
on the client side too.
Defaults: 5 s, 30 s, 10 s and 30 s; a new leader's :meth:`record_epoch` behind
a paused writer therefore fails within ``lock_timeout`` (the Loop retries) and
succeeds once the server has aborted the paused transaction.

Scope: a repository given to a Loop is bound to it (:meth:`bind_loop`) and
scopes its rows by the Loop's reconciler id unless ``scope=`` was given; used
alone, the scope is ``"default"``. One scope is numbered by one lease: a
repository is bound to one reconciler only, and :meth:`record_epoch` refuses
(:class:`~kopf_reconcile.ConfigError`) a scope already led under another
reconciler's lease, since two independent epoch sequences would fence each
other (or let one lease's zombie through the other's fence). The tenant
stored with each row comes from the Loop's
:class:`~kopf_reconcile.tenancy.Tenancy` (``_notenant`` when single-tenant).
"""

from __future__ import annotations

import functools

import asyncpg

from kopf_reconcile.api import ConfigError, Duration, positive_seconds
from kopf_reconcile.closing import AsyncClosing
from kopf_reconcile.database import Database
from kopf_reconcile.fencing.postgres.layout import ShardLayout
from kopf_reconcile.fencing.postgres.schema import DEFAULT_FENCE_TABLE, Tables
from kopf_reconcile.tenancy import Tenancy

__all__ = ["DEFAULT_SCOPE", "Rejected", "RepositoryBase", "check_epoch"]

DEFAULT_SCOPE = "default"
DEFAULT_LOCK_TIMEOUT = 5.0  # a statement waits this long for a row or scope lock
DEFAULT_STATEMENT_TIMEOUT = 30.0  # one statement of a fenced write, the user's SQL included
DEFAULT_IDLE_IN_TRANSACTION_TIMEOUT = 10.0  # a silent client's transaction is aborted then
DEFAULT_WRITE_TIMEOUT = 30.0  # one apply_fenced call, end to end
_MAX_EPOCH = 2**63 - 1  # bigint


class Rejected(Exception):
    """Raised inside a transaction to roll it back (a stale callable mutation, a redrive
    request whose dead letters moved)."""


class RepositoryBase(AsyncClosing):
    """The state of a fenced repository: tables, pool, scope and tenancy, timeouts.

    Each concern (documents, epochs, shard layouts, dead letters) is a subclass of it;
    :class:`~kopf_reconcile.fencing.postgres.PostgresFencedRepository` joins them.
    Statements are built from the table names on first use.
    """

    def __init__(
        self,
        dsn_or_pool: str | asyncpg.Pool,
        table: str = DEFAULT_FENCE_TABLE,
        scope: str | None = None,
        *,
        lock_timeout: Duration = DEFAULT_LOCK_TIMEOUT,
        statement_timeout: Duration = DEFAULT_STATEMENT_TIMEOUT,
        idle_in_transaction_timeout: Duration = DEFAULT_IDLE_IN_TRANSACTION_TIMEOUT,
        write_timeout: Duration = DEFAULT_WRITE_TIMEOUT,
    ) -> None:
        """Rows live in ``table``; ``scope`` defaults to the bound Loop's reconciler id.

        The timeouts (seconds or timedelta) bound how long a paused or hung writer
        can hold up another: see the module documentation.
        """
        if scope is not None and (not isinstance(scope, str) or not scope):
            raise ConfigError(f"scope must be a non-empty string or None, got {scope!r}")
        tables = Tables.named(table)
        self._tables = tables
        self._table = tables.fence
        self._explicit_scope = scope
        self._scope = scope if scope is not None else DEFAULT_SCOPE
        self._tenancy = Tenancy.SINGLE_TENANT
        self._bound_to: tuple[str, Tenancy] | None = None
        self._write_timeout = positive_seconds("write_timeout", write_timeout)
        # Server settings in milliseconds, as PostgreSQL reads a bare number.
        self._settings = {
            "lock_timeout": _milliseconds("lock_timeout", lock_timeout),
            "statement_timeout": _milliseconds("statement_timeout", statement_timeout),
            "idle_in_transaction_session_timeout": _milliseconds(
                "idle_in_transaction_timeout", idle_in_transaction_timeout
            ),
        }
        # The epochs that led each scope, recorded before they write (see record_epoch).
        self._epochs = tables.epochs
        # Durable dead letters, redrive requests and the leadership changes of each scope.
        self._dead = tables.dead
        self._redrives = tables.redrives
        self._leaders = tables.leaders
        self._database = Database(
            dsn_or_pool,
            table=self._table,
            schema=tables.schema(),
            server_settings=self._settings,
        )
        self._scopes_ready: set[str] = set()
        # The layout this repository's shards run (record_shard_count), and, in a shard's
        # repository (for_shard), the one its record_epoch verifies in the base scope.
        self._shards_layout = ShardLayout()
        self._layout_check: ShardLayout | None = None

    @functools.cached_property
    def _scope_row_sql(self) -> str:
        return f"INSERT INTO {self._epochs} (scope, epoch) VALUES ($1, 0) ON CONFLICT DO NOTHING"

    @functools.cached_property
    def _scope_rows_sql(self) -> str:
        return (
            f"INSERT INTO {self._epochs} (scope, epoch) SELECT unnest($1::text[]), 0 "
            "ON CONFLICT DO NOTHING"
        )

    _local_settings_sql = (
        "SELECT set_config('lock_timeout', $1, true),"
        " set_config('statement_timeout', $2, true),"
        " set_config('idle_in_transaction_session_timeout', $3, true)"
    )

    # -- configuration ---------------------------------------------------------

    def bind_loop(self, *, reconciler_id: str, tenancy: Tenancy) -> None:
        """Called by the Loop this repository is given to: adopt its scope and tenancy.

        Binding again to the same reconciler is a no-op; binding to another one is
        refused, explicit scope or not: one scope's epochs come from one lease.
        """
        if not isinstance(reconciler_id, str) or not reconciler_id:
            raise ConfigError(f"reconciler_id must be a non-empty string, got {reconciler_id!r}")
        if not isinstance(tenancy, Tenancy):
            raise ConfigError(f"tenancy must be a Tenancy, got {tenancy!r}")
        if self._bound_to is not None and self._bound_to != (reconciler_id, tenancy):
            bound_id, bound_tenancy = self._bound_to
            raise ConfigError(
                f"this PostgresFencedRepository (scope {self._scope!r}) is already bound to "
                f"reconciler {bound_id!r} ({bound_tenancy.value}); cannot bind it to "
                f"{reconciler_id!r} ({tenancy.value}): each reconciler's lease numbers its own "
                f"epochs, so give each Loop its own repository and scope"
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
        """Create the tables if they do not exist (idempotent, safe across processes)."""
        await self._database.migrate()

    # -- lifecycle -------------------------------------------------------------

    async def close(self) -> None:
        """Close the pool if it was created from a DSN (a borrowed pool stays open)."""
        await self._database.close()

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} table={self._table} scope={self._scope!r} "
            f"at {self._database.describe()}>"
        )

    async def _ready_pool(self) -> asyncpg.Pool:
        """The pool, with this scope's epoch row in place (the row writes share-lock).

        Without the row, a write would lock nothing and could not be ordered with
        the scope's first recorded epoch.
        """
        pool = await self._database.pool()
        scope = self._scope
        if scope not in self._scopes_ready:
            await pool.execute(self._scope_row_sql, scope)
            self._scopes_ready.add(scope)
        return pool

    async def _bound_transaction(self, connection: asyncpg.Connection) -> None:
        """Apply the timeouts to this transaction (a borrowed pool has its own settings)."""
        if not self._database.owns_pool:
            settings = self._settings
            await connection.fetchrow(
                self._local_settings_sql,
                settings["lock_timeout"],
                settings["statement_timeout"],
                settings["idle_in_transaction_session_timeout"],
            )

    def _tenant_of(self, entity_id: str) -> str:
        if not isinstance(entity_id, str):
            raise TypeError(f"entity_id must be a str, got {type(entity_id).__qualname__}")
        if not entity_id:
            raise ValueError("entity_id must not be empty")
        return self._tenancy.tenant_of(entity_id)


def _milliseconds(option: str, value: Duration) -> str:
    return str(max(1, round(positive_seconds(option, value) * 1000)))


def check_epoch(epoch: object) -> None:
    # bool is an int subclass; True as an epoch is a bug, not epoch 1.
    if isinstance(epoch, bool) or not isinstance(epoch, int):
        raise TypeError(f"epoch must be an int, got {type(epoch).__qualname__} {epoch!r}")
    if not 0 <= epoch <= _MAX_EPOCH:
        raise ValueError(f"epoch must be between 0 and {_MAX_EPOCH}, got {epoch}")
