"""The HTTP face of the embedded cluster: kube-apiserver's URL layout on an aiohttp app.

(Over 400 lines on purpose: kube-apiserver's URL layout and the list, get and write
dispatch read as one routing table.)

Routing follows kube-apiserver's paths (``/api/v1/...``, ``/apis/<group>/<version>/...``,
``/namespaces/<ns>/`` for namespaced resources, ``/<name>/status`` for the status
subresource; a group it does not serve is no API path at all: a plain-text 404); query
parameters are those clients send (``watch``, ``resourceVersion``,
``resourceVersionMatch``, ``labelSelector``, ``fieldSelector``, ``limit``, ``continue``,
``timeoutSeconds``, ``allowWatchBookmarks``, ``dryRun``, ``fieldValidation``,
``fieldManager``, ``force``, and ``shardSelector`` of sharded list and watch, see
:mod:`.shard_selectors`). Watches stream newline-delimited JSON events.

Reads at a ``resourceVersion`` behave as kube-apiserver v1.37's: a list or get at a version
the store has not reached waits up to 3 s for it, then answers 504 (clients retry); an exact
list (``resourceVersionMatch=Exact``, or a ``limit`` with a ``resourceVersion`` and no match
rule) and every page after the first (its ``continue`` token) read the state at their
version, rewound from the change history (410 once that version left it).

Beside this routing and the list, get and write dispatch: watch streams in
:mod:`.watching`, option and body parsing in :mod:`.request_options`, response shaping
in :mod:`.responses`, and the ``/_embedded/`` admin API in :mod:`.admin`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kopf_reconcile.testing.emulated_apiserver import (
    audit,
    discovery,
    errors,
    identity,
    openapi,
    patching,
    request_options,
    selecting,
    shard_selectors,
    tables,
)
from kopf_reconcile.testing.emulated_apiserver.admin import ADMIN_PREFIX, AdminApi
from kopf_reconcile.testing.emulated_apiserver.faults import FaultInjector
from kopf_reconcile.testing.emulated_apiserver.registry import ResourceAPI, WriteOptions
from kopf_reconcile.testing.emulated_apiserver.resources import ResourceType
from kopf_reconcile.testing.emulated_apiserver.responses import (
    as_list_item,
    as_served,
    deleted_status,
    error_response,
    json_response,
    with_warnings,
    written,
)
from kopf_reconcile.testing.emulated_apiserver.reviews import Reviews
from kopf_reconcile.testing.emulated_apiserver.store import Object
from kopf_reconcile.testing.emulated_apiserver.watching import WatchStream, WatchStreams

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
        sharded_list_and_watch: bool = True,
    ) -> None:
        self.api = api
        self.faults = faults
        # The ShardedListAndWatch feature gate (KEP-5866): off, shardSelector is ignored.
        self.sharded_list_and_watch = sharded_list_and_watch
        self.watches = WatchStreams(
            api.store,
            bookmark_interval=bookmark_interval,
            watch_timeout=watch_timeout,
            freshness_wait=FRESHNESS_WAIT,
        )
        self.server_address = "127.0.0.1"
        #: Where every write's audit Event goes (None: no audit log).
        self.audit_log: audit.AuditLog | None = None
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
        self.reviews = Reviews(api)
        self.reviews.add_routes(self.app.router)  # before the resource routes, which match too
        self.app.router.add_route("*", "/api/{version}/{tail:.+}", self._resource_request)
        self.app.router.add_route("*", "/apis/{group}/{version}/{tail:.+}", self._resource_request)
        AdminApi(faults, self.watches, api.store).add_routes(self.app.router)

    @property
    def streams(self) -> set[WatchStream]:
        """The open watch streams."""
        return self.watches.streams

    def cut_watches(self, path_pattern: str | None = None) -> int:
        """Abruptly close open watch streams (those whose path matches, if a pattern is given)."""
        return self.watches.cut(path_pattern)

    def close_watches(self) -> None:
        """End every open watch stream cleanly (at shutdown)."""
        self.watches.close()

    # Cross-cutting: faults first, then every ApiError becomes a Status response.

    @web.middleware
    async def _faults_and_errors(
        self, request: web.Request, handler: Handler
    ) -> web.StreamResponse:
        if request.path.startswith(ADMIN_PREFIX):
            return await handler(request)
        fault = self.faults.take(request.method, request.path)
        if fault is not None:
            if fault.delay:
                await asyncio.sleep(fault.delay)
            if fault.status is not None:
                return error_response(errors.for_code(fault.status, f"injected fault #{fault.id}"))
        context = audit.begin()
        request[audit.AUDIT_CONTEXT] = context
        try:
            response = await self._identified(request, handler, context)
        except errors.ApiError as error:
            response = error_response(error)
        except web.HTTPNotFound:
            raise _no_such_path() from None  # also where no route matches, in the same words
        except web.HTTPMethodNotAllowed:
            response = error_response(errors.method_not_allowed())
        if self.audit_log is not None and isinstance(response, web.Response):
            response.headers["Audit-Id"] = context.audit_id
            self.audit_log.record(request, context, response)
        return response

    async def _identified(
        self, request: web.Request, handler: Handler, context: audit.AuditContext
    ) -> web.StreamResponse:
        """Who asks (bearer token), then whom it impersonates (see :mod:`.identity`)."""
        user = identity.authenticate(
            request.headers.get("Authorization", ""), self.reviews.token_users
        )
        context.user = user
        if identity.wants_impersonation(request.headers):
            impersonated = identity.impersonate(
                request.headers,
                user,
                self.reviews.authorizer,
                self._request_attributes(request),
            )
            if impersonated is not None:
                context.impersonated = impersonated
        return await handler(request)

    def _request_attributes(self, request: web.Request) -> identity.RequestAttributes:
        """The authorization attributes of a request (its verb, resource, scope, name)."""
        path = [s for s in request.path.split("/") if s]
        if path[:1] == ["api"]:
            group, rest = "", path[2:]
        elif path[:1] == ["apis"] and len(path) >= 3:
            group, rest = path[1], path[3:]
        else:
            verb = request.method.lower()
            return identity.RequestAttributes(verb, "", "", "", "", "", path=request.path)
        namespace = ""
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        resource, name, subresource = [*rest, "", "", ""][:3]
        verbs = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
        verb = verbs.get(request.method, "get")
        if request.method == "GET":
            watching = request_options.flag(request.query.get("watch"))
            verb = "watch" if watching else ("get" if name else "list")
        elif request.method == "DELETE" and not name:
            verb = "deletecollection"
        return identity.RequestAttributes(verb, group, resource, subresource, namespace, name)

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
        if resource.verbs == ("create",) and method != "POST":
            raise errors.method_not_allowed()  # reviews are only created
        if resource.namespaced and address.namespace is None and method != "GET":
            raise errors.method_not_allowed()  # the all-namespaces path only lists and watches
        if resource.namespaced and address.namespace is None and name:
            raise errors.resource_not_served()
        if method == "GET" and not name:
            request_options.check_list_options(request)
            if request_options.flag(request.query.get("watch")):
                return await self.watches.serve(
                    request,
                    resource,
                    address.namespace,
                    self._filters(request, resource, address.namespace),
                )
            return await self._list(request, resource, address.namespace)
        if method == "GET":
            await self._wait_for(request_options.resource_version(request))
            obj = self.api.get(resource, namespace, name)
            if tables.wants_table(request.headers.get("Accept", "")):
                metadata = {"resourceVersion": obj["metadata"]["resourceVersion"]}
                include = request.query.get("includeObject")
                return json_response(tables.table(resource, [obj], metadata, include))
            return json_response(as_served(resource, obj))
        options = request_options.write_options(request)
        context = request[audit.AUDIT_CONTEXT]
        options.user = context.impersonated or context.user
        options.annotations = context.annotations
        if method == "POST" and not name:
            created = self.api.create(
                resource, namespace, await request_options.read_body(request), options
            )
            return written(resource, created, options, status=201)
        if method == "PUT" and name:
            body = await request_options.read_body(request)
            replaced, was_created = self.api.replace(
                resource, namespace, name, body, subresource=address.subresource, options=options
            )
            return written(resource, replaced, options, status=201 if was_created else 200)
        if method == "PATCH" and name and request.content_type == patching.APPLY_PATCH:
            request_options.check_patch_options(request)
            applied, was_created = self.api.apply(
                resource,
                namespace,
                name,
                await request_options.read_yaml(request),
                manager=request.query["fieldManager"],
                force=request_options.flag(request.query.get("force")),
                subresource=address.subresource,
                options=options,
            )
            return written(resource, applied, options, status=201 if was_created else 200)
        if method == "PATCH" and name:
            request_options.check_patch_options(request)
            content_type = request.content_type
            readable = content_type in (
                patching.MERGE_PATCH,
                patching.JSON_PATCH,
                patching.STRATEGIC_MERGE_PATCH,
            )
            # An unknown patch type is answered with 415 by the API, naming what it accepts.
            patch = await request_options.read_json(request) if readable else None
            patched = self.api.patch(
                resource,
                namespace,
                name,
                content_type,
                patch,
                subresource=address.subresource,
                options=options,
            )
            return written(resource, patched, options)
        if method == "DELETE" and name and not address.subresource:
            body = await request_options.read_json(request) if request.can_read_body else {}
            preconditions = body.get("preconditions") if isinstance(body, dict) else None
            obj, gone = self.api.delete(resource, namespace, name, preconditions, options=options)
            response = json_response(
                deleted_status(resource, obj) if gone else as_served(resource, obj)
            )
            return with_warnings(response, options)
        if method == "DELETE" and not name:
            return self._delete_collection(request, resource, namespace, options)
        raise errors.method_not_allowed()

    def _filters(
        self, request: web.Request, resource: ResourceType, namespace: str | None
    ) -> Callable[[Object], bool]:
        label = selecting.parse_label_selector(request.query.get("labelSelector", ""))
        fields = selecting.parse_field_selector(
            request.query.get("fieldSelector", ""), resource.kind, resource.custom
        )
        checks = [check for check in (label, fields) if check is not None]
        shard = self._shard_selector(request)
        if shard is not None:
            checks.append(shard.matches)
        if namespace is not None:
            checks.insert(0, lambda obj: obj["metadata"].get("namespace") == namespace)
        return lambda obj: all(check(obj) for check in checks)

    def _shard_selector(self, request: web.Request) -> shard_selectors.ShardSelector | None:
        """The request's shard selector (KEP-5866); None without one or with the gate off."""
        if not self.sharded_list_and_watch:
            return None
        return shard_selectors.parse_shard_selector(request.query.get("shardSelector", ""))

    async def _wait_for(self, revision: int) -> None:
        """Wait until the store has reached ``revision`` (0: any), or answer 504."""
        store = self.api.store
        if revision and not await store.wait_for_revision(revision, FRESHNESS_WAIT):
            raise errors.too_large_resource_version(revision, store.revision)

    async def _list(
        self, request: web.Request, resource: ResourceType, namespace: str | None
    ) -> web.StreamResponse:
        matches = self._filters(request, resource, namespace)
        requested = request_options.resource_version(request, listing=True)
        limit = request_options.non_negative_int(request.query.get("limit", "0"), "limit")
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
            revision, start_after = request_options.decode_continue(token)
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
            metadata["continue"] = request_options.encode_continue(
                revision, _sort_key(items[limit - 1])
            )
            metadata["remainingItemCount"] = len(items) - limit
            items = items[:limit]
        shard = self._shard_selector(request)
        if shard is not None and not resource.custom:
            # A filtered subset: the selector is echoed, in canonical form. Not for custom
            # resources: v1.37 filters them too, but their lists (unstructured) cannot carry it.
            metadata["shardInfo"] = {"selector": str(shard)}
        if tables.wants_table(request.headers.get("Accept", "")):
            return json_response(
                tables.table(resource, items, metadata, request.query.get("includeObject"))
            )
        document = {
            "kind": resource.list_kind,
            "apiVersion": resource.api_version,
            "metadata": metadata,
            "items": [as_list_item(resource, obj) for obj in items],
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
        self,
        request: web.Request,
        resource: ResourceType,
        namespace: str,
        options: WriteOptions,
    ) -> web.StreamResponse:
        matches = self._filters(request, resource, namespace if resource.namespaced else None)
        items, _ = self.api.list_objects(resource, namespace if resource.namespaced else None)
        deleted = []
        for obj in items:
            if matches(obj):
                meta = obj["metadata"]
                last, _ = self.api.delete(
                    resource, meta.get("namespace", ""), meta["name"], options=options
                )
                deleted.append(as_list_item(resource, last))
        document = {
            "kind": resource.list_kind,
            "apiVersion": resource.api_version,
            "metadata": {"resourceVersion": str(self.api.store.revision)},
            "items": deleted,
        }
        return with_warnings(json_response(document), options)


# Helpers.


def _no_such_path() -> web.HTTPNotFound:
    """What kube-apiserver answers for a path outside its API: plain text, not a Status."""
    return web.HTTPNotFound(text="404 page not found\n")


def _sort_key(obj: Object) -> str:
    meta = obj["metadata"]
    return f"{meta.get('namespace', '')}/{meta['name']}"
