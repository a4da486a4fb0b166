"""A chargeback report: one period of the ledger, grouped, with what a reader needs to
trust it: the period, the price book, the idle GPU line, and the series the HTML charts draw.

Owns: `build` (the ledger read once, grouped by the chosen dimension, by day and group, and by
model), naming the price book (`price_book`: the file given to the report and its SHA-256, or
"unknown"), and the table, csv and json of a report (html: `report_html`).
Never: reprices the ledger (its costs are those written when each request was served), or shows a
value it does not have: an unknown cost, GPU count or price stays unknown.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import ConfigError, load
from . import idle as idle_mod
from .idle import Capacity, Idle
from .report import Group, cell, check_dimension, columns, group_rows, keys_of, ledger_rows

NO_GPU_COUNT = "not in the ledger; pass --gpus N (the GPUs the engine held through the period)"


@dataclass(frozen=True)
class PriceBook:
    """Which price book the report states: its file and digest, or None ("unknown")."""

    source: str | None = None
    sha256: str | None = None
    gpu_hour_usd: float | None = None

    @property
    def label(self) -> str:
        if self.source is None:
            return "unknown"
        return f"{self.source} (sha256 {self.sha256})"


@dataclass
class Report:
    by: str
    start: float
    end: float
    price_book: PriceBook
    groups: list[dict[str, Any]]
    idle: Idle | None
    spread_idle: bool
    daily: list[dict[str, Any]] = field(default_factory=list)  # day x group: known cost
    models: list[dict[str, Any]] = field(default_factory=list)
    requests: int = 0
    known_cost_usd: float = 0.0
    unknown_cost_requests: int = 0


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def price_book(pricing: str | None, config: str | None) -> PriceBook:
    """The price book named to the report: `--pricing FILE`, else `--config FILE`'s pricing
    section (as `serve` reads them). Its digest is of the file as read now: the ledger's costs
    were priced by the book in force when each request was served."""
    path = pricing or config
    if path is None:
        return PriceBook()
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"price book '{path}' cannot be read: {exc.strerror}") from exc
    digest = hashlib.sha256(data).hexdigest()
    if pricing:
        from ..metering.pricing import load_pricing_file

        rate = load_pricing_file(pricing).gpu_hour_usd
        return PriceBook(f"pricing file {pricing}", digest, rate)
    return PriceBook(f"config {config}, pricing section", digest, load(config).pricing.gpu_hour_usd)


def capacity(gpus: int | None, config: str | None) -> Capacity:
    """--gpus N, else a config's explicit `gpu.devices` (not `devices_file`: which of them the
    engine had is known only at run time); else unknown."""
    if gpus is not None:
        if gpus < 1:
            raise ValueError(f"--gpus '{gpus}': expected a count of at least 1")
        return Capacity(gpus, "--gpus")
    if config is not None:
        try:
            g = load(config).gpu
        except ConfigError as exc:
            raise ValueError(str(exc)) from exc
        if g.enabled and g.devices and not g.devices_file:
            return Capacity(len(g.devices), f"config {config} gpu.devices")
    return Capacity(None, NO_GPU_COUNT)


def build(
    ledger: str,
    since: float,
    until: float | None,
    by: str,
    day_start_hour_utc: int = 0,
    *,
    book: PriceBook | None = None,
    gpus: Capacity | None = None,
    spread_idle: bool = False,
    now: float | None = None,
) -> Report:
    """The report of [since, until) (until None: up to now). The idle time is that of the period
    up to now: a month not over yet has had only its days so far."""
    check_dimension(by, day_start_hour_utc)
    now = time.time() if now is None else now
    end = max(since, now if until is None else min(until, now))  # a month to come: empty
    book = book or PriceBook()
    rows = ledger_rows(ledger, since, until)
    groups = group_rows(rows, by, day_start_hour_utc)
    idle = idle_mod.measure(
        rows, end - since, gpus or Capacity(None, NO_GPU_COUNT), book.gpu_hour_usd,
        book.source or "unknown",
    )  # fmt: skip
    if spread_idle:
        idle_mod.spread(groups, idle)
    rep = Report(by, since, end, book, groups, idle, spread_idle)
    rep.daily = _daily(rows, by, day_start_hour_utc)
    rep.models = group_rows(rows, "model", day_start_hour_utc)
    rep.requests = len(rows)
    rep.known_cost_usd = sum(r[8] for r in rows if r[8] is not None)
    rep.unknown_cost_requests = sum(1 for r in rows if r[8] is None)
    return rep


def _daily(rows: list[Any], by: str, hour: int) -> list[dict[str, Any]]:
    """Each budget day's known cost by group: [{day, costs: {group: usd}}], days in order."""
    days: dict[str, dict[str, float]] = {}
    for row in rows:
        day = keys_of(row, "day", hour * 3600)[0]
        costs = days.setdefault(day, {})
        for k in keys_of(row, by, hour * 3600):
            costs[k] = costs.get(k, 0.0) + (row[8] or 0.0)
    return [{"day": d, "costs": days[d]} for d in sorted(days)]


