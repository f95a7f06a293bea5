"""The chart's Grafana dashboard and alerts, held to the metrics the operator exports.

Every PromQL expression (dashboard panels, annotations and variables; alert rules) is parsed
with a real PromQL parser, and every series it selects must be one the operator's registry
exposes, with every label it matches, groups or joins on present on that series at that point
of the expression. The exported names come from :func:`kopf_reconcile.metrics.register_metrics`
itself, as prometheus-client exposes them (``_total`` on counters, ``_bucket``/``_sum``/
``_count`` on histograms), so renaming a metric or a label fails here until the dashboard and
the alerts follow. Helm's rendering of them: tests/integration/test_chart_observability.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import promql_parser as promql
import pytest
import yaml
from prometheus_client import CollectorRegistry

from kopf_reconcile.metrics import BoundMetrics, Metrics, register_metrics

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kopf-reconcile"
DASHBOARD = CHART / "dashboards" / "kopf-reconcile.json"
RULES = CHART / "rules" / "kopf-reconcile.rules.yaml"
OPERATIONS = ROOT / "docs" / "operations.md"

#: Labels Prometheus adds to every series it scrapes through the chart's ServiceMonitor.
TARGET_LABELS = frozenset(
    {"namespace", "pod", "service", "container", "endpoint", "job", "instance"}
)
#: Labels whose values the user names (the reconciler id): their values are not checked.
NAME_LABELS = frozenset({"controller", "name"})
#: Grafana's range variables, replaced by a duration before parsing.
GRAFANA_RANGES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
#: Aggregations that keep the labels of the series they select.
SELECTING_AGGREGATIONS = frozenset({"topk", "bottomk", "limitk", "limit_ratio"})

Series = dict[str, dict[str, set[str]]]  # exported sample name -> label -> values seen


def exported_series() -> Series:
    """Every sample name the operator's registry exposes, with its labels and their values.

    The instruments are bound as a Loop binds them at start (every label set of every
    instrument, initialised), so each histogram exposes its buckets, sum and count: an
    unsharded reconciler's (``shard=""``) and the Loops of a sharded one's two shards.
    """
    registry = CollectorRegistry()
    metrics = register_metrics(registry)
    BoundMetrics(metrics, "devices")
    for shard in ("0", "1"):
        BoundMetrics(metrics, "sharded", shard=shard)
    series: Series = {}
    for family in registry.collect():
        for sample in family.samples:
            labels = series.setdefault(sample.name, {})
            for label, value in sample.labels.items():
                labels.setdefault(label, set()).add(value)
    return series


@pytest.fixture(scope="module")
def series() -> Series:
    return exported_series()


# --- what an expression uses ------------------------------------------------------------


@dataclass
class Check:
    """What one expression selects, and what is wrong with it."""

    metrics: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)


def parse(expr: str) -> Any:
    for variable, duration in GRAFANA_RANGES.items():
        expr = expr.replace(variable, duration)
    return promql.parse(expr)


def _alternatives(regex: str) -> list[str] | None:
    """The values of a plain alternation (``a|b``); None for any other regular expression."""
    return regex.split("|") if re.fullmatch(r"[A-Za-z0-9_]+(\|[A-Za-z0-9_]+)*", regex) else None


def _selector(node: Any, series: Series, check: Check) -> frozenset[str]:
    name = node.name
    check.metrics.add(name)
    if name not in series:
        check.problems.append(f"{name} is not exported")
        return TARGET_LABELS
    own = series[name]
    available = frozenset(own) | TARGET_LABELS
    for matcher in node.matchers.matchers:
        if matcher.name == "__name__":
            continue
        if matcher.name not in available:
            check.problems.append(f"{name} has no label {matcher.name!r}")
            continue
        if matcher.name in NAME_LABELS or matcher.name not in own or "$" in matcher.value:
            continue
        if matcher.op in (promql.MatchOp.Equal, promql.MatchOp.NotEqual):
            values: list[str] | None = [matcher.value]
        else:
            values = _alternatives(matcher.value)
        for value in values or []:
            if value not in own[matcher.name]:
                check.problems.append(f"{name}{{{matcher.name}}} is never {value!r}")
    return available


def _need(labels: list[str], available: frozenset[str], where: str, check: Check) -> None:
    for label in labels:
        if label not in available:
            check.problems.append(f"{where}: label {label!r} is not on {sorted(available)}")


def labels_of(node: Any, series: Series, check: Check) -> frozenset[str] | None:
    """The labels of ``node``'s result (None for a scalar or string); problems go to ``check``."""
    kind = type(node).__name__
    if kind == "VectorSelector":
        return _selector(node, series, check)
    if kind == "MatrixSelector":
        return labels_of(node.vector_selector, series, check)
    if kind in ("ParenExpr", "UnaryExpr", "SubqueryExpr"):
        return labels_of(node.expr, series, check)
    if kind in ("NumberLiteral", "StringLiteral"):
        return None
    if kind == "AggregateExpr":
        inner = labels_of(node.expr, series, check) or frozenset()
        if node.param is not None:
            labels_of(node.param, series, check)
        op = str(node.op)
        modifier = node.modifier
        if modifier is None:
            return inner if op in SELECTING_AGGREGATIONS else frozenset()
        wanted = list(modifier.labels)
        _need(wanted, inner, f"{op} {str(modifier.type).split('.')[-1].lower()}", check)
        if op in SELECTING_AGGREGATIONS:
            return inner
        if modifier.type == promql.AggModifierType.By:
            return frozenset(wanted)
        return inner - set(wanted)
    if kind == "Call":
        function = node.func.name
        args = [labels_of(arg, series, check) for arg in node.args]
        vector = next((a for a in args if a is not None), None)
        if function == "histogram_quantile":
            _need(["le"], vector or frozenset(), function, check)
            return (vector or frozenset()) - {"le"}
        if function in ("label_replace", "label_join"):
            strings = [a.val for a in node.args if type(a).__name__ == "StringLiteral"]
            sources = strings[3:] if function == "label_replace" else strings[2:]
            _need([s for s in sources if s], vector or frozenset(), function, check)
            return (vector or frozenset()) | {strings[0]}
        if function in ("scalar", "time", "pi"):
            return None
        if function == "vector":
            return frozenset()
        return vector
    if kind == "BinaryExpr":
        lhs = labels_of(node.lhs, series, check)
        rhs = labels_of(node.rhs, series, check)
        if lhs is None or rhs is None:
            return lhs if rhs is None else rhs
        op = str(node.op)
        modifier = node.modifier
        matching = modifier.matching if modifier is not None else None
        card = modifier.card if modifier is not None else None
        extra = list((modifier.group_labels if modifier is not None else None) or [])
        if matching is not None:
            on = matching.type == promql.LabelModifierType.Include
            both = lhs & rhs if on else lhs | rhs
            _need(list(matching.labels), both, f"{op} {'on' if on else 'ignoring'}", check)
        if card == promql.VectorMatchCardinality.ManyToOne:
            _need(extra, rhs, f"{op} group_left", check)
            return lhs | set(extra)
        if card == promql.VectorMatchCardinality.OneToMany:
            _need(extra, lhs, f"{op} group_right", check)
            return rhs | set(extra)
        if op == "or":
            return lhs | rhs
        if op in ("and", "unless"):
            return lhs
        if matching is not None and matching.type == promql.LabelModifierType.Include:
            return frozenset(matching.labels)
        if matching is not None:
            return lhs - set(matching.labels)
        return lhs
    raise AssertionError(f"a {kind} in an expression: teach labels_of about it")


