"""Budgets against a client that wants to spend past its limits (issue 25, hostile review): each
test is an attack that once worked, against the real sidecar and a real upstream's behaviour."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from sidecar.billing.budget import to_micros
from sidecar.config import ConfigError, load
from sidecar.proxy.headers import BUDGET_HEADER
from tests.conftest import StartSidecar
from tests.fakes import MODEL
from tests.test_budget_limits import ANN, BOB, LIMIT, MSGS, ledger_micros, sidecar_config
from tests.waiting import wait_for


def renaming_upstream(arrived: list[int], release: asyncio.Event) -> web.Application:
    """An engine that serves one model whatever name a request gives, and names its own in the
    answer (5 prompt and 10 output tokens). It answers once `release` is set, counting in
    `arrived` the requests waiting: a burst's admitted requests are all in flight together."""

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        arrived[0] += 1
        await release.wait()
        return web.json_response(
            {
                "id": "x",
                "object": "chat.completion",
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "hi"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15},
            }
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def test_a_model_name_the_price_book_lacks_cannot_burst_past_a_limit(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    # Attack: ask for a name with no price ("alias"), which an engine serving one model answers
    # as its own, priced one. The hold was $0 (an unpriced model), the charge the full cost: 20
    # at once were all admitted against $0.20 and spent $0.30 (40: $0.60), far past the bound.
    arrived, release = [0], asyncio.Event()
    up = await aiohttp_server(renaming_upstream(arrived, release))
    run = await start_sidecar(
        sidecar_config(tmp_path, [{"scope": "user", "usd": LIMIT}]),
        upstream_url=str(up.make_url("")).rstrip("/"),
    )
    ledger = [run.sc.config.ledger.path or ""]
    body = {"model": "alias", "messages": MSGS, "max_tokens": 10}
    refused: list[int] = []

    async def one(s: aiohttp.ClientSession) -> int:
        headers = {"Authorization": f"Bearer {ANN}"}
        async with s.post(run.url + "/v1/chat/completions", json=body, headers=headers) as r:
            await r.read()
            if r.status != 200:
                refused.append(r.status)
            return r.status

    async with aiohttp.ClientSession() as s:
        burst = asyncio.gather(*(one(s) for _ in range(20)))
        await wait_for(lambda: arrived[0] + len(refused) == 20, "every request decided")
        release.set()  # only now does any admitted request finish and settle
        statuses = await burst
    admitted = statuses.count(200)
    assert admitted + statuses.count(429) == 20
    await wait_for(lambda: ledger_micros(ledger)[1] == admitted, "every admitted row")
    total, _ = ledger_micros(ledger)
    assert total == admitted * 15_000  # priced at the model the engine named
    assert total <= to_micros(LIMIT)  # an output limit, an exact price: within the limit
    assert admitted >= 10  # held at the book's dearest price: as many as a priced name gets


async def test_filling_the_model_label_cap_does_not_dodge_a_named_model_limit(
    start_sidecar: StartSidecar, tmp_path: Path
) -> None:
    # Attack: the model scope is the model's label, and the label cap gives the 101st distinct
    # name `__other__`. A model limit on a model priced by `pricing.default` (so not published
    # ahead) was dodged by first sending 100 other names: the limited model's requests then
    # carried no model limit at all.
    cfg = sidecar_config(tmp_path, [{"scope": "model", "name": MODEL, "usd": 0.05}])
    cfg["pricing"] = {"default": {"input_per_1m": 1000.0, "output_per_1m": 1000.0}}
    cfg["metering"] = {"max_tracked_models": 8}
    run = await start_sidecar(cfg)
    headers = {"Authorization": f"Bearer {ANN}"}

    async def one(s: aiohttp.ClientSession, model: str) -> int:
        body = {"model": model, "messages": MSGS, "max_tokens": 10}
        async with s.post(run.url + "/v1/chat/completions", json=body, headers=headers) as r:
            await r.read()
            return r.status

    async with aiohttp.ClientSession() as s:
        for i in range(8):  # each another name: the cap is full
            assert await one(s, f"junk-{i}") == 200
        statuses = [await one(s, MODEL) for _ in range(5)]
    # $0.017 held, $0.015 spent each: three fit in $0.05 ($0.045), a fourth would pass it
    assert statuses == [200, 200, 200, 429, 429]


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("org/m,v2", "a comma: its label reads org/m_v2"),
        ("m=1", "an '=': its label reads m_1"),
        ("o/" + "m" * 140, "past the label's 128 characters"),
    ],
)
def test_a_model_limit_the_model_label_could_never_match_is_refused_at_load(
    tmp_path: Path, name: str, why: str
) -> None:
    # Such a limit was loaded and never applied: the request's model scope is its label
    # (sanitised, at most 128 characters), never equal to the limit's name.
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump({"budgets": {"limits": [{"scope": "model", "name": name, "usd": 1}]}})
    )
    with pytest.raises(ConfigError) as err:
        load(str(path))
    assert str(err.value) == (
        f"config 'budgets.limits[0].name' has value '{name}': expected * or a model name of "
        "1-128 of A-Z a-z 0-9 . _ : / @ + - (its label)"
    ), why


