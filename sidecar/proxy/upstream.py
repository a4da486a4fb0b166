"""The one client of the inference server: HTTP/1.1 connections, kept alive and reused.

Every call to the upstream goes through it: metered requests (their bodies in memory), requests
whose body is streamed through (unmetered routes), and the sidecar's own calls (`/tokenize`,
`/info`, the readiness probe: `fetch`). One pool, so `upstream.max_connections` is one number.
Owns: a pool of connections (at most `limit` open; a request waits for one beyond that), opening
them within the connect timeout, writing a request (its body in memory, or streamed with the
client's Content-Length or chunked), and the read timeout (the longest silence of the upstream
while a response is awaited or read).
Reading is aiohttp's own client protocol (`ResponseHandler`: its C parser, the body as a
`StreamReader` with flow control, its errors), so a response reads as aiohttp's client reads it.
What is left out is aiohttp's `ClientSession` around it: request and response objects, URL
handling, traces, cookies, a timer per request and per read. Counted under callgrind, a
non-streaming request through the session cost about 370k instructions on the client side, and
about 90k here: a third of the sidecar's whole work on such a request.
Never: adds a header but Host and the body's framing (Content-Length, or Transfer-Encoding:
chunked for a streamed body of unknown length), follows a redirect, decompresses, or keeps a
cookie.

aiohttp's private names used (pyproject pins aiohttp to the minor version tested):
`ResponseHandler._reschedule_timeout`, `_drop_timeout`, `_on_read_timeout`, `_read_timeout`,
`_payload`, `_loop`, overridden or read to keep the read timeout lazily and to forget a response
once its connection is back in the pool.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
from collections.abc import AsyncIterable, Mapping

import aiohttp
from aiohttp.client_proto import ResponseHandler
from aiohttp.helpers import HeadersMixin
from aiohttp.http import StreamWriter
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.streams import StreamReader
from multidict import CIMultiDictProxy
from yarl import URL

# A timer may fire this much before the time it was set for: uvloop keeps time in whole
# milliseconds and rounds a delay to one. A deadline that near is due (re-arming for the rest
# would fire again at once, every loop iteration until the clock ticks). The edge's timers too.
TIMER_EARLY_S = 0.001

# Every byte but the control characters (tab aside): deleted, what is left of a head is its CRs
# and LFs and what a header may not carry (RFC 9110 5.5: no control character but tab, as
# aiohttp's client refuses it too), in order.
_NOT_CONTROL = bytes(b for b in range(256) if b == 0x09 or 0x20 <= b <= 0x7E or b >= 0x80)
_INJECTION = "a control character in the request's head (header injection)"
# An idle connection is closed after this long, as aiohttp's connector does (its keep-alive
# timeout), and never reused past it.
IDLE_S = 15.0
# Methods whose request has no content unless the client sent some: no Content-Length: 0 added.
_NO_CONTENT = frozenset({"GET", "HEAD", "DELETE", "OPTIONS", "TRACE"})

# A request body: in memory, or streamed from the client (its reader, or any async iterable).
Body = bytes | AsyncIterable[bytes]


class BadResponse(aiohttp.ClientError):
    """The upstream answered with something that is not HTTP/1.1."""


class Connection(ResponseHandler):
    """aiohttp's client protocol, with its read timeout kept lazily.

    `ResponseHandler` cancels a timer and schedules another on every read. Here a read moves a
    deadline (one attribute write), and the one timer, when it fires before the deadline, re-arms
    for what is left: a stream of many small reads schedules a timer about once per timeout.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, pool: Upstream) -> None:
        super().__init__(loop)
        self.pool = pool
        self.idle_since = 0.0  # loop time it was put back in the pool
        self.made = False  # connected: from now on connection_lost gives its place back
        self.sending: asyncio.Task[None] | None = None  # a streamed body still being written
        self._deadline: float | None = None
        self._watch: asyncio.TimerHandle | None = None

    def _reschedule_timeout(self) -> None:
        if not self._read_timeout:
            self._deadline = None
            return
        self._deadline = deadline = self._loop.time() + self._read_timeout
        if self._watch is None:
            self._watch = self._loop.call_at(deadline, self._check_deadline)

    def _drop_timeout(self) -> None:
        self._deadline = None  # the timer, when it fires, finds no deadline and stops

    def _check_deadline(self) -> None:
        self._watch = None
        deadline = self._deadline
        if deadline is None:
            return
        if self._loop.time() < deadline - TIMER_EARLY_S:  # a read moved it since
            self._watch = self._loop.call_at(deadline, self._check_deadline)
            return
        self._deadline = None
        self._on_read_timeout()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.made = True

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        if self.sending is not None:
            self.sending.cancel()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        self.pool.lost(self)


