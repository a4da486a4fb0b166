"""Budgets as a list of limits (issue 25): every scope (user, team, project, tag, model, global) in
a day or a month window, reserved and settled at once; what a client sees of them (the
x-tollbooth-budget-remaining-usd header, GET /v1/tollbooth/spend) equals the ledger; the config
is validated at load; a month boundary (clock injected) starts a new month."""

from __future__ import annotations

import asyncio
import calendar
import hashlib
import sqlite3
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml

from sidecar.billing.budget import (
    DAY,
    Budgets,
    Hold,
    LocalStore,
    Scope,
    limit_list,
    max_scopes,
    month_start,
    next_month,
    to_micros,
)
from sidecar.config import AdmissionConfig, BudgetConfig, ConfigError, LimitConfig, build, load
from sidecar.metering.pricing import PriceBook
from sidecar.proxy.headers import BUDGET_HEADER
from sidecar.telemetry.metrics import LabelCap, Metrics
from tests.conftest import Running, StartSidecar
from tests.fakes import MODEL
from tests.waiting import wait_for

MSGS = [{"role": "user", "content": "one two three four five"}]
# $0.001 per token in both directions: a request with max_tokens 10 holds (7 + 10) x $0.001
PRICES = {"models": {MODEL: {"input_per_1m": 1000.0, "output_per_1m": 1000.0}}}
HOLD = 17_000  # micro-dollars: 7 estimated prompt tokens + max_tokens 10
LIMIT = 0.2
ANN = "tb-ann-0123456789"
BOB = "tb-bob-0123456789"
KEYS = {
    ANN: {"user": "ann", "team": "red", "project": "atlas", "tags": ["eu", "prod"]},
    BOB: {"user": "bob", "team": "blue", "project": "zeus", "tags": ["us"]},
}
ANN_NAMES = {"user": "ann", "team": "red", "project": "atlas", "tag": "eu", "model": MODEL}


def keys_file(tmp: Path) -> str:
    path = tmp / "keys.yaml"
    entries = [{"sha256": hashlib.sha256(k.encode()).hexdigest(), **p} for k, p in KEYS.items()]
    path.write_text(yaml.safe_dump({"keys": entries}))
    return str(path)


def sidecar_config(tmp: Path, limits: list[dict[str, Any]], name: str = "l") -> dict[str, Any]:
    return {
        "pricing": PRICES,
        "identity": {"keys_file": keys_file(tmp)},
        "budgets": {"limits": limits},
        "ledger": {"path": str(tmp / f"{name}.db"), "flush_interval_s": 0.02},
    }


def ledger_micros(paths: list[str], user: str | None = None) -> tuple[int, int]:
    """(spend in micro-dollars as the budget charges it, admitted rows) in the ledgers."""
    total = rows = 0
    for path in paths:
        conn = sqlite3.connect(path)
        where = "status = '200'" + (" AND user = ?" if user else "")
        found = conn.execute(
            f"SELECT cost_usd FROM requests WHERE {where}", (user,) if user else ()
        ).fetchall()
        conn.close()
        total += sum(to_micros(c) for (c,) in found)
        rows += len(found)
    return total, rows


async def burst(urls: list[str], key: str, n: int) -> list[int]:
    """n concurrent streams of one key, spread over the sidecars at `urls`."""
    clients = [openai.AsyncOpenAI(base_url=u + "/v1", api_key=key, max_retries=0) for u in urls]

    async def one(i: int) -> int:
        try:
            stream = await clients[i % len(clients)].chat.completions.create(
                model=MODEL,
                messages=MSGS,
                stream=True,
                max_tokens=10,
                extra_headers={"X-Fake": "slow-stream"},
            )
            async for _ in stream:
                pass
        except openai.RateLimitError:
            return 429
        return 200

    try:
        return list(await asyncio.gather(*(one(i) for i in range(n))))
    finally:
        for c in clients:
            await c.close()


async def spend(url: str, key: str | None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with (
        aiohttp.ClientSession() as s,
        s.get(url + "/v1/tollbooth/spend", headers=headers) as r,
    ):
        return r.status, await r.json()


async def one_request(url: str, key: str) -> tuple[int, str | None]:
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 10}
    headers = {"Authorization": f"Bearer {key}"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", json=body, headers=headers) as r,
    ):
        await r.read()
        return r.status, r.headers.get(BUDGET_HEADER)


def ratio_of(run: Running, metric: str, scope: str, name: str, window: str) -> float | None:
    labels = {"scope": scope, "name": name, "window": window}
    return run.sc.metrics.registry.get_sample_value(metric, labels)


