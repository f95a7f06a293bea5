"""The shim's finalizer steps around a reconcile, without kopf running: added once before
the first reconcile (also while the cache has not shown the addition yet), removed only
after a finished cleanup of a deleting object that carries it, or of one that left the
selection while carrying it (a finalizer never blocks a deletion after a cleanup)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import kopf
import pytest
import pytest_asyncio

import kopf_reconcile as kr
from kopf_reconcile.cache import ObjectCache
from kopf_reconcile.integration import kopf_shim
from kopf_reconcile.integration.api_client import LazyApiClient
from kopf_reconcile.integration.fenced_client import ClientContext
from kopf_reconcile.integration.finalizers import FinalizerWriter, Finalizing, finalizer_name
from kopf_reconcile.integration.related import RelatedObjects

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


def configmap(
    *, finalizers: list[str] | None = None, deleting: bool = False, selected: bool = True
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": "site", "namespace": "ns", "uid": "uid-1"}
    metadata["labels"] = {"app": "site"} if selected else {}
    if finalizers is not None:
        metadata["finalizers"] = finalizers
    if deleting:
        metadata["deletionTimestamp"] = "2026-12-01T04:00:00Z"
    return {"metadata": metadata}


@pytest_asyncio.fixture
async def shim() -> AsyncIterator[Any]:
    outcomes: list[object] = []
    seen: list[bool] = []

    @kr.reconciler(
        "", "v1", "configmaps",
        tenancy=kr.Tenancy.TENANT_SCOPED, finalizer=NAME, labels={"app": "site"},
        leader=None, fenced=None, metrics=None, registry=kopf.OperatorRegistry(),
    )  # fmt: skip
    async def reconcile_site(req: kr.Request) -> object:
        seen.append(kr.is_deleting(kr.cached(req)))
        return outcomes.pop(0) if outcomes else None

    registration = kopf_shim._registrations[-1]
    registration.cache = ObjectCache()
    registration.related = RelatedObjects((), None)
    registration.client_context = ClientContext(LazyApiClient(), field_manager="reconcile_site")
    registration.finalizing = Finalizing(RecordingWriter())
    registration.writes = registration.finalizing.writer.writes
    registration.outcomes = outcomes
    registration.seen = seen
    registration.requests = []

    async def emit(request: kr.Request) -> None:
        registration.requests.append(request.entity_id)

    feeding = asyncio.create_task(registration.cache.run(emit))
    yield registration
    feeding.cancel()
    await asyncio.gather(feeding, return_exceptions=True)
    kopf_shim._registrations.remove(registration)


async def test_the_finalizer_is_added_once_though_the_cache_shows_it_late(shim: Any) -> None:
    request = kr.Request("ns/site")
    shim.cache.keep("ns/site", configmap())
    await shim.reconcile(request)
    await shim.reconcile(request)  # the cache has not shown the addition yet
    assert shim.writes == [("add", "uid-1")]
    shim.cache.keep("ns/site", configmap(finalizers=[NAME]))  # the echo
    await shim.reconcile(request)
    # Someone strips it by hand: it is added again.
    shim.cache.keep("ns/site", configmap(finalizers=[]))
    await shim.reconcile(request)
    assert shim.writes == [("add", "uid-1"), ("add", "uid-1")]
    assert shim.seen == [False] * 4


async def test_the_finalizer_goes_only_after_a_finished_cleanup(shim: Any) -> None:
    request = kr.Request("ns/site")
    shim.cache.keep("ns/site", configmap(finalizers=[NAME], deleting=True))
    shim.outcomes.extend([kr.Result(requeue_after=5), "not a result"])
    await shim.reconcile(request)  # not finished
    await shim.reconcile(request)  # a programmer error (the Loop dead-letters it)
    assert shim.writes == []
    await shim.reconcile(request)  # None: done
    assert shim.writes == [("remove", "uid-1")]
    shim.outcomes.append(kr.Result())
    await shim.reconcile(request)  # a Result without requeue_after: done too
    assert shim.writes == [("remove", "uid-1")] * 2
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
    assert shim.writes == []


async def _none() -> None:
    return None


async def test_an_object_that_left_the_selection_with_the_finalizer_is_released(
    shim: Any,
) -> None:
    request = kr.Request("ns/site")
    await shim.on_event({"type": "ADDED", "object": configmap(finalizers=[NAME])})
    await shim.on_event(
        {"type": "MODIFIED", "object": configmap(finalizers=[NAME], selected=False)}
    )
    assert shim.requests == ["ns/site", "ns/site"]  # the second one: gone for the reconciler
    shim.outcomes.append(RuntimeError("cleanup failed"))
    shim.fn = _raising_or_none(shim.outcomes)
    with pytest.raises(RuntimeError):
        await shim.reconcile(request)
    assert shim.writes == []  # not before a successful cleanup
    await shim.reconcile(request)
    assert shim.writes == [("remove", "uid-1")]
    await shim.reconcile(request)  # released once
    assert shim.writes == [("remove", "uid-1")]


async def test_an_unselected_object_carrying_the_finalizer_is_reconciled_to_release_it(
    shim: Any,
) -> None:
    """Say the selection changed in the code since the finalizer was added."""
    request = kr.Request("ns/site")
    await shim.on_event({"type": "ADDED", "object": configmap(selected=False)})
    assert shim.requests == []  # never selected: not its business...
    await shim.on_event(
        {"type": "MODIFIED", "object": configmap(finalizers=[NAME], selected=False)}
    )
    assert shim.requests == ["ns/site"]  # ... unless it carries this reconciler's finalizer
    await shim.reconcile(request)
    assert shim.seen == [True] and shim.writes == [("remove", "uid-1")]
    # Deleted meanwhile: nothing left to release.
    await shim.on_event(
        {"type": "MODIFIED", "object": configmap(finalizers=[NAME], selected=False)}
    )
    await shim.on_event({"type": "DELETED", "object": configmap(finalizers=[NAME], selected=False)})
    await shim.reconcile(request)
    assert shim.writes == [("remove", "uid-1")]


def _raising_or_none(outcomes: list[object]) -> Any:
    async def reconcile(req: kr.Request) -> None:
        outcome = outcomes.pop(0) if outcomes else None
        if isinstance(outcome, Exception):
            raise outcome

    return reconcile


@pytest.mark.parametrize(
    ("option", "group", "name"),
    [
        (True, "example.com", "example.com/websites.example.com-reconcile-website"),
        (True, "", "kopf-reconcile/websites.example.com-reconcile-website"),
        ("example.com/cleanup", "", "example.com/cleanup"),
        (None, "example.com", None),
        (False, "example.com", None),
    ],
)
def test_the_finalizer_option_names_a_finalizer(option: object, group: str, name: str) -> None:
    assert finalizer_name(option, group, "websites.example.com-reconcile-website") == name


@pytest.mark.parametrize("option", ["Example.com/x", "example.com/", "a/b/c", "x" * 64, 1])
def test_a_bad_finalizer_name_fails_at_decoration(option: object) -> None:
    with pytest.raises(kr.ConfigError, match="finalizer must be"):
        kr.reconciler(
            "", "v1", "configmaps", tenancy=kr.Tenancy.TENANT_SCOPED, finalizer=option,  # type: ignore[arg-type]
            registry=kopf.OperatorRegistry(),
        )(lambda req: None)  # fmt: skip


async def test_a_finalizer_stripped_before_any_reconcile_saw_it_is_added_again() -> None:
    finalizing = Finalizing(RecordingWriter())

    async def cleanup() -> None:
        return None

    await finalizing.reconcile(configmap(), "ns/site", cleanup)
    # The add's echo reaches the watch, then another writer strips the finalizer, before any
    # reconcile saw either (a merge patch of the finalizers from an older body).
    finalizing.observe("ns/site", configmap(finalizers=[NAME]), deleted=False, selected=True)
    finalizing.observe("ns/site", configmap(finalizers=["other/x"]), deleted=False, selected=True)
    await finalizing.reconcile(configmap(finalizers=["other/x"]), "ns/site", cleanup)
    writer = finalizing.writer
    assert isinstance(writer, RecordingWriter)
    assert writer.writes == [("add", "uid-1"), ("add", "uid-1")]


def test_two_reconcilers_of_a_kind_cannot_share_a_finalizer() -> None:
    registry = kopf.OperatorRegistry()
    common = {"tenancy": kr.Tenancy.TENANT_SCOPED, "leader": None, "fenced": None,
              "metrics": None, "registry": registry, "finalizer": NAME}  # fmt: skip

    @kr.reconciler("", "v1", "configmaps", labels={"app": "a"}, reconciler_id="a", **common)
    async def reconcile_a(req: kr.Request) -> None:
        return None

    with pytest.raises(kr.ConfigError, match="already the finalizer of reconciler 'a'"):

        @kr.reconciler("", "v1", "configmaps", labels={"app": "b"}, reconciler_id="b", **common)
        async def reconcile_b(req: kr.Request) -> None:
            return None

    @kr.reconciler("", "v1", "secrets", reconciler_id="c", **common)  # another kind: fine
    async def reconcile_c(req: kr.Request) -> None:
        return None
