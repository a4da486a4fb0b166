"""The numbers on-call and finance agreed on: one place for alerts, dashboards and audit.

Owns: every threshold, window and selector that an alert rule, a dashboard threshold line or the
audit capture uses, and loading per-deployment overrides from YAML. `alerts/` and `dashboards/`
render from this; a test fails if a rule hides a number that belongs here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import build, load_yaml


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    # Spend
    daily_spend_usd: float = 50.0  # LLMDailySpendHigh: rolling 24 h, all users
    daily_spend_window: str = "24h"
    daily_spend_priority: str = "P2"  # the on-call handbook's priority for LLMDailySpendHigh
    spend_for: str = "0m"  # spend is cumulative: fire as soon as it is over
    user_daily_spend_usd: float = 20.0  # LLMUserDailySpendHigh (inhibited by the global one)
    request_cost_usd: float = 0.10  # LLMRequestCostHigh and the audit capture
    request_cost_window: str = "5m"
    # Queue: saturated when, within each window, the admission budget peaked this full and
    # requests were waiting in at least this share of it; for this long. Windowed: both gauges
    # move with every request, so their values at one instant rarely agree.
    queue_saturation_ratio: float = 0.9
    queue_waiting_share: float = 0.5
    queue_saturation_window: str = "5m"
    queue_saturation_for: str = "10m"
    # Upstream errors (5xx, stream errors, sidecar 502/504) as a share of requests
    error_ratio: float = 0.05
    error_window: str = "5m"
    error_for: str = "1m"  # shorter than the window: a 30 s outage fires (then resolves)
    # GPU memory used / total
    gpu_memory_ratio: float = 0.95
    gpu_memory_for: str = "5m"
    # Requests whose usage could not be measured, as a share of requests
    unmeasured_ratio: float = 0.01
    unmeasured_window: str = "15m"
    unmeasured_for: str = "15m"
    # Traffic around the sidecar (LLMMeterBypassed): the engine's own output-token count
    # (llm_engine_tokens_total) above what the sidecar metered, over the window, by more than
    # this share of the metered count and more than this many tokens, for this long.
    bypass_ratio: float = 0.02
    bypass_min_tokens: float = 1000.0
    bypass_window: str = "1h"
    bypass_for: str = "15m"
    # Sidecar scrape target down
    down_for: str = "2m"
    # A writer (ledger, shipper, access log, audit) that cannot write, for this long
    writer_failing_for: str = "2m"
    # Selectors and identities
    job: str = "tollbooth"
    engine_job: str = "inference"  # the vLLM / TGI server (or the simulator) scraped directly
    # Where docs/runbooks.md is served; set it to your repository's or wiki's address.
    runbook_base: str = "docs/runbooks.md"
    datasource_uid: str = "tollbooth-prometheus"
    traces_datasource_uid: str = "tollbooth-jaeger"
    logs_datasource_uid: str = "tollbooth-loki"
    dashboard_tags: tuple[str, ...] = ("tollbooth", "llm")
    dashboard_refresh: str = "30s"

    @property
    def selector(self) -> str:
        return f'job="{self.job}"'


DEFAULT = Thresholds()


def load(path: str | Path | None = None, **overrides: object) -> Thresholds:
    """Defaults, then a YAML file of overrides, then keyword overrides (tests lower thresholds)."""
    data = load_yaml(path) if path else {}
    data.update(overrides)
    return build(Thresholds, data, prefix="thresholds")
