"""The shim's finalizer steps around a reconcile, without kopf running: added once before
the first reconcile (also while the cache has not shown the addition yet), removed only
after a finished cleanup of a deleting object that carries it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf
import pytest

import kopf_reconcile as kr
from kopf_reconcile.cache import ObjectCache
from kopf_reconcile.integration import kopf_shim
from kopf_reconcile.integration.finalizers import FinalizerWriter

NAME = "example.com/cleanup"


class RecordingWriter(FinalizerWriter):
    """Records the finalizer writes instead of sending them."""

    def __init__(self) -> None:
        super().__init__(NAME, "", "v1", "configmaps")
        self.writes: list[tuple[str, str]] = []

    async def add(self, body: Mapping[str, Any]) -> None:
        self.writes.append(("add", body["metadata"]["uid"]))

    async def remove(self, body: Mapping[str, Any]) -> None:
        self.writes.append(("remove", body["metadata"]["uid"]))


def configmap(*, finalizers: list[str] | None = None, deleting: bool = False) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": "site", "namespace": "ns", "uid": "uid-1"}
    if finalizers is not None:
        metadata["finalizers"] = finalizers
    if deleting:
        metadata["deletionTimestamp"] = "2026-12-01T04:00:00Z"
    return {"metadata": metadata}


@pytest.fixture
def shim() -> Any:
    outcomes: list[object] = []
    seen: list[bool] = []

    @kr.reconciler(
        "", "v1", "configmaps",
        tenancy=kr.Tenancy.TENANT_SCOPED, finalizer=NAME,
        leader=None, fenced=None, metrics=None, registry=kopf.OperatorRegistry(),
    )  # fmt: skip
    async def reconcile_site(req: kr.Request) -> object:
        seen.append(kr.is_deleting(kr.cached(req)))
        return outcomes.pop(0) if outcomes else None

    registration = kopf_shim._registrations[-1]
    registration.cache = ObjectCache()
    registration.finalizers = RecordingWriter()
    registration.outcomes = outcomes
    registration.seen = seen
    yield registration
    kopf_shim._registrations.remove(registration)


async def test_the_finalizer_is_added_once_though_the_cache_shows_it_late(shim: Any) -> None:
    request = kr.Request("ns/site")
    shim.cache.keep("ns/site", configmap())
    await shim.reconcile(request)
    await shim.reconcile(request)  # the cache has not shown the addition yet
    assert shim.finalizers.writes == [("add", "uid-1")]
    shim.cache.keep("ns/site", configmap(finalizers=[NAME]))  # the echo
    await shim.reconcile(request)
    # Someone strips it by hand: it is added again.
    shim.cache.keep("ns/site", configmap(finalizers=[]))
    await shim.reconcile(request)
    assert shim.finalizers.writes == [("add", "uid-1"), ("add", "uid-1")]
    assert shim.seen == [False] * 4


async def test_the_finalizer_goes_only_after_a_finished_cleanup(shim: Any) -> None:
    request = kr.Request("ns/site")
    shim.cache.keep("ns/site", configmap(finalizers=[NAME], deleting=True))
    shim.outcomes.extend([kr.Result(requeue_after=5), "not a result"])
    await shim.reconcile(request)  # not finished
    await shim.reconcile(request)  # a programmer error (the Loop dead-letters it)
    assert shim.finalizers.writes == []
    await shim.reconcile(request)  # None: done
    assert shim.finalizers.writes == [("remove", "uid-1")]
    shim.outcomes.append(kr.Result())
    await shim.reconcile(request)  # a Result without requeue_after: done too
    assert shim.finalizers.writes == [("remove", "uid-1")] * 2
    assert shim.seen == [True] * 4


async def test_a_failed_cleanup_keeps_the_finalizer_and_others_are_never_touched(
    shim: Any,
) -> None:
    request = kr.Request("ns/site")
    shim.cache.keep("ns/site", configmap(finalizers=[NAME], deleting=True))

    async def failing(req: kr.Request) -> None:
        raise kr.PermanentError("cannot clean up")

    shim.fn = failing
    with pytest.raises(kr.PermanentError):
        await shim.reconcile(request)
    # Deleting with another finalizer only, or already gone: nothing to add or remove.
    shim.fn = lambda req: _none()
    shim.cache.keep("ns/site", configmap(finalizers=["other/keep"], deleting=True))
    await shim.reconcile(request)
    shim.cache.drop("ns/site", configmap())
    await shim.reconcile(request)
    assert shim.finalizers.writes == []


async def _none() -> None:
    return None
