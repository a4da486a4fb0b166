"""llama.cpp's native /completion and /infill metered (issue 23), over raw HTTP.

The wire shapes are those of llama.cpp's tools/server/server-task.cpp (`to_json_non_oaicompat` of
the partial and the final result) and tools/server/README.md: running counts on every streamed
event, totals on the `stop: true` one, no [DONE], `:` keep-alive lines; `tokens_cached` is the
slot's cache after the request (prompt + output), so cached input is `timings.cache_n`.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from sidecar.billing.budget import to_micros
from sidecar.exchange import Endpoint
from sidecar.metering.wire import inspect_request, open_stream, usage_from_body
from sidecar.proxy.routes import classify
from tests import simulated as sim
from tests.conftest import Running, StartSidecar
from tests.waiting import wait_for

SIM_MODEL = "sim-llama-3-8b"
PRICES = sim.prices(SIM_MODEL)
# the sidecar in front of each fake llama.cpp below: a ledger, these prices, a budget
FRONTED: dict[str, Any] = {"pricing": PRICES, "budgets": {"user_daily_usd": 5.0}}
NAMED = {**FRONTED, "upstream": {"model_name": SIM_MODEL}}  # and the one model it serves

# A final result as llama.cpp writes it (server-task.cpp, `server_task_result_cmpl_final::
# to_json_non_oaicompat`, fields in its order; values from the README's /completion example).
FINAL = {
    "index": 0,
    "content": " world",
    "tokens": [],
    "id_slot": 0,
    "stop": True,
    "model": "gpt-3.5-turbo",
    "tokens_predicted": 7,
    "tokens_evaluated": 12,
    "generation_settings": {"n_predict": 7},
    "prompt": "<s> Hello",
    "has_new_line": False,
    "truncated": False,
    "stop_type": "limit",
    "stopping_word": "",
    "tokens_cached": 18,  # n_past: prompt + output in the slot, not the cached prefix
    "timings": {"cache_n": 4, "prompt_n": 8, "predicted_n": 7},
}


def partial(n: int) -> dict[str, Any]:
    """A partial result (`server_task_result_cmpl_partial::to_json_non_oaicompat`)."""
    return {
        "index": 0,
        "content": "x",
        "tokens": [n],
        "stop": False,
        "id_slot": 0,
        "tokens_predicted": n,
        "tokens_evaluated": 12,
    }


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_the_routes_are_metered() -> None:
    assert classify("POST", "/completion") is Endpoint.LLAMA_COMPLETION
    assert classify("POST", "/infill") is Endpoint.LLAMA_INFILL


@pytest.mark.parametrize(
    ("body", "limit"),
    [
        ({"prompt": "a", "n_predict": 8}, 8),
        ({"prompt": "a", "max_tokens": 9}, 9),
        ({"prompt": "a", "n_predict": -1, "max_tokens": 5}, None),  # n_predict wins: unbounded
        ({"prompt": "a"}, None),
        ({"prompt": "a", "n_predict": "8"}, None),
        # then max_completion_tokens, then max_tokens (before: max_tokens, the hold for 1)
        ({"prompt": "a", "max_tokens": 1, "max_completion_tokens": 500}, 500),
        ({"prompt": "a", "max_completion_tokens": None, "max_tokens": 9}, 9),  # null: absent
        ({"prompt": "a", "max_completion_tokens": -1, "max_tokens": 9}, None),
        # a value get<int> refuses is absent to `json_value`: its default, the next field. Before,
        # each of these was unreadable and the sidecar refused the request (400) that llama.cpp
        # serves with the next field's limit
        ({"prompt": "a", "n_predict": "8", "max_tokens": 9}, 9),
        ({"prompt": "a", "n_predict": [8], "max_completion_tokens": 7, "max_tokens": 9}, 7),
        ({"prompt": "a", "max_completion_tokens": "x", "max_tokens": 9}, 9),
        ({"prompt": "a", "n_predict": {"n": 1}, "max_completion_tokens": "x", "max_tokens": 3}, 3),
        ({"prompt": "a", "n_predict": "8", "max_completion_tokens": [1]}, None),  # the default
        ({"prompt": "a", "n_predict": 8, "max_tokens": "x"}, 8),  # a later one is never read
    ],
)
def test_the_limit_is_read_as_llama_cpp_reads_it(body: dict[str, Any], limit: int | None) -> None:
    """`params_from_json_cmpl`: `n_predict`, else `max_completion_tokens`, else `max_tokens`
    (`json_value` each, the next one its default)."""
    info = inspect_request(Endpoint.LLAMA_COMPLETION, json.dumps(body).encode(), inject_usage=True)
    assert info.max_tokens == limit
    assert info.unreadable == ()  # nothing the hold must refuse: llama.cpp reads each of these
    # no cap where the server reads no limit; else the largest limit that is a number (another
    # version may read another field), never one llama.cpp reads as absent
    numbers = [v for k, v in body.items() if k in LIMITS and type(v) is int]
    assert info.output_cap == (None if limit is None else max(numbers))
    assert info.body == json.dumps(body).encode()  # never changed


LIMITS = ("n_predict", "max_completion_tokens", "max_tokens")


@pytest.mark.parametrize(
    ("extra", "limit"),
    [
        ({"n_predict": 8.9}, 8),  # get<int> truncates
        ({"n_predict": 0.5, "max_tokens": 9}, None),  # 0: no limit of its own, never the next
        ({"n_predict": True, "max_tokens": 9}, 1),  # a boolean is 0 or 1 to get<int>
        ({"n_predict": False, "max_tokens": 9}, None),
        ({"max_completion_tokens": 1e30, "max_tokens": 9}, None),  # past int32: no limit read
    ],
)
def test_a_limit_of_another_number_type_is_read_as_get_int_reads_it(
    extra: dict[str, Any], limit: int | None
) -> None:
    """Before, a fraction or a boolean was unreadable (a 400); llama.cpp reads it as a number.
    The cap on counted output never reads one below the limit (a fraction is no cap)."""
    body = json.dumps({"prompt": "a", **extra}).encode()
    info = inspect_request(Endpoint.LLAMA_COMPLETION, body, inject_usage=True)
    assert (info.max_tokens, info.unreadable) == (limit, ())
    assert info.output_cap is None or (limit is not None and info.output_cap >= limit)


def test_several_prompts_are_several_results() -> None:
    body = json.dumps({"prompt": ["a", "b", [1, 2]], "n_predict": 4}).encode()
    assert inspect_request(Endpoint.LLAMA_COMPLETION, body, inject_usage=False).choices == 3
    ids = json.dumps({"prompt": [1, 2, 3], "n_predict": 4}).encode()
    assert inspect_request(Endpoint.LLAMA_COMPLETION, ids, inject_usage=False).choices == 1


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ([12, "a", 34], 1),  # tokens and text mixed: one prompt (`tokenize_mixed`)
        (["a", 12], 1),
        (["a", [12, "b"], [1, 2]], 3),  # mixed within a list of prompts: each one
        ([True, "a"], 2),  # a boolean is no number to llama.cpp: two "prompts" (refused)
    ],
)
def test_a_prompt_of_tokens_and_text_mixed_is_one_prompt(prompt: list[Any], prompts: int) -> None:
    """llama.cpp's `tokenize_input_prompts` reads a `prompt` list holding both an integer and a
    string as one prompt (`json_is_array_of_mixed_numbers_strings`, then `tokenize_mixed`: "
    [12, 34, "string", 56, 78]"). Before, such a list was read as len(prompt) prompts: the hold
    (and the output cap) was that many times too large."""
    body = json.dumps({"prompt": prompt, "n_predict": 4}).encode()
    info = inspect_request(Endpoint.LLAMA_COMPLETION, body, inject_usage=False)
    assert (info.choices, info.n) == (prompts, prompts)
    # llama.cpp's /v1/completions hands its `prompt` to the same `tokenize_input_prompts`. Before,
    # the OpenAI route read a list by its first element: ["a", 12] was 2 prompts (the hold and
    # the output cap twice too large), [True, "a"] one
    body = json.dumps({"model": SIM_MODEL, "prompt": prompt, "max_tokens": 4}).encode()
    assert inspect_request(Endpoint.COMPLETIONS, body, inject_usage=False).choices == prompts


def test_a_final_body_is_read_with_cache_n_as_cached_input() -> None:
    u = usage_from_body(Endpoint.LLAMA_COMPLETION, json.dumps(FINAL).encode(), {})
    assert (u.input_tokens, u.output_tokens, u.cached_input_tokens) == (12, 7, 4)
    assert u.unknown_reason is None and u.finish_reasons == ("limit",)
    two = usage_from_body(Endpoint.LLAMA_INFILL, json.dumps([FINAL, FINAL]).encode(), {})
    assert (two.input_tokens, two.output_tokens, two.cached_input_tokens) == (24, 14, 8)
    bad = usage_from_body(
        Endpoint.LLAMA_COMPLETION, json.dumps({**FINAL, "tokens_predicted": -1}).encode(), {}
    )
    assert bad.output_tokens is None and bad.unknown_reason == "invalid_usage"
    err = {"error": {"code": 400, "message": "bad", "type": "invalid_request_error"}}
    e = usage_from_body(Endpoint.LLAMA_COMPLETION, json.dumps(err).encode(), {})
    assert e.error == "invalid_request_error" and e.input_tokens is None


WIRE = b": keep-alive\n\n" + b"".join(sse(partial(n)) for n in range(1, 8)) + sse(FINAL)


@pytest.mark.parametrize("cut", [1, 7, 50, len(WIRE)])
def test_a_stream_is_read_at_every_cut_and_passes_unchanged(cut: int) -> None:
    meter = open_stream(Endpoint.LLAMA_COMPLETION)
    out = b"".join(meter.feed(WIRE[i : i + cut]) for i in range(0, len(WIRE), cut))
    tail, u = meter.finish()
    assert out + tail == WIRE
    assert meter.done and meter.token_events == 7
    assert (u.input_tokens, u.output_tokens, u.cached_input_tokens) == (12, 7, 4)


def test_a_stream_cut_short_is_billed_its_running_counts() -> None:
    meter = open_stream(Endpoint.LLAMA_COMPLETION)
    meter.feed(b"".join(sse(partial(n)) for n in range(1, 4)))
    u = meter.usage_so_far()
    assert (u.input_tokens, u.output_tokens) == (12, 3) and not meter.done


def _read_with_limit(data: bytes, choices: int = 1) -> set[tuple[Any, ...]]:
    """(input, output, cached, reason) of `data` cut in two at every byte; each read unchanged."""
    results = set()
    for cut in range(len(data) + 1):
        meter = open_stream(Endpoint.LLAMA_COMPLETION, max_event_bytes=1024, choices=choices)
        out = meter.feed(data[:cut]) + meter.feed(data[cut:])
        tail, u = meter.finish()
        assert out + tail == data
        results.add((u.input_tokens, u.output_tokens, u.cached_input_tokens, u.unknown_reason))
    return results


LONG_EVENT = sse({**partial(3), "content": "t" * 2000})  # one event too long to read
UNKNOWN = {(None, None, None, "event_too_large")}


def test_counts_after_an_event_over_the_limit_are_the_usage() -> None:
    """Every event carries its prompt's counts so far: the final event read after a long one
    supersedes it (before, the whole stream was unknown); one read before it does not."""
    assert _read_with_limit(sse(partial(1)) + LONG_EVENT + sse(FINAL)) == {(12, 7, 4, None)}
    assert _read_with_limit(sse(partial(1)) + sse(FINAL) + LONG_EVENT) == UNKNOWN


def test_a_prompt_whose_counts_came_before_an_event_over_the_limit_is_unknown() -> None:
    """Two prompts: each prompt's counts must be read after the long event, which may have
    been an event of either."""
    second = {**FINAL, "index": 1, "tokens_predicted": 5}
    before = sse(FINAL) + LONG_EVENT + sse(second)
    assert _read_with_limit(before, choices=2) == UNKNOWN
    after = LONG_EVENT + sse(FINAL) + sse(second)
    assert _read_with_limit(after, choices=2) == {(24, 12, 8, None)}


# --- through the sidecar, in front of the simulator speaking llama.cpp ---------------------------


async def _start(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, **config: Any
) -> tuple[Running, Path]:
    return await sim.start_simulated(start_sidecar, aiohttp_server, tmp_path, PRICES, **config)


def _rows(db: Path) -> list[tuple[Any, ...]]:
    return sim.ledger_rows(db, COLUMNS)


COLUMNS = "user, endpoint, input_tokens, output_tokens, cached_input_tokens, status"


def _tokens(run: Running, kind: str, route: str, user: str) -> Any:
    labels = {"model": SIM_MODEL, "api_endpoint": route, "user_id": user}
    if kind == "cached":
        return run.value("llm_cached_input_tokens_total", **labels)
    return run.value("llm_tokens_total", token_type=kind, **labels)


PROMPT = "one two three four five six"  # 6 tokens at the simulator


@pytest.mark.parametrize("stream", [False, True])
async def test_exact_tokens_per_user_with_the_cached_prefix(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, stream: bool
) -> None:
    run, db = await _start(start_sidecar, aiohttp_server, tmp_path)
    got = []
    async with aiohttp.ClientSession() as s:
        for user, path, body in (
            ("ann", "/completion", {"prompt": PROMPT, "n_predict": 4}),
            ("bob", "/completion", {"prompt": PROMPT + " seven", "n_predict": 3}),
            ("bob", "/infill", {"input_prefix": "one", "input_suffix": "two", "n_predict": 2}),
        ):
            headers = {"X-Tollbooth-User": user}
            async with s.post(
                run.url + path, json={**body, "stream": stream}, headers=headers
            ) as r:
                assert r.status == 200
                raw = await r.read()
            events = [json.loads(x[6:]) for x in raw.split(b"\n\n") if x.startswith(b"data: ")]
            got.append(events[-1] if stream else json.loads(raw))
    # what the upstream reported, per request (the client got it unchanged)
    reported = [
        (g["tokens_evaluated"], g["tokens_predicted"], g["timings"]["cache_n"]) for g in got
    ]
    assert reported[0][0] == 6 and reported[1] == (7, reported[1][1], 6)  # 6 reused by bob
    await wait_for(lambda: len(_rows(db)) == 3, "three ledger rows")
    assert [r[2:5] for r in _rows(db)] == reported
    assert [r[:2] for r in _rows(db)] == [
        ("ann", "/completion"),
        ("bob", "/completion"),
        ("bob", "/infill"),
    ]
    assert _tokens(run, "input", "/completion", "ann") == 6
    assert _tokens(run, "output", "/completion", "ann") == reported[0][1]
    assert _tokens(run, "input", "/completion", "bob") == 7
    assert _tokens(run, "cached", "/completion", "bob") == 6
    assert _tokens(run, "input", "/infill", "bob") == reported[2][0]


async def test_a_client_leaving_mid_stream_is_billed_what_was_measured(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    run, db = await _start(start_sidecar, aiohttp_server, tmp_path)
    body = {"prompt": PROMPT, "n_predict": 400, "stream": True}

    def progress(line: bytes) -> int | None:
        return event["tokens_predicted"] if (event := sim.sse_data(line)) is not None else None

    seen = await sim.leave_mid_stream(run, "/completion", body, "cy", progress)
    await wait_for(lambda: len(_rows(db)) == 1, "the ledger row")
    ((user, _, inp, out, _, status),) = _rows(db)
    assert (user, inp, status) == ("cy", 6, "499")
    assert seen <= out < 400  # the running count the sidecar read last; the rest not generated


async def test_a_burst_against_a_small_budget_is_held(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    limit = 0.05  # $0.001 per input token, $0.002 per output token: 50 input tokens
    run, db = await _start(
        start_sidecar,
        aiohttp_server,
        tmp_path,
        budgets={"user_daily_usd": limit},
        upstream={"model_name": SIM_MODEL},  # the hold's price: the request names no model
    )
    body = {"prompt": PROMPT, "n_predict": 5, "stream": True}
    async with aiohttp.ClientSession() as s:
        statuses = await sim.burst(lambda: sim.post_status(s, run.url + "/completion", body, "dee"))
    # billed exactly what the served ones measured
    await sim.assert_burst_held(
        run, db, COLUMNS, "dee", limit, statuses, lambda r: sim.token_cost(r[2], r[3])
    )


# --- llama.cpp's OpenAI-compatible routes, metered by the OpenAI adapter -------------------------
# Its `oaicompat_chat_params_parse` (tools/server/server-common.cpp) maps `max_tokens` and then
# copies the body's other fields over ("if "n_predict" is present, we overwrite the value specified
# earlier by "max_tokens""), and `params_from_json_cmpl` (server-task.cpp) reads `n_predict`
# first, then `max_completion_tokens`, then `max_tokens`: so `n_predict` is the limit it obeys.

ANSWER = 50  # tokens the fake generates without a limit it reads


def _llama_cpp_limit(obj: dict[str, Any]) -> int:
    for key in ("n_predict", "max_completion_tokens", "max_tokens"):
        if obj.get(key) is not None:
            return int(obj[key]) if obj[key] > 0 else ANSWER
    return ANSWER


async def llama_cpp_v1(request: web.Request) -> web.Response:
    """/v1/chat/completions and /v1/completions as llama.cpp answers them (not streamed):
    `to_json_oaicompat_chat` / `to_json_oaicompat`, usage the real counts."""
    obj = json.loads(await request.read())
    out = min(ANSWER, _llama_cpp_limit(obj))
    text = " ".join(["x"] * out)
    if request.path.endswith("/chat/completions"):
        choice = {"finish_reason": "length", "index": 0, "message": {"content": text}}
        kind = "chat.completion"
    else:
        choice, kind = {"text": text, "index": 0, "finish_reason": "length"}, "text_completion"
    usage = {"completion_tokens": out, "prompt_tokens": 5, "total_tokens": out + 5}
    body = {"choices": [choice], "created": 1, "model": obj["model"], "object": kind}
    return web.json_response({**body, "usage": usage, "id": "chatcmpl-1"})


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_n_predict_beside_max_tokens_on_llama_cpps_openai_routes_is_billed_in_full(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, path: str
) -> None:
    """Before: the cap on counted output was the largest of max_tokens, max_completion_tokens and
    max_output_tokens: `max_tokens: 1, n_predict: 50` had its 50 tokens, which llama.cpp
    generated and reported, taken as more than it asked (invalid usage): the ledger NULL, the
    budget charged the hold of one output token. `n_predict` is one of the limit fields now."""
    route = (path, llama_cpp_v1)
    run, db = await sim.start_fake(start_sidecar, aiohttp_server, tmp_path, route, **FRONTED)
    body: dict[str, Any] = {"model": SIM_MODEL, "max_tokens": 1, "n_predict": ANSWER}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "a"}
    headers = {"X-Tollbooth-User": "nia"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + path, json=body, headers=headers) as r,
    ):
        assert r.status == 200
        assert (await r.json())["usage"]["completion_tokens"] == ANSWER
    columns = "user, endpoint, input_tokens, output_tokens, cost_usd"
    await wait_for(lambda: len(sim.ledger_rows(db, columns)) == 1, "the ledger row")
    cost = pytest.approx(sim.token_cost(5, ANSWER))
    assert sim.ledger_rows(db, columns) == [("nia", path, 5, ANSWER, cost)]
    await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")
    assert run.sc.budgets.store.spent["user:nia"] == to_micros(sim.token_cost(5, ANSWER))
    assert run.value("llm_budget_unmeasured_charges_total") in (None, 0)
    # the largest limit field caps the count; n_predict: -1 (llama.cpp's "no limit") is no cap
    for extra, cap in (({"n_predict": 1000}, 1000), ({"n_predict": -1}, None)):
        sent = json.dumps({"max_tokens": 1, "messages": [], **extra}).encode()
        assert inspect_request(Endpoint.CHAT, sent, inject_usage=False).output_cap == cap


# --- parallel sampling: `n_cmpl` (alias `n`) completions of each prompt -------------------------
# server-schema.cpp: "n_cmpl ... add_alias n", "total outputs will be N prompts times n_cmpl";
# `server_response_reader::post_tasks` numbers the results prompt * n_cmpl + completion.

ANSWERS = [40, 28, 33, 21]  # tokens each completion generates to its end (no limit it obeys)
MSGS: Any = [{"role": "user", "content": "one two three four five"}]  # 5 prompt tokens
BILLED = "user, endpoint, input_tokens, output_tokens, cost_usd"


async def _billed(run: Running, db: Path) -> list[tuple[Any, ...]]:
    await wait_for(lambda: len(sim.ledger_rows(db, BILLED)) == 1, "the ledger row")
    await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")
    return sim.ledger_rows(db, BILLED)


def _json_value(obj: dict[str, Any], key: str, default: int) -> int:
    """llama.cpp's `json_value` for an int: the value, or `default` when it is absent, null or
    of another type (nlohmann's type_error caught)."""
    value = obj.get(key)
    return value if type(value) is int else default


def _completions(obj: dict[str, Any]) -> list[int]:
    """Each completion's output: `n_cmpl`, else `n`, of them (`params_from_json_cmpl`:
    `json_value(data, "n_cmpl", json_value(data, "n", 1))`), up to the limit llama.cpp reads."""
    limit = obj.get("n_predict", obj.get("max_tokens"))
    n = _json_value(obj, "n_cmpl", _json_value(obj, "n", 1))
    return [min(a, limit) if limit and limit > 0 else a for a in ANSWERS[:n]]


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def llama_cpp_v1_chat_stream(request: web.Request) -> web.StreamResponse:
    """/v1/chat/completions streamed as llama.cpp streams parallel samples: each completion its
    own task (index i), its chunks, its finish chunk and then (include_usage) a usage-only chunk
    of its own counts (server-task.cpp `to_json_oaicompat_chat_stream`); the shortest first."""
    obj = json.loads(await request.read())
    outs = _completions(obj)
    chunk = {"id": "chatcmpl-l", "created": 1, "model": obj["model"]}
    chunk |= {"object": "chat.completion.chunk", "system_fingerprint": "b1"}
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    include_usage = (obj.get("stream_options") or {}).get("include_usage")
    for step in range(max(outs)):
        for i, out in enumerate(outs):
            if step < out:
                choice = {"finish_reason": None, "index": i, "delta": {"content": "x "}}
                await resp.write(_event({**chunk, "choices": [choice]}))
            if step == out - 1:  # this task's final result
                done = {"finish_reason": "stop", "index": i, "delta": {}}
                await resp.write(_event({**chunk, "choices": [done]}))
                if include_usage:
                    usage = {"completion_tokens": out, "prompt_tokens": 5, "total_tokens": 5 + out}
                    await resp.write(_event({**chunk, "choices": [], "usage": usage}))
    await resp.write(b"data: [DONE]\n\n")
    return resp


@pytest.mark.parametrize("field", ["n", "n_cmpl"])
@pytest.mark.parametrize("n", [2, 4])
async def test_parallel_samples_on_llama_cpps_chat_stream_are_each_billed(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, n: int, field: str
) -> None:
    """llama.cpp's chat stream with `n` (or its own `n_cmpl`, which the OpenAI SDK passes in
    `extra_body`) sends one usage-only chunk per completion. Before: the last one replaced the
    others ("last wins", 3b3c617), so n=2 was billed 40 of its 68 output tokens and n=4 40 of
    122; with `n_cmpl` (read as one choice) the other completions' chunks were stray too. Each
    is billed now, the one prompt once."""
    route = ("/v1/chat/completions", llama_cpp_v1_chat_stream)
    run, db = await sim.start_fake(start_sidecar, aiohttp_server, tmp_path, route, **NAMED)
    client = openai.AsyncOpenAI(
        base_url=run.url + "/v1", api_key="k", default_headers={"X-Tollbooth-User": "pat"}
    )
    got = [0] * n
    async with client:
        chunks = await client.chat.completions.create(
            model=SIM_MODEL, messages=MSGS, stream=True, max_tokens=100, extra_body={field: n}
        )
        async for c in chunks:
            for choice in c.choices:
                got[choice.index] += bool(choice.delta.content)
    assert got == ANSWERS[:n]
    out = sum(ANSWERS[:n])
    cost = pytest.approx(sim.token_cost(5, out))
    assert await _billed(run, db) == [("pat", "/v1/chat/completions", 5, out, cost)]
    assert run.sc.budgets.store.spent["user:pat"] == to_micros(sim.token_cost(5, out))


LONG, SHORT = 40, 10  # completion 0's and completion 1's tokens, of an n=2 request


def _slow_second_completion(release: asyncio.Event, *, end_early: bool) -> Any:
    """llama.cpp's n=2 chat stream, completion 1 (SHORT tokens) ending first with its finish and
    usage-only chunk; completion 0 goes on only once `release` is set (or, `end_early`, the
    stream ends there: an upstream that died)."""
    chunk = {"id": "chatcmpl-l", "created": 1, "model": SIM_MODEL}
    chunk |= {"object": "chat.completion.chunk"}

    def content(i: int, delta: dict[str, Any], reason: str | None = None) -> bytes:
        return _event({**chunk, "choices": [{"finish_reason": reason, "index": i, "delta": delta}]})

    def usage(out: int) -> bytes:
        counts = {"completion_tokens": out, "prompt_tokens": 5, "total_tokens": 5 + out}
        return _event({**chunk, "choices": [], "usage": counts})

    async def handler(request: web.Request) -> web.StreamResponse:
        obj = json.loads(await request.read())
        assert obj.get("n") == 2 and (obj.get("stream_options") or {}).get("include_usage")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        x = {"content": "x "}
        first = b"".join(content(0, x) + content(1, x) for _ in range(SHORT))
        await resp.write(first + content(1, {}, "stop") + usage(SHORT))
        if end_early:
            return resp
        await release.wait()
        await resp.write(b"".join(content(0, x) for _ in range(LONG - SHORT)))
        await resp.write(content(0, {}, "stop") + usage(LONG) + b"data: [DONE]\n\n")
        return resp

    return handler


@pytest.mark.parametrize("end_early", [False, True], ids=["client_leaves", "upstream_dies"])
async def test_leaving_after_the_first_completions_usage_is_not_billed_as_measured(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, end_early: bool
) -> None:
    """A client asks llama.cpp's chat for n=2 with include_usage, reads up to the first usage-only
    chunk (completion 1's: 10 tokens) and leaves while completion 0 still generates (it has 10
    tokens by then, and would go on to 40); or the upstream ends the stream there. Before, the
    ledger said 5 in / 10 out, measured, and the budget was charged that: the other
    completion's tokens free. Now the usage is unknown (NULL counts), charged at least both
    completions' first 10 tokens (the hold)."""
    release = asyncio.Event()
    handler = _slow_second_completion(release, end_early=end_early)
    route = ("/v1/chat/completions", handler)
    run, db = await sim.start_fake(start_sidecar, aiohttp_server, tmp_path, route, **NAMED)
    body = {"model": SIM_MODEL, "messages": MSGS, "stream": True, "max_tokens": 100, "n": 2}
    body["stream_options"] = {"include_usage": True}
    try:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(
                run.url + "/v1/chat/completions", json=body, headers={"X-Tollbooth-User": "pat"}
            )
            seen = b""
            while b'"choices": [], "usage"' not in seen:
                piece = await resp.content.readany()
                assert piece, seen
                seen += piece
            resp.close()  # the client leaves
        rows = await _billed(run, db)
    finally:
        release.set()
    spent = run.sc.budgets.store.spent["user:pat"]
    floor = to_micros(sim.token_cost(5, 2 * SHORT))
    assert rows[0][2:4] == (None, None) and spent >= floor, (rows, spent, floor)


async def llama_cpp_completion_stream(request: web.Request) -> web.StreamResponse:
    """/completion streamed as llama.cpp streams `n_cmpl` (or `n`) completions of each prompt:
    each event with its result's index (prompt * n_cmpl + completion), its task's whole prompt
    in `tokens_evaluated`, each result ending with its `stop: true` totals
    (`to_json_non_oaicompat`); no [DONE]."""
    obj = json.loads(await request.read())
    outs = _completions(obj)
    prompts = obj["prompt"] if isinstance(obj["prompt"], list) else [obj["prompt"]]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for step in range(max(outs)):
        for p, prompt in enumerate(prompts):
            size = len(prompt.split())
            for c, out in enumerate(outs):
                if step >= out:
                    continue
                i = p * len(outs) + c
                event: dict[str, Any] = {"index": i, "content": "x", "stop": False, "id_slot": i}
                event |= {"tokens_predicted": step + 1, "tokens_evaluated": size}
                await resp.write(_event(event))
                if step == out - 1:
                    final = {**event, "content": "", "stop": True, "model": SIM_MODEL}
                    final |= {"stop_type": "eos", "timings": {"cache_n": 0, "prompt_n": size}}
                    await resp.write(_event(final))
    return resp


@pytest.mark.parametrize(
    "extra", [{"n_cmpl": 4}, {"n": 4}, {"n_cmpl": "x", "n": 4}], ids=["n_cmpl", "n", "string"]
)
async def test_n_completions_of_a_completion_stream_are_measured(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, extra: dict[str, Any]
) -> None:
    """Before: the request was read as its prompts only (one choice), so the other completions'
    events (index 1..3) were stray and the usage invalid: the ledger NULL, the budget charged
    the hold of ONE completion (40 output tokens) for the 122 that four generated; and so was a
    string `n_cmpl` beside `n: 4` after that, which llama.cpp reads as `n` (`json_value`'s
    default). Each completion reports its prompt (5 tokens), which llama.cpp evaluated once
    (`copy_state_to`): then the four results' counts were added up, 20 input tokens billed for
    5. Now the prompt is billed once, every completion's output."""
    route = ("/completion", llama_cpp_completion_stream)
    run, db = await sim.start_fake(start_sidecar, aiohttp_server, tmp_path, route, **NAMED)
    req = {"prompt": "one two three four five", "n_predict": 40, "stream": True, **extra}
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/completion", json=req, headers={"X-Tollbooth-User": "cmp"}) as r,
    ):
        assert r.status == 200
        await r.read()
    out = sum(ANSWERS)
    cost = pytest.approx(sim.token_cost(5, out))
    assert await _billed(run, db) == [("cmp", "/completion", 5, out, cost)]
    assert run.sc.budgets.store.spent["user:cmp"] == to_micros(sim.token_cost(5, out))


async def test_n_completions_of_two_prompts_streamed_bill_each_prompt_once(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """Two prompts (3 and 4 tokens), two completions of each, streamed: results 0, 1 are the
    first prompt's, 2, 3 the second's. Before, 14 input tokens were billed for 7."""
    route = ("/completion", llama_cpp_completion_stream)
    run, db = await sim.start_fake(start_sidecar, aiohttp_server, tmp_path, route, **NAMED)
    req = {"prompt": ["one two three", "four five six seven"], "n_predict": 40, "n_cmpl": 2}
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/completion", json={**req, "stream": True}) as r,
    ):
        assert r.status == 200
        await r.read()
    out = 2 * sum(ANSWERS[:2])
    cost = pytest.approx(sim.token_cost(7, out))
    assert await _billed(run, db) == [("anonymous", "/completion", 7, out, cost)]


async def llama_cpp_completion_body(request: web.Request) -> web.Response:
    """/completion not streamed, as llama.cpp answers `n_cmpl` completions of each prompt: one
    result object, or a list of them numbered prompt * n_cmpl + completion (`post_tasks`,
    `handle_completions_impl`), each reporting its task's whole prompt (a completion's copy of
    the first one's: `tokens_evaluated` and `timings.cache_n` the same in each)."""
    obj = json.loads(await request.read())
    prompts = obj["prompt"] if isinstance(obj["prompt"], list) else [obj["prompt"]]
    outs = _completions(obj)
    results = []
    for p, prompt in enumerate(prompts):
        for c, out in enumerate(outs):
            result = {**FINAL, "index": p * len(outs) + c, "model": SIM_MODEL, "id_slot": c}
            result |= {"tokens_predicted": out, "tokens_evaluated": len(prompt.split())}
            results.append(result | {"timings": {"cache_n": 1, "prompt_n": len(prompt.split())}})
    return web.json_response(results if len(results) > 1 else results[0])


@pytest.mark.parametrize(
    ("prompt", "n_cmpl"),
    [("one two three four five", 4), (["one two three", "four five six seven"], 2)],
    ids=["one_prompt", "two_prompts"],
)
async def test_n_completions_of_a_completion_body_bill_each_prompt_once(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, prompt: Any, n_cmpl: int
) -> None:
    """A list body of `n_cmpl` completions of each prompt: each result reports its prompt, the
    one llama.cpp evaluated once for all its completions. Before, every result's
    `tokens_evaluated` (and `cache_n`) was added up: 20 input tokens billed for one prompt of 5
    (n_cmpl 4), 14 for two prompts of 3 and 4 (n_cmpl 2). Each prompt is its own input."""
    route = ("/completion", llama_cpp_completion_body)
    run, db = await sim.start_fake(start_sidecar, aiohttp_server, tmp_path, route, **NAMED)
    req = {"prompt": prompt, "n_predict": 40, "n_cmpl": n_cmpl}
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/completion", json=req, headers={"X-Tollbooth-User": "cmp"}) as r,
    ):
        assert r.status == 200
        got = await r.json()
    assert len(got) == n_cmpl * (len(prompt) if isinstance(prompt, list) else 1)
    prompts = prompt if isinstance(prompt, list) else [prompt]
    inp = sum(len(p.split()) for p in prompts)
    out = sum(ANSWERS[:n_cmpl]) * len(prompts)
    cost = pytest.approx(sim.token_cost(inp, out))
    assert await _billed(run, db) == [("cmp", "/completion", inp, out, cost)]
    cached = run.value(
        "llm_cached_input_tokens_total", model=SIM_MODEL, api_endpoint="/completion", user_id="cmp"
    )
    assert cached == len(prompts)  # each prompt's cache_n (1) once


