"""TGI traffic through the sidecar with the real Hugging Face client."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from huggingface_hub import AsyncInferenceClient, InferenceClient

from sidecar.exchange import Endpoint
from sidecar.metering.wire import open_stream
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


# --- /generate_stream with an event over metering.max_event_bytes -------------------------------

LIMIT = 1024  # a small metering.max_event_bytes: a longer event is not read


def _token(i: int, text: str = "a") -> bytes:
    token = {"id": 1, "text": text, "logprob": -1.0, "special": False}
    event = {"index": i, "token": token, "generated_text": None, "details": None}
    return b"data:" + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def _last(i: int, details: dict[str, Any]) -> bytes:
    token = {"id": 2, "text": "b", "logprob": -1.0, "special": False}
    event = {"index": i, "token": token, "generated_text": "ab", "details": details}
    return b"data:" + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def _read_with_limit(data: bytes) -> set[tuple[Any, ...]]:
    """(input, output, reason) of `data` cut in two at every byte, on the fast path and the
    reference path; each read passes unchanged."""
    results = set()
    for fast in (True, False):
        for cut in range(len(data) + 1):
            meter = open_stream(Endpoint.TGI_GENERATE_STREAM, max_event_bytes=LIMIT, fast=fast)
            out = meter.feed(data[:cut]) + meter.feed(data[cut:])
            tail, u = meter.finish()
            assert out + tail == data
            results.add((u.input_tokens, u.output_tokens, u.unknown_reason))
    return results


DETAILS = {"finish_reason": "length", "generated_tokens": 5, "input_length": 9}


def test_the_last_event_after_an_event_over_the_limit_is_the_usage() -> None:
    """TGI's last event's `details` are the request's final counts: read after a token event
    too long to read, they are the usage (before, the whole stream was unknown)."""
    data = _token(0) + _token(1) + _token(2, "t" * 2000) + _token(3) + _last(4, DETAILS)
    assert _read_with_limit(data) == {(9, 5, None)}


def test_token_events_counted_around_an_event_over_the_limit_are_no_usage() -> None:
    """Without `generated_tokens` the output is the token events counted, and the long event
    may have been one: unknown. So is a last event before a long one."""
    no_count = {"finish_reason": "length", "input_length": 9}
    data = _token(0) + _token(1, "t" * 2000) + _last(2, no_count)
    assert _read_with_limit(data) == {(None, None, "event_too_large")}
    after = _token(0) + _last(1, DETAILS) + _token(2, "t" * 2000)
    assert _read_with_limit(after) == {(None, None, "event_too_large")}


@pytest.mark.parametrize(("generated", "billed"), [(1, None), (4, None), (5, 5), (7, 7)])
def test_a_count_below_the_token_events_is_invalid(generated: int, billed: int | None) -> None:
    """TGI sends one event per generated token (server.rs `generate_stream_internal`: "Yield
    event for every new token", the last token in the `End` event). A `generated_tokens` below
    the token events read is a broken count: before, 50 token events with a count of 1 were
    billed 1 token (h-rev6). Now invalid usage (charged as unmeasured: a token an event)."""
    details = {**DETAILS, "generated_tokens": generated}
    data = b"".join(_token(i) for i in range(4)) + _last(4, details)
    reason = None if billed else "invalid_usage"
    assert _read_with_limit(data) == {(9 if billed else None, billed, reason)}
