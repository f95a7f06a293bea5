"""The example operator end to end: real ``kopf-reconcile run`` processes, a Kubernetes API
(embedded, and the real kube-apiserver for the single-replica story), real PostgreSQL."""

from __future__ import annotations

import json
import socket
from typing import Any

import aiohttp
import pytest
from operator_e2e import (
    RECONCILER_ID,
    Devices,
    Operator,
    Operators,
    Store,
    converged,
    kopf_traces,
)

from support import eventually

pytestmark = pytest.mark.slow


async def test_one_replica_reconciles_creates_updates_deletes_and_bad_specs(
    operators: Operators, devices: Devices, store: Store, embedded_postgres_dsn: str
) -> None:
    operator = await operators.start(
        env={
            "KOPF_RECONCILE_DATABASE_URL": embedded_postgres_dsn,
            "KOPF_RECONCILE_LEADER": "kubernetes",
            "POD_NAMESPACE": devices.namespace,
        }
    )
    await devices.create("lamp", "on")
    await devices.create("fan", "off")
    await devices.create("toaster", "explode")  # outside the vocabulary: PermanentError
    await eventually(lambda: converged(devices, store, ["lamp", "fan"]), timeout=30)
    lamp = await devices.get("lamp")
    assert lamp is not None and lamp["status"]["epoch"] >= 1  # fenced by a real lease epoch

    # The malformed Device is dead-lettered with a log line naming it; the operator goes on.
    line = await operator.printed("dead-lettered", f"'{devices.namespace}/toaster'")
    assert "spec.desired must be one of on, off, standby, got 'explode'" in line
    # ... with a Warning Event on the Device, and its dead letter kept in PostgreSQL.
    await eventually(lambda: _has_event(devices, "toaster", "Warning", "DeadLettered"), timeout=20)
    database = {"KOPF_RECONCILE_DATABASE_URL": embedded_postgres_dsn}

    async def dead_letter_listed() -> bool:
        _, output = await operators.command("dead-letters", "-n", devices.namespace, env=database)
        return f"{devices.namespace}/toaster" in output and "'explode'" in output

    await eventually(dead_letter_listed, timeout=20, message="`dead-letters` lists the Device")
    await devices.set("lamp", "standby")
    await devices.set("toaster", "on")  # the fix is a fresh trigger: no longer dead
    await eventually(lambda: converged(devices, store, ["lamp", "toaster"]), timeout=20)
    # The recovery is a Normal Event; the dead letter is cleared.
    await eventually(lambda: _has_event(devices, "toaster", "Normal", "Reconciled"), timeout=20)
    status, output = await operators.command("dead-letters", env=database)
    assert status == 0 and "no dead letters" in output, output

    # DELETED reaches the reconciler, and cached() is None there: it writes a tombstone.
    await devices.delete("fan")
    await eventually(lambda: _is_tombstone(store, "fan"), timeout=20)

    # The framework never wrote kopf's annotations or finalizers to a watched object.
    assert {d["metadata"]["name"]: kopf_traces(d) for d in await devices.all()} == {
        "lamp": [],
        "toaster": [],
    }
    status, body = await operator.get("/readyz")
    assert status == 200, body
    assert await operator.is_leader()

    # The CLI: migrate is idempotent next to a running operator; leases shows its Lease.
    status, output = await operators.command("migrate", f"--database-url={embedded_postgres_dsn}")
    assert status == 0, output
    assert "kopf_reconcile_fence" in output and "kopf_reconcile_lease" in output
    status, output = await operators.command(
        "leases",
        f"--kubeconfig={operators.kubeconfig}",
        f"--namespace={devices.namespace}",
        f"--database-url={embedded_postgres_dsn}",
    )
    assert status == 0, output
    kubernetes, postgres = output.split("PostgreSQL leases")
    row = next(line.split() for line in kubernetes.splitlines() if RECONCILER_ID in line)
    assert row[:2] == [devices.namespace, RECONCILER_ID]
    assert row[3] == str(lamp["status"]["epoch"])  # the epoch that wrote the status
    assert "(none)" in postgres  # the table exists (migrate) but Kubernetes Leases are in use
    assert await operator.stop() == 0
    assert not operator.lines("Traceback"), operator.text
    assert not operator.lines(RECONCILER_ID, "failed"), operator.text
    assert not operator.lines("does not cover lease"), operator.text  # the fence is installed

    # Stopping released the lease at once (a successor need not wait for it to expire).
    status, output = await operators.command(
        "leases", f"--kubeconfig={operators.kubeconfig}", f"--namespace={devices.namespace}"
    )
    assert status == 0, output
    assert "(released)" in next(line for line in output.splitlines() if RECONCILER_ID in line)


async def _has_event(devices: Devices, name: str, kind: str, reason: str) -> bool:
    async with devices.http.get(f"/api/v1/namespaces/{devices.namespace}/events") as response:
        items = (await response.json())["items"]
    return any(
        e["involvedObject"].get("name") == name
        and e["involvedObject"].get("kind") == "Device"
        and (e["type"], e["reason"]) == (kind, reason)
        for e in items
    )


