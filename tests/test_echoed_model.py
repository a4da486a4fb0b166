"""Servers of one model that answer a request's `model` with the request's own string, whatever
it names (h-rev6 finding 9): SGLang's OpenAI and Anthropic routes (`serving_chat.py` builds every
answer with `model=request.model`, no check against the model it serves) and TGI's chat route
(`server.rs` `chat_completions`: the request's `model` unless it is "tgi" or absent; the name is
also its LoRA `adapter_id`, an unknown one the base model, `flash_causal_lm.py`). A client naming
the price book's cheapest model was priced, held and recorded at it for the dearest one. Now such
a request is the model the server serves (`upstream.model_name`, TGI's /info `model_id`); vLLM,
which refuses a model it does not serve (404), is read as before."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from sidecar.config import Config, ConfigError, build, validate
from tests import simulated as sim
from tests.conftest import StartSidecar
from tests.test_native_model import CHEAP, SERVED, TWO_PRICES, tgi_info
from tests.waiting import wait_for

IN, OUT = 9, 500  # the prompt and output tokens each fake answer reports


def _openai_answer(path: str, model: Any) -> dict[str, Any]:
    usage = {"prompt_tokens": IN, "completion_tokens": OUT, "total_tokens": IN + OUT}
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    if path == "/v1/chat/completions":
        choice["message"] = {"role": "assistant", "content": "x"}
    else:
        choice["text"] = "x"
    return {"id": "c1", "object": "x", "created": 1, "model": model, "choices": [choice]} | {
        "usage": usage
    }


def _messages_answer(model: Any) -> dict[str, Any]:
    content = [{"type": "text", "text": "x"}]
    usage = {"input_tokens": IN, "output_tokens": OUT}
    return {"id": "m1", "type": "message", "role": "assistant", "model": model} | {
        "content": content,
        "stop_reason": "max_tokens",
        "usage": usage,
    }


async def echoing(request: web.Request) -> web.Response:
    """An engine answering with the request's `model`, as SGLang and TGI's chat route do."""
    model = json.loads(await request.read()).get("model")
    if request.path == "/v1/messages":
        return web.json_response(_messages_answer(model))
    return web.json_response(_openai_answer(request.path, model))


def _request(path: str) -> dict[str, Any]:
    if path == "/v1/completions":
        return {"model": CHEAP, "prompt": "hello", "max_tokens": OUT}
    return {"model": CHEAP, "messages": [{"role": "user", "content": "hello"}], "max_tokens": OUT}


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _start(
    start_sidecar: StartSidecar,
    aiohttp_server: Any,
    tmp_path: Path,
    engine: dict[str, Any],
    info: Handler | None = None,
    answer: Handler | None = None,
) -> tuple[Any, Path]:
    """A sidecar with a ledger and a $5 daily budget in front of an engine whose OpenAI and
    Messages routes `answer` (`echoing` by default) and whose /info is `info` (`tgi_info`)."""
    app = web.Application()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        app.router.add_post(path, answer or echoing)
    app.router.add_get("/info", info or tgi_info)
    up = await aiohttp_server(app)
    db = tmp_path / "ledger.db"
    config = {"ledger": {"path": str(db), "flush_interval_s": 0.05}, "pricing": TWO_PRICES}
    config |= {"upstream": engine, "budgets": {"user_daily_usd": 5.0}}
    run = await start_sidecar(config, upstream_url=str(up.make_url("")).rstrip("/"))
    return run, db


async def _billed(run: Any, db: Path, path: str, body: dict[str, Any]) -> tuple[str, float]:
    """One request by user `arb`: the ledger's model and what its budget was charged."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + path, json=body, headers={"X-Tollbooth-User": "arb"}) as r,
    ):
        assert r.status == 200, await r.text()
        assert json.loads(await r.read())["model"] == CHEAP  # the client gets what was sent
    await wait_for(lambda: len(sim.ledger_rows(db, "model")) == 1, "the ledger row")
    await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")
    ((model,),) = sim.ledger_rows(db, "model")
    return model, run.sc.budgets.store.spent["user:arb"] / 1e6


ECHOING = [
    pytest.param({"api": "sglang", "model_name": SERVED}, path, id=f"sglang{path}")
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages")
] + [pytest.param({"api": "tgi"}, "/v1/chat/completions", id="tgi-info/v1/chat/completions")]