class Response(HeadersMixin):
    """The upstream's answer: what the proxy reads of aiohttp's `ClientResponse`, by the same
    names (`status`, `reason`, `headers`, `content`, `content_type`, `content_length`, `read`,
    `release`, `close`)."""

    def __init__(
        self,
        conn: Connection,
        status: int,
        reason: str,
        headers: CIMultiDictProxy[str],
        body: StreamReader,
    ) -> None:
        self._conn: Connection | None = conn
        self.status, self.reason = status, reason
        self.headers = self._headers = headers
        self.content = body
        body.on_eof(self.release)  # read to its end (now, or later): the connection goes back

    async def read(self) -> bytes:
        return await self.content.read()

    def release(self) -> None:
        """Done with it: the connection goes back to the pool if the body was read to its end
        and the upstream keeps it open, else it is closed (which stops the upstream's work)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.pool.put(conn)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


UpstreamResponse = Response  # the name the proxy and the finishers use


async def _read_at_most(content: StreamReader, limit: int) -> bytes:
    """A body of at most `limit` bytes; BadResponse, the rest unread, for a longer one."""
    body = bytearray()
    while chunk := await content.readany():
        body += chunk
        if len(body) > limit:
            raise BadResponse(f"an answer of more than {limit} bytes")
    return bytes(body)


class Upstream:
    """The pool. One request at a time on a connection; a connection is reused most recently
    idle first, so a quiet period leaves the others to time out."""

    def __init__(
        self,
        base: str,
        *,
        connect_timeout: float,
        read_timeout: float,
        limit: int,
        authorization: str | None = None,
    ) -> None:
        url = URL(base)
        assert url.scheme in ("http", "https") and url.raw_host, base
        self.prefix = url.raw_path.rstrip("/")  # the base URL's own path, before every target
        # The sidecar's own calls carry the upstream's key; proxied requests set theirs.
        self.own_headers = {"Authorization": authorization} if authorization else {}
        self.host, self.port = url.raw_host, url.port or (443 if url.scheme == "https" else 80)
        self.host_header = url.host_port_subcomponent
        self._host_line = f"Host: {self.host_header}"
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        self.connect_timeout, self.read_timeout, self.limit = connect_timeout, read_timeout, limit
        self.idle: list[Connection] = []
        self.opened = 0  # connections open or being opened
        self.waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self.closed = False
        self._sweep: asyncio.TimerHandle | None = None

    async def request(
        self,
        method: str,
        target: str,
        headers: Mapping[str, str],
        body: Body = b"",
        *,
        length: int | None = None,
    ) -> Response:
        """Send `method target` (the path and query, as they go on the wire) and return the
        response once its headers are in. A streamed `body` is sent with `length` as its
        Content-Length when the client gave one, else chunked, while the response is awaited.
        Failures are aiohttp's exceptions: `ClientError`s (`ServerDisconnectedError`,
        `ClientOSError`, `BadResponse`) and `TimeoutError`s (`SocketTimeoutError`: the read
        timeout; `ConnectionTimeoutError`: the connect timeout)."""
        framing = _framing(method, body, length)
        head = self._head(method, target, headers, framing)
        conn = await self._acquire()
        try:
            conn.set_response_params(
                skip_payload=method == "HEAD",
                read_until_eof=True,  # a response without a length ends when the upstream closes
                auto_decompress=False,
                read_timeout=self.read_timeout,
            )
            assert conn.transport is not None
            if not isinstance(body, bytes):
                conn.transport.write(head)
                conn.sending = asyncio.ensure_future(_send(conn, body, chunked=length is None))
            else:
                conn.transport.writelines((head, body) if body else (head,))
            conn.start_timeout()
            while True:
                try:
                    message, payload = await conn.read()
                except HttpProcessingError as exc:
                    raise BadResponse(f"invalid response from the upstream: {exc.message}") from exc
                if message.code == 101:  # never asked for (Upgrade is not forwarded)
                    raise BadResponse("the upstream switched protocols (101) unasked")
                if not 100 <= message.code <= 199:  # an interim 1xx is read past, as aiohttp does
                    break
        except BaseException:
            conn.close()
            raise
        return Response(conn, message.code, message.reason, message.headers, payload)

    async def fetch(
        self,
        method: str,
        path: str,
        *,
        timeout: float,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        limit: int | None = None,
    ) -> tuple[int, bytes]:
        """The sidecar's own call (`/tokenize`, `/info`, the probe): (status, body), read whole
        within `timeout`, with the upstream's key when one is configured. `path` is below the
        base URL's own path. `limit`: an answer of more bytes raises BadResponse, unread."""
        sent = {**self.own_headers, **(headers or {})}
        async with asyncio.timeout(timeout):
            resp = await self.request(method, self.prefix + path, sent, body)
            try:
                if limit is None:
                    return resp.status, await resp.read()
                return resp.status, await _read_at_most(resp.content, limit)
            finally:
                resp.release()

    @property
    def saturated(self) -> bool:
        """Every connection is open and busy: a new call would wait for one."""
        return self.opened >= self.limit and not self.idle

    def _head(self, method: str, target: str, headers: Mapping[str, str], framing: str) -> bytes:
        """The request line and headers, Host first (as aiohttp writes them). A header value is
        written as the client's bytes (the server read them as UTF-8 with surrogateescape)."""
        # Joined in C: an f-string of each line cost 2k instructions a header (a name read by
        # the server is an `istr`, formatted through str's __format__ as a subclass).
        fields = "\r\n".join(map(": ".join, headers.items()))
        end = f"{framing}\r\n\r\n" if framing else "\r\n"
        start = f"{method} {target} HTTP/1.1\r\n{self._host_line}\r\n"
        text = f"{start}{fields}\r\n{end}" if fields else f"{start}{end}"
        ends = len(headers) + (4 if framing else 3)  # the lines' ends: one a line, two at the end
        try:
            head = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # not the server's text: the same check first, as ever (a
            # surrogate passed through is three bytes above 0x7f, none a control byte)
            lines = text.encode("utf-8", "surrogatepass").translate(None, _NOT_CONTROL)
            if lines != b"\r\n" * ends or " " in target:
                raise ValueError(_INJECTION)  # noqa: B904 - its context: the encoding failed
            raise
        # One pass in C over the bytes, not a regex over the text (some 15k instructions a
        # request; tests/test_upstream.py keeps it as the reference): a control character is
        # the same byte in the encoding and no other byte is one, so the head's control bytes,
        # tabs aside, are its lines' ends and nothing else exactly when the lines are clean.
        if head.translate(None, _NOT_CONTROL) != b"\r\n" * ends or " " in target:
            raise ValueError(_INJECTION)
        return head

    # --- the pool

    async def _acquire(self) -> Connection:
        loop = asyncio.get_running_loop()
        while True:
            if self.closed:
                raise aiohttp.ClientConnectionError("the upstream pool is closed")
            while self.idle:
                conn = self.idle.pop()
                fresh = loop.time() - conn.idle_since < IDLE_S
                if fresh and conn.is_connected() and not conn.should_close:
                    return conn
                conn.close()
            if self.opened < self.limit:
                return await self._open(loop)
            waiter = loop.create_future()
            self.waiting.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # woken, then cancelled: the turn goes to the next in line
                raise
            finally:
                with contextlib.suppress(ValueError):
                    self.waiting.remove(waiter)

    async def _open(self, loop: asyncio.AbstractEventLoop) -> Connection:
        self.opened += 1
        made: list[Connection] = []

        def connection() -> Connection:
            made.append(Connection(loop, self))
            return made[-1]

        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    connection,
                    self.host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None,
                )
        except BaseException as exc:
            # Cancelled (or timed out) once connected, asyncio closes the transport, and the
            # connection's connection_lost gives the place back: given back here too, the pool
            # would count one connection fewer than are open and go past its limit.
            if not any(c.made for c in made):
                self._gone()
            if isinstance(exc, TimeoutError):
                raise aiohttp.ConnectionTimeoutError(f"connecting to the upstream: {exc}") from exc
            if isinstance(exc, OSError):
                raise aiohttp.ClientOSError(
                    exc.errno, f"connecting to the upstream: {exc}"
                ) from exc
            raise
        return conn

    def put(self, conn: Connection) -> None:
        """A connection whose response is over: back to the pool, or closed (also when the
        request's body was still being sent: the connection is in the middle of a request)."""
        sending = conn.sending is not None and not conn.sending.done()
        if self.closed or sending or conn.should_close or not conn.is_connected():
            conn.close()  # connection_lost (soon) gives its place back
            return
        conn.idle_since = conn._loop.time()
        # The response just read may still be in its reader's buffer: the protocol forgets it,
        # so a failure of the next request on this connection (read timeout, lost connection)
        # is not set on that reader too, breaking a response that arrived whole.
        conn._payload = None
        self.idle.append(conn)
        if self._sweep is None:
            self._sweep = conn._loop.call_at(conn.idle_since + IDLE_S, self._close_stale)
        self._wake()

    def _close_stale(self) -> None:
        """Close the connections idle for IDLE_S; look again when the next one will be. Reuse is
        most recent first, so the stack is in the order they went idle."""
        self._sweep = None
        if not self.idle:
            return
        loop = self.idle[0]._loop
        now = loop.time()
        stale = 0
        while stale < len(self.idle) and now - self.idle[stale].idle_since >= IDLE_S:
            stale += 1
        gone, self.idle = self.idle[:stale], self.idle[stale:]
        for conn in gone:
            conn.close()
        if self.idle:
            self._sweep = loop.call_at(self.idle[0].idle_since + IDLE_S, self._close_stale)

    def lost(self, conn: Connection) -> None:
        """`conn` closed (either side): its place in the pool is free."""
        with contextlib.suppress(ValueError):
            self.idle.remove(conn)
        self._gone()

    def _gone(self) -> None:
        self.opened -= 1
        self._wake()

    def _wake(self) -> None:
        while self.waiting:
            waiter = self.waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def close(self) -> None:
        self.closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        idle, self.idle = self.idle, []
        for conn in idle:
            conn.close()
        while self.waiting:  # each finds the pool closed
            self._wake()


def _framing(method: str, body: Body, length: int | None) -> str:
    """The header that frames the body: its Content-Length, chunked for a stream of unknown
    length, or none for a bodiless request of a method that has no content."""
    if not isinstance(body, bytes):
        return f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    if not body and method in _NO_CONTENT:
        return ""
    return f"Content-Length: {len(body)}"


async def _send(conn: Connection, body: AsyncIterable[bytes], *, chunked: bool) -> None:
    """Write a streamed body to the upstream as it arrives, waiting while the upstream reads
    slower than the client sends (aiohttp's writer: its flow control and chunked framing). A
    client that stops sending mid-body closes the connection: the upstream sees the request cut
    short, never a request ended early."""
    writer = StreamWriter(conn, conn._loop)
    if chunked:
        writer.enable_chunking()
    try:
        async for chunk in body:
            if chunk:
                await writer.write(chunk)
        await writer.write_eof()
    except Exception:  # (a cancellation is no Exception: it goes on as it is)
        conn.close()
    finally:
        conn.sending = None if conn.sending is asyncio.current_task() else conn.sending
