"""Siblings of 150d440 (an invalid usage that kept its reasoning count): each test failed on main
(150d440). Wherever a count is judged no measurement, no part of it (reasoning is a part of the
output, cached input a part of the input) survives to be exported or billed; and every rule one
wire's reader applies to a count holds on the others (docs/budgets.md, "Numbers").

Through the metering API (`sidecar.metering.wire`), and end to end with a hostile upstream that
answers the bytes it is given (the one boundary faked) in front of a real sidecar and its ledger.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from sidecar.exchange import Endpoint, RequestInfo, Usage
from sidecar.metering.audio import FormHead, audio_request
from sidecar.metering.counts import INVALID_USAGE, MAX_TOKEN_COUNT
from sidecar.metering.wire import inspect_request, open_stream, usage_from_body, within_request
from tests.conftest import StartSidecar
from tests.test_hostile_numbers import MODEL, PRICES, wait_for

NONE4 = (None, None, None, None)


def counts(u: Usage) -> tuple[int | None, ...]:
    return (u.input_tokens, u.output_tokens, u.cached_input_tokens, u.reasoning_tokens)


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


def chat_info(max_tokens: int = 10, **fields: Any) -> RequestInfo:
    body = {"model": MODEL, "messages": [], "max_tokens": max_tokens, **fields}
    return inspect_request(Endpoint.CHAT, json.dumps(body).encode(), inject_usage=False)


def metered(endpoint: Endpoint, data: bytes, *, fast: bool = True, **options: Any) -> Usage:
    meter = open_stream(endpoint, fast=fast, **options)
    meter.feed(data)
    return meter.finish()[1]


# --- a stream's totals: a part of an unknown sum -------------------------------------------------
# `openai._totals` summed a stream's usage objects (a usage chunk sent twice is now read as the
# last one sent: tests/test_hostile_streams.py): `total` of the input and output (None when one
# part has none), but `total_present` of the cached and reasoning counts, which kept the parts
# that were read when the sum was invalid or incomplete. `within_request` sees no output, so the
# 800,000,000 reasoning tokens of a request capped at 10 passed (the bug 150d440 fixed, again).

TOKEN = {"id": "x", "model": MODEL, "choices": [{"index": 0, "delta": {"content": "hi"}}]}
FINISH = {
    "id": "x",
    "model": MODEL,
    "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
}
BIG = {
    "prompt_tokens": 5,
    "completion_tokens": 900_000_000,
    "prompt_tokens_details": {"cached_tokens": 5},
    "completion_tokens_details": {"reasoning_tokens": 800_000_000},
}
SECOND = {
    "invalid": {"prompt_tokens": -1, "completion_tokens": 1},  # the whole sum is invalid
    "incomplete": {"prompt_tokens": 5},  # the sum's output is unknown
}


def two_usage_chunks(second: dict[str, Any]) -> bytes:
    usage = [{"id": "x", "model": MODEL, "choices": [], "usage": u} for u in (BIG, second)]
    return sse(TOKEN, FINISH, *usage) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "reference"])
@pytest.mark.parametrize("second", list(SECOND))
def test_no_part_of_a_stream_total_that_is_unknown_is_counted(second: str, fast: bool) -> None:
    u = within_request(
        metered(Endpoint.CHAT, two_usage_chunks(SECOND[second]), fast=fast), chat_info()
    )
    assert u.output_tokens is None
    assert u.reasoning_tokens is None  # was 800,000,000
    if second == "invalid":
        assert counts(u) == NONE4  # cached was 5: a part of no input count
        assert u.unknown_reason == INVALID_USAGE


class Raw:
    """An engine answering every POST with the bytes it is given, as a stream or a JSON body."""

    def __init__(self, data: bytes, *, streaming: bool) -> None:
        self.data, self.streaming = data, streaming
        self.app = web.Application()
        self.app.router.add_post("/{tail:.*}", self.answer)

    async def answer(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        kind = "text/event-stream" if self.streaming else "application/json"
        resp = web.StreamResponse(headers={"Content-Type": kind})
        await resp.prepare(request)
        await resp.write(self.data)
        await resp.write_eof()
        return resp


def exported(run: Any, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of `name` in the sidecar's registry, by its labels (whatever they are)."""
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for metric in run.sc.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == name
    }


