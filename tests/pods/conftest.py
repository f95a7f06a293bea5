"""Fixtures of the pod tier: one real node for the session (see ``node.py``).

The tier is required under ``CI=true``; elsewhere ``KOPF_RECONCILE_SKIP_POD_TIER=1``
skips it, as the real kube-apiserver tier's variable skips that one. ``make
pod-tier`` (part of ``make test``) builds what it needs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio
from node import PodNode

from support import start_tier

SKIP_PODS_VARIABLE = "KOPF_RECONCILE_SKIP_POD_TIER"


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def pod_node() -> AsyncIterator[PodNode]:
    """A node that runs pods (kubelet, containerd), started once per test session."""
    node = await start_tier(PodNode(), "pod tier", SKIP_PODS_VARIABLE)
    try:
        yield node
    finally:
        await node.stop()
