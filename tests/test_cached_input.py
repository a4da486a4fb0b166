"""Cached input on the OpenAI routes: `prompt_tokens_details.cached_tokens` (vLLM's
--enable-prompt-tokens-details) read from a body and from an include_usage stream, counted as a
part of the input and priced at the cached price. Through the real openai SDK against the
simulator's prefix cache."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import openai
import pytest
from tollbooth_lab.simulator import EngineParams, create_simulator

from tests.conftest import Running, StartSidecar

FAST = EngineParams(step_base_s=0.0005, prefill_s_per_token=0.0, decode_s_per_seq=0.00001)
MODEL = "sim-llama-3-8b"
USER = "key-" + hashlib.sha256(b"k").hexdigest()[:12]
LABELS = {"model": MODEL, "api_endpoint": "/v1/chat/completions", "user_id": USER}
PRICE = {"input_per_1m": 4.0, "output_per_1m": 8.0, "cached_input_per_1m": 1.0}
PROMPT = " ".join(f"word{i}" for i in range(40))  # longer than two 16-token blocks


async def requests_done(run: Running, n: int) -> None:
    labels = {"model": MODEL, "api_endpoint": "/v1/chat/completions", "status_code": "200"}
    for _ in range(250):
        if (run.value("llm_requests_total", **labels) or 0) >= n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the requests were never recorded")


async def test_cached_prompt_tokens_are_read_from_a_body_and_a_stream(
    start_sidecar: StartSidecar, aiohttp_server: Any
) -> None:
    sim = await aiohttp_server(create_simulator("vllm", FAST, prompt_tokens_details=True))
    run = await start_sidecar(
        {"pricing": {"models": {MODEL: PRICE}}}, upstream_url=str(sim.make_url("")).rstrip("/")
    )
    messages = [{"role": "user", "content": PROMPT}]
    async with openai.AsyncOpenAI(base_url=run.url + "/v1", api_key="k", max_retries=0) as c:
        first = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
        again = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        streamed = [ch.usage async for ch in stream if ch.usage is not None]
    usages = [first.usage, again.usage, *streamed]
    assert len(usages) == 3 and all(u is not None and u.prompt_tokens_details for u in usages)
    cached = [u.prompt_tokens_details.cached_tokens for u in usages]  # type: ignore[union-attr]
    prompt = first.usage.prompt_tokens  # type: ignore[union-attr]
    assert cached[0] == 0 and cached[1] == cached[2] == (prompt - 1) // 16 * 16 > 0
    await requests_done(run, 3)
    assert run.value("llm_cached_input_tokens_total", **LABELS) == sum(cached)
    assert run.value("llm_tokens_total", token_type="input", **LABELS) == 3 * prompt
    want = ((3 * prompt - sum(cached)) * 4.0 + sum(cached) * 1.0) / 1e6
    got = run.value("llm_cost_usd_total", token_type="input", **LABELS)
    assert got == pytest.approx(want, rel=1e-12)
