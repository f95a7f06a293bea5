"""``@kr.reconciler(..., shards=N)`` in kopf's real operator, with PostgreSQL leases and fencing.

One replica leads every shard (``<reconciler_id>-shard-<k>``), each at an epoch of
its own; every object is reconciled and written in its own shard's scope; the probe
shows the shards held; cleanup releases every shard lease. Bad shard options fail at
decoration.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import kopf
import pytest
from operator_e2e import kopf_running

import kopf_reconcile as kr
from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.integration import kopf_shim
from kopf_reconcile.leader.postgres import PostgresLeaseElector
from kopf_reconcile.sharding import ShardAssignment
from support import eventually

CONFIGMAPS = "/api/v1/namespaces/default/configmaps"
RID = "configmaps-sharded"
SHARDS = 3


pytestmark = pytest.mark.usefixtures("no_environment")


async def test_a_sharded_reconciler_leads_each_shard_under_its_own_lease(
    cluster_url: str, cluster_http: aiohttp.ClientSession, embedded_postgres_dsn: str
) -> None:
    dsn = embedded_postgres_dsn
    registry = kopf.OperatorRegistry()
    seen: dict[str, int] = {}

    @kr.reconciler(
        "", "v1", "configmaps",
        tenancy=kr.Tenancy.TENANT_SCOPED,
        reconciler_id=RID,
        shards=SHARDS,
        leader=lambda: PostgresLeaseElector(dsn, ttl=2),
        fenced=lambda: PostgresFencedRepository(dsn),
        renew_interval=0.2,
        metrics=None,
        events=False,
        registry=registry,
    )  # fmt: skip
    async def reconcile_sharded(req: kr.Request) -> None:
        writer = kr.fenced_writer()
        assert writer is not None
        await writer.write(req.entity_id, {"epoch": writer.epoch})
        seen[req.entity_id] = writer.epoch

    names = [f"cm-{i}" for i in range(9)]
    async with kopf_running(registry, cluster_url, stop_timeout=30, namespaces=["default"]):
        await eventually(
            lambda: len(kopf_shim.status(registry)[RID].get("shards", {})) == SHARDS,  # type: ignore[arg-type]
            timeout=20,
        )
        for name in names:
            body = {"metadata": {"name": name}, "data": {"k": "v"}}
            async with cluster_http.post(CONFIGMAPS, json=body) as response:
                assert response.status == 201, await response.text()
        await eventually(lambda: all(f"default/{n}" in seen for n in names), timeout=20)
        status = kopf_shim.status(registry)[RID]
        assert status["leader"] is True
        assert set(status["shards"]) == {"0", "1", "2"}  # type: ignore[arg-type]
        assignment = ShardAssignment(SHARDS)
        for name in names:
            entity = f"default/{name}"
            k = assignment.shard_of(entity)
            async with PostgresFencedRepository(dsn, scope=f"{RID}-shard-{k}") as repo:
                assert await repo.get_state(entity) == {"epoch": seen[entity]}
    async with PostgresLeaseElector(dsn) as elector:
        records = {r.reconciler_id: r for r in await elector.list_leases()}
    for k in range(SHARDS):
        assert records[f"{RID}-shard-{k}"].holder_id == ""  # released at cleanup
    assert RID not in records  # no lease under the unsharded name


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"shards": 0}, "shards must be an integer from 1 to 1024"),
        ({"shards": 2, "leader": None}, "shards=2 requires a leader"),
    ],
)
def test_bad_shard_options_fail_at_decoration(options: dict[str, Any], message: str) -> None:
    with pytest.raises(kr.ConfigError, match=message):
        kr.reconciler(
            "",
            "v1",
            "configmaps",
            tenancy=kr.Tenancy.SINGLE_TENANT,
            registry=kopf.OperatorRegistry(),
            **options,
        )(lambda req: None)
