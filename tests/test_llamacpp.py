"""llama.cpp's native /completion and /infill metered (issue 23), over raw HTTP.

The wire shapes are those of llama.cpp's tools/server/server-task.cpp (`to_json_non_oaicompat` of
the partial and the final result) and tools/server/README.md: running counts on every streamed
event, totals on the `stop: true` one, no [DONE], `:` keep-alive lines; `tokens_cached` is the
slot's cache after the request (prompt + output), so cached input is `timings.cache_n`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar.exchange import Endpoint
from sidecar.metering.wire import inspect_request, open_stream, usage_from_body
from sidecar.proxy.routes import classify
from tests import simulated as sim
from tests.conftest import Running, StartSidecar
from tests.waiting import wait_for

SIM_MODEL = "sim-llama-3-8b"
PRICES = sim.prices(SIM_MODEL)

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
    ],
)
def test_the_limit_is_read_as_llama_cpp_reads_it(body: dict[str, Any], limit: int | None) -> None:
    info = inspect_request(Endpoint.LLAMA_COMPLETION, json.dumps(body).encode(), inject_usage=True)
    assert info.max_tokens == limit
    assert info.output_cap == limit  # no cap where the server reads no limit
    assert info.body == json.dumps(body).encode()  # never changed


def test_several_prompts_are_several_results() -> None:
    body = json.dumps({"prompt": ["a", "b", [1, 2]], "n_predict": 4}).encode()
    assert inspect_request(Endpoint.LLAMA_COMPLETION, body, inject_usage=False).choices == 3
    ids = json.dumps({"prompt": [1, 2, 3], "n_predict": 4}).encode()
    assert inspect_request(Endpoint.LLAMA_COMPLETION, ids, inject_usage=False).choices == 1


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
