"""Budgets that hold under concurrency: reserve the worst case first, settle to the measured.

Owns: the budget day and month, the limits (`budgets.limits` and the day shorthands), the scopes a
request is charged to (global, its user, team, project, each tag, its model; each in a day or a
month window) and their limits, the hold a request reserves before it reaches the queue or the
upstream (its worst-case cost) on all of them at once, settling that hold to what was measured
when the request ends, the `llm_spend_today_usd` gauge, the 429 a request over budget
receives, and the 503 of a request to a server of one model the price book cannot price.
The store is an interface (`BudgetStore`): `LocalStore` keeps one process's state; fleet mode puts
the same holds in a shared store. Amounts are integer micro-dollars; holds are keyed by request id
so a repeated reserve or settle does nothing twice.
Never: exports a hold as spend, or counts an unknown cost as $0 for a request that reached the
server (see `charge`).
"""

from __future__ import annotations

import calendar
import datetime
import functools
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal, NoReturn, Protocol

from ..config import (
    AdmissionConfig,
    BudgetConfig,
    LimitConfig,
    MeteringConfig,
    ModelPrice,
    limit_list,
)
from ..exchange import (
    AUDIO_ROUTES,
    UNKNOWN_MODEL,
    BudgetHold,
    Exchange,
    Refusal,
    RequestInfo,
    consumed,
    held_output,
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
# Served models without a price that are logged (once each); more are counted, not logged.
UNPRICED_LOGGED = 64


def to_micros(usd: float) -> int:
    """Dollars to integer micro-dollars, rounded up: a hold or a charge never rounds to less.
    Within [0, MAX_MICROS]: a negative amount is 0 (never a credit), an infinite or NaN one the
    most (never less than it could be). The 1e-6 absorbs float noise (0.1 * 1e6 is not exact)."""
    if not usd > 0:  # also NaN
        return 0 if usd <= 0 else MAX_MICROS
    micros = usd * MICRO - 1e-6
    return MAX_MICROS if micros >= MAX_MICROS else max(0, math.ceil(micros))


def usd(micros: int) -> float:
    return micros / MICRO


def money(amount: float) -> str:
    """$0.10, $40.00, but $0.001 (never a small budget printed as $0.00)."""
    return f"${amount:.2f}" if round(amount, 2) == amount else f"${amount:.6g}"


Kind = Literal["global", "team", "user", "project", "tag", "model"]
Window = Literal["day", "month"]
KINDS: tuple[Kind, ...] = ("global", "team", "user", "project", "tag", "model")
MONTH = "month:"  # the key prefix of a month window's scope (a day's has none: keys as before)


@functools.lru_cache(maxsize=64)
def month_start(day: int) -> int:
    """The start of the budget month of budget day `day`: its first day's start (UTC), at the
    same hour as every budget day."""
    offset = day % DAY
    first = datetime.datetime.fromtimestamp(day - offset, datetime.UTC).date().replace(day=1)
    return calendar.timegm(first.timetuple()) + offset


def next_month(day: int) -> int:
    """The start of the budget month after the one of day `day`."""
    return month_start(month_start(day) + 32 * DAY)


@dataclass(frozen=True, slots=True)
class Scope:
    kind: Kind
    name: str
    limit: int  # micro-dollars per window
    window: Window = "day"

    @property
    def key(self) -> str:
        base = f"{self.kind}:{self.name}"
        return base if self.window == "day" else MONTH + base


@dataclass(frozen=True, slots=True)
class Rule:
    """The limits of one scope kind and window: the "*" one, and those by name."""

    kind: Kind
    window: Window
    each: LimitConfig | None
    named: Mapping[str, LimitConfig]


def rules(config: BudgetConfig) -> tuple[Rule, ...]:
    """One rule per scope kind and window that has a limit, in KINDS order, day before month."""
    limits = limit_list(config)
    out = []
    for kind in KINDS:
        for window in ("day", "month"):
            mine = [lim for lim in limits if lim.scope == kind and lim.window == window]
            if mine:
                each = next((lim for lim in mine if lim.name == "*"), None)
                named = {lim.name: lim for lim in mine if lim.name != "*"}
                out.append(Rule(kind, window, each, named))
    return tuple(out)


def max_scopes(config: BudgetConfig) -> int:
    """Scopes tracked per window: max_tracked_users for each "*" limit, plus every named one (and
    the global one). A new scope beyond this is refused (docs/budgets.md, Memory)."""
    limits = limit_list(config)
    each = sum(1 for lim in limits if lim.name == "*" and lim.scope != "global")
    return config.max_tracked_users * max(1, each) + len(limits) + 1


@dataclass(frozen=True, slots=True)
class Hold:
    request_id: str  # the sidecar's uid of the request, never a client-chosen id
    day: int  # start of the budget day it is charged to, unix seconds
    amount: int  # micro-dollars reserved
    scopes: tuple[Scope, ...]
    # the name asked for has no price: held at the book's dearest, charged as before (nothing
    # unless the answer names a priced model)
    unpriced: bool = False


@dataclass(frozen=True, slots=True)
class Verdict:
    admitted: bool
    scope: Scope | None = None  # the scope the hold would overrun
    reason: Literal["ok", "budget", "capacity", "unavailable"] = "ok"
    # admitted: the least left of its scopes once this hold is counted (micro-dollars), where
    # the store decided it (None: admitted without a decision, e.g. `store_unavailable: open`)
    left: int | None = None


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
        """Spend already in the ledger for `day` (and its month, for month scope keys), by scope
        key; set only where absent."""
        ...

    async def usage(self, day: int, scopes: Sequence[Scope]) -> list[tuple[int, int]] | None:
        """(spent, held) of each scope in day `day` (month scopes: its month); None when the
        store cannot tell now."""
        ...

    def spent_now(self, day: int) -> Mapping[str, int]:
        """Spend by scope key of day `day` and its month, as far as this process knows it now,
        without waiting on anything (read at scrape time)."""
        ...


class LocalStore:
    """One process's holds and spend, for the current budget day only. A hold or a spend never
    goes negative: an amount out of [0, MAX_MICROS] is clamped into it and counted
    (`tollbooth_metering_errors_total{stage="budget_amount"}`)."""

    def __init__(self, max_scopes: int, metrics: Metrics | None = None) -> None:
        self.max_scopes = max_scopes
        self.metrics = metrics
        self.day = -1
        self.month = -1
        self.spent: dict[str, int] = {}
        self.held: dict[str, int] = {}
        self.holds: dict[str, Hold] = {}

    def _checked(self, amount: int) -> int:
        if 0 <= amount <= MAX_MICROS:
            return amount
        log.error("budget amount %r out of range: clamped", amount)
        if self.metrics is not None:
            self.metrics.metering_errors.labels("budget_amount").inc()
        return min(max(amount, 0), MAX_MICROS)

    def _at(self, day: int) -> bool:
        """Move to `day` if it is newer (a new month: to its month too); False for a day already
        gone. A new day forgets the day scopes; the month scopes go with their month only."""
        if day > self.day:
            self.spent = dict(_current(self.spent, self.day, self.month, day))
            self.held = dict(_current(self.held, self.day, self.month, day))
            self.day, self.month = day, month_start(day)
            self.holds = {k: h for k, h in self.holds.items() if h.day >= self.month}
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
        left = MAX_MICROS
        for s in hold.scopes:
            room = s.limit - self.spent.get(s.key, 0) - self.held.get(s.key, 0)
            if need > room:
                return Verdict(False, s, "budget")
            left = min(left, room - hold.amount)
        for s in hold.scopes:
            self.spent.setdefault(s.key, 0)
            self.held[s.key] = self.held.get(s.key, 0) + hold.amount
        self.holds[hold.request_id] = hold
        return Verdict(True, left=left)

    def settle(self, request_id: str, charge: int) -> None:
        hold = self.holds.pop(request_id, None)
        if hold is None:
            return
        if hold.day == self.day:
            scopes: Iterable[Scope] = hold.scopes
        elif month_start(hold.day) == self.month:  # admitted yesterday: only its month is open
            scopes = [s for s in hold.scopes if s.window == "month"]
        else:
            return
        charge = self._checked(charge)
        for s in scopes:
            self.held[s.key] = max(0, self.held.get(s.key, 0) - hold.amount)
            self.spent[s.key] = min(self.spent.get(s.key, 0) + charge, MAX_MICROS)

    async def seed(self, day: int, spent: Mapping[str, int]) -> None:
        if not self._at(day):
            return
        for key, micros in spent.items():
            if key not in self.spent and len(self.spent) < self.max_scopes:
                self.spent[key] = self._checked(micros)

    async def usage(self, day: int, scopes: Sequence[Scope]) -> list[tuple[int, int]] | None:
        spent = _current(self.spent, self.day, self.month, day)
        held = _current(self.held, self.day, self.month, day)
        return [(spent.get(s.key, 0), held.get(s.key, 0)) for s in scopes]

    def spent_now(self, day: int) -> Mapping[str, int]:
        """Spend by scope key in day `day` and its month (the used-ratio gauge)."""
        return _current(self.spent, self.day, self.month, day)

    def note(self, day: int, key: str, spent: int) -> None:
        """Spend of a scope as a shared store answered it, kept like this store's own (the
        used-ratio gauge of a fleet)."""
        if self._at(day) and (key in self.spent or len(self.spent) < self.max_scopes):
            self.spent[key] = spent


def _current(spent: Mapping[str, int], at: int, month: int, day: int) -> Mapping[str, int]:
    """What of `spent` (kept for day `at` and month `month`) belongs to day `day`."""
    if day == at:
        return spent
    if month_start(day) == month:
        return {k: v for k, v in spent.items() if k.startswith(MONTH)}
    return {}


# (user, team, project, tags comma-joined, model, 1 if in today's budget day, measured cost USD,
# what the budgets were charged USD: at least the hold where usage was not measured): spend
# grouped from a ledger since the start of the budget month (ledger.spend_rows)
SpendRow = tuple[str | None, str | None, str | None, str | None, str | None, int, float, float]


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
        teams: LabelCap | None = None,
    ) -> None:
        self.config = config
        self.chars_per_token = admission.chars_per_token
        self.metrics = metrics
        self.users = users
        # `teams or ...` would not do: an empty LabelCap is falsy (it has a length)
        self.teams = LabelCap(MeteringConfig().max_tracked_teams) if teams is None else teams
        self.prices = prices
        self.rules = rules(config)
        self.store: BudgetStore = store or LocalStore(max_scopes(config), metrics)
        self.clock = clock
        self._gauge_day = self.day_start(clock())
        self._unpriced_logged: set[str] = set()

    def day_start(self, now: float) -> int:
        offset = self.config.day_start_hour_utc * 3600
        return int((now - offset) // DAY) * DAY + offset

    def seconds_to_reset(self, window: Window = "day") -> float:
        now = self.clock()
        day = self.day_start(now)
        return (day + DAY if window == "day" else next_month(day)) - now

    # --- what a request is charged to, and its worst case

    def scopes_for(
        self,
        user: str,
        team: str | None,
        project: str | None,
        tags: Sequence[str],
        model: str | None,
    ) -> tuple[Scope, ...]:
        """Every limit that applies to a request or a ledger row: its user's, team's, project's,
        each of its tags', its model's and the global one, in each window that has one."""
        names = {"global": "*", "user": user, "team": team, "project": project, "model": model}
        out = []
        for rule in self.rules:
            one = names.get(rule.kind)  # None for tag: a request has any number of tags
            for name in tags if rule.kind == "tag" else (one,) if one else ():
                lim = rule.named.get(name, rule.each)
                if lim is not None:
                    out.append(Scope(rule.kind, name, to_micros(lim.usd), rule.window))
        return tuple(out)

    def worst_case_usd(self, ex: Exchange, limit: int | None = None) -> float:
        """The prompt (exact when sized by the upstream, else every character of the body's text
        over chars_per_token plus any token ids) at the input price, plus every output token the
        request may generate (`limit`, by default `held_output`: its limit as the route's server
        reads it, else the server's own (`Exchange.server_limit`) or the default, none on a
        route that generates nothing; times its choices: n x
        prompts) at the output price. A name the price book does not list is held at the book's
        dearest prices: the engine may answer it as a listed model, charged at that one's price.
        $0 only with no price at all."""
        price = self.prices.hold_price(priced_model(ex))
        if price is None:
            return 0.0
        info = ex.info
        if info.endpoint in AUDIO_ROUTES:
            return self._audio_worst_case(price, info)
        prompt = ex.prompt_tokens
        if prompt is None:
            chars = info.text_chars if info.parsed else len(info.body)
            prompt = math.ceil(chars / self.chars_per_token) + info.prompt_ids
        if limit is None:
            limit = self._held_output(ex)
        out = min(limit, MAX_TOKENS) * min(info.choices, MAX_TOKENS)
        return compute(price, min(prompt, MAX_TOKENS), None, out).total_usd

    def _held_output(self, ex: Exchange) -> int:
        """The output one choice is held at: `held_output`, else the limit its server applies to
        a request that sets none (TGI's max_total_tokens, whole: its prompt, which TGI's limit
        leaves out, is only estimated here, and an estimate above the count would hold less
        than TGI may run; SGLang's default max_new_tokens), else the default."""
        limit = held_output(ex.info)
        if limit is None:
            limit = ex.server_limit
        return self.config.default_max_output_tokens if limit is None else limit

    def unmeasured_usd(self, ex: Exchange) -> float:
        """The worst case an unmeasured request is charged beside its hold (the larger), when
        its stream showed that the server ignored the limit the hold read: more events carried
        output (`Exchange.output_events`, each at least one token) than that limit allows its
        choices. Then its output limit is the one every server behind the route obeys,
        `RequestInfo.output_cap` (the cap on its counted output), else the default: vLLM's chat
        reads `max_completion_tokens` first, which Ollama's /v1/chat/completions ignores (it
        obeys `max_tokens` only), or the events seen when more. Otherwise (a server that
        obeyed it, or nothing streamed) the hold is the worst case: $0 here. The audio routes
        (vLLM's alone) keep their hold."""
        info = ex.info
        if info.endpoint in AUDIO_ROUTES:
            return 0.0
        echoed = info.choices if info.echoed else 0  # vLLM's echo: an event a choice, no token
        if ex.output_events <= self._held_output(ex) * info.choices + echoed:
            return 0.0
        cap = info.output_cap
        limit = self.config.default_max_output_tokens if cap is None else cap
        # and never below what the client was seen to get: a server past even that limit
        # streamed at least one token an event (a choice's share, rounded up)
        seen = -(-ex.output_events // max(1, info.choices))
        return self.worst_case_usd(ex, max(limit, seen))

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
        scopes = self.scopes_for(ex.user_id, ex.team, ex.project, ex.tags, ex.model)
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
        if (served := self.unpriced_served_model(ex)) is not None:
            self._refuse_unpriced(served, ex.model)
        if ex.info.unreadable:  # the server may read it; the hold could not: never guess low
            raise Refusal(
                400,
                "invalid_request_error",
                f"'{ex.info.unreadable[0]}' must be a non-negative integer, under the "
                "name the API gives it (a Go server reads 'MAX_TOKENS' as 'max_tokens')",
            )
        if ex.server_limit_unknown:  # held at the default, the server may run far past it
            raise Refusal(
                503,
                "upstream_limit_unknown",
                "with budgets enforced, a request without an output limit is held at the "
                "server's own (TGI's max_total_tokens, from its /info; SGLang's default "
                "max_new_tokens, from its /model_info), which cannot be read now; set "
                "'parameters.max_new_tokens' ('sampling_params.max_new_tokens' on SGLang, "
                "'max_tokens' on the OpenAI routes) or try again shortly",
                retry_after=5,  # TgiInfo.RETRY_S, SGLangDefault.RETRY_S: asked again after it
            )
        hold = Hold(
            ex.uid,
            self.day_start(self.clock()),
            to_micros(self.worst_case_usd(ex)),
            scopes,
            unpriced=self.prices.price(priced_model(ex)) is None,
        )
        verdict = await self.store.reserve(hold)
        if verdict.admitted:
            ex.budget_hold = hold
            if verdict.left is not None:
                ex.budget_left_usd = usd(verdict.left)
            # The request belongs to the day it was admitted in, its ledger row (ts: the start,
            # once the body was read) too, when a boundary fell between its start and this
            # admission (a restart restores by ts).
            ex.started_at = max(ex.started_at, float(hold.day))
            return None
        self._refuse(verdict, hold.amount, ex.user_id)

    def unpriced_served_model(self, ex: Exchange) -> str | None:
        """The model a server of one model serves (`Exchange.served_model`: upstream.model_name,
        else TGI's /info model_id), where a book that prices by model has no price for it: every
        request is priced at it, never at the name it sends or is answered with, so none would
        have a price and each would settle as unpriced, $0. None otherwise (the unknown model,
        whose name is not known, is held and charged at the dearest)."""
        served = ex.served_model
        if served is None or served == UNKNOWN_MODEL or not self.prices.config.models:
            return None
        return served if self.prices.price(served) is None else None

    def _refuse_unpriced(self, served: str, label: str) -> NoReturn:
        self.metrics.child(self.metrics.budget_unpriced_refusals, label).inc()
        if served not in self._unpriced_logged and len(self._unpriced_logged) < UNPRICED_LOGGED:
            self._unpriced_logged.add(served)
            log.warning(
                "the upstream serves '%s', which pricing.models does not list and there is no "
                "pricing.default: with budgets enforced its requests are refused (503 "
                "model_not_priced) until it is priced",
                served,
            )
        raise Refusal(
            503,
            "model_not_priced",
            f"with budgets enforced, every request here is priced as the model the server "
            f"serves, '{served}' (upstream.model_name, else TGI's /info model_id), which "
            "pricing.models does not list and there is no pricing.default; the operator can "
            "add its price under pricing.models, or set upstream.model_name to the listed "
            "name it is priced as",
        )

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
                "budget table full (%d users a limit): refusing new %s",
                self.config.max_tracked_users,
                scope.kind,
            )
            message = f"too many distinct {scope.kind}s today for per-{scope.kind} budgets"
        else:
            who = "the site" if scope.kind == "global" else f"{scope.kind} '{scope.name}'"
            message = (
                f"{who} would exceed the {'daily' if scope.window == 'day' else 'monthly'} "
                f"budget of {money(usd(scope.limit))} "
                f"(this request may cost up to {money(usd(amount))})"
            )
        window: Window = "day" if scope.window == "day" or verdict.reason == "capacity" else "month"
        raise Refusal(
            429,
            "budget_exceeded",
            message + f"; it resets at the start of the next budget {window}",
            retry_after=self.seconds_to_reset(window),
        )

    def settle(self, ex: Exchange) -> None:
        """A sink: the hold becomes the measured charge; measured spend feeds the gauge."""
        measured = self.measured_usd(ex)
        hold = ex.budget_hold
        if hold is not None:
            charge = self.charge(ex, hold, measured)
            ex.budget_charge_usd = usd(charge)
            self.store.settle(hold.request_id, charge)
        if measured:
            self._gauge(ex.user_id, ex.team, measured, self.request_day(ex))

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
        a client cannot make output free by hiding it from the meter; and at least its worst
        case at the output limit every server behind the route obeys when its stream showed the
        server ignored the limit the hold read (`unmeasured_usd`); and at least its hold when
        it reached a server of one model whose name was not known, or not priced."""
        # a server of one model whose name was not known (TGI's /info unanswered), or is one the
        # book lacks (TGI's /info model_id, its upstream.model_name): its price is unknown,
        # never the name the client sent; the hold (the dearest) stands
        unknown = ex.served_model is not None and ex.cost is None and consumed(ex)
        if hold.unpriced and self.prices.price(priced_model(ex)) is None and not unknown:
            return to_micros(measured)  # no price asked, none served: its cost is unknown
        if not measured_in_full(ex.usage) and ex.upstream_start is not None and consumed(ex):
            self.metrics.budget_unmeasured_charges.inc()
            return max(hold.amount, to_micros(measured), to_micros(self.unmeasured_usd(ex)))
        return max(hold.amount, to_micros(measured)) if unknown else to_micros(measured)

    def _gauge(self, user: str | None, team: str | None, amount: float, day: int) -> None:
        """Spend of budget day `day` on today's gauges (by user; by team when the key has one):
        an earlier day's (a stream admitted before the boundary that ended after it) is that
        day's, in the ledger and the report, not today's."""
        m, now = self.metrics, self.clock()
        if not self._gauge_day <= now < self._gauge_day + DAY:  # another budget day
            self._gauge_day = self.day_start(now)
            m.clear(m.spend_today)
            m.clear(m.team_spend_today)
        if day < self._gauge_day:
            return
        if user is not None:
            m.child(m.spend_today, self.users(user)).inc(amount)
        if team:
            m.child(m.team_spend_today, self.teams(team)).inc(amount)

    async def restore(self, rows: Iterable[SpendRow]) -> None:
        """This month's spend read from the ledger at start: today's gauge, and the store."""
        rows = list(rows)
        self.restore_gauge(*today_by_user_and_team(rows))
        await self.store.seed(self.day_start(self.clock()), self.spent_by_scope(rows))

    def restore_gauge(
        self, by_user: Mapping[str, float], by_team: Mapping[str, float] | None = None
    ) -> None:
        """This process's spend today (its own ledger): the gauges only. A shared store seeds
        itself from the fleet's ledger."""
        today = self.day_start(self.clock())
        for user, amount in by_user.items():
            self._gauge(user, None, amount, today)
        for team, amount in (by_team or {}).items():
            self._gauge(None, team, amount, today)

    def spent_by_scope(self, rows: Iterable[SpendRow]) -> dict[str, int]:
        """Spend rows as micro-dollars by scope key, for each scope with a limit: day scopes from
        today's rows, month scopes from all of them (rows since the month's start)."""
        dollars: dict[str, float] = {}
        for user, team, project, tags, model, in_day, _, cost in rows:
            tag_list = tags.split(",") if tags else ()
            for s in self.scopes_for(user or "", team, project, tag_list, model):
                if in_day or s.window == "month":
                    dollars[s.key] = dollars.get(s.key, 0.0) + cost
        return {key: to_micros(amount) for key, amount in dollars.items()}

    async def statement(
        self, user: str, team: str | None, project: str | None, tags: Sequence[str]
    ) -> list[dict[str, object]] | None:
        """The limits that apply to one principal (its user's, team's, project's, tags', each
        named model limit and the global one) with their spend: GET /v1/tollbooth/spend. None
        when the store cannot be read now."""
        scopes = self.scopes_for(user, team, project, tags, None) + tuple(
            Scope("model", name, to_micros(lim.usd), rule.window)
            for rule in self.rules
            if rule.kind == "model"
            for name, lim in rule.named.items()
        )
        usage = await self.store.usage(self.day_start(self.clock()), scopes)
        if usage is None:
            return None
        return [
            {
                "scope": s.kind,
                "name": s.name,
                "window": s.window,
                "limit_usd": usd(s.limit),
                "spent_usd": usd(spent),
                "remaining_usd": usd(max(0, s.limit - spent - held)),
            }
            for s, (spent, held) in zip(scopes, usage, strict=True)
        ]


def today_by_user_and_team(
    rows: Iterable[SpendRow],
) -> tuple[dict[str, float], dict[str, float]]:
    """Today's spend by billed user and by team, from spend rows."""
    by_user: dict[str, float] = {}
    by_team: dict[str, float] = {}
    for user, team, _, _, _, in_day, cost, _ in rows:
        if not in_day:
            continue
        if user is not None:
            by_user[user] = by_user.get(user, 0.0) + cost
        if team is not None:
            by_team[team] = by_team.get(team, 0.0) + cost
    return by_user, by_team
