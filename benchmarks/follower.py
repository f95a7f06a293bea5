"""A follower with 10,000 objects: the shim's memory and CPU while another replica leads.

The example operator (``kopf-reconcile run operator/examples/devices.py``, a Kubernetes
Lease, fenced writes) starts on the embedded cluster of ``benchmarks/kopf_e2e.py`` (its
cluster process and helpers, imported) against ``--devices`` existing Devices whose
status already reports their spec. Three phases, in one run, on the same objects:

* **empty**: the operator in a namespace without Devices (the process's own start:
  imports, kopf, the Loop), the base of the figures below;
* **follower**: the reconciler's Lease is held by another holder (created here, with a
  long ``leaseDurationSeconds``), so the operator only watches and caches: a warm
  standby;
* **leader**: the same operator once that Lease is gone: it leads, and its resync-all
  reconciles every cached Device (each finds its status converged and writes nothing).

For each: CPU seconds from the process start until every Device is cached (its
start and the initial listing, next to the empty start: the listing's own share is
not subtracted, since it is smaller than the start's variation), RSS growth per
cached object (VmRSS then, less the empty start's, divided by the objects), CPU
seconds per minute idle (over ``--idle-seconds``), and CPU seconds for a burst of
``--burst`` spec updates (the leader reconciles them: fenced writes and status
patches; the follower caches them), until the process is quiet again. The
follower is compared with the leader.

    python benchmarks/follower.py [--devices N] [--burst N] [--idle-seconds S]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time

import aiohttp

from kopf_e2e import (
    BIN,
    DRIVER,
    ROOT,
    SCOPE,
    cluster_process,
    cpu_seconds,
    create,
    free_port,
    gather_limited,
    install_devices_crd,
    memory_of,
    operator_env,
    start_operator,
    stop_operator,
    until,
)
from kopf_reconcile.testing.postgres import EmbeddedPostgres
from results import result

LEASE = SCOPE  # the reconciler id of the example: its Lease's name and its fenced scope
FOREIGN_HOLDER = "another-replica-0000"
QUIET_CPU = 0.02  # CPU seconds per second below which the operator counts as quiet


@dataclasses.dataclass
class Phase:
    listing_cpu: float  # CPU seconds from the process start until every Device is cached
    listing_wall: float  # seconds from the start until then
    rss: float  # VmRSS in bytes once listed (and, for the leader, resynced)
    idle_cpu_per_minute: float
    burst_cpu: float  # CPU seconds from the burst's first request until quiet again
    burst_wall: float
    leader: bool


async def populate(http: aiohttp.ClientSession, namespace: str, devices: int) -> None:
    """``devices`` Devices whose status already reports their spec (nothing to reconcile)."""
    url = f"/apis/example.com/v1/namespaces/{namespace}/devices"

    async def device(name: str) -> None:
        created = await create(http, url, name)
        status = {
            "observed": "on",
            "epoch": 0,
            "observedGeneration": created["metadata"]["generation"],
        }
        patch = [{"op": "add", "path": "/status", "value": status}]
        headers = {"Content-Type": "application/json-patch+json"}
        async with http.patch(f"{url}/{name}/status", json=patch, headers=headers) as response:
            assert response.status == 200, await response.text()

    await gather_limited([lambda i=i: device(f"device-{i:05d}") for i in range(devices)])


async def hold_lease(http: aiohttp.ClientSession, namespace: str) -> None:
    """The reconciler's Lease, held by another replica for an hour."""
    now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
    body = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": LEASE, "namespace": namespace},
        "spec": {
            "holderIdentity": FOREIGN_HOLDER,
            "leaseDurationSeconds": 3600,
            "acquireTime": now,
            "renewTime": now,
            "leaseTransitions": 1,
        },
    }
    url = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
    async with http.post(url, json=body) as response:
        assert response.status == 201, await response.text()


async def drop_lease(http: aiohttp.ClientSession, namespace: str) -> None:
    url = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{LEASE}"
    async with http.delete(url) as response:
        assert response.status in (200, 404), await response.text()