def test_shared_prompts_of_a_body_and_a_stream_agree() -> None:
    """The same results, whole or streamed: each prompt's input once, every output, and a
    result never read (a stream cut short) leaves the usage unknown, as before."""
    results = [{**FINAL, "index": i, "tokens_predicted": 3 + i} for i in range(6)]
    for per_prompt, inp in ((1, 72), (2, 36), (3, 24), (6, 12)):
        raw = json.dumps(results).encode()
        body = usage_from_body(
            Endpoint.LLAMA_COMPLETION, raw, {}, sequences=6, per_prompt=per_prompt
        )
        meter = open_stream(Endpoint.LLAMA_COMPLETION, choices=6, per_prompt=per_prompt)
        meter.feed(b"".join(sse(r) for r in results))
        streamed = meter.finish()[1]
        for u in (body, streamed):
            assert (u.input_tokens, u.output_tokens) == (inp, 33), per_prompt
            assert u.cached_input_tokens == 4 * inp // 12 and u.unknown_reason is None
        cut = open_stream(Endpoint.LLAMA_COMPLETION, choices=6, per_prompt=per_prompt)
        cut.feed(b"".join(sse(r) for r in results[:5]))
        assert cut.usage_so_far().output_tokens is None
    # a server without `n_cmpl` (older than its schema) makes one result a prompt: three
    # prompts asked two completions each (6 choices) come back as 3 results, each its own prompt
    old = usage_from_body(
        Endpoint.LLAMA_COMPLETION, json.dumps(results[:3]).encode(), {}, sequences=6, per_prompt=2
    )
    assert (old.input_tokens, old.output_tokens) == (36, 12)


