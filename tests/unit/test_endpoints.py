"""The operator's endpoints: metrics of the given registry, liveness with a report, readiness."""

from __future__ import annotations

import aiohttp
from prometheus_client import CollectorRegistry, Counter

from kopf_reconcile.integration.endpoints import Endpoints


async def test_endpoints() -> None:
    registry = CollectorRegistry()
    Counter("kopf_reconcile_probe_total", "a test counter", registry=registry).inc(3)
    ready = False
    report = {"reconcile-device": {"running": True, "leader": False, "epoch": 0}}
    endpoints = Endpoints(
        "127.0.0.1", 0, ready=lambda: ready, report=lambda: report, registry=registry
    )
    url = await endpoints.start()
    try:
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
        async with aiohttp.ClientSession(base_url=url) as http:
            async with http.get("/readyz") as response:
                assert response.status == 503  # not ready: kopf is starting
            ready = True
            async with http.get("/readyz") as response:
                assert response.status == 200
            async with http.get("/healthz") as response:
                assert response.status == 200  # alive, though not leading
                assert await response.json() == {"status": "ok", "reconcilers": report}
            async with http.get("/metrics") as response:
                assert response.status == 200
                assert "kopf_reconcile_probe_total 3.0" in await response.text()
    finally:
        await endpoints.stop()
