"""An object deleted and created again under its name: late events of the old one."""

from __future__ import annotations

from typing import Any

from kopf_reconcile.cache import ObjectCache
from support import feeding


def body(uid: str, created: str, value: str = "") -> dict[str, Any]:
    meta = {"namespace": "ns", "name": "a", "uid": uid, "creationTimestamp": created}
    return {"metadata": meta, "spec": {"v": value or uid}}


async def test_a_late_deleted_of_the_old_incarnation_keeps_the_new_one() -> None:
    cache = ObjectCache()
    task, emitted = await feeding(cache)
    try:
        await cache.update("ns/a", body("old", "2026-01-01T00:00:00Z"))
        await cache.update("ns/a", body("new", "2026-01-01T00:00:05Z"))  # its worker ran first
        await cache.remove("ns/a", body("old", "2026-01-01T00:00:00Z"))  # the old DELETED
        current = cache.get("ns/a")
        assert current is not None and current["metadata"]["uid"] == "new"
        assert emitted == ["ns/a"] * 3  # every event still asks for a reconcile
    finally:
        task.cancel()


async def test_late_events_of_a_deleted_incarnation_are_ignored() -> None:
    cache = ObjectCache()
    task, _ = await feeding(cache)
    try:
        await cache.update("ns/a", body("old", "2026-01-01T00:00:00Z"))
        await cache.remove("ns/a", body("old", "2026-01-01T00:00:00Z"))
        await cache.update("ns/a", body("old", "2026-01-01T00:00:00Z", "late"))  # a straggler
        assert cache.get("ns/a") is None
        await cache.update("ns/a", body("new", "2026-01-01T00:00:05Z"))
        assert cache.get("ns/a") is not None
    finally:
        task.cancel()


async def test_an_older_incarnation_never_overwrites_a_newer_one() -> None:
    cache = ObjectCache()
    task, _ = await feeding(cache)
    try:
        await cache.update("ns/a", body("new", "2026-01-01T00:00:05Z"))
        await cache.update("ns/a", body("old", "2026-01-01T00:00:00Z", "late"))
        current = cache.get("ns/a")
        assert current is not None and current["metadata"]["uid"] == "new"
    finally:
        task.cancel()


async def test_a_deletion_without_a_body_forgets_whatever_is_cached() -> None:
    cache = ObjectCache()
    task, _ = await feeding(cache)
    try:
        await cache.update("ns/a", body("x", "2026-01-01T00:00:00Z"))
        await cache.remove("ns/a")  # e.g. it left the label selection
        assert cache.get("ns/a") is None
        await cache.update("ns/a", body("x", "2026-01-01T00:00:00Z"))  # and it may come back
        assert cache.get("ns/a") is not None
    finally:
        task.cancel()
