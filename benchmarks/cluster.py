"""The embedded Kubernetes API under 100,000 requests: latency must stay flat.

One process, one event loop, one core: the client (aiohttp) and the server share it, so
the numbers are a lower bound for the server alone. The workload is what a leader elector
and an operator do: read a Lease, renew it (merge PATCH), replace it (PUT with its
resourceVersion), list a namespace's Leases, with a watch streaming every change.

Printed: latency percentiles of the first and the last 1,000 requests (``last/first``
should stay near 1, but wall-clock percentiles move with the machine's load), the CPU time
per request of each tenth of the run (steadier under load; the first tenth is cheaper
because the change-history window is still filling), the throughput against a bare aiohttp
handler answering a fixed JSON document through the same client in the same run (the HTTP
floor), and the sizes of the cluster's internal structures, which must not grow.

    python benchmarks/cluster.py [--requests N] [--window W]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import time
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from kopf_reconcile.testing.emulated_apiserver import EmbeddedCluster
from results import result

LEASES = "/apis/coordination.k8s.io/v1/namespaces/default/leases"
MERGE = {"Content-Type": "application/merge-patch+json"}

Request = Callable[[aiohttp.ClientSession, int], Awaitable[None]]


def percentiles(samples: list[float]) -> tuple[float, float]:
    """p50 and p99 in milliseconds."""
    cuts = statistics.quantiles(samples, n=100)
    return cuts[49] * 1000, cuts[98] * 1000


async def timed(session: aiohttp.ClientSession, requests: int, request: Request) -> list[float]:
    """Wall-clock latency of each request, sent one after the other."""
    latencies = []
    for index in range(requests):
        started = time.perf_counter()
        await request(session, index)
        latencies.append(time.perf_counter() - started)
    return latencies


async def cpu_per_request(
    session: aiohttp.ClientSession, requests: int, request: Request, first: int
) -> float:
    """CPU seconds this process spends per request (client and server): unlike wall-clock
    latency, it does not move when other processes compete for the cores."""
    started = time.process_time()
    for index in range(first, first + requests):
        await request(session, index)
    return (time.process_time() - started) / requests


async def bare_baseline(requests: int) -> float:
    """Requests/s of a bare aiohttp handler answering a fixed JSON body."""
    body = json.dumps({"kind": "Lease", "metadata": {"name": "x", "resourceVersion": "1"}}).encode()

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]

    async def get(session: aiohttp.ClientSession, index: int) -> None:
        async with session.get(f"{LEASES}/bench") as response:
            await response.read()

    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as session:
            started = time.perf_counter()
            await timed(session, requests, get)
            return requests / (time.perf_counter() - started)
    finally:
        await runner.cleanup()


async def elector_like(session: aiohttp.ClientSession, index: int) -> None:
    """Read, renew, replace, list: the requests a lease holder and an operator make."""
    step = index % 4
    url = f"{LEASES}/bench"
    if step == 0:
        async with session.get(url) as response:
            await response.read()
    elif step == 1:
        renew = {"spec": {"renewTime": f"2024-01-01T00:00:{index % 60:02d}.{index % 10**6:06d}Z"}}
        async with session.patch(url, json=renew, headers=MERGE) as response:
            await response.read()
    elif step == 2:
        async with session.get(url) as response:
            current = await response.json()
        current["spec"]["leaseTransitions"] = index
        async with session.put(url, json=current) as response:
            await response.read()
    else:
        async with session.get(LEASES) as response:
            await response.read()


async def watch_everything(session: aiohttp.ClientSession, seen: list[int]) -> None:
    params = {"watch": "true", "resourceVersion": "0", "allowWatchBookmarks": "true"}
    async with session.get(LEASES, params=params, timeout=aiohttp.ClientTimeout()) as response:
        async for _ in response.content:
            seen[0] += 1


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def main(requests: int, window: int) -> None:
    baseline = await bare_baseline(min(requests, 20_000))
    async with EmbeddedCluster() as cluster, cluster.http_session() as session:
        lease = {"metadata": {"name": "bench"}, "spec": {"holderIdentity": "bench"}}
        async with session.post(LEASES, json=lease) as response:
            assert response.status == 201, await response.text()
        for index in range(20):  # a realistic list size
            await session.post(LEASES, json={"metadata": {"name": f"other-{index}"}})
        seen = [0]
        watching = asyncio.create_task(watch_everything(session, seen))

        early = await timed(session, window, elector_like)
        sizes_early = cluster.sizes()
        rss_early = rss_mib()
        tenth = (requests - 2 * window) // 10
        cpu: list[float] = []
        started = time.perf_counter()
        for part in range(10):
            cpu.append(await cpu_per_request(session, tenth, elector_like, part * tenth))
        middle_rate = 10 * tenth / (time.perf_counter() - started)
        late = await timed(session, window, elector_like)
        sizes_late = cluster.sizes()
        rss_late = rss_mib()
        watching.cancel()

    early_p50, early_p99 = percentiles(early)
    late_p50, late_p99 = percentiles(late)
    print(f"requests: {requests:,} (sequential, one loop for client and server)")
    print(f"latency first {window:,}: p50 {early_p50:.3f} ms  p99 {early_p99:.3f} ms")
    print(f"latency last  {window:,}: p50 {late_p50:.3f} ms  p99 {late_p99:.3f} ms")
    flat_p50, flat_p99 = late_p50 / early_p50, late_p99 / early_p99
    print(f"flatness (last/first):    p50 {flat_p50:.2f}x  p99 {flat_p99:.2f}x")
    print("CPU per request, each tenth of the run (us): " + " ".join(f"{c * 1e6:.0f}" for c in cpu))
    print(f"CPU flatness (last tenth/first tenth): {cpu[-1] / cpu[0]:.2f}x")
    print(f"throughput: {middle_rate:,.0f} requests/s (target >= 1,000)")
    print(f"bare aiohttp handler, same client: {baseline:,.0f} requests/s")
    print(f"ratio cluster/bare: {middle_rate / baseline:.2f}x")
    print(f"watch events streamed: {seen[0]:,}")
    print(f"internal sizes after {window:,}: {sizes_early}")
    print(f"internal sizes after {requests:,}: {sizes_late}")
    print(f"max RSS: {rss_early:.1f} MiB -> {rss_late:.1f} MiB")
    result(
        "cluster",
        "embedded API server requests/s (the test harness) vs a bare aiohttp handler",
        ours=[middle_rate],
        baseline=[baseline],
        unit="/s",
        ratio="ours/baseline",
        target=(">=", 1000),
        target_applies_to="ours_median",
        extra={"p50 latency flatness (last/first)": flat_p50},
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--window", type=int, default=1_000)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.requests, arguments.window))
