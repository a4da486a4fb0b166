"""Budget state is exported: each limit, what is left, and refusals by user and reason
(sidecar/billing/budget_state.py)."""

from __future__ import annotations

import aiohttp
import pytest

from tests.conftest import StartSidecar
from tests.fakes import MODEL

PRICES = {"models": {MODEL: {"input_per_1m": 1000.0, "output_per_1m": 1000.0}}}
BODY = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "a b c"}]}


async def post(url: str, user: str) -> int:
    async with (
        aiohttp.ClientSession(headers={"X-Tollbooth-User": user}) as s,
        s.post(url + "/v1/chat/completions", json=BODY) as r,
    ):
        await r.read()
        return r.status


async def test_limits_remainders_and_refusals_by_user(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar(
        {
            "pricing": PRICES,
            "budgets": {
                "global_daily_usd": 10.0,
                "user_daily_usd": 1.0,
                "users": {"tiny": 0.001},
                "teams": {"research": 5.0},
            },
        }
    )

    def v(metric: str, **labels: str) -> float | None:
        return run.sc.metrics.registry.get_sample_value(metric, labels)

    assert v("llm_budget_limit_usd", scope="user", name="*") == 1.0
    assert v("llm_budget_limit_usd", scope="user", name="tiny") == 0.001
    assert v("llm_budget_limit_usd", scope="team", name="research") == 5.0
    assert v("llm_budget_limit_usd", scope="global", name="*") == 10.0
    assert await post(run.url, "tiny") == 429
    assert await post(run.url, "ok") == 200
    assert v("llm_budget_refusals_total", user_id="tiny", scope="user", reason="budget") == 1
    assert v("llm_budget_refusals_total", user_id="ok", scope="user", reason="budget") is None
    spent = v("llm_spend_today_usd", user_id="ok")
    assert spent is not None and spent > 0
    assert v("llm_budget_remaining_usd", scope="user", name="ok") == pytest.approx(1.0 - spent)
    assert v("llm_budget_remaining_usd", scope="global", name="*") == pytest.approx(10.0 - spent)
    assert v("llm_budget_remaining_usd", scope="team", name="research") is None  # not kept here


async def test_without_budgets_no_limit_is_invented(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar({"pricing": PRICES})
    assert await post(run.url, "u") == 200
    text = "\n".join(s.name for fam in run.sc.metrics.registry.collect() for s in fam.samples)
    assert "llm_budget_limit_usd" not in text and "llm_budget_remaining_usd" not in text
