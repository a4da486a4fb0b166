"""Shared pieces for the dashboards: panels that always carry a unit, a description and the fixed
datasource; queries that read 0, not "No data", when nothing has failed yet; template variables;
and the post-processor that turns grafanalib's output into a dashboard in Grafana's current
format (schema, heatmap options, no legacy keys, uid, tags, refresh, exemplars linked to traces).
"""

from __future__ import annotations

from typing import Any

from grafanalib.core import (
    BarGauge,
    Dashboard,
    GridPos,
    Heatmap,
    Stat,
    Target,
    Template,
    Templating,
    Text,
    TimeSeries,
    YAxis,
)

from sidecar.telemetry.thresholds import Thresholds

# Grafana 11.3 (the compose file's pin) writes schema 40; the JSON also needs nothing from 41's
# migration (no timepicker.time_options), so Grafana 12 loads it unchanged too.
SCHEMA_VERSION = 40
DS = "${datasource}"
FILTER = 'job="$job",instance=~"$instance",model=~"$model"'
# Reasoning tokens are a part of output (llm_tokens_total{token_type="reasoning"}): a sum over
# token_type leaves them out, or it counts them twice (docs/metrics.md).
NOT_REASONING = 'token_type!="reasoning"'
INST = 'job="$job",instance=~"$instance"'
ENGINE = 'job="$engine_job"'  # the inference server's own /metrics
# Heatmap columns: at the usual panel width this keeps a cell a few pixels wide. Other panels use
# Grafana's default (one point per pixel); the datasource's timeInterval (the scrape interval) is
# the floor of every query step, so $__rate_interval always spans several scrapes.
HEATMAP_MAX_POINTS = 120
NOT_SCRAPED = "sidecar not scraped"
# Units. A rate of spend is drawn per hour and says so (Grafana has no $/h unit: a custom suffix).
USD_PER_HOUR = "suffix: $/h"
COUNT = "short"  # a count of requests or tokens: drawn as a whole number on a stat
# Models that went through a metered route: `other` (unmetered POSTs) carries model "unknown".
METERED = 'job="$job",api_endpoint!="other"'


# The users with tokens in the dashboard's range: a user published ahead at 0 and never seen is
# not offered (no phantom users).
USERS = 'query_result(sum by (user_id) (increase(llm_tokens_total{job="$job"}[$__range])) > 0)'


def or_zero(expr: str, label: str | None = None) -> str:
    """`expr`, or 0 while the sidecar is being scraped and `expr` has no series yet (nothing failed,
    nobody rejected): a measured zero, not "No data". With `label`, the zero is labelled "none"."""
    zero = f"0 * group(up{{{INST}}} == 1)"
    if label:
        zero = f'label_replace({zero}, "{label}", "none", "", "")'
    return f"({expr}) or on() ({zero})"


def ratio(num: str, den: str) -> str:
    """num / den; 0 when num has no series yet or nothing was served in the interval."""
    return or_zero(f"({num} or on() 0 * {den}) / ({den} > 0)")


def ds(t: Thresholds) -> dict[str, str]:
    return {"type": "prometheus", "uid": t.datasource_uid}


def target(expr: str, legend: str = "", ref: str = "A") -> Target:
    return Target(expr=expr, legendFormat=legend, refId=ref)


class Grid:
    """Places panels left to right, wrapping at 24 columns."""

    def __init__(self) -> None:
        self.x = self.y = self.row_h = 0

    def next(self, w: int, h: int = 8) -> GridPos:
        if self.x + w > 24:
            self.x, self.y = 0, self.y + self.row_h
            self.row_h = 0
        pos = GridPos(h=h, w=w, x=self.x, y=self.y)
        self.x += w
        self.row_h = max(self.row_h, h)
        return pos


def timeseries(
    grid: Grid,
    title: str,
    description: str,
    unit: str,
    targets: list[Target],
    w: int = 12,
    threshold: float | None = None,
    stack: bool = False,
    decimals: int | None = None,
) -> TimeSeries:
    extra: dict[str, Any] = {}
    if threshold is not None:
        extra = {
            "fieldConfig": {
                "defaults": {
                    "thresholds": {
                        "mode": "absolute",
                        "steps": [
                            {"color": "green", "value": None},
                            {"color": "red", "value": threshold},
                        ],
                    },
                    "custom": {"thresholdsStyle": {"mode": "line+area"}},
                }
            }
        }
    if decimals is not None:
        extra.setdefault("fieldConfig", {}).setdefault("defaults", {})["decimals"] = decimals
    return TimeSeries(
        title=title,
        description=description,
        unit=unit,
        targets=targets,
        gridPos=grid.next(w),
        dataSource=DS,
        stacking={"mode": "normal"} if stack else {},
        extraJson=extra,
    )


