"""Readiness covers kopf's watches: the watch probe, on both Kubernetes API tiers."""

from __future__ import annotations

import secrets
from typing import Any

import aiohttp
import pytest

from kopf_reconcile.integration import kopf_shim
from kopf_reconcile.integration.endpoints import Endpoints
from kopf_reconcile.integration.watch_probe import (
    CRDS,
    NAMESPACES,
    WatchProbe,
    WatchTarget,
    namespace_patterns,
    targets,
)
from kopf_reconcile.testing.real_apiserver import UNPRIVILEGED_USER
from support import eventually

DEVICES = ("example.com", "v1", "devices")


def test_targets_follow_what_kopf_watches() -> None:
    namespaced = targets([DEVICES], ["ops", "team-*"], clusterwide=False)
    assert namespaced == [CRDS, NAMESPACES, WatchTarget(*DEVICES, "ops")]  # globs: via namespaces
    assert targets([DEVICES], [], clusterwide=True) == [CRDS, WatchTarget(*DEVICES)]
    assert WatchTarget(*DEVICES, "ops").path == "/apis/example.com/v1/namespaces/ops/devices"
    assert NAMESPACES.path == "/api/v1/namespaces"


def test_neither_namespaces_nor_clusterwide_is_clusterwide_as_kopf_goes() -> None:
    assert targets([DEVICES], [], clusterwide=False) == [CRDS, WatchTarget(*DEVICES)]


def test_patterns_are_matched_as_kopf_matches_them() -> None:
    patterns = namespace_patterns([DEVICES], ["ops", "team-*, !team-x"], kopf_shim.match_namespace)
    assert patterns is not None
    assert patterns.targets(["ops", "team-a", "team-x", "other"]) == [
        WatchTarget(*DEVICES, "team-a")
    ]
    assert namespace_patterns([DEVICES], ["ops"], kopf_shim.match_namespace) is None


async def test_a_pattern_checks_the_resource_in_each_namespace_it_matches(
    kube: Any, kube_namespace: str
) -> None:
    api = kube.api_client()
    missing = ("example.invalid", "v1", "nothings")  # no such resource: 404 where checked
    patterns = namespace_patterns([missing], [f"{kube_namespace[:-1]}*"], kopf_shim.match_namespace)
    try:
        probe = WatchProbe(targets([missing], [], clusterwide=True)[:1], api=api, patterns=patterns)
        problem = await probe.check_once()
        assert problem is not None
        assert f"nothings.example.invalid in {kube_namespace!r} answered 404" in problem
    finally:
        await api.close()


@pytest.mark.real_apiserver
async def test_a_pattern_needs_the_permission_to_watch_the_resource(real_cluster: Any) -> None:
    """A user who may watch namespaces but not ConfigMaps: the glob's namespace is named."""
    kube_namespace = f"test-{secrets.token_hex(4)}"
    name = f"watch-namespaces-{kube_namespace}"
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": [{"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "User", "name": UNPRIVILEGED_USER}],
    }
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": kube_namespace}}
    async with real_cluster.http_session() as http:
        for path, body in (
            ("/api/v1/namespaces", namespace),
            (f"{rbac}/clusterroles", role),
            (f"{rbac}/clusterrolebindings", binding),
        ):
            async with http.post(path, json=body) as response:
                assert response.status == 201, await response.text()
    api = real_cluster.api_client(unprivileged=True)
    configmaps = ("", "v1", "configmaps")
    patterns = namespace_patterns(
        [configmaps], [kube_namespace[:-1] + "*"], kopf_shim.match_namespace
    )
    try:
        probe = WatchProbe([NAMESPACES], api=api, patterns=patterns)
        problems: list[str | None] = []

        async def namespaces_allowed() -> bool:
            problems.append(await probe.check_once())
            return problems[-1] is not None and "namespaces cluster-wide" not in problems[-1]

        await eventually(namespaces_allowed, message="RBAC for namespaces in effect")
        assert f"configmaps in {kube_namespace!r} is forbidden (403)" in str(problems[-1])
    finally:
        await api.close()
        async with real_cluster.http_session() as http:
            for path in (
                f"{rbac}/clusterrolebindings/{name}",
                f"{rbac}/clusterroles/{name}",
                f"/api/v1/namespaces/{kube_namespace}",
            ):
                async with http.delete(path) as response:
                    assert response.status == 200, await response.text()


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
