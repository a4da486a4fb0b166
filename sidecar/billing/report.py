"""`tollbooth report`: spend, tokens, requests and latency from the ledger, grouped.

Owns: reading the ledger (read-only), grouping by user, model or day, and the table/csv/json
formats. Never: shows an unknown cost as 0; a group with any unknown cost has `cost_usd` null and
says how many requests were unknown.
"""

from __future__ import annotations

import calendar
import csv
import io
import json
import math
import re
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Any

_SINCE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
GROUPS = {"user": "user", "model": "model", "day": "day"}


def parse_since(value: str, now: float | None = None) -> float:
    """'24h', '7d', '30m' ago, or an ISO date/time (UTC) -> unix seconds."""
    now = time.time() if now is None else now
    if m := _SINCE.match(value.strip()):
        return now - float(m.group(1)) * _UNITS[m.group(2)]
    for fmt in ("%Y-%m-%dT%H:%M:%S", "%Y-%m-%d"):
        try:
            # timegm reads the fields as UTC; mktime would apply the local zone and its summer time
            return float(calendar.timegm(time.strptime(value, fmt)))
        except ValueError:
            continue
    raise ValueError(f"--since '{value}': expected e.g. 24h, 7d, 30m or 2026-11-01")


@dataclass
class Group:
    key: str
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    unknown_cost_requests: int = 0
    unknown_token_requests: int = 0
    durations: list[float] = field(default_factory=list)

    def add(self, inp: int | None, out: int | None, cost: float | None, dur: float | None) -> None:
        self.requests += 1
        self.input_tokens += inp or 0
        self.output_tokens += out or 0
        if inp is None or out is None:
            self.unknown_token_requests += 1
        if cost is None:
            self.unknown_cost_requests += 1
        else:
            self.cost_usd += cost
        if dur is not None:
            self.durations.append(dur)

    def as_dict(self, by: str) -> dict[str, Any]:
        return {
            by: self.key,
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cost_usd": None if self.unknown_cost_requests else round(self.cost_usd, 8),
            "unknown_cost_requests": self.unknown_cost_requests,
            "unknown_token_requests": self.unknown_token_requests,
            "p50_duration_s": percentile(self.durations, 50),
            "p99_duration_s": percentile(self.durations, 99),
        }


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return round(ordered[rank - 1], 6)


def summarize(
    path: str, since: float, by: str, day_start_hour_utc: int = 0
) -> list[dict[str, Any]]:
    """Rows since `since`, grouped. By day, a day is a budget day (`budgets.day_start_hour_utc`),
    named by the date it starts on: a request is in the day it started in (its `ts`)."""
    if by not in GROUPS:
        raise ValueError(f"--by '{by}': expected one of {', '.join(GROUPS)}")
    if not 0 <= day_start_hour_utc <= 23:
        raise ValueError(f"--day-start-hour-utc '{day_start_hour_utc}': expected 0 to 23")
    offset = day_start_hour_utc * 3600
    if path.lower().startswith(("postgresql://", "postgres://")):  # the fleet's ledger
        from .fleet_ledger import report_rows

        return _grouped(report_rows(path, since, by, offset), by)
    if "://" in path:  # never echoed: a URL may carry a password
        raise ValueError("--ledger: a URL must start with postgresql:// or postgres://")
    uri = f"file:{path}?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True)
    except sqlite3.Error as exc:
        raise ValueError(f"ledger '{path}' cannot be opened: {exc}") from exc
    with conn:
        key = f"strftime('%Y-%m-%d', ts - {offset:d}, 'unixepoch')" if by == "day" else by
        rows = conn.execute(
            f"SELECT {key}, input_tokens, output_tokens, cost_usd, duration_s FROM requests "
            "WHERE ts >= ? ORDER BY ts",
            (since,),
        ).fetchall()
    conn.close()
    return _grouped(rows, by)


def _grouped(rows: list[Any], by: str) -> list[dict[str, Any]]:
    groups: dict[str, Group] = {}
    for k, inp, out, cost, dur in rows:
        groups.setdefault(k, Group(k)).add(inp, out, cost, dur)
    result = [g.as_dict(by) for g in groups.values()]
    if by == "day":
        return sorted(result, key=lambda r: r["day"])
    return sorted(result, key=lambda r: (r["cost_usd"] is None, -(r["cost_usd"] or 0), r[by]))


def render(rows: list[dict[str, Any]], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(rows, indent=2)
    if fmt == "csv":
        buf = io.StringIO()
        if rows:
            w = csv.DictWriter(buf, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows({k: "" if v is None else v for k, v in r.items()} for r in rows)
        return buf.getvalue()
    return table(rows)


def table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no requests in this period)"
    cols = list(rows[0])
    return columns(cols, [[_cell(r[c], c) for c in cols] for r in rows])


def columns(cols: list[str], cells: list[list[str]]) -> str:
    """Aligned text columns: the first left-aligned, the rest right-aligned."""
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += [
        "  ".join(
            v.rjust(w) if i else v.ljust(w)
            for i, (v, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in cells
    ]
    return "\n".join(lines)


def _cell(v: Any, col: str) -> str:
    if v is None:
        return "unknown"
    if col == "cost_usd":
        return f"${v:.4f}"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)