def entry(limits: list[dict[str, Any]], scope: str, window: str) -> dict[str, Any]:
    (found,) = [e for e in limits if e["scope"] == scope and e["window"] == window]
    return found


SCOPES = ["user", "team", "project", "tag", "model", "global"]


@pytest.mark.parametrize("window", ["day", "month"])
@pytest.mark.parametrize("scope", SCOPES)
async def test_a_burst_against_one_limit_stays_within_it_and_what_the_client_sees_is_the_ledger(
    start_sidecar: StartSidecar, tmp_path: Path, scope: str, window: str
) -> None:
    # a model limit by name: a "*" one is per request, and /v1/tollbooth/spend lists named ones
    named = {"name": MODEL} if scope == "model" else {}
    run = await start_sidecar(
        sidecar_config(tmp_path, [{"scope": scope, "usd": LIMIT, "window": window, **named}])
    )
    ledger = [run.sc.config.ledger.path or ""]
    name = ANN_NAMES.get(scope, "*")
    names = ["eu", "prod"] if scope == "tag" else [name]  # ann's two tags: two limits, each held

    # one request first: its header is the limit minus its own hold (nothing spent yet)
    status, header = await one_request(run.url, ANN)
    assert (status, header) == (200, f"{(to_micros(LIMIT) - HOLD) / 1e6:.6f}")
    await wait_for(lambda: ledger_micros(ledger)[1] == 1, "the first row in the ledger")
    first, _ = ledger_micros(ledger)
    assert first == 15_000  # 5 prompt + 10 output tokens, as the fake server counts them

    # a second one: the header is the limit minus what the ledger has, minus this hold
    await wait_for(
        lambda: (
            run.sc.budgets is not None
            and not run.sc.budgets.store.held.get(  # type: ignore[attr-defined]
                Scope(scope, name, 0, window).key  # type: ignore[arg-type]
            )
        ),
        "the first hold settled",
    )
    status, header = await one_request(run.url, ANN)
    assert (status, header) == (200, f"{(to_micros(LIMIT) - first - HOLD) / 1e6:.6f}")

    statuses = await burst([run.url], ANN, 20)
    admitted = statuses.count(200)
    await wait_for(lambda: ledger_micros(ledger)[1] == admitted + 2, "every admitted row")
    total, _ = ledger_micros(ledger)
    assert total == (admitted + 2) * 15_000
    assert total <= to_micros(LIMIT)  # an output limit and an exact price: no overshoot at all
    # all at once, (0.2 - 0.03) / 0.017 = 10 fit; more only as earlier streams end
    assert 10 <= admitted <= 11

    async def settled() -> bool:
        _, body = await spend(run.url, ANN)
        return all(e["spent_usd"] == total / 1e6 for e in body["limits"])

    await wait_for(settled, "/v1/tollbooth/spend to show the ledger's spend")
    status, body = await spend(run.url, ANN)
    assert status == 200
    assert body["limits"] == [
        {
            "scope": scope,
            "name": n,
            "window": window,
            "limit_usd": LIMIT,
            "spent_usd": total / 1e6,
            "remaining_usd": (to_micros(LIMIT) - total) / 1e6,
        }
        for n in names
    ]
    for n in names:  # the same figure on the used-ratio gauge
        ratio = ratio_of(run, "llm_budget_used_ratio", scope, n, window)
        assert ratio == total / to_micros(LIMIT)


