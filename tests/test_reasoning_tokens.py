"""Reasoning tokens: read from OpenAI-style usage, exported as their own token type (a part of
the output, never added to it), in the ledger, and priced at the output price unless the model
sets a reasoning price. Through the real openai SDK against the simulator."""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from tollbooth_lab.simulator import EngineParams, create_simulator

from sidecar.billing.ledger import connect
from sidecar.config import ModelPrice
from sidecar.exchange import Endpoint
from sidecar.metering.counts import INVALID_USAGE
from sidecar.metering.openai import read_usage
from sidecar.metering.pricing import compute
from tests.conftest import Running, StartSidecar

FAST = EngineParams(step_base_s=0.0005, prefill_s_per_token=0.0, decode_s_per_seq=0.00001)
MODEL = "sim-llama-3-8b"
USER = "key-" + hashlib.sha256(b"k").hexdigest()[:12]
PRICE = {"input_per_1m": 1.0, "output_per_1m": 2.0, "reasoning_per_1m": 10.0}


def tokens(run: Running, kind: str) -> float | None:
    return run.value(
        "llm_tokens_total",
        model=MODEL,
        token_type=kind,
        api_endpoint="/v1/chat/completions",
        user_id=USER,
    )


def output_cost(run: Running) -> float | None:
    return run.value(
        "llm_cost_usd_total",
        model=MODEL,
        token_type="output",
        api_endpoint="/v1/chat/completions",
        user_id=USER,
    )


async def wait_for(run: Running, name: str, **labels: str) -> None:
    for _ in range(250):
        if run.value(name, **labels):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{name} {labels} never came")


async def ledger_rows(path: Path, want: int) -> list[tuple[Any, ...]]:
    for _ in range(250):
        if path.exists():
            with sqlite3.connect(path) as conn:
                rows = conn.execute(
                    "SELECT output_tokens, reasoning_tokens FROM requests ORDER BY id"
                ).fetchall()
            if len(rows) >= want:
                return rows
        await asyncio.sleep(0.02)
    raise AssertionError("the ledger rows never came")


async def start(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, *, reasoning: bool
) -> Running:
    sim = await aiohttp_server(create_simulator("vllm", FAST, reasoning=reasoning))
    return await start_sidecar(
        {
            "pricing": {"models": {MODEL: PRICE}},
            "ledger": {"path": str(tmp_path / "ledger.db"), "flush_interval_s": 0.05},
        },
        upstream_url=str(sim.make_url("")).rstrip("/"),
    )


async def test_a_reasoning_models_answer_is_metered_ledgered_and_priced(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    run = await start(start_sidecar, aiohttp_server, tmp_path, reasoning=True)
    async with openai.AsyncOpenAI(base_url=run.url + "/v1", api_key="k", max_retries=0) as c:
        r = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "think"}], max_tokens=9
        )
    assert r.usage is not None and r.usage.completion_tokens_details is not None
    out = r.usage.completion_tokens
    reasoning = r.usage.completion_tokens_details.reasoning_tokens
    assert out >= 2 and reasoning == out // 2  # the client got the server's usage, untouched
    await wait_for(run, "llm_requests_total", model=MODEL, api_endpoint=Endpoint.CHAT.value,
                   status_code="200")  # fmt: skip
    assert tokens(run, "output") == out  # reasoning is inside the output, not added to it
    assert tokens(run, "reasoning") == reasoning
    assert tokens(run, "input") == r.usage.prompt_tokens
    want = ((out - reasoning) * 2.0 + reasoning * 10.0) / 1e6
    assert output_cost(run) == pytest.approx(want, rel=1e-12)
    assert await ledger_rows(tmp_path / "ledger.db", 1) == [(out, reasoning)]


