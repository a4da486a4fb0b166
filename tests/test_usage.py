"""Usage parsing on the recorded TGI responses (tests/fixtures/tgi) and on vLLM shapes."""

from __future__ import annotations

import json
import re
from typing import Any
from unittest import mock

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.exchange import Endpoint, Usage
from sidecar.metering import counts, shape, tgi
from sidecar.metering.sse import SSEParser
from sidecar.metering.wire import (
    StreamMeter,
    inspect_request,
    open_stream,
    tokenize_requests,
    usage_from_body,
    within_request,
)
from sidecar.proxy.routes import AmbiguousPath, classify, routing_path
from tests.fakes import load_fixture


def openai_sse(events: list[dict]) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def meter_all(
    endpoint: Endpoint, wire: bytes, *, strip: bool = False, step: int = 7, choices: int = 1
):
    m = open_stream(endpoint, strip_usage=strip, choices=choices)
    out = b"".join(m.feed(wire[i : i + step]) for i in range(0, len(wire), step))
    tail, usage = m.finish()
    return out + tail, usage, m


def test_classify() -> None:
    assert classify("POST", "/v1/chat/completions") is Endpoint.CHAT
    assert classify("POST", "/v1/chat/completions/") is Endpoint.CHAT
    assert classify("POST", "/") is Endpoint.TGI_COMPAT
    assert classify("GET", "/v1/chat/completions") is None
    assert classify("POST", "/tokenize") is None


def test_tgi_chat_stream_with_usage() -> None:
    events = load_fixture("test_completion_prompts_test_chat_openai_usage.json")
    _, usage, _ = meter_all(Endpoint.CHAT, openai_sse(events))
    assert (usage.input_tokens, usage.output_tokens) == (39, 3)
    assert usage.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert usage.finish_reasons == ("stop",)


def test_tgi_chat_stream_without_usage_is_unknown() -> None:
    events = load_fixture("test_completion_prompts_test_chat_openai_nousage.json")
    _, usage, m = meter_all(Endpoint.CHAT, openai_sse(events))
    assert usage.input_tokens is None and usage.output_tokens is None
    assert usage.unknown_reason == "stream_without_usage"
    # chunks carrying text are seen (for TTFT), but never reported as tokens
    assert m.token_events == sum(1 for e in events if e["choices"][0]["delta"]["content"]) == 2


def test_stripping_removes_only_the_usage_chunk() -> None:
    events = load_fixture("test_completion_prompts_test_flash_llama_completion_stream_usage.json")
    wire = openai_sse(events)
    out, usage, _ = meter_all(Endpoint.CHAT, wire, strip=True, step=5)
    assert (usage.input_tokens, usage.output_tokens) == (40, 10)
    assert out == openai_sse(events[:-1])


def test_tgi_many_prompts_stream_sums_per_prompt_usage() -> None:
    events = load_fixture(
        "test_completion_prompts_test_flash_llama_completion_many_prompts_stream.json"
    )
    # four prompts: four choices, as the sidecar opens the meter (`RequestInfo.choices`)
    _, usage, _ = meter_all(Endpoint.COMPLETIONS, openai_sse(events), choices=4)
    expected = [e["usage"] for e in events if e.get("usage")]
    assert len(expected) == 4
    assert usage.input_tokens == sum(u["prompt_tokens"] for u in expected)
    assert usage.output_tokens == sum(u["completion_tokens"] for u in expected) == 40


def test_tool_call_stream_chunks_are_not_tokens() -> None:
    events = load_fixture(
        "test_tools_llama_test_flash_llama_grammar_tools_sea_creatures_stream_auto.json"
    )
    _, usage, m = meter_all(Endpoint.CHAT, openai_sse(events))
    assert m.token_events == 20 and usage.output_tokens is None


@pytest.mark.parametrize(
    "name,inp,out",
    [
        ("test_chat_llama_test_flash_llama_simple.json", 61, 100),
        ("test_completion_prompts_test_flash_llama_completion_single_prompt.json", 6, 10),
        ("test_completion_prompts_test_flash_llama_completion_many_prompts.json", 22, 40),
    ],
)
def test_non_streaming_openai_bodies(name: str, inp: int, out: int) -> None:
    body = load_fixture(name)
    usage = usage_from_body(Endpoint.COMPLETIONS, json.dumps(body).encode(), {})
    assert (usage.input_tokens, usage.output_tokens) == (inp, out)
    assert usage.model == body["model"]


def test_tgi_generate_headers_then_details() -> None:
    body = json.dumps(load_fixture("test_flash_llama_test_flash_llama_simple.json")).encode()
    with_headers = usage_from_body(
        Endpoint.TGI_GENERATE, body, {"x-prompt-tokens": "4", "x-generated-tokens": "10"}
    )
    assert (with_headers.input_tokens, with_headers.output_tokens) == (4, 10)
    only_body = usage_from_body(Endpoint.TGI_GENERATE, body, {})
    assert only_body.output_tokens == 10 and only_body.input_tokens is None
    mpt = json.dumps(load_fixture("test_mpt_test_mpt.json")).encode()
    prefill = usage_from_body(Endpoint.TGI_GENERATE, mpt, {})
    assert (prefill.input_tokens, prefill.output_tokens) == (5, 17)


def test_tgi_generate_stream_counts_events_and_reads_input_length() -> None:
    events = [
        {
            "index": i,
            "token": {"id": i, "text": "x", "special": False},
            "generated_text": None,
            "details": None,
        }
        for i in range(1, 4)
    ]
    events[-1]["details"] = {"finish_reason": "length", "generated_tokens": 3, "input_length": 9}
    events[-1]["generated_text"] = "xxx"
    wire = b"".join(f"data:{json.dumps(e)}\n\n".encode() for e in events)
    _, usage, m = meter_all(Endpoint.TGI_GENERATE_STREAM, wire)
    assert (usage.input_tokens, usage.output_tokens) == (9, 3) and m.done
    no_details = wire.replace(
        b'"details": {"finish_reason": "length", "generated_tokens": 3, "input_length": 9}',
        b'"details": null',
    )
    _, usage, _ = meter_all(Endpoint.TGI_GENERATE_STREAM, no_details)
    assert usage.output_tokens == 3 and usage.input_tokens is None
    assert usage.unknown_reason == "no_input_length"


def test_tgi_stream_error_event() -> None:
    wire = (
        b'data:{"index":1,"token":{"id":1,"text":"a","special":false}}\n\n'
        b'data:{"error":"Request failed during generation","error_type":"generation"}\n\n'
    )
    _, usage, _ = meter_all(Endpoint.TGI_GENERATE_STREAM, wire)
    assert usage.error == "generation" and usage.output_tokens == 1


def test_vllm_error_event_inside_stream() -> None:
    wire = (
        b'data: {"id":"x","model":"m","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
        b'data: {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}\n\n'
        b"data: [DONE]\n\n"
    )
    _, usage, _ = meter_all(Endpoint.CHAT, wire)
    assert usage.error == "InternalServerError"


def test_inject_respects_explicit_choices() -> None:
    body = (
        b'{"model":"m","stream":true,'
        b'"stream_options":{"include_usage":false,"continuous_usage_stats":false}}'
    )
    info = inspect_request(Endpoint.CHAT, body, inject_usage=True)
    assert info.injected_usage
    assert json.loads(info.body)["stream_options"] == {
        "include_usage": True,
        "continuous_usage_stats": False,
    }
    asked = b'{"model":"m","stream":true,"stream_options":{"include_usage":true}}'
    assert not inspect_request(Endpoint.CHAT, asked, inject_usage=True).injected_usage
    assert not inspect_request(
        Endpoint.EMBEDDINGS, b'{"stream":true}', inject_usage=True
    ).injected_usage
    off = inspect_request(Endpoint.CHAT, b'{"stream":true}', inject_usage=False)
    assert off.body == b'{"stream":true}'


def test_request_fields() -> None:
    tgi = inspect_request(
        Endpoint.TGI_GENERATE,
        b'{"inputs":"abc","parameters":{"max_new_tokens":7,"temperature":0.5}}',
        inject_usage=True,
    )
    assert (tgi.max_tokens, tgi.temperature, tgi.prompt_chars) == (7, 0.5, 3)
    chat = inspect_request(
        Endpoint.CHAT,
        json.dumps(
            {
                "model": "m",
                "max_completion_tokens": 9,
                "messages": [{"role": "user", "content": "hey"}],
                "tools": [{}, {}],
            }
        ).encode(),
        inject_usage=True,
    )
    assert (chat.max_tokens, chat.tools, chat.messages, chat.prompt_chars) == (9, 2, 1, 3)


@pytest.mark.parametrize(
    ("body", "choices"),
    [
        ({"prompt_embeds": "AAAA"}, 1),
        ({"prompt_embeds": ["AAAA", "BBBB"]}, 2),
        ({"prompt_embeds": ["AAAA", "BBBB"], "n": 2}, 4),
        ({"prompt_embeds": ["AAAA"], "prompt": ["a", "b"]}, 3),  # the embeds, then the texts
        ({"prompt_embeds": "AAAA", "prompt": "a"}, 2),
        ({"prompt_embeds": "AAAA", "prompt": [1, 2, 3]}, 2),  # token ids: one prompt
    ],
)
def test_prompt_embeds_are_prompts(body: dict[str, Any], choices: int) -> None:
    """vLLM's /v1/completions takes `prompt_embeds` as one base64 tensor or a list, one prompt
    each, beside `prompt`'s (CompletionRequest). Before, `prompt` alone was read: two tensors
    were one choice, so the second's chunks were stray and its output over one choice's cap
    invalid usage (charged the hold of one)."""
    sent = json.dumps({"model": "m", "max_tokens": 5, "stream": True, **body}).encode()
    info = inspect_request(Endpoint.COMPLETIONS, sent, inject_usage=True)
    assert info.choices == choices
    both = Usage(input_tokens=8, output_tokens=5 * choices)  # each generated its 5 tokens
    assert within_request(both, info).unknown_reason is None


def _usage_only(prompt: int, out: int) -> bytes:
    usage = {"prompt_tokens": prompt, "completion_tokens": out}
    return b"data: " + json.dumps({"id": "c", "choices": [], "usage": usage}).encode() + b"\n\n"


