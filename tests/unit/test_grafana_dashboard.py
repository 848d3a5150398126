"""The Grafana dashboard in packaging/grafana/ imports, and queries only the endpoint's metrics (issue 18)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuhook.daemon.metrics import METRICS

DASHBOARD = Path(__file__).resolve().parents[2] / "packaging" / "grafana" / "gpuhook.json"

#: The histogram series a family's name may carry (Prometheus' exposition of a histogram).
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

#: PromQL's aggregation operators, functions and keywords: identifiers in an expression that name no metric.
PROMQL_WORDS = frozenset({
    # aggregation operators
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
    "quantile", "limitk", "limit_ratio",
    # functions
    "abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min", "day_of_month",
    "day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp", "floor", "histogram_avg",
    "histogram_count", "histogram_fraction", "histogram_quantile", "histogram_stddev", "histogram_stdvar",
    "histogram_sum", "holt_winters", "hour", "idelta", "increase", "irate", "label_join", "label_replace", "ln",
    "log2", "log10", "minute", "month", "predict_linear", "rate", "resets", "round", "scalar", "sgn", "sort",
    "sort_desc", "sort_by_label", "sort_by_label_desc", "sqrt", "time", "timestamp", "vector", "year",
    "avg_over_time", "min_over_time", "max_over_time", "sum_over_time", "count_over_time", "quantile_over_time",
    "stddev_over_time", "stdvar_over_time", "last_over_time", "present_over_time", "mad_over_time",
    # keywords and binary operators
    "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or", "unless",
    "atan2", "inf", "nan",
})

#: Grafana's templating functions a variable's query may use (label_values(metric, label) and friends).
GRAFANA_VARIABLE_FUNCTIONS = frozenset({"label_names", "label_values", "metrics", "query_result"})

IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def _dashboard() -> dict[str, Any]:
    obj = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert isinstance(obj, dict)
    return obj


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, those nested in (collapsed) rows too."""
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _targets(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield panel, target


def metric_names(expr: str, *, variable_query: bool = False) -> set[str]:
    """The metric names *expr* reads: its identifiers less PromQL's words, label names and Grafana's variables."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers: {label="value", ...}
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery durations: [5m], [1h:1m]
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    expr = re.sub(r"\$\{[^}]*\}|\$\w+", "", expr)  # Grafana's variables: $instance, ${datasource}
    expr = re.sub(r"\boffset\s+-?\w+", "", expr)  # offset 5m
    expr = re.sub(r"(?<![\w:])\d[\w.]*", "", expr)  # numbers and durations: 0.99, 1e3, 5m
    if variable_query:
        # label_values(label) and label_values(metric, label): the last argument is a label name
        expr = re.sub(r"\blabel_values\(\s*[A-Za-z_]\w*\s*\)", "", expr)
        expr = re.sub(r",\s*[A-Za-z_]\w*\s*\)\s*$", ")", expr)
    words = PROMQL_WORDS | (GRAFANA_VARIABLE_FUNCTIONS if variable_query else frozenset())
    return {name for name in IDENTIFIER.findall(expr) if name not in words}


def family(name: str) -> str:
    """The METRICS family a series belongs to: the histogram's _bucket/_sum/_count fold into it."""
    if name in METRICS:
        return name
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in METRICS:
            return name.removesuffix(suffix)
    return name


def _variable_queries(dashboard: dict[str, Any]) -> Iterator[str]:
    for variable in dashboard["templating"]["list"]:
        if variable.get("type") != "query":
            continue
        query = variable["query"]
        yield query["query"] if isinstance(query, dict) else query


# ---------------------------------------------------------------------------------------------- the parser


@pytest.mark.parametrize(("expr", "names"), [
    ('sum by (result) (rate(gpuhook_container_starts_total{instance=~"$instance"}[5m]))',
     {"gpuhook_container_starts_total"}),
    ("histogram_quantile(0.99, sum by (le) (rate(gpuhook_start_duration_seconds_bucket[5m])))",
     {"gpuhook_start_duration_seconds_bucket"}),
    ('sum(rate(a_total{result="hit"}[5m])) / sum without (gpu) (rate(a_total[5m] offset 1h))', {"a_total"}),
    ("max by (gpu, uuid) (x) * on (gpu) group_left (model) y", {"x", "y"}),
    ('label_replace(up, "dst", "$1", "src", "(.*)") > bool 0', {"up"}),
])
def test_metric_names_are_found_and_nothing_else(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_variable_queries_name_their_metric_not_the_label() -> None:
    assert metric_names("label_values(gpuhook_gpu_info, instance)", variable_query=True) == {"gpuhook_gpu_info"}
    assert metric_names("label_values(instance)", variable_query=True) == set()


def test_histogram_series_fold_into_their_family() -> None:
    assert family("gpuhook_start_duration_seconds_bucket") == "gpuhook_start_duration_seconds"
    assert family("gpuhook_start_duration_seconds_count") == "gpuhook_start_duration_seconds"
    assert family("gpuhook_refusals_total") == "gpuhook_refusals_total"
    assert family("gpuhook_nonexistent_bucket") == "gpuhook_nonexistent_bucket"


# ---------------------------------------------------------------------------------------------- the dashboard


def test_the_dashboard_has_what_grafanas_import_needs() -> None:
    dashboard = _dashboard()
    for key in ("title", "uid", "panels", "templating", "time", "refresh", "schemaVersion"):
        assert key in dashboard, key
    assert dashboard["uid"] == "gpuhook"
    assert dashboard["schemaVersion"] == 39
    assert isinstance(dashboard["title"], str)
    assert dashboard["title"]
    assert dashboard.get("id") is None  # an id would clash with the importing Grafana's own
    assert set(dashboard["time"]) == {"from", "to"}
    assert isinstance(dashboard["templating"]["list"], list)


def test_every_panel_has_a_type_a_place_and_a_unique_id() -> None:
    panels = list(_panels(_dashboard()["panels"]))
    assert panels
    ids = [panel["id"] for panel in panels]
    assert all(isinstance(i, int) for i in ids)
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        assert isinstance(panel.get("type"), str), panel
        assert panel["type"]
        grid = panel["gridPos"]
        assert set(grid) >= {"h", "w", "x", "y"}, panel["title"]
        assert all(type(grid[k]) is int for k in ("h", "w", "x", "y")), panel["title"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]  # Grafana's grid is 24 columns wide
        assert grid["h"] > 0
        assert grid["w"] > 0


def test_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in _panels(_dashboard()["panels"]):
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[x, y]}"
                cells[x, y] = panel["title"]


def test_every_panel_but_a_row_has_targets_with_expr_and_ref_id() -> None:
    for panel in _panels(_dashboard()["panels"]):
        if panel["type"] == "row":
            assert not panel.get("targets")
            continue
        targets = panel.get("targets")
        assert targets, panel["title"]
        ref_ids = [target["refId"] for target in targets]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in targets:
            assert isinstance(target["refId"], str)
            assert target["refId"]
            assert isinstance(target["expr"], str)
            assert target["expr"].strip()


def test_a_prometheus_datasource_variable_is_what_every_query_uses() -> None:
    dashboard = _dashboard()
    variables = [v for v in dashboard["templating"]["list"] if v.get("type") == "datasource"]
    assert [v["query"] for v in variables] == ["prometheus"]
    uid = "${" + variables[0]["name"] + "}"
    users = [panel for panel in _panels(dashboard["panels"]) if panel["type"] != "row"]
    users += [v for v in dashboard["templating"]["list"] if v.get("type") == "query"]
    for user in users:
        assert user["datasource"] == {"type": "prometheus", "uid": uid}, user.get("title", user.get("name"))
    for panel, target in _targets(dashboard):
        assert target["datasource"] == {"type": "prometheus", "uid": uid}, panel["title"]


def test_queries_name_only_the_endpoints_metrics() -> None:
    dashboard = _dashboard()
    for panel, target in _targets(dashboard):
        for name in metric_names(target["expr"]):
            assert family(name) in METRICS, f"{panel['title']}: {name} is not in gpuhook.daemon.metrics.METRICS"
    for query in _variable_queries(dashboard):
        for name in metric_names(query, variable_query=True):
            assert family(name) in METRICS, f"variable query {query!r}: {name} is not in METRICS"


def test_every_metric_family_is_on_some_panel() -> None:
    used = {family(name) for _, target in _targets(_dashboard()) for name in metric_names(target["expr"])}
    assert set(METRICS) - used == set()


@pytest.mark.parametrize(("metric", "unit"), [
    ("gpuhook_container_gpu_memory_used_bytes", "bytes"),
    ("gpuhook_start_duration_seconds", "s"),
])
def test_panels_carry_their_metrics_unit(metric: str, unit: str) -> None:
    for panel, target in _targets(_dashboard()):
        if metric in {family(name) for name in metric_names(target["expr"])}:
            assert panel["fieldConfig"]["defaults"]["unit"] == unit, panel["title"]
