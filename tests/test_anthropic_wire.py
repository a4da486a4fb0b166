"""The Anthropic Messages adapter as a pure object, and the key headers its clients send.

Guards: usage from recorded streams (Anthropic's documented example, without `[DONE]`, with
`ping` and a placeholder `output_tokens: 1` in `message_start`; vLLM's, with `[DONE]` and the
input repeated in `message_delta`) at every chunk cut, bytes passed through unchanged; the output
never read from `message_start`; cache reads and writes added to input once; hostile counts
(negative, boolean, string, huge) as invalid usage, never a number; what a request asks
(`max_tokens` as vLLM reads it, `stream`, `metadata.user_id`, every string of `system`,
`messages` and `tools` in the hold); `x-api-key` as a key wherever `Authorization` is one
(identity, audit redaction, the upstream's headers when the sidecar has its own key).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from sidecar.billing.audit import redact
from sidecar.credentials import ConflictingKeys, bearer, key_id
from sidecar.exchange import Endpoint
from sidecar.metering.counts import INVALID_USAGE, MAX_TOKEN_COUNT
from sidecar.metering.wire import (
    SGLANG_PROMPT_USAGE,
    inspect_request,
    open_stream,
    tokenize_requests,
    usage_api,
    usage_from_body,
)
from sidecar.proxy.headers import anthropic_error_body, request_headers
from sidecar.telemetry.logs import redact_credentials
from tests import simulated as sim
from tests.conftest import StartSidecar
from tests.waiting import wait_for

EP = Endpoint.MESSAGES


def sse(*events: tuple[str, dict[str, Any]]) -> bytes:
    return b"".join(f"event: {k}\ndata: {json.dumps(d)}\n\n".encode() for k, d in events)


# Anthropic's "Streaming Messages" documentation, its basic example (text shortened).
ANTHROPIC_DOCS = sse(
    (
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": "msg_1nZdL29xx5MUA1yADyHTEsnR8uuvGzszyY",
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": "claude-opus-4-6",
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 25, "output_tokens": 1},
            },
        },
    ),
    (
        "content_block_start",
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    ),
    ("ping", {"type": "ping"}),
    (
        "content_block_delta",
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
    ),
    (
        "content_block_delta",
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "!"}},
    ),
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {"output_tokens": 15},
        },
    ),
    ("message_stop", {"type": "message_stop"}),
)

# vLLM's (vllm/entrypoints/anthropic/serving.py, message_stream_converter): exclude_unset, the
# input repeated in message_delta, then `data: [DONE]`; here with a prompt cache's counts.
VLLM = (
    sse(
        (
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": "chatcmpl-1",
                    "content": [],
                    "model": "m",
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {
                        "input_tokens": 7,
                        "output_tokens": 0,
                        "cache_read_input_tokens": 30,
                        "cache_creation_input_tokens": 3,
                    },
                },
            },
        ),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": "a"},
            },
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "max_tokens"},
                "usage": {"input_tokens": 7, "output_tokens": 4},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    )
    + b"data: [DONE]\n\n"
)


def fed(data: bytes, cuts: list[int]) -> tuple[bytes, Any, Any]:
    meter = open_stream(EP, api="vllm")
    out, prev = b"", 0
    for c in [*cuts, len(data)]:
        out += meter.feed(data[prev:c])
        prev = c
    tail, usage = meter.finish()
    return out + tail, usage, meter


@pytest.mark.parametrize(
    "data,expected",
    [
        (ANTHROPIC_DOCS, (25, 15, None, "claude-opus-4-6", ("end_turn",), 2)),
        (VLLM, (7 + 30 + 3, 4, 30, "m", ("max_tokens",), 1)),
    ],
    ids=["anthropic-docs", "vllm"],
)
def test_a_recorded_stream_at_every_cut(data: bytes, expected: tuple[Any, ...]) -> None:
    for cut in range(len(data) + 1):
        out, u, meter = fed(data, [cut])
        assert out == data  # nothing is ever changed on this route
        got = (u.input_tokens, u.output_tokens, u.cached_input_tokens, u.model, u.finish_reasons)
        assert (*got, meter.token_events) == expected
        assert u.unknown_reason is None and meter.done and meter.finished


def test_a_client_leaving_before_message_delta_has_its_output_unknown() -> None:
    # message_start says output_tokens 1 (Anthropic) or 0 (vLLM) before anything is generated
    upto = ANTHROPIC_DOCS.index(b"event: message_delta")
    meter = open_stream(EP)
    meter.feed(ANTHROPIC_DOCS[:upto])
    u = meter.usage_so_far()
    assert (u.input_tokens, u.output_tokens) == (25, None)
    assert u.unknown_reason == "no_usage" and not meter.finished
    meter.feed(ANTHROPIC_DOCS[upto:])
    assert meter.usage_so_far().output_tokens == 15


def test_the_last_message_delta_wins() -> None:
    delta = {"type": "message_delta", "usage": {"output_tokens": 3}}
    later = {"type": "message_delta", "usage": {"output_tokens": 9, "input_tokens": 5}}
    _, u, _ = fed(sse(("message_delta", delta), ("message_delta", later)), [])
    assert (u.input_tokens, u.output_tokens) == (5, 9)


@pytest.mark.parametrize(
    ("start", "input_left"),
    [
        ({"input_tokens": 0, "output_tokens": 0}, None),  # SGLang's placeholder
        ({"input_tokens": 0, "cache_read_input_tokens": 40}, 40),  # all of it cached
        ({"input_tokens": 7, "output_tokens": 0}, 7),
    ],
)
def test_an_input_of_0_in_message_start_is_no_count(
    start: dict[str, int], input_left: int | None
) -> None:
    """SGLang's message_start says `input_tokens: 0` before anything is counted (its chat
    stream has usage on the last chunk only: anthropic/serving.py), then the real count in
    message_delta. Before, a client leaving in between had 0 input measured and count_tokens
    never asked (h-rev6). A prompt is never 0 tokens, unless all of it was read from the cache
    (Anthropic's input excludes cache reads): there 0 is the count."""
    message = {"id": "msg_1", "content": [], "model": "m", "usage": start}
    head = sse(
        ("message_start", {"type": "message_start", "message": message}),
        ("content_block_delta", {"type": "content_block_delta", "delta": {"text": "a"}}),
    )
    meter = open_stream(EP)  # Anthropic's rule: input excludes the cache reads
    meter.feed(head)
    assert meter.usage_so_far().input_tokens == input_left  # the client left here
    meter.feed(sse(_delta(input_tokens=12, output_tokens=5)))
    if input_left is None:
        assert (meter.finish()[1].input_tokens, meter.usage_so_far().output_tokens) == (12, 5)


@pytest.mark.parametrize("api", [SGLANG_PROMPT_USAGE, "vllm"])
def test_sglangs_message_start_is_no_count_and_no_invalid_one(api: str) -> None:
    """h-rev8: an older SGLang's message_start is `input_tokens: 0, cache_read_input_tokens: 0,
    output_tokens: 0` (anthropic/serving.py `_generate_anthropic_stream`: the cache count is set
    to 0, not left out, so it is serialised). The placeholder input was dropped but its cache
    count of 0 kept, a part of no input: a stream cut before message_delta read as
    `invalid_usage` (a count SGLang cannot have sent) where nothing was counted yet. A 0 input
    without a cache count above 0 is a placeholder whole: no count, reason `no_usage`."""
    usage = {"input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 0}
    message = {"id": "msg_1", "content": [], "model": "m", "usage": usage}
    text = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "a"}}
    meter = open_stream(EP, api=api)
    meter.feed(sse(("message_start", {"type": "message_start", "message": message})))
    meter.feed(sse(("content_block_delta", text)))
    cut = meter.usage_so_far()  # the stream ends here
    assert (cut.input_tokens, cut.cached_input_tokens, cut.unknown_reason) == (
        None,
        None,
        "no_usage",
    )
    meter.feed(sse(_delta(input_tokens=100, output_tokens=5, cache_read_input_tokens=60)))
    done = meter.finish()[1]
    inp = 100 if api == SGLANG_PROMPT_USAGE else 160  # the older SGLang's input holds them
    assert (done.input_tokens, done.cached_input_tokens, done.output_tokens) == (inp, 60, 5)


