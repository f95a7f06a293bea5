"""The ``kopf-reconcile`` command (also ``python -m kopf_reconcile``).

(Over 400 lines on purpose: one short section per command (run, migrate, leases, dead
letters, redrive, status, reshard, demo) sharing one argument parser and one way of
reporting failures on one line.)

* ``kopf-reconcile run handlers.py [kopf run options]`` runs kopf with the
  handlers, like ``kopf run``, plus what a deployed operator needs: the
  configuration validated before anything starts (a bad value, or a database
  that refuses its URL, stops the process with a message naming the variable;
  a database that does not answer yet is retried), ``/metrics``, ``/healthz`` and
  ``/readyz`` on one port (see :mod:`kopf_reconcile.integration.endpoints`), and JSON or
  text logs with secrets redacted (see :mod:`kopf_reconcile.integration.logs`). With
  uvloop installed (``pip install kopf-reconcile[uvloop]``) it runs on uvloop's event
  loop, as ``kopf run`` does: about a tenth less CPU per object at 10,000 objects
  (``benchmarks/kopf_e2e.py``).
* ``kopf-reconcile migrate`` creates the PostgreSQL tables of the fenced
  repository and the lease elector (idempotent).
* ``kopf-reconcile leases`` prints the kopf-reconcile Leases of a cluster
  (and, given a database, the PostgreSQL lease table): reconciler id, holder,
  epoch, acquired, renewed, expires. Whoever may edit a Lease chooses its
  holder text, so control characters are escaped before they reach a terminal.
* ``kopf-reconcile dead-letters [-n NS] [--reconciler R]`` lists the dead letters
  leaders kept in PostgreSQL; ``kopf-reconcile redrive ENTITY|--all`` writes redrive
  requests there, which the leader of each reconciler takes (followers never do).
* ``kopf-reconcile status`` shows per reconciler the leader, its epoch and since when
  it leads, failovers in the last hour (from the database's record of each epoch that
  led, else from the Lease), dead letters, and, given the replicas' addresses (``--endpoint``),
  the leader's queued and in-flight reconciles (from ``/healthz``).
* ``kopf-reconcile reshard --reconciler R --shards M [--by-namespace] --leases STORE``
  changes a reconciler's shard layout in one PostgreSQL transaction (M = 1: unsharded;
  an unsharded reconciler can be sharded): once no lease of the old layout is held in
  STORE (no replica of the old layout leads; it refuses otherwise), every scope of the
  reconciler is fenced above every epoch it has seen, each entity's rows move to its new
  scope, and the new layout is recorded (``PostgresFencedRepository.reshard``); it names
  the leases the new layout never uses, and the command that deletes them. ``dead-letters``,
  ``redrive`` and ``status`` given ``--reconciler R`` include R's shards.

* ``kopf-reconcile init NAME`` writes a new operator project into an empty folder
  (:mod:`kopf_reconcile.commands.init`).
* ``kopf-reconcile dev [HANDLERS]`` starts an embedded Kubernetes API and PostgreSQL for your
  own work and runs the handlers on them (:mod:`kopf_reconcile.commands.dev`).

As ``kubectl-reconcile`` the same commands are a kubectl plugin: ``kubectl reconcile status``.

The database URL of ``migrate``, ``leases`` and the others comes from
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
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kopf_reconcile.api import ConfigError
from kopf_reconcile.commands import dev, fence_policy, init
from kopf_reconcile.database import redact_dsn
from kopf_reconcile.integration import logs, shard_leases
from kopf_reconcile.integration import settings as process_settings
from kopf_reconcile.integration.metrics_auth import server_tls
from kopf_reconcile.integration.settings import LeaderKind, MetricsAuth, Settings
from kopf_reconcile.integration.tables import format_table
from kopf_reconcile.leader.protocol import LeaseRecord
from kopf_reconcile.redaction import dsn_secrets, redact
from kopf_reconcile.remote_errors import describe_error
from kopf_reconcile.sharding import MAX_SHARDS, of_reconciler

__all__ = ["main"]

logger = logging.getLogger("kopf_reconcile.cli")

EXIT_FAILURE = 1
EXIT_USAGE = 2  # a configuration error, as argparse's usage errors
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # the reader left (`| head -1`): as SIGPIPE ends kubectl
NAMESPACE_CHECK_TIMEOUT = 10.0  # an API server that does not answer is not a config error
DATABASE_CHECK_TIMEOUT = 10.0  # nor is a database that does not answer
# kopf's own signal handling SIGKILLs a shutdown that hangs this long (its
# ultimate_exiting_timeout default); the handling that replaces it keeps that backstop.
ULTIMATE_EXIT_TIMEOUT = 600.0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run the subcommand; returns the exit status."""
    try:
        try:
            return _command(argv)
        finally:  # a reader that left is found here, not in the interpreter's exit
            sys.stdout.flush()
    except BrokenPipeError:
        # Nobody reads the rest: say nothing more, and keep the interpreter's last flush of
        # stdout from failing again with a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _command(argv: Sequence[str] | None) -> int:
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

    dead = commands.add_parser(
        "dead-letters", help="list the dead letters a leader kept in PostgreSQL"
    )
    dead.add_argument("-n", "--namespace", help="only entities of this namespace")
    dead.add_argument(
        "--reconciler", help="only this reconciler id (fenced scope), its shards' included"
    )
    _database_options(dead, "default: $KOPF_RECONCILE_DATABASE_URL")
    dead.set_defaults(command=_dead_letters)

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
    _database_options(redrive, "default: $KOPF_RECONCILE_DATABASE_URL")
    redrive.set_defaults(command=_redrive)

    status = commands.add_parser(
        "status",
        help="per reconciler: leader, epoch, failovers, dead letters, queue",
        description=(
            "Per reconciler: the leader and its epoch, since when it leads, failovers in "
            "the last hour, dead letters (with a database), and queued and in-flight work "
            "of the leader when its endpoint is given (--endpoint, repeatable)."
        ),
    )
    status.add_argument("--kubeconfig", help="default: in-cluster, $KUBECONFIG, ~/.kube/config")
    status_scope = status.add_mutually_exclusive_group()
    status_scope.add_argument("-n", "--namespace", help="default: $POD_NAMESPACE or the context's")
    status_scope.add_argument("-A", "--all-namespaces", action="store_true")
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
    _database_options(status, "dead letters, failovers and the PostgreSQL lease table")
    status.set_defaults(command=_status)

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
    _database_options(reshard, "default: $KOPF_RECONCILE_DATABASE_URL")
    reshard.set_defaults(command=_reshard)

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
        "--shards", type=int, default=1,
        help="shard the Devices (default 1: one leader); with N > 1 the replicas share N "
        "shards and a SIGKILL moves only the killed replica's",
    )  # fmt: skip
    demo.add_argument(
        "--keep", action="store_true", help="keep the temporary directory (logs, kubeconfig)"
    )
    demo.set_defaults(command=_demo)

    # Commands in modules of their own (kopf_reconcile.commands.<command>).
    init.add_parser(commands)
    dev.add_parser(commands)
    fence_policy.add_parser(commands)
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
    if url is not None and dsn_secrets(url):
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
        shards=args.shards,
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
    server_tls(config.metrics_tls_cert, config.metrics_tls_key)  # bad files stop it here
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(_serve(args, config))
    except Exception:
        logger.exception("the operator failed")
        return EXIT_FAILURE


