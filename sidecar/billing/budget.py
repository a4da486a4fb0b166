"""Daily budgets that hold under concurrency: reserve the worst case first, settle to the measured.

Owns: the budget day, the scopes a request is charged to (global, its team, its user) and their
limits, the hold a request reserves before it reaches the queue or the upstream (its worst-case
cost), settling that hold to what was measured when the request ends, the `llm_spend_today_usd`
gauge, and the 429 a request over budget receives.
The store is an interface (`BudgetStore`): `LocalStore` keeps one process's state; fleet mode puts
the same holds in a shared store. Amounts are integer micro-dollars; holds are keyed by request id
so a repeated reserve or settle does nothing twice.
Never: exports a hold as spend, or counts an unknown cost as $0 for a request that reached the
server (see `charge`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Literal, Protocol

from ..config import AdmissionConfig, BudgetConfig, ModelPrice
from ..exchange import (
    AUDIO_ROUTES,
    BudgetHold,
    Exchange,
    Refusal,
    RequestInfo,
    consumed,
    priced_model,
)
from ..exchange import measured as measured_in_full
from ..metering.pricing import PriceBook, compute
from ..telemetry.metrics import LabelCap, Metrics

log = logging.getLogger("tollbooth.budget")

DAY = 86400
MICRO = 1_000_000
# Larger token counts are read as this: the hold stays a finite number (and is refused).
MAX_TOKENS = 2**31
# Every micro-dollar amount (hold, charge, limit, seed) is at most this ($9.0e9): exact in a
# double (Lua's numbers), and far inside the int64 of a Redis hash field, so that no store's sum
# overflows. The stores saturate their totals at it too (docs/budgets.md, "Numbers").
MAX_MICROS = 2**53 - 1


def to_micros(usd: float) -> int:
    """Dollars to integer micro-dollars, rounded up: a hold or a charge never rounds to less.
    Within [0, MAX_MICROS]: a negative amount is 0 (never a credit), an infinite or NaN one the
    most (never less than it could be). The 1e-6 absorbs float noise (0.1 * 1e6 is not exact)."""
    if not usd > 0:  # also NaN
        return 0 if usd <= 0 else MAX_MICROS
    micros = usd * MICRO - 1e-6
    return MAX_MICROS if micros >= MAX_MICROS else max(0, math.ceil(micros))


def valid_micros(amount: int) -> bool:
    return 0 <= amount <= MAX_MICROS


def usd(micros: int) -> float:
    return micros / MICRO


def money(amount: float) -> str:
    """$0.10, $40.00, but $0.001 (never a small budget printed as $0.00)."""
    return f"${amount:.2f}" if round(amount, 2) == amount else f"${amount:.6g}"


@dataclass(frozen=True, slots=True)
class Scope:
    kind: Literal["global", "team", "user"]
    name: str
    limit: int  # micro-dollars per budget day

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.name}"


@dataclass(frozen=True, slots=True)
class Hold:
    request_id: str  # the sidecar's uid of the request, never a client-chosen id
    day: int  # start of the budget day it is charged to, unix seconds
    amount: int  # micro-dollars reserved
    scopes: tuple[Scope, ...]


@dataclass(frozen=True, slots=True)
class Verdict:
    admitted: bool
    scope: Scope | None = None  # the scope the hold would overrun
    reason: Literal["ok", "budget", "capacity", "unavailable"] = "ok"


class BudgetStore(Protocol):
    """Where holds and spend live. Every method is idempotent per request id."""

    async def reserve(self, hold: Hold) -> Verdict:
        """Atomically, over all scopes: admit when spent + held + amount <= limit for each, and
        hold the amount on each; else change nothing."""
        ...

    def settle(self, request_id: str, charge: int) -> None:
        """Replace the hold by `charge` micro-dollars of spend (0 releases it). Never blocks:
        a remote store sends it in the background."""
        ...

    async def seed(self, day: int, spent: Mapping[str, int]) -> None:
        """Spend already in the ledger for `day`, by scope key; set only where absent."""
        ...


class LocalStore:
    """One process's holds and spend, for the current budget day only. A hold or a spend never
    goes negative: an amount out of [0, MAX_MICROS] is clamped into it and counted
    (`tollbooth_metering_errors_total{stage="budget_amount"}`)."""

    def __init__(self, max_scopes: int, metrics: Metrics | None = None) -> None:
        self.max_scopes = max_scopes
        self.metrics = metrics
        self.day = -1
        self.spent: dict[str, int] = {}
        self.held: dict[str, int] = {}
        self.holds: dict[str, Hold] = {}

    def _checked(self, amount: int) -> int:
        if valid_micros(amount):
            return amount
        log.error("budget amount %r out of range: clamped", amount)
        if self.metrics is not None:
            self.metrics.metering_errors.labels("budget_amount").inc()
        return min(max(amount, 0), MAX_MICROS)

    def _at(self, day: int) -> bool:
        """Move to `day` if it is newer; False for a day already gone."""
        if day > self.day:
            self.day = day
            self.spent.clear()
            self.held.clear()
            self.holds = {k: h for k, h in self.holds.items() if h.day >= day}
        return day == self.day

    async def reserve(self, hold: Hold) -> Verdict:
        if hold.request_id in self.holds or not self._at(hold.day):
            return Verdict(True)
        if (amount := self._checked(hold.amount)) != hold.amount:
            hold = replace(hold, amount=amount)
        new = sum(1 for s in hold.scopes if s.key not in self.spent)
        if new and len(self.spent) + new > self.max_scopes:
            return Verdict(
                False, next(s for s in hold.scopes if s.key not in self.spent), "capacity"
            )
        need = max(hold.amount, 1)  # a spent budget admits nothing, not even a $0 hold
        for s in hold.scopes:
            if self.spent.get(s.key, 0) + self.held.get(s.key, 0) + need > s.limit:
                return Verdict(False, s, "budget")
        for s in hold.scopes:
            self.spent.setdefault(s.key, 0)
            self.held[s.key] = self.held.get(s.key, 0) + hold.amount
        self.holds[hold.request_id] = hold
        return Verdict(True)

    def settle(self, request_id: str, charge: int) -> None:
        hold = self.holds.pop(request_id, None)
        if hold is None or hold.day != self.day:
            return
        charge = self._checked(charge)
        for s in hold.scopes:
            self.held[s.key] = max(0, self.held.get(s.key, 0) - hold.amount)
            self.spent[s.key] = min(self.spent.get(s.key, 0) + charge, MAX_MICROS)

    async def seed(self, day: int, spent: Mapping[str, int]) -> None:
        if not self._at(day):
            return
        for key, micros in spent.items():
            if key not in self.spent and len(self.spent) < self.max_scopes:
                self.spent[key] = self._checked(micros)


class Budgets:
    """The gate and the sink around a `BudgetStore`."""

    def __init__(
        self,
        config: BudgetConfig,
        admission: AdmissionConfig,
        metrics: Metrics,
        users: LabelCap,
        prices: PriceBook,
        store: BudgetStore | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.chars_per_token = admission.chars_per_token
        self.metrics = metrics
        self.users = users
        self.prices = prices
        self.store: BudgetStore = store or LocalStore(
            config.max_tracked_users + 1 + len(config.teams), metrics
        )
        self.clock = clock
        self._gauge_day = self.day_start(clock())

    @property
    def enforcing(self) -> bool:
        c = self.config
        return any(
            (
                c.global_daily_usd is not None,
                c.user_daily_usd is not None,
                bool(c.users),
                c.team_daily_usd is not None,
                bool(c.teams),
            )
        )

    def day_start(self, now: float) -> int:
        offset = self.config.day_start_hour_utc * 3600
        return int((now - offset) // DAY) * DAY + offset

    def seconds_to_reset(self) -> float:
        return self.day_start(self.clock()) + DAY - self.clock()

    # --- what a request is charged to, and its worst case

    def scopes(self, user: str, team: str | None) -> tuple[Scope, ...]:
        c, out = self.config, []
        if c.global_daily_usd is not None:
            out.append(Scope("global", "*", to_micros(c.global_daily_usd)))
        team_cap = c.teams.get(team, c.team_daily_usd) if team else None
        if team and team_cap is not None:
            out.append(Scope("team", team, to_micros(team_cap)))
        user_cap = c.users.get(user, c.user_daily_usd)
        if user_cap is not None:
            out.append(Scope("user", user, to_micros(user_cap)))
        return tuple(out)

    def worst_case_usd(self, ex: Exchange) -> float:
        """The prompt (exact when sized by the upstream, else every character of the body's text
        over chars_per_token plus any token ids) at the input price, plus every output token the
        request may generate (its limit, or the default, times its choices: n x prompts) at the
        output price. $0 for a model without a price: its cost is unknown and is not spend."""
        price = self.prices.price(priced_model(ex))
        if price is None:
            return 0.0
        info = ex.info
        if info.endpoint in AUDIO_ROUTES:
            return self._audio_worst_case(price, info)
        prompt = ex.prompt_tokens
        if prompt is None:
            chars = info.text_chars if info.parsed else len(info.body)
            prompt = math.ceil(chars / self.chars_per_token) + info.prompt_ids
        limit = info.max_tokens or self.config.default_max_output_tokens
        out = min(limit, MAX_TOKENS) * min(info.choices, MAX_TOKENS)
        return compute(price, min(prompt, MAX_TOKENS), None, out).total_usd

    def _audio_worst_case(self, price: ModelPrice, info: RequestInfo) -> float:
        """An audio request: its upload (the Content-Length, else the largest one taken) as one
        second per budgets.audio_bytes_per_second at the audio price, plus its output limit
        (or the default) as tokens at the output price: a stream is billed in tokens."""
        seconds = math.ceil(info.audio_bytes / self.config.audio_bytes_per_second)
        limit = info.max_tokens or self.config.default_max_output_tokens
        audio = seconds * (price.audio_per_second or 0.0)
        return audio + compute(price, 0, None, min(limit, MAX_TOKENS)).total_usd

    # --- the gate and the sink

    async def gate(self, ex: Exchange) -> None:
        """Reserve the worst case on every scope, or refuse before the queue and the upstream."""
        scopes = self.scopes(ex.user_id, ex.team)
        if not scopes:
            return None
        if ex.info.endpoint in AUDIO_ROUTES and priced_model(ex) is None:
            # The answer names no model: a model the head did not show is never priced after.
            raise Refusal(
                400,
                "invalid_request_error",
                "with budgets enforced, the form field 'model' must come before the file, as "
                "the OpenAI SDKs send it, within server.audio_form_bytes (or set "
                "upstream.model_name)",
            )
        if ex.info.unreadable:  # the server may read it; the hold could not: never guess low
            raise Refusal(
                400,
                "invalid_request_error",
                f"'{ex.info.unreadable[0]}' must be a non-negative integer, under the "
                "name the API gives it (a Go server reads 'MAX_TOKENS' as 'max_tokens')",
            )
        hold = Hold(
            ex.uid, self.day_start(self.clock()), to_micros(self.worst_case_usd(ex)), scopes
        )
        verdict = await self.store.reserve(hold)
        if verdict.admitted:
            ex.budget_hold = hold
            # The request belongs to the day it was admitted in, its ledger row (ts: the start,
            # once the body was read) too, when a boundary fell between its start and this
            # admission (a restart restores by ts).
            ex.started_at = max(ex.started_at, float(hold.day))
            return None
        self._refuse(verdict, hold.amount, ex.user_id)

    def _refuse(self, verdict: Verdict, amount: int, user: str) -> None:
        if verdict.reason == "unavailable":
            raise Refusal(
                503,
                "budget_store_unavailable",
                "the shared budget store cannot be reached; try again shortly",
                retry_after=1,
            )
        scope = verdict.scope
        assert scope is not None
        self.metrics.budget_rejections.labels(scope.kind).inc()
        self.metrics.budget_refusals.labels(self.users(user), scope.kind, verdict.reason).inc()
        if verdict.reason == "capacity":
            log.warning(
                "budget table full (%d users): refusing new user", self.config.max_tracked_users
            )
            message = "too many distinct users today for per-user budgets"
        else:
            who = {
                "global": "the site",
                "team": f"team '{scope.name}'",
                "user": f"user '{scope.name}'",
            }
            message = (
                f"{who[scope.kind]} would exceed the daily budget of {money(usd(scope.limit))} "
                f"(this request may cost up to {money(usd(amount))})"
            )
        raise Refusal(
            429,
            "budget_exceeded",
            message + "; it resets at the start of the next budget day",
            retry_after=self.seconds_to_reset(),
        )

    def settle(self, ex: Exchange) -> None:
        """A sink: the hold becomes the measured charge; measured spend feeds the gauge."""
        measured = self.measured_usd(ex)
        hold = ex.budget_hold
        if hold is not None:
            self.store.settle(hold.request_id, self.charge(ex, hold, measured))
        if measured:
            self._gauge(ex.user_id, measured, self.request_day(ex))

    def request_day(self, ex: Exchange) -> int:
        """The budget day a request belongs to: the one it was admitted in (its hold's), else
        the one it started in. Never the day it happens to end in."""
        if ex.budget_hold is not None:
            return int(ex.budget_hold.day)
        return self.day_start(ex.started_at)

    def measured_usd(self, ex: Exchange) -> float:
        if ex.cost is not None:
            return ex.cost.total_usd
        if ex.usage.input_tokens is not None and consumed(ex):
            return self.prices.input_cost(priced_model(ex), ex.usage) or 0.0
        return 0.0

    def charge(self, ex: Exchange, hold: BudgetHold, measured: float) -> int:
        """What the budget is charged: the measured cost; for a request that reached the server
        and whose usage was not measured in full (either direction unknown), at least its hold:
        a client cannot make output free by hiding it from the meter."""
        partial = not measured_in_full(ex.usage)
        if partial and ex.upstream_start is not None and consumed(ex):
            self.metrics.budget_unmeasured_charges.inc()
            return max(hold.amount, to_micros(measured))
        return to_micros(measured)

    def _gauge(self, user: str, amount: float, day: int) -> None:
        """Spend of budget day `day` on today's gauge: an earlier day's (a stream admitted before
        the boundary that ended after it) is that day's, in the ledger and the report, not
        today's."""
        now = self.clock()
        if not self._gauge_day <= now < self._gauge_day + DAY:  # another budget day
            self._gauge_day = self.day_start(now)
            self.metrics.clear(self.metrics.spend_today)
        if day >= self._gauge_day:
            self.metrics.child(self.metrics.spend_today, self.users(user)).inc(amount)

    async def restore(self, by_user: Mapping[str, float], by_team: Mapping[str, float]) -> None:
        """Today's spend read from the ledger at start: the gauge and the store."""
        self.restore_gauge(by_user)
        await self.store.seed(self.day_start(self.clock()), spent_by_scope(by_user, by_team))

    def restore_gauge(self, by_user: Mapping[str, float]) -> None:
        """This process's spend today (its own ledger): the gauge only. A shared store seeds
        itself from the fleet's ledger."""
        today = self.day_start(self.clock())
        for user, amount in by_user.items():
            self._gauge(user, amount, today)


def spent_by_scope(by_user: Mapping[str, float], by_team: Mapping[str, float]) -> dict[str, int]:
    """Spend by user and team (dollars) as micro-dollars by scope key, with the global total."""
    spent = {f"user:{u}": to_micros(a) for u, a in by_user.items()}
    spent.update({f"team:{t}": to_micros(a) for t, a in by_team.items()})
    spent["global:*"] = to_micros(sum(by_user.values()))
    return spent
