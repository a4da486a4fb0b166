"""The Anthropic Messages API through the sidecar, with the real `anthropic` SDK (issue 23).

The sidecar runs in front of the simulator's /v1/messages (vLLM's wire: lab's simulator/
anthropic.py). Guards: exact input, output and cached tokens per verified key in the metrics and
the ledger, for `messages.create`, `messages.stream` and `create(stream=True)`; Anthropic's
`input_tokens` excludes the cache's reads and writes, and no sum counts them twice;
`count_tokens` is free (forwarded, not metered, never charged, even on a spent budget); a key
identifies its principal sent as `x-api-key` or as `Authorization: Bearer`; the sidecar's
refusals arrive in Anthropic's error shape, as the SDK's own exception classes; a burst against
a small budget is held; a client that leaves mid-stream is billed what was measured.
"""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import pytest
import yaml
from tollbooth_lab.simulator import EngineParams, create_simulator

from tests.conftest import Running, StartSidecar
from tests.waiting import wait_for

MODEL = "sim-claude"
EP = "/v1/messages"
PRICES = {
    "models": {
        MODEL: {"input_per_1m": 1000.0, "cached_input_per_1m": 100.0, "output_per_1m": 2000.0}
    }
}
ALICE, BOB = "sk-ant-alice", "sk-ant-bob"
MSGS = [{"role": "user", "content": "one two three four five"}]
SYSTEM = [
    {
        "type": "text",
        "text": "a long shared system prompt " * 5,
        "cache_control": {"type": "ephemeral"},
    }
]


@pytest.fixture
async def sim(aiohttp_server: Any) -> str:
    server = await aiohttp_server(create_simulator("vllm", EngineParams(step_base_s=0.0005)))
    return str(server.make_url("")).rstrip("/")


@pytest.fixture
def keys(tmp_path: Path) -> str:
    path = tmp_path / "keys.yaml"
    entries = [
        {"sha256": hashlib.sha256(k.encode()).hexdigest(), "user": u}
        for k, u in ((ALICE, "alice"), (BOB, "bob"))
    ]
    path.write_text(yaml.safe_dump({"keys": entries}))
    return str(path)


@pytest.fixture
async def clients() -> AsyncIterator[Any]:
    made: list[anthropic.AsyncAnthropic] = []

    def make(run: Running, **auth: str) -> anthropic.AsyncAnthropic:
        client = anthropic.AsyncAnthropic(base_url=run.url, max_retries=0, **auth)
        made.append(client)
        return client

    yield make
    for c in made:
        await c.close()


async def start(
    start_sidecar: StartSidecar, sim: str, keys: str, tmp_path: Path, **extra: Any
) -> Running:
    config = {
        "pricing": PRICES,
        "identity": {"keys_file": keys},
        "ledger": {"path": str(tmp_path / "ledger.db"), "flush_interval_s": 0.05},
        **extra,
    }
    return await start_sidecar(config, upstream_url=sim)


def tokens(run: Running, user: str, kind: str) -> float | None:
    return run.value(
        "llm_tokens_total", model=MODEL, token_type=kind, api_endpoint=EP, user_id=user
    )


def cached(run: Running, user: str) -> float | None:
    return run.value("llm_cached_input_tokens_total", model=MODEL, api_endpoint=EP, user_id=user)


async def ledger(tmp_path: Path, n: int) -> list[tuple[Any, ...]]:
    def read() -> list[tuple[Any, ...]]:
        conn = sqlite3.connect(tmp_path / "ledger.db")
        try:
            return conn.execute(
                "SELECT user, endpoint, input_tokens, cached_input_tokens, output_tokens, "
                "cost_usd, status FROM requests ORDER BY rowid"
            ).fetchall()
        except sqlite3.OperationalError:  # not created yet
            return []
        finally:
            conn.close()

    await wait_for(lambda: len(read()) >= n, f"{n} ledger rows")
    return read()


async def test_create_is_metered_exactly_per_key_sent_either_way(
    start_sidecar: StartSidecar, sim: str, keys: str, tmp_path: Path, clients: Any
) -> None:
    run = await start(start_sidecar, sim, keys, tmp_path)
    by_header = clients(run, api_key=ALICE)  # x-api-key
    by_bearer = clients(run, auth_token=BOB)  # Authorization: Bearer
    a = await by_header.messages.create(model=MODEL, max_tokens=7, messages=MSGS)
    b = await by_bearer.messages.create(model=MODEL, max_tokens=3, messages=MSGS)
    assert a.usage.output_tokens == 7 and b.usage.output_tokens == 3
    assert a.usage.input_tokens == b.usage.input_tokens > 5
    assert tokens(run, "alice", "input") == a.usage.input_tokens
    assert tokens(run, "alice", "output") == 7
    assert tokens(run, "bob", "input") == b.usage.input_tokens
    assert tokens(run, "bob", "output") == 3
    assert cached(run, "alice") is None  # the server reported no cache: none is made up
    rows = await ledger(tmp_path, 2)
    n = a.usage.input_tokens
    assert rows == [
        ("alice", EP, n, None, 7, pytest.approx((n * 1000 + 7 * 2000) / 1e6), "200"),
        ("bob", EP, n, None, 3, pytest.approx((n * 1000 + 3 * 2000) / 1e6), "200"),
    ]


