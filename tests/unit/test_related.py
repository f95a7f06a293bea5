"""Owned and watched resources: which child events request which owner, what kr.owned reads,
and that a burst of child events is one reconcile of the owner."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest

import kopf_reconcile as kr
from kopf_reconcile.cache import ObjectCache, strip_managed_fields
from kopf_reconcile.integration import kopf_shim
from kopf_reconcile.integration.related import RelatedObjects, parse_related, serving_related
from support import eventually

OWNER = ("example.com", "websites")
PAGES = ("", "configmaps")


def website(name: str, uid: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": uid}}


def page(name: str, owner_uid: str | None, labels: dict[str, str] | None = None) -> dict[str, Any]:
    references = (
        [] if owner_uid is None else [{"name": "site", "uid": owner_uid, "controller": True}]
    )
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "labels": labels if labels is not None else {"managed": "yes"},
            "ownerReferences": references,
        }
    }


def event(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"type": kind, "object": body}


class Owners:
    """An owner cache fed to a recorder, as a Loop would run it."""

    def __init__(self) -> None:
        self.cache = ObjectCache()
        self.requests: list[str] = []

    async def __aenter__(self) -> Owners:
        self._task = asyncio.create_task(self.cache.run(self._emit))
        return self

    async def __aexit__(self, *_: object) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _emit(self, request: kr.Request) -> None:
        self.requests.append(request.entity_id)


def related(**options: Any) -> RelatedObjects:
    return RelatedObjects(parse_related(options.get("owns"), options.get("watches"), OWNER), None)


async def test_a_child_event_requests_its_controller_owner_only_when_held() -> None:
    children = related(owns=[kr.Owns("", "v1", "configmaps", labels={"managed": "yes"})])
    async with Owners() as owners:
        owners.cache.keep("ns/site", website("site", "uid-1"))
        await children.on_event(PAGES, event("ADDED", page("p", "uid-1")), owners.cache)
        await children.on_event(PAGES, event("MODIFIED", page("p", "uid-1")), owners.cache)
        await children.on_event(PAGES, event("DELETED", page("p", "uid-1")), owners.cache)
        assert owners.requests == ["ns/site"] * 3
        # An older incarnation's child, an unowned object, one outside the selection: nothing.
        await children.on_event(PAGES, event("ADDED", page("q", "uid-0")), owners.cache)
        await children.on_event(PAGES, event("ADDED", page("r", None)), owners.cache)
        await children.on_event(PAGES, event("ADDED", page("s", "uid-1", {})), owners.cache)
        await children.on_event(PAGES, event("DELETED", page("s", "uid-1", {})), owners.cache)
        assert owners.requests == ["ns/site"] * 3
        assert len(children) == 1  # q only: s was never cached, p is deleted


async def test_a_child_leaving_the_selection_requests_its_owner_once_and_is_forgotten() -> None:
    children = related(owns=[kr.Owns("", "v1", "configmaps", labels={"managed": "yes"})])
    async with Owners() as owners:
        owners.cache.keep("ns/site", website("site", "uid-1"))
        await children.on_event(PAGES, event("ADDED", page("p", "uid-1")), owners.cache)
        await children.on_event(PAGES, event("MODIFIED", page("p", "uid-1", {})), owners.cache)
        await children.on_event(PAGES, event("MODIFIED", page("p", "uid-1", {})), owners.cache)
        assert owners.requests == ["ns/site"] * 2
        assert len(children) == 0


async def test_owned_returns_the_cached_children_of_the_current_incarnation() -> None:
    children = related(owns=[("", "v1", "configmaps")])
    async with Owners() as owners:
        # A child listed before its owner is indexed all the same.
        await children.on_event(PAGES, event("ADDED", page("early", "uid-1")), owners.cache)
        owners.cache.keep("ns/site", website("site", "uid-1"))
        await children.on_event(PAGES, event("ADDED", page("late", "uid-1")), owners.cache)
        await children.on_event(PAGES, event("ADDED", page("stale", "uid-0")), owners.cache)
        with serving_related(children, owners.cache):
            names = [c["metadata"]["name"] for c in kr.owned(kr.Request("ns/site"))]
            assert names == ["early", "late"]
            assert kr.owned(kr.Request("ns/gone")) == []
        await children.on_event(PAGES, event("DELETED", page("early", "uid-1")), owners.cache)
        with serving_related(children, owners.cache):
            assert [c["metadata"]["name"] for c in kr.owned(kr.Request("ns/site"))] == ["late"]
    with pytest.raises(LookupError):
        kr.owned(kr.Request("ns/site"))


async def test_a_watched_object_requests_what_map_to_returns_among_the_held_objects() -> None:
    def sites(body: Any) -> list[object]:
        return ["ns/site", kr.Request("ns/unknown")]

    watched = related(watches=[kr.Watches("", "v1", "secrets", map_to=sites)])
    async with Owners() as owners:
        owners.cache.keep("ns/site", website("site", "uid-1"))
        secret = {"metadata": {"name": "tls", "namespace": "ns", "uid": "uid-tls"}}
        await watched.on_event(("", "secrets"), event("ADDED", secret), owners.cache)
        await watched.on_event(("", "secrets"), event("DELETED", secret), owners.cache)
        assert owners.requests == ["ns/site", "ns/site"]
        assert len(watched) == 0  # watched objects are not cached


async def test_a_burst_of_child_events_is_one_rerun_of_the_running_owner_reconcile() -> None:
    children = related(owns=[("", "v1", "configmaps")])
    owners = ObjectCache()
    started, release = asyncio.Event(), asyncio.Event()
    calls: list[str] = []

    async def reconcile(req: kr.Request) -> None:
        calls.append(req.entity_id)
        started.set()
        await release.wait()

    loop = kr.Builder(reconcile, kr.Tenancy.TENANT_SCOPED).with_trigger(owners).build()
    async with loop:
        await owners.update("ns/site", website("site", "uid-1"))
        await started.wait()
        for i in range(50):
            await children.on_event(PAGES, event("ADDED", page(f"p{i}", "uid-1")), owners)
        release.set()
        await eventually(lambda: len(calls) == 2)
        # A later object's reconcile comes after anything the burst could still cause.
        await owners.update("ns/later", website("later", "uid-2"))
        await eventually(lambda: "ns/later" in calls)
        assert calls == ["ns/site", "ns/site", "ns/later"]


@pytest.mark.parametrize(
    ("owns", "watches", "message"),
    [
        ("configmaps", None, "owns must be a list"),
        (["configmaps"], None, "owns entries must be kr.Owns"),
        ([kr.Watches("", "v1", "secrets", map_to=list)], None, "owns entries must be kr.Owns"),
        (None, [kr.Owns("", "v1", "secrets")], "watches entries must be kr.Watches"),
        (None, [kr.Watches("", "v1", "secrets", map_to=None)], "map_to must be a callable"),  # type: ignore[arg-type]
        ([("", "", "configmaps")], None, "owns version must be a non-empty string"),
        ([kr.Owns("", "v1", "configmaps", labels={"a": 1})], None, "owns labels must map"),  # type: ignore[dict-item]
        ([("example.com", "v1", "websites")], None, "the reconciled resource itself"),
        ([("", "v1", "secrets")], [kr.Watches("", "v1", "secrets", map_to=list)], "more than once"),
    ],
)
def test_bad_owns_and_watches_fail_at_decoration(owns: Any, watches: Any, message: str) -> None:
    with pytest.raises(kr.ConfigError, match=message):
        parse_related(owns, watches, OWNER)


def test_readiness_covers_the_owned_and_watched_resources() -> None:
    registry = kopf.OperatorRegistry()

    @kr.reconciler(
        "example.com", "v1", "websites",
        tenancy=kr.Tenancy.TENANT_SCOPED,
        owns=[("", "v1", "configmaps")],
        watches=[kr.Watches("", "v1", "secrets", map_to=list)],
        registry=registry,
    )  # fmt: skip
    async def reconcile_website(req: kr.Request) -> None:
        return None

    assert kopf_shim.watched_resources(registry) == [
        ("example.com", "v1", "websites"),
        ("", "v1", "configmaps"),
        ("", "v1", "secrets"),
    ]


async def test_children_are_cached_through_the_reconcilers_cache_transform() -> None:
    children = RelatedObjects(
        parse_related([("", "v1", "configmaps")], None, OWNER), strip_managed_fields
    )
    async with Owners() as owners:
        owners.cache.keep("ns/site", website("site", "uid-1"))
        child = page("p", "uid-1")
        child["metadata"]["managedFields"] = [{"manager": "kubectl"}]
        await children.on_event(PAGES, event("ADDED", child), owners.cache)
        with serving_related(children, owners.cache):
            (cached,) = kr.owned(kr.Request("ns/site"))
        assert "managedFields" not in cached["metadata"]
        assert "managedFields" in child["metadata"]  # the watch's body is left alone


async def test_a_swept_deletion_with_the_identity_only_finds_the_owner_from_the_cache() -> None:
    children = related(owns=[kr.Owns("", "v1", "configmaps", labels={"managed": "yes"})])
    async with Owners() as owners:
        owners.cache.keep("ns/site", website("site", "uid-1"))
        await children.on_event(PAGES, event("ADDED", page("p", "uid-1")), owners.cache)
        identity = {"metadata": {"name": "p", "namespace": "ns", "uid": "uid-p"}}
        await children.on_event(PAGES, event("DELETED", identity), owners.cache)
        assert owners.requests == ["ns/site", "ns/site"]
        assert len(children) == 0


async def test_a_child_whose_controller_moves_or_goes_requests_its_former_owner_too() -> None:
    children = related(owns=[("", "v1", "configmaps")])

    def child(owner: str | None, uid: str | None) -> dict[str, Any]:
        body = page("p", None)
        if owner is not None:
            body["metadata"]["ownerReferences"] = [{"name": owner, "uid": uid, "controller": True}]
        return body

    async with Owners() as owners:
        owners.cache.keep("ns/a", website("a", "uid-a"))
        owners.cache.keep("ns/b", website("b", "uid-b"))
        await children.on_event(PAGES, event("ADDED", child("a", "uid-a")), owners.cache)
        await eventually(lambda: owners.requests == ["ns/a"], message="a requested")
        await children.on_event(PAGES, event("MODIFIED", child("b", "uid-b")), owners.cache)
        await eventually(
            lambda: sorted(owners.requests) == ["ns/a", "ns/a", "ns/b"], message="moved"
        )
        await children.on_event(PAGES, event("MODIFIED", child(None, None)), owners.cache)
        await eventually(
            lambda: sorted(owners.requests) == ["ns/a", "ns/a", "ns/b", "ns/b"], message="orphaned"
        )
        with serving_related(children, owners.cache):
            assert kr.owned(kr.Request("ns/a")) == kr.owned(kr.Request("ns/b")) == []
