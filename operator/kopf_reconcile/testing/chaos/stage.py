"""The stage of a chaos run: its constants, its replica positions (:class:`Slot`), and the
state and plumbing the run, the nemesis and the checks share (:class:`Stage`): starting a
replica, the API server's HTTP API, waiting for a condition, the actions in flight."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import shutil
import ssl
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from multidict import CIMultiDict

from kopf_reconcile.sharding import ShardAssignment, shard_id
from kopf_reconcile.testing.chaos.leadership import (
    ProcessHistory,
    read_events,
)
from kopf_reconcile.testing.chaos.proxy import PartitionProxy
from kopf_reconcile.testing.chaos.report import Options, Report
from kopf_reconcile.testing.examples import find_crd, find_handlers
from kopf_reconcile.testing.postgres import EmbeddedPostgres
from kopf_reconcile.testing.real_apiserver import ChildProcess, RealCluster, free_loopback_port

GROUP, VERSION, PLURAL = "example.com", "v1", "devices"
NAMESPACE = "default"
SCOPE = "devices.example.com-reconcile-device"  # the example's reconciler id
STATES = ("on", "off", "standby")
ALL_DEVICES_PATH = f"/apis/{GROUP}/{VERSION}/{PLURAL}"  # in every namespace
ELECTORS = ("kubernetes", "postgres")
TIERS = ("embedded", "real")
START_TIMEOUT = 60.0
STOP_GRACE = 5.0
HTTP_TIMEOUT = 5.0
#: A leadership that begins and ends this soon after its process resumed never led.
PAUSE_GRACE = 1.5

# Fault patterns the replicas hit and the harness never does (it only PATCHes specs
# and creates Devices): lease reads and writes, status patches, Device lists and watches.
API_FAULT_TARGETS = (
    ("PUT", r"/apis/coordination\.k8s\.io/v1/namespaces/[^/]+/leases/[^/]+"),
    ("GET", r"/apis/coordination\.k8s\.io/v1/namespaces/[^/]+/leases/[^/]+"),
    ("PATCH", rf"/apis/{GROUP}/{VERSION}/namespaces/[^/]+/{PLURAL}/[^/]+/status"),
    ("GET", rf"/apis/{GROUP}/{VERSION}(/namespaces/[^/]+)?/{PLURAL}"),
)


def devices_path(namespace: str) -> str:
    """The Devices of ``namespace``."""
    return f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"


class ChaosError(RuntimeError):
    """The run could not be set up or driven (not an invariant: see :class:`Report`)."""


@dataclasses.dataclass
class Slot:
    """One replica position: its proxy and kubeconfig outlive the processes that fill it."""

    index: int
    proxy: PartitionProxy
    kubeconfig: Path
    scopes: tuple[str, ...] = (SCOPE,)  # the leases it may lead: one per shard when sharded
    # A position for a replica that joins (and later leaves): empty unless it joined.
    standby: bool = False
    process: asyncio.subprocess.Process | None = None
    history: ProcessHistory | None = None
    generation: int = 0
    port: int = 0
    busy: bool = False  # paused, or being restarted: not a target of other actions
    expected_exit: bool = False

    @property
    def name(self) -> str:
        return f"replica-{self.index}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    def _scan(self) -> tuple[dict[str, int], list[str]]:
        """From the current process's events: the scopes it leads (with their epochs),
        and those it is handing off right now."""
        if not self.alive or self.history is None:
            return {}, []
        last: dict[str, dict[str, Any]] = {}
        handoffs: dict[str, bool] = {}
        for event in read_events(self.history.events):
            scope = event.get("reconciler")
            if scope not in self.scopes:
                continue
            if event["event"] in ("lead", "lose"):
                last[scope] = event
            elif event["event"] in ("handoff", "handed_off"):
                handoffs[scope] = event["event"] == "handoff"
        led = {s: int(e["epoch"]) for s, e in last.items() if e["event"] == "lead"}
        return led, [scope for scope, now in handoffs.items() if now]

    def led(self) -> dict[str, int]:
        """The scopes this replica's current process says it leads, with their epochs."""
        return self._scan()[0]

    def leading(self) -> int | None:
        """The highest epoch this replica's current process says it leads at, if any."""
        return max(self.led().values(), default=None)

    def handing_off(self) -> list[str]:
        """The scopes (shards) this replica's current process is handing off right now."""
        return self._scan()[1]