def _choice(index: int, **choice: Any) -> bytes:
    chunk = {"id": "c", "model": "m", "choices": [{"index": index, **choice}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize(
    ("endpoint", "choices", "wire", "expected"),
    [
        # llama.cpp's n=2 chat stream: each completion's finish chunk, then a usage-only chunk
        # of its own counts
        (Endpoint.CHAT, 2, [0, (5, 28), 1, (5, 40)], (5, 68, None)),
        (Endpoint.CHAT, 2, [0, 1, (5, 68)], (5, 68, None)),  # vLLM's: one, the totals
        (Endpoint.CHAT, 2, [0, 1, (5, 68), (5, 68)], (5, 68, None)),  # ... sent again
        # no choice finished since the usage-only chunk before: it repeats that one
        (Endpoint.CHAT, 2, [0, (5, 28), (5, 28), 1, (5, 40)], (5, 68, None)),
        # the choices share one prompt: its largest count, once
        (Endpoint.CHAT, 3, [0, (5, 1), 1, (6, 2), 2, (5, 3)], (6, 6, None)),
        # a completion's parts may each be another prompt's: the inputs add up
        (Endpoint.COMPLETIONS, 2, [0, (5, 28), 1, (7, 40)], (12, 68, None)),
        # more parts than choices: which repeat another cannot be told
        (Endpoint.CHAT, 2, [(5, 1), 0, (5, 28), 1, (5, 40)], (None, None, "invalid_usage")),
        # one choice: a repeated final word replaces the one before (3b3c617)
        (Endpoint.CHAT, 1, [0, (5, 40), (5, 40)], (5, 40, None)),
    ],
)
def test_usage_only_chunks_of_several_choices_add_up_on_both_paths(
    endpoint: Endpoint,
    choices: int,
    wire: list[int | tuple[int, int]],
    expected: tuple[int | None, int | None, str | None],
    fast: bool,
) -> None:
    """Before, a usage-only chunk replaced the one before whatever the choices, so llama.cpp's
    n=2 stream was billed its last completion's 40 tokens of 68 (both paths). `wire`: a choice's
    finish chunk (its index) or a usage-only chunk (input, output), in order."""
    text = "delta" if endpoint is Endpoint.CHAT else "text"
    out = {"delta": {"content": "a"}} if text == "delta" else {"text": "a"}
    data = b"".join(_choice(i, **out) for i in range(choices))
    for item in wire:
        if isinstance(item, int):
            data += _choice(item, finish_reason="stop", **out)
        else:
            data += _usage_only(*item)
    meter = open_stream(endpoint, fast=fast, choices=choices, strip_usage=True)
    meter.feed(data + b"data: [DONE]\n\n")
    u = meter.finish()[1]
    assert (u.input_tokens, u.output_tokens, u.unknown_reason) == expected


def _n2_chat_prefix(long_so_far: int, short: int = 10) -> bytes:
    """llama.cpp's n=2 chat stream (`to_json_oaicompat_chat_stream`, each completion its own
    task) up to the short completion's usage-only chunk: completion 1 ended with `short`
    tokens, completion 0 has `long_so_far` and still generates."""
    data = b""
    for step in range(max(short, long_so_far)):
        if step < long_so_far:
            data += _choice(0, delta={"content": "x "}, finish_reason=None)
        if step < short:
            data += _choice(1, delta={"content": "x "}, finish_reason=None)
        if step == short - 1:
            data += _choice(1, delta={}, finish_reason="stop") + _usage_only(5, short)
    return data


@pytest.mark.parametrize("fast", [True, False])
def test_fewer_usage_only_chunks_than_choices_count_only_after_done(fast: bool) -> None:
    """n=2: llama.cpp sends each completion's usage-only chunk as that completion ends, the other
    still generating. Before, the first one (5 in / 10 out) was read as the request's measured
    usage: a client (or an upstream) leaving there was billed it, completion 0's 30 tokens free.
    Fewer parts than choices are the request's only once [DONE] came (vLLM's one chunk of the
    totals, right before it); all the parts count without it."""
    meter = open_stream(Endpoint.CHAT, fast=fast, choices=2)
    meter.feed(_n2_chat_prefix(30))
    left = meter.usage_so_far()
    assert (left.input_tokens, left.output_tokens) == (None, None)
    assert left.unknown_reason == "incomplete_usage"
    assert meter.finish()[1].unknown_reason == "incomplete_usage"  # the upstream ended there
    # both parts, no [DONE] yet: measured
    meter = open_stream(Endpoint.CHAT, fast=fast, choices=2)
    meter.feed(_n2_chat_prefix(40) + _choice(0, delta={}, finish_reason="stop"))
    meter.feed(_usage_only(5, 40))
    u = meter.usage_so_far()
    assert (u.input_tokens, u.output_tokens, u.unknown_reason) == (5, 50, None)
    # vLLM's one chunk of the totals: unknown until [DONE], then the totals
    meter = open_stream(Endpoint.CHAT, fast=fast, choices=2)
    finishes = b"".join(_choice(i, delta={}, finish_reason="stop") for i in (0, 1))
    meter.feed(finishes + _usage_only(5, 68))
    assert meter.usage_so_far().unknown_reason == "incomplete_usage"
    meter.feed(b"data: [DONE]\n\n")
    u = meter.finish()[1]
    assert (u.input_tokens, u.output_tokens, u.unknown_reason) == (5, 68, None)


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_usage_only_chunks_of_two_choices_agree_on_both_paths_at_every_cut(parts: int) -> None:
    """n=2 and one (vLLM's totals, after both finish chunks), two (llama.cpp's parts, each
    after its completion's finish chunk) or three (the last part sent again) usage-only chunks,
    the wire cut at every byte: the same bytes for the client, the same usage so far after each
    piece (before [DONE] as after it), the same finish, on the fast and the reference path."""
    wire = b"".join(_choice(i, delta={"content": "x "}, finish_reason=None) for i in (0, 1))
    finish = [_choice(i, delta={}, finish_reason="stop") for i in (1, 0)]
    if parts == 1:
        wire += b"".join(finish) + _usage_only(5, 50)
    else:
        wire += finish[0] + _usage_only(5, 10) + finish[1]
        wire += _usage_only(5, 40) * (parts - 1)
    wire += b"data: [DONE]\n\n"
    for strip in (False, True):
        for cut in range(len(wire) + 1):
            fast = open_stream(Endpoint.CHAT, fast=True, choices=2, strip_usage=strip)
            ref = open_stream(Endpoint.CHAT, fast=False, choices=2, strip_usage=strip)
            for piece in (wire[:cut], wire[cut:]):
                assert fast.feed(piece) == ref.feed(piece), (strip, cut)
                assert fast.usage_so_far() == ref.usage_so_far(), (strip, cut)
            assert fast.finish() == ref.finish(), (strip, cut)
    meter = open_stream(Endpoint.CHAT, fast=False, choices=2)
    meter.feed(wire)
    u = meter.finish()[1]
    assert (u.input_tokens, u.output_tokens, u.unknown_reason) == (5, 50, None)


def test_role_only_first_chunk_is_not_a_token() -> None:
    role = {
        "id": "c",
        "model": "m",
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        ],
    }
    token = {
        "id": "c",
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}],
    }
    m = open_stream(Endpoint.CHAT)
    m.feed(openai_sse([role])[: -len(b"data: [DONE]\n\n")])
    assert m.token_events == 0
    m.feed(f"data: {json.dumps(token)}\n\n".encode())
    assert m.token_events == 1


# --- billing integrity (issue 10) and bodies that must never be corrupted (issue 13) -------------

_PYDANTIC_BOOL = pydantic.TypeAdapter(bool | None)  # what vLLM's request models do with `stream`

json_scalars = st.one_of(
    st.booleans(),
    st.none(),
    st.integers(-3, 3),
    st.sampled_from([0.0, 1.0, 1.5, -1.0]),
    st.sampled_from(["true", "TRUE", "True", "1", "yes", "Yes", "on", "ON", "t", "T", "y", "Y"]),
    st.sampled_from(["false", "0", "no", "off", "f", "n", "", " true", "true ", "2", "tru"]),
    st.text(max_size=5),
)


def _vllm_reads_true(value: object) -> bool:
    try:
        return _PYDANTIC_BOOL.validate_python(value) is True
    except pydantic.ValidationError:
        return False


@settings(max_examples=300)
@given(json_scalars)
def test_stream_flag_is_read_as_vllm_reads_it(value: object) -> None:
    body = json.dumps({"model": "m", "stream": value}).encode()
    for endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES):
        info = inspect_request(endpoint, body, inject_usage=True)
        assert info.stream is _vllm_reads_true(value), (endpoint, value)
        if endpoint is not Endpoint.RESPONSES:
            assert info.injected_usage is info.stream
    # TGI's native routes take only a JSON boolean (serde), whatever the string says
    tgi = inspect_request(Endpoint.TGI_COMPAT, body, inject_usage=True)
    assert tgi.stream is (value is True)


@pytest.mark.parametrize("value", ["true", "1", "yes", "on", "t", "y", "TRUE", 1, 1.0])
def test_lax_stream_gets_usage_injected_and_metered(value: object) -> None:
    body = json.dumps({"model": "m", "stream": value}).encode()
    info = inspect_request(Endpoint.CHAT, body, inject_usage=True)
    assert info.stream and info.injected_usage
    assert json.loads(info.body)["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    "raw,expected",
    [
        ("/v1/chat/completions", "/v1/chat/completions"),
        ("/v1/chat/completions/", "/v1/chat/completions"),
        ("/v1/./chat/completions", "/v1/chat/completions"),
        ("/v1/x/../chat/completions", "/v1/chat/completions"),
        ("//v1//chat///completions", "/v1/chat/completions"),
        ("/v1/%2e/chat/completions", "/v1/chat/completions"),
        ("/v1/%2E%2E/v1/chat/completions", "/v1/chat/completions"),
        ("/v1/%63hat/completions", "/v1/chat/completions"),
        ("/../../../v1/completions", "/v1/completions"),
        ("/invocations/.", "/invocations"),
        ("/", "/"),
        ("/a%20b", "/a b"),
        ("/%252F", "/%2F"),  # decoded once, as the servers do: a literal '%2F', not a slash
    ],
)
def test_routing_path_normalises(raw: str, expected: str) -> None:
    assert routing_path(raw) == expected


@pytest.mark.parametrize(
    "raw",
    ["/v1/chat%2Fcompletions", "/v1%2fchat/completions", "/v1/%5Cchat", "/a%00", "/%0a", "/%ff"],
)
def test_ambiguous_paths_are_refused(raw: str) -> None:
    with pytest.raises(AmbiguousPath):
        routing_path(raw)


def test_classify_new_routes() -> None:
    assert classify("POST", "/invocations") is Endpoint.INVOCATIONS
    assert classify("POST", "/vertex") is Endpoint.TGI_VERTEX
    assert classify("POST", "/v1/messages") is Endpoint.MESSAGES
    assert classify("POST", "/v1/messages/count_tokens") is None  # a free route: forwarded


