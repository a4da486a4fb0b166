"""The admission queue's invariants, with property-based tests, and through the proxy."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.billing.admission import Admission
from sidecar.config import AdmissionConfig
from sidecar.exchange import Refusal, estimate_tokens
from sidecar.telemetry.metrics import Metrics
from tests.conftest import StartSidecar
from tests.fakes import MODEL
from tests.waiting import wait_for


def make(strategy: str = "token-budget", **kw: Any) -> Admission:
    return Admission(AdmissionConfig(strategy=strategy, **kw), Metrics())  # type: ignore[arg-type]


class Probe:
    """Wraps an Admission and checks invariants after every admission."""

    def __init__(self, adm: Admission) -> None:
        self.adm = adm
        self.order: list[int] = []  # admission order, recorded by the queue itself
        self.max_in_use = 0
        admit = adm._admit

        def recording_admit(w: Any) -> None:
            admit(w)
            self.order.append(int(w.model))
            self.max_in_use = max(self.max_in_use, adm.in_use)

        adm._admit = recording_admit  # type: ignore[method-assign]

    async def run(self, i: int, tokens: int, hold: float, leave_after: float | None) -> str:
        task = asyncio.ensure_future(self.adm.acquire(tokens, str(i)))
        try:
            if leave_after is not None:
                done, _ = await asyncio.wait({task}, timeout=leave_after)
                if not done:
                    task.cancel()
                    (res,) = await asyncio.gather(task, return_exceptions=True)
                    if callable(res):  # admitted in the same instant: it must still be released
                        res()
                    return "left"
            release = await task
        except Refusal as r:
            return r.err_type
        await asyncio.sleep(hold)
        release()
        release()  # idempotent
        return "done"


REQUESTS = st.lists(
    st.tuples(st.integers(1, 120), st.floats(0, 0.004), st.one_of(st.none(), st.floats(0, 0.003))),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(REQUESTS, st.booleans())
def test_token_budget_invariants(
    reqs: list[tuple[int, float, float | None]], overtake: bool
) -> None:
    async def scenario() -> None:
        adm = make(token_budget=100, allow_overtake=overtake, max_queue_wait_s=5)
        probe = Probe(adm)
        results = await asyncio.gather(
            *(probe.run(i, t, h, leave) for i, (t, h, leave) in enumerate(reqs))
        )
        # budget never exceeded
        assert probe.max_in_use <= 100
        # a request larger than the whole budget is refused at once, never queued
        for (tokens, _, _), res in zip(reqs, results, strict=True):
            if tokens > 100:
                assert res == "request_too_large_for_budget"
        # every future resolved, nothing held
        assert adm.in_use == 0 and adm.running == 0 and not adm.queue
        # strict FIFO: admissions happen in arrival order among those that stayed
        if not overtake:
            assert probe.order == sorted(probe.order)
        assert len(set(probe.order)) == len(probe.order)

    asyncio.run(scenario())


async def test_head_is_never_overtaken_no_starvation() -> None:
    adm = make(token_budget=100)
    small = await adm.acquire(60, "m")
    big = asyncio.ensure_future(adm.acquire(90, "m"))  # waits at the head
    await asyncio.sleep(0)
    later = asyncio.ensure_future(adm.acquire(20, "m"))  # would fit, but must not pass the head
    await asyncio.sleep(0.01)
    assert not big.done() and not later.done()
    small()
    release_big = await big
    assert not later.done()
    release_big()
    (await later)()
    assert adm.in_use == 0


async def test_client_leaving_while_queued_is_removed() -> None:
    adm = make(strategy="serial")
    first = await adm.acquire(5, "m")
    waiting = asyncio.ensure_future(adm.acquire(5, "m"))
    await asyncio.sleep(0)
    assert len(adm.queue) == 1
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert len(adm.queue) == 0
    first()
    assert adm.in_use == 0 and adm.metrics.queue_depth._value.get() == 0


async def test_queue_full_and_timeout_are_429() -> None:
    adm = make(strategy="serial", max_queue_length=1, max_queue_wait_s=0.05)
    hold = await adm.acquire(1, "m")
    queued = asyncio.ensure_future(adm.acquire(1, "m"))
    await asyncio.sleep(0)
    with pytest.raises(Refusal) as full:
        await adm.acquire(1, "m")
    assert (full.value.status, full.value.err_type) == (429, "queue_full")
    with pytest.raises(Refusal) as late:
        await queued
    assert (late.value.status, late.value.err_type) == (429, "queue_timeout")
    assert late.value.retry_after == 0.05
    hold()
    assert adm.in_use == 0 and not adm.queue


async def test_fixed_batch_releases_groups() -> None:
    adm = make(strategy="fixed-batch", max_batch=3, batch_window_s=0.02)
    tasks = [asyncio.ensure_future(adm.acquire(1, "m")) for _ in range(5)]
    await wait_for(lambda: sum(t.done() for t in tasks) == 3, "a full group to go at once")
    releases = [t.result() for t in tasks if t.done()]
    releases[0]()
    releases[1]()
    await asyncio.sleep(0.05)  # past the window: a slower machine only waits longer
    assert sum(t.done() for t in tasks) == 3  # the next group waits for the whole group
    releases[2]()
    # window elapsed, group completed: the last two go
    await wait_for(lambda: all(t.done() for t in tasks), "the last two to go")
    for t in tasks[3:]:
        t.result()()
    assert adm.in_use == 0


async def test_close_resolves_every_future() -> None:
    adm = make(strategy="serial")
    hold = await adm.acquire(1, "m")
    waiting = [asyncio.ensure_future(adm.acquire(1, "m")) for _ in range(3)]
    await asyncio.sleep(0)
    adm.close()
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    hold()


def test_estimate_is_prompt_plus_max_new_tokens() -> None:
    config = make(chars_per_token=4.0, default_max_tokens=50).config
    assert estimate_tokens(config, 40, 10, None) == 20
    assert estimate_tokens(config, 41, None, None) == 61
    assert estimate_tokens(config, 0, 10, 3) == 30


async def test_through_the_proxy(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar(
        {"admission": {"strategy": "token-budget", "token_budget": 40, "chars_per_token": 1.0}}
    )
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "abcdefghij"}],
        "max_tokens": 20,
    }  # 10 chars + 20 = 30 estimated tokens: one at a time
    async with aiohttp.ClientSession() as s:

        async def one() -> int:
            async with s.post(
                run.url + "/v1/chat/completions", json=body, headers={"X-Fake": "sleep:0.05"}
            ) as r:
                await r.read()
                return r.status

        assert await asyncio.gather(one(), one(), one()) == [200, 200, 200]
        big = {**body, "max_tokens": 100}
        async with s.post(run.url + "/v1/chat/completions", json=big) as r:
            assert r.status == 413
            assert (await r.json())["error"]["type"] == "request_too_large_for_budget"
    wait_sum = run.value("llm_queue_wait_seconds_sum", model=MODEL)
    assert run.value("llm_queue_wait_seconds_count", model=MODEL) == 3
    assert wait_sum is not None and wait_sum >= 0.05  # the others waited behind the first
    assert run.value("llm_budget_tokens_limit") == 40
    assert run.value("llm_budget_tokens_in_use") == 0
    assert run.value("llm_admission_rejections_total", reason="never_fits") == 1


async def test_exact_prompt_size_from_upstream_tokenize(
    start_sidecar: StartSidecar, aiohttp_server: Any
) -> None:
    from tollbooth_lab.simulator import EngineParams, create_simulator

    sim = await aiohttp_server(create_simulator("vllm", EngineParams(step_base_s=0.0005)))
    base = str(sim.make_url("")).rstrip("/")
    run = await start_sidecar(
        {
            "admission": {
                "strategy": "token-budget",
                "token_budget": 1000,
                "tokenize": True,
                "chars_per_token": 1000.0,
            }
        },
        upstream_url=base,
    )
    messages = [{"role": "user", "content": "count these eight words for me please now"}]
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/tokenize", json={"messages": messages}) as r:
            exact = (await r.json())["count"]
        async with s.post(
            run.url + "/v1/chat/completions",
            json={"model": "m", "messages": messages, "max_tokens": 5},
        ) as r:
            assert r.status == 200
    (admit,) = [d for d in run.sc.admission.decisions if d.event == "admit"]
    assert exact > 8 and admit.tokens == exact + 5  # the estimate would have been 0 + 5


@pytest.mark.parametrize(
    "answer",
    [
        None,  # 500
        b'{"count": "4"}',
        # nested past json's depth: RecursionError, which escaped the count in the request's
        # path (the request answered 500)
        b"[" * 100_000 + b"]" * 100_000,
    ],
)
async def test_tokenize_failure_falls_back_to_the_estimate(
    start_sidecar: StartSidecar, answer: bytes | None
) -> None:
    run = await start_sidecar(
        {"admission": {"strategy": "token-budget", "tokenize": True, "chars_per_token": 1.0}}
    )
    run.upstream.tokenize_fails = answer is None
    run.upstream.tokenize_body = answer
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            run.url + "/v1/completions", json={"model": MODEL, "prompt": "abcd", "max_tokens": 3}
        ) as r,
    ):
        assert r.status == 200
    (admit,) = [d for d in run.sc.admission.decisions if d.event == "admit"]
    assert admit.tokens == 4 + 3
    assert run.value("tollbooth_upstream_errors_total", reason="tokenize") == 1


@pytest.mark.parametrize(
    ("path", "body", "output"),
    [
        ("/v1/embeddings", {"input": "a" * 40}, 0),
        ("/rerank", {"query": "a" * 20, "documents": ["a" * 20]}, 0),
        ("/api/embed", {"input": "a" * 40}, 0),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 40}]}, 256),
    ],
)
async def test_a_route_that_generates_nothing_is_estimated_without_output(
    path: str, body: dict[str, Any], output: int
) -> None:
    """The admission estimate (and the GPU split, which shares it) holds the output the budget's
    hold does: none where nothing is generated. Before, an embedding was estimated at its prompt
    plus `default_max_tokens` (256), as a chat request that sets no limit still is."""
    from sidecar.exchange import Endpoint, Exchange
    from sidecar.metering.wire import inspect_request

    info = inspect_request(
        Endpoint(path), json.dumps({"model": "m", **body}).encode(), inject_usage=False
    )
    ex = Exchange(
        request_id="r", endpoint=info.endpoint, info=info, user="u", user_id="u", model="m"
    )
    adm = make(token_budget=10_000)
    release = await adm.gate(ex)
    assert adm.in_use == math.ceil(info.prompt_chars / 4.0) + output
    release()
