"""Readiness covers kopf's watches: the watch probe, on both Kubernetes API tiers."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from kopf_reconcile.integration.endpoints import Endpoints
from kopf_reconcile.integration.watch_probe import (
    CRDS,
    NAMESPACES,
    WatchProbe,
    WatchTarget,
    targets,
)

DEVICES = ("example.com", "v1", "devices")


def test_targets_follow_what_kopf_watches() -> None:
    namespaced = targets([DEVICES], ["ops", "team-*"], clusterwide=False)
    assert namespaced == [CRDS, NAMESPACES, WatchTarget(*DEVICES, "ops")]  # globs: via namespaces
    assert targets([DEVICES], [], clusterwide=True) == [CRDS, WatchTarget(*DEVICES)]
    assert WatchTarget(*DEVICES, "ops").path == "/apis/example.com/v1/namespaces/ops/devices"
    assert NAMESPACES.path == "/api/v1/namespaces"


async def test_probe_passes_where_every_watch_is_allowed(kube: Any, kube_namespace: str) -> None:
    api = kube.api_client()
    try:
        probe = WatchProbe(
            [NAMESPACES, WatchTarget("", "v1", "configmaps", kube_namespace)], api=api
        )
        assert probe.problem() is not None  # not checked yet: not ready
        assert await probe.check_once() is None
    finally:
        await api.close()


@pytest.mark.real_apiserver
async def test_probe_names_a_forbidden_watch(real_cluster: Any) -> None:
    api = real_cluster.api_client(unprivileged=True)  # a user with no rights at all
    try:
        probe = WatchProbe([NAMESPACES], api=api)
        problem = await probe.check_once()
        assert problem is not None
        assert "namespaces cluster-wide is forbidden (403)" in problem
    finally:
        await api.close()


async def test_readyz_reports_the_problem_once_started() -> None:
    problem: list[str | None] = ["the watch of devices.example.com in 'ops' is forbidden (403)"]
    started = [False]
    endpoints = Endpoints(
        "127.0.0.1", 0, ready=lambda: started[0], report=dict, problem=lambda: problem[0]
    )
    url = await endpoints.start()
    try:
        async with aiohttp.ClientSession() as http:

            async def readyz() -> tuple[int, dict[str, Any]]:
                async with http.get(f"{url}/readyz") as response:
                    return response.status, await response.json()

            assert (await readyz())[0] == 503
            started[0] = True
            status, body = await readyz()
            assert status == 503 and "forbidden" in body["reason"]
            problem[0] = None
            assert (await readyz())[0] == 200
    finally:
        await endpoints.stop()