@pytest.mark.parametrize(
    "body,api,expected",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "vllm", Endpoint.CHAT),
        # which route serves a body with two shapes depends on which validation fails: refused
        ({"messages": [], "prompt": "x"}, "vllm", None),
        ({"messages": "not a list", "prompt": "x"}, "vllm", None),
        ({"prompt": "x"}, "vllm", Endpoint.COMPLETIONS),
        ({"prompt": [1, 2, 3]}, "vllm", Endpoint.COMPLETIONS),
        ({"input": "x"}, "vllm", Endpoint.EMBEDDINGS),
        ({"inputs": "x", "messages": []}, "vllm", Endpoint.CHAT),
        ({"inputs": "x", "messages": []}, "tgi", None),  # TGI serves it as chat if seed = -1
        ({"messages": []}, "tgi", Endpoint.CHAT),
        ({"query": "x", "documents": []}, "vllm", Endpoint.OTHER),
    ],
)
def test_invocations_dispatch_by_body_shape(
    body: dict, api: str, expected: Endpoint | None
) -> None:
    info = inspect_request(
        Endpoint.INVOCATIONS, json.dumps(body).encode(), inject_usage=True, api=api
    )
    if expected is None:
        assert info.ambiguous and info.endpoint is Endpoint.OTHER
    else:
        assert info.endpoint is expected and info.ambiguous is None


def test_invocations_stream_is_injected_like_its_route() -> None:
    body = b'{"messages":[{"role":"user","content":"a b"}],"stream":"true"}'
    info = inspect_request(Endpoint.INVOCATIONS, body, inject_usage=True)
    assert (info.endpoint, info.stream, info.injected_usage) == (Endpoint.CHAT, True, True)
    unknown = inspect_request(Endpoint.INVOCATIONS, b"not json", inject_usage=True)
    assert unknown.endpoint is Endpoint.OTHER and unknown.body == b"not json"


def test_vertex_request_and_response() -> None:
    body = json.dumps(
        {
            "instances": [
                {"inputs": "a b c", "parameters": {"max_new_tokens": 3}},
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            ]
        }
    ).encode()
    info = inspect_request(Endpoint.TGI_VERTEX, body, inject_usage=True)
    # one limit (the largest) for each of the instances: estimates multiply it by them
    assert (info.stream, info.max_tokens, info.n, info.choices) == (False, 4, 2, 2)
    assert info.body == body
    usage = usage_from_body(Endpoint.TGI_VERTEX, b'{"predictions":["x","y"]}', {})
    assert usage.input_tokens is None and usage.unknown_reason == "no_usage"
    calls = tokenize_requests(info, "tgi")
    assert calls is not None and [p for p, _ in calls] == ["/tokenize", "/chat_tokenize"]


@pytest.mark.parametrize("instances", ["1.0", "true", "null", '"ab"', '{"inputs": "x"}'])
def test_vertex_instances_that_are_no_list_are_none(instances: str) -> None:
    """TGI refuses such a body (422); the sidecar forwards it, reading no instance from it."""
    body = ('{"instances": ' + instances + "}").encode()
    info = inspect_request(Endpoint.TGI_VERTEX, body, inject_usage=True)
    assert (info.body, info.n, info.choices, info.max_tokens) == (body, 1, 1, None)


def test_injection_never_reserialises_the_body() -> None:
    body = (
        b'{"model": "m", "stream": true,  "temperature": 1e999, "x": "caf\\u00e9 \xc3\xa9",\n'
        b' "stream_options": {"include_usage": false, "other": [1, 2.50]}}'
    )
    info = inspect_request(Endpoint.CHAT, body, inject_usage=True)
    assert info.body == body.replace(b'"include_usage": false', b'"include_usage": true'), (
        "only the value changes: 1e999, the escapes, spacing and key order survive"
    )
    null_opts = b'{"stream":true,"stream_options":null,"n":1E400}'
    assert (
        inspect_request(Endpoint.CHAT, null_opts, inject_usage=True).body
        == b'{"stream":true,"stream_options":{"include_usage":true},"n":1E400}'
    )
    dup = b'{"stream":true,"stream_options":{"x":1},"stream_options":{}}'
    assert (  # the server keeps the last of a repeated key: that is the one edited
        inspect_request(Endpoint.CHAT, dup, inject_usage=True).body
        == b'{"stream":true,"stream_options":{"x":1},"stream_options":{"include_usage":true}}'
    )


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32", "latin-1"])
def test_only_utf8_json_objects_are_changed(encoding: str) -> None:
    body = '{"model":"m","stream":true,"prompt":"caf\u00e9"}'.encode(encoding)
    info = inspect_request(Endpoint.COMPLETIONS, body, inject_usage=True, continuous_usage=True)
    assert info.body == body and not info.injected_usage and not info.utf8


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"])
@pytest.mark.parametrize("options", ["", ',"stream_options":{"include_usage":false}'])
def test_a_body_in_another_encoding_is_never_changed_even_when_its_bytes_are_utf8(
    encoding: str, options: str
) -> None:
    """ASCII in UTF-16 or UTF-32 without a BOM is valid UTF-8 too (its NULs are characters), but
    the server reads it, by the NULs in its first four bytes, as UTF-16 or UTF-32. Spliced as
    UTF-8 text, a body the server accepts became one it refuses; with stream_options, unchanged
    but its stream's usage unknown as "stream_without_usage", not "body_not_utf8"."""
    body = ('{"model":"m","stream":true,"prompt":"hi"' + options + "}").encode(encoding)
    body.decode("utf-8")  # no UnicodeDecodeError
    assert json.loads(body)["stream"] is True  # what the server reads
    info = inspect_request(Endpoint.COMPLETIONS, body, inject_usage=True, continuous_usage=True)
    assert info.body == body and not info.injected_usage and not info.utf8
    assert info.parsed and info.stream


def test_continuous_usage_requested_without_changing_what_was_asked() -> None:
    def opts(body: bytes) -> tuple[dict, bool, bool]:
        info = inspect_request(Endpoint.CHAT, body, inject_usage=True, continuous_usage=True)
        return (
            json.loads(info.body).get("stream_options"),
            info.injected_usage,
            info.strip_chunk_usage,
        )

    both = {"include_usage": True, "continuous_usage_stats": True}
    assert opts(b'{"stream":true}') == (both, True, True)
    # asked for the final usage only: keep that chunk, cut the running totals
    assert opts(b'{"stream":true,"stream_options":{"include_usage":true}}') == (
        {"continuous_usage_stats": True, "include_usage": True},
        False,
        True,
    )
    # asked for running totals but include_usage false: vLLM would send no usage at all
    assert opts(
        b'{"stream":true,"stream_options":{"include_usage":false,"continuous_usage_stats":true}}'
    ) == (both, True, True)
    # asked for everything: nothing changes
    asked = b'{"stream":true,"stream_options":{"include_usage":"yes","continuous_usage_stats":1}}'
    info = inspect_request(Endpoint.CHAT, asked, inject_usage=True, continuous_usage=True)
    assert info.body == asked and not info.injected_usage and not info.strip_chunk_usage
    # without continuous_usage, a client's own continuous_usage_stats under include_usage:false
    # still makes vLLM send per-chunk usage once we ask for usage: it is cut out again
    info = inspect_request(
        Endpoint.CHAT,
        b'{"stream":true,"stream_options":{"include_usage":false,"continuous_usage_stats":true}}',
        inject_usage=True,
    )
    assert info.injected_usage and info.strip_chunk_usage


def test_per_chunk_usage_a_client_did_not_ask_for_is_cut_without_continuous_usage() -> None:
    """Without continuous_usage we ask for include_usage alone; Ollama's /v1/completions then
    puts a zero `usage` on every chunk (middleware/openai.go CompleteWriter), which a client
    that asked for no usage would never have seen: cut, as the usage chunk is dropped."""
    info = inspect_request(Endpoint.COMPLETIONS, b'{"stream":true}', inject_usage=True)
    assert json.loads(info.body)["stream_options"] == {"include_usage": True}
    assert info.injected_usage and info.strip_chunk_usage
    zero = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    chunk = {"id": "c", "object": "text_completion", "model": "m"}
    events = [
        {**chunk, "choices": [{"index": 0, "text": t, "finish_reason": None}], "usage": zero}
        for t in ("a", "b")
    ]
    totals = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    events.append({**chunk, "choices": [], "usage": totals})
    wire = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    for fast in (True, False):
        m = open_stream(
            Endpoint.COMPLETIONS,
            strip_usage=info.injected_usage,
            strip_chunk_usage=info.strip_chunk_usage,
            fast=fast,
        )
        out = m.feed(wire)
        tail, usage = m.finish()
        sent = [json.loads(e[6:]) for e in (out + tail).split(b"\n\n") if e[:7] == b"data: {"]
        assert sent == [{k: v for k, v in e.items() if k != "usage"} for e in events[:2]]
        assert (usage.input_tokens, usage.output_tokens) == (3, 2)
    # asked for include_usage alone: what the server sends on each chunk is the client's
    asked = b'{"stream":true,"stream_options":{"include_usage":true}}'
    assert not inspect_request(Endpoint.COMPLETIONS, asked, inject_usage=True).strip_chunk_usage


def _chunk(i: int, usage: dict | None, finish: str | None = None) -> dict:
    c: dict = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": finish}],
    }
    if usage is not None:
        c["usage"] = usage
    return c


def _running(i: int) -> dict:
    return {"prompt_tokens": 7, "total_tokens": 7 + i, "completion_tokens": i}


def _compact_sse(events: list[dict]) -> bytes:
    return b"".join(
        b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events
    )


@settings(max_examples=60)
@given(st.integers(1, 40))
def test_running_usage_is_cut_out_byte_for_byte(step: int) -> None:
    n = 5
    final = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [],
    }
    with_usage = [_chunk(i, _running(i + 1), "length" if i == n - 1 else None) for i in range(n)]
    wire = _compact_sse([*with_usage, {**final, "usage": _running(n)}]) + b"data: [DONE]\n\n"
    plain = _compact_sse([_chunk(i, None, "length" if i == n - 1 else None) for i in range(n)])
    m = open_stream(Endpoint.CHAT, strip_usage=True, strip_chunk_usage=True)
    out = b"".join(m.feed(wire[i : i + step]) for i in range(0, len(wire), step))
    tail, usage = m.finish()
    assert out + tail == plain + b"data: [DONE]\n\n"  # what vLLM sends when nobody asked
    assert (usage.input_tokens, usage.output_tokens) == (7, 5)
    # a client that asked for the final usage keeps that chunk, and only that
    keep = open_stream(Endpoint.CHAT, strip_chunk_usage=True)
    out = b"".join(keep.feed(wire[i : i + step]) for i in range(0, len(wire), step))
    assert out + keep.finish()[0] == (
        plain + _compact_sse([{**final, "usage": _running(n)}]) + b"data: [DONE]\n\n"
    )


def test_usage_so_far_and_finished() -> None:
    m = open_stream(Endpoint.CHAT, strip_usage=True, strip_chunk_usage=True)
    m.feed(_compact_sse([_chunk(0, _running(2)), _chunk(1, _running(4))]))
    assert not m.finished
    usage = m.usage_so_far()
    assert (usage.input_tokens, usage.output_tokens) == (7, 4)  # exact up to the last chunk
    m.feed(_compact_sse([_chunk(2, _running(5), "stop")]))
    assert m.finished and not m.done  # generation over, the usage chunk still to come
    plain = open_stream(Endpoint.CHAT, choices=2)
    plain.feed(_compact_sse([_chunk(0, None, "stop")]))
    assert not plain.finished  # n=2: the other choice is still generating
    assert plain.usage_so_far().output_tokens is None


