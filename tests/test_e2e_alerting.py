"""End to end with the real binaries: simulator -> tollbooth -> Prometheus (the real rules, with
thresholds lowered through the shared config) -> Alertmanager -> a webhook in this test.

An expensive run must page (LLMDailySpendHigh, critical) and open a ticket (LLMRequestCostHigh,
warning); a cheap-only run must page nobody. Bounded in time; every process is stopped.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from tollbooth_lab.simulator import EngineParams, create_simulator

from alerts.build import render_alertmanager, render_rules
from sidecar.telemetry.thresholds import load
from tests.procs import Tollbooth, free_port, start_tollbooth

PROMETHEUS, ALERTMANAGER = shutil.which("prometheus"), shutil.which("prometheus-alertmanager")
if not (PROMETHEUS and ALERTMANAGER):
    if os.environ.get("CI"):
        raise RuntimeError(
            "CI must have Debian's prometheus and prometheus-alertmanager (make test installs them)"
        )
    pytest.skip(
        "Debian's prometheus/prometheus-alertmanager not installed", allow_module_level=True
    )

pytestmark = pytest.mark.binaries
EXPENSIVE, CHEAP = "sim-expensive", "sim-llama-3-8b"
PRICES = {
    "models": {
        EXPENSIVE: {"input_per_1m": 20000.0, "output_per_1m": 20000.0},
        CHEAP: {"input_per_1m": 0.2, "output_per_1m": 0.6},
    }
}
# Lowered for the test through the same config the rules are rendered from.
THRESHOLDS = load(daily_spend_usd=0.5, user_daily_spend_usd=100.0)


class Webhook:
    def __init__(self) -> None:
        self.posts: list[tuple[str, dict[str, Any]]] = []
        self.app = web.Application()
        self.app.router.add_post("/{receiver}", self.receive)

    async def receive(self, request: web.Request) -> web.Response:
        self.posts.append((request.match_info["receiver"], await request.json()))
        return web.Response(text="ok")

    def alerts(self) -> list[tuple[str, str, dict[str, str]]]:
        return [
            (recv, a["labels"]["alertname"], a["labels"])
            for recv, body in self.posts
            for a in body["alerts"]
            if a["status"] == "firing"
        ]


async def spawn(tmp: Path, name: str, *args: str) -> asyncio.subprocess.Process:
    log = (tmp / f"{name}.log").open("wb")
    try:
        return await asyncio.create_subprocess_exec(*args, stdout=log, stderr=log)
    finally:
        log.close()


async def wait_http(url: str, deadline: float = 30.0) -> None:
    async with aiohttp.ClientSession() as s:
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(url)


class Stack:
    def __init__(self, tb: Tollbooth, prom: str, webhook: Webhook) -> None:
        self.tb, self.prom, self.webhook = tb, prom, webhook

    async def query(self, expr: str) -> list[Any]:
        async with (
            aiohttp.ClientSession() as s,
            s.get(self.prom + "/api/v1/query", params={"query": expr}) as r,
        ):
            return list((await r.json())["data"]["result"])

    async def chat(self, model: str, words: int, n: int) -> None:
        body = {
            "model": model,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": " ".join(["word"] * words)}],
        }
        async with aiohttp.ClientSession() as s:
            for _ in range(n):
                async with s.post(self.tb.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()


@pytest.fixture
async def stack(tmp_path: Path, aiohttp_server: Any) -> AsyncIterator[Stack]:
    webhook = Webhook()
    hook = await aiohttp_server(webhook.app)
    sim = await aiohttp_server(create_simulator("vllm", EngineParams(step_base_s=0.0005)))
    tb = await start_tollbooth(
        tmp_path,
        {
            "upstream": {"url": str(sim.make_url("")).rstrip("/")},
            "pricing": PRICES,
            "metering": {"new_series_hold_s": 2},  # above the 1 s scrape interval
            "logging": {"access_log": "off"},
            "audit": {"enabled": False},
            "gpu": {"enabled": False},
        },
    )
    prom_port, am_port = free_port(), free_port()
    (tmp_path / "rules.yml").write_text(render_rules(THRESHOLDS))
    (tmp_path / "alertmanager.yml").write_text(
        render_alertmanager(
            page_url=str(hook.make_url("/page")),
            ticket_url=str(hook.make_url("/ticket")),
            group_wait="1s",
            group_interval="1s",
            repeat_interval="1h",
        )
    )
    (tmp_path / "prometheus.yml").write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(tmp_path / "rules.yml")],
                "alerting": {
                    "alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]
                },
                "scrape_configs": [
                    {
                        "job_name": THRESHOLDS.job,
                        "static_configs": [{"targets": [tb.admin.removeprefix("http://")]}],
                    }
                ],
            }
        )
    )
    am = await spawn(
        tmp_path,
        "alertmanager",
        ALERTMANAGER,
        "--config.file",
        str(tmp_path / "alertmanager.yml"),
        "--storage.path",
        str(tmp_path / "am"),
        f"--web.listen-address=127.0.0.1:{am_port}",
        "--cluster.listen-address=",
    )
    prom = await spawn(
        tmp_path,
        "prometheus",
        PROMETHEUS,
        "--config.file",
        str(tmp_path / "prometheus.yml"),
        "--storage.tsdb.path",
        str(tmp_path / "tsdb"),
        f"--web.listen-address=127.0.0.1:{prom_port}",
    )
    try:
        await wait_http(f"http://127.0.0.1:{am_port}/-/ready")
        await wait_http(f"http://127.0.0.1:{prom_port}/-/ready")
        st = Stack(tb, f"http://127.0.0.1:{prom_port}", webhook)
        # the pre-initialised cost series must have been scraped at 0 before any traffic
        for _ in range(100):
            if await st.query(f'llm_request_cost_usd_count{{model="{EXPENSIVE}"}}'):
                break
            await asyncio.sleep(0.2)
        else:
            raise TimeoutError("prometheus never scraped tollbooth")
        await asyncio.sleep(1.5)
        yield st
    finally:
        for p in (prom, am):
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
        for p in (prom, am):
            await asyncio.wait_for(p.wait(), 20)
        await tb.stop(signal.SIGTERM)


async def wait_for(cond: Any, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        await asyncio.sleep(0.25)
    return bool(cond())


async def test_expensive_traffic_pages_and_tickets(stack: Stack) -> None:
    await stack.chat(EXPENSIVE, words=10, n=4)  # ~$0.3 each: 4 over $0.10, $1.2 over $0.50
    wanted = {("page", "LLMDailySpendHigh"), ("ticket", "LLMRequestCostHigh")}
    got = await wait_for(lambda: wanted <= {(r, n) for r, n, _ in stack.webhook.alerts()}, 60)
    assert got, f"alerts received: {stack.webhook.alerts()}"
    labels = {n: lbl for _, n, lbl in stack.webhook.alerts()}
    assert labels["LLMDailySpendHigh"]["severity"] == "critical"
    assert labels["LLMDailySpendHigh"]["job"] == THRESHOLDS.job
    assert labels["LLMRequestCostHigh"]["severity"] == "warning"
    assert labels["LLMRequestCostHigh"]["model"] == EXPENSIVE
    pages = {n for r, n, _ in stack.webhook.alerts() if r == "page"}
    assert pages == {"LLMDailySpendHigh"}


async def test_cheap_traffic_pages_nobody(stack: Stack) -> None:
    await stack.chat(CHEAP, words=10, n=20)
    # the spend reached Prometheus, so the rules were evaluated with it
    for _ in range(40):
        res = await stack.query(f'sum(increase(llm_cost_usd_total{{model="{CHEAP}"}}[24h]))')
        if res and float(res[0]["value"][1]) > 0:
            break
        await asyncio.sleep(0.25)
    else:
        raise AssertionError("cheap spend never reached Prometheus")
    await asyncio.sleep(6)  # several evaluations and Alertmanager group waits
    assert await stack.query('ALERTS{alertstate="firing"}') == []
    assert stack.webhook.alerts() == []
