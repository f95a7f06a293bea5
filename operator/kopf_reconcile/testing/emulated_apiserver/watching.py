"""Watch streams of the embedded API server: newline-delimited JSON events over HTTP.

A watch first sends the current state (or, from a ``resourceVersion``, the changes since
it, rewound from the store's history; an expired version is an ``ERROR`` event inside a
200 stream, as kube-apiserver answers), then every change, with ``BOOKMARK`` events when
the client allows them, until ``timeoutSeconds`` (or the server's own watch timeout).

``sendInitialEvents`` (WatchList) says it outright: ``true`` sends the state at a version
not older than ``resourceVersion`` (waiting for it, as a read does), then a ``BOOKMARK``
annotated ``k8s.io/initial-events-end`` when bookmarks are allowed; ``false`` sends only
the changes after ``resourceVersion`` (from now when there is none).
Open streams are tracked so that the admin API can cut them abruptly (a dropped
connection) and a shutdown can end them cleanly.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from kopf_reconcile.testing.emulated_apiserver import errors, request_options
from kopf_reconcile.testing.emulated_apiserver.resources import ResourceType
from kopf_reconcile.testing.emulated_apiserver.responses import as_served, dumps
from kopf_reconcile.testing.emulated_apiserver.store import Object, Store, Watcher, WatchEvent

#: The annotation of the bookmark that ends a WatchList's initial events.
INITIAL_EVENTS_END = "k8s.io/initial-events-end"


@dataclass(eq=False)
class WatchStream:
    """An open watch response, tracked so that it can be cut."""

    path: str
    watcher: Watcher
    cut: bool = field(default=False)


class WatchStreams:
    """The open watch streams of one server over one store."""

    def __init__(
        self,
        store: Store,
        *,
        bookmark_interval: float,
        watch_timeout: float,
        freshness_wait: float,
    ) -> None:
        self.store = store
        self.bookmark_interval = bookmark_interval
        self.watch_timeout = watch_timeout
        self.freshness_wait = freshness_wait
        self.streams: set[WatchStream] = set()

    async def serve(
        self,
        request: web.Request,
        resource: ResourceType,
        namespace: str | None,
        matches: Callable[[Object], bool],
    ) -> web.StreamResponse:
        """Stream the events of ``resource`` objects that ``matches`` until the watch ends."""
        requested = request_options.resource_version(request)
        since = requested or None
        initial_events = request.query.get("sendInitialEvents")
        if initial_events is not None:
            # WatchList: the state not older than the version, or only the changes after it.
            since = None if request_options.flag(initial_events) else since
        timeout = float(
            request_options.non_negative_int(
                request.query.get("timeoutSeconds", "0"), "timeoutSeconds"
            )
        )
        bookmarks = request_options.flag(request.query.get("allowWatchBookmarks"))
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        store = self.store
        send_state = since is None and (
            initial_events is None or request_options.flag(initial_events)
        )
        try:
            waits = send_state and requested and initial_events is not None
            if waits and not await store.wait_for_revision(requested, self.freshness_wait):
                raise errors.too_large_resource_version(requested, store.revision)
            initial, watcher = store.watch(resource.storage_key, matches, since)
        except errors.ApiError as error:
            # kube-apiserver answers an expired or a future resourceVersion inside the
            # stream, with 200.
            await response.prepare(request)
            await response.write(dumps({"type": "ERROR", "object": error.status()}) + b"\n")
            await response.write_eof()
            return response
        if send_state:  # the current state first, as synthetic ADDED events
            initial = [
                WatchEvent("ADDED", obj)
                for obj in store.items(resource.storage_key, namespace)
                if matches(obj)
            ]
        snapshot = store.revision  # what the initial events show: nothing awaited since
        stream = WatchStream(request.path, watcher)
        self.streams.add(stream)
        try:
            await response.prepare(request)
            await self._write_events(response, resource, initial)
            if initial_events is not None and send_state and bookmarks:
                await self._write_bookmark(
                    response, resource, snapshot, {INITIAL_EVENTS_END: "true"}
                )
            await self._pump(response, resource, watcher, timeout or self.watch_timeout, bookmarks)
            if stream.cut and request.transport is not None:
                request.transport.abort()  # an abrupt end, like a dropped connection
            else:
                await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away: nothing more to send
        finally:
            store.unwatch(watcher)
            self.streams.discard(stream)
        return response

    async def _pump(
        self,
        response: web.StreamResponse,
        resource: ResourceType,
        watcher: Watcher,
        timeout: float,
        bookmarks: bool,
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        next_bookmark = loop.time() + self.bookmark_interval
        while not watcher.closed:
            now = loop.time()
            wake_at = min(deadline, next_bookmark) if bookmarks else deadline
            if now >= deadline:
                return
            try:
                async with asyncio.timeout(wake_at - now):
                    await watcher.wait()
            except TimeoutError:
                pass
            await self._write_events(response, resource, watcher.drain())
            if bookmarks and loop.time() >= next_bookmark:
                await self._write_bookmark(response, resource, self.store.revision)
                next_bookmark = loop.time() + self.bookmark_interval

    async def _write_bookmark(
        self,
        response: web.StreamResponse,
        resource: ResourceType,
        revision: int,
        annotations: dict[str, str] | None = None,
    ) -> None:
        """A BOOKMARK at ``revision``: every event up to it has been written before."""
        metadata: dict[str, object] = {"resourceVersion": str(revision)}
        if annotations:
            metadata["annotations"] = annotations
        bookmark = {"kind": resource.kind, "apiVersion": resource.api_version, "metadata": metadata}
        await response.write(dumps({"type": "BOOKMARK", "object": bookmark}) + b"\n")

    async def _write_events(
        self, response: web.StreamResponse, resource: ResourceType, events: list[WatchEvent]
    ) -> None:
        if events:
            chunk = b"".join(
                dumps({"type": event.type, "object": as_served(resource, event.object)}) + b"\n"
                for event in events
            )
            await response.write(chunk)

    def cut(self, path_pattern: str | None = None) -> int:
        """Abruptly close open watch streams (those whose path matches, if a pattern is given)."""
        pattern = re.compile(path_pattern) if path_pattern else None
        cut = 0
        for stream in list(self.streams):
            if pattern is None or pattern.fullmatch(stream.path):
                stream.cut = True
                stream.watcher.close()
                cut += 1
        return cut

    def close(self) -> None:
        """End every open watch stream cleanly (at shutdown)."""
        for stream in list(self.streams):
            stream.watcher.close()
