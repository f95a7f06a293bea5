"""The processes of the demo: an embedded cluster, an embedded PostgreSQL, N replicas.

Everything runs on this machine, bound to 127.0.0.1 (PostgreSQL to a Unix
socket), in one temporary directory. :class:`Stack` starts what it needs and,
on exit — normal, failure or Ctrl-C — stops exactly what it started (by PID)
and removes the directory unless asked to keep it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kopf_reconcile.testing.operator_process import free_port
from kopf_reconcile.testing.postgres import EmbeddedPostgres

STARTUP_TIMEOUT = 30.0
STOP_GRACE = 5.0


class DemoError(RuntimeError):
    """Something the demo needs did not work; the message says what."""


@dataclasses.dataclass
class Scrape:
    """What one replica's /metrics said about the reconciler (summed over its shards)."""

    leader: bool = False  # sharded: leads at least one shard
    epoch: int = 0  # sharded: the highest epoch of the shards it leads
    shards: dict[int, int] = dataclasses.field(default_factory=dict)  # shard led -> epoch
    reconciled: int = 0
    accepted: int = 0
    stale: int = 0
    canceled: int = 0
    in_flight: int = 0


@dataclasses.dataclass
class Replica:
    """One operator process."""

    name: str
    port: int
    process: asyncio.subprocess.Process
    log: Path
    state: str = "running"  # running | paused | killed | stopped
    last: Scrape = dataclasses.field(default_factory=Scrape)

    @property
    def pid(self) -> int:
        return self.process.pid


