"""`tollbooth report`: spend, tokens, requests and latency from the ledger, grouped.

Owns: reading the ledger (read-only), grouping by any chargeback dimension over a period or a
budget month (`chargeback`: with each group's device-seconds and device cost), and the text
columns and cells of a table. The whole chargeback report (period, price book, idle GPU line,
table, csv, json, html) is `chargeback.py`'s. Never: shows an unknown cost as 0; a group with
any unknown cost has `cost_usd` null and says how many requests were unknown.
"""

from __future__ import annotations

import calendar
import contextlib
import math
import re
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Any

_SINCE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
# Chargeback: dimensions read from every request's columns, grouped here.
DIMENSIONS = ("user", "team", "project", "tag", "model", "day", "month")
PERIODS = {"day": "%Y-%m-%d", "month": "%Y-%m"}  # budget days and months, named by their date
NONE = "(none)"  # the group of requests without a team, a project or a tag
_MONTH = re.compile(r"^(\d{4})-(\d{2})$")
# The columns the report reads of each request, from either ledger.
COLUMNS = (
    "ts, user, team, project, tags, model, input_tokens, output_tokens, cost_usd, duration_s, "
    "device_seconds, device_cost_usd"
)


def parse_since(value: str, now: float | None = None) -> float:
    """'24h', '7d', '30m' ago, or an ISO date/time (UTC) -> unix seconds."""
    now = time.time() if now is None else now
    if m := _SINCE.match(value.strip()):
        return now - float(m.group(1)) * _UNITS[m.group(2)]
    for fmt in ("%Y-%m-%dT%H:%M:%S", "%Y-%m-%d"):
        with contextlib.suppress(ValueError):
            # timegm reads the fields as UTC; mktime would apply the local zone and its summer time
            return float(calendar.timegm(time.strptime(value, fmt)))
    raise ValueError(f"--since '{value}': expected e.g. 24h, 7d, 30m or 2026-11-01")


def month_bounds(value: str, day_start_hour_utc: int = 0) -> tuple[float, float]:
    """--month YYYY-MM: [start, end) in unix seconds. A budget month starts at the budget day's
    start hour on its first day, UTC."""
    m = _MONTH.match(value.strip())
    if not m or not 1 <= int(m.group(2)) <= 12:
        raise ValueError(f"--month '{value}': expected YYYY-MM, e.g. 2026-11")
    year, month = int(m.group(1)), int(m.group(2))
    nxt = (year + month // 12, month % 12 + 1)
    offset = day_start_hour_utc * 3600
    start = calendar.timegm((year, month, 1, 0, 0, 0)) + offset
    return float(start), float(calendar.timegm((*nxt, 1, 0, 0, 0)) + offset)


def keys_of(row: Any, by: str, offset: int) -> list[str]:
    """The groups one request belongs to: one, or by tag one per tag (a request with two tags is
    in both groups, so tag totals add up to more than the ledger; none: NONE)."""
    ts, user, team, project, tags, model = row[:6]
    if by in PERIODS:
        return [time.strftime(PERIODS[by], time.gmtime(ts - offset))]
    if by == "tag":
        return tags.split(",") if tags else [NONE]
    value = {"user": user, "team": team, "project": project, "model": model}[by]
    return [value if value is not None else NONE]


def chargeback(
    path: str, since: float, by: str, day_start_hour_utc: int = 0, until: float | None = None
) -> list[dict[str, Any]]:
    """Rows in [since, until), grouped by any of DIMENSIONS; days and months are budget days and
    months (`budgets.day_start_hour_utc`), named by the date they start on."""
    check_dimension(by, day_start_hour_utc)
    return group_rows(ledger_rows(path, since, until), by, day_start_hour_utc)


def check_dimension(by: str, day_start_hour_utc: int) -> None:
    if by not in DIMENSIONS:
        raise ValueError(f"--by '{by}': expected one of {', '.join(DIMENSIONS)}")
    if not 0 <= day_start_hour_utc <= 23:
        raise ValueError(f"--day-start-hour-utc '{day_start_hour_utc}': expected 0 to 23")


def ledger_rows(path: str, since: float, until: float | None = None) -> list[Any]:
    """The report's COLUMNS of each request in [since, until), oldest first."""
    end = math.inf if until is None else until
    if path.lower().startswith(("postgresql://", "postgres://")):  # the fleet's ledger
        from .fleet_ledger import request_rows

        return request_rows(path, COLUMNS.split(", "), since, end)
    if "://" in path:  # never echoed: a URL may carry a password
        raise ValueError("--ledger: a URL must start with postgresql:// or postgres://")
    return _sqlite_rows(path, since, end)


def group_rows(rows: list[Any], by: str, day_start_hour_utc: int = 0) -> list[dict[str, Any]]:
    """The rows grouped by `by`: by cost, highest first (unknown last); days and months in order."""
    offset = day_start_hour_utc * 3600
    groups: dict[str, Group] = {}
    for row in rows:
        for k in keys_of(row, by, offset):
            groups.setdefault(k, Group(k)).add(*row[6:12])
    result = [g.as_dict(by) for g in groups.values()]
    if by in PERIODS:
        return sorted(result, key=lambda r: r[by])
    return sorted(result, key=lambda r: (r["cost_usd"] is None, -(r["cost_usd"] or 0), r[by]))


def _sqlite_rows(path: str, since: float, until: float) -> list[Any]:
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise ValueError(f"ledger '{path}' cannot be opened: {exc}") from exc
    try:
        with contextlib.closing(conn):  # read-only: a ledger older than a column reads it as NULL
            have = {r[1] for r in conn.execute("PRAGMA table_info(requests)")}
            cols = ", ".join(c if c in have else "NULL" for c in COLUMNS.split(", "))
            return conn.execute(
                f"SELECT {cols} FROM requests WHERE ts >= ? AND ts < ? ORDER BY ts",
                (since, until),
            ).fetchall()
    except sqlite3.Error as exc:
        raise ValueError(f"ledger '{path}' cannot be read: {exc}") from exc


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
    device_seconds: float = 0.0
    device_cost_usd: float = 0.0
    device_rows: int = 0  # requests with device-seconds measured (GPU telemetry on)
    unpriced_device_rows: int = 0  # of those, without a device cost (no pricing.gpu_hour_usd)

    def add(
        self,
        inp: int | None,
        out: int | None,
        cost: float | None,
        dur: float | None,
        device_s: float | None,
        device_cost: float | None,
    ) -> None:
        self.requests += 1
        if device_s is not None:
            self.device_rows += 1
            self.device_seconds += device_s
            if device_cost is None:
                self.unpriced_device_rows += 1
            else:
                self.device_cost_usd += device_cost
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
        priced = self.device_rows and not self.unpriced_device_rows  # device-seconds, all priced
        return {
            by: self.key,
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cost_usd": None if self.unknown_cost_requests else round(self.cost_usd, 8),
            "unknown_cost_requests": self.unknown_cost_requests,
            "unknown_token_requests": self.unknown_token_requests,
            "device_seconds": round(self.device_seconds, 6) if self.device_rows else None,
            "device_cost_usd": round(self.device_cost_usd, 8) if priced else None,
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


def cell(v: Any, col: str) -> str:
    if v is None:
        return "unknown"
    if col.endswith("_usd"):
        return f"${v:.4f}"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)
