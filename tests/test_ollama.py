"""Ollama's native /api/chat, /api/generate and /api/embed metered (issue 23), through the real
`ollama` Python client in front of the simulator speaking Ollama's wire; and its OpenAI-compatible
/v1/chat/completions, through the openai SDK in front of a fake that reads the body as Ollama does.

The shapes are Ollama's api/types.go (`ChatResponse`, `GenerateResponse`, `Metrics`, whose counts
are `omitempty`, `EmbedResponse`) and server/routes.go; the fixtures are the response examples
of Ollama's docs/api.md.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import ollama
import openai
import pytest
from aiohttp import web
from tollbooth_lab.simulator import EngineParams
from tollbooth_lab.simulator.engine import Engine, chat_prompt

from sidecar.billing.budget import to_micros
from sidecar.exchange import Endpoint
from sidecar.metering.wire import inspect_request, open_stream, usage_from_body
from sidecar.proxy.routes import classify
from tests import simulated as sim
from tests.conftest import Running, StartSidecar
from tests.waiting import wait_for

MODEL = "sim-llama-3-8b"  # the simulator's tokenizer: one token a word
PRICES = sim.prices(MODEL)
FAKE: dict[str, Any] = {"pricing": PRICES}  # the sidecar in front of a fake Ollama

# docs/api.md, "Generate a completion", the final streamed response
DOCS_GENERATE_FINAL = {
    "model": "llama3.2",
    "created_at": "2023-08-04T19:22:45.499127Z",
    "response": "",
    "done": True,
    "context": [1, 2, 3],
    "total_duration": 10706818083,
    "load_duration": 6338219291,
    "prompt_eval_count": 26,
    "prompt_eval_duration": 130079000,
    "eval_count": 259,
    "eval_duration": 4232710000,
}
# docs/api.md, "Generate a chat completion", the final streamed response
DOCS_CHAT_FINAL = {
    "model": "llama3.2",
    "created_at": "2023-08-04T19:22:45.499127Z",
    "message": {"role": "assistant", "content": ""},
    "done": True,
    "total_duration": 4883583458,
    "load_duration": 1334875,
    "prompt_eval_count": 26,
    "prompt_eval_duration": 342546000,
    "eval_count": 282,
    "eval_duration": 4535599000,
}
# docs/api.md, "Generate Embeddings" (/api/embed), embeddings shortened
DOCS_EMBED = {
    "model": "all-minilm",
    "embeddings": [[0.010071029, -0.0017594862, 0.05007221]],
    "total_duration": 14143917,
    "load_duration": 1019500,
    "prompt_eval_count": 8,
}


def test_the_routes_are_metered() -> None:
    assert classify("POST", "/api/chat") is Endpoint.OLLAMA_CHAT
    assert classify("POST", "/api/generate") is Endpoint.OLLAMA_GENERATE
    assert classify("POST", "/api/embed") is Endpoint.OLLAMA_EMBED


@pytest.mark.parametrize(
    ("body", "stream", "limit"),
    [
        ({"model": "m", "prompt": "a"}, True, None),  # streaming by default, no limit
        ({"model": "m", "prompt": "a", "stream": False}, False, None),
        ({"model": "m", "prompt": "a", "stream": None}, True, None),
        ({"model": "m", "prompt": "a", "options": {"num_predict": 7}}, True, 7),
        ({"model": "m", "prompt": "a", "options": {"num_predict": 7.9}}, True, 7),
        ({"model": "m", "prompt": "a", "options": {"num_predict": -1}}, True, None),
        ({"model": "m", "prompt": "a", "options": {"num_predict": -2}}, True, None),
        ({"model": "m", "prompt": "a", "max_tokens": 5}, True, None),  # not Ollama's field
    ],
)
def test_the_request_is_read_as_ollama_reads_it(
    body: dict[str, Any], stream: bool, limit: int | None
) -> None:
    raw = json.dumps(body).encode()
    info = inspect_request(Endpoint.OLLAMA_GENERATE, raw, inject_usage=True)
    assert (info.stream, info.max_tokens, info.output_cap) == (stream, limit, limit)
    assert info.body == raw  # never changed
    embed = inspect_request(
        Endpoint.OLLAMA_EMBED, json.dumps({"input": "a"}).encode(), inject_usage=True
    )
    assert embed.stream is False


def test_the_docs_examples_are_read() -> None:
    g = usage_from_body(Endpoint.OLLAMA_GENERATE, json.dumps(DOCS_GENERATE_FINAL).encode(), {})
    assert (g.input_tokens, g.output_tokens, g.model) == (26, 259, "llama3.2")
    c = usage_from_body(Endpoint.OLLAMA_CHAT, json.dumps(DOCS_CHAT_FINAL).encode(), {})
    assert (c.input_tokens, c.output_tokens, c.unknown_reason) == (26, 282, None)
    e = usage_from_body(Endpoint.OLLAMA_EMBED, json.dumps(DOCS_EMBED).encode(), {})
    assert (e.input_tokens, e.output_tokens) == (8, 0)
    # omitempty: a count of 0 is left out of the final object
    z = {k: v for k, v in DOCS_CHAT_FINAL.items() if k != "eval_count"}
    assert usage_from_body(Endpoint.OLLAMA_CHAT, json.dumps(z).encode(), {}).output_tokens == 0
    bad = {**DOCS_CHAT_FINAL, "eval_count": -3}
    assert (
        usage_from_body(Endpoint.OLLAMA_CHAT, json.dumps(bad).encode(), {}).unknown_reason
        == "invalid_usage"
    )
    err = usage_from_body(Endpoint.OLLAMA_CHAT, b'{"error":"model \\"x\\" not found"}', {})
    assert (err.error, err.input_tokens) == ("error", None)


@pytest.mark.parametrize("key", ["prompt_eval_count", "eval_count"])
@pytest.mark.parametrize("value", [None, "26", 26.0, True, {}])
def test_a_count_ollama_cannot_have_sent_is_unknown_never_0(key: str, value: Any) -> None:
    """`Metrics`' counts are Go `int`s, `omitempty` (api/types.go): Ollama leaves out a 0 and
    never writes `null` or anything but an integer. Before, a `null` was read as a measured 0
    (as an absent count is): the other count billed alone, the missing one free."""
    final = {**DOCS_CHAT_FINAL, key: value}
    body = usage_from_body(Endpoint.OLLAMA_CHAT, json.dumps(final).encode(), {})
    meter = open_stream(Endpoint.OLLAMA_CHAT)
    meter.feed(_lines(2) + json.dumps(final).encode() + b"\n")
    streamed = meter.finish()[1]
    for u in (body, streamed):
        assert (u.input_tokens, u.output_tokens, u.unknown_reason) == (None, None, "invalid_usage")
    if key == "prompt_eval_count":
        embed = {**DOCS_EMBED, key: value}
        e = usage_from_body(Endpoint.OLLAMA_EMBED, json.dumps(embed).encode(), {})
        assert (e.input_tokens, e.output_tokens, e.unknown_reason) == (None, None, "invalid_usage")
    # absent is the 0 Go's omitempty left out: measured
    absent = {k: v for k, v in DOCS_CHAT_FINAL.items() if k != key}
    u = usage_from_body(Endpoint.OLLAMA_CHAT, json.dumps(absent).encode(), {})
    measured = (0, 282) if key == "prompt_eval_count" else (26, 0)
    assert (u.input_tokens, u.output_tokens, u.unknown_reason) == (*measured, None)


def _lines(n: int) -> bytes:
    part = {
        "model": "llama3.2",
        "created_at": "t",
        "message": {"role": "assistant", "content": "x"},
        "done": False,
    }
    return b"".join(json.dumps(part).encode() + b"\n" for _ in range(n))


WIRE = _lines(5) + json.dumps(DOCS_CHAT_FINAL).encode() + b"\n"


@pytest.mark.parametrize("cut", [1, 3, 64, len(WIRE)])
def test_a_stream_is_read_at_every_cut_and_passes_unchanged(cut: int) -> None:
    meter = open_stream(Endpoint.OLLAMA_CHAT)
    out = b"".join(meter.feed(WIRE[i : i + cut]) for i in range(0, len(WIRE), cut))
    tail, u = meter.finish()
    assert out + tail == WIRE and meter.done and meter.token_events == 5
    assert (u.input_tokens, u.output_tokens) == (26, 282)


def test_a_line_over_the_limit_makes_the_usage_unknown() -> None:
    meter = open_stream(Endpoint.OLLAMA_CHAT, max_event_bytes=100)
    big = json.dumps({**DOCS_CHAT_FINAL, "pad": "p" * 200}).encode() + b"\n"
    assert meter.feed(big) == big
    assert meter.finish()[1].unknown_reason == "event_too_large"


def _read_with_limit(data: bytes) -> set[tuple[Any, ...]]:
    """(input, output, reason) of `data` cut in two at every byte; each read unchanged."""
    results = set()
    for cut in range(len(data) + 1):
        meter = open_stream(Endpoint.OLLAMA_CHAT, max_event_bytes=1024)
        out = meter.feed(data[:cut]) + meter.feed(data[cut:])
        tail, u = meter.finish()
        assert out + tail == data
        results.add((u.input_tokens, u.output_tokens, u.unknown_reason))
    return results


LONG_LINE = json.dumps({"model": "llama3.2", "message": {"content": "t" * 2000}}).encode() + b"\n"
DONE_LINE = json.dumps(DOCS_CHAT_FINAL).encode() + b"\n"


def test_the_done_line_after_a_line_over_the_limit_is_the_usage() -> None:
    """The `done` line's counts are the request's: read after a line too long to read, they
    are the usage (before, the whole stream was unknown). A `done` line before it is not."""
    assert _read_with_limit(_lines(2) + LONG_LINE + _lines(1) + DONE_LINE) == {(26, 282, None)}
    unknown = {(None, None, "event_too_large")}
    assert _read_with_limit(_lines(2) + DONE_LINE + LONG_LINE) == unknown


def test_a_line_over_the_limit_counts_as_an_event_of_output() -> None:
    """A line too long to read reached the client and may have carried output: the unmeasured
    charge reads each as at least one token (`Budgets.unmeasured_usd`), as it reads a line read."""
    data = _lines(2) + LONG_LINE + _lines(1) + LONG_LINE
    for cut in range(len(data) + 1):
        meter = open_stream(Endpoint.OLLAMA_CHAT, max_event_bytes=1024)
        meter.feed(data[:cut])
        meter.feed(data[cut:])
        assert meter.token_events == 5


def test_a_stream_cut_before_its_done_line_has_no_measured_usage() -> None:
    meter = open_stream(Endpoint.OLLAMA_GENERATE)
    meter.feed(_lines(3))
    u = meter.usage_so_far()
    assert (u.input_tokens, u.output_tokens) == (None, None) and not meter.done


# --- the real client, through the sidecar, in front of the simulator ------------------------------


async def _start(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, **config: Any
) -> tuple[Running, Path]:
    return await sim.start_simulated(start_sidecar, aiohttp_server, tmp_path, PRICES, **config)


def _rows(db: Path) -> list[tuple[Any, ...]]:
    return sim.ledger_rows(db, COLUMNS)


COLUMNS = "user, endpoint, input_tokens, output_tokens, stream, status"


def _tokens(run: Running, kind: str, route: str, user: str) -> Any:
    return run.value(
        "llm_tokens_total", model=MODEL, token_type=kind, api_endpoint=route, user_id=user
    )


MSGS = [{"role": "user", "content": "one two three four five"}]


async def _traffic(ann: ollama.AsyncClient, bob: ollama.AsyncClient, stream: bool) -> Any:
    opts = {"num_predict": 6}
    if stream:
        parts = [p async for p in await ann.chat(MODEL, MSGS, stream=True, options=opts)]
        gparts = [p async for p in await bob.generate(MODEL, "a b c", stream=True, options=opts)]
        assert len(parts) > 1 and "".join(p.message.content or "" for p in parts)
        chat, gen = parts[-1], gparts[-1]
    else:
        chat = await ann.chat(MODEL, MSGS, options=opts)
        gen = await bob.generate(MODEL, "a b c", options=opts)
    return chat, gen, await bob.embed(MODEL, ["one two", "three"])


@pytest.mark.parametrize("stream", [False, True])
async def test_the_client_is_metered_exactly_per_user(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, stream: bool
) -> None:
    run, db = await _start(start_sidecar, aiohttp_server, tmp_path)
    async with (
        ollama.AsyncClient(host=run.url, headers={"X-Tollbooth-User": "ann"}) as ann,
        ollama.AsyncClient(host=run.url, headers={"X-Tollbooth-User": "bob"}) as bob,
    ):
        chat, gen, emb = await _traffic(ann, bob, stream)
    assert chat.done and gen.done and len(emb.embeddings) == 2
    await wait_for(lambda: len(_rows(db)) == 3, "three ledger rows")
    assert _rows(db) == [
        ("ann", "/api/chat", chat.prompt_eval_count, chat.eval_count, int(stream), "200"),
        ("bob", "/api/generate", 3, gen.eval_count, int(stream), "200"),
        ("bob", "/api/embed", 3, 0, 0, "200"),
    ]
    assert chat.prompt_eval_count and chat.eval_count and gen.eval_count  # measured, not 0
    assert _tokens(run, "input", "/api/chat", "ann") == chat.prompt_eval_count
    assert _tokens(run, "output", "/api/chat", "ann") == chat.eval_count
    assert _tokens(run, "input", "/api/generate", "bob") == 3
    assert _tokens(run, "output", "/api/generate", "bob") == gen.eval_count
    assert _tokens(run, "input", "/api/embed", "bob") == 3


async def test_a_client_leaving_mid_stream_is_charged_its_hold(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """Ollama's partial lines carry no counts: nothing was measured, so the budget charges the
    hold (unknown usage is never free) and the ledger records the usage as unknown."""
    run, db = await _start(start_sidecar, aiohttp_server, tmp_path, budgets={"user_daily_usd": 5.0})
    body = {"model": MODEL, "messages": MSGS, "options": {"num_predict": 400}}
    lines = 0

    def progress(line: bytes) -> int:  # NDJSON lines carry no running count: count the lines
        nonlocal lines
        lines += 1
        return lines

    await sim.leave_mid_stream(run, "/api/chat", body, "cy", progress)
    await wait_for(lambda: len(_rows(db)) == 1, "the ledger row")
    assert _rows(db) == [("cy", "/api/chat", None, None, 1, "499")]
    await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")
    assert run.sc.budgets.store.spent["user:cy"] > 0
    assert run.value("llm_budget_unmeasured_charges_total") == 1


async def test_a_burst_against_a_small_budget_is_held(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """Ollama's chat template adds tokens the body does not show, so the hold's prompt estimate
    (characters / `admission.chars_per_token`) is set to over-count here: then the budget holds."""
    limit = 0.05
    run, db = await _start(
        start_sidecar,
        aiohttp_server,
        tmp_path,
        budgets={"user_daily_usd": limit},
        admission={"chars_per_token": 1.0},
    )

    async def one(client: ollama.AsyncClient) -> int:
        try:
            await client.chat(MODEL, MSGS, options={"num_predict": 5})
        except ollama.ResponseError as exc:
            return exc.status_code
        return 200

    async with ollama.AsyncClient(host=run.url, headers={"X-Tollbooth-User": "dee"}) as client:
        statuses = await sim.burst(lambda: one(client))
    await sim.assert_burst_held(
        run, db, COLUMNS, "dee", limit, statuses, lambda r: sim.token_cost(r[2], r[3])
    )


# --- Ollama's OpenAI-compatible /v1/chat/completions ----------------------------------------------
# Its `ChatCompletionRequest` (openai/openai.go) has `MaxTokens *int \`json:"max_tokens"\``, sent
# on as `options.num_predict`, and no `max_completion_tokens`: that field is ignored, and the
# answer runs to its end. The usage it reports is `ToUsage`'s, the real counts.

V1_ANSWER = 40  # words (tokens) the fake answers without a limit it reads


def _v1_usage(prompt: int, out: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}


async def ollama_v1_chat(request: web.Request) -> web.StreamResponse:
    """/v1/chat/completions as Ollama answers it: only `max_tokens` limits the output (Go's
    decoder matches the key ignoring case, the last one winning), usage the real counts, in the
    stream as the last chunk when `stream_options.include_usage` asks for it."""
    obj = json.loads(await request.read())
    limits = [v for k, v in obj.items() if k.casefold() == "max_tokens"]
    out = min(V1_ANSWER, limits[-1]) if limits and limits[-1] else V1_ANSWER
    prompt = sum(len(str(m.get("content", "")).split()) for m in obj["messages"])
    base = {"id": "chatcmpl-1", "created": 1, "model": obj["model"]}
    base["system_fingerprint"] = "fp_ollama"
    reason = "length" if out < V1_ANSWER else "stop"
    if not obj.get("stream"):
        message = {"role": "assistant", "content": " ".join(["x"] * out)}
        choice = {"index": 0, "message": message, "finish_reason": reason}
        body = {**base, "object": "chat.completion", "choices": [choice]}
        return web.json_response({**body, "usage": _v1_usage(prompt, out)})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    chunk = {**base, "object": "chat.completion.chunk"}
    for i in range(out):
        delta = {"role": "assistant", "content": "x "}
        last = reason if i == out - 1 else None
        choice = {"index": 0, "delta": delta, "finish_reason": last}
        await resp.write(b"data: " + json.dumps({**chunk, "choices": [choice]}).encode() + b"\n\n")
    options = obj.get("stream_options") or {}
    if options.get("include_usage"):
        final = {**chunk, "choices": [], "usage": _v1_usage(prompt, out)}
        await resp.write(b"data: " + json.dumps(final).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


V1_COLUMNS = "user, endpoint, input_tokens, output_tokens, cost_usd, status"


async def _v1_chat(run: Running, user: str, stream: bool, **limits: int) -> int:
    """The openai SDK's chat call through the sidecar: the output tokens the answer says."""
    client = openai.AsyncOpenAI(
        base_url=run.url + "/v1", api_key="k", default_headers={"X-Tollbooth-User": user}
    )
    async with client:
        if not stream:
            answer = await client.chat.completions.create(model=MODEL, messages=MSGS_V1, **limits)
            assert answer.usage is not None
            return answer.usage.completion_tokens
        chunks = await client.chat.completions.create(
            model=MODEL, messages=MSGS_V1, stream=True, **limits
        )
        return len([c async for c in chunks if c.choices and c.choices[0].delta.content])


