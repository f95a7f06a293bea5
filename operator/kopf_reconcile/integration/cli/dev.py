"""``kopf-reconcile dev [HANDLERS]``: an embedded Kubernetes API and PostgreSQL for your own work.

It starts what ``make demo`` runs on (the embedded API server as a process of its own, on
127.0.0.1, and a real PostgreSQL in a temporary directory), creates the CRDs it is given
(``--crd FILE``, repeatable; by default every ``crds/*.yaml`` beside the handlers file, or
here), and prints ``KUBECONFIG`` and ``KOPF_RECONCILE_DATABASE_URL`` as ``export`` lines for
kubectl, helm, tests and your own ``kopf-reconcile run``. Given a handlers file, it runs the
operator on them (``kopf-reconcile run HANDLERS --namespace=default``, PostgreSQL leases and
fenced writes, its log on this terminal); ``--reload`` restarts the operator whenever a
``.py`` file beside the handlers changes. Ctrl-C (or SIGTERM) stops everything it started and
removes the temporary directory (``--keep`` keeps it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
from pathlib import Path
from typing import Any

from kopf_reconcile.api import ConfigError

__all__ = ["add_parser"]

CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
RELOAD_POLL = 0.5  # seconds between two looks at the handlers' files
READY_LINE = "ready: Ctrl-C stops everything"


def add_parser(commands: Any) -> None:
    """``dev``, on the CLI's subcommands."""
    parser = commands.add_parser(
        "dev",
        help="an embedded Kubernetes API and PostgreSQL for your own work",
        description=(
            "Start an embedded Kubernetes API and an embedded PostgreSQL, create the CRDs, "
            "print KUBECONFIG and the database URL, and run the handlers file when given "
            "(restarting it on changes with --reload), until Ctrl-C."
        ),
    )
    parser.add_argument(
        "handlers", nargs="?", type=Path, metavar="HANDLERS", help="a handlers file to run"
    )
    parser.add_argument(
        "--crd",
        dest="crds",
        action="append",
        type=Path,
        default=[],
        metavar="FILE",
        help="a CRD (YAML, one or more documents) to create; repeatable "
        "(default: crds/*.yaml beside HANDLERS, or here)",
    )
    parser.add_argument(
        "--reload", action="store_true", help="restart the operator when a .py file changes"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the temporary directory (kubeconfig, logs)"
    )
    parser.set_defaults(command=run)


def run(args: argparse.Namespace) -> int:
    handlers: Path | None = args.handlers
    if handlers is not None:
        if not handlers.is_file():
            raise ConfigError(f"dev: handlers file {str(handlers)!r} does not exist")
        handlers = handlers.resolve()
    beside = handlers.parent if handlers is not None else Path()
    crds = list(args.crds) or sorted((beside / "crds").glob("*.yaml"))
    for crd in crds:
        if not crd.is_file():
            raise ConfigError(f"dev: --crd {str(crd)!r} does not exist")
    if args.reload and handlers is None:
        raise ConfigError("dev: --reload needs a handlers file to run")
    return asyncio.run(_serve(handlers, crds, reload=args.reload, keep=args.keep))


async def _serve(handlers: Path | None, crds: list[Path], *, reload: bool, keep: bool) -> int:
    from kopf_reconcile.demo.stack import DemoError, Stack

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with Stack(keep=keep, reconciler="", prefix="kopf-reconcile-dev-") as stack:
        try:
            url = await stack.start_cluster()
            dsn = await stack.start_postgres()
            print(f"embedded Kubernetes API at {url}, embedded PostgreSQL (in {stack.workdir})")
            print(f"  export KUBECONFIG={shlex.quote(str(stack.kubeconfig))}")
            print(f"  export KOPF_RECONCILE_DATABASE_URL={shlex.quote(dsn)}")
            for name, source in await _create_crds(url, crds):
                print(f"created CRD {name} ({source})")
            fence = await _install_fence(url)
            print(f"installed the API server's fence ({fence}) for the Leases of default")
            env = {"KOPF_RECONCILE_DATABASE_URL": dsn, "KOPF_RECONCILE_LEADER": "postgres"}
            if handlers is None:
                print(READY_LINE, flush=True)
                await stop.wait()
                return 0
            return await _operate(stack, handlers, env, stop, reload=reload)
        except DemoError as exc:
            print(f"kopf-reconcile dev: {exc}")
            return 1