async def test_every_limit_that_applies_is_held_at_once_and_a_key_sees_only_its_own(
    start_sidecar: StartSidecar, tmp_path: Path
) -> None:
    limits = [{"scope": s, "usd": 5.0, "window": w} for s in SCOPES for w in ("day", "month")]
    limits.append({"scope": "tag", "name": "us", "usd": 0.05, "window": "day", "soft": 0.5})
    run = await start_sidecar(sidecar_config(tmp_path, limits))
    ledger = [run.sc.config.ledger.path or ""]
    assert (await one_request(run.url, ANN))[0] == 200
    for _ in range(3):  # bob's tag "us" allows $0.05: a 4th request of $0.017 would pass it
        assert (await one_request(run.url, BOB))[0] == 200
    assert (await one_request(run.url, BOB))[0] == 429
    await wait_for(lambda: ledger_micros(ledger)[1] == 4, "four rows")
    ann, _ = ledger_micros(ledger, "ann")
    bob, _ = ledger_micros(ledger, "bob")
    assert (ann, bob) == (15_000, 45_000)

    async def settled() -> bool:
        _, body = await spend(run.url, BOB)
        return bool(entry(body["limits"], "global", "day")["spent_usd"] == 0.06)

    await wait_for(settled, "every hold settled")
    status, body = await spend(run.url, ANN)
    assert status == 200
    assert (body["user"], body["team"], body["project"], body["tags"]) == (
        "ann",
        "red",
        "atlas",
        ["eu", "prod"],
    )
    seen = [(e["scope"], e["name"], e["window"], e["spent_usd"]) for e in body["limits"]]
    mine = [("global", ["*"]), ("team", ["red"]), ("user", ["ann"]), ("project", ["atlas"])]
    mine += [("tag", ["eu", "prod"])]
    expected = [
        (s, n, w, 0.06 if s == "global" else 0.015)
        for s, ns in mine
        for w in ("day", "month")
        for n in ns
    ]
    assert seen == expected  # no model "*" (per request, not per key), nothing of bob's
    _, body = await spend(run.url, BOB)
    names = {(e["scope"], e["name"]) for e in body["limits"]}
    assert names == {("global", "*"), ("team", "blue"), ("user", "bob"), ("project", "zeus")} | {
        ("tag", "us")
    }
    us = [e for e in body["limits"] if (e["scope"], e["name"]) == ("tag", "us")]
    assert [(e["window"], e["limit_usd"], e["spent_usd"]) for e in us] == [
        ("day", 0.05, 0.045),
        ("month", 5.0, 0.045),
    ]
    # the soft limit: 0.045 / 0.05 = 0.9 used, past its 0.5
    assert ratio_of(run, "llm_budget_used_ratio", "tag", "us", "day") == 0.9
    assert ratio_of(run, "llm_budget_soft_ratio", "tag", "us", "day") == 0.5
    assert ratio_of(run, "llm_budget_soft_ratio", "tag", "eu", "day") is None


async def test_spend_needs_a_known_key_and_never_reaches_the_upstream(
    start_sidecar: StartSidecar, tmp_path: Path
) -> None:
    run = await start_sidecar(sidecar_config(tmp_path, [{"scope": "user", "usd": 1.0}]))
    assert run.upstream is not None
    before = len(run.upstream.seen)
    assert (await spend(run.url, None))[0] == 401
    assert (await spend(run.url, "tb-nobody"))[0] == 401
    status, body = await spend(run.url, ANN)
    assert status == 200 and body["limits"][0]["spent_usd"] == 0.0
    async with aiohttp.ClientSession() as s, s.post(run.url + "/v1/tollbooth/spend") as r:
        assert r.status == 405
    assert len(run.upstream.seen) == before  # answered by the sidecar, never forwarded
    assert run.value("llm_requests_total", model=MODEL, status_code="200") is None


async def test_a_request_where_no_limit_applies_has_no_header(
    start_sidecar: StartSidecar, tmp_path: Path
) -> None:
    run = await start_sidecar(
        sidecar_config(tmp_path, [{"scope": "project", "name": "zeus", "usd": 1.0}])
    )
    assert await one_request(run.url, ANN) == (200, None)  # ann's project is atlas
    assert (await one_request(run.url, BOB))[1] == f"{(to_micros(1.0) - HOLD) / 1e6:.6f}"


# --- three sidecars sharing a real Redis ------------------------------------------------------


@pytest.mark.parametrize("window", ["day", "month"])
@pytest.mark.parametrize("scope", SCOPES)
async def test_a_burst_over_three_sidecars_sharing_redis_stays_within_each_limit(
    start_sidecar: StartSidecar, redis_server: Any, tmp_path: Path, scope: str, window: str
) -> None:
    named = {"name": MODEL} if scope == "model" else {}
    limits = [{"scope": scope, "usd": LIMIT, "window": window, **named}]
    runs: list[Running] = []
    for i in range(3):
        cfg = sidecar_config(tmp_path, limits, name=f"l{i}")
        cfg["budgets"].update(store=redis_server.url, store_timeout_s=1.0)
        runs.append(await start_sidecar(cfg))
    ledgers = [r.sc.config.ledger.path or "" for r in runs]
    name = ANN_NAMES.get(scope, "*")
    names = ["eu", "prod"] if scope == "tag" else [name]
    statuses = await burst([r.url for r in runs], ANN, 30)
    admitted = statuses.count(200)
    await wait_for(lambda: ledger_micros(ledgers)[1] == admitted, "every admitted row")
    total, _ = ledger_micros(ledgers)
    assert total == admitted * 15_000
    assert total <= to_micros(LIMIT)
    assert 11 <= admitted <= 13  # 11 x $0.017 fit at once; a 12th, 13th once streams ended

    async def settled() -> bool:
        _, body = await spend(runs[2].url, ANN)
        return all(e["spent_usd"] == total / 1e6 for e in body["limits"])

    await wait_for(settled, "Redis to hold the ledger's spend")
    for r in runs:  # every sidecar answers the fleet's figure
        _, body = await spend(r.url, ANN)
        left = (to_micros(LIMIT) - total) / 1e6
        assert [(e["name"], e["spent_usd"], e["remaining_usd"]) for e in body["limits"]] == [
            (n, total / 1e6, left) for n in names
        ]
    _, body = await spend(runs[0].url, BOB)
    if scope in ("global", "model"):  # shared by every key: the same spend
        assert [e["spent_usd"] for e in body["limits"]] == [total / 1e6]
    else:  # bob's own scope: nothing spent, and never ann's
        assert [(e["name"], e["spent_usd"]) for e in body["limits"]] == [
            (dict(user="bob", team="blue", project="zeus", tag="us")[scope], 0.0)
        ]
    if to_micros(LIMIT) - total >= HOLD:  # room for one more: its header, and the gauge
        status, header = await one_request(runs[0].url, ANN)
        assert (status, header) == (200, f"{(to_micros(LIMIT) - total - HOLD) / 1e6:.6f}")
        for n in names:  # Redis's spend as it answered this sidecar's last admission
            ratio = ratio_of(runs[0], "llm_budget_used_ratio", scope, n, window)
            assert ratio == total / to_micros(LIMIT)