def test_responses_body_with_null_error_is_not_a_failure() -> None:
    body = {
        "id": "resp_1",
        "object": "response",
        "status": "completed",
        "model": "m",
        "error": None,
        "incomplete_details": None,
        "output": [],
        "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5},
    }
    usage = usage_from_body(Endpoint.RESPONSES, json.dumps(body).encode(), {})
    assert usage.error is None and (usage.input_tokens, usage.output_tokens) == (3, 2)
    failed = {**body, "status": "failed", "error": {"code": "server_error", "message": "x"}}
    assert usage_from_body(Endpoint.RESPONSES, json.dumps(failed).encode(), {}).error


def test_tokenize_requests_carry_the_template_inputs() -> None:
    chat = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "a"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "chat_template_kwargs": {"enable_thinking": False},
            "max_tokens": 3,
            "stream": True,
        }
    ).encode()
    info = inspect_request(Endpoint.CHAT, chat, inject_usage=True)
    ((path, body),) = tokenize_requests(info, "vllm") or []
    assert path == "/tokenize"
    assert set(json.loads(body)) == {"model", "messages", "tools", "chat_template_kwargs"}
    completion = inspect_request(
        Endpoint.COMPLETIONS, b'{"model":"m","prompt":["a b"]}', inject_usage=True
    )
    ((path, body),) = tokenize_requests(completion, "vllm") or []
    assert json.loads(body) == {"model": "m", "prompt": "a b"}
    batch = inspect_request(Endpoint.COMPLETIONS, b'{"prompt":["a","b"]}', inject_usage=True)
    assert tokenize_requests(batch, "vllm") is None  # not one prompt: not counted


def test_running_usage_is_cut_whatever_the_content_or_spacing() -> None:
    tricky = _chunk(0, _running(1))
    tricky["choices"][0]["delta"]["content"] = 'data: ,"usage":{"x":1}}\n}'
    spaced = json.dumps(_chunk(1, _running(2)))  # not vLLM's compact form: the slow path
    wire = _compact_sse([tricky]) + f"data: {spaced}\r\n\r\n".encode()
    m = open_stream(Endpoint.CHAT, strip_chunk_usage=True)
    out = m.feed(wire)
    first, second = out.split(b"\n\n", 1)
    assert first + b"\n\n" == _compact_sse([{k: v for k, v in tricky.items() if k != "usage"}])
    assert second == b"data: " + json.dumps(_chunk(1, None)).encode() + b"\r\n\r\n"
    assert m.usage_so_far().output_tokens == 2


def test_tgi_tokenize_requests() -> None:
    chat = inspect_request(
        Endpoint.CHAT, b'{"messages":[{"role":"user","content":"a"}]}', inject_usage=False
    )
    assert tokenize_requests(chat, "tgi") == [("/chat_tokenize", chat.body)]
    comp = inspect_request(Endpoint.COMPLETIONS, b'{"prompt":"a b"}', inject_usage=False)
    assert tokenize_requests(comp, "tgi") == [("/tokenize", b'{"inputs": "a b"}')]
    native = inspect_request(
        Endpoint.TGI_GENERATE_STREAM,
        b'{"inputs":"a b","parameters":{"truncate":8,"max_new_tokens":3}}',
        inject_usage=False,
    )
    ((path, body),) = tokenize_requests(native, "tgi") or []
    assert path == "/tokenize" and json.loads(body)["parameters"]["truncate"] == 8


def test_responses_stream_is_finished_between_output_items() -> None:
    def ev(kind: str) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind})}\n\n".encode()

    m = open_stream(Endpoint.RESPONSES)
    m.feed(ev("response.created") + ev("response.output_text.delta"))
    assert not m.finished
    m.feed(ev("response.output_text.done") + ev("response.output_item.done"))
    assert m.finished and not m.done  # the usage rides on response.completed, still to come


# --- the fast paths against the general path (every event decoded) -------------------------------


def meter_pair(
    endpoint: Endpoint, strip: bool, strip_chunk: bool = False
) -> tuple[StreamMeter, StreamMeter]:
    def meter(fast: bool) -> StreamMeter:
        return open_stream(endpoint, strip_usage=strip, strip_chunk_usage=strip_chunk, fast=fast)

    # fast=False: the adapter's reference path alone (the line-by-line SSE parser, every event
    # decoded), the meter the fast paths must equal
    return meter(True), meter(False)


def run_pair(
    endpoint: Endpoint, wire: bytes, cuts: list[int], strip: bool, strip_chunk: bool = False
) -> Usage:
    """Feed both meters the same pieces; after every piece they agree on the bytes for the client
    and the token events (TTFT is read there); at the end, on usage and `done`, and on what a
    client leaving at that point would be billed."""
    fast, ref = meter_pair(endpoint, strip, strip_chunk)
    last = 0
    for c in [*sorted(set(cuts)), len(wire)]:
        out = fast.feed(wire[last:c])
        assert out == ref.feed(wire[last:c]), (wire, cuts, c)
        assert fast.token_events == ref.token_events, (wire, cuts, c)
        assert fast.usage_so_far() == ref.usage_so_far(), (wire, cuts, c)
        last = c
    got = fast.finish()
    assert got == ref.finish() and fast.done == ref.done
    return got[1]


def boundaries(wire: bytes) -> list[int]:
    """Where each event ends: the cuts a server's one write per event makes (where the wire fast
    path starts reading)."""
    return [m.end() for m in re.finditer(rb"\n\n", wire)]


def compact(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"))


def chunk(text: object, *, finish: str | None = None, **extra: object) -> dict:
    delta = {"content": text} if text is not None else {}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        **extra,
    }


