"""Every call to the upstream goes through one client (sidecar/proxy/upstream.py): metered requests,
unmetered ones whose body is streamed through, and the sidecar's own calls. So one
`upstream.max_connections`, and header bytes exact on every route."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from sidecar.config import UpstreamConfig
from sidecar.telemetry.health import UpstreamProbe
from sidecar.telemetry.metrics import Metrics

from .conftest import StartSidecar


async def _raw(url: str, head: str, body: bytes = b"") -> bytes:
    """One request written byte for byte; the whole answer (the request says Connection: close)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head.replace("\n", "\r\n").encode("utf-8", "surrogateescape") + b"\r\n" + body)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return answer


class Recorder:
    """An upstream that records what each request brought, and can hold a route open."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.busy = 0
        self.most_busy = 0
        self.release = asyncio.Event()
        self.holding = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_route("*", "/{tail:.*}", self.handle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.busy += 1
        self.most_busy = max(self.most_busy, self.busy)
        try:
            body = await request.read()
            self.seen.append({"path": request.path, "headers": dict(request.headers), "body": body})
            if request.path == "/hold":
                self.holding.set()
                await self.release.wait()
            if request.path == "/v1/completions":
                usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
                return web.json_response({"model": "m", "choices": [], "usage": usage})
            return web.json_response({"ok": True})
        finally:
            self.busy -= 1


async def test_header_bytes_reach_the_upstream_exactly_on_an_unmetered_route(
    start_sidecar: StartSidecar, aiohttp_server: Any
) -> None:
    """Unmetered routes went through aiohttp's session, which dropped header bytes above 0x7f
    (`caf` for `caf\\xe9`); they now go through the same client as metered ones."""
    rec = Recorder()
    server = await aiohttp_server(rec.app)
    run = await start_sidecar(upstream_url=f"http://127.0.0.1:{server.port}")
    head = "GET /v1/models HTTP/1.1\nHost: x\nX-Note: caf\udce9 \udcff!\nConnection: close\n"
    assert (await _raw(run.url, head)).startswith(b"HTTP/1.1 200 ")
    assert rec.seen[-1]["headers"]["X-Note"] == "caf\udce9 \udcff!"
    assert "Content-Length" not in rec.seen[-1]["headers"]  # a GET without content gets none


async def test_a_streamed_body_reaches_the_upstream_as_sent_with_its_length_or_chunked(
    start_sidecar: StartSidecar, aiohttp_server: Any
) -> None:
    """An unmetered POST (here a free route) is streamed through, never read whole: with the
    client's Content-Length, or chunked when the client sent it chunked."""
    rec = Recorder()
    server = await aiohttp_server(rec.app)
    run = await start_sidecar(
        {"metering": {"free_routes": ["/free"]}}, upstream_url=f"http://127.0.0.1:{server.port}"
    )
    body = b'{"x": "caf\xc3\xa9"}'
    head = f"POST /free HTTP/1.1\nHost: x\nContent-Length: {len(body)}\nConnection: close\n"
    assert (await _raw(run.url, head, body)).startswith(b"HTTP/1.1 200 ")
    assert rec.seen[-1]["body"] == body
    assert rec.seen[-1]["headers"]["Content-Length"] == str(len(body))
    chunked = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    head = "POST /free HTTP/1.1\nHost: x\nTransfer-Encoding: chunked\nConnection: close\n"
    assert (await _raw(run.url, head, chunked)).startswith(b"HTTP/1.1 200 ")
    assert rec.seen[-1]["body"] == b"hello world"
    assert rec.seen[-1]["headers"]["Transfer-Encoding"] == "chunked"
    assert "Content-Length" not in rec.seen[-1]["headers"]


async def test_max_connections_is_one_limit_for_metered_and_unmetered_requests(
    start_sidecar: StartSidecar, aiohttp_server: Any
) -> None:
    """With two pools, `upstream.max_connections: 1` let one unmetered and one metered request
    reach the upstream at once. One pool: the metered request waits for the connection."""
    rec = Recorder()
    server = await aiohttp_server(rec.app)
    run = await start_sidecar(
        {"upstream": {"max_connections": 1}, "metering": {"free_routes": ["/hold"]}},
        upstream_url=f"http://127.0.0.1:{server.port}",
    )
    held = asyncio.ensure_future(_raw(run.url, "GET /hold HTTP/1.1\nHost: x\nConnection: close\n"))
    await asyncio.wait_for(rec.holding.wait(), 10)
    body = b'{"model": "m", "prompt": "hi", "max_tokens": 2}'
    head = f"POST /v1/completions HTTP/1.1\nHost: x\nContent-Length: {len(body)}\n"
    metered = asyncio.ensure_future(_raw(run.url, head + "Connection: close\n", body))
    try:
        # It waits in the pool: it never reaches the upstream while /hold is open. (A wait for
        # something that must not happen: a slow machine can only make it pass, never fail.)
        done, _ = await asyncio.wait({metered}, timeout=0.3)
        own = ("/health", "/metrics")  # the probe and the reconciliation scrape
        assert not done and [s["path"] for s in rec.seen if s["path"] not in own] == ["/hold"]
    finally:
        rec.release.set()
    answers = await asyncio.wait_for(asyncio.gather(held, metered), 10)
    assert all(a.startswith(b"HTTP/1.1 200 ") for a in answers)
    assert rec.most_busy == 1


class _Saturated:
    limit = 4
    saturated = True
    calls = 0

    async def fetch(self, method: str, path: str, *, timeout: float) -> tuple[int, bytes]:
        self.calls += 1
        return 500, b""


async def test_the_probe_counts_a_saturated_pool_as_up_without_waiting_for_a_connection() -> None:
    """The probe shares the pool with the traffic: when every connection is serving a request,
    the upstream is answering, and a probe queued behind them would time out and fail /readyz."""
    fetcher = _Saturated()
    probe = UpstreamProbe(UpstreamConfig(), Metrics(), lambda: fetcher)
    await probe.once()
    assert probe.state() == (True, "busy: all 4 connections in use")
    assert fetcher.calls == 0
