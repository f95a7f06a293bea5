"""Which watch streams follow a replica's shards: only its reconciled resource's own.

A stream of a related resource (``owns=`` children, ``watches=`` objects mapped to owners)
carries every object even when the reconciler is sharded by namespace: a child deleted while
another replica led its shard must leave the children's cache, and an object in a shard this
replica does not lead may still map to an owner in one it leads. A reconciled resource's
stream that is not narrowed (another kopf handler needs it whole) still tells when its
listing covers every shard, or no reconcile would ever start.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Mapping
from typing import Any

import kopf
import pytest
from kopf._cogs.clients import watching

from kopf_reconcile.control.holding import LeadershipChange
from kopf_reconcile.integration.shard_watch import ShardWatch
from kopf_reconcile.integration.stream_feed import Feeder, install_stream_feed
from kopf_reconcile.sharding import ShardAssignment, shard_id
from support import eventually

RID = "widgets"
ASSIGNMENT = ShardAssignment(4, by_namespace=True)
PRIMARY, RELATED = ("example.com", "widgets"), ("", "secrets")


class Fed:
    """A reconciler of widgets that also watches secrets, sharded by namespace."""

    def __init__(self, settings: object) -> None:
        self.settings = settings
        self.registry = kopf.OperatorRegistry()
        self.feeding_streams: collections.Counter[tuple[str, str]] = collections.Counter()
        self.shard_watch: ShardWatch | None = ShardWatch(RID, ASSIGNMENT)
        self.events: dict[tuple[str, str], list[Mapping[str, Any]]] = {PRIMARY: [], RELATED: []}

    def watches(self, key: tuple[str, str], version: str | None = None) -> bool:
        return key in (PRIMARY, RELATED)

    def reconciles(self, key: tuple[str, str]) -> bool:
        return key == PRIMARY

    def maps(self, key: tuple[str, str]) -> bool:
        return key == RELATED

    def feeder(self, key: tuple[str, str]) -> Feeder:
        async def feed(event: Mapping[str, Any]) -> None:
            self.events[key].append(event)

        return RID, feed

    async def release(self, body: Mapping[str, Any]) -> None:
        return None


def obj(namespace: str) -> dict[str, Any]:
    return {"metadata": {"namespace": namespace, "name": "x", "uid": f"uid-{namespace}"}}


async def test_only_the_reconciled_resources_stream_is_narrowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    namespaces: dict[int, str] = {}  # one per shard
    i = 0
    while len(namespaces) < ASSIGNMENT.shards:
        namespaces.setdefault(ASSIGNMENT.shard_of(f"team-{i}/x"), f"team-{i}")
        i += 1
    selectors: dict[str, list[str]] = {"widgets": [], "secrets": []}

    async def server(*, resource: Any, settings: Any, **_: Any) -> AsyncIterator[Any]:
        found = settings.watching.shard_selectors.collect(resource)
        selectors[resource.plural].append(found[0] if found else "")
        for namespace in namespaces.values():  # a server that ignores selectors
            yield {"type": None, "object": obj(namespace)}
        yield watching.Bookmark.LISTED
        await asyncio.Event().wait()

    monkeypatch.setattr(watching, "infinite_watch", server)
    settings = kopf.OperatorSettings()
    fed = Fed(settings)
    install_stream_feed(lambda: [fed])
    assert fed.shard_watch is not None
    fed.shard_watch.observe(LeadershipChange(True, shard_id(RID, 0), 1, "me"))

    async def run(group: str, plural: str) -> None:
        resource = kopf.Resource(group, "v1", plural, namespaced=True)
        async for _ in watching.infinite_watch(
            resource=resource, settings=settings, namespace=None
        ):
            pass

    tasks = [asyncio.create_task(run(*key)) for key in (PRIMARY, RELATED)]
    try:
        shard_watch = fed.shard_watch
        await eventually(
            lambda: shard_watch.covers(0) and len(fed.events[RELATED]) == len(namespaces),
            timeout=5,
        )
        assert selectors["widgets"] == [ASSIGNMENT.selector([0])]
        assert selectors["secrets"] == [""]  # a related stream carries everything
        assert [e["object"]["metadata"]["namespace"] for e in fed.events[PRIMARY]] == [
            namespaces[0]
        ]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_stream_not_narrowed_covers_every_shard_once_listed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def server(*, resource: Any, settings: Any, **_: Any) -> AsyncIterator[Any]:
        yield {"type": None, "object": obj("ns-1")}
        yield watching.Bookmark.LISTED
        await asyncio.Event().wait()

    monkeypatch.setattr(watching, "infinite_watch", server)
    settings = kopf.OperatorSettings()
    settings.watching.shard_selectors["example.com", "widgets"] = "the user's own"  # whole
    fed = Fed(settings)
    install_stream_feed(lambda: [fed])
    assert fed.shard_watch is not None

    async def run() -> None:
        resource = kopf.Resource("example.com", "v1", "widgets", namespaced=True)
        async for _ in watching.infinite_watch(
            resource=resource, settings=settings, namespace=None
        ):
            pass

    task = asyncio.create_task(run())
    try:
        await asyncio.wait_for(fed.shard_watch.until_covered(3), 5)
        assert fed.shard_watch.covers(0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert not fed.shard_watch.covers(0)  # the stream ended