# --- windows, the month boundary and restore ------------------------------------------------------


def utc(y: int, m: int, d: int, h: int = 0) -> int:
    return calendar.timegm((y, m, d, h, 0, 0))


# Redis tests run on next year's dates: Redis expires a day's keys on its own clock (EXPIREAT),
# so a day already two days gone would vanish as it is written.
NEXT = time.gmtime().tm_year + 1


def test_a_month_starts_at_the_day_start_hour_on_its_first_day() -> None:
    assert month_start(utc(2026, 12, 2, 6)) == utc(2026, 12, 1, 6)
    # the budget day of 1 Dec 06:00 UTC-start days that began on 30 Nov is November's
    assert month_start(utc(2026, 11, 30, 6)) == utc(2026, 11, 1, 6)
    assert month_start(utc(2024, 2, 29)) == utc(2024, 2, 1)
    assert next_month(utc(2026, 12, 31, 6)) == utc(2027, 1, 1, 6)
    assert next_month(utc(2024, 1, 31)) == utc(2024, 2, 1)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def month_budgets(clock: Clock, store: Any = None) -> Budgets:
    from sidecar.config import ModelPrice, PricingConfig

    config = BudgetConfig(
        day_start_hour_utc=6,
        limits=(
            LimitConfig(scope="user", usd=1.0, window="month"),
            LimitConfig(scope="user", usd=0.5),
        ),
    )
    prices = PriceBook(PricingConfig(models={"m": ModelPrice(input_per_1m=1.0, output_per_1m=1.0)}))
    return Budgets(config, AdmissionConfig(), Metrics(), LabelCap(10), prices, store, clock)


async def test_a_month_boundary_starts_a_new_month_and_a_day_boundary_keeps_the_month() -> None:
    clock = Clock(utc(2026, 11, 29, 12))
    b = month_budgets(clock)
    store = b.store
    assert isinstance(store, LocalStore)
    scopes = b.scopes_for("eve", None, None, (), "m")
    assert [s.key for s in scopes] == ["user:eve", "month:user:eve"]

    async def charge(rid: str, micros: int) -> bool:
        day = b.day_start(clock())
        verdict = await store.reserve(Hold(rid, day, micros, scopes))
        if verdict.admitted:
            store.settle(rid, micros)
        return verdict.admitted

    assert await charge("a", 400_000)
    clock.now = utc(2026, 11, 30, 12)  # a new day, the same month
    assert await charge("b", 400_000)
    assert not await charge("c", 400_000)  # the month has 0.2 left
    assert store.spent == {"user:eve": 400_000, "month:user:eve": 800_000}
    clock.now = utc(2026, 12, 1, 5)  # still 30 Nov's budget day: the day starts at 06:00
    assert not await charge("d", 400_000)
    clock.now = utc(2026, 12, 1, 6)  # December
    assert await charge("e", 400_000)
    assert store.spent == {"user:eve": 400_000, "month:user:eve": 400_000}
    assert b.seconds_to_reset("month") == utc(2027, 1, 1, 6) - clock.now


