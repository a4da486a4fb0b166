"""An upstream SSE event longer than `metering.max_event_bytes`: passed through unparsed, in time
linear in its length, holding nothing, its stream's usage unknown (issue 21, item 10). One
unterminated 300 MB event took 100% CPU for 30 s: every read searched the whole line again."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.exchange import Endpoint
from sidecar.metering import sse as sse_module
from sidecar.metering.sse import Oversized, SSEParser
from sidecar.metering.wire import open_stream
from tests.conftest import StartSidecar
from tests.fakes import MODEL
from tests.test_sse import LinesOnly

READ = 65536  # one read of the upstream


class Scanned:
    """A stand-in for one of the parser's patterns that counts the bytes each search may read."""

    def __init__(self, pattern: re.Pattern[bytes]) -> None:
        self.pattern, self.bytes = pattern, 0

    def search(self, data: Any, pos: int = 0, *args: Any) -> Any:
        self.bytes += len(data) - pos
        return self.pattern.search(data, pos, *args)

    def match(self, data: Any, pos: int = 0, *args: Any) -> Any:
        self.bytes += len(data) - pos
        return self.pattern.match(data, pos, *args)


def chunk(content: str, **extra: Any) -> bytes:
    obj = {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"content": content}}]}
    return b"data: " + json.dumps({**obj, **extra}, separators=(",", ":")).encode() + b"\n\n"


USAGE = b'data: {"id":"c","model":"m","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":9}}\n\n'  # noqa: E501
LEARNT = chunk("a") + chunk("b") + chunk("c")  # the wire fast path learns its shape on these
HUGE_HEAD = chunk("x")[:-4]  # an event of that shape whose text never ends


def huge(size: int) -> list[bytes]:
    """One event of `size` bytes of text, in reads of 64 KiB, without its end."""
    first = HUGE_HEAD + b"y" * (READ - len(HUGE_HEAD))
    return [first] + [b"y" * READ] * (size // READ - 1)


@pytest.mark.parametrize("strips", [(False, False), (True, False), (True, True)])
def test_a_huge_unterminated_event_costs_linear_work_and_holds_nothing(
    monkeypatch: pytest.MonkeyPatch, strips: tuple[bool, bool]
) -> None:
    """32 MiB in 512 reads: every byte is searched a bounded number of times (before the fix,
    each read searched the whole line again: 512 x 16 MiB on average), and what the parser
    holds stays under the limit plus one read. The client gets every byte as it came."""
    eol = Scanned(sse_module._EOL)
    blank = Scanned(re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r|\n)"))
    monkeypatch.setattr(sse_module, "_EOL", eol)
    monkeypatch.setattr(sse_module, "_BLANK", blank, raising=False)
    # the default limit, 1 MiB (metering.max_event_bytes)
    meter = open_stream(Endpoint.CHAT, strip_usage=strips[0], strip_chunk_usage=strips[1])
    sent = [LEARNT, *huge(32 << 20)]
    out, fed = [], 0
    for piece in sent:
        out.append(meter.feed(piece))
        fed += len(piece)
        assert eol.bytes + blank.bytes <= 3 * fed
        assert meter._parser.pending <= (1 << 20) + READ
    tail, usage = meter.finish()
    assert b"".join(out) + tail == b"".join(sent)
    assert usage.unknown_reason == "event_too_large"
    assert usage.input_tokens is None and usage.output_tokens is None


def test_after_the_huge_event_the_stream_is_read_again_and_the_usage_chunk_is_its_usage() -> None:
    """The event ends; the chunks after it are counted again, and the usage chunk after it is
    the request's totals (of one choice: it replaces whatever the unread event carried).
    Before, the stream's usage stayed unknown, and a budget charged only the hold."""
    meter = open_stream(Endpoint.CHAT, strip_usage=True, max_event_bytes=4096)
    sent = [LEARNT, HUGE_HEAD + b"z" * 10000, b'"}}]}\n', b"\n" + chunk("d"), USAGE]
    sent.append(b"data: [DONE]\n\n")
    out = [meter.feed(p) for p in sent]
    tail, usage = meter.finish()
    assert b"".join(out) + tail == b"".join(sent[:-2]) + sent[-1]  # our usage chunk cut only
    assert meter.token_events == 5 and meter.done  # the huge event among them, unread
    assert usage.unknown_reason is None
    assert (usage.input_tokens, usage.output_tokens) == (3, 9)
    assert usage.model == "m"


@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.TGI_GENERATE_STREAM])
def test_a_long_event_is_not_read_whether_it_comes_whole_or_in_pieces(endpoint: Endpoint) -> None:
    """The wire fast paths match whole events without the parser: one over the limit in a single
    read must not be read when the same bytes in pieces are not (it counts as one event of
    output, unread, either way)."""
    if endpoint is Endpoint.CHAT:
        before, event = LEARNT, chunk("t" * 5000)
    else:
        token = '{"index":%d,"token":{"id":1,"text":"%s","logprob":-1.0,"special":false},'
        token += '"generated_text":null,"details":null}'
        before = b"".join(b"data:" + (token % (i, "a")).encode() + b"\n\n" for i in range(3))
        event = b"data:" + (token % (3, "t" * 5000)).encode() + b"\n\n"
    results = []
    for pieces in ([before + event], [before, event], [before, event[:100], event[100:]]):
        meter = open_stream(endpoint, max_event_bytes=4096)
        for p in pieces:
            assert meter.feed(p) == p
        results.append((meter.token_events, meter.finish()[1].unknown_reason))
    assert results == [(4, "event_too_large")] * 3