def _loop_factory() -> Any:
    """uvloop's event loop when it is installed (``kopf-reconcile[uvloop]``), as ``kopf run``
    picks it; else None: asyncio's own loop."""
    try:
        uvloop = importlib.import_module("uvloop")  # optional: not a dependency
    except ImportError:
        return None
    logger.info("event loop: uvloop %s", getattr(uvloop, "__version__", ""))
    return uvloop.new_event_loop


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
    from kopf_reconcile.integration.metrics_auth import KubernetesAuthorizer
    from kopf_reconcile.integration.probing import first_problem
    from kopf_reconcile.integration.watch_probe import WatchProbe, namespace_patterns, targets

    # Ready also means every watch kopf keeps is allowed and answering (a forbidden watch
    # leaves the operator idle while kopf's own startup flag says it is done), and the
    # database a leader needs answers.
    resources = kopf_shim.watched_resources()
    watch_probe = WatchProbe(
        targets(resources, args.namespaces, args.clusterwide),
        patterns=namespace_patterns(resources, args.namespaces, kopf_shim.match_namespace),
    )
    probes = [watch_probe, *config.store_probes()]
    guard = config.broken_watch_guard(watch_probe.problem, kopf_shim.running_loops)
    authorizer = KubernetesAuthorizer() if config.metrics_auth is MetricsAuth.KUBERNETES else None
    endpoints = Endpoints(
        host,
        port,
        ready=ready.is_set,
        report=kopf_shim.status,
        stopping=stop.is_set,
        problem=first_problem(*probes),
        authorizer=authorizer,
        ssl_context=server_tls(config.metrics_tls_cert, config.metrics_tls_key),
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
    guarding: asyncio.Task[None] | None = None
    try:
        for probe in probes:
            await probe.start()
        guarding = asyncio.create_task(guard.run(), name="kopf-reconcile broken watch guard")
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
        if guarding is not None:
            guarding.cancel()
        for probe in probes:
            await probe.stop()
        await endpoints.stop()
        if authorizer is not None:
            await authorizer.close()
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
        records = await _kubernetes_leases(
            args.kubeconfig, args.namespace or config.pod_namespace, args.all_namespaces
        )
    except Exception as exc:
        print(
            f"Kubernetes Leases: cannot list them: {redact(describe_error(exc))}", file=sys.stderr
        )
        status = EXIT_FAILURE
    else:
        print("Kubernetes Leases:")
        _print_table(records)
    if config.database_url is not None:
        try:
            records = await _postgres_leases(config.database_url)
        except Exception as exc:
            print(
                f"PostgreSQL leases: cannot read them: {redact(describe_error(exc))}",
                file=sys.stderr,
            )
            status = EXIT_FAILURE
        else:
            print(f"\nPostgreSQL leases ({redact_dsn(config.database_url)}):")
            _print_table(records)
    return status


async def _kubernetes_leases(
    kubeconfig: str | None, namespace: str | None, all_namespaces: bool
) -> list[LeaseRecord]:
    from kopf_reconcile.leader.kubernetes import KubernetesLeaseElector

    # The elector finds the cluster and the namespace by its own rules (in-cluster
    # configuration, else the kubeconfig); the listing is its knowledge too.
    async with KubernetesLeaseElector(namespace=namespace, kubeconfig=kubeconfig) as elector:
        return await elector.list_leases(all_namespaces=all_namespaces)


async def _postgres_leases(url: str) -> list[LeaseRecord]:
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
            _when(record.acquired_at),
            _when(record.renewed_at),
            _when(record.expires_at),
        )
        for record in shard_leases.ordered(records)
    ]


