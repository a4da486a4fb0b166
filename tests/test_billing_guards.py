"""Billing guards: each test kills a change a real edit could make to the billing code (issue 21's
mutation run found them alive). Real parts throughout: the suite's redis-server, a real SQLite
ledger, the aiohttp app in front of an engine double (the one boundary where a fake stands in).

Each test names the change it catches; tools/mutate.py applies those changes (`--named`).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.billing.budget import DAY, Budgets, Hold, Scope, to_micros, usd
from sidecar.billing.ledger import Ledger, connect, row_of
from sidecar.billing.redis_scripts import day_keys
from sidecar.billing.redis_store import RedisStore
from sidecar.config import (
    AdmissionConfig,
    BudgetConfig,
    Config,
    LedgerConfig,
    ModelPrice,
    PricingConfig,
    build,
    validate,
)
from sidecar.credentials import bearer
from sidecar.exchange import Endpoint, Exchange, Usage
from sidecar.metering.pricing import PriceBook, compute
from sidecar.metering.wire import StreamMeter, inspect_request, open_stream, usage_from_body
from sidecar.proxy.identity import Identity
from sidecar.telemetry.metrics import LabelCap, Metrics
from tests.conftest import StartSidecar

TODAY = int(time.time() // DAY * DAY)
PRICE = ModelPrice(input_per_1m=1000.0, output_per_1m=2000.0, cached_input_per_1m=100.0)


# --- numbers from the upstream --------------------------------------------------------------------


def _chat_body(usage: dict[str, Any]) -> bytes:
    return json.dumps(
        {
            "id": "r",
            "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop"}],
            "usage": usage,
        }
    ).encode()


@pytest.mark.parametrize("field", ["prompt_tokens", "completion_tokens"])
def test_a_negative_count_is_no_count(field: str) -> None:
    """`_int` accepting a negative: a negative cost, which credits the budget."""
    usage = {"prompt_tokens": 7, "completion_tokens": 3, field: -1000}
    got = usage_from_body(Endpoint.CHAT, _chat_body(usage), {})
    counts = (got.input_tokens, got.output_tokens)
    assert None in counts and all(c is None or c >= 0 for c in counts)
    assert got.unknown_reason == "invalid_usage"  # a count out of range, since issue 21
    cost, reason = PriceBook(PricingConfig(default=PRICE)).cost("m", got)
    assert cost is None and reason == "usage_unknown"


def test_zero_is_a_count() -> None:
    """`_int` refusing 0 (`>= 0` made `> 0`): an embedding or an empty answer becomes unknown."""
    got = usage_from_body(
        Endpoint.CHAT, _chat_body({"prompt_tokens": 0, "completion_tokens": 0}), {}
    )
    assert (got.input_tokens, got.output_tokens, got.unknown_reason) == (0, 0, None)


@settings(deadline=None)  # a loaded machine is slow, not wrong
@given(
    prompt=st.integers(0, 10**9),
    cached=st.integers(0, 10**10),
    output=st.integers(0, 10**9),
)
def test_cost_is_never_negative_whatever_the_cached_count(
    prompt: int, cached: int, output: int
) -> None:
    """More cached tokens than prompt tokens (a buggy upstream): the uncached part went negative."""
    cost = compute(PRICE, prompt, cached, output)
    assert cost.input_usd >= 0 and cost.output_usd >= 0
    # cached input is part of the input: never cheaper than all of it at the cached price
    assert cost.input_usd >= prompt * 100.0 / 1e6 * (1 - 1e-12)
    assert cost.input_usd <= prompt * 1000.0 / 1e6 * (1 + 1e-12)


def test_cached_tokens_above_the_prompt_are_capped_at_the_prompt() -> None:
    book = PriceBook(PricingConfig(default=PRICE))
    cost, _ = book.cost("m", Usage(input_tokens=10, output_tokens=0, cached_input_tokens=50))
    assert cost is not None and cost.input_usd == pytest.approx(10 * 100.0 / 1e6)
    only_input = book.input_cost("m", Usage(input_tokens=10, cached_input_tokens=50))
    assert only_input == pytest.approx(10 * 100.0 / 1e6)


@settings(deadline=None)
@given(micros=st.integers(0, 10**12), part=st.floats(0.01, 0.99))
def test_to_micros_rounds_up_never_down(micros: int, part: float) -> None:
    """`to_micros` truncating: every charge a fraction of a micro-dollar short."""
    assert to_micros(usd(micros)) >= micros  # never below, at any size
    if micros < 10**9:  # below $1000 a double resolves a hundredth of a micro-dollar
        assert to_micros(usd(micros)) == micros  # whole micro-dollars stay what they are
        assert to_micros(usd(micros) + part / 1e6) == micros + 1


def test_a_tiny_cost_is_at_least_one_micro_dollar() -> None:
    assert to_micros(1e-9) == 1
    assert to_micros(0.0) == 0


# --- the shared store: seeding and the day --------------------------------------------------------


def _store(server: Any, source: Any = None) -> RedisStore:
    cfg = BudgetConfig(store=server.url, store_unavailable="closed", store_timeout_s=0.5)
    store = RedisStore(cfg, Metrics(), lambda: TODAY, source, max_scopes=10)
    store.breaker.cooldown_s = 0.1
    return store


def _spent(server: Any) -> dict[str, int]:
    raw = server.client().hgetall(day_keys(TODAY)[0])
    return {k.decode(): int(v) for k, v in raw.items()}


USER = Scope("user", "u", to_micros(1.0))


async def test_a_late_seed_never_overwrites_todays_spend(redis_server: Any) -> None:
    """The seed script without its `seeded` check: a second sidecar's (older) ledger read
    replaces the spend Redis already counted today."""
    a, b = _store(redis_server), _store(redis_server)
    try:
        assert await a._seed(TODAY, {"user:u": 300_000}, time.time())
        assert (await a.reserve(Hold("r1", TODAY, 200_000, (USER,)))).admitted
        replies = await a._settle_batch([(a.open.pop("r1"), 150_000, int(time.time() * 1000))])
        assert replies == [b"settled"]
        assert _spent(redis_server) == {"user:u": 450_000}
        assert not await b._seed(TODAY, {"user:u": 0}, time.time())
        await b.seed(TODAY, {"user:u": 1})
        assert _spent(redis_server) == {"user:u": 450_000}
    finally:
        await a.close()
        await b.close()


async def test_todays_settlement_that_finds_redis_emptied_waits_and_is_charged(
    redis_server: Any,
) -> None:
    """`day < today` made `<=`: a settlement of today's request after Redis was emptied is
    dropped (counted) instead of waiting for the reseed; the day's spend loses it."""
    reads: list[int] = []

    async def ledger(day: int) -> tuple[dict[str, int], float]:
        reads.append(day)
        return {}, 0.0  # read before the request ended: its charge is not in it

    store = _store(redis_server, source=ledger)
    store.start()
    try:
        assert (await store.reserve(Hold("r1", TODAY, 200_000, (USER,)))).admitted
        redis_server.client().flushall()
        store.settle("r1", 120_000)
        for _ in range(300):
            if _spent(redis_server).get("user:u") == 120_000:
                break
            await asyncio.sleep(0.01)
        assert _spent(redis_server) == {"user:u": 120_000}
        dropped = store.metrics.registry.get_sample_value("llm_budget_settles_dropped_total")
        assert not dropped
        assert len(reads) == 2  # the cold start, then the reseed after the flush
    finally:
        await store.close()