@pytest.mark.parametrize(
    ("extra", "choices"),
    [
        ({"n_cmpl": 3}, 3),
        ({"n": 3}, 3),
        ({"n_cmpl": 2, "n": 4}, 2),  # n_cmpl first; `n` is its alias
        ({"n_cmpl": None, "n": 4}, 4),  # a null is absent
        ({"n_cmpl": 2.9}, 2),  # nlohmann's get<int> truncates
        ({"n_cmpl": True}, 1),
        ({"n_cmpl": 0}, 1),  # refused (hard limits 1..n_parallel): nothing is generated
        ({"n_cmpl": -3}, 1),
        ({"n_cmpl": "4"}, 1),  # no number: `json_value`'s default, `n` (absent: 1)
        ({"n_cmpl": "x", "n": 4}, 4),  # before: 1
        ({"n_cmpl": [2], "n": 3}, 3),
        ({"n_cmpl": "x", "n": "4"}, 1),
    ],
)
def test_completions_per_prompt_are_read_as_llama_cpp_reads_them(
    extra: dict[str, Any], choices: int
) -> None:
    """Two prompts: their results are numbered 0 .. 2 * n_cmpl - 1, all of them choices, and
    the hold is for as many (`info.n`)."""
    body = {"prompt": ["a b", "c d"], "n_predict": 4, **extra}
    info = inspect_request(Endpoint.LLAMA_COMPLETION, json.dumps(body).encode(), inject_usage=False)
    assert (info.choices, info.n) == (2 * choices, 2 * choices)


