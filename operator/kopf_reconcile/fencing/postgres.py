"""Monotonic-epoch fenced writes to PostgreSQL, fenced per entity and per scope.

(Over 400 lines on purpose: the fenced write, the recording of epochs and their SQL are
one atomic protocol.)

:class:`PostgresFencedRepository` keeps two tables:

* ``<table>``: one fence row per entity, keyed by ``(scope, entity_id)``,
  recording the highest epoch that ever wrote to that entity
  (``last_epoch``), the entity's tenant, its state document and when it last
  changed;
* ``<table>_epochs``: one row per scope, the highest epoch that has *led*
  it (recorded by the Loop before it dispatches, :meth:`record_epoch`), and
  the reconciler whose lease numbers that scope's epochs.

and, beside them, for operating the operator:

* ``<table>_dead_letters``: the dead letters of each scope (the
  :class:`~kopf_reconcile.fencing.protocol.DeadLetterStore` protocol, used by the
  Loop's :mod:`~kopf_reconcile.dead_letters`), written and cleared under the same
  fence as a document write;
* ``<table>_redrives``: redrive requests (``kopf-reconcile redrive``), taken by the
  scope's leader only (the take is fenced too);
* ``<table>_leaders``: each epoch that led each scope, when, and which epoch led
  before it (kept a day), for ``kopf-reconcile status``'s failovers in the last hour.

Sharded reconcilers (:meth:`for_shard`) fence each shard in a scope of its own, and
their base scope records the layout (:meth:`record_shard_count`). A shard scope's
:meth:`record_epoch` verifies that layout in the same transaction (it share-locks the
base scope's row), so a replica of another layout never starts leading a shard;
:meth:`reshard` changes the layout in one transaction that locks the base row
exclusively, fences every shard scope, old and new, above every epoch they have seen,
names in each the shard's lease qualified by the new layout (so a client without the
layout check, which requires the plain lease, is refused by the server), and moves each
entity's rows to its new shard scope (``kopf-reconcile reshard``). Lock order, in every
transaction that locks several epochs rows: by scope (a base scope sorts before its
shard scopes), then data rows; a redrive request (:meth:`request_redrive`) share-locks
the epochs rows of its scopes first, so it lands before a reshard moves them or after.

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

import asyncio
import copy
import dataclasses
import inspect
import json
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import asyncpg

from kopf_reconcile.api import ConfigError, Duration, positive_seconds
from kopf_reconcile.closing import AsyncClosing
from kopf_reconcile.database import Database, qualified_table
from kopf_reconcile.fencing.protocol import DeadLetter, ShardLayoutError, StaleEpochError
from kopf_reconcile.sharding import MAX_SHARDS, ShardAssignment, shard_id, validate_shards
from kopf_reconcile.tenancy import Tenancy

__all__ = ["DEFAULT_FENCE_TABLE", "DEFAULT_SCOPE", "PostgresFencedRepository", "ReshardReport"]

DEFAULT_FENCE_TABLE = "kopf_reconcile_fence"
DEFAULT_SCOPE = "default"
DEFAULT_LOCK_TIMEOUT = 5.0  # a statement waits this long for a row or scope lock
DEFAULT_STATEMENT_TIMEOUT = 30.0  # one statement of a fenced write, the user's SQL included
DEFAULT_IDLE_IN_TRANSACTION_TIMEOUT = 10.0  # a silent client's transaction is aborted then
DEFAULT_WRITE_TIMEOUT = 30.0  # one apply_fenced call, end to end
_MAX_EPOCH = 2**63 - 1  # bigint
REDRIVE_ATTEMPTS = 5  # a redrive request whose dead letters a reshard moved is made again
MAX_REASON = 4096  # characters of a dead letter's reason kept
LEADER_HISTORY = "1 day"  # how long the leadership changes of a scope are kept
_STILL_VALID = "SELECT 1"  # fails (InFailedSQLTransactionError) in an aborted transaction
# Compact, and strict: PostgreSQL's jsonb rejects NaN and Infinity.
_JSON = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


class _Rejected(Exception):
    """Raised inside a transaction to roll it back (a stale callable mutation, a redrive
    request whose dead letters moved)."""


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A layout recorded in a base scope: its scope, its lease, its assignment."""

    base_scope: str
    lease: str  # what the base scope's epochs row must name (layout_lease)
    assignment: ShardAssignment


@dataclasses.dataclass
class _ShardLayout:
    """The layout a sharded repository runs, shared by it and its shard repositories.

    Set by :meth:`PostgresFencedRepository.record_shard_count`; each shard's
    :meth:`~PostgresFencedRepository.record_epoch` checks the base scope against it.
    """

    current: _Layout | None = None


