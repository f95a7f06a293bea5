"""Shutdown of a kopf operator with several reconcilers: every Loop stops at once.

kopf calls cleanup handlers one after another. Were each reconciler's Loop stopped by
its own handler only, N reconcilers with work in flight would take N stop timeouts,
past a pod's grace period. The embedded cluster runs as a process of its own (see
test_kopf_shim.py for why).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import kopf
import pytest_asyncio

import kopf_reconcile as kr
from kopf_reconcile.integration import kopf_shim
from kopf_reconcile.integration import settings as process_settings
from kopf_reconcile.integration.settings import Settings
from kopf_reconcile.testing.memory import MemoryLeaseElector, MemoryLeaseStore
from support import eventually


@pytest_asyncio.fixture
async def long_stop_timeout() -> AsyncIterator[None]:
    """In-flight reconciles may take a minute to finish: far longer than the test waits."""
    process_settings.install(Settings.load({"KOPF_RECONCILE_STOP_TIMEOUT": "60"}))
    yield
    process_settings.install(None)


async def operator_with_a_held_configmap(
    cluster_url: str, registry: kopf.OperatorRegistry, stop: asyncio.Event
) -> asyncio.Task[None]:
    """The ConfigMap ``default/held`` created, then the operator of ``registry`` started."""
    async with aiohttp.ClientSession(base_url=cluster_url) as http:
        body = {"metadata": {"name": "held"}}
        async with http.post("/api/v1/namespaces/default/configmaps", json=body) as response:
            assert response.status == 201, await response.text()
    return asyncio.create_task(
        kopf.operator(registry=registry, namespaces=["default"], stop_flag=stop)
    )


async def test_cleanup_stops_every_loop_at_once(cluster_url: str, long_stop_timeout: None) -> None:
    registry = kopf.OperatorRegistry()
    leases = MemoryLeaseStore()
    holding: set[str] = set()
    release = asyncio.Event()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=cluster_url)

    def holds(reconciler_id: str) -> Any:
        """A reconciler whose reconcile of ``held`` runs until the test releases it."""

        async def reconcile(req: kr.Request) -> None:
            if req.entity_id == "default/held":
                holding.add(reconciler_id)
                await release.wait()

        return kr.reconciler(
            "", "v1", "configmaps",
            tenancy=kr.Tenancy.TENANT_SCOPED,
            name=reconciler_id,
            reconciler_id=reconciler_id,
            leader=lambda: MemoryLeaseElector(leases),
            fenced=None,
            metrics=None,
            registry=registry,
        )(reconcile)  # fmt: skip

    holds("drain-first")
    holds("drain-second")
    stop = asyncio.Event()
    operator = await operator_with_a_held_configmap(cluster_url, registry, stop)
    try:
        await eventually(lambda: holding == {"drain-first", "drain-second"}, timeout=20)
        stop.set()
        # Both Loops are stopping (draining their reconcile) while neither has finished.
        await eventually(
            lambda: not any(s["running"] for s in kopf_shim.status(registry).values()),
            timeout=10,
            message="every Loop stopping while the first one still drains",
        )
        assert not release.is_set()
    finally:
        release.set()
        await asyncio.wait_for(operator, 30)
    assert leases.holder("drain-first") is None
    assert leases.holder("drain-second") is None


async def test_a_users_cleanup_runs_once_every_loop_has_stopped(
    cluster_url: str, long_stop_timeout: None
) -> None:
    """Written above the reconciler, a cleanup that closes what reconciles use still runs
    after the Loop stopped: no reconcile in flight, the lease released."""
    registry = kopf.OperatorRegistry()
    leases = MemoryLeaseStore()
    reconciling = asyncio.Event()
    release = asyncio.Event()
    seen_by_cleanup: list[tuple[object, str | None]] = []

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=cluster_url)

    @kopf.on.cleanup(registry=registry)
    async def close_the_pool(**_: Any) -> None:
        running = kopf_shim.status(registry)["pool-user"]["running"]
        seen_by_cleanup.append((running, leases.holder("pool-user")))

    @kr.reconciler(
        "", "v1", "configmaps",
        tenancy=kr.Tenancy.TENANT_SCOPED,
        reconciler_id="pool-user",
        leader=lambda: MemoryLeaseElector(leases),
        fenced=None,
        metrics=None,
        registry=registry,
    )  # fmt: skip
    async def reconcile_with_the_pool(req: kr.Request) -> None:
        if req.entity_id == "default/held":
            reconciling.set()
            await release.wait()

    stop = asyncio.Event()
    operator = await operator_with_a_held_configmap(cluster_url, registry, stop)
    try:
        await asyncio.wait_for(reconciling.wait(), 20)
        stop.set()
        await eventually(
            lambda: not kopf_shim.status(registry)["pool-user"]["running"],
            timeout=10,
            message="the Loop stopping",
        )
        assert seen_by_cleanup == []  # the reconcile still drains: the user's cleanup waits
    finally:
        release.set()
        await asyncio.wait_for(operator, 30)
    assert seen_by_cleanup == [(False, None)]