async def test_a_settlement_that_makes_the_days_spend_hash_gives_it_its_expiry(
    redis_server: Any,
) -> None:
    """A settlement of a hold Redis no longer has, in a day seeded with no spend, created the
    `spent` hash after the script's EXPIREAT: that hash never expired (one leaked a day)."""
    store = _store(redis_server)
    try:
        assert await store._seed(TODAY, {}, time.time() - 60)  # read a minute ago, no spend
        ended = int(time.time() * 1000)
        hold = Hold("gone", TODAY, 200_000, (USER,))
        assert await store._settle_batch([(hold, 120_000, ended)]) == [b"charged"]
        assert _spent(redis_server) == {"user:u": 120_000}
        ttl = redis_server.client().ttl(day_keys(TODAY)[0])
        assert 0 < ttl <= 3 * DAY  # kept for the day and a margin, then gone
    finally:
        await store.close()


# --- identity -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header", ["Bearer k1", "bearer k1", "BEARER k1", "Bearer  k1 ", "Bearer k1\t", " k1"]
)
def test_the_key_is_read_whatever_the_scheme_case_and_spaces(header: str) -> None:
    """`Bearer` matched case-sensitively, or the token left unstripped: the same key presented
    two ways was two principals (a fresh budget for the asking)."""
    assert bearer({"Authorization": header}) == "k1"


def _identity(**identity: Any) -> Identity:
    return Identity(validate(build(Config, {"identity": identity})))


def test_a_user_name_with_spaces_is_billed_as_the_user() -> None:
    """`"alice "` billed apart from `alice`: each spelling its own budget."""
    ident = _identity()
    header = ident.user_header
    assert ident.resolve({header: "alice "}, None).user == "alice"
    assert ident.resolve({header: " alice"}, None).user == "alice"
    assert ident.resolve({}, "alice ").user == "alice"
    assert ident.resolve({}, "   ").user == "anonymous"


def test_a_key_in_any_spelling_resolves_to_its_principal(tmp_path: Path) -> None:
    from sidecar.credentials import digest

    keys = tmp_path / "keys.yaml"
    keys.write_text(f"keys: [{{sha256: {digest('k1')}, user: alice, team: t}}]\n")
    ident = _identity(keys_file=str(keys))
    for header in ("Bearer k1", "bearer k1 ", "BEARER  k1"):
        p = ident.resolve({"Authorization": header}, "mallory")
        assert (p.user, p.team) == ("alice", "t")


# --- the ledger row -------------------------------------------------------------------------------


def _exchange(status: int, usage: Usage, **kw: Any) -> Exchange:
    info = inspect_request(
        Endpoint.CHAT,
        json.dumps({"model": "asked", "messages": [{"role": "user", "content": "hi"}]}).encode(),
        inject_usage=False,
    )
    fields = {"user": "__other__", "user_id": "alice", "model": "asked", **kw}
    ex = Exchange(request_id="r", endpoint=Endpoint.CHAT, info=info, **fields)
    ex.status, ex.usage = status, usage
    return ex


