"""A reconciler of the ConfigMaps labelled ``team=a``; it prints what ``cached`` returns.

Each reconcile prints ``reconcile <entity id> live <uid>`` or ``reconcile <entity id> gone``.
"""

from __future__ import annotations

import kopf_reconcile as kr


@kr.reconciler("", "v1", "configmaps", tenancy=kr.Tenancy.TENANT_SCOPED, labels={"team": "a"})
async def reconcile_team_a(req: kr.Request) -> None:
    body = kr.cached(req)
    state = "gone" if body is None else f"live {body['metadata']['uid']}"
    print(f"reconcile {req.entity_id} {state}", flush=True)