def ledger(db: Path) -> list[tuple[Any, ...]]:
    with sqlite3.connect(db) as conn:
        cols = "input_tokens, output_tokens, cached_input_tokens, reasoning_tokens"
        return conn.execute(f"SELECT {cols} FROM requests").fetchall()


async def one_request(
    start_sidecar: StartSidecar,
    aiohttp_server: Any,
    tmp_path: Path,
    upstream: Raw,
    path: str,
    req: dict[str, Any],
    api: str = "vllm",
) -> tuple[Any, tuple[Any, ...]]:
    up = await aiohttp_server(upstream.app)
    db = tmp_path / "ledger.db"
    run = await start_sidecar(
        {
            "pricing": PRICES,
            "ledger": {"path": str(db), "flush_interval_s": 0.05},
            "upstream": {"api": api, "model_name": MODEL},
        },
        upstream_url=str(up.make_url("")).rstrip("/"),
    )
    async with aiohttp.ClientSession() as s, s.post(run.url + path, json=req) as r:
        assert r.status == 200, await r.text()
        assert await r.read() == upstream.data  # the client gets what was sent
    await wait_for(lambda: len(ledger(db)) == 1, "the ledger row")
    return run, ledger(db)[0]


async def test_reasoning_of_a_stream_whose_totals_are_invalid_is_not_exported(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """Was: 800,000,000 in llm_tokens_total{token_type="reasoning"} and the ledger's
    reasoning_tokens, 5 cached tokens of no input, for a request capped at 10."""
    upstream = Raw(two_usage_chunks(SECOND["invalid"]), streaming=True)
    req = {"model": MODEL, "messages": [], "max_tokens": 10, "stream": True}
    req["stream_options"] = {"include_usage": True}
    run, row = await one_request(
        start_sidecar, aiohttp_server, tmp_path, upstream, "/v1/chat/completions", req
    )
    assert row == NONE4
    assert exported(run, "llm_tokens_total") == {}  # was {..., token_type="reasoning"}: 8e8
    assert exported(run, "llm_cached_input_tokens_total") == {}


# --- cached input of no input count ---------------------------------------------------------------
# Reasoning tokens without an output count are invalid usage (`openai.read_usage`); cached tokens
# without an input count were kept, unchecked against anything: up to 10^9 of them exported to
# llm_cached_input_tokens_total, the ledger, the access log and the span, on every wire.

CACHED = 999_999_999
NO_INPUT = [
    pytest.param(
        Endpoint.CHAT,
        "vllm",
        {
            "id": "x",
            "model": MODEL,
            "choices": [{"index": 0, "finish_reason": "stop"}],
            "usage": {"completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": CACHED}},
        },
        id="chat",
    ),
    pytest.param(
        Endpoint.RESPONSES,
        "vllm",
        {
            "id": "x",
            "model": MODEL,
            "status": "completed",
            "usage": {"output_tokens": 5, "input_tokens_details": {"cached_tokens": CACHED}},
        },
        id="responses",
    ),
    pytest.param(
        Endpoint.MESSAGES,
        "vllm",
        {
            "id": "x",
            "type": "message",
            "usage": {"output_tokens": 5, "cache_read_input_tokens": CACHED},
        },
        id="messages",
    ),
    pytest.param(
        Endpoint.TGI_GENERATE,
        "sglang",
        {"text": "x", "meta_info": {"completion_tokens": 5, "cached_tokens": CACHED}},
        id="sglang",
    ),
    pytest.param(
        Endpoint.LLAMA_COMPLETION,
        "llamacpp",
        {"content": "x", "tokens_predicted": 5, "timings": {"cache_n": CACHED}},
        id="llamacpp",
    ),
]


