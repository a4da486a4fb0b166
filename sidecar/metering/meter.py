"""The record of one proxied request, and what happens to it once it is finished.

Owns: the `Exchange` (everything measured about a request), and `Meter.record()`, which turns it
into metrics, cost, spend and sinks (ledger, access log, audit, GPU attribution).
Never: raises into the proxy. Any failure here is logged and counted in
`tollbooth_metering_errors_total{stage}`; the client's response is already decided.
"""

from __future__ import annotations

import contextlib
import logging

from ..exchange import UPSTREAM_FAILED, Cost, Exchange, Sink, consumed, measured, priced_model
from ..telemetry.metrics import Metrics, RequestSeries
from .pricing import PriceBook

log = logging.getLogger("tollbooth.meter")


class Meter:
    def __init__(self, metrics: Metrics, prices: PriceBook) -> None:
        self.metrics = metrics
        self.prices = prices
        self._sinks: list[tuple[str, Sink]] = []

    def add_sink(self, stage: str, sink: Sink) -> None:
        """Sinks run in order after metrics and cost; each is isolated from the others' failures."""
        self._sinks.append((stage, sink))

    @property
    def stages(self) -> list[str]:
        """The sinks' stage names, in the order they run."""
        return [stage for stage, _ in self._sinks]

    def record(self, ex: Exchange) -> None:
        # Each stage isolated from the others' failures; the try inline (free when nothing
        # fails), not a guard function called per stage.
        try:
            self._count(ex)
        except Exception:
            self._failed("metrics", ex)
        try:
            self._price(ex)
        except Exception:
            self._failed("cost", ex)
        for stage, sink in self._sinks:
            try:
                sink(ex)
            except Exception:
                self._failed(stage, ex)

    def _failed(self, stage: str, ex: Exchange) -> None:
        """Called in the `except` of a failed stage: log it with its traceback, and count it."""
        log.exception("metering stage %s failed for request %s", stage, ex.request_id)
        with contextlib.suppress(Exception):  # the registry itself is broken
            self.metrics.metering_errors.labels(stage).inc()

    def _count(self, ex: Exchange) -> None:
        m, ep, u, model = self.metrics, ex.endpoint.label, ex.usage, ex.model
        s = m.series.get((model, ep, ex.user)) or _new_series(m, model, ep, ex.user)
        status = ex.status_label
        (s.requests.get(status) or s.status_child(status)).inc()
        if ex.duration_s is not None:
            (s.duration or s.fill("duration", m.duration, model, ep)).observe(
                ex.duration_s, self._exemplar(ex)
            )
        if (ttft := ex.ttft_s) is not None:
            m.child(m.ttft, model, ep).observe(ttft)
            if (tpot := time_per_output_token(ex)) is not None:
                m.child(m.tpot, model, ep).observe(tpot)
        for reason in u.finish_reasons:  # one a choice, as the server reported it
            m.child(m.finish_reasons, model, m.reason_labels(reason)).inc()
        if not consumed(ex):
            return
        if u.input_tokens is not None:
            (s.input_tokens or s.fill("input_tokens", m.tokens, model, "input", ep, ex.user)).inc(
                u.input_tokens
            )
            (s.prompt_len or s.fill("prompt_len", m.prompt_tokens, model)).observe(u.input_tokens)
        if u.output_tokens is not None:
            (
                s.output_tokens or s.fill("output_tokens", m.tokens, model, "output", ep, ex.user)
            ).inc(u.output_tokens)
            (s.output_len or s.fill("output_len", m.output_tokens, model)).observe(u.output_tokens)
        if u.reasoning_tokens is not None:  # a part of output: sums of token_type exclude it
            m.child(m.tokens, model, "reasoning", ep, ex.user).inc(u.reasoning_tokens)
        if u.cached_input_tokens is not None:
            m.child(m.cached_tokens, model, ep, ex.user).inc(u.cached_input_tokens)
        if u.audio_seconds is not None:
            m.child(m.audio_seconds, model, ep, ex.user).inc(u.audio_seconds)
        if not measured(u):
            failed = ex.status >= 500 or status == "stream_error"
            reason = UPSTREAM_FAILED if failed else (u.unknown_reason or "unknown")
            m.child(m.usage_unknown, model, ep, reason).inc()

    def _price(self, ex: Exchange) -> None:
        if not consumed(ex):
            return
        m, ep, model = self.metrics, ex.endpoint.label, ex.model
        cost = price_cost(self.prices, ex)
        if cost is None:
            # Each measured direction is spent even if the other is unknown: the input, when
            # only the output is unknown.
            if ex.usage.output_tokens is None:
                partial = self.prices.input_cost(priced_model(ex), ex.usage)
                if partial is not None:
                    m.child(m.cost, model, "input", ep, ex.user).inc(partial)
            m.child(m.cost_unknown, model, ex.cost_unknown_reason or "unknown").inc()
            return
        s = m.series.get((model, ep, ex.user)) or _new_series(m, model, ep, ex.user)
        (s.input_cost or s.fill("input_cost", m.cost, model, "input", ep, ex.user)).inc(
            cost.input_usd
        )
        (s.output_cost or s.fill("output_cost", m.cost, model, "output", ep, ex.user)).inc(
            cost.output_usd
        )
        (s.request_cost or s.fill("request_cost", m.request_cost, model, ep)).observe(
            cost.input_usd + cost.output_usd, self._exemplar(ex)
        )

    @staticmethod
    def _exemplar(ex: Exchange) -> dict[str, str] | None:
        return {"trace_id": ex.trace_id} if ex.trace_id and ex.trace_sampled else None


def time_per_output_token(ex: Exchange) -> float | None:
    """Decode time per token after the first, per choice: the choices of one request (`n`, or
    several prompts) are decoded side by side, so the time is divided by the tokens of one choice
    (all output tokens / choices, the mean when their lengths differ), not by all choices' tokens.
    The choices are those that reported a finish reason, at least the `n` asked for."""
    out, first = ex.usage.output_tokens, ex.first_token_at
    if not out or first is None or ex.duration_s is None:
        return None
    choices = max(len(ex.usage.finish_reasons), ex.info.n or 1)
    per_choice = out / choices
    if per_choice <= 1:
        return None
    return max(ex.t0 + ex.duration_s - first, 0.0) / (per_choice - 1)


def price_cost(prices: PriceBook, ex: Exchange) -> Cost | None:
    """Set `ex.cost` (or `ex.cost_unknown_reason`) once; the proxy calls it for the cost header."""
    if ex.cost is None and ex.cost_unknown_reason is None:
        ex.cost, ex.cost_unknown_reason = prices.cost(priced_model(ex), ex.usage)
    return ex.cost


def _new_series(m: Metrics, model: str, ep: str, user: str) -> RequestSeries:
    s = m.series[(model, ep, user)] = RequestSeries(m, model, ep)
    return s