async def test_a_hold_admitted_yesterday_settles_into_this_month_not_into_today() -> None:
    clock = Clock(utc(2026, 11, 29, 12))
    b = month_budgets(clock)
    store = b.store
    assert isinstance(store, LocalStore)
    scopes = b.scopes_for("eve", None, None, (), "m")
    assert (await store.reserve(Hold("a", b.day_start(clock()), 300_000, scopes))).admitted
    clock.now += DAY
    assert (await store.reserve(Hold("b", b.day_start(clock()), 100_000, scopes))).admitted
    store.settle("a", 200_000)
    assert store.spent == {"user:eve": 0, "month:user:eve": 200_000}
    assert store.held == {"user:eve": 100_000, "month:user:eve": 100_000}


async def test_the_month_boundary_in_redis(redis_server: Any) -> None:
    from sidecar.billing.redis_store import RedisStore

    clock = Clock(utc(NEXT, 11, 30, 12))
    holder: list[Budgets] = []
    config = BudgetConfig(store=redis_server.url, store_timeout_s=1.0, day_start_hour_utc=6)
    store = RedisStore(
        config,
        Metrics(),
        lambda: holder[0].day_start(clock()),
        None,
        max_scopes=100,
        clock=clock,
    )
    b = month_budgets(clock, store)
    holder.append(b)
    store.start()
    scopes = b.scopes_for("eve", None, None, (), "m")
    try:

        async def charge(rid: str, micros: int) -> bool:
            verdict = await store.reserve(Hold(rid, b.day_start(clock()), micros, scopes))
            if verdict.admitted:
                store.settle(rid, micros)
                await wait_for(lambda: not store.queue, "the settlement sent")
            return verdict.admitted

        assert await charge("a", 400_000)
        clock.now += DAY / 2  # 1 Dec 00:00: still 30 Nov's budget day
        assert await charge("b", 100_000)
        assert not await charge("c", 600_000)  # the day's 0.5 is spent
        clock.now = utc(NEXT, 12, 1, 6)
        assert await charge("d", 400_000)  # a new day and a new month
        assert await store.usage(b.day_start(clock()), scopes) == [(400_000, 0), (400_000, 0)]
        nov = b.day_start(utc(NEXT, 11, 30, 12))
        assert await store.usage(nov, scopes) == [(500_000, 0), (500_000, 0)]
    finally:
        await store.close()


async def test_restore_from_the_ledger_covers_every_scope_and_window(tmp_path: Path) -> None:
    from sidecar.billing.ledger import connect, spend_rows

    now = utc(2026, 11, 20, 12)
    b = Budgets(
        BudgetConfig(
            user_daily_usd=1.0,
            limits=tuple(
                LimitConfig(scope=s, usd=9.0, window="month")  # type: ignore[arg-type]
                for s in SCOPES
            ),
        ),
        AdmissionConfig(),
        Metrics(),
        LabelCap(10),
        PriceBook(build(__import__("sidecar.config").config.PricingConfig, {})),
        clock=Clock(now),
    )
    conn = connect(tmp_path / "l.db")
    day = b.day_start(now)
    rows = [  # ts, user, team, project, tags, model, cost
        (day + 10, "ann", "red", "atlas", "eu,prod", "m", 0.25),
        (day - DAY, "ann", "red", "atlas", "eu", "m", 0.5),  # this month, not today
        (month_start(day) - 10, "ann", "red", "atlas", "eu", "m", 4.0),  # last month
        (day + 20, "bob", None, None, None, "n", 0.125),
    ]
    for i, (ts, user, team, project, tags, model, cost) in enumerate(rows):
        conn.execute(
            "INSERT INTO requests (ts, request_id, model, endpoint, user, cost_usd, status, "
            "stream, team, project, tags) VALUES (?, ?, ?, '/v1/chat/completions', ?, ?, '200', "
            "0, ?, ?, ?)",
            (ts, f"r{i}", model, user, cost, team, project, tags),
        )
    conn.commit()
    await b.restore(spend_rows(conn, day, month_start(day)))
    conn.close()
    assert b.store.spent == {  # type: ignore[attr-defined]
        "user:ann": 250_000,
        "user:bob": 125_000,
        "month:global:*": 875_000,
        "month:team:red": 750_000,
        "month:user:ann": 750_000,
        "month:user:bob": 125_000,
        "month:project:atlas": 750_000,
        "month:tag:eu": 750_000,
        "month:tag:prod": 250_000,
        "month:model:m": 750_000,
        "month:model:n": 125_000,
    }


# --- the config -----------------------------------------------------------------------------------


