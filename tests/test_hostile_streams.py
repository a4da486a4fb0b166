"""Stream readers against a hostile (or buggy) upstream: each test failed on main (b6076b1).

- A stream's final totals sent twice (two `response.completed` events on the Responses API, two
  usage-only chunks on chat) were added together: the request billed twice. One response has one
  final word; the last one seen is it (`openai.ResponsesStream`, `openai.ChatStream`).
- A choice `index` outside the request's choices (negative, huge, not an integer, or one the
  request did not ask for) was read as choice 0, or as a choice of its own: its running usage
  replaced choice 0's (tokens lost) or was added beside it (tokens counted twice).
- TGI's /vertex request reader never said whether the body was UTF-8 (`RequestInfo.utf8`).

Through the metering API (`sidecar.metering.wire`), both paths (`fast=False` is the reference the
fast path must equal), and end to end with a hostile upstream in front of a real sidecar.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sidecar.exchange import Endpoint, Usage
from sidecar.metering.wire import inspect_request, open_stream
from tests.conftest import StartSidecar
from tests.rawhttp import raw_request
from tests.test_hostile_numbers import MODEL
from tests.test_hostile_siblings import Raw, exported, one_request
from tests.waiting import wait_for

PATHS = pytest.mark.parametrize("fast", [True, False], ids=["fast", "reference"])


def two(u: Usage) -> tuple[int | None, int | None]:
    return (u.input_tokens, u.output_tokens)


def responses_event(kind: str, **extra: object) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **extra})}\n\n".encode()


def completed(usage: dict[str, Any] | None, kind: str = "response.completed") -> bytes:
    response: dict[str, Any] = {"id": "r", "model": MODEL, "status": "completed"}
    if usage is not None:
        response["usage"] = usage
    return responses_event(kind, response=response)


def read_all(endpoint: Endpoint, data: bytes, *, fast: bool, **options: Any) -> Usage:
    """The usage both ways a stream is read: at its end, and for a client that left at its end;
    fed whole and one byte at a time (the fast path's cuts)."""
    whole = open_stream(endpoint, fast=fast, **options)
    whole.feed(data)
    bytewise = open_stream(endpoint, fast=fast, **options)
    for i in range(len(data)):
        bytewise.feed(data[i : i + 1])
    assert whole.usage_so_far() == bytewise.usage_so_far()
    got = whole.finish()[1]
    assert got == bytewise.finish()[1] == whole.usage_so_far()
    return got


# --- the final totals, sent twice -----------------------------------------------------------------

USAGE = {"input_tokens": 4, "output_tokens": 2}
RESPONSES = responses_event("response.output_text.delta", delta="a")


@PATHS
@pytest.mark.parametrize("kind", ["response.completed", "response.incomplete", "response.failed"])
def test_a_second_terminal_event_is_not_added_to_the_first(kind: str, fast: bool) -> None:
    """Was (8, 4): each terminal event's response carries the whole response's usage."""
    data = RESPONSES + completed(USAGE) + completed(USAGE, kind)
    assert two(read_all(Endpoint.RESPONSES, data, fast=fast)) == (4, 2)


@PATHS
def test_the_last_terminal_event_is_the_response_s_final_word(fast: bool) -> None:
    later = {"input_tokens": 4, "output_tokens": 3}
    data = RESPONSES + completed(USAGE) + completed(later)
    assert two(read_all(Endpoint.RESPONSES, data, fast=fast)) == (4, 3)  # was (8, 5)
    # a final word without usage leaves the response's usage unknown (charged its hold), not the
    # earlier word's
    u = read_all(Endpoint.RESPONSES, RESPONSES + completed(USAGE) + completed(None), fast=fast)
    assert two(u) == (None, None) and u.unknown_reason == "stream_without_usage"


def chat_chunk(**extra: object) -> dict[str, Any]:
    return {"id": "c", "model": MODEL, "choices": [], **extra}


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


TOKEN = chat_chunk(choices=[{"index": 0, "delta": {"content": "hi"}}])
FINISH = chat_chunk(choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}])


@PATHS
@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETIONS])
def test_a_second_usage_chunk_is_not_added_to_the_first(endpoint: Endpoint, fast: bool) -> None:
    """The same bug on chat: a usage-only chunk holds the request's totals, and a repeated one
    replaced nothing, it was added (was (10, 4) and (10, 5))."""
    usage = {"prompt_tokens": 5, "completion_tokens": 2}
    later = {"prompt_tokens": 5, "completion_tokens": 3}
    twice = sse(TOKEN, FINISH, chat_chunk(usage=usage), chat_chunk(usage=usage))
    assert two(read_all(endpoint, twice + b"data: [DONE]\n\n", fast=fast)) == (5, 2)
    changed = sse(TOKEN, FINISH, chat_chunk(usage=usage), chat_chunk(usage=later))
    assert two(read_all(endpoint, changed + b"data: [DONE]\n\n", fast=fast)) == (5, 3)