def test_a_consumed_request_of_unknown_cost_has_no_cost_in_its_row() -> None:
    """A request that reached the server with its usage unknown written as cost 0.0: the ledger
    (and the spend restored from it) says it was free."""
    row = row_of(_exchange(200, Usage(unknown_reason="no_usage")))
    assert row.cost_usd is None
    refused = row_of(_exchange(429, Usage()))
    assert refused.cost_usd == 0.0  # refused before anything was generated: nothing spent


def test_the_row_bills_the_user_not_the_label_and_records_the_served_model() -> None:
    """The capped label (`__other__`) written for the user, or the requested model for the
    served one: the report and the restored budgets bill the wrong name."""
    row = row_of(_exchange(200, Usage(input_tokens=1, output_tokens=1, model="served")))
    assert (row.user, row.model) == ("alice", "served")
    assert row_of(_exchange(200, Usage(input_tokens=1, output_tokens=1))).model == "asked"


def test_retention_is_counted_in_days(tmp_path: Path) -> None:
    """`retention_days` counted in hours (or seconds): a restart deletes the month's ledger."""
    db = tmp_path / "ledger.db"
    conn = connect(db)
    now = time.time()
    with conn:
        for age_s in (3600, 2 * DAY, 2.9 * DAY, 3.1 * DAY, 30 * DAY):
            conn.execute(
                "INSERT INTO requests (ts, request_id, model, endpoint, user, status, stream) "
                "VALUES (?, ?, 'm', 'chat', 'u', '200', 0)",
                (now - age_s, f"age-{age_s / DAY:.2f}d"),
            )
    conn.close()
    ledger = Ledger(LedgerConfig(path=str(db), retention_days=3), Metrics())
    assert ledger._try_connect()
    assert ledger._conn is not None
    kept = sorted(r[0] for r in ledger._conn.execute("SELECT request_id FROM requests"))
    ledger._conn.close()
    assert kept == ["age-0.04d", "age-2.00d", "age-2.90d"]


# --- the whole path: served model, 5xx with input usage -------------------------------------------


class Engine:
    """An engine double whose answer each test sets: status, body and the model it serves."""

    def __init__(self) -> None:
        self.status = 200
        self.served = "dear"
        self.usage: dict[str, Any] = {"prompt_tokens": 10, "completion_tokens": 5}
        self.app = web.Application()
        self.app.router.add_post("/v1/chat/completions", self.chat)

    async def chat(self, request: web.Request) -> web.Response:
        await request.read()
        body = {
            "id": "cmpl-1",
            "object": "chat.completion",
            "model": self.served,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "x"},
                    "finish_reason": None,
                }
            ],
            "usage": self.usage,
        }
        return web.json_response(body, status=self.status)


PRICES = {
    "models": {
        "cheap": {"input_per_1m": 1.0, "output_per_1m": 1.0},
        "dear": {"input_per_1m": 1000.0, "output_per_1m": 1000.0},
    }
}


async def _post(url: str, model: str, max_tokens: int = 20) -> int:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", json=body, headers={"X-Tollbooth-User": "eve"}) as r,
    ):
        await r.read()
        return r.status


async def _settled(run: Any) -> None:
    for _ in range(200):
        if not run.sc.budgets.store.holds:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the hold was never settled")


async def test_the_served_model_is_priced_not_the_requested_one(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """Pricing the requested model: asking for a cheap name served by a dear model pays the
    cheap price."""
    engine = Engine()
    server = await aiohttp_server(engine.app)
    run = await start_sidecar(
        {"pricing": PRICES, "budgets": {"user_daily_usd": 1.0}},
        upstream_url=str(server.make_url("")).rstrip("/"),
    )
    assert await _post(run.url, "cheap") == 200
    await _settled(run)
    dear = (10 + 5) * 1000.0 / 1e6
    assert run.sc.budgets.store.spent["user:eve"] == to_micros(dear)
    assert run.value("llm_spend_today_usd", user_id="eve") == pytest.approx(dear)


async def test_a_5xx_with_only_input_usage_is_billed(
    start_sidecar: StartSidecar, aiohttp_server: Any
) -> None:
    """A server error after the prompt was read (input counted, output unknown): it consumed the
    server, so it is charged at least its hold, never left free."""
    engine = Engine()
    engine.status, engine.served, engine.usage = 500, "dear", {"prompt_tokens": 10}
    server = await aiohttp_server(engine.app)
    run = await start_sidecar(
        {"pricing": PRICES, "budgets": {"user_daily_usd": 1.0}},
        upstream_url=str(server.make_url("")).rstrip("/"),
    )
    assert await _post(run.url, "dear", max_tokens=20) == 500
    await _settled(run)
    spent = run.sc.budgets.store.spent["user:eve"]
    assert spent >= to_micros(10 * 1000.0 / 1e6) > 0  # at least the measured input
    assert run.value("llm_budget_unmeasured_charges_total") == 1
    assert run.value("llm_spend_today_usd", user_id="eve") == pytest.approx(10 * 1000.0 / 1e6)


# --- streams cut short ----------------------------------------------------------------------------


def _running_chunk(index: int, prompt: int, done: int) -> bytes:
    chunk = {
        "id": "c",
        "model": "m",
        "choices": [{"index": index, "delta": {"content": "t"}, "finish_reason": None}],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": done,
            "total_tokens": prompt + done,
        },
    }
    return f"data: {json.dumps(chunk)}\n\n".encode()


