"""Native routes whose server serves one model and ignores a body's `model` (SGLang's and
TGI's /generate): the price is the served model's, never the one a client names (from the
h-rev6 hostile review: a client naming the price book's cheapest model paid 0.1%)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests import simulated as sim
from tests.conftest import Running, StartSidecar
from tests.waiting import wait_for

PROMPT = "one two three four five six seven eight"


async def billed(run: Running, db: Path, path: str, body: dict[str, Any]) -> tuple[str, float]:
    """POST `body` as user arb; once its ledger row is written and its hold settled, the row's
    model and what arb's budget was charged (USD)."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + path, json=body, headers={"X-Tollbooth-User": "arb"}) as r,
    ):
        assert r.status == 200
        await r.read()
    await wait_for(lambda: len(sim.ledger_rows(db, "model")) == 1, "the ledger row")
    await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")
    ((model,),) = sim.ledger_rows(db, "model")
    return model, run.sc.budgets.store.spent["user:arb"] / 1e6


def _sglang_body(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """One /generate result as tokenizer_manager.py builds it (`text`, `output_ids`,
    `meta_info`)."""
    return {
        "text": " tok" * completion_tokens,
        "output_ids": list(range(completion_tokens)),
        "meta_info": {
            "id": "r1",
            "finish_reason": {"type": "length", "length": completion_tokens},
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "cached_tokens": 0,
        },
    }


async def sglang_generate(request: web.Request) -> web.Response:
    """SGLang's /generate, POST or PUT alike, answering 9 prompt tokens and the request's
    `max_new_tokens` (or 20 without one) generated."""
    obj = json.loads(await request.read())
    params = obj.get("sampling_params") or {}
    return web.json_response(_sglang_body(9, params.get("max_new_tokens") or 20))


SERVED, CHEAP = "big-70b", "tiny-1b"  # what the engine serves; the book's cheapest name
TWO_PRICES = {
    "models": {
        SERVED: {"input_per_1m": 1000.0, "output_per_1m": 2000.0},
        CHEAP: {"input_per_1m": 1.0, "output_per_1m": 2.0},
    }
}


async def tgi_generate(request: web.Request) -> web.Response:
    """TGI's /generate (server.rs `generate_internal`): `{"generated_text", "details"}` and the
    `x-prompt-tokens`/`x-generated-tokens` headers; no model named anywhere."""
    obj = json.loads(await request.read())
    out = obj["parameters"]["max_new_tokens"]
    headers = {"x-prompt-tokens": "9", "x-generated-tokens": str(out)}
    return web.json_response({"generated_text": " tok" * out}, headers=headers)


async def tgi_info(request: web.Request) -> web.Response:
    """TGI's /info: the one model it serves, `model_id`."""
    return web.json_response({"model_id": SERVED, "max_total_tokens": 32768})


@pytest.mark.parametrize("engine", ["sglang", "tgi"])
async def test_a_model_named_in_a_native_body_never_prices_it(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, engine: str
) -> None:
    """The client adds `"model": "tiny-1b"` (the price book's cheapest name) to a native
    /generate body. Neither server reads a model there: SGLang's `GenerateReqInput`
    (python/sglang/srt/managers/io_struct.py) has no `model` field (FastAPI's dataclass body
    ignores it), TGI's `GenerateRequest` (router/src/lib.rs) is `inputs` and `parameters`
    (serde ignores the rest); each serves its one model and names none in its answer. Before,
    the sidecar read the body's `model` ahead of upstream.model_name and TGI's /info, and
    priced by it: 9 + 500 tokens of big-70b ($1.009) recorded as tiny-1b, charged $0.001009.
    Now priced as the model the server serves (upstream.model_name, TGI's /info `model_id`)."""
    routes = (
        [("POST", "/generate", sglang_generate)]
        if engine == "sglang"
        else [("POST", "/generate", tgi_generate), ("GET", "/info", tgi_info)]
    )
    upstream = {"api": engine, **({"model_name": SERVED} if engine == "sglang" else {})}
    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    up = await aiohttp_server(app)
    db = tmp_path / "ledger.db"
    config = {"ledger": {"path": str(db), "flush_interval_s": 0.05}, "pricing": TWO_PRICES}
    config |= {"upstream": upstream, "budgets": {"user_daily_usd": 5.0}}
    run = await start_sidecar(config, upstream_url=str(up.make_url("")).rstrip("/"))
    params = {"max_new_tokens": 500}
    body: dict[str, Any] = (
        {"text": PROMPT, "sampling_params": params, "model": CHEAP}
        if engine == "sglang"
        else {"inputs": PROMPT, "parameters": params, "model": CHEAP}
    )
    assert await billed(run, db, "/generate", body) == (
        SERVED,
        pytest.approx(sim.token_cost(9, 500)),
    )


def _sglang_chat(model: str, stream: bool) -> bytes:
    """SGLang's /v1/chat/completions answer (openai/serving_chat.py): `model=request.model`, the
    name the client sent, whatever SGLang serves; 9 prompt tokens, 500 generated."""
    usage = {"prompt_tokens": 9, "completion_tokens": 500, "total_tokens": 509}
    head = {"id": "c1", "object": "chat.completion", "created": 1, "model": model}
    if not stream:
        message = {"role": "assistant", "content": " tok" * 500}
        choice = {"index": 0, "message": message, "finish_reason": "length"}
        return json.dumps({**head, "choices": [choice], "usage": usage}).encode()
    delta = {"index": 0, "delta": {"content": " tok"}, "finish_reason": None}
    chunks = [{**head, "object": "chat.completion.chunk", "choices": [delta]}]
    chunks.append({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage})
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + (
        b"data: [DONE]\n\n"
    )


async def sglang_openai(request: web.Request) -> web.Response:
    """SGLang's OpenAI and Messages routes: each answers the request's `model` as its own
    (serving_chat.py `model=request.model`; anthropic/serving.py `model = anthropic_request.model`),
    never validated against the one it serves."""
    obj = json.loads(await request.read())
    if request.path == "/v1/messages":
        usage = {"input_tokens": 9, "output_tokens": 500, "cache_read_input_tokens": 0}
        body = {"id": "m1", "type": "message", "role": "assistant", "model": obj["model"]}
        body |= {"content": [{"type": "text", "text": "x"}], "stop_reason": "max_tokens"}
        return web.json_response({**body, "usage": usage})
    stream = bool(obj.get("stream"))
    kind = "text/event-stream" if stream else "application/json"
    return web.Response(body=_sglang_chat(obj["model"], stream), content_type=kind)


@pytest.mark.parametrize(
    ("path", "stream"),
    [("/v1/chat/completions", False), ("/v1/chat/completions", True), ("/v1/messages", False)],
)
async def test_a_model_named_to_sglangs_openai_routes_never_prices_it(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, path: str, stream: bool
) -> None:
    """h-rev8: SGLang ignores the `model` of its OpenAI and Messages requests too (no check
    against its served name: openai/serving_chat.py `_validate_request`; a `base:adapter` name
    picks a LoRA adapter of the one model) and answers the request's name as the model
    (`model=request.model`). Before, on `upstream.api: sglang` with `upstream.model_name` set,
    a client naming the book's cheapest model was priced and labelled by it: 9 + 500 tokens of
    big-70b ($1.009) recorded as tiny-1b, charged $0.001009. Now upstream.model_name prices it."""
    app = web.Application()
    app.router.add_post(path, sglang_openai)
    up = await aiohttp_server(app)
    db = tmp_path / "ledger.db"
    config = {"ledger": {"path": str(db), "flush_interval_s": 0.05}, "pricing": TWO_PRICES}
    config |= {"upstream": {"api": "sglang", "model_name": SERVED}}
    config |= {"budgets": {"user_daily_usd": 5.0}}
    run = await start_sidecar(config, upstream_url=str(up.make_url("")).rstrip("/"))
    body = {"model": CHEAP, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 500}
    if stream:
        body["stream"] = True
    assert await billed(run, db, path, body) == (
        SERVED,
        pytest.approx(sim.token_cost(9, 500)),
    )


@pytest.mark.parametrize("stream", [False, True])
async def test_a_model_named_to_tgis_chat_route_never_prices_it(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, stream: bool
) -> None:
    """h-rev8: TGI's /v1/chat/completions answers the request's `model` as its own, unchecked
    (router/src/server.rs `chat_completions`: `Some(m_id) => m_id.to_string()`, its /info
    `model_id` only for none or "tgi"; the field is documented "[UNUSED]"). Before, on
    `upstream.api: tgi`, a client naming the book's cheapest model paid its price: 9 + 500
    tokens of big-70b ($1.009) recorded as tiny-1b, charged $0.001009. Now TGI's /info names it."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", sglang_openai)  # the same echo
    app.router.add_get("/info", tgi_info)
    up = await aiohttp_server(app)
    db = tmp_path / "ledger.db"
    config = {"ledger": {"path": str(db), "flush_interval_s": 0.05}, "pricing": TWO_PRICES}
    config |= {"upstream": {"api": "tgi"}, "budgets": {"user_daily_usd": 5.0}}
    run = await start_sidecar(config, upstream_url=str(up.make_url("")).rstrip("/"))
    body = {"model": CHEAP, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 500}
    body |= {"stream": True} if stream else {}
    assert await billed(run, db, "/v1/chat/completions", body) == (
        SERVED,
        pytest.approx(sim.token_cost(9, 500)),
    )


async def test_tgis_native_route_whose_info_is_unanswered_is_never_free_on_any_api(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """h-rev9 finding 4: TGI's native routes are a server of one model on any upstream.api (the
    body's `model` names nothing, 7c89dbf), but 68c6633 held the unknown model's request at
    least at its hold only with `upstream.api: tgi`. With the default `api: vllm` (TGI's native
    paths are told from the body there) and /info unanswered, 9 + 500 tokens of /generate were
    the unknown model, unpriced, and its budget charged $0. Now charged at least its hold, as
    on `api: tgi`."""

    async def no_info(request: web.Request) -> web.Response:
        return web.Response(status=503)

    app = web.Application()
    app.router.add_post("/generate", tgi_generate)
    app.router.add_get("/info", no_info)
    up = await aiohttp_server(app)
    db = tmp_path / "ledger.db"
    config = {"ledger": {"path": str(db), "flush_interval_s": 0.05}, "pricing": TWO_PRICES}
    config |= {"budgets": {"user_daily_usd": 5.0}}  # upstream.api: vllm, the default
    run = await start_sidecar(config, upstream_url=str(up.make_url("")).rstrip("/"))
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 500}, "model": CHEAP}
    model, spent = await billed(run, db, "/generate", body)
    ((cost,),) = sim.ledger_rows(db, "cost_usd")
    assert (model, cost) == ("unknown", None)
    assert sim.token_cost(0, 500) < spent < sim.token_cost(100, 500)
