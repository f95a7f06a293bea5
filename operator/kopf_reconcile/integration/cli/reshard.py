"""``kopf-reconcile reshard --reconciler R --shards M [--by-namespace] --leases STORE``.

It changes a reconciler's shard layout in one PostgreSQL transaction (M = 1: unsharded;
an unsharded reconciler can be sharded): once no lease of the old layout is held in STORE
(no replica of the old layout leads; it refuses otherwise), every scope of the reconciler
is fenced above every epoch it has seen, each entity's rows move to its new scope, and the
new layout is recorded (``PostgresFencedRepository.reshard``); it names the leases the new
layout never uses, and the command that deletes them.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from typing import Any

from kopf_reconcile.api import ConfigError
from kopf_reconcile.database import redact_dsn
from kopf_reconcile.integration import shard_leases
from kopf_reconcile.integration.cli.arguments import (
    database_options,
    failed,
    quiet_libraries,
    required_database,
)
from kopf_reconcile.integration.cli.leases import kubernetes_leases, postgres_leases
from kopf_reconcile.integration.settings import LeaderKind, Settings
from kopf_reconcile.integration.tables import escape_terminal, format_when
from kopf_reconcile.leader.protocol import LeaseRecord
from kopf_reconcile.sharding import MAX_SHARDS

__all__ = ["add_parser", "retired_leases"]


def add_parser(commands: Any) -> None:
    """``reshard``, on the CLI's subcommands."""
    reshard = commands.add_parser(
        "reshard",
        help="change a sharded reconciler's shard count, in one transaction",
        description=(
            "Move a reconciler's entities to a new shard layout in one PostgreSQL "
            "transaction (--shards 1: unsharded): check that no lease of the old layout is "
            "held (stop the replicas of the old layout first), fence every scope of the "
            "reconciler above every epoch it has seen (replicas of the old layout are refused "
            "from the commit on), move each entity's state, dead letter and redrive request "
            "to its new scope, and record the new layout (replicas of it lead from then on)."
        ),
    )
    reshard.add_argument(
        "--reconciler",
        required=True,
        help="the base fenced scope of the reconciler: its reconciler id, unless its "
        "repository was built with an explicit scope (then that scope)",
    )
    reshard.add_argument(
        "--shards",
        required=True,
        type=int,
        help=f"the new shard count (from 1 to {MAX_SHARDS}; 1: unsharded again)",
    )
    reshard.add_argument(
        "--by-namespace", action="store_true", help="assign shards by namespace (as the replicas)"
    )
    reshard.add_argument(
        "--leases",
        choices=[LeaderKind.KUBERNETES.value, LeaderKind.POSTGRES.value],
        help="where the replicas' leases are, to check that none of the old layout is held "
        "(default: $KOPF_RECONCILE_LEADER, or kubernetes inside a pod)",
    )
    reshard.add_argument("--kubeconfig", help="default: in-cluster, $KUBECONFIG, ~/.kube/config")
    reshard.add_argument(
        "-n", "--namespace", help="the Leases' namespace (default: $POD_NAMESPACE or the context's)"
    )
    reshard.add_argument("--table", help="the fence table (default: kopf_reconcile_fence)")
    database_options(reshard, "default: $KOPF_RECONCILE_DATABASE_URL")
    reshard.set_defaults(command=_reshard)


def _reshard(args: argparse.Namespace) -> int:
    quiet_libraries()
    url = required_database(args, "reshard")
    config = Settings.load(database_url=url)
    leases = _reshard_lease_store(args, config)
    try:
        report = asyncio.run(_run_reshard(url, args, leases, config))
    except ConfigError:
        raise  # a refusal (never led, a shard's scope, same layout, no tables, ...): status 2
    except Exception as exc:
        return failed(f"kopf-reconcile reshard: nothing changed at {redact_dsn(url)}", exc)
    print(
        escape_terminal(
            f"resharded {report.scope}: {report.old_layout} -> {report.new_layout}, "
            f"fence epoch {report.fence_epoch}"
        )
    )
    if report.new_shards == 1:
        print(f"  unsharded: {report.entities[0]} entities ({report.moved[0]} moved in)")
    for k, count in report.entities.items() if report.new_shards > 1 else ():
        print(f"  shard {k}: {count} entities ({report.moved[k]} moved in)")
    print(
        f"dead letters moved: {report.dead_letters_moved}; redrive requests moved: "
        f"{report.redrives_moved}"
        + (
            f"; duplicate redrive requests merged: {report.duplicates_dropped}"
            if report.duplicates_dropped
            else ""
        )
    )
    kind = "shard lease" if report.old_shards > 1 else "lease"
    print(
        f"no {kind} of {report.reconciler_id} was held ({leases.value} leases); its scopes "
        f"now record epoch {report.fence_epoch}: writes of replicas of the old layout are "
        "refused, and they lead nothing again"
    )
    retired = retired_leases(report.reconciler_id, report.old_shards, report.new_shards)
    if retired:
        print(escape_terminal(_retired_leases_advice(retired, leases, args, config)))
    return 0


