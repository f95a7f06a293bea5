"""``kopf-reconcile run handlers.py [kopf run options]``: kopf with the handlers, like
``kopf run``, plus what a deployed operator needs.

The configuration is validated before anything starts (a bad value, or a database that
refuses its URL, stops the process with a message naming the variable; a database that
does not answer yet is retried); ``/metrics``, ``/healthz`` and ``/readyz`` are served on
one port (see :mod:`kopf_reconcile.integration.endpoints`), and the logs are JSON or text
with secrets redacted (see :mod:`kopf_reconcile.integration.logs`). With uvloop installed
(``pip install kopf-reconcile[uvloop]``) it runs on uvloop's event loop, as ``kopf run``
does: about a tenth less CPU per object at 10,000 objects (``benchmarks/kopf_e2e.py``).

Shutdown. Once kopf's startup is done, ``run`` handles SIGTERM and SIGINT itself:
``/readyz`` answers 503 from that moment (the pod leaves its Service while it
drains), then kopf stops as on its own signal handling.
"""

from __future__ import annotations

import argparse
import asyncio
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
from kopf_reconcile.integration.cli.arguments import EXIT_FAILURE
from kopf_reconcile.integration.metrics_auth import server_tls
from kopf_reconcile.integration.settings import LeaderKind, MetricsAuth, Settings
from kopf_reconcile.remote_errors import describe_error

__all__ = ["add_parser"]

logger = logging.getLogger("kopf_reconcile.cli")

NAMESPACE_CHECK_TIMEOUT = 10.0  # an API server that does not answer is not a config error
DATABASE_CHECK_TIMEOUT = 10.0  # nor is a database that does not answer
# kopf's own signal handling SIGKILLs a shutdown that hangs this long (its
# ultimate_exiting_timeout default); the handling that replaces it keeps that backstop.
ULTIMATE_EXIT_TIMEOUT = 600.0


def add_parser(commands: Any) -> None:
    """``run``, on the CLI's subcommands."""
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