LIMIT = 1024  # a small metering.max_event_bytes: a longer event is not read
LONG_DELTA = (
    "content_block_delta",
    {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": "t" * 2000},
    },
)


def _start(**usage: int) -> tuple[str, dict[str, Any]]:
    message = {"id": "msg_1", "content": [], "model": "m", "usage": usage}
    return ("message_start", {"type": "message_start", "message": message})


def _delta(**usage: int) -> tuple[str, dict[str, Any]]:
    return ("message_delta", {"type": "message_delta", "usage": usage})


def _read_with_limit(data: bytes) -> set[tuple[Any, ...]]:
    """(input, cached, output, reason) of `data` cut in two at every byte; each read unchanged."""
    results = set()
    for cut in range(len(data) + 1):
        meter = open_stream(EP, max_event_bytes=LIMIT)
        out = meter.feed(data[:cut]) + meter.feed(data[cut:])
        tail, u = meter.finish()
        assert out + tail == data
        results.add((u.input_tokens, u.cached_input_tokens, u.output_tokens, u.unknown_reason))
    return results


CACHE = {"cache_read_input_tokens": 30, "cache_creation_input_tokens": 3}


def test_a_message_delta_after_an_event_over_the_limit_with_every_count_is_the_usage() -> None:
    """`message_delta`'s usage is cumulative: read after the long event, with the input (and
    the cache counts `message_start` gave) repeated there, it is the usage."""
    vllm = sse(
        _start(input_tokens=7, output_tokens=0), LONG_DELTA, _delta(input_tokens=7, output_tokens=4)
    )
    assert _read_with_limit(vllm) == {(7, None, 4, None)}
    every = sse(
        _start(input_tokens=7, **CACHE),
        LONG_DELTA,
        _delta(input_tokens=7, output_tokens=4, **CACHE),
    )
    assert _read_with_limit(every) == {(40, 30, 4, None)}


