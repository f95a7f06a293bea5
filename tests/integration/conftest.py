"""Fixtures of the integration tests."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest
import pytest_asyncio

from kopf_reconcile.leader.kubernetes import KubernetesLeaseElector
from kopf_reconcile.leader.postgres import PostgresLeaseElector


@pytest.fixture
def dsn(embedded_postgres_dsn: str) -> str:
    """A fresh database on the session's real PostgreSQL server."""
    return embedded_postgres_dsn


@pytest_asyncio.fixture
async def api(kube: Any) -> AsyncIterator[Any]:
    """A kubernetes-asyncio client of the ``kube`` tier, closed after the test."""
    client = kube.api_client()
    try:
        yield client
    finally:
        await client.close()


@dataclasses.dataclass
class LeaseBackend:
    """Electors of one lease store, and a way to delete one reconciler's lease record."""

    name: str
    make: Callable[..., Any]  # make(ttl=..., **options) -> an elector
    delete: Callable[[str], Awaitable[None]]


@pytest.fixture(
    params=["postgres", "embedded", pytest.param("real", marks=pytest.mark.real_apiserver)]
)
def lease_store(request: pytest.FixtureRequest) -> Any:
    """``None`` for PostgreSQL leases, else the Kubernetes API tier holding the Leases."""
    if request.param == "postgres":
        return None
    return request.getfixturevalue(
        "embedded_cluster" if request.param == "embedded" else "real_cluster"
    )


@pytest_asyncio.fixture
async def lease_backend(lease_store: Any, dsn: str) -> AsyncIterator[LeaseBackend]:
    """Every lease backend: PostgreSQL rows, Kubernetes Leases on both API tiers.

    Electors made here are closed when the test ends.
    """
    made: list[Any] = []
    if lease_store is None:

        def make_row_elector(ttl: float = 15, **options: Any) -> PostgresLeaseElector:
            made.append(PostgresLeaseElector(dsn, ttl=ttl, **options))
            return made[-1]

        async def delete_row(reconciler_id: str) -> None:
            connection = await asyncpg.connect(dsn)
            try:
                await connection.execute(
                    "DELETE FROM kopf_reconcile_lease WHERE reconciler_id = $1", reconciler_id
                )
            finally:
                await connection.close()

        yield LeaseBackend("postgres", make_row_elector, delete_row)
    else:
        kube = lease_store
        namespace = f"test-{secrets.token_hex(4)}"
        body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
        async with kube.http_session() as http, http.post("/api/v1/namespaces", json=body) as r:
            assert r.status == 201, await r.text()
        api = kube.api_client()

        def make_lease_elector(ttl: float = 15, **options: Any) -> KubernetesLeaseElector:
            made.append(KubernetesLeaseElector(namespace=namespace, ttl=ttl, api=api, **options))
            return made[-1]

        async def delete_lease(reconciler_id: str) -> None:
            path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{reconciler_id}"
            async with kube.http_session() as http, http.delete(path) as response:
                assert response.status == 200, await response.text()

        try:
            yield LeaseBackend("kubernetes", make_lease_elector, delete_lease)
        finally:
            for elector in made:
                await elector.close()
            await api.close()
        return
    for elector in made:
        await elector.close()
