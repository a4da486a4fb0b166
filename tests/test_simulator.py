"""The simulated server: real clients, real wire formats, an engine that batches and runs out of
memory, and output that does not depend on batching."""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import aiohttp
import openai
import pytest
from huggingface_hub import AsyncInferenceClient
from prometheus_client.parser import text_string_to_metric_families
from tollbooth_lab.simulator import EngineParams, create_simulator
from tollbooth_lab.simulator.engine import Engine, chat_prompt, tokenize
from tollbooth_lab.simulator.server import ENGINE

from sidecar.telemetry.metrics import (
    TGI_BATCH,
    TGI_QUEUE,
    VLLM_KV_USAGE,
    VLLM_PREEMPTIONS,
    VLLM_RUNNING,
    VLLM_WAITING,
)
from tests.conftest import StartSidecar

FAST = EngineParams(step_base_s=0.0005, prefill_s_per_token=0.0, decode_s_per_seq=0.00001)
MODEL = "sim-llama-3-8b"


@pytest.fixture
async def vllm_sim(aiohttp_server: Any) -> Any:
    return await aiohttp_server(create_simulator("vllm", FAST))


@pytest.fixture
async def tgi_sim(aiohttp_server: Any) -> Any:
    return await aiohttp_server(create_simulator("tgi", FAST))


def base(server: Any) -> str:
    return str(server.make_url("")).rstrip("/")


async def test_openai_sdk_against_vllm_sim(vllm_sim: Any) -> None:
    async with openai.AsyncOpenAI(
        base_url=base(vllm_sim) + "/v1", api_key="x", max_retries=0
    ) as client:
        r = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=9
        )
        assert r.usage.completion_tokens == len(r.choices[0].message.content.split()) <= 9
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=9,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert chunks[-1].choices == [] and chunks[-1].usage == r.usage
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == r.choices[0].message.content  # same prompt and seed: same text
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]


async def test_vllm_sim_errors_and_tokenize(vllm_sim: Any) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(base(vllm_sim) + "/v1/completions", data=b"{nope") as r:
            assert r.status == 400
            body = await r.json()
            assert body["error"]["type"] == "BadRequestError" and body["error"]["code"] == 400
        async with s.post(base(vllm_sim) + "/tokenize", json={"prompt": "a b, c"}) as r:
            assert (await r.json())["count"] == 4
        async with s.get(base(vllm_sim) + "/metrics") as r:
            text = await r.text()
            assert 'tollbooth_simulator_info{simulated="true"' in text
            assert "vllm:kv_cache_usage_perc" in text


async def test_hf_client_against_tgi_sim_through_sidecar(
    tgi_sim: Any, start_sidecar: StartSidecar
) -> None:
    run = await start_sidecar(upstream_url=base(tgi_sim))
    async with AsyncInferenceClient(base_url=run.url) as client:
        out = await client.text_generation("one two three", max_new_tokens=5, details=True)
        assert out.details.generated_tokens <= 5
        toks = [
            t
            async for t in await client.text_generation(
                "one two three", max_new_tokens=5, stream=True, details=True
            )
        ]
        assert "".join(t.token.text for t in toks) == out.generated_text
        assert toks[-1].details.input_length == 3
    assert (
        run.value(
            "llm_tokens_total",
            model=MODEL,
            token_type="input",
            api_endpoint=_tgi_endpoint(run),
            user_id="anonymous",
        )
        is not None
    )


def _tgi_endpoint(run: Any) -> str:
    for ep in ("/", "/generate", "/generate_stream"):
        if run.value(
            "llm_tokens_total",
            model=MODEL,
            token_type="input",
            api_endpoint=ep,
            user_id="anonymous",
        ):
            return ep
    return "/"


async def test_tgi_sim_wire_format(tgi_sim: Any) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(
            base(tgi_sim) + "/generate_stream",
            json={"inputs": "x y", "parameters": {"max_new_tokens": 3}},
        ) as r:
            raw = await r.read()
        assert raw.startswith(b'data:{"index": 1')  # TGI writes no space after the colon
        async with s.post(
            base(tgi_sim) + "/generate", json={"inputs": "x y", "parameters": {"max_new_tokens": 3}}
        ) as r:
            assert r.headers["x-prompt-tokens"] == "2"
            assert int(r.headers["x-generated-tokens"]) <= 3
        async with s.post(base(tgi_sim) + "/generate", json={"inputs": 5}) as r:
            assert r.status == 422 and (await r.json())["error_type"] == "validation"
        async with s.post(base(tgi_sim) + "/tokenize", json={"inputs": "ab cd"}) as r:
            assert await r.json() == [
                {"id": 0, "text": "ab", "start": 0, "stop": 2},
                {"id": 1, "text": "cd", "start": 3, "stop": 5},
            ]
        async with s.get(base(tgi_sim) + "/info") as r:
            assert (await r.json())["model_id"] == MODEL


