"""The cost of the API server's fence: fenced API writes against plain ones, on the real tier.

One kube-apiserver v1.37 (the real tier: ``make real-apiserver`` builds it), one Lease held by
a ``KubernetesLeaseElector``, one ConfigMap that every write patches (a merge patch of one
key), the same client code (``FencedClient``) for every contender, in the same run:

* baseline: no fence policy installed, writes without the lease's extras (what
  ``KOPF_RECONCILE_API_FENCE=off`` sends);
* fenced: the policy and its binding installed (``integration/fence_policy.py``), every write
  impersonating the client's own identity with the Lease, holder and epoch as user extras,
  checked by the policy against the Lease (every write is admitted: a refused one would not
  be the same work, and aborts the run);
* bystander: the policy installed, writes without extras (everyone else's writes to the
  cluster: the policy's match condition skips them);
* impersonation alone: the extras sent, no policy installed (what the impersonation costs
  the API server by itself: it authorizes each impersonated attribute).

Figures: writes per second with ``--concurrency`` in flight, and the median latency of one
write at a time. Rounds alternate between the contenders, the median and range are
reported. The API server runs on the same machine as the client: on a shared 2-core VM the
rates vary between rounds; compare the ratios.

Run: ``.venv/bin/python benchmarks/api_fence.py [--writes N] [--rounds R]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import kopf_reconcile as kr
from kopf_reconcile.fencing.writer import ReconcileLease
from kopf_reconcile.integration import fence_policy
from kopf_reconcile.integration.api_client import LazyApiClient
from kopf_reconcile.integration.fence_lease import LeaseFence
from kopf_reconcile.integration.fenced_client import ClientContext, FencedClient
from kopf_reconcile.testing.real_apiserver import RealCluster
from results import result

NAMESPACE = "bench"
CONFIGMAPS = kr.Resource("", "v1", "configmaps")
ADMISSION = "/apis/admissionregistration.k8s.io/v1"
BASELINE, FENCED, BYSTANDER, IMPERSONATED = (
    "no policy, no extras",
    "fenced",
    "policy, no extras",
    "extras, no policy",
)


async def rate(client: FencedClient, writes: int, concurrency: int) -> float:
    """Writes per second with ``concurrency`` in flight."""
    queue = iter(range(writes))

    async def worker() -> None:
        for n in queue:
            await client.patch(CONFIGMAPS, "target", {"data": {"n": str(n)}}, namespace=NAMESPACE)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return writes / (time.perf_counter() - started)


async def latency(client: FencedClient, writes: int) -> float:
    """The median seconds of one write at a time."""
    times = []
    for n in range(writes):
        started = time.perf_counter()
        await client.patch(CONFIGMAPS, "target", {"data": {"n": str(n)}}, namespace=NAMESPACE)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def main(writes: int, rounds: int, concurrency: int) -> None:
    async with RealCluster() as cluster, cluster.http_session() as http:
        body = {"metadata": {"name": NAMESPACE}}
        async with http.post("/api/v1/namespaces", json=body) as response:
            assert response.status == 201, await response.text()
        async with cluster.api_client() as api:
            elector = kr.KubernetesLeaseElector(NAMESPACE, api=api, holder_id="bench")
            token = await elector.acquire_lease("bench")
            lazy = LazyApiClient(api)

            async def namespace() -> str:
                return NAMESPACE

            lease = ReconcileLease(
                token.epoch, lambda epoch: True, lease_id="bench", holder=token.holder_id
            )
            plain = FencedClient(ClientContext(lazy, field_manager="bench"), lease)
            fence = LeaseFence(lazy, namespace)
            fenced = FencedClient(ClientContext(lazy, field_manager="bench", fence=fence), lease)
            await plain.create(CONFIGMAPS, {"metadata": {"name": "target", "namespace": NAMESPACE}})

            async def install(installed: bool) -> None:
                name = "bench-fence"
                kinds = (
                    ("validatingadmissionpolicies", fence_policy.policy(name)),
                    (
                        "validatingadmissionpolicybindings",
                        fence_policy.binding(name, name, NAMESPACE),
                    ),
                )
                for kind, manifest in kinds if installed else reversed(kinds):
                    if installed:
                        async with http.post(f"{ADMISSION}/{kind}", json=manifest) as response:
                            assert response.status == 201, await response.text()
                    else:
                        async with http.delete(f"{ADMISSION}/{kind}/{name}") as response:
                            assert response.status == 200, await response.text()
                # The API server loads policies from an informer: write until it enforces.
                probe = FencedClient(
                    ClientContext(lazy, field_manager="bench", fence=fence),
                    ReconcileLease(
                        token.epoch + 7, lambda epoch: True, lease_id="bench", holder="x"
                    ),
                )
                for _ in range(500):
                    try:
                        await probe.patch(
                            CONFIGMAPS, "target", {"data": {"p": "1"}}, namespace=NAMESPACE
                        )
                    except kr.StaleEpochError:
                        if installed:
                            return
                    else:
                        if not installed:
                            return
                    await asyncio.sleep(0.02)
                raise RuntimeError("the API server did not pick the policy change up")

            contenders: list[tuple[str, bool, FencedClient]] = [
                (BASELINE, False, plain),
                (IMPERSONATED, False, fenced),
                (FENCED, True, fenced),
                (BYSTANDER, True, plain),
            ]
            rates: dict[str, list[float]] = {name: [] for name, _, _ in contenders}
            latencies: dict[str, list[float]] = {name: [] for name, _, _ in contenders}
            installed = False
            await rate(fenced, writes // 4, concurrency)  # warm-up: connections, identity
            for round_ in range(rounds):
                order = contenders if round_ % 2 == 0 else contenders[::-1]
                for name, needs_policy, client in order:
                    if needs_policy != installed:
                        await install(needs_policy)
                        installed = needs_policy
                    rates[name].append(await rate(client, writes, concurrency))
                    latencies[name].append(await latency(client, writes // 4))
                    print(
                        f"round {round_ + 1} {name}: {rates[name][-1]:,.0f} writes/s, "
                        f"{latencies[name][-1] * 1000:.2f} ms each",
                        flush=True,
                    )
            await elector.close()
    report(rates, latencies, concurrency)


def report(
    rates: dict[str, list[float]], latencies: dict[str, list[float]], concurrency: int
) -> None:
    whats = {
        FENCED: "fenced writes",
        BYSTANDER: "others' writes with the policy installed",
        IMPERSONATED: "writes with the extras and no policy (impersonation alone)",
    }
    for name, what in whats.items():
        result(
            "api_fence",
            f"API writes/s ({concurrency} in flight), {what} vs no policy (real kube-apiserver)",
            ours=rates[name],
            baseline=rates[BASELINE],
            unit="/s",
            ratio="ours/baseline",
            target={FENCED: (">=", 0.8), BYSTANDER: (">=", 0.9)}.get(name),
        )
        result(
            "api_fence",
            f"API write latency (one at a time), {what} vs no policy (real kube-apiserver)",
            ours=[x * 1000 for x in latencies[name]],
            baseline=[x * 1000 for x in latencies[BASELINE]],
            unit="ms",
            ratio="ours/baseline",
            target={FENCED: ("<=", 1.25), BYSTANDER: ("<=", 1.1)}.get(name),
        )


def _run(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writes", type=int, default=800, help="writes per round and contender")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args(argv)
    asyncio.run(main(args.writes, args.rounds, args.concurrency))


if __name__ == "__main__":
    _run()