async def test_streams_are_metered_exactly(
    start_sidecar: StartSidecar, sim: str, keys: str, tmp_path: Path, clients: Any
) -> None:
    run = await start(start_sidecar, sim, keys, tmp_path)
    client = clients(run, api_key=ALICE)
    async with client.messages.stream(model=MODEL, max_tokens=6, messages=MSGS) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text and final.usage.output_tokens == 6
    events = await client.messages.create(model=MODEL, max_tokens=4, messages=MSGS, stream=True)
    kinds = []
    async for ev in events:
        kinds.append(ev.type)
        if ev.type == "message_start":
            streamed_input = ev.message.usage.input_tokens
        elif ev.type == "message_delta":
            streamed_output = ev.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert streamed_output == 4 and streamed_input == final.usage.input_tokens
    assert tokens(run, "alice", "input") == 2 * final.usage.input_tokens
    assert tokens(run, "alice", "output") == 6 + 4
    rows = await ledger(tmp_path, 2)
    assert [(r[2], r[4], r[6]) for r in rows] == [
        (streamed_input, 6, "200"),
        (streamed_input, 4, "200"),
    ]


async def test_cache_reads_and_writes_are_input_once_and_reads_are_cached(
    start_sidecar: StartSidecar, sim: str, keys: str, tmp_path: Path, clients: Any
) -> None:
    run = await start(start_sidecar, sim, keys, tmp_path)
    client = clients(run, api_key=ALICE)
    first = await client.messages.create(model=MODEL, max_tokens=2, system=SYSTEM, messages=MSGS)
    async with client.messages.stream(
        model=MODEL, max_tokens=2, system=SYSTEM, messages=MSGS
    ) as stream:
        second = await stream.get_final_message()
    written, rest = first.usage.cache_creation_input_tokens, first.usage.input_tokens
    read = second.usage.cache_read_input_tokens
    assert written and written == read and first.usage.cache_read_input_tokens == 0
    assert second.usage.input_tokens == rest  # Anthropic's input_tokens: the cache left out
    prompt = rest + written  # the whole prompt, each time
    count = await client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=MSGS)
    assert count.input_tokens == prompt
    assert tokens(run, "alice", "input") == 2 * prompt  # not 2 * prompt + read: no double count
    assert cached(run, "alice") == read
    rows = await ledger(tmp_path, 2)
    assert [(r[2], r[3]) for r in rows] == [(prompt, 0), (prompt, read)]
    # the cache read is priced at the cached price, the rest of the input at the input price
    assert rows[1][5] == pytest.approx((rest * 1000 + read * 100 + 2 * 2000) / 1e6)


async def test_count_tokens_is_free_even_on_a_spent_budget(
    start_sidecar: StartSidecar, sim: str, keys: str, tmp_path: Path, clients: Any
) -> None:
    run = await start(start_sidecar, sim, keys, tmp_path, budgets={"user_daily_usd": 0.001})
    client = clients(run, api_key=ALICE)
    with pytest.raises(anthropic.RateLimitError) as refused:
        await client.messages.create(model=MODEL, max_tokens=100, messages=MSGS)
    assert refused.value.body == {
        "type": "error",
        "error": {
            "type": "rate_limit_error",
            "message": refused.value.body["error"]["message"],
            "code": "budget_exceeded",
        },
    }
    counted = await client.messages.count_tokens(model=MODEL, messages=MSGS)
    assert counted.input_tokens > 5
    # none counted (the series may be published at 0 ahead: docs/metrics.md)
    assert not run.value("llm_requests_total", model=MODEL, api_endpoint=EP, status_code="200")
    assert run.value("llm_unmetered_requests_total", endpoint="/v1/messages/count_tokens") is None
    assert run.sc.budgets is not None and not run.sc.budgets.store.spent.get("user:alice")