def test_counts_read_only_before_an_event_over_the_limit_leave_the_usage_unknown() -> None:
    """The long event may have been a `message_delta` with other counts: an input (or cache
    count) read only in `message_start` before it, a `message_start` not read at all, or a
    `message_delta` before it, leave the usage unknown."""
    unknown = {(None, None, None, "event_too_large")}
    docs = sse(_start(input_tokens=25, output_tokens=1), LONG_DELTA, _delta(output_tokens=15))
    assert _read_with_limit(docs) == unknown
    cache = sse(
        _start(input_tokens=7, **CACHE), LONG_DELTA, _delta(input_tokens=7, output_tokens=4)
    )
    assert _read_with_limit(cache) == unknown
    long_start = _start(input_tokens=7, output_tokens=0)
    long_start[1]["message"]["content"] = [{"type": "text", "text": "t" * 2000}]
    assert _read_with_limit(sse(long_start, _delta(input_tokens=7, output_tokens=4))) == unknown
    after = sse(_start(input_tokens=7), _delta(input_tokens=7, output_tokens=4), LONG_DELTA)
    assert _read_with_limit(after) == unknown


@pytest.mark.parametrize(
    "bad", [-1, True, "12", 1.5, MAX_TOKEN_COUNT + 1, 10**40, None, [], {"n": 1}]
)
@pytest.mark.parametrize(
    "field",
    ["input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"],
)
def test_hostile_counts_are_invalid_usage(field: str, bad: object) -> None:
    usage = {"input_tokens": 5, "output_tokens": 2, field: bad}
    body = json.dumps({"type": "message", "usage": usage}).encode()
    streamed = sse(("message_delta", {"type": "message_delta", "usage": usage}))
    for u in (usage_from_body(EP, body, {}), fed(streamed, [])[1]):
        if bad is None and field.startswith("cache"):  # an absent cache: no cache, valid
            assert (u.input_tokens, u.output_tokens) == (5, 2)
        elif bad is None:
            assert u.unknown_reason == "no_usage" and None in (u.input_tokens, u.output_tokens)
        else:
            assert u.unknown_reason == INVALID_USAGE
            assert (u.input_tokens, u.output_tokens, u.cached_input_tokens) == (None, None, None)


def test_counts_that_add_up_past_the_ceiling_are_invalid() -> None:
    usage = {"input_tokens": MAX_TOKEN_COUNT, "output_tokens": 1, "cache_read_input_tokens": 5}
    u = usage_from_body(EP, json.dumps({"usage": usage}).encode(), {})
    assert u.unknown_reason == INVALID_USAGE and u.input_tokens is None


def test_a_body_with_cache_counts_input_once() -> None:
    usage = {
        "input_tokens": 10,
        "output_tokens": 4,
        "cache_read_input_tokens": 100,
        "cache_creation_input_tokens": 20,
    }
    body = {"id": "msg_1", "model": "m", "stop_reason": "end_turn", "usage": usage}
    u = usage_from_body(EP, json.dumps(body).encode(), {})
    assert (u.input_tokens, u.cached_input_tokens, u.output_tokens) == (130, 100, 4)
    assert (u.model, u.response_id, u.finish_reasons) == ("m", "msg_1", ("end_turn",))


# An older SGLang's /v1/messages usage (anthropic/serving.py `_convert_response`, and
# `message_delta` in `_generate_anthropic_stream`): `input_tokens` is the chat usage's whole
# `prompt_tokens`, `cache_read_input_tokens` its `prompt_tokens_details.cached_tokens`, a part of
# it. A 100-token prompt with 60 cached is sent as input 100, cache reads 60.
SGLANG_USAGE = {"input_tokens": 100, "output_tokens": 10, "cache_read_input_tokens": 60}


@pytest.mark.parametrize(
    ("api", "inp"), [(SGLANG_PROMPT_USAGE, 100), ("sglang", 160), ("vllm", 160), ("tgi", 160)]
)
def test_cache_reads_are_added_to_the_input_by_the_servers_rule(api: str, inp: int) -> None:
    """An older SGLang's input already holds its cache reads (read so under
    `upstream.sglang_messages_usage: prompt`); Anthropic's rule (current SGLang's, llama.cpp's,
    `to_json_anthropic`: `n_prompt_tokens - n_prompt_tokens_cache`) adds them. The default on
    `upstream.api: sglang` is Anthropic's, which bills an older SGLang's cached tokens twice
    (160 for a 100-token prompt) where the other rule would under-bill a current one."""
    body = json.dumps({"type": "message", "usage": SGLANG_USAGE}).encode()
    end = sse(
        ("message_start", {"type": "message_start", "message": {"usage": SGLANG_USAGE}}),
        ("message_delta", {"type": "message_delta", "usage": SGLANG_USAGE}),
        ("message_stop", {"type": "message_stop"}),
    )
    for fast in (True, False):
        meter = open_stream(EP, api=api, fast=fast)
        meter.feed(end)
        streamed = meter.finish()[1]
        for u in (usage_from_body(EP, body, {}, api=api), streamed):
            assert (u.input_tokens, u.cached_input_tokens, u.output_tokens) == (inp, 60, 10)
            assert u.unknown_reason is None


