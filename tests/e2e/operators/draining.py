"""A reconciler of ConfigMaps whose reconcile of ``held`` lasts until it is cancelled.

Shutdown must drain it (up to ``KOPF_RECONCILE_STOP_TIMEOUT``): the window in which the
process still runs but must no longer look ready.
"""

from __future__ import annotations

import asyncio
import logging

import kopf_reconcile as kr

logger = logging.getLogger("draining")


@kr.reconciler("", "v1", "configmaps", tenancy=kr.Tenancy.TENANT_SCOPED)
async def reconcile_draining(req: kr.Request) -> None:
    if req.entity_id.endswith("/held"):
        logger.info("holding %s until cancelled", req.entity_id)
        await asyncio.sleep(3600)
