"""The metered requests' pool (sidecar/proxy/upstream.py) against a hostile or buggy upstream and
clients that leave at awkward moments: one request's failure must never reach another's response,
the pool must count its connections exactly, and no answer may hang a request."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from sidecar.proxy import upstream as pool_module
from tests.conftest import StartSidecar
from tests.fakes import MODEL
from tests.test_upstream import OK, Serve, Server, upstream_answering
from tests.waiting import wait_for

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def first_then_silent(first: bytes, *, rest: bytes = b"") -> Any:
    """The first request gets `first` (then `rest` a little later); any later one on the same
    connection gets nothing at all (the upstream is busy)."""

    def make(server: Server) -> Serve:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while await server.head(reader):
                if len(server.heads) > 1:
                    await reader.read()  # until the pool gives up and closes the connection
                    return
                writer.write(first)
                await writer.drain()
                if rest:
                    await asyncio.sleep(0.05)  # the rest in a later read: headers are in first
                    writer.write(rest)
                    await writer.drain()

        return serve

    return make


async def test_a_failure_on_a_reused_connection_does_not_reach_the_response_read_before() -> None:
    """A's body arrived whole (the connection went back to the pool at once) but A's handler has
    not read all of it yet: a slow client holds it in a write. B's request then times out on that
    connection. Before the fix, the protocol still held A's body as its current payload and set
    B's timeout on it: A's stream broke with B's error, its usage chunk (the last bytes) unread,
    so A went unbilled."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 12\r\n\r\n"
    make = first_then_silent(head, rest=b"data: A-end\n")
    async with upstream_answering(make, read_timeout=0.3, limit=1) as (server, up):
        a = await up.request("POST", "/v1/chat/completions", CIMultiDict(), b"{}")
        await wait_for(lambda: bool(up.idle), "the connection back in the pool")
        assert a.content.is_eof()  # A's body is all in its reader, unread; the connection is idle
        with pytest.raises(aiohttp.SocketTimeoutError):
            await up.request("POST", "/v1/chat/completions", CIMultiDict(), b"{}")
        assert server.accepted == 1  # B went on A's connection
        assert await a.content.read() == b"data: A-end\n"


async def test_a_101_the_sidecar_never_asked_for_is_a_bad_response_not_a_hang() -> None:
    """A 101 ends HTTP on the connection; read past like a 100, the pool waited for a final
    answer that could never be parsed, with the read timeout dropped: the request hung until its
    client gave up, holding a place in the pool. aiohttp's client returned the 101."""
    switched = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n"
    async with upstream_answering(first_then_silent(switched), read_timeout=0.3) as (_, up):
        with pytest.raises(pool_module.BadResponse):
            await asyncio.wait_for(up.request("POST", "/v1/completions", CIMultiDict(), b"{}"), 3)
        await wait_for(lambda: up.opened == 0, "the connection closed")


async def test_a_101_through_the_sidecar_is_a_502(
    start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    switched = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n"
    run = await start_sidecar(upstream_url=await raw_upstream(lambda head: switched))
    async with aiohttp.ClientSession() as s:
        post = s.post(run.url + "/v1/chat/completions", json=CHAT)
        async with await asyncio.wait_for(post, 5) as r:
            assert r.status == 502
            assert (await r.json())["error"]["type"] == "upstream_unreachable"


RawUpstream = Callable[[Callable[[bytes], bytes]], Awaitable[str]]


@pytest.fixture
async def raw_upstream() -> AsyncIterator[RawUpstream]:
    """Start loopback upstreams that read each request (head, and a Content-Length body) and write
    `answer(head)`; each gives its URL. Closed at teardown."""
    servers: list[asyncio.Server] = []

    async def start(answer: Callable[[bytes], bytes]) -> str:
        srv = await asyncio.start_server(functools.partial(_serve_raw, answer), "127.0.0.1", 0)
        servers.append(srv)
        return f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"

    yield start
    for srv in servers:
        srv.close()


async def _serve_raw(
    answer: Callable[[bytes], bytes], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        while head := await reader.readuntil(b"\r\n\r\n"):
            lines = head.lower().split(b"\r\n")
            length = [int(x.split(b":")[1]) for x in lines if x.startswith(b"content-length:")]
            await reader.readexactly(length[0] if length else 0)
            writer.write(answer(head))
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def _answer_each(
    server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes
) -> None:
    while await server.head(reader):
        writer.write(data)
        await writer.drain()


async def test_a_request_cancelled_as_its_connection_is_made_gives_its_place_back_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The client leaves in the instant the upstream's connection comes up: asyncio closes the
    new transport, whose connection_lost gives the place back; the failed open gave it back as
    well, so the pool counted -1 open and went past its limit from then on."""
    async with upstream_answering(lambda server: _serving(server, OK), limit=1) as (server, up):
        opener: list[asyncio.Task[Any]] = []
        made = pool_module.Connection.connection_made

        def made_then_cancelled(conn: Any, transport: asyncio.BaseTransport) -> None:
            made(conn, transport)
            opener[0].cancel()

        monkeypatch.setattr(pool_module.Connection, "connection_made", made_then_cancelled)
        opener.append(asyncio.ensure_future(up._acquire()))
        with pytest.raises(asyncio.CancelledError):
            await opener[0]
        monkeypatch.undo()
        await wait_for(lambda: up.opened == 0, "the closed transport's connection_lost")
        # limit 1: two requests at once, never two connections open
        await asyncio.gather(*(_post(up) for _ in range(2)))
        assert server.most_open == 1


def _serving(server: Server, data: bytes) -> Serve:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _answer_each(server, reader, writer, data)

    return serve


async def _post(up: pool_module.Upstream) -> bytes:
    resp = await up.request("POST", "/v1/completions", CIMultiDict(), b"{}")
    try:
        return await resp.read()
    finally:
        resp.release()


async def test_an_ipv6_upstream_with_a_path_prefix_gets_the_prefix_and_its_host(
    start_sidecar: StartSidecar,
) -> None:
    """`http://[::1]:port/prefix`: the pool connects to ::1, writes `Host: [::1]:port`, and the
    request target keeps the prefix (as aiohttp's client did)."""
    heads: list[bytes] = []
    body = b'{"usage": {"prompt_tokens": 2, "completion_tokens": 1}}'
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"

    def record(head: bytes) -> bytes:
        heads.append(head)
        return answer % len(body) + body

    try:
        srv = await asyncio.start_server(functools.partial(_serve_raw, record), "::1", 0)
    except OSError:
        pytest.skip("no IPv6 loopback")
    port = srv.sockets[0].getsockname()[1]
    try:
        run = await start_sidecar(upstream_url=f"http://[::1]:{port}/prefix")
        async with (
            aiohttp.ClientSession() as s,
            s.post(run.url + "/v1/chat/completions?a=1", json=CHAT) as r,
        ):
            assert r.status == 200 and await r.read() == body
    finally:
        srv.close()
    sent = [h for h in heads if h.startswith(b"POST")]
    assert sent[0].startswith(b"POST /prefix/v1/chat/completions?a=1 HTTP/1.1\r\n")
    assert f"\r\nHost: [::1]:{port}\r\n".encode() in sent[0]
