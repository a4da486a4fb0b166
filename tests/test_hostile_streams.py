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
from sidecar.metering.wire import open_stream
from tests.conftest import StartSidecar
from tests.test_hostile_siblings import Raw, one_request
from tests.test_hostile_numbers import MODEL

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