def _when(moment: Any) -> str:
    if not isinstance(moment, datetime.datetime):
        return "-"
    from kopf_reconcile.leader.kubernetes import format_micro_time  # one time format for all

    return format_micro_time(moment)


def _print_table(records: Sequence[LeaseRecord]) -> None:
    """The leases; then, per sharded reconciler, its holders with their shards and epochs."""
    if not records:
        print("  (none)")
        return
    rows = _rows(records)
    for line in format_table(_COLUMNS, [tuple(map(escape_terminal, row)) for row in rows]):
        print("  " + line)
    for line in shard_leases.summaries(records):
        print("  " + escape_terminal(line))


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


# -- dead letters, redrive, status -----------------------------------------------------------

_DEAD_COLUMNS = ("RECONCILER", "ENTITY", "ATTEMPTS", "EPOCH", "FIRST", "LAST", "REASON")
_STATUS_COLUMNS = (
    "NAMESPACE", "RECONCILER", "LEADER", "EPOCH", "SINCE", "FAILOVERS(1H)", "DEAD LETTERS",
    "QUEUED", "IN FLIGHT",
)  # fmt: skip
FAILOVER_WINDOW = 3600.0  # "failovers in the last hour"
ENDPOINT_TIMEOUT = 5.0


def _required_database(args: argparse.Namespace, command: str) -> str:
    config = Settings.load(database_url=_database_url_argument(args))
    if config.database_url is None:
        raise ConfigError(
            f"{command} needs the database: set KOPF_RECONCILE_DATABASE_URL or pass "
            "--database-url-file"
        )
    return config.database_url


