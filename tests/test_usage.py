"""Usage parsing on the recorded TGI responses (tests/fixtures/tgi) and on vLLM shapes."""

from __future__ import annotations

import json

import pytest

from sidecar.usage import Endpoint, StreamMeter, classify, inspect_request, usage_from_body
from tests.fakes import load_fixture


def openai_sse(events: list[dict]) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def meter_all(endpoint: Endpoint, wire: bytes, *, strip: bool = False, step: int = 7):
    m = StreamMeter(endpoint, strip_usage=strip)
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
    _, usage, _ = meter_all(Endpoint.COMPLETIONS, openai_sse(events))
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
    m = StreamMeter(Endpoint.CHAT)
    m.feed(openai_sse([role])[: -len(b"data: [DONE]\n\n")])
    assert m.token_events == 0
    m.feed(f"data: {json.dumps(token)}\n\n".encode())
    assert m.token_events == 1
