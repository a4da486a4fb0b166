"""Per-user drill-down."""

from grafanalib.core import Dashboard

from dashboards.lib import (
    COUNT,
    NOT_REASONING,
    USD_PER_HOUR,
    Grid,
    dashboard,
    or_zero,
    stat,
    target,
    timeseries,
)
from sidecar.telemetry.thresholds import Thresholds

U = 'job="$job",instance=~"$instance",model=~"$model",user_id="$user_id"'
ME = 'job="$job",instance=~"$instance",user_id="$user_id"'
# The user's own daily limit: an override, else the per-user default (llm_budget_limit_usd).
MY_LIMIT = (
    'max(llm_budget_limit_usd{job="$job",scope="user",name="$user_id"})'
    ' or max(llm_budget_limit_usd{job="$job",scope="user",name="*"})'
)


def build(t: Thresholds) -> Dashboard:
    g = Grid()
    w24 = t.daily_spend_window
    panels = [
        stat(
            g,
            f"Spend, last {w24}",
            "This user's spend over the rolling window; red above the per-user limit.",
            "currencyUSD",
            [target(or_zero(f"sum(increase(llm_cost_usd_total{{{U}}}[{w24}]))"))],
            threshold=t.user_daily_spend_usd,
        ),
        stat(
            g,
            "Spend, budget day",
            "Spend since the start of the budget day.",
            "currencyUSD",
            [target(or_zero('sum(llm_spend_today_usd{job="$job",user_id="$user_id"})'))],
        ),
        stat(
            g,
            "Tokens, selected range",
            "Input and output tokens reported by the server.",
            "short",
            [target(or_zero(f"sum(increase(llm_tokens_total{{{U},{NOT_REASONING}}}[$__range]))"))],
        ),
        stat(
            g,
            "Device time, selected range",
            "GPU-seconds attributed to this user (needs GPU telemetry: empty without NVML).",
            "s",
            [target(f"sum(increase(llm_device_seconds_total{{{U}}}[$__range]))")],
            no_value="no GPU telemetry",
        ),
        timeseries(
            g,
            "Spend rate by model",
            "USD per hour.",
            USD_PER_HOUR,
            [
                target(
                    f"sum by (model) (rate(llm_cost_usd_total{{{U}}}[$__rate_interval])) * 3600",
                    "{{model}}",
                )
            ],
        ),
        timeseries(
            g,
            "Tokens by direction",
            "Tokens per second, input and output.",
            "short",
            [
                target(
                    f"sum by (token_type) (rate(llm_tokens_total{{{U}}}[$__rate_interval]))",
                    "{{token_type}}",
                )
            ],
        ),
        timeseries(
            g,
            "Cached input share",
            "Share of input tokens served from the prefix cache. Empty when the server does not "
            "report cached tokens (vLLM: --enable-prompt-tokens-details): unknown, not 0.",
            "percentunit",
            [
                target(
                    f"sum(rate(llm_cached_input_tokens_total{{{U}}}[$__rate_interval]))"
                    f' / sum(rate(llm_tokens_total{{{U},token_type="input"}}'
                    "[$__rate_interval]))",
                    "cached",
                )
            ],
        ),
        timeseries(
            g,
            "Spend vs the per-user alert threshold",
            f"Rolling {w24} spend with the LLMUserDailySpendHigh threshold line (the alert, not "
            "the user's budget: that is on 'Budget day: spend vs this user's limit').",
            "currencyUSD",
            [target(f"sum(increase(llm_cost_usd_total{{{U}}}[{w24}]))", "spend")],
            threshold=t.user_daily_spend_usd,
        ),
        timeseries(
            g,
            "Budget day: spend vs this user's limit",
            "Spend since the start of the budget day (llm_spend_today_usd), this user's own daily "
            "limit (its override, else the per-user default: llm_budget_limit_usd) and what is "
            "left (llm_budget_remaining_usd). Empty limit: no per-user budget is configured.",
            "currencyUSD",
            [
                target(f"sum(llm_spend_today_usd{{{ME}}})", "spent today"),
                target(MY_LIMIT, "daily limit", ref="B"),
                target(
                    'max(llm_budget_remaining_usd{job="$job",scope="user",name="$user_id"})',
                    "left",
                    ref="C",
                ),
            ],
        ),
        stat(
            g,
            "Budget refusals, selected range",
            "Requests of this user refused with 429 by a daily budget (any scope).",
            COUNT,
            [target(or_zero(f"sum(increase(llm_budget_refusals_total{{{ME}}}[$__range]))"))],
            threshold=1,
        ),
        timeseries(
            g,
            "Budget refusals by scope and reason",
            "429s of this user per 5 minutes: the scope whose budget the request would exceed "
            "(user, team, global) and why (budget, or capacity: the budget table was full).",
            COUNT,
            [
                target(
                    or_zero(
                        f"sum by (scope, reason) (increase(llm_budget_refusals_total{{{ME}}}[5m]))",
                        "scope",
                    ),
                    "{{scope}} {{reason}}",
                )
            ],
            decimals=0,
        ),
    ]
    return dashboard(
        t,
        "tollbooth-user",
        "Tollbooth / Per-user drill-down",
        "One user's spend, tokens and device time.",
        panels,
        user=True,
    )
