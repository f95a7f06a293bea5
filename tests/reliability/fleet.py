"""Replica processes and the lease stores they share, for failover tests and benchmarks.

:class:`Replica` starts ``replica.py`` as an OS process, collects the JSON events it
reports, and signals, pauses or kills exactly that process (by its PID).
:func:`lease_store` starts what the replicas of one elector kind contend on: the
embedded Kubernetes API as a process of its own (``python -m
kopf_reconcile.testing.emulated_apiserver``), or an embedded PostgreSQL server; it yields the
replica arguments that point at it. Every process started here dies with its
parent (``dying_with_parent``), and callers stop them in ``finally``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import IO, Any

from kopf_reconcile.testing.postgres import EmbeddedPostgres
from kopf_reconcile.testing.real_apiserver import dying_with_parent

REPLICA = Path(__file__).with_name("replica.py")
ELECTORS = ("kubernetes", "postgres")
START_TIMEOUT = 30.0
STOP_GRACE = 5.0

Event = dict[str, Any]


class Replica:
    """A running ``replica.py`` and every event it has reported so far."""

    def __init__(self, name: str, process: asyncio.subprocess.Process, log: IO[bytes]) -> None:
        self.name = name
        self.process = process
        self.events: list[Event] = []
        self._log = log
        self._changed = asyncio.Condition()
        self._reader = asyncio.create_task(self._read(), name=f"events of {name}")

    @classmethod
    async def start(cls, name: str, store_args: list[str], *options: str) -> Replica:
        # Its stderr, shown when a test fails; closed by kill(), as it lives as long as the process.
        log = tempfile.TemporaryFile()  # noqa: SIM115
        process = await asyncio.create_subprocess_exec(
            *dying_with_parent([sys.executable, str(REPLICA), *store_args, *options]),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
        )
        return cls(name, process, log)

    @property
    def pid(self) -> int:
        return self.process.pid

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for line in self.process.stdout:
            event = json.loads(line)
            async with self._changed:
                self.events.append(event)
                self._changed.notify_all()
        async with self._changed:  # end of output: wake waiters so they can give up
            self._changed.notify_all()

    async def wait_for(
        self, condition: Callable[[Event], bool], timeout: float, after: int = 0
    ) -> Event:
        """The first event (from index ``after``) matching ``condition``; fail after ``timeout``."""
        deadline = time.monotonic() + timeout
        async with self._changed:
            while True:
                for event in self.events[after:]:
                    if condition(event):
                        return event
                if self._reader.done():
                    raise AssertionError(f"{self} ended before the event came:\n{self.log()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"{self}: no such event within {timeout}s:\n{self.log()}")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await self._changed.wait()

    def leadership(self) -> Event | None:
        """The last ``leader``/``follower`` event: what the replica last said it was."""
        changes = [e for e in self.events if e["event"] in ("leader", "follower")]
        return changes[-1] if changes else None

    @property
    def leading(self) -> bool:
        state = self.leadership()
        return state is not None and state["event"] == "leader"

    def signal(self, signum: signal.Signals) -> None:
        self.process.send_signal(signum)

    async def stop(self) -> int:
        """SIGTERM (a graceful stop), then SIGKILL after a grace period; the exit code."""
        if self.process.returncode is None:
            self.signal(signal.SIGCONT)  # a paused process cannot handle SIGTERM
            self.signal(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STOP_GRACE):
                    await self.process.wait()
        await self.kill()
        return self.process.returncode

    async def kill(self) -> None:
        """SIGKILL (paused or not) and reap it. Idempotent."""
        if self.process.returncode is None:
            self.process.kill()
        await self.process.wait()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        self._log.close()

    def log(self) -> str:
        if self._log.closed:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-3000:]

    def __str__(self) -> str:
        return f"replica {self.name} (pid {self.pid})"


async def first_event(
    group: list[Replica], condition: Callable[[Event], bool], timeout: float
) -> tuple[Replica, Event]:
    """Which replica of ``group`` reports a matching event first, and the event."""
    waits = {asyncio.create_task(r.wait_for(condition, timeout)): r for r in group}
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
    finished = next(iter(done))
    return waits[finished], finished.result()


@contextlib.asynccontextmanager
async def replicas(
    store_args: list[str], count: int, *options: str
) -> AsyncIterator[list[Replica]]:
    """``count`` replicas started together, each killed on the way out."""
    started: list[Replica] = []
    try:
        for index in range(count):
            started.append(await Replica.start(chr(ord("a") + index), store_args, *options))
        await asyncio.gather(
            *(r.wait_for(lambda e: e["event"] == "ready", START_TIMEOUT) for r in started)
        )
        yield started
    finally:
        for replica in started:
            await replica.kill()


@contextlib.asynccontextmanager
async def lease_store(elector: str) -> AsyncIterator[list[str]]:
    """Start what replicas of ``elector`` contend on; yield the replica arguments for it."""
    if elector == "postgres":
        async with EmbeddedPostgres() as postgres:
            yield ["--elector", "postgres", "--dsn", await postgres.create_database()]
        return
    if elector != "kubernetes":
        raise ValueError(f"elector must be one of {ELECTORS}, got {elector!r}")
    with tempfile.TemporaryDirectory(prefix="kopf-reconcile-fleet-") as workdir:
        kubeconfig = Path(workdir) / "kubeconfig"
        cluster = await asyncio.create_subprocess_exec(
            *dying_with_parent(
                [
                    sys.executable,
                    "-m",
                    "kopf_reconcile.testing.emulated_apiserver",
                    "--kubeconfig",
                    str(kubeconfig),
                ]
            ),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert cluster.stdout is not None
            async with asyncio.timeout(START_TIMEOUT):
                url = (await cluster.stdout.readline()).decode().strip()
            if not url:
                raise RuntimeError("the embedded cluster process exited before serving")
            yield ["--elector", "kubernetes", "--kubeconfig", str(kubeconfig)]
        finally:
            if cluster.returncode is None:
                cluster.terminate()
                try:
                    async with asyncio.timeout(STOP_GRACE):
                        await cluster.wait()
                except TimeoutError:
                    cluster.kill()
            await cluster.wait()
