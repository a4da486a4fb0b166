"""Slow clients, with raw sockets against `tollbooth serve`: a client that sends nothing, or its
headers one byte at a time, is cut off after server.header_timeout_s; an idle kept-alive connection
after server.keepalive_timeout_s; a request in progress never; and each cut is counted."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp

from tests.fakes import MODEL
from tests.procs import Tollbooth, start_tollbooth

HEADER_TIMEOUT, KEEPALIVE_TIMEOUT = 0.5, 2.0
PARTIAL = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def closed_after(
    reader: asyncio.StreamReader, limit: float, start: float | None = None
) -> float | None:
    """Seconds from `start` (default: now) until the server closed the connection (None: still
    open after `limit`)."""
    start = time.monotonic() if start is None else start
    try:
        while await asyncio.wait_for(reader.read(4096), limit - (time.monotonic() - start)):
            pass  # a response (keep-alive test); read on until the close
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - start


async def silent(url: str) -> float | None:
    start = time.monotonic()  # before connecting: the server's deadline starts later
    reader, writer = await connect(url)
    try:
        return await closed_after(reader, 5, start)
    finally:
        writer.close()


async def drip_until_closed(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, start: float | None = None
) -> float:
    """Send a request's headers one byte every 50 ms, never completing them; seconds from `start`
    (default: now) until the server closed the connection (5 or more: it did not)."""
    start = time.monotonic() if start is None else start

    async def drip() -> None:
        for i in range(10_000):
            writer.write(PARTIAL[i % len(PARTIAL) : i % len(PARTIAL) + 1])
            await writer.drain()
            await asyncio.sleep(0.05)

    dripping = asyncio.create_task(drip())
    try:
        await closed_after(reader, 5)
    finally:
        dripping.cancel()
        await asyncio.gather(dripping, return_exceptions=True)
        writer.close()
    return time.monotonic() - start


async def trickle(url: str) -> float | None:
    start = time.monotonic()
    elapsed = await drip_until_closed(*await connect(url), start)
    return None if elapsed >= 5 else elapsed


GET = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
# Requests aiohttp answers before the proxy's handler: the router (no route takes "*", a
# CONNECT's authority, or a path with a newline in it) and the Expect handler.
NOT_ROUTED = {
    b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n": b"HTTP/1.1 404",
    b"GET /v1/models%0A HTTP/1.1\r\nHost: x\r\n\r\n": b"HTTP/1.1 404",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: x\r\nContent-Length: 2\r\n\r\n{}": (
        b"HTTP/1.1 417"
    ),
}


async def request(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    raw: bytes = GET,
    status: bytes = b"HTTP/1.1 200",
) -> None:
    """One complete keep-alive request and its whole response."""
    writer.write(raw)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(status), head
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    await reader.readexactly(length)


async def kept_alive(url: str, raw: bytes = GET, status: bytes = b"HTTP/1.1 200") -> float | None:
    """One complete request, then nothing: seconds from the response until the close."""
    reader, writer = await connect(url)
    await request(reader, writer, raw, status)
    try:
        return await closed_after(reader, 5)
    finally:
        writer.close()


async def kept_alive_then_trickle(url: str) -> float | None:
    """A request, 0.2 s of quiet, then the next one a byte at a time: seconds from its first byte
    to the close (its header deadline, earlier than the idle one)."""
    reader, writer = await connect(url)
    await request(reader, writer)
    await asyncio.sleep(0.2)
    elapsed = await drip_until_closed(reader, writer)
    return None if elapsed >= 5 else elapsed


async def metric(tb: Tollbooth, name: str, **labels: str) -> float:
    want = name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
    async with aiohttp.ClientSession() as s, s.get(tb.admin + "/metrics") as r:
        text = await r.text()
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(want))


async def test_slow_and_idle_clients_are_cut_off_and_counted(upstream: Any, tmp_path: Path) -> None:
    _, server = upstream
    tb = await start_tollbooth(
        tmp_path,
        {
            "upstream": {"url": str(server.make_url("")).rstrip("/")},
            "server": {
                "header_timeout_s": HEADER_TIMEOUT,
                "keepalive_timeout_s": KEEPALIVE_TIMEOUT,
            },
            "logging": {"access_log": "off"},
        },
    )
    try:
        async with aiohttp.ClientSession() as s:

            async def slow_request() -> int:  # in progress longer than both deadlines
                async with s.post(
                    tb.url + "/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                    headers={"X-Fake": "sleep:1.5"},
                ) as r:
                    await r.read()
                    return r.status

            results = await asyncio.gather(
                slow_request(),
                *(silent(tb.url) for _ in range(20)),
                *(trickle(tb.url) for _ in range(20)),
                *(kept_alive(tb.url) for _ in range(5)),
                *(kept_alive_then_trickle(tb.url) for _ in range(5)),
                silent(tb.admin),
                *(kept_alive(tb.url, raw, status) for raw, status in NOT_ROUTED.items()),
            )
        status, silents, trickles, idle, next_trickles, admin = (
            results[0],
            results[1:21],
            results[21:41],
            [*results[41:46], *results[52:]],  # answered by aiohttp itself: idle all the same
            results[46:51],
            results[51],
        )
        assert status == 200  # a request being handled is never cut
        # Upper bounds: before aiohttp's own backstop (3.5 s) and the 5 s the clients wait.
        for t in [*silents, *trickles, admin]:
            assert t is not None and HEADER_TIMEOUT * 0.9 <= t < 3.0, (silents, trickles, admin)
        for t in idle:
            assert t is not None and KEEPALIVE_TIMEOUT * 0.9 <= t < 3.0, idle
        for t in next_trickles:  # cut by the header deadline, not the later idle one
            assert t is not None and HEADER_TIMEOUT * 0.9 <= t < KEEPALIVE_TIMEOUT - 0.5, t
        cut = "tollbooth_connections_cut_total"
        assert await metric(tb, cut, listener="proxy", reason="header_timeout") == 45
        assert await metric(tb, cut, listener="proxy", reason="idle_timeout") >= 5 + len(NOT_ROUTED)
        assert await metric(tb, cut, listener="admin", reason="header_timeout") == 1
        assert await metric(tb, "tollbooth_client_connections", listener="proxy") <= 1
    finally:
        await tb.stop(signal.SIGTERM)


# --- the lazy deadline, on the loop `tollbooth serve` runs (uvloop) ------------------------------


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0


class _Inner(asyncio.Protocol):
    pass


def test_each_deadline_fires_its_timer_about_once_on_uvloop() -> None:
    """uvloop keeps time in whole milliseconds and rounds a timer's delay, so a timer may fire
    up to a millisecond before the time it was set for. Re-arming for what is left then fires it
    again at once, every loop iteration until the clock ticks: a busy loop at every deadline. A
    deadline is due when its timer fires, as it was before it was kept lazily."""
    import uvloop

    from sidecar.config import ServerConfig
    from sidecar.proxy.edge import ConnectionGuard, GuardedConnection
    from sidecar.telemetry.metrics import Metrics

    fired = 0

    async def main() -> list[GuardedConnection]:
        nonlocal fired
        # 50.4 ms: uvloop rounds the delay to 50 ms, 0.4 ms early; 60 ms: early by a rounding
        config = ServerConfig(header_timeout_s=0.0504, keepalive_timeout_s=0.06)
        guard = ConnectionGuard(config, Metrics(), "proxy")
        conns = []
        for i in range(40):
            conn = GuardedConnection(guard, _Inner())
            expire = conn._expire

            def counted(expire: Any = expire) -> None:
                nonlocal fired
                fired += 1
                expire()

            conn._expire = counted  # type: ignore[method-assign]
            conn.connection_made(_Transport())
            if i % 2:  # a request: the idle deadline is later than the header one's timer
                conn.request_started()
                conn.request_ended()
            conns.append(conn)
            await asyncio.sleep(0.0013)
        for _ in range(500):  # all are cut after 0.11 s; a loaded machine may take longer
            if all(c.transport is not None and c.transport.is_closing() for c in conns):
                break
            await asyncio.sleep(0.01)
        return conns

    conns = uvloop.run(main())
    assert all(c.transport is not None and c.transport.is_closing() for c in conns)
    # one timer per connection, and one more where the deadline moved later: 60 in all
    assert fired <= 60, fired