def retired_leases(reconciler_id: str, old_shards: int, new_shards: int) -> list[str]:
    """The leases a layout change leaves unused: the shard and membership leases of shards
    ``>= new_shards`` (all of them when unsharded again), or the reconciler's own lease when
    it becomes sharded."""
    if old_shards == 1:
        return [reconciler_id]
    gone = range(new_shards if new_shards > 1 else 0, old_shards)
    return [f"{reconciler_id}-{kind}-{k}" for kind in ("shard", "member") for k in gone]


def _retired_leases_advice(
    retired: Sequence[str], leases: LeaderKind, args: argparse.Namespace, config: Settings
) -> str:
    """Which leases the new layout never uses, and the command that deletes them.

    Deleting them is safe once no replica of the old layout runs (the command checked it):
    each one's epochs are fenced in the store, and a lease made again later starts above
    them (its epoch floor).
    """
    names = " ".join(retired)
    if leases is LeaderKind.KUBERNETES:
        namespace = args.namespace or config.pod_namespace
        where = f" -n {namespace}" if namespace else ""
        how = f"kubectl delete lease{where} {names}"
    else:
        quoted = ", ".join(f"'{name}'" for name in retired)
        from kopf_reconcile.leader.postgres import DEFAULT_LEASE_TABLE

        how = f"DELETE FROM {DEFAULT_LEASE_TABLE} WHERE reconciler_id IN ({quoted})"
    return (
        f"leases the new layout never uses: {', '.join(retired)}; once no replica of the old "
        f"layout runs, delete them: {how}"
    )


def _reshard_lease_store(args: argparse.Namespace, config: Settings) -> LeaderKind:
    """Where the replicas' leases are: ``--leases``, else the configured elector."""
    if args.leases is not None:
        return LeaderKind(args.leases)
    # `auto` is resolved only inside a pod: elsewhere it picks PostgreSQL whenever a
    # database URL is given, wherever the replicas' leases are.
    resolved = config.leader is not LeaderKind.AUTO or config.in_cluster
    if resolved and config.leader_kind in (LeaderKind.KUBERNETES, LeaderKind.POSTGRES):
        return config.leader_kind
    raise ConfigError(
        "reshard: say where the replicas' leases are, to check that no replica of the old "
        "layout still leads a shard: --leases kubernetes (Lease objects; -n NAMESPACE) or "
        "--leases postgres (the database's lease table); nothing changed"
    )


WATCH_MARGIN = 1.1  # a lease is watched this many of its durations (clock rates differ)
WATCH_LONGEST = 600.0  # a held lease of a longer duration is refused, not waited for
WATCH_ROUNDS = 3  # new holders appearing while held ones are watched: refuse after this many


