"""Usage parsing on the recorded TGI responses (../shared/fixtures/tgi) and on vLLM shapes."""

from __future__ import annotations

import json
import re
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar import usage as usage_module
from sidecar.usage import (
    Endpoint,
    StreamMeter,
    Usage,
    classify,
    inspect_request,
    usage_from_body,
)
from tests.fakes import load_fixture
from tests.test_sse import LinesOnly


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


# --- the fast paths against the general path (every event decoded) -------------------------------

NEVER = re.compile(r"(?!)")


def meter_pair(endpoint: Endpoint, strip: bool) -> tuple[StreamMeter, StreamMeter]:
    ref = StreamMeter(endpoint, strip_usage=strip)
    ref._shape = None
    ref._parser = LinesOnly(keep_raw=strip)  # and the general SSE path
    return StreamMeter(endpoint, strip_usage=strip), ref


def run_pair(endpoint: Endpoint, wire: bytes, cuts: list[int], strip: bool) -> Usage:
    """Feed both meters the same pieces; after every piece they agree on the bytes for the client
    and the token events (TTFT is read there); at the end, on usage and `done`."""
    fast, ref = meter_pair(endpoint, strip)
    last = 0
    for c in [*sorted(set(cuts)), len(wire)]:
        out = fast.feed(wire[last:c])
        with mock.patch.object(usage_module, "_TGI_TOKEN_EVENT", NEVER):
            assert out == ref.feed(wire[last:c]), (wire, cuts, c)
        assert fast.token_events == ref.token_events, (wire, cuts, c)
        last = c
    got = fast.finish()
    assert got == ref.finish() and fast.done == ref.done
    return got[1]


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
    m = StreamMeter(Endpoint.CHAT)
    calls = []
    real = json.loads
    with mock.patch.object(usage_module.json, "loads", lambda s: calls.append(s) or real(s)):
        m.feed(wire)
    decoded = [c for c in calls if isinstance(c, str) and '"content":"x"' not in c]
    # the role chunk and "Hello" are decoded (learning), " x", "y" and "" are not; the rest
    # (quote and newline, backslash, U+2028, a control character, the finish, usage) are
    assert len(decoded) == len(VLLM_STREAM) - 3
    assert m.token_events == 8


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
        [compact(chunk("a")), compact(chunk("a")).replace('"a"', '"\t"')],
    ],
)
def test_fast_path_is_not_fooled(datas: list[str]) -> None:
    run_pair(Endpoint.CHAT, sse_of(datas, sep=""), [], False)


def test_shapes_are_learnt_only_from_chunks_that_do_nothing_but_carry_text() -> None:
    assert usage_module._text_slot(chunk("a")) == ("content", "a")
    for obj in (
        chunk("a", finish="stop"),
        chunk("a", usage={"prompt_tokens": 1}),
        chunk("a", error={"type": "x"}),
        chunk('"a'),
        {**chunk(""), "choices": [{"delta": {"content": "", "reasoning_content": "r"}}]},
    ):
        assert usage_module._text_slot(obj) is None, obj


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
)
def test_tgi_fast_path_agrees_with_decoding_every_event(
    events: list[tuple[str, str, str]], cuts: list[int]
) -> None:
    wire = b"".join(f"data:{tgi_event(*e)}\n\n".encode() for e in events)
    run_pair(Endpoint.TGI_GENERATE_STREAM, wire, [c for c in cuts if c <= len(wire)], False)


def test_tgi_token_events_take_the_fast_path_and_count() -> None:
    plain = tgi_event("a\\n\\u00e9", "-0.25")
    assert usage_module._TGI_TOKEN_EVENT.fullmatch(plain)
    for odd in (tgi_event("a", "01"), tgi_event("a\\x", "-1"), tgi_event("\x01", "-1")):
        assert not usage_module._TGI_TOKEN_EVENT.fullmatch(odd)
    final = tgi_event(
        "b", "-1", '"generated_text":"ab","details":{"generated_tokens":2,"input_length":5}'
    )
    wire = f"data:{plain}\n\ndata:{final}\n\n".encode()
    got = run_pair(Endpoint.TGI_GENERATE_STREAM, wire, [], False)
    assert (got.input_tokens, got.output_tokens) == (5, 2)
