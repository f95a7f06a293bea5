"""An audit trail of fenced writes, kept by the database itself.

The promise checked. Fencing is scope-wide: once a leader has led a fenced
scope at epoch N (it records N in ``<fence table>_epochs`` before it
dispatches), no write below N is accepted for ANY entity of that scope, not
only for the entities that leader wrote. A write is therefore *stale* when it
was applied at an epoch below the highest epoch already recorded for its
scope at that moment, or below an epoch already applied to its own row (the
per-entity rule, which holds even where nothing was recorded).

:func:`install` adds triggers to a fence table (which must exist) and to its
``<fence table>_epochs`` table (created if missing). Every audit row takes its
``seq`` from ONE sequence, so the audit tables share one order: the order in
which the triggers fired. The repository share-locks its scope's epoch row
for the whole of each write and recording an epoch updates that row, so a
write that commits before a recording fired its triggers before it, and a
write after it waited for it: in one scope, that order is the order of
application. (Writes to one entity are serialised by the row lock as well.)
Only what commits is audited: a rolled-back transaction takes its audit rows
with it. Each table holds, in ``seq`` order:

``fence_applied`` (:func:`applied_writes`, and :class:`Applied` in :func:`history`)
    every write applied to a fence row (``AFTER INSERT OR UPDATE``, per
    row): its scope, entity, epoch and state.
``fence_led`` (:class:`Led` in :func:`history`)
    every insert or update of a row of ``<fence table>_epochs``: the scope
    and the epoch it now holds (the highest epoch that led it). Install seeds
    it with the rows already there. A deleted row is not recorded: deleting
    it withdraws no promise.
``fence_statements`` (:func:`rejected_writes`)
    every ``INSERT`` statement on the fence table (``BEFORE INSERT``, per
    statement, so it fires even when the statement proposes no row). Each
    fenced write is one such statement proposing at most one row; a
    statement that applied no row is a write the database rejected.
``fence_attempted`` (:func:`attempted_writes`)
    every row a write proposed to the fence table (``BEFORE INSERT``, per
    row), whether the entity's epoch check (``ON CONFLICT … WHERE``) then let
    it through or not. A write rejected by its scope's recorded epoch
    proposes no row at all, so it is NOT here: count rejections with
    :func:`rejected_writes`.

Tests and the demo use them to prove that writes reached the database and
were rejected there (:func:`rejected_writes`), that no stale write was
applied (:func:`stale_writes`, :func:`assert_no_stale_writes`), and that
nothing was applied twice (:func:`applied_writes`).
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, TypeAlias

import asyncpg

from kopf_reconcile.database import qualified_table

Writes = dict[str, list[tuple[int, Any]]]

# Transaction-local: the fence_statements row of the INSERT being executed.
_STATEMENT = "kopf_reconcile_audit.statement"
_CURRENT_STATEMENT = f"NULLIF(current_setting('{_STATEMENT}', true), '')::bigint"


@dataclasses.dataclass(frozen=True)
class Applied:
    """A write the database applied to a fence row (``fence_applied``)."""

    seq: int
    scope: str
    entity_id: str
    epoch: int
    state: Any


@dataclasses.dataclass(frozen=True)
class Led:
    """A change of ``<fence table>_epochs``: ``scope`` has now been led at ``epoch``."""

    seq: int
    scope: str
    epoch: int


#: One event of :func:`history`.
Event: TypeAlias = Applied | Led


@dataclasses.dataclass(frozen=True)
class StaleWrite:
    """An applied write that fencing should have rejected (see :func:`stale_writes`)."""

    write: Applied
    led: int | None  # the highest epoch recorded for the scope before it, if any
    newest: int | None  # the highest epoch applied to its entity before it, if any

    @property
    def below_scope(self) -> bool:
        """Below an epoch that had already led its scope (the scope-wide rule)."""
        return self.led is not None and self.write.epoch < self.led

    @property
    def regression(self) -> bool:
        """Below an epoch already applied to its own row (the per-entity rule)."""
        return self.newest is not None and self.write.epoch < self.newest

    def __str__(self) -> str:
        w = self.write
        return (
            f"{w.scope}/{w.entity_id} at epoch {w.epoch} (seq {w.seq}; scope led at "
            f"{self.led}, entity last written at {self.newest})"
        )


@dataclasses.dataclass(frozen=True)
class Rejected:
    """A fenced write statement that committed and applied no row.

    ``scope``, ``entity_id``, ``epoch`` and ``state`` are those of the row it
    proposed, when it proposed one (it was then rejected by its entity's
    epoch); all ``None`` when it proposed none (rejected by its scope's
    recorded epoch before any row existed: the statement's parameters are not
    visible to a trigger).
    """

    seq: int
    scope: str | None
    entity_id: str | None
    epoch: int | None
    state: Any


async def install(dsn: str, fence_table: str = "kopf_reconcile_fence") -> None:
    """Create the audit tables and their triggers on ``fence_table`` and its epochs table.

    ``fence_table`` must exist; ``<fence_table>_epochs`` is created if it does not
    exist yet (with the repository's own DDL), and the epochs it already holds are
    recorded first. Call it once per database, before the writes to audit.
    """
    table = qualified_table("fence_table", fence_table)
    epochs = qualified_table("fence_table", f"{fence_table}_epochs")
    record_row = f"""
                VALUES ({_CURRENT_STATEMENT}, NEW.scope, NEW.entity_id, NEW.last_epoch, NEW.state)
    """
    connection = await asyncpg.connect(dsn)
    try:
        async with connection.transaction():
            await connection.execute(f"""
                CREATE TABLE IF NOT EXISTS {epochs} (
                    scope text PRIMARY KEY,
                    epoch bigint NOT NULL CHECK (epoch >= 0)
                );
                CREATE SEQUENCE fence_audit_seq;
                CREATE TABLE fence_statements (
                    seq bigint PRIMARY KEY DEFAULT nextval('fence_audit_seq')
                );
                CREATE FUNCTION fence_statements_record() RETURNS trigger LANGUAGE plpgsql AS $$
                DECLARE
                    statement bigint;
                BEGIN
                    INSERT INTO fence_statements DEFAULT VALUES RETURNING seq INTO statement;
                    PERFORM set_config('{_STATEMENT}', statement::text, true);
                    RETURN NULL;
                END $$;
                CREATE TRIGGER fence_statements BEFORE INSERT ON {table}
                    FOR EACH STATEMENT EXECUTE FUNCTION fence_statements_record();
            """)
            for kind, moment in (
                ("attempted", "BEFORE INSERT"),
                ("applied", "AFTER INSERT OR UPDATE"),
            ):
                await connection.execute(f"""
                    CREATE TABLE fence_{kind} (
                        seq       bigint PRIMARY KEY DEFAULT nextval('fence_audit_seq'),
                        statement bigint,
                        scope     text   NOT NULL,
                        entity_id text   NOT NULL,
                        epoch     bigint NOT NULL,
                        state     jsonb
                    );
                    CREATE FUNCTION fence_{kind}_record() RETURNS trigger LANGUAGE plpgsql AS $$
                    BEGIN
                        INSERT INTO fence_{kind} (statement, scope, entity_id, epoch, state)
                        {record_row};
                        RETURN NEW;
                    END $$;
                    CREATE TRIGGER fence_{kind} {moment} ON {table}
                        FOR EACH ROW EXECUTE FUNCTION fence_{kind}_record();
                """)
            # The trigger locks out recordings until commit: the seed misses none.
            await connection.execute(f"""
                CREATE TABLE fence_led (
                    seq   bigint PRIMARY KEY DEFAULT nextval('fence_audit_seq'),
                    scope text   NOT NULL,
                    epoch bigint NOT NULL
                );
                CREATE FUNCTION fence_led_record() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN
                    INSERT INTO fence_led (scope, epoch) VALUES (NEW.scope, NEW.epoch);
                    RETURN NEW;
                END $$;
                CREATE TRIGGER fence_led AFTER INSERT OR UPDATE ON {epochs}
                    FOR EACH ROW EXECUTE FUNCTION fence_led_record();
                INSERT INTO fence_led (scope, epoch)
                    SELECT scope, epoch FROM {epochs} ORDER BY scope;
            """)
    finally:
        await connection.close()


async def applied_writes(dsn: str, scope: str | None = None) -> Writes:
    """Per entity, every applied write as ``(epoch, state)``, in the order applied.

    Entities of one ``scope``; without one, the audit must hold a single scope
    (an entity id may exist in several: :class:`ValueError` otherwise).
    """
    return await _writes(dsn, "applied", scope)


async def attempted_writes(dsn: str, scope: str | None = None) -> Writes:
    """Per entity, every row a write proposed, applied or rejected by its entity's epoch.

    A write rejected by its scope's recorded epoch proposed no row and is not
    here (see :func:`rejected_writes`). ``scope`` as for :func:`applied_writes`.
    """
    return await _writes(dsn, "attempted", scope)


async def history(dsn: str, scope: str | None = None) -> list[Event]:
    """Every applied write and every recorded epoch (of ``scope``, or all), in order."""
    connection = await asyncpg.connect(dsn)
    try:
        applied = await connection.fetch(
            "SELECT seq, scope, entity_id, epoch, state::text FROM fence_applied "
            "WHERE $1::text IS NULL OR scope = $1",
            scope,
        )
        led = await connection.fetch(
            "SELECT seq, scope, epoch FROM fence_led WHERE $1::text IS NULL OR scope = $1",
            scope,
        )
    finally:
        await connection.close()
    events: list[Event] = [
        Applied(
            seq=int(row["seq"]),
            scope=row["scope"],
            entity_id=row["entity_id"],
            epoch=int(row["epoch"]),
            state=_state(row["state"]),
        )
        for row in applied
    ]
    events += [Led(seq=int(row["seq"]), scope=row["scope"], epoch=int(row["epoch"])) for row in led]
    return sorted(events, key=lambda event: event.seq)


async def rejected_writes(dsn: str) -> list[Rejected]:
    """Every fenced write statement that committed without applying a row, in order.

    Both kinds of rejection: by the entity's epoch (the statement proposed a row,
    whose fields are given) and by the scope's recorded epoch (it proposed none).
    A rejected callable mutation rolls its transaction back and is not counted.
    """
    connection = await asyncpg.connect(dsn)
    try:
        rows = await connection.fetch("""
            SELECT s.seq, a.scope, a.entity_id, a.epoch, a.state::text
              FROM fence_statements s
              LEFT JOIN fence_attempted a ON a.statement = s.seq
             WHERE NOT EXISTS (SELECT 1 FROM fence_applied p WHERE p.statement = s.seq)
             ORDER BY s.seq, a.seq
        """)
    finally:
        await connection.close()
    return [
        Rejected(
            seq=int(row["seq"]),
            scope=row["scope"],
            entity_id=row["entity_id"],
            epoch=None if row["epoch"] is None else int(row["epoch"]),
            state=_state(row["state"]),
        )
        for row in rows
    ]


def stale_writes(events: Iterable[Event]) -> list[StaleWrite]:
    """Every applied write that was stale when applied, in order.

    Stale: its epoch was below the highest epoch recorded for its scope earlier
    in ``events`` (the scope-wide rule, whichever entities the leader of that
    epoch wrote), or below an epoch applied earlier to the same entity (the
    per-entity rule: an older epoch applied after a newer one).
    """
    led: dict[str, int] = {}
    newest: dict[tuple[str, str], int] = {}
    stale: list[StaleWrite] = []
    for event in sorted(events, key=lambda e: e.seq):
        if isinstance(event, Led):
            led[event.scope] = max(event.epoch, led.get(event.scope, event.epoch))
            continue
        entity = (event.scope, event.entity_id)
        floor, previous = led.get(event.scope), newest.get(entity)
        write = StaleWrite(event, floor, previous)
        if write.below_scope or write.regression:
            stale.append(write)
        newest[entity] = event.epoch if previous is None else max(previous, event.epoch)
    return stale


def assert_no_stale_writes(events: Iterable[Event]) -> None:
    """Fail, naming them, if any write in ``events`` was stale (see :func:`stale_writes`)."""
    stale = stale_writes(events)
    if stale:
        shown = "; ".join(str(write) for write in stale[:10])
        more = f" (and {len(stale) - 10} more)" if len(stale) > 10 else ""
        raise AssertionError(f"{len(stale)} stale write(s) applied: {shown}{more}")


def epoch_regressions(writes: Writes) -> list[str]:
    """Entities where an older epoch was applied after a newer one (per entity only).

    Blind to a late write to an entity the newer leader never wrote: use
    :func:`stale_writes` for the scope-wide rule.
    """
    return [
        entity
        for entity, applied in writes.items()
        if [epoch for epoch, _ in applied] != sorted(epoch for epoch, _ in applied)
    ]


def assert_epochs_never_decrease(writes: Writes) -> None:
    """The per-entity check alone; :func:`assert_no_stale_writes` is the full one."""
    regressions = epoch_regressions(writes)
    if regressions:
        raise AssertionError(f"an older epoch was applied after a newer one: {regressions}")


async def _writes(dsn: str, kind: str, scope: str | None) -> Writes:
    connection = await asyncpg.connect(dsn)
    try:
        rows = await connection.fetch(
            f"SELECT scope, entity_id, epoch, state::text FROM fence_{kind} "
            "WHERE $1::text IS NULL OR scope = $1 ORDER BY seq",
            scope,
        )
    finally:
        await connection.close()
    scopes = sorted({row["scope"] for row in rows})
    if len(scopes) > 1:
        raise ValueError(f"the audit holds writes of several scopes {scopes}: pass scope=")
    writes: Writes = defaultdict(list)
    for row in rows:
        writes[row["entity_id"]].append((int(row["epoch"]), _state(row["state"])))
    return dict(writes)


def _state(text: str | None) -> Any:
    return None if text is None else json.loads(text)
