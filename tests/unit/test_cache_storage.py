"""ObjectCache storage: bodies kept serialised, never shared with the watch or a reconcile."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Mapping
from typing import Any

import pytest

from kopf_reconcile.cache import ObjectCache
from support import feeding


def device(name: str, generation: int = 1) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "generation": generation,
            "creationTimestamp": "2026-12-01T07:00:00Z",
        },
        "spec": {"desired": "on", "ports": [1, 2]},
    }


async def test_the_cache_keeps_no_reference_to_the_watch_s_body() -> None:
    cache = ObjectCache()
    task, _ = await feeding(cache)
    watched = device("a")
    await cache.update("ns/a", watched)
    watched["spec"]["desired"] = "changed by the watch's owner"
    watched["spec"]["ports"].append(3)
    first, second = cache.get("ns/a"), cache.get("ns/a")
    assert first == device("a") == second
    assert first is not second
    assert first is not None and second is not None
    assert first["spec"]["ports"] is not second["spec"]["ports"]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize(
    "transform",
    [
        pytest.param(lambda body: types.MappingProxyType(dict(body)), id="mapping-proxy"),
        pytest.param(lambda body: {**body, "unpicklable": lambda: None}, id="unpicklable-value"),
    ],
)
async def test_bodies_that_cannot_be_pickled_are_kept_and_copied(
    transform: Any,
) -> None:
    cache = ObjectCache(transform=transform)
    task, requests = await feeding(cache)
    await cache.update("ns/a", device("a", generation=1))
    await cache.update("ns/a", device("a", generation=1), skip_same_generation=True)
    assert requests == ["ns/a"]  # the generation is read from a body kept as it is, too
    got = cache.get("ns/a")
    assert isinstance(got, dict)
    assert got["spec"] == device("a")["spec"]
    got["spec"]["desired"] = "tampered"
    again = cache.get("ns/a")
    assert isinstance(again, Mapping) and again["spec"]["desired"] == "on"
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
