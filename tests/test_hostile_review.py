"""Breaks found by the hostile review after issue 21's fixes: each test failed on main (ebea3b5).

TGI's `parameters.best_of` (router/src/server.rs `generate_internal`): a non-streaming /generate,
`/` or /vertex request with `best_of: N > 1` runs N generations (`generate_best_of`), but answers
`x-generated-tokens` (and `details.generated_tokens`) for the best one only; the others appear
only in `details.best_of_sequences`, when the client asked for details. Held and charged as one
sequence, N-1 of them were free (TGI caps N with `--max-best-of`, 2 by default).
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from sidecar.exchange import Endpoint
from sidecar.metering.wire import inspect_request, usage_from_body


def info(endpoint: Endpoint, body: dict[str, Any]) -> Any:
    return inspect_request(endpoint, json.dumps(body).encode(), inject_usage=False, api="tgi")


@pytest.mark.parametrize("endpoint", [Endpoint.TGI_GENERATE, Endpoint.TGI_COMPAT])
def test_best_of_is_held_as_that_many_sequences(endpoint: Endpoint) -> None:
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 100, "best_of": 3}}
    assert info(endpoint, body).choices == 3


def test_best_of_on_a_stream_is_refused_by_tgi_so_held_as_one() -> None:
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 100, "best_of": 3}}
    assert info(Endpoint.TGI_GENERATE_STREAM, body).choices == 1


@pytest.mark.parametrize("best_of", [None, 1, 0, "3", 2.0, True, -4])
def test_only_an_integer_best_of_above_one_adds_sequences(best_of: object) -> None:
    """serde reads `Option<usize>`: a JSON integer; TGI refuses anything else (422)."""
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 100, "best_of": best_of}}
    assert info(Endpoint.TGI_GENERATE, body).choices == 1


def test_vertex_holds_each_instance_best_of() -> None:
    body = {
        "instances": [
            {"inputs": "a", "parameters": {"max_new_tokens": 10, "best_of": 2}},
            {"inputs": "b", "parameters": {"max_new_tokens": 10}},
        ]
    }
    assert info(Endpoint.TGI_VERTEX, body).choices == 3


def _answer(best_of_sequences: object) -> bytes:
    details: dict[str, Any] = {"finish_reason": "length", "generated_tokens": 10}
    if best_of_sequences is not None:
        details["best_of_sequences"] = best_of_sequences
    return json.dumps({"generated_text": "x", "details": details}).encode()


HEADERS = {"x-prompt-tokens": "5", "x-generated-tokens": "10"}


def test_best_of_output_is_every_sequence_generated() -> None:
    seqs = [{"generated_text": "y", "finish_reason": "length", "generated_tokens": 7}]
    usage = usage_from_body(Endpoint.TGI_GENERATE, _answer(seqs), HEADERS, sequences=2)
    assert (usage.input_tokens, usage.output_tokens, usage.unknown_reason) == (5, 17, None)


@pytest.mark.parametrize(
    "seqs",
    [
        None,  # no details asked: the others are not reported at all
        [],
        [{"generated_tokens": -7}],
        [{"generated_tokens": 10**30}],
        [{"generated_tokens": "7"}],
        ["seq"],
        [{"generated_tokens": 7}, {"generated_tokens": 7}],  # more than were asked for
    ],
)
def test_best_of_output_not_reported_for_every_sequence_is_unknown(seqs: object) -> None:
    """Not measured, so not a count: the budget charges at least the hold (N sequences)."""
    usage = usage_from_body(Endpoint.TGI_GENERATE, _answer(seqs), HEADERS, sequences=2)
    assert usage.output_tokens is None
    assert usage.unknown_reason is not None
    assert usage.input_tokens == 5  # the prompt was measured


def test_one_sequence_reads_as_before() -> None:
    usage = usage_from_body(Endpoint.TGI_GENERATE, _answer(None), HEADERS)
    assert (usage.input_tokens, usage.output_tokens, usage.unknown_reason) == (5, 10, None)


# --- an output count the request could not have produced ------------------------------------------
# The hostile upstream answered `"completion_tokens": 7, "completion_tokens": 900000000` (JSON
# readers keep the last) to a request with max_tokens 5: under the 10^9 ceiling, so it was read
# as measured, $90,000 charged to the user and the global budget drained for everyone else. The
# server stops at the limit it reads (the table in docs/budgets.md), so more is no measurement.


@pytest.mark.parametrize("streaming", [False, True])
async def test_more_output_than_the_request_allows_is_invalid_usage(
    start_sidecar: Any, aiohttp_server: Any, tmp_path: Any, streaming: bool
) -> None:
    from sidecar.metering.counts import INVALID_USAGE
    from tests.test_hostile_numbers import MODEL, PRICES, Hostile, ledger_rows, wait_for

    hostile = Hostile()
    up = await aiohttp_server(hostile.app)
    db = tmp_path / "ledger.db"
    run = await start_sidecar(
        {
            "pricing": PRICES,  # $0.001 a token
            "budgets": {"user_daily_usd": 1.0, "global_daily_usd": 2.0},
            "ledger": {"path": str(db), "flush_interval_s": 0.05},
        },
        upstream_url=str(up.make_url("")).rstrip("/"),
    )
    msg = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    async with aiohttp.ClientSession() as s:
        for user, completion in (("eve", "900000000"), ("eve", "10"), ("bob", "10")):
            hostile.completion = completion
            req = {**msg, "stream": streaming, "n": 1}
            if streaming:
                req["stream_options"] = {"include_usage": True}
            headers = {"X-Tollbooth-User": user}
            async with s.post(run.url + "/v1/chat/completions", json=req, headers=headers) as r:
                assert r.status == 200, await r.text()  # not refused: no budget drained
                assert completion.encode() in await r.read()  # the client gets what was sent
    await wait_for(lambda: len(ledger_rows(db)) == 3, "every ledger row")
    bad, good, other = ledger_rows(db)
    assert bad == (None, None, None)
    assert good == other == (5, 10, pytest.approx(0.015))
    labels = {"model": MODEL, "api_endpoint": "/v1/chat/completions", "reason": INVALID_USAGE}
    assert run.value("llm_usage_unknown_total", **labels) == 1


@pytest.mark.parametrize("streaming", [False, True])
async def test_reasoning_tokens_of_an_output_beyond_the_limit_are_not_counted(
    start_sidecar: Any, aiohttp_server: Any, tmp_path: Any, streaming: bool
) -> None:
    """The usage an output beyond the request's limit made invalid kept its reasoning count:
    800,000,000 reasoning tokens were added to llm_tokens_total and written to the ledger
    for a request that asked for 10 tokens at most."""
    import sqlite3

    from tests.test_hostile_numbers import MODEL, PRICES, Hostile, wait_for

    hostile = Hostile()
    hostile.completion = '900000000, "completion_tokens_details": {"reasoning_tokens": 800000000}'
    up = await aiohttp_server(hostile.app)
    db = tmp_path / "ledger.db"
    run = await start_sidecar(
        {"pricing": PRICES, "ledger": {"path": str(db), "flush_interval_s": 0.05}},
        upstream_url=str(up.make_url("")).rstrip("/"),
    )
    req: dict[str, Any] = {"model": MODEL, "messages": [], "max_tokens": 10, "stream": streaming}
    if streaming:
        req["stream_options"] = {"include_usage": True}
    url = run.url + "/v1/chat/completions"
    async with aiohttp.ClientSession() as s, s.post(url, json=req) as r:
        assert r.status == 200, await r.text()
        assert b"800000000" in await r.read()  # the client gets what was sent

    def rows() -> list[tuple[Any, ...]]:
        with sqlite3.connect(db) as conn:
            sql = "SELECT input_tokens, output_tokens, reasoning_tokens FROM requests"
            return conn.execute(sql).fetchall()

    await wait_for(lambda: len(rows()) == 1, "the ledger row")
    assert rows() == [(None, None, None)]
    tokens = {"model": MODEL, "api_endpoint": "/v1/chat/completions", "user_id": "anonymous"}
    assert run.value("llm_tokens_total", token_type="reasoning", **tokens) is None
    assert run.value("llm_tokens_total", token_type="output", **tokens) is None


def test_output_within_the_limit_times_the_choices_is_a_count() -> None:
    from sidecar.metering.wire import within_request

    chat = inspect_request(
        Endpoint.CHAT,
        json.dumps({"messages": [], "max_tokens": 10, "n": 3}).encode(),
        inject_usage=False,
    )
    from sidecar.exchange import Usage

    assert within_request(Usage(input_tokens=1, output_tokens=30), chat).output_tokens == 30
    over = within_request(Usage(input_tokens=1, output_tokens=31), chat)
    assert (over.input_tokens, over.output_tokens, over.unknown_reason) == (
        None,
        None,
        "invalid_usage",
    )
    unlimited = inspect_request(Endpoint.CHAT, b'{"messages": []}', inject_usage=False)
    big = Usage(input_tokens=1, output_tokens=10**9)
    assert within_request(big, unlimited) == big  # no limit read: any count under the ceiling


@pytest.mark.parametrize(
    ("endpoint", "body", "api", "out"),
    [
        # an older vLLM reads max_tokens only: its 4000 tokens are measured, never made free
        (Endpoint.CHAT, {"max_completion_tokens": 1, "max_tokens": 4000}, "vllm", 4000),
        # a 0 another server may read as "no limit": no cap
        (Endpoint.CHAT, {"max_completion_tokens": 0, "max_tokens": 5}, "vllm", 900),
        (Endpoint.CHAT, {"max_completion_tokens": "x", "max_tokens": 5}, "vllm", 900),
        # the route reads none of the fields sent: the server's own default applies, no cap
        (Endpoint.COMPLETIONS, {"max_completion_tokens": 5}, "vllm", 900),
        # Ollama's /v1/chat/completions reads max_tokens only: a chat without it has no cap
        (Endpoint.CHAT, {"max_completion_tokens": 5}, "vllm", 900),
        (Endpoint.CHAT, {"max_completion_tokens": 5, "max_tokens": None}, "vllm", 900),
        (Endpoint.CHAT, {"max_completion_tokens": 5}, "tgi", 900),
        (Endpoint.TGI_GENERATE, {"max_tokens": 5, "parameters": {}}, "tgi", 900),
    ],
)
def test_output_a_server_may_have_been_asked_for_stays_measured(
    endpoint: Endpoint, body: dict[str, Any], api: str, out: int
) -> None:
    from sidecar.exchange import Usage
    from sidecar.metering.wire import within_request

    req = inspect_request(endpoint, json.dumps(body).encode(), inject_usage=False, api=api)
    usage = Usage(input_tokens=1, output_tokens=out)
    assert within_request(usage, req) == usage
