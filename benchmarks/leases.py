"""Leases at scale: Lease API requests per minute with 1, 10 and 50 reconcilers in one process.

Each reconciler is a Loop with its own Kubernetes Lease (``KubernetesLeaseElector``, the
default TTL of 15 s and the default renew interval of 2 s), all in one process against the
embedded cluster, which counts the requests it serves. Once every Loop leads, requests
are counted for ``--seconds``. The baseline is client-go's leader election at its defaults
(a renewal every RetryPeriod, 2 s: 30 Lease writes per minute per lease). No target is set
(issue 16 asks for the figures). A final ``RESULT`` line per size is read by
``scripts/bench.py``.

    python benchmarks/leases.py [--seconds S] [--sizes 1,10,50]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

import kopf_reconcile as kr
from kopf_reconcile.testing.emulated_apiserver import EmbeddedCluster
from results import result

CLIENT_GO_WRITES_PER_MINUTE = 60 / 2  # one renewal (a PUT) every RetryPeriod of 2 s


async def measure(size: int, seconds: float) -> dict[str, int]:
    verbs: collections.Counter[str] = collections.Counter()

    @web.middleware
    async def count(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if "/leases" in request.path:
            verbs["WATCH" if request.query.get("watch") in ("true", "1") else request.method] += 1
        return await handler(request)

    async def noop(req: kr.Request) -> None:
        return None

    cluster = EmbeddedCluster()
    cluster.server.app.middlewares.append(count)
    async with cluster:
        api = cluster.api_client()
        loops = [
            kr.Builder(noop, kr.Tenancy.SINGLE_TENANT)
            .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
            .with_leader(kr.KubernetesLeaseElector(namespace="default", api=api))
            .with_reconciler_id(f"bench-{i}")
            .build()
            for i in range(size)
        ]
        for loop in loops:
            await loop.start()
        try:
            deadline = time.monotonic() + 60
            while not all(loop.stats().is_leader for loop in loops):
                if time.monotonic() > deadline:
                    raise TimeoutError("not every Loop leads after 60 s")
                await asyncio.sleep(0.1)
            verbs.clear()
            await asyncio.sleep(seconds)
            counted = dict(verbs)
        finally:
            for loop in loops:
                await loop.stop()
            await api.close()
    return counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--sizes", default="1,10,50")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(
        f"leases: Lease requests per minute, {args.seconds:g} s counted once every Loop leads; "
        f"default TTL and renew interval; baseline: client-go, "
        f"{CLIENT_GO_WRITES_PER_MINUTE:g} writes/min per lease"
    )
    print(f"{'reconcilers':>11}  {'writes/min':>10}  {'per lease':>9}  {'all/min':>8}  by verb")
    for size in sizes:
        counted = asyncio.run(measure(size, args.seconds))
        per_minute = 60 / args.seconds
        writes = sum(n for verb, n in counted.items() if verb in ("POST", "PUT", "PATCH"))
        total = sum(counted.values())
        print(
            f"{size:>11}  {writes * per_minute:>10.0f}  {writes * per_minute / size:>9.1f}  "
            f"{total * per_minute:>8.0f}  {counted}"
        )
        result(
            "leases",
            f"Lease writes per minute per lease, {size} reconciler(s) in one process, "
            "vs client-go at its defaults",
            ours=[writes * per_minute / size],
            baseline=[CLIENT_GO_WRITES_PER_MINUTE],
            unit="/min",
            ratio="ours/baseline",
            target=None,
            extra={"all Lease requests per minute": total * per_minute},
        )


if __name__ == "__main__":
    main()
