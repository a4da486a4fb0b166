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
