"""The admin API of the embedded cluster, under ``/_embedded/`` (never subject to faults).

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

import re

from aiohttp import web

from kopf_reconcile.testing.emulated_apiserver.faults import FaultInjector
from kopf_reconcile.testing.emulated_apiserver.responses import json_response
from kopf_reconcile.testing.emulated_apiserver.store import Store
from kopf_reconcile.testing.emulated_apiserver.watching import WatchStreams

ADMIN_PREFIX = "/_embedded/"


class AdminApi:
    """The ``/_embedded/`` routes over one server's faults, watches and store."""

    def __init__(self, faults: FaultInjector, watches: WatchStreams, store: Store) -> None:
        self.faults = faults
        self.watches = watches
        self.store = store

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_route("*", ADMIN_PREFIX + "faults", self._admin_faults)
        router.add_delete(ADMIN_PREFIX + "faults/{id}", self._admin_remove_fault)
        router.add_post(ADMIN_PREFIX + "watches/cut", self._admin_cut_watches)
        router.add_get(ADMIN_PREFIX + "stats", self._admin_stats)

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
        return json_response({"cut": self.watches.cut(spec.get("path_pattern"))})

    async def _admin_stats(self, request: web.Request) -> web.StreamResponse:
        return json_response(
            {
                **self.store.sizes(),
                "faults": len(self.faults.active()),
                "streams": len(self.watches.streams),
            }
        )
