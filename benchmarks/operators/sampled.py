"""``kopf-reconcile`` in this process, under a sampler of its CPU time by owner.

``python benchmarks/operators/sampled.py OUT HANDLERS -- run HANDLERS ...`` runs
exactly ``kopf-reconcile run HANDLERS ...`` (the same ``cli.main``, in the same
process) with one probe: every ``INTERVAL`` of the process's CPU time
(``ITIMER_PROF``: user and system time of all its threads) the main thread's Python
stack is looked at, and the sample is given to the first frame from the innermost
outward that belongs to a known owner:

* ``loop``: the Loop's own modules (:data:`LOOP_MODULES`: the worker switch, what the
  end of a reconcile does, the queue, its timers and backoff, the triggers, the sharded
  Loop, and the Loop's
  metrics, the ``prometheus_client`` calls they make included);
* ``reconciler``: the handlers file (the example's reconcile, the client calls it
  makes included);
* ``kopf_reconcile``: the rest of the project (the watch feed, the cache, fencing,
  leases, the shim);
* ``kopf``: kopf itself;
* ``other``: nothing of the above on the stack (the event loop between callbacks,
  the selector, another thread's CPU while the main thread waited).

Library frames (asyncio, aiohttp, asyncpg, ...) count for the owner that called
them. SIGUSR1 writes the counts so far to ``OUT`` (``{"seq": n, "interval": s,
"samples": {...}}``, replaced atomically); ``benchmarks/kopf_e2e.py`` takes two such
snapshots around its measurement. The probe itself costs about 10-20 us of CPU per
sample (under 0.5 % at the default interval), counted in the operator's CPU.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import sys
from pathlib import Path
from types import FrameType

INTERVAL = 0.005  # seconds of process CPU time between samples
PACKAGE = "kopf_reconcile"
LOOP_MODULES = frozenset(
    {
        "loop.py",
        "outcomes.py",
        "workqueue.py",
        "dispatch_queue.py",
        "backoff.py",
        "triggers.py",
        "sharded_loop.py",
        "metrics.py",
    }
)


class Sampler:
    """Counts of samples by owner; ``owner_of`` caches what each file belongs to."""

    def __init__(self, handlers: Path, package: Path, kopf: Path) -> None:
        self.handlers = str(handlers.resolve())
        self.package = str(package.resolve())
        self.kopf = str(kopf.resolve())
        self.samples: collections.Counter[str] = collections.Counter()
        self.seq = 0
        self._owners: dict[str, str] = {}

    def classify(self, filename: str) -> str:
        """The owner of a file's frames, or '' for a library's (they count for their caller)."""
        if filename == self.handlers:
            return "reconciler"
        if filename.startswith(self.package + os.sep):
            relative = filename[len(self.package) + 1 :]
            return "loop" if relative in LOOP_MODULES else PACKAGE
        if filename.startswith(self.kopf + os.sep):
            return "kopf"
        return ""

    def owner_of(self, frame: FrameType | None) -> str:
        while frame is not None:
            filename = frame.f_code.co_filename
            owner = self._owners.get(filename)
            if owner is None:
                owner = self._owners[filename] = self.classify(filename)
            if owner:
                return owner
            frame = frame.f_back
        return "other"

    def sample(self, _signum: int, frame: FrameType | None) -> None:
        self.samples[self.owner_of(frame)] += 1

    def dump(self, path: Path) -> None:
        self.seq += 1
        snapshot = {"seq": self.seq, "interval": INTERVAL, "samples": dict(self.samples)}
        staging = path.with_name(path.name + ".new")
        staging.write_text(json.dumps(snapshot))
        staging.replace(path)


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: sampled.py OUT HANDLERS -- run HANDLERS ...", file=sys.stderr)
        return 2
    out, handlers = Path(argv[0]), Path(argv[1])
    import kopf

    import kopf_reconcile
    from kopf_reconcile.integration import cli

    sampler = Sampler(handlers, Path(kopf_reconcile.__file__).parent, Path(kopf.__file__).parent)
    signal.signal(signal.SIGPROF, sampler.sample)
    signal.signal(signal.SIGUSR1, lambda _s, _f: sampler.dump(out))
    signal.setitimer(signal.ITIMER_PROF, INTERVAL, INTERVAL)
    try:
        return cli.main(argv[3:])
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