@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES])
def test_n_cmpl_on_llama_cpps_openai_routes_is_as_many_choices(endpoint: Endpoint) -> None:
    """llama.cpp's OpenAI routes copy `n_cmpl` through to the completion it runs, which makes
    that many (vLLM ignores the field, and reads `n`): the route's choices are the most either
    makes, so none of llama.cpp's is stray, and the hold is for as many. /v1/responses too
    (`post_responses_oai`: the body copied into a chat's, then run as one); before, it was read
    as one choice there, the hold one completion's of the three llama.cpp generated."""
    body: dict[str, Any] = {"model": SIM_MODEL, "max_tokens": 5, "n_cmpl": 3}
    if endpoint is Endpoint.RESPONSES:
        body = {"model": SIM_MODEL, "max_output_tokens": 5, "n_cmpl": 3, "input": "hi"}
    elif endpoint is Endpoint.CHAT:
        body |= {"messages": MSGS}
    else:
        body |= {"prompt": ["a", "b"]}
    prompts = 2 if endpoint is Endpoint.COMPLETIONS else 1
    info = inspect_request(endpoint, json.dumps(body).encode(), inject_usage=False)
    assert (info.choices, info.n) == (3 * prompts, 3)
    vllm_n = inspect_request(endpoint, json.dumps({**body, "n": 4}).encode(), inject_usage=False)
    assert (vllm_n.choices, vllm_n.n) == (4 * prompts, 4)  # vLLM's n=4 is more than 3