# Current SGLang (anthropic/response_conversion.py `anthropic_usage_from_openai`, used by
# anthropic/serving.py since its refactor) follows Anthropic's rule instead: `input_tokens` is
# `max(prompt_tokens - cached_tokens, 0)`, the cache reads beside it. A 100-token prompt with 60
# cached is sent as input 40, cache reads 60.
CURRENT_SGLANG_USAGE = {"input_tokens": 40, "output_tokens": 10, "cache_read_input_tokens": 60}


def _both_paths(api: str, usage: dict[str, int]) -> list[Any]:
    """`usage` read from a Messages body and from a stream carrying it, on server `api`."""
    body = json.dumps({"type": "message", "usage": usage}).encode()
    end = sse(
        ("message_start", {"type": "message_start", "message": {"usage": usage}}),
        ("message_delta", {"type": "message_delta", "usage": usage}),
        ("message_stop", {"type": "message_stop"}),
    )
    meter = open_stream(EP, api=api)
    meter.feed(end)
    return [usage_from_body(EP, body, {}, api=api), meter.finish()[1]]


def test_more_cache_reads_than_an_input_that_holds_them_are_anthropics_rule() -> None:
    """h-rev9 finding 1: under `upstream.sglang_messages_usage: prompt` the input is read as
    holding its cache reads (the older SGLang, 3d47e31), and such an input is never below them:
    cache reads above it prove the server follows Anthropic's rule (current SGLang,
    response_conversion.py: input = prompt - cached), by which the counts are exact. Before
    (f093e0e) such usage was invalid and charged the hold: every request of a current SGLang
    named the older one with more than half its prompt cached. Now input 40 beside 60 cache reads
    is a 100-token prompt, 60 of it cached."""
    for u in _both_paths(SGLANG_PROMPT_USAGE, CURRENT_SGLANG_USAGE):
        assert (u.input_tokens, u.cached_input_tokens, u.output_tokens) == (100, 60, 10)
        assert u.unknown_reason is None
    writes = CURRENT_SGLANG_USAGE | {"cache_creation_input_tokens": 5}
    for u in _both_paths(SGLANG_PROMPT_USAGE, writes):  # Anthropic's rule whole: writes added
        assert (u.input_tokens, u.cached_input_tokens, u.unknown_reason) == (105, 60, None)
    # input 0: current SGLang's clamp of more cached than prompt tokens, a count it logs as a bug
    clamped = CURRENT_SGLANG_USAGE | {"input_tokens": 0}
    for u in _both_paths(SGLANG_PROMPT_USAGE, clamped):
        assert (u.input_tokens, u.cached_input_tokens, u.unknown_reason) == (
            None,
            None,
            INVALID_USAGE,
        )


@pytest.mark.parametrize(
    ("usage", "counts"),
    [
        ({"input_tokens": 70, "output_tokens": 10, "cache_read_input_tokens": 30}, (100, 30)),
        (CURRENT_SGLANG_USAGE, (100, 60)),
        ({"input_tokens": 0, "output_tokens": 10, "cache_read_input_tokens": 100}, (100, 100)),
        ({"input_tokens": 100, "output_tokens": 10}, (100, None)),  # no cache report
    ],
)
def test_current_sglangs_input_excludes_its_cache_reads(
    usage: dict[str, int], counts: tuple[int, int | None]
) -> None:
    """h-rev8 finding 5: current SGLang sends a 100-token prompt with 30 cached as input 70,
    cache reads 30 (Anthropic's rule). `upstream.api: sglang` read it as a 70-token prompt, 30
    of it cached: 30 tokens fewer billed and 30 of those at the cached price (and 40 beside 60
    as invalid usage). Now Anthropic's rule is the default there, as on every other server:
    100 input tokens, 30 of them cached. (An older SGLang, which sent input 100, cache reads 30
    for the same prompt, is named with `upstream.sglang_messages_usage: prompt`.)"""
    for u in _both_paths("sglang", usage):
        assert (u.input_tokens, u.cached_input_tokens, u.output_tokens) == (*counts, 10)
        assert u.unknown_reason is None


def test_only_sglangs_messages_take_the_configured_rule() -> None:
    """`upstream.sglang_messages_usage: prompt` names the older rule for SGLang's /v1/messages
    alone: its /generate and OpenAI routes, and every other server, are read as before."""
    assert usage_api(EP, "sglang", "prompt") == SGLANG_PROMPT_USAGE
    assert usage_api(EP, "sglang", "anthropic") == "sglang"
    assert usage_api(EP, "sglang") == "sglang"  # the default: Anthropic's rule
    for endpoint in (Endpoint.TGI_GENERATE, Endpoint.CHAT, Endpoint.COMPLETIONS):
        assert usage_api(endpoint, "sglang", "prompt") == "sglang"
    for api in ("vllm", "tgi"):
        assert usage_api(EP, api, "prompt") == api


