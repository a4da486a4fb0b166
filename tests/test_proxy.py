"""The proxy end to end: real openai SDK and HF client -> tollbooth -> the in-test upstream."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from sidecar.proxy.headers import HOP_BY_HOP, request_headers, response_headers
from tests.conftest import Running, StartSidecar
from tests.fakes import MODEL
from tests.waiting import wait_for

PRICING = {"models": {MODEL: {"input_per_1m": 1.0, "output_per_1m": 2.0}}}
MSGS = [{"role": "user", "content": "one two three four five"}]  # 5 prompt tokens at the fake


def tokens(
    run: Running,
    direction: str,
    endpoint: str = "/v1/chat/completions",
    user: str = "anonymous",
    model: str = MODEL,
) -> float | None:
    return run.value(
        "llm_tokens_total", model=model, token_type=direction, api_endpoint=endpoint, user_id=user
    )


async def test_sync_client_non_streaming_counts_exact_usage(
    start_sidecar: StartSidecar, oai: Any
) -> None:
    run = await start_sidecar()
    client = oai(run, "sk-test", sync=True)
    resp = await asyncio.to_thread(
        client.chat.completions.create,
        model=MODEL,
        messages=MSGS,
        max_tokens=7,
        extra_headers={"X-Tollbooth-User": "alice"},
    )
    assert resp.usage is not None and resp.usage.completion_tokens == 7
    assert tokens(run, "input", user="alice") == 5
    assert tokens(run, "output", user="alice") == 7
    assert (
        run.value(
            "llm_requests_total",
            model=MODEL,
            api_endpoint="/v1/chat/completions",
            status_code="200",
        )
        == 1
    )
    # non-streaming: no TTFT is claimed
    assert (
        run.value(
            "llm_time_to_first_token_seconds_count",
            model=MODEL,
            api_endpoint="/v1/chat/completions",
        )
        is None
    )


async def test_async_streaming_injects_usage_and_strips_its_chunk(
    start_sidecar: StartSidecar, oai: Any
) -> None:
    run = await start_sidecar()
    client = oai(run, "sk-test")
    stream = await client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=8, stream=True
    )
    chunks = [c async for c in stream]
    # The client did not ask for usage and sees none: 4 content chunks, no usage-only chunk.
    assert len(chunks) == 4
    assert all(c.choices and c.usage is None for c in chunks)
    sent = json.loads(run.upstream.seen[-1]["body"])
    # usage, and vLLM's running totals on every chunk (cut out again: the client saw none)
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    # 8 tokens in 4 chunks: counted from usage, not chunks
    user = "key-" + __import__("hashlib").sha256(b"sk-test").hexdigest()[:12]
    assert tokens(run, "output", user=user) == 8
    assert tokens(run, "input", user=user) == 5
    assert (
        run.value(
            "llm_time_to_first_token_seconds_count",
            model=MODEL,
            api_endpoint="/v1/chat/completions",
        )
        == 1
    )
    assert (
        run.value(
            "llm_time_per_output_token_seconds_count",
            model=MODEL,
            api_endpoint="/v1/chat/completions",
        )
        == 1
    )


async def test_client_that_asked_for_usage_keeps_its_usage_chunk(
    start_sidecar: StartSidecar, oai: Any
) -> None:
    run = await start_sidecar()
    client = oai(run)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        user="bob",
    )
    chunks = [c async for c in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert tokens(run, "output", user="bob") == 4


async def test_non_streaming_request_never_gets_stream_options(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar()
    async with aiohttp.ClientSession() as s:
        body = {"model": MODEL, "prompt": "a b", "max_tokens": 2}
        async with s.post(run.url + "/v1/completions", json=body) as r:
            assert r.status == 200
    assert "stream_options" not in json.loads(run.upstream.seen[-1]["body"])
    assert tokens(run, "input", endpoint="/v1/completions") == 2


async def test_injection_keeps_every_other_byte_of_the_body(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar()
    raw = b'{  "model": "m", "stream": true,\n "prompt": "x y"}'
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            run.url + "/v1/completions", data=raw, headers={"Content-Type": "application/json"}
        ) as r,
    ):
        await r.read()
    sent = run.upstream.seen[-1]["body"]
    spliced = b'{"stream_options":{"include_usage":true,"continuous_usage_stats":true},'
    assert sent == spliced + b'  "model": "m", "stream": true,\n "prompt": "x y"}'


async def test_cached_tokens_are_counted_as_a_subset(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar()
    async with aiohttp.ClientSession() as s:
        body = {"model": MODEL, "messages": MSGS, "max_tokens": 2}
        async with s.post(
            run.url + "/v1/chat/completions", json=body, headers={"X-Fake": "cached"}
        ) as r:
            await r.read()
    assert (
        run.value(
            "llm_cached_input_tokens_total",
            model=MODEL,
            api_endpoint="/v1/chat/completions",
            user_id="anonymous",
        )
        == 2
    )
    assert tokens(run, "input") == 5


async def test_stream_chunks_are_forwarded_as_they_arrive(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar()
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 6, "stream": True}
    arrivals = []
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/v1/chat/completions", json=body, headers={"X-Fake": "slow-stream"}) as r,
    ):
        async for _ in r.content.iter_any():
            arrivals.append(asyncio.get_running_loop().time())
    # The upstream sleeps 50 ms between chunks; a buffering proxy would deliver them at once.
    assert len(arrivals) >= 3
    assert arrivals[-1] - arrivals[0] > 0.08


async def test_midstream_error_marks_failure(start_sidecar: StartSidecar, oai: Any) -> None:
    # without running totals (TGI, or continuous_usage off) the stream's usage is unknown
    run = await start_sidecar({"metering": {"continuous_usage": False}})
    client = oai(run)
    seen = []
    with contextlib.suppress(openai.APIError):  # the SDK may or may not raise on an error event
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=MSGS,
            max_tokens=8,
            stream=True,
            extra_headers={"X-Fake": "error-midstream"},
        )
        async for chunk in stream:
            seen.append(chunk)
    assert len(seen) == 1  # the chunk before the error was delivered
    assert (
        run.value(
            "llm_requests_total",
            model=MODEL,
            api_endpoint="/v1/chat/completions",
            status_code="stream_error",
        )
        == 1
    )
    assert (
        run.value(
            "llm_usage_unknown_total",
            model=MODEL,
            api_endpoint="/v1/chat/completions",
            reason="upstream_error",  # a failure: LLMUpstreamErrorRateHigh's, not a metering gap
        )
        == 1
    )
    assert tokens(run, "output") is None


async def test_truncated_stream_is_unknown_not_invented(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar({"metering": {"continuous_usage": False}})
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 6, "stream": True}
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/v1/chat/completions", json=body, headers={"X-Fake": "truncate"}) as r,
    ):
        await r.read()
    assert (
        run.value(
            "llm_usage_unknown_total",
            model=MODEL,
            api_endpoint="/v1/chat/completions",
            reason="stream_truncated",
        )
        == 1
    )
    assert tokens(run, "input") is None and tokens(run, "output") is None


async def test_upstream_reset_midstream_breaks_client_stream(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar()
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 8, "stream": True}
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientPayloadError):
            async with s.post(
                run.url + "/v1/chat/completions", json=body, headers={"X-Fake": "reset"}
            ) as r:
                await r.read()
    key = {"model": MODEL, "api_endpoint": "/v1/chat/completions", "status_code": "stream_error"}

    def recorded() -> bool:
        interrupted = run.value("tollbooth_upstream_errors_total", reason="stream_interrupted")
        return interrupted == 1 and run.value("llm_requests_total", **key) == 1

    await wait_for(recorded, "the request and its interrupted stream recorded")


async def test_upstream_down_is_502_with_openai_error(
    start_sidecar: StartSidecar, oai: Any
) -> None:
    run = await start_sidecar(upstream_url="http://127.0.0.1:9")
    client = oai(run)
    with pytest.raises(openai.APIStatusError) as err:
        await client.chat.completions.create(model=MODEL, messages=MSGS)
    assert err.value.status_code == 502
    assert err.value.body["type"] == "upstream_unreachable"
    assert (
        run.value(
            "llm_requests_total",
            model=MODEL,
            api_endpoint="/v1/chat/completions",
            status_code="502",
        )
        == 1
    )


async def test_upstream_timeout_is_504(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar({"upstream": {"read_timeout_s": 0.2}})
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            run.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": MSGS},
            headers={"X-Fake": "sleep:2"},
        ) as r,
    ):
        assert r.status == 504
        assert (await r.json())["error"]["type"] == "upstream_timeout"


async def test_client_disconnect_cancels_upstream_and_is_recorded(
    start_sidecar: StartSidecar,
) -> None:
    run = await start_sidecar()
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 40, "stream": True}
    async with aiohttp.ClientSession() as s:
        r = await s.post(
            run.url + "/v1/chat/completions", json=body, headers={"X-Fake": "slow-stream"}
        )
        await r.content.readany()
        r.close()  # the client goes away mid-stream
    for _ in range(50):
        await asyncio.sleep(0.02)
        if run.value(
            "llm_requests_total",
            model=MODEL,
            api_endpoint="/v1/chat/completions",
            status_code="499",
        ):
            break
    assert (
        run.value(
            "llm_requests_total",
            model=MODEL,
            api_endpoint="/v1/chat/completions",
            status_code="499",
        )
        == 1
    )
    assert run.value("llm_in_flight_requests", model=MODEL) == 0


async def test_malformed_json_is_forwarded_untouched(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar()
    raw = b'{"model": "x", "messages": [oops'
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/v1/chat/completions", data=raw) as r,
    ):
        assert r.status == 400
        assert (await r.json())["error"]["message"] == "bad json"
    assert run.upstream.seen[-1]["body"] == raw
    # refused upstream, consumed nothing: not an unmeasured request
    assert (
        run.value(
            "llm_usage_unknown_total",
            model="unknown",
            api_endpoint="/v1/chat/completions",
            reason="error_response",
        )
        is None
    )


async def test_oversized_body_is_413(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar({"server": {"max_request_body_bytes": 1000}})
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/v1/completions", data=b"x" * 5000) as r,
    ):
        assert r.status == 413
        assert (await r.json())["error"]["type"] == "request_too_large"
    assert run.upstream.seen == []


async def test_hop_by_hop_dropped_and_forwarded_for_added(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar({"metering": {"unknown_routes": "forward"}})  # /echo is unmetered
    headers = {
        "Connection": "keep-alive, X-Secret-Hop",
        "X-Secret-Hop": "1",
        "X-Keep": "yes",
        "X-Forwarded-For": "10.0.0.1",
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/echo", data=b"abc", headers=headers) as r,
    ):
        assert await r.read() == b"abc"
    got = run.upstream.seen[-1]["headers"]
    assert got["X-Keep"] == "yes"
    assert "X-Secret-Hop" not in got
    assert got["X-Forwarded-For"] == "10.0.0.1, 127.0.0.1"
    assert got["X-Forwarded-Proto"] == "http"


async def test_unmetered_routes_pass_through(start_sidecar: StartSidecar, oai: Any) -> None:
    run = await start_sidecar()
    client = oai(run)
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_user_cardinality_is_capped_totals_exact(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar({"metering": {"max_tracked_users": 2}})
    async with aiohttp.ClientSession() as s:
        for user in ["u1", "u2", "u3", "u4"]:
            async with s.post(
                run.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": MSGS, "max_tokens": 3},
                headers={"X-Tollbooth-User": user},
            ) as r:
                await r.read()
    assert tokens(run, "output", user="u1") == 3
    assert tokens(run, "output", user="__other__") == 6
    total = sum(tokens(run, "output", user=u) or 0 for u in ["u1", "u2", "__other__"])
    assert total == 12


async def test_hostile_user_values_are_sanitised(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar()
    async with aiohttp.ClientSession() as s:
        async with s.post(
            run.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": MSGS, "max_tokens": 1},
            headers={"X-Tollbooth-User": 'a"b\\c{d}' + "x" * 200},
        ) as r:
            await r.read()
        async with s.get(run.admin_url + "/metrics") as m:
            body = await m.text()
    line = next(
        ln for ln in body.splitlines() if ln.startswith("llm_tokens_total{") and "output" in ln
    )
    assert 'user_id="a_b_c_d_' in line
    assert len(line) < 300


async def test_embeddings_and_responses_are_metered(start_sidecar: StartSidecar, oai: Any) -> None:
    run = await start_sidecar()
    client = oai(run)
    await client.embeddings.create(
        model=MODEL, input="a b c", extra_headers={"X-Tollbooth-User": "e"}
    )
    assert tokens(run, "input", "/v1/embeddings", "e") == 3
    await client.responses.create(model=MODEL, input="a b", extra_headers={"X-Tollbooth-User": "r"})
    assert tokens(run, "input", "/v1/responses", "r") == 2
    assert tokens(run, "output", "/v1/responses", "r") == 4
    stream = await client.responses.create(
        model=MODEL, input="a b c", stream=True, extra_headers={"X-Tollbooth-User": "rs"}
    )
    events = [e.type async for e in stream]
    assert events[-1] == "response.completed"
    assert tokens(run, "input", "/v1/responses", "rs") == 3
    assert (
        run.value(
            "llm_cached_input_tokens_total", model=MODEL, api_endpoint="/v1/responses", user_id="rs"
        )
        == 1
    )


async def test_metrics_endpoints(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar()
    async with aiohttp.ClientSession() as s:
        async with s.get(run.admin_url + "/healthz") as r:
            assert r.status == 200
        async with s.get(run.admin_url + "/readyz") as r:
            assert r.status == 200
        async with s.get(
            run.admin_url + "/metrics", headers={"Accept": "application/openmetrics-text"}
        ) as r:
            assert r.headers["Content-Type"].startswith("application/openmetrics-text")
            assert (await r.text()).endswith("# EOF\n")


# --- end-to-end headers (pure helpers) -----------------------------------------------------------

_HEADER_NAMES = ["Connection", "connection", "CONNECTION", "Keep-Alive", "keep-alive", "TE", "te"]
_HEADER_NAMES += ["Transfer-Encoding", "Upgrade", "Proxy-Connection", "Host", "Content-Length"]
_HEADER_NAMES += [
    "X-A",
    "x-a",
    "X-B",
    "Authorization",
    "Trailer",
    "Proxy-Authorization",
    "Accept",
    "Expect",
]


def _end_to_end_by_definition(items: list[tuple[str, str]], drop: set[str]) -> list[Any]:
    """RFC 9110 7.6.1, the obvious way: every Connection field line names options (a list,
    case-insensitive, optional whitespace); those and `drop` go, all else stays in order."""
    listed = {
        t.strip(" \t").lower()
        for k, v in items
        if k.lower() == "connection"
        for t in v.split(",")
        if t.strip(" \t")
    }
    return [(k, v) for k, v in items if k.lower() not in drop | listed]


@given(
    st.lists(
        st.tuples(
            st.sampled_from(_HEADER_NAMES),
            st.lists(
                st.tuples(
                    st.sampled_from(["", " ", "\t", " \t"]),
                    st.sampled_from([*_HEADER_NAMES, "close", "x-c"]),
                    st.sampled_from([",", ", ", " ,", ",,", ",\t"]),
                ),
                max_size=3,
            ).map(lambda parts: "".join(a + b + c for a, b, c in parts)),
        ),
        max_size=8,
    )
)
def test_headers_named_in_any_connection_field_line_are_dropped(
    items: list[tuple[str, str]],
) -> None:
    src = CIMultiDictProxy(CIMultiDict(items))
    got = response_headers(src, drop_length=False)
    assert list(got.items()) == _end_to_end_by_definition(items, set(HOP_BY_HOP))
    got = request_headers(src, peer=None, scheme="http")
    kept = _end_to_end_by_definition(items, {*HOP_BY_HOP, "host", "content-length", "expect"})
    first: dict[str, str] = {}  # upstream: a repeated name spelt as its first (_one_spelling)
    want = [(first.setdefault(k.lower(), k), v) for k, v in kept]
    assert list(got.items())[: len(want)] == want


def test_a_second_connection_header_is_read_too() -> None:
    src = CIMultiDict([("Connection", "keep-alive"), ("connection", "X-Hop, x-other")])
    src.extend([("X-Hop", "1"), ("x-OTHER", "2"), ("X-Keep", "3")])
    got = request_headers(CIMultiDictProxy(src), peer=None, scheme="http")
    assert list(got.items()) == [("X-Keep", "3"), ("X-Forwarded-Proto", "http")]


async def test_a_request_body_the_meter_cannot_read_is_forwarded_and_counted(
    start_sidecar: StartSidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in reading a request is accounting's, not the client's: logged, counted, and the
    request goes on, metered from the response."""
    import sidecar.proxy.request

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("a body the meter did not expect")

    monkeypatch.setattr(sidecar.proxy.request, "inspect_request", broken)
    run = await start_sidecar()
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 3}
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 200
        assert (await r.json())["usage"]["completion_tokens"] == 3
    assert run.value("tollbooth_metering_errors_total", stage="inspect") == 1
    assert tokens(run, "output") == 3


