"""Dashboards say what they draw: $/h on spend rates, whole numbers on counts, model variables from
metered series only (dashboards/lib.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dashboards.lib import COUNT, USD_PER_HOUR

ROOT = Path(__file__).parents[1]


def dashboards() -> dict[str, dict[str, Any]]:
    return {
        p.name: json.loads(p.read_text()) for p in (ROOT / "dashboards/generated").glob("*.json")
    }


def test_spend_rates_are_per_hour() -> None:
    for name, data in dashboards().items():
        for p in data["panels"]:
            exprs = " ".join(t.get("expr", "") for t in p.get("targets", []))
            if "llm_cost_usd_total" in exprs and "* 3600" in exprs:
                assert p["fieldConfig"]["defaults"]["unit"] == USD_PER_HOUR, (name, p["title"])


def test_count_stats_are_whole_numbers() -> None:
    stats = [p for d in dashboards().values() for p in d["panels"] if p["type"] == "stat"]
    counts = [p for p in stats if p["fieldConfig"]["defaults"]["unit"] == COUNT]
    assert counts
    assert all(p["fieldConfig"]["defaults"]["decimals"] == 0 for p in counts)


def test_model_variable_reads_metered_series_only() -> None:
    for data in dashboards().values():
        model = next(v for v in data["templating"]["list"] if v["name"] == "model")
        assert model["definition"].startswith("label_values(llm_requests_total{")
        assert 'api_endpoint!="other"' in model["definition"]


def test_a_top_k_is_one_instant_value_per_series_and_never_lists_zero() -> None:
    """A range query of a rolling top-k lists every series that was in it at some point (more
    than k over a range), and a top-k over series at 0 lists users who spent nothing."""
    tops = [
        (p, t)
        for d in dashboards().values()
        for p in d["panels"]
        for t in p.get("targets", [])
        if "topk(" in t["expr"]
    ]
    assert tops
    for panel, t in tops:
        assert panel["type"] == "bargauge" and t.get("instant") is True, panel["title"]
        assert "[$__range]" in t["expr"] and t["expr"].rstrip(")").endswith("> 0"), t["expr"]


def test_the_user_variable_offers_only_users_with_tokens() -> None:
    user = next(
        v for v in dashboards()["user.json"]["templating"]["list"] if v["name"] == "user_id"
    )
    assert user["definition"].startswith("query_result(") and user["definition"].endswith("> 0)")
    assert user["regex"] == '/user_id="([^"]+)"/'