def test_a_cut_short_chat_with_n_choices_is_charged_its_prompt_once() -> None:
    """A chat's `n` choices share one prompt: summing each choice's running prompt count charged
    it n times."""
    meter = open_stream(Endpoint.CHAT, choices=3, per_prompt=3)
    for index, done in ((0, 2), (1, 3), (2, 4)):
        meter.feed(_running_chunk(index, 11, done))
    usage = meter.usage_so_far()
    assert (usage.input_tokens, usage.output_tokens) == (11, 2 + 3 + 4)
    assert usage.unknown_reason is None


def test_the_budget_charges_a_cut_short_chat_its_prompt_once() -> None:
    info = inspect_request(
        Endpoint.CHAT,
        json.dumps({"model": "m", "messages": [], "n": 3, "max_tokens": 4}).encode(),
        inject_usage=False,
    )
    meter = open_stream(Endpoint.CHAT, choices=info.choices, per_prompt=info.n or 1)
    for index in range(3):
        meter.feed(_running_chunk(index, 100, 1))
    b = Budgets(
        BudgetConfig(user_daily_usd=1.0),
        AdmissionConfig(),
        Metrics(),
        LabelCap(10),
        PriceBook(PricingConfig(default=PRICE)),
    )
    ex = Exchange(
        request_id="r", endpoint=Endpoint.CHAT, info=info, user="u", user_id="u", model="m"
    )
    ex.status, ex.usage = 499, meter.usage_so_far()
    ex.cost, _ = b.prices.cost("m", ex.usage)
    assert b.measured_usd(ex) == pytest.approx((100 * 1000.0 + 3 * 2000.0) / 1e6)


# --- survivors of tools/mutate.py's run ---------------------------------------------------------


def _budgets(clock: Any, **config: Any) -> Budgets:
    return Budgets(
        BudgetConfig(user_daily_usd=1.0, **config),
        AdmissionConfig(),
        Metrics(),
        LabelCap(10),
        PriceBook(PricingConfig(default=PRICE)),
        clock=clock,
    )


def test_the_budget_day_starts_at_the_configured_hour() -> None:
    """`day_start_hour_utc * 3600` off by a second, or the offset subtracted: spend moves to the
    wrong day around the boundary."""
    b = _budgets(lambda: 0.0, day_start_hour_utc=6)
    six = 6 * 3600
    assert b.day_start(10 * DAY + six) == 10 * DAY + six
    assert b.day_start(10 * DAY + six - 1) == 9 * DAY + six
    assert b.day_start(10 * DAY + 7 * 3600) == 10 * DAY + six
    assert _budgets(lambda: 0.0).day_start(10 * DAY + 1) == 10 * DAY


async def test_the_last_micro_dollar_of_a_budget_admits_a_one_micro_hold() -> None:
    """`max(hold.amount, 1)` made 2: a budget with one micro-dollar left refuses what fits."""
    from sidecar.billing.budget import LocalStore

    store = LocalStore(10)
    scope = Scope("user", "u", 10)
    assert (await store.reserve(Hold("a", 0, 9, (scope,)))).admitted
    store.settle("a", 9)
    assert (await store.reserve(Hold("b", 0, 1, (scope,)))).admitted  # 9 + 1 = the limit
    store.settle("b", 1)
    refused = await store.reserve(Hold("c", 0, 0, (scope,)))  # spent: not even a $0 hold
    assert not refused.admitted and refused.reason == "budget"


async def test_redis_bounds_the_scopes_it_tracks(redis_server: Any) -> None:
    """The reserve script's count of new scopes made `new - 1`: the capacity check never fires
    and Redis tracks every invented user."""
    cfg = BudgetConfig(store=redis_server.url, store_unavailable="closed", store_timeout_s=0.5)
    store = RedisStore(cfg, Metrics(), lambda: TODAY, None, max_scopes=2)
    try:
        for name in ("a", "b"):
            scope = Scope("user", name, to_micros(1.0))
            assert (await store.reserve(Hold(name, TODAY, 10, (scope,)))).admitted
        third = await store.reserve(Hold("c", TODAY, 10, (Scope("user", "c", 10**6),)))
        assert not third.admitted and third.reason == "capacity"
        assert len(redis_server.client().hgetall(day_keys(TODAY)[0])) == 2
    finally:
        await store.close()


