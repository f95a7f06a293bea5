"""The API server's fence as the chart installs it and `kopf-reconcile fence-policy` prints it:
the same objects as the library's, on by default, off with `fence.enabled=false`."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
import yaml

from chart_support import CHART, HELM, helm
from kopf_reconcile.integration import fence_policy
from support import BIN

pytestmark = pytest.mark.skipif(
    not HELM.exists(), reason="helm is installed into .venv/bin by `make tools`"
)


def rendered(*settings: str) -> list[dict[str, Any]]:
    sets = [f"--set={s}" for s in ("database.existingSecret=db", *settings)]
    result = helm("template", "devices", str(CHART), "--namespace=ops", *sets)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def essence(obj: dict[str, Any]) -> dict[str, Any]:
    """What an object does (labels aside; Helm puts the release namespace on namespaced ones)."""
    metadata = {k: v for k, v in obj["metadata"].items() if k not in ("labels", "namespace")}
    return {**obj, "metadata": metadata}


def test_the_chart_installs_the_librarys_fence_for_its_own_account() -> None:
    docs = rendered()
    fence = [essence(d) for d in docs if d["metadata"]["name"] == "devices-ops-fence"]
    expected = [essence(d) for d in fence_policy.manifests("devices", "ops", "devices")]
    key = lambda d: d["kind"]  # noqa: E731
    assert sorted(fence, key=key) == sorted(expected, key=key)
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    env = {e["name"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "KOPF_RECONCILE_API_FENCE" not in env  # on: the default


def test_the_policy_file_is_the_librarys_policy() -> None:
    spec = json.loads((CHART / "files" / "fence-policy-spec.json").read_text())
    assert spec == fence_policy.policy("any")["spec"]


def test_without_the_fence_the_writes_carry_no_lease() -> None:
    docs = rendered("fence.enabled=false")
    assert not [d for d in docs if d["metadata"]["name"].endswith("-fence")]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    env = {
        e["name"]: e.get("value")
        for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["KOPF_RECONCILE_API_FENCE"] == "off"


def test_the_command_prints_the_same_objects_and_refuses_a_bad_name() -> None:
    argv = [
        str(BIN / "kopf-reconcile"),
        "fence-policy",
        "--namespace",
        "ops",
        "--service-account",
        "op",
    ]
    printed = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60)
    assert list(yaml.safe_load_all(printed.stdout)) == fence_policy.manifests(
        "kopf-reconcile", "ops", "op"
    )
    refused = subprocess.run(
        [*argv[:-1], "Op"], capture_output=True, text=True, check=False, timeout=60
    )
    assert refused.returncode == 2
    assert "--service-account must be a Kubernetes name" in refused.stderr
    assert not refused.stdout