def test_errors_in_a_body_and_in_a_stream() -> None:
    err = {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
    u = usage_from_body(EP, json.dumps(err).encode(), {})
    assert (u.error, u.unknown_reason) == ("overloaded_error", "error_response")
    _, s, _ = fed(sse(("error", err)), [])
    assert s.error == "overloaded_error" and s.input_tokens is None


def test_what_a_request_asks() -> None:
    body = {
        "model": "claude-x",
        "max_tokens": "300",  # vLLM's `max_tokens: int` reads it as pydantic does
        "stream": True,
        "metadata": {"user_id": "end-user-7"},
        "system": [{"type": "text", "text": "S" * 40}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "T" * 50}]}],
        "tools": [{"name": "get", "input_schema": {"type": "object", "properties": {"q": {}}}}],
    }
    info = inspect_request(EP, json.dumps(body).encode(), inject_usage=True)
    assert info.body == json.dumps(body).encode()  # never changed
    assert (info.max_tokens, info.stream, info.model, info.user) == (
        300,
        True,
        "claude-x",
        "end-user-7",
    )
    assert (info.messages, info.tools, info.prompt_chars) == (1, 1, 90)
    assert info.text_chars >= 40 + 50 + len("getobjecttypepropertiesq")
    missing = inspect_request(EP, b'{"model": "m", "messages": []}', inject_usage=False)
    assert missing.max_tokens is None and not missing.stream
    bad = inspect_request(EP, b'{"max_tokens": "lots", "messages": []}', inject_usage=False)
    assert bad.unreadable == ("max_tokens",)


def test_the_prompt_is_counted_by_count_tokens() -> None:
    body = {
        "model": "m",
        "max_tokens": 9,
        "stream": True,
        "system": "s",
        "messages": [{"role": "user", "content": "x"}],
    }
    info = inspect_request(EP, json.dumps(body).encode(), inject_usage=False)
    ((path, sent),) = tokenize_requests(info, "vllm") or []
    assert path == "/v1/messages/count_tokens"
    assert json.loads(sent) == {"model": "m", "system": "s", "messages": body["messages"]}


# --- keys ----------------------------------------------------------------------------------------


def test_a_key_in_either_header_is_the_same_key() -> None:
    assert bearer({"x-api-key": "k1"}) == bearer({"Authorization": "Bearer k1"}) == "k1"
    assert bearer({"Authorization": "Bearer k1", "x-api-key": "k1"}) == "k1"
    with pytest.raises(ConflictingKeys):
        bearer({"Authorization": "Bearer k1", "x-api-key": "k2"})
    assert bearer({"x-api-key": "  "}) is None


def test_x_api_key_is_redacted_in_audit_and_kept_from_the_upstream() -> None:
    out = redact({"X-Api-Key": "sk-ant-secret", "User-Agent": "a"})
    assert out["X-Api-Key"] == f"[redacted] {key_id('sk-ant-secret')}"
    mine = request_headers(
        {"x-api-key": "sk-ant-secret"}, peer=None, scheme="http", authorization="Bearer up"
    )
    assert "x-api-key" not in mine and mine["Authorization"] == "Bearer up"
    theirs = request_headers({"x-api-key": "sk-ant-secret"}, peer=None, scheme="http")
    assert theirs["x-api-key"] == "sk-ant-secret"  # no key of our own: the client's goes on


def test_anthropic_error_types_by_status() -> None:
    got = {
        s: json.loads(anthropic_error_body(s, "x", "m"))["error"]["type"]
        for s in (400, 401, 403, 413, 415, 429, 502, 503)
    }
    assert got == {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        413: "request_too_large",
        415: "invalid_request_error",
        429: "rate_limit_error",
        502: "api_error",
        503: "overloaded_error",
    }


def test_x_api_key_is_masked_in_log_text() -> None:
    text = redact_credentials("bad header line 'x-api-key: sk-ant-secret-1' from peer")
    assert "sk-ant-secret-1" not in text and "x-api-key" in text


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(
    model=_JSON,
    usage=st.dictionaries(
        st.sampled_from(
            [
                "input_tokens",
                "output_tokens",
                "cache_read_input_tokens",
                "cache_creation_input_tokens",
            ]
        ),
        _JSON,
    ),
    reason=_JSON,
)
def test_whatever_the_upstream_sends_is_made_safe(
    model: object, usage: object, reason: object
) -> None:
    start = {"type": "message_start", "message": {"model": model, "id": model, "usage": usage}}
    delta = {"type": "message_delta", "delta": {"stop_reason": reason}, "usage": usage}
    body = json.dumps({"model": model, "stop_reason": reason, "usage": usage}).encode()
    for u in (
        usage_from_body(EP, body, {}),
        fed(sse(("message_start", start), ("message_delta", delta)), [])[1],
    ):
        for n in (u.input_tokens, u.output_tokens, u.cached_input_tokens):
            assert n is None or (type(n) is int and 0 <= n <= MAX_TOKEN_COUNT)
        for s in (u.model, u.response_id, *u.finish_reasons):
            assert s is None or (isinstance(s, str) and s.encode("utf-8"))


# --- SGLang's Messages, through the sidecar -------------------------------------------------------