def stat(
    grid: Grid,
    title: str,
    description: str,
    unit: str,
    targets: list[Target],
    w: int = 6,
    threshold: float | None = None,
    no_value: str = NOT_SCRAPED,
    mappings: list[dict[str, Any]] | None = None,
) -> Stat:
    from grafanalib.core import Threshold

    steps = [Threshold("green", 0, 0.0)]
    if threshold is not None:
        steps.append(Threshold("red", 1, float(threshold)))
    return Stat(
        title=title,
        description=description,
        format=unit,
        targets=targets,
        gridPos=grid.next(w, 6),
        dataSource=DS,
        thresholds=steps,
        reduceCalc="lastNotNull",
        decimals=0 if unit == COUNT else None,
        noValue=no_value,
        mappings=mappings or [],
    )


def today(
    grid: Grid, title: str, description: str, unit: str, targets: list[Target], w: int = 8
) -> Stat:
    """One value per series (user, model...) for today so far: the panel's range is pinned to
    the UTC day (`now/d`; the dashboards are in UTC), so `$__range` in its queries is today."""
    panel = stat(grid, title, description, unit, targets, w=w)
    panel.gridPos = GridPos(h=8, w=w, x=panel.gridPos.x, y=panel.gridPos.y)
    grid.row_h = max(grid.row_h, 8)
    panel.timeFrom = "now/d"
    panel.orientation = "horizontal"
    panel.textMode = "value_and_name"
    panel.graphMode = "none"
    return panel


def top(grid: Grid, title: str, description: str, unit: str, expr: str, legend: str) -> BarGauge:
    """One bar per series of an instant query at the end of the dashboard's range: a top-k over
    `$__range` lists exactly k (a time series of a rolling top-k lists every series that was in
    it at some point of the range)."""
    return BarGauge(
        title=title,
        description=description,
        format=unit,
        targets=[Target(expr=expr, legendFormat=legend, refId="A", instant=True)],
        gridPos=grid.next(12),
        dataSource=DS,
        thresholds=[],
    )


def text(grid: Grid, title: str, content: str, w: int = 24, h: int = 4) -> Text:
    return Text(title=title, content=content, mode="markdown", gridPos=grid.next(w, h))


def heatmap(
    grid: Grid, title: str, description: str, unit: str, metric: str, w: int = 12
) -> Heatmap:
    """A Prometheus histogram as a heatmap; `finish` writes it in the current options format."""
    expr = f"sum by (le) (rate({metric}_bucket{{{FILTER}}}[$__rate_interval]))"
    return Heatmap(
        title=title,
        description=description,
        targets=[Target(expr=expr, format="heatmap", legendFormat="{{le}}", refId="A")],
        gridPos=grid.next(w),
        dataSource=DS,
        yAxis=YAxis(format=unit),
    )


def _heatmap(panel: dict[str, Any]) -> None:
    """Grafana's heatmap (since 9): everything in options; none of the legacy panel's fields."""
    unit = (panel.get("yAxis") or {}).get("format") or "s"
    panel["maxDataPoints"] = HEATMAP_MAX_POINTS
    panel["fieldConfig"] = {
        "defaults": {
            "unit": "reqps",  # each cell: observations per second in that bucket
            "custom": {
                "hideFrom": {"legend": False, "tooltip": False, "viz": False},
                "scaleDistribution": {"type": "linear"},
            },
        },
        "overrides": [],
    }
    panel["options"] = {
        "calculate": False,  # the buckets come from Prometheus
        "cellGap": 1,
        "cellValues": {"unit": "reqps"},
        "color": {
            "mode": "scheme",
            "scheme": "Oranges",
            "fill": "dark-orange",
            "scale": "exponential",
            "exponent": 0.5,
            "steps": 64,
            "reverse": False,
        },
        "exemplars": {"color": "rgba(255,0,255,0.7)"},
        "filterValues": {"le": 1e-9},  # empty buckets are not painted
        "legend": {"show": True},
        "rowsFrame": {"layout": "le"},  # Prometheus buckets are upper bounds
        "tooltip": {"mode": "single", "yHistogram": False, "showColorScale": False},
        "yAxis": {"axisPlacement": "left", "reverse": False, "unit": unit},
    }


