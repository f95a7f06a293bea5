"""kopf-reconcile and controller-runtime side by side: failover, and writes after a takeover.

Both run the Device operator (``operator/examples/devices.py``, and its
controller-runtime port in ``benchmarks/baselines/controller_runtime``, built from
source by this benchmark if the cache has no binary for it) as replicas against
one embedded Kubernetes API (a process of its own) and one embedded PostgreSQL,
electing their leader on a Lease:

* **failover**: two replicas and a few Devices; the leader is SIGKILLed at a random
  point of its renewal cycle, measured until the other replica's first reconcile;
  then a third replica joins, the leader gets SIGTERM (a graceful stop: kopf-reconcile
  releases its lease, controller-runtime runs with ``LeaderElectionReleaseOnCancel``),
  measured until the newcomer's first reconcile. At both frameworks' defaults
  (lease 15 s, renewed every 2 s, renew deadline 10 s: the project took client-go's)
  and at a matched short lease (``--ttl``, renewed every ``--renew``, renew deadline
  2/3 of the lease, the project's rule, given to controller-runtime by its flags).
* **stale writes** (the chaos harness's zombie fault): two replicas converge
  ``--devices`` Devices, each reconcile doing ``DEVICES_WORK_DELAY`` of simulated
  device I/O before its writes; ``spec.desired`` of half of them changes, and while the
  leader is in the middle of that work it is SIGSTOPped past its lease, the Devices
  change again, the peer takes over (its first successful Lease write is the
  takeover), then the paused leader gets SIGCONT. Counted: the deposed leader's
  writes applied after the takeover, to PostgreSQL (a trigger records every row
  applied to the fence table with the writing connection's ``application_name``,
  one per replica) and to the API (the cluster records every write request that
  succeeded, with the replica's bearer token, one per replica). The schedule (when
  to pause, for how long) is drawn from ``random.Random(--seed)`` once and applied
  to both frameworks.

Times are ``time.monotonic()`` stamps (``CLOCK_MONOTONIC``, one clock for every
process of the machine): kopf-reconcile's from the chaos harness's replica probe,
controller-runtime's from its ``--events`` lines. ``RESULT`` and ``TABLE`` lines at
the end are read by ``scripts/bench.py``.

    python benchmarks/side_by_side.py [--only failover,stale-writes] [--seed N]
        [--rounds N] [--runs N] [--default-runs N] [--ttl S] [--renew S]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import yaml
from aiohttp import web

from baselines.build import build as build_baseline
from kopf_e2e import cluster_process, free_port, install_devices_crd, until
from kopf_reconcile.testing import install_fence
from kopf_reconcile.testing.emulated_apiserver import EmbeddedCluster
from kopf_reconcile.testing.postgres import EmbeddedPostgres
from results import result, table

ROOT = Path(__file__).parents[1]
HANDLERS = ROOT / "operator" / "examples" / "devices.py"
DRIVER = "benchmark-driver"  # the bearer token of the benchmark's own requests
WRITES_LOG = "/_benchmark/writes"
WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
FRAMEWORKS = ("controller-runtime", "kopf-reconcile")
STARTUP = 60.0
SETTLE = 4.0  # seconds after SIGCONT for the deposed leader's late work to land or fail
DEFAULTS = (15.0, 2.0)  # both frameworks' default lease and renew interval (client-go's)


# -- the cluster process: every successful write, by whose token --------------------------


async def serve_cluster() -> None:
    writes: list[dict[str, Any]] = []
    owners: dict[tuple[int, int], int | None] = {}  # (peer port, connection) -> pid

    @web.middleware
    async def record(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        response = await handler(request)
        if request.method in WRITES and response.status < 300 and request.transport is not None:
            peer = request.transport.get_extra_info("peername")
            server = request.transport.get_extra_info("sockname")
            key = (peer[1], id(request.transport))
            if key not in owners:
                owners[key] = socket_owner(peer[1], server[1])
            entry = {"t": time.monotonic(), "pid": owners[key], "verb": request.method}
            entry["path"] = request.path
            writes.append(entry)
        return response

    async def log(request: web.Request) -> web.Response:
        snapshot = list(writes)
        if request.method == "DELETE":
            writes.clear()
        return web.json_response(snapshot)

    cluster = EmbeddedCluster()
    cluster.server.app.middlewares.append(record)
    cluster.server.app.router.add_route("*", WRITES_LOG, log)
    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    async with cluster:
        print(json.dumps({"url": cluster.url, "kubeconfig": cluster.kubeconfig}), flush=True)
        await stopping.wait()


def socket_owner(port: int, server_port: int) -> int | None:
    """The pid of the process whose TCP socket 127.0.0.1:``port`` talks to ``server_port``.

    The kernel's own record of who holds the connection (``/proc/net/tcp`` for the
    socket's inode, ``/proc/<pid>/fd`` for its holder): no client has to say who it is.
    """
    inode = None
    for table_path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table_path) as tcp:
            for line in list(tcp)[1:]:
                fields = line.split()
                local, remote = fields[1].rsplit(":", 1)[1], fields[2].rsplit(":", 1)[1]
                if int(local, 16) == port and int(remote, 16) == server_port:
                    inode = fields[9]
    if inode is None:
        return None
    wanted = f"socket:[{inode}]"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == wanted:
                        return int(pid)
    return None


def kubeconfig_with_token(source: str, token: str, target: Path) -> Path:
    """A copy of the cluster's kubeconfig whose user presents ``token`` (who is writing)."""
    config = yaml.safe_load(Path(source).read_text())
    for user in config["users"]:
        user["user"] = {"token": token}
    target.write_text(yaml.safe_dump(config))
    return target


