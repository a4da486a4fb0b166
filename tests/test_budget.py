"""Budgets hold under concurrency: the worst case is reserved first and settled to the measured.

The store's rules in isolation, then bursts of real openai SDK streams against a small budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from sidecar.billing.budget import DAY, Budgets, Hold, LocalStore, Scope, money, to_micros, usd
from sidecar.exchange import Exchange
from sidecar.telemetry.metrics import LabelCap, Metrics
from tests import simulated as sim
from tests.conftest import Running, StartSidecar
from tests.fakes import MODEL
from tests.waiting import wait_for

# 5 tokens upstream; 7 estimated: the body's text ("user" and the content) over 4 chars per token
MSGS = [{"role": "user", "content": "one two three four five"}]
# $0.001 per token in both directions
PRICES = {"models": {MODEL: {"input_per_1m": 1000.0, "output_per_1m": 1000.0}}}
USER = Scope("user", "u", to_micros(1.0))
GLOBAL = Scope("global", "*", to_micros(1.5))


def hold(rid: str, usd: float, *scopes: Scope, day: int = 0) -> Hold:
    return Hold(rid, day, to_micros(usd), scopes or (USER,))


async def test_reserve_is_atomic_over_scopes_and_idempotent() -> None:
    store = LocalStore(max_scopes=10)
    assert (await store.reserve(hold("a", 0.6, USER, GLOBAL))).admitted
    assert (await store.reserve(hold("a", 0.6, USER, GLOBAL))).admitted  # again: no second hold
    assert store.held == {"user:u": 600_000, "global:*": 600_000}
    refused = await store.reserve(hold("b", 0.6, USER, GLOBAL))
    assert not refused.admitted and refused.scope == USER and refused.reason == "budget"
    assert store.held == {"user:u": 600_000, "global:*": 600_000}  # nothing held on refusal
    store.settle("a", to_micros(0.25))
    store.settle("a", to_micros(0.25))  # again: nothing twice
    assert store.spent == {"user:u": 250_000, "global:*": 250_000}
    assert store.held == {"user:u": 0, "global:*": 0}
    assert (await store.reserve(hold("c", 0.75, USER))).admitted  # 0.25 + 0.75 = the limit
    assert not (await store.reserve(hold("d", 0.000001, USER))).admitted


async def test_a_new_budget_day_starts_from_zero_and_old_holds_settle_nowhere() -> None:
    store = LocalStore(max_scopes=10)
    await store.reserve(hold("a", 0.9, day=0))
    assert (await store.reserve(hold("b", 0.9, day=86400))).admitted
    store.settle("a", to_micros(0.9))  # yesterday's request ends today: not today's spend
    assert store.spent == {"user:u": 0}


async def test_seeding_sets_only_absent_scopes() -> None:
    store = LocalStore(max_scopes=10)
    await store.seed(0, {"user:u": 400_000})
    await store.seed(0, {"user:u": 400_000})  # a second seed does not add it twice
    assert store.spent == {"user:u": 400_000}
    assert not (await store.reserve(hold("a", 0.7))).admitted


async def test_the_number_of_tracked_users_is_bounded() -> None:
    store = LocalStore(max_scopes=2)
    assert (await store.reserve(hold("a", 0.1, Scope("user", "x", 10**6)))).admitted
    assert (await store.reserve(hold("b", 0.1, Scope("user", "y", 10**6)))).admitted
    verdict = await store.reserve(hold("c", 0.1, Scope("user", "z", 10**6)))
    assert not verdict.admitted and verdict.reason == "capacity"
    assert (await store.reserve(hold("d", 0.1, Scope("user", "x", 10**6)))).admitted


def test_small_budgets_are_printed_exactly() -> None:
    assert money(0.001) == "$0.001"
    assert money(0.1) == "$0.10"
    assert money(40) == "$40.00"


async def burst(
    run: Running, oai: Any, n: int, headers: dict[str, str] | None = None, **kwargs: Any
) -> list[int]:
    """n concurrent streams from one user; returns the status of each."""
    client = oai(run)
    headers = {"X-Tollbooth-User": "eve", "X-Fake": "slow-stream", **(headers or {})}

    async def one() -> int:
        try:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=MSGS,
                stream=True,
                extra_headers=headers,
                **kwargs,
            )
            async for _ in stream:
                pass
        except openai.RateLimitError:
            return 429
        return 200

    return await asyncio.gather(*(one() for _ in range(n)))


def spent(run: Running) -> float:
    return run.value("llm_spend_today_usd", user_id="eve") or 0.0


async def test_a_concurrent_burst_cannot_overspend(start_sidecar: StartSidecar, oai: Any) -> None:
    run = await start_sidecar({"pricing": PRICES, "budgets": {"user_daily_usd": 0.2}})
    # each stream holds (7 + 10) x $0.001 = $0.017 and spends (5 + 10) x $0.001 = $0.015
    statuses = await burst(run, oai, 20, max_tokens=10)
    # all at once: 11 x $0.017 = $0.187 and a 12th would hold $0.204; more fit only if the first
    # streams ended (spending $0.015 each) before the last were reserved.
    admitted = statuses.count(200)
    assert 11 <= admitted <= 13
    assert spent(run) == pytest.approx(admitted * 0.015)
    assert spent(run) <= 0.2
    assert run.sc.budgets.store.held == {"user:eve": 0}  # every hold settled


async def test_a_repeated_request_id_does_not_share_a_hold(
    start_sidecar: StartSidecar, oai: Any
) -> None:
    # The client names X-Request-Id; holds are keyed by an id the sidecar makes, so twenty
    # concurrent requests that all say "same" reserve twenty holds, not one.
    run = await start_sidecar({"pricing": PRICES, "budgets": {"user_daily_usd": 0.2}})
    statuses = await burst(run, oai, 20, {"X-Request-Id": "same"}, max_tokens=10)
    assert 11 <= statuses.count(200) <= 13
    assert spent(run) <= 0.2


async def test_without_an_output_limit_overshoot_stays_within_the_documented_bound(
    start_sidecar: StartSidecar, oai: Any
) -> None:
    # The fake server generates 6 tokens when no max_tokens is given; 4 are reserved. Each admitted
    # request can overshoot its hold by (6 - 4) output tokens minus the prompt estimate's surplus.
    run = await start_sidecar(
        {
            "pricing": PRICES,
            "budgets": {"user_daily_usd": 0.1, "default_max_output_tokens": 4},
        }
    )
    statuses = await burst(run, oai, 20)
    admitted = statuses.count(200)
    hold_usd, actual_usd = (7 + 4) * 0.001, (5 + 6) * 0.001
    assert 9 <= admitted <= 10  # 9 x $0.011 = $0.099, when all are in flight at once
    bound = admitted * max(0.0, actual_usd - hold_usd)
    assert spent(run) == pytest.approx(admitted * actual_usd)
    assert spent(run) <= 0.1 + bound + 1e-9


async def test_a_stream_without_usage_is_charged_its_hold(
    start_sidecar: StartSidecar, oai: Any
) -> None:
    run = await start_sidecar(
        {
            "pricing": PRICES,
            "budgets": {"user_daily_usd": 0.05},
            "metering": {"inject_stream_usage": False},
        }
    )
    client = oai(run)
    for _ in range(2):  # each holds $0.017; nothing is measured, so each is charged $0.017
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=MSGS,
            stream=True,
            max_tokens=10,
            extra_headers={"X-Tollbooth-User": "eve"},
        )
        async for _ in stream:
            pass
    with pytest.raises(openai.RateLimitError):
        await client.chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=10, extra_headers={"X-Tollbooth-User": "eve"}
        )
    assert run.value("llm_budget_unmeasured_charges_total") == 2
    assert spent(run) == 0.0  # a hold is never exported as spend


async def test_spend_is_kept_only_for_scopes_with_a_limit(
    start_sidecar: StartSidecar, oai: Any
) -> None:
    run = await start_sidecar({"pricing": PRICES, "budgets": {"global_daily_usd": 100.0}})
    client = oai(run)
    for i in range(50):
        await client.chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=1, extra_headers={"X-Tollbooth-User": f"u{i}"}
        )
    assert set(run.sc.budgets.store.spent) == {"global:*"}


async def test_a_tiny_budget_is_named_exactly_in_the_refusal(
    start_sidecar: StartSidecar, oai: Any
) -> None:
    run = await start_sidecar({"pricing": PRICES, "budgets": {"user_daily_usd": 0.001}})
    with pytest.raises(openai.RateLimitError) as err:
        await oai(run).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5)
    assert "daily budget of $0.001 " in err.value.body["message"]


def worst_case(
    body: dict[str, Any], endpoint: str = "/v1/chat/completions", **budgets: Any
) -> float:
    """The hold, in dollars at $1 per token, for a request body."""
    b, ex = _budgets_and_exchange(body, endpoint, **budgets)
    return b.worst_case_usd(ex)


def _budgets_and_exchange(
    body: dict[str, Any], endpoint: str, **budgets: Any
) -> tuple[Budgets, Exchange]:
    """Budgets at $1 per token (one character a token) and an exchange of `body`."""
    from sidecar.config import AdmissionConfig, BudgetConfig, ModelPrice, PricingConfig
    from sidecar.exchange import Endpoint
    from sidecar.metering.pricing import PriceBook
    from sidecar.metering.wire import inspect_request

    info = inspect_request(Endpoint(endpoint), json.dumps(body).encode(), inject_usage=False)
    price = ModelPrice(input_per_1m=1e6, output_per_1m=1e6)
    b = Budgets(
        BudgetConfig(user_daily_usd=1.0, **budgets),
        AdmissionConfig(chars_per_token=1.0),
        Metrics(),
        LabelCap(10),
        PriceBook(PricingConfig(default=price)),
    )
    ex = Exchange(
        request_id="r", endpoint=info.endpoint, info=info, user="u", user_id="u", model="m"
    )
    return b, ex


@pytest.mark.parametrize(
    ("limits", "output"),
    [
        ({"max_completion_tokens": 0, "max_tokens": 30000}, 30000),  # vLLM: `mct or mt`
        ({"max_tokens": 30000.0}, 30000),
        ({"max_tokens": " 30000"}, 30000),
        ({"max_tokens": "+30_000"}, 30000),
        ({"max_tokens": "30000.0"}, 30000),
        ({"max_tokens": 10, "n": 8.0}, 80),
        ({"max_tokens": 10, "n": "+8"}, 80),
        ({"max_tokens": 10**400}, 2**31),
        ({}, 4096),
    ],
)
def test_the_hold_reads_limits_as_the_server_does(limits: dict[str, Any], output: int) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "ab"}], **limits}
    text = len("user" + "ab") + sum(len(v) for v in limits.values() if isinstance(v, str))
    assert worst_case(body) == pytest.approx(text + output)


def test_the_hold_covers_every_prompt_and_all_the_text() -> None:
    batch = {"model": "m", "prompt": ["hi"] * 50, "max_tokens": 1000}
    assert worst_case(batch, "/v1/completions") == 50 * 2 + 50 * 1000
    ids = {"model": "m", "prompt": [[1, 2, 3]] * 4, "max_tokens": 1}
    assert worst_case(ids, "/v1/completions") == 12 + 4
    tools = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "f", "description": "d" * 4000}}],
        "max_tokens": 1,
    }
    assert worst_case(tools) >= 4000
    image = {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64," + "A" * 9000},
                    }
                ],
            }
        ],
        "max_tokens": 1,
    }
    assert worst_case(image) < 100  # base64 media is not text


async def test_a_limit_the_hold_cannot_read_is_refused(
    start_sidecar: StartSidecar, oai: Any
) -> None:
    # $100: the deep body below names no model the hold can read, so it holds at the book's
    # dearest price, 200,000 characters / 4 + 4,096 output tokens at $0.001: $54.10
    run = await start_sidecar({"pricing": PRICES, "budgets": {"user_daily_usd": 100.0}})
    async with aiohttp.ClientSession() as s:
        for bad in ({"max_tokens": "lots"}, {"n": [2]}, {"max_tokens": "²"}):
            body = {"model": MODEL, "messages": MSGS, **bad}
            async with s.post(run.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 400, bad
                assert "must be a non-negative integer" in (await r.json())["error"]["message"]
        deep = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        async with s.post(run.url + "/v1/chat/completions", data=deep) as r:
            await r.read()  # what the server answers; the sidecar forwarded it, unharmed
    assert run.upstream is not None and run.upstream.seen[-1]["body"] == deep
    assert run.value("tollbooth_metering_errors_total", stage="gate") is None


async def test_a_spent_budget_admits_no_free_route(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar(
        {
            "pricing": PRICES,
            "budgets": {"user_daily_usd": 0.05},
            "metering": {"unknown_routes": "forward"},
        }
    )
    budgets = run.sc.budgets
    await budgets.store.seed(budgets.day_start(budgets.clock()), {"user:eve": to_micros(0.05)})
    # no model, so no price: its hold is $0, and still nothing is left to admit it
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            run.url + "/v1/rerank", json={"query": "q"}, headers={"X-Tollbooth-User": "eve"}
        ) as r,
    ):
        assert r.status == 429
    assert run.upstream is not None and run.upstream.seen == []


async def test_output_hidden_from_the_meter_is_charged_the_hold(
    start_sidecar: StartSidecar,
) -> None:
    # TGI's /vertex answers with no counts: the prompt is counted, the output cannot be. Charging
    # the measured input alone made long outputs on short prompts nearly free.
    run = await start_sidecar(
        {
            "upstream": {"api": "tgi"},
            "pricing": {"default": {"input_per_1m": 1000.0, "output_per_1m": 1000.0}},
            "budgets": {"user_daily_usd": 0.05},
        }
    )
    body = {"instances": [{"inputs": "one two three", "parameters": {"max_new_tokens": 20}}]}
    statuses = []
    async with aiohttp.ClientSession() as s:
        for _ in range(6):  # each holds (ceil(13 / 4) + 20) x $0.001 = $0.024
            async with s.post(run.url + "/vertex", json=body) as r:
                statuses.append(r.status)
            for _ in range(100):  # the prompt is counted after the answer went out
                if not run.sc.budgets.store.holds:
                    break
                await asyncio.sleep(0.02)
    assert statuses == [200, 200, 429, 429, 429, 429]
    assert run.sc.budgets.store.spent["user:anonymous"] == 2 * 24_000
    assert run.value("llm_budget_unmeasured_charges_total") == 2
    # what is exported stays what was measured: the input only
    assert run.value("llm_spend_today_usd", user_id="anonymous") == pytest.approx(2 * 0.003)


async def test_an_invocations_body_with_two_shapes_is_refused(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar({"upstream": {"api": "tgi"}})
    body = {
        "inputs": "x",
        "parameters": {"max_new_tokens": 1, "seed": -1},
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 50,
    }
    async with aiohttp.ClientSession() as s, s.post(run.url + "/invocations", json=body) as r:
        assert r.status == 400
        assert (await r.json())["error"]["type"] == "ambiguous_request"
    assert run.upstream is not None and run.upstream.seen == []


def test_a_body_behind_a_bom_is_read_for_the_hold_and_never_edited() -> None:
    from sidecar.exchange import Endpoint
    from sidecar.metering.wire import inspect_request

    body = b'\xef\xbb\xbf{"model":"m","messages":[],"stream":true,"max_tokens":30000}'
    info = inspect_request(Endpoint.CHAT, body, inject_usage=True)
    assert (info.max_tokens, info.stream, info.body) == (30000, True, body)
    assert not info.injected_usage


def test_running_totals_of_a_batched_completion_give_every_prompts_size() -> None:
    from sidecar.exchange import Endpoint
    from sidecar.metering.wire import open_stream

    meter = open_stream(Endpoint.COMPLETIONS, choices=4, per_prompt=2)  # 2 prompts, n = 2
    for index, prompt in ((0, 3), (1, 3), (2, 5), (3, 5)):
        chunk = {
            "choices": [{"index": index, "text": "t", "finish_reason": None}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": 4, "total_tokens": prompt + 4},
        }
        meter.feed(f"data: {json.dumps(chunk)}\n\n".encode())
    usage = meter.usage_so_far()
    assert (usage.input_tokens, usage.output_tokens) == (3 + 5, 16)


def test_a_tgi_stream_without_token_events_has_no_output_count() -> None:
    from sidecar.exchange import Endpoint
    from sidecar.metering.wire import open_stream

    meter = open_stream(Endpoint.TGI_COMPAT)
    chat = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
    meter.feed(f"data:{json.dumps(chat)}\n\n".encode())
    _, usage = meter.finish()
    assert usage.output_tokens is None and usage.unknown_reason == "no_token_events"


def no_limits(m: Metrics, now: list[float], teams: LabelCap | None = None) -> Budgets:
    """Budgets without a limit (its gauges only), on the clock `now[0]`."""
    from sidecar.config import AdmissionConfig, BudgetConfig, PricingConfig
    from sidecar.metering.pricing import PriceBook

    return Budgets(
        BudgetConfig(),
        AdmissionConfig(),
        m,
        LabelCap(10),
        PriceBook(PricingConfig()),
        clock=lambda: now[0],
        teams=teams,
    )


def test_spend_today_starts_again_at_the_next_budget_day() -> None:
    """The gauge is cleared at the day's start; a user's spend the next day is that day's only,
    and still exported (a cached child of the cleared gauge used to swallow it)."""
    now = [10 * DAY + 100.0]
    m = Metrics()
    b = no_limits(m, now)
    b.restore_gauge({"ann": 0.5})
    now[0] += DAY
    b.restore_gauge({"ann": 0.25, "bob": 0.125})
    spend = {
        u: m.registry.get_sample_value("llm_spend_today_usd", {"user_id": u})
        for u in ("ann", "bob")
    }
    assert spend == {"ann": 0.25, "bob": 0.125}


def test_team_spend_today_is_measured_spend_by_the_keys_team_and_bounded() -> None:
    """llm_team_spend_today_usd: a request's measured cost on its key's team; no team, no
    series; later teams share __other__; restored from the ledger; cleared at the next day."""
    from sidecar.exchange import Cost, Usage
    from sidecar.telemetry.metrics import OTHER
    from tests.test_meter import exchange

    now = [10 * DAY + 100.0]
    m = Metrics()
    b = no_limits(m, now, teams=LabelCap(2))

    def team_spend() -> dict[str, float]:
        fam = next(iter(m.team_spend_today.collect()))
        return {s.labels["team"]: s.value for s in fam.samples}

    def settle(team: str | None, usd: float | None) -> None:
        ex = exchange(Usage(input_tokens=1, output_tokens=1))
        ex.started_at, ex.team = now[0], team
        ex.cost = None if usd is None else Cost(input_usd=usd, output_usd=0.0)
        b.settle(ex)

    b.restore_gauge({"u": 0.5}, {"ml": 0.5})
    settle("ml", 0.25)
    settle("web", 0.125)
    settle(None, 1.0)  # no team on the key: the user's spend only
    settle("ops", 0.0625)  # past the cap of 2 teams
    assert team_spend() == {"ml": 0.75, "web": 0.125, OTHER: 0.0625}
    assert m.registry.get_sample_value("llm_spend_today_usd", {"user_id": "u"}) == 1.9375
    now[0] += DAY
    settle("web", 0.5)
    assert team_spend() == {"web": 0.5}


# --- an unmeasured request: its hold, unless its stream showed its limit ignored ----------------


def unmeasured_charge(body: dict[str, Any], output_events: int) -> float:
    """What a chat request that reached the server, with nothing measured and `output_events`
    events of output streamed, is charged (in dollars at $1 per token)."""
    b, ex = _budgets_and_exchange(body, "/v1/chat/completions")
    ex.upstream_start, ex.status, ex.output_events = 0.0, 499, output_events
    amount = to_micros(b.worst_case_usd(ex))
    return usd(b.charge(ex, Hold("r", 0, amount, (USER,)), 0.0))


@pytest.mark.parametrize(
    ("limits", "events", "output"),
    [
        # the hold reads vLLM's max_completion_tokens (50 a choice); Ollama's chat obeys only
        # max_tokens: more events than the hold allows show it ignored the limit
        ({"max_completion_tokens": 50}, 0, 50),
        ({"max_completion_tokens": 50}, 50, 50),
        ({"max_completion_tokens": 50}, 51, 4096),  # no max_tokens: the default worst case
        ({"max_completion_tokens": 50, "max_tokens": 4000}, 51, 4000),
        # n: 2, one choice a chunk (vLLM's): 100 events fit the two choices' limits
        ({"max_completion_tokens": 50, "n": 2}, 100, 100),
        ({"max_completion_tokens": 50, "n": 2}, 101, 2 * 4096),
        ({"max_tokens": 50}, 50, 50),  # the limit every server obeys: the hold is the worst
        # vLLM's echo of an assistant's last message: one more event a choice, no token
        ({"max_completion_tokens": 50, "echo": True}, 51, 50),
        ({"max_completion_tokens": 50, "echo": True, "n": 2}, 102, 100),
        ({"max_completion_tokens": 50, "echo": True}, 52, 4096),
        # a server past even the larger limit: charged at least a token an event seen
        ({}, 5000, 5000),
        ({"max_completion_tokens": 50, "max_tokens": 60}, 61, 61),
        ({"max_completion_tokens": 50, "n": 2}, 9001, 2 * 4501),
    ],
)
def test_an_unmeasured_request_is_charged_its_hold_unless_its_stream_overran_it(
    limits: dict[str, Any], events: int, output: int
) -> None:
    """An unmeasured request is charged the worst case at the limit every server obeys only on
    the evidence that the server ignored the one the hold read: each event that carried output
    holds a token at least, so more of them than the hold's limit x choices. Before, any
    unmeasured chat request without `max_tokens` (an honest vLLM, TGI or SGLang client sending
    `max_completion_tokens`, the openai SDK's field) was charged 4096 output tokens."""
    body = {"model": "m", "messages": [{"role": "user", "content": "ab"}], **limits}
    prompt = len("user" + "ab")
    assert unmeasured_charge(body, events) == pytest.approx(prompt + output)


SIM_MODEL = "sim-llama-3-8b"
LIMIT = 10  # max_completion_tokens: the limit vLLM, TGI and SGLang obey on chat
STREAMED = 5  # chunks a streaming fake sends before it waits
LEFT_COLUMNS = "user, endpoint, input_tokens, output_tokens, cost_usd, status"
# the sidecar in front of each fake below: the simulator's prices, a budget it stays within
FAKE: dict[str, Any] = {"pricing": sim.prices(SIM_MODEL), "budgets": {"user_daily_usd": 50.0}}


def _chat_chunks(count: int) -> bytes:
    """`count` chat chunks of one token each, no usage on them (as TGI and SGLang send none)."""
    c = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": SIM_MODEL}
    c |= {"choices": [{"index": 0, "delta": {"content": "x "}, "finish_reason": None}]}
    return (b"data: " + json.dumps(c).encode() + b"\n\n") * count


def _generating(entered: asyncio.Event, release: asyncio.Event) -> Any:
    """A chat server that obeys its limit and has not answered yet: non-streaming, it answers
    nothing until `release`; streaming, STREAMED chunks and then it waits."""

    async def handler(request: web.Request) -> web.StreamResponse:
        obj = json.loads(await request.read())
        assert obj.get("max_completion_tokens") == LIMIT
        if not obj.get("stream"):
            entered.set()
            await release.wait()
            return web.json_response({})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_chat_chunks(STREAMED))
        entered.set()
        await release.wait()
        return resp

    return handler


