"""``kopf-reconcile dead-letters [-n NS] [--reconciler R]``: the dead letters leaders kept in
PostgreSQL (given ``--reconciler R``, R's shards' too)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from kopf_reconcile.database import redact_dsn
from kopf_reconcile.integration.cli.arguments import (
    database_options,
    failed,
    quiet_libraries,
    required_database,
)
from kopf_reconcile.integration.tables import format_when, terminal_table

__all__ = ["add_parser"]

_DEAD_COLUMNS = ("RECONCILER", "ENTITY", "ATTEMPTS", "EPOCH", "FIRST", "LAST", "REASON")


def add_parser(commands: Any) -> None:
    """``dead-letters``, on the CLI's subcommands."""
    dead = commands.add_parser(
        "dead-letters", help="list the dead letters a leader kept in PostgreSQL"
    )
    dead.add_argument("-n", "--namespace", help="only entities of this namespace")
    dead.add_argument(
        "--reconciler", help="only this reconciler id (fenced scope), its shards' included"
    )
    database_options(dead, "default: $KOPF_RECONCILE_DATABASE_URL")
    dead.set_defaults(command=_dead_letters)


def _dead_letters(args: argparse.Namespace) -> int:
    quiet_libraries()
    url = required_database(args, "dead-letters")
    try:
        letters = asyncio.run(_list_dead_letters(url, args.reconciler, args.namespace))
    except Exception as exc:
        return failed(f"kopf-reconcile dead-letters: cannot read them at {redact_dsn(url)}", exc)
    rows = [
        (
            d.reconciler_id,
            d.entity_id,
            str(d.attempts),
            str(d.epoch),
            format_when(d.first_at),
            format_when(d.last_at),
            d.reason,
        )
        for d in letters
    ]
    if not rows:
        print("no dead letters")
        return 0
    for line in terminal_table(_DEAD_COLUMNS, rows):
        print(line)
    return 0


async def _list_dead_letters(url: str, scope: str | None, namespace: str | None) -> list[Any]:
    from kopf_reconcile.fencing.postgres import PostgresFencedRepository

    async with PostgresFencedRepository(url) as repository:
        return await repository.list_dead_letters(scope=scope, namespace=namespace)
