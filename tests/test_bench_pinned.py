"""benchmarks/pinned.py: its lean fake engine sends exactly the bytes of overhead.py's aiohttp
one (what tollbooth meters must not change with the fake), and its wrk script counts a stream as
whole only when every chunk and the [DONE] event came (wrk, when installed)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
import overhead  # noqa: E402
import pinned  # noqa: E402

BOUNDED = aiohttp.ClientTimeout(total=20)  # a stream that never ends fails, not hangs
BODIES: list[dict[str, Any]] = [
    {"model": "m", "max_tokens": 16},
    {"model": "m", "max_tokens": 5, "stream": True},
    {"model": "m", "max_tokens": 300, "stream": True, "stream_options": {"include_usage": True}},
    {
        "model": "m",
        "max_tokens": 7,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    },
]


@pytest.fixture(params=[1, 8, 5])  # one event a write (as the aiohttp one), and several
async def lean(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    engine = pinned.Engine(request.param)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: pinned.LeanHTTP(engine), "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    server.close()
    await server.wait_closed()


@pytest.fixture
async def reference() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", overhead.upstream_handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


async def test_the_lean_engine_sends_the_reference_engines_bytes(lean: str, reference: str) -> None:
    async with aiohttp.ClientSession(timeout=BOUNDED) as s:
        for body in BODIES:
            got = []
            for url in (lean, reference):
                # twice on one connection: keep-alive, the next request after a stream
                for _ in range(2):
                    async with s.post(url + "/v1/chat/completions", json=body) as r:
                        got.append((r.status, r.headers["Content-Type"], await r.read()))
            assert got[0] == got[1] == got[2] == got[3], body
            assert len(got[0][2]) > 100


async def test_concurrent_streams_are_each_whole(lean: str) -> None:
    body = {"model": "m", "max_tokens": 64, "stream": True}
    async with aiohttp.ClientSession(timeout=BOUNDED) as s:

        async def one() -> bytes:
            async with s.post(lean + "/v1/chat/completions", json=body) as r:
                return await r.read()

        replies = await asyncio.gather(*(one() for _ in range(16)))
    for reply in replies:
        assert reply.count(b'"delta":{"content":"') == 64
        assert reply.endswith(b"data: [DONE]\n\n")


class Recorder:
    """Stands in for a transport: keeps each write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return False


@pytest.mark.parametrize(
    ("per_write", "writes"),
    [
        (1, [b"e0", b"e1", b"e2", b"e3", b"e4"]),
        (2, [b"e0e1", b"e2e3", b"e4"]),
        (8, [b"e0e1e2e3e4"]),
    ],
)
async def test_each_write_carries_the_streams_next_events(
    per_write: int, writes: list[bytes]
) -> None:
    engine, sent, ended = pinned.Engine(per_write), Recorder(), asyncio.Event()
    engine.add(sent, [b"e%d" % i for i in range(5)], ended.set)  # type: ignore[arg-type]
    await asyncio.wait_for(ended.wait(), 5)
    assert sent.writes == writes


def wrk_check(url: str, chunks: int, counted: int) -> dict[str, Any]:
    body = json.dumps({"model": "m", "max_tokens": chunks, "stream": chunks > 0})
    env = {**os.environ, "TB_BODY": body, "TB_CHECK": "1", "TB_CHUNKS": str(counted)}
    cmd = ["wrk", "-t1", "-c4", "-d1s", "-s", str(pinned.LUA), url + "/v1/chat/completions"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=True)
    line = next(s for s in out.stdout.splitlines() if s.startswith("TBJSON "))
    result: dict[str, Any] = json.loads(line.removeprefix("TBJSON "))
    return result


NO_WRK = shutil.which("wrk") is None


@pytest.mark.skipif(NO_WRK, reason="wrk is not installed (apt-get install wrk)")
async def test_the_wrk_script_counts_only_whole_responses(lean: str) -> None:
    for chunks, counted, whole in ((32, 32, True), (32, 31, False), (32, 33, False), (0, 0, True)):
        r = await asyncio.to_thread(wrk_check, lean, chunks, counted)
        assert r["checked"] > 0
        assert r["complete"] == (r["checked"] if whole else 0), (chunks, counted, r)