@pytest.mark.parametrize(("engine", "path"), ECHOING)
async def test_a_model_an_echoing_server_repeats_never_prices_it(
    start_sidecar: StartSidecar,
    aiohttp_server: Any,
    tmp_path: Path,
    engine: dict[str, Any],
    path: str,
) -> None:
    """The client names tiny-1b ($1 / $2 a million); the server serves big-70b ($1000 / $2000)
    and answers 9 + 500 tokens under the name sent. Before: recorded as tiny-1b and charged
    $0.001009; now big-70b, $1.009."""
    run, db = await _start(start_sidecar, aiohttp_server, tmp_path, engine)
    model, spent = await _billed(run, db, path, _request(path))
    assert (model, spent) == (SERVED, pytest.approx(sim.token_cost(IN, OUT)))


@pytest.mark.parametrize(("engine", "path"), ECHOING)
async def test_the_hold_of_a_name_an_echoing_server_repeats_is_the_served_models(
    start_sidecar: StartSidecar,
    aiohttp_server: Any,
    tmp_path: Path,
    engine: dict[str, Any],
    path: str,
) -> None:
    """The hold of 100,000 output tokens is $200 at big-70b's price, over the $5 budget: refused
    before the upstream. Before, held at tiny-1b's $0.2 and admitted."""
    run, _ = await _start(start_sidecar, aiohttp_server, tmp_path, engine)
    body = _request(path) | {"max_tokens": 100_000}
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + path, json=body, headers={"X-Tollbooth-User": "arb"}) as r,
    ):
        assert r.status == 429, await r.text()


