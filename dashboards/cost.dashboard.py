"""Cost overview: what finance asks for."""

from grafanalib.core import Dashboard, TimeSeries

from dashboards.lib import (
    COUNT,
    FILTER,
    INST,
    NOT_REASONING,
    USD_PER_HOUR,
    Grid,
    dashboard,
    or_zero,
    stat,
    target,
    timeseries,
    today,
    top,
)
from sidecar.telemetry.thresholds import Thresholds


def metered_share(g: Grid, t: Thresholds) -> TimeSeries:
    """The sidecar's output tokens over the engine's own count (reconciliation): below 1, the
    engine served traffic around the sidecar (LLMMeterBypassed, same window)."""
    w, out = t.bypass_window, 'token_type="output"'
    metered = f"sum by (model) (increase(llm_tokens_total{{{FILTER},{out}}}[{w}]))"
    engine = f"sum by (model) (increase(llm_engine_tokens_total{{{FILTER},{out}}}[{w}]))"
    return timeseries(
        g,
        f"Metered share of the engine's output tokens, {w}",
        "Output tokens the sidecar metered over those the engine counted itself "
        "(llm_engine_tokens_total), by model. Below 1: traffic reached the engine around the "
        f"sidecar (LLMMeterBypassed below {1 - t.bypass_ratio:.0%}). Empty when the engine's "
        "metrics are not readable (llm_engine_metrics_up 0).",
        "percentunit",
        # a model the engine served and the sidecar never metered: share 0, as the alert reads it
        [target(f"({metered} or 0 * {engine}) / ({engine} > 0)", "{{model}}")],
    )


def build(t: Thresholds) -> Dashboard:
    g = Grid()
    w24 = t.daily_spend_window
    le = f"{t.request_cost_usd:g}"
    over = (
        f'sum(increase(llm_request_cost_usd_bucket{{{FILTER},le="+Inf"}}[$__range]))'
        f' - sum(increase(llm_request_cost_usd_bucket{{{FILTER},le="{le}"}}[$__range]))'
    )
    panels = [
        today(
            g,
            "Today: spend by user",
            "Spend since the start of the budget day by user (llm_spend_today_usd: settled, "
            "restored from the ledger after a restart; equals the ledger's day).",
            "currencyUSD",
            [target(f"sort_desc(sum by (user_id) (llm_spend_today_usd{{{INST}}}))", "{{user_id}}")],
        ),
        today(
            g,
            "Today: spend by team",
            "Spend since the start of the budget day by team: the keys file's team of each "
            "billed key (llm_team_spend_today_usd: measured spend, restored from the ledger "
            "after a restart). Keys without a team are in no row; empty without a keys file "
            "that names teams.",
            "currencyUSD",
            [
                target(
                    f"sort_desc(sum by (team) (llm_team_spend_today_usd{{{INST}}}) > 0)",
                    "{{team}}",
                )
            ],
        ),
        today(
            g,
            "Today: spend by model",
            "Spend since 00:00 UTC by model, from the cost counters (increase over today).",
            "currencyUSD",
            [
                target(
                    f"sort_desc(sum by (model) (increase(llm_cost_usd_total{{{FILTER}}}"
                    "[$__range])))",
                    "{{model}}",
                )
            ],
        ),
        today(
            g,
            "Today: requests and errors by model",
            "Requests since 00:00 UTC by model and status code (5xx and stream_error are "
            "errors; 429 budget or admission refusals; 499 the client left).",
            COUNT,
            [
                target(
                    f"sort_desc(sum by (model, status_code) (increase(llm_requests_total"
                    f"{{{FILTER}}}[$__range])) > 0)",
                    "{{model}} {{status_code}}",
                )
            ],
        ),
        today(
            g,
            "Today: budget left by user",
            "What is left of each user's daily budget (llm_budget_remaining_usd) and of the "
            "site's; empty when no budget is configured.",
            "currencyUSD",
            [
                target(
                    f"sort(max by (scope, name) (llm_budget_remaining_usd{{{INST}}}))",
                    "{{scope}} {{name}}",
                )
            ],
        ),
        today(
            g,
            "Today: budget refusals by user",
            "Requests refused with 429 by a daily budget since 00:00 UTC, by user and reason.",
            COUNT,
            [
                target(
                    or_zero(
                        f"sort_desc(sum by (user_id, reason) (increase("
                        f"llm_budget_refusals_total{{{INST}}}[$__range])) > 0)",
                        "user_id",
                    ),
                    "{{user_id}} {{reason}}",
                )
            ],
        ),
        top(
            g,
            "Budgets: share of each limit used",
            "Spent / limit of each budget limit (llm_budget_used_ratio), day and month windows, "
            "largest first; LLMBudgetSoftLimit warns where it passes the limit's soft share. "
            "Empty when no budget is configured.",
            "percentunit",
            f"sort_desc(max by (scope, name, window) (llm_budget_used_ratio{{{INST}}}))",
            "{{scope}} {{name}} ({{window}})",
        ),
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
            USD_PER_HOUR,
            [
                target(
                    f"sum by (model) (rate(llm_cost_usd_total{{{FILTER}}}"
                    f"[$__rate_interval])) * 3600",
                    "{{model}}",
                )
            ],
            stack=True,
        ),
        top(
            g,
            "Top 10 users by spend, selected range",
            "The ten users who spent most over the dashboard's time range (one value each, at "
            "its end); users with no spend in it are not listed. Users beyond the cardinality "
            "cap share __other__.",
            "currencyUSD",
            f"topk(10, sum by (user_id) (increase(llm_cost_usd_total{{{FILTER}}}[$__range])) > 0)",
            "{{user_id}}",
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
            USD_PER_HOUR,
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
            decimals=0,
        ),
        metered_share(g, t),
    ]
    return dashboard(
        t,
        "tollbooth-cost",
        "Tollbooth / Cost overview",
        "Spend by model, user and direction, against the agreed limits.",
        panels,
    )