VLLM_STREAM = [
    {**chunk(""), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    chunk("Hello"),
    chunk(" x"),
    chunk("y"),
    chunk(""),
    chunk('say "hi"\n'),
    chunk("\\"),
    chunk("caf\u00e9 \u2028"),
    chunk("\x01"),
    chunk(" world", finish="stop"),
    {**chunk(None), "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9}},
]


def running(tokens: int) -> dict[str, int]:
    """vLLM's running totals, in its field order."""
    return {"prompt_tokens": 3, "total_tokens": 3 + tokens, "completion_tokens": tokens}


def sse_of(datas: list[str], sep: str = " ") -> bytes:
    return b"".join(f"data:{sep}{d}\n\n".encode() for d in datas) + b"data: [DONE]\n\n"


def test_fast_path_agrees_at_every_cut_and_every_pair_of_cuts_near_the_markers() -> None:
    """vLLM's shape: one cut anywhere; two cuts anywhere within 5 bytes of a marker the fast
    paths look for (the text's opening and closing quote, `\\n\\n`, `data:`)."""
    wire = sse_of([compact(e) for e in VLLM_STREAM])
    markers = [
        i
        for i in range(len(wire))
        if wire.startswith((b'"content":"', b'"},', b"\n\n", b"data:"), i)
    ]
    near = sorted({p for m in markers for p in range(m - 5, m + 6) if 0 <= p <= len(wire)})
    whole = run_pair(Endpoint.CHAT, wire, [], False)
    assert (whole.input_tokens, whole.output_tokens, whole.finish_reasons) == (3, 9, ("stop",))
    for a in range(len(wire) + 1):
        run_pair(Endpoint.CHAT, wire, [a], True)
    for i, a in enumerate(near):
        for b in near[i : i + 12]:
            run_pair(Endpoint.CHAT, wire, [a, b], a % 2 == 0)


def test_the_shape_is_learnt_and_used() -> None:
    """Not a speed test: the fast path is taken for plain tokens, and only for them."""
    wire = sse_of([compact(e) for e in VLLM_STREAM])
    m = open_stream(Endpoint.CHAT)
    calls = []
    real = json.loads
    with mock.patch.object(json, "loads", lambda s: calls.append(s) or real(s)):
        m.feed(wire)
    decoded = [c for c in calls if isinstance(c, str) and '"content":"x"' not in c]
    # the role chunk and "Hello" are decoded (learning), " x", "y" and "" are not; the rest
    # (quote and newline, backslash, U+2028, a control character, the finish, usage) are
    assert len(decoded) == len(VLLM_STREAM) - 3
    assert m.token_events == 8


RUNNING_STREAM = [
    {**chunk(""), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    *(chunk(t, usage=running(i)) for i, t in enumerate(["Hello", " x", "y", "", "caf\u00e9"])),
    chunk('say "hi"', usage=running(6)),
    chunk(" world", finish="stop", usage=running(7)),
    {**chunk(None), "choices": [], "usage": running(7)},
]


def test_running_usage_is_cut_the_same_at_every_cut_near_the_markers() -> None:
    """vLLM's running totals, asked for by us (cut out) or by the client (kept)."""
    wire = sse_of([compact(e) for e in RUNNING_STREAM])
    markers = [
        i
        for i in range(len(wire))
        if wire.startswith((b'"content":"', b',"usage":', b"}\n\n", b"data:"), i)
    ]
    near = sorted({p for m in markers for p in range(m - 3, m + 4) if 0 <= p <= len(wire)})
    whole = run_pair(Endpoint.CHAT, wire, [], True, True)
    assert (whole.input_tokens, whole.output_tokens) == (3, 7)
    for a in range(len(wire) + 1):
        run_pair(Endpoint.CHAT, wire, [a], True, a % 2 == 0)
    for i, a in enumerate(near):
        for b in near[i : i + 8]:
            run_pair(Endpoint.CHAT, wire, [a, b], True, True)


# Ollama's /v1/completions stream with `include_usage` (middleware/openai.go `CompleteWriter`,
# openai/openai.go `CompletionChunk`, Go's field order): an all-zero `Usage{}` on every chunk, the
# finish chunk too, then the totals on a chunk of no choices.
def ollama_completion(text: str, finish: str | None = None, usage: object = None) -> dict:
    choices = [] if usage else [{"text": text, "index": 0, "finish_reason": finish}]
    zero = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return {
        "id": "cmpl-42",
        "object": "text_completion",
        "created": 1733340000,
        "choices": choices,
        "model": "llama3.2",
        "system_fingerprint": "fp_ollama",
        "usage": usage or zero,
    }


OLLAMA_COMPLETION = [
    *(ollama_completion(t) for t in ["Once", " upon", " a", " time", "."]),
    ollama_completion("", finish="stop"),
    ollama_completion("", usage={"prompt_tokens": 26, "completion_tokens": 5, "total_tokens": 31}),
]


@pytest.mark.parametrize("strips", [(True, True), (False, False)])
def test_ollamas_zero_usage_on_every_completion_chunk_is_no_running_total(
    strips: tuple[bool, bool],
) -> None:
    """Before: the zeros were read as vLLM's running totals, so a client that left before the
    usage chunk was billed 0 tokens ($0, its budget $0). They measure nothing: such a client's
    usage is unknown (charged its hold), on the fast path as on the reference one; read to the
    end, the totals are Ollama's."""
    wire = sse_of([compact(e) for e in OLLAMA_COMPLETION])
    whole = run_pair(Endpoint.COMPLETIONS, wire, boundaries(wire), *strips)
    assert (whole.input_tokens, whole.output_tokens) == (26, 5)
    usage_at = wire.index(b'"choices":[]')
    for a in range(len(wire) + 1):
        run_pair(Endpoint.COMPLETIONS, wire, [a], *strips)
        fast, ref = meter_pair(Endpoint.COMPLETIONS, *strips)
        fast.feed(wire[:a])
        ref.feed(wire[:a])
        left = fast.usage_so_far()
        assert left == ref.usage_so_far()
        if a < usage_at:  # a client leaving here: nothing was measured, and 0 is no count
            assert (left.input_tokens, left.output_tokens) == (None, None), a
    # Ollama's chat (`ChatWriter`) sends no usage on its chunks (`ChatCompletionChunk.Usage` is a
    # nil pointer, omitted): a client leaving mid-stream has none to read, as before
    chat = [compact({**chunk(t), "system_fingerprint": "fp_ollama"}) for t in ["a", " b"]]
    left = run_pair(Endpoint.CHAT, sse_of(chat)[: -len(b"data: [DONE]\n\n")], [], *strips)
    assert (left.input_tokens, left.output_tokens) == (None, None)


def _choice_chunk(endpoint: Endpoint, index: int, text: str, prompt: int, out: int) -> dict:
    """A chunk of choice `index` with running usage (`prompt`, `out`) on it."""
    if endpoint is Endpoint.CHAT:
        choice: dict[str, Any] = {"index": index, "delta": {"content": text}}
        head: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk"}
    else:
        choice = {"index": index, "text": text}
        head = {"id": "cmpl-1", "object": "text_completion"}
    usage = {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}
    choice |= {"logprobs": None, "finish_reason": None}
    return {**head, "created": 1, "model": "m", "choices": [choice], "usage": usage}


@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETIONS])
@pytest.mark.parametrize("fast", [True, False])
def test_a_zero_usage_choice_beside_running_totals_leaves_the_usage_unknown(
    fast: bool, endpoint: Endpoint
) -> None:
    """n: 2, choice 0 with vLLM-like running totals, choice 1 with an all-zero usage on each of
    its 5 chunks (which measures nothing, `_counts_a_prompt`). Before, choice 1 was dropped and
    the rest read as measured in full: 5 output tokens for 10 streamed. Now unknown (charged at
    least the hold), on the fast path as on the reference one."""
    events = []
    for k in range(1, 6):
        events += [_choice_chunk(endpoint, 0, "a", 10, k), _choice_chunk(endpoint, 1, "b", 0, 0)]
    meter = open_stream(endpoint, choices=2, per_prompt=2, fast=fast)
    meter.feed(b"".join(f"data: {compact(e)}\n\n".encode() for e in events))
    left = meter.usage_so_far()
    assert (left.input_tokens, left.output_tokens) == (None, None), left
    assert left.unknown_reason == "incomplete_usage"
    # both choices with running totals: measured, as before (choice 1's 5 tokens counted)
    both = [_choice_chunk(endpoint, i, "a", 10, k) for k in range(1, 6) for i in (0, 1)]
    meter = open_stream(endpoint, choices=2, per_prompt=2, fast=fast)
    meter.feed(b"".join(f"data: {compact(e)}\n\n".encode() for e in both))
    assert meter.usage_so_far().output_tokens == 10


def _llama_cpp_text(index: int, final: int | None = None) -> bytes:
    """llama.cpp's /v1/completions stream (server-task.cpp): partial chunks carry text alone; a
    result's final chunk (`to_json_oaicompat`) is its one choice with its finish_reason and that
    result's own usage beside it."""
    choice: dict[str, Any] = {"text": "x", "index": index, "logprobs": None}
    obj: dict[str, Any] = {"id": "cmpl-l", "object": "text_completion", "choices": [choice]}
    choice["finish_reason"] = None
    if final is not None:
        choice |= {"text": "", "finish_reason": "stop"}
        obj["usage"] = {"completion_tokens": final, "prompt_tokens": 5, "total_tokens": 5 + final}
    return f"data: {compact(obj)}\n\n".encode()


@pytest.mark.parametrize("fast", [True, False])
def test_running_usage_of_one_choice_of_two_is_no_measure(fast: bool) -> None:
    """llama.cpp's /v1/completions with n_cmpl: 2 (one prompt): completion 1 ended with its usage
    on its final chunk, completion 0 has 30 tokens and none yet. Before, every *prompt* having
    running usage was enough (choice 1 is prompt 0's): a client leaving there was billed 5 in /
    10 out as measured. Running totals measure only when every choice sent them."""
    meter = open_stream(Endpoint.COMPLETIONS, fast=fast, choices=2, per_prompt=2)
    data = b"".join(_llama_cpp_text(0) for _ in range(30))
    meter.feed(data + b"".join(_llama_cpp_text(1) for _ in range(10)) + _llama_cpp_text(1, 10))
    left = meter.usage_so_far()
    assert (left.input_tokens, left.output_tokens) == (None, None)
    assert left.unknown_reason == "incomplete_usage"
    meter.feed(_llama_cpp_text(0, 30))  # completion 0's own: both measured, the prompt once
    u = meter.usage_so_far()
    assert (u.input_tokens, u.output_tokens, u.unknown_reason) == (5, 40, None)


def test_the_wire_path_waits_for_an_event_begun_in_an_earlier_read() -> None:
    """A read that ends inside a line: the next read's bytes continue that line, even when they
    look like a whole event of the learnt shape."""
    token = f"data: {compact(chunk('a', usage=running(1)))}\n\n".encode()
    for head in (b"data: ", b": comment", b"data: x\n", b"event: e"):
        wire = token * 3 + head + token * 2 + b"data: [DONE]\n\n"
        cut = len(token) * 3 + len(head)
        for strips in ((True, True), (False, False)):
            got = run_pair(Endpoint.CHAT, wire, [len(token), 2 * len(token), cut], *strips)
            assert got.output_tokens == 1


@pytest.mark.parametrize("held", [b"data: 1\n", b": comment\n", b"event: x\n", b"data: 1\r"])
@pytest.mark.parametrize("strips", [(True, True), (False, False)])
def test_a_whole_event_of_the_shape_after_a_held_line_is_read_as_its_continuation(
    held: bytes, strips: tuple[bool, bool]
) -> None:
    """The parser holds a line of an event not yet ended; the next read is, byte for byte, one
    whole event of the learnt shape. It is not that event: its lines belong to the held one (a
    `data:` line makes them one event whose data is no JSON object). The fast path for a read of
    one event must not take it."""
    learnt = b"".join(f"data: {compact(e)}\n\n".encode() for e in RUNNING_STREAM[:4])
    shaped = f"data: {compact(RUNNING_STREAM[2])}\n\n".encode()
    wire = learnt + held + shaped + sse_of([compact(RUNNING_STREAM[3])])
    cuts = [*boundaries(learnt), len(learnt) + len(held), len(learnt) + len(held) + len(shaped)]
    run_pair(Endpoint.CHAT, wire, cuts, *strips)


@pytest.fixture
def none_wired(monkeypatch: pytest.MonkeyPatch) -> None:
    """No shape wired by an earlier stream (the tests before this one wire vLLM's)."""
    monkeypatch.setattr(shape, "_WIRED", {})


@pytest.mark.usefixtures("none_wired")
def test_running_usage_chunks_take_the_wire_path() -> None:
    """Not a speed test: plain running-usage chunks are neither decoded nor parsed as SSE, their
    usage is cut out byte for byte, and a client leaving is billed the last running totals."""
    wire = sse_of([compact(e) for e in RUNNING_STREAM[:5]])
    # decoded: the role chunk (its empty text not learnt), "Hello" (learnt, its shape met once)
    # and " x" (met twice: now on the wire); not "y", "". The next stream of that shape has it
    # on the wire from "Hello" on. None decoded twice: the slot is confirmed on the text.
    calls: list[object] = []
    real = json.loads
    for decoded in (3, 2):
        m = open_stream(Endpoint.CHAT, strip_usage=True, strip_chunk_usage=True)
        calls.clear()
        with mock.patch.object(json, "loads", lambda s: calls.append(s) or real(s)):
            events = wire.split(b"\n\n")[:-1]
            out = b"".join(m.feed(e + b"\n\n") for e in events)
        cut = [compact({k: v for k, v in e.items() if k != "usage"}) for e in RUNNING_STREAM[:5]]
        assert out == sse_of(cut)
        assert len([c for c in calls if isinstance(c, str)]) == decoded
        assert m.token_events == 3
        assert (m.usage_so_far().input_tokens, m.usage_so_far().output_tokens) == (3, 3)


@pytest.mark.usefixtures("none_wired")
def test_a_read_of_many_events_takes_the_wire_path_once_the_shape_is_met() -> None:
    """Not a speed test: a busy server's read holds many events; once the tokens' shape is met
    twice the rest of that read, and every later one, is read on the bytes, not decoded, with the
    same bytes, token events and totals as one event per read (and as the reference path)."""
    datas = [compact(e) for e in RUNNING_STREAM[:5]]
    more = [compact(chunk(t, usage=running(4 + i))) for i, t in enumerate(["a", "", "b c"] * 3)]
    wire = sse_of(datas + more)
    m = open_stream(Endpoint.CHAT, strip_usage=True, strip_chunk_usage=True)
    calls: list[object] = []
    real, parse = json.loads, SSEParser.feed
    parsed: list[bytes] = []
    with (
        mock.patch.object(json, "loads", lambda s: calls.append(s) or real(s)),
        mock.patch.object(SSEParser, "feed", lambda p, b: parsed.append(b) or parse(p, b)),
    ):
        half = boundaries(wire)[8]
        out = m.feed(wire[:half]) + m.feed(wire[half:])
    cut = [compact({k: v for k, v in e.items() if k != "usage"}) for e in RUNNING_STREAM[:5]]
    cut += [compact(chunk(t)) for t in ["a", "", "b c"] * 3]
    assert out == sse_of(cut)
    assert len([c for c in calls if isinstance(c, str)]) == 3  # as one event per read
    # SSE-parsed: the role chunk, "Hello" and " x" (decoded), and [DONE]; nothing else
    assert b"".join(parsed) == wire[: boundaries(wire)[2]] + b"data: [DONE]\n\n"
    assert m.token_events == 3 + 6
    assert (m.usage_so_far().input_tokens, m.usage_so_far().output_tokens) == (3, 4 + 8)
    run_pair(Endpoint.CHAT, wire, [half], True, True)
    run_pair(Endpoint.CHAT, wire, [half], False, False)


TEXTS = st.text(alphabet=st.sampled_from(["a", "x", "y", '"', "\\", "\n", "\x01", "é", " ", "}"]))
RAW = st.text(alphabet=st.sampled_from(["a", '"', "\\", "u", "0", ",", ":", "{", "}", "]", "n"]))


# Chunk makers, each applied to many texts so that shapes are learnt and then met again. Each
# one is a way a chunk can look like a plain token and yet mean something else.
TEMPLATES: list[Any] = [
    chunk,
    lambda t: chunk(t, usage=None),
    lambda t: chunk(t, finish="stop"),
    lambda t: chunk(t, finish=""),
    lambda t: chunk(t, usage={"prompt_tokens": 1, "completion_tokens": len(t)}),
    lambda t: chunk(t, error={"type": "E"}),
    lambda t: chunk(t, error=None),
    lambda t: {"decoy": {"content": t}, **chunk(t)},  # the same text under another "content"
    lambda t: {"decoy": {"content": t}, **chunk("")},
    lambda t: {**chunk(t), "decoy": {"content": ""}},
    lambda t: {**chunk(t), "choices": [{"index": 0, "delta": {"content": t, "tool_calls": [{}]}}]},
    lambda t: {**chunk(t), "choices": [{"index": 0, "delta": {"content": t, "role": "a"}}]},
    lambda t: {**chunk(t), "choices": [{"index": 0, "delta": {"content": t}}, {"index": 1}]},
    lambda t: {**chunk(t), "choices": [{"delta": {"content": t}}, {"delta": {"content": "z"}}]},
    lambda t: {**chunk(t), "choices": [{"index": 1, "text": t, "finish_reason": None}]},
    lambda t: {**chunk(t), "choices": [{"index": 0, "text": t, "delta": None}]},
    lambda t: {**chunk(t), "model": t, "id": ""},
    lambda t: {**chunk(t), "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 4}},
    # vLLM's running totals (continuous_usage_stats), and what only looks like them
    lambda t: chunk(t, usage=running(len(t))),
    lambda t: chunk(t, usage={**running(len(t)), "prompt_tokens_details": None}),
    lambda t: chunk(t, usage={**running(len(t)), "prompt_tokens_details": {"cached_tokens": 1}}),
    lambda t: chunk(t, usage={"prompt_tokens": 2.0, "completion_tokens": -1}),
    lambda t: chunk(t, usage={"prompt_tokens": 10**30, "completion_tokens": 1}),
    lambda t: chunk(t, usage={}),
    lambda t: {"usage": running(len(t)), **chunk(t)},  # usage first, not last
    lambda t: {**chunk(t, usage=running(1)), "usage": running(len(t))},
]


@st.composite
def openai_stream(draw: st.DrawFn) -> list[str]:
    """Events from two or three chunk makers, so that a learnt shape is met again."""
    templates = draw(st.lists(st.sampled_from(TEMPLATES), min_size=1, max_size=3))
    texts = st.one_of(st.sampled_from(["", "a", "x", "y", " q"]), TEXTS)
    out = []
    for _ in range(draw(st.integers(0, 14))):
        template = draw(st.sampled_from(templates))
        if draw(st.integers(0, 9)) == 0:  # the learnt shape's bytes around anything at all
            raw = '"content":"' + draw(RAW) + '"'
            out.append(compact(template("")).replace('"content":""', raw, 1))
            continue
        obj = template(draw(texts))
        out.append(compact(obj) if draw(st.integers(0, 4)) else json.dumps(obj))
    return out


@settings(max_examples=400, deadline=None)
@given(
    openai_stream(),
    st.lists(st.integers(min_value=0, max_value=3000), max_size=6),
    st.booleans(),
    st.sampled_from([Endpoint.CHAT, Endpoint.COMPLETIONS]),
)
def test_openai_fast_path_agrees_with_decoding_every_event(
    datas: list[str], cuts: list[int], strip: bool, endpoint: Endpoint
) -> None:
    wire = sse_of(datas, sep="")
    run_pair(endpoint, wire, [c for c in cuts if c <= len(wire)], strip)
    run_pair(endpoint, wire, boundaries(wire), strip)


@settings(max_examples=400, deadline=None)
@given(
    openai_stream(),
    st.lists(st.integers(min_value=0, max_value=3000), max_size=6),
    st.sampled_from([(True, True), (False, True), (True, False)]),
    st.sampled_from([" ", ""]),
)
def test_wire_fast_path_agrees_with_decoding_every_event_when_usage_is_cut(
    datas: list[str], cuts: list[int], strips: tuple[bool, bool], sep: str
) -> None:
    wire = sse_of(datas, sep=sep)
    run_pair(Endpoint.CHAT, wire, [c for c in cuts if c <= len(wire)], *strips)
    run_pair(Endpoint.CHAT, wire, boundaries(wire) + cuts[:1], *strips)


@pytest.mark.parametrize(
    "datas",
    [
        # the later "content" wins: the learnt span must be the one that counts
        ['{"choices":[{"delta":{"content":"","content":""}}]}'] * 2
        + ['{"choices":[{"delta":{"content":"q","content":""}}]}'],
        [
            '{"choices":[{"delta":{"content":"","content":""}}]}',
            '{"choices":[{"delta":{"content":"","content":"q"}}]}',
        ],
        # the text between the learnt prefix and suffix changes the structure
        [compact(chunk("")), compact(chunk("")).replace('"content":""', '"content":"a","x":""')],
        [compact(chunk("a")), compact(chunk("a")).replace('"a"', '"a\\"')],
        # the same length of bytes after the text, but not the same bytes: a finish reason
        [compact(chunk("a")), compact(chunk("b", finish="ab"))],
        [compact(chunk("a")), compact(chunk("a")).replace('"a"', '"\t"')],
        # a shape learnt from text: the first "content" reads as the text, yet is not where it
        # was read from (a later key of that name, one written with an escape, or a key whose
        # escaped quote makes the marker), so an empty text there is still a token
        ['{"choices":[{"delta":{"content":"a","content":"a"}}]}'] * 2
        + ['{"choices":[{"delta":{"content":"","content":"a"}}]}'],
        ['{"choices":[{"delta":{"content":"a","\\u0063ontent":"a"}}]}'] * 2
        + ['{"choices":[{"delta":{"content":"","\\u0063ontent":"a"}}]}'],
        ['{"x\\"content":"a","choices":[{"delta":{"content":"a"}}]}'] * 2
        + ['{"x\\"content":"","choices":[{"delta":{"content":"a"}}]}'],
        ['{"choices":[{"text":"a","text":"a"}]}'] * 2 + ['{"choices":[{"text":"","text":"a"}]}'],
    ],
)
def test_fast_path_is_not_fooled(datas: list[str]) -> None:
    for sep in ("", " ", "  "):
        wire = sse_of(datas * 2, sep=sep)
        run_pair(Endpoint.CHAT, wire, [], False)
        run_pair(Endpoint.CHAT, wire, boundaries(wire), False)
        run_pair(Endpoint.CHAT, wire, boundaries(wire), True, True)


ROLE = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}


@pytest.mark.parametrize(
    "datas",
    [
        # vLLM's role chunk (empty content, the tokens' suffix), then its tokens
        [compact({**chunk(""), "choices": [ROLE]})] + [compact(chunk(t)) for t in "ab c"],
        [compact({**chunk(""), "choices": [ROLE], "usage": running(0)})]
        + [compact(chunk(t, usage=running(i + 1))) for i, t in enumerate(["a", "b", "", "c"])],
        # nothing but empty content: no shape is ever learnt
        [compact(chunk(""))] * 6,
        [compact(chunk("", usage=running(0)))] * 3 + [compact(chunk("", finish="stop"))],
        [compact({**chunk(""), "choices": [ROLE]})] * 2 + [compact(chunk(""))] * 3,
        [compact(chunk(t, usage=running(1))) for t in ["", "", "a", "", "", "b", ""]],
        ['{"choices":[{"index":0,"text":""}]}'] * 3 + ['{"choices":[{"index":0,"text":"a"}]}'],
    ],
)
@pytest.mark.usefixtures("none_wired")
def test_empty_texts_are_not_learnt_and_agree(datas: list[str]) -> None:
    """A chunk whose text is empty teaches no shape (its shape is not the tokens'); streams
    of them, alone or before tokens, agree with the reference, before and after the tokens'
    shape is wired by an earlier stream."""
    final = compact({**chunk(None), "choices": [], "usage": running(4)})
    for _ in range(2):
        wire = sse_of([*datas, final])
        for strips in ((True, True), (False, False), (True, False)):
            run_pair(Endpoint.CHAT, wire, [], *strips)
            run_pair(Endpoint.CHAT, wire, boundaries(wire), *strips)
            for cut in range(len(wire)):
                run_pair(Endpoint.CHAT, wire, [cut], *strips)


TOP = '{"id":"c","choices":[{"index":0,"delta":{"content":"%s"}}]%s}'
RUNNING = ',"usage":{"prompt_tokens":3,"completion_tokens":%d}'
NAMED_USAGE = ',"usage":{"prompt_tokens":3,"usage":%d}'
CHOICE_USAGE = '{"id":"c","choices":[{"index":0,"delta":{"content":"%s"},"usage":{"x":1}}]%s}'


@pytest.mark.parametrize(
    "datas",
    [
        # TGI writes "usage":null on every chunk; vLLM's running totals are appended last
        [TOP % ("a", ',"usage":null'), TOP % ("b", ',"usage":null' + RUNNING % 2)],
        # a repeated key: the first "usage" is not the one a reader keeps, nor the one cut
        [TOP % ("a", ',"usage":{"x":1}' + RUNNING % 1), TOP % ("b", ',"usage":{"x":1}')],
        [
            TOP % ("a", ',"usage":{"x":1}' + RUNNING % 1),
            TOP % ("b", ',"usage":{"x":1}' + RUNNING % 2),
        ],
        [TOP % ("a", ',"usage":null'), TOP % ("b", ',"usage":{"x":{"y":1}}' + RUNNING % 2)],
        # the same key written escaped: a JSON reader's "usage" all the same
        [
            TOP % ("a", ',"\\u0075sage":{"x":1}' + RUNNING % 1),
            TOP % ("b", ',"\\u0075sage":{"x":1}'),
        ],
        # running totals with a member of that name: inside them, not a second running usage
        [TOP % ("a", NAMED_USAGE % 1), TOP % ("b", NAMED_USAGE % 2)],
        # a choice's own member of that name, in every event: not the running totals
        [CHOICE_USAGE % ("a", RUNNING % 1), CHOICE_USAGE % ("b", RUNNING % 2)] * 2,
        [CHOICE_USAGE % ("a", RUNNING % 1), CHOICE_USAGE % ("b", "")] * 2,
        [
            '{"usage":{"x":1},' + (TOP % ("a", RUNNING % 1))[1:],
            '{"usage":{"x":1},' + (TOP % ("b", ""))[1:],
        ],
        # not JSON: a number with a leading zero
        [
            TOP % ("a", RUNNING % 1),
            TOP % ("b", RUNNING % 2),
            TOP % ("c", RUNNING.replace("%d", "02")),
        ],
        [TOP % ("a", RUNNING % 1), TOP % ("b", RUNNING.replace(":3", ":03") % 2)],
        # two choices, each with its own running totals: kept apart
        [TOP % ("a", RUNNING % 1)] * 3
        + [(TOP % ("b", RUNNING % 5)).replace('"index":0', '"index":1')] * 3
        + [TOP % ("c", RUNNING % 2)],
        # a shape learnt anew inside one read: the totals after it are that choice's
        [TOP % ("a", RUNNING % 1), '{"id":"c","choices":[{"index":1,"text":""}]}']
        + [TOP % ("b", RUNNING % 2)] * 2,
    ],
)
def test_running_usage_on_the_wire_is_not_fooled(datas: list[str]) -> None:
    wire = sse_of(datas * 2)
    for strips in ((True, True), (False, False), (True, False)):
        run_pair(Endpoint.CHAT, wire, [], *strips)
        run_pair(Endpoint.CHAT, wire, boundaries(wire), *strips)
        for cut in boundaries(wire):  # the rest in one read
            run_pair(Endpoint.CHAT, wire, [cut], *strips)


LEARNT = ',"usage":{"prompt_tokens":3,"total_tokens":%d,"completion_tokens":1}'


@pytest.mark.parametrize(
    "later",
    [
        LEARNT % 4,
        LEARNT % 0,
        LEARNT.replace("%d", "null"),
        ',"usage":{"total_tokens":4,"prompt_tokens":3,"completion_tokens":1}',  # reordered
        ',"usage":{"prompt_tokens":3,"total_tokens":4}',  # one left out
        (LEARNT % 4)[:-1] + ',"cached_tokens":2}',  # one added
        ',"usage":{"prompt_tokens":3,"total_tokens":4,"completion_tokens":1,"x":1}',
        ',"usage":{"\\u0070rompt_tokens":3,"total_tokens":4,"completion_tokens":1}',
        ',"usage":{"Prompt_tokens":3,"total_tokens":4,"completion_tokens":1}',
        ',"usage":{"prompt_tokens":3,"total_tokens":04,"completion_tokens":1}',  # not JSON
        ',"usage":{"prompt_tokens":3,"total_tokens":,"completion_tokens":1}',
        ',"usage":{"prompt_tokens":3,"total_tokens":"4","completion_tokens":1}',
        ',"usage":{"prompt_tokens":3,"total_tokens":4.0,"completion_tokens":1}',
        ',"usage":{"prompt_tokens":3,"total_tokens":-4,"completion_tokens":1}',
        LEARNT % 10**18,  # past the digits the wire path reads
        LEARNT % (10**18 - 1),
        ',"usage":{"prompt_tokens":3,"total_tokens":4,"completion_tokens":1,}',
        ',"usage":{"prompt_tokens":3,"total_tokens":4,"completion_tokens":1} ',
        ',"usage":{"prompt_tokens":3,"total_tokens":4 ,"completion_tokens":1}',
        ',"usage":{"prompt_tokens":3,"total_tokens":{"x":4},"completion_tokens":1}',
        ',"usage":{}',
        ',"usage":null',
        "",
    ],
)
def test_running_usage_of_other_members_than_the_learnt_ones(later: str) -> None:
    """The usual read's tail names the members of the learnt chunk's running usage
    (`shape._named_tail`): any later chunk whose running usage differs (members reordered,
    added, left out, spelt otherwise, values that are no counts) is read as the reference path
    reads it, one event a read or any other cut."""
    learnt = [TOP % ("a", LEARNT % 2), TOP % ("b", LEARNT % 3)] * 2
    wire = sse_of([*learnt, TOP % ("c", later), TOP % ("d", LEARNT % 5), TOP % ("e", later)])
    for strips in ((True, True), (False, False), (True, False)):
        run_pair(Endpoint.CHAT, wire, boundaries(wire), *strips)
        for cut in range(len(wire)):
            run_pair(Endpoint.CHAT, wire, [cut], *strips)


SLOT_KEYS = st.sampled_from(['"content"', '"text"', '"con\\u0074ent"', '"x"', '"content" '])
SLOT_VALUES = st.sampled_from(['"a"', '"content"', '""', "1", '{"content":"a"}', '"\\""'])


@st.composite
def slot_chunk(draw: st.DrawFn) -> str:
    """A chunk whose delta (or choice) holds "a" under its text key, among other members whose
    keys and values may repeat that key's name, quoted or escaped."""

    def members() -> str:
        pairs = draw(st.lists(st.tuples(SLOT_KEYS, SLOT_VALUES), max_size=3))
        return "".join(f"{k}:{v}," for k, v in pairs)

    slot = draw(st.sampled_from(['"content":"a"', '"text":"a"']))
    inner = members() + slot + ("," + members()[:-1] if draw(st.booleans()) else "")
    choice = '"delta":{' + inner + "}" if slot.startswith('"content"') else inner
    return "{" + members() + '"choices":[{"index":0,' + choice + "}]}"


@settings(max_examples=500, deadline=None)
@given(slot_chunk())
def test_a_slot_confirmed_on_the_text_is_the_one_decoding_confirms(data: str) -> None:
    """`_is_the_slot` without a second decode (no backslash, the key's name quoted once) says
    what decoding the chunk with other text in the slot says."""
    try:
        obj = json.loads(data)
    except ValueError:
        return
    found = shape._text_slot(obj)
    if found is None or (at := data.find(f'"{found[0]}":"a"')) < 0:
        return
    key, start = found[0], at + len(found[0]) + 4
    if shape._is_the_slot(data, start, start + 1, key, "a"):
        choice = json.loads(data[:start] + "x" + data[start + 1 :])["choices"][0]
        assert (choice["delta"] if key == "content" else choice)[key] == "x", data


def test_shapes_are_learnt_only_from_chunks_that_do_nothing_but_carry_text() -> None:
    def learnt(obj: dict) -> bool:
        learner = shape._TokenShape()
        learner.learn(compact(obj), obj, 1)
        return learner.prefix != ""

    assert learnt(chunk("a")) and learnt(chunk("a", usage=running(1)))
    for obj in (
        chunk("a", finish="stop"),
        chunk("a", usage={"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": 1}}),
        chunk("a", error={"type": "x"}),
        chunk('"a'),
        # a choice the request (one choice) did not ask for: `ChatStream._read` must see it
        {**chunk("a"), "choices": [{"index": 1, "delta": {"content": "a"}}]},
        {**chunk("a"), "choices": [{"index": -1, "delta": {"content": "a"}}]},
        {**chunk(""), "choices": [{"delta": {"content": "", "reasoning_content": "r"}}]},
        # no text: vLLM's role chunk is not its tokens' shape
        chunk(""),
        VLLM_STREAM[0],
        RUNNING_STREAM[0],
    ):
        assert not learnt(obj), obj