# -- replicas of either framework ---------------------------------------------------------


@dataclasses.dataclass
class Timing:
    """A lease and its renewal: ``ttl`` seconds, renewed every ``renew`` seconds."""

    label: str
    ttl: float
    renew: float

    def controller_runtime_flags(self) -> list[str]:
        deadline = self.ttl * 2 / 3  # the project's renew deadline, as client-go's default
        return [
            f"--lease-duration={self.ttl * 1000:.0f}ms",
            f"--renew-deadline={deadline * 1000:.0f}ms",
            f"--retry-period={self.renew * 1000:.0f}ms",
        ]

    def kopf_reconcile_env(self) -> dict[str, str]:
        return {
            "KOPF_RECONCILE_LEASE_TTL": f"{self.ttl:g}",
            "KOPF_RECONCILE_RENEW_INTERVAL": f"{self.renew:g}",
        }


@dataclasses.dataclass
class Replica:
    name: str
    framework: str
    process: asyncio.subprocess.Process
    events: Path  # kopf-reconcile: the probe's files; controller-runtime: its stdout, copied
    reader: asyncio.Task[None] | None = None

    def read(self) -> list[dict[str, Any]]:
        """Its events so far, as ``{"event": "lead" | "reconcile", "t": ...}``."""
        found = []
        paths = [self.events, Path(f"{self.events}.spans")]
        for path in paths:
            with contextlib.suppress(OSError):
                for line in path.read_text().splitlines():
                    with contextlib.suppress(ValueError):
                        event = json.loads(line)
                        kind = {"lead": "lead", "leader": "lead", "enter": "reconcile"}.get(
                            event["event"], event["event"]
                        )
                        found.append({**event, "event": kind})
        return found

    def first(self, kind: str, after: float = 0.0) -> float | None:
        times = [e["t"] for e in self.read() if e["event"] == kind and e["t"] > after]
        return min(times) if times else None

    async def wait_for(self, kind: str, after: float, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.first(kind, after)
            if found is not None:
                return found
            if self.process.returncode is not None:
                raise RuntimeError(f"{self.name} exited ({self.process.returncode})")
            await asyncio.sleep(0.01)
        raise TimeoutError(f"{self.name}: no {kind} within {timeout:.0f}s")

    def signal(self, number: int) -> None:
        if self.process.returncode is None:
            self.process.send_signal(number)

    async def stop(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.process.wait(), 20)
        except TimeoutError:
            self.signal(signal.SIGKILL)
            await self.process.wait()
        if self.reader is not None:
            await self.reader


@dataclasses.dataclass
class Setup:
    """What replicas of one round share."""

    cluster: dict[str, str]
    dsn: str
    namespace: str
    workdir: Path
    timing: Timing
    work_delay: float = 0.0
    baseline: Path | None = None


async def start_replica(framework: str, name: str, setup: Setup) -> Replica:
    kubeconfig = kubeconfig_with_token(
        setup.cluster["kubeconfig"], name, setup.workdir / f"{name}.kubeconfig"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KOPF_RECONCILE_") and k not in ("KUBERNETES_SERVICE_HOST", "POD_NAME")
    }
    env |= {
        "KUBECONFIG": str(kubeconfig),
        # One application_name per replica: the audit trigger records who applied a row.
        "KOPF_RECONCILE_DATABASE_URL": with_application_name(setup.dsn, name),
        "DEVICES_WORK_DELAY": f"{setup.work_delay:g}",
    }
    events = setup.workdir / f"{name}.events"
    log = (setup.workdir / f"{name}.log").open("wb")
    if framework == "kopf-reconcile":
        env |= {
            "KOPF_RECONCILE_LEADER": "kubernetes",
            "POD_NAME": name,
            "POD_NAMESPACE": setup.namespace,
            "KOPF_RECONCILE_STOP_TIMEOUT": "2",
            **setup.timing.kopf_reconcile_env(),
        }
        argv = [sys.executable, "-m", "kopf_reconcile.testing.chaos.replica", str(events),
                "--", "run", str(HANDLERS), f"--namespace={setup.namespace}", "--standalone",
                "--metrics-port", str(free_port())]  # fmt: skip
        process = await asyncio.create_subprocess_exec(
            *argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log
        )
        return Replica(name, framework, process, events)
    assert setup.baseline is not None
    argv = [str(setup.baseline), f"--namespace={setup.namespace}", "--metrics-bind-address=0",
            "--events", "--leader-election-release-on-cancel",
            *setup.timing.controller_runtime_flags()]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=log
    )
    replica = Replica(name, framework, process, events)
    replica.reader = asyncio.create_task(copy_lines(process, events))
    return replica