def check(expr: str, series: Series) -> Check:
    result = Check()
    labels_of(parse(expr), series, result)
    return result


# --- the assets --------------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def dashboard_expressions() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and annotation of the dashboard."""
    board = dashboard()
    found = [
        (f"panel {panel['title']!r} {target['refId']}", target["expr"])
        for panel in panels(board)
        for target in panel.get("targets", [])
    ]
    found += [
        (f"annotation {a['name']!r}", a["expr"])
        for a in board["annotations"]["list"]
        if "expr" in a
    ]
    return found


def rules() -> list[dict[str, Any]]:
    loaded = yaml.safe_load(RULES.read_text())
    return [rule for group in loaded["groups"] for rule in group["rules"]]


def expressions() -> list[tuple[str, str]]:
    return [*dashboard_expressions(), *((f"alert {r['alert']}", r["expr"]) for r in rules())]


# --- the registry the checks rely on ----------------------------------------------------


def test_the_exported_names_are_what_prometheus_client_exposes(series: Series) -> None:
    registry = CollectorRegistry()
    metrics = register_metrics(registry)
    instruments = [f for f in vars(metrics) if getattr(metrics, f) is not None]
    assert len(instruments) == len(vars(Metrics()))  # every instrument is registered
    families = {family.name for family in registry.collect()}
    assert len(families) == len(instruments)
    for family in registry.collect():  # every instrument is bound and exposes its samples
        kind = family.type
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
        for suffix in suffixes.get(kind, [""]):
            assert family.name + suffix in series, (family.name, kind)
        if kind == "histogram":
            assert "le" in series[family.name + "_bucket"]


