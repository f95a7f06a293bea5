"""The operator's HTTP endpoints: ``/metrics``, ``/healthz`` and ``/readyz`` on one port.

* ``/metrics``: prometheus-client's text exposition of a registry (the
  default one, where the kopf shim records every reconciler's instruments).
* ``/healthz``: liveness. It answers 200 as long as the event loop runs the
  server, with a JSON report per reconciler (running, leader, epoch, queue
  figures) for people and tests; followers are healthy too.
* ``/readyz``: readiness: 200 once kopf's startup has finished (every
  reconciler's Loop runs and kopf starts its watches) and while every watch
  is allowed and answering (:mod:`kopf_reconcile.integration.watch_probe`) and the
  database a leader needs answers (:mod:`kopf_reconcile.integration.probing`), else 503; 503 again
  from the moment shutdown begins, so the pod leaves its Services while its
  Loops drain. It is not tied to leadership: a follower is ready, as a warm
  standby.

With an ``authorizer`` (:mod:`kopf_reconcile.integration.metrics_auth`), ``/metrics``
answers only a bearer token the Kubernetes API allows to ``get`` it (401 without one,
403 when not allowed); ``/healthz`` and ``/readyz`` still answer everyone, the kubelet
included, with their status code, and show the per-reconciler report and the reason
for not being ready only to such a token. With an ``ssl_context`` the port speaks TLS.

Bind to 127.0.0.1 unless something outside the process's host must reach them: in a pod
the kubelet's probes and Prometheus come to the pod's IP (``kopf-reconcile run`` then
defaults to 0.0.0.0).
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable
from typing import Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

from kopf_reconcile.integration.metrics_auth import Verdict

__all__ = ["Endpoints"]

Report = Callable[[], dict[str, dict[str, object]]]


class Authorizer(Protocol):
    """Decides on a request from its ``Authorization`` header."""

    async def verdict(self, authorization: str | None) -> Verdict: ...


class Endpoints:
    """An aiohttp server for metrics, liveness and readiness; ``start()`` then ``stop()``."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        ready: Callable[[], bool],
        report: Report,
        registry: CollectorRegistry = REGISTRY,
        stopping: Callable[[], bool] | None = None,
        problem: Callable[[], str | None] | None = None,
        authorizer: Authorizer | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._host = host
        self._port = port
        self._ready = ready
        self._stopping = stopping
        self._problem = problem  # why not ready although started (a failing watch, no database)
        self._report = report
        self._registry = registry
        self._authorizer = authorizer
        self._ssl_context = ssl_context
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        """Listen; returns the base URL (with the actual port when 0 was asked for)."""
        app = web.Application()
        app.on_response_prepare.append(_name_without_versions)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        # No keep-alive: at shutdown kopf cancels and awaits every task of the process, and
        # the task of a scraper's idle keep-alive connection held the exit up until SIGKILL.
        runner = web.AppRunner(app, access_log=None, handle_signals=False, keepalive_timeout=0)
        await runner.setup()
        try:
            await web.TCPSite(runner, self._host, self._port, ssl_context=self._ssl_context).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        host, port = runner.addresses[0][:2]
        scheme = "https" if self._ssl_context is not None else "http"
        self.url = f"{scheme}://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _verdict(self, request: web.Request) -> Verdict | None:
        """``None`` when anyone may read everything, else the request's verdict."""
        if self._authorizer is None:
            return None
        return await self._authorizer.verdict(request.headers.get("Authorization"))

    async def _trusted(self, request: web.Request) -> bool:
        """Whether the request may see details (the reports, the reasons)."""
        verdict = await self._verdict(request)
        return verdict is None or verdict.allowed

    async def _metrics(self, request: web.Request) -> web.Response:
        verdict = await self._verdict(request)
        if verdict is not None and not verdict.allowed:
            refused = web.Response(status=verdict.status, text=f"{verdict.reason}\n")
            if verdict.status == 401:
                refused.headers["WWW-Authenticate"] = 'Bearer realm="kopf-reconcile metrics"'
            return refused
        response = web.Response(body=generate_latest(self._registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def _healthz(self, request: web.Request) -> web.Response:
        if not await self._trusted(request):
            return _json(200, {"status": "ok"})
        return _json(200, {"status": "ok", "reconcilers": self._report()})

    async def _readyz(self, request: web.Request) -> web.Response:
        ready, reason = self._readiness()
        if ready:
            return _json(200, {"ready": True})
        if not await self._trusted(request):
            return _json(503, {"ready": False})
        return _json(503, {"ready": False, "reason": reason})

    def _readiness(self) -> tuple[bool, str]:
        if self._stopping is not None and self._stopping():
            return False, "the operator is shutting down"
        if not self._ready():
            return False, "the operator is starting"
        problem = self._problem() if self._problem is not None else None
        return problem is None, problem or ""


def _json(status: int, document: object) -> web.Response:
    return web.Response(status=status, text=json.dumps(document), content_type="application/json")


async def _name_without_versions(request: web.Request, response: web.StreamResponse) -> None:
    """A ``Server`` header without versions (aiohttp's names Python's and its own): the port
    answers strangers, who need not learn them."""
    response.headers["Server"] = "kopf-reconcile"