async def test_a_settlement_into_a_reseeded_day_keeps_the_days_keys(redis_server: Any) -> None:
    """The settle's expiry `hold.day + KEEP_S` made `-`: it deletes the day's holds and leaves
    its spend without an expiry. (The spend of a day seeded empty gets no expiry today either:
    the script sets it before the first HINCRBY creates the hash; reported, not asserted.)"""

    async def ledger(day: int) -> tuple[dict[str, int], float]:
        return {}, 0.0

    store = _store(redis_server, source=ledger)
    try:
        assert await store.reseed(TODAY)
        replies = await store._settle_batch(
            [(Hold("gone", TODAY, 5, (USER,)), 7, int(time.time() * 1000))]
        )
        assert replies == [b"charged"]
        client = redis_server.client()
        holds_key = day_keys(TODAY)[2]
        assert client.hget(holds_key, "gone") == b'["s"]'  # settled once, remembered
        assert DAY < client.ttl(holds_key) <= 2 * DAY
        assert _spent(redis_server) == {"user:u": 7}
    finally:
        await store.close()


def test_the_key_id_of_an_authorization_header() -> None:
    from sidecar.credentials import api_key_id, key_id

    assert api_key_id("Bearer k1") == key_id("k1") == api_key_id("bearer  k1")
    assert key_id("k1") is not None and key_id("k1") != key_id("k2")
    assert api_key_id(None) is None and api_key_id("") is None


def test_only_without_a_keys_file_does_the_body_decide_who_pays(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys: []\n")
    assert _identity().needs_body is True
    assert _identity(keys_file=str(keys)).needs_body is False


def test_status_label_and_failed() -> None:
    """`status_label` or `failed` changed: 5xx, refusals and broken streams counted as served."""
    ok = _exchange(200, Usage())
    assert (ok.status_label, ok.failed) == ("200", False)
    broken = _exchange(200, Usage())
    broken.error = "reset"
    assert (broken.status_label, broken.failed) == ("stream_error", True)
    for status, failed in ((399, False), (400, True), (0, True), (1, False), (503, True)):
        assert _exchange(status, Usage()).failed is failed, status


def _meter_record(ex: Exchange) -> Metrics:
    from sidecar.metering.meter import Meter

    m = Metrics()
    Meter(m, PriceBook(PricingConfig(default=PRICE))).record(ex)
    return m


def test_cost_is_counted_for_what_was_consumed_and_only_that() -> None:
    """`not consumed(ex)` removed, or `cost is None` flipped: a refusal gets a cost, or a
    priced request none."""
    labels = {"model": "asked", "api_endpoint": "/v1/chat/completions", "user_id": "__other__"}
    served = _meter_record(_exchange(200, Usage(input_tokens=10, output_tokens=5)))
    get = served.registry.get_sample_value
    assert get("llm_cost_usd_total", {**labels, "token_type": "input"}) == pytest.approx(0.01)
    assert get("llm_cost_usd_total", {**labels, "token_type": "output"}) == pytest.approx(0.01)
    assert get("llm_tokens_total", {**labels, "token_type": "input"}) == 10  # `_count` too
    refused = _meter_record(_exchange(429, Usage())).registry.get_sample_value
    assert refused("llm_cost_usd_total", {**labels, "token_type": "input"}) is None
    assert refused("llm_cost_unknown_total", {"model": "asked", "reason": "usage_unknown"}) is None
    unknown = _meter_record(_exchange(200, Usage(unknown_reason="no_usage"))).registry
    assert (
        unknown.get_sample_value(
            "llm_cost_unknown_total", {"model": "asked", "reason": "usage_unknown"}
        )
        == 1
    )
    assert (
        unknown.get_sample_value("llm_cost_usd_total", {**labels, "token_type": "output"}) is None
    )


def test_consumed_is_every_2xx_and_no_other_status() -> None:
    from sidecar.exchange import consumed

    assert [consumed(_exchange(s, Usage())) for s in (199, 200, 299, 300, 429)] == [
        False,
        True,
        True,
        False,
        False,
    ]
    assert consumed(_exchange(500, Usage(input_tokens=3)))  # measured input: it used the server


def test_time_per_output_token_from_two_tokens_a_choice() -> None:
    from sidecar.metering.meter import time_per_output_token

    ex = _exchange(200, Usage(input_tokens=1, output_tokens=4, finish_reasons=("stop", "stop")))
    ex.upstream_start, ex.first_token_at, ex.duration_s = ex.t0, ex.t0 + 1.0, 3.0
    assert time_per_output_token(ex) == pytest.approx(2.0)  # 2 tokens a choice: 2 s for 1
    ex.usage = Usage(input_tokens=1, output_tokens=2, finish_reasons=("stop", "stop"))
    assert time_per_output_token(ex) is None  # one token a choice: no time between tokens


def test_a_space_in_a_path_is_no_control_character() -> None:
    from sidecar.proxy.routes import AmbiguousPath, routing_path

    assert routing_path("/v1/a%20b") == "/v1/a b"
    with pytest.raises(AmbiguousPath):
        routing_path("/v1/a%1fb")


def test_the_root_route_and_a_trailing_slash_are_metered() -> None:
    from sidecar.proxy.routes import classify

    assert classify("POST", "/") is Endpoint.TGI_COMPAT
    assert classify("POST", "/v1/completions/") is Endpoint.COMPLETIONS
    assert classify("GET", "/v1/completions") is None


@pytest.mark.parametrize("api", ["vllm", "tgi"])
def test_an_invocations_body_of_two_shapes_is_ambiguous(api: str) -> None:
    """The count of shapes `> 1` made `> 2`: a body the server may route either way is metered
    as the first."""
    from sidecar.metering.dispatch import AmbiguousBody, invocation_endpoint

    with pytest.raises(AmbiguousBody, match="more than one of '"):
        invocation_endpoint({"messages": [], "prompt": "x"}, api)
    assert invocation_endpoint({"prompt": "x"}, api) is Endpoint.COMPLETIONS
    assert invocation_endpoint({"temperature": 1}, api) is Endpoint.OTHER


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'"text"', b"\xff\xfe"])
def test_an_unparseable_answer_is_usage_unknown(body: bytes) -> None:
    got = usage_from_body(Endpoint.CHAT, body, {})
    assert isinstance(got, Usage) and got.unknown_reason == "unparseable_response"
    assert (got.input_tokens, got.output_tokens) == (None, None)