# --- several completions on llama.cpp's OpenAI routes: what its body and stream report -----------
# server-context.cpp `handle_completions_impl`, not streamed: one result is its body; several, on
# /v1/chat/completions and /v1/completions, are the first result's body with the others'
# `choices[0]` appended (its usage the first completion's alone), and on /v1/responses a JSON
# array of responses. Streamed, each result sends its own events; on /v1/responses each under
# its own response id (`task_result_state`: "resp_" and a random string per task).

TIMINGS = {"cache_n": 0, "prompt_n": 5, "predicted_n": ANSWERS[0]}  # every final result's


async def llama_cpp_v1_several(request: web.Request) -> web.Response:
    """/v1/chat/completions or /v1/completions, not streamed, with `n` or `n_cmpl` completions
    (or a `prompt` list), as `handle_completions_impl` merges them: the first result's body,
    `usage` and `timings` included, every result's choice."""
    obj = json.loads(await request.read())
    outs = _completions(obj)
    prompts = obj["prompt"] if isinstance(obj.get("prompt"), list) else [None]
    chat = request.path.endswith("/chat/completions")
    choices = []
    for i in range(len(prompts) * len(outs)):
        text = " ".join(["x"] * outs[i % len(outs)])
        if chat:
            choices.append({"finish_reason": "stop", "index": i, "message": {"content": text}})
        else:
            choices.append({"text": text, "index": i, "finish_reason": "stop"})
    usage = {"completion_tokens": outs[0], "prompt_tokens": 5, "total_tokens": 5 + outs[0]}
    body = {"choices": choices, "created": 1, "model": obj["model"], "usage": usage}
    return web.json_response({**body, "id": "chatcmpl-m", "timings": TIMINGS})