# --- table, csv, json ---------------------------------------------------------------------------


def report_columns(rep: Report) -> list[str]:
    """The columns of a group, also when the period has none (the idle line alone)."""
    if rep.groups:
        return list(rep.groups[0])
    extra = ["idle_share_usd", "loaded_device_cost_usd"] if rep.spread_idle else []
    return [*Group("").as_dict(rep.by), *extra]


def rows_with_idle(rep: Report) -> list[dict[str, Any]]:
    """The groups, and the idle line last where the period has GPU data."""
    out = list(rep.groups)
    if rep.idle is not None:
        out.append(idle_mod.idle_row(rep.by, rep.idle, report_columns(rep)))
    return out


def render(rep: Report, fmt: str) -> str:
    if fmt == "json":
        return _json(rep)
    if fmt == "csv":
        return _csv(rep)
    if fmt == "html":
        from .report_html import render_html

        return render_html(rep)
    return _table(rep)


def _json(rep: Report) -> str:
    """A list of the groups as before, the idle line last, with its details under `idle_gpu`."""
    out = rows_with_idle(rep)
    if rep.idle is not None:
        out[-1] = {**out[-1], "idle_gpu": rep.idle.as_dict()}
    return json.dumps(out, indent=2)


def _csv(rep: Report) -> str:
    rows = rows_with_idle(rep)
    buf = io.StringIO()
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows({k: csv_value(v) for k, v in r.items()} for r in rows)
    return buf.getvalue()


FORMULA = ("=", "+", "-", "@", "\t", "\r")  # what a spreadsheet reads as the start of a formula


def csv_value(v: Any) -> Any:
    """None as empty (unknown, never 0); a name a spreadsheet would run as a formula (`=HYPERLINK(`
    from a user name) quoted with a leading apostrophe, as OWASP advises. Numbers as they are."""
    if v is None:
        return ""
    if isinstance(v, str) and v.startswith(FORMULA):
        return "'" + v
    return v


def _table(rep: Report) -> str:
    if not rep.groups and rep.idle is None:
        return "(no requests in this period)\n" + _footer(rep)
    return columns(*text_cells(rep)) + "\n" + _footer(rep)


def text_cells(rep: Report) -> tuple[list[str], list[list[str]]]:
    """The columns, and each group's cells as text with the idle line's last (table and page)."""
    cols = report_columns(rep)
    cells = [[cell(r[c], c) for c in cols] for r in rep.groups]
    if rep.idle is not None:
        line = idle_mod.idle_row(rep.by, rep.idle, cols)
        cells.append([idle_cell(line[c], c) for c in cols])
    return cols, cells


def idle_cell(v: Any, col: str) -> str:
    if col in ("idle_share_usd", "loaded_device_cost_usd", "p50_duration_s", "p99_duration_s"):
        return "-"
    return cell(v, col)


def _footer(rep: Report) -> str:
    lines = [
        f"period: {_iso(rep.start)} to {_iso(rep.end)}, by {rep.by}",
        f"price book: {rep.price_book.label}",
    ]
    if rep.idle is not None:
        lines.append("idle GPU: " + idle_text(rep.idle))
        if rep.spread_idle:
            lines.append("idle cost spread over the groups by device-seconds (idle_share_usd)")
    return "\n".join(lines)


def idle_text(i: Idle) -> str:
    used = f"requests used {i.used_s / 3600:.3f} GPU-h"
    if i.unmeasured_requests:
        used += (
            f" (requests without device-seconds: {i.unmeasured_requests}, refused before "
            "admission, or served with GPU telemetry off)"
        )
    if i.idle_s is None or i.available_s is None:
        return f"unknown ({i.note}); {used}"
    text = (
        f"{i.gpus} GPUs ({i.gpus_source}) x {i.period_s / 3600:.3f} h = "
        f"{i.available_s / 3600:.3f} GPU-h available; {used}; idle {i.idle_s / 3600:.3f} GPU-h"
    )
    if i.idle_cost_usd is None or i.gpu_hour_usd is None:
        return f"{text}; cost unknown ({i.note})"
    return f"{text} at ${i.gpu_hour_usd:.4f}/GPU-h ({i.rate_source}) = ${i.idle_cost_usd:.4f}"
