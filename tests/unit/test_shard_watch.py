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
from kopf_reconcile.integration import shard_watch
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


# -- what an adversarial review found, each a test that failed before its fix ------------------


def noop_stream(opened: list[str], closed: list[str] | None = None, closing: float = 0.0) -> Any:
    """A server that lists nothing, then watches quietly (recording opens and closes)."""

    async def open_stream(selector: str) -> AsyncGenerator[Any, None]:
        opened.append(selector)
        try:
            yield LISTED
            await asyncio.Event().wait()
        finally:
            if closing:
                await asyncio.sleep(closing)  # closing the HTTP response takes a moment
            if closed is not None:
                closed.append(selector)

    return open_stream


async def ignore(_: object) -> None:
    return None


def consuming(open_stream: Any, watch: ShardWatch, *, tracker: ListingTracker | None = None,
              feed: Any = ignore, release: Any = ignore,
              ) -> asyncio.Task[None]:  # fmt: skip
    async def consume() -> None:
        async for _ in narrowed_stream(
            open_stream, [watch], resource="things", listed_marker=LISTED,
            tracker=tracker or ListingTracker(), feed=feed, release=release,
        ):  # fmt: skip
            pass

    return asyncio.create_task(consume())


async def test_a_change_right_after_asking_for_the_next_one_is_seen() -> None:
    # The stream asks for the next change, then its waiting task first runs an iteration
    # later: a lease won in between must still wake it (else its shard is never listed).
    watch = ShardWatch(RID, ASSIGNMENT)
    waiting = asyncio.ensure_future(watch.changed())
    lead(watch, 0)
    await asyncio.wait_for(waiting, 5)


async def test_a_deletion_during_a_listing_cut_by_a_change_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shard_watch, "SETTLE_SECONDS", 0.01)  # the change cuts the listing
    server = {f"{NAMESPACES[0][0]}/{n}": body(NAMESPACES[0][0], n) for n in ("a", "b")}

    async def slow_lister(selector: str) -> AsyncGenerator[Any, None]:
        for obj in [server[k] for k in sorted(server)]:
            yield {"type": None, "object": obj}
            await asyncio.sleep(0.1)
        yield LISTED
        await asyncio.Event().wait()

    watch = ShardWatch(RID, ASSIGNMENT)
    deleted: list[str] = []

    async def feed(event: Mapping[str, Any]) -> None:
        if event["type"] == "DELETED":
            deleted.append(event["object"]["metadata"]["name"])

    lead(watch, 0)
    consumer = consuming(slow_lister, watch, feed=feed)
    try:
        await asyncio.sleep(0.05)  # "a" listed, "b" not yet
        lead(watch, 1)  # the listing is cut: the stream starts again
        del server[f"{NAMESPACES[0][0]}/a"]  # "a" is deleted meanwhile
        await eventually(lambda: watch.covers(0) and watch.covers(1), timeout=5)
        assert deleted == ["a"]
    finally:
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)


@pytest.mark.parametrize("restarting", [False, True])
async def test_cancelling_the_stream_closes_kopfs_and_leaves_nothing_running(
    restarting: bool,
) -> None:
    watch = ShardWatch(RID, ASSIGNMENT)
    opened: list[str] = []
    closed: list[str] = []
    lead(watch, 0)
    consumer = consuming(noop_stream(opened, closed, closing=0.1), watch)
    await eventually(lambda: watch.covers(0), timeout=5)
    if restarting:  # cancelled while a restart closes the previous stream
        lead(watch, 1)
        await eventually(lambda: len(closed) == 1, timeout=5, interval=0.001)
        await asyncio.sleep(0.05)
    consumer.cancel()
    outcome = (await asyncio.gather(consumer, return_exceptions=True))[0]
    assert isinstance(outcome, asyncio.CancelledError), outcome
    assert len(opened) == len(closed) and len(opened) <= 2
    left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert not left, left
    assert not watch.covers(0)
