"""Latency and queue: what on-call looks at."""

from grafanalib.core import Dashboard, TimeSeries

from dashboards.lib import (
    ENGINE,
    FILTER,
    INST,
    Grid,
    by_model_quantiles,
    dashboard,
    heatmap,
    or_zero,
    percentiles,
    ratio,
    target,
    timeseries,
)
from sidecar.telemetry.metrics import (
    MAX_FINISH_REASONS,
    TGI_BATCH,
    TGI_QUEUE,
    VLLM_KV_USAGE,
    VLLM_KV_USAGE_OLD,
    VLLM_PREEMPTIONS,
    VLLM_RUNNING,
    VLLM_WAITING,
)
from sidecar.telemetry.thresholds import Thresholds


def build(t: Thresholds) -> Dashboard:
    g = Grid()
    inst = INST
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
                    or_zero(
                        f"sum by (reason) (rate(llm_admission_rejections_total{{{inst}}}"
                        "[$__rate_interval]))",
                        "reason",
                    ),
                    "queue: {{reason}}",
                ),
                target(
                    or_zero(
                        f"sum by (scope) (rate(llm_budget_rejections_total{{{inst}}}"
                        "[$__rate_interval]))",
                        "scope",
                    ),
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
                    ratio(
                        f'sum(rate(llm_requests_total{{{FILTER},status_code=~"5..|stream_error"}}'
                        "[$__rate_interval]))",
                        f"sum(rate(llm_requests_total{{{FILTER}}}[$__rate_interval]))",
                    ),
                    "errors",
                )
            ],
            threshold=t.error_ratio,
        ),
        *engine_panels(g),
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
        timeseries(
            g,
            "Requests by status code and model",
            "Requests per second by model and status: 2xx served, 4xx refused (413 too large, "
            "429 budget or admission, 499 the client left), 5xx and stream_error failed.",
            "reqps",
            [
                target(
                    f"sum by (model, status_code) (rate(llm_requests_total{{{FILTER}}}"
                    "[$__rate_interval])) > 0",
                    "{{model}} {{status_code}}",
                )
            ],
            stack=True,
        ),
        timeseries(
            g,
            "Request duration p50 / p99 by model",
            "Time from request received to response complete, per model.",
            "s",
            by_model_quantiles("llm_request_duration_seconds"),
        ),
        timeseries(
            g,
            "Time to first token p50 / p99 by model",
            "Upstream send to first token (streams only), per model.",
            "s",
            by_model_quantiles("llm_time_to_first_token_seconds"),
        ),
        timeseries(
            g,
            "Token throughput by model",
            "Tokens per second reported by the server, by model and direction.",
            "short",
            [
                target(
                    f"sum by (model, token_type) (rate(llm_tokens_total{{{FILTER}}}"
                    "[$__rate_interval]))",
                    "{{model}} {{token_type}}",
                )
            ],
            stack=True,
        ),
        timeseries(
            g,
            "Prompt length p50 / p99 by model",
            "Prompt tokens per request as the server reported them (measured counts only: a "
            "request whose input usage is unknown is not in it), per model; vLLM's "
            "request_prompt_tokens. Powers-of-two buckets: a percentile is within a factor of 2.",
            "short",
            by_model_quantiles("llm_request_prompt_tokens"),
        ),
        timeseries(
            g,
            "Output length p50 / p99 by model",
            "Output tokens per request (all its choices) as the server reported them (measured "
            "counts only), per model; vLLM's request_generation_tokens.",
            "short",
            by_model_quantiles("llm_request_output_tokens"),
        ),
        timeseries(
            g,
            "Finish reasons by model",
            "Choices finished per second by the reason the server gave (stop: a natural end; "
            "length: cut at max_tokens or the context; tool_calls...). A rising length share "
            f"means truncated answers. Reasons past the first {MAX_FINISH_REASONS} distinct "
            "ones share __other__.",
            "cps",
            [
                target(
                    f"sum by (model, finish_reason) (rate(llm_finish_reasons_total{{{FILTER}}}"
                    "[$__rate_interval]))",
                    "{{model}} {{finish_reason}}",
                )
            ],
            stack=True,
        ),
    ]
    return dashboard(
        t,
        "tollbooth-latency",
        "Tollbooth / Latency and queue",
        "Queue wait, TTFT, duration and time per token; admission state.",
        panels,
    )


def engine_panels(g: Grid) -> list[TimeSeries]:
    """The inference server's own scheduler beside the sidecar's: where a request waits."""
    return [
        timeseries(
            g,
            "Where requests wait: sidecar queue vs engine queue",
            "Requests waiting in the sidecar's admission queue, and in the inference server's "
            "own scheduler (vLLM num_requests_waiting, TGI queue_size; the simulator exports "
            'the same names, labelled simulated="true"). A full sidecar queue beside an empty '
            "engine queue means the admission budget is the limit, not the server.",
            "short",
            [
                target(f"sum(llm_queue_depth{{{INST}}})", "sidecar admission queue"),
                target(f"sum({VLLM_WAITING}{{{ENGINE}}})", "vLLM waiting", "B"),
                target(f"sum({TGI_QUEUE}{{{ENGINE}}})", "TGI queue", "C"),
            ],
        ),
        timeseries(
            g,
            "Running: sidecar in flight vs engine batch",
            "Requests the sidecar has admitted and is proxying, and the requests the server is "
            "running (vLLM num_requests_running, TGI batch_current_size).",
            "short",
            [
                target(f"sum(llm_in_flight_requests{{{INST}}})", "sidecar in flight"),
                target(f"sum({VLLM_RUNNING}{{{ENGINE}}})", "vLLM running", "B"),
                target(f"sum({TGI_BATCH}{{{ENGINE}}})", "TGI batch", "C"),
            ],
        ),
        timeseries(
            g,
            "Engine KV-cache usage",
            f"vLLM's KV-cache use per server (0-1; {VLLM_KV_USAGE_OLD} on older vLLM). Near 1 "
            "the engine preempts or queues requests however much budget the sidecar admits.",
            "percentunit",
            [
                target(
                    f"max by (instance) ({VLLM_KV_USAGE}{{{ENGINE}}} "
                    f"or {VLLM_KV_USAGE_OLD}{{{ENGINE}}})",
                    "{{instance}}",
                )
            ],
        ),
        timeseries(
            g,
            "Engine preemptions",
            "Sequences vLLM evicted from the KV cache and recomputed later, per second.",
            "short",
            [
                target(
                    f"sum(rate({VLLM_PREEMPTIONS}{{{ENGINE}}}[$__rate_interval]))",
                    "preemptions/s",
                )
            ],
        ),
    ]