@pytest.mark.parametrize(("endpoint", "api", "answer"), NO_INPUT)
def test_cached_input_without_an_input_count_is_no_count(
    endpoint: Endpoint, api: str, answer: dict[str, Any]
) -> None:
    u = usage_from_body(endpoint, json.dumps(answer).encode(), {}, api=api)
    assert u.input_tokens is None
    assert u.cached_input_tokens is None  # was 999,999,999


def test_cached_input_of_a_messages_stream_without_an_input_count_is_no_count() -> None:
    """`message_delta`'s `input_tokens: null` replaces `message_start`'s count: the cache reads
    read before stayed, a part of no input."""
    data = sse(
        {
            "type": "message_start",
            "message": {
                "id": "m",
                "model": MODEL,
                "usage": {"input_tokens": 5, "cache_read_input_tokens": CACHED, "output_tokens": 0},
            },
        },
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn"},
            "usage": {"input_tokens": None, "output_tokens": 5},
        },
        {"type": "message_stop"},
    )
    u = metered(Endpoint.MESSAGES, data)
    assert u.input_tokens is None
    assert u.cached_input_tokens is None  # was 999,999,999


async def test_cached_input_without_an_input_count_is_not_exported(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """Was: 999,999,999 in llm_cached_input_tokens_total and the ledger for a request whose
    input was never measured."""
    answer = NO_INPUT[0].values[2]
    upstream = Raw(json.dumps(answer).encode(), streaming=False)
    req = {"model": MODEL, "messages": [], "max_tokens": 10}
    run, row = await one_request(
        start_sidecar, aiohttp_server, tmp_path, upstream, "/v1/chat/completions", req
    )
    assert row[0] is None and row[2] is None
    assert exported(run, "llm_cached_input_tokens_total") == {}


# --- more cached input than input (llama.cpp, SGLang) ---------------------------------------------
# docs/budgets.md: "more `cached_tokens` than prompt tokens is invalid usage: that response's
# counts are all unknown". `openai.read_usage` says so; `counts.counts_of`, the reader of
# llama.cpp's and SGLang's counts, never compared them.

MORE_CACHED = [
    pytest.param(
        Endpoint.TGI_GENERATE,
        "sglang",
        {
            "text": "x",
            "meta_info": {"prompt_tokens": 5, "completion_tokens": 5, "cached_tokens": CACHED},
        },
        id="sglang",
    ),
    pytest.param(
        Endpoint.LLAMA_COMPLETION,
        "llamacpp",
        {
            "content": "x",
            "stop": True,
            "tokens_evaluated": 5,
            "tokens_predicted": 5,
            "timings": {"cache_n": CACHED},
        },
        id="llamacpp",
    ),
]


@pytest.mark.parametrize(("endpoint", "api", "answer"), MORE_CACHED)
@pytest.mark.parametrize("streaming", [False, True])
def test_more_cached_input_than_input_is_invalid_usage(
    endpoint: Endpoint, api: str, answer: dict[str, Any], streaming: bool
) -> None:
    if streaming:
        u = metered(endpoint, sse(answer) + b"data: [DONE]\n\n", api=api)
    else:
        u = usage_from_body(endpoint, json.dumps(answer).encode(), {}, api=api)
    assert counts(u) == NONE4  # was (5, 5, 999,999,999, None)
    assert u.unknown_reason == INVALID_USAGE


async def test_more_cached_input_than_input_is_not_exported(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    answer = MORE_CACHED[0].values[2]
    upstream = Raw(json.dumps(answer).encode(), streaming=False)
    req = {"model": MODEL, "text": "hi", "sampling_params": {"max_new_tokens": 10}}
    run, row = await one_request(
        start_sidecar, aiohttp_server, tmp_path, upstream, "/generate", req, api="sglang"
    )
    assert row == NONE4
    assert exported(run, "llm_cached_input_tokens_total") == {}


# --- the totals of several prompts under the ceiling ----------------------------------------------
# `counts.bounded` keeps a stream's totals (a sum) under MAX_TOKEN_COUNT on the OpenAI and
# Anthropic wires; `counts.summed`, the sum of llama.cpp's and SGLang's prompts, never applied it.


def test_the_totals_of_a_batch_above_the_ceiling_are_invalid() -> None:
    result = {"text": "x", "meta_info": {"prompt_tokens": MAX_TOKEN_COUNT, "completion_tokens": 5}}
    u = usage_from_body(Endpoint.TGI_GENERATE, json.dumps([result] * 3).encode(), {}, api="sglang")
    assert counts(u) == NONE4  # was 3,000,000,000 input tokens, measured
    assert u.unknown_reason == INVALID_USAGE


def test_the_totals_of_a_batched_stream_above_the_ceiling_are_invalid() -> None:
    meta = {
        "prompt_tokens": MAX_TOKEN_COUNT,
        "completion_tokens": 1,
        "finish_reason": {"type": "stop"},
    }
    data = (
        sse(*({"index": i, "text": "a", "meta_info": meta} for i in (0, 1))) + b"data: [DONE]\n\n"
    )
    u = metered(Endpoint.TGI_GENERATE, data, api="sglang", choices=2)
    assert counts(u) == NONE4  # was 2,000,000,000 input tokens, measured
    assert u.unknown_reason == INVALID_USAGE


# --- running totals of several choices at the stream's end ----------------------------------------
# vLLM's running usage (`continuous_usage_stats`) gives each choice's chunks the whole prompt's
# count. `usage_so_far` (a client that left) counts a chat's prompt once; `finish` (an upstream
# that broke before the usage chunk) added it once per choice: n times the prompt, measured.


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "reference"])
def test_a_chat_prompt_is_counted_once_from_the_running_totals_of_its_choices(fast: bool) -> None:
    chunks = [
        {
            "id": "x",
            "model": MODEL,
            "choices": [{"index": i, "delta": {"content": "a"}}],
            "usage": {"prompt_tokens": 100, "completion_tokens": step, "total_tokens": 100 + step},
        }
        for step in (1, 2)
        for i in (0, 1)
    ]
    meter = open_stream(Endpoint.CHAT, choices=2, per_prompt=2, fast=fast)
    meter.feed(sse(*chunks))  # the upstream broke here: no usage chunk, no [DONE]
    left = meter.usage_so_far()
    _, ended = meter.finish()
    assert (left.input_tokens, left.output_tokens) == (100, 4)
    assert (ended.input_tokens, ended.output_tokens) == (100, 4)  # was (200, 4)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "reference"])
