"""Deletions and client-side selection, with a real ``kopf-reconcile run`` process on both
API tiers: only what a reconciler selected can be gone for it."""

from __future__ import annotations

import aiohttp
import pytest
from operator_e2e import OPERATORS, Operators

pytestmark = pytest.mark.slow

SELECTED = OPERATORS / "selected.py"  # reconciles ConfigMaps labelled team=a


async def test_deleting_an_object_the_reconciler_never_selected_does_not_call_it(
    operators: Operators, http: aiohttp.ClientSession, kube_namespace: str
) -> None:
    url = f"/api/v1/namespaces/{kube_namespace}/configmaps"
    operator = await operators.start(handlers=SELECTED)
    for name, labels in (("outsider", {"team": "b"}), ("member", {"team": "a"})):
        body = {"metadata": {"name": name, "labels": labels}, "data": {"k": "v"}}
        async with http.post(url, json=body) as response:
            assert response.status == 201, await response.text()
    await operator.printed(f"reconcile {kube_namespace}/member live", timeout=30)

    # The outsider's deletion comes first; the member's "gone" reconcile comes after it.
    for name in ("outsider", "member"):
        async with http.delete(f"{url}/{name}") as response:
            assert response.status == 200, await response.text()
    await operator.printed(f"reconcile {kube_namespace}/member gone", timeout=30)
    assert not operator.lines(f"{kube_namespace}/outsider"), operator.text