SIM_MODEL = "sim-llama-3-8b"
PROMPT = "one two three four five six seven eight"
LEDGER = "user, input_tokens, cached_input_tokens, output_tokens, status"


async def sglang_messages(request: web.Request) -> web.Response:
    """An older SGLang's /v1/messages answer (python/sglang/srt/entrypoints/anthropic/serving.py
    `_convert_response`): `input_tokens` is the chat response's `usage.prompt_tokens`, the whole
    prompt, cached part included, and `cache_read_input_tokens` its `prompt_tokens_details.
    cached_tokens` (with --enable-cache-report), a part of that same prompt: 100 prompt tokens
    of which 60 were cached, 10 generated."""
    await request.read()
    return web.json_response(
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": SIM_MODEL,
            "content": [{"type": "text", "text": "ok"}],
            "stop_reason": "end_turn",
            "usage": SGLANG_USAGE,
        }
    )


async def test_sglang_messages_cache_reads_are_counted_twice(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """Upstream SGLang answers /v1/messages with `input_tokens` = the whole prompt (100, its
    chat usage's `prompt_tokens`) and `cache_read_input_tokens` = the cached part of it (60,
    `prompt_tokens_details.cached_tokens`): anthropic/serving.py `_convert_response`, and
    `message_start` in `_generate_anthropic_stream` alike. `anthropic.counted` applies
    Anthropic's own rule (input EXCLUDES the cache reads) to every server, so the ledger records
    160 input tokens, 60 of them cached, for a 100-token prompt: a count no server measured.
    Observed: input 160 (cached 60). Expected with `upstream.api: sglang`: input 100, cached 60.
    Severity: an over-charge (each cached token billed twice, once at the full input price,
    once at the cached), and a ledger count that was never measured; llama.cpp's and
    Anthropic's own `input_tokens` do exclude the cache reads (llama.cpp server-task.cpp
    `to_json_anthropic`: `n_prompt_tokens - n_prompt_tokens_cache`), so the rule is the
    server's, not the wire's. (From the rev6 review.) Current SGLang excludes them too
    (h-rev8): the older rule is named with `upstream.sglang_messages_usage: prompt`."""
    upstream = {"api": "sglang", "model_name": SIM_MODEL, "sglang_messages_usage": "prompt"}
    run, db = await sim.start_fake(
        start_sidecar,
        aiohttp_server,
        tmp_path,
        ("/v1/messages", sglang_messages),
        pricing=sim.prices(SIM_MODEL),
        upstream=upstream,
    )
    body = {"model": SIM_MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": PROMPT}]}
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/v1/messages", json=body, headers={"X-Tollbooth-User": "sm"}) as r,
    ):
        assert r.status == 200
        await r.read()
    await wait_for(lambda: len(sim.ledger_rows(db, LEDGER)) == 1, "the ledger row")
    assert sim.ledger_rows(db, LEDGER) == [("sm", 100, 60, 10, "200")]


# Current SGLang's /v1/messages (anthropic/response_conversion.py `anthropic_usage_from_openai`):
# a 100-token prompt with 30 cached, 10 generated. The body's usage is input 70 (prompt less
# cached), cache reads 30; a stream's message_start carries the input and cache counts and its
# message_delta the output alone.
CURRENT_USAGE = {"input_tokens": 70, "output_tokens": 10, "cache_read_input_tokens": 30}
# $1000 a million input tokens, $100 cached, $2000 output: each count shows in the cost.
CACHED_PRICES = {
    "models": {
        SIM_MODEL: {"input_per_1m": 1000.0, "cached_input_per_1m": 100.0, "output_per_1m": 2000.0}
    }
}


def _current_sglang_stream() -> bytes:
    start = {"input_tokens": 70, "output_tokens": 0, "cache_read_input_tokens": 30}
    message = {"id": "msg_c", "type": "message", "role": "assistant", "content": []}
    message |= {"model": SIM_MODEL, "usage": start}
    block = {"type": "content_block_delta", "index": 0, "delta": {"text": "x "}}
    delta = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}}
    return sse(
        ("message_start", {"type": "message_start", "message": message}),
        *[("content_block_delta", block)] * 10,
        ("message_delta", {**delta, "usage": {"output_tokens": 10}}),
        ("message_stop", {"type": "message_stop"}),
    )