async def _settled(run: Running, db: Path) -> None:
    await wait_for(lambda: len(sim.ledger_rows(db, LEFT_COLUMNS)) == 1, "the ledger row")
    await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")


@pytest.mark.parametrize(
    ("api", "stream"),
    [("vllm", False), ("tgi", False), ("tgi", True), ("sglang", True)],
)
async def test_an_honest_max_completion_tokens_client_leaving_is_charged_its_limit_not_4096(
    start_sidecar: StartSidecar,
    aiohttp_server: Any,
    tmp_path: Path,
    api: str,
    stream: bool,
) -> None:
    """vLLM, TGI and SGLang all obey `max_completion_tokens` (the openai SDK's field). A client
    asking for 10 tokens that leaves before the usage (non-streaming: always unmeasured; TGI's
    and SGLang's streams carry no running totals) is charged its hold (prompt + 10 tokens,
    < $0.03). Before (d335792's rule), prompt + the default 4096 tokens ($8.19+)."""
    entered, release = asyncio.Event(), asyncio.Event()
    route = ("/v1/chat/completions", _generating(entered, release))
    up = {"upstream": {"api": api, "model_name": SIM_MODEL}}  # SGLang's needs it named
    run, db = await sim.start_fake(start_sidecar, aiohttp_server, tmp_path, route, **FAKE, **up)
    body = {"model": SIM_MODEL, "messages": MSGS, "max_completion_tokens": LIMIT}
    body["stream"] = stream
    try:
        async with aiohttp.ClientSession() as s:
            headers = {"X-Tollbooth-User": "hon"}
            call = asyncio.ensure_future(
                s.post(run.url + "/v1/chat/completions", json=body, headers=headers)
            )
            await asyncio.wait_for(entered.wait(), 10)
            if stream:
                r = await asyncio.wait_for(call, 10)
                got = 0
                while got < STREAMED:  # read what was sent, then leave
                    got += (await r.content.readline()).startswith(b"data:")
                r.close()
            else:
                call.cancel()
        await _settled(run, db)
    finally:
        release.set()
    [(user, _, inp, out, _, status)] = sim.ledger_rows(db, LEFT_COLUMNS)
    assert (user, inp, out, status) == ("hon", None, None, "499")
    charged = run.sc.budgets.store.spent["user:hon"] / 1e6
    # the most this request can have cost at the limit its server obeys: the body's every
    # character a token (far more than its 5 words), LIMIT output tokens
    most = sim.token_cost(len(json.dumps(body)), LIMIT)
    assert charged <= most, (
        f"charged ${charged:.4f} for a {LIMIT}-token limit (at most ${most:.4f})"
    )