def tgi_event(text: str, logprob: str, tail: str = '"generated_text":null,"details":null') -> str:
    return (
        f'{{"index":1,"token":{{"id":7,"text":"{text}","logprob":{logprob},"special":false}},'
        f"{tail}}}"
    )


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.text(alphabet=st.sampled_from(["a", "\\", '"', "n", "u", "0", "\x01", "é"])),
            st.sampled_from(["-0.1", "-1.5e-06", "null", "01", "-", "1.", "NaN", "0"]),
            st.sampled_from(
                [
                    '"generated_text":null,"details":null',
                    '"generated_text":"ab","details":{"finish_reason":"length",'
                    '"generated_tokens":2,"input_length":5}',
                    '"generated_text":null,"details":null,"error":"x","error_type":"t"',
                ]
            ),
        ),
        max_size=10,
    ),
    st.lists(st.integers(min_value=0, max_value=2000), max_size=5),
    st.sampled_from(["", " ", "  "]),
)
def test_tgi_fast_path_agrees_with_decoding_every_event(
    events: list[tuple[str, str, str]], cuts: list[int], sep: str
) -> None:
    wire = b"".join(f"data:{sep}{tgi_event(*e)}\n\n".encode() for e in events)
    run_pair(Endpoint.TGI_GENERATE_STREAM, wire, [c for c in cuts if c <= len(wire)], False)
    run_pair(Endpoint.TGI_GENERATE_STREAM, wire, boundaries(wire), False)


