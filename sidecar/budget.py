"""Spend today, per user and in total, and the optional daily budgets that refuse requests.

Owns: the running spend of the current budget day (restored from the ledger at start, settled as
each request finishes), the `llm_spend_today_usd` gauge, and the 429 a user over budget receives.
Never: counts an unknown cost as zero spend or as spend; it is simply not added.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .config import BudgetConfig
from .meter import Exchange
from .metrics import LabelCap, Metrics
from .proxy import Refusal

DAY = 86400.0


class Spend:
    """Spend since the start of the budget day; rolls over by itself."""

    def __init__(
        self,
        config: BudgetConfig,
        metrics: Metrics,
        users: LabelCap,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.users = users
        self.clock = clock
        self.by_user: dict[str, float] = {}
        self.total = 0.0
        self._day_start = self.day_start(clock())

    def day_start(self, now: float) -> float:
        offset = self.config.day_start_hour_utc * 3600
        return ((now - offset) // DAY) * DAY + offset

    def seconds_to_reset(self) -> float:
        return self._day_start + DAY - self.clock()

    def _roll(self) -> None:
        start = self.day_start(self.clock())
        if start != self._day_start:
            self._day_start = start
            self.by_user.clear()
            self.total = 0.0
            self.metrics.spend_today.clear()

    def restore(self, by_user: dict[str, float]) -> None:
        """Today's spend read from the ledger at start."""
        for user, usd in by_user.items():
            self._add(user, usd)

    def settle(self, ex: Exchange) -> None:
        """A finished request's known cost becomes spend (a sink)."""
        self._roll()
        if ex.cost is not None:
            self._add(ex.user_id, ex.cost.total_usd)

    def _add(self, user: str, usd: float) -> None:
        self.by_user[user] = self.by_user.get(user, 0.0) + usd
        self.total += usd
        self.metrics.child(self.metrics.spend_today, self.users(user)).inc(usd)

    # --- the budget gate

    def limit_for(self, user: str) -> float | None:
        return self.config.users.get(user, self.config.user_daily_usd)

    async def gate(self, ex: Exchange) -> None:
        """Refuse, before reaching the upstream, a request whose user or the whole site is over."""
        self._roll()
        cap = self.config.global_daily_usd
        if cap is not None and self.total >= cap:
            self._refuse("global", f"the daily budget of ${cap:.2f} is spent")
        user_cap = self.limit_for(ex.user_id)
        if user_cap is not None and self.by_user.get(ex.user_id, 0.0) >= user_cap:
            self._refuse(
                "user", f"user '{ex.user_id}' has spent the daily budget of ${user_cap:.2f}"
            )
        return None

    def _refuse(self, scope: str, message: str) -> None:
        self.metrics.budget_rejections.labels(scope).inc()
        raise Refusal(
            429,
            "budget_exceeded",
            message + "; it resets at the start of the next budget day",
            retry_after=self.seconds_to_reset(),
        )

    @property
    def enforcing(self) -> bool:
        c = self.config
        return c.global_daily_usd is not None or c.user_daily_usd is not None or bool(c.users)
