"""End to end on the embedded cluster: the kopf shim vs plain kopf handlers, 1,000 Devices.

Two operators do the same work for every Device: validate ``spec.desired``, write it to
PostgreSQL (the same statement through the same repository), report it in
``status.observed``, and write a tombstone when the Device is deleted.

* shim: ``kopf-reconcile run operator/examples/devices.py`` — ``@kr.reconciler`` with its
  stateless ``on.event`` handler, a Kubernetes Lease (renewed every 2 s) and fenced writes;
* plain: ``kopf run benchmarks/operators/plain_kopf_devices.py`` — ``@kopf.on.create`` /
  ``@kopf.on.update`` (and ``@kopf.on.delete`` for the deletions, hence kopf's finalizer),
  the status written by kopf's own patch.

The embedded cluster runs in a process of its own (this file with ``--serve-cluster``),
counting every API request an operator makes; each operator runs as a process against it
and one embedded PostgreSQL. After a warm-up Device proves the operator is up (and
leading), 1,000 Devices are created (32 requests at a time) and the clock runs until every
one's state is in PostgreSQL, then until every status reports it. The operators take turns
for ``--rounds`` rounds, each in a fresh namespace and database; the medians are printed
with the ratio and the API requests (all, and writes) per Device, the operator's CPU
seconds per 1,000 Devices and its peak RSS per Device (its high-water mark over the whole
process, less the one after the warm-up), and for the shim the reconciles per Device
(from its /metrics), and the machine's busy cores until every state was stored (the
cluster, PostgreSQL and this driver share the cores with the operator: when they are all
busy, the time to converge measures the harness as much as the operator, and the CPU per
Device is the fair comparison). Target: the shim >= 3x faster. ``--shim-handlers`` runs
another handlers file as the shim (to compare a variant of the example). A final
``RESULT`` line per figure is read by ``scripts/bench.py``.

    python benchmarks/kopf_e2e.py [--devices N] [--rounds R] [--shim-handlers PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import signal
import socket
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import yaml
from aiohttp import web

from kopf_reconcile.testing.emulated_apiserver import EmbeddedCluster
from kopf_reconcile.testing.postgres import EmbeddedPostgres
from results import result

ROOT = Path(__file__).parents[1]
BIN = Path(sys.executable).parent
DRIVER = "kopf-reconcile-benchmark"  # the User-Agent of the benchmark's own requests
COUNTS = "/_benchmark/requests"  # the cluster process's request counts (GET, DELETE resets)
SCOPE = "devices.example.com-reconcile-device"  # the fence scope both operators write to
WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
CREATE_CONCURRENCY = 32


@dataclasses.dataclass
class Contestant:
    name: str
    label: str
    argv: list[str]


@dataclasses.dataclass
class Outcome:
    created: float  # seconds the creation requests took
    stored: float  # seconds until every state was in PostgreSQL
    reported: float  # seconds until every status reported it
    cpu: float  # CPU seconds the operator process spent meanwhile
    requests: dict[str, int]  # by verb (WATCH for watch requests)
    rss_growth: float  # bytes: peak RSS at the end less the peak after the warm-up
    reconciles: float  # reconciles of Devices (shim only, from its metrics; NaN otherwise)
    cores_busy: float  # the machine's busy cores until every state was stored (all processes)

    @property
    def total(self) -> int:
        return sum(self.requests.values())

    @property
    def writes(self) -> int:
        return sum(n for verb, n in self.requests.items() if verb in WRITES)


# -- the cluster process --------------------------------------------------------------------


async def serve_cluster() -> None:
    """An embedded cluster that counts requests not made by the benchmark itself."""
    verbs: collections.Counter[str] = collections.Counter()

    @web.middleware
    async def count(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.headers.get("User-Agent") != DRIVER:
            verbs["WATCH" if request.query.get("watch") in ("true", "1") else request.method] += 1
        return await handler(request)

    async def counts(request: web.Request) -> web.Response:
        snapshot = dict(verbs)
        if request.method == "DELETE":
            verbs.clear()
        return web.json_response(snapshot)

    cluster = EmbeddedCluster()
    cluster.server.app.middlewares.append(count)  # the app is frozen at start: add them now
    cluster.server.app.router.add_route("*", COUNTS, counts)
    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    async with cluster:
        print(json.dumps({"url": cluster.url, "kubeconfig": cluster.kubeconfig}), flush=True)
        await stopping.wait()


@asynccontextmanager
async def cluster_process() -> AsyncIterator[dict[str, str]]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--serve-cluster", stdout=asyncio.subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        yield json.loads(await asyncio.wait_for(process.stdout.readline(), 60))
    finally:
        process.send_signal(signal.SIGTERM)
        await process.wait()


# -- one round of one contestant ----------------------------------------------------------


def operator_env(cluster: dict[str, str], dsn: str, namespace: str) -> dict[str, str]:
    """An operator process's environment: this one's, less its own settings, plus the run's."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KOPF_RECONCILE_") and k not in ("KUBERNETES_SERVICE_HOST", "POD_NAME")
    }
    return env | {
        "KUBECONFIG": cluster["kubeconfig"],
        "KOPF_RECONCILE_DATABASE_URL": dsn,
        "KOPF_RECONCILE_LEADER": "kubernetes",
        "POD_NAMESPACE": namespace,
    }


