"""Disconnects are billed for what was measured (issue 10).

A client that leaves after the last token is billed the exact usage (the sidecar reads on to the
usage chunk); one that leaves mid-generation cancels the upstream and is billed the exact prompt
and the output measured so far; a client leaving is a 499, never a 5xx. The sidecar runs as
`serve()` runs it (the handler is cancelled when the client goes) and as aiohttp runs it by
default (it is not, and the next write fails).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from sidecar.config import Config, build, validate
from sidecar.core.app import Sidecar, create_app
from sidecar.core.wiring import wire
from tests.conftest import Running, StartSidecar
from tests.fakes import MODEL, FakeUpstream
from tests.procs import free_port

PRICING = {"models": {MODEL: {"input_per_1m": 1.0, "output_per_1m": 2.0}}}
MSGS = [{"role": "user", "content": "one two three four five"}]  # 5 prompt tokens at the fake
CHAT = "/v1/chat/completions"
KEY = {"model": MODEL, "api_endpoint": CHAT}


def value(run: Running, name: str, **labels: str) -> Any:
    return run.value(name, **{**KEY, **labels})


async def recorded(run: Running, status: str = "499", timeout: float = 5.0) -> None:
    """Wait until the meter has recorded the request (a finisher may still be settling it)."""
    for _ in range(int(timeout / 0.02)):
        if value(run, "llm_requests_total", status_code=status):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"no request recorded with status {status}")


async def upstream_cancelled(run: Running, timeout: float = 2.0) -> None:
    """Wait until the upstream has seen a request cancelled (or the time is up: the caller's
    assertion on `run.upstream.cancelled` says what was expected)."""
    for _ in range(int(timeout / 0.02)):
        if run.upstream.cancelled:
            return
        await asyncio.sleep(0.02)


def tokens(run: Running, direction: str) -> Any:
    return value(run, "llm_tokens_total", token_type=direction, user_id="anonymous")


async def leave_before_the_first_byte(run: Running) -> None:
    """A non-streamed request whose client gives up while the upstream still has it."""
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 4}
    timeout = aiohttp.ClientTimeout(total=0.3)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        with pytest.raises(TimeoutError):
            async with s.post(run.url + CHAT, json=body, headers={"X-Fake": "sleep:1"}) as r:
                await r.read()


async def leave_after_three_chunks(run: Running) -> None:
    """A stream of 400 tokens whose client goes away after three chunks."""
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 400, "stream": True}
    async with aiohttp.ClientSession() as s:
        r = await s.post(run.url + CHAT, json=body, headers={"X-Fake": "slow-stream:0.02"})
        seen = b""
        while seen.count(b"data: ") < 3:
            seen += await r.content.readany()
        r.close()


Start = Callable[..., Awaitable[Running]]


@pytest.fixture
async def start_plain(upstream: tuple[FakeUpstream, Any], tmp_path: Any) -> AsyncIterator[Start]:
    """A sidecar whose handler learns that its client left only when a write fails (aiohttp's
    default; `start_sidecar`'s handler is cancelled instead, as under `serve()`)."""
    runners: list[web.AppRunner] = []

    async def plain(config: dict[str, Any] | None = None) -> Running:
        data = {**(config or {}), "audit": {"path": str(tmp_path / "audit.jsonl")}}
        data["upstream"] = {"url": str(upstream[1].make_url("")).rstrip("/")}
        sc = wire(Sidecar(validate(build(Config, data))))
        runner = web.AppRunner(create_app(sc), handler_cancellation=False)
        await runner.setup()
        runners.append(runner)
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return Running(f"http://127.0.0.1:{port}", "", sc, upstream[0])

    yield plain
    for runner in runners:
        await runner.cleanup()


@pytest.fixture(params=["cancelled", "not_cancelled"])
def start(request: pytest.FixtureRequest, start_sidecar: StartSidecar, start_plain: Start) -> Start:
    return start_sidecar if request.param == "cancelled" else start_plain


async def test_leaving_after_the_last_token_is_billed_the_exact_usage(
    start_sidecar: StartSidecar,
) -> None:
    run = await start_sidecar({"pricing": PRICING})
    async with openai.AsyncOpenAI(base_url=run.url + "/v1", api_key="k", max_retries=0) as c:
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=MSGS,
            max_tokens=8,
            stream=True,
            extra_headers={"X-Fake": "slow-usage:0.4", "X-Tollbooth-User": "anonymous"},
        )
        async for chunk in stream:
            if chunk.choices[0].finish_reason:
                break  # the whole answer is here; the usage chunk is not
        await stream.close()
    await recorded(run)
    assert (tokens(run, "input"), tokens(run, "output")) == (5, 8)  # exact, from the usage chunk
    assert value(run, "llm_usage_unknown_total", reason="client_disconnected") is None
    assert run.value("llm_cost_usd_total", token_type="output", user_id="anonymous", **KEY) > 0
    assert run.upstream is not None and run.upstream.cancelled == []  # it was read to its end


