"""Takeover in the middle of a deletion, with real ``kopf-reconcile run`` replicas on both API
tiers: the leader is killed while it cleans up a deleting object; the next leader finishes the
cleanup and only then is the finalizer removed and the object gone."""

from __future__ import annotations

import aiohttp
import pytest
from operator_e2e import OPERATORS, Operators, read_object

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