async def start_operator(
    argv: list[str], namespace: str, env: dict[str, str], metrics_port: int | None
) -> asyncio.subprocess.Process:
    """An operator process watching ``namespace``, its output discarded."""
    extra = [] if metrics_port is None else [f"--metrics-port={metrics_port}"]
    return await asyncio.create_subprocess_exec(
        *argv,
        *extra,
        f"--namespace={namespace}",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )


async def run(
    contestant: Contestant, devices: int, cluster: dict[str, str], dsn: str, namespace: str
) -> Outcome:
    env = operator_env(cluster, dsn, namespace)
    headers = {"User-Agent": DRIVER}
    async with (
        aiohttp.ClientSession(base_url=cluster["url"], headers=headers) as http,
        asyncpg.create_pool(dsn, min_size=1, max_size=2) as pool,
    ):
        async with http.post("/api/v1/namespaces", json={"metadata": {"name": namespace}}) as r:
            assert r.status == 201, await r.text()
        url = f"/apis/example.com/v1/namespaces/{namespace}/devices"
        metrics_port = free_port() if contestant.name == "shim" else None
        process = await start_operator(contestant.argv, namespace, env, metrics_port)
        try:
            await create(http, url, "warm-up")
            await until(lambda: stored(pool, namespace, 1), timeout=60)
            await http.delete(COUNTS)
            reconciles_before = await reconcile_total(metrics_port)
            rss_before = peak_rss(process.pid)
            cpu_before = cpu_seconds(process.pid)
            machine_before = machine_jiffies()
            started = time.perf_counter()
            await gather_limited(
                [lambda i=i: create(http, url, f"device-{i:05d}") for i in range(devices)]
            )
            created = time.perf_counter() - started
            await until(lambda: stored(pool, namespace, devices + 1), timeout=600)
            stored_after = time.perf_counter() - started
            cores_busy = busy_cores(machine_before, machine_jiffies())
            await until(lambda: reported(http, url, devices + 1), timeout=600, interval=0.25)
            reported_after = time.perf_counter() - started
            cpu = cpu_seconds(process.pid) - cpu_before
            rss_growth = peak_rss(process.pid) - rss_before
            async with http.get(COUNTS) as response:
                requests = await response.json()
            await asyncio.sleep(0.5)  # the echoes of the last status patches, if any
            reconciles = await reconcile_total(metrics_port) - reconciles_before
        finally:
            await stop_operator(process)
    return Outcome(
        created, stored_after, reported_after, cpu, requests, rss_growth, reconciles, cores_busy
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def reconcile_total(port: int | None) -> float:
    """Reconciles the shim has run (every result), from its /metrics; NaN without them."""
    if port is None:
        return float("nan")
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        text = await response.text()
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("kopf_reconcile_reconcile_total{")
    )


