"""The rule groups, as data. Every number and window comes from `Thresholds`.

Recording rules are named level:metric:operations. Alerts are CamelCase with the LLM prefix and
carry severity (critical pages, warning makes a ticket, info is not routed), a one-sentence
summary, a templated description and a runbook link.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.utils import floatToGoString

from sidecar.exchange import UPSTREAM_FAILED
from sidecar.telemetry.metrics import COST_BUCKETS
from sidecar.telemetry.thresholds import Thresholds

ERRORS = 'status_code=~"5..|stream_error"'


def cost_bucket(t: Thresholds) -> str:
    """The `le` label of the per-request limit; the limit must be a bucket boundary."""
    if t.request_cost_usd not in COST_BUCKETS:
        raise ValueError(
            f"request_cost_usd={t.request_cost_usd} is not a boundary of "
            f"llm_request_cost_usd (boundaries: {COST_BUCKETS})"
        )
    return floatToGoString(t.request_cost_usd)


def over_limit(t: Thresholds, by: str) -> str:
    sel, w, le = t.selector, t.request_cost_window, cost_bucket(t)
    return (
        f'sum by ({by}) (increase(llm_request_cost_usd_bucket{{{sel},le="+Inf"}}[{w}]))\n'
        f'- sum by ({by}) (increase(llm_request_cost_usd_bucket{{{sel},le="{le}"}}[{w}]))'
    )


def budget_soft(t: Thresholds) -> str:
    """Each budget scope's used share at or past its own soft limit: the sidecar exports both,
    from budgets.limits, so no threshold lives here. The most any sidecar of the job saw."""
    sel, by = t.selector, "job, scope, name, window"
    return (
        f"max by ({by}) (llm_budget_used_ratio{{{sel}}})\n"
        f">= on ({by}) max by ({by}) (llm_budget_soft_ratio{{{sel}}})"
    )


def queue_saturated(t: Thresholds) -> str:
    """Peak budget use in the window, while requests waited in a large enough share of it."""
    sel, w = t.selector, t.queue_saturation_window
    return (
        f"max by (job, instance) (max_over_time(llm_budget_tokens_in_use{{{sel}}}[{w}])\n"
        f"  / max_over_time(llm_budget_tokens_limit{{{sel}}}[{w}])) >= {t.queue_saturation_ratio}\n"
        f"and on (job, instance)\n"
        f"max by (job, instance) (avg_over_time((llm_queue_depth{{{sel}}} > bool 0)[{w}:]))"
        f" >= {t.queue_waiting_share}"
    )


def unmetered(t: Thresholds) -> tuple[str, str]:
    """(engine minus metered, metered) output tokens over the window, per job, instance and
    model. increase() on both sides: a restart of the engine or of the sidecar is a counter
    reset, not a gap. A model the sidecar metered nothing for counts as metered 0."""
    sel, w, by = t.selector, t.bypass_window, "job, instance, model"
    engine = f'sum by ({by}) (increase(llm_engine_tokens_total{{{sel},token_type="output"}}[{w}]))'
    metered = f'sum by ({by}) (increase(llm_tokens_total{{{sel},token_type="output"}}[{w}]))'
    metered_or_0 = f"({metered} or 0 * {engine})"
    return f"({engine} - {metered_or_0})", metered_or_0


def recording(t: Thresholds) -> list[dict[str, Any]]:
    s = t.selector
    return [
        {
            "record": "model_user:llm_cost_usd:rate5m",
            "expr": f"sum by (job, model, user_id) (rate(llm_cost_usd_total{{{s}}}[5m]))",
        },
        {
            "record": "model_token_type:llm_cost_usd:rate5m",
            "expr": f"sum by (job, model, token_type) (rate(llm_cost_usd_total{{{s}}}[5m]))",
        },
        {
            "record": "model_token_type:llm_tokens:rate5m",
            "expr": f"sum by (job, model, token_type) (rate(llm_tokens_total{{{s}}}[5m]))",
        },
        {
            "record": "model:llm_requests:rate5m",
            "expr": f"sum by (job, model) (rate(llm_requests_total{{{s}}}[5m]))",
        },
        {
            "record": "model:llm_request_errors:rate5m",
            "expr": f"sum by (job, model) (rate(llm_requests_total{{{s},{ERRORS}}}[5m]))",
        },
        {
            "record": "job:llm_cost_usd:increase24h",
            "expr": f"sum by (job) (increase(llm_cost_usd_total{{{s}}}[24h]))",
        },
        {
            "record": "model:llm_requests_over_cost_limit:increase5m",
            "expr": over_limit(t, "job, model"),
        },
    ]


def _alert(
    t: Thresholds,
    name: str,
    expr: str,
    for_: str,
    severity: str,
    summary: str,
    description: str,
    **labels: str,
) -> dict[str, Any]:
    rule: dict[str, Any] = {"alert": name, "expr": expr}
    if for_ not in ("0s", "0m"):
        rule["for"] = for_
    rule["labels"] = {"severity": severity, **labels}
    rule["annotations"] = {
        "summary": summary,
        "description": description,
        "runbook_url": f"{t.runbook_base}#{name.lower()}",
    }
    return rule


def alerting(t: Thresholds) -> list[dict[str, Any]]:
    s = t.selector
    money = '{{ $value | printf "%.2f" }}'
    return [
        _alert(
            t,
            "LLMDailySpendHigh",
            f"sum by (job) (increase(llm_cost_usd_total{{{s}}}[{t.daily_spend_window}]))"
            f" > {t.daily_spend_usd}",
            t.spend_for,
            "critical",
            f"LLM spend over the last {t.daily_spend_window} is above ${t.daily_spend_usd:g}.",
            f"Spend in the last {t.daily_spend_window} is ${money} "
            f"(limit ${t.daily_spend_usd:g}) on {{{{ $labels.job }}}}.",
            priority=t.daily_spend_priority,
        ),
        _alert(
            t,
            "LLMUserDailySpendHigh",
            f"sum by (job, user_id) (increase(llm_cost_usd_total{{{s}}}"
            f"[{t.daily_spend_window}])) > {t.user_daily_spend_usd}",
            t.spend_for,
            "warning",
            f"One user's LLM spend over the last {t.daily_spend_window} is above "
            f"${t.user_daily_spend_usd:g}.",
            f"User {{{{ $labels.user_id }}}} spent ${money} in the last "
            f"{t.daily_spend_window} (limit ${t.user_daily_spend_usd:g}).",
        ),
        _alert(
            t,
            "LLMBudgetSoftLimit",
            budget_soft(t),
            t.spend_for,
            "warning",
            "A budget has passed its soft limit.",
            "{{ $labels.scope }} {{ $labels.name }} has used {{ $value | humanizePercentage }} "
            "of its {{ $labels.window }} budget on {{ $labels.job }}, at or past the soft limit "
            "set for it in budgets.limits.",
        ),
        _alert(
            t,
            "LLMRequestCostHigh",
            f"({over_limit(t, 'job, model')}) > 0",
            t.spend_for,
            "warning",
            f"A request cost more than ${t.request_cost_usd:g}.",
            f'{{{{ $value | printf "%.0f" }}}} request(s) to {{{{ $labels.model }}}} cost more '
            f"than ${t.request_cost_usd:g} each in the last {t.request_cost_window}; the "
            "audit log has their trace ids.",
        ),
        _alert(
            t,
            "LLMTokenBudgetQueueSaturated",
            queue_saturated(t),
            t.queue_saturation_for,
            "warning",
            "The admission queue's token budget is saturated and requests are waiting.",
            f"{{{{ $labels.instance }}}} used up to {{{{ $value | humanizePercentage }}}} of its "
            f"token budget in every {t.queue_saturation_window} for {t.queue_saturation_for}, "
            f"with requests waiting at least {t.queue_waiting_share:.0%} of the time.",
        ),
        _alert(
            t,
            "LLMUpstreamErrorRateHigh",
            f"sum by (job) (rate(llm_requests_total{{{s},{ERRORS}}}[{t.error_window}]))\n"
            f"/ sum by (job) (rate(llm_requests_total{{{s}}}[{t.error_window}]))"
            f" > {t.error_ratio}",
            t.error_for,
            "critical",
            "Too many LLM requests are failing upstream.",
            f"{{{{ $value | humanizePercentage }}}} of requests failed (5xx or inside the "
            f"stream) over {t.error_window}; the limit is {t.error_ratio:.0%}.",
        ),
        _alert(
            t,
            "LLMGPUMemoryNearFull",
            f"max by (job, instance, gpu) (llm_gpu_memory_used_bytes{{{s}}} / "
            f"llm_gpu_memory_total_bytes{{{s}}}) > {t.gpu_memory_ratio}",
            t.gpu_memory_for,
            "warning",
            "A GPU serving the model is nearly out of memory.",
            f"GPU {{{{ $labels.gpu }}}} on {{{{ $labels.instance }}}} is at "
            f"{{{{ $value | humanizePercentage }}}} memory (limit {t.gpu_memory_ratio:.0%}).",
        ),
        _alert(
            t,
            "LLMUsageUnmeasured",
            f'sum by (job) (rate(llm_usage_unknown_total{{{s},reason!="{UPSTREAM_FAILED}"}}'
            f"[{t.unmeasured_window}]))\n"
            f"/ sum by (job) (rate(llm_requests_total{{{s}}}[{t.unmeasured_window}]))"
            f" > {t.unmeasured_ratio}",
            t.unmeasured_for,
            "warning",
            "Token usage of some LLM requests cannot be measured.",
            f"{{{{ $value | humanizePercentage }}}} of requests had unknown usage over "
            f"{t.unmeasured_window}: spend is under-reported by at least that share. Requests "
            "that failed upstream are LLMUpstreamErrorRateHigh's and are not counted here.",
        ),
        _alert(
            t,
            "LLMLedgerWriteFailing",
            f"max by (job, instance, writer) (tollbooth_writer_failing{{{s}}}) > 0",
            t.writer_failing_for,
            "critical",
            "A sidecar cannot write its ledger, ship it, or write its access or audit log.",
            f"The {{{{ $labels.writer }}}} of {{{{ $labels.instance }}}} has not been able to "
            f"write for {t.writer_failing_for}; its /readyz says why. Ledger rows wait in memory "
            "(bounded) until it can; log lines and audit records that fail are lost.",
        ),
        _alert(
            t,
            "LLMLedgerRowsRefused",
            f"max by (job, instance, where) (llm_ledger_rows_set_aside{{{s}}}) > 0",
            "0m",
            "warning",
            "Ledger rows were refused even cleaned and set aside, not written.",
            '{{ $value | printf "%.0f" }} ledger row(s) of {{ $labels.instance }} '
            "are set aside in {{ $labels.where }}; every other row was written.",
        ),
        _alert(
            t,
            "LLMMeterBypassed",
            f"{unmetered(t)[0]} > {t.bypass_min_tokens:g}\n"
            f"and {unmetered(t)[0]} > {t.bypass_ratio} * {unmetered(t)[1]}",
            t.bypass_for,
            "warning",
            "The engine generated tokens the sidecar did not meter: traffic goes around it.",
            "The engine behind {{ $labels.instance }} counted "
            '{{ $value | printf "%.0f" }} more output tokens of {{ $labels.model }} '
            f"in the last {t.bypass_window} than "
            f"the sidecar metered (limits: {t.bypass_ratio:.0%} and {t.bypass_min_tokens:g} "
            "tokens).",
        ),
        _alert(
            t,
            "LLMSidecarDown",
            f"up{{{s}}} == 0",
            t.down_for,
            "critical",
            "The tollbooth sidecar is not being scraped.",
            f"{{{{ $labels.instance }}}} has been down for {t.down_for}: no metering, "
            "no cost alerts.",
        ),
    ]


def groups(t: Thresholds) -> dict[str, Any]:
    return {
        "groups": [
            {"name": "tollbooth.recording", "rules": recording(t)},
            {"name": "tollbooth.alerts", "rules": alerting(t)},
        ]
    }
