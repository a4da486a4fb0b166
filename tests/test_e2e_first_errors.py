"""No first error or first expensive request is hidden by how series are published: a real sidecar
process (default hold) in front of the simulator, scraped by Debian's Prometheus every 2 s with the
project's rules at their default thresholds.

A 30 s engine outage (every connection cut) must show on the error query within one scrape, put
LLMUpstreamErrorRateHigh in pending at once, and fire it after its `for`; a first request over
$0.10 on a model priced through SIGHUP must fire LLMRequestCostHigh within one evaluation.
About 80 s, bounded; every process is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from tollbooth_lab.simulator import EngineParams, create_simulator

from alerts.build import render_rules
from sidecar.telemetry.thresholds import DEFAULT
from tests.procs import (
    Prometheus,
    free_port,
    require_prometheus,
    start_prometheus,
    start_tollbooth,
)

require_prometheus()

pytestmark = pytest.mark.binaries

SCRAPE_S = 2.0  # the scrape and evaluation interval of the run
SLACK_S = 1.5  # this test's polling (0.2 s) and the query's own time
OUTAGE_S = 30.0
MODEL, NEW_MODEL = "sim-a", "sim-new"
PRICES = {MODEL: {"input_per_1m": 1.0, "output_per_1m": 2.0}}
NEW_PRICE = {"input_per_1m": 20000.0, "output_per_1m": 20000.0}  # one short request > $0.10
ERRORS = 'sum(increase(llm_requests_total{status_code=~"5..|stream_error"}[1m])) > 0'


class Engine:
    """The simulator, with a switch that cuts every request's connection (an engine down)."""

    def __init__(self) -> None:
        self.down = False
        self.app = create_simulator("vllm", EngineParams(step_base_s=0.0005))
        self.app.middlewares.append(self._outage)

    @web.middleware
    async def _outage(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if self.down and request.transport is not None:
            request.transport.abort()
            raise asyncio.CancelledError
        return await handler(request)


async def wait_until(cond: Callable[[], Awaitable[bool]], seconds: float) -> float | None:
    """Seconds until `cond` held (polled every 0.2 s), or None after `seconds`."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if await cond():
            return time.monotonic() - start
        await asyncio.sleep(0.2)
    return None


def since(start: float, waited: float | None) -> float | None:
    """Seconds from `start` (a wall-clock time) to now, or None when the wait ran out."""
    return None if waited is None else time.time() - start


async def alert_state(prom: Prometheus, name: str, state: str, **labels: str) -> bool:
    sel = "".join(f',{k}="{v}"' for k, v in labels.items())
    return bool(await prom.query(f'ALERTS{{alertname="{name}",alertstate="{state}"{sel}}}'))


async def traffic(url: str, stop: asyncio.Event, statuses: list[int]) -> None:
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession(headers={"X-Tollbooth-User": "steady"}) as s:
        while not stop.is_set():
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                await r.read()
                statuses.append(r.status)
            await asyncio.sleep(0.05)


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[tuple[Engine, Any, Prometheus, Path]]:
    engine = Engine()
    runner = web.AppRunner(engine.app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    pricing = tmp_path / "pricing.yaml"
    pricing.write_text(yaml.safe_dump({"models": PRICES}))
    tb = await start_tollbooth(
        tmp_path,
        {
            "upstream": {"url": f"http://127.0.0.1:{port}"},
            "logging": {"access_log": "off"},
            "audit": {"enabled": False},
        },  # metering.new_series_hold_s: the default
        "--pricing",
        str(pricing),
    )
    (tmp_path / "rules.yml").write_text(render_rules(DEFAULT))
    every = f"{SCRAPE_S:g}s"
    prom = await start_prometheus(
        tmp_path,
        "prometheus",
        {
            "global": {"scrape_interval": every, "evaluation_interval": every},
            "rule_files": [str(tmp_path / "rules.yml")],
            "scrape_configs": [
                {
                    "job_name": DEFAULT.job,
                    "static_configs": [{"targets": [tb.admin.removeprefix("http://")]}],
                }
            ],
        },
    )
    try:
        yield engine, tb, prom, pricing
    finally:
        await prom.stop()
        await tb.stop(signal.SIGTERM)
        await runner.cleanup()


async def test_a_short_outage_shows_at_once_and_fires(
    stack: tuple[Engine, Any, Prometheus, Path], record_property: Any
) -> None:
    engine, tb, prom, pricing = stack
    error_series = f'llm_requests_total{{model="{MODEL}",status_code="502"}}'

    async def published_at_zero() -> bool:
        return bool(await prom.query(error_series + " == 0"))

    assert await wait_until(published_at_zero, 30) is not None, "502 series not published ahead"
    stop, statuses = asyncio.Event(), list[int]()
    sender = asyncio.create_task(traffic(tb.url, stop, statuses))
    try:
        await asyncio.sleep(3 * SCRAPE_S)  # successes before the outage
        assert statuses and set(statuses) == {200}
        engine.down, outage_at = True, time.time()

        async def errors_shown() -> bool:
            return bool(await prom.query(ERRORS))

        async def pending() -> bool:
            return await alert_state(prom, "LLMUpstreamErrorRateHigh", "pending")

        shown_after = since(outage_at, await wait_until(errors_shown, OUTAGE_S))
        pending_after = since(outage_at, await wait_until(pending, OUTAGE_S))
        await asyncio.sleep(max(0.0, outage_at + OUTAGE_S - time.time()))
        engine.down = False
        # the first 502 sample's own scrape time (raw samples), against the outage's start
        res = await prom.query(error_series + "[2m]")
        first = min(float(t) for r in res for t, v in r["values"] if float(v) > 0)

        # meanwhile: a model priced through SIGHUP, and its first request over $0.10
        pricing.write_text(yaml.safe_dump({"models": {**PRICES, NEW_MODEL: NEW_PRICE}}))
        tb.proc.send_signal(signal.SIGHUP)
        new_series = f'llm_request_cost_usd_count{{model="{NEW_MODEL}"}} == 0'

        async def new_published() -> bool:
            return bool(await prom.query(new_series))

        assert await wait_until(new_published, 10 * SCRAPE_S) is not None
        body = {"model": NEW_MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "a"}]}
        async with (
            aiohttp.ClientSession() as s,
            s.post(tb.url + "/v1/chat/completions", json=body) as r,
        ):
            assert r.status == 200
            cost = float(r.headers.get("X-Tollbooth-Cost-USD", "0") or 0)
            await r.read()

        async def cost_fires() -> bool:
            return await alert_state(prom, "LLMRequestCostHigh", "firing", model=NEW_MODEL)

        cost_after = await wait_until(cost_fires, 30)  # from the request's answer

        async def firing() -> bool:
            return await alert_state(prom, "LLMUpstreamErrorRateHigh", "firing")

        fired = await wait_until(firing, 120)
        fired_after = time.time() - outage_at if fired is not None else None
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(sender, 30)
    for name, value in (
        ("first_error_sample_after_s", first - outage_at),
        ("errors_on_query_after_s", shown_after),
        ("error_alert_pending_after_s", pending_after),
        ("error_alert_firing_after_s", fired_after),
        ("cost_alert_firing_after_s", cost_after),
        ("new_model_request_cost_usd", cost),
        ("requests_sent", len(statuses)),
        ("requests_502", statuses.count(502)),
    ):
        record_property(name, value)
        print(f"{name}={value}")
    assert statuses.count(502) > 0
    assert first - outage_at <= SCRAPE_S + 0.1  # the first scrape after the outage has it
    assert shown_after is not None and shown_after <= SCRAPE_S + SLACK_S
    # one scrape to see it, one evaluation to judge it
    assert pending_after is not None and pending_after <= 2 * SCRAPE_S + SLACK_S
    assert fired_after is not None
    assert cost_after is not None and cost_after <= 2 * SCRAPE_S + SLACK_S
