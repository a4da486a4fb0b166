"""Latency and queue: what on-call looks at."""

from grafanalib.core import Dashboard

from dashboards.lib import FILTER, Grid, dashboard, heatmap, percentiles, target, timeseries
from sidecar.thresholds import Thresholds


def build(t: Thresholds) -> Dashboard:
    g = Grid()
    inst = 'job="$job",instance=~"$instance"'
    panels = [
        percentiles(
            g,
            "Queue wait",
            "Time in the admission queue (p50/p90/p99), measured separately from TTFT.",
            "llm_queue_wait_seconds",
        ),
        heatmap(
            g,
            "Queue wait distribution",
            "Histogram of admission queue waits.",
            "s",
            "llm_queue_wait_seconds",
        ),
        percentiles(
            g,
            "Time to first token",
            "Upstream send to first token event, streams only (p50/p90/p99).",
            "llm_time_to_first_token_seconds",
        ),
        heatmap(
            g,
            "Time to first token distribution",
            "Histogram of TTFT.",
            "s",
            "llm_time_to_first_token_seconds",
        ),
        percentiles(
            g,
            "Request duration",
            "Request received to response complete, including the queue (p50/p90/p99).",
            "llm_request_duration_seconds",
        ),
        heatmap(
            g,
            "Request duration distribution",
            "Histogram of request durations.",
            "s",
            "llm_request_duration_seconds",
        ),
        percentiles(
            g,
            "Time per output token",
            "Decode time per output token after the first (streams only).",
            "llm_time_per_output_token_seconds",
        ),
        timeseries(
            g,
            "Queue depth",
            "Requests waiting for admission.",
            "short",
            [target(f"sum(llm_queue_depth{{{inst}}})", "waiting")],
        ),
        timeseries(
            g,
            "Token budget in use vs limit",
            "Estimated tokens admitted (an estimate "
            "used for admission, never a count) against the budget; the line is the "
            "saturation threshold.",
            "percentunit",
            [
                target(
                    f"sum(llm_budget_tokens_in_use{{{inst}}}) / "
                    f"sum(llm_budget_tokens_limit{{{inst}}})",
                    "in use",
                )
            ],
            threshold=t.queue_saturation_ratio,
        ),
        timeseries(
            g,
            "Rejections",
            "Requests refused by the admission queue and by budgets.",
            "reqps",
            [
                target(
                    f"sum by (reason) (rate(llm_admission_rejections_total{{{inst}}}"
                    "[$__rate_interval]))",
                    "queue: {{reason}}",
                ),
                target(
                    f"sum by (scope) (rate(llm_budget_rejections_total{{{inst}}}"
                    "[$__rate_interval]))",
                    "budget: {{scope}}",
                    "B",
                ),
            ],
        ),
        timeseries(
            g,
            "Error ratio",
            "Share of requests that failed (5xx or inside the "
            "stream); the line is the LLMUpstreamErrorRateHigh threshold.",
            "percentunit",
            [
                target(
                    f'sum(rate(llm_requests_total{{{FILTER},status_code=~"5..|stream_error"}}'
                    f"[$__rate_interval])) / sum(rate(llm_requests_total{{{FILTER}}}"
                    "[$__rate_interval]))",
                    "errors",
                )
            ],
            threshold=t.error_ratio,
        ),
        timeseries(
            g,
            "Requests by sidecar",
            "Each sidecar's request rate: in a fleet, how the load balancer spreads traffic.",
            "reqps",
            [
                target(
                    f"sum by (instance) (rate(llm_requests_total{{{FILTER}}}[$__rate_interval]))",
                    "{{instance}}",
                )
            ],
        ),
        timeseries(
            g,
            "Fleet: budget store and ledger shipping",
            "Requests decided without the shared budget store (bypassed, refused with 503, or "
            "on the local share), holds charged at lease end, and ledger rows not yet shipped "
            "to PostgreSQL.",
            "short",
            [
                target(
                    f"sum(rate(llm_budget_store_bypassed_total{{{inst}}}[$__rate_interval]))",
                    "bypassed/s",
                ),
                target(
                    f"sum(rate(llm_budget_store_refused_total{{{inst}}}[$__rate_interval]))",
                    "refused (503)/s",
                    "B",
                ),
                target(
                    f"sum(rate(llm_budget_store_local_decisions_total{{{inst}}}"
                    "[$__rate_interval]))",
                    "local share/s",
                    "C",
                ),
                target(
                    f"sum(increase(llm_budget_holds_expired_total{{{inst}}}[$__rate_interval]))",
                    "holds expired",
                    "D",
                ),
                target(
                    f"sum by (instance) (llm_ledger_unshipped_rows{{{inst}}})",
                    "unshipped rows {{instance}}",
                    "E",
                ),
            ],
        ),
    ]
    return dashboard(
        t,
        "tollbooth-latency",
        "Tollbooth / Latency and queue",
        "Queue wait, TTFT, duration and time per token; admission state.",
        panels,
    )
