"""Deletions with a finalizer, with real ``kopf-reconcile run`` replicas on both API tiers and a
real PostgreSQL: the leader is killed while it cleans up a deleting object, and the next leader
finishes the cleanup before the finalizer goes; a cleanup that cannot succeed keeps the
finalizer and is dead-lettered where on-call looks (its Event, ``kopf-reconcile
dead-letters``)."""

from __future__ import annotations

import aiohttp
import pytest
from operator_e2e import MERGE, OPERATORS, Operators, read_object

from support import eventually

pytestmark = pytest.mark.slow

FINALIZING = OPERATORS / "finalizing.py"


async def test_a_new_leader_finishes_the_cleanup_a_killed_leader_began(
    operators: Operators,
    http: aiohttp.ClientSession,
    kube_namespace: str,
    embedded_postgres_dsn: str,
) -> None:
    env = {
        "KOPF_RECONCILE_DATABASE_URL": embedded_postgres_dsn,
        "KOPF_RECONCILE_LEADER": "postgres",
        "KOPF_RECONCILE_LEASE_TTL": "2",
        "KOPF_RECONCILE_RENEW_INTERVAL": "0.5",
    }
    entity = f"{kube_namespace}/doomed"
    path = f"/api/v1/namespaces/{kube_namespace}/configmaps"
    first = await operators.start(handlers=FINALIZING, env={**env, "HANG_CLEANUP": "1"})
    body = {"metadata": {"name": "doomed", "labels": {"app": "finalizing"}}}
    async with http.post(path, json=body) as response:
        assert response.status == 201, await response.text()
    await first.printed(f"reconcile {entity} live", timeout=30)
    second = await operators.start(handlers=FINALIZING, env=env)

    async with http.delete(f"{path}/doomed") as response:
        assert response.status == 200, await response.text()
    await first.printed(f"cleanup {entity} started", timeout=30)
    first.kill()  # in the middle of the cleanup
    await first.stop()
    stored = await read_object(http, f"{path}/doomed")
    assert stored is not None and stored["metadata"]["finalizers"] == ["example.com/finalizing"]

    await second.printed(f"cleanup {entity} done", timeout=30)
    await eventually(
        lambda: _gone(http, f"{path}/doomed"), timeout=30, message="deleted after the cleanup"
    )
    assert not first.lines(f"cleanup {entity} done")


async def _gone(http: aiohttp.ClientSession, path: str) -> bool:
    return await read_object(http, path) is None


async def test_a_cleanup_that_cannot_succeed_keeps_the_finalizer_and_is_dead_lettered(
    operators: Operators,
    http: aiohttp.ClientSession,
    kube_namespace: str,
    embedded_postgres_dsn: str,
) -> None:
    database = {"KOPF_RECONCILE_DATABASE_URL": embedded_postgres_dsn}
    env = {**database, "KOPF_RECONCILE_LEADER": "postgres"}
    entity = f"{kube_namespace}/poison-pill"
    path = f"/api/v1/namespaces/{kube_namespace}/configmaps"
    operator = await operators.start(handlers=FINALIZING, env=env)
    body = {"metadata": {"name": "poison-pill", "labels": {"app": "finalizing"}}}
    async with http.post(path, json=body) as response:
        assert response.status == 201, await response.text()
    await operator.printed(f"reconcile {entity} live", timeout=30)
    async with http.delete(f"{path}/poison-pill") as response:
        assert response.status == 200, await response.text()
    await operator.printed(f"cleanup {entity} started", timeout=30)

    async def listed() -> bool:
        status, output = await operators.command("dead-letters", env=database)
        return status == 0 and entity in output and "cannot clean up" in output

    await eventually(listed, timeout=30, message="the dead letter listed")

    async def event_recorded() -> bool:
        events = await read_object(http, f"/api/v1/namespaces/{kube_namespace}/events")
        return any(
            e["reason"] == "DeadLettered" and e["involvedObject"]["name"] == "poison-pill"
            for e in (events or {}).get("items", [])
        )

    await eventually(event_recorded, timeout=30, message="the DeadLettered Event")
    stored = await read_object(http, f"{path}/poison-pill")
    assert stored is not None and stored["metadata"]["finalizers"] == ["example.com/finalizing"]
    await operator.stop()
    release = {"metadata": {"finalizers": None}}  # (a shared real cluster keeps namespaces)
    async with http.patch(f"{path}/poison-pill", json=release, headers=MERGE) as response:
        assert response.status == 200, await response.text()
