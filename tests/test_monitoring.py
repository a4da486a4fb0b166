"""Alerts and dashboards as code: rendered from one thresholds config, checked by the real
promtool and amtool, linted like grafana/dashboard-linter, and regenerated without diff."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from alerts import build as alerts_build
from dashboards import build as dash_build
from dashboards.lib import (
    DASHBOARD_KEYS,
    HEATMAP_MAX_POINTS,
    PANEL_KEYS,
    SCHEMA_VERSION,
    TARGET_KEYS,
)
from sidecar.billing.budget_state import LIMIT, REMAINING, SOFT, USED
from sidecar.telemetry import metrics
from sidecar.telemetry.exposition import read_by_increase
from sidecar.telemetry.metrics import Metrics
from sidecar.telemetry.thresholds import DEFAULT, Thresholds, load

ROOT = Path(__file__).parents[1]
needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="Debian's prometheus package is not installed"
)


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)


# --- alerts ---------------------------------------------------------------------------------------


def test_committed_rules_are_current() -> None:
    assert (ROOT / "alerts/tollbooth.rules.yml").read_text() == alerts_build.render_rules(DEFAULT)
    assert (ROOT / "alerts/alertmanager.yml").read_text() == alerts_build.render_alertmanager()


@needs_promtool
def test_promtool_check_and_unit_tests() -> None:
    check = run("promtool", "check", "rules", "alerts/tollbooth.rules.yml")
    assert check.returncode == 0, check.stdout + check.stderr
    tests = run("promtool", "test", "rules", "alerts/tests/tollbooth.test.yml")
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert "SUCCESS" in tests.stdout


@needs_promtool
def test_amtool_check_config() -> None:
    out = run("amtool", "check-config", "alerts/alertmanager.yml")
    assert out.returncode == 0, out.stdout + out.stderr


def alerts_of(t: Thresholds) -> list[dict[str, Any]]:
    doc = yaml.safe_load(alerts_build.render_rules(t))
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def test_alert_conventions() -> None:
    rules = alerts_of(DEFAULT)
    names = {r["alert"] for r in rules}
    assert names >= {
        "LLMDailySpendHigh",
        "LLMRequestCostHigh",
        "LLMTokenBudgetQueueSaturated",
        "LLMUpstreamErrorRateHigh",
        "LLMGPUMemoryNearFull",
        "LLMUsageUnmeasured",
        "LLMSidecarDown",
    }
    runbooks = (ROOT / "docs/runbooks.md").read_text()
    for r in rules:
        assert re.fullmatch(r"LLM[A-Z][A-Za-z0-9]+", r["alert"])
        assert r["labels"]["severity"] in ("critical", "warning", "info")
        a = r["annotations"]
        assert a["summary"].endswith(".") and "{{" not in a["summary"]
        assert "{{" in a["description"]
        anchor = a["runbook_url"].split("#")[1]
        assert f"## {r['alert']}" in runbooks and anchor == r["alert"].lower()
    spend = next(r for r in rules if r["alert"] == "LLMDailySpendHigh")
    assert spend["labels"]["priority"] == DEFAULT.daily_spend_priority == "P2"  # the handbook's
    doc = yaml.safe_load(alerts_build.render_rules(DEFAULT))
    for g in doc["groups"]:
        for r in g["rules"]:
            if "record" in r:
                assert re.fullmatch(r"[a-z_]+:[a-z_]+:[a-z0-9_]+", r["record"])


def test_no_alert_hides_a_number_that_belongs_in_the_config() -> None:
    """Render with every threshold changed: no default value may survive in any expression."""
    changed = load(
        daily_spend_usd=123.5,
        user_daily_spend_usd=77.25,
        request_cost_usd=0.25,
        queue_saturation_ratio=0.81,
        queue_waiting_share=0.63,
        queue_saturation_window="4m",
        error_ratio=0.033,
        gpu_memory_ratio=0.91,
        unmeasured_ratio=0.027,
        daily_spend_window="23h",
        request_cost_window="7m",
        error_window="6m",
        unmeasured_window="17m",
        queue_saturation_for="11m",
        error_for="8m",
        gpu_memory_for="9m",
        unmeasured_for="19m",
        down_for="3m",
        writer_failing_for="4m",
        bypass_ratio=0.037,
        bypass_min_tokens=1234.5,
        bypass_window="2h",
        bypass_for="21m",
    )
    base, new = alerts_of(DEFAULT), alerts_of(changed)
    literal = re.compile(r"(?<![\w.\[])(\d+(?:\.\d+)?)(?![\w\]])")
    allowed = {"0", "1"}  # `> 0` on a count; `up == 0`
    values = dataclasses.asdict(changed).values()
    for old_rule, new_rule in zip(base, new, strict=True):
        expr = re.sub(r'"[^"]*"', '""', new_rule["expr"])  # label values are not thresholds
        numbers = set(literal.findall(expr)) - allowed
        config_numbers = {str(v) for v in values if isinstance(v, float)}
        assert numbers <= config_numbers, (new_rule["alert"], numbers)
        windows = set(re.findall(r"\[(\w+):?\]", new_rule["expr"])) - {"5m"}
        assert windows <= {str(v) for v in values}, new_rule["alert"]
        if "for" in old_rule:
            assert new_rule["for"] != old_rule["for"], new_rule["alert"]


def test_request_cost_threshold_must_be_a_bucket() -> None:
    with pytest.raises(ValueError, match="not a boundary"):
        alerts_build.render_rules(load(request_cost_usd=0.2))


# --- dashboards -----------------------------------------------------------------------------------


def test_committed_dashboards_are_current() -> None:
    rendered = dash_build.render_all(DEFAULT)
    committed = {p.name: p.read_text() for p in (ROOT / "dashboards/generated").glob("*.json")}
    assert committed == rendered


def exported_metrics() -> set[str]:
    names = set()
    for fam in Metrics().registry.collect():
        kind = fam.type
        base = fam.name
        if kind == "counter":
            names.add(base + "_total")
        elif kind == "histogram":
            names |= {base + s for s in ("_bucket", "_sum", "_count")}
        else:
            names.add(base)
    return names | {"up", LIMIT, REMAINING, USED, SOFT}  # the budget state, read at scrape time


# The inference server's own metrics the latency dashboard reads (the simulator exports them too:
# tests/test_simulator.py).
ENGINE_METRICS = {
    metrics.VLLM_RUNNING,
    metrics.VLLM_WAITING,
    metrics.VLLM_KV_USAGE,
    metrics.VLLM_KV_USAGE_OLD,
    metrics.VLLM_PREEMPTIONS,
    metrics.TGI_QUEUE,
    metrics.TGI_BATCH,
}
# The engine's own counters as the sidecar re-exports them (sidecar/telemetry/reconcile.py): the
# engine's totals, published at their value at once (held at 0 first, an engine's count from
# before the sidecar started would read as traffic around it).
ENGINE_COUNTS = {"llm_engine_tokens_total", "llm_engine_metrics_up"}


GRAFANA_VARS = {"$__rate_interval": "5m", "$__range": "1h", "$__interval": "1m"}


def promql(expr: str) -> str:
    for k, v in GRAFANA_VARS.items():
        expr = expr.replace(k, v)
    return re.sub(r"\$\{?(\w+)\}?", "x", expr)


def walk(node: Any, parent_call: str | None = None) -> list[tuple[str, str | None]]:
    """(metric name, enclosing function) for every selector in a PromQL AST."""
    kind = type(node).__name__
    if kind == "VectorSelector":
        return [(node.name, parent_call)]
    if kind == "MatrixSelector":
        return [(node.vector_selector.name, parent_call)]
    if kind == "Call":
        return [x for a in node.args for x in walk(a, node.func.name)]
    out = []
    for attr in ("expr", "lhs", "rhs", "param"):
        child = getattr(node, attr, None)
        if child is not None and not isinstance(child, str | int | float):
            out += walk(child, None if attr != "expr" or kind != "ParenExpr" else parent_call)
    return out


def panels() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted((ROOT / "dashboards/generated").glob("*.json")):
        data = json.loads(path.read_text())
        assert data["schemaVersion"] == SCHEMA_VERSION and data["uid"].startswith("tollbooth-")
        assert data["tags"] == list(DEFAULT.dashboard_tags)
        out += [(f"{path.name}: {p['title']}", p) for p in data["panels"]]
    return out


@pytest.mark.parametrize("name,panel", panels(), ids=lambda x: x if isinstance(x, str) else "")
def test_dashboard_lint(name: str, panel: dict[str, Any]) -> None:
    if panel["type"] == "text":
        assert panel["title"] and panel["options"]["mode"] == "markdown"
        assert len(panel["options"]["content"]) > 40
        return
    assert panel["title"] and panel["description"]
    assert panel["fieldConfig"]["defaults"]["unit"], "every panel states a unit"
    assert panel["datasource"]["uid"] == "${datasource}"
    assert panel["targets"], "at least one target"
    known = exported_metrics() | ENGINE_METRICS | ENGINE_COUNTS
    for t in panel["targets"]:
        ast = promql_parser.parse(promql(t["expr"]))
        for metric, fn in walk(ast):
            assert metric in known, f"{metric} is not exported by the sidecar or the server"
            if metric.endswith("_total") or metric.endswith("_bucket"):
                assert fn in ("rate", "increase", "irate"), f"{metric} not in rate/increase"


def test_dashboard_variables_and_units() -> None:
    names = {}
    for path in (ROOT / "dashboards/generated").glob("*.json"):
        data = json.loads(path.read_text())
        names[path.name] = [v["name"] for v in data["templating"]["list"]]
    assert all({"datasource", "model", "instance"} <= set(v) for v in names.values())
    assert "user_id" in names["user.json"]
    units = {p["fieldConfig"]["defaults"]["unit"] for _, p in panels() if p["type"] != "text"}
    assert {"currencyUSD", "s", "percentunit", "watt"} <= units


def test_threshold_lines_follow_the_config() -> None:
    changed = load(daily_spend_usd=75.0, gpu_memory_ratio=0.9)
    cost = json.loads(dash_build.render_all(changed)["cost.json"])
    gpu = json.loads(dash_build.render_all(changed)["gpu.json"])

    def lines(data: dict[str, Any]) -> set[float]:
        return {
            s["value"]
            for p in data["panels"]
            if "fieldConfig" in p
            for s in p["fieldConfig"]["defaults"].get("thresholds", {}).get("steps", [])
            if s["value"] is not None
        }

    assert 75.0 in lines(cost) and 50.0 not in lines(cost)
    assert 0.9 in lines(gpu) and 0.95 not in lines(gpu)


def test_current_grafana_format_without_legacy_keys() -> None:
    for path in (ROOT / "dashboards/generated").glob("*.json"):
        data = json.loads(path.read_text())
        assert set(data) <= DASHBOARD_KEYS and "time_options" not in data["timepicker"]
        for var in data["templating"]["list"]:
            assert not {"tags", "useTags", "tagsQuery", "auto", "auto_count"} & set(var)
    for name, panel in panels():
        assert set(panel) <= PANEL_KEYS | {"id", "type", "title", "gridPos", "options"}, name
        for t in panel.get("targets", []):
            assert set(t) <= TARGET_KEYS, name
        if panel["type"] == "heatmap":  # the current heatmap: calculate off, options-only
            assert panel["options"]["calculate"] is False
            assert panel["options"]["yAxis"]["unit"] == "s"
            assert panel["maxDataPoints"] == HEATMAP_MAX_POINTS
            assert panel["targets"][0]["format"] == "heatmap"
        else:
            assert "maxDataPoints" not in panel, name
        if panel["type"] == "stat":  # never the word "none" for a missing value
            assert panel["fieldConfig"]["defaults"]["noValue"] not in ("", "none"), name


def cumulative_reads() -> set[str]:
    """Every counter or histogram family a rule or a panel reads."""
    exprs = [r["expr"] for g in yaml.safe_load(alerts_build.render_rules(DEFAULT))["groups"]
             for r in g["rules"]]  # fmt: skip
    exprs += [t["expr"] for _, p in panels() for t in p.get("targets", [])]
    names = {m for e in exprs for m, _ in walk(promql_parser.parse(promql(e)))}
    return {
        re.sub(r"_(total|bucket|sum|count)$", "", n)
        for n in names
        if re.search(r"_(total|bucket|sum|count)$", n) and n not in ENGINE_METRICS | ENGINE_COUNTS
    }


def test_every_counter_a_rule_or_panel_reads_is_published_at_zero_first() -> None:
    held = set(read_by_increase(Metrics()))
    reads = cumulative_reads()
    assert {"llm_cost_usd", "llm_tokens", "llm_request_cost_usd"} <= reads
    assert reads <= held, reads - held