async def test_refusals_arrive_as_the_sdks_own_errors(
    start_sidecar: StartSidecar, sim: str, keys: str, tmp_path: Path, clients: Any
) -> None:
    run = await start(start_sidecar, sim, keys, tmp_path, server={"max_request_body_bytes": 4096})
    with pytest.raises(anthropic.AuthenticationError) as unknown:
        await clients(run, api_key="sk-ant-nobody").messages.create(
            model=MODEL, max_tokens=5, messages=MSGS
        )
    assert unknown.value.body["type"] == "error"
    assert unknown.value.body["error"]["type"] == "authentication_error"
    # two keys, one in each header: which one pays is unclear (raw HTTP: the SDK sends one)
    body = {"model": MODEL, "max_tokens": 5, "messages": MSGS}
    both = {"x-api-key": ALICE, "Authorization": f"Bearer {BOB}"}
    async with aiohttp.ClientSession() as s, s.post(run.url + EP, json=body, headers=both) as r:
        assert r.status == 401
        assert (await r.json())["error"]["type"] == "authentication_error"
    client = clients(run, api_key=ALICE)
    with pytest.raises(anthropic.PermissionDeniedError) as unmetered:
        await client.post("/v1/messages/batches", body={"requests": []}, cast_to=object)
    assert unmetered.value.body["error"]["type"] == "permission_error"
    huge = [{"role": "user", "content": "x" * 5000}]
    with pytest.raises(anthropic.APIStatusError) as large:
        await client.messages.create(model=MODEL, max_tokens=5, messages=huge)
    assert large.value.status_code == 413
    assert large.value.body["error"]["type"] == "request_too_large"
    # an upstream's own error passes through as it came (the simulator's 400)
    with pytest.raises(anthropic.BadRequestError) as bad:
        await client.messages.create(model=MODEL, max_tokens=5, messages=[])
    assert bad.value.body["error"]["message"].startswith("messages:")
    assert not tokens(run, "alice", "input")  # none counted (absent, or published at 0)


async def test_a_burst_against_a_small_budget_is_held(
    start_sidecar: StartSidecar, sim: str, keys: str, tmp_path: Path, clients: Any
) -> None:
    # a character per token: the hold's prompt covers the simulator's chat template
    run = await start(
        start_sidecar,
        sim,
        keys,
        tmp_path,
        budgets={"user_daily_usd": 0.2},
        admission={"chars_per_token": 1.0},
    )
    client = clients(run, api_key=ALICE)

    async def one() -> int:
        try:
            await client.messages.create(model=MODEL, max_tokens=10, messages=MSGS)
        except anthropic.RateLimitError:
            return 429
        return 200

    statuses = await asyncio.gather(*(one() for _ in range(20)))
    assert 429 in statuses and 200 in statuses
    budgets = run.sc.budgets
    assert budgets is not None
    spent = budgets.store.spent["user:alice"]
    prompt = tokens(run, "alice", "input")
    assert prompt is not None
    per_request = (prompt / statuses.count(200) * 1000 + 10 * 2000) / 1e6
    assert spent == pytest.approx(statuses.count(200) * per_request * 1e6, abs=20)
    assert spent <= 0.2 * 1e6
    assert budgets.store.held == {"user:alice": 0}  # every hold settled


async def test_a_client_leaving_mid_stream_is_billed_what_was_measured(
    start_sidecar: StartSidecar, aiohttp_server: Any, keys: str, tmp_path: Path
) -> None:
    slow = await aiohttp_server(create_simulator("vllm", EngineParams(step_base_s=0.02)))
    run = await start(start_sidecar, str(slow.make_url("")).rstrip("/"), keys, tmp_path)
    body = {"model": MODEL, "max_tokens": 500, "messages": MSGS, "stream": True}
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + EP, json=body, headers={"x-api-key": ALICE}) as r,
    ):
        assert r.status == 200
        seen = b""
        while seen.count(b"content_block_delta") < 6:
            seen += await r.content.readany()
    (row,) = await ledger(tmp_path, 1)
    counted = await _count(str(slow.make_url("")).rstrip("/"))
    user, _, inp, _, out, cost, status = row
    # the prompt was measured (message_start); the output was not (it comes with message_delta)
    assert (user, inp, out, cost, status) == ("alice", counted, None, None, "499")
    assert tokens(run, "alice", "input") == counted
    assert not tokens(run, "alice", "output")  # none counted (absent, or published at 0)
    assert (
        run.value(
            "llm_usage_unknown_total", model=MODEL, api_endpoint=EP, reason="client_disconnected"
        )
        == 1
    )


async def _count(base: str) -> int:
    async with (
        aiohttp.ClientSession() as s,
        s.post(base + "/v1/messages/count_tokens", json={"model": MODEL, "messages": MSGS}) as r,
    ):
        return int((await r.json())["input_tokens"])


async def test_a_client_leaving_a_whole_answer_has_its_prompt_counted_by_count_tokens(
    start_sidecar: StartSidecar, aiohttp_server: Any, keys: str, tmp_path: Path
) -> None:
    # not streamed: nothing of the answer came, so the prompt is counted by the server's own
    # /v1/messages/count_tokens, with the client's key
    slow = await aiohttp_server(create_simulator("vllm", EngineParams(step_base_s=0.02)))
    base = str(slow.make_url("")).rstrip("/")
    run = await start(start_sidecar, base, keys, tmp_path)
    client = anthropic.AsyncAnthropic(base_url=run.url, api_key=ALICE, max_retries=0, timeout=0.3)
    try:
        with pytest.raises(anthropic.APITimeoutError):
            await client.messages.create(model=MODEL, max_tokens=60, messages=MSGS)
    finally:
        await client.close()
    (row,) = await ledger(tmp_path, 1)
    assert row[:5] == ("alice", EP, await _count(base), None, None) and row[6] == "499"