class Stage:
    """The state of one chaos run, shared by its run, its nemesis and its checks."""

    def __init__(self, options: Options, out: Callable[[str], None] = print) -> None:
        if options.elector not in ELECTORS:
            raise ChaosError(f"elector must be one of {ELECTORS}, got {options.elector!r}")
        if options.tier not in TIERS:
            raise ChaosError(f"tier must be one of {TIERS}, got {options.tier!r}")
        if options.replicas < 2:
            raise ChaosError(f"--replicas must be at least 2, got {options.replicas}")
        self.options = options
        self.rng = random.Random(options.seed)  # the nemesis' schedule
        # The workload's own stream: spec changes run concurrently with the nemesis and
        # must not shift its draws.
        self.workload = random.Random(f"workload-{options.seed}")
        if options.shards < 1:
            raise ChaosError(f"shards must be at least 1, got {options.shards}")
        if options.by_namespace and options.shards < 2:
            raise ChaosError("by_namespace needs shards of at least 2")
        self.report = Report(options)
        self.sharded = options.shards > 1
        self.assignment = ShardAssignment(options.shards, options.by_namespace)
        # The Devices' namespaces: by namespace one per shard (chaos-<i>, the first names
        # falling in each shard), else the one namespace.
        self.device_namespaces = [NAMESPACE]
        if options.by_namespace:
            first: dict[int, str] = {}
            i = 0
            while len(first) < options.shards:
                first.setdefault(self.assignment.shard_of(f"chaos-{i}/x"), f"chaos-{i}")
                i += 1
            self.device_namespaces = [first[k] for k in range(options.shards)]
        self.scopes = (
            tuple(shard_id(SCOPE, k) for k in range(options.shards)) if self.sharded else (SCOPE,)
        )
        self.handlers = find_handlers(options.handlers)
        self.crd = find_crd(self.handlers)
        self.workdir = Path(tempfile.mkdtemp(prefix="kopf-reconcile-chaos-"))
        # The API server's audit log (the real tier's is in its own directory).
        self.audit_log = self.workdir / "audit.log"
        self.slots: list[Slot] = []
        self.histories: list[ProcessHistory] = []
        self._out = out
        self._origin = time.monotonic()
        self._cluster: asyncio.subprocess.Process | None = None
        self._cluster_url = ""
        self._cluster_paused = False
        self._real: RestartableRealCluster | None = None
        self._headers: dict[str, str] = {}
        self._ssl: ssl.SSLContext | None = None
        self._postgres: EmbeddedPostgres | None = None
        self._postgres_down = False
        self._guard: asyncio.subprocess.Process | None = None
        self._http: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._partitioned = False
        self._chaos_on = False
        self._changing = False

    # -- the Devices ---------------------------------------------------------------------

    def device(self, index: int) -> tuple[str, str]:
        """Device ``index``'s namespace and name (spread over the Devices' namespaces)."""
        return self.device_namespaces[index % len(self.device_namespaces)], f"device-{index:04d}"

    def device_path(self, index: int) -> str:
        namespace, name = self.device(index)
        return f"{devices_path(namespace)}/{name}"

    # -- the run ---------------------------------------------------------------------

    def say(self, text: str) -> None:
        self._out(f"[{time.monotonic() - self._origin:6.1f}s] {text}")

    @property
    def dsn(self) -> str:
        assert self._postgres is not None
        return self._postgres.dsn

    async def _start_replica(self, slot: Slot) -> None:
        o = self.options
        slot.generation += 1
        name = f"{slot.name}-{slot.generation}"
        slot.port = free_loopback_port()
        history = ProcessHistory(replica=name, events=self.workdir / f"{name}.events")
        env = {
            **os.environ,
            "KUBECONFIG": str(slot.kubeconfig),
            "POD_NAME": name,
            "POD_NAMESPACE": NAMESPACE,
            "KOPF_RECONCILE_DATABASE_URL": self.dsn,
            "KOPF_RECONCILE_LEADER": o.elector,
            "KOPF_RECONCILE_LEASE_TTL": str(o.ttl),
            "KOPF_RECONCILE_RENEW_INTERVAL": str(o.renew_interval),
            "KOPF_RECONCILE_STOP_TIMEOUT": "2",
            "DEVICES_WORK_DELAY": str(o.work_delay),
            "DEVICES_SHARDS": str(o.shards),
            "DEVICES_SHARD_BY_NAMESPACE": "1" if o.by_namespace else "0",
        }
        watched = [f"--namespace={namespace}" for namespace in self.device_namespaces]
        argv = [sys.executable, "-m", "kopf_reconcile.testing.chaos.replica", str(history.events),
                "--", "run", str(self.handlers), *watched, "--standalone",
                "--metrics-port", str(slot.port), "--log-format", "json"]  # fmt: skip
        slot.process = await asyncio.create_subprocess_exec(
            *dying_with_parent(argv),
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=(self.workdir / f"{name}.log").open("wb"),
            stderr=asyncio.subprocess.STDOUT,
        )
        history.pid = slot.process.pid
        slot.history = history
        slot.expected_exit = False
        self.histories.append(history)

    async def _wait_ready(self, slot: Slot) -> None:
        async def ready() -> bool:
            if not slot.alive:
                raise ChaosError(f"{slot.name} exited at startup; see {self.workdir}")
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with self._session().get(
                    f"http://127.0.0.1:{slot.port}/readyz", timeout=aiohttp.ClientTimeout(total=1)
                ) as response:
                    return response.status == 200
            return False

        await self._until_async(ready, f"{slot.name} ready", START_TIMEOUT)

    # -- the nemesis -----------------------------------------------------------------

    # -- plumbing --------------------------------------------------------------------

    def _scope_of(self, entity: str) -> str:
        """The fencing scope (and lease) ``entity`` belongs to: its shard's when sharded."""
        return self.scopes[self.assignment.shard_of(entity)] if self.sharded else SCOPE

    def _leader(self) -> Slot | None:
        leaders = [(s.leading(), s) for s in self.slots if not s.busy]
        found = [(epoch, s) for epoch, s in leaders if epoch is not None]
        return max(found, key=lambda pair: pair[0])[1] if found else None

    def _spawn(self, coroutine: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coroutine)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.say(f"chaos action {task.get_name()} failed: {task.exception()!r}")

    async def _wait_actions(self, exclude: set[asyncio.Task[Any]]) -> None:
        keep = {t for t in self._tasks if t.get_name() == "supervisor"} | exclude
        pending = self._tasks - keep
        if pending:
            await asyncio.wait(pending, timeout=START_TIMEOUT)

    async def _api(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        extra_headers: Any = None,
    ) -> Any:
        data = None if body is None else json.dumps(body)
        headers: CIMultiDict[str] = CIMultiDict(self._headers)
        headers.extend(extra_headers or {})  # repeated headers stay repeated (impersonation)
        if body is not None:
            headers["Content-Type"] = content_type
        async with self._session().request(
            method,
            self._cluster_url + path,
            data=data,
            headers=headers,
            ssl=self._ssl if self._ssl is not None else True,
            timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT),
        ) as response:
            text = await response.text()
            if response.status >= 400:
                raise ChaosError(f"{method} {path}: {response.status} {text[:1000]}")
            return json.loads(text) if text else {}

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession()
        return self._http

    async def _until(self, condition: Callable[[], bool], what: str, timeout: float) -> None:
        async def check() -> bool:
            return condition()

        await self._until_async(check, what, timeout)

    async def _until_async(
        self, condition: Callable[[], Awaitable[bool]], what: str, timeout: float
    ) -> None:
        deadline = time.monotonic() + timeout
        while not await condition():
            if time.monotonic() > deadline:
                raise ChaosError(f"timed out after {timeout:.0f}s waiting for {what}")
            await asyncio.sleep(0.25)


class RestartableRealCluster(RealCluster):
    """The real tier, whose kube-apiserver can crash and come back on the same etcd and port."""

    def __init__(self) -> None:
        super().__init__(audit_log=True)  # the API server's record: stale API writes
        self._argv: dict[str, list[str]] = {}

    def _spawn(self, name: str, argv: list[str]) -> ChildProcess:
        self._argv[name] = argv
        return super()._spawn(name, argv)

    @property
    def workdir(self) -> Path:
        return self._dir

    @property
    def apiserver(self) -> ChildProcess:
        return next(p for p in self._processes if p.name == "kube-apiserver")

    async def restart_apiserver(self) -> None:
        old = self.apiserver
        old.popen.kill()
        await old.stop()
        self._processes.remove(old)
        await self._wait_until_ready(self._spawn("kube-apiserver", self._argv["kube-apiserver"]))


def dying_with_parent(argv: list[str]) -> list[str]:
    """``argv`` run so that it is SIGKILLed when the harness dies.

    SIGKILL, not SIGTERM: a replica or API server the harness left SIGSTOPped would
    keep a SIGTERM pending forever.
    """
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *argv] if setpriv else argv