def with_application_name(dsn: str, name: str) -> str:
    """``dsn`` whose connections name themselves ``name`` (PostgreSQL's application_name)."""
    return f"{dsn}{'&' if '?' in dsn else '?'}application_name={name}"


async def copy_lines(process: asyncio.subprocess.Process, path: Path) -> None:
    """controller-runtime's event lines, from its stdout into ``path`` as they come."""
    assert process.stdout is not None
    with path.open("ab") as file:
        async for line in process.stdout:
            file.write(line)
            file.flush()


@asynccontextmanager
async def replicas(framework: str, setup: Setup, count: int) -> AsyncIterator[list[Replica]]:
    group = [await start_replica(framework, f"{setup.namespace}-{i}", setup) for i in range(count)]
    try:
        yield group
    finally:
        await asyncio.gather(*(replica.stop() for replica in group))


async def leader_of(group: list[Replica], after: float = 0.0) -> Replica:
    """The first of ``group`` to lead (and reconcile) after ``after``."""
    deadline = time.monotonic() + STARTUP
    while time.monotonic() < deadline:
        for replica in group:
            if replica.first("lead", after) is not None:
                await replica.wait_for("reconcile", after, STARTUP)
                return replica
        await asyncio.sleep(0.02)
    raise TimeoutError("no replica led")


# -- the driver's own API requests ---------------------------------------------------------


async def create_namespace(http: aiohttp.ClientSession, namespace: str, devices: int) -> str:
    async with http.post("/api/v1/namespaces", json={"metadata": {"name": namespace}}) as r:
        assert r.status == 201, await r.text()
    # The API server's fence over the namespace's Leases, as the chart installs it: it refuses
    # kopf-reconcile's writes made under a Lease that changed hands (controller-runtime's
    # carry no lease, and it does not touch them).
    await install_fence(http, namespace)
    url = f"/apis/example.com/v1/namespaces/{namespace}/devices"
    for i in range(devices):
        body = {"apiVersion": "example.com/v1", "kind": "Device",
                "metadata": {"name": f"device-{i:03d}"}, "spec": {"desired": "on"}}  # fmt: skip
        async with http.post(url, json=body) as r:
            assert r.status == 201, await r.text()
    return url


async def set_desired(http: aiohttp.ClientSession, url: str, names: list[str], state: str) -> None:
    patch = {"spec": {"desired": state}}
    headers = {"Content-Type": "application/merge-patch+json"}
    for name in names:
        async with http.patch(f"{url}/{name}", json=patch, headers=headers) as r:
            assert r.status == 200, await r.text()


async def spec_desired(http: aiohttp.ClientSession, url: str) -> dict[str, tuple[str, str]]:
    """Each Device's ``spec.desired`` and ``status.observed``, by name."""
    async with http.get(url) as response:
        items = (await response.json())["items"]
    return {
        i["metadata"]["name"]: (i["spec"]["desired"], (i.get("status") or {}).get("observed"))
        for i in items
    }