def memory_of(pid: int, field: str) -> float:
    """A memory figure of the process in bytes, such as ``VmRSS`` or its peak ``VmHWM``
    (Linux /proc; NaN elsewhere)."""
    try:
        with open(f"/proc/{pid}/status") as file:
            for line in file:
                if line.startswith(f"{field}:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float("nan")


def peak_rss(pid: int) -> float:
    """The process's peak resident set size in bytes."""
    return memory_of(pid, "VmHWM")


async def gather_limited(calls: list[Callable[[], Awaitable[None]]]) -> None:
    """Await every call, at most CREATE_CONCURRENCY at a time."""
    semaphore = asyncio.Semaphore(CREATE_CONCURRENCY)

    async def one(call: Callable[[], Awaitable[None]]) -> None:
        async with semaphore:
            await call()

    await asyncio.gather(*(one(c) for c in calls))


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process (Linux /proc; NaN elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rpartition(")")[2].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_jiffies() -> tuple[int, int]:
    """The machine's busy and total CPU time so far, in clock ticks (Linux /proc/stat)."""
    with open("/proc/stat") as file:
        ticks = [int(field) for field in file.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle and iowait
    return sum(ticks) - idle, sum(ticks)


def busy_cores(before: tuple[int, int], after: tuple[int, int]) -> float:
    """How many of the machine's cores were busy between two ``machine_jiffies`` readings."""
    busy, total = after[0] - before[0], after[1] - before[1]
    return busy / total * (os.cpu_count() or 1) if total else float("nan")


async def create(http: aiohttp.ClientSession, url: str, name: str) -> dict[str, Any]:
    """A Device ``name`` at ``url`` (its collection), desired ``on``; the created body."""
    body = {
        "apiVersion": "example.com/v1",
        "kind": "Device",
        "metadata": {"name": name},
        "spec": {"desired": "on"},
    }
    async with http.post(url, json=body) as response:
        assert response.status == 201, await response.text()
        created: dict[str, Any] = await response.json()
    return created


async def install_devices_crd(http: aiohttp.ClientSession) -> None:
    """The example's CRD, on the benchmark's fresh cluster."""
    crd = yaml.safe_load((ROOT / "crds" / "devices.yaml").read_text())
    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    async with http.post(crds, json=crd) as response:
        assert response.status == 201, await response.text()


async def stop_operator(process: asyncio.subprocess.Process) -> None:
    """SIGTERM, then SIGKILL after 30 s; reaped either way."""
    process.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), 30)
    except TimeoutError:
        process.kill()
        await process.wait()


async def stored(pool: asyncpg.Pool, namespace: str, expected: int) -> bool:
    count = await pool.fetchval(
        "SELECT count(*) FROM kopf_reconcile_fence WHERE scope = $1 AND entity_id LIKE $2",
        SCOPE,
        f"{namespace}/%",
    )
    return bool(count >= expected)


async def reported(http: aiohttp.ClientSession, url: str, expected: int) -> bool:
    async with http.get(url) as response:
        items = (await response.json())["items"]
    observed = [i for i in items if (i.get("status") or {}).get("observed") == i["spec"]["desired"]]
    return len(observed) >= expected


async def until(
    condition: Callable[[], Awaitable[bool]], timeout: float, interval: float = 0.05
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if await condition():
                return
        except asyncpg.UndefinedTableError:
            pass  # the operator has not created its table yet
        if time.monotonic() > deadline:
            raise TimeoutError(f"not done within {timeout}s")
        await asyncio.sleep(interval)


# -- the comparison -------------------------------------------------------------------------


async def main(devices: int, rounds: int, shim_handlers: Path) -> None:
    contestants = [
        Contestant(
            "plain",
            "plain kopf on.create/update",
            [str(BIN / "kopf"), "run", str(ROOT / "benchmarks/operators/plain_kopf_devices.py")],
        ),
        Contestant(
            "shim",
            "kopf-reconcile shim",
            [str(BIN / "kopf-reconcile"), "run", str(shim_handlers)],
        ),
    ]  # fmt: skip
    outcomes: dict[str, list[Outcome]] = {c.name: [] for c in contestants}
    async with cluster_process() as cluster, EmbeddedPostgres() as postgres:
        async with aiohttp.ClientSession(base_url=cluster["url"]) as http:
            await install_devices_crd(http)
        for round_ in range(rounds):  # alternate who goes first
            for contestant in contestants if round_ % 2 == 0 else contestants[::-1]:
                dsn = await postgres.create_database()
                namespace = f"bench-{contestant.name}-{round_}"
                outcome = await run(contestant, devices, cluster, dsn, namespace)
                outcomes[contestant.name].append(outcome)
    report(devices, rounds, contestants, outcomes)


def report(
    devices: int, rounds: int, contestants: list[Contestant], outcomes: dict[str, list[Outcome]]
) -> None:
    def median(name: str, value: Callable[[Outcome], float]) -> float:
        return statistics.median(value(o) for o in outcomes[name])

    created = statistics.median(o.created for runs in outcomes.values() for o in runs)
    print(
        f"{devices} Devices created on the embedded cluster ({CREATE_CONCURRENCY} at a time, "
        f"{created:.2f}s); time until all are reconciled, median of {rounds} rounds"
    )
    print(
        f"{'':<28} {'state stored':>12} {'status':>8} {'requests/Device':>16} "
        f"{'writes/Device':>14} {'operator CPU':>13} {'CPU s/1k':>9} {'RSS KiB/Device':>15} "
        f"{'reconciles/Device':>18} {'cores busy':>11}"
    )
    for c in contestants:
        print(
            f"{c.label:<28} {median(c.name, lambda o: o.stored):>11.2f}s "
            f"{median(c.name, lambda o: o.reported):>7.2f}s "
            f"{median(c.name, lambda o: o.total) / devices:>16.2f} "
            f"{median(c.name, lambda o: o.writes) / devices:>14.2f} "
            f"{median(c.name, lambda o: o.cpu):>12.2f}s "
            f"{median(c.name, lambda o: o.cpu) * 1000 / devices:>9.2f} "
            f"{median(c.name, lambda o: o.rss_growth) / 1024 / devices:>15.2f} "
            f"{median(c.name, lambda o: o.reconciles) / devices:>18.2f} "
            f"{median(c.name, lambda o: o.cores_busy):>11.2f}"
        )
    for c in contestants:
        runs = ", ".join(f"{o.stored:.2f}s" for o in outcomes[c.name])
        print(
            f"  {c.name}: state stored per round {runs}; requests {outcomes[c.name][-1].requests}"
        )
    stored = median("plain", lambda o: o.stored) / median("shim", lambda o: o.stored)
    status = median("plain", lambda o: o.reported) / median("shim", lambda o: o.reported)
    print(f"shim speed-up: {stored:.2f}x until state stored (target >= 3x), {status:.2f}x status")
    cpu = median("plain", lambda o: o.cpu) / median("shim", lambda o: o.cpu)
    print(f"operator CPU per Device: plain / shim = {cpu:.2f}x (target >= 3x)")
    shim, plain = outcomes["shim"], outcomes["plain"]
    scale = f" ({devices:,} Devices)"
    result(
        "kopf_e2e",
        "time until every state is stored, shim vs plain kopf" + scale,
        ours=[o.stored for o in shim],
        baseline=[o.stored for o in plain],
        unit="s",
        ratio="baseline/ours",
        target=(">=", 3.0),
        extra={
            f"machine cores busy until stored (of {os.cpu_count()}), shim": median(
                "shim", lambda o: o.cores_busy
            ),
            "plain": median("plain", lambda o: o.cores_busy),
        },
    )
    result(
        "kopf_e2e",
        "operator CPU seconds per 1,000 Devices, shim vs plain kopf" + scale,
        ours=[o.cpu * 1000 / devices for o in shim],
        baseline=[o.cpu * 1000 / devices for o in plain],
        unit="s",
        ratio="baseline/ours",
        target=(">=", 3.0),
        extra={"shim reconciles per Device": median("shim", lambda o: o.reconciles) / devices},
    )
    result(
        "kopf_e2e",
        "operator peak RSS growth per Device, shim vs plain kopf" + scale,
        ours=[o.rss_growth / 1024 / devices for o in shim],
        baseline=[o.rss_growth / 1024 / devices for o in plain],
        unit="KiB",
        ratio="ours/baseline",
        target=("<=", 1.0),
    )
    result(
        "kopf_e2e",
        "API requests per Device, shim vs plain kopf" + scale,
        ours=[o.total / devices for o in shim],
        baseline=[o.total / devices for o in plain],
        unit="",
        ratio="ours/baseline",
        target=("<=", 1.0),
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--shim-handlers",
        type=Path,
        default=ROOT / "operator" / "examples" / "devices.py",
        help="the handlers file the shim runs (default: the example operator)",
    )
    parser.add_argument("--serve-cluster", action="store_true", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.serve_cluster:
        asyncio.run(serve_cluster())
    else:
        asyncio.run(main(arguments.devices, arguments.rounds, arguments.shim_handlers))
