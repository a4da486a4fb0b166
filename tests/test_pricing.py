"""Cost: exact dollars for known prices, unknown (never $0) otherwise."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar.config import ModelPrice, PricingConfig
from sidecar.metering.pricing import PriceBook, compute
from sidecar.telemetry.metrics import COST_BUCKETS
from tests.conftest import StartSidecar
from tests.fakes import MODEL
from tests.procs import start_tollbooth

PRICES = {
    "models": {MODEL: {"input_per_1m": 3.0, "output_per_1m": 15.0, "cached_input_per_1m": 0.3}}
}
MSGS = [{"role": "user", "content": "one two three four five"}]
CHAT = "/v1/chat/completions"


def test_compute_cached_is_part_of_input() -> None:
    p = ModelPrice(input_per_1m=3.0, output_per_1m=15.0, cached_input_per_1m=0.3)
    c = compute(p, input_tokens=1000, cached=400, output_tokens=100)
    assert c.input_usd == pytest.approx((600 * 3.0 + 400 * 0.3) / 1e6)
    assert c.output_usd == pytest.approx(100 * 15.0 / 1e6)
    no_cached_price = ModelPrice(input_per_1m=3.0, output_per_1m=15.0)
    assert compute(no_cached_price, 1000, 400, 0).input_usd == pytest.approx(3000 / 1e6)


def test_cost_buckets_include_ten_cents_exactly() -> None:
    assert 0.1 in COST_BUCKETS


async def post(run: Any, body: dict[str, Any], **headers: str) -> aiohttp.ClientResponse:
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + CHAT, json=body, headers=headers) as r,
    ):
        await r.read()
        return r


async def test_non_streaming_cost_header_and_metrics(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar({"pricing": PRICES})
    r = await post(
        run, {"model": MODEL, "messages": MSGS, "max_tokens": 10}, **{"X-Fake": "cached"}
    )
    expected_in = (3 * 3.0 + 2 * 0.3) / 1e6  # 5 prompt tokens, 2 of them cached
    expected_out = 10 * 15.0 / 1e6
    assert float(r.headers["x-tollbooth-cost-usd"]) == pytest.approx(expected_in + expected_out)
    labels = {"model": MODEL, "api_endpoint": CHAT, "user_id": "anonymous"}
    assert run.value("llm_cost_usd_total", token_type="input", **labels) == pytest.approx(
        expected_in
    )
    assert run.value("llm_cost_usd_total", token_type="output", **labels) == pytest.approx(
        expected_out
    )
    assert run.value("llm_request_cost_usd_count", model=MODEL, api_endpoint=CHAT) == 1
    assert run.value("llm_request_cost_usd_bucket", model=MODEL, api_endpoint=CHAT, le="0.001") == 1


async def test_streaming_cost(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar({"pricing": PRICES})
    await post(run, {"model": MODEL, "messages": MSGS, "max_tokens": 8, "stream": True})
    total = (5 * 3.0 + 8 * 15.0) / 1e6
    assert run.value("llm_request_cost_usd_sum", model=MODEL, api_endpoint=CHAT) == pytest.approx(
        total
    )


async def test_request_over_ten_cents_lands_above_the_bucket(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar(
        {"pricing": {"models": {MODEL: {"input_per_1m": 30000.0, "output_per_1m": 0.0}}}}
    )
    await post(run, {"model": MODEL, "messages": MSGS, "max_tokens": 1})  # 5 * 0.03 = $0.15
    le01 = run.value("llm_request_cost_usd_bucket", model=MODEL, api_endpoint=CHAT, le="0.1")
    inf = run.value("llm_request_cost_usd_bucket", model=MODEL, api_endpoint=CHAT, le="+Inf")
    assert (le01, inf) == (0, 1)


async def test_unpriced_model_is_unknown_not_free(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar({"pricing": PRICES})
    r = await post(run, {"model": "other-model", "messages": MSGS, "max_tokens": 2})
    assert "x-tollbooth-cost-usd" not in r.headers
    assert run.value("llm_cost_unknown_total", model="other-model", reason="no_price") == 1
    assert (
        run.value(
            "llm_cost_usd_total",
            model="other-model",
            token_type="input",
            api_endpoint=CHAT,
            user_id="anonymous",
        )
        is None
    )
    assert run.value("llm_request_cost_usd_count", model="other-model", api_endpoint=CHAT) is None


async def test_default_price_applies(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar({"pricing": {"default": {"input_per_1m": 1.0, "output_per_1m": 1.0}}})
    r = await post(run, {"model": "anything", "messages": MSGS, "max_tokens": 5})
    assert float(r.headers["x-tollbooth-cost-usd"]) == pytest.approx(10 / 1e6)


async def test_unknown_usage_means_unknown_cost(start_sidecar: StartSidecar) -> None:
    # without vLLM's running totals a truncated stream has no usage at all
    run = await start_sidecar({"pricing": PRICES, "metering": {"continuous_usage": False}})
    await post(run, {"model": MODEL, "messages": MSGS, "stream": True}, **{"X-Fake": "truncate"})
    assert run.value("llm_cost_unknown_total", model=MODEL, reason="usage_unknown") == 1
    assert run.value("llm_request_cost_usd_count", model=MODEL, api_endpoint=CHAT) == 0


async def test_known_models_are_initialised_at_zero(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar({"pricing": PRICES})
    assert run.value("llm_request_cost_usd_count", model=MODEL, api_endpoint=CHAT) == 0


async def test_sighup_rereads_the_pricing_file(upstream: Any, tmp_path: Path) -> None:
    _, server = upstream
    prices = tmp_path / "prices.yaml"
    prices.write_text(f"models:\n  {MODEL}: {{input_per_1m: 1.0, output_per_1m: 0.0}}\n")
    tb = await start_tollbooth(
        tmp_path,
        {"upstream": {"url": str(server.make_url("")).rstrip("/")}},
        "--pricing",
        str(prices),
    )
    try:
        body = {"model": MODEL, "messages": MSGS, "max_tokens": 1}
        async with aiohttp.ClientSession() as s:
            async with s.post(tb.url + CHAT, json=body) as r:
                assert float(r.headers["x-tollbooth-cost-usd"]) == pytest.approx(5 / 1e6)
            prices.write_text(f"models:\n  {MODEL}: {{input_per_1m: 2.0, output_per_1m: 0.0}}\n")
            tb.proc.send_signal(signal.SIGHUP)
            for _ in range(100):
                async with s.post(tb.url + CHAT, json=body) as r:
                    cost = float(r.headers["x-tollbooth-cost-usd"])
                if cost == pytest.approx(10 / 1e6):
                    break
                import asyncio

                await asyncio.sleep(0.05)
            assert cost == pytest.approx(10 / 1e6)
    finally:
        assert await tb.stop(signal.SIGTERM) == 0


def test_a_name_and_its_latest_tag_are_one_ollama_model() -> None:
    """`llama3.2` and `llama3.2:latest` are served as one model by Ollama: a price listed under
    either spelling prices both, so the other spelling is not an unpriced (free under a budget)
    model. Another tag is another model."""
    price = ModelPrice(input_per_1m=1.0, output_per_1m=2.0)
    book = PriceBook(PricingConfig(models={"llama3.2": price, "qwen3:latest": price}))
    assert book.price("llama3.2:latest") is price
    assert book.price("qwen3") is price
    assert book.price("llama3.2:1b") is None
    assert book.price(":latest") is None