async def converged(http: aiohttp.ClientSession, url: str) -> bool:
    async with http.get(url) as response:
        items = (await response.json())["items"]
    return all((i.get("status") or {}).get("observed") == i["spec"]["desired"] for i in items)


# -- failover --------------------------------------------------------------------------------


async def failover_run(
    framework: str, setup: Setup, http: aiohttp.ClientSession, rng: random.Random
) -> tuple[float, float]:
    """Seconds to the new leader's first reconcile: after a SIGKILL, after a graceful stop."""
    await create_namespace(http, setup.namespace, 5)
    async with replicas(framework, setup, 2) as group:
        leader = await leader_of(group)
        [follower] = [r for r in group if r is not leader]
        await asyncio.sleep(rng.uniform(2 * setup.timing.renew, 3 * setup.timing.renew))
        killed_at = time.monotonic()
        leader.signal(signal.SIGKILL)
        after_kill = await follower.wait_for("reconcile", killed_at, 3 * setup.timing.ttl + STARTUP)
        newcomer = await start_replica(framework, f"{setup.namespace}-new", setup)
        try:
            await asyncio.sleep(max(4.0, 2 * setup.timing.renew))  # it is up, a follower
            stopped_at = time.monotonic()
            follower.signal(signal.SIGTERM)
            after_stop = await newcomer.wait_for(
                "reconcile", stopped_at, 3 * setup.timing.ttl + STARTUP
            )
        finally:
            await newcomer.stop()
    return after_kill - killed_at, after_stop - stopped_at


# -- stale writes after a takeover ---------------------------------------------------------


AUDIT = """
CREATE TABLE IF NOT EXISTS benchmark_applied (
    at       double precision NOT NULL,
    writer   text             NOT NULL,
    entity   text             NOT NULL,
    epoch    bigint           NOT NULL,
    state    jsonb
);
CREATE OR REPLACE FUNCTION benchmark_applied() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO benchmark_applied VALUES (
        extract(epoch FROM clock_timestamp()), current_setting('application_name'),
        NEW.entity_id, NEW.last_epoch, NEW.state);
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER benchmark_applied AFTER INSERT OR UPDATE ON kopf_reconcile_fence
    FOR EACH ROW EXECUTE FUNCTION benchmark_applied();
"""


@dataclasses.dataclass
class Zombie:
    """One round's outcome: the deposed leader's writes applied after the takeover."""

    database: int
    status_patches: int
    other_api_writes: int
    paused: float  # seconds it was paused
    took_over: float  # seconds from the SIGSTOP to the takeover
    left_status: int  # Devices whose status disagrees with their spec at the end
    left_rows: int  # rows of PostgreSQL that disagree with their Device's spec at the end

    @property
    def total(self) -> int:
        return self.database + self.status_patches + self.other_api_writes