async def test_vllm_is_priced_at_the_model_it_answers(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """vLLM serves only the models it names (`_check_model`: 404 for another), so the name it
    answers with is one it served: tiny-1b is priced as tiny-1b, as before."""
    engine = {"api": "vllm", "model_name": SERVED}
    run, db = await _start(start_sidecar, aiohttp_server, tmp_path, engine)
    path = "/v1/chat/completions"
    cheap = IN * 1.0 / 1e6 + OUT * 2.0 / 1e6
    assert await _billed(run, db, path, _request(path)) == (CHEAP, pytest.approx(cheap))


def test_sglang_with_named_prices_needs_its_model_name() -> None:
    """SGLang answers with whatever name a request sends: with prices by name and no
    upstream.model_name, no request could be priced at the model it was served by."""
    data: dict[str, Any] = {"upstream": {"api": "sglang"}, "pricing": TWO_PRICES}
    with pytest.raises(ConfigError, match=r"upstream\.model_name"):
        validate(build(Config, data))
    validate(build(Config, {"upstream": {"api": "sglang"}}))  # no prices: nothing to pick
    data["upstream"]["model_name"] = SERVED
    validate(build(Config, data))


async def test_tgi_whose_info_is_unanswered_charges_the_hold_not_the_name_sent(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """TGI without upstream.model_name and its /info unanswered: the model served is not known,
    and the name the client sent is still not it. The cost stays unknown (no price), the
    request is recorded as the unknown model, and its budget is charged its hold at the book's
    dearest prices (500 output tokens at $2000 a million, $1, and the prompt). Before: priced
    as tiny-1b, $0.001009."""

    async def no_info(request: web.Request) -> web.Response:
        return web.Response(status=503)

    run, db = await _start(start_sidecar, aiohttp_server, tmp_path, {"api": "tgi"}, info=no_info)
    path = "/v1/chat/completions"
    model, spent = await _billed(run, db, path, _request(path))
    ((cost,),) = sim.ledger_rows(db, "cost_usd")
    assert (model, cost) == ("unknown", None)
    assert sim.token_cost(0, OUT) < spent < sim.token_cost(100, OUT)


def test_a_pricing_file_by_model_for_sglang_needs_its_model_name(tmp_path: Path) -> None:
    """The same for a --pricing file: at start, and on SIGHUP (the old prices stay)."""
    from sidecar.core.app import Sidecar

    by_model, default = tmp_path / "by_model.yaml", tmp_path / "default.yaml"
    by_model.write_text(json.dumps(TWO_PRICES))
    default.write_text(json.dumps({"default": TWO_PRICES["models"][CHEAP]}))
    cfg = validate(build(Config, {"upstream": {"api": "sglang"}}))
    with pytest.raises(ConfigError, match=r"upstream\.model_name"):
        Sidecar(cfg, pricing_path=str(by_model))
    sc = Sidecar(cfg, pricing_path=str(default))
    default.write_text(by_model.read_text())
    sc.reload()
    assert (sc.prices.config.models, sc.prices.price(SERVED)) == ({}, sc.prices.price(CHEAP))


async def test_a_tgi_restarted_with_another_model_is_priced_at_the_new_one(
    start_sidecar: StartSidecar,
    aiohttp_server: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """h-rev9 finding 2: TGI without upstream.model_name is priced at its /info model_id, read
    once and kept for the sidecar's life, though /info is read again for max_total_tokens (a
    TGI restarted behind a running sidecar). Restarted serving big-70b where it served tiny-1b,
    every request was still priced as tiny-1b: 9 + 500 tokens charged $0.001009 for $1.009. Now
    the name is read again as the limit is (FRESH_S, 0 here)."""
    monkeypatch.setattr("sidecar.proxy.settings.TgiInfo.FRESH_S", 0.0)
    info = {"model_id": CHEAP, "max_total_tokens": 32768}

    async def restartable_info(request: web.Request) -> web.Response:
        return web.json_response(info)

    run, db = await _start(
        start_sidecar, aiohttp_server, tmp_path, {"api": "tgi"}, info=restartable_info
    )
    path = "/v1/chat/completions"
    cheap = IN * 1.0 / 1e6 + OUT * 2.0 / 1e6
    assert await _billed(run, db, path, _request(path)) == (CHEAP, pytest.approx(cheap))
    info["model_id"] = SERVED  # TGI restarted with --model-id big-70b
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + path, json=_request(path), headers={"X-Tollbooth-User": "arb"}) as r,
    ):
        assert r.status == 200, await r.text()
        await r.read()
    await wait_for(lambda: len(sim.ledger_rows(db, "model")) == 2, "the second ledger row")
    await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")
    assert sim.ledger_rows(db, "model")[1] == (SERVED,)
    spent = run.sc.budgets.store.spent["user:arb"] / 1e6
    assert spent == pytest.approx(cheap + sim.token_cost(IN, OUT))


def test_sglangs_model_name_must_have_a_price() -> None:
    """h-rev9 finding 3: with upstream.api sglang every request is upstream.model_name's. A name
    the book by model does not list (big-70B for big-70b), with no pricing.default, priced
    nothing: every request's cost unknown and its budget charged $0 (held at the dearest, then
    `hold.unpriced`), where before 68c6633 a client naming big-70b paid it. Refused at start,
    as a missing name is; listed, or with a default, it starts."""
    data: dict[str, Any] = {"upstream": {"api": "sglang", "model_name": "big-70B"}}
    data["pricing"] = TWO_PRICES
    with pytest.raises(ConfigError, match=r"upstream\.model_name' has value 'big-70B'"):
        validate(build(Config, data))
    data["pricing"] = TWO_PRICES | {"default": TWO_PRICES["models"][CHEAP]}
    validate(build(Config, data))
    data["pricing"] = TWO_PRICES
    data["upstream"]["model_name"] = SERVED
    validate(build(Config, data))


async def test_sglangs_unpriced_model_name_is_never_free(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """What the refusal above prevents: 9 + 500 tokens of big-70b served under a model_name the
    book lacks were charged $0 against the budget (cost unknown)."""
    with pytest.raises(ConfigError, match=r"upstream\.model_name"):
        await _start(
            start_sidecar,
            aiohttp_server,
            tmp_path,
            {"api": "sglang", "model_name": "big-70B"},
        )


def test_a_pricing_file_without_sglangs_model_is_not_taken_on_sighup(tmp_path: Path) -> None:
    """The same for a --pricing file re-read on SIGHUP: one that no longer lists the served
    model (and has no default) keeps the old prices."""
    from sidecar.core.app import Sidecar

    prices = tmp_path / "prices.yaml"
    prices.write_text(json.dumps(TWO_PRICES))
    cfg = validate(build(Config, {"upstream": {"api": "sglang", "model_name": SERVED}}))
    sc = Sidecar(cfg, pricing_path=str(prices))
    prices.write_text(json.dumps({"models": {CHEAP: TWO_PRICES["models"][CHEAP]}}))
    sc.reload()
    assert sc.prices.price(SERVED) is not None
    with pytest.raises(ConfigError, match=r"upstream\.model_name"):
        Sidecar(cfg, pricing_path=str(prices))


async def test_an_unknown_models_unmeasured_stream_is_charged_what_it_was_seen_to_make(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """h-rev9 finding 5: the unknown model's charge (68c6633: TGI without upstream.model_name,
    /info unanswered) was at least its hold and no more, ahead of the unmeasured rule: a stream
    without its counts was neither counted in llm_budget_unmeasured_charges_total nor charged
    its worst case when it carried more output events than the held limit (a server past
    max_tokens 10, 50 events: the 10-token hold, ~$0.02 at the dearest, where any other model
    is charged 50 tokens, $0.1+). Now the unmeasured rule comes first, as for every model."""

    async def no_info(request: web.Request) -> web.Response:
        return web.Response(status=503)

    async def past_its_limit(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        head = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": CHEAP}
        for _ in range(50):
            choice = {"index": 0, "delta": {"content": " x"}, "finish_reason": None}
            await resp.write(
                b"data: " + json.dumps(head | {"choices": [choice]}).encode() + b"\n\n"
            )
        return resp  # no usage chunk, no [DONE]: the counts never come

    run, db = await _start(
        start_sidecar, aiohttp_server, tmp_path, {"api": "tgi"}, info=no_info, answer=past_its_limit
    )
    body = _request("/v1/chat/completions") | {"max_tokens": 10, "stream": True}
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/v1/chat/completions", json=body, headers={"X-Tollbooth-User": "u"}) as r,
    ):
        assert r.status == 200
        await r.read()
    await wait_for(lambda: len(sim.ledger_rows(db, "model")) == 1, "the ledger row")
    await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")
    spent = run.sc.budgets.store.spent["user:u"] / 1e6
    assert spent >= sim.token_cost(0, 50)
    assert run.value("llm_budget_unmeasured_charges_total") == 1


UNLISTED = "big-70B"  # what TGI's /info names, where the book lists big-70b


async def _tgi_serving(
    start_sidecar: StartSidecar,
    aiohttp_server: Any,
    tmp_path: Path,
    config: dict[str, Any],
) -> tuple[Any, Path, list[str]]:
    """A TGI (api tgi, no upstream.model_name) whose /info names UNLISTED; the paths it was sent."""
    sent: list[str] = []

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"model_id": UNLISTED, "max_total_tokens": 32768})

    async def chat(request: web.Request) -> web.Response:
        sent.append(request.path)
        return await echoing(request)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/info", info)
    up = await aiohttp_server(app)
    db = tmp_path / "ledger.db"
    config |= {"ledger": {"path": str(db), "flush_interval_s": 0.05}, "upstream": {"api": "tgi"}}
    run = await start_sidecar(config, upstream_url=str(up.make_url("")).rstrip("/"))
    return run, db, sent


async def test_a_tgi_model_the_book_cannot_price_is_refused_under_budgets(
    start_sidecar: StartSidecar,
    aiohttp_server: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """h-fix10: TGI without upstream.model_name is priced as its /info model_id. One the book by
    model does not list (big-70B beside big-70b), with no pricing.default, priced nothing: held
    at the dearest, then charged as unpriced, $0 for 9 + 500 tokens, every request free. With
    budgets enforced it is refused with 503 naming the model and the key, before the upstream;
    counted by model, and logged once."""
    config = {"pricing": TWO_PRICES, "budgets": {"user_daily_usd": 5.0}}
    run, _, sent = await _tgi_serving(start_sidecar, aiohttp_server, tmp_path, config)
    path = "/v1/chat/completions"
    for _ in range(2):
        async with (
            aiohttp.ClientSession() as s,
            s.post(run.url + path, json=_request(path), headers={"X-Tollbooth-User": "arb"}) as r,
        ):
            assert r.status == 503, await r.text()
            error = (await r.json())["error"]
        assert error["type"] == "model_not_priced"
        assert f"'{UNLISTED}'" in error["message"] and "pricing.models" in error["message"]
    assert sent == []
    assert run.sc.budgets.store.spent.get("user:arb", 0) == 0
    refused = run.value("llm_budget_unpriced_refusals_total", model=UNLISTED)
    assert refused == 2
    warned = [r for r in caplog.records if UNLISTED in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelname == "WARNING"


async def test_a_tgi_model_the_book_cannot_price_is_unknown_without_budgets(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """Without budgets it is served, its cost unknown (the ledger's cost NULL, counted as
    no_price), never $0."""
    run, db, sent = await _tgi_serving(
        start_sidecar, aiohttp_server, tmp_path, {"pricing": TWO_PRICES}
    )
    path = "/v1/chat/completions"
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + path, json=_request(path), headers={"X-Tollbooth-User": "arb"}) as r,
    ):
        assert r.status == 200, await r.text()
        await r.read()
    await wait_for(lambda: len(sim.ledger_rows(db, "model")) == 1, "the ledger row")
    assert sim.ledger_rows(db, "model, input_tokens, output_tokens, cost_usd") == [
        (UNLISTED, IN, OUT, None)
    ]
    assert run.value("llm_cost_unknown_total", model=UNLISTED, reason="no_price") == 1
    assert sent == [path]


async def test_a_tgi_model_priced_by_the_default_is_served_under_budgets(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """With a pricing.default every name has a price: served and charged at it."""
    pricing = TWO_PRICES | {"default": TWO_PRICES["models"][CHEAP]}
    config = {"pricing": pricing, "budgets": {"user_daily_usd": 5.0}}
    run, db, _ = await _tgi_serving(start_sidecar, aiohttp_server, tmp_path, config)
    path = "/v1/chat/completions"
    cheap = IN * 1.0 / 1e6 + OUT * 2.0 / 1e6
    assert await _billed(run, db, path, _request(path)) == (UNLISTED, pytest.approx(cheap))


def test_sglangs_model_name_is_looked_up_as_the_book_prices_it() -> None:
    """h-rev10 finding 4: the book prices `llama3.2` by its listed `llama3.2:latest` (Ollama's
    tag for a name without one, `PriceBook.listed`), but f35274d's check read the listing
    verbatim: SGLang's model_name llama3.2 beside a shared book listing llama3.2:latest refused
    to start ("not a model of pricing.models") though every request would be priced. Now the
    check reads the name as the book does; a name it cannot price is still refused."""
    price = {"input_per_1m": 1.0, "output_per_1m": 2.0}
    for served, listed in (("llama3.2", "llama3.2:latest"), ("llama3.2:latest", "llama3.2")):
        data: dict[str, Any] = {"upstream": {"api": "sglang", "model_name": served}}
        data["pricing"] = {"models": {listed: price}}
        validate(build(Config, data))
    data["pricing"] = {"models": {"llama3.1": price}}
    with pytest.raises(ConfigError, match=r"upstream\.model_name"):
        validate(build(Config, data))


async def test_an_info_without_its_model_id_is_not_asked_again_on_every_request(
    start_sidecar: StartSidecar,
    aiohttp_server: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """h-rev10 finding 5: once TGI's /info had named its model, an answer without a readable
    model_id (null, a number) beside a good max_total_tokens kept the old name, as meant, but
    was no failure: RETRY_S never rested it, so once the name was FRESH_S old every request on
    every route asked /info again, one at a time under its lock (each waiting up to 2 s for a
    slow one). Now such an answer rests the name's reads for RETRY_S, as an unanswered /info
    does; the old name is kept."""
    monkeypatch.setattr("sidecar.proxy.settings.TgiInfo.FRESH_S", 0.0)
    info: dict[str, Any] = {"model_id": SERVED, "max_total_tokens": 32768}
    asked = []

    async def changing_info(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.json_response(info)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", echoing)
    app.router.add_get("/info", changing_info)
    up = await aiohttp_server(app)
    config = {"pricing": TWO_PRICES, "upstream": {"api": "tgi"}}
    run = await start_sidecar(config, upstream_url=str(up.make_url("")).rstrip("/"))
    path = "/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        for _ in range(4):
            async with s.post(run.url + path, json=_request(path)) as r:
                assert r.status == 200, await r.text()
            info["model_id"] = None  # after the first: TGI answers without its name
    assert len(asked) == 2  # the first read, then one that rests
    assert await run.sc.proxy.tgi_info.model() == SERVED  # type: ignore[union-attr]
