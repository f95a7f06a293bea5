"""kubectl's imperative creates of built-in kinds (``create namespace``, ``create
configmap``, ``create secret generic``): kubectl sends them as protobuf, and the objects
read back as JSON are what was asked for."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from test_cluster_kubectl import KUBECTL, kubectl

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not KUBECTL.exists(), reason="no kubectl")]


async def test_kubectl_create_namespace_configmap_and_secret(
    kube: Any, http: aiohttp.ClientSession, unique: Callable[[str], str], tmp_path: Path
) -> None:
    namespace = unique("created")
    assert f"namespace/{namespace} created" in await kubectl(kube, "create", "namespace", namespace)
    async with http.get(f"/api/v1/namespaces/{namespace}") as response:
        assert response.status == 200
        created = await response.json()
    assert created["status"]["phase"] == "Active"
    assert created["spec"]["finalizers"] == ["kubernetes"]

    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\x00\xff\xfe binary")
    await kubectl(
        kube, "create", "configmap", "settings", "-n", namespace,
        "--from-literal=mode=fast", "--from-literal=empty=", f"--from-file=blob={binary}",
    )  # fmt: skip
    await kubectl(kube, "label", "configmap", "settings", "-n", namespace, "team=a")
    async with http.get(f"/api/v1/namespaces/{namespace}/configmaps/settings") as response:
        assert response.status == 200
        configmap = await response.json()
    assert configmap["data"] == {"mode": "fast", "empty": ""}
    assert base64.b64decode(configmap["binaryData"]["blob"]) == b"\x00\xff\xfe binary"
    assert configmap["metadata"]["labels"] == {"team": "a"}

    await kubectl(
        kube, "create", "secret", "generic", "credentials", "-n", namespace,
        "--from-literal=password=s3cret", "--type=example.com/token",
    )  # fmt: skip
    async with http.get(f"/api/v1/namespaces/{namespace}/secrets/credentials") as response:
        assert response.status == 200
        secret = await response.json()
    assert secret["type"] == "example.com/token"
    assert base64.b64decode(secret["data"]["password"]) == b"s3cret"

    # A second create of the same name is refused as the server words it.
    process_output = await _failing(kube, "create", "configmap", "settings", "-n", namespace)
    assert 'configmaps "settings" already exists' in process_output


async def _failing(kube: Any, *args: str) -> str:
    process = await asyncio.create_subprocess_exec(
        str(KUBECTL), "--kubeconfig", kube.kubeconfig, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    output, _ = await process.communicate()
    assert process.returncode != 0, output.decode()
    return output.decode()
