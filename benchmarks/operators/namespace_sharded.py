"""A ConfigMap reconciler that does nothing, in ``BENCH_SHARDS`` shards by namespace (or
unsharded with 1): what its replica holds is its watch's cache alone."""

from __future__ import annotations

import os

import kopf_reconcile as kr

SHARDS = int(os.environ.get("BENCH_SHARDS", "4"))


@kr.reconciler(
    "", "v1", "configmaps",
    tenancy=kr.Tenancy.TENANT_SCOPED,
    reconciler_id=os.environ["BENCH_RECONCILER_ID"],
    shards=SHARDS,
    shard_by_namespace=SHARDS > 1,
    events=False,
)  # fmt: skip
async def reconcile_configmap(req: kr.Request) -> None:
    return None
