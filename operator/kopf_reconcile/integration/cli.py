"""The ``kopf-reconcile`` command (also ``python -m kopf_reconcile``).

(Over 400 lines on purpose: one short section per command (run, migrate, leases, demo)
sharing one argument parser and one way of reporting failures on one line.)

* ``kopf-reconcile run handlers.py [kopf run options]`` runs kopf with the
  handlers, like ``kopf run``, plus what a deployed operator needs: the
  configuration validated before anything starts (a bad value, or a database
  that refuses its URL, stops the process with a message naming the variable;
  a database that does not answer yet is retried), ``/metrics``, ``/healthz`` and
  ``/readyz`` on one port (see :mod:`kopf_reconcile.integration.endpoints`), and JSON or
  text logs with secrets redacted (see :mod:`kopf_reconcile.integration.logs`).
* ``kopf-reconcile migrate`` creates the PostgreSQL tables of the fenced
  repository and the lease elector (idempotent).
* ``kopf-reconcile leases`` prints the kopf-reconcile Leases of a cluster
  (and, given a database, the PostgreSQL lease table): reconciler id, holder,
  epoch, acquired, renewed, expires. Whoever may edit a Lease chooses its
  holder text, so control characters are escaped before they reach a terminal.

The database URL of ``migrate`` and ``leases`` comes from
``KOPF_RECONCILE_DATABASE_URL`` or ``--database-url-file``: a password given with
``--database-url`` is visible to every user of the machine in the process list
(a warning says so). Their failures are one line naming the problem, never a
traceback.

Shutdown. Once kopf's startup is done, ``run`` handles SIGTERM and SIGINT itself:
``/readyz`` answers 503 from that moment (the pod leaves its Service while it
drains), then kopf stops as on its own signal handling.

Settings come from the options given here, then the environment (see
:mod:`kopf_reconcile.integration.settings`).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib
import importlib.util
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kopf_reconcile.api import ConfigError
from kopf_reconcile.database import redact_dsn
from kopf_reconcile.integration import logs
from kopf_reconcile.integration import settings as process_settings
from kopf_reconcile.integration.settings import LeaderKind, Settings
from kopf_reconcile.integration.tables import format_table
from kopf_reconcile.leader.protocol import LeaseRecord
from kopf_reconcile.redaction import redact
from kopf_reconcile.remote_errors import describe_error

__all__ = ["main"]

logger = logging.getLogger("kopf_reconcile.cli")

EXIT_FAILURE = 1
EXIT_USAGE = 2  # a configuration error, as argparse's usage errors
NAMESPACE_CHECK_TIMEOUT = 10.0  # an API server that does not answer is not a config error
DATABASE_CHECK_TIMEOUT = 10.0  # nor is a database that does not answer
# kopf's own signal handling SIGKILLs a shutdown that hangs this long (its
# ultimate_exiting_timeout default); the handling that replaces it keeps that backstop.
ULTIMATE_EXIT_TIMEOUT = 600.0


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
    _database_options(migrate, "default: $KOPF_RECONCILE_DATABASE_URL")
    migrate.set_defaults(command=_migrate)

    leases = commands.add_parser("leases", help="show the kopf-reconcile leases")
    leases.add_argument("--kubeconfig", help="default: in-cluster, $KUBECONFIG, ~/.kube/config")
    scope = leases.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", help="default: $POD_NAMESPACE or the context's")
    scope.add_argument("-A", "--all-namespaces", action="store_true")
    _database_options(leases, "also show this database's lease table")
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


def _database_options(parser: argparse.ArgumentParser, what: str) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--database-url-file",
        metavar="PATH",
        help=f"a file holding the PostgreSQL URL (a mounted Secret); {what}",
    )
    source.add_argument(
        "--database-url",
        help="the PostgreSQL URL itself; a password here shows in the process list: prefer "
        "$KOPF_RECONCILE_DATABASE_URL or --database-url-file",
    )


def _database_url_argument(args: argparse.Namespace) -> str | None:
    """The URL given on the command line (read from its file), warning about a visible password."""
    if args.database_url_file is not None:
        try:
            with open(args.database_url_file, encoding="utf-8") as file:
                from_file = file.read().strip()
        except OSError as exc:
            raise ConfigError(
                f"--database-url-file {args.database_url_file!r} cannot be read: "
                f"{exc.strerror or exc}"
            ) from None
        if not from_file:
            raise ConfigError(f"--database-url-file {args.database_url_file!r} is empty")
        return from_file
    url: str | None = args.database_url
    if url is not None and redact(url) != url:
        print(
            "kopf-reconcile: warning: the password in --database-url is visible to every user "
            "of this machine in the process list; set KOPF_RECONCILE_DATABASE_URL or use "
            "--database-url-file instead",
            file=sys.stderr,
        )
    return url


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
    from kopf_reconcile.integration.kopf_shim import check_reconciler_ids

    check_reconciler_ids(config)  # an ambiguous lease name stops it before anything runs
    asyncio.run(_check_lease_namespace(config))
    asyncio.run(_check_database(config))
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


async def _check_lease_namespace(config: Settings) -> None:
    """With Kubernetes Leases, a namespace that does not exist is a configuration error."""
    if config.leader_kind is not LeaderKind.KUBERNETES:
        return
    from kopf_reconcile.leader.kubernetes import KubernetesLeaseElector

    elector = config.build_elector()
    assert isinstance(elector, KubernetesLeaseElector)
    source = "POD_NAMESPACE" if config.pod_namespace else "the kubeconfig's namespace"
    try:
        async with asyncio.timeout(NAMESPACE_CHECK_TIMEOUT):
            await elector.check_namespace(source)
    except ConfigError:
        raise
    except Exception as exc:
        logger.warning(
            "cannot check that the namespace of the Leases exists: %s", describe_error(exc)
        )
    finally:
        await elector.close()


async def _check_database(config: Settings) -> None:
    """A database that refuses the URL is a configuration error; one that is down is retried."""
    if config.database_url is None or not config.fenced:
        return
    from kopf_reconcile.database import check_database

    source = "KOPF_RECONCILE_DATABASE_URL"
    problem = await check_database(config.database_url, source, DATABASE_CHECK_TIMEOUT)
    if problem is not None:
        logger.warning(
            "cannot reach the database of %s (%s): %s; starting anyway and retrying: no "
            "reconciler leads until it answers",
            source,
            redact_dsn(config.database_url),
            problem,
        )


def _take_over_signals(stop: asyncio.Event) -> None:
    """SIGTERM/SIGINT start the shutdown: readiness goes first, then kopf stops.

    kopf's own handlers (installed before its startup) would stop it without telling
    anyone; these replace them once it has started, and stop it through its stop flag.
    """
    loop = asyncio.get_running_loop()

    def begin(signum: signal.Signals) -> None:
        if stop.is_set():
            return
        logger.info("%s received: shutting down; /readyz answers 503 from now on", signum.name)
        stop.set()
        loop.call_later(ULTIMATE_EXIT_TIMEOUT, os.kill, os.getpid(), signal.SIGKILL)

    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(signum, begin, signum)
        except (NotImplementedError, RuntimeError, ValueError):
            return  # not the main thread, or no signals here: kopf's handling stays


async def _serve(args: argparse.Namespace, config: Settings) -> int:
    """The endpoints, then kopf until it stops; the exit status."""
    import kopf

    from kopf_reconcile.integration import kopf_shim
    from kopf_reconcile.integration.endpoints import Endpoints

    ready = asyncio.Event()
    stop = asyncio.Event()
    host, port = config.metrics_host, config.metrics_port
    from kopf_reconcile.integration.watch_probe import WatchProbe, targets

    # Ready also means every watch kopf keeps is allowed and answering (a forbidden watch
    # leaves the operator idle while kopf's own startup flag says it is done).
    probe = WatchProbe(targets(kopf_shim.watched_resources(), args.namespaces, args.clusterwide))
    endpoints = Endpoints(
        host,
        port,
        ready=ready.is_set,
        report=kopf_shim.status,
        stopping=stop.is_set,
        problem=probe.problem,
    )
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
    if config.in_cluster and not config.metrics_host_given:
        logger.info(
            "listening on all addresses (%s) because this process runs in a pod, where the "
            "kubelet and Prometheus reach the pod's IP; KOPF_RECONCILE_METRICS_HOST changes it",
            host,
        )

    async def signals_once_started() -> None:
        await ready.wait()
        _take_over_signals(stop)

    taking_over = asyncio.create_task(signals_once_started())
    try:
        await probe.start()
        await kopf.operator(
            namespaces=args.namespaces,
            clusterwide=args.clusterwide,
            standalone=args.standalone,
            peering_name=args.peering_name,
            priority=666 if args.dev else args.priority,
            liveness_endpoint=args.liveness_endpoint,
            ready_flag=ready,
            stop_flag=stop,
        )
    finally:
        taking_over.cancel()
        await probe.stop()
        await endpoints.stop()
    return 0


# -- migrate -------------------------------------------------------------------------------


def _quiet_libraries() -> None:
    """The one-line failure says it all: no library warning repeats it (without logging set up,
    Python prints warnings to stderr)."""
    for name in ("kubernetes_asyncio", "asyncpg"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _migrate(args: argparse.Namespace) -> int:
    _quiet_libraries()
    config = Settings.load(database_url=_database_url_argument(args))
    if config.database_url is None:
        raise ConfigError(
            "migrate needs a database: set KOPF_RECONCILE_DATABASE_URL or pass --database-url-file"
        )
    try:
        tables = asyncio.run(_create_tables(config.database_url))
    except Exception as exc:
        print(
            f"kopf-reconcile migrate: cannot create the tables at "
            f"{redact_dsn(config.database_url)}: {redact(describe_error(exc))}",
            file=sys.stderr,
        )
        return EXIT_FAILURE
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

_COLUMNS = ("NAMESPACE", "RECONCILER", "HOLDER", "EPOCH", "ACQUIRED", "RENEWED", "EXPIRES")


def _leases(args: argparse.Namespace) -> int:
    _quiet_libraries()
    config = Settings.load(database_url=_database_url_argument(args))
    return asyncio.run(_show_leases(args, config))


async def _show_leases(args: argparse.Namespace, config: Settings) -> int:
    status = 0
    try:
        rows = await _kubernetes_leases(
            args.kubeconfig, args.namespace or config.pod_namespace, args.all_namespaces
        )
    except Exception as exc:
        print(
            f"Kubernetes Leases: cannot list them: {redact(describe_error(exc))}", file=sys.stderr
        )
        status = EXIT_FAILURE
    else:
        print("Kubernetes Leases:")
        _print_table(rows)
    if config.database_url is not None:
        try:
            rows = await _postgres_leases(config.database_url)
        except Exception as exc:
            print(
                f"PostgreSQL leases: cannot read them: {redact(describe_error(exc))}",
                file=sys.stderr,
            )
            status = EXIT_FAILURE
        else:
            print(f"\nPostgreSQL leases ({redact_dsn(config.database_url)}):")
            _print_table(rows)
    return status


async def _kubernetes_leases(
    kubeconfig: str | None, namespace: str | None, all_namespaces: bool
) -> list[tuple[str, ...]]:
    from kopf_reconcile.leader.kubernetes import KubernetesLeaseElector

    # The elector finds the cluster and the namespace by its own rules (in-cluster
    # configuration, else the kubeconfig); the listing is its knowledge too.
    async with KubernetesLeaseElector(namespace=namespace, kubeconfig=kubeconfig) as elector:
        return _rows(await elector.list_leases(all_namespaces=all_namespaces))


async def _postgres_leases(url: str) -> list[tuple[str, ...]]:
    from kopf_reconcile.leader.postgres import PostgresLeaseElector

    async with PostgresLeaseElector(url) as elector:
        return _rows(await elector.list_leases())


def _rows(records: Sequence[LeaseRecord]) -> list[tuple[str, ...]]:
    return [
        (
            record.namespace or "-",
            record.reconciler_id,
            record.holder_id or "(released)",
            str(record.epoch),
            _when(record.acquired_at),
            _when(record.renewed_at),
            _when(record.expires_at),
        )
        for record in records
    ]


def _when(moment: Any) -> str:
    if not isinstance(moment, datetime.datetime):
        return "-"
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _print_table(rows: Sequence[tuple[str, ...]]) -> None:
    if not rows:
        print("  (none)")
        return
    for line in format_table(_COLUMNS, [tuple(map(escape_terminal, row)) for row in rows]):
        print("  " + line)


def escape_terminal(text: str) -> str:
    """``text`` safe to print on a terminal: no escape sequence or control character survives.

    ESC becomes ``^[`` and CR ``\\r``, as kubectl's printers write them; every other
    character that is not printable (other controls, bidirectional overrides, ...) is
    written as its Python escape (``\\x07``, ``\\u202e``).
    """
    if text.isprintable():
        return text
    out: list[str] = []
    for char in text:
        if char == "\x1b":
            out.append("^[")
        elif char == "\r":
            out.append("\\r")
        elif char.isprintable():
            out.append(char)
        else:
            out.append(char.encode("unicode_escape").decode("ascii"))
    return "".join(out)