def test_an_event_at_the_limit_is_read() -> None:
    event = chunk("q" * 100)
    meter = open_stream(Endpoint.CHAT, max_event_bytes=len(event))
    meter.feed(event + USAGE)
    assert meter.token_events == 1
    assert meter.finish()[1].output_tokens == 9


_LINE = st.binary(max_size=12).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
_EVENT = st.tuples(
    st.lists(_LINE, min_size=1, max_size=4), st.sampled_from([b"\n", b"\r\n", b"\r"])
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_EVENT, min_size=1, max_size=6),
    st.integers(4, 40),
    st.lists(st.integers(0, 400), max_size=10),
    st.booleans(),
)
def test_events_over_the_limit_are_passed_through_and_all_others_read_at_any_cut(
    events: list[tuple[list[bytes], bytes]], limit: int, cuts: list[int], keep_raw: bool
) -> None:
    """Against a parser without a limit: the same bytes; the same events, but those longer than
    the limit, which come as pieces without data; the fast path agrees with the general one."""
    data = b"".join(
        b"".join(b"data:" + line + eol for line in lines) + eol for lines, eol in events
    )
    data += b"data: ok\n\n"  # a last event in LF, so a lone CR before it is settled
    free = SSEParser(max_event_bytes=1 << 30)
    every = free.feed(data)
    free.finish()
    fast = SSEParser(keep_raw=keep_raw, max_event_bytes=limit)
    ref = LinesOnly(keep_raw=keep_raw, max_event_bytes=limit)
    got, last = [], 0
    for c in [*sorted({c for c in cuts if c <= len(data)}), len(data)]:
        piece = data[last:c]
        out = fast.feed(piece)
        assert out == ref.feed(piece)
        assert fast.pending <= limit + len(piece)
        got += out
        last = c
    tail = fast.finish()
    assert tail == ref.finish()
    if keep_raw:
        assert b"".join(e.raw for e in got) + tail == data
    read = [(e.data, e.event) for e in got if e.data is not None]
    assert read == [(e.data, e.event) for e in every if e.data is not None and len(e.raw) <= limit]
    assert fast.oversized == sum(1 for e in every if len(e.raw) > limit)
    # each is marked in its place: the first piece of an event over the limit is `Oversized`
    assert fast.oversized == sum(1 for e in got if isinstance(e, Oversized))