MSGS_V1: Any = [{"role": "user", "content": "one two three four five"}]


@pytest.mark.parametrize("stream", [False, True])
async def test_ollama_v1_ignoring_max_completion_tokens_is_billed_its_whole_answer(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, stream: bool
) -> None:
    """Before: vLLM's limit, `max_completion_tokens: 1`, was the cap on the counted output, so
    the 40 tokens Ollama generated and reported were taken as more than the request could ask
    (invalid usage): the ledger's counts and cost NULL, the budget charged the hold of one
    output token. Now a field a server behind the route may ignore sets no cap."""
    route = ("/v1/chat/completions", ollama_v1_chat)
    budgets = {"user_daily_usd": 5.0}
    run, db = await sim.start_fake(
        start_sidecar, aiohttp_server, tmp_path, route, **FAKE, budgets=budgets
    )
    out = await _v1_chat(run, "vic", stream, max_completion_tokens=1)
    assert out == V1_ANSWER  # the whole answer came
    await wait_for(lambda: len(sim.ledger_rows(db, V1_COLUMNS)) == 1, "the ledger row")
    cost = pytest.approx(sim.token_cost(5, V1_ANSWER))
    assert sim.ledger_rows(db, V1_COLUMNS) == [
        ("vic", "/v1/chat/completions", 5, V1_ANSWER, cost, "200")
    ]
    await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")
    assert run.sc.budgets.store.spent["user:vic"] / 1e6 == cost
    assert run.value("llm_budget_unmeasured_charges_total") in (None, 0)
    # `max_tokens`, which Ollama obeys, is still a cap: output above it is no measurement
    info = inspect_request(
        Endpoint.CHAT, json.dumps({"max_tokens": 3, "messages": []}).encode(), inject_usage=False
    )
    assert info.output_cap == 3