async def _is_tombstone(store: Store, name: str) -> bool:
    return await store.state(name) == {"deleted": True}


@pytest.mark.parametrize("kube", ["embedded"], indirect=True)
@pytest.mark.parametrize("elector", ["kubernetes", "postgres"])
async def test_three_replicas_one_leader_and_failover_after_sigkill(
    operators: Operators, devices: Devices, store: Store, embedded_postgres_dsn: str, elector: str
) -> None:
    env = {
        "KOPF_RECONCILE_DATABASE_URL": embedded_postgres_dsn,
        "KOPF_RECONCILE_LEADER": elector,
        "POD_NAMESPACE": devices.namespace,
        "KOPF_RECONCILE_LEASE_TTL": "2",
        "KOPF_RECONCILE_RENEW_INTERVAL": "0.5",
    }
    replicas = [await operators.start(env=env, name=f"replica-{i}") for i in range(3)]
    first = [f"dev-{i}" for i in range(8)]
    for name in first:
        await devices.create(name, "on")
    await eventually(lambda: converged(devices, store, first), timeout=30)

    leaders = [r for r in replicas if await r.is_leader()]
    assert len(leaders) == 1, [r.name for r in leaders]
    leader = leaders[0]
    followers = [r for r in replicas if r is not leader]
    for follower in followers:  # warm standbys: watching, caching, not reconciling
        await eventually(lambda f=follower: _caches(f, len(first)), timeout=10)
        assert (await _report(follower))["leader"] is False
        assert await follower.reconciles() == 0
        await eventually(lambda f=follower: _ready(f), timeout=15)  # ready, though not leading
    epoch_before = (await devices.get("dev-0") or {})["status"]["epoch"]

    leader.kill()
    await leader.process.wait()
    more = [f"dev-{i}" for i in range(8, 12)]
    for name in more:
        await devices.create(name, "standby")
    for name in first[:4]:
        await devices.set(name, "off")
    await eventually(lambda: converged(devices, store, first + more), timeout=30)

    new_leaders = [f for f in followers if await f.is_leader()]
    assert len(new_leaders) == 1
    idle = next(f for f in followers if f is not new_leaders[0])
    assert await idle.reconciles() == 0
    device = await devices.get("dev-0")
    assert device is not None and device["status"]["epoch"] > epoch_before
    assert all(kopf_traces(d) == [] for d in await devices.all())

    # The new leader's lease, as `kopf-reconcile leases` shows it, carries that epoch.
    status, output = await operators.command(
        "leases",
        f"--kubeconfig={operators.kubeconfig}",
        f"--namespace={devices.namespace}",
        f"--database-url={embedded_postgres_dsn}",
    )
    assert status == 0, output
    section = output.split("PostgreSQL leases")[elector == "postgres"]
    rows = [line.split() for line in section.splitlines() if RECONCILER_ID in line]
    assert len(rows) == 1, output
    assert rows[0][3] == str(device["status"]["epoch"]), output


@pytest.mark.parametrize("kube", ["embedded"], indirect=True)
async def test_plain_kopf_run_is_single_process_mode(
    operators: Operators, devices: Devices
) -> None:
    liveness = f"http://127.0.0.1:{free_port()}/healthz"
    operator = await operators.start(f"--liveness={liveness}", command="kopf")
    await devices.create("lamp", "on")
    await eventually(lambda: converged(devices, None, ["lamp"]), timeout=30)
    lamp = await devices.get("lamp")
    assert lamp is not None and lamp["status"]["epoch"] == 0  # no lease: epoch 0, no fencing

    # The shim's probe in kopf's own liveness endpoint.
    async with aiohttp.ClientSession() as http, http.get(liveness) as response:
        assert response.status == 200
        probe = (await response.json())[f"kopf-reconcile/{RECONCILER_ID}"]
    assert probe["leader"] is True
    assert probe["epoch"] == 0
    assert probe["cached_objects"] == 1
    await devices.delete("lamp")
    await operator.printed("single-process (always leader, epoch 0)")
    assert await operator.stop() == 0
    assert not operator.lines("Traceback"), operator.text
    assert not operator.lines("[ERROR"), operator.text
    # kopf's per-event INFO line for the shim's handler is quieted.
    assert not operator.lines("Handler 'kopf-reconcile/"), operator.text
    assert kopf_traces(lamp) == []


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def _caches(operator: Operator, objects: int) -> bool:
    return bool((await _report(operator))["cached_objects"] == objects)


async def _report(operator: Operator) -> dict[str, Any]:
    status, text = await operator.get("/healthz")
    assert status == 200, text
    report: dict[str, Any] = json.loads(text)["reconcilers"][RECONCILER_ID]
    return report


async def _ready(operator: Any) -> bool:
    return bool((await operator.get("/readyz"))[0] == 200)
