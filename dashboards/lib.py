"""Shared pieces for the dashboards: panels that always carry a unit, a description and the fixed
datasource; template variables; and the post-processor that turns grafanalib's output into a
dashboard Grafana 11/12 provisions without migration (schema, uid, tags, refresh, datasource uid,
exemplars linked to traces).
"""

from __future__ import annotations

from typing import Any

from grafanalib.core import (
    Dashboard,
    GridPos,
    Heatmap,
    Stat,
    Target,
    Template,
    Templating,
    TimeSeries,
    YAxis,
)

from sidecar.thresholds import Thresholds

SCHEMA_VERSION = 39  # Grafana 11.x provisions this without migrating it
DS = "${datasource}"
FILTER = 'job="$job",instance=~"$instance",model=~"$model"'


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
    )


def heatmap(
    grid: Grid, title: str, description: str, unit: str, metric: str, w: int = 12
) -> Heatmap:
    expr = f"sum by (le) (rate({metric}_bucket{{{FILTER}}}[$__rate_interval]))"
    return Heatmap(
        title=title,
        description=description,
        targets=[Target(expr=expr, format="heatmap", legendFormat="{{le}}", refId="A")],
        gridPos=grid.next(w),
        dataSource=DS,
        dataFormat="tsbuckets",
        yAxis=YAxis(format=unit),
        extraJson={
            "fieldConfig": {"defaults": {"unit": unit}},
            "options": {"calculate": False, "yAxis": {"unit": unit}},
        },
    )


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
    def query(name: str, q: str, multi: bool = True) -> Template:
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
        query("instance", 'label_values(llm_requests_total{job="$job"}, instance)'),
        query("model", 'label_values(llm_requests_total{job="$job"}, model)'),
    ]
    if user:
        items.append(
            query("user_id", 'label_values(llm_tokens_total{job="$job"}, user_id)', multi=False)
        )
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


def finish(data: dict[str, Any], t: Thresholds) -> dict[str, Any]:
    """One place for cross-cutting touches: schema, tags, refresh, fixed datasource, exemplars."""
    data.pop("rows", None)
    data["schemaVersion"] = SCHEMA_VERSION
    data["tags"] = list(t.dashboard_tags)
    data["refresh"] = t.dashboard_refresh
    data["editable"] = False
    data["id"] = None
    data["version"] = 1
    data["time"] = {"from": "now-6h", "to": "now"}
    for i, panel in enumerate(data["panels"], 1):
        panel["id"] = i
        panel["datasource"] = {"type": "prometheus", "uid": "${datasource}"}
        for tgt in panel.get("targets", []):
            tgt["datasource"] = {"type": "prometheus", "uid": "${datasource}"}
            tgt["exemplar"] = panel["type"] == "timeseries"
            tgt.pop("step", None)
            tgt.pop("intervalFactor", None)
        _unit(panel)
    for var in data["templating"]["list"]:
        if var["name"] == "datasource":
            var["current"] = {"selected": True, "text": "Prometheus", "value": t.datasource_uid}
        elif var["type"] == "query":
            var["datasource"] = {"type": "prometheus", "uid": "${datasource}"}
            var["definition"] = var["query"]
            var["query"] = {"query": var["query"], "refId": "PrometheusVariableQueryEditor"}
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
    if defaults.get("custom", {}).get("stacking") == {}:
        defaults["custom"]["stacking"] = {"mode": "none", "group": "A"}
    unit = defaults.get("unit") or panel.pop("format", None) or panel.get("unit")
    if panel["type"] == "heatmap":
        unit = unit or (panel.get("yAxis") or {}).get("format")
    if unit:
        defaults["unit"] = unit
