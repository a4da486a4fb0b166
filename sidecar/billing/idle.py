"""Fully loaded GPU cost: the idle GPU time of a report's period, and its share by use.

Owns: idle = the GPU time available in the period (the GPUs the engine held x the period's length)
minus the device-seconds the ledger attributed to its requests; its price (`gpu_hour_usd`); and
`spread`, which shares the idle cost over a report's groups in proportion to their device-seconds.
Never: guesses a GPU count or a price. The ledger records device-seconds per request but not how
many GPUs were held or for how long, so the count comes from the operator (`--gpus`, or a
config's explicit `gpu.devices`); without one, idle is unknown and `note` says why. A price comes
from the price book given to the report, else from the ledger when all its rows agree on one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

IDLE = "(idle GPU)"  # the group name of the idle line in table and csv
_SAME_RATE = 1e-6  # relative: device costs written at one gpu_hour_usd agree to float rounding


@dataclass(frozen=True)
class Capacity:
    """The GPUs the engine held through the period, and who said so."""

    gpus: int | None
    source: str  # "--gpus", "config gpu.devices", or why it is not known


@dataclass(frozen=True)
class Idle:
    gpus: int | None
    gpus_source: str
    period_s: float
    available_s: float | None
    used_s: float
    idle_s: float | None
    gpu_hour_usd: float | None
    rate_source: str
    idle_cost_usd: float | None
    note: str | None  # why idle or its cost is unknown; None when both are known
    # requests without device-seconds: refused before admission (no GPU), or served while GPU
    # telemetry was off (their GPU time, if any, is counted as idle)
    unmeasured_requests: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "gpus": self.gpus,
            "gpus_source": self.gpus_source,
            "period_s": round(self.period_s, 6),
            "available_device_seconds": _r(self.available_s, 6),
            "used_device_seconds": round(self.used_s, 6),
            "idle_device_seconds": _r(self.idle_s, 6),
            "gpu_hour_usd": self.gpu_hour_usd,
            "gpu_hour_usd_source": self.rate_source,
            "idle_cost_usd": _r(self.idle_cost_usd, 8),
            "note": self.note,
            "requests_without_device_seconds": self.unmeasured_requests,
        }


def _r(v: float | None, digits: int) -> float | None:
    return None if v is None else round(v, digits)


def ledger_rate(rows: list[Any]) -> float | None:
    """The gpu_hour_usd the ledger's device costs were written at, when every priced row agrees
    (a SIGHUP that changed the price in the period: None, the report cannot choose)."""
    rates = [
        cost / secs * 3600
        for secs, cost in ((r[10], r[11]) for r in rows)
        if secs is not None and cost is not None and secs > 0
    ]
    if not rates:
        return None
    lo, hi = min(rates), max(rates)
    return lo if hi - lo <= _SAME_RATE * max(abs(hi), 1e-12) else None


def measure(
    rows: list[Any],
    period_s: float,
    capacity: Capacity,
    book_rate: float | None,
    book_source: str,
) -> Idle | None:
    """The period's idle GPU time and cost; None where the ledger has no GPU data for it (no
    request with device-seconds) and no GPU count was given."""
    used = [r[10] for r in rows if r[10] is not None]
    if not used and capacity.gpus is None:
        return None
    used_s = math.fsum(used)
    rate, rate_source = _rate(rows, book_rate, book_source)
    available = None if capacity.gpus is None else capacity.gpus * max(period_s, 0.0)
    idle_s, note = _idle_seconds(available, used_s, capacity)
    if idle_s is not None and rate is None:
        note = "no GPU price: pricing.gpu_hour_usd is in neither the price book nor the ledger"
    cost = None if idle_s is None or rate is None else idle_s / 3600 * rate
    return Idle(
        capacity.gpus, capacity.source, period_s, available, used_s, idle_s, rate, rate_source,
        cost, note, len(rows) - len(used),
    )  # fmt: skip


def _rate(rows: list[Any], book_rate: float | None, book_source: str) -> tuple[float | None, str]:
    if book_rate is not None:
        return book_rate, book_source
    rate = ledger_rate(rows)
    return rate, "ledger (device_cost_usd / device_seconds)" if rate is not None else "unknown"


def _idle_seconds(
    available: float | None, used_s: float, capacity: Capacity
) -> tuple[float | None, str | None]:
    if available is None:
        return None, f"the GPU count is not known: {capacity.source}"
    if used_s > available:  # never a negative idle: the stated count is wrong, or the period
        return None, (
            f"the requests' {used_s:.1f} device-seconds exceed the {available:.1f} available "
            f"({capacity.gpus} GPUs x the period): is the GPU count right?"
        )
    return available - used_s, None


def spread(groups: list[dict[str, Any]], idle: Idle | None) -> None:
    """Adds `idle_share_usd` (the idle cost x the group's share of the period's device-seconds)
    and `loaded_device_cost_usd` (its device cost + that share) to each group. By tag a request
    counts in each of its tags, so the shares add up to more than the idle cost, as the costs do."""
    for g in groups:
        share = _share(g.get("device_seconds"), idle)
        g["idle_share_usd"] = None if share is None else round(share, 8)
        device = g.get("device_cost_usd")
        g["loaded_device_cost_usd"] = (
            None if share is None or device is None else round(device + share, 8)
        )


def _share(device_s: float | None, idle: Idle | None) -> float | None:
    if idle is None or idle.idle_cost_usd is None or idle.used_s <= 0:
        return None  # nothing to share, or no use to share it by
    return idle.idle_cost_usd * (device_s or 0.0) / idle.used_s


def idle_row(by: str, idle: Idle, columns: list[str]) -> dict[str, Any]:
    """The idle line as a row of the report's columns: no requests, no tokens, nothing sold at
    list price (0, exact), the idle device time and its cost; columns that do not apply: None."""
    row: dict[str, Any] = dict.fromkeys(columns)
    row.update({by: IDLE, "requests": 0, "input_tokens": 0, "output_tokens": 0, "cost_usd": 0.0})
    row.update({"unknown_cost_requests": 0, "unknown_token_requests": 0})
    row["device_seconds"] = _r(idle.idle_s, 6)
    row["device_cost_usd"] = _r(idle.idle_cost_usd, 8)
    return row