@pytest.mark.parametrize(
    ("path", "extra", "inp"),
    [
        ("/v1/chat/completions", {"n": 3}, 5),
        ("/v1/chat/completions", {"n_cmpl": 3}, 5),
        ("/v1/completions", {"n": 3, "prompt": "one two three four five"}, 5),
        ("/v1/completions", {"prompt": ["one two three four five", "six seven"]}, None),
    ],
    ids=["chat_n", "chat_n_cmpl", "completions_n", "completions_two_prompts"],
)
async def test_several_completions_in_one_body_are_not_billed_as_the_first_ones(
    start_sidecar: StartSidecar,
    aiohttp_server: Any,
    tmp_path: Path,
    path: str,
    extra: dict[str, Any],
    inp: int | None,
) -> None:
    """llama.cpp answers n=3 with the three choices and the first completion's usage (40 of the
    101 tokens generated). Before, the ledger said 5 in / 40 out, measured, and the budget was
    charged that: the other completions free. Now the output is unknown (the input, the one
    prompt's, measured; two prompts' is not) and the budget charges the hold, which covers
    every completion at the limit."""
    run, db = await sim.start_fake(
        start_sidecar, aiohttp_server, tmp_path, (path, llama_cpp_v1_several), **NAMED
    )
    body: dict[str, Any] = {"model": SIM_MODEL, "max_tokens": 100, **extra}
    if "chat" in path:
        body["messages"] = MSGS
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + path, json=body, headers={"X-Tollbooth-User": "pat"}) as r,
    ):
        assert r.status == 200
        got = await r.json()
    served = sum(len(c.get("text") or c["message"]["content"]) // 2 + 1 for c in got["choices"])
    rows = await _billed(run, db)
    assert rows[0][2:4] == (inp, None), rows
    spent = run.sc.budgets.store.spent["user:pat"]
    assert spent >= to_micros(sim.token_cost(5, served)), (spent, served)
    unknown = {"model": SIM_MODEL, "api_endpoint": path, "reason": "choices_unreported"}
    assert run.value("llm_usage_unknown_total", **unknown) == 1


def test_an_honest_vllm_body_of_several_choices_is_read_as_before() -> None:
    """vLLM's usage of n choices counts every one (no `timings`): measured as it is; and a
    llama.cpp body of one choice is its whole usage."""
    usage = {"prompt_tokens": 5, "completion_tokens": 101, "total_tokens": 106}
    choices = [{"index": i, "message": {"content": "x"}, "finish_reason": "stop"} for i in range(3)]
    vllm = json.dumps({"id": "c", "model": "m", "choices": choices, "usage": usage}).encode()
    u = usage_from_body(Endpoint.CHAT, vllm, {}, sequences=3, per_prompt=3)
    assert (u.input_tokens, u.output_tokens, u.unknown_reason) == (5, 101, None)
    one = {"id": "c", "model": "m", "choices": choices[:1], "usage": usage, "timings": TIMINGS}
    u = usage_from_body(Endpoint.CHAT, json.dumps(one).encode(), {})
    assert (u.input_tokens, u.output_tokens, u.unknown_reason) == (5, 101, None)


def _resp_event(kind: str, **data: Any) -> bytes:
    """llama.cpp's `format_oai_resp_sse`: `event:` and `data:` lines."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


def llama_cpp_responses_stream(outs: list[int], upto: int | None = None) -> bytes:
    """/v1/responses streamed as llama.cpp streams n_cmpl completions: each completion's
    `response.created` and `.in_progress` with its first token (`n_decoded == 1`), its deltas,
    interleaved, and its own `response.completed` with its usage, under its own response id;
    `upto`: only the events before completion `upto`'s terminal event and the rest."""
    out: list[bytes] = []
    for step in range(max(outs)):
        for i, n in enumerate(outs):
            rid = f"resp_{i}abc"
            if step == 0:
                head = {"id": rid, "object": "response", "status": "in_progress"}
                out.append(_resp_event("response.created", response=head))
                out.append(_resp_event("response.in_progress", response=head))
            if step < n:
                out.append(_resp_event("response.output_text.delta", item_id=f"msg_{i}", delta="x"))
            if step == n - 1:
                if upto == i:
                    return b"".join(out)
                item = {"type": "message", "status": "completed", "id": f"msg_{i}"}
                out.append(_resp_event("response.output_item.done", item=item))
                usage = {"input_tokens": 5, "output_tokens": n, "total_tokens": 5 + n}
                done = {"id": rid, "object": "response", "status": "completed", "model": SIM_MODEL}
                out.append(_resp_event("response.completed", response={**done, "usage": usage}))
    return b"".join(out)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "reference"])
