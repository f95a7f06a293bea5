"""Run an embedded cluster as a process: ``python -m kopf_reconcile.testing.emulated_apiserver``.

Prints the URL as the only line on stdout once it accepts connections (so a parent process
can read it), optionally writes a kubeconfig, and stops cleanly on SIGTERM or SIGINT (exit
status 0). Faults are injected over its admin API (see :mod:`.server`).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import sys
from pathlib import Path

from kopf_reconcile.testing.emulated_apiserver.embedded import (
    DEFAULT_BOOKMARK_INTERVAL,
    DEFAULT_HISTORY_SIZE,
    EmbeddedCluster,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kopf_reconcile.testing.emulated_apiserver", description=__doc__
    )
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: any)")
    parser.add_argument("--kubeconfig", type=Path, help="also write a kubeconfig for it here")
    parser.add_argument(
        "--history-size",
        type=int,
        default=DEFAULT_HISTORY_SIZE,
        help="changes a watch can resume from (older: 410 Expired)",
    )
    parser.add_argument(
        "--bookmark-interval",
        type=float,
        default=DEFAULT_BOOKMARK_INTERVAL,
        help="seconds between watch BOOKMARKs",
    )
    parser.add_argument(
        "--audit-log", type=Path, help="append an audit log (JSON lines) to this file"
    )
    return parser


async def serve(
    port: int,
    kubeconfig: Path | None,
    history_size: int,
    bookmark_interval: float,
    audit_log: Path | None = None,
) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    cluster = EmbeddedCluster(
        port=port,
        history_size=history_size,
        bookmark_interval=bookmark_interval,
        audit_log=audit_log,
    )
    async with cluster:
        if kubeconfig is not None:
            kubeconfig.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(cluster.kubeconfig, kubeconfig)
        print(cluster.url, flush=True)
        await stopping.wait()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    asyncio.run(
        serve(args.port, args.kubeconfig, args.history_size, args.bookmark_interval, args.audit_log)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
