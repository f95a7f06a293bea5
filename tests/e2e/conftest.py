"""End-to-end fixtures: the example operator as real processes, a Kubernetes API, PostgreSQL.

``operators`` starts operator processes for a test and stops them all afterwards;
``devices`` handles Device objects in the test's namespace (the example's CRD is
installed and discoverable); ``store`` reads what the example wrote to PostgreSQL.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml
from operator_e2e import (
    CRDS,
    DEVICES_CRD,
    RECONCILER_ID,
    WEBSITES_CRD,
    Devices,
    Operators,
    Store,
)

from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.integration import settings as process_settings
from kopf_reconcile.integration.settings import Settings
from kopf_reconcile.testing import install_fence
from support import eventually


@pytest_asyncio.fixture
async def cluster_url() -> AsyncIterator[str]:
    """An embedded cluster as a process of its own
    (``python -m kopf_reconcile.testing.emulated_apiserver``), for tests that run kopf in this
    process."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kopf_reconcile.testing.emulated_apiserver",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        url = (await asyncio.wait_for(process.stdout.readline(), 30)).decode().strip()
        assert url.startswith("http://127.0.0.1:"), url
        yield url
    finally:
        process.terminate()
        await process.wait()


@pytest_asyncio.fixture
async def http(kube: Any) -> AsyncIterator[aiohttp.ClientSession]:
    async with kube.http_session() as session:
        yield session


@pytest_asyncio.fixture
async def cluster_http(cluster_url: str) -> AsyncIterator[aiohttp.ClientSession]:
    """A raw HTTP session on ``cluster_url``'s embedded cluster."""
    async with aiohttp.ClientSession(base_url=cluster_url) as session:
        yield session


@pytest.fixture
def no_environment() -> Iterator[None]:
    """kopf run in this process, with the shim's settings of an empty environment."""
    process_settings.install(Settings.load({}))
    yield
    process_settings.install(None)


@pytest_asyncio.fixture
async def devices_crd(http: aiohttp.ClientSession) -> None:
    """The example's CRD, established and discoverable (kept on a shared real cluster)."""
    await install_crd(http, yaml.safe_load(DEVICES_CRD.read_text()))


@pytest_asyncio.fixture
async def websites_crd(http: aiohttp.ClientSession) -> None:
    """The Website example's CRD, established and discoverable."""
    await install_crd(http, yaml.safe_load(WEBSITES_CRD.read_text()))


async def install_crd(http: aiohttp.ClientSession, crd: dict[str, Any]) -> None:
    """Create ``crd`` (unless it exists) and wait until its resource is served."""
    async with http.post(CRDS, json=crd) as response:
        assert response.status in (201, 409), await response.text()
    spec = crd["spec"]
    served = f"/apis/{spec['group']}/{spec['versions'][0]['name']}"

    async def discoverable() -> bool:
        async with http.get(served) as response:
            if response.status != 200:
                return False
            resources = (await response.json()).get("resources", [])
            return any(r.get("name") == spec["names"]["plural"] for r in resources)

    await eventually(
        discoverable, timeout=30, interval=0.1, message=f"{crd['metadata']['name']} served"
    )


@pytest_asyncio.fixture
async def devices(http: aiohttp.ClientSession, kube_namespace: str, devices_crd: None) -> Devices:
    return Devices(http, kube_namespace)


@pytest_asyncio.fixture
async def store(embedded_postgres_dsn: str, kube_namespace: str) -> AsyncIterator[Store]:
    repository = PostgresFencedRepository(embedded_postgres_dsn, scope=RECONCILER_ID)
    yield Store(repository, kube_namespace)
    await repository.close()


@pytest_asyncio.fixture
async def operators(kube: Any, kube_namespace: str) -> AsyncIterator[Operators]:
    # The API server's fence, as the chart installs it, over the Leases of the operators'
    # namespace (POD_NAMESPACE: the test's).
    async with kube.http_session() as http:
        await install_fence(http, kube_namespace)
    manager = Operators(kube.kubeconfig, kube_namespace)
    try:
        yield manager
    finally:
        await manager.stop_all()
