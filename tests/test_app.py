"""The process: SIGTERM drains requests in flight; the listeners answer health checks."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import aiohttp

from tests.fakes import MODEL
from tests.procs import start_tollbooth
from tests.waiting import wait_for


async def test_sigterm_drains_in_flight_requests(upstream: Any, tmp_path: Path) -> None:
    fake, server = upstream
    tb = await start_tollbooth(
        tmp_path,
        {
            "upstream": {"url": str(server.make_url("")).rstrip("/")},
            "server": {"shutdown_grace_s": 10},
            "logging": {"access_log": "off"},
        },
    )
    async with aiohttp.ClientSession() as s:

        async def slow() -> tuple[int, dict[str, Any]]:
            async with s.post(
                tb.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                headers={"X-Fake": "sleep:1.0"},
            ) as r:
                return r.status, await r.json()

        in_flight = asyncio.create_task(slow())
        await wait_for(lambda: len(fake.seen) == 1, "the request to reach the upstream")
        tb.proc.send_signal(signal.SIGTERM)
        status, body = await in_flight
    assert status == 200 and body["usage"]["completion_tokens"] == 6
    # the one SIGTERM stops it: a second one, sent while it shuts down, would find the default
    # handler back and kill it (-15)
    assert await asyncio.wait_for(tb.proc.wait(), 30) == 0
    await tb.stop(signal.SIGTERM)  # exited: sends nothing, closes its log
    log = tb.log.read_text()
    assert "draining in-flight requests" in log and "stopped" in log