def test_shorthands_expand_to_day_limits_in_front_of_the_list() -> None:
    config = BudgetConfig(
        global_daily_usd=9.0,
        user_daily_usd=1.0,
        users={"ann": 2.0},
        team_daily_usd=3.0,
        teams={"red": 4.0},
        limits=(LimitConfig(scope="project", usd=5.0, window="month", soft=0.8),),
    )
    assert [(x.scope, x.name, x.usd, x.window, x.soft) for x in limit_list(config)] == [
        ("global", "*", 9.0, "day", None),
        ("team", "*", 3.0, "day", None),
        ("team", "red", 4.0, "day", None),
        ("user", "*", 1.0, "day", None),
        ("user", "ann", 2.0, "day", None),
        ("project", "*", 5.0, "month", 0.8),
    ]
    # max_tracked_users for each "*" limit but the global one, plus every limit, plus one
    assert max_scopes(config) == 100_000 * 3 + 6 + 1


def write(tmp: Path, budgets: dict[str, Any]) -> Path:
    path = tmp / "c.yaml"
    path.write_text(yaml.safe_dump({"budgets": budgets}))
    return path


@pytest.mark.parametrize(
    ("budgets", "message"),
    [
        (
            {"limits": [{"scope": "org", "usd": 1}]},
            "config 'budgets.limits[0].scope' has value 'org': expected one of user, team, "
            "project, tag, model, global",
        ),
        (
            {"limits": [{"scope": "user", "usd": 1, "window": "week"}]},
            "config 'budgets.limits[0].window' has value 'week': expected one of day, month",
        ),
        ({"limits": [{"scope": "user"}]}, "config 'budgets.limits[0].usd' is required"),
        (
            {"limits": [{"scope": "user", "usd": -1}]},
            "config 'budgets.limits[0].usd' has value -1: must not be negative",
        ),
        (
            {"limits": [{"scope": "user", "usd": 1, "soft": 1.5}]},
            "config 'budgets.limits[0].soft' has value 1.5: must be in (0, 1]",
        ),
        (
            {"limits": [{"scope": "user", "usd": 1, "soft": 0}]},
            "config 'budgets.limits[0].soft' has value 0.0: must be in (0, 1]",
        ),
        (
            {"limits": [{"scope": "global", "name": "ann", "usd": 1}]},
            "config 'budgets.limits[0].name' has value 'ann': a global limit has name '*'",
        ),
        (
            {"limits": [{"scope": "tag", "name": "a b", "usd": 1}]},
            "config 'budgets.limits[0].name' has value 'a b': expected * or a name of 1-64 of "
            "A-Z a-z 0-9 . _ : @ + -",
        ),
        (
            {"limits": [{"scope": "tag", "usd": 1}, {"scope": "tag", "usd": 2}]},
            "config 'budgets.limits[1]' has value 'tag/*/day': given twice",
        ),
        (
            {"user_daily_usd": 1, "limits": [{"scope": "user", "usd": 2}]},
            "config 'budgets.limits' has value 'user/*/day': also set by a shorthand key",
        ),
        (
            {"limits": [{"scope": "user", "usd": 1, "hard": True}]},
            "config 'budgets.limits[0].hard' is not a known key (known: name, scope, soft, usd, "
            "window)",
        ),
        (
            {"limits": {"scope": "user"}},
            "config 'budgets.limits' has value {'scope': 'user'}: expected a list",
        ),
    ],
)
def test_bad_limits_are_refused_at_load_naming_the_key(
    tmp_path: Path, budgets: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        load(write(tmp_path, budgets))
    assert str(err.value) == message


def test_a_model_limit_may_name_a_model_with_a_slash(tmp_path: Path) -> None:
    cfg = load(write(tmp_path, {"limits": [{"scope": "model", "name": "org/m-7b", "usd": 1}]}))
    assert cfg.budgets.limits == (LimitConfig(scope="model", name="org/m-7b", usd=1.0),)


# --- all or nothing over day and month scopes -----------------------------------------------------


def redis_store(redis_server: Any, clock: Clock) -> Any:
    from sidecar.billing.redis_store import RedisStore

    config = BudgetConfig(store=redis_server.url, store_timeout_s=1.0)
    store = RedisStore(
        config,
        Metrics(),
        lambda: int(clock() // DAY * DAY),
        None,
        max_scopes=100,
        clock=clock,
    )
    store.start()
    return store


def hashes(redis_server: Any, day: int) -> dict[str, dict[bytes, bytes]]:
    from sidecar.billing.redis_scripts import day_keys, month_keys

    c = redis_server.client()
    return {
        "day_spent": c.hgetall(day_keys(day)[0]),
        "day_held": c.hgetall(day_keys(day)[1]),
        "month_spent": c.hgetall(month_keys(day)[0]),
        "month_held": c.hgetall(month_keys(day)[1]),
    }


async def test_a_tight_month_limit_refuses_the_hold_on_every_scope_in_redis(
    redis_server: Any,
) -> None:
    clock = Clock(utc(NEXT, 11, 29, 12))
    day = int(clock() // DAY * DAY)
    store = redis_store(redis_server, clock)
    day_scope = Scope("user", "eve", to_micros(5.0))
    month_scope = Scope("project", "atlas", to_micros(0.5), "month")
    try:
        first = await store.reserve(Hold("a", day, 400_000, (day_scope, month_scope)))
        assert (first.admitted, first.left) == (True, 100_000)
        before = hashes(redis_server, day)
        assert before == {
            "day_spent": {b"user:eve": b"0"},
            "day_held": {b"user:eve": b"400000"},
            "month_spent": {b"month:project:atlas": b"0"},
            "month_held": {b"month:project:atlas": b"400000"},
        }
        refused = await store.reserve(Hold("b", day, 200_000, (day_scope, month_scope)))
        assert (refused.admitted, refused.scope, refused.reason) == (False, month_scope, "budget")
        assert hashes(redis_server, day) == before  # nothing held on the day's scope either
        # yesterday's hold settles into this month, not into today
        clock.now += DAY
        today = day + DAY
        assert (await store.reserve(Hold("c", today, 50_000, (day_scope, month_scope)))).admitted
        store.settle("a", 300_000)
        await wait_for(lambda: not store.queue, "the settlement sent")
        assert hashes(redis_server, today) == {
            "day_spent": {b"user:eve": b"0"},
            "day_held": {b"user:eve": b"50000"},
            "month_spent": {b"month:project:atlas": b"300000"},
            "month_held": {b"month:project:atlas": b"50000"},
        }
    finally:
        await store.close()


async def test_a_tight_month_limit_refuses_the_hold_on_every_scope_in_process() -> None:
    store = LocalStore(max_scopes=10)
    day = utc(2026, 11, 29)
    day_scope = Scope("user", "eve", to_micros(5.0))
    month_scope = Scope("project", "atlas", to_micros(0.5), "month")
    first = await store.reserve(Hold("a", day, 400_000, (day_scope, month_scope)))
    assert (first.admitted, first.left) == (True, 100_000)
    refused = await store.reserve(Hold("b", day, 200_000, (day_scope, month_scope)))
    assert (refused.admitted, refused.scope, refused.reason) == (False, month_scope, "budget")
    assert store.held == {"user:eve": 400_000, "month:project:atlas": 400_000}


async def test_a_month_marker_that_is_not_a_number_never_breaks_a_settlement(
    redis_server: Any,
) -> None:
    from sidecar.billing.redis_scripts import KEEP_S, day_keys, month_keys, script_keys

    clock = Clock(utc(NEXT, 11, 29, 12))
    day = int(clock() // DAY * DAY)
    store = redis_store(redis_server, clock)
    month_scope = Scope("project", "atlas", to_micros(0.5), "month")
    try:
        assert (await store.reserve(Hold("a", day, 1_000, (month_scope,)))).admitted
        c = redis_server.client()
        c.set(month_keys(day)[2], "garbage")
        read = int(c.get(day_keys(day)[4]))
        # a request admitted while Redis was away settles: no hold record, charged by its keys
        args = ["zz", 5_000, read + 1, day + KEEP_S, month_scope.key]
        reply = await store.scripts["settle"](keys=script_keys(day), args=args)
        assert reply == b"charged"
        assert c.hgetall(month_keys(day)[0]) == {b"month:project:atlas": b"5000"}
        assert c.hget(day_keys(day)[2], "zz") == b'["s"]'
    finally:
        await store.close()


async def test_redis_seeds_a_month_once_and_each_day_from_the_ledger(redis_server: Any) -> None:
    from sidecar.billing.redis_scripts import day_keys, month_keys
    from sidecar.billing.redis_store import RedisStore

    clock = Clock(utc(NEXT, 11, 20, 12))
    b = month_budgets(clock)
    reads: list[int] = []

    async def source(day: int) -> tuple[dict[str, int], float]:
        reads.append(day)
        # what the ledger holds: 0.25 today, 0.5 earlier this month (ledger.spend_rows' shape)
        rows = [
            ("eve", None, None, None, "m", 1, 0.25, 0.25),
            ("eve", None, None, None, "m", 0, 0.5, 0.5),
        ]
        if day > reads[0]:  # the next day: yesterday's rows are no longer today's
            rows = [("eve", None, None, None, "m", 0, 0.75, 0.75)]
        return b.spent_by_scope(rows), clock()

    config = BudgetConfig(store=redis_server.url, store_timeout_s=1.0)
    store = RedisStore(
        config, Metrics(), lambda: b.day_start(clock()), source, max_scopes=100, clock=clock
    )
    store.start()
    scopes = b.scopes_for("eve", None, None, (), "m")
    c = redis_server.client()
    try:
        day = b.day_start(clock())
        verdict = await store.reserve(Hold("a", day, 100_000, scopes))
        assert (verdict.admitted, verdict.left) == (True, 150_000)  # the day's 0.5 - 0.25 - 0.1
        assert c.hgetall(day_keys(day)[0]) == {b"user:eve": b"250000"}
        assert c.hgetall(month_keys(day)[0]) == {b"month:user:eve": b"750000"}
        store.settle("a", 100_000)
        await wait_for(lambda: not store.queue, "the settlement sent")
        clock.now += DAY  # the next day: seeded again; the month runs on from Redis
        nxt = b.day_start(clock())
        assert (await store.reserve(Hold("b", nxt, 50_000, scopes))).admitted
        assert reads == [day, nxt]
        assert c.hgetall(day_keys(nxt)[0]) == {b"user:eve": b"0"}
        assert c.hgetall(month_keys(nxt)[0]) == {b"month:user:eve": b"850000"}
    finally:
        await store.close()


async def test_a_full_budget_table_names_the_scope_it_refuses(
    start_sidecar: StartSidecar, tmp_path: Path
) -> None:
    cfg = sidecar_config(tmp_path, [{"scope": "tag", "usd": 1.0}])
    cfg["budgets"]["max_tracked_users"] = 1  # max_scopes: 1 x 1 "*" limit + 1 limit + 1 = 3
    run = await start_sidecar(cfg)
    assert (await one_request(run.url, ANN))[0] == 200  # tags eu, prod: 2 of 3
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 10}
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            run.url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {BOB}"},
        ) as r,
    ):
        assert r.status == 200  # us: 3 of 3
    assert (await one_request(run.url, ANN))[0] == 200  # known scopes pass
    path = Path(cfg["identity"]["keys_file"])  # a third key, with a new tag
    keys = yaml.safe_load(path.read_text())
    keys["keys"].append(
        {"sha256": hashlib.sha256(b"tb-cy-0123456789").hexdigest(), "user": "cy", "tags": ["x"]}
    )
    path.write_text(yaml.safe_dump(keys))
    run.sc.identity.reload()
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            run.url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": "Bearer tb-cy-0123456789"},
        ) as r,
    ):
        assert r.status == 429
        error = (await r.json())["error"]
    assert (error["code"], error["message"]) == (
        "budget_exceeded",
        "too many distinct tags today for per-tag budgets; it resets at the start of the next "
        "budget day",
    )


