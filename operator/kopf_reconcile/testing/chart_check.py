"""The Helm chart's test: a live leader holds every reconciler's Lease.

``helm test`` runs this module in a pod of the operator's own image
(``python -m kopf_reconcile.testing.chart_check``). A release is healthy when,
for every reconciler its pods run, the reconciler's Lease

* is held (a holder identity is set),
* has not expired (renewed within its duration, judged with a small allowance
  for clock skew between the node that renewed it and this one),
* and is held by one of the release's running pods: holder identities are the
  pod name plus a random suffix, so a Lease still naming a deleted pod is a
  stale one, not a leader.

Which reconcilers run comes from the pods themselves: each answers
``/healthz`` with a report keyed by reconciler id, which is also the Lease's
name. Pods are reached on their own IPs, so the check needs neither DNS nor
Service routing. It retries until every condition holds or the timeout
passes; the exit status says which, and the last line says why.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

__all__ = ["Verdict", "judge", "main"]

#: How far the clocks of the renewing node and of this pod may disagree.
CLOCK_SKEW_SECONDS = 5.0
RETRY_SECONDS = 2.0


@dataclass(frozen=True)
class Verdict:
    """Whether the release is healthy, and what was found (one line per reconciler)."""

    healthy: bool
    lines: tuple[str, ...]


SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def _parse_time(text: str | None) -> datetime.datetime | None:
    if not text:
        return None
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


def judge(
    pods: Sequence[str],
    reconcilers: Sequence[str],
    leases: dict[str, dict[str, Any] | None],
    now: datetime.datetime,
) -> Verdict:
    """The verdict on ``leases`` (by reconciler id; ``None``: no such Lease) for ``pods``."""
    if not pods:
        return Verdict(False, ("no running pod of the release answered /healthz",))
    if not reconcilers:
        return Verdict(False, ("the release's pods report no reconciler",))
    lines, healthy = [], True
    for rid in sorted(reconcilers):
        lease = leases.get(rid)
        spec = (lease or {}).get("spec") or {}
        holder = str(spec.get("holderIdentity") or "")
        renewed = _parse_time(spec.get("renewTime"))
        duration = float(spec.get("leaseDurationSeconds") or 0)
        problem = None
        if lease is None:
            problem = "no Lease"
        elif not holder:
            problem = "no holder"
        elif renewed is None or (now - renewed).total_seconds() > duration + CLOCK_SKEW_SECONDS:
            problem = f"expired (renewed {renewed}, duration {duration:.0f} s)"
        elif not any(holder.startswith(f"{pod}-") for pod in pods):
            problem = f"held by {holder!r}, which is none of the running pods"
        epoch = spec.get("leaseTransitions", 0)
        if problem is None:
            lines.append(f"ok   {rid}: held by {holder} at epoch {epoch}")
        else:
            healthy = False
            lines.append(f"FAIL {rid}: {problem}")
    return Verdict(healthy, tuple(lines))


async def _api_get(
    session: aiohttp.ClientSession, path: str, **params: str
) -> dict[str, Any] | None:
    async with session.get(path, params=params) as response:
        if response.status == 404:
            return None
        response.raise_for_status()
        document: dict[str, Any] = await response.json()
        return document


def _in_cluster_session() -> aiohttp.ClientSession:
    """An API session with the pod's ServiceAccount token, verifying the cluster's CA."""
    import os
    import ssl

    secrets = SERVICE_ACCOUNT
    host = os.environ["KUBERNETES_SERVICE_HOST"]
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if ":" in host:
        host = f"[{host}]"
    tls = ssl.create_default_context(cafile=f"{secrets}/ca.crt")
    return aiohttp.ClientSession(
        base_url=f"https://{host}:{port}",
        headers={"Authorization": f"Bearer {_token()}"},
        connector=aiohttp.TCPConnector(ssl=tls),
        timeout=aiohttp.ClientTimeout(total=10),
    )


def _token() -> str:
    with open(f"{SERVICE_ACCOUNT}/token", encoding="ascii") as file:
        return file.read().strip()


def _pods_session(ca_file: str | None) -> aiohttp.ClientSession:
    """A session to the pods' ``/healthz``: with this pod's token, which the chart lets read
    the reports when the metrics are authenticated, and over TLS when ``ca_file`` is given
    (the certificate names the Service, not the pod IPs asked here: its CA is what counts)."""
    connector = None
    if ca_file is not None:
        import ssl

        tls = ssl.create_default_context(cafile=ca_file)
        tls.check_hostname = False
        connector = aiohttp.TCPConnector(ssl=tls)
    return aiohttp.ClientSession(
        headers={"Authorization": f"Bearer {_token()}"},
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=5),
    )


async def _observe(
    api: aiohttp.ClientSession, namespace: str, selector: str, port: int, ca_file: str | None
) -> Verdict:
    pods = await _api_get(api, f"/api/v1/namespaces/{namespace}/pods", labelSelector=selector)
    running: list[str] = []
    reconcilers: set[str] = set()
    scheme = "http" if ca_file is None else "https"
    async with _pods_session(ca_file) as plain:
        for pod in (pods or {}).get("items") or []:
            ip = (pod.get("status") or {}).get("podIP")
            if not ip or (pod.get("status") or {}).get("phase") != "Running":
                continue
            if pod["metadata"].get("deletionTimestamp"):
                continue  # leaving: it may still hold a lease it is about to release
            try:
                async with plain.get(f"{scheme}://{ip}:{port}/healthz") as response:
                    report = await response.json()
            except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError):
                continue
            running.append(pod["metadata"]["name"])
            reconcilers.update((report.get("reconcilers") or {}).keys())
    leases = {
        rid: await _api_get(
            api, f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{rid}"
        )
        for rid in reconcilers
    }
    return judge(running, sorted(reconcilers), leases, datetime.datetime.now(datetime.UTC))


async def check(
    namespace: str, selector: str, port: int, timeout: float, ca_file: str | None = None
) -> Verdict:
    """Observe until healthy or ``timeout`` seconds have passed; the last verdict."""
    deadline = time.monotonic() + timeout
    async with _in_cluster_session() as api:
        while True:
            try:
                verdict = await _observe(api, namespace, selector, port, ca_file)
            except (aiohttp.ClientError, TimeoutError) as exc:
                verdict = Verdict(False, (f"the API answered: {exc}",))
            if verdict.healthy or time.monotonic() > deadline:
                return verdict
            await asyncio.sleep(RETRY_SECONDS)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kopf_reconcile.testing.chart_check")
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--selector", required=True, help="label selector of the operator pods")
    parser.add_argument("--port", type=int, default=8080, help="the pods' /healthz port")
    parser.add_argument("--timeout", type=float, default=90.0)
    parser.add_argument("--ca-file", help="the CA of the pods' certificate: ask over HTTPS")
    args = parser.parse_args(argv)
    verdict = asyncio.run(
        check(args.namespace, args.selector, args.port, args.timeout, args.ca_file)
    )
    for line in verdict.lines:
        print(line, flush=True)
    if verdict.healthy:
        print("every reconciler's lease is held by a live leader")
        return 0
    print("not every reconciler's lease is held by a live leader", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