def _responses(meter: StreamMeter, kind: str, **response: Any) -> None:
    event = {"type": kind, "response": {"id": "resp", "model": "m", **response}}
    meter.feed(f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode())


@pytest.mark.parametrize("kind", ["response.completed", "response.incomplete", "response.failed"])
def test_a_responses_stream_ends_with_its_terminal_event_and_its_usage(kind: str) -> None:
    meter = open_stream(Endpoint.RESPONSES)
    _responses(meter, "response.created", status="in_progress")
    assert not meter.done
    usage = {"input_tokens": 9, "output_tokens": 4}
    _responses(meter, kind, status=kind.split(".")[1], usage=usage)
    _, got = meter.finish()
    assert meter.done and (got.input_tokens, got.output_tokens) == (9, 4)
    assert got.error == ("response.failed" if kind == "response.failed" else None)


async def test_a_hold_admitted_without_redis_counts_in_the_next_decision(
    redis_server: Any,
) -> None:
    """`outage or settling` made `and`: holds admitted while Redis was away, still running, are
    left out of the next decision once it answers, and the budget is spent twice."""
    cfg = BudgetConfig(store=redis_server.url, store_unavailable="local", store_timeout_s=1.0)
    store = RedisStore(cfg, Metrics(), lambda: TODAY, None, max_scopes=10)
    try:
        assert (await store.reserve(Hold("k", TODAY, 100_000, (USER,)))).admitted
        store.breaker.in_row, store.breaker.retry_at = 3, time.monotonic() + 60  # open: not sent
        assert (await store.reserve(Hold("o", TODAY, 500_000, (USER,)))).admitted
        assert "o" in store.outage and store.metrics.store_local
        store.breaker.retry_at = 0.0  # the cooldown is over: the next call is the trial
        late = await store.reserve(Hold("n", TODAY, 500_000, (USER,)))
        assert not late.admitted and late.reason == "budget"  # 0.1 + 0.5 + 0.5 > 1.0
    finally:
        await store.close()


async def test_a_spent_budget_admits_nothing_while_redis_is_away(redis_server: Any) -> None:
    """`max(0, left)` made `max(1, left)`: a spent scope's share during an outage is a
    micro-dollar, and free (unpriced) requests go through."""
    cfg = BudgetConfig(store=redis_server.url, store_unavailable="local", store_timeout_s=1.0)
    store = RedisStore(cfg, Metrics(), lambda: TODAY, None, max_scopes=10)
    try:
        assert (await store.reserve(Hold("k", TODAY, USER.limit, (USER,)))).admitted
        assert store.known == {"user:u": 0}
        store.breaker.in_row, store.breaker.retry_at = 3, time.monotonic() + 60  # open: not sent
        refused = await store.reserve(Hold("z", TODAY, 0, (USER,)))
        assert not refused.admitted and refused.reason == "budget"
    finally:
        await store.close()


def test_the_priced_model_falls_back_from_served_to_requested_to_label() -> None:
    """`or` made `and` in priced_model: a request with no served model would be priced as
    nothing (None), however it was asked for."""
    from sidecar.exchange import priced_model

    assert priced_model(_exchange(200, Usage(model="served"))) == "served"
    assert priced_model(_exchange(200, Usage())) == "asked"
    assert priced_model(_exchange(200, Usage(), model="unknown")) == "asked"


def test_an_out_of_range_budget_amount_is_clamped_to_zero_not_one() -> None:
    """The clamp's floor 0 made 1: a negative amount would be charged a micro-dollar."""
    from sidecar.billing.budget import MAX_MICROS, LocalStore

    store = LocalStore(10)
    assert store._checked(-5) == 0
    assert store._checked(MAX_MICROS + 1) == MAX_MICROS
    assert store._checked(7) == 7


def test_a_request_without_a_hold_belongs_to_the_day_it_started() -> None:
    """`request_day` returning None without a hold: its spend has no day."""
    b = _budgets(lambda: 0.0, day_start_hour_utc=6)
    ex = _exchange(200, Usage())
    ex.started_at = 10 * DAY + 7 * 3600
    assert ex.budget_hold is None
    assert b.request_day(ex) == 10 * DAY + 6 * 3600


