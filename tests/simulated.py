"""Scaffolding shared by the tests of an engine's routes through the sidecar in front of the
simulator (llama.cpp, Ollama, SGLang, audio): start both with a ledger, read its rows, a client
that leaves mid-stream, and a burst against a small budget with what it must leave spent.
The assertions stay in each test; the checks here are the ones every such test makes alike.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from tollbooth_lab.simulator import EngineParams, create_simulator

from sidecar.billing.budget import to_micros
from tests.conftest import Running, StartSidecar
from tests.waiting import wait_for

# $0.001 an input token, $0.002 an output token: what these tests price the simulator's model at.
INPUT_PER_1M, OUTPUT_PER_1M = 1000.0, 2000.0


def prices(model: str) -> dict[str, Any]:
    """A pricing section with `model` at INPUT_PER_1M and OUTPUT_PER_1M."""
    return {"models": {model: {"input_per_1m": INPUT_PER_1M, "output_per_1m": OUTPUT_PER_1M}}}


def token_cost(input_tokens: int, output_tokens: int) -> float:
    """USD of a row's tokens at INPUT_PER_1M and OUTPUT_PER_1M."""
    return input_tokens * INPUT_PER_1M / 1e6 + output_tokens * OUTPUT_PER_1M / 1e6


async def start_simulated(
    start_sidecar: StartSidecar,
    aiohttp_server: Any,
    tmp_path: Path,
    prices: dict[str, Any],
    **config: Any,
) -> tuple[Running, Path]:
    """The simulator (vLLM's routes and every engine's own) and a sidecar in front of it,
    writing its ledger to a file under `tmp_path` (returned)."""
    up = await aiohttp_server(create_simulator("vllm", EngineParams(step_base_s=0.002)))
    return await _fronting(start_sidecar, up, tmp_path, pricing=prices, **config)


async def start_fake(
    start_sidecar: StartSidecar,
    aiohttp_server: Any,
    tmp_path: Path,
    route: tuple[str, Any],
    **config: Any,
) -> tuple[Running, Path]:
    """A sidecar configured with `config` and a ledger under `tmp_path` (returned), in front of
    a fake engine answering one `(path, handler)` POST route."""
    app = web.Application()
    app.router.add_post(*route)
    return await _fronting(start_sidecar, await aiohttp_server(app), tmp_path, **config)


async def _fronting(
    start_sidecar: StartSidecar, up: Any, tmp_path: Path, **config: Any
) -> tuple[Running, Path]:
    db = tmp_path / "ledger.db"
    run = await start_sidecar(
        {"ledger": {"path": str(db), "flush_interval_s": 0.05}, **config},
        upstream_url=str(up.make_url("")).rstrip("/"),
    )
    return run, db


def ledger_rows(db: Path, columns: str) -> list[tuple[Any, ...]]:
    """`SELECT columns FROM requests` in the order written; [] before the file exists."""
    if not db.exists():
        return []
    with sqlite3.connect(db) as conn:
        return conn.execute(f"SELECT {columns} FROM requests ORDER BY id").fetchall()


async def leave_mid_stream(
    run: Running,
    path: str,
    body: dict[str, Any],
    user: str,
    progress: Callable[[bytes], int | None],
    after: int = 3,
) -> int:
    """POST `body` as `user` and leave once `progress` (a line read: its running count, or None
    for a line that carries none) has reached `after`; the last count seen."""
    seen = 0
    async with aiohttp.ClientSession() as s:
        r = await s.post(run.url + path, json=body, headers={"X-Tollbooth-User": user})
        async for line in r.content:
            if (count := progress(line)) is not None:
                seen = count
                if seen >= after:
                    break
        r.close()  # the client leaves mid-generation
    return seen


async def burst(one: Callable[[], Awaitable[int]], n: int = 12) -> list[int]:
    """`n` requests at once, each made by `one` (its status)."""
    return list(await asyncio.gather(*(one() for _ in range(n))))


async def post_status(s: aiohttp.ClientSession, url: str, body: dict[str, Any], user: str) -> int:
    """A POST of a JSON body, read to its end: its status."""
    async with s.post(url, json=body, headers={"X-Tollbooth-User": user}) as r:
        await r.read()
        return r.status


async def assert_burst_held(
    run: Running,
    db: Path,
    columns: str,
    user: str,
    limit: float,
    statuses: list[int],
    cost: Callable[[tuple[Any, ...]], float],
) -> None:
    """Some of the burst served, some refused; every hold settled within `limit`, and the budget
    charged exactly what the served ones measured (`cost` of each served ledger row; `columns`
    ends with the status)."""
    assert 200 in statuses and 429 in statuses
    await wait_for(lambda: not run.sc.budgets.store.holds, "every hold settled")
    spent = run.sc.budgets.store.spent[f"user:{user}"]
    assert 0 < spent <= to_micros(limit)
    await wait_for(lambda: len(ledger_rows(db, columns)) == len(statuses), "every ledger row")
    served = [r for r in ledger_rows(db, columns) if r[-1] == "200"]
    assert len(served) == statuses.count(200)
    assert spent == to_micros(sum(cost(r) for r in served))


def sse_data(line: bytes) -> Any:
    """The JSON of an SSE `data:` line carrying an object; None for any other line."""
    return json.loads(line[6:]) if line.startswith(b"data: {") else None
