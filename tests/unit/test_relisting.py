"""Relists: a completed listing reports what it no longer holds as deleted, as an informer's
Replace does; and the kopf shim inserts those events into kopf's own watch stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import kopf
import pytest
from kopf._cogs.clients import watching
from kopf._cogs.structs import references

import kopf_reconcile as kr
from kopf_reconcile.integration.relisting import ListingTracker


def obj(uid: str, name: str = "", version: str = "1") -> dict[str, Any]:
    metadata = {"namespace": "ns", "name": name or uid, "uid": uid, "resourceVersion": version}
    return {"metadata": metadata}


def deleted_uids(events: list[dict[str, Any]]) -> list[str]:
    assert all(e["type"] == "DELETED" for e in events)
    return [e["object"]["metadata"]["uid"] for e in events]


def test_the_first_listing_reports_nothing() -> None:
    tracker = ListingTracker()
    tracker.observe({"type": None, "object": obj("a")})
    tracker.observe({"type": None, "object": obj("b")})
    assert tracker.listed() == []
    assert len(tracker) == 2


def test_a_relist_reports_each_object_it_no_longer_holds_with_its_last_body() -> None:
    tracker = ListingTracker()
    for uid in ("a", "b", "c"):
        tracker.observe({"type": None, "object": obj(uid)})
    assert tracker.listed() == []
    tracker.observe({"type": "MODIFIED", "object": obj("b", version="7")})
    tracker.observe({"type": "ADDED", "object": obj("d")})
    tracker.observe({"type": "DELETED", "object": obj("c")})  # seen deleted: never again
    # 410: the watch lists again; b and d were deleted in the gap, a survives.
    tracker.observe({"type": None, "object": obj("a")})
    gone = tracker.listed()
    assert sorted(deleted_uids(gone)) == ["b", "d"]
    assert next(e for e in gone if e["object"]["metadata"]["uid"] == "b")["object"] == obj(
        "b", version="7"
    )
    assert len(tracker) == 1
    assert deleted_uids(tracker.listed()) == ["a"]  # then an empty listing: a is gone too
    assert len(tracker) == 0


def test_an_object_recreated_in_the_gap_is_a_new_uid_and_the_old_one_is_gone() -> None:
    tracker = ListingTracker()
    tracker.observe({"type": None, "object": obj("old", name="x")})
    tracker.listed()
    tracker.observe({"type": None, "object": obj("new", name="x")})
    assert deleted_uids(tracker.listed()) == ["old"]


def test_a_listing_cut_short_is_merged_with_the_next_one() -> None:
    tracker = ListingTracker()
    for uid in ("a", "b"):
        tracker.observe({"type": None, "object": obj(uid)})
    tracker.listed()
    tracker.observe({"type": None, "object": obj("a")})  # then the connection broke
    tracker.observe({"type": None, "object": obj("b")})  # the next listing, complete
    assert tracker.listed() == []


def test_the_last_body_is_kept_apart_from_the_watch_s_own_dict() -> None:
    tracker = ListingTracker()
    body = obj("a")
    tracker.observe({"type": None, "object": body})
    tracker.listed()
    body["metadata"]["name"] = "changed by the stream's owner"  # the tracker kept a copy
    assert [e["object"] for e in tracker.listed()] == [obj("a")]


def test_without_whole_bodies_a_deletion_carries_the_object_s_identity() -> None:
    tracker = ListingTracker(whole_bodies=False)
    body = {"apiVersion": "v1", "kind": "ConfigMap", **obj("a"), "data": {"k": "v"}}
    tracker.observe({"type": None, "object": body})
    tracker.observe({"type": None, "object": {"metadata": {"name": "c", "uid": "c"}}})
    tracker.listed()
    gone = sorted((e["object"] for e in tracker.listed()), key=lambda b: b["metadata"]["uid"])
    assert gone == [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "a", "namespace": "ns", "uid": "a"},
        },
        {"apiVersion": None, "kind": None, "metadata": {"name": "c", "uid": "c"}},
    ]


def test_events_without_an_object_identity_are_ignored() -> None:
    tracker = ListingTracker()
    tracker.observe({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}})
    tracker.observe({"type": "ERROR", "object": {"code": 410}})
    assert len(tracker) == 0 and tracker.listed() == []


async def test_kopf_watch_streams_of_reconciled_resources_report_what_a_relist_lacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through kopf's own ``infinite_watch``: two listings, one watch event between them."""
    registry = kopf.OperatorRegistry()
    kr.reconciler(
        "example.com", "v1", "relistwidgets", tenancy=kr.Tenancy.TENANT_SCOPED, registry=registry
    )(lambda req: None)
    listings = [
        [{"type": None, "object": obj("a")}, {"type": None, "object": obj("b")}],
        [{"type": None, "object": obj("a")}],  # b was deleted while the watch was away
    ]
    streams = iter(
        [
            [*listings[0], watching.Bookmark.LISTED, {"type": "ADDED", "object": obj("c")}],
            [*listings[1], watching.Bookmark.LISTED],
        ]
    )

    async def continuous_watch(**_: Any) -> AsyncIterator[Any]:
        for item in next(streams):
            yield item

    monkeypatch.setattr(watching, "continuous_watch", continuous_watch)
    settings = kopf.OperatorSettings()
    settings.watching.reconnect_backoff = 0
    items: list[Any] = []

    async def consume(resource: references.Resource) -> None:
        stream = watching.infinite_watch(
            settings=settings, resource=resource, namespace="ns", _iterations=2
        )
        async for item in stream:
            items.append(item)

    await asyncio.wait_for(
        consume(references.Resource("example.com", "v1", "relistwidgets")), timeout=10
    )
    # After the first listing, its marker and the watch's ADDED event: the second listing.
    second_listing = items[items.index(watching.Bookmark.LISTED) + 2 :]
    assert second_listing[0] == listings[1][0]
    swept = [i for i in second_listing if isinstance(i, dict) and i["type"] == "DELETED"]
    assert sorted(deleted_uids(swept)) == ["b", "c"]
    assert second_listing[-1] is watching.Bookmark.LISTED  # the sweep comes before the marker

    # A resource no reconciler watches passes through untouched.
    items.clear()
    streams = iter([[*listings[0], watching.Bookmark.LISTED], [watching.Bookmark.LISTED]])
    await asyncio.wait_for(consume(references.Resource("example.com", "v1", "others")), 10)
    assert not [i for i in items if isinstance(i, dict) and i["type"] == "DELETED"]
