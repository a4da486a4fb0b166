"""A preview of the dashboards without Grafana: each panel's queries evaluated by a live Prometheus
over a time range, drawn as inline SVG in one HTML page a reviewer can open (tests only).

Stats and bar gauges show each series' last value; every other panel draws its series as lines.
Not Grafana: no units' formatting beyond a suffix, no stacking; enough to see that each panel has
data and what shape it has.
"""

from __future__ import annotations

import html
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

Query = Callable[[str], Awaitable[list[Any]]]  # expr -> Prometheus range-query result
W, H = 460, 150
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def legend(fmt: str, metric: dict[str, str]) -> str:
    out = fmt or json.dumps(metric)
    for k, v in metric.items():
        out = out.replace("{{" + k + "}}", v)
    return out


def svg(series: list[tuple[str, list[tuple[float, float]]]]) -> str:
    points = [p for _, pts in series for p in pts]
    if not points:
        return '<div class="empty">no data</div>'
    t0, t1 = min(t for t, _ in points), max(t for t, _ in points)
    v0, v1 = min(0.0, *(v for _, v in points)), max(v for _, v in points)
    sx = (W - 10) / ((t1 - t0) or 1)
    sy = (H - 20) / ((v1 - v0) or 1)
    lines = []
    for i, (_, pts) in enumerate(series):
        path = " ".join(f"{5 + (t - t0) * sx:.1f},{H - 10 - (v - v0) * sy:.1f}" for t, v in pts)
        lines.append(
            f'<polyline fill="none" stroke="{COLOURS[i % len(COLOURS)]}" points="{path}"/>'
        )
    return (
        f'<svg width="{W}" height="{H}"><text x="5" y="12" font-size="10">max {v1:.4g}</text>'
        + "".join(lines)
        + "</svg>"
    )


async def panel_html(panel: dict[str, Any], query: Query) -> tuple[str, bool]:
    """The panel's HTML, and whether any of its queries returned data."""
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
    series: list[tuple[str, list[tuple[float, float]]]] = []
    for t in panel.get("targets", []):
        for r in await query(t["expr"]):
            pts = [(float(ts), float(v)) for ts, v in r["values"] if v not in ("NaN", "+Inf")]
            series.append((legend(t.get("legendFormat", ""), r["metric"]), pts))
    rows = "".join(
        f'<li style="color:{COLOURS[i % len(COLOURS)]}">{html.escape(name)}: '
        f"{pts[-1][1]:.4g} {html.escape(unit)}</li>"
        for i, (name, pts) in enumerate(series)
        if pts
    )
    body = "" if panel["type"] in ("stat", "bargauge") else svg(series)
    title = html.escape(panel["title"])
    return (
        f'<div class="panel"><h3>{title} <small>{panel["type"]}, {html.escape(unit)}</small></h3>'
        f"{body}<ul>{rows or '<li>no data</li>'}</ul></div>",
        any(pts for _, pts in series),
    )


async def render(dashboards: list[Path], query: Query, out: Path) -> dict[str, bool]:
    """Write one HTML page of every dashboard's panels; returns each panel's has-data."""
    parts, has = [], {}
    for path in dashboards:
        data = json.loads(path.read_text())
        parts.append(f"<h2>{html.escape(data['title'])}</h2><div class='grid'>")
        for panel in data["panels"]:
            if panel["type"] == "text":
                continue
            block, ok = await panel_html(panel, query)
            has[f"{path.name}: {panel['title']}"] = ok
            parts.append(block)
        parts.append("</div>")
    style = (
        "body{font-family:sans-serif;font-size:12px;background:#fafafa}"
        ".grid{display:flex;flex-wrap:wrap}"
        ".panel{width:480px;margin:4px;padding:4px;background:#fff;border:1px solid #ddd}"
        "h3{font-size:13px;margin:2px}ul{margin:2px;padding-left:16px;max-height:90px;"
        "overflow:hidden}.empty{color:#a00;height:20px}"
    )
    out.write_text(f"<html><head><style>{style}</style></head><body>{''.join(parts)}</body></html>")
    return has
