"""The metered requests' pool (sidecar/proxy/upstream.py) against a server written byte for byte:
reuse, the connection limit, timeouts, odd answers, and what goes on the wire."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict

from sidecar.proxy import upstream as upstream_module
from sidecar.proxy.upstream import BadResponse, Upstream
from tests.waiting import wait_for

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


class Server:
    """A loopback server running `serve` for each connection; it counts them."""

    def __init__(self, serve: Serve) -> None:
        self.serve = serve
        self.accepted = 0
        self.open = 0
        self.most_open = 0
        self.heads: list[bytes] = []

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            await self.serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.open -= 1
            writer.close()

    async def head(self, reader: asyncio.StreamReader) -> bytes:
        """One request's head and body (Content-Length); b"" when the client closed."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return b""
        self.heads.append(head)
        length = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.startswith(b"Content-")
        )
        await reader.readexactly(length)
        return head


@contextlib.asynccontextmanager
async def serving(serve: Serve, **pool: Any) -> AsyncIterator[tuple[Server, Upstream]]:
    server = Server(serve)
    srv = await asyncio.start_server(server, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    settings = {"connect_timeout": 2.0, "read_timeout": 5.0, "limit": 10, **pool}
    up = Upstream(f"http://127.0.0.1:{port}", **settings)
    try:
        yield server, up
    finally:
        await up.close()
        srv.close()


def answering(*responses: bytes, then_close: bool = False) -> Callable[[Server], Serve]:
    """Each request gets the next of `responses`, whatever its connection (the last repeats)."""

    def make(server: Server) -> Serve:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while await server.head(reader):
                writer.write(responses[min(len(server.heads) - 1, len(responses) - 1)])
                await writer.drain()
                if then_close:
                    return

        return serve

    return make


@contextlib.asynccontextmanager
async def upstream_answering(
    make: Callable[[Server], Serve], **pool: Any
) -> AsyncIterator[tuple[Server, Upstream]]:
    holder: dict[str, Server] = {}

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await make(holder["server"])(reader, writer)

    async with serving(serve, **pool) as (server, up):
        holder["server"] = server
        yield server, up


async def post(up: Upstream, body: bytes = b"{}", **headers: str) -> bytes:
    resp = await up.request("POST", "/v1/chat/completions", CIMultiDict(headers), body)
    try:
        return await resp.read()
    finally:
        resp.release()


async def test_a_connection_is_reused_once_its_response_was_read_to_the_end() -> None:
    async with upstream_answering(answering(OK)) as (server, up):
        for _ in range(3):
            assert await post(up) == b"{}"
        assert server.accepted == 1


async def test_a_response_left_unread_closes_its_connection() -> None:
    """Not read to its end, a connection cannot carry another request: closed (which is how the
    upstream learns the client left), and the next request opens a new one."""
    started = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"
    async with upstream_answering(answering(started, OK)) as (server, up):
        resp = await up.request("POST", "/v1/completions", CIMultiDict(), b"{}")
        assert await resp.content.readany() == b"hello"
        resp.release()
        assert await post(up) == b"{}"
        assert server.accepted == 2
        await wait_for(lambda: server.open == 1, "the first one to be closed")


async def test_the_pool_opens_at_most_its_limit_and_the_rest_wait() -> None:
    def make(server: Server) -> Serve:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while await server.head(reader):
                await asyncio.sleep(0.05)
                writer.write(OK)
                await writer.drain()

        return serve

    async with upstream_answering(make, limit=2) as (server, up):
        bodies = await asyncio.gather(*(post(up) for _ in range(7)))
        assert bodies == [b"{}"] * 7
        assert server.most_open == 2
        assert up.opened == 2


async def test_a_waiter_that_gives_up_leaves_its_turn_to_the_next() -> None:
    hold = asyncio.Event()

    def make(server: Server) -> Serve:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while await server.head(reader):
                await hold.wait()
                writer.write(OK)
                await writer.drain()

        return serve

    async with upstream_answering(make, limit=1) as (server, up):
        first = asyncio.ensure_future(post(up))
        await wait_for(lambda: server.accepted == 1, "the first request's connection")
        quitter = asyncio.ensure_future(post(up))
        patient = asyncio.ensure_future(post(up))
        await wait_for(lambda: len(up.waiting) == 2, "two requests waiting for a place")
        quitter.cancel()
        hold.set()
        assert await asyncio.wait_for(first, 2) == b"{}"
        assert await asyncio.wait_for(patient, 2) == b"{}"
        assert quitter.cancelled()
        assert server.accepted == 1 and not up.waiting


async def test_a_waiter_woken_then_cancelled_passes_its_turn_on() -> None:
    """The connection went to the first waiter, which was cancelled before it could take it:
    the next waiter must get it, or it waits for good."""
    async with upstream_answering(answering(OK), limit=1) as (_, up):
        conn = await up._acquire()  # the only place
        quitter = asyncio.ensure_future(up._acquire())
        patient = asyncio.ensure_future(up._acquire())
        await wait_for(lambda: len(up.waiting) == 2, "two waiters")
        up.put(conn)  # wakes the quitter...
        quitter.cancel()  # ...which leaves before it runs
        assert await asyncio.wait_for(patient, 1) is conn


async def test_silence_longer_than_the_read_timeout_fails_and_a_slow_stream_does_not() -> None:
    """The read timeout bounds each silence, not the whole response: a stream whose events come
    every 0.1 s for over 4 timeouts is read to its end; one silent for a timeout fails."""
    events = 12

    def make(server: Server) -> Serve:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while head := await server.head(reader):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
                writer.write(b"Transfer-Encoding: chunked\r\n\r\n")
                if b"silent" in head:
                    await asyncio.sleep(2)
                    return
                for _ in range(events):
                    await asyncio.sleep(0.1)
                    writer.write(b"6\r\ndata:\n\r\n")
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
                await writer.drain()

        return serve

    async with upstream_answering(make, read_timeout=0.3) as (_, up):
        assert await post(up) == b"data:\n" * events
        with pytest.raises(aiohttp.SocketTimeoutError) as caught:
            await post(up, x_mode="silent")
        assert isinstance(caught.value, TimeoutError)


async def test_an_upstream_that_sends_nothing_after_the_request_times_out() -> None:
    def make(server: Server) -> Serve:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.head(reader)
            await asyncio.sleep(2)

        return serve

    async with upstream_answering(make, read_timeout=0.2) as (_, up):
        with pytest.raises(TimeoutError):
            await post(up)
        await wait_for(lambda: up.opened == 0, "the connection closed, its place given back")


async def test_an_interim_response_is_read_past() -> None:
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
    async with upstream_answering(answering(interim + OK)) as (_, up):
        resp = await up.request("POST", "/v1/completions", CIMultiDict(), b"{}")
        assert resp.status == 200 and await resp.read() == b"{}"
        resp.release()


async def test_an_answer_that_is_not_http_is_a_client_error() -> None:
    async with upstream_answering(answering(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")) as (_, up):
        with pytest.raises(BadResponse) as caught:
            await post(up)
        assert isinstance(caught.value, aiohttp.ClientError)


async def test_a_connection_the_upstream_closed_while_idle_is_not_used_again() -> None:
    async with upstream_answering(answering(OK, then_close=True)) as (server, up):
        assert await post(up) == b"{}"
        await wait_for(lambda: up.opened == 0, "the upstream's FIN")
        assert await post(up) == b"{}"
        assert server.accepted == 2
        assert up.opened == 1


async def test_a_connection_idle_for_long_is_closed_though_no_request_comes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A quiet pool does not hold its connections open for good (aiohttp's connector closed
    them after 15 s idle too): the upstream sees them closed, and their places are free."""
    monkeypatch.setattr(upstream_module, "IDLE_S", 0.4)
    async with upstream_answering(answering(OK)) as (server, up):
        await asyncio.gather(post(up), post(up), post(up))
        assert server.open == up.opened == 3
        await asyncio.sleep(0.2)  # idle for less than IDLE_S: the time passing is what is tested
        assert await post(up) == b"{}"  # the most recent one, reused: it waits 0.4 s anew
        assert server.accepted == 3
        # the two others close (each at its own deadline); the reused one is still open
        await wait_for(lambda: up.opened <= 1, "the two others to be closed")
        assert up.opened == len(up.idle) == 1
        await wait_for(lambda: server.open == 1, "the upstream to see the two closed")
        await wait_for(lambda: up.opened == 0, "the reused one to be closed")
        await wait_for(lambda: server.open == 0, "the upstream to see it closed")
        assert not up.idle


async def test_an_upstream_that_refuses_connections_is_a_client_error_and_leaks_no_place() -> None:
    srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    srv.close()
    await srv.wait_closed()
    up = Upstream(f"http://127.0.0.1:{port}", connect_timeout=1, read_timeout=1, limit=1)
    for _ in range(3):  # limit 1: a leaked place would make the second attempt wait forever
        with pytest.raises(aiohttp.ClientOSError):
            await asyncio.wait_for(post(up), 2)
    assert up.opened == 0
    await up.close()


async def test_the_head_is_the_method_target_host_headers_and_length() -> None:
    async with upstream_answering(answering(OK)) as (server, up):
        port = up.port
        headers = CIMultiDict([("X-A", "1"), ("x-a", "2"), ("Authorization", "Bearer k")])
        resp = await up.request("POST", "/v1/completions?x=%20y", headers, b'{"a":1}')
        await resp.read()
        resp.release()
    assert server.heads == [
        b"POST /v1/completions?x=%20y HTTP/1.1\r\n"
        + f"Host: 127.0.0.1:{port}\r\n".encode()
        + b"X-A: 1\r\nx-a: 2\r\nAuthorization: Bearer k\r\nContent-Length: 7\r\n\r\n"
    ]


@pytest.mark.parametrize("bad", ["a\nb", "a\rb", "a\r\nX-Evil: 1", "a\x00b", "a\x7fb", "a\x1bb"])
async def test_a_header_with_a_control_character_is_never_written(bad: str) -> None:
    async with upstream_answering(answering(OK)) as (server, up):
        for headers in (CIMultiDict({"X-Note": bad}), CIMultiDict({bad: "1"})):
            with pytest.raises(ValueError, match="header injection"):
                await up.request("POST", "/v1/completions", headers, b"{}")
        with pytest.raises(ValueError, match="header injection"):
            await up.request("POST", "/v1/x HTTP/1.1\r\nX-Evil: 1\r\n\r\nGET /", CIMultiDict(), b"")
        with pytest.raises(ValueError, match="header injection"):
            await up.request("POST", "/v1/x y", CIMultiDict(), b"")
        assert await post(up, x_note="tab\there") == b"{}"  # a tab is allowed
        assert server.accepted == 1 and len(server.heads) == 1


# What a header may not carry (RFC 9110 5.5: no control character but tab); CR and LF are
# counted instead (the only ones are the lines' ends).
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _reference_head(up: Upstream, method: str, target: str, headers: CIMultiDict[str]) -> bytes:
    """`Upstream._head` as it was written first: the text checked by counts and a regex."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: {up.host_header}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines.append("Content-Length: 2\r\n\r\n")
    text = "\r\n".join(lines)
    ends = len(lines) + 1
    if (
        text.count("\n") != ends
        or text.count("\r") != ends
        or _CONTROL.search(text) is not None
        or " " in target
    ):
        raise ValueError("a control character in the request's head (header injection)")
    return text.encode("utf-8", "surrogateescape")


# Tabs, spaces, CR, LF, the other controls, DEL, a C1 control, text, and the surrogates a server
# reads bytes above 0x7f as (and one it never does).
_HEAD_TEXT = st.text(
    st.sampled_from(["a", "Z", " ", "\t", "\r", "\n", "\x00", "\x0b", "\x1f", "\x7f", "\x85"])
    | st.sampled_from(["é", "\u212a", "\udc80", "\udcff", "\ud800"]),
    max_size=8,
)


@given(
    target=_HEAD_TEXT,
    headers=st.lists(st.tuples(_HEAD_TEXT, _HEAD_TEXT), max_size=4),
)
def test_the_head_is_checked_as_the_reference_checks_it(
    target: str, headers: list[tuple[str, str]]
) -> None:
    up = Upstream("http://127.0.0.1:9", connect_timeout=1, read_timeout=1, limit=1)
    sent = CIMultiDict(headers)
    expected: bytes | BaseException
    try:
        expected = _reference_head(up, "POST", "/" + target, sent)
    except ValueError as exc:
        expected = exc
    try:
        head: bytes | BaseException = up._head("POST", "/" + target, sent, "Content-Length: 2")
    except ValueError as exc:
        head = exc
    if isinstance(expected, BaseException):
        assert type(head) is type(expected) and str(head) == str(expected)
    else:
        assert head == expected
