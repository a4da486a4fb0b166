"""Daily budgets (429 with Retry-After) and `tollbooth report` from a real ledger."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import openai
import pytest

from sidecar.billing.chargeback import build, render
from sidecar.billing.ledger import SCHEMA
from sidecar.billing.report import chargeback, parse_since, percentile
from tests.conftest import StartSidecar
from tests.fakes import MODEL

MSGS = [{"role": "user", "content": "one two three four five"}]
PRICES = {"models": {MODEL: {"input_per_1m": 10000.0, "output_per_1m": 10000.0}}}  # 1 cent/token


async def test_user_over_budget_gets_429_without_reaching_upstream(
    start_sidecar: StartSidecar, oai: object
) -> None:
    run = await start_sidecar({"pricing": PRICES, "budgets": {"user_daily_usd": 0.15}})
    client = oai(run)  # type: ignore[operator]
    hdr = {"X-Tollbooth-User": "carol"}
    await client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=5, extra_headers=hdr
    )  # holds $0.11 (6 estimated prompt tokens + 5), spends $0.10
    # no max_tokens: the hold is 6 + 4096 tokens, more than the $0.05 left
    sent_before = len(run.upstream.seen)
    with pytest.raises(openai.RateLimitError) as err:
        await client.chat.completions.create(model=MODEL, messages=MSGS, extra_headers=hdr)
    assert len(run.upstream.seen) == sent_before
    assert err.value.body["code"] == "budget_exceeded"
    assert err.value.body["type"] == "budget_exceeded"
    retry_after = int(err.value.response.headers["Retry-After"])
    assert 0 < retry_after <= 86400
    assert run.value("llm_budget_rejections_total", scope="user") == 1
    # another user is not affected
    await client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=1, extra_headers={"X-Tollbooth-User": "dave"}
    )


async def test_global_budget_and_per_user_override(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar(
        {
            "pricing": PRICES,
            "budgets": {"global_daily_usd": 0.5, "user_daily_usd": 0.01, "users": {"vip": 1.0}},
        }
    )
    async with aiohttp.ClientSession() as s:
        statuses = []
        for _ in range(6):
            async with s.post(
                run.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": MSGS, "max_tokens": 5},
                headers={"X-Tollbooth-User": "vip"},
            ) as r:
                statuses.append(r.status)
    # each holds $0.11 and spends $0.10: the 5th would hold $0.40 + $0.11 > $0.50
    assert statuses == [200] * 4 + [429, 429]
    assert run.value("llm_budget_rejections_total", scope="global") == 2


def make_ledger(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.executescript(SCHEMA)
    now = time.time()
    rows = [
        (
            now - 10,
            "a",
            None,
            "m1",
            "/v1/chat/completions",
            "alice",
            10,
            0,
            5,
            0.5,
            "200",
            0,
            None,
            None,
            1.0,
            None,
        ),
        (
            now - 20,
            "b",
            None,
            "m1",
            "/v1/chat/completions",
            "alice",
            10,
            0,
            5,
            0.25,
            "200",
            1,
            0.0,
            0.1,
            3.0,
            None,
        ),
        (
            now - 30,
            "c",
            None,
            "m2",
            "/v1/completions",
            "bob",
            7,
            0,
            None,
            None,
            "200",
            1,
            None,
            None,
            2.0,
            None,
        ),
        (
            now - 90000,
            "d",
            None,
            "m1",
            "/v1/chat/completions",
            "old",
            1,
            0,
            1,
            9.0,
            "200",
            0,
            None,
            None,
            1.0,
            None,
        ),
    ]
    conn.executemany(
        "INSERT INTO requests (ts, request_id, trace_id, model, endpoint, user, "
        "input_tokens, cached_input_tokens, output_tokens, cost_usd, status, stream, "
        "queue_s, ttft_s, duration_s, error) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        rows,
    )
    conn.commit()
    conn.close()


def test_report_groups_and_marks_unknown(tmp_path: Path) -> None:
    db = tmp_path / "l.db"
    make_ledger(db)
    by_user = chargeback(str(db), parse_since("24h"), "user")
    assert by_user == [
        {
            "user": "alice",
            "requests": 2,
            "input_tokens": 20,
            "output_tokens": 10,
            "cost_usd": 0.75,
            "unknown_cost_requests": 0,
            "unknown_token_requests": 0,
            "device_seconds": None,
            "device_cost_usd": None,
            "p50_duration_s": 1.0,
            "p99_duration_s": 3.0,
        },
        {
            "user": "bob",
            "requests": 1,
            "input_tokens": 7,
            "output_tokens": 0,
            "cost_usd": None,
            "unknown_cost_requests": 1,
            "unknown_token_requests": 1,
            "device_seconds": None,
            "device_cost_usd": None,
            "p50_duration_s": 2.0,
            "p99_duration_s": 2.0,
        },
    ]
    by_model = chargeback(str(db), parse_since("7d"), "model")
    assert [r["model"] for r in by_model] == ["m1", "m2"]
    assert by_model[0]["cost_usd"] == 9.75
    table = render(build(str(db), parse_since("24h"), None, "user"), "table")
    assert "unknown" in table and "$0.7500" in table
    assert "0.0000" not in table.splitlines()[2]  # bob's unknown cost is not shown as zero


def test_report_cli_json_and_csv(tmp_path: Path) -> None:
    db = tmp_path / "l.db"
    make_ledger(db)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar.core.cli",
            "report",
            "--ledger",
            str(db),
            "--since",
            "24h",
            "--by",
            "day",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    days = json.loads(out.stdout)
    assert len(days) == 1 and days[0]["requests"] == 3 and days[0]["cost_usd"] is None
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar.core.cli",
            "report",
            "--ledger",
            str(db),
            "--by",
            "user",
            "--format",
            "csv",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("user,requests,input_tokens")
    assert lines[2].split(",")[4] == ""  # bob's cost: empty, not 0


def test_since_and_percentile() -> None:
    assert parse_since("2h", now=10000.0) == 10000.0 - 7200
    with pytest.raises(ValueError):
        parse_since("yesterday")
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
