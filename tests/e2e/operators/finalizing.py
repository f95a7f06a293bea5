"""A reconciler of the ConfigMaps labelled ``app=finalizing``, with a finalizer.

It prints ``reconcile <entity id> live``, ``cleanup <entity id> started`` and ``cleanup
<entity id> done``. With ``HANG_CLEANUP=1`` a cleanup never finishes (a replica to kill in
the middle of a deletion); the cleanup of an object named ``poison-*`` raises
``PermanentError``.
"""

from __future__ import annotations

import asyncio
import os

import kopf_reconcile as kr


@kr.reconciler(
    "",
    "v1",
    "configmaps",
    tenancy=kr.Tenancy.TENANT_SCOPED,
    labels={"app": "finalizing"},
    finalizer="example.com/finalizing",
)
async def reconcile_finalizing(req: kr.Request) -> None:
    if not kr.is_deleting(kr.cached(req)):
        print(f"reconcile {req.entity_id} live", flush=True)
        return
    print(f"cleanup {req.entity_id} started", flush=True)
    if req.entity_id.split("/")[-1].startswith("poison-"):
        raise kr.PermanentError(f"cannot clean up {req.entity_id}")
    if os.environ.get("HANG_CLEANUP") == "1":
        await asyncio.Event().wait()
    print(f"cleanup {req.entity_id} done", flush=True)
