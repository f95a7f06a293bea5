"""The shim takes its events straight from kopf's watch stream.

With no other kopf handler of the resource, kopf sees none of the events (no per-object
worker or memory); with another handler of it, that handler sees every event and the
reconciler still sees each change once, never twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import kopf
import pytest
import pytest_asyncio
from kopf._core.reactor import inventory

import kopf_reconcile as kr
from kopf_reconcile.integration import kopf_shim
from kopf_reconcile.integration import settings as process_settings
from kopf_reconcile.integration.settings import Settings
from kopf_reconcile.testing.memory import MemoryLeaseElector, MemoryLeaseStore
from support import eventually

CONFIGMAPS = "/api/v1/namespaces/default/configmaps"
MERGE = {"Content-Type": "application/merge-patch+json"}


@pytest_asyncio.fixture
async def http(cluster_url: str) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(base_url=cluster_url) as session:
        yield session


@pytest.fixture(autouse=True)
def no_environment() -> Any:
    process_settings.install(Settings.load({}))
    yield
    process_settings.install(None)


@pytest.mark.parametrize("other_handler", [False, True], ids=["alone", "beside-kopf-handler"])
async def test_events_reach_the_reconciler_from_the_watch_stream(
    cluster_url: str,
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
    other_handler: bool,
) -> None:
    registry = kopf.OperatorRegistry()
    seen: list[tuple[str, str | None]] = []  # (entity, data.k) per reconcile
    kopf_saw: list[str] = []  # names the plain kopf handler saw
    remembered: list[str] = []  # uids kopf kept a per-object memory of

    recall = inventory.ResourceMemories.recall

    async def remembering(self: Any, raw_body: Any, **kwargs: Any) -> Any:
        remembered.append(raw_body["metadata"]["uid"])
        return await recall(self, raw_body, **kwargs)

    monkeypatch.setattr(inventory.ResourceMemories, "recall", remembering)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=cluster_url)

    @kr.reconciler(
        "", "v1", "configmaps",
        tenancy=kr.Tenancy.TENANT_SCOPED,
        reconciler_id="configmaps-stream-feed",
        leader=lambda: MemoryLeaseElector(MemoryLeaseStore()),
        fenced=None,
        metrics=None,
        events=False,
        registry=registry,
    )  # fmt: skip
    async def reconcile_stream_feed(req: kr.Request) -> None:
        body = kr.cached(req)
        seen.append((req.entity_id, None if body is None else body["data"]["k"]))

    if other_handler:

        @kopf.on.event("", "v1", "configmaps", registry=registry)
        def plain(name: str, **_: Any) -> None:
            kopf_saw.append(name)

    stop = asyncio.Event()
    operator = asyncio.create_task(
        kopf.operator(registry=registry, namespaces=["default"], stop_flag=stop)
    )
    try:
        await eventually(
            lambda: all(s.get("leader") for s in kopf_shim.status(registry).values()), timeout=10
        )
        body = {"metadata": {"name": "fed"}, "data": {"k": "v1"}}
        async with http.post(CONFIGMAPS, json=body) as response:
            assert response.status == 201, await response.text()
        await eventually(lambda: ("default/fed", "v1") in seen, timeout=10)
        patch = {"data": {"k": "v2"}}
        async with http.patch(f"{CONFIGMAPS}/fed", json=patch, headers=MERGE) as response:
            assert response.status == 200
        await eventually(lambda: ("default/fed", "v2") in seen, timeout=10)
        async with http.delete(f"{CONFIGMAPS}/fed") as response:
            assert response.status == 200
        await eventually(lambda: ("default/fed", None) in seen, timeout=10)
        await asyncio.sleep(0.3)  # a second delivery, if any, would come now
    finally:
        stop.set()
        await asyncio.wait_for(operator, 20)

    # One reconcile per change: no event reached the reconciler twice.
    assert [s for s in seen if s[0] == "default/fed"] == [
        ("default/fed", "v1"),
        ("default/fed", "v2"),
        ("default/fed", None),
    ]
    if other_handler:
        assert kopf_saw.count("fed") >= 3  # kopf's own handler saw every event
        assert remembered
    else:
        assert not remembered  # kopf never saw an object: no per-object memory, no worker
