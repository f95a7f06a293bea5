"""Run an embedded cluster as a process: ``python -m kopf_reconcile.testing.cluster``.

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

from kopf_reconcile.testing.cluster.embedded import EmbeddedCluster


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kopf_reconcile.testing.cluster", description=__doc__
    )
    parser.add_argument(
        "--port", type=int, default=0, help="port on 127.0.0.1 (default: any free port)"
    )
    parser.add_argument(
        "--kubeconfig", type=Path, help="also write a kubeconfig for the cluster here"
    )
    parser.add_argument(
        "--history-size", type=int, default=None, help="changes a watch can resume from"
    )
    parser.add_argument(
        "--bookmark-interval", type=float, default=None, help="seconds between watch BOOKMARKs"
    )
    return parser


async def serve(
    port: int, kubeconfig: Path | None, history_size: int | None, bookmark_interval: float | None
) -> None:
    options: dict[str, float] = {}
    if history_size is not None:
        options["history_size"] = history_size
    if bookmark_interval is not None:
        options["bookmark_interval"] = bookmark_interval
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    async with EmbeddedCluster(port=port, **options) as cluster:  # type: ignore[arg-type]
        if kubeconfig is not None:
            kubeconfig.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(cluster.kubeconfig, kubeconfig)
        print(cluster.url, flush=True)
        await stopping.wait()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    asyncio.run(serve(args.port, args.kubeconfig, args.history_size, args.bookmark_interval))
    return 0


if __name__ == "__main__":
    sys.exit(main())
