"""``kopf-reconcile run`` as a process: with ``KOPF_RECONCILE_METRICS_AUTH=kubernetes`` (as the
chart runs it) ``/metrics`` refuses a scrape without a token and serves one the API server
allows, and ``/healthz`` shows its report to that token only; a replica that cannot reach
its database is not ready; a leader whose watch stays broken stands aside."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from operator_e2e import Operators

from support import eventually

pytestmark = pytest.mark.slow


async def test_metrics_need_a_token_the_api_server_allows(
    kube: Any, operators: Operators, devices_crd: None
) -> None:
    operator = await operators.start(env={"KOPF_RECONCILE_METRICS_AUTH": "kubernetes"})
    url = await operator.endpoints()
    reader = {"Authorization": f"Bearer {kube.admin_token}"}
    stranger = {"Authorization": f"Bearer {kube.unprivileged_token}"}
    async with aiohttp.ClientSession() as http:

        async def status(path: str, headers: dict[str, str]) -> int:
            async with http.get(url + path, headers=headers) as response:
                return response.status

        async def ready() -> bool:
            return await status("/readyz", {}) == 200

        await eventually(ready, timeout=30, message="ready")
        assert await status("/metrics", {}) == 401
        assert await status("/metrics", stranger) == 403
        assert await status("/metrics", reader) == 200
        async with http.get(url + "/healthz") as response:
            assert await response.json() == {"status": "ok"}
        async with http.get(url + "/healthz", headers=reader) as response:
            assert (await response.json())["reconcilers"]
    assert await operator.stop() == 0


@pytest.mark.parametrize("kube", ["embedded"], indirect=True)
async def test_a_leader_whose_watch_stays_broken_stands_aside_and_leads_again_alone(
    kube: Any, operators: Operators, devices_crd: None, embedded_postgres_dsn: str
) -> None:
    """The only candidate: it steps down after one TTL of a failing watch, waits a TTL and a
    renew interval, then leads again (a new term) as nobody else took the lease."""
    operator = await operators.start(
        env={
            "KOPF_RECONCILE_DATABASE_URL": embedded_postgres_dsn,
            "KOPF_RECONCILE_LEADER": "postgres",
            "KOPF_RECONCILE_LEASE_TTL": "3",
            "KOPF_RECONCILE_RENEW_INTERVAL": "1",
        }
    )
    first = await operator.printed(" leads ", "(epoch ")
    devices = rf"/apis/example\.com/v1/namespaces/{operators.namespace}/devices"
    kube.inject_fault("GET", devices, status=500, times=None)
    try:
        await operator.printed("standing aside for 4s", timeout=60)
        await operator.printed(" steps down from ", "the watch stayed broken for 3s")
        await eventually(
            lambda: len(operator.lines(" leads ", "(epoch ")) == 2,
            timeout=30,
            message="leading again after the hold-off",
        )
        assert operator.lines(" leads ", "(epoch ")[1] != first
        assert len(operator.lines("standing aside")) == 1  # not again while still broken
    finally:
        kube.clear_faults()
    assert await operator.stop() == 0


@pytest.mark.parametrize("kube", ["embedded"], indirect=True)
async def test_a_replica_that_cannot_reach_its_database_is_not_ready(
    operators: Operators, devices_crd: None
) -> None:
    password = "unreachable-s3cret"
    operator = await operators.start(
        env={
            # Nothing listens on port 1: the database cannot be reached, as after a network cut.
            "KOPF_RECONCILE_DATABASE_URL": f"postgresql://app:{password}@127.0.0.1:1/app",
            "KOPF_RECONCILE_LEADER": "postgres",
        }
    )
    url = await operator.endpoints()
    async with aiohttp.ClientSession() as http:

        async def names_the_database() -> bool:
            async with http.get(url + "/readyz") as response:
                body = await response.json()
            return response.status == 503 and "PostgreSQL at" in str(body.get("reason"))

        await eventually(names_the_database, timeout=30, message="/readyz naming the database")
        async with http.get(url + "/readyz") as response:
            reason = (await response.json())["reason"]
    assert "postgresql://app:***@127.0.0.1:1/app cannot be reached" in reason
    assert password not in operator.text + reason
    assert await operator.stop() == 0