async def test_output_is_the_same_alone_or_batched(aiohttp_server: Any) -> None:
    server = await aiohttp_server(create_simulator("vllm", FAST))
    prompts = [f"prompt number {i} " * (i + 1) for i in range(6)]

    async def complete(s: aiohttp.ClientSession, p: str) -> str:
        async with s.post(
            base(server) + "/v1/completions", json={"prompt": p, "max_tokens": 12, "seed": 7}
        ) as r:
            return str((await r.json())["choices"][0]["text"])

    async with aiohttp.ClientSession() as s:
        alone = [await complete(s, p) for p in prompts]
        batched = await asyncio.gather(*(complete(s, p) for p in prompts))
    assert alone == list(batched)


async def test_kv_overflow_oom_fails_running_requests(aiohttp_server: Any) -> None:
    params = EngineParams(
        kv_capacity_tokens=60,
        on_full="oom",
        step_base_s=0.001,
        prefill_s_per_token=0.0,
        decode_s_per_seq=0.0,
    )
    server = await aiohttp_server(create_simulator("vllm", params))
    async with aiohttp.ClientSession() as s:

        async def one() -> tuple[int, Any]:
            async with s.post(
                base(server) + "/v1/completions", json={"prompt": "w " * 10, "max_tokens": 40}
            ) as r:
                return r.status, await r.json()

        results = await asyncio.gather(*(one() for _ in range(4)))
        assert any(
            status == 500 and "out of memory" in body["error"]["message"]
            for status, body in results
        )
        async with s.post(
            base(server) + "/v1/completions",
            json={"prompt": "w " * 10, "max_tokens": 5, "stream": True},
        ) as r:
            assert r.status == 200  # the engine recovers: the queue's context was cleared
        async with s.get(base(server) + "/metrics") as r:
            text = await r.text()
    ooms = next(ln for ln in text.splitlines() if ln.startswith("tollbooth_simulator_oom_total "))
    assert int(ooms.split()[1]) >= 1


async def test_kv_overflow_preempt_completes_everything(aiohttp_server: Any) -> None:
    params = EngineParams(
        kv_capacity_tokens=60,
        on_full="preempt",
        step_base_s=0.0005,
        prefill_s_per_token=0.0,
        decode_s_per_seq=0.0,
    )
    server = await aiohttp_server(create_simulator("vllm", params))
    async with aiohttp.ClientSession() as s:

        async def one(i: int) -> dict[str, Any]:
            async with s.post(
                base(server) + "/v1/completions", json={"prompt": f"w{i} " * 10, "max_tokens": 30}
            ) as r:
                assert r.status == 200
                return dict(await r.json())

        results = await asyncio.gather(*(one(i) for i in range(4)))
        async with s.get(base(server) + "/metrics") as r:
            text = await r.text()
    assert all(r["usage"]["completion_tokens"] >= 1 for r in results)
    preempted = float(
        next(ln for ln in text.splitlines() if ln.startswith("vllm:num_preemptions_total")).split()[
            1
        ]
    )
    assert preempted > 0


async def test_midstream_oom_reaches_the_client_and_the_sidecar(
    aiohttp_server: Any, start_sidecar: StartSidecar
) -> None:
    params = EngineParams(
        kv_capacity_tokens=50,
        on_full="oom",
        step_base_s=0.001,
        prefill_s_per_token=0.0,
        decode_s_per_seq=0.0,
    )
    server = await aiohttp_server(create_simulator("vllm", params))
    run = await start_sidecar(upstream_url=base(server))
    async with aiohttp.ClientSession() as s:

        async def one() -> bytes:
            async with s.post(
                run.url + "/v1/completions",
                json={"model": MODEL, "prompt": "w " * 10, "max_tokens": 40, "stream": True},
            ) as r:
                return await r.read()

        bodies = await asyncio.gather(*(one() for _ in range(3)))
    errors = [b for b in bodies if b'"error"' in b]
    assert errors
    event = next(
        json.loads(line[6:])
        for line in errors[0].split(b"\n\n")
        if line.startswith(b'data: {"error"')
    )
    assert event["error"]["type"] == "InternalServerError"
    assert run.value(
        "llm_requests_total",
        model=MODEL,
        api_endpoint="/v1/completions",
        status_code="stream_error",
    ) == len(errors)