def _bargauge(panel: dict[str, Any]) -> None:
    """Grafana's bar gauge (since 7): options in the current shape, no legacy fieldOptions."""
    unit = panel["options"]["fieldOptions"]["defaults"]["unit"]
    panel["options"] = {
        "displayMode": "gradient",
        "orientation": "horizontal",
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "showUnfilled": True,
        "valueMode": "color",
    }
    panel["fieldConfig"] = {
        "defaults": {"min": 0, "unit": unit, "thresholds": {"mode": "absolute", "steps": []}},
        "overrides": [],
    }


def by_model_quantiles(metric: str) -> list[Target]:
    """p50 and p99 of a histogram, one line each per model."""
    return [
        target(
            f"histogram_quantile({q}, sum by (model, le) (rate({metric}_bucket{{{FILTER}}}"
            "[$__rate_interval])))",
            f"{{{{model}}}} p{int(q * 100)}",
            ref,
        )
        for q, ref in ((0.5, "A"), (0.99, "B"))
    ]


def percentiles(grid: Grid, title: str, description: str, metric: str, w: int = 12) -> TimeSeries:
    targets = [
        target(
            f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{FILTER}}}"
            f"[$__rate_interval])))",
            f"p{int(q * 100)}",
            ref,
        )
        for q, ref in ((0.5, "A"), (0.9, "B"), (0.99, "C"))
    ]
    return timeseries(grid, title, description, "s", targets, w)


def variables(t: Thresholds, user: bool = False) -> Templating:
    def query(name: str, q: str, multi: bool = True, regex: str | None = None) -> Template:
        return Template(
            name=name,
            label=name,
            query=q,
            dataSource=DS,
            includeAll=multi,
            multi=multi,
            allValue=".*" if multi else None,
            refresh=2,
            sort=1,
            type="query",
            regex=regex,
        )

    items = [
        Template(
            name="datasource",
            label="Data source",
            query="prometheus",
            type="datasource",
            default=t.datasource_uid,
        ),
        Template(name="job", label="job", query=t.job, type="constant", hide=2),
        Template(
            name="engine_job", label="engine job", query=t.engine_job, type="constant", hide=2
        ),
        query("instance", 'label_values(up{job="$job"}, instance)'),
        query("model", f"label_values(llm_requests_total{{{METERED}}}, model)"),
    ]
    if user:
        items.append(query("user_id", USERS, multi=False, regex=r'/user_id="([^"]+)"/'))
    return Templating(list=items)


def dashboard(
    t: Thresholds, uid: str, title: str, description: str, panels: list[Any], user: bool = False
) -> Dashboard:
    return Dashboard(
        title=title,
        uid=uid,
        description=description,
        panels=panels,
        templating=variables(t, user),
        timezone="utc",
    )


# --- post-processing ------------------------------------------------------------------------------

# What a current Grafana reads; grafanalib also writes fields of older panel versions (span, height,
# error, cacheTimeout, the legacy heatmap's cards/color/xAxis/yAxis, target.step...) and nulls.
DASHBOARD_KEYS = {
    "annotations", "description", "editable", "graphTooltip", "id", "links", "panels", "refresh",
    "schemaVersion", "tags", "templating", "time", "timepicker", "timezone", "title", "uid",
    "version",
}  # fmt: skip
PANEL_KEYS = {
    "datasource", "description", "fieldConfig", "gridPos", "id", "maxDataPoints", "options",
    "targets", "timeFrom", "title", "type",
}  # fmt: skip
TARGET_KEYS = {"datasource", "exemplar", "expr", "format", "instant", "legendFormat", "refId"}
VARIABLE_KEYS = {
    "allValue", "current", "datasource", "definition", "hide", "includeAll", "label", "multi",
    "name", "options", "query", "refresh", "regex", "sort", "type",
}  # fmt: skip


