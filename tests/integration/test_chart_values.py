"""The chart for any operator, as Helm renders it: the usual Helm values, CRDs from the user's
files (the example's only by default), handlers from the image or a ConfigMap, extra RBAC
rules, a strict schema, and a README that documents every value."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from chart_support import CHART, HELM, helm, rendered

pytestmark = pytest.mark.skipif(
    not HELM.exists(), reason="helm is installed into .venv/bin by `make tools`"
)

DB = "--set=database.existingSecret=db"
WEBSITES_CRD = """\
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: websites.example.org, annotations: {team: web}}
spec:
  group: example.org
  scope: Namespaced
  names: {kind: Website, plural: websites}
  versions: [{name: v1, served: true, storage: true, schema: {openAPIV3Schema: {type: object}}}]
---
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: blogs.example.org}
spec:
  group: example.org
  scope: Namespaced
  names: {kind: Blog, plural: blogs}
  versions: [{name: v1, served: true, storage: true, schema: {openAPIV3Schema: {type: object}}}]
"""


def render(*settings: str, files: dict[str, Path] | None = None) -> list[dict[str, Any]]:
    sets = [f"--set={s}" for s in settings]
    set_files = [f"--set-file={k}={v}" for k, v in (files or {}).items()]
    return rendered(DB, *sets, *set_files)


def refusal(*settings: str) -> str:
    result = helm("template", "devices", str(CHART), DB, *(f"--set={s}" for s in settings))
    assert result.returncode != 0, f"{settings} was accepted"
    return result.stderr


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = of_kind(docs, "Deployment")
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


def value_paths(schema: dict[str, Any], prefix: str = "") -> list[str]:
    """Every value the schema allows, as `a.b` (and `a[].b` inside lists of objects)."""
    paths = []
    for key, spec in schema.get("properties", {}).items():
        path = f"{prefix}{key}"
        paths.append(path)
        paths += value_paths(spec, f"{path}.")
        paths += value_paths(spec.get("items", {}), f"{path}[].")
    return paths


def test_the_readme_documents_every_value_and_no_other() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    readme = (CHART / "README.md").read_text()
    documented = set(re.findall(r"^\| `([^`]+)` \|", readme, re.MULTILINE))
    paths = value_paths(schema)
    leaves = {p for p in paths if not any(q.startswith((f"{p}.", f"{p}[].")) for q in paths)}
    assert leaves - documented == set(), "values the chart README does not document"
    assert documented - set(paths) == set(), "documented values the chart lacks"


def test_name_overrides_name_the_objects_and_the_app() -> None:
    docs = render("nameOverride=websites")
    (deployment,) = of_kind(docs, "Deployment")
    assert deployment["metadata"]["name"] == "devices-websites"
    labels = deployment["spec"]["selector"]["matchLabels"]
    assert labels["app.kubernetes.io/name"] == "websites"
    (test_pod,) = of_kind(docs, "Pod")
    assert "--selector=app.kubernetes.io/name=websites," in " ".join(
        test_pod["spec"]["containers"][0]["command"]
    )
    docs = render("fullnameOverride=web")
    names = {d["metadata"]["name"] for d in docs}
    assert "web" in names and "web-metrics" in names and "devices" not in names


def test_the_service_account_can_be_given_or_annotated() -> None:
    docs = render("serviceAccount.annotations.team=web")
    (account,) = [a for a in of_kind(docs, "ServiceAccount") if a["metadata"]["name"] == "devices"]
    assert account["metadata"]["annotations"] == {"team": "web"}
    docs = render("serviceAccount.create=false", "serviceAccount.name=ops-operator")
    # The chart makes only the helm test's and the metrics scraper's accounts then.
    made = sorted(a["metadata"]["name"] for a in of_kind(docs, "ServiceAccount"))
    assert made == ["devices-metrics-scraper", "devices-test"]
    assert pod_spec(docs)["serviceAccountName"] == "ops-operator"
    bindings = of_kind(docs, "RoleBinding") + of_kind(docs, "ClusterRoleBinding")
    operator_bindings = [
        b for b in bindings if not b["metadata"]["name"].endswith(("-test", "-metrics-reader"))
    ]
    assert operator_bindings
    assert all(b["subjects"][0]["name"] == "ops-operator" for b in operator_bindings)
    assert "serviceAccount.name is required" in refusal("serviceAccount.create=false")


def test_the_pod_takes_the_usual_values() -> None:
    docs = render(
        "podAnnotations.team=web",
        "podLabels.tier=ops",
        "resources.limits.memory=512Mi",
        "nodeSelector.disk=ssd",
        "tolerations[0].key=dedicated",
        "tolerations[0].operator=Exists",
        "affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight=1",
        "affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].preference.matchExpressions[0].key=zone",
        "affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].preference.matchExpressions[0].operator=Exists",
        "extraEnv[0].name=GREETING",
        "extraEnv[0].value=hello",
        "imagePullSecrets[0].name=registry",
        "priorityClassName=operators",
    )
    (deployment,) = of_kind(docs, "Deployment")
    template = deployment["spec"]["template"]
    assert template["metadata"]["annotations"]["team"] == "web"
    assert template["metadata"]["labels"]["tier"] == "ops"
    spec = template["spec"]
    container = spec["containers"][0]
    assert container["resources"]["limits"]["memory"] == "512Mi"
    assert {"name": "GREETING", "value": "hello"} in container["env"]
    assert spec["nodeSelector"] == {"disk": "ssd"}
    assert spec["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]
    assert spec["affinity"]["nodeAffinity"]
    assert spec["imagePullSecrets"] == [{"name": "registry"}]
    assert spec["priorityClassName"] == "operators"


def test_zero_replicas_are_allowed() -> None:
    docs = render("replicaCount=0")
    (deployment,) = of_kind(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 0
    assert of_kind(docs, "PodDisruptionBudget") == []
    assert "replicaCount" in refusal("replicaCount=-1")


def test_the_example_crd_is_only_the_default(tmp_path: Path) -> None:
    (example,) = of_kind(render(), "CustomResourceDefinition")
    assert example["metadata"]["name"] == "devices.example.com"
    assert example["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}

    mine = tmp_path / "websites.yaml"
    mine.write_text(WEBSITES_CRD)
    crds = of_kind(render(files={"crds.manifests": mine}), "CustomResourceDefinition")
    assert [c["metadata"]["name"] for c in crds] == ["websites.example.org", "blogs.example.org"]
    assert crds[0]["metadata"]["annotations"] == {"team": "web", "helm.sh/resource-policy": "keep"}
    assert of_kind(render("crds.install=false"), "CustomResourceDefinition") == []

    not_a_crd = tmp_path / "configmap.yaml"
    not_a_crd.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    result = helm("template", "devices", str(CHART), DB, f"--set-file=crds.manifests={not_a_crd}")
    assert result.returncode != 0
    assert "crds.manifests holds a ConfigMap, not a CustomResourceDefinition" in result.stderr


def test_no_crd_comes_from_helms_crds_directory() -> None:
    """Helm installs what crds/ holds whatever the values say: the example's CRD would come
    with every operator."""
    assert not (CHART / "crds").exists()


@pytest.mark.parametrize("cluster_wide", [False, True])
def test_extra_rules_are_granted_where_the_watched_resources_are(cluster_wide: bool) -> None:
    docs = render(
        f"clusterWide={str(cluster_wide).lower()}",
        "rbac.extraRules[0].apiGroups={}",
        "rbac.extraRules[0].resources={configmaps}",
        "rbac.extraRules[0].verbs={get,create}",
        "rbac.extraClusterRules[0].apiGroups={}",
        "rbac.extraClusterRules[0].resources={namespaces}",
        "rbac.extraClusterRules[0].verbs={create}",
    )
    kind = "ClusterRole" if cluster_wide else "Role"
    name = "devices-ops-extra" if cluster_wide else "devices-extra"
    (role,) = [r for r in of_kind(docs, kind) if r["metadata"]["name"] == name]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "create"]}
    ]
    (binding,) = [b for b in of_kind(docs, f"{kind}Binding") if b["metadata"]["name"] == name]
    assert binding["roleRef"]["name"] == name
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "devices", "namespace": "ops"}
    ]
    (cluster,) = [
        r
        for r in of_kind(docs, "ClusterRole")
        if r["metadata"]["name"] == "devices-ops-extra-cluster"
    ]
    assert cluster["rules"][0]["resources"] == ["namespaces"]
    # None asked for: no role at all (the RBAC tests take every verb of every role away).
    assert not [d for d in render() if d["metadata"]["name"].endswith(("-extra", "-extra-cluster"))]


def test_handlers_come_from_a_configmap_of_yours() -> None:
    docs = render("handlers.configMap.name=website-handlers", "handlers.configMap.key=main.py")
    spec = pod_spec(docs)
    assert spec["containers"][0]["args"][0] == "/handlers/main.py"
    (volume,) = [v for v in spec["volumes"] if v["name"] == "handlers"]
    assert volume["configMap"]["name"] == "website-handlers"
    assert of_kind(docs, "ConfigMap") == []  # yours, not the chart's
    assert "not both" in refusal("handlers.inline=x", "handlers.configMap.name=website-handlers")


@pytest.mark.parametrize(
    ("setting", "complaint"),
    [
        ("serviceAccount.role=x", "additional properties 'role' not allowed"),
        ("rbac.rules[0].verbs={get}", "additional properties 'rules' not allowed"),
        ("rbac.extraRules[0].resources={configmaps}", "verbs"),
        ("crds.files=x", "additional properties 'files' not allowed"),
        ("nameOverride=Not_A_Name", "nameOverride"),
        ("handlers.configMap.key=handlers.sh", "key"),
    ],
)
def test_the_schema_stays_strict(setting: str, complaint: str) -> None:
    assert complaint in refusal(setting)