async def test_a_responses_stream_completed_twice_is_billed_once(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """End to end: the ledger and the token counters had the request's usage twice."""
    upstream = Raw(RESPONSES + completed(USAGE) + completed(USAGE), streaming=True)
    req = {"model": MODEL, "input": "hi", "max_output_tokens": 10, "stream": True}
    run, row = await one_request(
        start_sidecar, aiohttp_server, tmp_path, upstream, "/v1/responses", req
    )
    assert row[:2] == (4, 2)  # was (8, 4)
    key = {"model": MODEL, "api_endpoint": "/v1/responses", "user_id": "anonymous"}
    assert run.value("llm_tokens_total", token_type="input", **key) == 4
    assert run.value("llm_tokens_total", token_type="output", **key) == 2


# --- a choice `index` the request did not ask for -------------------------------------------------
# Each chunk names its choice (`choices[i].index`, from 0 to the choices asked for, n times the
# prompts); vLLM's running totals ride on each choice's chunks and are what a client that leaves
# mid-stream is billed. An index outside that range was read as choice 0 (negative, huge, not an
# integer: its totals replaced choice 0's) or as a choice of its own (its totals added beside the
# request's: the prompt counted twice). Now such a chunk belongs to no choice: the running totals
# are unknown (charged the hold), and the request's own totals, which name no choice, still count.

STRAY = [-1, 1, 7, 10**30, 0.0, 1.5, "0", True, None, [0]]


def vllm_chunk(index: object, text: str, done: int | None = None) -> dict[str, Any]:
    """A compact chunk as vLLM writes it, with running totals (`continuous_usage_stats`)."""
    usage = None if done is None else {"prompt_tokens": 3, "total_tokens": 3 + done}
    if usage is not None:
        usage["completion_tokens"] = done
    choice = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
    return {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
            "choices": [choice], **({} if usage is None else {"usage": usage})}  # fmt: skip


def compact_sse(*events: dict[str, Any]) -> bytes:
    return b"".join(
        b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events
    )


def left_at_the_end(endpoint: Endpoint, data: bytes, *, fast: bool, choices: int = 1) -> Usage:
    """What a client that left after these chunks is billed (no usage chunk came), every way."""
    return read_all(endpoint, data, fast=fast, choices=choices)


ONE_CHOICE = [vllm_chunk(0, t, i + 1) for i, t in enumerate(["a", "b", "c", "d"])]


@PATHS
@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETIONS])
def test_running_totals_of_one_choice_are_exact(endpoint: Endpoint, fast: bool) -> None:
    """The case the stray ones are measured against: 3 prompt tokens, 4 generated."""
    u = left_at_the_end(endpoint, compact_sse(*ONE_CHOICE), fast=fast)
    assert two(u) == (3, 4) and u.unknown_reason is None


@PATHS
@pytest.mark.parametrize("index", STRAY, ids=repr)
def test_running_totals_beside_a_stray_choice_are_unknown(index: object, fast: bool) -> None:
    """Was (6, 5) for index 1 and 7 (a choice of its own: the prompt counted twice); for the
    others, read as choice 0, (3, 1) when the stray chunk came last (choice 0's 4 tokens
    replaced by its 1)."""
    data = compact_sse(*ONE_CHOICE[:2], vllm_chunk(index, "x", 1), *ONE_CHOICE[2:])
    u = left_at_the_end(Endpoint.CHAT, data, fast=fast)
    assert two(u) == (None, None) and u.unknown_reason == "invalid_usage"
    # before the shape is learnt, and after it is wired (three chunks of it)
    data = compact_sse(*ONE_CHOICE, vllm_chunk(index, "x", 1))
    assert two(left_at_the_end(Endpoint.CHAT, data, fast=fast)) == (None, None)
    data = compact_sse(vllm_chunk(index, "x", 1), *ONE_CHOICE)
    assert two(left_at_the_end(Endpoint.CHAT, data, fast=fast)) == (None, None)


@PATHS
def test_a_stray_choice_beside_two_is_neither_added_nor_folded(fast: bool) -> None:
    """n=2: choices 0 and 1 (4 and 5 tokens). Index 2 was a third choice's 5 tokens added (14);
    index -1 replaced choice 0's 4 by its 5 (10)."""
    pair = [vllm_chunk(0, "a", 4), vllm_chunk(1, "b", 5)]
    assert two(left_at_the_end(Endpoint.CHAT, compact_sse(*pair), fast=fast, choices=2)) == (3, 9)
    for index in (2, -1):
        data = compact_sse(*pair, vllm_chunk(index, "c", 5))
        u = left_at_the_end(Endpoint.CHAT, data, fast=fast, choices=2)
        assert two(u) == (None, None) and u.unknown_reason == "invalid_usage", index


@PATHS
def test_the_request_s_own_totals_still_count_beside_a_stray_choice(fast: bool) -> None:
    """The usage chunk names no choice: the request's totals are read as ever."""
    totals = chat_chunk(usage={"prompt_tokens": 3, "completion_tokens": 5})
    data = compact_sse(*ONE_CHOICE, vllm_chunk(7, "x", 1), totals) + b"data: [DONE]\n\n"
    u = read_all(Endpoint.CHAT, data, fast=fast)
    assert two(u) == (3, 5) and u.unknown_reason is None