async def null_eval_count(request: web.Request) -> web.Response:
    """/api/chat answering 300 tokens with `eval_count: null` (no Ollama writes that)."""
    done = {"model": MODEL, "message": {"role": "assistant", "content": "x " * 300}}
    done |= {"done": True, "done_reason": "stop", "prompt_eval_count": 5, "eval_count": None}
    return web.json_response(done)


async def test_an_output_count_of_null_is_charged_the_hold_not_free(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """Before: `eval_count: null` was read as 0 output: the ledger said 0 and the budget was
    charged the 5 input tokens alone for 300 generated. Now the usage is unknown: NULL in the
    ledger, the budget charged the hold (its output term the default 4096 tokens)."""
    route = ("/api/chat", null_eval_count)
    budgets = {"user_daily_usd": 50.0}
    run, db = await sim.start_fake(
        start_sidecar, aiohttp_server, tmp_path, route, **FAKE, budgets=budgets
    )
    async with ollama.AsyncClient(host=run.url, headers={"X-Tollbooth-User": "nil"}) as client:
        answer = await client.chat(MODEL, MSGS)
    assert answer.done and answer.eval_count is None
    await wait_for(lambda: len(sim.ledger_rows(db, V1_COLUMNS)) == 1, "the ledger row")
    assert sim.ledger_rows(db, V1_COLUMNS) == [("nil", "/api/chat", None, None, None, "200")]
    await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")
    assert run.sc.budgets.store.spent["user:nil"] / 1e6 > sim.token_cost(5, 4096)
    assert run.value("llm_budget_unmeasured_charges_total") == 1


# --- a client leaving Ollama's /v1 streams mid-generation -------------------------------------
# Ollama's OpenAI writers (middleware/openai.go): `CompleteWriter` puts an all-zero `Usage{}` on
# every chunk once `include_usage` is asked for (which the sidecar does), `ChatWriter` none; the
# totals come only in the last chunk. So a client that leaves mid-stream has nothing measured.

STREAMED = 100  # chunks of one token each the fake sends before it waits (generating on)
ZERO_USAGE = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


def ollama_v1_generating(release: asyncio.Event, chunks: int = STREAMED) -> Any:
    """/v1/chat/completions and /v1/completions as Ollama streams them, `chunks` chunks sent and
    the rest still being generated (the handler waits for `release`, set by the test at its end)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        obj = json.loads(await request.read())
        usage = (obj.get("stream_options") or {}).get("include_usage")
        chat = request.path.endswith("/chat/completions")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(chunks):
            if chat:
                choice: dict[str, Any] = {"index": 0, "delta": {"content": "x "}}
                c: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk"}
            else:
                choice = {"text": "x ", "index": 0}
                c = {"id": "cmpl-1", "object": "text_completion"}
            c |= {"created": 1, "choices": [{**choice, "finish_reason": None}]}
            c |= {"model": obj["model"], "system_fingerprint": "fp_ollama"}
            if usage and not chat:
                c["usage"] = ZERO_USAGE
            await resp.write(b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n")
        await release.wait()
        return resp

    return handler


def _tokens_read() -> Any:
    """A `leave_mid_stream` progress: the tokens read so far, counted by the client."""
    read = 0

    def progress(line: bytes) -> int | None:
        nonlocal read
        choices = (sim.sse_data(line) or {}).get("choices") or [{}]
        if not (choices[0].get("delta") or {}).get("content") and not choices[0].get("text"):
            return None
        read += 1
        return read

    return progress


@pytest.mark.parametrize(
    ("path", "limits", "charged_output"),
    [
        # /v1/completions: Ollama reads `max_tokens` (`CompletionRequest`), as vLLM does
        ("/v1/completions", {"max_tokens": 400}, 400),
        # chat: the hold reads vLLM's `max_completion_tokens`; Ollama obeys only `max_tokens`
        ("/v1/chat/completions", {"max_completion_tokens": 1}, 4096),
        ("/v1/chat/completions", {"max_completion_tokens": 1, "max_tokens": 4000}, 4000),
    ],
)
async def test_a_client_leaving_an_ollama_v1_stream_is_charged_what_ollama_may_have_made(
    start_sidecar: StartSidecar,
    aiohttp_server: Any,
    tmp_path: Path,
    path: str,
    limits: dict[str, int],
    charged_output: int,
) -> None:
    """The client reads 100 tokens ($0.20 of output) and leaves. Before: on /v1/completions
    Ollama's zeros were read as running totals, the ledger said 0 tokens and the budget was
    charged $0; on chat, `max_completion_tokens: 1` made the hold (one output token, $0.009) the
    whole charge. Now nothing measured is charged the worst case at the limit Ollama obeys (the
    default 4096 tokens when the body sends no `max_tokens`); the ledger's counts are unknown."""
    release = asyncio.Event()
    route = (path, ollama_v1_generating(release))
    budgets = {"user_daily_usd": 50.0}
    run, db = await sim.start_fake(
        start_sidecar, aiohttp_server, tmp_path, route, **FAKE, budgets=budgets
    )
    body = {"model": MODEL, "stream": True, **limits}
    body |= {"messages": MSGS_V1} if "chat" in path else {"prompt": "one two three four five"}
    try:
        progress = _tokens_read()
        seen = await sim.leave_mid_stream(run, path, body, "lee", progress, after=STREAMED)
        assert seen == STREAMED
        await wait_for(lambda: len(sim.ledger_rows(db, V1_COLUMNS)) == 1, "the ledger row")
        await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")
    finally:
        release.set()
    assert sim.ledger_rows(db, V1_COLUMNS) == [("lee", path, None, None, None, "499")]
    assert run.sc.budgets.store.spent["user:lee"] / 1e6 > sim.token_cost(0, charged_output)
    assert run.value("llm_budget_unmeasured_charges_total") == 1


async def test_vllm_with_max_completion_tokens_alone_is_still_billed_its_running_totals(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """The worst case above is for output nobody measured. vLLM's running totals measure a
    client that leaves mid-stream: with `max_completion_tokens` alone (the modern SDKs' field)
    it is charged exactly what was measured, not the default worst case."""
    run, db = await _start(start_sidecar, aiohttp_server, tmp_path, budgets={"user_daily_usd": 5.0})
    seed = next(
        s
        for s in range(100)
        if Engine(EngineParams()).submit(chat_prompt(MSGS), 300, s).stop_at == 300
    )
    body = {"model": MODEL, "messages": MSGS, "max_completion_tokens": 300, "stream": True}
    seen = await sim.leave_mid_stream(
        run, "/v1/chat/completions", {**body, "seed": seed}, "val", _tokens_read(), after=5
    )
    assert seen == 5
    await wait_for(lambda: len(sim.ledger_rows(db, V1_COLUMNS)) == 1, "the ledger row")
    await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")
    [(user, _, inp, out, cost, status)] = sim.ledger_rows(db, V1_COLUMNS)
    assert (user, status) == ("val", "499") and inp and 5 <= out < 300
    assert cost == pytest.approx(sim.token_cost(inp, out))
    assert run.sc.budgets.store.spent["user:val"] == to_micros(cost)
    assert run.value("llm_budget_unmeasured_charges_total") in (None, 0)


@pytest.mark.parametrize(("chunks", "worst"), [(50, False), (51, True)])
async def test_a_client_leaving_ollamas_chat_is_charged_the_worst_case_only_past_its_held_limit(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, chunks: int, worst: bool
) -> None:
    """`max_completion_tokens: 50`, which the hold reads and Ollama's chat ignores. 50 chunks
    read and left: an obeying server could have sent them, so the hold (50 output tokens) is
    the charge. 51: more chunks carrying output than the held limit allows, so the server
    ignored it: the worst case at the limit Ollama obeys (none sent: the default 4096)."""
    release = asyncio.Event()
    route = ("/v1/chat/completions", ollama_v1_generating(release, chunks))
    budgets = {"user_daily_usd": 50.0}
    run, db = await sim.start_fake(
        start_sidecar, aiohttp_server, tmp_path, route, **FAKE, budgets=budgets
    )
    body = {"model": MODEL, "stream": True, "messages": MSGS_V1, "max_completion_tokens": 50}
    try:
        seen = await sim.leave_mid_stream(
            run, "/v1/chat/completions", body, "lim", _tokens_read(), after=chunks
        )
        assert seen == chunks
        await wait_for(lambda: len(sim.ledger_rows(db, V1_COLUMNS)) == 1, "the ledger row")
        await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")
    finally:
        release.set()
    assert sim.ledger_rows(db, V1_COLUMNS) == [
        ("lim", "/v1/chat/completions", None, None, None, "499")
    ]
    charged = run.sc.budgets.store.spent["user:lim"] / 1e6
    if worst:
        assert charged > sim.token_cost(0, 4096)
    else:  # the hold: at most every character of the body a token, and 50 output tokens
        assert sim.token_cost(0, 50) < charged <= sim.token_cost(len(json.dumps(body)), 50)


async def test_an_ollama_embed_whose_client_left_is_not_charged_output_tokens(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """/api/embed generates nothing: it holds and is charged its prompt alone, as /v1/embeddings.
    Before, its `output_cap` was `num_predict` (absent: None), so its hold, and the charge of a
    client that left, added the default 4096 output tokens ($8.19 at the test's prices)."""
    entered, release = asyncio.Event(), asyncio.Event()

    async def embed(request: web.Request) -> web.Response:
        await request.read()
        entered.set()
        await release.wait()
        return web.json_response({})

    budgets = {"user_daily_usd": 50.0}
    route = ("/api/embed", embed)
    run, db = await sim.start_fake(
        start_sidecar, aiohttp_server, tmp_path, route, **FAKE, budgets=budgets
    )
    body = {"model": MODEL, "input": "one two three four five"}
    try:
        async with aiohttp.ClientSession() as s:
            headers = {"X-Tollbooth-User": "emb"}
            call = asyncio.ensure_future(s.post(run.url + "/api/embed", json=body, headers=headers))
            await asyncio.wait_for(entered.wait(), 10)
            call.cancel()
        await wait_for(lambda: len(sim.ledger_rows(db, V1_COLUMNS)) == 1, "the ledger row")
        await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")
    finally:
        release.set()
    [(_, _, _, _, _, status)] = sim.ledger_rows(db, V1_COLUMNS)
    assert status == "499"
    charged = run.sc.budgets.store.spent["user:emb"] / 1e6
    most = sim.token_cost(len(json.dumps(body)), 0)  # every character a token, no output
    assert 0 < charged <= most, f"charged ${charged:.4f} for an embedding (at most ${most:.4f})"


def ollama_messages_generating(release: asyncio.Event, estimate: int) -> Any:
    """/v1/messages as Ollama streams it (anthropic/anthropic.go `StreamConverter.Process`):
    message_start with `estimate` as its input (middleware/anthropic.go `EstimateInputTokens`,
    the prompt's length / 4), then STREAMED text deltas, the rest still being generated (the
    handler waits for `release`)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        obj = json.loads(await request.read())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        message = {"id": "msg_4f0c1e2d3b4a596877665544", "type": "message"}
        message |= {"role": "assistant", "model": obj["model"], "content": []}
        message |= {"usage": {"input_tokens": estimate, "output_tokens": 0}}
        events: list[tuple[str, Any]] = [
            ("message_start", {"type": "message_start", "message": message}),
            ("content_block_start", {"type": "content_block_start", "index": 0}),
        ]
        events[1][1]["content_block"] = {"type": "text", "text": ""}
        delta = {"type": "text_delta", "text": "x "}
        events += [
            ("content_block_delta", {"type": "content_block_delta", "delta": delta})
        ] * STREAMED
        for kind, data in events:
            line = f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
            await resp.write(line.encode())
        await release.wait()
        return resp

    return handler


async def test_a_client_leaving_ollamas_messages_stream_has_its_input_unknown_not_estimated(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """h-fix10: Ollama's message_start says as input a len/4 estimate of the request, not a
    count (its chunks carry prompt_eval_count only on the last one). A client that left before
    message_delta had it recorded as its measured input (12 for a prompt Ollama would count
    otherwise). Now its input is unknown, as its output is, and its budget is charged the hold."""
    release = asyncio.Event()
    route = ("/v1/messages", ollama_messages_generating(release, estimate=12))
    run, db = await sim.start_fake(
        start_sidecar, aiohttp_server, tmp_path, route, **FAKE, budgets={"user_daily_usd": 50.0}
    )
    body = {"model": MODEL, "max_tokens": 400, "stream": True, "messages": MSGS_V1}
    read = 0

    def progress(line: bytes) -> int | None:
        nonlocal read
        if (sim.sse_data(line) or {}).get("type") != "content_block_delta":
            return None
        read += 1
        return read

    try:
        await sim.leave_mid_stream(run, "/v1/messages", body, "mia", progress, after=10)
        await wait_for(lambda: len(sim.ledger_rows(db, V1_COLUMNS)) == 1, "the ledger row")
        await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")
    finally:
        release.set()
    assert sim.ledger_rows(db, V1_COLUMNS) == [("mia", "/v1/messages", None, None, None, "499")]
    assert run.sc.budgets.store.spent["user:mia"] / 1e6 > sim.token_cost(0, 400)
    assert run.value("llm_budget_unmeasured_charges_total") == 1
