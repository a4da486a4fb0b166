"""TGI traffic through the sidecar with the real Hugging Face client."""

from __future__ import annotations

import asyncio

import aiohttp
from huggingface_hub import AsyncInferenceClient, InferenceClient

from tests.conftest import StartSidecar

TGI_MODEL = "fake/tgi-model"  # what the fake's /info reports


def tgi_tokens(run, direction: str, endpoint: str, user: str = "anonymous") -> float | None:
    return run.value(
        "llm_tokens_total",
        model=TGI_MODEL,
        token_type=direction,
        api_endpoint=endpoint,
        user_id=user,
    )


async def test_hf_client_text_generation_non_streaming(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar()
    with InferenceClient(base_url=run.url) as client:
        out = await asyncio.to_thread(
            client.text_generation, "a b c", max_new_tokens=10, details=True
        )
    assert out.details.generated_tokens == 10
    paths = {s["path"] for s in run.upstream.seen}
    endpoint = "/" if "/" in paths else "/generate"
    assert tgi_tokens(run, "input", endpoint) == 3
    assert tgi_tokens(run, "output", endpoint) == 10


async def test_hf_client_streaming_with_details(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar()
    async with AsyncInferenceClient(base_url=run.url) as client:
        tokens = [
            t
            async for t in await client.text_generation(
                "one two three four", max_new_tokens=6, stream=True, details=True
            )
        ]
    assert len(tokens) == 6
    endpoint = run.upstream.seen[-1]["path"]
    ep = "/generate_stream" if endpoint == "/generate_stream" else "/"
    assert tgi_tokens(run, "output", ep) == 6
    assert tgi_tokens(run, "input", ep) == 4


async def test_generate_stream_without_details_counts_output_flags_input(
    start_sidecar: StartSidecar,
) -> None:
    run = await start_sidecar()
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            run.url + "/generate_stream",
            json={"inputs": "x y", "parameters": {"max_new_tokens": 5}},
        ) as r,
    ):
        body = await r.read()
    assert body.count(b"data:") == 5
    assert tgi_tokens(run, "output", "/generate_stream") == 5
    assert tgi_tokens(run, "input", "/generate_stream") is None
    assert (
        run.value(
            "llm_usage_unknown_total",
            model=TGI_MODEL,
            api_endpoint="/generate_stream",
            reason="no_input_length",
        )
        == 1
    )


async def test_tgi_stream_error_is_a_failure_with_delivered_tokens(
    start_sidecar: StartSidecar,
) -> None:
    run = await start_sidecar()
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            run.url + "/generate_stream",
            json={"inputs": "x", "parameters": {"max_new_tokens": 5}},
            headers={"X-Fake": "tgi-stream-error"},
        ) as r,
    ):
        await r.read()
    assert (
        run.value(
            "llm_requests_total",
            model=TGI_MODEL,
            api_endpoint="/generate_stream",
            status_code="stream_error",
        )
        == 1
    )
    assert tgi_tokens(run, "output", "/generate_stream") == 2


async def test_configured_model_name_wins_over_info(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar({"upstream": {"model_name": "my-tgi"}})
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            run.url + "/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 10}}
        ) as r,
    ):
        await r.read()
    assert (
        run.value(
            "llm_tokens_total",
            model="my-tgi",
            token_type="input",
            api_endpoint="/generate",
            user_id="anonymous",
        )
        == 1
    )