async def test_the_sidecar_passes_a_huge_event_through_and_others_stay_fast(
    start_sidecar: StartSidecar, aiohttp_server: Any
) -> None:
    """Through the proxy: the client gets every byte of an 8 MiB event as it came, another
    request is answered meanwhile, and the usage chunk after the event is the request's usage
    (before, it was counted as unknown, event_too_large, and charged its hold)."""
    body = b"".join([LEARNT, *huge(8 << 20), b'"}}]}\n\n', USAGE, b"data: [DONE]\n\n"])
    flowing = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(0, len(body), READ):
            await resp.write(body[i : i + READ])
            if i > (1 << 20):
                flowing.set()
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": MODEL}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", stream)
    app.router.add_get("/v1/models", models)
    up = await aiohttp_server(app)
    run = await start_sidecar(
        {"metering": {"max_event_bytes": 1 << 20, "inject_stream_usage": False}},
        upstream_url=str(up.make_url("")).rstrip("/"),
    )
    req = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with aiohttp.ClientSession() as s:

        async def read_all() -> bytes:
            async with s.post(run.url + "/v1/chat/completions", json=req) as r:
                return await r.read()

        task = asyncio.ensure_future(read_all())
        await asyncio.wait_for(flowing.wait(), 30)
        async with s.get(run.url + "/v1/models") as r:  # answered while the flood flows
            assert r.status == 200
        assert await asyncio.wait_for(task, 60) == body
    for _ in range(200):  # the request is metered after its last byte went out
        if _tokens(run, "output"):
            break
        await asyncio.sleep(0.01)
    assert (_tokens(run, "input"), _tokens(run, "output")) == (3, 9)
    assert _unknown(run) == 0


def _tokens(run: Any, kind: str) -> float:
    return _sum(run, "llm_tokens_total", "token_type", kind)


def _unknown(run: Any) -> float:
    return _sum(run, "llm_usage_unknown_total", None, None)


def _sum(run: Any, name: str, label: str | None, value: str | None) -> float:
    return sum(
        sample.value
        for metric in run.sc.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == name and (label is None or sample.labels.get(label) == value)
    )


# --- usage read after an event over the limit --------------------------------------------------
# The event that was not read may have carried anything, so a reading before it may have been
# superseded (or, for parts added up, joined) by it: the usage is measured only when every
# reading it is built from came after the last such event and supersedes all before it.

LIMIT = 1024  # a small metering.max_event_bytes
DONE = b"data: [DONE]\n\n"


def completion(text: str, **extra: Any) -> bytes:
    obj = {"id": "c", "model": "m", "choices": [{"index": 0, "text": text}]}
    return b"data: " + json.dumps({**obj, **extra}, separators=(",", ":")).encode() + b"\n\n"


def usage_only(prompt: int, out: int) -> bytes:
    obj = {"id": "c", "model": "m", "choices": [], "usage": {"prompt_tokens": prompt}}
    obj["usage"]["completion_tokens"] = out  # type: ignore[index]
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def read_at_every_cut(endpoint: Endpoint, data: bytes, **options: Any) -> set[tuple[Any, ...]]:
    """(input, output, reason) of `data` read in two pieces cut at every byte, and whole in
    reads of 64 bytes, on the fast path and the reference path; each read passes unchanged."""
    results = set()
    pieces = [[data[:c], data[c:]] for c in range(len(data) + 1)]
    pieces.append([data[i : i + 64] for i in range(0, len(data), 64)])
    for fast in (True, False):
        for parts in pieces:
            meter = open_stream(endpoint, max_event_bytes=LIMIT, fast=fast, **options)
            out = b"".join(meter.feed(p) for p in parts)
            tail, u = meter.finish()
            assert out + tail == data
            results.add((u.input_tokens, u.output_tokens, u.unknown_reason))
    return results


@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETIONS])
def test_the_usage_chunk_after_an_event_over_the_limit_is_the_usage(endpoint: Endpoint) -> None:
    """One choice: the usage-only chunk is the request's totals, whatever came before it (the
    reviewer's stream: a 1 MiB event, then the usage, read in full, charged the hold alone)."""
    make = chunk if endpoint is Endpoint.CHAT else completion
    learnt = make("a") + make("b") + make("c")
    data = learnt + make("t" * 2000) + make("d") + usage_only(3, 9) + DONE
    assert read_at_every_cut(endpoint, data) == {(3, 9, None)}


def test_a_usage_chunk_before_an_event_over_the_limit_leaves_the_usage_unknown() -> None:
    """The event after it may have been another usage chunk, which would replace it. Read in
    one piece, the parser counts the long event before the meter reads the usage chunk: the
    order is the stream's, not the parser's count at the time."""
    data = LEARNT + usage_only(3, 9) + chunk("t" * 2000) + DONE
    assert read_at_every_cut(Endpoint.CHAT, data) == {(None, None, "event_too_large")}
    unterminated = LEARNT + usage_only(3, 9) + chunk("t" * 2000)[:-2]
    assert read_at_every_cut(Endpoint.CHAT, unterminated) == {(None, None, "event_too_large")}