@pytest.mark.parametrize("continuous", [True, False])
async def test_leaving_mid_generation_cancels_the_upstream_and_bills_what_was_measured(
    start: Start, continuous: bool
) -> None:
    run = await start({"pricing": PRICING, "metering": {"continuous_usage": continuous}})
    assert run.upstream is not None
    await leave_after_three_chunks(run)
    await recorded(run)
    await upstream_cancelled(run)
    assert run.upstream.cancelled == [CHAT]  # the generation was stopped, the GPU freed
    assert tokens(run, "input") == 5  # exact: the server's running totals, or its /tokenize
    out = tokens(run, "output")
    if continuous:  # the running total of the last chunk the sidecar read: exact
        assert out is not None and 2 <= out <= run.upstream.sent_tokens < 400 and out % 2 == 0
        assert run.upstream.tokenized == []
    else:
        assert out is None
        assert value(run, "llm_usage_unknown_total", reason="client_disconnected") == 1
        assert [t["path"] for t in run.upstream.tokenized] == ["/tokenize"]
        assert run.upstream.tokenized[0]["body"]["messages"] == MSGS
    # never billed $0: the prompt at least is spent
    assert run.value("llm_cost_usd_total", token_type="input", user_id="anonymous", **KEY) > 0


async def test_leaving_before_the_first_byte_bills_the_prompt(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar({"pricing": PRICING})
    assert run.upstream is not None
    await leave_before_the_first_byte(run)
    await recorded(run)
    assert tokens(run, "input") == 5  # counted by the server's own tokenizer
    assert tokens(run, "output") is None
    assert value(run, "llm_usage_unknown_total", reason="client_disconnected") == 1
    await upstream_cancelled(run)
    assert run.upstream.cancelled == [CHAT]


async def test_leaving_once_the_stream_is_complete_is_a_499_not_a_502(start_plain: Start) -> None:
    """The last event is delivered; the client resets before the response's end (the handler is
    not cancelled: the failed end of the response is where the sidecar learns it)."""
    run = await start_plain({"pricing": PRICING})
    body = json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 4, "stream": True})
    host, port = run.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    request = (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"X-Fake: slow-eof:0.5\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    )
    writer.write(request.encode())
    seen = b""
    while b"data: [DONE]" not in seen:
        seen += await reader.read(65536)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()  # RST: the client is gone before the chunked terminator
    await recorded(run)
    assert (tokens(run, "input"), tokens(run, "output")) == (5, 4)
    assert run.value("tollbooth_upstream_errors_total", reason="upstream_unreachable") is None
    assert not value(run, "llm_requests_total", status_code="502")  # published ahead at 0: none


async def test_reading_on_after_the_client_left_is_bounded(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar(
        {"metering": {"continuous_usage": False, "drain_after_disconnect_s": 0.3}}
    )
    assert run.upstream is not None
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 4, "stream": True}
    async with aiohttp.ClientSession() as s:
        r = await s.post(run.url + CHAT, json=body, headers={"X-Fake": "slow-usage:30"})
        seen = b""
        while b'"finish_reason":"length"' not in seen:
            seen += await r.content.readany()
        r.close()  # after the last token; the usage chunk would come 30 s later
    await recorded(run, timeout=3.0)  # the drain gave up after 0.3 s, /tokenize took over
    assert tokens(run, "input") == 5 and tokens(run, "output") is None
    assert value(run, "llm_usage_unknown_total", reason="client_disconnected") == 1
    await upstream_cancelled(run)
    assert run.upstream.cancelled == [CHAT]


async def test_a_client_leaving_mid_stream_with_no_finisher_free_is_counted_once(
    start_sidecar: StartSidecar,
) -> None:
    """At the finishers' limit the stream's own handling records the request as measured; the
    handler's (for a request the upstream still had) must not count it a second time."""
    run = await start_sidecar({"pricing": PRICING})
    assert run.sc.proxy is not None
    run.sc.proxy.deps.finishers.limit = 0
    await leave_after_three_chunks(run)
    await recorded(run)
    assert run.value("tollbooth_metering_errors_total", stage="finisher_limit") == 1
    assert tokens(run, "input") == 5  # the running totals read before it left
    assert value(run, "llm_requests_total", status_code="499") == 1


async def test_a_client_leaving_before_the_first_byte_with_no_finisher_free_is_disconnected(
    start_sidecar: StartSidecar,
) -> None:
    """No finisher can count the prompt: the usage is unknown for the reason it is unknown."""
    run = await start_sidecar({"pricing": PRICING})
    assert run.sc.proxy is not None
    run.sc.proxy.deps.finishers.limit = 0
    await leave_before_the_first_byte(run)
    await recorded(run)
    assert run.value("tollbooth_metering_errors_total", stage="finisher_limit") == 1
    assert value(run, "llm_usage_unknown_total", reason="client_disconnected") == 1
    assert value(run, "llm_usage_unknown_total", reason="unknown") is None