def test_more_named_model_limits_than_the_model_label_cap_are_refused_at_load(
    tmp_path: Path,
) -> None:
    limits = [{"scope": "model", "name": f"m{i}", "usd": 1} for i in range(3)]
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump({"metering": {"max_tracked_models": 2}, "budgets": {"limits": limits}})
    )
    with pytest.raises(ConfigError) as err:
        load(str(path))
    assert str(err.value) == (
        "config 'budgets.limits' has value '3 named model limits': more than "
        "metering.max_tracked_models: those past it could never apply"
    )


def lying_upstream() -> web.Application:
    """An engine whose usage no meter can take (10^30 tokens): the budget charges each request
    at least its hold, and the ledger has no measured cost for it."""

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        huge = 10**30
        return web.json_response(
            {
                "id": "x",
                "object": "chat.completion",
                "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
                "usage": {"prompt_tokens": huge, "completion_tokens": huge, "total_tokens": 1},
            }
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def test_a_restart_restores_what_the_budgets_charged_not_only_the_measured_cost(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    # Attack: spend a budget on requests whose usage is not measured (charged their holds), and
    # wait for a restart: spend was restored from the ledger's measured cost only, so the user
    # got the whole limit back ($0.051 charged of $0.06, then $0.00 after the restart).
    up = await aiohttp_server(lying_upstream())
    url = str(up.make_url("")).rstrip("/")
    cfg = sidecar_config(tmp_path, [{"scope": "user", "usd": 0.06}])
    first = await start_sidecar(cfg, upstream_url=url)
    headers = {"Authorization": f"Bearer {ANN}"}
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 10}
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(first.url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200
                await r.read()
    path = first.sc.config.ledger.path or ""

    def costs() -> list[Any]:
        conn = sqlite3.connect(path)
        try:
            return [c for (c,) in conn.execute("SELECT cost_usd FROM requests")]
        finally:
            conn.close()

    await wait_for(lambda: len(costs()) == 3, "three rows")
    assert costs() == [None, None, None]  # no measured cost: the usage was invalid

    async def charged(url: str) -> float:
        async with (
            aiohttp.ClientSession() as s,
            s.get(url + "/v1/tollbooth/spend", headers=headers) as r,
        ):
            return float((await r.json())["limits"][0]["spent_usd"])

    assert await charged(first.url) == 0.051  # 3 x the $0.017 hold, settled as each ended
    again = await start_sidecar(cfg, upstream_url=url)  # a restart on the same ledger
    assert await charged(again.url) == 0.051
    async with (
        aiohttp.ClientSession() as s,
        s.post(again.url + "/v1/chat/completions", json=body, headers=headers) as r,
    ):
        assert r.status == 429  # $0.051 + $0.017 would pass $0.06


async def test_an_upstreams_budget_header_never_reaches_the_client(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    # Attack (a hostile engine): send x-tollbooth-budget-remaining-usd itself. Where no limit
    # applied to the request, the client received it as the sidecar's figure ($1000000 left).
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        answer = {
            "id": "x",
            "object": "chat.completion",
            "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15},
        }
        lie = {BUDGET_HEADER: "1000000.000000"}
        if not body.get("stream"):
            return web.json_response(answer, headers=lie)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **lie})
        await resp.prepare(request)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": []}, headers={BUDGET_HEADER: "1000000.000000"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    up = await aiohttp_server(app)
    run = await start_sidecar(
        sidecar_config(tmp_path, [{"scope": "project", "name": "zeus", "usd": 1.0}]),
        upstream_url=str(up.make_url("")).rstrip("/"),
    )
    headers = {"Authorization": f"Bearer {ANN}"}  # ann's project is atlas: no limit applies
    async with aiohttp.ClientSession() as s:
        for stream in (False, True):
            body = {"model": MODEL, "messages": MSGS, "max_tokens": 10, "stream": stream}
            async with s.post(run.url + "/v1/chat/completions", json=body, headers=headers) as r:
                await r.read()
                assert r.status == 200
                assert r.headers.getall(BUDGET_HEADER, []) == [], stream
        async with s.get(run.url + "/v1/models", headers=headers) as r:
            await r.read()
            assert r.headers.getall(BUDGET_HEADER, []) == []
        bob = {"Authorization": f"Bearer {BOB}"}  # bob's is zeus: the sidecar's figure, once
        body = {"model": MODEL, "messages": MSGS, "max_tokens": 10, "stream": True}
        async with s.post(run.url + "/v1/chat/completions", json=body, headers=bob) as r:
            await r.read()
            assert r.headers.getall(BUDGET_HEADER, []) == ["0.983000"]
