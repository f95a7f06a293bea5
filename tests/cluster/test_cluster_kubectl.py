"""kubectl with the cluster's kubeconfig: get, apply, replace and delete, plain defaults
(client-side validation and apply, no ``--validate=false``)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from widget_kind import widget_crd

from support import eventually

KUBECTL = Path(sys.executable).with_name("kubectl")


async def kubectl(kube: Any, *args: str, stdin: str | None = None) -> str:
    """Run kubectl against the cluster; fail the test with its stderr if it fails."""
    process = await asyncio.create_subprocess_exec(
        str(KUBECTL),
        "--kubeconfig",
        kube.kubeconfig,
        *args,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await process.communicate(stdin.encode() if stdin is not None else None)
    assert process.returncode == 0, f"kubectl {' '.join(args)}: {stderr.decode()}"
    return stdout.decode()


def manifest(tmp_path: Path, name: str, document: dict[str, Any]) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(document))
    return str(path)


def lease(namespace: str, name: str, holder: str) -> dict[str, Any]:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": 15,
            "renewTime": "2024-01-02T03:04:05.000006Z",
        },
    }


pytestmark = [pytest.mark.slow, pytest.mark.skipif(not KUBECTL.exists(), reason="no kubectl")]


async def test_get_leases(
    kube: Any, http: aiohttp.ClientSession, kube_namespace: str, unique: Callable[[str], str]
) -> None:
    name = unique("lease")
    body = lease(kube_namespace, name, "holder-1")
    url = f"/apis/coordination.k8s.io/v1/namespaces/{kube_namespace}/leases"
    assert (await http.post(url, json=body)).status == 201

    table = await kubectl(kube, "get", "leases", "-A")
    header, *rows = table.splitlines()
    assert header.split()[:3] == ["NAMESPACE", "NAME", "HOLDER"]
    assert [kube_namespace, name, "holder-1"] in [row.split()[:3] for row in rows]

    document = yaml.safe_load(
        await kubectl(kube, "get", "lease", name, "-n", kube_namespace, "-o", "yaml")
    )
    assert document["kind"] == "Lease"
    assert document["metadata"]["name"] == name
    assert document["spec"]["holderIdentity"] == "holder-1"
    assert document["spec"]["renewTime"] == "2024-01-02T03:04:05.000006Z"


async def test_apply_replace_delete_lease(
    kube: Any,
    http: aiohttp.ClientSession,
    kube_namespace: str,
    tmp_path: Path,
    unique: Callable[[str], str],
) -> None:
    name = unique("lease")
    url = f"/apis/coordination.k8s.io/v1/namespaces/{kube_namespace}/leases/{name}"
    output = await kubectl(
        kube, "apply", "-f", manifest(tmp_path, "a", lease(kube_namespace, name, "one"))
    )
    assert "created" in output
    output = await kubectl(
        kube, "apply", "-f", manifest(tmp_path, "b", lease(kube_namespace, name, "two"))
    )
    assert "configured" in output
    assert (await (await http.get(url)).json())["spec"]["holderIdentity"] == "two"

    await kubectl(
        kube, "replace", "-f", manifest(tmp_path, "c", lease(kube_namespace, name, "three"))
    )
    assert (await (await http.get(url)).json())["spec"]["holderIdentity"] == "three"

    await kubectl(kube, "delete", "lease", name, "-n", kube_namespace)
    assert (await http.get(url)).status == 404


async def test_server_side_apply(
    kube: Any,
    http: aiohttp.ClientSession,
    kube_namespace: str,
    tmp_path: Path,
    unique: Callable[[str], str],
) -> None:
    name = unique("lease")
    url = f"/apis/coordination.k8s.io/v1/namespaces/{kube_namespace}/leases/{name}"
    for step, holder in enumerate(("one", "two")):
        path = manifest(tmp_path, f"ssa{step}", lease(kube_namespace, name, holder))
        output = await kubectl(kube, "apply", "--server-side", "-f", path)
        assert "serverside-applied" in output
    applied = await (await http.get(url)).json()
    assert applied["spec"]["holderIdentity"] == "two"
    managers = {(e["manager"], e["operation"]) for e in applied["metadata"]["managedFields"]}
    assert ("kubectl", "Apply") in managers

    # Another manager changing a field kubectl applied must force its way.
    taken = lease(kube_namespace, name, "three")
    path = manifest(tmp_path, "ssa-other", taken)
    process = await asyncio.create_subprocess_exec(
        str(KUBECTL),
        "--kubeconfig",
        kube.kubeconfig,
        "apply",
        "--server-side",
        "--field-manager=other",
        "-f",
        path,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await process.communicate()
    assert process.returncode != 0
    assert "conflict" in stderr.decode().lower()
    await kubectl(
        kube, "apply", "--server-side", "--field-manager=other", "--force-conflicts", "-f", path
    )
    assert (await (await http.get(url)).json())["spec"]["holderIdentity"] == "three"


async def test_apply_a_crd_and_its_object(
    kube: Any, http: aiohttp.ClientSession, kube_namespace: str, tmp_path: Path
) -> None:
    group = f"{kube_namespace}.example.com"  # CRDs are cluster-wide: a group of its own
    await kubectl(kube, "apply", "-f", manifest(tmp_path, "crd", widget_crd(group)))

    async def established() -> bool:
        crd = await (
            await http.get(
                f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/widgets.{group}"
            )
        ).json()
        conditions = {c["type"]: c["status"] for c in crd.get("status", {}).get("conditions") or []}
        return conditions.get("Established") == "True"

    await eventually(established, 30, message="CRD established")
    await kubectl(kube, "wait", "--for=condition=Established", f"crd/widgets.{group}")

    def widget(size: int) -> dict[str, Any]:
        return {
            "apiVersion": f"{group}/v1",
            "kind": "Widget",
            "metadata": {"name": "w1", "namespace": kube_namespace},
            "spec": {"size": size},
        }

    url = f"/apis/{group}/v1/namespaces/{kube_namespace}/widgets/w1"
    assert "created" in await kubectl(kube, "apply", "-f", manifest(tmp_path, "w1", widget(1)))
    assert "configured" in await kubectl(kube, "apply", "-f", manifest(tmp_path, "w2", widget(2)))
    document = json.loads(
        await kubectl(kube, "get", f"widgets.{group}", "w1", "-n", kube_namespace, "-o", "json")
    )
    assert document["spec"] == {"size": 2, "color": "red"}
    assert document["metadata"]["generation"] == 2

    await kubectl(kube, "replace", "-f", manifest(tmp_path, "w3", widget(3)))
    assert (await (await http.get(url)).json())["spec"]["size"] == 3

    await kubectl(kube, "delete", "-f", manifest(tmp_path, "w4", widget(3)))
    assert (await http.get(url)).status == 404
    await kubectl(kube, "delete", "crd", f"widgets.{group}")