async def _body_in_parts(url: str, body: bytes, parts: int, pause: float) -> bytes:
    """POST `body` split in `parts` sent `pause` seconds apart (never the rest when parts is 0:
    half of it, then silence); what came back before the server closed, at most 3 s."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode())
    size = -(-len(body) // parts) if parts else len(body)
    pieces = [body[i : i + size] for i in range(0, len(body), size)] if parts else [body[:20]]
    try:
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(pause)
        return await asyncio.wait_for(reader.read(65536), 3.0)
    finally:
        writer.close()


async def test_a_body_that_stops_arriving_is_answered_408(start_sidecar: StartSidecar) -> None:
    """Headers, half the body, silence: 408 after server.body_timeout_s, the connection closed,
    nothing forwarded, the cut counted. A slow body that arrives in time is served."""
    run = await start_sidecar({"server": {"body_timeout_s": 0.5}})
    body = json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 3}).encode()
    answer = await _body_in_parts(run.url, body, 0, 0.0)
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"Connection: close" in head, head
    assert json.loads(payload)["error"]["type"] == "request_timeout"
    cut = {"listener": "proxy", "reason": "body_timeout"}
    assert run.value("tollbooth_connections_cut_total", **cut) == 1
    assert run.upstream is not None and run.upstream.seen == []
    answer = await _body_in_parts(run.url, body, 3, 0.1)  # 0.2 s in all: in time
    assert answer.startswith(b"HTTP/1.1 200"), answer[:100]
    assert run.value("tollbooth_connections_cut_total", **cut) == 1


async def _send_raw(url: str, head: str, body: bytes) -> bytes:
    """One request written byte for byte (no client library adds a header); the whole answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head.replace("\n", "\r\n").encode("utf-8", "surrogateescape") + b"\r\n" + body)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return answer


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/echo"])
async def test_the_upstream_gets_no_header_the_client_did_not_send(
    start_sidecar: StartSidecar, path: str
) -> None:
    """aiohttp's client adds Accept, Accept-Encoding (gzip: an upstream may then compress a reply
    the client cannot read), User-Agent and Content-Type to a request that lacks them. The proxy
    sends none of them: only Host, the body's framing and X-Forwarded-*."""
    run = await start_sidecar({"metering": {"unknown_routes": "forward"}})  # /echo is unmetered
    assert run.upstream is not None
    body = json.dumps({"model": MODEL, "messages": MSGS}).encode()
    head = f"POST {path} HTTP/1.1\nHost: x\nContent-Length: {len(body)}\nConnection: close\n"
    answer = await _send_raw(run.url, head, body)
    assert answer.startswith(b"HTTP/1.1 200 ")
    sent = {k.lower() for k in run.upstream.seen[-1]["headers"]}
    framing = {"content-length", "transfer-encoding"}
    assert sent - framing == {"host", "x-forwarded-for", "x-forwarded-proto"}


