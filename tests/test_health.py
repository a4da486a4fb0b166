"""Readiness follows a background probe of the upstream (cached, never on a request's path);
liveness does not."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from sidecar.config import UpstreamConfig
from sidecar.telemetry.health import UpstreamProbe
from sidecar.telemetry.metrics import Metrics
from tests.conftest import Running, StartSidecar


class Upstream:
    """An upstream whose /health answers `status`, counting the probes it gets."""

    def __init__(self) -> None:
        self.status, self.probes, self.requests = 200, 0, 0
        self.app = web.Application()
        self.app.router.add_get("/health", self.health)
        self.app.router.add_post("/v1/completions", self.complete)

    async def health(self, request: web.Request) -> web.Response:
        self.probes += 1
        return web.Response(status=self.status)

    async def complete(self, request: web.Request) -> web.Response:
        self.requests += 1
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        return web.json_response({"model": "m", "choices": [], "usage": usage})


async def get(run: Running, path: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(run.admin_url + path) as r:
        return r.status, await r.json()


async def until(run: Running, status: int) -> dict[str, Any]:
    for _ in range(100):
        got, body = await get(run, "/readyz")
        if got == status:
            return body
        await asyncio.sleep(0.05)
    raise AssertionError(f"/readyz never answered {status}: {body}")


async def test_readiness_follows_the_upstream(
    aiohttp_server: Any, start_sidecar: StartSidecar
) -> None:
    up = Upstream()
    server = await aiohttp_server(up.app)
    run = await start_sidecar(
        {"upstream": {"probe_interval_s": 0.1}}, upstream_url=str(server.make_url("")).rstrip("/")
    )
    body = await until(run, 200)
    assert body == {"status": "ready", "checks": {"upstream": "answered 200"}}
    assert run.value("tollbooth_upstream_up") == 1
    up.status = 503  # e.g. vLLM's engine died
    body = await until(run, 503)
    assert body == {"status": "not_ready", "checks": {"upstream": "down: answered 503"}}
    assert run.value("tollbooth_upstream_up") == 0
    assert (await get(run, "/healthz"))[0] == 200  # liveness is unchanged
    up.status = 404  # a server without /health answers: it is reachable
    await until(run, 200)


async def test_an_unreachable_upstream_is_not_ready(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar(upstream_url="http://127.0.0.1:9")  # nothing listens there
    status, body = await get(run, "/readyz")
    assert status == 503 and body["checks"]["upstream"].startswith("down: unreachable")
    assert (await get(run, "/healthz"))[0] == 200


async def test_the_probe_is_never_on_a_requests_path(
    aiohttp_server: Any, start_sidecar: StartSidecar
) -> None:
    up = Upstream()
    server = await aiohttp_server(up.app)
    run = await start_sidecar(
        {"upstream": {"probe_interval_s": 3600}}, upstream_url=str(server.make_url("")).rstrip("/")
    )
    async with aiohttp.ClientSession() as s:
        for _ in range(10):
            async with s.post(run.url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 200
            async with s.get(run.admin_url + "/readyz") as r:
                assert r.status == 200
    assert up.requests == 10 and up.probes == 1  # the one at start, before any request


def test_an_old_probe_result_counts_as_down() -> None:
    now = [1000.0]
    probe = UpstreamProbe(
        UpstreamConfig(probe_interval_s=5.0, probe_timeout_s=2.0),
        Metrics(),
        lambda: None,
        clock=lambda: now[0],
    )
    assert probe.state() == (False, "not probed yet")
    probe.up, probe.detail, probe.checked_at = True, "answered 200", now[0]
    now[0] += 17.0  # 3 intervals + the timeout: still the last result
    assert probe.state() == (True, "answered 200")
    now[0] += 1.0  # the probe task has stopped answering
    assert probe.state() == (False, "no probe for 18s")
