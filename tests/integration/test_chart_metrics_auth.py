"""The chart's authenticated metrics, as Helm renders them: on by default, the RBAC the operator
needs for TokenReviews and SubjectAccessReviews, the reader role, the ServiceMonitor's token,
TLS and the NetworkPolicy as options. (That the operator uses the review permissions, and
that a scrape with the ServiceMonitor's token succeeds, is shown with the image in
test_chart.py and in the pod tier.)"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from chart_support import CHART, HELM, helm

pytestmark = pytest.mark.skipif(
    not HELM.exists(), reason="helm is installed into .venv/bin by `make tools`"
)

MONITORING = "--api-versions=monitoring.coreos.com/v1/ServiceMonitor"


def rendered(*settings: str, extra: tuple[str, ...] = ()) -> dict[tuple[str, str], Any]:
    """The chart's objects by (kind, name), for release ``devices`` in namespace ``ops``."""
    sets = [f"--set={s}" for s in ("database.existingSecret=db", *settings)]
    result = helm("template", "devices", str(CHART), "--namespace=ops", *sets, *extra)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def container(objects: dict[tuple[str, str], Any]) -> dict[str, Any]:
    spec: dict[str, Any] = objects[("Deployment", "devices")]["spec"]["template"]["spec"]
    return spec["containers"][0]  # type: ignore[no-any-return]


def test_metrics_are_authenticated_by_default() -> None:
    objects = rendered(extra=(MONITORING,))
    env = {e["name"]: e.get("value") for e in container(objects)["env"]}
    assert env["KOPF_RECONCILE_METRICS_AUTH"] == "kubernetes"
    assert "KOPF_RECONCILE_METRICS_TLS_CERT" not in env
    reviews = objects[("ClusterRole", "devices-ops-metrics-auth")]["rules"]
    assert reviews == [
        {
            "apiGroups": ["authentication.k8s.io"],
            "resources": ["tokenreviews"],
            "verbs": ["create"],
        },
        {
            "apiGroups": ["authorization.k8s.io"],
            "resources": ["subjectaccessreviews"],
            "verbs": ["create"],
        },
    ]
    binding = objects[("ClusterRoleBinding", "devices-ops-metrics-auth")]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "devices", "namespace": "ops"}
    ]
    reader = objects[("ClusterRole", "devices-ops-metrics-reader")]
    assert reader["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    readers = objects[("ClusterRoleBinding", "devices-ops-metrics-reader")]["subjects"]
    assert readers == [
        {"kind": "ServiceAccount", "name": "devices-metrics-scraper", "namespace": "ops"}
    ]
    token = objects[("Secret", "devices-metrics-scraper-token")]
    assert token["type"] == "kubernetes.io/service-account-token"
    assert token["metadata"]["annotations"] == {
        "kubernetes.io/service-account.name": "devices-metrics-scraper"
    }
    (endpoint,) = objects[("ServiceMonitor", "devices")]["spec"]["endpoints"]
    assert endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "devices-metrics-scraper-token", "key": "token"},
    }
    assert ("NetworkPolicy", "devices-metrics") not in objects


def test_more_readers_can_be_bound() -> None:
    prometheus = "metricsAuth.readers[0].kind=ServiceAccount,metricsAuth.readers[0].name=prom"
    objects = rendered(f"{prometheus},metricsAuth.readers[0].namespace=monitoring")
    subjects = objects[("ClusterRoleBinding", "devices-ops-metrics-reader")]["subjects"]
    assert {"kind": "ServiceAccount", "name": "prom", "namespace": "monitoring"} in subjects


def test_metrics_auth_can_be_turned_off() -> None:
    objects = rendered("metricsAuth.enabled=false", extra=(MONITORING,))
    env = {e["name"] for e in container(objects)["env"]}
    assert "KOPF_RECONCILE_METRICS_AUTH" not in env
    assert not [key for key in objects if "metrics-auth" in key[1] or "scraper" in key[1]]
    (endpoint,) = objects[("ServiceMonitor", "devices")]["spec"]["endpoints"]
    assert "authorization" not in endpoint


def test_tls_serves_https_to_probes_and_the_service_monitor() -> None:
    objects = rendered("metricsAuth.tls.secretName=metrics-tls", extra=(MONITORING,))
    operator = container(objects)
    env = {e["name"]: e.get("value") for e in operator["env"]}
    assert env["KOPF_RECONCILE_METRICS_TLS_CERT"] == "/etc/kopf-reconcile/metrics-tls/tls.crt"
    assert env["KOPF_RECONCILE_METRICS_TLS_KEY"] == "/etc/kopf-reconcile/metrics-tls/tls.key"
    assert operator["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert operator["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    (endpoint,) = objects[("ServiceMonitor", "devices")]["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"]["serverName"] == "devices-metrics.ops.svc"
    hook = objects[("Pod", "devices-test-leases")]["spec"]["containers"][0]
    assert "--ca-file=/etc/kopf-reconcile/metrics-ca/ca.crt" in hook["command"]


def test_a_network_policy_admits_only_the_given_peers_to_the_metrics_port() -> None:
    peer = "metricsAuth.networkPolicy.from[0].namespaceSelector.matchLabels.name=monitoring"
    objects = rendered("metricsAuth.networkPolicy.enabled=true", peer)
    policy = objects[("NetworkPolicy", "devices-metrics")]["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]


def test_the_helm_test_hook_may_read_the_reports() -> None:
    objects = rendered()
    binding = objects[("ClusterRoleBinding", "devices-test-ops-metrics-reader")]
    assert binding["roleRef"]["name"] == "devices-ops-metrics-reader"
