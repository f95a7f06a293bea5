"""The audit trail itself, on a real PostgreSQL: what it counts as a stale write, and why.

Fencing is scope-wide: once epoch N has led a scope (recorded in
``<fence table>_epochs``), no write below N may be applied to ANY entity of the
scope. These tests write straight to the tables by SQL, bypassing the
repository (which would refuse the stale writes), to put into the audit
exactly the histories the checks must judge.
"""

from __future__ import annotations

import asyncpg
import pytest

from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.testing import audit

FENCE = "kopf_reconcile_fence"
EPOCHS = f"{FENCE}_epochs"
SCOPE, OTHER_SCOPE = "devices", "gadgets"
# A fence table as the repository defines it.
FENCE_DDL = f"""
    CREATE TABLE {FENCE} (
        scope      text        NOT NULL,
        entity_id  text        NOT NULL,
        tenant     text        NOT NULL,
        last_epoch bigint      NOT NULL CHECK (last_epoch >= 0),
        state      jsonb,
        updated_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (scope, entity_id)
    )
"""
# A document write as the repository makes it, minus any scope-wide check.
WRITE = f"""
    INSERT INTO {FENCE} AS fence (scope, entity_id, tenant, last_epoch, state, updated_at)
    VALUES ($1, $2, '_notenant', $3, $4::jsonb, now())
    ON CONFLICT (scope, entity_id) DO UPDATE
       SET last_epoch = EXCLUDED.last_epoch, state = EXCLUDED.state
     WHERE fence.last_epoch <= $3
    RETURNING true
"""
# A write refused for its scope's epoch: it proposes no row at all.
REFUSED_BY_SCOPE = f"""
    INSERT INTO {FENCE} (scope, entity_id, tenant, last_epoch, state)
    SELECT $1, $2, '_notenant', $3, '{{}}'::jsonb
     WHERE $3 >= (SELECT epoch FROM {EPOCHS} WHERE scope = $1)
"""
RECORD = f"""
    INSERT INTO {EPOCHS} AS led (scope, epoch) VALUES ($1, $2)
    ON CONFLICT (scope) DO UPDATE SET epoch = GREATEST(led.epoch, EXCLUDED.epoch)
"""


class Database:
    """One connection to the test's database."""

    def __init__(self, connection: asyncpg.Connection) -> None:
        self.connection = connection

    async def write(self, scope: str, entity: str, epoch: int) -> bool:
        state = f'{{"epoch": {epoch}}}'
        return bool(await self.connection.fetchval(WRITE, scope, entity, epoch, state))

    async def record(self, scope: str, epoch: int) -> None:
        await self.connection.execute(RECORD, scope, epoch)


async def connect(dsn: str, *, with_epochs_table: bool = True) -> Database:
    connection = await asyncpg.connect(dsn)
    await connection.execute(FENCE_DDL)
    if with_epochs_table:
        await connection.execute(
            f"CREATE TABLE {EPOCHS} (scope text PRIMARY KEY, epoch bigint NOT NULL)"
        )
    return Database(connection)


async def test_a_write_below_the_epoch_that_led_its_scope_is_stale_on_an_unwritten_entity(
    dsn: str,
) -> None:
    db = await connect(dsn)
    try:
        await audit.install(dsn)
        assert await db.write(SCOPE, "dev-1", 1)  # before epoch 2 led: legitimate
        await db.record(SCOPE, 2)  # epoch 2 leads the scope ...
        assert await db.write(SCOPE, "dev-2", 2)  # ... and writes dev-2 only
        assert await db.write(SCOPE, "dev-3", 1)  # a zombie at epoch 1: an entity never
        assert await db.write(SCOPE, "dev-1", 1)  # written at epoch 2, or written before
        assert await db.write(SCOPE, "dev-2", 2)  # the current epoch again: fine
        assert await db.write(OTHER_SCOPE, "dev-3", 1)  # another scope: not led at 2
    finally:
        await db.connection.close()

    history = await audit.history(dsn)
    stale = audit.stale_writes(history)
    assert [(s.write.scope, s.write.entity_id, s.write.epoch) for s in stale] == [
        (SCOPE, "dev-3", 1),
        (SCOPE, "dev-1", 1),
    ]
    assert all(s.below_scope and s.led == 2 for s in stale)
    assert [s.regression for s in stale] == [False, False]
    with pytest.raises(AssertionError, match=r"2 stale write\(s\).*devices/dev-3 at epoch 1"):
        audit.assert_no_stale_writes(history)
    # The per-entity view sees nothing wrong: no entity's epochs ever went down.
    assert audit.epoch_regressions(await audit.applied_writes(dsn, scope=SCOPE)) == []
    assert audit.stale_writes(await audit.history(dsn, scope=OTHER_SCOPE)) == []


