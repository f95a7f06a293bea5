"""An object recreated within the same second: creation times tie, uids tell them apart."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest_asyncio

from kopf_reconcile.api import Request
from kopf_reconcile.cache import ObjectCache
from support import eventually

SECOND = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:00:05Z"


def body(uid: str, created: str = SECOND, value: str = "") -> dict[str, Any]:
    meta = {"namespace": "ns", "name": "a", "uid": uid, "creationTimestamp": created}
    return {"metadata": meta, "spec": {"v": value or uid}}


def current_uid(cache: ObjectCache) -> str | None:
    current = cache.get("ns/a")
    return None if current is None else str(current["metadata"]["uid"])


@pytest_asyncio.fixture
async def fed() -> AsyncIterator[tuple[ObjectCache, list[str]]]:
    """A cache whose requests are collected, as a running Loop would take them."""
    cache, emitted = ObjectCache(), []

    async def emit(req: Request) -> None:
        emitted.append(req.entity_id)

    task = asyncio.create_task(cache.run(emit))
    yield cache, emitted
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_late_modified_and_deleted_of_the_old_uid_keep_the_new_one(
    fed: tuple[ObjectCache, list[str]],
) -> None:
    cache, emitted = fed
    await cache.update("ns/a", body("old"))
    await cache.update("ns/a", body("new"))  # recreated within the same second
    await cache.update("ns/a", body("old", value="late"))  # the old uid's worker lags behind
    assert current_uid(cache) == "new"
    await cache.remove("ns/a", body("old", value="late"))
    current = cache.get("ns/a")
    assert current is not None, "the live object was lost with the old incarnation"
    assert current == body("new")
    assert "ns/a" in cache and len(cache) == 1
    assert emitted == ["ns/a"] * 4  # every event still asks for a reconcile
    emitted.clear()
    cache.request_resync()  # a resync still knows the object
    await eventually(lambda: emitted == ["ns/a"], timeout=5)


async def test_on_a_creation_time_tie_the_uid_seen_later_is_current(
    fed: tuple[ObjectCache, list[str]],
) -> None:
    cache, _ = fed
    await cache.update("ns/a", body("first"))
    await cache.update("ns/a", body("second"))
    await cache.update("ns/a", body("first", value="late"))
    assert current_uid(cache) == "second"
    await cache.update("ns/a", body("second", value="updated"))
    assert cache.get("ns/a") == body("second", value="updated")


async def test_a_later_creation_time_wins_whatever_the_order_seen(
    fed: tuple[ObjectCache, list[str]],
) -> None:
    cache, _ = fed
    await cache.update("ns/a", body("new", LATER))
    await cache.update("ns/a", body("old", SECOND))  # seen later, but created earlier
    assert current_uid(cache) == "new"


async def test_deleting_the_current_uid_falls_back_to_another_live_one(
    fed: tuple[ObjectCache, list[str]],
) -> None:
    cache, _ = fed
    await cache.update("ns/a", body("old", SECOND, "old body"))
    await cache.update("ns/a", body("new", LATER))
    await cache.remove("ns/a", body("new", LATER))  # its DELETED came before the old one's
    assert cache.get("ns/a") == body("old", SECOND, "old body")
    await cache.remove("ns/a", body("old", SECOND))
    assert cache.get("ns/a") is None
    assert "ns/a" not in cache and len(cache) == 0


async def test_recreations_leave_nothing_behind_their_deletions(
    fed: tuple[ObjectCache, list[str]],
) -> None:
    """A long churn of same-second recreations with late events: only live uids count."""
    cache, _ = fed
    await cache.update("ns/a", body("u0"))
    for i in range(1, 500):
        await cache.update("ns/a", body(f"u{i}"))
        await cache.update("ns/a", body(f"u{i - 1}", value="late"))
        await cache.remove("ns/a", body(f"u{i - 1}"))
        await cache.update("ns/a", body(f"u{i - 1}", value="later still"))  # ignored: deleted
        assert current_uid(cache) == f"u{i}"
    await cache.remove("ns/a", body("u499"))
    # Had any deleted incarnation stayed behind, the fallback would return it here.
    assert cache.get("ns/a") is None
    assert len(cache) == 0