@dataclasses.dataclass(frozen=True)
class ReshardReport:
    """What :meth:`PostgresFencedRepository.reshard` did, in its one transaction."""

    scope: str  # the base scope
    reconciler_id: str  # whose shard leases are ``<reconciler_id>-shard-<k>``
    old_layout: str  # the lease the base scope recorded, ``<id>/shards=N[/by-namespace]``
    new_layout: str
    old_shards: int
    new_shards: int
    fence_epoch: int  # recorded as leading every shard scope, old and new
    moved: dict[int, int]  # new shard -> entities moved into it from another shard scope
    entities: dict[int, int]  # new shard -> entities fenced in it now
    dead_letters_moved: int
    redrives_moved: int
    duplicates_dropped: int  # redrive requests of one entity in two scopes, merged into one


def layout_lease(reconciler_id: str, shards: int, by_namespace: bool) -> str:
    """The lease a base scope's epochs row names for a layout (``<id>/shards=N[/by-namespace]``)."""
    return f"{reconciler_id}/shards={shards}" + ("/by-namespace" if by_namespace else "")


def shard_scope_lease(shard_lease: str, shards: int, by_namespace: bool) -> str:
    """What a shard scope's epochs row names once a reshard made ``shards`` its layout.

    ``<id>-shard-<k>@shards=N[/by-namespace]``: the shard's lease qualified by the layout.
    A shard's :meth:`~PostgresFencedRepository.record_epoch` of this release accepts it
    when its layout is that one, and a client of a release without the layout check
    (which requires the plain lease name) is refused by the server. It never contains
    ``/shards=``, so it is never taken for a base scope's layout (:func:`parse_layout`).
    """
    return f"{shard_lease}@shards={shards}" + ("/by-namespace" if by_namespace else "")


# A scope of a reconciler: its base scope ``given`` or one of its shard scopes
# ``<given>-shard-<k>`` (never another scope that merely starts with the same text).
_OF_RECONCILER = (
    "({scope} = {given} OR (starts_with({scope}, {given} || '-shard-') "
    "AND substr({scope}, char_length({given}) + 8) ~ '^[0-9]+$'))"
)

_LAYOUT = re.compile(r"(?s)(?P<id>.+)/shards=(?P<shards>[0-9]+)(?P<by_namespace>/by-namespace)?")


def parse_layout(lease: object) -> tuple[str, ShardAssignment] | None:
    """The reconciler id and assignment a base scope's lease names; ``None`` if unsharded."""
    found = _LAYOUT.fullmatch(lease) if isinstance(lease, str) else None
    if found is None:
        return None
    shards = int(found["shards"])
    if not 2 <= shards <= MAX_SHARDS:
        return None
    return found["id"], ShardAssignment(shards, bool(found["by_namespace"]))