async def zombie_round(
    framework: str,
    setup: Setup,
    http: aiohttp.ClientSession,
    devices: int,
    schedule: tuple[float, float],
) -> Zombie:
    pause_after, pause_for = schedule
    url = await create_namespace(http, setup.namespace, devices)
    names = [f"device-{i:03d}" for i in range(devices)]
    async with replicas(framework, setup, 2) as group:
        leader = await leader_of(group)
        await until(lambda: converged(http, url), timeout=STARTUP)
        async with asyncpg.create_pool(setup.dsn, min_size=1, max_size=1) as pool:
            await pool.execute(AUDIT)
            async with http.delete(WRITES_LOG):
                pass
            await set_desired(http, url, names[: devices // 2], "off")
            await asyncio.sleep(pause_after)  # its reconciles are in their device I/O
            leader.signal(signal.SIGSTOP)
            paused_at = time.monotonic()
            wall_offset = time.time() - time.monotonic()
            await asyncio.sleep(pause_for / 2)
            await set_desired(http, url, names[: devices // 2], "standby")
            await asyncio.sleep(pause_for / 2)
            async with http.get(WRITES_LOG) as response:
                writes = await response.json()
            takeover = min(
                (
                    w["t"]
                    for w in writes
                    if w["pid"] != leader.process.pid
                    and "/leases/" in w["path"]
                    and w["t"] > paused_at
                ),
                default=None,
            )
            leader.signal(signal.SIGCONT)
            resumed_at = time.monotonic()
            if takeover is None:
                raise RuntimeError(f"{framework}: no takeover while the leader was paused")
            await asyncio.sleep(SETTLE)
            with contextlib.suppress(TimeoutError):  # a stale status may never be corrected
                await until(lambda: converged(http, url), timeout=2 * SETTLE)
            desired = await spec_desired(http, url)
            left_status = sum(spec != observed for spec, observed in desired.values())
            rows = await pool.fetch(
                "SELECT entity_id, state->>'desired' AS desired FROM kopf_reconcile_fence"
            )
            left_rows = sum(
                1
                for row in rows
                if row["entity_id"].split("/", 1)[1] in desired
                and row["desired"] != desired[row["entity_id"].split("/", 1)[1]][0]
            )
            async with http.get(WRITES_LOG) as response:
                writes = await response.json()
            applied = await pool.fetchval(
                "SELECT count(*) FROM benchmark_applied WHERE writer = $1 AND at > $2",
                leader.name,
                takeover + wall_offset,
            )
    late = [w for w in writes if w["pid"] == leader.process.pid and w["t"] > takeover]
    status = [w for w in late if w["verb"] == "PATCH" and w["path"].endswith("/status")]
    return Zombie(
        database=int(applied),
        status_patches=len(status),
        other_api_writes=len(late) - len(status),
        paused=resumed_at - paused_at,
        took_over=takeover - paused_at,
        left_status=left_status,
        left_rows=left_rows,
    )


# -- the run ---------------------------------------------------------------------------------


@contextlib.contextmanager
def workspace(keep: bool) -> Iterator[str]:
    """A temporary directory for the replicas' files, removed at the end unless ``keep``."""
    workdir = tempfile.mkdtemp(prefix="kopf-side-by-side-")
    try:
        yield workdir
    finally:
        if keep:
            print(f"replicas' files kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


async def main(args: argparse.Namespace) -> None:
    parts = set(args.only.split(","))
    baseline = build_baseline()
    matched = Timing(f"matched lease {args.ttl:g}s", args.ttl, args.renew)
    defaults = Timing(f"defaults, lease {DEFAULTS[0]:g}s", *DEFAULTS)
    rng = random.Random(args.seed)
    # The zombie schedule, drawn once from the seed and applied to both frameworks.
    schedule = [
        (rng.uniform(0.1, 0.6) * args.work_delay, rng.uniform(2.0, 3.0) * args.ttl)
        for _ in range(args.rounds)
    ]
    failover: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    zombies: dict[str, list[Zombie]] = collections.defaultdict(list)
    with workspace(args.keep) as workdir:
        async with (
            cluster_process(__file__) as cluster,
            EmbeddedPostgres() as postgres,
            aiohttp.ClientSession(
                base_url=cluster["url"], headers={"Authorization": f"Bearer {DRIVER}"}
            ) as http,
        ):
            await install_devices_crd(http)
            counter = iter(range(10**6))

            async def setup(timing: Timing, work_delay: float = 0.0) -> Setup:
                namespace = f"side-{next(counter)}"
                dsn = await postgres.create_database()
                return Setup(cluster, dsn, namespace, Path(workdir), timing, work_delay, baseline)

            if "failover" in parts:
                for timing, runs in ((defaults, args.default_runs), (matched, args.runs)):
                    for framework in FRAMEWORKS if runs > 0 else ():
                        kills, stops = [], []
                        for _ in range(runs):
                            kill, stop = await failover_run(
                                framework, await setup(timing), http, rng
                            )
                            kills.append(kill)
                            stops.append(stop)
                            print(
                                f"failover {framework}, {timing.label}: SIGKILL {kill:.3f}s, "
                                f"graceful stop {stop:.3f}s",
                                flush=True,
                            )
                        failover[framework, timing.label] = (kills, stops)
            if "stale-writes" in parts:
                for framework in FRAMEWORKS:
                    for i, planned in enumerate(schedule):
                        zombie = await zombie_round(
                            framework,
                            await setup(matched, args.work_delay),
                            http,
                            args.devices,
                            planned,
                        )
                        zombies[framework].append(zombie)
                        print(
                            f"stale writes {framework}, round {i + 1}: paused "
                            f"{zombie.paused:.1f}s (taken over after {zombie.took_over:.1f}s); "
                            f"applied after the takeover: {zombie.database} to PostgreSQL, "
                            f"{zombie.status_patches} status patches, "
                            f"{zombie.other_api_writes} other API writes; left disagreeing "
                            f"with their spec: {zombie.left_status} statuses, "
                            f"{zombie.left_rows} rows",
                            flush=True,
                        )
    if failover:
        report_failover(failover)
    if zombies:
        report_zombies(zombies, args)


def report_failover(failover: dict[tuple[str, str], tuple[list[float], list[float]]]) -> None:
    rows = []
    for (framework, label), (kills, stops) in failover.items():
        for event, times in (("SIGKILL of the leader", kills), ("graceful stop", stops)):
            rows.append([label, event, framework, seconds(times)])
    labels = dict.fromkeys(label for _, label in failover)
    merged = []
    for label in labels:
        for event in ("SIGKILL of the leader", "graceful stop"):
            cells = {r[2]: r[3] for r in rows if r[0] == label and r[1] == event}
            merged.append([label, event, cells["kopf-reconcile"], cells["controller-runtime"]])
            print(f"failover, {label}, {event}: {cells}")
    table("failover", ["lease", "event", "kopf-reconcile", "controller-runtime"], merged)
    for label in labels:
        for index, event in enumerate(("SIGKILL", "graceful stop")):
            ours = failover["kopf-reconcile", label][index]
            theirs = failover["controller-runtime", label][index]
            result(
                "side_by_side",
                f"{event} to the new leader's first reconcile, kopf-reconcile vs "
                f"controller-runtime ({label})",
                ours=ours,
                baseline=theirs,
                unit="s",
                ratio="ours/baseline",
                target=None,
            )


def seconds(times: list[float]) -> str:
    median = statistics.median(times)
    if len(times) == 1:
        return f"{median:.2f} s"
    return f"{median:.2f} s ({min(times):.2f} to {max(times):.2f}, n={len(times)})"


def report_zombies(zombies: dict[str, list[Zombie]], args: argparse.Namespace) -> None:
    def total(framework: str, value: Callable[[Zombie], int]) -> int:
        return sum(value(z) for z in zombies[framework])

    figures: list[tuple[str, Callable[[Zombie], int]]] = [
        ("to PostgreSQL", lambda z: z.database),
        ("status patches to the API", lambda z: z.status_patches),
        ("other writes to the API", lambda z: z.other_api_writes),
        ("stale writes accepted", lambda z: z.total),
        ("Devices whose status was left stale (lost updates)", lambda z: z.left_status),
        ("PostgreSQL rows left stale (lost updates)", lambda z: z.left_rows),
    ]
    rows = [
        [label, str(total("controller-runtime", value)), str(total("kopf-reconcile", value))]
        for label, value in figures
    ]
    for row in rows:
        print(f"applied after the takeover, {row[0]}: controller-runtime {row[1]}, "
              f"kopf-reconcile {row[2]}")  # fmt: skip
    command = (
        f"python benchmarks/side_by_side.py --only stale-writes --seed {args.seed} "
        f"--rounds {args.rounds} --devices {args.devices} --ttl {args.ttl:g} "
        f"--renew {args.renew:g} --work-delay {args.work_delay:g}"
    )
    print(f"reproduce: {command}")
    table(
        "stale_writes",
        [f"deposed leader's writes applied after the takeover ({args.rounds} rounds, seed "
         f"{args.seed})", "controller-runtime", "kopf-reconcile"],
        [*rows, ["reproduce", f"`{command}`", ""]],
    )  # fmt: skip
    result(
        "side_by_side",
        "stale writes accepted after a takeover (zombie leader), kopf-reconcile vs "
        f"controller-runtime ({args.rounds} rounds, seed {args.seed})",
        ours=[float(z.total) for z in zombies["kopf-reconcile"]],
        baseline=[float(z.total) for z in zombies["controller-runtime"]],
        unit="",
        ratio="ours/baseline",
        target=("<=", 0.0),
        target_applies_to="ours_max",
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="failover,stale-writes")
    parser.add_argument("--seed", type=int, default=28)
    parser.add_argument("--rounds", type=int, default=2, help="zombie rounds per framework")
    parser.add_argument("--devices", type=int, default=32, help="Devices per zombie round")
    parser.add_argument("--work-delay", type=float, default=0.5, help="device I/O per reconcile")
    parser.add_argument("--runs", type=int, default=2, help="failovers at the matched lease")
    parser.add_argument("--default-runs", type=int, default=1, help="failovers at the defaults")
    parser.add_argument("--ttl", type=float, default=2.0, help="the matched lease, seconds")
    parser.add_argument("--renew", type=float, default=0.2, help="its renew interval, seconds")
    parser.add_argument("--keep", action="store_true", help="keep the replicas' logs")
    parser.add_argument("--serve-cluster", action="store_true", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.serve_cluster:
        asyncio.run(serve_cluster())
    else:
        asyncio.run(main(arguments))