# --- the dashboard -----------------------------------------------------------------------


def test_dashboard_is_valid_json_with_the_expected_panels() -> None:
    board = dashboard()
    assert board["uid"] == "kopf-reconcile"
    assert board["title"] == "kopf-reconcile"
    titles = {panel["title"] for panel in panels(board) if panel["type"] != "row"}
    assert {
        "Leaders per reconciler",
        "Reconciles by result",
        "Reconcile latency",
        "Errors and retries",
        "Queue depth",
        "Follower backlog",
        "Leader per reconciler",
        "Epoch",
        "Lease acquisitions",
        "Lease errors",
        "Fenced writes by outcome",
        "Dead-lettered entities",
    } <= titles
    used = {metric for _, expr in dashboard_expressions() for metric in check(expr, {}).metrics}
    for metric in (
        "kopf_reconcile_reconcile_total",
        "kopf_reconcile_reconcile_time_seconds_bucket",
        "kopf_reconcile_workqueue_depth",
        "kopf_reconcile_follower_backlog",
        "kopf_reconcile_leader",
        "kopf_reconcile_epoch",
        "kopf_reconcile_lease_transitions_total",
        "kopf_reconcile_fenced_writes_total",
        "kopf_reconcile_dead_letter_entities",
    ):
        assert metric in used, f"the dashboard shows no {metric}"


def test_dashboard_layout_is_consistent() -> None:
    board = dashboard()
    ids = [panel["id"] for panel in panels(board)]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    titles = [panel["title"] for panel in panels(board)]
    assert len(titles) == len(set(titles)), "panel titles are unique"
    cells: set[tuple[int, int]] = set()
    for panel in panels(board):
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        area = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not area & cells, f"{panel['title']!r} overlaps another panel"
        cells |= area
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"


def test_dashboard_variables_name_exported_metrics_and_labels(series: Series) -> None:
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]["query"]
        assert query == variable["definition"]
        found = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
        assert found, query
        selector, label = found.groups()
        result = check(selector, series)
        assert result.problems == [], (query, result.problems)
        (metric,) = result.metrics
        assert label in set(series[metric]) | TARGET_LABELS, query


# --- every expression ----------------------------------------------------------------------


@pytest.mark.parametrize(("where", "expr"), expressions(), ids=[w for w, _ in expressions()])
def test_expression_parses_and_selects_exported_series(
    where: str, expr: str, series: Series
) -> None:
    result = check(expr, series)  # raises on a syntax error, an unknown function, a bad type
    assert result.metrics, f"{where} selects nothing"
    assert result.problems == [], f"{where}: {result.problems}"