async def test_header_bytes_that_are_not_utf8_reach_the_upstream_as_the_client_sent_them(
    start_sidecar: StartSidecar,
) -> None:
    """HTTP allows any byte above 0x7f in a header value (obs-text). aiohttp's client dropped
    such a byte; a metered request's headers now reach the upstream byte for byte."""
    run = await start_sidecar()
    assert run.upstream is not None
    body = json.dumps({"model": MODEL, "messages": MSGS}).encode()
    head = "POST /v1/chat/completions HTTP/1.1\nHost: x\nX-Note: caf\udce9 \udcff!\n"
    head += f"Content-Length: {len(body)}\nConnection: close\n"
    assert (await _send_raw(run.url, head, body)).startswith(b"HTTP/1.1 200 ")
    # the fake upstream (aiohttp's server) reads bytes that are not UTF-8 as surrogates
    assert run.upstream.seen[-1]["headers"]["X-Note"] == "caf\udce9 \udcff!"


async def test_a_cookie_the_upstream_sets_is_not_sent_with_another_clients_request(
    start_sidecar: StartSidecar, aiohttp_server: Any
) -> None:
    """The sidecar's client to the upstream keeps no cookies: one the upstream (or a sticky
    load balancer in front of it) sets for one client's request reaches that client only, and is
    never replayed on the requests of others."""
    cookies: list[str | None] = []

    async def models(request: web.Request) -> web.Response:
        cookies.append(request.headers.get("Cookie"))
        return web.json_response({"data": []}, headers={"Set-Cookie": "session=alice; Path=/"})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    server = await aiohttp_server(app)
    run = await start_sidecar(upstream_url=f"http://localhost:{server.port}")  # a host name
    async with aiohttp.ClientSession() as alice, alice.get(run.url + "/v1/models") as r:
        assert r.headers["Set-Cookie"] == "session=alice; Path=/"  # the client gets it
    async with (
        aiohttp.ClientSession() as bob,
        bob.get(run.url + "/v1/models", headers={"Cookie": "mine=bob"}) as r,
    ):
        assert r.status == 200
    assert cookies == [None, "mine=bob"]


