"""The shard layout of a base scope, and its change (``kopf-reconcile reshard``).

Sharded reconcilers (:meth:`~ShardLayouts.for_shard`) fence each shard in a scope of
its own, and their base scope records the layout (:meth:`~ShardLayouts.record_shard_count`).
:meth:`~ShardLayouts.reshard` changes the layout in one transaction that locks the base
row exclusively, fences every shard scope, old and new, above every epoch they have seen,
names in each the shard's lease qualified by the new layout (so a client without the
layout check, which requires the plain lease, is refused by the server), and moves each
entity's rows to its new shard scope. Lock order, in every transaction that locks several
epochs rows: by scope (a base scope sorts before its shard scopes), then data rows; a
redrive request share-locks the epochs rows of its scopes first, so it lands before a
reshard moves them or after.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Self

import asyncpg

from kopf_reconcile.api import ConfigError
from kopf_reconcile.fencing.postgres.base import DEFAULT_SCOPE, check_epoch
from kopf_reconcile.fencing.postgres.epochs import EpochRecording
from kopf_reconcile.fencing.postgres.layout import (
    SHARD_SCOPE_LEASE,
    Layout,
    ShardLayout,
    base_lease,
    check_shard_count,
    describe_layout,
    layout_lease,
    parse_layout,
    reconciler_of,
    reshard_hint,
    shard_scope_lease,
)
from kopf_reconcile.fencing.protocol import ShardLayoutError
from kopf_reconcile.sharding import ShardAssignment, shard_id, validate_shards
from kopf_reconcile.tenancy import Tenancy

__all__ = ["ReshardReport", "ShardLayouts"]


@dataclasses.dataclass(frozen=True)
class ReshardReport:
    """What :meth:`PostgresFencedRepository.reshard` did, in its one transaction."""

    scope: str  # the base scope
    reconciler_id: str  # whose shard leases are ``<reconciler_id>-shard-<k>``
    old_layout: str  # the lease the base scope recorded, ``<id>/shards=N[/namespace-ranges]``
    new_layout: str
    old_shards: int
    new_shards: int
    fence_epoch: int  # recorded as leading every shard scope, old and new
    moved: dict[int, int]  # new shard -> entities moved into it from another shard scope
    entities: dict[int, int]  # new shard -> entities fenced in it now
    dead_letters_moved: int
    redrives_moved: int
    duplicates_dropped: int  # redrive requests of one entity in two scopes, merged into one


class ShardLayouts(EpochRecording):
    """The ``ShardableRepository`` protocol (:meth:`for_shard`, :meth:`record_shard_count`)
    and :meth:`reshard`."""

    def for_shard(self, shard: int) -> Self:
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
        sibling._shards_layout = ShardLayout()
        return sibling

    async def record_shard_count(self, shards: int, *, by_namespace: bool = False) -> None:
        """Record in this scope that its entities are fenced in ``shards`` shard scopes.

        The scope's epochs row then names the lease ``<reconciler id>/shards=<N>`` (with
        ``/namespace-ranges`` when entities are sharded by namespace): an
        unsharded leader of the scope (whose lease is the reconciler id) and a
        reconciler with another shard count are refused, and so is this one when the
        scope was led unsharded or with another count (a
        :class:`~kopf_reconcile.fencing.protocol.ShardLayoutError`): one entity must never
        be fenced in two scopes by two unrelated leases. The layout is also the one this
        repository's shard repositories (:meth:`for_shard`) verify in every
        :meth:`record_epoch`.
        """
        assignment = ShardAssignment(check_shard_count(shards), by_namespace)
        base = self._bound_to[0] if self._bound_to is not None else self._scope
        lease = layout_lease(base, assignment)
        self._shards_layout.current = Layout(self._scope, lease, assignment)
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
        if reconciler_of(owner) != base:
            # Another reconciler's scope: no reshard of it would make it this one's.
            raise ConfigError(
                f"fenced scope {self._scope!r} of {self._table} is numbered by the lease "
                f"{owner!r}, not one of reconciler {base!r}: two reconcilers' epochs would "
                "fence each other; give this reconciler its own scope"
            )
        raise ShardLayoutError(
            f"fenced scope {self._scope!r} of {self._table} is recorded for lease "
            f"{owner!r}, not {lease!r}: the shard layout changed (or the scope was led "
            f"unsharded). {reshard_hint(self._scope, assignment)}"
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
        if SHARD_SCOPE_LEASE.fullmatch(recorded):
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
        new_lease = base_lease(reconciler_id, target)
        if current == target:
            raise ConfigError(f"fenced scope {base!r} is already {describe_layout(new_lease)}")
        count = max(current.shards, target.shards)
        shard_scopes = [shard_id(base, k) for k in range(count)] if count > 1 else []
        leases = [
            shard_scope_lease(shard_id(reconciler_id, k), target) for k in range(len(shard_scopes))
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
        check_epoch(fence)
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
