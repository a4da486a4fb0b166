"""The wire adapters' registry and their two paths: `open_stream(fast=False)` is each adapter's
plain reference path (SSE parsed line by line, every event decoded), and the fast path must equal
it byte for byte, token for token, usage after every piece, with a cut at every byte."""

from __future__ import annotations

import json

import pytest

from sidecar.exchange import Endpoint
from sidecar.metering import openai, shape, tgi, wire
from sidecar.metering.sse import LineParser, SSEParser
from tests.test_usage import VLLM_STREAM, boundaries, chunk, compact, run_pair, running, sse_of


@pytest.mark.parametrize(
    ("endpoint", "api", "adapter"),
    [
        (Endpoint.CHAT, "vllm", openai.OpenAIAdapter),
        (Endpoint.RESPONSES, "vllm", openai.OpenAIAdapter),
        (Endpoint.CHAT, "tgi", tgi.TGIOpenAIAdapter),
        (Endpoint.COMPLETIONS, "tgi", tgi.TGIOpenAIAdapter),
        (Endpoint.TGI_GENERATE_STREAM, "tgi", tgi.TGIAdapter),
        (Endpoint.TGI_VERTEX, "vllm", tgi.TGIAdapter),
    ],
)
def test_each_route_is_read_by_its_wire_family(endpoint: Endpoint, api: str, adapter: type) -> None:
    assert type(wire.adapter_for(endpoint, api)) is adapter


def test_tgi_openai_routes_read_their_own_limit_fields() -> None:
    """The one request field the two servers' chat routes read differently: with both limits,
    vLLM takes `max_completion_tokens`, TGI `max_tokens`."""
    body = json.dumps({"messages": [], "max_tokens": 5, "max_completion_tokens": 9}).encode()
    read = {
        api: wire.inspect_request(Endpoint.CHAT, body, inject_usage=False, api=api).max_tokens
        for api in ("vllm", "tgi")
    }
    assert read == {"vllm": 9, "tgi": 5}


@pytest.mark.parametrize(
    ("endpoint", "fast", "reference"),
    [
        (Endpoint.CHAT, shape.FastChatStream, openai.ChatStream),
        (Endpoint.COMPLETIONS, shape.FastChatStream, openai.ChatStream),
        (Endpoint.TGI_GENERATE_STREAM, tgi.FastTGIStream, tgi.TGIStream),
        (Endpoint.RESPONSES, openai.ResponsesStream, openai.ResponsesStream),
    ],
)
def test_fast_false_is_the_plain_reference_path(
    endpoint: Endpoint, fast: type, reference: type
) -> None:
    """The switch the differential tests use: no fast path, and the line-by-line SSE parser."""
    ref = wire.open_stream(endpoint, fast=False)
    assert type(ref) is reference
    assert type(ref._parser) is LineParser  # type: ignore[attr-defined]
    quick = wire.open_stream(endpoint)
    assert type(quick) is fast
    assert type(quick._parser) is SSEParser  # type: ignore[attr-defined]


def test_running_usage_agrees_at_every_cut() -> None:
    """vLLM's running totals on every chunk, cut out of each (we asked for them), then the usage
    chunk dropped: the fast path against the reference with one event per read (a server's one
    write per event) and with one cut at every byte."""
    datas = [compact(chunk(t, usage=running(i + 1))) for i, t in enumerate(["Hi", " x", "", "y"])]
    datas.append(compact({**chunk(None), "choices": [], "usage": running(3)}))
    stream = sse_of(datas)
    got = run_pair(Endpoint.CHAT, stream, [], True, True)
    assert (got.input_tokens, got.output_tokens) == (3, 3)
    run_pair(Endpoint.CHAT, stream, boundaries(stream), True, True)  # one event per read
    for a in range(len(stream) + 1):
        run_pair(Endpoint.CHAT, stream, [a], True, True)


def test_a_stray_choice_agrees_at_every_cut() -> None:
    """A chunk of a choice the request did not ask for (index 1 of one, with running totals) is
    never learnt as the shape: both paths decode it, before the shape is learnt and after it is
    on the wire, cut its running usage alike, and find the running totals unknown."""
    datas = [compact(chunk(t, usage=running(i + 1))) for i, t in enumerate(["Hi", " x", "y"])]
    choice = {"index": 1, "delta": {"content": "z"}, "logprobs": None, "finish_reason": None}
    stray = compact({**chunk("z", usage=running(1)), "choices": [choice]})
    stream = sse_of([stray, *datas, stray, *datas[:2]])
    got = run_pair(Endpoint.CHAT, stream, [], True, True)
    assert (got.input_tokens, got.unknown_reason) == (None, "invalid_usage")
    run_pair(Endpoint.CHAT, stream, boundaries(stream), True, True)  # one event per read
    for a in range(len(stream) + 1):
        run_pair(Endpoint.CHAT, stream, [a], True, True)


def test_responses_events_agree_at_every_cut() -> None:
    """The Responses API has no learnt shape: the fast and reference meters differ in their SSE
    parser alone, and agree at every cut."""

    def ev(kind: str, **extra: object) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **extra})}\n\n".encode()

    done = {"model": "m", "id": "r", "status": "completed"}
    usage = {"input_tokens": 4, "output_tokens": 2}
    stream = (
        ev("response.created", response={"model": "m", "id": "r"})
        + ev("response.output_text.delta", delta="a")
        + ev("response.output_text.delta", delta="b")
        + ev("response.completed", response={**done, "usage": usage})
    )
    got = run_pair(Endpoint.RESPONSES, stream, [], False)
    assert (got.input_tokens, got.output_tokens, got.finish_reasons) == (4, 2, ("completed",))
    for a in range(len(stream) + 1):
        run_pair(Endpoint.RESPONSES, stream, [a], False)
    # a second terminal event: the last one's usage, on both paths, at every cut
    again = stream + ev("response.completed", response={**done, "usage": {**usage, "x": 1}})
    assert run_pair(Endpoint.RESPONSES, again, [], False) == got
    for a in range(len(stream), len(again) + 1):
        run_pair(Endpoint.RESPONSES, again, [a], False)


def test_the_reference_path_reads_the_whole_vllm_stream() -> None:
    """Not a comparison: the reference alone reads vLLM's stream to its totals."""
    ref = wire.open_stream(Endpoint.CHAT, fast=False)
    ref.feed(sse_of([compact(e) for e in VLLM_STREAM]))
    usage = ref.finish()[1]
    assert (usage.input_tokens, usage.output_tokens, ref.token_events) == (3, 9, 8)


def test_a_registered_family_takes_its_server_s_routes_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """How the next adapters come in (SGLang's /generate is TGI's path): one `register` call, for
    one server; the other servers' reading of the route is untouched."""
    monkeypatch.setattr(wire, "_ROUTES", dict(wire._ROUTES))  # the test's registration only

    class Other(tgi.TGIAdapter):
        pass

    other = Other()
    wire.register(other, [Endpoint.TGI_GENERATE], "sglang")
    assert wire.adapter_for(Endpoint.TGI_GENERATE, "sglang") is other
    assert type(wire.adapter_for(Endpoint.TGI_GENERATE, "tgi")) is tgi.TGIAdapter
    assert type(wire.adapter_for(Endpoint.TGI_GENERATE_STREAM, "sglang")) is tgi.TGIAdapter