async def test_one_clients_body_cannot_stop_the_metering_of_anothers(
    start_sidecar: StartSidecar,
) -> None:
    """Mallory's request names two keys (tests/test_usage.py: USAGE_TWIN is a key that a parser
    with a hash-only key cache reads as "usage"); Alice's later request is metered all the same."""
    from tests.test_usage import USAGE_SLOT, USAGE_TWIN

    run = await start_sidecar()
    chat = {"model": MODEL, "messages": MSGS, "max_tokens": 7}
    async with aiohttp.ClientSession() as s:
        mallory = {**chat, USAGE_SLOT: 0, USAGE_TWIN: 0}
        headers = {"X-Tollbooth-User": "mallory"}
        async with s.post(run.url + "/v1/chat/completions", json=mallory, headers=headers) as r:
            assert r.status == 200
        headers = {"X-Tollbooth-User": "alice"}
        async with s.post(run.url + "/v1/chat/completions", json=chat, headers=headers) as r:
            assert r.status == 200
            assert (await r.json())["usage"]["completion_tokens"] == 7
    assert tokens(run, "input", user="alice") == 5
    assert tokens(run, "output", user="alice") == 7


async def test_a_header_sent_twice_reaches_the_upstream_twice_however_its_name_is_spelt(
    start_sidecar: StartSidecar, aiohttp_server: Any
) -> None:
    """Field lines of one name are one field (RFC 9110 5.3), whatever the case of each name:
    the upstream gets every value, in order (aiohttp's client kept only the last line of a name
    spelt two ways), and X-Forwarded-For appends to all of the client's lines, not the first."""
    got: list[list[tuple[str, str]]] = []

    async def echo(request: web.Request) -> web.Response:
        got.append([(k.decode().lower(), v.decode()) for k, v in request.raw_headers])
        return web.Response(body=await request.read())

    app = web.Application()
    app.router.add_post("/echo", echo)
    server = await aiohttp_server(app)
    run = await start_sidecar(
        {"metering": {"unknown_routes": "forward"}}, upstream_url=f"http://127.0.0.1:{server.port}"
    )
    head = (
        "POST /echo HTTP/1.1\nHost: x\nx-FoO: a\nX-foo: b\nX-Forwarded-For: 10.0.0.1\n"
        "x-forwarded-for: 10.0.0.2\nContent-Length: 3\nConnection: close\n"
    )
    answer = await _send_raw(run.url, head, b"abc")
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    assert [v for k, v in got[-1] if k == "x-foo"] == ["a", "b"]
    assert [v for k, v in got[-1] if k == "x-forwarded-for"] == ["10.0.0.1, 10.0.0.2, 127.0.0.1"]