def _dead_letters(args: argparse.Namespace) -> int:
    _quiet_libraries()
    url = _required_database(args, "dead-letters")
    try:
        letters = asyncio.run(_list_dead_letters(url, args.reconciler, args.namespace))
    except Exception as exc:
        print(
            f"kopf-reconcile dead-letters: cannot read them at {redact_dsn(url)}: "
            f"{redact(describe_error(exc))}",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    rows = [
        (
            d.reconciler_id,
            d.entity_id,
            str(d.attempts),
            str(d.epoch),
            _when(d.first_at),
            _when(d.last_at),
            d.reason,
        )
        for d in letters
    ]
    if not rows:
        print("no dead letters")
        return 0
    for line in format_table(_DEAD_COLUMNS, [tuple(map(escape_terminal, r)) for r in rows]):
        print(line)
    return 0


async def _list_dead_letters(url: str, scope: str | None, namespace: str | None) -> list[Any]:
    from kopf_reconcile.fencing.postgres import PostgresFencedRepository

    async with PostgresFencedRepository(url) as repository:
        return await repository.list_dead_letters(scope=scope, namespace=namespace)


def _redrive(args: argparse.Namespace) -> int:
    _quiet_libraries()
    url = _required_database(args, "redrive")
    entity = None if args.all else args.entity
    try:
        asked = asyncio.run(_request_redrive(url, entity, args.reconciler))
    except Exception as exc:
        print(
            f"kopf-reconcile redrive: cannot write the request at {redact_dsn(url)}: "
            f"{redact(describe_error(exc))}",
            file=sys.stderr,
        )
        return EXIT_FAILURE
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


def _status(args: argparse.Namespace) -> int:
    _quiet_libraries()
    config = Settings.load(database_url=_database_url_argument(args))
    return asyncio.run(_show_status(args, config))


async def _show_status(args: argparse.Namespace, config: Settings) -> int:
    status = 0
    records: list[LeaseRecord] = []
    try:
        from kopf_reconcile.leader.kubernetes import KubernetesLeaseElector

        async with KubernetesLeaseElector(
            namespace=args.namespace or config.pod_namespace, kubeconfig=args.kubeconfig
        ) as elector:
            records += await elector.list_leases(all_namespaces=args.all_namespaces)
    except Exception as exc:
        print(
            f"Kubernetes Leases: cannot list them: {redact(describe_error(exc))}", file=sys.stderr
        )
        status = EXIT_FAILURE
    dead: dict[str, int] = {}
    changes: dict[str, int] | None = None
    if config.database_url is not None:
        try:
            records += await _postgres_lease_records(config.database_url)
            dead, changes = await _database_figures(config.database_url)
        except Exception as exc:
            print(f"PostgreSQL: cannot read it: {redact(describe_error(exc))}", file=sys.stderr)
            status = EXIT_FAILURE
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
                _when(record.acquired_at) if record.holder_id else "-",
                failovers,
                str(dead.get(rid, 0)) if config.database_url is not None else "-",
                "-" if queue is None else str(queue.get("queued", "-")),
                "-" if queue is None else str(queue.get("in_flight", "-")),
            )
        )
    if not rows:
        print("no kopf-reconcile leases found")
        return status
    for line in format_table(_STATUS_COLUMNS, [tuple(map(escape_terminal, r)) for r in rows]):
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


def _reshard(args: argparse.Namespace) -> int:
    _quiet_libraries()
    url = _required_database(args, "reshard")
    config = Settings.load(database_url=url)
    leases = _reshard_lease_store(args, config)
    try:
        report = asyncio.run(_run_reshard(url, args, leases, config))
    except ConfigError:
        raise  # a refusal (never led, a shard's scope, same layout, no tables, ...): status 2
    except Exception as exc:
        print(
            f"kopf-reconcile reshard: nothing changed at {redact_dsn(url)}: "
            f"{redact(describe_error(exc))}",
            file=sys.stderr,
        )
        return EXIT_FAILURE
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
            records = await _kubernetes_leases(args.kubeconfig, namespace, False)
            where = f" in namespace {namespace}" if namespace else " in the context's namespace"
        else:
            records = await _postgres_leases(url)
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
                f"{r.reconciler_id} by {r.holder_id} until {_when(r.expires_at)}" for r in held
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
