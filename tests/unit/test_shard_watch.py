"""A watch stream that carries only the shards a replica leads (KEP-5866 selection).

Against a scripted API server: the stream starts again with the selector of exactly the
shards led whenever they change; what the server sends outside the selection (a server
that ignores the selector) is dropped; when a listing completes, an object no longer
selected is released (never reported deleted) and a selected one the listing lacks is
reported deleted; a shard counts as covered only once a listing holding it completed,
and stays covered while a wider selection is listed.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import pytest

from kopf_reconcile.control.holding import LeadershipChange
from kopf_reconcile.integration.relisting import ListingTracker
from kopf_reconcile.integration.shard_watch import ShardWatch, narrowed_stream
from kopf_reconcile.sharding import ShardAssignment, shard_id
from support import eventually

RID = "things"
SHARDS = 4
ASSIGNMENT = ShardAssignment(SHARDS, by_namespace=True)
LISTED = object()
# Namespaces, two per shard.
NAMESPACES: dict[int, list[str]] = {k: [] for k in range(SHARDS)}
for n in itertools.count():
    shard = ASSIGNMENT.shard_of(f"ns-{n}/x")
    if len(NAMESPACES[shard]) < 2:
        NAMESPACES[shard].append(f"ns-{n}")
    if all(len(v) == 2 for v in NAMESPACES.values()):
        break


def body(namespace: str, name: str) -> dict[str, Any]:
    return {"metadata": {"namespace": namespace, "name": name, "uid": f"{namespace}.{name}"}}


class Server:
    """Lists what it holds for a selector (or everything, when it ignores selectors)."""

    def __init__(self, *, filters: bool = True) -> None:
        self.filters = filters
        self.objects = {f"{ns}/o": body(ns, "o") for shard in NAMESPACES.values() for ns in shard}
        self.selectors: list[str] = []

    def shards_of(self, selector: str) -> frozenset[int]:
        for size in range(1, SHARDS + 1):
            for chosen in itertools.combinations(range(SHARDS), size):
                if ASSIGNMENT.selector(chosen) == selector:
                    return frozenset(chosen)
        raise AssertionError(f"not a selector of these shards: {selector}")

    async def open(self, selector: str) -> AsyncGenerator[Any, None]:
        self.selectors.append(selector)
        shards = self.shards_of(selector)
        for entity, obj in list(self.objects.items()):
            if not self.filters or ASSIGNMENT.shard_of(entity) in shards:
                yield {"type": None, "object": obj}
        yield LISTED
        await asyncio.Event().wait()  # then watch, quietly


def lead(watch: ShardWatch, shard: int, leading: bool = True) -> None:
    watch.observe(LeadershipChange(leading, shard_id(RID, shard), 1, "me"))


@pytest.mark.parametrize("filters", [True, False])
async def test_the_stream_follows_the_led_shards(filters: bool) -> None:
    server = Server(filters=filters)
    watch = ShardWatch(RID, ASSIGNMENT)
    fed: list[Mapping[str, Any]] = []
    released: list[str] = []

    async def feed(event: Mapping[str, Any]) -> None:
        fed.append(event)

    async def release(obj: Mapping[str, Any]) -> None:
        released.append(obj["metadata"]["namespace"])

    def fed_namespaces(kind: str | None = None) -> set[str]:
        return {e["object"]["metadata"]["namespace"] for e in fed if e["type"] == kind}

    async def consume() -> None:
        async for _ in narrowed_stream(
            server.open, [watch], resource="things", listed_marker=LISTED, tracker=ListingTracker(),
            feed=feed, release=release,
        ):  # fmt: skip
            pass

    consumer = asyncio.create_task(consume())
    try:
        await asyncio.sleep(0.05)
        assert server.selectors == [] and not watch.covers(0)  # nothing led: nothing watched
        lead(watch, 0)
        await eventually(lambda: watch.covers(0), timeout=5)
        assert server.selectors == [ASSIGNMENT.selector([0])]
        assert fed_namespaces() == set(NAMESPACES[0])  # what the server sent beyond: dropped
        assert not watch.covers(1)

        fed.clear()
        lead(watch, 2)
        await eventually(lambda: len(server.selectors) == 2, timeout=5)
        assert server.selectors[-1] == ASSIGNMENT.selector([0, 2])
        await eventually(lambda: watch.covers(2), timeout=5)
        assert watch.covers(0)
        assert fed_namespaces() == set(NAMESPACES[0] + NAMESPACES[2])

        # Shard 0 is lost, and one of shard 2's objects is deleted meanwhile.
        fed.clear()
        gone = NAMESPACES[2][0]
        del server.objects[f"{gone}/o"]
        lead(watch, 0, leading=False)
        await eventually(lambda: len(server.selectors) == 3, timeout=5)
        await eventually(lambda: sorted(released) == sorted(NAMESPACES[0]), timeout=5)
        assert server.selectors[-1] == ASSIGNMENT.selector([2])
        assert fed_namespaces("DELETED") == {gone}  # released objects are never "deleted"
        assert watch.covers(2) and not watch.covers(0)

        # Nothing led any more: the stream stops and everything it held is released.
        lead(watch, 2, leading=False)
        await eventually(lambda: NAMESPACES[2][1] in released, timeout=5)
        assert len(server.selectors) == 3 and not watch.covers(2)
    finally:
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
    assert not watch.covers(0)  # a stream that ended covers nothing


async def test_a_reconcile_waits_until_its_shard_is_listed() -> None:
    watch = ShardWatch(RID, ASSIGNMENT)
    waiting = asyncio.create_task(watch.until_covered(1))
    stream = object()
    watch.stream_covers(stream, frozenset({0}))
    await asyncio.sleep(0)
    assert not waiting.done()
    other = object()
    watch.stream_covers(other, frozenset({1}))  # one stream of two holds it: not yet
    watch.stream_covers(stream, frozenset({0, 1}))
    await asyncio.wait_for(waiting, 5)
    watch.stream_covers(other, None)
    assert watch.covers(1)


def test_only_a_layout_the_server_can_select_gets_a_shard_watch() -> None:
    for assignment in (ShardAssignment(4), ShardAssignment(4, True, namespace_modulo=True)):
        with pytest.raises(ValueError, match="cannot select"):
            ShardWatch(RID, assignment)