def test_a_batch_whose_every_prompt_was_not_seen_has_no_input_count(fast: bool) -> None:
    """Two prompts, the stream cut after the first one's choice carried its running usage: its
    prompt alone was the input, measured (the second prompt, prefilled too, was free)."""
    chunk = {
        "id": "x",
        "model": MODEL,
        "choices": [{"index": 0, "text": "a"}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 1, "total_tokens": 101},
    }
    meter = open_stream(Endpoint.COMPLETIONS, choices=2, fast=fast)
    meter.feed(sse(chunk))
    for u in (meter.usage_so_far(), meter.finish()[1]):
        assert u.input_tokens is None  # was 100
        assert u.unknown_reason is not None  # was None: measured


# --- output on routes whose limit was not read ----------------------------------------------------


def audio_info(max_completion_tokens: int) -> RequestInfo:
    fields = {"model": MODEL, "stream": "true", "max_completion_tokens": str(max_completion_tokens)}
    head = b"".join(
        b'--B\r\nContent-Disposition: form-data; name="%s"\r\n\r\n%s\r\n' % (k.encode(), v.encode())
        for k, v in fields.items()
    )
    head += b'--B\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
    form = FormHead(b"B", 65536)
    form.feed(head)
    return audio_request(Endpoint.AUDIO_TRANSCRIPTIONS, head, form, None, 1000)


