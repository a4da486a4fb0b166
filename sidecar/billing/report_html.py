"""`tollbooth report --format html`: one self-contained page a finance reader opens in a browser.

Owns: the page (the period, the price book, the charts from `charts`, and the tables behind them).
Never: references anything outside the file (no script, stylesheet, font or image is fetched; a
Content-Security-Policy of `default-src 'none'` makes sure of it) or writes a ledger string
unescaped: user, team, project, tag and model names are outside input.
"""

from __future__ import annotations

import time
from typing import Any

from . import charts
from .chargeback import Report, idle_text, text_cells
from .charts import esc, usd

STACKED = 7  # groups drawn by name in the daily chart; the rest add up in OTHER
TOP = 10  # bars in the top-spender and device-cost charts
OTHER = "other"
CSP = "default-src 'none'; style-src 'unsafe-inline'"
CSS = """
body{font-family:sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:22px;margin-bottom:4px} h2{font-size:17px;margin:28px 0 8px}
.meta{color:#444;margin:2px 0} .note{color:#555;font-size:13px}
table{border-collapse:collapse;font-size:13px;margin:8px 0}
th,td{border:1px solid #ccc;padding:3px 8px} th{background:#f2f2f2;text-align:left}
td.n{text-align:right;font-variant-numeric:tabular-nums}
td:first-child{min-width:7em;max-width:18em;overflow-wrap:anywhere}
tr.idle td{background:#fff7e0}
svg.chart{display:block;margin:8px 0} .wide{overflow-x:auto}
"""


def render_html(rep: Report) -> str:
    parts = [_head(rep), _summary(rep), _daily_chart(rep), _top(rep), _model_chart(rep)]
    parts += [_device(rep), _groups(rep), _daily_table(rep), _model_table(rep)]
    parts.append("</body></html>\n")
    return "\n".join(p for p in parts if p)


def _period(rep: Report) -> str:
    f = "%Y-%m-%d %H:%M UTC"
    return f"{time.strftime(f, time.gmtime(rep.start))} to {time.strftime(f, time.gmtime(rep.end))}"


def _head(rep: Report) -> str:
    title = f"Tollbooth chargeback by {rep.by}, {_period(rep)}"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>"
        f"<h1>{esc(title)}</h1>"
    )


def _summary(rep: Report) -> str:
    unknown = (
        f"; requests of unknown cost: {rep.unknown_cost_requests} (in no sum below)"
        if rep.unknown_cost_requests
        else ""
    )
    lines = [
        f"Period: {_period(rep)} (budget days; a month not over runs to now).",
        f"Price book: {rep.price_book.label}. The costs are the ledger's, priced when each "
        "request was served.",
        f"{rep.requests} requests, {_usd4(rep.known_cost_usd)} at list price{unknown}.",
    ]
    if rep.by == "tag":
        lines.append("By tag, a request counts in each of its tags: the groups add up to more.")
    return "".join(f'<p class="meta">{esc(t)}</p>' for t in lines)


def _series(rep: Report) -> list[tuple[str, list[float]]]:
    """The daily chart's stacks: the top groups by name, the rest as OTHER (by day: one)."""
    if rep.by == "day":
        return [("spend", [sum(d["costs"].values()) for d in rep.daily])]
    named = [g[rep.by] for g in rep.groups if g["cost_usd"]][:STACKED]
    series = [(n, [d["costs"].get(n, 0.0) for d in rep.daily]) for n in named]
    rest = [sum(v for k, v in d["costs"].items() if k not in named) for d in rep.daily]
    if any(rest):
        series.append((OTHER, rest))
    return series


def _daily_chart(rep: Report) -> str:
    days, series = [d["day"] for d in rep.daily], _series(rep)
    colours = [charts.colour(i) for i in range(len(series))]
    if series and series[-1][0] == OTHER:
        colours[-1] = charts.OTHER_COLOUR
    chart = charts.stacked_columns(
        f"Spend per day by {rep.by}", days, series, colours=colours
    ) if days else '<p class="note">No requests in this period.</p>'  # fmt: skip
    return (
        f"<h2>Spend per day, stacked by {esc(rep.by)}</h2>{chart}"
        '<p class="note">Known costs at list price; requests of unknown cost are left out.</p>'
    )


