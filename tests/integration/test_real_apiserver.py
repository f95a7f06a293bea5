"""The real kube-apiserver tier itself: identities, TLS, kubeconfig, and clean stops.

These run on the session's ``RealCluster`` (one API server for the whole run),
except the failed-start test, which needs only etcd and a stand-in server, and
the ``kube_namespace`` test, which holds on every backend.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client

from kopf_reconcile.testing.real_apiserver import KUBE_VERSION, RealCluster, RealClusterError

KUBECTL = Path(sys.executable).with_name("kubectl")


@pytest.mark.real_apiserver
async def test_serves_the_version_it_was_built_as(real_cluster: RealCluster) -> None:
    async with real_cluster.http_session() as http, http.get("/version") as response:
        assert response.status == 200
        assert (await response.json())["gitVersion"] == KUBE_VERSION


@pytest.mark.real_apiserver
async def test_unprivileged_identity_is_authenticated_but_forbidden(
    real_cluster: RealCluster,
) -> None:
    async with real_cluster.http_session(unprivileged=True) as http:
        async with http.get("/api/v1/namespaces") as response:
            assert response.status == 403
            status = await response.json()
        assert status["reason"] == "Forbidden"
        assert '"nobody"' in status["message"]  # the token's user, not system:anonymous
    async with real_cluster.http_session() as http, http.get("/api/v1/namespaces") as response:
        assert response.status == 200


@pytest.mark.real_apiserver
async def test_api_client_authenticates_as_admin(real_cluster: RealCluster) -> None:
    async with real_cluster.api_client() as api:
        namespaces = await client.CoreV1Api(api).list_namespace()
    assert "default" in {item.metadata.name for item in namespaces.items}


@pytest.mark.real_apiserver
async def test_tls_is_verified_against_the_generated_certificate(
    real_cluster: RealCluster,
) -> None:
    untrusting = aiohttp.TCPConnector(ssl=ssl.create_default_context())
    async with aiohttp.ClientSession(connector=untrusting) as http:
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await http.get(f"{real_cluster.url}/version")


@pytest.mark.real_apiserver
async def test_serves_custom_resources(real_cluster: RealCluster) -> None:
    # A server built with a Go newer than its dependencies expect can die encoding custom
    # resources (reflect-based codecs read the runtime's internals): the build must serve them.
    group = f"g{secrets.token_hex(4)}.example.com"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                        "spec": {"type": "object", "properties": {"size": {"type": "integer"}}},
                    }}},
                }
            ],
        },
    }  # fmt: skip
    widget = {"apiVersion": f"{group}/v1", "kind": "Widget", "metadata": {"name": "w"}}
    widgets = f"/apis/{group}/v1/namespaces/default/widgets"
    async with real_cluster.http_session() as http:
        async with http.post(
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=crd
        ) as response:
            assert response.status == 201, await response.text()
        deadline = time.monotonic() + 30
        while True:  # the group is served a moment after the definition is established
            async with http.post(widgets, json={**widget, "spec": {"size": 3}}) as response:
                if response.status == 201:
                    break
                assert response.status == 404, await response.text()
            assert time.monotonic() < deadline, "the custom resource was never served"
            await asyncio.sleep(0.1)
        async with http.get(f"{widgets}/w") as response:
            assert response.status == 200
            assert (await response.json())["spec"] == {"size": 3}


@pytest.mark.real_apiserver
@pytest.mark.skipif(not KUBECTL.exists(), reason="kubectl is installed by `make tools`")
def test_kubeconfigs_work_with_kubectl(real_cluster: RealCluster) -> None:
    def kubectl(kubeconfig: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [KUBECTL, "--kubeconfig", kubeconfig, "get", "namespaces", "-o", "name"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    admin = kubectl(real_cluster.kubeconfig)
    assert admin.returncode == 0, admin.stderr
    assert "namespace/default" in admin.stdout.split()
    unprivileged = kubectl(real_cluster.unprivileged_kubeconfig)
    assert unprivileged.returncode != 0
    assert "forbidden" in unprivileged.stderr.lower()


async def test_kube_namespace_exists_and_is_fresh(kube: Any, kube_namespace: str) -> None:
    async with kube.http_session() as http:
        async with http.get(f"/api/v1/namespaces/{kube_namespace}") as response:
            assert response.status == 200
            assert (await response.json())["status"]["phase"] == "Active"
        async with http.get(f"/api/v1/namespaces/{kube_namespace}/configmaps") as response:
            assert response.status == 200
            assert (await response.json())["items"] == []


@pytest.mark.real_apiserver
async def test_failed_start_stops_what_it_started_and_says_why(tmp_path: Path) -> None:
    # A stand-in API server that shows its arguments, then fails: etcd is already up by then.
    stand_in = tmp_path / "kube-apiserver"
    stand_in.write_text('#!/bin/sh\necho "broken on purpose: $*"\nexit 3\n')
    stand_in.chmod(0o755)

    with pytest.raises(RealClusterError) as failure:
        async with RealCluster(apiserver=stand_in):
            pytest.fail("a cluster whose API server exits must not start")

    message = str(failure.value)
    assert "exited with code 3" in message
    assert "broken on purpose" in message
    match = re.search(r"--cert-dir=(\S+)/certs", message)
    assert match is not None, message
    assert _leftovers(workdir=match[1]) == []


def _leftovers(workdir: str) -> list[str]:
    """The directory, if it still exists, and every process started with it (etcd's data dir)."""
    found = [workdir] if Path(workdir).exists() else []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if workdir.encode() in cmdline.read_bytes():
                found.append(f"process {cmdline.parent.name}")
        except OSError:
            continue  # exited while we looked
    return found
