"""What an operator says about its leases, on the embedded cluster and a real kube-apiserver:
API errors with their status, reason and message, refusals that retrying cannot fix
counted apart, a missing lease namespace caught at startup, and Lease fields escaped
before they reach a terminal.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

import kopf_reconcile as kr
from kopf_reconcile.leader.kubernetes import MANAGED_BY, MANAGED_BY_LABEL, KubernetesLeaseElector
from support import eventually

BIN = Path(sys.executable).parent


async def test_a_missing_namespace_is_logged_with_its_status_and_counted_as_permanent(
    kube: Any, api: Any, caplog: pytest.LogCaptureFixture
) -> None:
    missing = f"missing-{secrets.token_hex(4)}"
    registry = CollectorRegistry()
    elector = KubernetesLeaseElector(namespace=missing, ttl=3, api=api)
    loop = (
        kr.Builder(lambda req: None, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_leader(elector)
        .with_reconciler_id("devices")
        .with_renew_interval(0.2)
        .with_metrics(kr.register_metrics(registry))
        .build()
    )

    def permanent_errors() -> float:
        labels = {"controller": loop.reconciler_id, "shard": ""}
        value = registry.get_sample_value("kopf_reconcile_lease_permanent_errors_total", labels)
        return value or 0

    expected = f'404 Not Found (NotFound): namespaces "{missing}" not found'
    caplog.set_level(logging.WARNING, logger="kopf_reconcile.leader")
    async with loop:
        await eventually(lambda: permanent_errors() >= 2, timeout=10)
        assert not loop.stats().is_leader
    lines = [r.getMessage() for r in caplog.records if "acquiring lease devices" in r.getMessage()]
    assert lines, caplog.text
    assert all(expected in line for line in lines), lines
    assert all("retrying cannot help" in line for line in lines), lines
    errors = registry.get_sample_value(
        "kopf_reconcile_lease_errors_total", {"controller": loop.reconciler_id, "shard": ""}
    )
    assert errors is not None and errors >= permanent_errors()


async def test_the_lease_namespace_is_checked_at_startup(
    kube: Any, api: Any, kube_namespace: str
) -> None:
    missing = KubernetesLeaseElector(namespace=f"missing-{secrets.token_hex(4)}", api=api)
    with pytest.raises(kr.ConfigError, match=r"^POD_NAMESPACE names namespace 'missing-.*'"):
        await missing.check_namespace("POD_NAMESPACE")
    present = KubernetesLeaseElector(namespace=kube_namespace, api=api)
    await present.check_namespace("POD_NAMESPACE")  # nothing stored: a dry run
    async with kube.http_session() as http:
        path = f"/apis/coordination.k8s.io/v1/namespaces/{kube_namespace}/leases"
        async with http.get(path) as response:
            assert (await response.json())["items"] == []


@pytest.mark.skipif(not (BIN / "kopf-reconcile").exists(), reason="the package's script")
async def test_leases_escapes_what_a_lease_holder_wrote(kube: Any, kube_namespace: str) -> None:
    hostile = "evil\x1b]0;owned\x07\x1b[2J\rreplica\u202e-0"
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "devices", "labels": {MANAGED_BY_LABEL: MANAGED_BY}},
        "spec": {"holderIdentity": hostile, "leaseDurationSeconds": 15, "leaseTransitions": 3},
    }
    async with kube.http_session() as http:
        path = f"/apis/coordination.k8s.io/v1/namespaces/{kube_namespace}/leases"
        async with http.post(path, json=lease) as response:
            assert response.status == 201, await response.text()
            assert (await response.json())["spec"]["holderIdentity"] == hostile
    environment = {
        k: v for k, v in os.environ.items() if not k.startswith(("KOPF_RECONCILE_", "POD_"))
    }
    result = await asyncio.to_thread(
        subprocess.run,
        [str(BIN / "kopf-reconcile"), "leases", f"--kubeconfig={kube.kubeconfig}",
         "-n", kube_namespace],
        capture_output=True, text=True, timeout=60, env=environment, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout and "\r" not in result.stdout
    assert "\x07" not in result.stdout and "\u202e" not in result.stdout
    assert "evil^[]0;owned\\x07^[[2J\\rreplica\\u202e-0" in result.stdout
