"""A reconciler of ConfigMaps that logs secrets on purpose: what the redaction must catch.

It logs the database URL (with its password) and a bearer token as message arguments,
as an ``Authorization`` header in a dict, and in the text of an exception (the first
attempt of every object fails, so the Loop logs it with its traceback).
"""

from __future__ import annotations

import logging
import os
from collections import Counter

import kopf_reconcile as kr

logger = logging.getLogger("leaky")
DSN = os.environ["KOPF_RECONCILE_DATABASE_URL"]
TOKEN = os.environ["TEST_BEARER_TOKEN"]
attempts: Counter[str] = Counter()


@kr.reconciler("", "v1", "configmaps", tenancy=kr.Tenancy.TENANT_SCOPED)
async def leak(req: kr.Request) -> None:
    attempts[req.entity_id] += 1
    logger.info("connecting to %s with headers %r", DSN, {"Authorization": f"Bearer {TOKEN}"})
    if attempts[req.entity_id] == 1:
        raise ConnectionError(f"cannot reach {DSN}; Authorization: Bearer {TOKEN} was refused")
    logger.warning("retrying with Authorization: Bearer %s", TOKEN)
    logger.info("leaked everything for %s", req.entity_id)