def test_a_responses_stream_of_n_completions_is_measured_at_every_cut(fast: bool) -> None:
    """Three completions (40, 28, 33 tokens), each its own response. Before: the last terminal
    event's usage replaced the others' (5 in / 40 out for 101 generated), the stream `done` at
    the first one's end. Now each response's usage is added, the prompt once; while a response
    seen has not ended, the usage is unknown, never the ended ones' alone."""
    outs = ANSWERS[:3]
    data = llama_cpp_responses_stream(outs)
    for cut in range(0, len(data), 97):
        meter = open_stream(Endpoint.RESPONSES, choices=3, fast=fast)
        meter.feed(data[:cut])
        meter.feed(data[cut:])
        u = meter.finish()[1]
        assert (u.input_tokens, u.output_tokens, u.unknown_reason) == (5, sum(outs), None)
        assert u.finish_reasons == ("completed",) * 3 and meter.done
    # a client that left after the shortest completion's end: the others' output is unknown
    for upto in (0, 2):
        meter = open_stream(Endpoint.RESPONSES, choices=3, fast=fast)
        meter.feed(llama_cpp_responses_stream(outs, upto=upto))
        u = meter.usage_so_far()
        assert u.output_tokens is None and not meter.done, (upto, u)
    # vLLM's one response to a request with `n: 3` (a field it ignores): its usage, as before
    one = llama_cpp_responses_stream(outs[:1])
    meter = open_stream(Endpoint.RESPONSES, choices=3, fast=fast)
    meter.feed(one)
    u = meter.finish()[1]
    assert (u.input_tokens, u.output_tokens, u.unknown_reason) == (5, outs[0], None)
    # more responses than the request's choices: whose they are cannot be told
    meter = open_stream(Endpoint.RESPONSES, choices=2, fast=fast)
    meter.feed(data)
    assert meter.finish()[1].unknown_reason == "invalid_usage"