def test_an_unreachable_budget_store_says_retry_after_one_second() -> None:
    """Retry-After 1 made 2 for `budget_store_unavailable`."""
    from sidecar.billing.budget import Verdict
    from sidecar.exchange import Refusal

    b = _budgets(lambda: 0.0)
    with pytest.raises(Refusal) as refused:
        b._refuse(Verdict(False, reason="unavailable"), 1, "alice")
    assert refused.value.status == 503
    assert refused.value.retry_after == 1


def test_estimate_tokens_counts_at_least_one_choice() -> None:
    """`max(1, n or 1)` made `min(...)` / `max(0, ...)`: n=0 or n=3 would be misestimated."""
    from sidecar.exchange import estimate_tokens

    config = AdmissionConfig()
    assert estimate_tokens(config, 0, 10, 0, prompt_tokens=5) == 15
    assert estimate_tokens(config, 0, 10, None, prompt_tokens=5) == 15
    assert estimate_tokens(config, 0, 10, 3, prompt_tokens=5) == 35
    assert estimate_tokens(config, 0, 10, -2, prompt_tokens=5) == 15  # a negative n: one choice


def test_the_operation_of_every_route_is_a_name() -> None:
    """`operation` returning None for OTHER (or any route): a span without its operation."""
    assert Endpoint.OTHER.operation == "other"
    assert Endpoint.CHAT.operation == "chat"
    assert Endpoint.EMBEDDINGS.operation == "embeddings"
    assert Endpoint.COMPLETIONS.operation == "text_completion"


def test_a_del_in_a_path_is_refused() -> None:
    """DEL (0x7F) no longer refused: a control character reaches the route and the logs."""
    from sidecar.proxy.routes import AmbiguousPath, routing_path

    for raw in ("/v1/chat\x7f/completions", "/v1/chat%7F/completions", "/v1/\x1f"):
        with pytest.raises(AmbiguousPath):
            routing_path(raw)
    assert routing_path("/v1/chat~/x") == "/v1/chat~/x"
    assert routing_path("/v1/ a") == "/v1/ a"


def test_an_embeddings_answer_with_its_input_generated_zero_tokens() -> None:
    """Embeddings output not set to 0 when the input is known: a counted request would be
    reported as usage unknown."""
    body = json.dumps({"model": "e", "usage": {"prompt_tokens": 5, "total_tokens": 5}}).encode()
    usage = usage_from_body(Endpoint.EMBEDDINGS, body, {})
    assert (usage.input_tokens, usage.output_tokens, usage.unknown_reason) == (5, 0, None)
    unknown = usage_from_body(Endpoint.EMBEDDINGS, json.dumps({"usage": {}}).encode(), {})
    assert (unknown.input_tokens, unknown.output_tokens) == (None, None)
    assert unknown.unknown_reason == "incomplete_usage"


def test_a_usage_without_its_output_count_says_incomplete_usage() -> None:
    """The `incomplete_usage` reason lost: a half-counted answer would look fully counted."""
    body = json.dumps({"model": "m", "choices": [], "usage": {"prompt_tokens": 5}}).encode()
    usage = usage_from_body(Endpoint.CHAT, body, {})
    assert (usage.input_tokens, usage.output_tokens) == (5, None)
    assert usage.unknown_reason == "incomplete_usage"


def test_a_cut_short_batch_with_an_unseen_prompt_says_incomplete_usage() -> None:
    """usage_so_far's running totals when a prompt was never seen: unknown, and why. (Not the
    seen choices' output, 5: the other choices' is unknown, and an output count beside an input
    counted by /tokenize later would be read as measured, `finishers.with_prompt_count`.)"""
    meter = open_stream(Endpoint.COMPLETIONS, choices=4, per_prompt=2)
    for index, done in ((0, 2), (1, 3)):
        meter.feed(_running_chunk(index, 11, done))
    usage = meter.usage_so_far()
    assert (usage.input_tokens, usage.output_tokens) == (None, None)
    assert usage.unknown_reason == "incomplete_usage"


def _finish_chunk(index: int, reason: str) -> bytes:
    choice = {"index": index, "text": "t", "finish_reason": reason}
    return f"data: {json.dumps({'id': 'c', 'model': 'm', 'choices': [choice]})}\n\n".encode()


def test_a_stream_counts_its_token_events_and_every_choice_s_finish_reason() -> None:
    """`_read`'s constants: a token event counted as 0, or choice 0's finish reason (and running
    usage) filed under index 1, where choice 1's overwrites it."""
    meter = open_stream(Endpoint.COMPLETIONS, choices=2, per_prompt=2)
    meter.feed(_finish_chunk(0, "stop"))
    assert meter.token_events == 1
    assert not meter.finished
    meter.feed(_finish_chunk(1, "length"))
    assert meter.token_events == 2
    assert meter.finished
    assert meter.usage_so_far().finish_reasons == ("stop", "length")


