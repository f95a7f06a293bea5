"""``kopf-reconcile redrive ENTITY|--all``: redrive requests written to PostgreSQL, which the
leader of each reconciler takes (followers never do); given ``--reconciler R``, R's shards'
dead letters too."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from kopf_reconcile.database import redact_dsn
from kopf_reconcile.integration.cli.arguments import (
    EXIT_FAILURE,
    database_options,
    failed,
    quiet_libraries,
    required_database,
)
from kopf_reconcile.integration.tables import escape_terminal

__all__ = ["add_parser"]


def add_parser(commands: Any) -> None:
    """``redrive``, on the CLI's subcommands."""
    redrive = commands.add_parser(
        "redrive",
        help="ask the leader to retry dead-lettered entities",
        description=(
            "Write a redrive request for ENTITY (<namespace>/<name>), or for every dead "
            "letter with --all, to PostgreSQL; the leader of each reconciler takes its "
            "requests within its redrive interval (2 s) and reconciles them at once."
        ),
    )
    target = redrive.add_mutually_exclusive_group(required=True)
    target.add_argument("entity", nargs="?", metavar="ENTITY", help="<namespace>/<name>")
    target.add_argument("--all", action="store_true", help="every dead letter")
    redrive.add_argument(
        "--reconciler", help="only this reconciler id (fenced scope), its shards' included"
    )
    database_options(redrive, "default: $KOPF_RECONCILE_DATABASE_URL")
    redrive.set_defaults(command=_redrive)


def _redrive(args: argparse.Namespace) -> int:
    quiet_libraries()
    url = required_database(args, "redrive")
    entity = None if args.all else args.entity
    try:
        asked = asyncio.run(_request_redrive(url, entity, args.reconciler))
    except Exception as exc:
        where = redact_dsn(url)
        return failed(f"kopf-reconcile redrive: cannot write the request at {where}", exc)
    if not asked:
        what = "no dead letter" if entity is None else f"no dead letter of {entity!r}"
        print(escape_terminal(f"{what} to redrive"), file=sys.stderr)
        return EXIT_FAILURE
    print(
        f"asked the leader to retry {len(asked)} entit{'y' if len(asked) == 1 else 'ies'}: "
        + escape_terminal(", ".join(asked))
    )
    return 0


async def _request_redrive(url: str, entity: str | None, scope: str | None) -> list[str]:
    from kopf_reconcile.fencing.postgres import PostgresFencedRepository

    async with PostgresFencedRepository(url) as repository:
        return await repository.request_redrive(entity, scope=scope)
