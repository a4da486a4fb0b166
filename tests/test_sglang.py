"""SGLang's native /generate metered (issue 23), over raw HTTP, told apart from TGI's by the body.

The shapes are sglang's srt/entrypoints/http_server.py (`generate_request`: one JSON body, or SSE
`data:` chunks then `data: [DONE]`), srt/managers/io_struct.py (`GenerateReqInput`: `text` or
`input_ids`, `sampling_params`, `stream`) and srt/managers/tokenizer_manager.py (`meta_info`:
`prompt_tokens`, `completion_tokens`, `cached_tokens`, `finish_reason`, cumulative per chunk).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from sidecar.exchange import Endpoint, Usage
from sidecar.metering.wire import inspect_request, open_stream, usage_from_body, within_request
from tests import simulated as sim
from tests.conftest import Running, StartSidecar
from tests.waiting import wait_for

SIM_MODEL = "sim-llama-3-8b"
PRICES = sim.prices(SIM_MODEL)
GEN = Endpoint.TGI_GENERATE  # the path SGLang shares with TGI

# A /generate response in the shape tokenizer_manager.py builds `meta_info` (values made up).
BODY = {
    "text": " Paris.",
    "output_ids": [1, 2, 3],
    "meta_info": {
        "id": "a1",
        "finish_reason": {"type": "length", "length": 3},
        "prompt_tokens": 9,
        "completion_tokens": 3,
        "cached_tokens": 4,
        "e2e_latency": 0.2,
    },
}


def info(body: dict[str, Any], api: str = "vllm") -> Any:
    return inspect_request(GEN, json.dumps(body).encode(), inject_usage=True, api=api)


@pytest.mark.parametrize(
    ("body", "limit", "choices"),
    [
        ({"text": "a"}, None, 1),  # the server's default max_new_tokens (below)
        ({"text": "a", "sampling_params": {"max_new_tokens": 9}}, 9, 1),
        ({"text": "a", "sampling_params": {"max_new_tokens": None}}, None, 1),
        ({"text": ["a", "b"], "sampling_params": {"max_new_tokens": 4}}, 4, 2),
        ({"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 4, "n": 2}}, 4, 4),
        ({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}, 4, 1),
        # embeddings: one prompt's are [token][hidden], a batch's [prompt][token][hidden]
        ({"input_embeds": [[0.5, 0.25]] * 3, "sampling_params": {"max_new_tokens": 4}}, 4, 1),
        ({"input_embeds": [[[0.5, 0.25]] * 3] * 2, "sampling_params": {"max_new_tokens": 4}}, 4, 2),
    ],
)
def test_an_sglang_body_is_read_as_sglang_reads_it(
    body: dict[str, Any], limit: int | None, choices: int
) -> None:
    got = info(body)
    assert (got.api, got.max_tokens, got.output_cap, got.choices) == (
        "sglang",
        limit,
        limit,
        choices,
    )
    assert got.limit_beside_default == (None if "sampling_params" in body else 0)
    assert got.body == json.dumps(body).encode()  # never changed


@pytest.mark.parametrize(
    ("params", "cap", "beside"),
    [
        (None, None, 0),
        ({"temperature": 0.5}, None, 0),
        ({"max_new_tokens": 9}, 9, None),
        ([{"max_new_tokens": 9}, {"temperature": 0.5}], None, 9),  # one prompt of the batch: none
        ([{"max_new_tokens": 9}, {"max_new_tokens": 4}], 9, None),
        ([{"max_new_tokens": None}, {"temperature": 0.5}], None, None),  # one without any limit
    ],
)
def test_an_absent_max_new_tokens_is_the_servers_default_and_caps_no_count(
    params: Any, cap: int | None, beside: int | None
) -> None:
    """An absent max_new_tokens is the server's default: 128 unless SGLang was started with
    --preferred-sampling-params (tokenizer_manager.py `_create_tokenized_object`:
    `{**self.preferred_sampling_params, **obj.sampling_params}`). Before, 128 was the cap on
    counted output too: 600 tokens measured on such a server were invalid usage, and the budget
    charged the 128-token hold, $0.266 for $1.209 (h-rev6). It caps nothing; the hold reads the
    server's default (`test_a_client_leaving_a_body_without_a_limit_is_charged_the_servers_
    default`) beside the largest limit the batch's other prompts set."""
    body: dict[str, Any] = {"text": ["a", "b"] if isinstance(params, list) else "a"}
    if params is not None:
        body["sampling_params"] = params
    read = info(body, api="sglang")
    assert (read.output_cap, read.limit_beside_default) == (cap, beside)
    usage = within_request(Usage(input_tokens=9, output_tokens=600 * read.choices), read)
    assert usage.output_tokens == (None if cap else 600 * read.choices)


def test_the_body_tells_sglang_from_tgi_unless_upstream_api_says() -> None:
    tgi = {"inputs": "a", "parameters": {"max_new_tokens": 5}}
    assert info(tgi).api is None and info(tgi).max_tokens == 5  # read as TGI's, as before
    assert info(tgi, api="tgi").api is None
    assert info({"text": "a"}, api="tgi").api is None  # a TGI server: read as TGI's
    assert info(tgi, api="sglang").api == "sglang"  # an SGLang server: read as SGLang's
    both = info({"inputs": "a", "text": "a", "sampling_params": {}})
    assert both.endpoint is Endpoint.OTHER and both.ambiguous and "both" in both.ambiguous
    assert info({"inputs": "a", "text": "a"}, api="sglang").ambiguous is None


def test_a_body_and_a_batch_are_read() -> None:
    u = usage_from_body(GEN, json.dumps(BODY).encode(), {}, api="sglang")
    assert (u.input_tokens, u.output_tokens, u.cached_input_tokens) == (9, 3, 4)
    assert u.finish_reasons == ("length",) and u.unknown_reason is None
    two = usage_from_body(GEN, json.dumps([BODY, BODY]).encode(), {}, api="sglang")
    assert (two.input_tokens, two.output_tokens, two.cached_input_tokens) == (18, 6, 8)
    bad = {**BODY, "meta_info": {**BODY["meta_info"], "completion_tokens": 1.5}}
    assert usage_from_body(GEN, json.dumps(bad).encode(), {}, api="sglang").unknown_reason == (
        "invalid_usage"
    )
    err = usage_from_body(GEN, b'{"error": {"message": "bad"}}', {}, api="sglang")
    assert err.unknown_reason == "error_response"


def _chunk(n: int, last: bool = False) -> bytes:
    meta = {**BODY["meta_info"], "completion_tokens": n, "finish_reason": None}
    if last:
        meta["finish_reason"] = {"type": "length", "length": n}
    return (
        b"data: " + json.dumps({"text": "x" * n, "meta_info": meta, "index": 0}).encode() + b"\n\n"
    )


WIRE = _chunk(1) + _chunk(2) + _chunk(3, last=True) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("cut", [1, 5, 80, len(WIRE)])
def test_a_stream_is_read_at_every_cut_and_passes_unchanged(cut: int) -> None:
    meter = open_stream(GEN, api="sglang")
    out = b"".join(meter.feed(WIRE[i : i + cut]) for i in range(0, len(WIRE), cut))
    tail, u = meter.finish()
    assert out + tail == WIRE and meter.done and meter.token_events == 3
    assert (u.input_tokens, u.output_tokens, u.cached_input_tokens) == (9, 3, 4)
    cut_short = open_stream(GEN, api="sglang")
    cut_short.feed(_chunk(1) + _chunk(2))
    assert cut_short.usage_so_far().output_tokens == 2 and not cut_short.done


def _read_with_limit(data: bytes) -> set[tuple[Any, ...]]:
    """(input, output, cached, reason) of `data` cut in two at every byte; each read unchanged."""
    results = set()
    for cut in range(len(data) + 1):
        meter = open_stream(GEN, api="sglang", max_event_bytes=1024)
        out = meter.feed(data[:cut]) + meter.feed(data[cut:])
        tail, u = meter.finish()
        assert out + tail == data
        results.add((u.input_tokens, u.output_tokens, u.cached_input_tokens, u.unknown_reason))
    return results


def test_counts_after_an_event_over_the_limit_are_the_usage() -> None:
    """Each chunk's `meta_info` is its prompt's counts so far: the last chunk read after a long
    one supersedes it; one read before it does not."""
    long = _chunk(2).replace(b'"xx"', b'"' + b"x" * 2000 + b'"')  # over the limit
    done = b"data: [DONE]\n\n"
    assert _read_with_limit(_chunk(1) + long + _chunk(3, last=True) + done) == {(9, 3, 4, None)}
    assert _read_with_limit(_chunk(1) + _chunk(3, last=True) + long + done) == {
        (None, None, None, "event_too_large")
    }


# --- through the sidecar, in front of the simulator speaking SGLang -------------------------------


async def _start(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, **config: Any
) -> tuple[Running, Path]:
    return await sim.start_simulated(start_sidecar, aiohttp_server, tmp_path, PRICES, **config)


def _rows(db: Path) -> list[tuple[Any, ...]]:
    return sim.ledger_rows(db, COLUMNS)


COLUMNS = "user, model, input_tokens, output_tokens, cached_input_tokens, status"


PROMPT = "one two three four five six"


@pytest.mark.parametrize("api", ["vllm", "sglang"])
@pytest.mark.parametrize("stream", [False, True])
async def test_exact_tokens_per_user_with_the_cached_prefix(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, stream: bool, api: str
) -> None:
    run, db = await _start(
        start_sidecar, aiohttp_server, tmp_path, upstream={"api": api, "model_name": SIM_MODEL}
    )
    finals = []
    async with aiohttp.ClientSession() as s:
        for user, text in (("ann", PROMPT), ("bob", PROMPT + " seven")):
            body = {"text": text, "sampling_params": {"max_new_tokens": 5}, "stream": stream}
            async with s.post(
                run.url + "/generate", json=body, headers={"X-Tollbooth-User": user}
            ) as r:
                assert r.status == 200
                raw = await r.read()
            if stream:
                events = [x[6:] for x in raw.split(b"\n\n") if x.startswith(b"data: ")]
                assert events[-1] == b"[DONE]"
                finals.append(json.loads(events[-2])["meta_info"])
            else:
                finals.append(json.loads(raw)["meta_info"])
    reported = [(m["prompt_tokens"], m["completion_tokens"], m["cached_tokens"]) for m in finals]
    assert reported[0][0] == 6 and reported[1][0::2] == (7, 6)
    await wait_for(lambda: len(_rows(db)) == 2, "two ledger rows")
    assert _rows(db) == [
        ("ann", SIM_MODEL, *reported[0], "200"),
        ("bob", SIM_MODEL, *reported[1], "200"),
    ]
    labels = {"model": SIM_MODEL, "api_endpoint": "/generate", "user_id": "bob"}
    assert run.value("llm_tokens_total", token_type="input", **labels) == 7
    assert run.value("llm_tokens_total", token_type="output", **labels) == reported[1][1]
    assert run.value("llm_cached_input_tokens_total", **labels) == 6


async def test_an_ambiguous_body_is_refused(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    run, _ = await _start(start_sidecar, aiohttp_server, tmp_path)
    body = {"inputs": "a", "text": "a", "sampling_params": {"max_new_tokens": 2}}
    async with aiohttp.ClientSession() as s, s.post(run.url + "/generate", json=body) as r:
        assert r.status == 400
        assert "ambiguous" in await r.text()


async def test_a_client_leaving_mid_stream_is_billed_what_was_measured(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    run, db = await _start(start_sidecar, aiohttp_server, tmp_path)
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 400}, "stream": True}

    def progress(line: bytes) -> int | None:
        event = sim.sse_data(line)
        return event["meta_info"]["completion_tokens"] if event is not None else None

    seen = await sim.leave_mid_stream(run, "/generate", body, "cy", progress)
    await wait_for(lambda: len(_rows(db)) == 1, "the ledger row")
    ((user, _, inp, out, _, status),) = _rows(db)
    assert (user, inp, status) == ("cy", 6, "499")
    assert seen <= out < 400


async def test_a_burst_against_a_small_budget_is_held(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    limit = 0.05
    run, db = await _start(
        start_sidecar,
        aiohttp_server,
        tmp_path,
        budgets={"user_daily_usd": limit},
        upstream={"model_name": SIM_MODEL},  # the hold's price: the request names no model
    )
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 5}, "stream": True}
    async with aiohttp.ClientSession() as s:
        statuses = await sim.burst(lambda: sim.post_status(s, run.url + "/generate", body, "dee"))
    await sim.assert_burst_held(
        run, db, COLUMNS, "dee", limit, statuses, lambda r: sim.token_cost(r[2], r[3])
    )


async def test_a_body_without_a_limit_is_served_with_budgets_on(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """The simulator answers /model_info as an SGLang without --preferred-sampling-params: the
    hold reads its 128 (else such a request would be refused, its default unknown) and the
    measured counts are charged."""
    run, _ = await _start(
        start_sidecar,
        aiohttp_server,
        tmp_path,
        budgets={"user_daily_usd": 5.0},
        upstream={"api": "sglang", "model_name": SIM_MODEL},
    )
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            run.url + "/generate", json={"text": PROMPT}, headers={"X-Tollbooth-User": "eve"}
        ) as r,
    ):
        assert r.status == 200
        out = (await r.json())["meta_info"]["completion_tokens"]
    assert 0 < out <= 128
    await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")
    assert run.sc.budgets.store.spent["user:eve"] / 1e6 == pytest.approx(sim.token_cost(6, out))


# --- PUT, which SGLang serves as POST ------------------------------------------------------------


async def sglang_generate_any_method(request: web.Request) -> web.Response:
    """SGLang's /generate, on POST or PUT alike (http_server.py `@app.api_route("/generate",
    methods=["POST", "PUT"])`, one `generate_request`): 9 prompt tokens, `max_new_tokens` out."""
    obj = json.loads(await request.read())
    out = obj["sampling_params"]["max_new_tokens"]
    meta = {"id": "r", "finish_reason": {"type": "length", "length": out}, "cached_tokens": 0}
    meta |= {"prompt_tokens": 9, "completion_tokens": out}
    return web.json_response({"text": " tok" * out, "output_ids": [7] * out, "meta_info": meta})


@pytest.mark.parametrize("method", ["PUT", "PATCH"])
async def test_a_generate_sent_as_put_is_metered_as_a_post_is(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, method: str
) -> None:
    """SGLang serves /generate (and /encode) on PUT too. Before, only a POST was metered and any
    other method forwarded untouched: a PUT /generate was served with no hold, no budget and no
    ledger row, every token free (h-rev6). A PUT or PATCH is now read as a POST is: held,
    refused past the budget, metered; an unknown path on it follows `metering.unknown_routes`."""
    app = web.Application()
    app.router.add_route("*", "/generate", sglang_generate_any_method)
    app.router.add_route("*", "/elsewhere", sglang_generate_any_method)
    up = await aiohttp_server(app)
    db = tmp_path / "ledger.db"
    run = await start_sidecar(
        {
            "ledger": {"path": str(db), "flush_interval_s": 0.05},
            "pricing": PRICES,
            "upstream": {"api": "sglang", "model_name": SIM_MODEL},
            "budgets": {"user_daily_usd": 0.1},
        },
        upstream_url=str(up.make_url("")).rstrip("/"),
    )
    body = {"text": "one two three four", "sampling_params": {"max_new_tokens": 20}}
    headers = {"X-Tollbooth-User": "put"}
    async with aiohttp.ClientSession() as s:
        async with s.request(method, run.url + "/generate", json=body, headers=headers) as r:
            assert r.status == 200
        too_many = {**body, "sampling_params": {"max_new_tokens": 500}}  # its hold: over $0.1
        async with s.request(method, run.url + "/generate", json=too_many, headers=headers) as r:
            assert r.status == 429
        async with s.request(method, run.url + "/elsewhere", json=body, headers=headers) as r:
            assert r.status == 403  # metering.unknown_routes: refuse
    columns = "endpoint, input_tokens, output_tokens, cost_usd, status"
    await wait_for(lambda: len(sim.ledger_rows(db, columns)) == 3, "the ledger rows")
    cost = pytest.approx(sim.token_cost(9, 20))
    assert sim.ledger_rows(db, columns) == [
        ("/generate", 9, 20, cost, "200"),
        ("/generate", None, None, 0.0, "429"),  # refused: nothing served
        ("other", None, None, 0.0, "403"),
    ]
    assert run.sc.budgets.store.spent["user:put"] / 1e6 == cost


# --- a stream whose chunks outgrow the event limit ------------------------------------------------

GROWN = 1000  # tokens the fake generates for a request with no limit


async def sglang_stream_no_limit(request: web.Request) -> web.StreamResponse:
    """A streamed /generate with `return_logprob`, as SGLang streams it without
    --incremental-streaming-output: every chunk carries the whole text, output ids and output
    logprobs so far (tokenizer_manager.py slices `output_token_logprobs` and the other
    `_INCREMENTAL_STREAMING_META_INFO_KEYS` only with incremental streaming), so each chunk is
    longer than the last; then `data: [DONE]`. With `max_new_tokens: null` the scheduler runs to
    the context's end (scheduler.py `init_req_max_new_tokens`): GROWN tokens here."""
    obj = json.loads(await request.read())
    assert obj["sampling_params"]["max_new_tokens"] is None
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for n in range(1, GROWN + 1):
        meta = {
            "id": "r1",
            "finish_reason": {"type": "length", "length": n} if n == GROWN else None,
            "prompt_tokens": 9,
            "completion_tokens": n,
            "cached_tokens": 0,
            "output_token_logprobs": [[-0.25, 7, None]] * n,
        }
        chunk = {"text": " tok" * n, "output_ids": [7] * n, "meta_info": meta, "index": 0}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


@pytest.mark.parametrize("fast", [True, False])
def test_an_event_over_the_limit_counts_as_an_event_of_output(fast: bool) -> None:
    """On both paths, at every cut: an event too long to read is one more output event."""
    long = b"data: " + json.dumps({"text": "t" * 2000, "index": 0}).encode() + b"\n\n"
    data = _chunk(1) + long + _chunk(2) + long
    for cut in range(len(data) + 1):
        meter = open_stream(GEN, max_event_bytes=1024, fast=fast, api="sglang")
        meter.feed(data[:cut])
        meter.feed(data[cut:])
        assert meter.token_events == 4


async def test_chunks_grown_past_the_event_limit_are_each_an_event_of_output(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """SGLang's cumulative chunks (`max_new_tokens: null`, `return_logprob`) outgrow
    `metering.max_event_bytes` as the output grows: the counts in them go unread and the stream
    is unmeasured (event_too_large). Each event over the limit is one the client got, which may
    carry output: the unmeasured charge counts it as at least one token. Before, only the events
    read counted: 1,000 tokens served (320 events read, 8 KiB limit) were charged $0.65, the
    held prompt and those 320 events, not the $2.009 of 1,000 tokens (from the h-rev6 review)."""
    run, db = await sim.start_fake(
        start_sidecar,
        aiohttp_server,
        tmp_path,
        ("/generate", sglang_stream_no_limit),
        pricing=PRICES,
        upstream={"api": "sglang", "model_name": SIM_MODEL},
        budgets={"user_daily_usd": 50.0, "default_max_output_tokens": 100},
        metering={"max_event_bytes": 8192},
    )
    body = {
        "text": "one two three four five six seven eight",
        "sampling_params": {"max_new_tokens": None},
        "return_logprob": True,
        "stream": True,
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/generate", json=body, headers={"X-Tollbooth-User": "grow"}) as r,
    ):
        assert r.status == 200
        raw = await r.read()
    events = [x[6:] for x in raw.split(b"\n\n") if x.startswith(b"data: ")]
    assert len(events) == GROWN + 1 and json.loads(events[-2])["meta_info"]["completion_tokens"]
    rows = "output_tokens, cost_usd, budget_usd"
    await wait_for(lambda: len(sim.ledger_rows(db, rows)) == 1, "the ledger row")
    ((out, cost, charged),) = sim.ledger_rows(db, rows)
    assert (out, cost) == (None, None)  # unmeasured: the counts were in chunks never read
    await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")
    spent = run.sc.budgets.store.spent["user:grow"] / 1e6
    assert spent == pytest.approx(charged)
    assert sim.token_cost(9, GROWN) <= spent <= sim.token_cost(10, GROWN)


# --- a batch of embeddings ------------------------------------------------------------------------

ANSWERS = [40, 28, 33, 21]  # tokens each prompt's generation runs to (no limit it obeys)
BILLED = "user, endpoint, input_tokens, output_tokens, cost_usd"


async def sglang_generate_batch(request: web.Request) -> web.StreamResponse:
    """/generate streamed as SGLang streams a batch (a `text` list, or `input_embeds` of
    [prompt][token][hidden]: io_struct `_determine_batch_size`): each prompt's chunks with its
    `index` and cumulative meta_info, then [DONE]."""
    obj = json.loads(await request.read())
    embeds, text = obj.get("input_embeds"), obj.get("text")
    prompts = len(embeds) if embeds is not None else len(text)
    limit = obj["sampling_params"]["max_new_tokens"]
    outs = [min(a, limit) for a in ANSWERS[:prompts]]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for step in range(max(outs)):
        for i, out in enumerate(outs):
            if step < out:
                reason = {"type": "stop"} if step == out - 1 else None
                meta = {"prompt_tokens": 5, "completion_tokens": step + 1, "cached_tokens": 0}
                meta["finish_reason"] = reason
                chunk = {"text": "x" * (step + 1), "meta_info": meta, "index": i}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


@pytest.mark.parametrize("batch", ["text", "input_embeds"])
async def test_a_batch_of_embeddings_is_measured(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, batch: str
) -> None:
    """Before: a batch was read from `text` and `input_ids` only, so four prompts' embeddings
    were one choice, the other prompts' chunks (index 1..3) stray and the usage invalid: the
    ledger NULL, the budget charged the hold of one prompt's 40 tokens for the 122 generated.
    (`text` is the control: it passed.)"""
    run, db = await sim.start_fake(
        start_sidecar,
        aiohttp_server,
        tmp_path,
        ("/generate", sglang_generate_batch),
        pricing=PRICES,
        budgets={"user_daily_usd": 5.0},
        upstream={"api": "sglang", "model_name": SIM_MODEL},
    )
    prompt: Any = [[[0.5, 0.25]] * 5] * 4 if batch == "input_embeds" else ["a b c d e"] * 4
    req = {batch: prompt, "sampling_params": {"max_new_tokens": 40}, "stream": True}
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/generate", json=req, headers={"X-Tollbooth-User": "sgl"}) as r,
    ):
        assert r.status == 200
        await r.read()
    await wait_for(lambda: len(sim.ledger_rows(db, BILLED)) == 1, "the ledger row")
    await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")
    cost = sim.token_cost(20, sum(ANSWERS))
    rows = sim.ledger_rows(db, BILLED)
    assert rows == [("sgl", "/generate", 20, sum(ANSWERS), pytest.approx(cost))]
    assert run.sc.budgets.store.spent["user:sgl"] / 1e6 == pytest.approx(cost)


# --- the server's own default max_new_tokens --------------------------------------------------


PREFERRED = 1000  # --preferred-sampling-params '{"max_new_tokens": 1000}'


class PreferredDefault:
    """An SGLang server started with --preferred-sampling-params: an absent max_new_tokens is
    its 1000 (tokenizer_manager.py `{**preferred_sampling_params, **obj.sampling_params}`), and
    /get_model_info says so (http_server.py `get_model_info`: `preferred_sampling_params`, the
    flag's JSON text). /generate answers, not streamed, once all 1000 are made: when the test
    sets `done` (`generating` is set while it makes them)."""

    def __init__(self) -> None:
        self.generating, self.done = asyncio.Event(), asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        if request.path == "/get_model_info":
            preferred = json.dumps({"max_new_tokens": PREFERRED})
            body = {"model_path": SIM_MODEL, "preferred_sampling_params": preferred}
            return web.json_response(body)
        await request.read()
        self.generating.set()
        await self.done.wait()
        body = {**BODY, "meta_info": {**BODY["meta_info"], "completion_tokens": PREFERRED}}
        return web.json_response(body)


async def test_a_client_leaving_a_body_without_a_limit_is_charged_the_servers_default(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """2a1e97b stopped capping the count at 128 (the server may default to more), but an
    unmeasured request was still charged its hold of 128: a client that sends no max_new_tokens
    to a server defaulting to 1000 and leaves a non-streamed /generate just before its answer
    (SGLang generates on until it notices the disconnect) was charged 128 tokens of output
    where the server may have made 1000: $0.263 charged, the 1000 tokens alone $2.00 (h-rev8
    finding 3). The hold now reads the server's default from /get_model_info: (7 + 1000)
    tokens, $2.007 (tests/test_sglang_limit.py: the values that cannot be read)."""
    server = PreferredDefault()
    app = web.Application()
    app.router.add_post("/generate", server.handle)
    app.router.add_get("/get_model_info", server.handle)
    up = await aiohttp_server(app)
    config = {"pricing": PRICES, "budgets": {"user_daily_usd": 5.0}}
    config |= {"upstream": {"api": "sglang", "model_name": SIM_MODEL}}
    run = await start_sidecar(config, upstream_url=str(up.make_url("")).rstrip("/"))
    body = {"text": PROMPT}  # no sampling_params: the server's default limit

    async def send() -> None:
        async with (
            aiohttp.ClientSession() as s,
            s.post(run.url + "/generate", json=body, headers={"X-Tollbooth-User": "lo"}) as r,
        ):
            await r.read()

    task = asyncio.ensure_future(send())
    await wait_for(server.generating.is_set, "the server generating")
    task.cancel()  # the client leaves before the answer
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await wait_for(lambda: "user:lo" in run.sc.budgets.store.spent, "the charge")
    await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")
    server.done.set()  # its handler ends (into a connection the sidecar closed)
    spent = run.sc.budgets.store.spent["user:lo"] / 1e6
    assert spent == pytest.approx(sim.token_cost(7, PREFERRED))  # ceil(27 / 4) prompt tokens


async def _stream_through(
    start_sidecar: StartSidecar,
    aiohttp_server: Any,
    tmp_path: Path,
    chunks: tuple[bytes, ...],
    text: str,
) -> tuple[Any, Path, bytes]:
    """A streamed /generate of `text` (max_new_tokens 500) by user sg, through a sidecar with a
    ledger and a $50 budget in front of an SGLang that sends `chunks`: the sidecar, its ledger
    once the row is written, and what the client received."""

    async def generate(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in chunks:
            await resp.write(chunk)
        return resp

    app = web.Application()
    app.router.add_post("/generate", generate)
    up = await aiohttp_server(app)
    db = tmp_path / "ledger.db"
    config = {"ledger": {"path": str(db), "flush_interval_s": 0.05}, "pricing": PRICES}
    config |= {"upstream": {"api": "sglang", "model_name": SIM_MODEL}}
    config |= {"budgets": {"user_daily_usd": 50.0}}
    run = await start_sidecar(config, upstream_url=str(up.make_url("")).rstrip("/"))
    body = {"text": text, "sampling_params": {"max_new_tokens": 500}, "stream": True}
    headers = {"X-Tollbooth-User": "sg"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/generate", json=body, headers=headers) as r,
    ):
        assert r.status == 200
        received = await r.read()
    await wait_for(lambda: len(sim.ledger_rows(db, "output_tokens")) == 1, "the ledger row")
    return run, db, received


async def test_an_event_the_meter_cannot_read_leaves_no_earlier_count_as_the_usage(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """h-rev10 finding 6: an event nested past json's depth (`[` x 5,000, 10 KB, under
    metering.max_event_bytes) raised RecursionError out of the SSE meter, which the proxy
    counts as a metering error and then forwards the rest unread (passthrough), as it should;
    but the stream's usage was then the counts read before it, measured: 9 in / 1 out billed
    where the server's last chunk said 500 out (the budget charged 1 token of a 500-token
    hold). Now such an event is unreadable, as one that is no JSON is (the later counts are the
    usage), and after any failure of the meter the usage is unknown (charged at least the
    hold), never the counts so far."""
    deep = b"data: " + b"[" * 5000 + b"]" * 5000 + b"\n\n"
    chunks = (_chunk(1), deep, _chunk(500, last=True), b"data: [DONE]\n\n")
    _, db, received = await _stream_through(start_sidecar, aiohttp_server, tmp_path, chunks, "a")
    assert deep in received  # forwarded unchanged
    assert sim.ledger_rows(db, "input_tokens, output_tokens") == [(9, 500)]


async def test_after_the_meter_failed_the_counts_read_before_are_no_measurement(
    start_sidecar: StartSidecar,
    aiohttp_server: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same for any failure of the meter (a bug of ours, here its second event raising):
    the rest of the stream passes unread, so the counts read before are not the usage."""
    from sidecar.metering.sglang import SGLangStream

    step = SGLangStream._step
    calls = []

    def failing(self: Any, index: int, read: Any, obj: Any) -> None:
        calls.append(index)
        if len(calls) == 2:
            raise RuntimeError("a metering bug")
        step(self, index, read, obj)

    monkeypatch.setattr(SGLangStream, "_step", failing)

    chunks = (_chunk(1), _chunk(2), _chunk(500, last=True), b"data: [DONE]\n\n")
    run, db, _ = await _stream_through(start_sidecar, aiohttp_server, tmp_path, chunks, "abcd")
    assert sim.ledger_rows(db, "input_tokens, output_tokens") == [(None, None)]
    await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")
    spent = run.sc.budgets.store.spent["user:sg"] / 1e6
    assert spent == pytest.approx(sim.token_cost(1, 500))  # the hold: ceil(4 / 4) + 500