def _daily_table(rep: Report) -> str:
    days, series = [d["day"] for d in rep.daily], _series(rep)
    head = ["day", *[s[0] for s in series], "total"]
    rows = [
        [day, *[_usd4(s[1][i]) for s in series], _usd4(sum(s[1][i] for s in series))]
        for i, day in enumerate(days)
    ]
    return "<h2>Spend per day</h2>" + _table(head, rows, "daily")


def _top(rep: Report) -> str:
    top = rep.groups[:TOP]  # by cost, highest first; unknown last, written "unknown"
    items = [(str(g[rep.by]), [g["cost_usd"]]) for g in top]
    chart = charts.hbars(f"Top spenders by {rep.by}", items, ["list price"]) if items else ""
    return f"<h2>Top spenders by {esc(rep.by)}</h2>{chart}"


def per_thousand(g: dict[str, Any]) -> float | None:
    tokens: int = g["input_tokens"] + g["output_tokens"]
    cost: float | None = g["cost_usd"]
    if cost is None or not tokens:
        return None
    return cost / tokens * 1000


def _model_chart(rep: Report) -> str:
    items = [(str(m["model"]), [per_thousand(m)]) for m in rep.models]
    if not items:
        return ""
    chart = charts.hbars("Cost per 1,000 tokens by model", items, ["per 1k tokens"])
    return f"<h2>Cost per 1,000 tokens by model</h2>{chart}"


def _model_table(rep: Report) -> str:
    head = ["model", "requests", "input_tokens", "output_tokens", "cost_usd", "usd_per_1k_tokens"]
    rows = [
        [m["model"], m["requests"], m["input_tokens"], m["output_tokens"],
         _money(m["cost_usd"]), _money(per_thousand(m), usd)]
        for m in rep.models
    ]  # fmt: skip
    return "<h2>By model</h2>" + _table(head, rows, "models")


def _usd4(v: float) -> str:
    return f"${v:.4f}"


def _money(v: float | None, fmt: charts.Fmt = _usd4) -> str:
    return "unknown" if v is None else fmt(v)


def _device(rep: Report) -> str:
    if rep.idle is None:
        return (
            "<h2>List price and device cost</h2>"
            '<p class="note">No GPU data in the ledger for this period (no request has '
            "device-seconds): device cost and idle GPU time are unknown.</p>"
        )
    top = rep.groups[:TOP]
    idle = f'<p class="meta">Idle GPU: {esc(idle_text(rep.idle))}</p>'
    if not top:
        return f"<h2>List price and device cost</h2>{idle}"
    bars = {"cost_usd": "list price", "device_cost_usd": "device cost"}
    if rep.spread_idle:
        bars["loaded_device_cost_usd"] = "device cost + idle share"
    items = [(str(g[rep.by]), [g.get(c) for c in bars]) for g in top]
    chart = charts.hbars(f"List price beside device cost by {rep.by}", items, [*bars.values()])
    return f"<h2>List price and device cost</h2>{chart}{idle}"


def _groups(rep: Report) -> str:
    if not rep.groups and rep.idle is None:
        return ""
    head, cells = text_cells(rep)
    classes = [""] * len(rep.groups) + (["idle"] if rep.idle is not None else [])
    return f"<h2>All groups by {esc(rep.by)}</h2>" + _table(head, cells, "groups", classes)


def _table(
    head: list[str], rows: list[list[Any]], name: str, classes: list[str] | None = None
) -> str:
    th = "".join(f"<th>{esc(h.replace('_', ' '))}</th>" for h in head)  # headers may wrap
    trs = []
    for i, row in enumerate(rows):
        cls = classes[i] if classes else ""
        tds = "".join(f"<td{' class=n' if j else ''}>{esc(v)}</td>" for j, v in enumerate(row))
        trs.append(f'<tr class="{cls}">{tds}</tr>' if cls else f"<tr>{tds}</tr>")
    body = "".join(trs)
    table = f'<table class="{name}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'
    return f'<div class="wide">{table}</div>'
