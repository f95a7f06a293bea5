"""An audit trail of fenced writes, kept by the database itself.

:func:`install` adds two triggers to a fence table. One records every write
that reaches the database (``BEFORE INSERT``: each fenced write is an
``INSERT … ON CONFLICT``, so its proposed row passes there whether or not the
epoch check then lets it through); the other records every write applied
(``AFTER INSERT OR UPDATE`` of a fence row), with its epoch and state, in the
order the database applied them. Writes to one entity are serialised by the
row lock, so per entity the audit order is the order of application. Tests (and the
demo) use them to prove that a write reached the database and was rejected there, that
epochs never decrease, and that nothing was applied twice.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import asyncpg

from kopf_reconcile._cogs.pg import qualified_table

Writes = dict[str, list[tuple[int, Any]]]


async def install(dsn: str, fence_table: str = "kopf_reconcile_fence") -> None:
    """Create the audit tables and the triggers on ``fence_table`` (which must exist)."""
    fence_table = qualified_table("fence_table", fence_table)
    connection = await asyncpg.connect(dsn)
    try:
        for kind, moment in (("attempted", "BEFORE INSERT"), ("applied", "AFTER INSERT OR UPDATE")):
            await connection.execute(f"""
                CREATE TABLE fence_{kind} (
                    seq       bigserial PRIMARY KEY,
                    entity_id text   NOT NULL,
                    epoch     bigint NOT NULL,
                    state     jsonb
                );
                CREATE FUNCTION fence_{kind}_record() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN
                    INSERT INTO fence_{kind} (entity_id, epoch, state)
                    VALUES (NEW.entity_id, NEW.last_epoch, NEW.state);
                    RETURN NEW;
                END $$;
                CREATE TRIGGER fence_{kind} {moment} ON {fence_table}
                    FOR EACH ROW EXECUTE FUNCTION fence_{kind}_record();
            """)
    finally:
        await connection.close()


async def applied_writes(dsn: str) -> Writes:
    """Per entity, every applied write as ``(epoch, state)``, in the order applied."""
    return await _writes(dsn, "applied")


async def attempted_writes(dsn: str) -> Writes:
    """Per entity, every write that reached the database, applied or not."""
    return await _writes(dsn, "attempted")


def epoch_regressions(writes: Writes) -> list[str]:
    """Entities where an older epoch was applied after a newer one (a stale write accepted)."""
    return [
        entity
        for entity, applied in writes.items()
        if [epoch for epoch, _ in applied] != sorted(epoch for epoch, _ in applied)
    ]


def assert_epochs_never_decrease(writes: Writes) -> None:
    regressions = epoch_regressions(writes)
    if regressions:
        raise AssertionError(f"an older epoch was applied after a newer one: {regressions}")


async def _writes(dsn: str, kind: str) -> Writes:
    connection = await asyncpg.connect(dsn)
    try:
        rows = await connection.fetch(
            f"SELECT entity_id, epoch, state::text FROM fence_{kind} ORDER BY seq"
        )
    finally:
        await connection.close()
    writes: Writes = defaultdict(list)
    for row in rows:
        state = None if row["state"] is None else json.loads(row["state"])
        writes[row["entity_id"]].append((int(row["epoch"]), state))
    return dict(writes)
