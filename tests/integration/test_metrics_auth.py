"""``/metrics`` behind TokenReview and SubjectAccessReview, on both Kubernetes API tiers;
``/healthz`` and ``/readyz`` open to everyone but telling details only to a reader."""

from __future__ import annotations

import contextlib
import secrets
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from kopf_reconcile import ConfigError
from kopf_reconcile.integration.endpoints import Endpoints
from kopf_reconcile.integration.metrics_auth import KubernetesAuthorizer, server_tls
from support import eventually

RBAC = "/apis/rbac.authorization.k8s.io/v1"
REASON = "the watch of devices.example.com in 'ops' is forbidden (403)"


@contextlib.asynccontextmanager
async def granted(
    kube: Any, rules: list[dict[str, Any]], subject: dict[str, str]
) -> AsyncIterator[None]:
    """A ClusterRole of ``rules`` bound to ``subject``, deleted afterwards."""
    name = f"granted-{secrets.token_hex(4)}"
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": rules,
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [subject],
    }
    async with kube.http_session() as http:
        for path, body in (
            (f"{RBAC}/clusterroles", role),
            (f"{RBAC}/clusterrolebindings", binding),
        ):
            async with http.post(path, json=body) as response:
                assert response.status == 201, await response.text()
    try:
        yield
    finally:
        async with kube.http_session() as http:
            for path in (f"{RBAC}/clusterrolebindings/{name}", f"{RBAC}/clusterroles/{name}"):
                async with http.delete(path) as response:
                    assert response.status == 200, await response.text()


@pytest_asyncio.fixture
async def authorizer(kube: Any) -> AsyncIterator[KubernetesAuthorizer]:
    api = kube.api_client()
    try:
        yield KubernetesAuthorizer(api)
    finally:
        await api.close()


async def test_the_kubernetes_api_decides_who_reads_metrics(
    kube: Any, authorizer: KubernetesAuthorizer
) -> None:
    assert (await authorizer.verdict(None)).status == 401
    assert (await authorizer.verdict("Basic YWRtaW46YWRtaW4=")).status == 401
    assert (await authorizer.verdict(f"Bearer {secrets.token_hex(16)}")).status == 401
    assert (await authorizer.verdict(f"Bearer {kube.admin_token}")).status == 200
    refused = await authorizer.verdict(f"Bearer {kube.unprivileged_token}")
    assert (refused.status, refused.reason) == (403, "nobody may not get /metrics")


async def test_a_cluster_role_on_the_metrics_url_lets_its_subject_read(kube: Any) -> None:
    rules = [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    nobody = {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "nobody"}
    api = kube.api_client()
    try:
        async with granted(kube, rules, nobody):

            async def allowed() -> bool:
                fresh = KubernetesAuthorizer(api)  # no cached verdict
                return (await fresh.verdict(f"Bearer {kube.unprivileged_token}")).allowed

            await eventually(allowed, message="the binding is in effect")
    finally:
        await api.close()


async def access_allowed(http: aiohttp.ClientSession, spec: dict[str, Any]) -> bool:
    review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec}
    path = "/apis/authorization.k8s.io/v1/subjectaccessreviews"
    async with http.post(path, json=review) as response:
        assert response.status == 201, await response.text()
        return bool((await response.json())["status"].get("allowed"))


async def test_access_reviews_follow_cluster_role_bindings_of_service_accounts(
    kube: Any, kube_namespace: str
) -> None:
    rules = [
        {
            "apiGroups": ["authentication.k8s.io"],
            "resources": ["tokenreviews"],
            "verbs": ["create"],
        },
        {"nonResourceURLs": ["/metrics", "/debug/*"], "verbs": ["get"]},
    ]
    reader = {"kind": "ServiceAccount", "name": "reader", "namespace": kube_namespace}
    account = f"system:serviceaccount:{kube_namespace}:reader"
    groups = ["system:serviceaccounts", "system:authenticated"]
    reviews = {"group": "authentication.k8s.io", "resource": "tokenreviews"}
    async with granted(kube, rules, reader), kube.http_session() as http:

        async def may(attributes: dict[str, Any], user: str = account) -> bool:
            kind = "nonResourceAttributes" if "path" in attributes else "resourceAttributes"
            return await access_allowed(http, {"user": user, "groups": groups, kind: attributes})

        async def bound() -> bool:
            return await may({"path": "/metrics", "verb": "get"})

        await eventually(bound, message="the binding is in effect")
        assert await may({"path": "/debug/pprof", "verb": "get"})
        assert not await may({"path": "/metrics", "verb": "post"})
        # Not /healthz: kube-apiserver's bootstrap roles let everyone get it.
        assert not await may({"path": "/configz", "verb": "get"})
        assert await may({**reviews, "verb": "create"})
        assert not await may({**reviews, "verb": "get"})
        other = f"system:serviceaccount:{kube_namespace}:other"
        assert not await may({"path": "/metrics", "verb": "get"}, user=other)


async def test_an_access_review_needs_exactly_one_kind_of_attributes(kube: Any) -> None:
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {"user": "nobody"},
    }
    async with (
        kube.http_session() as http,
        http.post("/apis/authorization.k8s.io/v1/subjectaccessreviews", json=review) as response,
    ):
        assert response.status == 422, await response.text()


async def test_endpoints_refuse_strangers_and_tell_them_nothing(
    kube: Any, authorizer: KubernetesAuthorizer
) -> None:
    endpoints = Endpoints(
        "127.0.0.1",
        0,
        ready=lambda: True,
        report=lambda: {"devices": {"leader": True}},
        problem=lambda: REASON,
        authorizer=authorizer,
    )
    url = await endpoints.start()
    reader = {"Authorization": f"Bearer {kube.admin_token}"}
    stranger = {"Authorization": f"Bearer {kube.unprivileged_token}"}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/metrics") as response:
                assert response.status == 401
                assert response.headers["WWW-Authenticate"].startswith("Bearer")
            async with http.get(f"{url}/metrics", headers=stranger) as response:
                assert response.status == 403
            async with http.get(f"{url}/metrics", headers=reader) as response:
                assert response.status == 200
                assert "# TYPE" in await response.text()
            for headers in ({}, stranger):
                async with http.get(f"{url}/healthz", headers=headers) as response:
                    assert (response.status, await response.json()) == (200, {"status": "ok"})
                async with http.get(f"{url}/readyz", headers=headers) as response:
                    assert (response.status, await response.json()) == (503, {"ready": False})
            async with http.get(f"{url}/healthz", headers=reader) as response:
                assert (await response.json())["reconcilers"] == {"devices": {"leader": True}}
            async with http.get(f"{url}/readyz", headers=reader) as response:
                assert (await response.json())["reason"] == REASON
    finally:
        await endpoints.stop()


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl makes the test certificate")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return str(cert), str(key)


async def test_metrics_over_tls(certificate: tuple[str, str]) -> None:
    cert, _ = certificate
    endpoints = Endpoints(
        "127.0.0.1", 0, ready=lambda: True, report=dict, ssl_context=server_tls(*certificate)
    )
    url = await endpoints.start()
    try:
        assert url.startswith("https://")
        trust = ssl.create_default_context(cafile=cert)
        async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics", ssl=trust) as r:
            assert r.status == 200
    finally:
        await endpoints.stop()


def test_unreadable_tls_files_are_a_configuration_error(tmp_path: Path) -> None:
    assert server_tls(None, None) is None
    with pytest.raises(ConfigError, match="KOPF_RECONCILE_METRICS_TLS_CERT"):
        server_tls(str(tmp_path / "absent.crt"), str(tmp_path / "absent.key"))
