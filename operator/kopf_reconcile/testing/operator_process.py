"""Your operator as a process of its own, for your tests: ``kopf-reconcile run HANDLERS``.

:class:`OperatorProcess` runs the handlers file as a pod runs it (``kopf-reconcile run``,
configured by environment variables), against a Kubernetes API given by its kubeconfig
(:class:`~kopf_reconcile.testing.EmbeddedCluster` or a real one) and, when a database URL
is given, a PostgreSQL (:class:`~kopf_reconcile.testing.EmbeddedPostgres`): with one, the
operator leads through PostgreSQL leases and fences its writes. Entering waits until the
operator is ready (``/readyz``: kopf's startup is done and its watches answer); leaving
stops it with SIGTERM, as the kubelet does, and SIGKILLs it only after ``stop_timeout``.

A process rather than kopf in the test's event loop: an embedded API server serving in that
loop would see its watch handlers cancelled when kopf stops, and a process is what runs in
the cluster. :func:`eventually` waits for what the operator does::

    async with OperatorProcess("handlers.py", kubeconfig=cluster.kubeconfig, database_url=dsn):
        ...  # create an object
        await eventually(reconciled, timeout=30, message="the object reconciled")
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Self

import aiohttp

__all__ = ["OperatorProcess", "eventually", "free_port"]

# Variables of the test's own environment that would choose the operator's elector,
# identity or cluster instead of what the test gives it.
_NOT_INHERITED = ("KOPF_RECONCILE_", "POD_", "KUBERNETES_", "KOPF_RUN_PEERING")
POLL_INTERVAL = 0.05


async def eventually(
    condition: Callable[[], bool | Awaitable[bool]],
    timeout: float = 30.0,
    interval: float = POLL_INTERVAL,
    message: str = "",
) -> None:
    """Wait until ``condition()`` (sync or async) is true, looking every ``interval``
    seconds; ``AssertionError`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        outcome = condition()
        if not isinstance(outcome, bool):
            outcome = await outcome
        if outcome:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {message or condition}")
        await asyncio.sleep(interval)


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now (for a server that is about to listen on it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class OperatorProcess:
    """``kopf-reconcile run HANDLERS --namespace NAMESPACE`` as a child process
    (``namespace=None``: ``--all-namespaces``)."""

    def __init__(
        self,
        handlers: str | os.PathLike[str],
        *,
        kubeconfig: str | os.PathLike[str],
        database_url: str | None = None,
        namespace: str | None = "default",
        env: Mapping[str, str] | None = None,
        startup_timeout: float = 60.0,
        stop_timeout: float = 30.0,
    ) -> None:
        self.handlers = Path(handlers)
        if not self.handlers.is_file():
            raise FileNotFoundError(f"OperatorProcess: no handlers file {str(self.handlers)!r}")
        self.kubeconfig = str(kubeconfig)
        self.database_url = database_url
        self.namespace = namespace
        self.env = dict(env or {})
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.port = 0
        descriptor, log = tempfile.mkstemp(prefix="kopf-reconcile-operator-", suffix=".log")
        os.close(descriptor)  # the process gets a file of its own
        self.log = Path(log)
        self._process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        """Where its ``/metrics``, ``/healthz`` and ``/readyz`` are."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def output(self) -> str:
        """What it logged so far (text lines); the file is removed when ``async with`` ends
        without an error, and kept (``.log``) otherwise."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    @property
    def pid(self) -> int | None:
        """Its process id once started (for figures read from ``/proc``)."""
        return None if self._process is None else self._process.pid

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.returncode

    async def start(self) -> None:
        """Start it and wait until it is ready; ``RuntimeError`` (with its log) if it is not."""
        if self._process is not None:
            raise RuntimeError("OperatorProcess: already started")
        self.port = free_port()
        environment = {k: v for k, v in os.environ.items() if not k.startswith(_NOT_INHERITED)}
        environment.update(
            KUBECONFIG=self.kubeconfig,
            KOPF_RECONCILE_METRICS_HOST="127.0.0.1",
            KOPF_RECONCILE_METRICS_PORT=str(self.port),
            KOPF_RECONCILE_LOG_FORMAT="text",
        )
        if self.database_url is not None:
            environment["KOPF_RECONCILE_DATABASE_URL"] = self.database_url
        environment.update(self.env)
        with self.log.open("wb") as log:
            self._process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kopf_reconcile", "run", str(self.handlers),
                "--all-namespaces" if self.namespace is None else f"--namespace={self.namespace}",
                env=environment, stdout=log, stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
        try:
            await self._wait_ready()
        except BaseException:
            await self.stop()
            self.log.unlink(missing_ok=True)  # what it said is in the error
            raise

    async def _wait_ready(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self.startup_timeout
        async with aiohttp.ClientSession() as http:
            while self._process.returncode is None:
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with http.get(f"{self.url}/readyz") as response:
                        if response.status == 200:
                            return
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the operator ({self.handlers}) was not ready within "
                        f"{self.startup_timeout}s; its log:\n{self.output}"
                    )
                await asyncio.sleep(POLL_INTERVAL)
        raise RuntimeError(
            f"the operator ({self.handlers}) exited with {self._process.returncode} before "
            f"it was ready; its log:\n{self.output}"
        )

    async def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after ``stop_timeout``; its exit status."""
        process = self._process
        if process is None:
            return None
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(self.stop_timeout):
                    await process.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        return process.returncode

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.shield(self.stop())
        if exc is None:
            self.log.unlink(missing_ok=True)  # kept when the test failed, to be read
