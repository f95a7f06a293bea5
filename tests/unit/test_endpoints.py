"""The operator's endpoints: metrics of the given registry, liveness with a report, readiness."""

from __future__ import annotations

import asyncio

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


async def test_a_connection_is_closed_after_its_response() -> None:
    """No keep-alive: at shutdown kopf cancels and awaits every task of the process, and the
    task of a scraper's idle keep-alive connection held the operator's exit up (by seconds,
    past a short grace period)."""
    endpoints = Endpoints("127.0.0.1", 0, ready=lambda: True, report=dict)
    await endpoints.start()
    host, port = endpoints.url.removeprefix("http://").split(":")
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            # HTTP/1.1 keeps a connection by default: only the server's choice ends it.
            writer.write(b"GET /readyz HTTP/1.1\r\nHost: probe\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), timeout=30)  # until the server closes
        finally:
            writer.close()
        assert answer.startswith(b"HTTP/1.1 200")
    finally:
        await endpoints.stop()


async def test_no_answer_names_the_versions_of_python_or_aiohttp() -> None:
    endpoints = Endpoints("127.0.0.1", 0, ready=lambda: True, report=dict)
    url = await endpoints.start()
    try:
        async with aiohttp.ClientSession(base_url=url) as http:
            for path in ("/healthz", "/readyz", "/metrics", "/nothing"):
                async with http.get(path) as response:
                    assert response.headers["Server"] == "kopf-reconcile", path
    finally:
        await endpoints.stop()
