"""pytest fixtures for users' own tests: ``embedded_cluster`` and ``embedded_postgres``.

Registered through the ``pytest11`` entry point, so installing
``kopf-reconcile[testing]`` makes them available without a conftest.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest_asyncio

if TYPE_CHECKING:
    from kopf_reconcile.testing.cluster import EmbeddedCluster
    from kopf_reconcile.testing.postgres import EmbeddedPostgres


@pytest_asyncio.fixture
async def embedded_cluster() -> AsyncIterator[EmbeddedCluster]:
    """A fresh embedded Kubernetes API on 127.0.0.1 for one test."""
    from kopf_reconcile.testing.cluster import EmbeddedCluster

    async with EmbeddedCluster() as cluster:
        yield cluster


@pytest_asyncio.fixture
async def embedded_postgres() -> AsyncIterator[EmbeddedPostgres]:
    """A fresh real PostgreSQL server in a temporary directory for one test."""
    from kopf_reconcile.testing.postgres import EmbeddedPostgres

    async with EmbeddedPostgres() as server:
        yield server
