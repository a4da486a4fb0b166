"""Cost overview: what finance asks for."""

from grafanalib.core import Dashboard

from dashboards.lib import (
    FILTER,
    INST,
    NOT_REASONING,
    Grid,
    dashboard,
    or_zero,
    stat,
    target,
    timeseries,
)
from sidecar.telemetry.thresholds import Thresholds


def build(t: Thresholds) -> Dashboard:
    g = Grid()
    w24 = t.daily_spend_window
    le = f"{t.request_cost_usd:g}"
    over = (
        f'sum(increase(llm_request_cost_usd_bucket{{{FILTER},le="+Inf"}}[$__range]))'
        f' - sum(increase(llm_request_cost_usd_bucket{{{FILTER},le="{le}"}}[$__range]))'
    )
    panels = [
        stat(
            g,
            f"Spend, last {w24}",
            f"Spend over the rolling {w24} window; red above the "
            f"${t.daily_spend_usd:g} LLMDailySpendHigh limit.",
            "currencyUSD",
            [target(or_zero(f"sum(increase(llm_cost_usd_total{{{FILTER}}}[{w24}]))"))],
            threshold=t.daily_spend_usd,
        ),
        stat(
            g,
            "Spend, current budget day",
            "Spend since the start of the budget day, "
            "restored from the ledger after restarts (llm_spend_today_usd).",
            "currencyUSD",
            [target(or_zero(f"sum(llm_spend_today_usd{{{INST}}})"))],
        ),
        stat(
            g,
            f"Requests over ${t.request_cost_usd:g}",
            "Requests in the selected range whose "
            "cost was above the per-request limit (LLMRequestCostHigh); their trace ids are in "
            "the audit log.",
            "short",
            [target(or_zero(over))],
            threshold=1,
        ),
        stat(
            g,
            "Requests with unknown cost",
            "Requests the sidecar could not price (no price "
            "for the model, or usage not measured). Never counted as $0.",
            "short",
            [target(or_zero(f"sum(increase(llm_cost_unknown_total{{{FILTER}}}[$__range]))"))],
            threshold=1,
        ),
        timeseries(
            g,
            f"Spend, rolling {w24}, vs the limit",
            "Rolling spend with the LLMDailySpendHigh threshold drawn as a line.",
            "currencyUSD",
            [target(or_zero(f"sum(increase(llm_cost_usd_total{{{FILTER}}}[{w24}]))"), "spend")],
            threshold=t.daily_spend_usd,
        ),
        timeseries(
            g,
            "$/hour by model",
            "Spend rate per model, from per-token prices.",
            "currencyUSD",
            [
                target(
                    f"sum by (model) (rate(llm_cost_usd_total{{{FILTER}}}"
                    f"[$__rate_interval])) * 3600",
                    "{{model}}",
                )
            ],
            stack=True,
        ),
        timeseries(
            g,
            "Top 10 users by spend",
            "Users with the highest spend over the rolling "
            f"{w24}; later users beyond the cardinality cap share __other__.",
            "currencyUSD",
            [
                target(
                    f"topk(10, sum by (user_id) (increase(llm_cost_usd_total{{{FILTER}}}[{w24}])))",
                    "{{user_id}}",
                )
            ],
        ),
        timeseries(
            g,
            "Cost per 1k tokens by model",
            "USD per thousand tokens (input and output together), from prices.",
            "currencyUSD",
            [
                target(
                    f"sum by (model) (rate(llm_cost_usd_total{{{FILTER}}}"
                    f"[$__rate_interval])) / sum by (model) (rate(llm_tokens_total"
                    f"{{{FILTER},{NOT_REASONING}}}[$__rate_interval])) * 1000",
                    "{{model}}",
                )
            ],
        ),
        timeseries(
            g,
            "Cost: input vs output",
            "Spend rate split by token direction (cached "
            "input is part of input, at its own price).",
            "currencyUSD",
            [
                target(
                    f"sum by (token_type) (rate(llm_cost_usd_total{{{FILTER}}}"
                    f"[$__rate_interval])) * 3600",
                    "{{token_type}}",
                )
            ],
            stack=True,
        ),
        timeseries(
            g,
            f"Requests over ${t.request_cost_usd:g} per 5m",
            "Count of requests above the per-request limit, from the cost histogram's buckets.",
            "short",
            [
                target(
                    f'sum(increase(llm_request_cost_usd_bucket{{{FILTER},le="+Inf"}}[5m]))'
                    f' - sum(increase(llm_request_cost_usd_bucket{{{FILTER},le="{le}"}}'
                    "[5m]))",
                    "over limit",
                )
            ],
            threshold=1,
        ),
    ]
    return dashboard(
        t,
        "tollbooth-cost",
        "Tollbooth / Cost overview",
        "Spend by model, user and direction, against the agreed limits.",
        panels,
    )
