"""The new user's scenario, end to end with real ``kopf-reconcile run`` processes on both API
tiers and a real PostgreSQL: a Website owns a ConfigMap and a row; the ConfigMap comes back
when deleted by hand; a Website deleted while no replica runs is cleaned up after a start."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import asyncpg
import pytest
import pytest_asyncio
from operator_e2e import WEBSITES, Operators, read_object

from support import eventually

pytestmark = pytest.mark.slow

FINALIZER = "example.com/websites.example.com-reconcile-website"


@pytest_asyncio.fixture
async def database(embedded_postgres_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(embedded_postgres_dsn)
    yield connection
    await connection.close()


async def _rows(database: asyncpg.Connection) -> dict[str, str]:
    exists = await database.fetchval("SELECT to_regclass('websites') IS NOT NULL")
    if not exists:
        return {}
    return {r["entity"]: r["content"] for r in await database.fetch("SELECT * FROM websites")}


@pytest.mark.usefixtures("websites_crd")
async def test_a_website_owns_its_configmap_and_row_and_is_cleaned_up_after_a_stopped_deletion(
    operators: Operators,
    http: aiohttp.ClientSession,
    kube_namespace: str,
    embedded_postgres_dsn: str,
    database: asyncpg.Connection,
) -> None:
    env = {
        "KOPF_RECONCILE_DATABASE_URL": embedded_postgres_dsn,
        "KOPF_RECONCILE_LEADER": "postgres",
    }
    websites = f"/apis/example.com/v1/namespaces/{kube_namespace}/websites"
    pages = f"/api/v1/namespaces/{kube_namespace}/configmaps"
    entity = f"{kube_namespace}/flaky"
    operator = await operators.start(handlers=WEBSITES, env=env, name="first")
    body = {
        "apiVersion": "example.com/v1",
        "kind": "Website",
        "metadata": {"name": "flaky"},
        "spec": {"content": "<h1>hello</h1>"},
    }
    async with http.post(websites, json=body) as response:
        assert response.status == 201, await response.text()

    async def page_served() -> bool:
        page = await read_object(http, f"{pages}/flaky-page")
        return page is not None and page["data"] == {"index.html": "<h1>hello</h1>"}

    await eventually(page_served, timeout=30, message="the Website's ConfigMap")
    await eventually(lambda: _has_row(database, entity), timeout=30, message="the Website's row")
    website = await read_object(http, f"{websites}/flaky")
    assert website is not None and FINALIZER in website["metadata"]["finalizers"]
    page = await read_object(http, f"{pages}/flaky-page")
    assert page is not None
    (owner,) = page["metadata"]["ownerReferences"]
    assert owner["uid"] == website["metadata"]["uid"] and owner["controller"] is True

    # A child deleted by hand comes back: its DELETED event reconciles its owner.
    async with http.delete(f"{pages}/flaky-page") as response:
        assert response.status == 200, await response.text()
    await eventually(
        lambda: _is_new_page(http, f"{pages}/flaky-page", page["metadata"]["uid"]),
        timeout=30,
        message="the ConfigMap recreated",
    )

    # Deleted while no replica runs: the finalizer keeps it until a start cleans up.
    assert await operator.stop() == 0
    async with http.delete(f"{websites}/flaky") as response:
        assert response.status == 200, await response.text()
    deleting = await read_object(http, f"{websites}/flaky")
    assert deleting is not None and deleting["metadata"].get("deletionTimestamp")
    assert entity in await _rows(database)

    second = await operators.start(handlers=WEBSITES, env=env, name="second")
    await eventually(
        lambda: _gone(http, f"{websites}/flaky"), timeout=30, message="the Website deleted"
    )
    assert entity not in await _rows(database)
    # No reconcile failed on the way (a finalizer added twice would have).
    assert not operator.lines("failed; retrying"), operator.text
    assert not second.lines("failed; retrying"), second.text


async def _has_row(database: asyncpg.Connection, entity: str) -> bool:
    return entity in await _rows(database)


async def _is_new_page(http: aiohttp.ClientSession, path: str, old_uid: str) -> bool:
    page = await read_object(http, path)
    return page is not None and page["metadata"]["uid"] != old_uid


async def _gone(http: aiohttp.ClientSession, path: str) -> bool:
    return await read_object(http, path) is None
