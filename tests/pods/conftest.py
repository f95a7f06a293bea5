"""Fixtures of the pod tier: one real node for the session (see ``node.py``).

The tier is required under ``CI=true``; elsewhere ``KOPF_RECONCILE_SKIP_POD_TIER=1``
skips it, as the real kube-apiserver tier's variable skips that one. ``make
pod-tier`` (part of ``make test``) builds what it needs.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from node import NodeError, PodNode

SKIP_PODS_VARIABLE = "KOPF_RECONCILE_SKIP_POD_TIER"


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def pod_node() -> AsyncIterator[PodNode]:
    """A node that runs pods (kubelet, containerd), started once per test session."""
    in_ci = os.environ.get("CI") == "true"
    if os.environ.get(SKIP_PODS_VARIABLE) == "1" and not in_ci:
        pytest.skip(f"pod tier skipped ({SKIP_PODS_VARIABLE}=1)")
    node = PodNode()
    try:
        await node.__aenter__()
        cannot_start = None
    except NodeError as exc:
        cannot_start = str(exc)
    if cannot_start is not None:
        hint = "it is required under CI=true" if in_ci else f"set {SKIP_PODS_VARIABLE}=1 to skip it"
        pytest.fail(f"the pod tier cannot start ({hint}): {cannot_start}", pytrace=False)
    try:
        yield node
    finally:
        await node.stop()