def test_a_renamed_metric_or_label_is_caught(series: Series) -> None:
    """The checks themselves: each mistake below is reported."""
    bad = {
        "kopf_reconcile_leaders": "is not exported",
        "kopf_reconcile_reconcile": "is not exported",  # a counter is exposed with _total
        "kopf_reconcile_reconcile_time_seconds": "is not exported",  # a histogram is not
        'kopf_reconcile_reconcile_total{outcome="error"}': "no label 'outcome'",
        'kopf_reconcile_fenced_writes_total{outcome="rejected"}': "never 'rejected'",
        'kopf_reconcile_reconcile_total{result=~"error|failed"}': "never 'failed'",
        "sum by (controller) (kopf_reconcile_workqueue_depth)": "'controller' is not on",
        "sum by (name) (sum by (controller) (kopf_reconcile_epoch))": "'name' is not on",
        "histogram_quantile(0.9, sum by (controller) (rate("
        "kopf_reconcile_reconcile_time_seconds_bucket[5m])))": "'le' is not on",
        "kopf_reconcile_leader and on (result) kopf_reconcile_epoch": "'result' is not on",
    }
    for expr, complaint in bad.items():
        problems = check(expr, series).problems
        assert any(complaint in p for p in problems), (expr, problems)
    for expr in ("sum(rate(kopf_reconcile_reconcile_total[5m])", "rate(kopf_reconcile_epoch)"):
        with pytest.raises(ValueError):
            parse(expr)


# --- the alerts ------------------------------------------------------------------------------


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def operations_headings() -> dict[str, int]:
    """Anchor -> level of every heading of docs/operations.md (code blocks skipped)."""
    headings: dict[str, int] = {}
    fenced = False
    for line in OPERATIONS.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (found := re.match(r"(#+) (.+)", line)):
            headings[github_anchor(found.group(2))] = len(found.group(1))
    return headings


def test_alerts_are_the_promised_ones_with_severity_and_annotations() -> None:
    by_name = {rule["alert"]: rule for rule in rules()}
    assert set(by_name) == {
        "KopfReconcileNoLeader",
        "KopfReconcileDeadLettersRising",
        "KopfReconcileStaleWritesRejected",
        "KopfReconcileLeaderFlapping",
    }
    assert by_name["KopfReconcileNoLeader"]["for"] == "1m"
    for name, rule in by_name.items():
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert {"summary", "description", "runbook_url"} <= set(rule["annotations"]), name
        # Every alert is per reconciler, so it names the reconciler it is about; those
        # about a lease fire per shard of a sharded reconciler, and name it.
        assert "$labels.controller" in rule["annotations"]["summary"], name
        fires_per = labels_of(parse(rule["expr"]), exported_series(), Check())
        if name in PER_LEASE_ALERTS:
            assert fires_per == {"namespace", "controller", "shard"}, f"{name} fires per lease"
            assert "$labels.shard" in rule["annotations"]["summary"], name
        else:
            assert fires_per == {"namespace", "controller"}, f"{name} fires per reconciler"


#: Alerts about a lease: a shard of a sharded reconciler without a leader, or flapping,
#: is a problem of its own even when the other shards are fine.
PER_LEASE_ALERTS = frozenset({"KopfReconcileNoLeader", "KopfReconcileLeaderFlapping"})


def test_the_shard_label_is_on_counters_and_gauges_not_on_histograms(series: Series) -> None:
    registry = CollectorRegistry()
    register_metrics(registry)
    for family in registry.collect():
        if family.type == "histogram":
            assert "shard" not in series[f"{family.name}_count"], family.name
        else:  # unsharded: "" (no label, to Prometheus); a shard: its number
            exposed = family.name + ("_total" if family.type == "counter" else "")
            assert series[exposed]["shard"] == {"", "0", "1"}, family.name


def test_every_runbook_url_points_at_its_section_of_operations_md() -> None:
    headings = operations_headings()
    assert headings.get("alerts") == 2, "docs/operations.md has an '## Alerts' section"
    for rule in rules():
        url = rule["annotations"]["runbook_url"]
        page, _, anchor = url.partition("#")
        assert page.endswith("/docs/operations.md"), url
        assert anchor == github_anchor(rule["alert"]), url
        assert headings.get(anchor) == 3, f"no '### {rule['alert']}' in docs/operations.md"
