"""The record of one proxied request, and what happens to it once it is finished.

Owns: the `Exchange` (everything measured about a request), and `Meter.record()`, which turns it
into metrics, cost, spend and sinks (ledger, access log, audit, GPU attribution).
Never: raises into the proxy. Any failure here is logged and counted in
`tollbooth_metering_errors_total{stage}`; the client's response is already decided.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .metrics import Metrics
from .pricing import Cost, PriceBook
from .usage import Endpoint, RequestInfo, Usage

log = logging.getLogger("tollbooth.meter")

_UID_PREFIX = uuid.uuid4().hex[:12]  # per process; ids are prefix + counter, unique and cheap
_UID_COUNTER = itertools.count(1)


def new_uid() -> str:
    """An id the sidecar made, unique across processes (random prefix + counter). Budget holds
    are keyed by it; a client's X-Request-Id is only for joining logs and never keys a hold."""
    return f"{_UID_PREFIX}{next(_UID_COUNTER):012x}"


STATUS_CLIENT_CLOSED = 499  # nginx's convention: the client went away before the response ended
# The usage_unknown reason of a request that failed upstream (5xx, or an error inside the stream):
# LLMUpstreamErrorRateHigh pages for those, LLMUsageUnmeasured leaves them out.
UPSTREAM_FAILED = "upstream_error"


_NOTHING_MEASURED = Usage()  # a shared default: Usage is frozen


@dataclass(slots=True)
class Exchange:
    """Mutable while the request runs; read-only once handed to `Meter.record`."""

    request_id: str  # the client's X-Request-Id (for joining logs), else the uid
    endpoint: Endpoint
    info: RequestInfo
    user: str  # label value (sanitised, capped for cardinality)
    user_id: str  # the billed principal, sanitised but not capped (ledger, budgets, logs)
    model: str  # label value chosen at start; replaced by the response's model when known
    uid: str = field(default_factory=lambda: new_uid())  # unique: holds are keyed by it
    started_at: float = field(default_factory=time.time)  # wall clock, for the ledger
    t0: float = field(default_factory=time.perf_counter)
    status: int = 0
    queue_s: float | None = None
    upstream_start: float | None = None
    first_token_at: float | None = None
    duration_s: float | None = None
    usage: Usage = _NOTHING_MEASURED
    cost: Cost | None = None
    cost_unknown_reason: str | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    error: str | None = None  # why the request failed, when it did
    trace_id: str | None = None
    span_id: str | None = None
    trace_sampled: bool = False
    trace_headers: dict[str, str] = field(default_factory=dict)  # traceparent for the upstream
    upstream: str = ""
    device_seconds: float | None = None
    energy_j: float | None = None
    audited: bool = False
    response_sample: bytes | bytearray | None = None  # audit text capture only; bounded
    request_headers: Mapping[str, str] = field(default_factory=dict)  # the client's, read-only
    team: str | None = None  # the billed principal's team (keys file)
    end_user: str | None = None  # the body's `user`: recorded, never billed when keys are verified
    key_id: str | None = None  # "key-" + 12 hex of the key's sha256; never the key
    prompt_tokens: int | None = None  # the prompt's exact size from the upstream's /tokenize
    budget_hold: Any = None  # budget.Hold reserved by the budget gate
    path: str = ""  # the normalised path: what was classified and forwarded
    # Set when the client left and a background task settles the usage (drain, /tokenize);
    # the exchange is recorded once it is done.
    finisher: asyncio.Future[None] | None = None

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_at is None or self.upstream_start is None:
            return None
        return self.first_token_at - self.upstream_start

    @property
    def status_label(self) -> str:
        """The HTTP status, or `stream_error` when a 2xx response failed inside its body."""
        if 200 <= self.status < 300 and self.error is not None:
            return "stream_error"
        return str(self.status)

    @property
    def failed(self) -> bool:
        return self.error is not None or self.status >= 400 or self.status == 0

    def finish(self) -> None:
        self.duration_s = time.perf_counter() - self.t0


Sink = Callable[[Exchange], None]


