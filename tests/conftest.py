"""Shared fixtures.

``kube`` is a Kubernetes API backend for tests that must hold on every tier:
the embedded emulation and (when built) the real kube-apiserver. Each backend
offers ``.url``, ``.kubeconfig``, ``.api_client()`` and ``.http_session()``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest_asyncio


@pytest_asyncio.fixture
async def kube() -> AsyncIterator[Any]:
    from kopf_reconcile.testing.cluster import EmbeddedCluster

    async with EmbeddedCluster() as cluster:
        yield cluster
