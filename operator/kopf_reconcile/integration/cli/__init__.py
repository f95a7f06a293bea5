"""The ``kopf-reconcile`` command (also ``python -m kopf_reconcile``): one module per command.

* ``run`` (:mod:`.run`): kopf with the handlers, plus metrics, probes, redacted logs;
* ``migrate`` (:mod:`.migrate`): the PostgreSQL tables (idempotent);
* ``leases`` (:mod:`.leases`): the Leases of a cluster, and the database's lease table;
* ``dead-letters`` (:mod:`.dead_letters`) and ``redrive`` (:mod:`.redrive`): the dead
  letters leaders kept in PostgreSQL, and the requests to retry them;
* ``status`` (:mod:`.status`): per reconciler, leader, epoch, failovers, dead letters, queue;
* ``reshard`` (:mod:`.reshard`): a reconciler's shard layout, changed in one transaction;
* ``demo`` (:mod:`.demo`): the whole story on an embedded cluster and PostgreSQL;
* ``init`` (:mod:`.init`): a new operator project in an empty folder;
* ``dev`` (:mod:`.dev`): an embedded Kubernetes API and PostgreSQL for your own work;
* ``fence-policy`` (:mod:`.fence_policy`): the API server's fence, for ``kubectl apply``.

Each module adds its own parser (``add_parser``); :mod:`.arguments` holds what they share
(the database options, the exit statuses), :mod:`kopf_reconcile.integration.tables` the
tables, escaping and time format of what they print.

As ``kubectl-reconcile`` the same commands are a kubectl plugin: ``kubectl reconcile status``.

The database URL of ``migrate``, ``leases`` and the others comes from
``KOPF_RECONCILE_DATABASE_URL`` or ``--database-url-file``: a password given with
``--database-url`` is visible to every user of the machine in the process list
(a warning says so). Their failures are one line naming the problem, never a
traceback.

Settings come from the options given here, then the environment (see
:mod:`kopf_reconcile.integration.settings`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from kopf_reconcile.api import ConfigError
from kopf_reconcile.integration.cli import (
    dead_letters,
    demo,
    dev,
    fence_policy,
    init,
    leases,
    migrate,
    redrive,
    reshard,
    run,
    status,
)
from kopf_reconcile.integration.cli.arguments import EXIT_BROKEN_PIPE, EXIT_USAGE
from kopf_reconcile.integration.cli.reshard import retired_leases

__all__ = ["main", "retired_leases"]

# In the order of `kopf-reconcile --help`.
COMMANDS = (
    run, migrate, leases, dead_letters, redrive, status, reshard, demo, init, dev, fence_policy
)  # fmt: skip


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
    for command in COMMANDS:
        command.add_parser(commands)
    return parser
