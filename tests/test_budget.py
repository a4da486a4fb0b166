"""Budgets hold under concurrency: the worst case is reserved first and settled to the measured.

The store's rules in isolation, then bursts of real openai SDK streams against a small budget.
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from sidecar.budget import Hold, LocalStore, Scope, money, to_micros
from tests.conftest import Running, StartSidecar
from tests.fakes import MODEL

MSGS = [{"role": "user", "content": "one two three four five"}]  # 5 tokens upstream, 6 estimated
# $0.001 per token in both directions
PRICES = {"models": {MODEL: {"input_per_1m": 1000.0, "output_per_1m": 1000.0}}}
USER = Scope("user", "u", to_micros(1.0))
GLOBAL = Scope("global", "*", to_micros(1.5))


def hold(rid: str, usd: float, *scopes: Scope, day: int = 0) -> Hold:
    return Hold(rid, day, to_micros(usd), scopes or (USER,))


async def test_reserve_is_atomic_over_scopes_and_idempotent() -> None:
    store = LocalStore(max_scopes=10)
    assert (await store.reserve(hold("a", 0.6, USER, GLOBAL))).admitted
    assert (await store.reserve(hold("a", 0.6, USER, GLOBAL))).admitted  # again: no second hold
    assert store.held == {"user:u": 600_000, "global:*": 600_000}
    refused = await store.reserve(hold("b", 0.6, USER, GLOBAL))
    assert not refused.admitted and refused.scope == USER and refused.reason == "budget"
    assert store.held == {"user:u": 600_000, "global:*": 600_000}  # nothing held on refusal
    store.settle("a", to_micros(0.25))
    store.settle("a", to_micros(0.25))  # again: nothing twice
    assert store.spent == {"user:u": 250_000, "global:*": 250_000}
    assert store.held == {"user:u": 0, "global:*": 0}
    assert (await store.reserve(hold("c", 0.75, USER))).admitted  # 0.25 + 0.75 = the limit
    assert not (await store.reserve(hold("d", 0.000001, USER))).admitted


async def test_a_new_budget_day_starts_from_zero_and_old_holds_settle_nowhere() -> None:
    store = LocalStore(max_scopes=10)
    await store.reserve(hold("a", 0.9, day=0))
    assert (await store.reserve(hold("b", 0.9, day=86400))).admitted
    store.settle("a", to_micros(0.9))  # yesterday's request ends today: not today's spend
    assert store.spent == {"user:u": 0}


async def test_seeding_sets_only_absent_scopes() -> None:
    store = LocalStore(max_scopes=10)
    await store.seed(0, {"user:u": 400_000})
    await store.seed(0, {"user:u": 400_000})  # a second seed does not add it twice
    assert store.spent == {"user:u": 400_000}
    assert not (await store.reserve(hold("a", 0.7))).admitted


async def test_the_number_of_tracked_users_is_bounded() -> None:
    store = LocalStore(max_scopes=2)
    assert (await store.reserve(hold("a", 0.1, Scope("user", "x", 10**6)))).admitted
    assert (await store.reserve(hold("b", 0.1, Scope("user", "y", 10**6)))).admitted
    verdict = await store.reserve(hold("c", 0.1, Scope("user", "z", 10**6)))
    assert not verdict.admitted and verdict.reason == "capacity"
    assert (await store.reserve(hold("d", 0.1, Scope("user", "x", 10**6)))).admitted


def test_small_budgets_are_printed_exactly() -> None:
    assert money(0.001) == "$0.001"
    assert money(0.1) == "$0.10"
    assert money(40) == "$40.00"


async def burst(
    run: Running, oai: Any, n: int, headers: dict[str, str] | None = None, **kwargs: Any
) -> list[int]:
    """n concurrent streams from one user; returns the status of each."""
    client = oai(run)
    headers = {"X-Tollbooth-User": "eve", "X-Fake": "slow-stream", **(headers or {})}

    async def one() -> int:
        try:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=MSGS,
                stream=True,
                extra_headers=headers,
                **kwargs,
            )
            async for _ in stream:
                pass
        except openai.RateLimitError:
            return 429
        return 200

    return await asyncio.gather(*(one() for _ in range(n)))


def spent(run: Running) -> float:
    return run.value("llm_spend_today_usd", user_id="eve") or 0.0


async def test_a_concurrent_burst_cannot_overspend(start_sidecar: StartSidecar, oai: Any) -> None:
    run = await start_sidecar({"pricing": PRICES, "budgets": {"user_daily_usd": 0.2}})
    # each stream holds (6 + 10) x $0.001 = $0.016 and spends (5 + 10) x $0.001 = $0.015
    statuses = await burst(run, oai, 20, max_tokens=10)
    # all at once: 12 x $0.016 = $0.192 and a 13th would hold $0.208; one more fits only if the
    # first streams ended (spending $0.015 each) before the last were reserved.
    admitted = statuses.count(200)
    assert admitted in (12, 13)
    assert spent(run) == pytest.approx(admitted * 0.015)
    assert spent(run) <= 0.2
    assert run.sc.budgets.store.held == {"user:eve": 0}  # every hold settled


async def test_a_repeated_request_id_does_not_share_a_hold(
    start_sidecar: StartSidecar, oai: Any
) -> None:
    # The client names X-Request-Id; holds are keyed by an id the sidecar makes, so twenty
    # concurrent requests that all say "same" reserve twenty holds, not one.
    run = await start_sidecar({"pricing": PRICES, "budgets": {"user_daily_usd": 0.2}})
    statuses = await burst(run, oai, 20, {"X-Request-Id": "same"}, max_tokens=10)
    assert statuses.count(200) in (12, 13)
    assert spent(run) <= 0.2


async def test_without_an_output_limit_overshoot_stays_within_the_documented_bound(
    start_sidecar: StartSidecar, oai: Any
) -> None:
    # The fake server generates 6 tokens when no max_tokens is given; 4 are reserved. Each admitted
    # request can overshoot its hold by (6 - 4) output tokens minus the prompt estimate's surplus.
    run = await start_sidecar(
        {
            "pricing": PRICES,
            "budgets": {"user_daily_usd": 0.1, "default_max_output_tokens": 4},
        }
    )
    statuses = await burst(run, oai, 20)
    admitted = statuses.count(200)
    hold_usd, actual_usd = (6 + 4) * 0.001, (5 + 6) * 0.001
    assert 9 <= admitted <= 10  # 10 x $0.010 = the budget, when all are in flight at once
    bound = admitted * max(0.0, actual_usd - hold_usd)
    assert spent(run) == pytest.approx(admitted * actual_usd)
    assert spent(run) <= 0.1 + bound + 1e-9


async def test_a_stream_without_usage_is_charged_its_hold(
    start_sidecar: StartSidecar, oai: Any
) -> None:
    run = await start_sidecar(
        {
            "pricing": PRICES,
            "budgets": {"user_daily_usd": 0.05},
            "metering": {"inject_stream_usage": False},
        }
    )
    client = oai(run)
    for _ in range(3):  # each holds $0.016; nothing is measured, so each is charged $0.016
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=MSGS,
            stream=True,
            max_tokens=10,
            extra_headers={"X-Tollbooth-User": "eve"},
        )
        async for _ in stream:
            pass
    with pytest.raises(openai.RateLimitError):
        await client.chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=10, extra_headers={"X-Tollbooth-User": "eve"}
        )
    assert run.value("llm_budget_unmeasured_charges_total") == 3
    assert spent(run) == 0.0  # a hold is never exported as spend
