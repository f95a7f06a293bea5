"""The kopf shim's event handler with client-side selection: what it stores, forgets and
requests, event by event (the handler is called directly, without a cluster)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import kopf
import pytest_asyncio

import kopf_reconcile as kr
from kopf_reconcile.api import Request
from kopf_reconcile.cache import ObjectCache
from kopf_reconcile.integration import kopf_shim


def configmap(uid: str, created: str, team: str) -> dict[str, Any]:
    metadata = {
        "namespace": "ns",
        "name": "a",
        "uid": uid,
        "creationTimestamp": created,
        "labels": {"team": team},
    }
    return {"metadata": metadata, "data": {"team": team}}


class Handler:
    """The registration's on.event handler, its cache, and the requests the cache emitted."""

    def __init__(self, registration: Any, emitted: list[str]) -> None:
        self.registration = registration
        self.emitted = emitted

    @property
    def cache(self) -> ObjectCache:
        cache = self.registration.cache
        assert isinstance(cache, ObjectCache)
        return cache

    async def event(self, kind: str | None, body: dict[str, Any]) -> None:
        await self.registration.on_event({"type": kind, "object": body})


@pytest_asyncio.fixture
async def handler() -> AsyncIterator[Handler]:
    registry = kopf.OperatorRegistry()

    @kr.reconciler(
        "", "v1", "configmaps",
        tenancy=kr.Tenancy.TENANT_SCOPED,
        labels={"team": "a"},
        leader=None, fenced=None, metrics=None,
        registry=registry,
    )  # fmt: skip
    async def reconcile_team_a(req: kr.Request) -> None:
        pass

    registration = next(r for r in kopf_shim._registrations if r.registry is registry)
    emitted: list[str] = []

    async def emit(req: Request) -> None:
        emitted.append(req.entity_id)

    registration.cache = ObjectCache()
    feeding = asyncio.create_task(registration.cache.run(emit))
    await asyncio.sleep(0)
    try:
        yield Handler(registration, emitted)
    finally:
        feeding.cancel()
        registration.cache = None


async def test_the_deletion_of_an_object_never_selected_requests_nothing(
    handler: Handler,
) -> None:
    await handler.event(None, configmap("b", "2026-01-01T00:00:00Z", team="b"))  # listed
    await handler.event("DELETED", configmap("b", "2026-01-01T00:00:00Z", team="b"))
    assert handler.emitted == []
    await handler.event("ADDED", configmap("c", "2026-01-01T00:00:01Z", team="a"))
    await handler.event("DELETED", configmap("c", "2026-01-01T00:00:01Z", team="a"))
    assert handler.emitted == ["ns/a", "ns/a"]  # a selected one: stored, then gone


async def test_a_late_event_of_an_old_incarnation_leaving_the_selection_keeps_the_new_one(
    handler: Handler,
) -> None:
    await handler.event("ADDED", configmap("old", "2026-01-01T00:00:00Z", team="a"))
    await handler.event("ADDED", configmap("new", "2026-01-01T00:00:00Z", team="a"))
    # The old object's worker was late: its relabelling arrives after the new one exists.
    await handler.event("MODIFIED", configmap("old", "2026-01-01T00:00:00Z", team="b"))
    current = handler.cache.get("ns/a")
    assert current is not None and current["metadata"]["uid"] == "new"
    # The old incarnation is forgotten, not deleted: it comes back if it matches again.
    await handler.event("DELETED", configmap("new", "2026-01-01T00:00:00Z", team="a"))
    assert handler.cache.get("ns/a") is None
    await handler.event("MODIFIED", configmap("old", "2026-01-01T00:00:00Z", team="a"))
    current = handler.cache.get("ns/a")
    assert current is not None and current["metadata"]["uid"] == "old"


async def test_leaving_the_selection_looks_like_a_deletion_once(handler: Handler) -> None:
    await handler.event("ADDED", configmap("x", "2026-01-01T00:00:00Z", team="a"))
    await handler.event("MODIFIED", configmap("x", "2026-01-01T00:00:00Z", team="b"))
    assert handler.cache.get("ns/a") is None
    await handler.event("MODIFIED", configmap("x", "2026-01-01T00:00:00Z", team="c"))
    assert handler.emitted == ["ns/a", "ns/a"]  # stored, then gone; the next change is not ours