async def current_sglang_messages(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if not body.get("stream"):
        answer = {"id": "msg_c", "type": "message", "role": "assistant", "model": SIM_MODEL}
        answer |= {"content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn"}
        return web.json_response(answer | {"usage": CURRENT_USAGE})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(_current_sglang_stream())
    return resp


@pytest.mark.parametrize("stream", [False, True])
async def test_current_sglangs_cache_reads_are_billed_beside_its_input(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, stream: bool
) -> None:
    """h-rev8 finding 5, through the sidecar with the default `upstream.sglang_messages_usage`:
    current SGLang's input 70 beside 30 cache reads is a 100-token prompt, 30 of it cached:
    $0.093 (70 at $1000 a million, 30 at $100, 10 output at $2000). Before, the ledger had 70
    input tokens, 30 cached, and $0.063: the 30 cached tokens' full-price share unbilled."""
    run, db = await sim.start_fake(
        start_sidecar,
        aiohttp_server,
        tmp_path,
        ("/v1/messages", current_sglang_messages),
        pricing=CACHED_PRICES,
        upstream={"api": "sglang", "model_name": SIM_MODEL},
    )
    body = {"model": SIM_MODEL, "max_tokens": 10, "stream": stream}
    body["messages"] = [{"role": "user", "content": PROMPT}]
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/v1/messages", json=body, headers={"X-Tollbooth-User": "sc"}) as r,
    ):
        assert r.status == 200
        await r.read()
    rows = LEDGER + ", cost_usd"
    await wait_for(lambda: len(sim.ledger_rows(db, rows)) == 1, "the ledger row")
    ((*counts, cost),) = sim.ledger_rows(db, rows)
    assert tuple(counts) == ("sc", 100, 30, 10, "200")
    assert cost == pytest.approx(0.093)


def _sglang_stream(usage: dict[str, int] | None, tokens: int = 20) -> bytes:
    """SGLang's /v1/messages stream (anthropic/serving.py `_generate_anthropic_stream`): its
    message_start's usage is 0s (its chat stream has usage on no chunk but the usage-only one);
    at its chat stream's [DONE], message_delta's usage is that usage-only chunk's
    (`usage_info`: input = prompt_tokens, output = completion_tokens, cache reads = cached
    tokens) or, `usage_info` None when none came (the chat stream ended on an error chunk, which
    SGLang writes before its [DONE]), 0 for each."""
    zeros = {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0}
    message = {"id": "msg_s", "type": "message", "role": "assistant", "content": []}
    message |= {"model": SIM_MODEL, "usage": zeros}
    block = {"type": "content_block_delta", "index": 0}
    delta = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}}
    return sse(
        ("message_start", {"type": "message_start", "message": message}),
        ("content_block_start", {"type": "content_block_start", "index": 0}),
        *[("content_block_delta", {**block, "delta": {"text": "x "}})] * tokens,
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {**delta, "usage": zeros if usage is None else usage}),
        ("message_stop", {"type": "message_stop"}),
    )


@pytest.mark.parametrize("api", ["sglang", "vllm"])
@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        # no usage came: its 0s are placeholders, so output and input are unknown (the hold)
        (None, (None, None, None, "no_usage")),
        # a count: a prompt is never 0 tokens, so an output of 0 beside it is measured
        ({"input_tokens": 12, "output_tokens": 0, "cache_read_input_tokens": 0}, (12, 0, 0, None)),
        (
            {"input_tokens": 12, "output_tokens": 20, "cache_read_input_tokens": 0},
            (12, 20, 0, None),
        ),
    ],
)
def test_sglangs_message_delta_of_0s_is_no_count(
    api: str, usage: dict[str, int] | None, expected: tuple[Any, ...]
) -> None:
    """Before, SGLang's message_delta of 0s (no usage chunk came) was read as measured: 0 input,
    0 output for the 20 tokens the client got, free. Its 0s are the same placeholder as its
    message_start's (adb7f31): input 0 beside no cache count is no count, and the output sent
    beside it neither (vLLM's message_delta too writes 0 for each when its usage-only chunk
    has no usage: anthropic/serving.py `message_stream_converter`)."""
    data = _sglang_stream(usage)
    results = set()
    for cut in range(len(data) + 1):
        meter = open_stream(EP, api=api)
        out = meter.feed(data[:cut]) + meter.feed(data[cut:])
        tail, u = meter.finish()
        assert out + tail == data and meter.done
        results.add((u.input_tokens, u.output_tokens, u.cached_input_tokens, u.unknown_reason))
    assert results == {expected}


async def sglang_messages_stream_without_usage(request: web.Request) -> web.StreamResponse:
    """SGLang streaming /v1/messages whose chat stream sent no usage chunk: 20 text deltas, a
    message_delta of 0s (`_sglang_stream`)."""
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(_sglang_stream(None))
    return resp


async def test_sglangs_stream_without_usage_is_charged_its_hold(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """Before: the ledger had 0 input, 0 output, $0 for 20 tokens the client got, and the
    budget charged nothing. Now the usage is unknown and the budget charges the hold (the
    prompt and max_tokens 50 of output)."""
    run, db = await sim.start_fake(
        start_sidecar,
        aiohttp_server,
        tmp_path,
        ("/v1/messages", sglang_messages_stream_without_usage),
        pricing=sim.prices(SIM_MODEL),
        upstream={"api": "sglang", "model_name": SIM_MODEL},
        budgets={"user_daily_usd": 5.0},
    )
    body = {"model": SIM_MODEL, "max_tokens": 50, "stream": True}
    body["messages"] = [{"role": "user", "content": PROMPT}]
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/v1/messages", json=body, headers={"X-Tollbooth-User": "sz"}) as r,
    ):
        assert r.status == 200
        await r.read()
    rows = "input_tokens, output_tokens, cost_usd, budget_usd"
    await wait_for(lambda: len(sim.ledger_rows(db, rows)) == 1, "the ledger row")
    await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")
    ((inp, out, cost, charged),) = sim.ledger_rows(db, rows)
    assert (inp, out, cost) == (None, None, None)
    assert charged >= sim.token_cost(0, 50)
    assert run.sc.budgets.store.spent["user:sz"] / 1e6 == pytest.approx(charged)