async def llama_cpp_responses(request: web.Request) -> web.StreamResponse:
    """/v1/responses with `n_cmpl`: streamed, each completion its own response events; not
    streamed, a JSON array of the responses (`res->ok(arr)`: OAI_RESP is merged by no one)."""
    obj = json.loads(await request.read())
    outs = _completions(obj)
    if not obj.get("stream"):
        usages = [{"input_tokens": 5, "output_tokens": n, "total_tokens": 5 + n} for n in outs]
        arr = [{"id": f"resp_{i}", "object": "response", "usage": u} for i, u in enumerate(usages)]
        return web.json_response(arr if len(arr) > 1 else arr[0])
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(llama_cpp_responses_stream(outs))
    return resp


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "body"])
async def test_n_cmpl_completions_on_llama_cpps_responses_route_are_billed(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, stream: bool
) -> None:
    """Streamed: before, 5 in / 40 out (the last terminal event's) was billed as measured for
    the 101 tokens three completions generated; now 5 / 101. Not streamed, llama.cpp answers a
    JSON array the sidecar does not read: unknown, charged the hold of three completions."""
    route = ("/v1/responses", llama_cpp_responses)
    run, db = await sim.start_fake(start_sidecar, aiohttp_server, tmp_path, route, **NAMED)
    body = {"model": SIM_MODEL, "input": "one two three four five", "max_output_tokens": 100}
    body |= {"n_cmpl": 3, "stream": stream}
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/v1/responses", json=body, headers={"X-Tollbooth-User": "pat"}) as r,
    ):
        assert r.status == 200
        await r.read()
    out = sum(ANSWERS[:3])
    rows = await _billed(run, db)
    spent = run.sc.budgets.store.spent["user:pat"]
    if stream:
        assert rows == [("pat", "/v1/responses", 5, out, pytest.approx(sim.token_cost(5, out)))]
        assert spent == to_micros(sim.token_cost(5, out))
    else:
        assert rows[0][2:4] == (None, None)
        assert spent >= to_micros(sim.token_cost(5, 3 * 100)), spent  # every completion's limit


def _result(index: object, evaluated: int, predicted: int) -> dict[str, object]:
    timings = {"cache_n": 0}
    out = {"content": "x", "tokens_evaluated": evaluated, "tokens_predicted": predicted}
    return {"index": index, **out, "stop": True, "stop_type": "limit", "timings": timings}


@pytest.mark.parametrize(
    ("indexes", "billed"),
    [([2, 0, 3, 1], (105, 18)), ([0, 1, 2, 3], (10, 18)), ([0, 0, 1, 1], (210, 18))],
    ids=["out_of_order", "as_the_indexes_say", "not_each_place_once"],
)
def test_n_cmpl_results_of_a_body_are_grouped_by_their_index(
    indexes: list[int], billed: tuple[int, int]
) -> None:
    """Two prompts (A: 100 tokens, B: 5), n_cmpl 2: llama.cpp numbers results prompt * n_cmpl +
    completion and puts that `index` in each (server-task.cpp `to_json_non_oaicompat`). A body
    listing them B0, A0, B1, A1 was grouped by list place, (B0, A0) and (B1, A1), each group's
    input its first's: 10 input tokens billed, not 105 (h-rev7). Grouped by index now; indexes
    that are not each place once group nothing (each result's own input: more, never fewer)."""
    sizes = [5, 100, 5, 100]  # the list: B, A, B, A
    body = [_result(i, e, p) for i, e, p in zip(indexes, sizes, [3, 4, 5, 6], strict=True)]
    u = usage_from_body(
        Endpoint.LLAMA_COMPLETION, json.dumps(body).encode(), {}, sequences=4, per_prompt=2
    )
    assert (u.input_tokens, u.output_tokens) == billed
