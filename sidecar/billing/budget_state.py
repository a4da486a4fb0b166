"""Each daily budget's limit and what is left of it, read at scrape time.

Owns: `llm_budget_limit_usd{scope,name}` (every configured limit: the site's, each team's, the
per-user default as name="*", each per-user override) and `llm_budget_remaining_usd{scope,name}`
(the site's, and each user's with spend on today's gauge: limit minus `llm_spend_today_usd`, never
below 0). Bounded: the configured limits, and the users of the spend gauge (the label cap).
Never: estimates (a team's remainder is not kept per sidecar, so it is absent, not guessed), runs
on the request path, or writes anything.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..config import BudgetConfig
from ..telemetry.metrics import OTHER, Metrics

LIMIT = "llm_budget_limit_usd"
REMAINING = "llm_budget_remaining_usd"


class BudgetState(Collector):
    def __init__(self, config: BudgetConfig, metrics: Metrics) -> None:
        self.config, self.metrics = config, metrics

    def collect(self) -> Iterator[Metric]:
        c = self.config
        limit = GaugeMetricFamily(
            LIMIT,
            'Daily budget in USD of each configured scope (user name "*": the per-user default).',
            labels=["scope", "name"],
        )
        if c.global_daily_usd is not None:
            limit.add_metric(["global", "*"], c.global_daily_usd)
        if c.team_daily_usd is not None:
            limit.add_metric(["team", "*"], c.team_daily_usd)
        for team, usd in c.teams.items():
            limit.add_metric(["team", team], usd)
        if c.user_daily_usd is not None:
            limit.add_metric(["user", "*"], c.user_daily_usd)
        for user, usd in c.users.items():
            limit.add_metric(["user", user], usd)
        yield limit
        yield self._remaining()

    def _remaining(self) -> GaugeMetricFamily:
        c = self.config
        left = GaugeMetricFamily(
            REMAINING,
            "What is left today of the site's and each user's daily budget, in USD: the limit "
            "minus llm_spend_today_usd (settled spend; requests in flight hold more).",
            labels=["scope", "name"],
        )
        spent = {
            s.labels["user_id"]: s.value
            for fam in self.metrics.spend_today.collect()
            for s in fam.samples
        }
        if c.global_daily_usd is not None:
            left.add_metric(["global", "*"], max(0.0, c.global_daily_usd - sum(spent.values())))
        for user, usd in spent.items():
            cap = c.users.get(user, c.user_daily_usd)
            if cap is not None and user != OTHER:
                left.add_metric(["user", user], max(0.0, cap - usd))
        return left
