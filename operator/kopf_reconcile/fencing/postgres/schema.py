"""The tables of :class:`~kopf_reconcile.fencing.postgres.PostgresFencedRepository`.

* ``<table>``: one fence row per entity, keyed by ``(scope, entity_id)``,
  recording the highest epoch that ever wrote to that entity
  (``last_epoch``), the entity's tenant, its state document and when it last
  changed;
* ``<table>_epochs``: one row per scope, the highest epoch that has *led*
  it (recorded by the Loop before it dispatches, ``record_epoch``), and
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
"""

from __future__ import annotations

import dataclasses

from kopf_reconcile.database import qualified_table

__all__ = ["DEFAULT_FENCE_TABLE", "Tables"]

DEFAULT_FENCE_TABLE = "kopf_reconcile_fence"


@dataclasses.dataclass(frozen=True)
class Tables:
    """The quoted, possibly schema-qualified names of the five tables."""

    fence: str
    epochs: str  # the epochs that led each scope, recorded before they write
    dead: str  # durable dead letters
    redrives: str  # redrive requests
    leaders: str  # the leadership changes of each scope

    @classmethod
    def named(cls, table: str) -> Tables:
        """The tables of the fence table ``table`` (checked as an identifier)."""
        return cls(
            fence=qualified_table("table", table),
            epochs=qualified_table("table", f"{table}_epochs"),
            dead=qualified_table("table", f"{table}_dead_letters"),
            redrives=qualified_table("table", f"{table}_redrives"),
            leaders=qualified_table("table", f"{table}_leaders"),
        )

    def schema(self) -> list[str]:
        """The statements that create them (idempotent)."""
        return [
            _schema(self.fence),
            *_epochs_schema(self.epochs),
            *_side_tables_schema(self.dead, self.redrives, self.leaders),
        ]


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