async def _operate(
    stack: Any, handlers: Path, env: dict[str, str], stop: asyncio.Event, *, reload: bool
) -> int:
    """Run the operator until ``stop``; with ``reload``, again after every change of a
    ``.py`` file in the handlers' folder, and after it failed, once it changed."""
    from kopf_reconcile.demo.stack import DemoError

    watched = handlers.parent
    while True:
        seen = _mtimes(watched)
        replica = await stack.start_replica(handlers, env, on_terminal=True)
        print(
            f"running {handlers} (kopf-reconcile run, pid {replica.pid})"
            + (f"; restarting it when a .py file in {watched} changes" if reload else ""),
            flush=True,
        )
        try:
            await stack.wait_ready(replica)
        except DemoError:
            started = False
        else:
            started = True
            print(READY_LINE, flush=True)
        changed = False
        while started and not stop.is_set() and replica.process.returncode is None:
            await _pause(stop)
            changed = reload and _mtimes(watched) != seen
            if changed:
                break
        await stack.stop(replica)
        if stop.is_set():
            return 0
        if not changed:
            what = "did not start" if not started else "stopped"
            print(f"the operator {what} (exit status {replica.process.returncode})", flush=True)
            if not reload:
                return 1
            print("it starts again when a .py file changes", flush=True)
            while not stop.is_set() and _mtimes(watched) == seen:
                await _pause(stop)
            if stop.is_set():
                return 0
        print(f"{handlers}: changed, restarting the operator", flush=True)


async def _pause(stop: asyncio.Event) -> None:
    """Until ``stop`` or for :data:`RELOAD_POLL` seconds, whichever comes first."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(RELOAD_POLL):
            await stop.wait()


def _mtimes(folder: Path) -> dict[str, float]:
    """Modification times of the ``.py`` files in ``folder`` and below (hidden folders, caches
    and virtual environments left out)."""
    times = {}
    for root, folders, files in os.walk(folder):
        folders[:] = [
            f for f in folders if not f.startswith(".") and f not in ("__pycache__", "venv")
        ]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with contextlib.suppress(OSError):
                    times[path] = os.stat(path).st_mtime
    return times


async def _install_fence(url: str) -> str:
    """The fence the chart installs, for the Leases of ``default`` (the operator's namespace)."""
    import aiohttp

    from kopf_reconcile.testing.fence import install_fence

    async with aiohttp.ClientSession(base_url=url) as http:
        return await install_fence(http, "default")


async def _create_crds(url: str, files: list[Path]) -> list[tuple[str, Path]]:
    """Create each CRD of ``files`` and wait until it is served; (name, file) of each."""
    import aiohttp
    import yaml

    from kopf_reconcile.testing.operator_process import eventually

    created = []
    async with aiohttp.ClientSession(base_url=url) as http:
        for path in files:
            try:
                documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
            except yaml.YAMLError as exc:
                raise ConfigError(f"dev: --crd {str(path)!r} is not YAML: {exc}") from None
            for crd in documents:
                if not isinstance(crd, dict) or crd.get("kind") != "CustomResourceDefinition":
                    kind = crd.get("kind") if isinstance(crd, dict) else type(crd).__name__
                    raise ConfigError(f"dev: {str(path)!r} holds a {kind}, not a CRD")
                async with http.post(CRDS, json=crd) as response:
                    if response.status != 201:
                        raise ConfigError(
                            f"dev: the CRD of {str(path)!r} was refused: {response.status} "
                            f"{await response.text()}"
                        )
                name = crd["metadata"]["name"]

                async def established(name: str = name) -> bool:
                    async with http.get(f"{CRDS}/{name}") as response:
                        status = (await response.json()).get("status") or {}
                    return any(
                        c.get("type") == "Established" and c.get("status") == "True"
                        for c in status.get("conditions") or []
                    )

                await eventually(established, timeout=30, message=f"CRD {name} established")
                created.append((name, path))
    return created
