"""What the commands share: exit statuses, the database options, one-line failures."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from kopf_reconcile.api import ConfigError
from kopf_reconcile.integration.settings import Settings
from kopf_reconcile.redaction import dsn_secrets, redact
from kopf_reconcile.remote_errors import describe_error

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_FAILURE",
    "EXIT_USAGE",
    "cluster_options",
    "database_options",
    "database_settings",
    "database_url_argument",
    "failed",
    "quiet_libraries",
    "required_database",
]

EXIT_FAILURE = 1
EXIT_USAGE = 2  # a configuration error, as argparse's usage errors
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # the reader left (`| head -1`): as SIGPIPE ends kubectl


def database_options(parser: argparse.ArgumentParser, what: str) -> None:
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


def database_url_argument(args: argparse.Namespace) -> str | None:
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


def quiet_libraries() -> None:
    """The one-line failure says it all: no library warning repeats it (without logging set up,
    Python prints warnings to stderr)."""
    for name in ("kubernetes_asyncio", "asyncpg"):
        logging.getLogger(name).setLevel(logging.ERROR)


def required_database(args: argparse.Namespace, command: str) -> str:
    config = database_settings(args)
    if config.database_url is None:
        raise ConfigError(
            f"{command} needs the database: set KOPF_RECONCILE_DATABASE_URL or pass "
            "--database-url-file"
        )
    return config.database_url


def database_settings(args: argparse.Namespace) -> Settings:
    """The settings, with the database URL given on the command line if any."""
    return Settings.load(database_url=database_url_argument(args))


def cluster_options(parser: argparse.ArgumentParser) -> None:
    """Which cluster, and which namespace of it (or all), a listing of Leases reads."""
    parser.add_argument("--kubeconfig", help="default: in-cluster, $KUBECONFIG, ~/.kube/config")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", help="default: $POD_NAMESPACE or the context's")
    scope.add_argument("-A", "--all-namespaces", action="store_true")


def failed(message: str, exc: BaseException) -> int:
    """Say on one line why the command failed, secrets redacted; the exit status."""
    print(f"{message}: {redact(describe_error(exc))}", file=sys.stderr)
    return EXIT_FAILURE
