"""Fixtures of the cluster conformance suite: clients of the ``kube`` backend, unique names.

Conformance tests use only ``kube`` (any backend: the embedded cluster or a real
kube-apiserver) and the fixtures here, so they run unchanged on both.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from widget_kind import CRDS, Widgets, established, widget_crd


@pytest.fixture
def unique() -> Callable[[str], str]:
    """Names that do not collide with other tests, even on a shared real cluster."""
    run = uuid.uuid4().hex[:6]
    counter = itertools.count()
    return lambda prefix: f"{prefix}-{run}-{next(counter)}"


@pytest_asyncio.fixture
async def http(kube: Any) -> AsyncIterator[aiohttp.ClientSession]:
    """A raw HTTP session to the backend."""
    async with kube.http_session() as session:
        yield session


@pytest_asyncio.fixture
async def api_client(kube: Any) -> AsyncIterator[Any]:
    """A kubernetes-asyncio ApiClient for the backend."""
    client = kube.api_client()
    try:
        yield client
    finally:
        await client.close()


@pytest_asyncio.fixture
async def widgets(
    http: aiohttp.ClientSession, unique: Callable[[str], str]
) -> AsyncIterator[Widgets]:
    """A fresh CRD (kind Widget, in a group of its own), established and discoverable."""
    group = f"{unique('g')}.example.com"
    response = await http.post(CRDS, json=widget_crd(group))
    assert response.status == 201, await response.text()
    await established(http, group)
    yield Widgets(group, await response.json())
    await http.delete(f"{CRDS}/widgets.{group}")
