"""A reconciler of the ConfigMaps labelled ``app=ns-sharded``, in 4 shards by namespace.

Its reconciler id comes from ``SHARDED_RECONCILER_ID`` (one per test); each reconcile
prints ``reconcile <entity id> live`` or ``reconcile <entity id> gone``. With
``WATCH_ALL_SHARDS=1`` every replica watches every shard. With ``ALSO_KOPF_HANDLER=1`` a
plain kopf handler of ConfigMaps needs the watch whole (it is then not narrowed).
"""

from __future__ import annotations

import os
from typing import Any

import kopf

import kopf_reconcile as kr


@kr.reconciler(
    "", "v1", "configmaps",
    tenancy=kr.Tenancy.TENANT_SCOPED,
    reconciler_id=os.environ["SHARDED_RECONCILER_ID"],
    labels={"app": "ns-sharded"},
    shards=4,
    shard_by_namespace=True,
    watch_all_shards=os.environ.get("WATCH_ALL_SHARDS") == "1",
)  # fmt: skip
async def reconcile_by_namespace(req: kr.Request) -> None:
    state = "gone" if kr.cached(req) is None else "live"
    print(f"reconcile {req.entity_id} {state}", flush=True)


if os.environ.get("ALSO_KOPF_HANDLER") == "1":

    @kopf.on.event("", "v1", "configmaps", labels={"app": "ns-sharded"})
    async def audit(body: kopf.Body, **_: Any) -> None:
        print(f"audit {body['metadata']['namespace']}/{body['metadata']['name']}", flush=True)
