"""``kopf-reconcile status``: per reconciler the leader, its epoch and since when it leads,
failovers in the last hour (from the database's record of each epoch that led, else from
the Lease), dead letters, and, given the replicas' addresses (``--endpoint``), the leader's
queued and in-flight reconciles (from ``/healthz``); given ``--reconciler R``, R's shard
and membership leases too."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
from collections.abc import Sequence
from typing import Any

from kopf_reconcile.integration.cli.arguments import (
    cluster_options,
    database_options,
    database_settings,
    failed,
    quiet_libraries,
)
from kopf_reconcile.integration.cli.leases import kubernetes_leases
from kopf_reconcile.integration.settings import Settings
from kopf_reconcile.integration.tables import format_when, terminal_table
from kopf_reconcile.leader.protocol import LeaseRecord
from kopf_reconcile.remote_errors import describe_error
from kopf_reconcile.sharding import of_reconciler

__all__ = ["add_parser"]

_STATUS_COLUMNS = (
    "NAMESPACE", "RECONCILER", "LEADER", "EPOCH", "SINCE", "FAILOVERS(1H)", "DEAD LETTERS",
    "QUEUED", "IN FLIGHT",
)  # fmt: skip
FAILOVER_WINDOW = 3600.0  # "failovers in the last hour"
ENDPOINT_TIMEOUT = 5.0


def add_parser(commands: Any) -> None:
    """``status``, on the CLI's subcommands."""
    status = commands.add_parser(
        "status",
        help="per reconciler: leader, epoch, failovers, dead letters, queue",
        description=(
            "Per reconciler: the leader and its epoch, since when it leads, failovers in "
            "the last hour, dead letters (with a database), and queued and in-flight work "
            "of the leader when its endpoint is given (--endpoint, repeatable)."
        ),
    )
    cluster_options(status)
    status.add_argument(
        "--endpoint",
        dest="endpoints",
        action="append",
        default=[],
        metavar="URL",
        help="a replica's metrics address (http://host:port), for queue figures; repeatable",
    )
    status.add_argument(
        "--reconciler", help="only this reconciler id, with its shard and membership leases"
    )
    database_options(status, "dead letters, failovers and the PostgreSQL lease table")
    status.set_defaults(command=_status)


def _status(args: argparse.Namespace) -> int:
    quiet_libraries()
    return asyncio.run(_show_status(args, database_settings(args)))


async def _show_status(args: argparse.Namespace, config: Settings) -> int:
    status = 0
    records: list[LeaseRecord] = []
    try:
        records += await kubernetes_leases(
            args.kubeconfig, args.namespace or config.pod_namespace, args.all_namespaces
        )
    except Exception as exc:
        status = failed("Kubernetes Leases: cannot list them", exc)
    dead: dict[str, int] = {}
    changes: dict[str, int] | None = None
    if config.database_url is not None:
        try:
            records += await _postgres_lease_records(config.database_url)
            dead, changes = await _database_figures(config.database_url)
        except Exception as exc:
            status = failed("PostgreSQL: cannot read it", exc)
    if args.reconciler is not None:
        records = [r for r in records if of_reconciler(r.reconciler_id, args.reconciler)]
    queues = await _leader_queues(args.endpoints)
    now = datetime.datetime.now(datetime.UTC)
    rows = []
    for record in _without_left_stores(records, now):
        rid = record.reconciler_id
        if changes is not None:
            failovers = str(changes.get(rid, 0))
        elif record.acquired_at is not None and record.holder_id:
            recent = (now - record.acquired_at).total_seconds() < FAILOVER_WINDOW
            failovers = ">=1" if recent else "0"  # the Lease keeps only the latest
        else:
            failovers = "-"
        queue = queues.get(rid)
        rows.append(
            (
                record.namespace or "(postgresql)",
                rid,
                record.holder_id or "(none)",
                str(record.epoch),
                format_when(record.acquired_at) if record.holder_id else "-",
                failovers,
                str(dead.get(rid, 0)) if config.database_url is not None else "-",
                "-" if queue is None else str(queue.get("queued", "-")),
                "-" if queue is None else str(queue.get("in_flight", "-")),
            )
        )
    if not rows:
        print("no kopf-reconcile leases found")
        return status
    for line in terminal_table(_STATUS_COLUMNS, rows):
        print(line)
    return status


def _without_left_stores(
    records: Sequence[LeaseRecord], now: datetime.datetime
) -> list[LeaseRecord]:
    """The records, less those a reconciler left behind in a lease store it no longer uses.

    After a switch of KOPF_RECONCILE_LEADER (PostgreSQL rows to Kubernetes Leases, or back)
    the old store keeps a released or expired record: shown, it would be a second, stale
    row of a reconciler that is held in the other store.
    """

    def store(record: LeaseRecord) -> str:
        return "postgresql" if record.namespace is None else "kubernetes"

    held = {(r.reconciler_id, store(r)) for r in records if r.held_at(now)}
    return [
        r
        for r in records
        if r.held_at(now) or not any(rid == r.reconciler_id and s != store(r) for rid, s in held)
    ]


async def _postgres_lease_records(url: str) -> list[LeaseRecord]:
    from kopf_reconcile.leader.postgres import PostgresLeaseElector

    async with PostgresLeaseElector(url) as elector:
        try:
            return await elector.list_leases()
        except Exception as exc:
            if type(exc).__name__ == "UndefinedTableError":
                return []  # Kubernetes Leases only: no lease table
            raise


async def _database_figures(url: str) -> tuple[dict[str, int], dict[str, int]]:
    """Dead letters and leadership changes in the last hour, per fenced scope."""
    from kopf_reconcile.fencing.postgres import PostgresFencedRepository

    async with PostgresFencedRepository(url) as repository:
        dead: dict[str, int] = {}
        for letter in await repository.list_dead_letters():
            dead[letter.reconciler_id] = dead.get(letter.reconciler_id, 0) + 1
        return dead, await repository.leadership_changes(FAILOVER_WINDOW)


# -- reshard ----------------------------------------------------------------------------------


async def _leader_queues(endpoints: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per reconciler id, the figures its leader's ``/healthz`` reports (reachable ones only)."""
    if not endpoints:
        return {}
    import aiohttp

    found: dict[str, dict[str, Any]] = {}
    timeout = aiohttp.ClientTimeout(total=ENDPOINT_TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for endpoint in endpoints:
            url = endpoint.rstrip("/") + "/healthz"
            try:
                async with http.get(url) as response:
                    report = await response.json()
            except Exception as exc:
                print(f"{url}: not reachable: {describe_error(exc)}", file=sys.stderr)
                continue
            reconcilers = report.get("reconcilers") if isinstance(report, dict) else None
            for rid, figures in (reconcilers or {}).items():
                if isinstance(figures, dict) and figures.get("leader"):
                    found[rid] = figures
    return found
