"""``kopf-reconcile migrate``: the PostgreSQL tables of the fenced repository and the lease
elector (idempotent)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from kopf_reconcile.api import ConfigError
from kopf_reconcile.database import redact_dsn
from kopf_reconcile.integration.cli.arguments import (
    database_options,
    database_settings,
    failed,
    quiet_libraries,
)

__all__ = ["add_parser"]


def add_parser(commands: Any) -> None:
    """``migrate``, on the CLI's subcommands."""
    migrate = commands.add_parser("migrate", help="create the PostgreSQL tables (idempotent)")
    database_options(migrate, "default: $KOPF_RECONCILE_DATABASE_URL")
    migrate.set_defaults(command=_migrate)


def _migrate(args: argparse.Namespace) -> int:
    quiet_libraries()
    config = database_settings(args)
    if config.database_url is None:
        raise ConfigError(
            "migrate needs a database: set KOPF_RECONCILE_DATABASE_URL or pass --database-url-file"
        )
    try:
        tables = asyncio.run(_create_tables(config.database_url))
    except Exception as exc:
        where = redact_dsn(config.database_url)
        return failed(f"kopf-reconcile migrate: cannot create the tables at {where}", exc)
    print(f"schema ready at {redact_dsn(config.database_url)}: {', '.join(tables)}")
    return 0


async def _create_tables(url: str) -> list[str]:
    from kopf_reconcile.fencing.postgres import PostgresFencedRepository
    from kopf_reconcile.leader.postgres import PostgresLeaseElector

    repository = PostgresFencedRepository(url)
    elector = PostgresLeaseElector(url)
    try:
        await repository.migrate()
        await elector.migrate()
    finally:
        await repository.close()
        await elector.close()
    return [repository.table, elector.table]


# -- leases --------------------------------------------------------------------------------
