"""Charts as plain inline SVG, for the HTML report: stacked columns, and horizontal bars (single or
paired). No library, no script, no external reference: a string a browser draws as it is.

Owns: the geometry (scales, ticks, bars, legends) and escaping every label (`esc`): names come from
the ledger, that is from clients and gateways, so `<script>` in a user name is text here.
Never: draws an unknown value as a bar of 0; it is written "unknown" in its place.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence

# Okabe-Ito's colour-blind-safe palette, then two more; the last groups are folded into OTHER.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")
OTHER_COLOUR = "#999999"
LABEL_CHARS = 28  # a longer name is cut on the chart (whole in its tooltip and in the tables)
FONT = "font-family:sans-serif;font-size:12px"

Fmt = Callable[[float], str]


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def short(name: str) -> str:
    return name if len(name) <= LABEL_CHARS else name[: LABEL_CHARS - 1] + "\u2026"


def usd(v: float) -> str:
    """Dollars for a chart: cents from $1 up, else three significant digits ($0.000127), so a
    small price per 1,000 tokens is not rounded away."""
    if v == 0 or abs(v) >= 1:
        return f"${v:,.2f}"
    decimals = 2 - math.floor(math.log10(abs(v)))
    return "$" + f"{v:.{decimals}f}".rstrip("0").rstrip(".")


def tick(v: float, step: float) -> str:
    """An axis label in dollars, every label of an axis with the same decimals."""
    decimals = 0 if step >= 1 else max(2, -math.floor(math.log10(step)))
    return f"${v:,.{decimals}f}"


def colour(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def nice_step(top: float) -> float:
    """A round tick step (1, 2 or 5 x 10^n) so that four of them reach `top`."""
    if top <= 0:
        return 1.0
    raw = top / 4
    mag = 10.0 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def _svg(kind: str, title: str, width: int, height: int, body: list[str]) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart {kind}" role="img" '
        f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" style="{FONT}">'
        f"<title>{esc(title)}</title>" + "".join(body) + "</svg>"
    )


def _rect(x: float, y: float, w: float, h: float, fill: str, group: str, tip: str) -> str:
    return (
        f'<rect class="bar" data-group="{esc(group)}" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" '
        f'height="{max(h, 0):.1f}" fill="{fill}"><title>{esc(tip)}</title></rect>'
    )


def _text(x: float, y: float, text: str, anchor: str = "start", extra: str = "") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{extra}>{esc(text)}</text>'


def legend(names: Sequence[str], colours: Sequence[str], x: float, y: float) -> list[str]:
    out = []
    for i, (name, fill) in enumerate(zip(names, colours, strict=True)):
        yy = y + i * 18
        out.append(
            f'<rect class="key" x="{x:.1f}" y="{yy:.1f}" width="12" height="12" fill="{fill}"/>'
        )
        out.append(_text(x + 18, yy + 10, short(name)))
    return out


def stacked_columns(
    title: str,
    categories: Sequence[str],
    series: Sequence[tuple[str, Sequence[float]]],
    colours: Sequence[str],
) -> str:
    """One column per category (a day), stacked by series (a group), with a y axis and a legend."""
    left, top, plot_h, col_w = 70, 30, 260, max(8, min(40, 720 // max(len(categories), 1)))
    plot_w = col_w * len(categories)
    width, height = left + plot_w + 30 + 230, top + plot_h + 70
    height = max(height, top + 18 * len(series) + 20)
    totals = [sum(s[1][i] for s in series) for i in range(len(categories))]
    step = nice_step(max(totals, default=0.0))
    ymax = step * max(1, math.ceil(max(totals, default=0.0) / step))
    body = _y_axis(left, top, plot_w, plot_h, step, ymax)
    for i, day in enumerate(categories):
        x, base = left + i * col_w + 1, float(top + plot_h)
        for (name, values), fill in zip(series, colours, strict=True):
            h = values[i] / ymax * plot_h
            if values[i] > 0:
                body.append(
                    _rect(x, base - h, col_w - 2, h, fill, name, f"{day} {name}: {usd(values[i])}")
                )
            base -= h
        if len(categories) <= 16 or i % math.ceil(len(categories) / 16) == 0:
            cx, cy = left + i * col_w + col_w / 2, top + plot_h + 12
            body.append(_text(cx, cy, day, "end", f' transform="rotate(-45 {cx:.1f} {cy:.1f})"'))
    body += legend([s[0] for s in series], colours, left + plot_w + 30, top)
    return _svg("stacked", title, width, height, body)


def _y_axis(left: float, top: float, w: float, h: float, step: float, ymax: float) -> list[str]:
    out = []
    for k in range(round(ymax / step) + 1):
        y = top + h - k * step / ymax * h
        out.append(f'<line x1="{left}" x2="{left + w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(_text(left - 6, y + 4, tick(k * step, step), "end"))
    out.append(f'<line x1="{left}" x2="{left}" y1="{top}" y2="{top + h}" stroke="#444"/>')
    return out


def hbars(
    title: str,
    items: Sequence[tuple[str, Sequence[float | None]]],
    names: Sequence[str],
) -> str:
    """Horizontal bars, one row per item and one bar per value in it (`names` says which):
    top spenders (one value), list price beside device cost (two). None: "unknown", no bar."""
    colours = [colour(i) for i in range(len(names))]
    label_w, bar_w, bar_h = 200, 380, 14
    row_h = bar_h * len(names) + 10
    legend_h = 18 * len(names) if len(names) > 1 else 0
    width, height = label_w + bar_w + 120, 20 + legend_h + row_h * len(items) + 10
    top = 20 + legend_h
    known = [v for _, vals in items for v in vals if v is not None]
    vmax = max(known, default=0.0) or 1.0
    body = legend(names, colours, label_w, 6) if len(names) > 1 else []
    for r, (label, vals) in enumerate(items):
        y = top + r * row_h
        body.append(_text(label_w - 8, y + row_h / 2, short(label), "end"))
        for j, v in enumerate(vals):
            yy = y + j * bar_h
            if v is None:
                body.append(_text(label_w + 4, yy + bar_h - 3, "unknown", extra=' fill="#666"'))
                continue
            w = v / vmax * bar_w
            body.append(
                _rect(label_w, yy, w, bar_h - 2, colours[j], label, f"{label} {names[j]}: {usd(v)}")
            )
            body.append(_text(label_w + w + 4, yy + bar_h - 3, usd(v)))
    return _svg("hbars", title, width, height, body)
