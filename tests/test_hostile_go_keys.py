"""A limit written under a key Go reads and Python does not (hostile review of issue 23; each
test failed on b269492).

Ollama's server decodes a request with Go's encoding/json (gin's `ShouldBindJSON`), which
matches an object key to a struct field ignoring case (Unicode simple folding: `Options`,
`OPTIONS`, `option\u017f` are all `options`), the last one read winning, and decodes a second
object into the map a first one made (the maps merge). So `{"options": {"num_predict": 1},
"OPTIONS": {"num_predict": 300}}` generates 300 tokens while the sidecar read a limit of 1,
and took the 300 counted as more than the request could ask (`within_request`: invalid usage,
charged the hold of one token). The same for `max_tokens` on Ollama's /v1/messages and /v1
routes. The upstream here is a fake Ollama that reads the body as Go does (the engine is the
one part tests may fake).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.exchange import Endpoint
from sidecar.metering import reqsize
from sidecar.metering.wire import inspect_request
from tests.conftest import Running, StartSidecar
from tests.simulated import ledger_rows, prices, token_cost
from tests.waiting import wait_for

MODEL = "llama-go"
BODY = {"model": MODEL, "stream": False, "messages": [{"role": "user", "content": "hi"}]}
TWINS = {
    "options": {"num_predict": 1},
    "OPTIONS": {"num_predict": 300},
}


def go_decode(obj: dict[str, Any], field: str) -> dict[str, Any]:
    """Go's encoding/json into `Options map[string]any \\`json:"options"\\``: every key equal to
    `field` but for case, in order, merged into one map."""
    merged: dict[str, Any] = {}
    for key, value in obj.items():
        if key.casefold() == field and isinstance(value, dict):
            merged.update(value)
    return merged


async def go_ollama(request: web.Request) -> web.Response:
    """/api/chat as Ollama answers a `stream: false` request: `num_predict` tokens generated."""
    obj = json.loads(await request.read())
    out = int(go_decode(obj, "options").get("num_predict", 1))
    done = {"model": MODEL, "message": {"role": "assistant", "content": "x" * out}}
    done |= {"done": True, "done_reason": "length", "prompt_eval_count": 7, "eval_count": out}
    return web.json_response(done)


async def _start(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, **config: Any
) -> tuple[Running, Path]:
    app = web.Application()
    app.router.add_post("/api/chat", go_ollama)
    up = await aiohttp_server(app)
    db = tmp_path / "ledger.db"
    run = await start_sidecar(
        {"pricing": prices(MODEL), "ledger": {"path": str(db), "flush_interval_s": 0.05}, **config},
        upstream_url=str(up.make_url("")).rstrip("/"),
    )
    return run, db


COLUMNS = "user, model, input_tokens, output_tokens, cost_usd, status"


async def _post(run: Any, body: dict[str, Any]) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/api/chat", json=body, headers={"X-Tollbooth-User": "eve"}) as r,
    ):
        return r.status, await r.json()


async def test_an_options_twin_is_billed_what_the_server_generated(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """Before: the 300 tokens were invalid usage (cost unknown); now they are billed."""
    run, db = await _start(start_sidecar, aiohttp_server, tmp_path)
    status, answer = await _post(run, {**BODY, **TWINS})
    assert status == 200 and answer["eval_count"] == 300
    await wait_for(lambda: len(ledger_rows(db, COLUMNS)) == 1, "the ledger row")
    assert ledger_rows(db, COLUMNS) == [
        ("eve", MODEL, 7, 300, pytest.approx(token_cost(7, 300)), "200")
    ]


async def test_under_a_budget_an_options_twin_is_refused(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """Before: 200, the budget charged the hold of 1 output token for 300 generated."""
    run, db = await _start(start_sidecar, aiohttp_server, tmp_path, budgets={"user_daily_usd": 5.0})
    status, answer = await _post(run, {**BODY, **TWINS})
    assert (
        status == 400 and "'OPTIONS' must be a non-negative integer" in answer["error"]["message"]
    )
    status, answer = await _post(run, {**BODY, "options": {"num_predict": 300}})
    assert status == 200 and answer["eval_count"] == 300  # one key, as the API names it: served
    await wait_for(lambda: len(ledger_rows(db, COLUMNS)) == 2, "two ledger rows")
    spent = run.sc.budgets.store.spent["user:eve"] / 1e6
    assert spent == pytest.approx(token_cost(7, 300))


@pytest.mark.parametrize(
    ("endpoint", "twin"),
    [
        (Endpoint.MESSAGES, "MAX_TOKENS"),
        (Endpoint.MESSAGES, "max_token\u017f"),  # Go folds the long s to s
        (Endpoint.CHAT, "Max_Tokens"),
        (Endpoint.CHAT, "MAX_COMPLETION_TOKENS"),
        (Endpoint.COMPLETIONS, "MAX_TOKENS"),
    ],
)
def test_a_limit_twin_on_the_other_routes_leaves_no_cap(endpoint: Endpoint, twin: str) -> None:
    """A Go server may obey the twin: the hold's limit is unreadable and the output uncapped."""
    body = {"model": MODEL, "max_tokens": 1, "messages": [], "prompt": "x", twin: 4000}
    info = inspect_request(endpoint, json.dumps(body).encode(), inject_usage=False)
    assert info.output_cap is None and twin in info.unreadable


