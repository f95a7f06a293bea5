"""What the object cache keeps (its transform) and when an update requests a reconcile
(the generation predicate), on the cache itself and through the kopf shim."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator, Mapping
from typing import Any

import kopf
import pytest

import kopf_reconcile as kr
from kopf_reconcile.cache import LAST_APPLIED, ObjectCache, strip_managed_fields
from kopf_reconcile.integration import kopf_shim
from kopf_reconcile.integration import settings as process_settings
from kopf_reconcile.integration.settings import Settings
from support import eventually

MANAGED = [{"manager": "kubectl", "operation": "Apply", "fieldsV1": {"f:spec": {"f:x": {}}}}]


def device(name: str = "a", *, generation: int | None = 1, phase: str = "") -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": "ns",
        "uid": f"uid-{name}",
        "labels": {"team": "a"},
        "annotations": {LAST_APPLIED: '{"spec": {"x": 1}}', "note": "kept"},
        "managedFields": MANAGED,
    }
    if generation is not None:
        metadata["generation"] = generation
    return {"metadata": metadata, "spec": {"x": 1}, "status": {"phase": phase}}


class Recorder:
    def __init__(self) -> None:
        self.requests: list[str] = []

    async def emit(self, request: kr.Request) -> None:
        self.requests.append(request.entity_id)


async def fed(cache: ObjectCache) -> tuple[asyncio.Task[None], Recorder]:
    recorder = Recorder()
    task = asyncio.create_task(cache.run(recorder.emit))
    await asyncio.sleep(0)
    return task, recorder


# -- the transform ---------------------------------------------------------------------


async def test_by_default_the_cache_drops_managed_fields_and_the_last_applied_copy() -> None:
    cache = ObjectCache()
    feeding, _ = await fed(cache)
    given = device()
    untouched = copy.deepcopy(given)
    await cache.update("ns/a", given)
    kept = cache.get("ns/a")
    assert kept is not None
    assert "managedFields" not in kept["metadata"]
    assert kept["metadata"]["annotations"] == {"note": "kept"}
    assert kept["metadata"]["labels"] == {"team": "a"}
    assert kept["spec"] == {"x": 1} and kept["status"] == {"phase": ""}
    assert given == untouched, "the transform changed the watch's own body"
    feeding.cancel()


def test_the_default_transform_returns_a_body_with_nothing_to_drop_as_it_is() -> None:
    body = {"metadata": {"name": "a", "annotations": {"note": "x"}}, "spec": {}}
    assert strip_managed_fields(body) is body
    assert strip_managed_fields({"spec": {}}) == {"spec": {}}


async def test_transform_none_keeps_bodies_whole_and_a_callable_replaces_the_default() -> None:
    whole = ObjectCache(transform=None)
    feeding, _ = await fed(whole)
    await whole.update("ns/a", device())
    assert whole.get("ns/a") == device()

    def only_spec(body: Mapping[str, Any]) -> Mapping[str, Any]:
        return {"metadata": body["metadata"], "spec": body["spec"]}

    custom = ObjectCache(transform=only_spec)
    feeding2, _ = await fed(custom)
    await custom.update("ns/a", device())
    kept = custom.get("ns/a")
    assert kept is not None and "status" not in kept
    assert kept["metadata"]["managedFields"] == MANAGED  # the default no longer applies
    feeding.cancel()
    feeding2.cancel()


# -- the generation predicate ----------------------------------------------------------


async def test_same_generation_updates_are_stored_but_request_nothing_when_asked() -> None:
    cache = ObjectCache()
    feeding, recorder = await fed(cache)
    await cache.update("ns/a", device(generation=1), skip_same_generation=True)  # first: passes
    await cache.update("ns/a", device(generation=1, phase="Ready"), skip_same_generation=True)
    assert recorder.requests == ["ns/a"]
    kept = cache.get("ns/a")
    assert kept is not None and kept["status"] == {"phase": "Ready"}  # the cache is current
    await cache.update("ns/a", device(generation=2, phase="Ready"), skip_same_generation=True)
    assert recorder.requests == ["ns/a", "ns/a"]
    # Without the option, or without a generation, every update requests.
    await cache.update("ns/a", device(generation=2, phase="Done"))
    await cache.update("ns/b", device("b", generation=None), skip_same_generation=True)
    await cache.update("ns/b", device("b", generation=None, phase="x"), skip_same_generation=True)
    assert recorder.requests == ["ns/a"] * 3 + ["ns/b"] * 2
    # A resync re-observes every object whatever its generation.
    cache.request_resync()
    await eventually(lambda: len(recorder.requests) == 7)
    feeding.cancel()


# -- through the kopf shim --------------------------------------------------------------


@pytest.fixture
def shim_settings() -> Iterator[None]:
    process_settings.install(Settings.load({}))
    yield
    process_settings.install(None)


def test_the_shim_refuses_a_cache_transform_that_is_not_callable() -> None:
    with pytest.raises(kr.ConfigError, match="cache_transform"):
        kr.reconciler(
            "", "v1", "configmaps", tenancy=kr.Tenancy.TENANT_SCOPED,
            cache_transform="strip", registry=kopf.OperatorRegistry(),  # type: ignore[arg-type]
        )  # fmt: skip
    with pytest.raises(kr.ConfigError, match="generation_changed"):
        kr.reconciler(
            "", "v1", "configmaps", tenancy=kr.Tenancy.TENANT_SCOPED,
            generation_changed="yes", registry=kopf.OperatorRegistry(),  # type: ignore[arg-type]
        )  # fmt: skip


@pytest.mark.parametrize("generation_changed", [False, True])
async def test_the_shim_trims_its_cache_and_skips_own_status_updates_when_asked(
    shim_settings: None, generation_changed: bool
) -> None:
    registry = kopf.OperatorRegistry()
    seen: list[dict[str, Any] | None] = []

    @kr.reconciler(
        "example.com", "v1", "devices", tenancy=kr.Tenancy.TENANT_SCOPED,
        leader=None, fenced=None, metrics=None, generation_changed=generation_changed,
        reconciler_id=f"trimming-{str(generation_changed).lower()}", registry=registry,
    )  # fmt: skip
    async def reconcile_device(req: kr.Request) -> None:
        seen.append(kr.cached(req))

    registration = next(r for r in kopf_shim._registrations if r.registry is registry)
    await registration.startup(settings=kopf.OperatorSettings())
    try:
        await registration.on_event(event={"type": "ADDED", "object": device()})
        await eventually(lambda: len(seen) == 1)
        first = seen[0]
        assert first is not None and "managedFields" not in first["metadata"]
        assert LAST_APPLIED not in first["metadata"]["annotations"]
        # The reconciler's own status patch comes back as a MODIFIED event, same generation.
        status_patch = device(phase="Ready")
        await registration.on_event(event={"type": "MODIFIED", "object": status_patch})
        if generation_changed:
            await asyncio.sleep(0.1)
            assert len(seen) == 1, "a status-only update triggered a reconcile"
        else:
            await eventually(lambda: len(seen) == 2)  # every change triggers by default
        spec_change = device(generation=2, phase="Ready")
        spec_change["spec"] = {"x": 2}
        await registration.on_event(event={"type": "MODIFIED", "object": spec_change})
        await eventually(lambda: seen[-1] is not None and seen[-1]["spec"] == {"x": 2})
        await registration.on_event(event={"type": "DELETED", "object": spec_change})
        await eventually(lambda: seen[-1] is None)  # deletions always pass
    finally:
        await registration.cleanup()