async def test_an_older_epoch_applied_after_a_newer_one_on_a_row_is_stale_too(dsn: str) -> None:
    db = await connect(dsn)
    try:
        await audit.install(dsn)
        # No epoch recorded at all: only the per-entity rule applies.
        assert await db.write(SCOPE, "dev-1", 3)
        await db.connection.execute(
            f"UPDATE {FENCE} SET last_epoch = 2 WHERE entity_id = 'dev-1'"
        )  # past the repository's epoch check
        assert await db.write(SCOPE, "dev-2", 1)  # another entity: no regression
    finally:
        await db.connection.close()

    [stale] = audit.stale_writes(await audit.history(dsn))
    assert (stale.write.entity_id, stale.write.epoch, stale.newest, stale.led) == (
        "dev-1",
        2,
        3,
        None,
    )
    assert stale.regression and not stale.below_scope
    assert audit.epoch_regressions(await audit.applied_writes(dsn)) == ["dev-1"]


async def test_install_creates_the_epochs_table_or_records_the_epochs_already_there(
    dsn: str,
) -> None:
    db = await connect(dsn, with_epochs_table=False)
    try:
        await audit.install(dsn)  # before the repository made its epochs table
        await db.record(SCOPE, 4)
        assert await db.write(SCOPE, "dev-1", 3)
    finally:
        await db.connection.close()
    history = await audit.history(dsn)
    assert [type(event) for event in history] == [audit.Led, audit.Applied]
    assert [s.write.entity_id for s in audit.stale_writes(history)] == ["dev-1"]


async def test_epochs_recorded_before_install_count(dsn: str) -> None:
    db = await connect(dsn)
    try:
        await db.record(SCOPE, 5)
        await db.record(OTHER_SCOPE, 1)
        await audit.install(dsn)
        assert await db.write(SCOPE, "dev-1", 4)
        assert await db.write(OTHER_SCOPE, "dev-1", 4)
    finally:
        await db.connection.close()
    history = await audit.history(dsn)
    assert [(e.scope, e.epoch) for e in history if isinstance(e, audit.Led)] == [
        (SCOPE, 5),
        (OTHER_SCOPE, 1),
    ]
    assert [(s.write.scope, s.led) for s in audit.stale_writes(history)] == [(SCOPE, 5)]


async def test_rejected_writes_count_both_kinds_of_rejection(dsn: str) -> None:
    async with PostgresFencedRepository(dsn, scope=SCOPE) as repository:
        await repository.migrate()
        await audit.install(dsn)
        assert await repository.apply_fenced("dev-1", 2, {"v": 2})
        # Rejected by the entity's epoch: the statement proposed a row.
        assert not await repository.apply_fenced("dev-1", 1, {"v": 1})
        # Rejected by the scope's epoch: the statement proposed no row.
        connection = await asyncpg.connect(dsn)
        try:
            await connection.execute(RECORD, SCOPE, 3)
            assert await connection.execute(REFUSED_BY_SCOPE, SCOPE, "dev-2", 2) == "INSERT 0 0"
        finally:
            await connection.close()

    proposed, unproposed = await audit.rejected_writes(dsn)
    assert (proposed.scope, proposed.entity_id, proposed.epoch, proposed.state) == (
        SCOPE,
        "dev-1",
        1,
        {"v": 1},
    )
    assert (unproposed.scope, unproposed.entity_id, unproposed.epoch) == (None, None, None)
    assert proposed.seq < unproposed.seq
    # The per-row trail sees only the first: the second proposed nothing.
    assert await audit.attempted_writes(dsn) == {"dev-1": [(2, {"v": 2}), (1, {"v": 1})]}
    assert await audit.applied_writes(dsn) == {"dev-1": [(2, {"v": 2})]}


async def test_the_readers_refuse_to_merge_entities_of_several_scopes(dsn: str) -> None:
    db = await connect(dsn)
    try:
        await audit.install(dsn)
        assert await db.write(SCOPE, "dev-1", 2)
        assert await db.write(OTHER_SCOPE, "dev-1", 1)
    finally:
        await db.connection.close()
    with pytest.raises(ValueError, match="several scopes"):
        await audit.applied_writes(dsn)
    assert await audit.applied_writes(dsn, scope=OTHER_SCOPE) == {"dev-1": [(1, {"epoch": 1})]}


def test_stale_writes_follow_the_order_of_the_sequence() -> None:
    write = audit.Applied(seq=2, scope=SCOPE, entity_id="dev-1", epoch=1, state=None)
    recorded_after = audit.Led(seq=3, scope=SCOPE, epoch=2)
    recorded_before = audit.Led(seq=1, scope=SCOPE, epoch=2)
    assert audit.stale_writes([recorded_after, write]) == []
    assert audit.stale_writes([write, recorded_before]) == [audit.StaleWrite(write, 2, None)]
