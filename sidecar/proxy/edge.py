"""The network edge: how long a client may hold a connection without sending a request.

Owns: a guard around each accepted connection (it wraps aiohttp's protocol and forwards every
event to it unchanged), two deadlines, and counting what they cut off:
- `server.header_timeout_s`: from connecting, or from the first byte of the next request on a
  kept-alive connection, until the request's headers are complete (the request reached a handler).
  A client that sends nothing, or its headers one byte at a time, is cut off here.
- `server.keepalive_timeout_s`: a kept-alive connection with no request for this long is closed.
Counted in `tollbooth_connections_cut_total{listener, reason}`; connections open now in
`tollbooth_client_connections{listener}`.
Never: touches a connection while a request on it is being handled, or while a response is still
being written to it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.web_request import BaseRequest

from ..config import ServerConfig
from ..telemetry.metrics import Metrics
from .upstream import TIMER_EARLY_S

log = logging.getLogger("tollbooth.edge")

HEADERS, IDLE = "header_timeout", "idle_timeout"
WRITE_RECHECK_S = 1.0  # a response still draining to the client: look again this much later

Handler = Callable[[BaseRequest], Awaitable[web.StreamResponse]]


class ConnectionGuard:
    """The deadlines of one listener's connections; `listen` puts every connection and every
    request of a runner behind it."""

    def __init__(self, config: ServerConfig, metrics: Metrics, listener: str) -> None:
        self.header_timeout = config.header_timeout_s
        self.keepalive_timeout = config.keepalive_timeout_s
        self.cut = {r: metrics.connections_cut.labels(listener, r) for r in (HEADERS, IDLE)}
        self.open: dict[asyncio.BaseTransport, GuardedConnection] = {}
        metrics.client_connections.labels(listener).set_function(lambda: len(self.open))

    @property
    def backstop_s(self) -> float:
        """aiohttp's own keep-alive timeout: later than ours, so ours decides (and counts)."""
        return self.keepalive_timeout + self.header_timeout + 1.0

    def wrap(self, handler: Handler) -> Handler:
        """`handler` (the server's: every request, those the router or the Expect handler
        answer too), telling the connection when a request is in it. Not an app middleware:
        that covers only what reaches the app's router, and an app with any runs every request
        through aiohttp's middleware chain and a context manager. The guard, middleware and
        protocol together, counted under callgrind: about 8k of a request's 980k instructions."""
        return functools.partial(self._guarded, handler=handler)

    async def _guarded(self, request: BaseRequest, handler: Handler) -> web.StreamResponse:
        conn = self.open.get(request.transport) if request.transport is not None else None
        if conn is None:
            return await handler(request)
        conn.request_started()
        try:
            return await handler(request)
        finally:
            conn.request_ended()


class GuardedConnection(asyncio.Protocol):
    """aiohttp's protocol for one connection, with a deadline while no request is in a handler.

    The deadline is kept lazily: moving it is an attribute write, and the one timer, when it fires
    before the deadline (which moved later) or while a request is in a handler, re-arms for what
    is left. So a busy kept-alive connection schedules a timer about once per header timeout, not
    two per request (cancelling one and starting another at each start and end was about 1% of a
    request's CPU here, under cProfile).
    """

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard, self.inner = guard, inner
        self.transport: asyncio.Transport | None = None
        self.busy = 0  # requests in a handler now
        self.heard = False  # a byte of the next request arrived
        self.reason = HEADERS
        self.deadline: float | None = None  # loop time; None while a request is in a handler
        self.timer: asyncio.TimerHandle | None = None

    # --- asyncio.Protocol: everything goes on to aiohttp

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.guard.open[transport] = self
        self._arm(self.guard.header_timeout, HEADERS)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.busy and not self.heard:
            self.heard = True
            if self.reason == IDLE:  # the next request began: its headers have a deadline now
                self._arm(self.guard.header_timeout, HEADERS)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.transport is not None:
            self.guard.open.pop(self.transport, None)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # --- requests, from the guard's wrapper of the server's handler

    def request_started(self) -> None:
        self.busy += 1
        self.deadline = None

    def request_ended(self) -> None:
        self.busy -= 1
        if not self.busy:
            self.heard = False
            self._arm(self.guard.keepalive_timeout, IDLE)

    # --- the deadline

    def _arm(self, seconds: float, reason: str) -> None:
        loop = asyncio.get_running_loop()
        self.reason = reason
        self.deadline = deadline = loop.time() + seconds
        if self.timer is None or self.timer.when() > deadline:  # else it fires first, re-arms
            self._schedule(loop, deadline)

    def _schedule(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = loop.call_at(when, self._expire)

    def _expire(self) -> None:
        self.timer = None
        transport, deadline = self.transport, self.deadline
        if self.busy or deadline is None or transport is None or transport.is_closing():
            return  # request_ended arms again
        loop = asyncio.get_running_loop()
        if loop.time() < deadline - TIMER_EARLY_S:  # it moved later since this timer was set
            self._schedule(loop, deadline)
            return
        if transport.get_write_buffer_size():  # the last response is still being sent
            self._schedule(loop, loop.time() + WRITE_RECHECK_S)
            return
        self.guard.cut[self.reason].inc()
        log.debug("closing a client connection: %s", self.reason)
        transport.close()


async def listen(
    runner: web.AppRunner, guard: ConnectionGuard, host: str, port: int
) -> asyncio.AbstractServer:
    """Accept connections for `runner`'s app, each (and each of its requests) behind `guard`.
    Close the returned server before `runner.cleanup()` (as a site would be stopped)."""
    server = runner.server
    assert server is not None, "call runner.setup() first"
    # A connection takes the server's handler when it is made: every request comes through here,
    # the ones aiohttp answers before the app's handler (404 from the router, 417) included.
    server.request_handler = guard.wrap(server.request_handler)
    loop = asyncio.get_running_loop()
    return await loop.create_server(
        lambda: GuardedConnection(guard, server()), host, port, reuse_address=True, backlog=128
    )