class PostgresFencedRepository(AsyncClosing):
    """A :class:`~kopf_reconcile.fencing.protocol.FencedRepository` on PostgreSQL (asyncpg)."""

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
        self._table = qualified_table("table", table)
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
        self._epochs = qualified_table("table", f"{table}_epochs")
        # Durable dead letters, redrive requests and the leadership changes of each scope.
        self._dead = qualified_table("table", f"{table}_dead_letters")
        self._redrives = qualified_table("table", f"{table}_redrives")
        self._leaders = qualified_table("table", f"{table}_leaders")
        self._database = Database(
            dsn_or_pool,
            table=self._table,
            schema=[
                _schema(self._table),
                *_epochs_schema(self._epochs),
                *_side_tables_schema(self._dead, self._redrives, self._leaders),
            ],
            server_settings=self._settings,
        )
        led = f"WITH led AS (SELECT epoch FROM {self._epochs} WHERE scope = $1 FOR SHARE)"
        # Dead letters are fenced as writes are: below the scope's epoch, nothing changes.
        self._dead_record_sql = f"""
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
        self._dead_clear_sql = f"""
            {led}, cleared AS (
                DELETE FROM {self._dead} WHERE scope = $1 AND entity_id = $2
                   AND $3 >= coalesce((SELECT epoch FROM led), 0) RETURNING 1)
            SELECT $3 >= coalesce((SELECT epoch FROM led), 0)
        """
        self._take_redrives_sql = f"""
            {led}
            DELETE FROM {self._redrives}
             WHERE scope = $1 AND $2 >= coalesce((SELECT epoch FROM led), 0)
            RETURNING entity_id
        """
        self._dead_list_sql = f"""
            SELECT scope, entity_id, reason, first_at, last_at, attempts, epoch
              FROM {self._dead}
             WHERE ($1::text IS NULL OR {_OF_RECONCILER.format(scope="scope", given="$1")})
               AND ($2::text IS NULL OR starts_with(entity_id, $2 || '/'))
             ORDER BY scope, entity_id
        """
        # A redrive request first share-locks the epochs rows of the scopes it writes to,
        # in scope order (the order of a reshard's exclusive locks: no deadlock), so a
        # reshard moving those scopes' rows commits before it or after it. Then, in a new
        # snapshot, it requests the dead letters of the scopes it locked, in key order (as
        # any other request: no deadlock), and tells the caller every dead letter it saw:
        # one in a scope it did not lock moved meanwhile, and the request is made again.
        # An existing request is left as it is (not locked: a take can delete it).
        redrive_where = (
            "($1::text IS NULL OR entity_id = $1) AND ($2::text IS NULL OR "
            f"{_OF_RECONCILER.format(scope='scope', given='$2')})"
        )
        self._redrive_lock_sql = f"""
            SELECT scope FROM {self._epochs}
             WHERE scope IN (SELECT scope FROM {self._dead} WHERE {redrive_where})
             ORDER BY scope FOR SHARE
        """
        self._redrive_sql = f"""
            WITH wanted AS (SELECT scope, entity_id FROM {self._dead} WHERE {redrive_where}),
                 requested AS (
                    INSERT INTO {self._redrives} (scope, entity_id)
                    SELECT scope, entity_id FROM wanted WHERE scope = ANY($3::text[])
                     ORDER BY scope, entity_id
                    ON CONFLICT (scope, entity_id) DO NOTHING)
            SELECT scope, entity_id FROM wanted
        """
        self._scope_rows_sql = (
            f"INSERT INTO {self._epochs} (scope, epoch) SELECT unnest($1::text[]), 0 "
            "ON CONFLICT DO NOTHING"
        )
        self._led_sql = f"""
            INSERT INTO {self._leaders} (scope, epoch, holder, previous) VALUES ($1, $2, $3, $4)
            ON CONFLICT (scope, epoch) DO NOTHING
        """
        self._led_before_sql = f"SELECT epoch FROM {self._epochs} WHERE scope = $1"
        self._prune_leaders_sql = (
            f"DELETE FROM {self._leaders} WHERE scope = $1 "
            f"AND led_at < now() - interval '{LEADER_HISTORY}'"
        )
        self._changes_sql = f"""
            SELECT scope, count(*) FROM {self._leaders}
             WHERE led_at > now() - make_interval(secs => $1) AND previous > 0
             GROUP BY scope
        """
        self._scopes_ready: set[str] = set()
        # The layout this repository's shards run (record_shard_count), and, in a shard's
        # repository (for_shard), the one its record_epoch verifies in the base scope.
        self._shards_layout = _ShardLayout()
        self._layout_check: _ShardLayout | None = None
        self._base_layout_sql = f"SELECT lease FROM {self._epochs} WHERE scope = $1 FOR SHARE"
        # The fence check and advance. The CTE share-locks the scope's epoch row
        # until commit (ordering this write with any recording of a new epoch) and
        # reads the epoch that led the scope: below it, no row is proposed at all.
        # A new entity is then inserted; an existing row is updated only when its
        # epoch is not higher than ours. A callable mutation passes a NULL state,
        # which keeps the stored one.
        self._cas_sql = f"""
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
        self._scope_row_sql = (
            f"INSERT INTO {self._epochs} (scope, epoch) VALUES ($1, 0) ON CONFLICT DO NOTHING"
        )
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
        # Raising the scope's epoch takes its row exclusively: it waits for every
        # write holding the share lock. The first lease to record names the scope's
        # epoch sequence; another lease is refused by the caller.
        # The holder that led at the current epoch is kept: a lease record lost and
        # recreated can hand one epoch to two holders, and only the first may lead.
        # $5 is, for a shard, its lease qualified by its layout (shard_scope_lease): a
        # reshard names it in every shard scope, and it is kept as it is. A client that
        # sends the plain lease only (a release without the layout check) is refused there.
        self._record_sql = f"""
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
        self._scope_lease_sql = f"SELECT lease FROM {self._epochs} WHERE scope = $1"
        self._local_settings_sql = (
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

    def for_shard(self, shard: int) -> PostgresFencedRepository:
        """A repository on the same table and pool for shard ``shard`` of a sharded reconciler.

        Unbound; bound to the shard's Loop, its scope is that Loop's reconciler id
        (``<reconciler id>-shard-<k>``), or ``<explicit scope>-shard-<k>``. It shares this
        repository's pool: close this one (not the shards') when done.
        """
        if isinstance(shard, bool) or not isinstance(shard, int) or shard < 0:
            raise ConfigError(f"shard must be an integer >= 0, got {shard!r}")
        sibling = copy.copy(self)
        explicit = self._explicit_scope
        sibling._explicit_scope = None if explicit is None else f"{explicit}-shard-{shard}"
        sibling._scope = sibling._explicit_scope or DEFAULT_SCOPE
        sibling._bound_to = None
        sibling._tenancy = Tenancy.SINGLE_TENANT
        sibling._scopes_ready = set()
        sibling._layout_check = self._shards_layout
        sibling._shards_layout = _ShardLayout()
        return sibling

    async def record_shard_count(self, shards: int, *, by_namespace: bool = False) -> None:
        """Record in this scope that its entities are fenced in ``shards`` shard scopes.

        The scope's epochs row then names the lease ``<reconciler id>/shards=<N>`` (with
        ``/by-namespace`` when entities are sharded by namespace): an
        unsharded leader of the scope (whose lease is the reconciler id) and a
        reconciler with another shard count are refused, and so is this one when the
        scope was led unsharded or with another count (a
        :class:`~kopf_reconcile.fencing.protocol.ShardLayoutError`): one entity must never
        be fenced in two scopes by two unrelated leases. The layout is also the one this
        repository's shard repositories (:meth:`for_shard`) verify in every
        :meth:`record_epoch`.
        """
        assignment = ShardAssignment(_check_shard_count(shards), by_namespace)
        base = self._bound_to[0] if self._bound_to is not None else self._scope
        lease = layout_lease(base, shards, by_namespace)
        self._shards_layout.current = _Layout(self._scope, lease, assignment)
        pool = await self._ready_pool()
        async with pool.acquire() as connection, connection.transaction():
            await self._bound_transaction(connection)
            row = await connection.fetchrow(self._record_sql, self._scope, 0, lease, "shards", None)
            owner = (
                None
                if row is not None
                else await connection.fetchval(self._scope_lease_sql, self._scope)
            )
        if row is not None:
            return
        if _reconciler_of(owner) != base:
            # Another reconciler's scope: no reshard of it would make it this one's.
            raise ConfigError(
                f"fenced scope {self._scope!r} of {self._table} is numbered by the lease "
                f"{owner!r}, not one of reconciler {base!r}: two reconcilers' epochs would "
                "fence each other; give this reconciler its own scope"
            )
        raise ShardLayoutError(
            f"fenced scope {self._scope!r} of {self._table} is recorded for lease "
            f"{owner!r}, not {lease!r}: the shard layout changed (or the scope was led "
            f"unsharded). {_reshard_hint(self._scope, assignment)}"
        )

    async def reshard(
        self,
        shards: int,
        *,
        by_namespace: bool = False,
        holder: str = "reshard",
        check: Callable[[str, tuple[str, ...]], Awaitable[None]] | None = None,
    ) -> ReshardReport:
        """Change the shard layout recorded in this (base) scope, in one transaction.

        ``shards`` is the new count; 1 makes the reconciler unsharded again, and a scope
        led unsharded (its epochs row names the reconciler's own lease) can be sharded:
        the base scope takes part as the one scope of the unsharded layout.

        Locks the base scope's epochs row exclusively (a shard's :meth:`record_epoch`
        share-locks it, an unsharded leader's records in it: none commits across the
        change), then every shard scope's row, old layout and new, in scope order (each
        waits for the writes and redrive requests in flight in it). ``E``, one above every
        epoch recorded or written in the base scope and those scopes, is recorded as
        leading each of them by ``holder``, each shard scope naming the shard's lease
        qualified by the new layout (:func:`shard_scope_lease`): from the commit on every
        writer of the old layout is refused in every scope it wrote to, a client that does
        not check layouts can no longer record an epoch in a shard scope, and the next
        holder of each lease starts above ``E`` (its epoch floor). Each entity's row, dead
        letter and redrive request moves to its scope under the new layout (its shard's, or
        the base scope when unsharded; the row is re-keyed, not copied), with its state and
        ``last_epoch`` (below ``E``); the base scope then records the new layout (the
        reconciler's own lease when unsharded).

        ``check``, when given, is awaited with the reconciler id and the leases of the old
        layout (its shard leases, or its own lease when it was unsharded) once the base
        scope's row and every shard scope's row are locked, before anything changes: no
        epoch of the old layout can be recorded meanwhile, so what it finds (none of those
        leases held: the command's lease check) still holds at the commit. What it raises
        rolls the reshard back.

        Creates nothing: raises :class:`~kopf_reconcile.ConfigError` when the tables do
        not exist, when the scope was never led, is a shard's scope or already has this
        layout, and when an entity has rows (or dead letters) in two of its scopes;
        nothing changes then.
        """
        target = ShardAssignment(validate_shards(shards), by_namespace)
        if target.shards == 1 and by_namespace:
            raise ConfigError("by_namespace needs shards >= 2: one shard has no assignment")
        if not isinstance(holder, str) or not holder:
            raise ConfigError(f"holder must be a non-empty string, got {holder!r}")
        pool = await self._database.existing_pool()
        try:
            async with pool.acquire() as connection, connection.transaction():
                await self._bound_transaction(connection)
                return await self._reshard(connection, target, holder, check)
        except asyncpg.UndefinedTableError as exc:
            raise ConfigError(
                f"the fence tables of {self._table} are missing in this database ({exc}): "
                "check the database URL and the table; a reshard creates no table and "
                "changed nothing"
            ) from None

    def _recorded_layout(self, recorded: object) -> tuple[str, ShardAssignment]:
        """The reconciler id and layout a base scope's lease names (unsharded: 1 shard)."""
        base = self._scope
        parsed = parse_layout(recorded)
        if parsed is not None:
            return parsed
        if not isinstance(recorded, str):
            raise ConfigError(
                f"fenced scope {base!r} of {self._table} was never led nor sharded (it has no "
                "epochs row, or its row names no lease): only the base scope of a reconciler "
                "(its reconciler id, or the explicit scope its repository was built with) can "
                "be resharded"
            )
        if _SHARD_SCOPE_LEASE.fullmatch(recorded):
            raise ConfigError(
                f"fenced scope {base!r} of {self._table} is a shard's (its epochs row names "
                f"the lease {recorded!r}): reshard the base scope of its reconciler"
            )
        return recorded, ShardAssignment(1)  # led unsharded, under the reconciler's lease

    async def _reshard(
        self,
        connection: asyncpg.Connection,
        target: ShardAssignment,
        holder: str,
        check: Callable[[str, tuple[str, ...]], Awaitable[None]] | None,
    ) -> ReshardReport:
        base = self._scope
        locked_base = await connection.fetchrow(
            f"SELECT lease, epoch FROM {self._epochs} WHERE scope = $1 FOR UPDATE", base
        )
        recorded = None if locked_base is None else locked_base["lease"]
        reconciler_id, current = self._recorded_layout(recorded)
        assert locked_base is not None
        new_lease = _base_lease(reconciler_id, target)
        if current == target:
            raise ConfigError(f"fenced scope {base!r} is already {_describe(new_lease)}")
        count = max(current.shards, target.shards)
        shard_scopes = [shard_id(base, k) for k in range(count)] if count > 1 else []
        leases = [
            shard_scope_lease(shard_id(reconciler_id, k), target.shards, target.by_namespace)
            for k in range(len(shard_scopes))
        ]
        # Every shard scope gets a row to lock (and to fence), then all are locked in
        # scope order, the one order of every transaction that locks several (redrive
        # requests); each lock waits for the writes in flight in its scope.
        await connection.execute(self._scope_rows_sql, shard_scopes)
        locked = await connection.fetch(
            f"SELECT epoch FROM {self._epochs} WHERE scope = ANY($1) ORDER BY scope FOR UPDATE",
            shard_scopes,
        )
        # Checked once every row an epoch recording locks is held here: a recording of this
        # release (base row) or of one without the layout check (shard row only) either
        # committed before, under a lease the check then sees, or waits for the commit.
        if check is not None:
            old_leases = (
                tuple(shard_id(reconciler_id, k) for k in range(current.shards))
                if current.shards > 1
                else (reconciler_id,)
            )
            await check(reconciler_id, old_leases)
        scopes = [base, *shard_scopes]
        entities = await connection.fetch(
            f"SELECT scope, entity_id, last_epoch FROM {self._table} WHERE scope = ANY($1)",
            scopes,
        )
        letters = await connection.fetch(
            f"SELECT scope, entity_id, epoch FROM {self._dead} WHERE scope = ANY($1)",
            scopes,
        )
        _refuse_duplicates(base, (self._table, self._dead), entities, letters)
        # One above every epoch recorded or written in those scopes (all read above, under
        # the locks that keep them from changing until commit).
        fence = 1 + max(
            (
                int(locked_base["epoch"]),
                *(int(row["epoch"]) for row in locked),
                *(int(row["last_epoch"]) for row in entities),
                *(int(row["epoch"]) for row in letters),
            ),
            default=0,
        )
        _check_epoch(fence)
        await connection.execute(
            f"UPDATE {self._epochs} AS led SET epoch = $3, holder = $4, lease = f.lease "
            "FROM unnest($1::text[], $2::text[]) AS f(scope, lease) WHERE led.scope = f.scope",
            [base, *shard_scopes],
            [str(recorded), *leases],
            fence,
            holder,
        )
        # Rows and dead letters have no duplicates (refused above): nothing is merged.
        moves, _ = await self._move_rows(connection, self._table, entities, base, target)
        letter_moves, _ = await self._move_rows(connection, self._dead, letters, base, target)
        requests = await connection.fetch(
            f"SELECT scope, entity_id FROM {self._redrives} WHERE scope = ANY($1)", scopes
        )
        request_moves, requests_merged = await self._move_rows(
            connection, self._redrives, requests, base, target
        )
        await connection.execute(
            f"UPDATE {self._epochs} SET lease = $2 WHERE scope = $1", base, new_lease
        )
        moved = {k: 0 for k in range(target.shards)}
        for _, entity_id, _ in moves:
            moved[target.shard_of(entity_id)] += 1
        placed = {k: 0 for k in range(target.shards)}
        for entity_id in {row["entity_id"] for row in entities}:
            placed[target.shard_of(entity_id)] += 1
        return ReshardReport(
            scope=base,
            reconciler_id=reconciler_id,
            old_layout=str(recorded),
            new_layout=new_lease,
            old_shards=current.shards,
            new_shards=target.shards,
            fence_epoch=fence,
            moved=moved,
            entities=placed,
            dead_letters_moved=len(letter_moves),
            redrives_moved=len(request_moves),
            duplicates_dropped=len(requests_merged),
        )

    async def _move_rows(
        self,
        connection: asyncpg.Connection,
        table: str,
        rows: list[asyncpg.Record],
        base: str,
        target: ShardAssignment,
    ) -> tuple[list[tuple[str, str, str]], list[tuple[str, str]]]:
        """Move ``rows`` of ``table`` to their scopes under ``target`` (:func:`_plan_moves`).

        The merged rows are deleted first, then each moved row is re-keyed ``(old scope,
        id) -> new scope``: after the drop every id is in one scope, so no re-keyed row
        meets another. A moved row is updated, not deleted and inserted: a statement that
        waited for it follows it. Returns the moves and the merged rows.
        """
        moves, dropped = _plan_moves(rows, base, target)
        if dropped:
            await connection.execute(
                f"DELETE FROM {table} AS t USING unnest($1::text[], $2::text[]) AS d(scope, id) "
                "WHERE t.scope = d.scope AND t.entity_id = d.id",
                [scope for scope, _ in dropped],
                [entity_id for _, entity_id in dropped],
            )
        if moves:
            await connection.execute(
                f"UPDATE {table} AS t SET scope = m.new "
                "FROM unnest($1::text[], $2::text[], $3::text[]) AS m(old, id, new) "
                "WHERE t.scope = m.old AND t.entity_id = m.id",
                [old for old, _, _ in moves],
                [entity_id for _, entity_id, _ in moves],
                [new for _, _, new in moves],
            )
        return moves, dropped

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

    # -- the fenced write ------------------------------------------------------

    async def apply_fenced(self, entity_id: str, epoch: int, mutation: object) -> bool:
        """Apply ``mutation`` if ``epoch`` is current for the entity and its scope.

        ``False`` when the entity or the scope has seen a higher epoch.
        """
        tenant = self._tenant_of(entity_id)
        _check_epoch(epoch)
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
                    raise _Rejected
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
        except _Rejected:
            return False
        return True

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
        _check_epoch(epoch)
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
                        f"{_reshard_hint(layout.base_scope, layout.assignment)}"
                    )
            before = await connection.fetchval(self._led_before_sql, self._scope)
            qualified = (
                None
                if layout is None
                else shard_scope_lease(
                    lease, layout.assignment.shards, layout.assignment.by_namespace
                )
            )
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
        if row is None and layout is None and _reconciler_of(owner, sharded=True) == lease:
            # An unsharded leader of a scope recorded as sharded: the layout changed (or
            # will, once this replica's rollout is done); a reshard to 1 shard ends it.
            raise ShardLayoutError(
                f"fenced scope {self._scope!r} of {self._table} records the shard layout "
                f"{owner!r}, and this replica runs it unsharded (lease {lease!r}). "
                f"{_reshard_hint(self._scope, ShardAssignment(1))}"
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

    # -- dead letters (the DeadLetterStore protocol) ------------------------------

    async def record_dead_letter(self, entity_id: str, epoch: int, reason: str) -> bool:
        """Record (or count once more) a dead letter; ``False`` for a stale epoch."""
        tenant = self._tenant_of(entity_id)
        _check_epoch(epoch)
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
        _check_epoch(epoch)
        async with asyncio.timeout(self._write_timeout):
            pool = await self._ready_pool()
            return bool(await pool.fetchval(self._dead_clear_sql, self._scope, entity_id, epoch))

    async def dead_letters(self) -> list[DeadLetter]:
        """This scope's dead letters."""
        await self._ready_pool()  # the tables, as a writer needs them
        return await self.list_dead_letters(scope=self._scope)

    async def take_redrives(self, epoch: int) -> list[str]:
        """Consume this scope's redrive requests; nothing for a stale epoch."""
        _check_epoch(epoch)
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
                            raise _Rejected
                    return sorted(row["entity_id"] for row in rows)
                except _Rejected:
                    # Dead letters moved by a reshard after their scopes were read (or in
                    # a scope with no epochs row yet): rolled back; again, locking theirs.
                    await pool.execute(self._scope_rows_sql, sorted(moved))
        except asyncpg.UndefinedTableError:
            return []
        raise RuntimeError(
            f"redrive request not made: the dead letters kept moving between scopes "
            f"({REDRIVE_ATTEMPTS} attempts; is a reshard running again and again?)"
        )

    async def leadership_changes(self, within: float = 3600.0) -> dict[str, int]:
        """Per scope, failovers within the last ``within`` seconds (database clock): epochs
        that started leading after another one had (a scope's first leader is none)."""
        pool = await self._database.existing_pool()
        try:
            rows = await pool.fetch(self._changes_sql, float(within))
        except asyncpg.UndefinedTableError:
            return {}
        return {row["scope"]: int(row["count"]) for row in rows}

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

    async def highest_epoch(self) -> int:
        """The highest epoch recorded or written in this scope (0 if none).

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


def _epochs_schema(table: str) -> list[str]:
    return [
        f"""
        CREATE TABLE IF NOT EXISTS {table} (
            scope  text   PRIMARY KEY,
            epoch  bigint NOT NULL CHECK (epoch >= 0),
            lease  text,
            holder text
        )
        """,
        # Tables made before the lease and holder columns existed. Checked first: even
        # with IF NOT EXISTS, ALTER TABLE takes an exclusive lock that would queue behind
        # every write in flight, and every later write behind it, at each replica's start.
        f"""
        DO $$ BEGIN
            IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = '{table}'::regclass
                           AND attname = 'holder' AND NOT attisdropped) THEN
                ALTER TABLE {table} ADD COLUMN IF NOT EXISTS lease text,
                                    ADD COLUMN IF NOT EXISTS holder text;
            END IF;
        END $$
        """,
    ]


def _side_tables_schema(dead: str, redrives: str, leaders: str) -> list[str]:
    return [
        f"""
        CREATE TABLE IF NOT EXISTS {dead} (
            scope     text        NOT NULL,
            entity_id text        NOT NULL,
            tenant    text        NOT NULL,
            reason    text        NOT NULL,
            first_at  timestamptz NOT NULL,
            last_at   timestamptz NOT NULL,
            attempts  bigint      NOT NULL,
            epoch     bigint      NOT NULL,
            PRIMARY KEY (scope, entity_id)
        )
        """,
        f"""
        CREATE TABLE IF NOT EXISTS {redrives} (
            scope        text        NOT NULL,
            entity_id    text        NOT NULL,
            requested_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (scope, entity_id)
        )
        """,
        f"""
        CREATE TABLE IF NOT EXISTS {leaders} (
            scope  text        NOT NULL,
            epoch  bigint      NOT NULL,
            holder text,
            previous bigint   NOT NULL DEFAULT 0,  -- the epoch that led before (0: none)
            led_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (scope, epoch)
        )
        """,
    ]


def _plan_moves(
    rows: list[asyncpg.Record], base: str, target: ShardAssignment
) -> tuple[list[tuple[str, str, str]], list[tuple[str, str]]]:
    """Which rows move where under ``target`` (``(old scope, id, new scope)``), and which
    are merged (``(scope, id)``, dropped).

    Rows and dead letters have one per entity (checked first, :func:`_refuse_duplicates`).
    A redrive request carries nothing but its entity: two of one entity (in two scopes)
    are one request, kept in the entity's new scope.
    """
    by_entity: dict[str, list[str]] = {}
    for row in rows:
        by_entity.setdefault(row["entity_id"], []).append(row["scope"])
    moves: list[tuple[str, str, str]] = []
    merged: list[tuple[str, str]] = []
    for entity_id, found in by_entity.items():
        home = base if target.shards == 1 else shard_id(base, target.shard_of(entity_id))
        kept = home if home in found else min(found)
        merged.extend((scope, entity_id) for scope in found if scope != kept)
        if kept != home:
            moves.append((kept, entity_id, home))
    return moves, merged


def _refuse_duplicates(
    base: str,
    tables: tuple[str, str],
    entities: list[asyncpg.Record],
    letters: list[asyncpg.Record],
) -> None:
    """Refuse a reshard when an entity has rows (or dead letters) in two of the scopes
    (the base scope and its shard scopes).

    Each scope's epochs come from its own lease: two rows of one entity carry
    epochs of two independent counters, and nothing tells which one is current.
    """
    found: dict[tuple[str, str], list[str]] = {}
    for kind, rows in ((tables[0], entities), (tables[1], letters)):
        for row in rows:
            found.setdefault((kind, row["entity_id"]), []).append(row["scope"])
    twice = sorted((key, sorted(scopes)) for key, scopes in found.items() if len(scopes) > 1)
    if not twice:
        return
    shown = "; ".join(
        f"{entity_id!r} has rows of {kind} in {', '.join(repr(s) for s in scopes)}"
        for (kind, entity_id), scopes in twice[:10]
    )
    more = f" (and {len(twice) - 10} more)" if len(twice) > 10 else ""
    raise ConfigError(
        f"cannot reshard {base!r}: {len(twice)} entities have rows in two shard scopes "
        f"(or in the base scope and a shard scope): {shown}{more}. Their epochs come from "
        "two independent leases, so which "
        "row is current cannot be told: keep the current one of each and delete the "
        "others (DELETE FROM <table> WHERE scope = '<scope>' AND entity_id = '<entity>'), "
        "then run the reshard again. Nothing changed"
    )


def _base_lease(reconciler_id: str, assignment: ShardAssignment) -> str:
    """What a base scope's epochs row names under ``assignment``: the reconciler's own
    lease when unsharded, else the layout (:func:`layout_lease`)."""
    if assignment.shards == 1:
        return reconciler_id
    return layout_lease(reconciler_id, assignment.shards, assignment.by_namespace)


def _reconciler_of(base_lease: object, *, sharded: bool = False) -> str | None:
    """The reconciler whose lease a base scope's epochs row names: the id of its layout
    (``<id>/shards=N``), or, unless ``sharded``, the lease itself (led unsharded)."""
    parsed = parse_layout(base_lease)
    if parsed is not None:
        return parsed[0]
    return None if sharded or not isinstance(base_lease, str) else base_lease


def _describe(base_lease: str) -> str:
    """``sharded as '<id>/shards=N'``, or ``unsharded`` for a base scope's lease."""
    return "unsharded" if parse_layout(base_lease) is None else f"sharded as {base_lease!r}"


# The lease a shard scope's epochs row names: ``<id>-shard-<k>``, maybe qualified by a layout.
_SHARD_SCOPE_LEASE = re.compile(r"(?s).+-(shard|member)-[0-9]+(@shards=.*)?")


def _reshard_hint(base_scope: str, assignment: ShardAssignment) -> str:
    """How to move a base scope to ``assignment``: the command, once, with the database."""
    flag = " --by-namespace" if assignment.by_namespace else ""
    return (
        f"To change the layout, once no replica of the old layout runs, run `kopf-reconcile "
        f"reshard --reconciler {base_scope} --shards {assignment.shards}{flag} --leases "
        "kubernetes|postgres` (once): it moves the entities to their new scopes and "
        "fences the old layout; until then this replica retries and leads nothing"
    )


def _check_shard_count(shards: object) -> int:
    """A sharded layout has from 2 to MAX_SHARDS shards (one shard is an unsharded Loop)."""
    try:
        count = validate_shards(shards)
    except ConfigError:
        count = 0  # refused below, with the range of a sharded layout
    if count < 2:
        raise ConfigError(f"shards must be an integer from 2 to {MAX_SHARDS}, got {shards!r}")
    return count


def _milliseconds(option: str, value: Duration) -> str:
    return str(max(1, round(positive_seconds(option, value) * 1000)))


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