@PATHS
def test_a_stray_choice_s_finish_is_no_choice_s(fast: bool) -> None:
    """n=2: a finish on index 7 made the stream `finished` (every choice done) while choice 1 was
    still generating; a client leaving then was read on, not cancelled."""
    finish = [{"index": i, "delta": {}, "finish_reason": "stop"} for i in (0, 7)]
    data = compact_sse(vllm_chunk(0, "a", 1), chat_chunk(choices=finish))
    meter = open_stream(Endpoint.CHAT, fast=fast, choices=2)
    meter.feed(data)
    assert not meter.finished
    assert meter.finish()[1].finish_reasons == ("stop",)  # was ("stop", "stop")


def llama_event(index: object, predicted: int, stop: bool = False) -> dict[str, Any]:
    return {"index": index, "content": "x", "stop": stop, "tokens_predicted": predicted,
            "tokens_evaluated": 12}  # fmt: skip


def sglang_event(index: object, completion: int) -> dict[str, Any]:
    meta = {"prompt_tokens": 12, "completion_tokens": completion, "cached_tokens": 0}
    return {"text": "x" * completion, "meta_info": meta, "index": index}


COUNTS = [
    pytest.param(Endpoint.LLAMA_COMPLETION, "vllm", llama_event, id="llama.cpp"),
    pytest.param(Endpoint.TGI_GENERATE, "sglang", sglang_event, id="sglang"),
]


@pytest.mark.parametrize(("endpoint", "api", "event"), COUNTS)
@pytest.mark.parametrize("index", STRAY, ids=repr)
def test_counts_of_a_stray_prompt_are_not_folded_into_the_first(
    endpoint: Endpoint, api: str, event: Any, index: object
) -> None:
    """The same bug on the streams whose every event carries its prompt's counts so far
    (`stream.CountsStream`): any stray index was read as prompt 0, its counts then prompt 0's
    (was (12, 1): prompt 0's 5 tokens lost)."""
    good = compact_sse(event(0, 4), event(0, 5))
    meter = open_stream(endpoint, api=api)
    meter.feed(good)
    assert two(meter.finish()[1]) == (12, 5)
    meter = open_stream(endpoint, api=api)
    meter.feed(compact_sse(event(0, 4), event(0, 5), event(index, 1)))
    u = meter.finish()[1]
    assert two(u) == (None, None) and u.unknown_reason == "invalid_usage"


# --- TGI's /vertex: whether its body is UTF-8 ----------------------------------------------------
# `RequestInfo.utf8` says the request body is UTF-8 text (only such a body is ever edited); when
# it is not, a stream whose usage is unknown says why: `body_not_utf8`, on every route whose
# reader sets it. /vertex's reader never set it, so left at its default (true) a UTF-16 /vertex
# body was read as UTF-8, and its stream's unknown usage was put down to the stream itself.

VERTEX = {"instances": [{"inputs": "caf\u00e9", "parameters": {"max_new_tokens": 3}}]}


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16", "utf-16-le", "utf-32"])
@pytest.mark.parametrize("endpoint", [Endpoint.TGI_VERTEX, Endpoint.TGI_GENERATE_STREAM])
def test_a_tgi_request_says_whether_its_body_is_utf8(endpoint: Endpoint, encoding: str) -> None:
    body = json.dumps(VERTEX if endpoint is Endpoint.TGI_VERTEX else VERTEX["instances"][0])
    info = inspect_request(endpoint, body.encode(encoding), inject_usage=True, api="tgi")
    assert info.parsed and info.endpoint is endpoint
    assert info.utf8 is (encoding == "utf-8")  # /vertex was always True


@pytest.mark.parametrize("path", ["/vertex", "/generate_stream"])
async def test_a_utf16_tgi_body_streamed_without_usage_says_so(
    start_sidecar: StartSidecar, aiohttp_server: Any, path: str
) -> None:
    """End to end, /vertex against TGI's native stream route: a UTF-16 body (forwarded as it
    came, never edited) answered with a stream that counts nothing. Was `no_token_events` on
    /vertex, `body_not_utf8` on /generate_stream."""
    upstream = Raw(b'data: {"generated_text":"x","details":null}\n\n', streaming=True)
    up = await aiohttp_server(upstream.app)
    run = await start_sidecar(
        {"upstream": {"api": "tgi"}}, upstream_url=str(up.make_url("")).rstrip("/")
    )
    req = VERTEX if path == "/vertex" else VERTEX["instances"][0]
    resp = await raw_request(run.url, path, json.dumps(req).encode("utf-16"))
    assert resp.status == 200 and resp.body == upstream.data

    def reasons() -> dict[str, float]:
        samples = exported(run, "llm_usage_unknown_total").items()
        return {dict(k)["reason"]: v for k, v in samples if dict(k)["api_endpoint"] == path}

    await wait_for(lambda: reasons() != {}, "the request's usage recorded")
    assert reasons() == {"body_not_utf8": 1}  # /vertex: {"no_token_events": 1}
