"""``kopf-reconcile leases``: the kopf-reconcile Leases of a cluster (and, given a database,
the PostgreSQL lease table): reconciler id, holder, epoch, acquired, renewed, expires.

Whoever may edit a Lease chooses its holder text, so control characters are escaped before
they reach a terminal.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from typing import Any

from kopf_reconcile.database import redact_dsn
from kopf_reconcile.integration import shard_leases
from kopf_reconcile.integration.cli.arguments import (
    cluster_options,
    database_options,
    database_settings,
    failed,
    quiet_libraries,
)
from kopf_reconcile.integration.settings import Settings
from kopf_reconcile.integration.tables import escape_terminal, format_when, terminal_table
from kopf_reconcile.leader.protocol import LeaseRecord

__all__ = ["add_parser", "kubernetes_leases", "postgres_leases"]

_COLUMNS = ("NAMESPACE", "RECONCILER", "HOLDER", "EPOCH", "ACQUIRED", "RENEWED", "EXPIRES")


def add_parser(commands: Any) -> None:
    """``leases``, on the CLI's subcommands."""
    leases = commands.add_parser("leases", help="show the kopf-reconcile leases")
    cluster_options(leases)
    database_options(leases, "also show this database's lease table")
    leases.set_defaults(command=_leases)


def _leases(args: argparse.Namespace) -> int:
    quiet_libraries()
    return asyncio.run(_show_leases(args, database_settings(args)))


async def _show_leases(args: argparse.Namespace, config: Settings) -> int:
    status = 0
    try:
        records = await kubernetes_leases(
            args.kubeconfig, args.namespace or config.pod_namespace, args.all_namespaces
        )
    except Exception as exc:
        status = failed("Kubernetes Leases: cannot list them", exc)
    else:
        print("Kubernetes Leases:")
        _print_table(records)
    if config.database_url is not None:
        try:
            records = await postgres_leases(config.database_url)
        except Exception as exc:
            status = failed("PostgreSQL leases: cannot read them", exc)
        else:
            print(f"\nPostgreSQL leases ({redact_dsn(config.database_url)}):")
            _print_table(records)
    return status


async def kubernetes_leases(
    kubeconfig: str | None, namespace: str | None, all_namespaces: bool
) -> list[LeaseRecord]:
    from kopf_reconcile.leader.kubernetes import KubernetesLeaseElector

    # The elector finds the cluster and the namespace by its own rules (in-cluster
    # configuration, else the kubeconfig); the listing is its knowledge too.
    async with KubernetesLeaseElector(namespace=namespace, kubeconfig=kubeconfig) as elector:
        return await elector.list_leases(all_namespaces=all_namespaces)


async def postgres_leases(url: str) -> list[LeaseRecord]:
    from kopf_reconcile.leader.postgres import PostgresLeaseElector

    async with PostgresLeaseElector(url) as elector:
        return await elector.list_leases()


def _rows(records: Sequence[LeaseRecord]) -> list[tuple[str, ...]]:
    """Table rows, each sharded reconciler's shards together and in order."""
    return [
        (
            record.namespace or "-",
            record.reconciler_id,
            record.holder_id or "(released)",
            str(record.epoch),
            format_when(record.acquired_at),
            format_when(record.renewed_at),
            format_when(record.expires_at),
        )
        for record in shard_leases.ordered(records)
    ]


def _print_table(records: Sequence[LeaseRecord]) -> None:
    """The leases; then, per sharded reconciler, its holders with their shards and epochs."""
    if not records:
        print("  (none)")
        return
    rows = _rows(records)
    for line in terminal_table(_COLUMNS, rows):
        print("  " + line)
    for line in shard_leases.summaries(records):
        print("  " + escape_terminal(line))
