"""An audit trail of fenced writes, kept by the database itself.

:func:`install` adds a trigger to a fence table that records every applied
write (insert or update of a fence row) with its epoch and state, in the
order the database applied them. Writes to one entity are serialised by the
row lock, so per entity the audit order is the order of application; tests
use it to prove that epochs never decrease and that nothing was applied twice.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import asyncpg

AUDIT_TABLE = "fence_audit"


async def install(dsn: str, fence_table: str = "kopf_reconcile_fence") -> None:
    """Create the audit table and the trigger on ``fence_table`` (which must exist)."""
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute(f"""
            CREATE TABLE {AUDIT_TABLE} (
                seq       bigserial PRIMARY KEY,
                scope     text   NOT NULL,
                entity_id text   NOT NULL,
                epoch     bigint NOT NULL,
                state     jsonb
            );
            CREATE FUNCTION {AUDIT_TABLE}_record() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO {AUDIT_TABLE} (scope, entity_id, epoch, state)
                VALUES (NEW.scope, NEW.entity_id, NEW.last_epoch, NEW.state);
                RETURN NEW;
            END $$;
            CREATE TRIGGER {AUDIT_TABLE} AFTER INSERT OR UPDATE ON {fence_table}
                FOR EACH ROW EXECUTE FUNCTION {AUDIT_TABLE}_record();
        """)
    finally:
        await connection.close()


async def applied_writes(dsn: str) -> dict[str, list[tuple[int, Any]]]:
    """Per entity, every applied write as ``(epoch, state)``, in the order applied."""
    connection = await asyncpg.connect(dsn)
    try:
        rows = await connection.fetch(
            f"SELECT entity_id, epoch, state::text FROM {AUDIT_TABLE} ORDER BY seq"
        )
    finally:
        await connection.close()
    writes: dict[str, list[tuple[int, Any]]] = defaultdict(list)
    for row in rows:
        state = None if row["state"] is None else json.loads(row["state"])
        writes[row["entity_id"]].append((int(row["epoch"]), state))
    return dict(writes)


def assert_epochs_never_decrease(writes: dict[str, list[tuple[int, Any]]]) -> None:
    for entity, applied in writes.items():
        epochs = [epoch for epoch, _ in applied]
        assert epochs == sorted(epochs), f"{entity}: an older epoch was applied after a newer one"