async def health(port: int) -> dict[str, object] | None:
    """The reconciler's /healthz report (running, leader, cached_objects, queue), or None."""
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{port}/healthz") as response,
        ):
            document = await response.json()
    except (aiohttp.ClientError, OSError, ValueError):
        return None
    report = document.get("reconcilers", {}).get(LEASE)
    return report if isinstance(report, dict) and report.get("running") else None


async def quiet(pid: int, timeout: float = 120) -> None:
    """Until the process spends under QUIET_CPU CPU seconds per second, for a second."""
    deadline = time.monotonic() + timeout
    before = cpu_seconds(pid)
    while time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        now = cpu_seconds(pid)
        if now - before < QUIET_CPU:
            return
        before = now
    raise TimeoutError(f"the operator was not quiet within {timeout}s")


async def run_phase(
    http: aiohttp.ClientSession,
    cluster: dict[str, str],
    dsn: str,
    namespace: str,
    expected: int,
    *,
    leader: bool,
    burst: int,
    idle_seconds: float,
) -> Phase:
    env = operator_env(cluster, dsn, namespace)
    port = free_port()
    argv = [str(BIN / "kopf-reconcile"), "run", str(ROOT / "operator/examples/devices.py")]
    started = time.perf_counter()
    process = await start_operator(argv, namespace, env, port)
    pid = process.pid
    try:

        async def listed() -> bool:
            report = await health(port)
            if report is None or int(report.get("cached_objects", -1)) < expected:  # type: ignore[call-overload]
                return False
            if leader:  # and its resync-all is done: nothing queued or in flight
                return (
                    bool(report.get("leader"))
                    and not report.get("queued")
                    and not report.get("in_flight")
                )
            return True

        await until(listed, timeout=600)
        listing_wall = time.perf_counter() - started
        listing_cpu = cpu_seconds(pid)
        await quiet(pid)
        rss = memory_of(pid, "VmRSS")
        report = await health(port)
        assert report is not None and bool(report.get("leader")) is leader, report
        before = cpu_seconds(pid)
        await asyncio.sleep(idle_seconds)
        idle = (cpu_seconds(pid) - before) * 60 / idle_seconds
        burst_cpu = burst_wall = float("nan")
        if burst:
            url = f"/apis/example.com/v1/namespaces/{namespace}/devices"
            desired = "off" if leader else "standby"  # a change for either phase
            patch = {"spec": {"desired": desired}}
            headers = {"Content-Type": "application/merge-patch+json"}

            async def update(name: str) -> None:
                async with http.patch(f"{url}/{name}", json=patch, headers=headers) as response:
                    assert response.status == 200, await response.text()

            before = cpu_seconds(pid)
            burst_started = time.perf_counter()
            await gather_limited([lambda i=i: update(f"device-{i:05d}") for i in range(burst)])
            await quiet(pid)
            burst_wall = time.perf_counter() - burst_started - 1.0  # less the quiet second
            burst_cpu = cpu_seconds(pid) - before
    finally:
        await stop_operator(process)
    return Phase(listing_cpu, listing_wall, rss, idle, burst_cpu, burst_wall, leader)


async def main(devices: int, burst: int, idle_seconds: float) -> None:
    async with cluster_process() as cluster, EmbeddedPostgres() as postgres:
        headers = {"User-Agent": DRIVER}
        async with aiohttp.ClientSession(base_url=cluster["url"], headers=headers) as http:
            await install_devices_crd(http)
            for namespace in ("follower-empty", "follower"):
                async with http.post(
                    "/api/v1/namespaces", json={"metadata": {"name": namespace}}
                ) as r:
                    assert r.status == 201, await r.text()
            started = time.perf_counter()
            await populate(http, "follower", devices)
            print(
                f"{devices:,} converged Devices created in {time.perf_counter() - started:.1f}s",
                flush=True,
            )
            dsn = await postgres.create_database()
            await hold_lease(http, "follower-empty")
            empty = await run_phase(
                http,
                cluster,
                dsn,
                "follower-empty",
                0,
                leader=False,
                burst=0,
                idle_seconds=idle_seconds,
            )
            await hold_lease(http, "follower")
            follower = await run_phase(
                http,
                cluster,
                dsn,
                "follower",
                devices,
                leader=False,
                burst=burst,
                idle_seconds=idle_seconds,
            )
            await drop_lease(http, "follower")
            leader = await run_phase(
                http,
                cluster,
                dsn,
                "follower",
                devices,
                leader=True,
                burst=burst,
                idle_seconds=idle_seconds,
            )
    report(devices, burst, idle_seconds, empty=empty, follower=follower, leader=leader)