def test_tgi_token_events_take_the_fast_path_and_count() -> None:
    plain = tgi_event("a\\n\\u00e9", "-0.25")
    assert tgi.TGI_TOKEN_EVENT.fullmatch(plain)
    for odd in (tgi_event("a", "01"), tgi_event("a\\x", "-1"), tgi_event("\x01", "-1")):
        assert not tgi.TGI_TOKEN_EVENT.fullmatch(odd)
    final = tgi_event(
        "b", "-1", '"generated_text":"ab","details":{"generated_tokens":2,"input_length":5}'
    )
    wire = f"data:{plain}\n\ndata:{final}\n\n".encode()
    got = run_pair(Endpoint.TGI_GENERATE_STREAM, wire, [], False)
    assert (got.input_tokens, got.output_tokens) == (5, 2)


def test_tgi_fast_paths_do_not_count_an_integer_json_refuses() -> None:
    """Python's `json.loads` refuses an integer of over 4300 digits (a ValueError: the general path
    counts no token for that event), so neither TGI fast path may count one, on the wire (whole
    reads) or as text (an event split across reads)."""
    huge = "1" * 5000
    for odd in (
        tgi_event("a", "-0.5").replace('"index":1', f'"index":{huge}'),
        tgi_event("a", "-0.5").replace('"id":7', f'"id":{huge}'),
        tgi_event("a", f"-{huge}"),
    ):
        wire = f"data:{odd}\n\n".encode() * 2
        for cuts in ([], [7], boundaries(wire)):
            got = run_pair(Endpoint.TGI_GENERATE_STREAM, wire, cuts, False)
            assert got.unknown_reason == "no_token_events", cuts


def echoed_completion(tokens: int, text: str) -> dict:
    """vLLM's first chunk of a completion with `echo` and `logprobs`: the prompt's text and then,
    after it, the prompt's logprobs (as long as the client's prompt)."""
    toks = [f" w{i}" for i in range(tokens)]
    logprobs = {
        "text_offset": list(range(tokens)),
        "token_logprobs": [None] + [-1.25] * (tokens - 1),
        "tokens": toks,
        "top_logprobs": [None] + [{t: -1.25} for t in toks[1:]],
    }
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": None}
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{**choice, "stop_reason": None}]}  # fmt: skip