class Meter:
    def __init__(self, metrics: Metrics, prices: PriceBook) -> None:
        self.metrics = metrics
        self.prices = prices
        self._sinks: list[tuple[str, Sink]] = []

    def add_sink(self, stage: str, sink: Sink) -> None:
        """Sinks run in order after metrics and cost; each is isolated from the others' failures."""
        self._sinks.append((stage, sink))

    def record(self, ex: Exchange) -> None:
        self._guard("metrics", self._count, ex)
        self._guard("cost", self._price, ex)
        for stage, sink in self._sinks:
            self._guard(stage, sink, ex)

    def _guard(self, stage: str, fn: Sink, ex: Exchange) -> None:
        try:
            fn(ex)
        except Exception:
            log.exception("metering stage %s failed for request %s", stage, ex.request_id)
            with contextlib.suppress(Exception):  # the registry itself is broken
                self.metrics.metering_errors.labels(stage).inc()

    def _count(self, ex: Exchange) -> None:
        m, ep, u, c = self.metrics, ex.endpoint.label, ex.usage, self.metrics.child
        c(m.requests, ex.model, ep, ex.status_label).inc()
        if ex.duration_s is not None:
            c(m.duration, ex.model, ep).observe(ex.duration_s, self._exemplar(ex))
        if (ttft := ex.ttft_s) is not None:
            c(m.ttft, ex.model, ep).observe(ttft)
            if (tpot := time_per_output_token(ex)) is not None:
                c(m.tpot, ex.model, ep).observe(tpot)
        if not consumed(ex):
            return
        if u.input_tokens is not None:
            c(m.tokens, ex.model, "input", ep, ex.user).inc(u.input_tokens)
        if u.output_tokens is not None:
            c(m.tokens, ex.model, "output", ep, ex.user).inc(u.output_tokens)
        if u.cached_input_tokens is not None:
            c(m.cached_tokens, ex.model, ep, ex.user).inc(u.cached_input_tokens)
        if u.input_tokens is None or u.output_tokens is None:
            failed = ex.status >= 500 or ex.status_label == "stream_error"
            reason = UPSTREAM_FAILED if failed else (u.unknown_reason or "unknown")
            c(m.usage_unknown, ex.model, ep, reason).inc()

    def _price(self, ex: Exchange) -> None:
        if not consumed(ex):
            return
        m, ep, c = self.metrics, ex.endpoint.label, self.metrics.child
        cost = price_cost(self.prices, ex)
        if cost is None:
            # Each measured direction is spent even if the other is unknown.
            if (partial := _partial_cost(self.prices, ex)) is not None:
                c(m.cost, ex.model, "input", ep, ex.user).inc(partial)
            c(m.cost_unknown, ex.model, ex.cost_unknown_reason or "unknown").inc()
            return
        c(m.cost, ex.model, "input", ep, ex.user).inc(cost.input_usd)
        c(m.cost, ex.model, "output", ep, ex.user).inc(cost.output_usd)
        c(m.request_cost, ex.model, ep).observe(cost.total_usd, self._exemplar(ex))

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


def consumed(ex: Exchange) -> bool:
    """Did the request use the server? A refused one (4xx/5xx, no usage) consumed nothing, nor
    did one whose client left before it was sent upstream."""
    u = ex.usage
    if u.input_tokens is not None or u.output_tokens is not None:
        return True
    if ex.status == STATUS_CLIENT_CLOSED:
        return ex.upstream_start is not None
    return 200 <= ex.status < 300


def priced_model(ex: Exchange) -> str | None:
    """The name prices are looked up by: the served model, else the requested one."""
    return ex.usage.model or ex.info.model or (ex.model if ex.model != "unknown" else None)


def price_cost(prices: PriceBook, ex: Exchange) -> Cost | None:
    """Set `ex.cost` (or `ex.cost_unknown_reason`) once; the proxy calls it for the cost header."""
    if ex.cost is None and ex.cost_unknown_reason is None:
        ex.cost, ex.cost_unknown_reason = prices.cost(priced_model(ex), ex.usage)
    return ex.cost


def _partial_cost(prices: PriceBook, ex: Exchange) -> float | None:
    """Input spend when only the input was measured (output unknown)."""
    if ex.usage.output_tokens is not None:
        return None
    return prices.input_cost(priced_model(ex), ex.usage)