class Stack:
    """Starts and owns every process of the demo."""

    def __init__(
        self, *, keep: bool, reconciler: str, prefix: str = "kopf-reconcile-demo-"
    ) -> None:
        self.keep = keep
        self.reconciler = reconciler  # its id: the controller label in the replicas' metrics
        self.workdir = Path(tempfile.mkdtemp(prefix=prefix))
        self.kubeconfig = self.workdir / "kubeconfig"
        self.audit_log = self.workdir / "audit.log"  # the API server's record of every write
        self.replicas: list[Replica] = []
        self.cluster_url = ""
        self._cluster: asyncio.subprocess.Process | None = None
        self._postgres: EmbeddedPostgres | None = None
        self._http: aiohttp.ClientSession | None = None

    @property
    def dsn(self) -> str:
        if self._postgres is None:
            raise DemoError("PostgreSQL is not running")
        return self._postgres.dsn

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Shielded: a second Ctrl-C must not leave processes behind.
        await asyncio.shield(self.close())

    async def start_cluster(self) -> str:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kopf_reconcile.testing.emulated_apiserver",
            "--port", "0", "--kubeconfig", str(self.kubeconfig),
            "--audit-log", str(self.audit_log),
            stdout=asyncio.subprocess.PIPE,
            stderr=(self.workdir / "cluster.log").open("wb"),
        )  # fmt: skip
        self._cluster = process
        assert process.stdout is not None
        try:
            async with asyncio.timeout(STARTUP_TIMEOUT):
                line = await process.stdout.readline()
        except TimeoutError:
            raise DemoError("the embedded cluster did not start in time") from None
        self.cluster_url = line.decode().strip()
        if not self.cluster_url.startswith("http"):
            raise DemoError(f"the embedded cluster failed to start: see {self.workdir}/cluster.log")
        return self.cluster_url

    async def start_postgres(self) -> str:
        self._postgres = EmbeddedPostgres()
        await self._postgres.__aenter__()
        return self._postgres.dsn

    async def start_replica(
        self, handlers: Path, env: dict[str, str], *, on_terminal: bool = False
    ) -> Replica:
        """A replica logging JSON into the work directory, or (``on_terminal``) text to this
        process's output."""
        index = len(self.replicas)
        name = f"replica-{index}"
        port = free_port()
        log = self.workdir / f"{name}.log"
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kopf_reconcile", "run", str(handlers),
            "--namespace=default", "--standalone",
            "--metrics-port", str(port), "--log-format", "text" if on_terminal else "json",
            env={**os.environ, **env, "POD_NAME": name, "KUBECONFIG": str(self.kubeconfig)},
            stdout=None if on_terminal else log.open("wb"),
            stderr=None if on_terminal else asyncio.subprocess.STDOUT,
        )  # fmt: skip
        replica = Replica(name=name, port=port, process=process, log=log)
        self.replicas.append(replica)
        return replica

    async def wait_ready(self, replica: Replica) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if replica.process.returncode is not None:
                raise DemoError(f"{replica.name} exited; see {replica.log}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with self._session().get(
                    f"http://127.0.0.1:{replica.port}/readyz"
                ) as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.1)
        raise DemoError(f"{replica.name} did not become ready; see {replica.log}")

    async def scrape(self, replica: Replica) -> Scrape:
        """Read the replica's metrics; a paused or dead replica keeps its last figures."""
        if replica.state != "running":
            return replica.last
        try:
            async with (
                asyncio.timeout(1.0),
                self._session().get(f"http://127.0.0.1:{replica.port}/metrics") as response,
            ):
                text = await response.text()
        except (aiohttp.ClientError, OSError, TimeoutError):
            return replica.last
        scrape = Scrape()
        # Per value of the shard label: "" for an unsharded reconciler, else one per shard.
        leading: dict[str, bool] = {}
        epochs: dict[str, int] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.labels.get("controller") != self.reconciler:
                    continue
                value = int(sample.value)
                name, labels = sample.name, sample.labels
                if name == "kopf_reconcile_leader":
                    leading[labels.get("shard", "")] = value == 1
                elif name == "kopf_reconcile_epoch":
                    epochs[labels.get("shard", "")] = value
                elif name == "kopf_reconcile_active_workers":
                    scrape.in_flight += value
                elif name == "kopf_reconcile_reconcile_total":
                    if labels["result"] in ("success", "requeue_after"):
                        scrape.reconciled += value
                    elif labels["result"] == "canceled":
                        scrape.canceled += value
                elif name == "kopf_reconcile_fenced_writes_total":
                    if labels["outcome"] == "accepted":
                        scrape.accepted += value
                    elif labels["outcome"] == "stale":
                        scrape.stale += value
        led = [shard for shard, leads in leading.items() if leads]
        scrape.leader = bool(led)
        scrape.epoch = max((epochs.get(shard, 0) for shard in led), default=epochs.get("", 0))
        scrape.shards = {int(shard): epochs.get(shard, 0) for shard in led if shard}
        replica.last = scrape
        return scrape

    def kill(self, replica: Replica) -> None:
        replica.process.send_signal(signal.SIGKILL)
        replica.state = "killed"

    def pause(self, replica: Replica) -> None:
        replica.process.send_signal(signal.SIGSTOP)
        replica.state = "paused"

    def resume(self, replica: Replica) -> None:
        replica.process.send_signal(signal.SIGCONT)
        replica.state = "running"

    async def stop(self, replica: Replica) -> None:
        """SIGTERM, then SIGKILL after a grace period."""
        with contextlib.suppress(ProcessLookupError):
            replica.process.send_signal(signal.SIGTERM)
        await _reap(replica.process)
        replica.state = "stopped"

    def alive(self) -> list[Replica]:
        return [r for r in self.replicas if r.process.returncode is None]

    async def close(self) -> None:
        for replica in self.alive():
            with contextlib.suppress(ProcessLookupError):
                if replica.state == "paused":
                    replica.process.send_signal(signal.SIGCONT)
                replica.process.send_signal(signal.SIGTERM)
        for replica in self.replicas:
            await _reap(replica.process)
            if replica.state in ("running", "paused"):
                replica.state = "stopped"
        if self._cluster is not None:
            with contextlib.suppress(ProcessLookupError):
                self._cluster.send_signal(signal.SIGTERM)
            await _reap(self._cluster)
        if self._postgres is not None:
            await self._postgres.close()
        if self._http is not None:
            await self._http.close()
        if not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession()
        return self._http


async def _reap(process: asyncio.subprocess.Process) -> None:
    """Wait for a process to exit; SIGKILL it after a grace period."""
    try:
        async with asyncio.timeout(STOP_GRACE):
            await process.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGKILL)
        await process.wait()