async def test_an_upstream_breaking_off_charges_an_honest_tgi_client_its_limit_not_4096(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """The same through no act of the client: TGI (its chat stream, `max_completion_tokens: 10`,
    no usage on its chunks) sends 5 tokens and drops the connection. Charged its hold; before,
    the worst case at the default 4096 tokens."""

    async def breaking(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_chat_chunks(STREAMED))
        assert request.transport is not None
        request.transport.close()
        return resp

    route = ("/v1/chat/completions", breaking)
    run, db = await sim.start_fake(
        start_sidecar, aiohttp_server, tmp_path, route, **FAKE, upstream={"api": "tgi"}
    )
    body = {"model": SIM_MODEL, "messages": MSGS, "max_completion_tokens": LIMIT, "stream": True}
    async with aiohttp.ClientSession() as s:
        headers = {"X-Tollbooth-User": "brk"}
        async with s.post(run.url + "/v1/chat/completions", json=body, headers=headers) as r:
            with contextlib.suppress(aiohttp.ClientError):
                await r.read()
    await _settled(run, db)
    [row] = sim.ledger_rows(db, LEFT_COLUMNS)
    assert row[2:4] == (None, None)  # nothing measured
    charged = run.sc.budgets.store.spent.get("user:brk", 0) / 1e6
    most = sim.token_cost(len(json.dumps(body)), LIMIT)
    assert 0 < charged <= most, f"row {row}: charged ${charged:.4f} (at most ${most:.4f})"


async def test_the_openai_sdk_leaving_vllm_is_charged_its_max_completion_tokens_not_4096(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """Through the openai SDK, whose chat call sends `max_completion_tokens` (max_tokens is
    deprecated there): the call is cancelled while vLLM generates (a client's own timeout), and
    the 10-token request is charged its hold; before, the default worst case."""
    entered, release = asyncio.Event(), asyncio.Event()
    route = ("/v1/chat/completions", _generating(entered, release))
    run, db = await sim.start_fake(start_sidecar, aiohttp_server, tmp_path, route, **FAKE)
    client = openai.AsyncOpenAI(
        base_url=run.url + "/v1",
        api_key="k",
        max_retries=0,
        default_headers={"X-Tollbooth-User": "sdk"},
    )
    try:
        async with client:
            call = asyncio.ensure_future(
                client.chat.completions.create(
                    model=SIM_MODEL, messages=MSGS, max_completion_tokens=LIMIT
                )
            )
            await asyncio.wait_for(entered.wait(), 10)
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call
        await _settled(run, db)
    finally:
        release.set()
    charged = run.sc.budgets.store.spent["user:sdk"] / 1e6
    most = sim.token_cost(len(json.dumps(MSGS)) + len(SIM_MODEL), LIMIT)
    assert 0 < charged <= most, (
        f"charged ${charged:.4f} for a {LIMIT}-token limit (at most ${most:.4f})"
    )