def test_an_audio_answer_beyond_its_max_completion_tokens_stays_measured() -> None:
    """Not a cap: vLLM splits audio longer than the model's clip (Whisper: 30 s) into chunks and
    generates each with `max_completion_tokens` (speech_to_text.py, `_create_speech_to_text`);
    the stream's usage sums every chunk's. Output above the form's limit is what a long file
    makes, and read as invalid it would be charged only its hold: free output."""
    info = audio_info(5)
    assert (info.max_tokens, info.output_cap) == (5, None)
    usage = {"prompt_tokens": 5, "completion_tokens": 20 * 5}  # 20 chunks of 30 s, 5 each
    data = sse(
        {"id": "x", "object": "transcription.chunk", "choices": [{"delta": {"content": "a"}}]},
        {"id": "x", "object": "transcription.chunk", "choices": [], "usage": usage},
    )
    u = within_request(metered(Endpoint.AUDIO_TRANSCRIPTIONS, data + b"data: [DONE]\n\n"), info)
    assert (u.input_tokens, u.output_tokens, u.unknown_reason) == (5, 100, None)


NOTHING_GENERATED = [
    (Endpoint.EMBEDDINGS, {"model": MODEL, "input": "hi"}),
    (Endpoint.POOLING, {"model": MODEL, "input": "hi"}),
    (Endpoint.CLASSIFY, {"model": MODEL, "input": "hi"}),
    (Endpoint.SCORE, {"model": MODEL, "text_1": "a", "text_2": "b"}),
    (Endpoint.RERANK, {"model": MODEL, "query": "a", "documents": ["b"]}),
]


@pytest.mark.parametrize(
    ("endpoint", "req"), NOTHING_GENERATED, ids=lambda v: getattr(v, "name", "")
)
def test_output_on_a_route_that_generates_nothing_is_invalid_usage(
    endpoint: Endpoint, req: dict[str, Any]
) -> None:
    """vLLM's embedding and pooling answers carry `completion_tokens: 0` (or none): nothing is
    generated, and the hold counts no output. 900,000,000 output tokens were charged."""
    info = inspect_request(endpoint, json.dumps(req).encode(), inject_usage=False)
    answer = {"id": "x", "model": MODEL, "data": [], "usage": {"prompt_tokens": 5}}
    zero = within_request(usage_from_body(endpoint, json.dumps(answer).encode(), {}), info)
    assert (zero.input_tokens, zero.output_tokens, zero.unknown_reason) == (5, 0, None)
    answer["usage"] = {"prompt_tokens": 5, "completion_tokens": 900_000_000, "total_tokens": 5}
    u = within_request(usage_from_body(endpoint, json.dumps(answer).encode(), {}), info)
    assert counts(u) == NONE4  # was (5, 900,000,000, None, None)
    assert u.unknown_reason == INVALID_USAGE


# --- output a server makes in several generations -------------------------------------------------
# vLLM's Responses API runs a built-in tool (web_search_preview, code_interpreter, container, an
# MCP server) between generations of one request, the later ones limited by what is left of the
# context, not by `max_output_tokens` (`_generate_with_builtin_tools`: `sampling_params.max_tokens
# = self.max_model_len - len(prompt_token_ids)`), and reports the output of every one. Capped at
# `max_output_tokens`, a client's 16 became invalid usage above it: charged only its hold, free.


@pytest.mark.parametrize(
    "tool",
    [
        {"type": "code_interpreter", "container": {"type": "auto"}},
        {"type": "web_search_preview"},
        {"type": "mcp", "server_label": "x", "server_url": "http://x"},
    ],
    ids=lambda t: t["type"],
)
def test_output_of_a_response_that_runs_built_in_tools_is_not_capped(tool: dict[str, Any]) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 16, "tools": [tool]}
    info = inspect_request(Endpoint.RESPONSES, json.dumps(body).encode(), inject_usage=False)
    u = within_request(Usage(input_tokens=10, output_tokens=5000), info)
    assert (u.input_tokens, u.output_tokens, u.unknown_reason) == (10, 5000, None)


def test_output_of_a_response_with_function_tools_only_is_capped() -> None:
    """A function tool is called by the client: one generation, as without tools."""
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 16, "tools": [tool]}
    info = inspect_request(Endpoint.RESPONSES, json.dumps(body).encode(), inject_usage=False)
    assert within_request(Usage(input_tokens=10, output_tokens=17), info).output_tokens is None
    assert within_request(Usage(input_tokens=10, output_tokens=16), info).output_tokens == 16
