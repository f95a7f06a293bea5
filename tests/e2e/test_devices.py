"""The example operator end to end: real ``kopf-reconcile run`` processes, a Kubernetes API
(embedded, and the real kube-apiserver for the single-replica story), real PostgreSQL."""

from __future__ import annotations

import pytest
from operator_e2e import RECONCILER_ID, Devices, Operators, Store, converged, kopf_traces

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
    await devices.set("lamp", "standby")
    await devices.set("toaster", "on")  # the fix is a fresh trigger: no longer dead
    await eventually(lambda: converged(devices, store, ["lamp", "toaster"]), timeout=20)

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
    assert await operator.stop() == 0
    assert not operator.lines("Traceback"), operator.text
    assert not operator.lines(RECONCILER_ID, "failed"), operator.text


async def _is_tombstone(store: Store, name: str) -> bool:
    return await store.state(name) == {"deleted": True}