SHOWN = 20  # lines a leaving client reads


async def go_ollama_stream(request: web.Request) -> web.StreamResponse:
    """/api/chat streamed as Ollama streams it, the model Go reads named on every line. Past
    `SHOWN` lines it sends nothing more until the connection closes: a client that leaves after
    reading them always leaves before the final counts."""
    obj = json.loads(await request.read())
    model = next(v for k, v in reversed(obj.items()) if k.casefold() == "model")
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    for i in range(int(go_decode(obj, "options").get("num_predict", 1))):
        if i == SHOWN:
            await asyncio.get_running_loop().create_future()  # never done: cancelled on close
        line = {"model": model, "message": {"role": "assistant", "content": "x"}, "done": False}
        await resp.write(json.dumps(line).encode() + b"\n")
    done = {"model": model, "message": {"role": "assistant", "content": ""}, "done": True}
    await resp.write(json.dumps(done | {"prompt_eval_count": 7, "eval_count": 0}).encode() + b"\n")
    return resp


async def test_a_model_twin_is_refused_as_ambiguous(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """`model` names an unpriced model (held $0), `MODEL` the served one (which Go reads). Before:
    a client leaving mid-stream, before the final counts, was charged that $0 hold for every
    token it read. Now the body is refused before the upstream."""
    app = web.Application()
    app.router.add_post("/api/chat", go_ollama_stream)
    up = await aiohttp_server(app)
    db = tmp_path / "ledger.db"
    run = await start_sidecar(
        {
            "pricing": prices(MODEL),
            "ledger": {"path": str(db), "flush_interval_s": 0.05},
            "budgets": {"user_daily_usd": 5.0},
        },
        upstream_url=str(up.make_url("")).rstrip("/"),
    )
    body = {**BODY, "model": "unpriced", "MODEL": MODEL, "stream": True}
    body["options"] = {"num_predict": 500}
    seen = 0
    async with aiohttp.ClientSession() as s:
        r = await s.post(run.url + "/api/chat", json=body, headers={"X-Tollbooth-User": "eve"})
        if r.status == 200:
            async for _ in r.content:
                seen += 1
                if seen == SHOWN:
                    break
        status, text = r.status, (await r.text() if r.status != 200 else "")
        r.close()
    assert (status, seen) == (400, 0) and "'MODEL'" in text
    await wait_for(lambda: len(ledger_rows(db, COLUMNS)) == 1, "the ledger row")
    assert ledger_rows(db, COLUMNS)[0][-1] == "400"


@settings(max_examples=300, deadline=None)
@given(
    keys=st.lists(st.text(max_size=12), max_size=8),
    fields=st.lists(
        st.sampled_from(["model", "max_tokens", "options", "Max_Tokens", "\u017f"]),
        min_size=1,
        max_size=3,
        unique=True,
    ),
)
def test_case_twins_is_every_key_that_folds_to_a_field_without_being_one(
    keys: list[str], fields: list[str]
) -> None:
    values = dict.fromkeys(keys, 1)
    folded = {f.casefold() for f in fields}
    expected = tuple(k for k in values if k not in fields and k.casefold() in folded)
    assert reqsize.case_twins(values, tuple(fields)) == expected
    # again, with what the first call learnt of its own folds (the fast path's answer)
    assert reqsize.case_twins(values, tuple(fields)) == expected


def test_case_twins_learns_only_strings_that_are_their_own_fold_and_only_so_many() -> None:
    for key in ("max_tokens", "MAX_TOKENS", "max_token\u017f", "\u017f", "K", "_"):
        reqsize.case_twins({key: 1}, ("max_tokens",))
        reqsize.case_twins({"model": 1}, (key,))
    assert all(k.casefold() == k for k in reqsize._OWN_FOLDS)
    assert {"max_tokens", "model", "_"} <= reqsize._OWN_FOLDS
    assert reqsize.case_twins({"MAX_TOKENS": 1, "max_tokens": 2}, ("max_tokens",)) == (
        "MAX_TOKENS",
    )
    for i in range(2 * reqsize._OWN_FOLDS_KEPT):
        reqsize.case_twins({f"k{i}": 1, "x" * 65 + str(i): 2}, ("model",))
    assert len(reqsize._OWN_FOLDS) <= reqsize._OWN_FOLDS_KEPT
    assert max(map(len, reqsize._OWN_FOLDS)) <= reqsize._OWN_FOLD_CHARS
