"""vLLM's pooling and scoring routes are metered: input tokens from `usage.prompt_tokens` (a
rerank counts every (query, document) pair, whatever `top_n` returns), priced as input, output
0; the body reaches the client untouched; the hold counts the query once per document."""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import aiohttp
import pytest
from tollbooth_lab.simulator import EngineParams, create_simulator
from tollbooth_lab.simulator.engine import tokenize

from sidecar.exchange import POOLING_ROUTES, Endpoint
from sidecar.metering.wire import inspect_request, usage_from_body
from sidecar.proxy.routes import classify
from tests.conftest import Running, StartSidecar

FAST = EngineParams(step_base_s=0.0005, prefill_s_per_token=0.0, decode_s_per_seq=0.00001)
MODEL = "sim-llama-3-8b"
KEY = "k"
USER = "key-" + hashlib.sha256(KEY.encode()).hexdigest()[:12]
PRICES = {"models": {MODEL: {"input_per_1m": 1000.0, "output_per_1m": 5000.0}}}  # $0.001/token
QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "berlin is in germany", "the sky is blue today"]


def pair_tokens(query: str, docs: list[str]) -> int:
    return sum(len(tokenize(query)) + len(tokenize(d)) for d in docs)


def tokens(run: Running, route: str, kind: str) -> float | None:
    return run.value(
        "llm_tokens_total", model=MODEL, token_type=kind, api_endpoint=route, user_id=USER
    )


def cost(run: Running, route: str, kind: str) -> float | None:
    return run.value(
        "llm_cost_usd_total", model=MODEL, token_type=kind, api_endpoint=route, user_id=USER
    )


async def served(run: Running, route: str, n: int = 1) -> None:
    labels = {"model": MODEL, "api_endpoint": route, "status_code": "200"}
    for _ in range(250):
        if (run.value("llm_requests_total", **labels) or 0) >= n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{route} was never recorded")


@pytest.fixture
async def run(start_sidecar: StartSidecar, aiohttp_server: Any) -> Running:
    sim = await aiohttp_server(create_simulator("vllm", FAST))
    return await start_sidecar({"pricing": PRICES}, upstream_url=str(sim.make_url("")).rstrip("/"))


async def post(run: Running, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}) as r,
    ):
        return r.status, await r.read()


@pytest.mark.parametrize("route", ["/rerank", "/v1/rerank", "/v2/rerank"])
async def test_a_rerank_bills_every_pair_whatever_top_n_returns(run: Running, route: str) -> None:
    status, raw = await post(
        run, route, {"model": MODEL, "query": QUERY, "documents": DOCS, "top_n": 1}
    )
    assert status == 200
    answer = json.loads(raw)
    assert len(answer["results"]) == 1  # the client got the server's answer
    want = pair_tokens(QUERY, DOCS)
    assert answer["usage"] == {"prompt_tokens": want, "total_tokens": want}
    await served(run, route)
    assert tokens(run, route, "input") == want
    assert tokens(run, route, "output") == 0  # measured: nothing is generated
    assert cost(run, route, "input") == pytest.approx(want * 0.001)
    assert cost(run, route, "output") == 0
    assert run.value("llm_usage_unknown_total", model=MODEL, api_endpoint=route,
                     reason="incomplete_usage") is None  # fmt: skip


@pytest.mark.parametrize(
    "route,body,want",
    [
        ("/score", {"text_1": QUERY, "text_2": DOCS}, pair_tokens(QUERY, DOCS)),
        ("/v1/score", {"queries": [QUERY], "documents": DOCS[:2]}, pair_tokens(QUERY, DOCS[:2])),
        ("/pooling", {"input": DOCS}, sum(len(tokenize(d)) for d in DOCS)),
        ("/classify", {"input": DOCS[0]}, len(tokenize(DOCS[0]))),
    ],
)
async def test_pooling_and_score_routes_bill_their_input(
    run: Running, route: str, body: dict[str, Any], want: int
) -> None:
    status, raw = await post(run, route, {"model": MODEL, **body})
    assert status == 200, raw
    assert json.loads(raw)["usage"]["prompt_tokens"] == want
    await served(run, route)
    assert tokens(run, route, "input") == want
    assert tokens(run, route, "output") == 0
    assert cost(run, route, "input") == pytest.approx(want * 0.001)


async def test_a_burst_of_reranks_against_a_small_budget_is_held(
    start_sidecar: StartSidecar, aiohttp_server: Any
) -> None:
    sim = await aiohttp_server(create_simulator("vllm", FAST))
    run = await start_sidecar(
        {
            "pricing": PRICES,
            "budgets": {"user_daily_usd": 0.05, "default_max_output_tokens": 1},
        },
        upstream_url=str(sim.make_url("")).rstrip("/"),
    )
    body = {"model": MODEL, "query": QUERY, "documents": DOCS}
    each = pair_tokens(QUERY, DOCS) * 0.001  # $0.027 measured; the hold is at least that
    results = await asyncio.gather(*(post(run, "/rerank", body) for _ in range(8)))
    ok = [s for s, _ in results if s == 200]
    assert 1 <= len(ok) <= int(0.05 // each) and len(ok) + [s for s, _ in results].count(429) == 8
    spent = sum(cost(run, "/rerank", k) or 0 for k in ("input", "output"))
    assert spent == pytest.approx(len(ok) * each) and spent <= 0.05


def test_the_hold_counts_the_query_once_per_document() -> None:
    body = json.dumps({"model": MODEL, "query": "q" * 100, "documents": ["d" * 10] * 5})
    info = inspect_request(Endpoint.RERANK, body.encode(), inject_usage=True)
    assert info.text_chars == 5 * 100 + 5 * 10 and not info.stream and info.body == body.encode()
    one = json.dumps({"text_1": "q" * 100, "text_2": ["d" * 10] * 3}).encode()
    assert inspect_request(Endpoint.SCORE, one, inject_usage=True).text_chars == 3 * 110
    pairwise = json.dumps({"text_1": ["a" * 7, "b" * 7], "text_2": ["c" * 3, "d" * 3]}).encode()
    assert inspect_request(Endpoint.SCORE_V1, pairwise, inject_usage=True).text_chars == 20


def test_every_pooling_route_is_metered_and_bad_usage_is_unknown() -> None:
    assert {classify("POST", e.value) for e in POOLING_ROUTES} == set(POOLING_ROUTES)
    u = usage_from_body(Endpoint.RERANK, b'{"usage":{"prompt_tokens":-1,"total_tokens":3}}', {})
    assert u.input_tokens is None and u.output_tokens is None
    none = usage_from_body(Endpoint.POOLING, b'{"data": [], "request_id": "x"}', {})
    assert none.unknown_reason == "no_usage" and none.input_tokens is None