@pytest.mark.parametrize("api", ["vllm", "tgi"])
async def test_scheduler_metrics_use_the_servers_names_marked_simulated(
    aiohttp_server: Any, api: str
) -> None:
    server = await aiohttp_server(create_simulator(api, EngineParams(step_base_s=0.0005)))
    async with aiohttp.ClientSession() as s, s.get(base(server) + "/metrics") as r:
        text = await r.text()
    samples = {
        sample.name: sample.labels
        for fam in text_string_to_metric_families(text)
        for sample in fam.samples
    }
    names = (
        {VLLM_RUNNING, VLLM_WAITING, VLLM_KV_USAGE, VLLM_PREEMPTIONS}
        if api == "vllm"
        else {TGI_QUEUE, TGI_BATCH}
    )
    for name in names:
        assert samples[name]["simulated"] == "true", name


async def test_vllm_sim_reads_lax_booleans_and_sends_running_usage(vllm_sim: Any) -> None:
    """vLLM's own behaviour, which the sidecar relies on: `"stream": "true"` streams, and
    continuous_usage_stats (with include_usage) puts running totals on every chunk."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 6,
        "stream": "true",
        "stream_options": {"include_usage": "yes", "continuous_usage_stats": 1},
    }
    async with aiohttp.ClientSession() as s:
        async with s.post(base(vllm_sim) + "/tokenize", json={"messages": body["messages"]}) as r:
            prompt = (await r.json())["count"]
        async with s.post(base(vllm_sim) + "/v1/chat/completions", json=body) as r:
            assert r.content_type == "text/event-stream"
            events = [
                json.loads(line[6:])
                for line in (await r.read()).split(b"\n\n")
                if line.startswith(b"data: {")
            ]
    running = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert running == sorted(running) and running[0] == 0  # the role chunk: nothing generated
    assert all(e["usage"]["prompt_tokens"] == prompt for e in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == running[-1]


async def test_a_client_leaving_mid_stream_is_billed_exactly_through_the_sim(
    aiohttp_server: Any, start_sidecar: StartSidecar
) -> None:
    params = EngineParams(step_base_s=0.01, prefill_s_per_token=0.0, decode_s_per_seq=0.0)
    server = await aiohttp_server(create_simulator("vllm", params))
    engine = server.app[ENGINE]
    run = await start_sidecar(upstream_url=base(server))
    messages = [{"role": "user", "content": "tell me a long story"}]
    seed = next(
        s for s in range(100) if Engine(FAST).submit(chat_prompt(messages), 300, s).stop_at == 300
    )
    async with openai.AsyncOpenAI(base_url=run.url + "/v1", api_key="k", max_retries=0) as c:
        stream = await c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=300, seed=seed, stream=True
        )
        n = 0
        async for chunk in stream:
            assert chunk.usage is None  # the running totals never reach the client
            n += bool(chunk.choices and chunk.choices[0].delta.content)
            if n == 5:
                break
        await stream.close()
    key = {"model": MODEL, "api_endpoint": "/v1/chat/completions"}
    for _ in range(250):
        if run.value("llm_requests_total", status_code="499", **key):
            break
        await asyncio.sleep(0.02)
    user = {"user_id": "key-" + hashlib.sha256(b"k").hexdigest()[:12], **key}
    out = run.value("llm_tokens_total", token_type="output", **user)
    assert run.value("llm_tokens_total", token_type="input", **user) == len(
        tokenize(chat_prompt(messages))
    )
    assert out is not None and 5 <= out <= engine.generation_tokens_total < 300
    for _ in range(100):  # the sequence was cancelled: the engine stops generating it
        if not engine.running and not engine.waiting:
            break
        await asyncio.sleep(0.02)
    assert not engine.running and engine.generation_tokens_total < 300
