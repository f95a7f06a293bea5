"""The Helm chart: lint, render, and server-side validation on the real API server."""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kopf-reconcile"
BIN = Path(sys.executable).parent
HELM, KUBECTL = BIN / "helm", BIN / "kubectl"

pytestmark = pytest.mark.skipif(
    not HELM.exists() or not KUBECTL.exists(),
    reason="helm/kubectl are installed into .venv/bin by `make tools`",
)


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(HELM), *args], capture_output=True, text=True, timeout=60, check=False
    )


def render(*settings: str, kube_version: str = "1.20.2") -> list[dict[str, Any]]:
    sets = [f"--set={s}" for s in ("database.existingSecret=db", *settings)]
    result = helm("template", "devices", str(CHART), "--namespace=ops", *sets,
                  f"--kube-version={kube_version}")  # fmt: skip
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_chart_lints() -> None:
    result = helm("lint", str(CHART), "--set=database.existingSecret=db", "--strict")
    assert result.returncode == 0, result.stdout + result.stderr


def test_dsn_secret_is_required_with_a_clear_message() -> None:
    result = helm("template", "devices", str(CHART))
    assert result.returncode != 0
    assert "database.existingSecret is required" in result.stderr


def test_deployment_wires_identity_database_and_probes() -> None:
    docs = render("replicaCount=3")
    (deployment,) = by_kind(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 3
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    secret_ref = env["KOPF_RECONCILE_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
    assert secret_ref == {"name": "db", "key": "database-url"}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["args"][:2] == ["run", "/app/handlers.py"]


def test_rbac_allows_leases_and_only_reading_the_watched_objects() -> None:
    docs = render()
    roles = {r["metadata"]["name"]: r for r in by_kind(docs, "Role")}
    lease_rules = roles["devices-leases"]["rules"]
    assert any("leases" in r["resources"] and "update" in r["verbs"] for r in lease_rules)
    watch_rules = roles["devices-watch"]["rules"]
    devices = [r for r in watch_rules if r["resources"] == ["devices"]]
    assert devices and set(devices[0]["verbs"]) == {"get", "list", "watch"}  # never patched
    status = [r for r in watch_rules if r["resources"] == ["devices/status"]]
    assert status and "patch" in status[0]["verbs"]
    assert by_kind(render("clusterWide=true"), "ClusterRole")


@pytest.mark.parametrize(
    ("kube_version", "api"), [("1.20.2", "policy/v1beta1"), ("1.25.0", "policy/v1")]
)
def test_api_versions_follow_the_cluster(kube_version: str, api: str) -> None:
    (pdb,) = by_kind(render(kube_version=kube_version), "PodDisruptionBudget")
    assert pdb["apiVersion"] == api


def test_inline_handlers_are_mounted_from_a_configmap() -> None:
    docs = render("handlers.inline=import kopf_reconcile")
    (config_map,) = by_kind(docs, "ConfigMap")
    assert "import kopf_reconcile" in config_map["data"]["handlers.py"]
    (deployment,) = by_kind(docs, "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["args"][1] == (
        "/handlers/handlers.py"
    )


@pytest.mark.real_apiserver
async def test_rendered_chart_passes_server_side_validation(real_cluster: Any) -> None:
    namespace = f"chart-{secrets.token_hex(4)}"
    body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    async with (
        real_cluster.http_session() as http,
        http.post("/api/v1/namespaces", json=body) as response,
    ):
        assert response.status == 201, await response.text()
    # Render for the server's own version, as `helm install` would.
    rendered = helm("template", "devices", str(CHART), f"--namespace={namespace}",
                    "--set=database.existingSecret=db", "--kube-version=1.20.2")  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    command = [str(KUBECTL), f"--kubeconfig={real_cluster.kubeconfig}", "apply",
               "--dry-run=server", f"--namespace={namespace}", "-f", "-"]  # fmt: skip
    applied = await asyncio.to_thread(
        subprocess.run,
        command,
        input=rendered.stdout,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert applied.returncode == 0, applied.stderr
    for kind in ("deployment.apps/devices", "role.rbac.authorization.k8s.io/devices-leases",
                 "poddisruptionbudget.policy/devices"):  # fmt: skip
        assert kind in applied.stdout, applied.stdout
