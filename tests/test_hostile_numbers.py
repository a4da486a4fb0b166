"""Numbers from the upstream are range-checked before they are used: a token count is an integer
from 0 to MAX_TOKEN_COUNT, anything else is invalid usage (unknown, charged the hold), never an
exception; amounts are micro-dollars in [0, MAX_MICROS], rounded up; no store's hold or spend goes
negative; the Redis scripts change nothing when an argument is out of range.

Through the readers, the pricing and the stores, then a hostile upstream (a fake engine: the
one boundary faked) in front of a real sidecar with its SQLite ledger, alone and with the real
Redis store the suite starts.
"""

from __future__ import annotations

import asyncio
import json
import math
import sqlite3
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sidecar.billing.budget import MAX_MICROS, Budgets, Hold, LocalStore, Scope, to_micros
from sidecar.billing.redis_scripts import day_keys, script_keys
from sidecar.billing.redis_store import RedisStore
from sidecar.config import (
    AdmissionConfig,
    BudgetConfig,
    ConfigError,
    ModelPrice,
    PricingConfig,
    build,
)
from sidecar.exchange import Endpoint, Exchange, Refusal, RequestInfo, Usage
from sidecar.metering.counts import INVALID_USAGE, MAX_TOKEN_COUNT
from sidecar.metering.meter import price_cost
from sidecar.metering.pricing import PriceBook, compute
from sidecar.metering.wire import open_stream, usage_from_body
from sidecar.proxy.finishers import _count
from sidecar.telemetry.metrics import LabelCap, Metrics
from tests.conftest import StartSidecar
from tests.test_budget_day import Clock

MODEL = "hostile"
PRICES = {"models": {MODEL: {"input_per_1m": 1000.0, "output_per_1m": 1000.0}}}  # $0.001/token
USER = Scope("user", "u", to_micros(1.0))

# Every one of these, as a usage count, is no count: a request's usage with it is invalid.
BAD = [
    "1" + "0" * 30,  # 10**30: killed the ledger thread, sent Redis's held negative
    str(MAX_TOKEN_COUNT + 1),
    "-1",
    "-0.5",
    "1.5",
    "5.0",
    "1e3",
    "NaN",
    "Infinity",
    "-Infinity",
    '"7"',
    "true",
    "[]",
    "{}",
]


def body(prompt: str, completion: str = "5", cached: str | None = None) -> bytes:
    details = f', "prompt_tokens_details": {{"cached_tokens": {cached}}}' if cached else ""
    return (
        f'{{"id": "x", "model": "{MODEL}", "choices": [{{"index": 0, "finish_reason": "stop"}}],'
        f' "usage": {{"prompt_tokens": {prompt}, "completion_tokens": {completion}{details}}}}}'
    ).encode()


def stream(prompt: str, completion: str = "5") -> bytes:
    chunk = {"id": "x", "model": MODEL, "choices": [{"index": 0, "delta": {"content": "hi"}}]}
    end = {
        "id": "x",
        "model": MODEL,
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
    }
    usage = f'{{"prompt_tokens": {prompt}, "completion_tokens": {completion}}}'
    last = f'{{"id": "x", "model": "{MODEL}", "choices": [], "usage": {usage}}}'
    return (
        f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(end)}\n\ndata: {last}\n\ndata: [DONE]\n\n"
    ).encode()


# --- the readers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("where", ["prompt", "completion"])
def test_an_out_of_range_count_in_a_body_is_invalid_usage(bad: str, where: str) -> None:
    raw = body(bad) if where == "prompt" else body("5", bad)
    u = usage_from_body(Endpoint.CHAT, raw, {})
    assert (u.input_tokens, u.output_tokens, u.cached_input_tokens) == (None, None, None)
    assert u.unknown_reason == INVALID_USAGE
    assert u.model == MODEL  # the rest of the response is still read


@pytest.mark.parametrize("bad", BAD)
def test_an_out_of_range_count_in_a_stream_is_invalid_usage(bad: str) -> None:
    meter = open_stream(Endpoint.CHAT)
    meter.feed(stream(bad))
    _, u = meter.finish()
    assert (u.input_tokens, u.output_tokens) == (None, None)
    assert u.unknown_reason == INVALID_USAGE