def test_running_usage_of_choice_0_and_1_is_kept_apart() -> None:
    """Choice 0's running usage filed under index 1: choice 1's replaces it, and the cut-short
    stream is charged one choice's output."""
    meter = open_stream(Endpoint.CHAT, choices=2, per_prompt=2)
    meter.feed(_running_chunk(0, 11, 2))
    meter.feed(_running_chunk(1, 11, 3))
    usage = meter.usage_so_far()
    assert (usage.input_tokens, usage.output_tokens) == (11, 5)


def test_compared_keeps_only_a_non_empty_string() -> None:
    """`compared()` returning a value that is not a string (`and` made `or`), or nothing."""
    from sidecar.metering.counts import compared

    assert compared("response.completed") == "response.completed"
    for v in (5, ["x"], {"a": 1}, True, "", None):
        assert compared(v) is None


def test_the_breaker_reports_when_it_opens_and_when_it_closes() -> None:
    """success()/failure() return values: True only for the call that closes / opens it."""
    from sidecar.billing.redis_store import Breaker

    now = [0.0]
    breaker = Breaker(2, 5.0, clock=lambda: now[0])
    assert breaker.success() is False  # closed already
    assert breaker.failure() is False
    assert breaker.failure() is True  # the second in a row opens it
    assert not breaker.closed
    assert breaker.failure() is False  # already open
    assert breaker.success() is True  # closes it
    assert breaker.closed
    assert breaker.success() is False


def test_a_generated_key_carries_32_random_bytes(tmp_path: Path) -> None:
    """`token_urlsafe(32)` made 31 or 33: a key of another strength than documented."""
    from sidecar.proxy.identity import add_key

    key = add_key(str(tmp_path / "keys.yaml"), "alice", None)
    assert key.startswith("tb-")
    assert len(key) == len("tb-") + 43  # 32 bytes in unpadded base64url


async def test_the_settler_backs_off_doubling_up_to_the_breaker_cooldown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The settler's backoff x3 instead of x2 (or its cap lost): settlements retried late while
    Redis is away. The breaker is held open, so no call leaves the process."""
    from sidecar.billing import redis_store

    cfg = BudgetConfig(store="redis://127.0.0.1:1/0", store_unavailable="closed")
    store = RedisStore(cfg, Metrics(), lambda: TODAY, max_scopes=10)
    store.breaker.in_row = store.breaker.failures
    store.breaker.retry_at = float("inf")
    store.queue.append((Hold("r1", TODAY, 100, (USER,)), 100, 0))
    delays: list[float] = []
    real_sleep = asyncio.sleep
    enough = asyncio.Event()

    async def recorded(delay: float, *args: Any) -> Any:
        if delay > 0:
            delays.append(delay)
            if len(delays) >= 8:
                enough.set()
        return await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", recorded)  # the module reads asyncio.sleep
    task = asyncio.create_task(store._settler())
    try:
        await asyncio.wait_for(enough.wait(), 5)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await store.redis.aclose()
    cap = redis_store.BREAKER_COOLDOWN_S
    expected = [min(0.05 * 2**i, cap) for i in range(8)]
    assert delays[:8] == pytest.approx(expected)


def test_the_priced_model_falls_back_to_a_known_label_only() -> None:
    """`ex.model != "unknown"` flipped: the placeholder priced as a model, a real label not."""
    from sidecar.exchange import priced_model

    def bare(model: str) -> Exchange:
        info = inspect_request(Endpoint.CHAT, b'{"messages": []}', inject_usage=False)
        ex = Exchange(
            request_id="r", endpoint=Endpoint.CHAT, info=info, model=model, user="u", user_id="u"
        )
        ex.status, ex.usage = 200, Usage()
        return ex

    assert priced_model(bare("labelled")) == "labelled"
    assert priced_model(bare("unknown")) is None


def test_an_uncounted_prompt_is_estimated_from_its_characters() -> None:
    """chars / ratio made chars * ratio: a prompt's hold 16 times too large."""
    from sidecar.exchange import estimate_tokens

    config = AdmissionConfig(chars_per_token=4.0)
    assert estimate_tokens(config, 100, 10, 1) == 25 + 10
    assert estimate_tokens(config, 101, 10, 1) == 26 + 10  # rounded up


def test_the_tgi_native_routes_are_known_as_such() -> None:
    """`is_tgi_native` returning None: TGI's own routes read as OpenAI ones."""
    assert Endpoint.TGI_GENERATE.is_tgi_native is True
    assert Endpoint.TGI_GENERATE_STREAM.is_tgi_native is True
    assert Endpoint.CHAT.is_tgi_native is False


def test_the_pooling_routes_are_known_as_such() -> None:
    """`is_pooling` returning None: a pooling route metered as a generation."""
    assert Endpoint.POOLING.is_pooling is True
    assert Endpoint.CLASSIFY.is_pooling is True
    assert Endpoint.CHAT.is_pooling is False
    assert Endpoint.CLASSIFY.operation == "embeddings"


def test_time_to_first_token_is_from_the_upstream_start() -> None:
    """ttft_s's `-` made `+`: a latency the sum of two clock readings."""
    ex = _exchange(200, Usage())
    assert ex.ttft_s is None
    ex.upstream_start, ex.first_token_at = 10.0, 10.5
    assert ex.ttft_s == pytest.approx(0.5)