async def test_redis_emptied_reseeds_month_scopes_from_postgresql(
    start_sidecar: StartSidecar, redis_server: Any, postgres: Any, tmp_path: Path
) -> None:
    from tests.test_fleet_ledger import fleet_ledger, shipped

    pg = postgres.database()
    limits = [
        {"scope": "project", "usd": 0.05, "window": "month"},
        {"scope": "tag", "name": "prod", "usd": 1.0, "window": "month"},
    ]

    def config(name: str) -> dict[str, Any]:
        cfg = sidecar_config(tmp_path, limits, name)
        cfg["budgets"]["store"] = redis_server.url
        cfg["ledger"] = fleet_ledger(tmp_path, pg, name)
        return cfg

    a, b = await start_sidecar(config("a")), await start_sidecar(config("b"))
    for _ in range(2):
        assert (await one_request(a.url, ANN))[0] == 200
    await shipped(pg, 2)
    redis_server.client().flushall()
    # reseeded from PostgreSQL: $0.030 of atlas's $0.05 this month; one more hold of $0.017 fits
    # ($0.047), and then, $0.045 spent, the next does not
    status, header = await one_request(b.url, ANN)
    assert (status, header) == (200, f"{(50_000 - 30_000 - HOLD) / 1e6:.6f}")
    assert (await one_request(b.url, ANN))[0] == 429

    async def settled() -> bool:
        _, body = await spend(a.url, ANN)
        return bool(entry(body["limits"], "project", "month")["spent_usd"] == 0.045)

    await wait_for(settled, "the third request settled")
    _, body = await spend(b.url, ANN)
    assert [(e["scope"], e["name"], e["spent_usd"]) for e in body["limits"]] == [
        ("project", "atlas", 0.045),
        ("tag", "prod", 0.045),
    ]