async def current_sglang_messages_60_cached(request: web.Request) -> web.Response:
    """Current SGLang's /v1/messages answer (anthropic/response_conversion.py
    `anthropic_usage_from_openai`): a 100-token prompt with 60 cached, 10 generated, sent by
    Anthropic's rule as input 40, cache reads 60."""
    await request.read()
    answer = {"id": "msg_2", "type": "message", "role": "assistant", "model": SIM_MODEL}
    answer |= {"content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn"}
    return web.json_response(answer | {"usage": CURRENT_SGLANG_USAGE})


@pytest.mark.parametrize("rule", ["anthropic", "prompt"])
async def test_a_current_sglangs_cached_prompt_is_billed_as_measured(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, rule: str
) -> None:
    """h-rev9 finding 1, through the sidecar: a client asking max_tokens 1000 of a current SGLang
    whose answer is 100 prompt tokens (60 cached) and 10 generated, under either
    `upstream.sglang_messages_usage`. Before, under `prompt` (3d47e31's rule): invalid usage, no
    cost, and the budget charged the hold, the prompt estimate and 1000 output tokens: $2.011
    for $0.12 measured. Now 100 input tokens of which 60 cached and 10 output, charged $0.12."""
    run, db = await sim.start_fake(
        start_sidecar,
        aiohttp_server,
        tmp_path,
        ("/v1/messages", current_sglang_messages_60_cached),
        pricing=sim.prices(SIM_MODEL),
        upstream={"api": "sglang", "model_name": SIM_MODEL, "sglang_messages_usage": rule},
        budgets={"user_daily_usd": 5.0},
    )
    body = {"model": SIM_MODEL, "max_tokens": 1000}
    body["messages"] = [{"role": "user", "content": PROMPT}]
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/v1/messages", json=body, headers={"X-Tollbooth-User": "cs"}) as r,
    ):
        assert r.status == 200
        await r.read()
    await wait_for(lambda: len(sim.ledger_rows(db, LEDGER)) == 1, "the ledger row")
    await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")
    charged = run.sc.budgets.store.spent["user:cs"] / 1e6
    assert sim.ledger_rows(db, LEDGER) == [("cs", 100, 60, 10, "200")]
    assert charged == pytest.approx(sim.token_cost(100, 10))


# Ollama's /v1/messages stream (ollama anthropic/anthropic.go `StreamConverter.Process`, written
# by Go's encoding/json): message_start has no `stop_reason` member (`omitempty`), an id of "msg_"
# and 24 hex digits (`GenerateMessageID`: 12 random bytes), and as `input_tokens` the first
# chunk's `prompt_eval_count`, 0 before the last chunk, so a len/4 estimate of the request in its
# place (middleware/anthropic.go `EstimateInputTokens`); the counts come in message_delta.
OLLAMA_ID = "msg_0123456789abcdef01234567"
TEXT_A = (
    "content_block_delta",
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "a"}},
)


def _ollama_start(estimate: int, **member: Any) -> tuple[str, dict[str, Any]]:
    message = {"id": OLLAMA_ID, "type": "message", "role": "assistant", "model": "llama3.2"}
    message |= {"content": [], "usage": {"input_tokens": estimate, "output_tokens": 0}} | member
    return ("message_start", {"type": "message_start", "message": message})


def test_ollamas_message_start_input_is_an_estimate_not_a_count() -> None:
    """h-fix10: a client that left Ollama's stream before message_delta had the estimate, 12
    for a prompt of 31 tokens, recorded as its measured input. Now its input is unknown until
    message_delta counts it."""
    meter = open_stream(EP)
    meter.feed(sse(_ollama_start(12), TEXT_A))
    cut = meter.usage_so_far()  # the client left here
    assert (cut.input_tokens, cut.output_tokens, cut.unknown_reason) == (None, None, "no_usage")
    delta = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}}
    delta["usage"] = {"input_tokens": 31, "output_tokens": 5}
    meter.feed(sse(("message_delta", delta), ("message_stop", {"type": "message_stop"})))
    done = meter.finish()[1]
    assert (done.input_tokens, done.output_tokens) == (31, 5)


@pytest.mark.parametrize(
    "start",
    [
        # vLLM, llama.cpp and Anthropic write `stop_reason: null`
        _ollama_start(12, stop_reason=None, stop_sequence=None),
        _ollama_start(12, id="msg_" + "0123456789abcdef" * 2),  # SGLang's: a uuid4's 32 digits
        _ollama_start(12, id="chatcmpl-1"),
        _ollama_start(12, id=OLLAMA_ID.upper()),
    ],
)
def test_only_ollamas_message_start_is_read_as_an_estimate(start: Any) -> None:
    meter = open_stream(EP)
    meter.feed(sse(start, TEXT_A))
    assert meter.usage_so_far().input_tokens == 12
