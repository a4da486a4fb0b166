"""A fleet of sidecars sharing budgets through a real redis-server and a ledger in a real
PostgreSQL: bursts spread over processes, a sidecar killed while holding reservations, Redis
emptied mid-day, and Redis stopped under each `budgets.store_unavailable`."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar.billing import redis_store as budget_redis
from sidecar.billing.budget import DAY
from sidecar.billing.redis_scripts import day_keys
from sidecar.billing.report import chargeback
from tests.conftest import StartSidecar
from tests.procs import Tollbooth, start_tollbooth
from tests.test_fleet_ledger import MSGS, PRICES, fleet_ledger, send, shipped

TODAY = int(time.time() // DAY * DAY)


def spent(redis_server: Any, scope: str = "user:eve") -> int:
    return int(redis_server.client().hget(day_keys(TODAY)[0], scope) or 0)


def held(redis_server: Any, scope: str = "user:eve") -> int:
    return int(redis_server.client().hget(day_keys(TODAY)[1], scope) or 0)


async def until(check: Any, what: str, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def process_config(
    tmp: Path, i: int, upstream: str, redis_url: str, pg_url: str, **budgets: Any
) -> dict[str, Any]:
    return {
        "upstream": {"url": upstream},
        "pricing": PRICES,
        "budgets": {"store": redis_url, "store_timeout_s": 0.5, **budgets},
        "ledger": fleet_ledger(tmp, pg_url, str(i)),
        "gpu": {"enabled": False},
        "audit": {"path": str(tmp / f"audit-{i}.jsonl")},
        "logging": {"access_log": "off"},
    }


async def fleet(
    tmp: Path, n: int, upstream: Any, redis_server: Any, pg_url: str, **budgets: Any
) -> list[Tollbooth]:
    up = str(upstream[1].make_url("")).rstrip("/")
    return list(
        await asyncio.gather(
            *(
                start_tollbooth(
                    tmp, process_config(tmp, i, up, redis_server.url, pg_url, **budgets)
                )
                for i in range(n)
            )
        )
    )


async def stop(procs: list[Tollbooth]) -> None:
    await asyncio.gather(*(p.stop(signal.SIGTERM) for p in procs))


async def test_a_burst_spread_over_sidecars_stays_within_the_budget_and_the_report_has_it_all(
    upstream: Any, redis_server: Any, postgres: Any, tmp_path: Path
) -> None:
    pg = postgres.database()
    procs = await fleet(tmp_path, 3, upstream, redis_server, pg, user_daily_usd=0.2)
    try:
        async with aiohttp.ClientSession() as s:

            async def one(i: int) -> int:
                # every stream holds (7 + 10) x $0.001 and spends (5 + 10) x $0.001; all with
                # the same X-Request-Id, which neither shares a hold nor merges ledger rows
                headers = {"X-Tollbooth-User": "eve", "X-Fake": "slow-stream"}
                headers["X-Request-Id"] = "dup"
                body = {"model": "fake/llama-3-8b", "messages": MSGS, "max_tokens": 10}
                body["stream"] = True
                url = procs[i % 3].url + "/v1/chat/completions"
                async with s.post(url, json=body, headers=headers) as r:
                    await r.read()
                    return r.status

            statuses = await asyncio.gather(*(one(i) for i in range(30)))
        admitted = statuses.count(200)
        assert statuses.count(429) == 30 - admitted
        # every request has an output limit: the documented overshoot is zero
        assert 11 <= admitted <= 13  # 11 x $0.017 at once; more if the first ones ended
        await until(lambda: held(redis_server) == 0, "every hold settled")
        assert spent(redis_server) == admitted * 15_000 <= 200_000
        await shipped(pg, 30)
        report = chargeback(pg, 0, "user")  # the groups of `tollbooth report --ledger URL`
        assert report == [
            {
                "user": "eve",
                "requests": 30,
                "input_tokens": admitted * 5,
                "output_tokens": admitted * 10,
                "cost_usd": pytest.approx(admitted * 0.015),
                "unknown_cost_requests": 0,
                "unknown_token_requests": 30 - admitted,
                "device_seconds": None,
                "device_cost_usd": None,
                "p50_duration_s": report[0]["p50_duration_s"],
                "p99_duration_s": report[0]["p99_duration_s"],
            }
        ]
    finally:
        await stop(procs)


async def test_a_killed_sidecars_holds_are_charged_when_their_lease_ends(
    start_sidecar: StartSidecar, upstream: Any, redis_server: Any, postgres: Any, tmp_path: Path
) -> None:
    pg = postgres.database()
    budgets = {"user_daily_usd": 1.0, "lease_s": 1.0}
    (a,) = await fleet(tmp_path, 1, upstream, redis_server, pg, **budgets)
    b = await start_sidecar({"pricing": PRICES, "budgets": {"store": redis_server.url, **budgets}})
    try:
        async with aiohttp.ClientSession() as s:

            async def hang() -> None:
                body = {"model": "fake/llama-3-8b", "messages": MSGS, "max_tokens": 10}
                headers = {"X-Tollbooth-User": "eve", "X-Fake": "sleep:4"}
                async with s.post(a.url + "/v1/chat/completions", json=body, headers=headers):
                    pass

            requests = [asyncio.create_task(hang()) for _ in range(3)]
            await until(lambda: held(redis_server) == 3 * 17_000, "three holds")
            await a.stop(signal.SIGKILL)
            assert spent(redis_server) == 0
            # `b` sweeps every lease/3: the holds are charged in full once their lease ends
            await until(lambda: spent(redis_server) == 3 * 17_000, "the holds charged", 5.0)
            assert held(redis_server) == 0
            await asyncio.gather(*requests, return_exceptions=True)
        assert b.value("llm_budget_holds_expired_total") == 3
    finally:
        await stop([a])


async def test_redis_emptied_mid_day_does_not_reset_anyones_spend(
    start_sidecar: StartSidecar, redis_server: Any, postgres: Any, tmp_path: Path
) -> None:
    pg = postgres.database()

    def config(name: str) -> dict[str, Any]:
        budgets = {"store": redis_server.url, "user_daily_usd": 0.05, "global_daily_usd": 1.0}
        return {"pricing": PRICES, "budgets": budgets, "ledger": fleet_ledger(tmp_path, pg, name)}

    a, b = await start_sidecar(config("a")), await start_sidecar(config("b"))
    # each holds (7 + 5) x $0.001 and spends (5 + 5) x $0.001
    assert await send(a, 3, "eve") == [200] * 3
    await shipped(pg, 3)
    redis_server.client().flushall()
    # reseeded from PostgreSQL: $0.030 spent, so one more fits ($0.042) and the next does not
    assert await send(b, 2, "eve") == [200, 429]
    await until(lambda: held(redis_server) == 0, "settled")
    assert spent(redis_server) == 40_000
    assert spent(redis_server, "global:*") == 40_000
    assert b.value("llm_budget_store_reseeds_total", outcome="seeded") == 1


@pytest.mark.parametrize(
    ("mode", "after_stop"),
    [
        ("closed", [503, 503, 503, 503]),
        ("open", [200, 200, 200, 200]),
        # the remainder known from the last reply, $0.039, shared by one sidecar alive: three
        # requests that hold $0.011 and spend $0.010 each fit, the fourth does not
        ("local", [200, 200, 200, 429]),
    ],
)
async def test_redis_stopped_gives_each_store_unavailable_behaviour(
    start_sidecar: StartSidecar,
    redis_server: Any,
    mode: str,
    after_stop: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # no trial call during the test, however slow the machine: the breaker, once open, stays so
    monkeypatch.setattr(budget_redis, "BREAKER_COOLDOWN_S", 3600.0)
    budgets = {"store": redis_server.url, "user_daily_usd": 0.05, "store_unavailable": mode}
    run = await start_sidecar({"pricing": PRICES, "budgets": budgets})
    assert await send(run, 1, "eve") == [200]
    redis_server.stop()
    async with aiohttp.ClientSession() as s:
        body = {"model": "fake/llama-3-8b", "messages": MSGS, "max_tokens": 5}
        statuses = []
        for _ in range(4):
            async with s.post(
                run.url + "/v1/chat/completions", json=body, headers={"X-Tollbooth-User": "eve"}
            ) as r:
                statuses.append(r.status)
                if r.status == 503:
                    assert (await r.json())["error"]["type"] == "budget_store_unavailable"
                    assert r.headers["Retry-After"] == "1"
    assert statuses == after_stop
    assert run.value("llm_budget_store_bypassed_total") == (4 if mode == "open" else 0)
    # fast: three failed calls (requests' or upkeep's) open the breaker; later requests do not
    # wait on Redis at all
    errors = [
        s.value
        for metric in run.sc.metrics.registry.collect()
        if metric.name == "llm_budget_store_errors"
        for s in metric.samples
        if s.name == "llm_budget_store_errors_total"
    ]
    assert sum(errors) == 3
    assert run.value("llm_budget_store_up") == 0