def test_the_ceiling_itself_is_a_count() -> None:
    u = usage_from_body(Endpoint.CHAT, body(str(MAX_TOKEN_COUNT), "0"), {})
    assert (u.input_tokens, u.output_tokens, u.unknown_reason) == (MAX_TOKEN_COUNT, 0, None)


def test_a_streams_totals_above_the_ceiling_are_invalid() -> None:
    """Two choices' running totals, each within the ceiling, whose sum is not (a usage chunk sent
    twice is no sum: the last is the request's totals, tests/test_hostile_streams.py)."""
    meter = open_stream(Endpoint.CHAT, choices=2)
    half = MAX_TOKEN_COUNT // 2 + 1
    for i in (0, 1):
        choice = {"index": i, "delta": {"content": "hi"}}
        usage = {"prompt_tokens": 3, "completion_tokens": half}
        chunk = {"id": "x", "model": MODEL, "choices": [choice], "usage": usage}
        meter.feed(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    _, u = meter.finish()
    assert u.output_tokens is None and u.unknown_reason == INVALID_USAGE


def test_more_cached_tokens_than_prompt_tokens_is_invalid_usage() -> None:
    u = usage_from_body(Endpoint.CHAT, body("10", "5", cached="11"), {})
    assert u.input_tokens is None and u.unknown_reason == INVALID_USAGE
    ok = usage_from_body(Endpoint.CHAT, body("10", "5", cached="10"), {})
    assert (ok.input_tokens, ok.cached_input_tokens, ok.unknown_reason) == (10, 10, None)


@pytest.mark.parametrize("bad", ["999999999999999999", "-3", "1.0", "x", " 5"])
def test_tgi_count_headers_out_of_range_are_invalid_usage(bad: str) -> None:
    raw = b'{"generated_text": "hi", "details": {"finish_reason": "length"}}'
    u = usage_from_body(
        Endpoint.TGI_GENERATE, raw, {"x-prompt-tokens": bad, "x-generated-tokens": "3"}
    )
    assert u.input_tokens is None and u.output_tokens is None
    assert u.unknown_reason == INVALID_USAGE and u.finish_reasons == ("length",)


@pytest.mark.parametrize("field", ["generated_tokens", "input_length"])
def test_tgi_stream_details_out_of_range_are_invalid_usage(field: str) -> None:
    meter = open_stream(Endpoint.TGI_GENERATE_STREAM)
    details = {"finish_reason": "length", "generated_tokens": 1, "input_length": 3, field: 10**30}
    token = {"token": {"id": 1, "text": "hi"}, "generated_text": None, "details": None}
    last = {"token": {"id": 2, "text": "!"}, "generated_text": "hi!", "details": details}
    meter.feed(f"data:{json.dumps(token)}\n\ndata:{json.dumps(last)}\n\n".encode())
    _, u = meter.finish()
    assert (u.input_tokens, u.output_tokens, u.unknown_reason) == (None, None, INVALID_USAGE)


@pytest.mark.parametrize(
    ("answer", "count"),
    [({"count": 10**30}, None), ({"count": -3}, None), ({"count": True}, None), ({"count": 7}, 7)],
)
def test_a_tokenize_answer_is_a_count_like_any_other(answer: Any, count: int | None) -> None:
    assert _count(answer) == count


# --- prices and amounts ---------------------------------------------------------------------------


def test_more_cached_than_input_never_makes_the_input_cost_negative() -> None:
    price = ModelPrice(input_per_1m=10.0, output_per_1m=20.0, cached_input_per_1m=1.0)
    cost = compute(price, 100, 500, 0)
    assert cost.input_usd == pytest.approx(100 * 1.0 / 1e6)  # all of the input, at the cached price
    assert compute(price, 100, -50, 0).input_usd == pytest.approx(100 * 10.0 / 1e6)
    assert compute(price, -5, None, -5).total_usd == 0.0


def test_to_micros_rounds_up_and_stays_in_range() -> None:
    assert to_micros(0.0000001) == 1  # a tenth of a micro-dollar is a micro-dollar, not 0
    assert to_micros(0.1234561) == 123_457
    assert to_micros(0.1) == 100_000  # float noise is not rounded up
    assert to_micros(0.0) == 0
    assert to_micros(-5.0) == 0  # never a credit
    assert to_micros(1e30) == MAX_MICROS
    assert to_micros(math.inf) == MAX_MICROS
    assert to_micros(math.nan) == MAX_MICROS


@pytest.mark.parametrize("value", [".inf", ".nan", "-.inf"])
def test_a_price_must_be_a_finite_number(value: str) -> None:
    import yaml

    data = {"models": {"m": {"input_per_1m": yaml.safe_load(value), "output_per_1m": 1.0}}}
    with pytest.raises(ConfigError, match="input_per_1m"):
        build(PricingConfig, data, prefix="pricing")


async def test_the_local_store_never_credits_a_budget_or_holds_less_than_nothing() -> None:
    m = Metrics()
    store = LocalStore(max_scopes=10, metrics=m)
    assert (await store.reserve(Hold("a", 0, to_micros(0.5), (USER,)))).admitted
    store.settle("a", -400_000)  # a negative charge is none
    assert store.spent == {"user:u": 0} and store.held == {"user:u": 0}
    assert (await store.reserve(Hold("b", 0, -900_000, (USER,)))).admitted  # held as 0
    assert store.held == {"user:u": 0}
    assert not (await store.reserve(Hold("c", 0, to_micros(1.000001), (USER,)))).admitted
    store.settle("b", 10**30)  # saturates
    assert store.spent == {"user:u": MAX_MICROS} and store.held == {"user:u": 0}
    errors = m.registry.get_sample_value(
        "tollbooth_metering_errors_total", {"stage": "budget_amount"}
    )
    assert errors == 3


# --- the Redis scripts: all or nothing ------------------------------------------------------------

TODAY = int(time.time() // 86400 * 86400)


def redis_state(server: Any, day: int = TODAY) -> dict[str, Any]:
    c = server.client()
    spent, held, holds, leases, seeded = day_keys(day)
    return {
        "spent": c.hgetall(spent),
        "held": c.hgetall(held),
        "holds": c.hgetall(holds),
        "leases": c.zrange(leases, 0, -1, withscores=True),
        "seeded": c.get(seeded),
    }


def make_store(server: Any) -> RedisStore:
    cfg = BudgetConfig(store=server.url, lease_s=60.0, store_timeout_s=0.5)
    return RedisStore(cfg, Metrics(), lambda: TODAY, None, max_scopes=10)


def script_errors(store: RedisStore) -> float:
    labels = {"stage": "budget_store"}
    return store.metrics.registry.get_sample_value("tollbooth_metering_errors_total", labels) or 0


@pytest.mark.parametrize("charge", [10**30, -173_400, "1.5", "1e6", "", "nan", 2**53])
async def test_a_settlement_out_of_range_changes_nothing_in_redis(
    redis_server: Any, charge: Any
) -> None:
    store = make_store(redis_server)
    try:
        assert (await store.reserve(Hold("a", TODAY, 400_000, (USER,)))).admitted
        before = redis_state(redis_server)
        hold = store.open.pop("a")
        for _ in range(3):  # retried: still nothing, never a half-applied settlement
            assert await store._settle_batch([(hold, charge, 1)]) == [b"invalid"]
        assert redis_state(redis_server) == before
        await store._after_settle([(hold, charge, 1)], [b"invalid"])
        assert script_errors(store) == 1
    finally:
        await store.close()


@pytest.mark.parametrize(
    "args",
    [
        ["r", 10**30, 60_000, TODAY + 1, 10, b"", "user:u", 1_000_000],
        ["r", -5, 60_000, TODAY + 1, 10, b"", "user:u", 1_000_000],
        ["r", 5, 60_000, TODAY + 1, 10, b"", "user:u", -1],
        ["r", 5, 60_000, TODAY + 1, 10, b"", "user:u", "1e9"],
        ["r", 5, 60_000, TODAY + 1, 10, b"", "user:u"],  # a scope without its limit
        ["r", 5, "x", TODAY + 1, 10, b"", "user:u", 1_000_000],
    ],
)
async def test_a_reservation_out_of_range_changes_nothing_and_is_refused(
    redis_server: Any, args: list[Any]
) -> None:
    store = make_store(redis_server)
    try:
        assert (await store.reserve(Hold("a", TODAY, 400_000, (USER,)))).admitted
        args[5] = store.seeds[TODAY]
        before = redis_state(redis_server)
        reply = await store.scripts["reserve"](keys=script_keys(TODAY), args=args)
        assert reply == [b"invalid"]
        assert redis_state(redis_server) == before
        verdict = store._verdict(Hold("r", TODAY, 5, (USER,)), reply)
        assert not verdict.admitted and verdict.reason == "unavailable"
    finally:
        await store.close()


async def test_renew_and_seed_out_of_range_change_nothing(redis_server: Any) -> None:
    store = make_store(redis_server)
    try:
        assert (await store.reserve(Hold("a", TODAY, 400_000, (USER,)))).admitted
        before = redis_state(redis_server)
        renew = [60_000, TODAY + 1, "b", 7, 1, "user:u", "c", 10**30, 1, "user:u"]
        assert await store.scripts["renew"](keys=script_keys(TODAY), args=renew) == -1
        assert redis_state(redis_server) == before  # not even the valid first record
        seed = [1, TODAY + 86400 * 3, "user:u", 5, "team:t", -5]
        assert await store.scripts["seed"](keys=script_keys(TODAY + 86400), args=seed) == -1
        assert redis_state(redis_server, TODAY + 86400)["seeded"] is None
    finally:
        await store.close()


async def test_a_hold_already_negative_in_redis_is_never_read_as_budget(redis_server: Any) -> None:
    """What the 10**30 settlement left behind (held -173,400) is read as nothing held, and the
    settlement that would take it lower clamps it at 0 and is counted."""
    store = make_store(redis_server)
    store.start()
    try:
        assert (await store.reserve(Hold("a", TODAY, 400_000, (USER,)))).admitted
        redis_server.client().hset(day_keys(TODAY)[1], "user:u", -173_400)
        # read as -173,400 held, $1.00 - $0 - (-$0.1734) would admit $1.10
        refused = await store.reserve(Hold("b", TODAY, 1_100_000, (USER,)))
        assert not refused.admitted and refused.reason == "budget"
        store.settle("a", 100_000)
        for _ in range(200):
            if script_errors(store):
                break
            await asyncio.sleep(0.01)
        state = redis_state(redis_server)
        assert state["held"] == {b"user:u": b"0"} and state["spent"] == {b"user:u": b"100000"}
        assert script_errors(store) == 1
    finally:
        await store.close()


# --- a hostile upstream in front of a real sidecar ------------------------------------------------


class Hostile:
    """An engine answering every chat request with the usage numbers it is given, verbatim."""

    def __init__(self) -> None:
        self.prompt, self.completion = "5", "5"
        self.app = web.Application()
        self.app.router.add_post("/v1/chat/completions", self.chat)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = await request.json()
        if not req.get("stream"):
            return web.Response(
                body=body(self.prompt, self.completion), content_type="application/json"
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(stream(self.prompt, self.completion))
        await resp.write_eof()
        return resp


def ledger_rows(db: Path) -> list[tuple[Any, ...]]:
    with sqlite3.connect(db) as conn:
        return conn.execute(
            "SELECT input_tokens, output_tokens, cost_usd FROM requests ORDER BY ts"
        ).fetchall()


async def wait_for(check: Any, what: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except sqlite3.OperationalError:  # the file or its schema is not there yet
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("shared", [False, True], ids=["local", "redis"])
async def test_an_upstream_reporting_10_to_the_30_tokens_is_charged_its_hold(
    start_sidecar: StartSidecar,
    aiohttp_server: Any,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    streaming: bool,
    shared: bool,
) -> None:
    hostile = Hostile()
    up = await aiohttp_server(hostile.app)
    db = tmp_path / "ledger.db"
    budgets: dict[str, Any] = {"user_daily_usd": 1.0}
    if shared:
        budgets["store"] = request.getfixturevalue("redis_server").url
    run = await start_sidecar(
        {
            "pricing": PRICES,
            "budgets": budgets,
            "ledger": {"path": str(db), "flush_interval_s": 0.05},
        },
        upstream_url=str(up.make_url("")).rstrip("/"),
    )
    budgets_ = run.sc.budgets
    holds: list[Hold] = []
    reserve = budgets_.store.reserve

    async def observed(hold: Hold) -> Any:
        holds.append(hold)
        return await reserve(hold)

    budgets_.store.reserve = observed  # type: ignore[method-assign]
    msg = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    headers = {"X-Tollbooth-User": "eve"}
    async with aiohttp.ClientSession() as s:
        for prompt in ("1" + "0" * 30, "5"):  # the hostile answer, then an ordinary one
            hostile.prompt = prompt
            req = {**msg, "stream": streaming}
            if streaming:  # asked for by the client: its usage chunk reaches it
                req["stream_options"] = {"include_usage": True}
            async with s.post(run.url + "/v1/chat/completions", json=req, headers=headers) as r:
                assert r.status == 200
                assert prompt.encode() in await r.read()  # the client gets what was sent

    # the ledger thread lives on: both rows, the first with its usage unknown
    await wait_for(lambda: len(ledger_rows(db)) == 2, "both ledger rows")
    (bad, good) = ledger_rows(db)
    assert bad == (None, None, None)
    assert good == (5, 5, pytest.approx(0.01))
    assert (
        run.value(
            "llm_usage_unknown_total",
            model=MODEL,
            api_endpoint="/v1/chat/completions",
            reason=INVALID_USAGE,
        )
        == 1
    )
    charged = holds[0].amount + to_micros(0.01)  # the hold in full, and the measured cost
    if shared:
        server = request.getfixturevalue("redis_server")
        spent_key, held_key = day_keys(holds[0].day)[:2]

        def balance() -> tuple[int, int]:
            c = server.client()
            return int(c.hget(spent_key, "user:eve") or 0), int(c.hget(held_key, "user:eve") or 0)

        await wait_for(lambda: balance()[1] == 0 and not budgets_.store.queue, "settled")
        assert balance() == (charged, 0)
    else:
        store = budgets_.store
        assert isinstance(store, LocalStore)
        assert (store.spent["user:eve"], store.held) == (charged, {"user:eve": 0})


# --- properties: any JSON value in any usage field ------------------------------------------------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**40), 10**40)
    | st.integers(0, 2 * MAX_TOKEN_COUNT)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
ENDPOINTS = st.sampled_from(
    [Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.EMBEDDINGS, Endpoint.RESPONSES]
)


def hostile_usage(endpoint: Endpoint, inp: Any, out: Any, cached: Any) -> dict[str, Any]:
    if endpoint is Endpoint.RESPONSES:
        return {"input_tokens": inp, "output_tokens": out, "input_tokens_details": cached}
    return {"prompt_tokens": inp, "completion_tokens": out, "prompt_tokens_details": cached}


def assert_sane(u: Usage) -> None:
    for n in (u.input_tokens, u.output_tokens, u.cached_input_tokens):
        assert n is None or (type(n) is int and 0 <= n <= MAX_TOKEN_COUNT)
    if u.cached_input_tokens is not None and u.input_tokens is not None:
        assert u.cached_input_tokens <= u.input_tokens
    if u.input_tokens is None or u.output_tokens is None:
        assert u.unknown_reason is not None


HOSTILE_PRICE = PriceBook(
    PricingConfig(default=ModelPrice(input_per_1m=1e6, output_per_1m=1e6, cached_input_per_1m=0.0))
)


def assert_priced_sane(u: Usage) -> None:
    cost, _ = HOSTILE_PRICE.cost(None, u)
    if cost is not None:
        assert math.isfinite(cost.total_usd) and cost.input_usd >= 0 and cost.output_usd >= 0
        assert 0 <= to_micros(cost.total_usd) <= MAX_MICROS


@settings(max_examples=300, deadline=None)
@given(ENDPOINTS, JSON, JSON, st.one_of(JSON, st.builds(lambda c: {"cached_tokens": c}, JSON)))
def test_any_json_value_in_a_usage_field_is_a_count_or_unknown(
    endpoint: Endpoint, inp: Any, out: Any, cached: Any
) -> None:
    usage = hostile_usage(endpoint, inp, out, cached)
    raw = json.dumps({"id": "x", "model": MODEL, "choices": [], "usage": usage}).encode()
    u = usage_from_body(endpoint, raw, {})
    assert_sane(u)
    assert_priced_sane(u)
    if endpoint is not Endpoint.EMBEDDINGS:
        meter = open_stream(endpoint)
        if endpoint is Endpoint.RESPONSES:
            done = {
                "type": "response.completed",
                "response": {"status": "completed", **{"usage": usage}},
            }
            meter.feed(f"data: {json.dumps(done)}\n\n".encode())
        else:
            meter.feed(f"data: {raw.decode()}\n\ndata: [DONE]\n\n".encode())
        _, su = meter.finish()
        assert_sane(su)
        assert_priced_sane(su)
        assert_sane(meter.usage_so_far())


@settings(max_examples=150, deadline=None)
@given(JSON, JSON, JSON)
def test_any_json_value_in_tgi_counts_is_a_count_or_unknown(
    gen: Any, inp: Any, header: Any
) -> None:
    details = {"finish_reason": "length", "generated_tokens": gen, "input_length": inp}
    token = {"token": {"id": 1, "text": "hi"}, "generated_text": None, "details": None}
    last = {"token": {"id": 2, "text": "!"}, "generated_text": "hi!", "details": details}
    meter = open_stream(Endpoint.TGI_GENERATE_STREAM)
    meter.feed(f"data:{json.dumps(token)}\n\ndata:{json.dumps(last)}\n\n".encode())
    _, u = meter.finish()
    assert_sane(u)
    raw = json.dumps({"generated_text": "hi", "details": details}).encode()
    hdr = {"x-prompt-tokens": json.dumps(header).strip('"'), "x-generated-tokens": "3"}
    assert_sane(usage_from_body(Endpoint.TGI_GENERATE, raw, hdr))


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.lists(st.tuples(JSON, JSON, JSON), min_size=1, max_size=4), st.booleans())
@example([(10**30, 5, 0), (95, None, None), (None, None, None), (None, None, [])], False)
def test_any_usage_through_the_budget_path_never_holds_or_spends_below_zero(
    redis_server: Any, answers: list[tuple[Any, Any, Any]], streaming: bool
) -> None:
    """Hostile usage, read as the proxy reads it, priced, charged and settled into the real Redis
    store: no exception, and every hold and spend in Redis within [0, MAX_MICROS]; every hold
    released once settled."""

    async def scenario() -> None:
        redis_server.client().flushall()
        clock = Clock(time.time())
        cfg = BudgetConfig(store=redis_server.url, user_daily_usd=100.0, store_timeout_s=1.0)
        holder: list[Budgets] = []
        store = RedisStore(
            cfg, Metrics(), lambda: holder[0].day_start(clock()), None, max_scopes=10, clock=clock
        )
        b = Budgets(
            cfg, AdmissionConfig(), store.metrics, LabelCap(10), HOSTILE_PRICE, store, clock
        )
        holder.append(b)
        store.start()
        try:
            for inp, out, cached in answers:
                ex = Exchange(
                    "r",
                    Endpoint.CHAT,
                    RequestInfo(Endpoint.CHAT, b"{}", True, max_tokens=3),
                    "eve",
                    "eve",
                    MODEL,
                )
                try:
                    await b.gate(ex)
                except Refusal as refused:  # the earlier answers spent the budget: fine
                    assert refused.status == 429
                    continue
                usage = hostile_usage(Endpoint.CHAT, inp, out, {"cached_tokens": cached})
                if streaming:
                    meter = open_stream(Endpoint.CHAT)
                    meter.feed(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
                    ex.usage = meter.finish()[1]
                else:
                    ex.usage = usage_from_body(
                        Endpoint.CHAT, json.dumps({"usage": usage}).encode(), {}
                    )
                ex.status, ex.upstream_start = 200, 0.0
                price_cost(HOSTILE_PRICE, ex)
                b.settle(ex)
            spent_key, held_key = day_keys(b.day_start(clock()))[:2]
            c = redis_server.client()
            for _ in range(500):  # bounded: until every settlement was answered
                if not store.queue and all(int(v) == 0 for v in c.hvals(held_key)):
                    break
                await asyncio.sleep(0.01)
            for key in (spent_key, held_key):
                assert all(0 <= int(v) <= MAX_MICROS for v in c.hvals(key))
            assert [int(v) for v in c.hvals(held_key)] == [0]
        finally:
            await store.close()

    asyncio.run(scenario())