def report(
    devices: int, burst: int, idle_seconds: float, *, empty: Phase, follower: Phase, leader: Phase
) -> None:
    def per_object(p: Phase) -> float:
        return (p.rss - empty.rss) / devices

    print(
        f"follower: the example operator with {devices:,} Devices while another holder has its "
        f"Lease, vs the same operator leading; idle over {idle_seconds:g}s, a burst of {burst:,} "
        "spec updates"
    )
    print(
        f"{'':<10} {'CPU s until listed':>18} {'listed after':>12} "
        f"{'RSS MiB':>8} {'B/object':>9} {'idle CPU s/min':>14} {'burst CPU s':>11} {'burst s':>8}"
    )
    for name, p in (("empty", empty), ("follower", follower), ("leader", leader)):
        print(
            f"{name:<10} {p.listing_cpu:>18.2f} {p.listing_wall:>11.1f}s "
            f"{p.rss / 2**20:>8.1f} "
            f"{per_object(p) if p is not empty else 0.0:>9,.0f} {p.idle_cpu_per_minute:>14.3f} "
            f"{p.burst_cpu:>11.2f} {p.burst_wall:>7.1f}s"
        )
    print(
        f"summary: a follower keeps {per_object(follower):,.0f} B per cached object "
        f"({per_object(follower) / per_object(leader):.2f}x the leader's), spends "
        f"{follower.listing_cpu:.2f} CPU s from its start until every Device is cached "
        f"({leader.listing_cpu:.2f} s as leader, with its resync-all; an empty operator's start: "
        f"{empty.listing_cpu:.2f} s), {follower.idle_cpu_per_minute:.3f} CPU s per idle minute and "
        f"{follower.burst_cpu:.2f} CPU s on {burst:,} updates ({leader.burst_cpu:.2f} s as leader)"
    )
    scale = f" ({devices:,} Devices)"
    result(
        "follower",
        "RSS growth per cached object, follower vs the same operator leading" + scale,
        ours=[per_object(follower)],
        baseline=[per_object(leader)],
        unit="B",
        ratio="ours/baseline",
        target=("<=", 1.0),
    )
    result(
        "follower",
        "CPU seconds from the start until every Device is cached, follower vs leader (with "
        "its resync-all)" + scale,
        ours=[follower.listing_cpu],
        baseline=[leader.listing_cpu],
        unit="s",
        ratio="ours/baseline",
        target=("<=", 1.0),
        extra={"start of an empty operator, CPU s": empty.listing_cpu},
    )
    result(
        "follower",
        "CPU seconds per idle minute, follower vs leader" + scale,
        ours=[follower.idle_cpu_per_minute],
        baseline=[leader.idle_cpu_per_minute],
        unit="s",
        ratio="ours/baseline",
        target=None,
    )
    result(
        "follower",
        f"CPU seconds for a burst of {burst:,} updates, follower vs leader" + scale,
        ours=[follower.burst_cpu],
        baseline=[leader.burst_cpu],
        unit="s",
        ratio="ours/baseline",
        target=("<=", 1.0),
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=10000)
    parser.add_argument("--burst", type=int, default=1000)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    arguments = parser.parse_args()
    if not 0 < arguments.burst <= arguments.devices:
        parser.error(f"--burst updates existing Devices: 1 to --devices, got {arguments.burst}")
    asyncio.run(main(arguments.devices, arguments.burst, arguments.idle_seconds))
