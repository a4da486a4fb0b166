"""A request belongs to the budget day it was admitted in: a stream admitted before the day's
boundary and settled after it is the old day's in every store, the gauge, the ledger and the
report, never the new day's. The clock is injected (Budgets' `clock`); no sleeps."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path
from typing import Any

from sidecar.billing.budget import DAY, Budgets, LocalStore, month_start, to_micros
from sidecar.billing.ledger import Ledger
from sidecar.billing.redis_scripts import day_keys
from sidecar.billing.redis_store import RedisStore
from sidecar.billing.report import chargeback
from sidecar.config import AdmissionConfig, BudgetConfig, LedgerConfig, ModelPrice, PricingConfig
from sidecar.exchange import Cost, Endpoint, Exchange, RequestInfo, Usage
from sidecar.metering.pricing import PriceBook
from sidecar.telemetry.metrics import LabelCap, Metrics

MODEL = "m"
SPEND = 0.162  # what each request measured (the figure)
# Yesterday's budget day (UTC midnight): real dates, for the ledger's retention at open.
OLD = int(time.time() // DAY * DAY) - DAY
NEW = OLD + DAY


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def budgets(clock: Clock, store: Any = None) -> Budgets:
    prices = PriceBook(
        PricingConfig(models={MODEL: ModelPrice(input_per_1m=1.0, output_per_1m=1.0)})
    )
    return Budgets(
        BudgetConfig(user_daily_usd=1.0),
        AdmissionConfig(),
        Metrics(),
        LabelCap(10),
        prices,
        store=store,
        clock=clock,
    )


def exchange(started_at: float) -> Exchange:
    info = RequestInfo(Endpoint.CHAT, b"{}", True, stream=True, model=MODEL, max_tokens=10)
    return Exchange("r", Endpoint.CHAT, info, "eve", "eve", MODEL, started_at=started_at)


def measured(ex: Exchange) -> Exchange:
    """The request ended: 200, both directions measured, $0.162."""
    ex.status, ex.upstream_start = 200, 0.0
    ex.usage = Usage(input_tokens=81_000, output_tokens=81_000, model=MODEL)
    ex.cost = Cost(input_usd=SPEND / 2, output_usd=SPEND / 2)
    return ex


def gauge(b: Budgets) -> float | None:
    return b.metrics.registry.get_sample_value("llm_spend_today_usd", {"user_id": "eve"})


async def across_the_boundary(b: Budgets, clock: Clock) -> tuple[Exchange, Exchange]:
    """A stream admitted ten seconds before the boundary; after it, another request admitted
    and ended; then the old stream ends."""
    clock.now = NEW - 10
    old = exchange(clock.now)
    await b.gate(old)
    clock.now = NEW + 5
    new = exchange(clock.now)
    await b.gate(new)
    b.settle(measured(new))
    clock.now = NEW + 60
    b.settle(measured(old))
    return old, new


async def test_an_old_days_stream_settled_after_the_boundary_is_the_old_days(
    tmp_path: Path,
) -> None:
    clock = Clock(NEW - 10)
    b = budgets(clock)
    old, new = await across_the_boundary(b, clock)
    assert old.budget_hold.day == OLD and new.budget_hold.day == NEW
    assert gauge(b) == SPEND  # $0.324 before: the old day's stream added to the new day
    store = b.store
    assert isinstance(store, LocalStore)
    assert store.day == NEW and store.spent == {"user:eve": to_micros(SPEND)}
    assert store.held == {"user:eve": 0}

    # the ledger's row has the request's start; the report and a restart's restore read by it
    db = tmp_path / "ledger.db"
    ledger = Ledger(LedgerConfig(path=str(db), flush_interval_s=0.05), b.metrics)
    await asyncio.to_thread(ledger.open)
    ledger.append(old)
    ledger.append(new)
    await asyncio.to_thread(ledger.close)
    with sqlite3.connect(db) as conn:
        assert sorted(r[0] for r in conn.execute("SELECT ts FROM requests")) == [NEW - 10, NEW + 5]
    days = {r["day"]: r["cost_usd"] for r in chargeback(str(db), OLD, "day")}
    assert days == {
        time.strftime("%Y-%m-%d", time.gmtime(OLD)): SPEND,
        time.strftime("%Y-%m-%d", time.gmtime(NEW)): SPEND,
    }
    ledger = Ledger(LedgerConfig(path=str(db)), b.metrics)
    await asyncio.to_thread(ledger.open)
    try:
        day = b.day_start(clock())  # what a restart restores the day's spend from
        today = [r for r in ledger.spend_rows(day, month_start(day)) if r[5]]
        assert [(r[0], r[1], r[6]) for r in today] == [("eve", None, SPEND)]
    finally:
        await asyncio.to_thread(ledger.close)


async def test_a_request_admitted_just_after_the_boundary_is_the_new_days_everywhere(
    tmp_path: Path,
) -> None:
    """Started at 23:59:59, admitted at 00:00:01 (a boundary between the exchange's start and the
    gate): held, charged and recorded in the new day (its row's ts is moved to that day's start),
    so a restart restores it where the store had it."""
    clock = Clock(NEW + 1)
    b = budgets(clock)
    ex = exchange(NEW - 1)
    await b.gate(ex)
    assert ex.budget_hold.day == NEW and ex.started_at == NEW
    b.settle(measured(ex))
    assert gauge(b) == SPEND
    store = b.store
    assert isinstance(store, LocalStore) and store.spent == {"user:eve": to_micros(SPEND)}


async def test_the_shared_store_keeps_an_old_days_stream_in_that_days_keys(
    redis_server: Any,
) -> None:
    clock = Clock(NEW - 10)
    cfg = BudgetConfig(store=redis_server.url, user_daily_usd=1.0, store_timeout_s=0.5)
    holder: list[Budgets] = []
    store = RedisStore(
        cfg,
        Metrics(),
        lambda: holder[0].day_start(clock()),
        None,
        max_scopes=10,
        clock=clock,
    )
    b = budgets(clock, store)
    holder.append(b)
    store.start()
    try:
        await across_the_boundary(b, clock)
        c = redis_server.client()

        def day(d: int) -> tuple[int, int]:
            spent, held = day_keys(d)[:2]
            return int(c.hget(spent, "user:eve") or 0), int(c.hget(held, "user:eve") or 0)

        for _ in range(500):  # until both settlements reached Redis (bounded)
            if day(OLD)[0] and day(NEW)[0]:
                break
            await asyncio.sleep(0.01)
        assert day(OLD) == (to_micros(SPEND), 0)
        assert day(NEW) == (to_micros(SPEND), 0)
        assert gauge(b) == SPEND
    finally:
        await store.close()


async def test_the_report_by_day_follows_the_budget_days_start_hour(tmp_path: Path) -> None:
    """With `budgets.day_start_hour_utc: 6`, a request at 05:59 UTC is the previous budget day's
    (named by the date it started on), one at 06:01 the next one's."""
    db = tmp_path / "ledger.db"
    ledger = Ledger(LedgerConfig(path=str(db), flush_interval_s=0.05), Metrics())
    await asyncio.to_thread(ledger.open)
    for ts in (NEW + 6 * 3600 - 60, NEW + 6 * 3600 + 60):
        ledger.append(measured(exchange(ts)))
    await asyncio.to_thread(ledger.close)
    date = time.strftime("%Y-%m-%d", time.gmtime(NEW))
    before = time.strftime("%Y-%m-%d", time.gmtime(OLD))
    by_budget_day = {r["day"]: r["requests"] for r in chargeback(str(db), OLD, "day", 6)}
    assert by_budget_day == {before: 1, date: 1}
    assert {r["day"]: r["requests"] for r in chargeback(str(db), OLD, "day")} == {date: 2}