class _LeasesToWatch(Exception):
    """Held shard leases not yet seen unrenewed for a whole duration: watch, then retry."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"watch the held shard leases for {seconds:.1f}s")
        self.seconds = seconds


async def _run_reshard(
    url: str, args: argparse.Namespace, leases: LeaderKind, config: Settings
) -> Any:
    from kopf_reconcile.fencing.postgres import DEFAULT_FENCE_TABLE, PostgresFencedRepository

    # Each held shard lease as first seen: (holder, epoch, renewal) and when (this
    # machine's monotonic clock). Clocks of two machines are never compared: a lease's
    # expiry is written by its holder's clock (Kubernetes) or the database's, so a held
    # lease counts as given up only once it went unrenewed for its whole duration as
    # measured here, as client-go's elector decides when it may take one.
    first_seen: dict[str, tuple[tuple[str, int, Any], float]] = {}

    async def no_shard_lease_held(reconciler_id: str, old_leases: tuple[str, ...]) -> None:
        # Runs while the reshard holds the base and shard scopes' rows: no shard epoch can
        # be recorded until it commits, and then only under the new layout. So a replica
        # of the old layout that leads no shard now never leads one again. One that leads
        # (it renews its lease) would go on dispatching its shards' entities, which the
        # new layout gives to other shards, beside their new holders: refuse.
        where = ""
        if leases is LeaderKind.KUBERNETES:
            namespace = args.namespace or config.pod_namespace
            records = await kubernetes_leases(args.kubeconfig, namespace, False)
            where = f" in namespace {namespace}" if namespace else " in the context's namespace"
        else:
            records = await postgres_leases(url)
        # The old layout's leases: its shard leases, or the reconciler's own when unsharded.
        wanted = set(old_leases)
        mine = shard_leases.ordered(r for r in records if r.reconciler_id in wanted)
        kind = "shard lease" if old_leases != (reconciler_id,) else "lease"
        if not mine:  # a reconciler that led leaves its lease records: look elsewhere
            led = "sharded" if kind == "shard lease" else "unsharded"
            raise ConfigError(
                escape_terminal(
                    f"reshard: no {kind} of {reconciler_id} among the {leases.value} "
                    f"leases{where}, though its scope was led {led}: the replicas' leases "
                    "are elsewhere, so whether one still leads cannot be checked; name their "
                    "store (--leases kubernetes -n NAMESPACE, or --leases postgres); "
                    "nothing changed"
                )
            )
        now = time.monotonic()
        held: list[LeaseRecord] = []
        watch = 0.0
        for record in mine:
            if not record.holder_id:
                continue  # released
            renewal = (record.holder_id, record.epoch, record.renewed_at)
            duration = _lease_duration(record)
            seen = first_seen.setdefault(record.reconciler_id, (renewal, now))
            if duration is None or seen[0] != renewal:
                held.append(record)  # renewed (or taken) while watched, or unknowable
            elif now - seen[1] < duration * WATCH_MARGIN:
                watch = max(watch, duration * WATCH_MARGIN - (now - seen[1]))
        if held:
            which = ", ".join(
                f"{r.reconciler_id} by {r.holder_id} until {format_when(r.expires_at)}"
                for r in held
            )
            raise ConfigError(
                escape_terminal(
                    f"reshard: {len(held)} {kind}(s) of {reconciler_id} are held "
                    f"({leases.value} leases): {which}. A replica of the old layout may "
                    "still lead them, and would go on reconciling their entities beside the "
                    "new layout's holders: stop the old layout's replicas, then run the "
                    "command again; nothing changed"
                )
            )
        if watch > 0:
            raise _LeasesToWatch(watch)

    table = args.table or DEFAULT_FENCE_TABLE
    async with PostgresFencedRepository(url, table, scope=args.reconciler) as repository:
        for _ in range(WATCH_ROUNDS):
            try:
                return await repository.reshard(
                    args.shards, by_namespace=args.by_namespace, check=no_shard_lease_held
                )
            except _LeasesToWatch as pending:
                print(
                    f"shard leases still name holders: watching {pending.seconds:.1f}s for a "
                    "renewal (a replica still leading renews; one that stopped does not)",
                    file=sys.stderr,
                )
                await asyncio.sleep(pending.seconds)
    raise ConfigError(
        f"reshard: shard leases kept changing holders over {WATCH_ROUNDS} watches: replicas "
        "still take them; stop the old layout's replicas, then run the command again; "
        "nothing changed"
    )


def _lease_duration(record: LeaseRecord) -> float | None:
    """A lease's duration, from two times its store wrote with one clock (None: unknown,
    or not one to wait for: none, or longer than :data:`WATCH_LONGEST`)."""
    if record.expires_at is None or record.renewed_at is None:
        return None
    duration = (record.expires_at - record.renewed_at).total_seconds()
    return duration if 0 < duration <= WATCH_LONGEST else None
