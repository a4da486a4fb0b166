"""Reconciliation against the engine's own counters (sidecar/telemetry/reconcile.py).

A vLLM-like fake engine counts every token it reads and generates in `vllm:prompt_tokens_total`
and `vllm:generation_tokens_total` (labels model_name, engine), as vLLM's loggers do, and nothing
for /tokenize, /health or /metrics (vLLM's tokenizer and probes do not reach the engine core).
Guards: traffic sent around the sidecar is the exact difference between llm_engine_tokens_total
and llm_tokens_total, the sidecar's own calls (the scrape, the probe, /tokenize) make none; an
engine without metrics leaves the counts absent, llm_engine_metrics_up 0, and no warning.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from sidecar.config import Config, ConfigError, build, validate
from sidecar.telemetry.reconcile import Reconciler, parse
from tests.conftest import Running, StartSidecar
from tests.waiting import wait_for

MODEL = "fake/llama-3-8b"


class FakeVllm:
    """Counts tokens as the engine core does; /tokenize, /health and /metrics count none."""

    def __init__(self, *, metrics: bool = True) -> None:
        self.prompt = 0
        self.generated = 0
        self.scrapes = 0
        self.tokenized = 0
        self.probes = 0
        self.app = web.Application()
        r = self.app.router
        r.add_post("/v1/chat/completions", self.chat)
        r.add_post("/tokenize", self.tokenize)
        r.add_get("/health", self.health)
        if metrics:
            r.add_get("/metrics", self.metrics)

    @staticmethod
    def _prompt(body: dict[str, Any]) -> int:
        return sum(len(str(m.get("content", "")).split()) for m in body.get("messages", []))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        p, c = self._prompt(body), int(body.get("max_tokens", 5))
        self.prompt += p
        self.generated += c
        usage = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        base = {"id": "x", "created": 1, "model": body["model"]}
        if not body.get("stream"):
            choice = {"index": 0, "message": {"role": "assistant", "content": "t " * c}}
            return web.json_response(
                {**base, "object": "chat.completion", "choices": [choice], "usage": usage}
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(c):
            delta = {"index": 0, "delta": {"content": "t "}, "finish_reason": None}
            chunk = {**base, "object": "chat.completion.chunk", "choices": [delta]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            last = {**base, "object": "chat.completion.chunk", "choices": [], "usage": usage}
            await resp.write(b"data: " + json.dumps(last).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def tokenize(self, request: web.Request) -> web.Response:
        self.tokenized += 1
        n = self._prompt(json.loads(await request.read()))
        return web.json_response({"count": n, "max_model_len": 4096, "tokens": list(range(n))})

    async def health(self, request: web.Request) -> web.Response:
        self.probes += 1
        return web.Response(text="")

    async def metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        # Split across two data-parallel engines, as vLLM labels them; with other families.
        p0, g0 = self.prompt // 2, self.generated // 3
        labels = f'model_name="{MODEL}"'
        page = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f'vllm:num_requests_running{{engine="0",{labels}}} 0.0',
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f'vllm:prompt_tokens_total{{engine="0",{labels}}} {float(p0)}',
            f'vllm:prompt_tokens_total{{engine="1",{labels}}} {float(self.prompt - p0)}',
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f'vllm:generation_tokens_total{{engine="0",{labels}}} {float(g0)}',
            f'vllm:generation_tokens_total{{engine="1",{labels}}} {float(self.generated - g0)}',
            "# TYPE vllm:request_generation_tokens histogram",
            f'vllm:request_generation_tokens_bucket{{engine="0",le="+Inf",{labels}}} 3.0',
            f'vllm:request_generation_tokens_sum{{engine="0",{labels}}} 999.0',
            f'vllm:request_generation_tokens_count{{engine="0",{labels}}} 3.0',
        ]
        return web.Response(text="\n".join(page) + "\n", content_type="text/plain")


def metered(run: Running, kind: str) -> float:
    total = 0.0
    for fam in run.sc.metrics.registry.collect():
        for s in fam.samples:
            if s.name == "llm_tokens_total" and s.labels["token_type"] == kind:
                total += s.value
    return total


def engine(run: Running, kind: str) -> float | None:
    return run.value("llm_engine_tokens_total", model=MODEL, token_type=kind)


async def chat(base: str, words: int, max_tokens: int, *, stream: bool = False) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": " ".join(["w"] * words)}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(base + "/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 200, await r.text()
        await r.read()


async def test_traffic_around_the_sidecar_is_the_exact_gap(
    start_sidecar: StartSidecar, aiohttp_server: Any
) -> None:
    fake = FakeVllm()
    server = await aiohttp_server(fake.app)
    engine_url = str(server.make_url("")).rstrip("/")
    cfg = {
        "reconcile": {"interval_s": 0.02},
        "admission": {"tokenize": True},  # the sidecar's own /tokenize on every request
        "upstream": {"probe_interval_s": 0.02},
    }
    run = await start_sidecar(cfg, upstream_url=engine_url)

    await chat(run.url, 7, 11)
    await chat(run.url, 3, 13, stream=True)
    await chat(run.url, 5, 17, stream=True)
    # Only the sidecar's traffic so far, and its own calls: no gap.
    assert fake.tokenized >= 3 and fake.probes >= 1
    seen = fake.scrapes
    await wait_for(lambda: fake.scrapes >= seen + 2, "two scrapes after the requests")
    assert engine(run, "output") == metered(run, "output") == 41
    assert engine(run, "input") == metered(run, "input") == 15
    assert run.value("llm_engine_metrics_up") == 1

    # Around the sidecar, straight to the engine: 19 and 23 tokens generated, 9 and 2 read.
    await chat(engine_url, 9, 19)
    await chat(engine_url, 2, 23, stream=True)
    await wait_for(lambda: engine(run, "output") == 41 + 42, "the engine's new count read")
    assert engine(run, "output") - metered(run, "output") == 42  # type: ignore[operator]
    assert engine(run, "input") - metered(run, "input") == 11  # type: ignore[operator]


async def test_an_engine_without_metrics_leaves_the_counts_absent_quietly(
    start_sidecar: StartSidecar, aiohttp_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeVllm(metrics=False)  # /metrics answers 404 (Ollama has no such endpoint)
    server = await aiohttp_server(fake.app)
    caplog.set_level(logging.DEBUG, "tollbooth.reconcile")
    run = await start_sidecar(
        {"reconcile": {"interval_s": 0.02}}, upstream_url=str(server.make_url("")).rstrip("/")
    )
    await chat(run.url, 4, 6)
    await wait_for(lambda: run.value("llm_engine_metrics_up") == 0, "a failed read")
    await wait_for(
        lambda: sum("answered 404" in r.getMessage() for r in caplog.records) >= 1, "its log"
    )
    assert engine(run, "output") is None and engine(run, "input") is None
    assert metered(run, "output") == 6
    mine = [r for r in caplog.records if r.name == "tollbooth.reconcile"]
    assert mine and not [r for r in mine if r.levelno >= logging.WARNING]
    assert sum("answered 404" in r.getMessage() for r in caplog.records) == 1  # once, not per read


async def test_an_unreachable_engine_reads_as_down_and_a_later_answer_as_up() -> None:
    class Flaky:
        def __init__(self) -> None:
            self.page: bytes | None = None

        async def fetch(self, method: str, path: str, *, timeout: float) -> tuple[int, bytes]:
            if self.page is None:
                raise aiohttp.ClientConnectionError("refused")
            return 200, self.page

    src = Flaky()
    rec = Reconciler(lambda: src, path="/metrics", interval_s=1, timeout_s=1, default_model="m")
    await rec.once()
    names = [f.name for f in rec.collect()]
    assert names == ["llm_engine_metrics_up"] and rec.counts is None
    src.page = b"# TYPE llamacpp:tokens_predicted counter\nllamacpp:tokens_predicted_total 12\n"
    await rec.once()
    fams = {f.name: f for f in rec.collect()}
    assert fams["llm_engine_metrics_up"].samples[0].value == 1
    [sample] = fams["llm_engine_tokens"].samples
    assert sample.labels == {"model": "m", "token_type": "output"} and sample.value == 12


def test_each_engines_counters_are_read() -> None:
    page = "\n".join(
        [
            "# TYPE sglang:prompt_tokens counter",
            'sglang:prompt_tokens_total{model_name="s"} 5',
            "# TYPE sglang:generation_tokens counter",
            'sglang:generation_tokens_total{model_name="s"} 6',
            "# TYPE tgi_request_input_length histogram",
            'tgi_request_input_length_bucket{le="+Inf"} 2',
            "tgi_request_input_length_sum 70",
            "tgi_request_input_length_count 2",
            "# TYPE tgi_request_generated_tokens histogram",
            'tgi_request_generated_tokens_bucket{le="+Inf"} 2',
            "tgi_request_generated_tokens_sum 80",
            "tgi_request_generated_tokens_count 2",
            "# TYPE trtllm_prompt_tokens counter",
            'trtllm_prompt_tokens_total{model_name="t"} 9',
            "# TYPE trtllm_generation_tokens counter",
            'trtllm_generation_tokens_total{model_name="t"} NaN',  # not a count: absent
            "some garbage line that is not the text format {",
            "# TYPE llamacpp:prompt_tokens counter",
            "llamacpp:prompt_tokens_total 3",
        ]
    )
    assert parse(page, "default") == {
        ("s", "input"): 5,
        ("s", "output"): 6,
        ("default", "input"): 73,
        ("default", "output"): 80,
        ("t", "input"): 9,
    }


def test_a_model_label_from_the_engine_is_made_safe() -> None:
    page = 'vllm:generation_tokens_total{model_name="a\\nb' + "x" * 500 + '"} 4\n'
    [(model, kind)] = parse(page, "d")
    assert "\n" not in model and len(model) <= 256 and kind == "output"


def test_the_metrics_path_must_be_a_path() -> None:
    with pytest.raises(ConfigError, match=r"upstream\.metrics_path"):
        validate(build(Config, {"upstream": {"metrics_path": "metrics"}}))
    with pytest.raises(ConfigError, match=r"reconcile\.interval_s"):
        validate(build(Config, {"reconcile": {"interval_s": 0}}))