async def test_a_meter_that_fails_on_a_stream_forwards_it_unchanged(
    start_sidecar: StartSidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accounting never breaks traffic: the meter raising on a read of a stream leaves the client
    with the upstream's bytes (nothing injected here, so nothing to cut), the failure counted,
    and the stream's usage unknown rather than invented."""
    from sidecar.metering.shape import FastChatStream

    run = await start_sidecar({"metering": {"inject_stream_usage": False}, "pricing": PRICING})
    body = {"model": MODEL, "messages": MSGS, "stream": True, "max_tokens": 6}

    async def stream(url: str) -> bytes:
        async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
            return await r.read()

    direct = await stream(run.sc.config.upstream.url + "/v1/chat/completions")
    feed, reads = FastChatStream.feed, [0]

    def failing(self: FastChatStream, chunk: bytes) -> bytes:
        reads[0] += 1
        if reads[0] == 1:
            raise RuntimeError("a bug in metering")
        return feed(self, chunk)

    monkeypatch.setattr(FastChatStream, "feed", failing)
    assert await stream(run.url + "/v1/chat/completions") == direct
    assert reads[0] >= 1
    assert run.value("tollbooth_metering_errors_total", stage="stream") == 1
    assert tokens(run, "output") is None


async def test_a_client_expecting_100_continue_is_answered_by_the_sidecar_alone(
    start_sidecar: StartSidecar,
) -> None:
    """The sidecar answers `Expect: 100-continue` itself (aiohttp's server sends the 100) and
    reads the body; it does not pass the expectation on. Passed on, aiohttp's client would hold
    the body until the upstream sent its own 100, and an upstream that never does (it may ignore
    the header) would see no body until it gave up."""
    reply = json.dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "created": 1,
            "model": MODEL,
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "ok"}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        }
    ).encode()
    seen: list[bytes] = []

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")  # answers no Expect: waits for the body
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        try:
            await asyncio.wait_for(reader.readexactly(length), 2.0)
        except TimeoutError:
            writer.close()
            return
        seen.append(head)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(reply)}\r\n\r\n".encode()
            + reply
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(upstream, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    run = await start_sidecar({"pricing": PRICING}, upstream_url=f"http://127.0.0.1:{port}")
    body = json.dumps({"model": MODEL, "messages": MSGS}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\nHost: x\nContent-Type: application/json\n"
        f"Content-Length: {len(body)}\nExpect: 100-continue\nConnection: close\n"
    )
    answer = await _send_raw(run.url, head, body)
    server.close()
    assert answer.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 "), answer[:80]
    assert b"expect" not in seen[0].lower()
    assert tokens(run, "output") == 1