def test_a_long_suffix_is_not_compiled_into_a_wire_pattern() -> None:
    """Not a speed test: a shape's suffix is the client's to size (the echoed prompt's logprobs
    follow the text). Compiling a pattern costs about 2 us per byte on the event loop and the
    pattern stays in a cache shared by streams; such a shape keeps to the text fast path, and the
    meter still agrees with the reference."""
    datas = [compact(echoed_completion(400, t)) for t in (" w0 w1", "", " out", " more")]
    datas.append(compact({**chunk(None), "choices": [], "usage": running(2)}))
    wire = sse_of(datas)
    compiled: list[bytes] = []
    real = shape._tail
    with mock.patch.object(shape, "_tail", lambda s: compiled.append(s) or real(s)):
        m = open_stream(Endpoint.COMPLETIONS, strip_usage=True)
        m.feed(wire)
    assert compiled == [] and m.token_events == 3
    for strips in ((True, True), (False, False)):
        run_pair(Endpoint.COMPLETIONS, wire, boundaries(wire), *strips)


@pytest.mark.usefixtures("none_wired")
def test_a_shape_met_once_compiles_nothing() -> None:
    """Not a speed test: with per-token logprobs every chunk has its own suffix, so no pattern is
    made (each would be used at most once); a shape met twice gets one, then the wire path, and
    a later stream whose chunks end the same way (its own id and prefix) uses it, compiling
    nothing."""

    def with_logprobs(i: int, t: str) -> dict[str, Any]:
        lp = {"content": [{"token": t, "logprob": -0.5 * i, "bytes": None, "top_logprobs": []}]}
        c = chunk(t, usage=running(i))
        c["choices"][0]["logprobs"] = lp
        return c

    varying = sse_of([compact(with_logprobs(i, t)) for i, t in enumerate(["a", "b", "c", "d"])])
    repeating = sse_of([compact(chunk(t, usage=running(i))) for i, t in enumerate("abcd")])
    plain = sse_of([compact(chunk(t)) for t in "abcd"])  # met again by the text fast path
    compiled: list[bytes] = []
    real = shape._tail
    with mock.patch.object(shape, "_tail", lambda s: compiled.append(s) or real(s)):
        for wire, made, wired in (
            (varying, 0, False),
            (repeating, 1, True),
            (plain, 0, True),  # the same suffix as `repeating`'s, less its running usage
            (varying, 0, False),
        ):
            compiled.clear()
            ends = boundaries(wire)
            pieces = [wire[a:b] for a, b in zip([0, *ends], ends, strict=False)]
            m = open_stream(Endpoint.CHAT, strip_usage=True, strip_chunk_usage=True)
            for piece in pieces:
                m.feed(piece)
            assert len(compiled) == made and m.token_events == 4
            assert bool(m._shape.head) == wired
    for wire in (varying, repeating, plain):
        run_pair(Endpoint.CHAT, wire, boundaries(wire), True, True)


# Bytes put straight into a learnt shape's text slot on the wire: multi-byte and invalid UTF-8,
# characters that are not printable, what a JSON string must escape, and SSE's line endings.
SLOT_BYTES = [b"a", b" ", b"}", b"{", b",", b'"', b"\\", b"\x7f", b"\x00", b"\t", b"\r", b"\n"]
SLOT_BYTES += [
    b"\xc3\xa9",
    b"\xe2\x80\xa8",
    b"\xc2\x85",
    b"\xff",
    b"\x80",
    b"\xe2\x80",
    b"\xed\xa0\x80",
]
SLOT_BYTES += [b"\xef\xbb\xbf", b"data: ", b"\\u0041", b"\xf0\x9f\x98\x80", b',"usage":{"a":1}']


def vllm_completion(index: int, text: bytes) -> bytes:
    head = b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":['
    tail = b'","logprobs":null,"finish_reason":null,"stop_reason":null}]}'
    return head + b'{"index":%d,"text":"' % index + text + tail


def tgi_chat(index: int, text: bytes) -> bytes:
    """TGI's OpenAI route: the role on every chunk, `"usage":null` last."""
    head = b'{"object":"chat.completion.chunk","id":"","created":1,"model":"m",'
    head += b'"system_fingerprint":"3.0.0-sha","choices":[{"index":%d,"delta":' % index
    tail = b'","tool_calls":null},"logprobs":null,"finish_reason":null}],"usage":null}'
    return head + b'{"role":"assistant","content":"' + text + tail


def vllm_chat(index: int, text: bytes) -> bytes:
    body = compact(chunk("\x00")).replace('"index":0', f'"index":{index}').encode()
    return body.replace(b"\\u0000", text)


RUNNING_OBJECTS = [
    b'{"prompt_tokens":3,"total_tokens":%d,"completion_tokens":%d}',
    b'{"prompt_tokens":3,"completion_tokens":%d,"prompt_tokens_details":null}',
    b'{"prompt_tokens":3,"completion_tokens":%d,"prompt_tokens_details":{"cached_tokens":1}}',
    b'{"prompt_tokens":03,"completion_tokens":%d}',
    b'{"prompt_tokens":3.0,"completion_tokens":%d}',
    b'{"prompt_tokens": 3,"completion_tokens":%d}',
    b'{"prompt_tokens":3,"prompt_tokens":5,"completion_tokens":%d}',
    b'{"prompt_tokens":99999999999999999999,"completion_tokens":%d}',
    b"{}",
]
SSE_HEADS = [b"data: ", b"data:", b"data:  ", b"data:\t", b"\xef\xbb\xbfdata: "]
SSE_ENDS = [b"\n\n", b"\r\n\r\n", b"\n\r\n", b"\r\r", b"\n\n\n", b"\r\n\n", b" \n\n"]
SSE_OTHER = [b": ping\n\n", b"event: x\n", b"id: 1\n", b"retry: 5\n", b"\n", b"\r\n", b"data\n"]
SSE_OTHER += [b"data: [DONE]\n\n", b"data: {}\n\n", b"data:\n\n", b"DATA: x\n\n", b":\n"]


@st.composite
def wire_stream(draw: st.DrawFn) -> bytes:
    """A stream of one server's token chunks, mostly as it writes them (so that a shape is learnt
    and met again), with anything in the text slot, running usage, n>1 choices, and every SSE
    variant now and then: other line endings, no space or two, comments, fields, empty events,
    data split over lines, a BOM."""
    make = draw(st.sampled_from([vllm_chat, vllm_completion, tgi_chat]))
    choices = draw(st.sampled_from([1, 1, 2, 3]))
    out: list[bytes] = []
    for k in range(1, draw(st.integers(1, 12)) + 1):
        if draw(st.integers(0, 12)) == 0:
            out.append(draw(st.sampled_from(SSE_OTHER)))
            continue
        plain = st.sampled_from([b"", b"a", b" x", b"hello"])
        raw = st.lists(st.sampled_from(SLOT_BYTES), max_size=4).map(b"".join)
        data = make(draw(st.integers(0, choices - 1)), draw(st.one_of(plain, plain, raw)))
        if draw(st.integers(0, 3)):  # running usage, last as vLLM puts it
            usage = draw(st.sampled_from(RUNNING_OBJECTS[:1] * 6 + RUNNING_OBJECTS[1:]))
            usage = usage % (3 + k, k)[2 - usage.count(b"%d") :]
            data = data[:-1] + b',"usage":' + usage + b"}"
        head, end = b"data: ", b"\n\n"
        if draw(st.integers(0, 5)) == 0:
            head, end = draw(st.sampled_from(SSE_HEADS)), draw(st.sampled_from(SSE_ENDS))
        if draw(st.integers(0, 15)) == 0:
            at = draw(st.integers(0, len(data)))
            data = data[:at] + b"\ndata:" + data[at:]
        out.append(head + data + end)
    out.append(
        b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":9}}\n\n'
    )
    return b"".join(out) + b"data: [DONE]\n\n"


@settings(max_examples=300, deadline=None)
@given(
    wire_stream(),
    st.lists(st.integers(min_value=0, max_value=4000), max_size=5),
    st.sampled_from([(False, False), (True, False), (True, True), (False, True)]),
    st.sampled_from([Endpoint.CHAT, Endpoint.COMPLETIONS]),
)
def test_wire_fast_path_agrees_on_raw_bytes_and_sse_variants(
    wire: bytes, cuts: list[int], strips: tuple[bool, bool], endpoint: Endpoint
) -> None:
    run_pair(endpoint, wire, [c for c in cuts if c <= len(wire)], *strips)
    run_pair(endpoint, wire, boundaries(wire), *strips)


# The budget's worst case (body_size, the limits): tests/test_hold_inputs.py.


# --- loads: what the server reads, for every body, whatever came before ------------------------
# The differential tests of orjson against json.loads went with orjson (see `counts.loads`).

USAGE_TWIN = "mpvinrekuspkfgbzhjfdpwyieucsyyeuchybkooqjruiqdlbnhxqaayngvnduyrk"
USAGE_SLOT = "evict4172"


def test_loads_reads_each_key_as_it_is_written_whatever_was_read_before() -> None:
    """One body that names the twin of "usage": every later response's "usage" must still be
    read as "usage" (json.loads does; a key cache keyed by hash alone does not)."""
    counts.loads(json.dumps({USAGE_SLOT: 0, USAGE_TWIN: 0}).encode())
    body = b'{"usage": {"prompt_tokens": 5, "completion_tokens": 7}}'
    assert counts.loads(body) == json.loads(body)
    headers: dict[str, str] = {}
    assert usage_from_body(Endpoint.CHAT, body, headers).output_tokens == 7
    twin = json.dumps({USAGE_TWIN: 1}).encode()
    counts.loads(b'{"usage": 0}')
    assert counts.loads(twin) == json.loads(twin)


def _outcome(read: Any, data: bytes) -> str:
    try:
        return repr(read(data))  # repr: tells 1 from 1.0 and True, and NaN equals itself
    except (ValueError, UnicodeDecodeError, RecursionError):
        return "refused"


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=600, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=12),
        st.tuples(
            _JSON_VALUES,
            st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32"]),
            st.sampled_from([b"", b"\x00", b"\xef\xbb\xbf", b"\xed\xa0\x80", b" "]),
            st.booleans(),
        ).map(
            lambda t: (
                (t[2] if t[3] else b"")
                + json.dumps(t[0], ensure_ascii=False).encode(t[1], "surrogatepass")
                + (b"" if t[3] else t[2])
            )
        ),
    )
)
def test_loads_reads_every_body_as_json_loads_reads_its_bytes(data: bytes) -> None:
    """Read from text where that is the same (`counts.loads`): for any bytes, in any encoding the
    server reads, with a BOM, a NUL or an encoded surrogate, the value (or the refusal) is
    `json.loads`'s of the bytes."""
    expected = _outcome(json.loads, data)
    assert _outcome(counts.loads, data) == expected
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return
    assert _outcome(lambda d: counts.loads(d, text), data) == expected
    # and a request is read by the same rule (`counts.parse`: None where `loads` refuses)
    read = counts.parse(data)
    assert read[0] == (text if counts.utf8_text(data) is not None else None)
    if expected != "refused" and data:
        assert repr(read[1]) == expected