def test_usage_parts_with_an_event_over_the_limit_between_them_are_unknown() -> None:
    """Two choices, a usage-only chunk each after its finish chunk (llama.cpp's parts): the long
    event may have been a part, so the two read are not known to be the request's. With both
    after it, they are."""
    two = chunk("a") + chunk("b", choices=[{"index": 1, "delta": {"content": "b"}}])
    fin = [chunk("", choices=[{"index": i, "delta": {}, "finish_reason": "stop"}]) for i in (0, 1)]
    long = chunk("t" * 2000)
    between = two + fin[0] + usage_only(3, 4) + long + fin[1] + usage_only(3, 5) + DONE
    assert read_at_every_cut(Endpoint.CHAT, between, choices=2) == {(None, None, "event_too_large")}
    after = two + long + fin[0] + usage_only(3, 4) + fin[1] + usage_only(3, 5) + DONE
    assert read_at_every_cut(Endpoint.CHAT, after, choices=2) == {(3, 9, None)}
    fewer = two + long + usage_only(3, 9) + DONE  # vLLM's totals, or one part
    assert read_at_every_cut(Endpoint.CHAT, fewer, choices=2) == {(None, None, "event_too_large")}
    # vLLM's totals sent twice (no choice finished between them) are not two parts
    again = two + fin[0] + fin[1] + long + usage_only(3, 9) * 2 + DONE
    assert read_at_every_cut(Endpoint.CHAT, again, choices=2) == {(None, None, "event_too_large")}


def test_running_totals_read_after_an_event_over_the_limit_are_the_usage() -> None:
    """vLLM's running totals (continuous usage) supersede each other: the last one read counts
    when it came after the long event, not when it came before."""

    def running(text: str, out: int) -> bytes:
        return chunk(text, usage={"prompt_tokens": 3, "completion_tokens": out})

    head = running("a", 1) + running("b", 2) + running("c", 3)
    after = head + running("t" * 2000, 4) + running("d", 5)
    assert read_at_every_cut(Endpoint.CHAT, after) == {(3, 5, None)}
    before = head + running("t" * 2000, 4) + DONE
    assert read_at_every_cut(Endpoint.CHAT, before) == {(None, None, "event_too_large")}


def test_the_responses_terminal_event_after_an_event_over_the_limit_is_the_usage() -> None:
    def ev(obj: dict[str, Any]) -> bytes:
        return f"event: {obj['type']}\ndata: {json.dumps(obj)}\n\n".encode()

    delta = {"type": "response.output_text.delta", "delta": "t" * 2000}
    response = {"id": "r", "model": "m", "status": "completed"}
    usage = {"input_tokens": 3, "output_tokens": 9}
    done = ev({"type": "response.completed", "response": {**response, "usage": usage}})
    data = ev({"type": "response.created", "response": response}) + ev(delta) + done
    assert read_at_every_cut(Endpoint.RESPONSES, data) == {(3, 9, None)}
    assert read_at_every_cut(Endpoint.RESPONSES, done + ev(delta)) == {
        (None, None, "event_too_large")
    }


def test_several_responses_after_an_event_over_the_limit_are_the_usage_only_all_after_it() -> None:
    """llama.cpp's /v1/responses with n_cmpl: 2 streams one response a completion, each under
    its own id with its own terminal event (see ResponsesStream). Both read after the long
    event: their usage, the prompt once. One before it, or fewer than the choices after it
    (the long event may have been the other's terminal event): unknown."""

    def ev(obj: dict[str, Any]) -> bytes:
        return f"event: {obj['type']}\ndata: {json.dumps(obj)}\n\n".encode()

    def done(rid: str, out: int) -> bytes:
        response = {"id": rid, "model": "m", "status": "completed"}
        usage = {"input_tokens": 3, "output_tokens": out}
        return ev({"type": "response.completed", "response": {**response, "usage": usage}})

    long = ev({"type": "response.output_text.delta", "delta": "t" * 2000})
    after = long + done("a", 4) + done("b", 5)
    assert read_at_every_cut(Endpoint.RESPONSES, after, choices=2) == {(3, 9, None)}
    between = done("a", 4) + long + done("b", 5)
    unknown = {(None, None, "event_too_large")}
    assert read_at_every_cut(Endpoint.RESPONSES, between, choices=2) == unknown
    one = long + done("a", 4)
    assert read_at_every_cut(Endpoint.RESPONSES, one, choices=2) == unknown
