"""The chart's opt-in Grafana dashboard ConfigMap and PrometheusRule, as Helm renders them.

The dashboard and the alerts themselves (their PromQL against the exported metrics, the
runbook anchors) are checked in tests/unit/test_observability_assets.py; here: both are
off by default, render from the chart's files unchanged when enabled, and follow their values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from chart_support import HELM, helm

pytestmark = pytest.mark.skipif(
    not HELM.exists(), reason="helm is installed into .venv/bin by `make tools`"
)

CHART = Path(__file__).resolve().parents[2] / "charts" / "kopf-reconcile"
DASHBOARD = CHART / "dashboards" / "kopf-reconcile.json"
RULES = CHART / "rules" / "kopf-reconcile.rules.yaml"
PROJECT_RUNBOOK = "https://github.com/kopf-reconcile/kopf-reconcile/blob/main/docs/operations.md"


def render(*settings: str) -> list[dict[str, Any]]:
    sets = [f"--set={s}" for s in ("database.existingSecret=db", *settings)]
    result = helm("template", "devices", str(CHART), "--namespace=ops", *sets)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def only(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def source_rules() -> list[dict[str, Any]]:
    loaded = yaml.safe_load(RULES.read_text())
    return [rule for group in loaded["groups"] for rule in group["rules"]]


def rendered_rules(rule: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def test_neither_is_rendered_by_default() -> None:
    docs = render()
    assert not [d for d in docs if d["kind"] == "PrometheusRule"]
    assert not [d for d in docs if d["metadata"]["name"] == "devices-dashboard"]


def test_the_dashboard_configmap_carries_the_file_and_the_sidecar_label() -> None:
    docs = render("grafanaDashboard.enabled=true")
    config_map = only(docs, "ConfigMap", "devices-dashboard")
    assert config_map["metadata"]["namespace"] == "ops"
    labels = config_map["metadata"]["labels"]
    assert labels["grafana_dashboard"] == "1"
    assert labels["app.kubernetes.io/instance"] == "devices"
    assert "annotations" not in config_map["metadata"]
    (key,) = config_map["data"]
    assert key.endswith(".json")
    assert json.loads(config_map["data"][key]) == json.loads(DASHBOARD.read_text())


def test_the_dashboard_configmap_follows_its_values() -> None:
    docs = render(
        "grafanaDashboard.enabled=true",
        "grafanaDashboard.namespace=monitoring",
        "grafanaDashboard.labels.grafana_dashboard=null",
        "grafanaDashboard.labels.dashboards=ops",
        "grafanaDashboard.annotations.grafana_folder=Operators",
    )
    metadata = only(docs, "ConfigMap", "devices-dashboard")["metadata"]
    assert metadata["namespace"] == "monitoring"
    assert metadata["labels"]["dashboards"] == "ops"
    assert "grafana_dashboard" not in metadata["labels"]
    assert metadata["annotations"] == {"grafana_folder": "Operators"}


def test_the_prometheus_rule_renders_the_rules_file_unchanged() -> None:
    rule = only(render("prometheusRule.enabled=true"), "PrometheusRule", "devices")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "ops"
    assert rendered_rules(rule) == source_rules()


def test_the_prometheus_rule_follows_its_values() -> None:
    docs = render(
        "prometheusRule.enabled=true",
        "prometheusRule.namespace=monitoring",
        "prometheusRule.labels.release=kube-prometheus-stack",
        "prometheusRule.annotations.owner=platform",
        "prometheusRule.additionalRuleLabels.team=platform",
        "prometheusRule.additionalRuleLabels.severity=page",
        "prometheusRule.runbookBaseUrl=https://wiki.example.com/kopf-reconcile/operations",
    )
    rule = only(docs, "PrometheusRule", "devices")
    assert rule["metadata"]["namespace"] == "monitoring"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["metadata"]["annotations"] == {"owner": "platform"}
    rendered = rendered_rules(rule)
    for source, out in zip(source_rules(), rendered, strict=True):
        assert out["expr"] == source["expr"]
        assert out.get("for") == source.get("for")
        # Added to every alert; the alert's own severity stays.
        assert out["labels"] == {**source["labels"], "team": "platform"}
        anchor = source["annotations"]["runbook_url"].split("#")[1]
        assert out["annotations"]["runbook_url"] == (
            f"https://wiki.example.com/kopf-reconcile/operations#{anchor}"
        )
        assert {k: v for k, v in out["annotations"].items() if k != "runbook_url"} == {
            k: v for k, v in source["annotations"].items() if k != "runbook_url"
        }


def test_the_template_knows_the_runbook_base_of_the_rules_file() -> None:
    """The template moves runbook URLs by replacing the file's base: they must agree."""
    for rule in source_rules():
        assert rule["annotations"]["runbook_url"].startswith(PROJECT_RUNBOOK + "#")
    assert PROJECT_RUNBOOK in (CHART / "templates" / "prometheusrule.yaml").read_text()


@pytest.mark.parametrize(
    ("setting", "complaint"),
    [
        ("prometheusRule.enable=true", "additional properties 'enable' not allowed"),
        ("grafanaDashboard.enabled=yes", "grafanaDashboard/enabled"),
        ("prometheusRule.runbookBaseUrl=docs/operations.md", "runbookBaseUrl"),
    ],
)
def test_values_schema_rejects_bad_observability_values(setting: str, complaint: str) -> None:
    result = helm(
        "template", "devices", str(CHART), "--set=database.existingSecret=db", f"--set={setting}"
    )
    assert result.returncode != 0, f"{setting} was accepted"
    assert complaint in result.stderr, result.stderr


def test_chart_lints_with_both_enabled() -> None:
    result = helm(
        "lint",
        str(CHART),
        "--strict",
        "--set=database.existingSecret=db",
        "--set=grafanaDashboard.enabled=true",
        "--set=prometheusRule.enabled=true",
    )
    assert result.returncode == 0, result.stdout + result.stderr
