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
import contextlib
import dataclasses
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import yaml
from aiohttp import web

from baselines.build import build as build_baseline
from baselines.build import controller_runtime_version
from kopf_reconcile.testing.emulated_apiserver import EmbeddedCluster
from kopf_reconcile.testing.postgres import EmbeddedPostgres
from operators.sampled import INTERVAL as SAMPLE_INTERVAL
from results import result, table

ROOT = Path(__file__).parents[1]
BIN = Path(sys.executable).parent
SAMPLED = ROOT / "benchmarks" / "operators" / "sampled.py"
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
    metrics_flag: str = ""  # the flag that serves its metrics on a port, formatted with it
    reconciles_metric: str = ""  # the counter of its reconciles in /metrics (every result)
    samples: Path | None = None  # where operators/sampled.py writes its CPU samples, if run so


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
    samples: dict[str, int]  # CPU samples by owner (operators/sampled.py), if it ran under it

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
async def cluster_process(script: str = __file__) -> AsyncIterator[dict[str, str]]:
    """``script --serve-cluster`` (its ``serve_cluster``) as a process: what it prints."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, script, "--serve-cluster", stdout=asyncio.subprocess.PIPE
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
    argv: list[str],
    namespace: str,
    env: dict[str, str],
    metrics_port: int | None,
    metrics_flag: str = "--metrics-port={port}",
) -> asyncio.subprocess.Process:
    """An operator process watching ``namespace``, its output discarded."""
    extra = [] if metrics_port is None else [metrics_flag.format(port=metrics_port)]
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
        metrics_port = free_port() if contestant.metrics_flag else None
        forget_samples(contestant.samples)  # a fresh process numbers its snapshots anew
        process = await start_operator(
            contestant.argv, namespace, env, metrics_port, contestant.metrics_flag
        )
        try:
            await create(http, url, "warm-up")
            await until(lambda: stored(pool, namespace, 1), timeout=60)
            await http.delete(COUNTS)
            reconciles_before = await reconcile_total(contestant, metrics_port)
            samples_before = await cpu_samples(process, contestant.samples)
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
            samples = await cpu_samples(process, contestant.samples)
            samples = {k: n - samples_before.get(k, 0) for k, n in samples.items()}
            async with http.get(COUNTS) as response:
                requests = await response.json()
            await asyncio.sleep(0.5)  # the echoes of the last status patches, if any
            reconciles = await reconcile_total(contestant, metrics_port) - reconciles_before
        finally:
            await stop_operator(process)
    return Outcome(
        created,
        stored_after,
        reported_after,
        cpu,
        requests,
        rss_growth,
        reconciles,
        cores_busy,
        samples,
    )


async def cpu_samples(process: asyncio.subprocess.Process, path: Path | None) -> dict[str, int]:
    """The CPU samples by owner so far of an operator run by operators/sampled.py ({} if not)."""
    if path is None:
        return {}
    seq = read_samples(path)[0]
    process.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now, samples = read_samples(path)
        if now > seq:
            return samples
        await asyncio.sleep(0.02)
    raise TimeoutError(f"no CPU samples written to {path}")


def forget_samples(path: Path | None) -> None:
    """Remove the snapshot a previous operator process left, if any."""
    if path is not None:
        path.unlink(missing_ok=True)


def read_samples(path: Path) -> tuple[int, dict[str, int]]:
    """The last snapshot operators/sampled.py wrote: its number and its samples ((0, {}): none)."""
    with contextlib.suppress(OSError, ValueError):
        snapshot = json.loads(path.read_text())
        return int(snapshot["seq"]), {str(k): int(v) for k, v in snapshot["samples"].items()}
    return 0, {}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def reconcile_total(contestant: Contestant, port: int | None) -> float:
    """Reconciles the operator has run (every result), from its /metrics; NaN without them."""
    if port is None:
        return float("nan")
    prefix = contestant.reconciles_metric + "{"
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        text = await response.text()
    return sum(
        float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(prefix)
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


async def main(devices: int, rounds: int, shim_handlers: Path, names: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="kopf-e2e-") as workdir:
        samples = Path(workdir) / "samples.json"
        contestants = [
            Contestant(
                "plain",
                "plain kopf on.create/update",
                [str(BIN / "kopf"), "run", str(ROOT / "benchmarks/operators/plain_kopf_devices.py")],  # noqa: E501
            ),
            Contestant(
                "shim",
                "kopf-reconcile shim",
                [sys.executable, str(SAMPLED), str(samples), str(shim_handlers), "--", "run",
                 str(shim_handlers)],
                metrics_flag="--metrics-port={port}",
                reconciles_metric="kopf_reconcile_reconcile_total",
                samples=samples,
            ),
            Contestant(
                "controller-runtime",
                f"controller-runtime {controller_runtime_version()}",
                [str(build_baseline()), "--leader-election-id=devices-controller-runtime"],
                metrics_flag="--metrics-bind-address=127.0.0.1:{port}",
                reconciles_metric="controller_runtime_reconcile_total",
            ),
        ]  # fmt: skip
        contestants = [c for c in contestants if c.name in names]
        outcomes: dict[str, list[Outcome]] = {c.name: [] for c in contestants}
        async with cluster_process() as cluster, EmbeddedPostgres() as postgres:
            async with aiohttp.ClientSession(base_url=cluster["url"]) as http:
                await install_devices_crd(http)
            for round_ in range(rounds):  # rotate who goes first
                shift = round_ % len(contestants)
                for contestant in contestants[shift:] + contestants[:shift]:
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
        f"{'':<30} {'state stored':>12} {'status':>8} {'requests/Device':>16} "
        f"{'writes/Device':>14} {'operator CPU':>13} {'CPU s/1k':>9} {'RSS KiB/Device':>15} "
        f"{'reconciles/Device':>18} {'cores busy':>11}"
    )
    for c in contestants:
        print(
            f"{c.label:<30} {median(c.name, lambda o: o.stored):>11.2f}s "
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
    names = {c.name for c in contestants}
    scale = f" ({devices:,} Devices)"
    if "shim" in outcomes:
        loop_share(devices, outcomes["shim"], scale)
    for baseline, target, label in (
        ("plain", (">=", 3.0), "plain kopf"),
        ("controller-runtime", None, "controller-runtime"),
    ):
        if not {"shim", baseline} <= names:
            continue
        stored = median(baseline, lambda o: o.stored) / median("shim", lambda o: o.stored)
        status = median(baseline, lambda o: o.reported) / median("shim", lambda o: o.reported)
        cpu = median(baseline, lambda o: o.cpu) / median("shim", lambda o: o.cpu)
        goal = f" (target >= {target[1]:g}x)" if target else ""
        print(
            f"shim speed-up vs {label}: {stored:.2f}x until state stored{goal}, "
            f"{status:.2f}x status"
        )
        print(f"operator CPU per Device: {label} / shim = {cpu:.2f}x{goal}")
        comparison(devices, outcomes["shim"], outcomes[baseline], label, target=target)
    side_by_side(devices, contestants, outcomes)


def comparison(
    devices: int,
    shim: list[Outcome],
    base: list[Outcome],
    label: str,
    *,
    target: tuple[str, float] | None,
) -> None:
    """The four RESULT lines of the shim against one baseline (targets against plain kopf)."""
    scale = f" ({devices:,} Devices)"
    cores = f"machine cores busy until stored (of {os.cpu_count()}), shim"
    result(
        "kopf_e2e",
        f"time until every state is stored, shim vs {label}" + scale,
        ours=[o.stored for o in shim],
        baseline=[o.stored for o in base],
        unit="s",
        ratio="baseline/ours",
        target=target,
        extra={
            cores: statistics.median(o.cores_busy for o in shim),
            label: statistics.median(o.cores_busy for o in base),
        },
    )
    result(
        "kopf_e2e",
        f"operator CPU seconds per 1,000 Devices, shim vs {label}" + scale,
        ours=[o.cpu * 1000 / devices for o in shim],
        baseline=[o.cpu * 1000 / devices for o in base],
        unit="s",
        ratio="baseline/ours",
        target=target,
        extra={
            "shim reconciles per Device": statistics.median(o.reconciles for o in shim) / devices
        },
    )
    result(
        "kopf_e2e",
        f"operator peak RSS growth per Device, shim vs {label}" + scale,
        ours=[o.rss_growth / 1024 / devices for o in shim],
        baseline=[o.rss_growth / 1024 / devices for o in base],
        unit="KiB",
        ratio="ours/baseline",
        target=None if target is None else ("<=", 1.0),
    )
    result(
        "kopf_e2e",
        f"API requests per Device, shim vs {label}" + scale,
        ours=[o.total / devices for o in shim],
        baseline=[o.total / devices for o in base],
        unit="",
        ratio="ours/baseline",
        target=None if target is None else ("<=", 1.0),
    )


def loop_share(devices: int, shim: list[Outcome], scale: str) -> None:
    """The Loop's own share of the shim's CPU (operators/sampled.py), reported with dispatch."""
    totals: collections.Counter[str] = collections.Counter()
    for outcome in shim:
        totals.update(outcome.samples)
    samples = sum(totals.values())
    if not samples:
        return
    shares = {owner: n / samples for owner, n in totals.most_common()}
    cpu = statistics.median(o.cpu for o in shim)
    reconciles = statistics.median(o.reconciles for o in shim)
    per_reconcile = cpu / reconciles if reconciles else float("nan")
    print(
        f"shim CPU by owner ({samples:,} samples, one every {SAMPLE_INTERVAL * 1000:g} ms of CPU): "
        + ", ".join(f"{owner} {share:.1%}" for owner, share in shares.items())
    )
    print(
        f"the Loop's own share: {shares.get('loop', 0.0):.2%} of {per_reconcile * 1e6:,.0f} us of "
        f"operator CPU per reconcile = {shares.get('loop', 0.0) * per_reconcile * 1e6:.1f} us "
        "(target < 2 %)"
    )
    result(
        "dispatch",
        "the Loop's own CPU per reconcile, vs the operator's CPU per reconcile, in kopf_e2e "
        f"(sampled){scale}",
        ours=[shares.get("loop", 0.0) * per_reconcile * 1e6],
        baseline=[per_reconcile * 1e6],
        unit="us",
        ratio="ours/baseline",
        target=("<=", 0.02),
        extra={
            "samples": float(samples),
            "reconciler share": shares.get("reconciler", 0.0),
            "rest of kopf_reconcile": shares.get("kopf_reconcile", 0.0),
            "kopf": shares.get("kopf", 0.0),
            "other": shares.get("other", 0.0),
        },
    )


def side_by_side(
    devices: int, contestants: list[Contestant], outcomes: dict[str, list[Outcome]]
) -> None:
    """The three-way rows of RESULTS.md's end-to-end table (a ``TABLE`` line)."""
    order = ["shim", "plain", "controller-runtime"]
    present = [name for name in order if name in outcomes]
    if len(present) < len(order):
        return

    def cell(name: str, value: Callable[[Outcome], float], fmt: str) -> str:
        return format(statistics.median(value(o) for o in outcomes[name]), fmt)

    figures: list[tuple[str, Callable[[Outcome], float], str]] = [
        ("time to converge (s)", lambda o: o.stored, ".2f"),
        ("operator CPU per Device (ms)", lambda o: o.cpu * 1000 / devices, ".2f"),
        ("RSS growth per Device (KiB)", lambda o: o.rss_growth / 1024 / devices, ".2f"),
        ("API requests per Device", lambda o: o.total / devices, ".2f"),
        ("machine cores busy until converged", lambda o: o.cores_busy, ".2f"),
    ]
    rows = [
        [f"{devices:,}", label, *(cell(name, value, fmt) for name in order)]
        for label, value, fmt in figures
    ]
    labels = {c.name: c.label for c in contestants}
    table(
        "end_to_end",
        ["Devices", "figure", "kopf-reconcile", "plain kopf", labels["controller-runtime"]],
        rows,
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
    parser.add_argument(
        "--contestants",
        default="plain,shim,controller-runtime",
        help="which operators run (comma-separated; default: all three)",
    )
    parser.add_argument("--serve-cluster", action="store_true", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.serve_cluster:
        asyncio.run(serve_cluster())
    else:
        chosen = arguments.contestants.split(",")
        asyncio.run(main(arguments.devices, arguments.rounds, arguments.shim_handlers, chosen))
