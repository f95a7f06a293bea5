"""Watch streams: kopf's stream of a reconciled resource, fed straight to its reconcilers.

kopf lists a resource (events of type None), yields its ``Bookmark.LISTED`` marker, then
watches; after a 410 it lists again. Its watcher reads the stream from
``kopf._cogs.clients.watching.infinite_watch`` (reached through
:mod:`~kopf_reconcile.integration.kopf_internals`) at every start, so a wrapper there
(:func:`install_stream_feed`) sees every event and every listing of every stream:

* it hands every event, in the stream's order, to the reconcilers of the operator running
  that stream (those whose startup handler received its settings): straight into their
  caches, with no kopf handler in between. Without other kopf handlers of the resource
  the events go no further, and kopf spends nothing on them. Namespaces and CRDs are never
  bypassed: kopf's own observers read those streams;
* once a listing is complete it inserts, before the marker, a DELETED event for each
  object the stream knew that the listing lacks (an object deleted during a 410 gap),
  as client-go's informers do (:mod:`~kopf_reconcile.integration.relisting`);
* a stream that feeds only reconcilers sharded by namespace ranges carries only the
  shards they lead, selected by the API server where it can
  (:mod:`~kopf_reconcile.integration.shard_watch`).

The reconcilers are the shim's registrations (:class:`FedReconciler`, the protocol they
meet here).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol, TypeAlias

from kopf_reconcile.integration import kopf_internals
from kopf_reconcile.integration.logs import EVENT_HANDLER_PREFIX
from kopf_reconcile.integration.relisting import ListingClock, ListingTracker
from kopf_reconcile.integration.shard_watch import ShardWatch, narrowed_stream

__all__ = ["FedReconciler", "Feeder", "install_stream_feed"]

logger = logging.getLogger("kopf_reconcile.kopf")

Feeder: TypeAlias = tuple[str, Callable[[Mapping[str, Any]], Awaitable[None]]]


class FedReconciler(Protocol):
    """What the stream feed needs of a reconciler (the shim's registration)."""

    settings: object | None  # the kopf settings of the operator that started it
    registry: Any  # its kopf registry
    feeding_streams: collections.Counter[tuple[str, str]]
    shard_watch: ShardWatch | None  # set when its streams may carry only its led shards

    def watches(self, key: tuple[str, str], version: str | None = None) -> bool: ...
    def reconciles(self, key: tuple[str, str]) -> bool: ...
    def maps(self, key: tuple[str, str]) -> bool: ...
    def feeder(self, key: tuple[str, str]) -> Feeder: ...
    async def release(self, body: Mapping[str, Any]) -> None: ...


def install_stream_feed(registrations: Callable[[], Iterable[FedReconciler]]) -> None:
    """Wrap kopf's watch streams (once per process): ``registrations()`` are the
    reconcilers that may be fed. Swept deletions go through kopf's per-object queues like
    real events, after that object's earlier ones, when kopf sees the stream's events."""
    found = kopf_internals.infinite_watch()
    if found is None:  # pragma: no cover - another kopf layout
        logger.warning(
            "this kopf version's watch stream cannot be followed: an object deleted while "
            "a watch lists again (410 Gone) is not reported to its reconciler"
        )
        return
    original, listed_marker = found
    if getattr(original, "_kopf_reconcile_sweeps", False):
        return

    async def infinite_watch(
        *, resource: Any, settings: Any = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        key = (resource.group, resource.plural)
        reconcilers = [r for r in registrations() if r.watches(key)]
        if not reconcilers:
            async with contextlib.aclosing(
                original(resource=resource, settings=settings, **kwargs)
            ) as stream:
                async for item in stream:
                    yield item
            return
        # The reconcilers of the operator running this stream, started: fed from here.
        # Not on the streams kopf's own observers read (namespaces for a namespace glob,
        # CRDs for resources that appear later): those must reach kopf whole, so there
        # the reconcilers are fed through their kopf handler, as for a shared resource.
        fed = [
            r
            for r in reconcilers
            if settings is not None
            and r.settings is settings
            and r.watches(key, getattr(resource, "version", None))
            and key not in _OBSERVED_BY_KOPF
        ]
        feeders = [r.feeder(key) for r in fed]
        # Without other kopf handlers of the resource, kopf need not see the events at all.
        alone = bool(fed) and not any(_kopf_handles(r.registry, resource) for r in fed)
        # Kept for the sweep: the last bodies for kopf's handlers and map_to functions,
        # else identities only (a child's owner is then read from its cached body).
        tracker = ListingTracker(whole_bodies=not alone or any(r.maps(key) for r in fed))
        # The shard watches of the reconcilers whose own resource this is (not a child's).
        watches = [r.shard_watch for r in fed if r.shard_watch is not None and r.reconciles(key)]
        narrowed = (
            alone
            and len(watches) == len(fed)
            and getattr(resource, "namespaced", False) is True
            and not kopf_internals.shard_selector_of(settings, resource)
        )
        plain = object()  # this stream, as a shard watch knows it when it is not narrowed
        for registration in fed:
            registration.feeding_streams[key] += 1
        try:
            if narrowed:

                def open_stream(selector: str) -> AsyncGenerator[Any, None]:
                    narrow = kopf_internals.with_shard_selector(settings, selector)
                    return original(resource=resource, settings=narrow, **kwargs)  # type: ignore[no-any-return]

                async def release(body: Mapping[str, Any]) -> None:
                    for registration in fed:
                        await registration.release(body)

                async for item in narrowed_stream(
                    open_stream,
                    watches,
                    resource="/".join(filter(None, key)),
                    listed_marker=listed_marker,
                    tracker=tracker,
                    feed=functools.partial(_feed, feeders),
                    release=release,
                ):
                    yield item
                return
            stream = original(resource=resource, settings=settings, **kwargs)
            clock = ListingClock()
            clock.start()
            for watch in watches:  # not narrowed: each listing holds every shard
                watch.stream_covers(plain, frozenset())
            async with contextlib.aclosing(stream):
                async for item in stream:
                    if item is listed_marker:
                        logger.info("listed %s: %s", "/".join(filter(None, key)), clock.listed())
                        for watch in watches:
                            watch.stream_covers(plain, frozenset(range(watch.assignment.shards)))
                        for deleted in tracker.listed():
                            await _feed(feeders, deleted)
                            if not alone:
                                yield deleted
                    elif isinstance(item, Mapping):
                        clock.observe(item)
                        tracker.observe(item)
                        await _feed(feeders, item)
                        if alone:
                            continue
                    yield item
        finally:
            for registration in fed:
                registration.feeding_streams[key] -= 1
            for watch in watches:
                watch.stream_covers(plain, None)  # (nothing, when narrowed)

    kopf_internals.replace_infinite_watch(infinite_watch, original)


# (group, plural) of the resources whose watch streams kopf's observers also read.
_OBSERVED_BY_KOPF = frozenset(
    {("", "namespaces"), ("apiextensions.k8s.io", "customresourcedefinitions")}
)


def _kopf_handles(registry: Any, resource: Any) -> bool:
    """Whether ``registry`` has a handler of ``resource`` other than the shim's own."""
    registries = kopf_internals.resource_handlers(registry)
    if registries is None:  # pragma: no cover - another kopf layout: let kopf see all
        return True
    for handlers in registries:
        for handler in handlers:
            if str(getattr(handler, "id", "")).startswith(EVENT_HANDLER_PREFIX):
                continue
            selector = getattr(handler, "selector", None)
            if selector is None or selector.check(resource):
                return True
    return False


async def _feed(feeders: list[Feeder], event: Mapping[str, Any]) -> None:
    """One watch event to each reconciler fed by this stream; a failure is logged, not raised."""
    for reconciler_id, feed in feeders:
        try:
            await feed(event)
        except Exception:
            logger.exception("reconciler %s could not take a watch event", reconciler_id)
