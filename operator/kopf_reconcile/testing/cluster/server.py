"""The HTTP face of the embedded cluster: kube-apiserver's URL layout on an aiohttp app.

Routing follows kube-apiserver's paths (``/api/v1/...``, ``/apis/<group>/<version>/...``,
``/namespaces/<ns>/`` for namespaced resources, ``/<name>/status`` for the status
subresource; a group it does not serve is no API path at all: a plain-text 404); query
parameters are those clients send (``watch``, ``resourceVersion``,
``resourceVersionMatch``, ``labelSelector``, ``fieldSelector``, ``limit``, ``continue``,
``timeoutSeconds``, ``allowWatchBookmarks``, ``dryRun``, ``fieldValidation``,
``fieldManager``, ``force``). Watches stream newline-delimited JSON events.

Reads at a ``resourceVersion`` behave as kube-apiserver v1.20's: a list or get at a version
the store has not reached waits up to 3 s for it, then answers 504 (clients retry); an exact
list (``resourceVersionMatch=Exact``, or a ``limit`` with a ``resourceVersion`` and no match
rule) and every page after the first (its ``continue`` token) read the state at their
version, rewound from the change history (410 once that version left it).

Everything under ``/_embedded/`` is the admin API of the embedded cluster itself (faults,
watch cuts, internal sizes); it is never subject to injected faults:

* ``POST /_embedded/faults`` with ``{"method", "path_pattern", "status", "delay", "times"}``
  adds a fault and answers 201 with its description (including ``id``);
* ``GET /_embedded/faults`` lists the active faults; ``DELETE /_embedded/faults`` clears
  them; ``DELETE /_embedded/faults/<id>`` removes one;
* ``POST /_embedded/watches/cut`` with ``{"path_pattern": ...}`` (optional) abruptly closes
  the open watch streams whose path matches, answering ``{"cut": <count>}``;
* ``GET /_embedded/stats`` answers the sizes of internal structures (objects, history,
  watchers, faults).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import yaml
from aiohttp import web

from kopf_reconcile.testing.cluster import (
    discovery,
    errors,
    openapi,
    patching,
    protobuf,
    selecting,
    tables,
)
from kopf_reconcile.testing.cluster.api import FIELD_VALIDATIONS, ResourceAPI, WriteOptions
from kopf_reconcile.testing.cluster.faults import FaultInjector
from kopf_reconcile.testing.cluster.resources import ResourceType
from kopf_reconcile.testing.cluster.store import Object, Watcher, WatchEvent

ADMIN_PREFIX = "/_embedded/"

#: How long a read waits for a resourceVersion the store has not reached (the watch cache's 3 s).
FRESHNESS_WAIT = 3.0

LIST_EXPIRED = "The resourceVersion for the provided list is too old."
CONTINUE_EXPIRED = (
    "The provided continue parameter is too old to display a consistent list result. "
    "You can start a new list without the continue parameter."
)

#: Subresources of a core namespace; anything else after ``/namespaces/<ns>/`` is a resource.
_NAMESPACE_SUBRESOURCES = frozenset({"status", "finalize"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _dumps(document: Any) -> bytes:
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()


def json_response(document: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_dumps(document), content_type="application/json")


def error_response(error: errors.ApiError) -> web.Response:
    return json_response(error.status(), error.code)


@dataclass(eq=False)
class WatchStream:
    """An open watch response, tracked so that it can be cut."""

    path: str
    watcher: Watcher
    cut: bool = field(default=False)


@dataclass(frozen=True)
class Address:
    """Where a request points: a resource type, a namespace, a name, a subresource."""

    resource: ResourceType
    namespace: str | None
    name: str
    subresource: str


class ApiServer:
    """The aiohttp application serving one :class:`ResourceAPI`."""

    def __init__(
        self,
        api: ResourceAPI,
        faults: FaultInjector,
        *,
        bookmark_interval: float,
        watch_timeout: float,
    ) -> None:
        self.api = api
        self.faults = faults
        self.bookmark_interval = bookmark_interval
        self.watch_timeout = watch_timeout
        self.streams: set[WatchStream] = set()
        self.server_address = "127.0.0.1"
        self.app = web.Application(
            middlewares=[self._faults_and_errors], client_max_size=16 * 2**20
        )
        self.app.router.add_get("/version", self._version)
        self.app.router.add_get("/healthz", self._ok)
        self.app.router.add_get("/livez", self._ok)
        self.app.router.add_get("/readyz", self._ok)
        self.app.router.add_get("/api", self._core_versions)
        self.app.router.add_get("/api/", self._core_versions)
        # kube-apiserver answers these two whatever the method (other discovery paths: 405).
        self.app.router.add_route("*", "/apis", self._groups)
        self.app.router.add_route("*", "/apis/", self._groups)
        self.app.router.add_get("/openapi/v2", self._openapi_v2)
        self.app.router.add_get("/openapi/v3", self._openapi_v3_index)
        self.app.router.add_get("/openapi/v3/{path:.+}", self._openapi_v3)
        for slash in ("", "/"):
            self.app.router.add_get("/api/{version}" + slash, self._core_resources)
            self.app.router.add_route("*", "/apis/{group}" + slash, self._group)
            self.app.router.add_route("*", "/apis/{group}/{version}" + slash, self._group_resources)
        self.app.router.add_route("*", "/api/{version}/{tail:.+}", self._resource_request)
        self.app.router.add_route("*", "/apis/{group}/{version}/{tail:.+}", self._resource_request)
        self.app.router.add_route("*", ADMIN_PREFIX + "faults", self._admin_faults)
        self.app.router.add_delete(ADMIN_PREFIX + "faults/{id}", self._admin_remove_fault)
        self.app.router.add_post(ADMIN_PREFIX + "watches/cut", self._admin_cut_watches)
        self.app.router.add_get(ADMIN_PREFIX + "stats", self._admin_stats)

    # Cross-cutting: faults first, then every ApiError becomes a Status response.

    @web.middleware
    async def _faults_and_errors(
        self, request: web.Request, handler: Handler
    ) -> web.StreamResponse:
        if not request.path.startswith(ADMIN_PREFIX):
            fault = self.faults.take(request.method, request.path)
            if fault is not None:
                if fault.delay:
                    await asyncio.sleep(fault.delay)
                if fault.status is not None:
                    return error_response(
                        errors.for_code(fault.status, f"injected fault #{fault.id}")
                    )
        try:
            return await handler(request)
        except errors.ApiError as error:
            return error_response(error)
        except web.HTTPNotFound:
            raise _no_such_path() from None  # also where no route matches, in the same words
        except web.HTTPMethodNotAllowed:
            return error_response(errors.method_not_allowed())

    # Discovery and health.

    async def _ok(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text="ok")

    async def _version(self, request: web.Request) -> web.StreamResponse:
        return json_response(discovery.version_info())

    async def _core_versions(self, request: web.Request) -> web.StreamResponse:
        return json_response(discovery.core_versions(self.server_address))

    async def _groups(self, request: web.Request) -> web.StreamResponse:
        return json_response(discovery.group_list(self.api.registry))

    async def _group(self, request: web.Request) -> web.StreamResponse:
        document = discovery.group(self.api.registry, request.match_info["group"])
        if document is None:
            raise _no_such_path()
        return json_response(document)

    async def _core_resources(self, request: web.Request) -> web.StreamResponse:
        document = discovery.resource_list(self.api.registry, "", request.match_info["version"])
        if document is None:
            raise errors.resource_not_served()  # the core group always exists
        return json_response(document)

    async def _group_resources(self, request: web.Request) -> web.StreamResponse:
        info = request.match_info
        document = discovery.resource_list(self.api.registry, info["group"], info["version"])
        if document is None and discovery.group(self.api.registry, info["group"]) is not None:
            raise errors.resource_not_served()  # a known group: a Status, not a plain 404
        if document is None:
            raise _no_such_path()
        if request.method != "GET":
            raise errors.method_not_allowed()
        return json_response(document)

    async def _openapi_v2(self, request: web.Request) -> web.StreamResponse:
        # kube-apiserver serves v2 as protobuf to kubectl; clients fall back to v3 without it.
        raise _no_such_path()

    async def _openapi_v3_index(self, request: web.Request) -> web.StreamResponse:
        return json_response(openapi.index(self.api.registry))

    async def _openapi_v3(self, request: web.Request) -> web.StreamResponse:
        document = openapi.group_version_document(self.api.registry, request.match_info["path"])
        if document is None:
            raise _no_such_path()
        return json_response(document)

    # Resources.

    def _address(self, request: web.Request) -> Address:
        info = request.match_info
        group = info.get("group", "")
        version = info["version"]
        segments = info["tail"].split("/")
        namespace: str | None = None
        if (
            segments[0] == "namespaces"
            and len(segments) >= 3
            and not (not group and segments[2] in _NAMESPACE_SUBRESOURCES)
        ):
            namespace, segments = segments[1], segments[2:]
        plural, name, subresource = [*segments, "", ""][:3]
        resource = self.api.registry.get(group, version, plural)
        if resource is None and discovery.group(self.api.registry, group) is None and group:
            raise _no_such_path()  # no such API path at all
        if (
            resource is None
            or len(segments) > 3
            or not all(segments)
            or (namespace is not None and not resource.namespaced)
            or (subresource and not (subresource == "status" and resource.status_subresource))
        ):
            raise errors.resource_not_served()
        return Address(resource, namespace, name, subresource)

    async def _resource_request(self, request: web.Request) -> web.StreamResponse:
        address = self._address(request)
        resource, name = address.resource, address.name
        namespace = address.namespace or ""
        method = request.method
        if resource.namespaced and address.namespace is None and method != "GET":
            raise errors.method_not_allowed()  # the all-namespaces path only lists and watches
        if resource.namespaced and address.namespace is None and name:
            raise errors.resource_not_served()
        if method == "GET" and not name:
            _check_list_options(request)
            if _flag(request.query.get("watch")):
                return await self._watch(request, resource, address.namespace)
            return await self._list(request, resource, address.namespace)
        if method == "GET":
            await self._wait_for(_resource_version(request))
            obj = self.api.get(resource, namespace, name)
            if tables.wants_table(request.headers.get("Accept", "")):
                metadata = {"resourceVersion": obj["metadata"]["resourceVersion"]}
                include = request.query.get("includeObject")
                return json_response(tables.table(resource, [obj], metadata, include))
            return json_response(_as_served(resource, obj))
        options = _write_options(request)
        if method == "POST" and not name:
            created = self.api.create(resource, namespace, await _read_body(request), options)
            return _written(resource, created, options, status=201)
        if method == "PUT" and name:
            body = await _read_body(request)
            replaced, was_created = self.api.replace(
                resource, namespace, name, body, subresource=address.subresource, options=options
            )
            return _written(resource, replaced, options, status=201 if was_created else 200)
        if method == "PATCH" and name and request.content_type == patching.APPLY_PATCH:
            _check_patch_options(request)
            applied, was_created = self.api.apply(
                resource,
                namespace,
                name,
                await _read_yaml(request),
                manager=request.query["fieldManager"],
                force=_flag(request.query.get("force")),
                subresource=address.subresource,
                options=options,
            )
            return _written(resource, applied, options, status=201 if was_created else 200)
        if method == "PATCH" and name:
            _check_patch_options(request)
            content_type = request.content_type
            readable = content_type in (
                patching.MERGE_PATCH,
                patching.JSON_PATCH,
                patching.STRATEGIC_MERGE_PATCH,
            )
            # An unknown patch type is answered with 415 by the API, naming what it accepts.
            patch = await _read_json(request) if readable else None
            patched = self.api.patch(
                resource,
                namespace,
                name,
                content_type,
                patch,
                subresource=address.subresource,
                options=options,
            )
            return _written(resource, patched, options)
        if method == "DELETE" and name and not address.subresource:
            body = await _read_json(request) if request.can_read_body else {}
            preconditions = body.get("preconditions") if isinstance(body, dict) else None
            obj, gone = self.api.delete(
                resource, namespace, name, preconditions, dry_run=options.dry_run
            )
            if not gone:
                return json_response(_as_served(resource, obj))
            return json_response(_deleted_status(resource, obj))
        if method == "DELETE" and not name:
            return self._delete_collection(request, resource, namespace, dry_run=options.dry_run)
        raise errors.method_not_allowed()

    def _filters(
        self, request: web.Request, resource: ResourceType, namespace: str | None
    ) -> Callable[[Object], bool]:
        label = selecting.parse_label_selector(request.query.get("labelSelector", ""))
        fields = selecting.parse_field_selector(
            request.query.get("fieldSelector", ""), resource.kind, resource.custom
        )
        checks = [check for check in (label, fields) if check is not None]
        if namespace is not None:
            checks.insert(0, lambda obj: obj["metadata"].get("namespace") == namespace)
        return lambda obj: all(check(obj) for check in checks)

    async def _wait_for(self, revision: int) -> None:
        """Wait until the store has reached ``revision`` (0: any), or answer 504."""
        store = self.api.store
        if revision and not await store.wait_for_revision(revision, FRESHNESS_WAIT):
            raise errors.too_large_resource_version(revision, store.revision)

    async def _list(
        self, request: web.Request, resource: ResourceType, namespace: str | None
    ) -> web.StreamResponse:
        matches = self._filters(request, resource, namespace)
        requested = _resource_version(request)
        limit = _non_negative_int(request.query.get("limit", "0"), "limit")
        token = request.query.get("continue")
        # A limit with a resourceVersion and no match rule is exact too (the legacy form).
        match = request.query.get("resourceVersionMatch", "")
        exact = match == "Exact" or (limit > 0 and not match)
        start_after = ""
        if token:
            if request.query.get("resourceVersion"):
                raise errors.bad_request(
                    "specifying resource version is not allowed when using continue"
                )
            revision, start_after = _decode_continue(token)
            items = self._items_at(resource, namespace, revision, CONTINUE_EXPIRED)
        elif requested and exact:
            items = self._items_at(resource, namespace, requested, LIST_EXPIRED)
            revision = requested
        else:
            await self._wait_for(requested)
            items, revision = self.api.list_objects(resource, namespace)
        items = [obj for obj in items if matches(obj) and _sort_key(obj) > start_after]
        metadata: dict[str, Any] = {"resourceVersion": str(revision)}
        if limit and len(items) > limit:
            metadata["continue"] = _encode_continue(revision, _sort_key(items[limit - 1]))
            metadata["remainingItemCount"] = len(items) - limit
            items = items[:limit]
        if tables.wants_table(request.headers.get("Accept", "")):
            return json_response(
                tables.table(resource, items, metadata, request.query.get("includeObject"))
            )
        document = {
            "kind": resource.list_kind,
            "apiVersion": resource.api_version,
            "metadata": metadata,
            "items": [_as_list_item(resource, obj) for obj in items],
        }
        return json_response(document)

    def _items_at(
        self, resource: ResourceType, namespace: str | None, revision: int, too_old: str
    ) -> list[Object]:
        store = self.api.store
        if revision > store.revision:  # etcd's own words, passed through by kube-apiserver
            raise errors.storage_error("etcdserver: mvcc: required revision is a future revision")
        items = store.items_at(resource.storage_key, namespace, revision)
        if items is None:
            raise errors.expired(too_old)
        return items

    def _delete_collection(
        self, request: web.Request, resource: ResourceType, namespace: str, *, dry_run: bool
    ) -> web.StreamResponse:
        matches = self._filters(request, resource, namespace if resource.namespaced else None)
        items, _ = self.api.list_objects(resource, namespace if resource.namespaced else None)
        deleted = []
        for obj in items:
            if matches(obj):
                meta = obj["metadata"]
                last, _ = self.api.delete(
                    resource, meta.get("namespace", ""), meta["name"], dry_run=dry_run
                )
                deleted.append(_as_list_item(resource, last))
        document = {
            "kind": resource.list_kind,
            "apiVersion": resource.api_version,
            "metadata": {"resourceVersion": str(self.api.store.revision)},
            "items": deleted,
        }
        return json_response(document)

    # Watching.

    async def _watch(
        self, request: web.Request, resource: ResourceType, namespace: str | None
    ) -> web.StreamResponse:
        matches = self._filters(request, resource, namespace)
        since = _resource_version(request) or None
        timeout = float(
            _non_negative_int(request.query.get("timeoutSeconds", "0"), "timeoutSeconds")
        )
        bookmarks = _flag(request.query.get("allowWatchBookmarks"))
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        store = self.api.store
        try:
            initial, watcher = store.watch(resource.storage_key, matches, since)
        except errors.ApiError as error:
            # kube-apiserver answers an expired resourceVersion inside the stream, with 200.
            await response.prepare(request)
            await response.write(_dumps({"type": "ERROR", "object": error.status()}) + b"\n")
            await response.write_eof()
            return response
        if since is None:  # the current state first, as synthetic ADDED events
            initial = [
                WatchEvent("ADDED", obj)
                for obj in store.items(resource.storage_key, namespace)
                if matches(obj)
            ]
        stream = WatchStream(request.path, watcher)
        self.streams.add(stream)
        try:
            await response.prepare(request)
            await self._write_events(response, resource, initial)
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
                bookmark = {
                    "kind": resource.kind,
                    "apiVersion": resource.api_version,
                    "metadata": {"resourceVersion": str(self.api.store.revision)},
                }
                await response.write(_dumps({"type": "BOOKMARK", "object": bookmark}) + b"\n")
                next_bookmark = loop.time() + self.bookmark_interval

    async def _write_events(
        self, response: web.StreamResponse, resource: ResourceType, events: list[WatchEvent]
    ) -> None:
        if events:
            chunk = b"".join(
                _dumps({"type": event.type, "object": _as_served(resource, event.object)}) + b"\n"
                for event in events
            )
            await response.write(chunk)

    def cut_watches(self, path_pattern: str | None = None) -> int:
        """Abruptly close open watch streams (those whose path matches, if a pattern is given)."""
        pattern = re.compile(path_pattern) if path_pattern else None
        cut = 0
        for stream in list(self.streams):
            if pattern is None or pattern.fullmatch(stream.path):
                stream.cut = True
                stream.watcher.close()
                cut += 1
        return cut

    def close_watches(self) -> None:
        """End every open watch stream cleanly (at shutdown)."""
        for stream in list(self.streams):
            stream.watcher.close()

    # Admin API.

    async def _admin_faults(self, request: web.Request) -> web.StreamResponse:
        if request.method == "GET":
            return json_response({"faults": [f.describe() for f in self.faults.active()]})
        if request.method == "DELETE":
            self.faults.clear()
            return json_response({"faults": []})
        if request.method != "POST":
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "POST", "DELETE"])
        spec = await request.json()
        if not isinstance(spec, dict):
            raise web.HTTPBadRequest(text="a fault is a JSON object")
        try:
            fault = self.faults.add(
                method=str(spec.get("method", "*")),
                path_pattern=str(spec["path_pattern"]),
                status=spec.get("status"),
                delay=spec.get("delay"),
                times=spec.get("times", 1),
            )
        except (KeyError, TypeError, ValueError, re.error) as exc:
            raise web.HTTPBadRequest(text=f"bad fault: {exc}") from None
        return json_response(fault.describe(), 201)

    async def _admin_remove_fault(self, request: web.Request) -> web.StreamResponse:
        self.faults.remove(int(request.match_info["id"]))
        return json_response({"faults": [f.describe() for f in self.faults.active()]})

    async def _admin_cut_watches(self, request: web.Request) -> web.StreamResponse:
        spec = await request.json() if request.can_read_body else {}
        return json_response({"cut": self.cut_watches(spec.get("path_pattern"))})

    async def _admin_stats(self, request: web.Request) -> web.StreamResponse:
        return json_response(
            {
                **self.api.store.sizes(),
                "faults": len(self.faults.active()),
                "streams": len(self.streams),
            }
        )


# Helpers: request decoding and response shaping.


def _no_such_path() -> web.HTTPNotFound:
    """What kube-apiserver answers for a path outside its API: plain text, not a Status."""
    return web.HTTPNotFound(text="404 page not found\n")


def _flag(value: str | None) -> bool:
    return value is not None and value.lower() in ("true", "1")


def _non_negative_int(value: str, name: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise errors.bad_request(f"invalid {name}: {value!r}") from None
    if number < 0:
        raise errors.bad_request(f"invalid {name}: {value!r}")
    return number


def _resource_version(request: web.Request) -> int:
    """The ``resourceVersion`` parameter; 0 when absent or ``0`` (any state will do)."""
    raw = request.query.get("resourceVersion", "")
    if not raw:
        return 0
    if not raw.isascii() or not raw.isdigit():
        quoted = json.dumps(raw)
        raise errors.storage_error(
            f"resourceVersion: Invalid value: {quoted}: strconv.ParseUint: parsing {quoted}: "
            "invalid syntax"
        )
    return int(raw)


class _YamlLoader(yaml.SafeLoader):
    """YAML read as Kubernetes reads it (converted to JSON): timestamps stay strings."""


_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


async def _read_yaml(request: web.Request) -> Any:
    try:
        return yaml.load(await request.read(), Loader=_YamlLoader)  # a SafeLoader subclass
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise errors.bad_request(
            f"error decoding YAML: error converting YAML to JSON: {exc}"
        ) from None


async def _read_json(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw) if raw else None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise errors.bad_request(f"error decoding patch: {exc}") from None


async def _read_body(request: web.Request) -> Any:
    raw = await request.read()
    content_type = request.content_type
    try:
        if content_type in ("application/yaml", "application/x-yaml"):
            return yaml.load(raw, Loader=_YamlLoader)  # a SafeLoader subclass
        if content_type in ("application/json", "application/octet-stream", ""):
            return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, yaml.YAMLError) as exc:
        raise errors.bad_request(f"couldn't get version/kind; json parse error: {exc}") from None
    if content_type == protobuf.MEDIA_TYPE:
        return protobuf.decode(raw)  # what kubectl create sends for built-in kinds
    raise errors.ApiError(
        415,
        f"the body of the request was in an unknown format - accepted media types include: "
        f"application/json, application/yaml, {protobuf.MEDIA_TYPE} (got {content_type})",
        "UnsupportedMediaType",
    )


def _check_list_options(request: web.Request) -> None:
    """kube-apiserver v1.20's ListOptions rules (which also turn WatchList clients away,
    so that client-go falls back to list-then-watch, as it does with a real v1.20)."""
    match = request.query.get("resourceVersionMatch", "")
    if not match:
        return
    problems: list[errors.FieldError] = []
    if _flag(request.query.get("watch")):
        problems.append(
            errors.FieldError.forbidden(
                "resourceVersionMatch", "resourceVersionMatch is forbidden for watch"
            )
        )
    if not request.query.get("resourceVersion"):
        problems.append(
            errors.FieldError.forbidden(
                "resourceVersionMatch",
                "resourceVersionMatch is forbidden unless resourceVersion is provided",
            )
        )
    if request.query.get("continue"):
        problems.append(
            errors.FieldError.forbidden(
                "resourceVersionMatch",
                "resourceVersionMatch is forbidden when continue is provided",
            )
        )
    if match not in ("NotOlderThan", "Exact"):
        problems.append(
            errors.FieldError.not_supported(
                "resourceVersionMatch", match, ("Exact", "NotOlderThan", "")
            )
        )
    if match == "Exact" and request.query.get("resourceVersion") == "0":
        problems.append(
            errors.FieldError.forbidden(
                "resourceVersionMatch",
                'resourceVersionMatch "exact" is forbidden for resourceVersion "0"',
            )
        )
    if problems:
        raise errors.invalid_options("ListOptions", problems)


def _check_patch_options(request: web.Request) -> None:
    """kube-apiserver's PatchOptions rules: apply needs a field manager, ``force`` is for
    apply only."""
    problem = None
    if request.content_type == patching.APPLY_PATCH and not request.query.get("fieldManager"):
        problem = errors.FieldError.required("fieldManager", "is required for apply patch")
    elif request.content_type != patching.APPLY_PATCH and "force" in request.query:
        problem = errors.FieldError.forbidden("force", "may not be specified for non-apply patch")
    if problem is not None:
        raise errors.invalid_options("PatchOptions", [problem])


def _write_options(request: web.Request) -> WriteOptions:
    requested = request.query.get("fieldValidation", "Ignore")
    validation = next((known for known in FIELD_VALIDATIONS if known == requested), None)
    if validation is None:
        raise errors.bad_request(
            f"fieldValidation parameter unsupported: {requested} "
            "(must be one of Ignore, Warn, Strict)"
        )
    return WriteOptions(
        dry_run=request.query.get("dryRun") == "All",
        field_validation=validation,
    )


def _written(
    resource: ResourceType, obj: Object, options: WriteOptions, status: int = 200
) -> web.Response:
    response = json_response(_as_served(resource, obj), status)
    for warning in options.warnings:
        response.headers.add("Warning", f"299 - {json.dumps(warning)}")
    return response


def _as_served(resource: ResourceType, obj: Object) -> Object:
    """An object as this version serves it (``None`` conversion between CRD versions)."""
    if obj.get("apiVersion") == resource.api_version:
        return obj
    return {**obj, "apiVersion": resource.api_version}


def _as_list_item(resource: ResourceType, obj: Object) -> Object:
    """List items of built-in kinds carry no kind/apiVersion (typed lists); custom ones do."""
    if resource.custom:
        return _as_served(resource, obj)
    return {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}


def _deleted_status(resource: ResourceType, obj: Object) -> dict[str, Any]:
    details: dict[str, Any] = {"name": obj["metadata"]["name"]}
    if resource.group:
        details["group"] = resource.group
    details["kind"] = resource.plural
    details["uid"] = obj["metadata"].get("uid", "")
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "details": details,
    }


def _sort_key(obj: Object) -> str:
    meta = obj["metadata"]
    return f"{meta.get('namespace', '')}/{meta['name']}"


def _encode_continue(revision: int, start_after: str) -> str:
    raw = json.dumps({"v": "meta.k8s.io/v1", "rv": revision, "start": start_after}).encode()
    return base64.urlsafe_b64encode(raw).decode()


def _decode_continue(token: str) -> tuple[int, str]:
    try:
        decoded = json.loads(base64.urlsafe_b64decode(token.encode()))
        return int(decoded["rv"]), str(decoded["start"])
    except (binascii.Error, ValueError, KeyError, TypeError):
        raise errors.bad_request(
            "continue key is not valid: incorrect encoded start resourceVersion "
            "(version meta.k8s.io/v1)"
        ) from None
