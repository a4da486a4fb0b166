"""Each budget's limit, what is left of it and how much of it is used, read at scrape time.

Owns: `llm_budget_limit_usd{scope,name}` (every configured day limit: the site's, each team's,
project's, tag's and model's, the defaults as name="*", each named one) and
`llm_budget_remaining_usd{scope,name}` (the site's, and each user's with spend on today's gauge:
limit minus `llm_spend_today_usd`, never below 0); `llm_budget_used_ratio{scope,name,window}` of
each limit (spent / limit, as the budget store holds it now: settled spend, and in a fleet the
spend Redis answered at this sidecar's last admission to that scope) beside
`llm_budget_soft_ratio{scope,name,window}` (the limit's `soft`, so the alert compares the two and
holds no number). Bounded: the configured limits, the users of the spend gauge (the label cap),
and at most RATIO_SERIES names per "*" limit (those nearest their limit).
Never: estimates (a team's remainder is not kept per sidecar, so it is absent, not guessed), runs
on the request path, or writes anything.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..config import BudgetConfig, LimitConfig, limit_list
from ..telemetry.metrics import OTHER, Metrics
from .budget import Budgets, Rule, Scope, to_micros

LIMIT = "llm_budget_limit_usd"
REMAINING = "llm_budget_remaining_usd"
USED = "llm_budget_used_ratio"
SOFT = "llm_budget_soft_ratio"
RATIO_SERIES = 200  # names per "*" limit on the used-ratio gauge: the nearest to the limit


class BudgetState(Collector):
    def __init__(
        self, config: BudgetConfig, metrics: Metrics, budgets: Budgets | None = None
    ) -> None:
        self.config, self.metrics, self.budgets = config, metrics, budgets

    def collect(self) -> Iterator[Metric]:
        limit = GaugeMetricFamily(
            LIMIT,
            'Daily budget in USD of each configured scope (user name "*": the per-user default).',
            labels=["scope", "name"],
        )
        for lim in limit_list(self.config):  # the day limits (month ones: llm_budget_used_ratio)
            if lim.window == "day":
                limit.add_metric([lim.scope, lim.name], lim.usd)
        yield limit
        yield self._remaining()
        if self.budgets is not None and self.budgets.rules:
            yield from self._ratios(self.budgets)

    def _ratios(self, budgets: Budgets) -> Iterator[GaugeMetricFamily]:
        labels = ["scope", "name", "window"]
        used = GaugeMetricFamily(
            USED,
            "Spend / limit of each budget scope, as the budget store holds it "
            '(settled spend; a "*" limit: its names nearest the limit).',
            labels=labels,
        )
        soft = GaugeMetricFamily(
            SOFT, "The soft limit of each series of llm_budget_used_ratio.", labels=labels
        )
        spent = budgets.store.spent_now(budgets.day_start(budgets.clock()))
        for rule in budgets.rules:
            for name, lim, ratio in _rule_ratios(rule, spent):
                used.add_metric([rule.kind, name, rule.window], ratio)
                if lim.soft is not None:
                    soft.add_metric([rule.kind, name, rule.window], lim.soft)
        yield used
        yield soft

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


def _rule_ratios(rule: Rule, spent: Mapping[str, int]) -> Iterator[tuple[str, LimitConfig, float]]:
    """(name, limit, spent / limit) of each limit of `rule` with spend in the store."""
    prefix = Scope(rule.kind, "", 0, rule.window).key
    for name, lim in rule.named.items():
        cap = to_micros(lim.usd)
        if cap > 0 and prefix + name in spent:
            yield name, lim, spent[prefix + name] / cap
    each = rule.each
    if each is None or to_micros(each.usd) == 0:
        return
    cap = to_micros(each.usd)
    names = (
        (key[len(prefix) :], micros)
        for key, micros in spent.items()
        if key.startswith(prefix) and key[len(prefix) :] not in rule.named
    )
    for name, micros in heapq.nlargest(RATIO_SERIES, names, key=lambda nm: nm[1]):
        yield name, each, micros / cap