def finish(data: dict[str, Any], t: Thresholds) -> dict[str, Any]:
    """One place for cross-cutting touches: schema, tags, refresh, fixed datasource, exemplars,
    current panel formats, and nothing a current Grafana would ignore."""
    data = {k: v for k, v in data.items() if k in DASHBOARD_KEYS}
    data["schemaVersion"] = SCHEMA_VERSION
    data["tags"] = list(t.dashboard_tags)
    data["refresh"] = t.dashboard_refresh
    data["editable"] = False
    data["id"] = None
    data["version"] = 1
    data["time"] = {"from": "now-6h", "to": "now"}
    data["timepicker"] = {}
    data["panels"] = [_panel(i, p) for i, p in enumerate(data["panels"], 1)]
    data["templating"]["list"] = [_variable(v, t) for v in data["templating"]["list"]]
    data["annotations"] = {
        "list": [
            {
                "builtIn": 1,
                "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                "enable": True,
                "hide": True,
                "iconColor": "rgba(0, 211, 255, 1)",
                "name": "Annotations & Alerts",
                "type": "dashboard",
            }
        ]
    }
    return data


def _panel(i: int, panel: dict[str, Any]) -> dict[str, Any]:
    panel["id"] = i
    if panel["type"] == "heatmap":
        _heatmap(panel)
    else:
        if panel["type"] == "bargauge":
            _bargauge(panel)
        _unit(panel)
        panel.pop("maxDataPoints", None)  # Grafana's default: the panel's width in pixels
    if panel["type"] == "text":
        return {k: panel[k] for k in ("id", "type", "title", "gridPos", "options")}
    panel["datasource"] = {"type": "prometheus", "uid": "${datasource}"}
    targets = []
    for tgt in panel.get("targets", []):
        tgt = {k: v for k, v in tgt.items() if k in TARGET_KEYS and v is not None}
        if not tgt.get("instant"):  # a range query: Grafana's default, not written
            tgt.pop("instant", None)
        tgt["datasource"] = {"type": "prometheus", "uid": "${datasource}"}
        tgt["exemplar"] = panel["type"] == "timeseries"
        targets.append(tgt)
    panel["targets"] = targets
    defaults = panel["fieldConfig"]["defaults"]
    for key in [k for k, v in defaults.items() if v is None]:
        del defaults[key]
    custom = defaults.get("custom") or {}
    for key in [k for k, v in custom.items() if v is None]:
        del custom[key]
    return {k: v for k, v in panel.items() if k in PANEL_KEYS and v is not None}


def _variable(var: dict[str, Any], t: Thresholds) -> dict[str, Any]:
    if var["name"] == "datasource":
        var["current"] = {"selected": True, "text": "Prometheus", "value": t.datasource_uid}
    elif var["type"] == "query":
        var["datasource"] = {"type": "prometheus", "uid": "${datasource}"}
        var["definition"] = var["query"]
        var["query"] = {"query": var["query"], "refId": "PrometheusVariableQueryEditor"}
        var["current"] = {"text": "All", "value": ["$__all"]} if var["includeAll"] else {}
    elif var["type"] == "constant":
        var["current"] = {"text": var["query"], "value": var["query"]}
    return {k: v for k, v in var.items() if k in VARIABLE_KEYS and v is not None}


def _unit(panel: dict[str, Any]) -> None:
    """Every panel states its unit in fieldConfig.defaults.unit (where Grafana 11 reads it)."""
    fc = panel.setdefault("fieldConfig", {"defaults": {}, "overrides": []})
    defaults = fc.setdefault("defaults", {})
    fc.setdefault("overrides", [])
    steps = defaults.get("thresholds", {}).get("steps")
    if steps:  # grafanalib's legacy step shape -> Grafana's {color, value}, base value null
        defaults["thresholds"]["steps"] = [
            {
                "color": s["color"],
                "value": None if s.get("value") in (None, "null") else float(s["value"]),
            }
            for s in steps
        ]
    elif "thresholds" in defaults:
        defaults["thresholds"]["steps"] = [{"color": "green", "value": None}]
    if defaults.get("custom", {}).get("stacking") == {}:
        defaults["custom"]["stacking"] = {"mode": "none", "group": "A"}
    unit = defaults.get("unit") or panel.pop("format", None) or panel.get("unit")
    if unit:
        defaults["unit"] = unit