async def test_an_include_usage_stream_asking_for_reasoning_is_metered(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    run = await start(start_sidecar, aiohttp_server, tmp_path, reasoning=False)
    async with openai.AsyncOpenAI(base_url=run.url + "/v1", api_key="k", max_retries=0) as c:
        plain = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=6
        )
        assert plain.usage is not None and plain.usage.completion_tokens_details is None
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "think harder"}],
            max_tokens=12,
            reasoning_effort="low",
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = [ch.usage async for ch in stream if ch.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens_details is not None
    out, reasoning = usage[0].completion_tokens, usage[0].completion_tokens_details.reasoning_tokens
    assert reasoning == out // 2 and reasoning >= 1
    rows = await ledger_rows(tmp_path / "ledger.db", 2)
    assert rows == [(plain.usage.completion_tokens, None), (out, reasoning)]  # not reported: NULL
    assert tokens(run, "reasoning") == reasoning
    assert tokens(run, "output") == plain.usage.completion_tokens + out
    want = (plain.usage.completion_tokens * 2.0 + (out - reasoning) * 2.0 + reasoning * 10.0) / 1e6
    assert output_cost(run) == pytest.approx(want, rel=1e-12)


def test_responses_and_chat_details_are_read_and_range_checked() -> None:
    u = read_usage(
        {"input_tokens": 5, "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 3}},
        Endpoint.RESPONSES,
    )
    assert (u.input_tokens, u.output_tokens, u.reasoning_tokens) == (5, 7, 3)
    chat = {"prompt_tokens": 5, "completion_tokens": 7}
    for bad in (8, -1, True, 1.5, "3", 10**10):  # more than the output, or no count
        u = read_usage({**chat, "completion_tokens_details": {"reasoning_tokens": bad}},
                       Endpoint.CHAT)  # fmt: skip
        assert u.unknown_reason == INVALID_USAGE and u.output_tokens is None, bad
    absent = read_usage({**chat, "completion_tokens_details": None}, Endpoint.CHAT)
    assert absent.reasoning_tokens is None and absent.output_tokens == 7
    full = read_usage({**chat, "completion_tokens_details": {"reasoning_tokens": 7}}, Endpoint.CHAT)
    assert full.reasoning_tokens == 7 and full.unknown_reason is None


def test_reasoning_is_priced_as_output_unless_the_model_sets_its_own_price() -> None:
    plain = ModelPrice(input_per_1m=1.0, output_per_1m=2.0)
    assert compute(plain, 10, None, 100, 40).output_usd == pytest.approx(200 / 1e6)
    own = ModelPrice(input_per_1m=1.0, output_per_1m=2.0, reasoning_per_1m=5.0)
    assert compute(own, 10, None, 100, 40).output_usd == pytest.approx((60 * 2 + 40 * 5) / 1e6)
    assert compute(own, 10, None, 100, None).output_usd == pytest.approx(200 / 1e6)
    # a reasoning count above the output (never read: range-checked) cannot make a cost negative
    assert compute(own, 0, None, 10, 50).output_usd == pytest.approx(50 / 1e6)


def test_an_old_sqlite_ledger_gets_the_reasoning_column(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as old:  # a ledger written before the column existed
        old.execute(
            "CREATE TABLE requests (id INTEGER PRIMARY KEY, ts REAL NOT NULL, request_id TEXT "
            "NOT NULL, trace_id TEXT, model TEXT NOT NULL, endpoint TEXT NOT NULL, user TEXT NOT "
            "NULL, input_tokens INTEGER, cached_input_tokens INTEGER, output_tokens INTEGER, "
            "cost_usd REAL, status TEXT NOT NULL, stream INTEGER NOT NULL, queue_s REAL, ttft_s "
            "REAL, duration_s REAL, error TEXT)"
        )
        old.execute(
            "INSERT INTO requests (ts, request_id, model, endpoint, user, status, stream) "
            "VALUES (1, 'r', 'm', '/v1/chat/completions', 'u', '200', 0)"
        )
    conn = connect(path)
    try:
        cols = {row[1] for row in conn.execute("PRAGMA table_info(requests)")}
        assert "reasoning_tokens" in cols
        assert conn.execute("SELECT reasoning_tokens FROM requests").fetchall() == [(None,)]
    finally:
        conn.close()


def test_an_old_fleet_ledger_gets_the_column_and_the_count_is_shipped(
    postgres: Any, tmp_path: Path
) -> None:
    import psycopg

    from sidecar.billing import ledger as sqlite_ledger
    from sidecar.billing.fleet_ledger import REQUEST_COLUMNS, Shipper
    from sidecar.config import LedgerConfig
    from sidecar.telemetry.metrics import Metrics

    url = postgres.database()
    old = {c: t for c, t in REQUEST_COLUMNS.items() if c != "reasoning_tokens"}
    with psycopg.connect(url) as pg:  # a fleet ledger made before the column existed
        pg.execute(
            "CREATE TABLE requests (source TEXT NOT NULL, seq BIGINT NOT NULL, "
            + ", ".join(f'"{c}" {t}' for c, t in old.items())
            + ", PRIMARY KEY (source, seq))"
        )
    path = tmp_path / "outbox.db"
    conn = sqlite_ledger.connect(path)
    with conn:
        row = dict.fromkeys(sqlite_ledger.Row._fields)
        row.update(ts=time.time(), request_id="r", model="m", endpoint="/v1/chat/completions")
        row.update(user="u", status="200", stream=0, output_tokens=9, reasoning_tokens=4)
        conn.execute(sqlite_ledger.INSERT, tuple(row.values()))
    conn.close()
    shipper = Shipper(LedgerConfig(path=str(path), postgres_url=url, ship_interval_s=3600.0),
                      Metrics())  # fmt: skip
    shipper.open()
    try:
        assert shipper.ship() == 1
    finally:
        shipper.close()
    with psycopg.connect(url) as pg:
        got = pg.execute("SELECT output_tokens, reasoning_tokens FROM requests").fetchall()
    assert got == [(9, 4)]
