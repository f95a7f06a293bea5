"""The ``kopf-reconcile`` command (also ``python -m kopf_reconcile``).

* ``kopf-reconcile run handlers.py [kopf run options]`` runs kopf with the
  handlers, like ``kopf run``, plus what a deployed operator needs: the
  configuration validated before anything starts (a bad value stops the
  process with a message naming the variable), ``/metrics``, ``/healthz`` and
  ``/readyz`` on one port (see :mod:`kopf_reconcile.endpoints`), and JSON or
  text logs with secrets redacted (see :mod:`kopf_reconcile.logs`).
* ``kopf-reconcile migrate`` creates the PostgreSQL tables of the fenced
  repository and the lease elector (idempotent).
* ``kopf-reconcile leases`` prints the kopf-reconcile Leases of a cluster
  (and, given a database, the PostgreSQL lease table): reconciler id, holder,
  epoch, acquired, renewed, expires.

Settings come from the options given here, then the environment (see
:mod:`kopf_reconcile.settings`).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kopf_reconcile import logs
from kopf_reconcile import settings as process_settings
from kopf_reconcile._cogs.pg import qualified_table, redact_dsn
from kopf_reconcile._cogs.tables import format_table
from kopf_reconcile.config import ConfigError
from kopf_reconcile.settings import Settings

__all__ = ["main"]

logger = logging.getLogger("kopf_reconcile.cli")

EXIT_FAILURE = 1
EXIT_USAGE = 2  # a configuration error, as argparse's usage errors


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run the subcommand; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        result: int = args.command(args)
    except ConfigError as exc:
        print(f"kopf-reconcile: configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kopf-reconcile",
        description="controller-runtime-style reconcile loops for kopf operators",
    )
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run",
        help="run an operator: kopf plus metrics, health, redacted logs and env configuration",
        description="Run kopf with the handlers in PATHS/MODULES (kopf run's options apply).",
    )
    run.add_argument("paths", nargs="*", metavar="PATH", help="Python files with handlers")
    run.add_argument("-m", "--module", dest="modules", action="append", default=[])
    run.add_argument("-n", "--namespace", dest="namespaces", action="append", default=[])
    run.add_argument("-A", "--all-namespaces", dest="clusterwide", action="store_true")
    run.add_argument("--standalone", action="store_true", default=None)
    run.add_argument(
        "-P", "--peering", dest="peering_name", default=os.environ.get("KOPF_RUN_PEERING")
    )
    run.add_argument("-p", "--priority", type=int)
    run.add_argument("--dev", action="store_true", help="kopf's dev mode (peering priority 666)")
    run.add_argument("-L", "--liveness", dest="liveness_endpoint", help="kopf's own probe URL")
    verbosity = run.add_mutually_exclusive_group()
    verbosity.add_argument("-v", "--verbose", action="store_true")
    verbosity.add_argument("-d", "--debug", action="store_true")
    verbosity.add_argument("-q", "--quiet", action="store_true")
    run.add_argument("--metrics-host", help="address of /metrics, /healthz, /readyz")
    run.add_argument("--metrics-port", help="port of /metrics, /healthz, /readyz (0: any)")
    run.add_argument("--log-format", choices=("text", "json"), help="default: text")
    run.set_defaults(command=_run)

    migrate = commands.add_parser("migrate", help="create the PostgreSQL tables (idempotent)")
    migrate.add_argument("--database-url", help="default: $KOPF_RECONCILE_DATABASE_URL")
    migrate.set_defaults(command=_migrate)

    leases = commands.add_parser("leases", help="show the kopf-reconcile leases")
    leases.add_argument("--kubeconfig", help="default: in-cluster, $KUBECONFIG, ~/.kube/config")
    scope = leases.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", help="default: $POD_NAMESPACE or the context's")
    scope.add_argument("-A", "--all-namespaces", action="store_true")
    leases.add_argument("--database-url", help="also show this database's lease table")
    leases.set_defaults(command=_leases)

    demo = commands.add_parser(
        "demo",
        help="the whole story on an embedded cluster and an embedded PostgreSQL",
        description=(
            "Start an embedded Kubernetes API, an embedded PostgreSQL and REPLICAS processes of "
            "the example operator; create Devices; SIGKILL the leader; SIGSTOP the next one past "
            "its lease and resume it; verify that every Device converged with no stale write "
            "accepted and no update lost. Exits 0 only if every invariant held."
        ),
    )
    demo.add_argument("--objects", type=int, default=200, help="Devices to create (default 200)")
    demo.add_argument(
        "--replicas", type=int, default=3, help="operator processes (>= 3, default 3)"
    )
    demo.add_argument("--ttl", type=int, default=3, help="lease TTL in seconds (default 3)")
    demo.add_argument(
        "--work-delay", type=float, default=0.2,
        help="simulated device I/O per reconcile, seconds (default 0.2)",
    )  # fmt: skip
    demo.add_argument("--handlers", type=Path, help="default: operator/examples/devices.py")
    demo.add_argument(
        "--keep", action="store_true", help="keep the temporary directory (logs, kubeconfig)"
    )
    demo.set_defaults(command=_demo)
    return parser


def _demo(args: argparse.Namespace) -> int:
    from kopf_reconcile import demo

    options = demo.Options(
        objects=args.objects,
        replicas=args.replicas,
        keep=args.keep,
        ttl=args.ttl,
        work_delay=args.work_delay,
        handlers=args.handlers,
    )
    return demo.run(options)


# -- run ---------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
    if args.namespaces and args.clusterwide:
        raise ConfigError("give either --namespace or --all-namespaces, not both")
    if not args.paths and not args.modules:
        raise ConfigError("run: name at least one handlers file (PATH) or --module")
    level = "DEBUG" if args.debug or args.verbose else "WARNING" if args.quiet else None
    config = Settings.load(
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        log_format=args.log_format,
        log_level=level,
    )
    logs.configure(config.log_format.value, config.log_level)
    process_settings.install(config)
    logger.info("kopf-reconcile settings: %s", config.describe())
    _load_handlers(args.paths, args.modules)
    try:
        return asyncio.run(_serve(args, config))
    except Exception:
        logger.exception("the operator failed")
        return EXIT_FAILURE


def _load_handlers(paths: Sequence[str], modules: Sequence[str]) -> None:
    """Import the handler files and modules, as ``kopf run`` does, registering their handlers."""
    for index, path in enumerate(paths):
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"run: handlers file {path!r} does not exist")
        sys.path.insert(0, str(file.resolve().parent))
        name = f"__kopf_reconcile_handlers_{index}__"
        spec = importlib.util.spec_from_file_location(name, file)
        if spec is None or spec.loader is None:
            raise ConfigError(f"run: {path!r} cannot be loaded as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    for name in modules:
        importlib.import_module(name)


async def _serve(args: argparse.Namespace, config: Settings) -> int:
    """The endpoints, then kopf until it stops; the exit status."""
    import kopf

    from kopf_reconcile import kopf_shim
    from kopf_reconcile.endpoints import Endpoints

    ready = asyncio.Event()
    host, port = config.metrics_host, config.metrics_port
    endpoints = Endpoints(host, port, ready=ready.is_set, report=kopf_shim.status)
    try:
        url = await endpoints.start()
    except OSError as exc:
        logger.error(
            "cannot serve /metrics, /healthz and /readyz on %s:%d (KOPF_RECONCILE_METRICS_HOST, "
            "KOPF_RECONCILE_METRICS_PORT): %s",
            host,
            port,
            exc,
        )
        return EXIT_FAILURE
    logger.info("serving %s/metrics, %s/healthz and %s/readyz", url, url, url)
    try:
        await kopf.operator(
            namespaces=args.namespaces,
            clusterwide=args.clusterwide,
            standalone=args.standalone,
            peering_name=args.peering_name,
            priority=666 if args.dev else args.priority,
            liveness_endpoint=args.liveness_endpoint,
            ready_flag=ready,
        )
    finally:
        await endpoints.stop()
    return 0


# -- migrate -------------------------------------------------------------------------------


def _migrate(args: argparse.Namespace) -> int:
    config = Settings.load(database_url=args.database_url)
    if config.database_url is None:
        raise ConfigError(
            "migrate needs a database: set KOPF_RECONCILE_DATABASE_URL or pass --database-url"
        )
    tables = asyncio.run(_create_tables(config.database_url))
    print(f"schema ready at {redact_dsn(config.database_url)}: {', '.join(tables)}")
    return 0


async def _create_tables(url: str) -> list[str]:
    from kopf_reconcile.fencing.postgres import PostgresFencedRepository
    from kopf_reconcile.leader.postgres import DEFAULT_LEASE_TABLE, PostgresLeaseElector

    repository = PostgresFencedRepository(url)
    elector = PostgresLeaseElector(url)
    try:
        await repository.migrate()
        await elector.migrate()
    finally:
        await repository.close()
        await elector.close()
    return [repository.table, qualified_table("lease table", DEFAULT_LEASE_TABLE)]


# -- leases --------------------------------------------------------------------------------

_COLUMNS = ("NAMESPACE", "RECONCILER", "HOLDER", "EPOCH", "ACQUIRED", "RENEWED", "EXPIRES")


def _leases(args: argparse.Namespace) -> int:
    config = Settings.load(database_url=args.database_url)
    return asyncio.run(_show_leases(args, config))


async def _show_leases(args: argparse.Namespace, config: Settings) -> int:
    status = 0
    try:
        rows = await _kubernetes_leases(
            args.kubeconfig, args.namespace or config.pod_namespace, args.all_namespaces
        )
    except Exception as exc:
        print(f"Kubernetes Leases: cannot list them: {exc}", file=sys.stderr)
        status = EXIT_FAILURE
    else:
        print("Kubernetes Leases:")
        _print_table(rows)
    if config.database_url is not None:
        try:
            rows = await _postgres_leases(config.database_url)
        except Exception as exc:
            print(f"PostgreSQL leases: cannot read them: {exc}", file=sys.stderr)
            status = EXIT_FAILURE
        else:
            print(f"\nPostgreSQL leases ({redact_dsn(config.database_url)}):")
            _print_table(rows)
    return status


async def _kubernetes_leases(
    kubeconfig: str | None, namespace: str | None, all_namespaces: bool
) -> list[tuple[str, ...]]:
    from kubernetes_asyncio.client import ApiClient, Configuration, CoordinationV1Api
    from kubernetes_asyncio.config import load_incluster_config, load_kube_config
    from kubernetes_asyncio.config.kube_config import list_kube_config_contexts

    from kopf_reconcile.leader.kubernetes import MANAGED_BY, MANAGED_BY_LABEL

    configuration = Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    else:
        await load_kube_config(
            config_file=kubeconfig, client_configuration=configuration, persist_config=False
        )
        if namespace is None:
            _, context = list_kube_config_contexts(kubeconfig)
            namespace = ((context or {}).get("context") or {}).get("namespace")
    selector = f"{MANAGED_BY_LABEL}={MANAGED_BY}"
    async with ApiClient(configuration) as api:
        coordination = CoordinationV1Api(api)
        if all_namespaces:
            listing = await coordination.list_lease_for_all_namespaces(label_selector=selector)
        else:
            listing = await coordination.list_namespaced_lease(
                namespace or "default", label_selector=selector
            )
    rows: list[tuple[str, ...]] = []
    for lease in sorted(
        listing.items, key=lambda item: (item.metadata.namespace, item.metadata.name)
    ):
        spec = lease.spec
        expires = None
        if spec.holder_identity and spec.renew_time and spec.lease_duration_seconds:
            expires = spec.renew_time + datetime.timedelta(seconds=spec.lease_duration_seconds)
        rows.append(
            (
                lease.metadata.namespace,
                lease.metadata.name,
                spec.holder_identity or "(released)",
                str(spec.lease_transitions or 0),
                _when(spec.acquire_time),
                _when(spec.renew_time),
                _when(expires),
            )
        )
    return rows


async def _postgres_leases(url: str) -> list[tuple[str, ...]]:
    import asyncpg

    from kopf_reconcile.leader.postgres import DEFAULT_LEASE_TABLE

    table = qualified_table("lease table", DEFAULT_LEASE_TABLE)
    connection = await asyncpg.connect(url)
    try:
        records = await connection.fetch(
            f"SELECT reconciler_id, holder_id, epoch, acquired_at, renewed_at, expires_at "
            f"FROM {table} ORDER BY reconciler_id"
        )
    except asyncpg.UndefinedTableError:
        return []
    finally:
        await connection.close()
    return [
        (
            "-",
            r["reconciler_id"],
            r["holder_id"] or "(released)",
            str(r["epoch"]),
            _when(r["acquired_at"]),
            _when(r["renewed_at"]),
            _when(r["expires_at"]),
        )
        for r in records
    ]


def _when(moment: Any) -> str:
    if not isinstance(moment, datetime.datetime):
        return "-"
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _print_table(rows: Sequence[tuple[str, ...]]) -> None:
    if not rows:
        print("  (none)")
        return
    for line in format_table(_COLUMNS, rows):
        print("  " + line)
