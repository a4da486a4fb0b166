"""Every Prometheus metric the sidecar exports, declared here and nowhere else.

Owns: metric names, label names, bucket boundaries, label-value sanitising and cardinality caps.
Never: decides what was measured (callers pass measured values only; an absent value means no
sample), and never raises into the request path.
"""

from __future__ import annotations

import re
import threading
from bisect import bisect_left
from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.samples import Exemplar

# Bucket boundaries, in one place.
# The OpenTelemetry GenAI semantic conventions' advised explicit boundaries (gen-ai-metrics.md, as
# of semconv 0.66b2), written once: the OTLP views (genai_metrics.py) use them as they are, and
# each Prometheus histogram below keeps every one of the advice for its quantity, so our
# histograms line up with spans and with vLLM/TGI's own exports, with boundaries added where LLM
# serving lives and the advice is coarse (tests/test_buckets.py).
GENAI_TOKEN_ADVICE = tuple(4**i for i in range(14))  # 1, 4, 16 ... 67108864
GENAI_DURATION_ADVICE = tuple(0.01 * 2**i for i in range(14))  # 0.01, 0.02, 0.04 ... 81.92
GENAI_TTFT_ADVICE = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0)  # fmt: skip
GENAI_TPOT_ADVICE = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# Request duration: the advice doubles (1.28 to 2.56 s put a 1.59 s p99 at 2.47 s); the steps
# in between (x1.25 to x1.5) keep a percentile's interpolation error under a quarter of its value.
_DURATION_STEPS = (0.24, 0.48, 0.8, 0.96, 1.6, 1.92, 3.2, 3.84, 7.68, 15.36, 30.72, 61.44)
DURATION_BUCKETS = tuple(sorted(GENAI_DURATION_ADVICE + _DURATION_STEPS))
# Time to first token: the advice resolves it as it is, from 1 ms to 10 s.
TTFT_BUCKETS = GENAI_TTFT_ADVICE
# Time per output token: the advice starts at 10 ms, where a fast GPU decodes (a few ms per token
# on an H200 for a small model; the simulator's 0.5 ms): every observation fell in its first
# bucket, so boundaries are added below it (and one at 15 ms).
TPOT_BUCKETS = tuple(sorted((*GENAI_TPOT_ADVICE, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.015)))
# Queue wait spans from "admitted at once" (tens of microseconds: a lock and a heap push) to
# "waited the full max_queue_wait".
QUEUE_BUCKETS = (
    0.00001,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
# Per-request cost in USD. 0.1 must be a boundary: the LLMRequestCostHigh alert reads the
# 0.1 and +Inf buckets to count requests over ten cents.
COST_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Prompt and output lengths in tokens: powers of two from 1 to 2^26, the GenAI advice for
# gen_ai.client.token.usage (powers of four, GENAI_TOKEN_ADVICE) with a boundary between each two
# of it, so a percentile is off by under a factor of two, not four.
TOKEN_COUNT_BUCKETS = tuple(float(2**i) for i in range(27))
# Finish reasons are the upstream's words (cleaned at the boundary): the first few distinct ones
# keep their own label, later ones share __other__. Every engine we know uses under ten.
MAX_FINISH_REASONS = 16

OTHER = "__other__"
# Label sets several families share. Tokens and cost are read together (cost per token; the
# series published ahead for a known user are both, per model, token type and endpoint).
PER_REQUEST = ("model", "api_endpoint")
PER_TOKEN_TYPE = ("model", "token_type", "api_endpoint", "user_id")
PER_MODEL_USER = ("model", "user_id")  # GPU time and its cost
LEDGER_STAGES = ("open", "write", "row", "kept", "make", "ship", "ship_row", "ship_kept")
_UNSAFE = re.compile(r"[^A-Za-z0-9._:/@+\-]")


def sanitize(value: str, max_len: int = 64) -> str:
    """A label value safe to export: limited length and charset, never empty."""
    cleaned = _UNSAFE.sub("_", value[:max_len])
    return cleaned or "_"


class LabelCap:
    """The first `limit` distinct values keep their own label; later ones share `__other__`.

    Bounded in bytes, not only in names: a label is at most `max_len` characters, and a raw
    spelling is remembered (so it is not sanitised again) only when it is at most `RAW_FACTOR`
    labels long, up to `RAW_FACTOR * limit` of them. A longer one is sanitised on every call
    (its first `max_len` characters only): 100 model names of 4-15 MiB once kept 1.9 GB here.
    """

    RAW_FACTOR = 4

    def __init__(self, limit: int, max_len: int = 64) -> None:
        self._limit = limit
        self._max_len = max_len
        self._raw_chars = self.RAW_FACTOR * max_len
        self._seen: set[str] = set()
        self._known: dict[str, str] = {}  # raw value -> label, for values already tracked
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        known = self._known.get(value)
        if known is not None:
            return known
        v = sanitize(value, self._max_len)
        with self._lock:
            if v not in self._seen:
                if len(self._seen) >= self._limit:
                    return OTHER
                self._seen.add(v)
            remember = len(value) <= self._raw_chars
            if remember and len(self._known) < self.RAW_FACTOR * self._limit:
                self._known[value] = v
            return v

    def __len__(self) -> int:
        return len(self._seen)

    def retained_chars(self) -> int:
        """Characters this cap holds (labels and raw spellings); at most
        `limit * max_len * (1 + RAW_FACTOR * (RAW_FACTOR + 1))`."""
        with self._lock:
            return sum(map(len, self._seen)) + sum(len(k) + len(v) for k, v in self._known.items())


# --- series every request updates --------------------------------------------------------------
# prometheus_client takes a lock for every update: here 0.9 us a counter increment and 2 us a
# histogram observation, against 0.3 and 0.6 us without. A request updates about a dozen series,
# all from the event loop, so the families the meter and the proxy update per request keep their
# values without a lock. The registry, labels, exposition, `_created` and exemplars stay
# prometheus_client's; only the cell a value is kept in differs. This leans on its `_metric_init`,
# `_value`, `_sum`, `_buckets` and `_upper_bounds` (0.20 to 0.26): tests/test_metrics.py compares
# the exposition of these classes with prometheus_client's own, update for update.
# Never updated from another thread while the loop updates them: an increment without the lock is
# not atomic. (exposition.restore runs in a thread at start, before the listeners open.)


class _Cell:
    """One value, prometheus_client's MutexValue interface without the mutex."""

    __slots__ = ("_exemplar", "_value")

    def __init__(self) -> None:
        self._value = 0.0
        self._exemplar: Exemplar | None = None

    def inc(self, amount: float) -> None:
        self._value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def set_exemplar(self, exemplar: Exemplar) -> None:
        self._exemplar = exemplar

    def get(self) -> float:
        return self._value

    def get_exemplar(self) -> Exemplar | None:
        return self._exemplar


class LoopCounter(Counter):
    """A Counter whose children are updated from the event loop only."""

    def _metric_init(self) -> None:
        super()._metric_init()
        self._value = _Cell()

    def inc(self, amount: float = 1, exemplar: dict[str, str] | None = None) -> None:
        if exemplar or not amount >= 0:  # prometheus_client's checks, on the rare path
            super().inc(amount, exemplar)
        else:
            self._value._value += amount  # the cell's own inc, without a call


class LoopGauge(Gauge):
    """A Gauge (inc/dec) whose children are updated from the event loop only."""

    def _metric_init(self) -> None:
        super()._metric_init()
        self._value = _Cell()

    def inc(self, amount: float = 1) -> None:
        self._value._value += amount

    def dec(self, amount: float = 1) -> None:
        self._value._value -= amount


class LoopHistogram(Histogram):
    """A Histogram whose children are updated from the event loop only."""

    def _metric_init(self) -> None:
        super()._metric_init()
        self._sum = _Cell()
        self._buckets = [_Cell() for _ in self._upper_bounds]

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        if exemplar:  # a sampled trace: prometheus_client's path validates and stamps it
            super().observe(amount, exemplar)
            return
        self._sum._value += amount  # the cells' own inc, without a call each
        if amount == amount:  # a NaN falls in no bucket, as in prometheus_client
            self._buckets[bisect_left(self._upper_bounds, amount)]._value += 1


class RequestSeries:
    """The children one (model, endpoint, user) updates on every request, each looked up in
    the registry on its first use (a series appears when first updated, as with `.labels()`),
    then read as an attribute: `Meter` updates about ten a request, and a `child()` lookup
    (a key tuple, a dict get) for each cost more than the update."""

    __slots__ = (
        "_ep",
        "_metrics",
        "_model",
        "duration",
        "input_cost",
        "input_tokens",
        "output_cost",
        "output_len",
        "output_tokens",
        "prompt_len",
        "request_cost",
        "requests",
    )

    def __init__(self, metrics: Metrics, model: str, ep: str) -> None:
        self._metrics, self._model, self._ep = metrics, model, ep
        self.requests: dict[str, Any] = {}  # by status label
        self.duration: Any = None
        self.input_tokens: Any = None
        self.output_tokens: Any = None
        self.prompt_len: Any = None
        self.output_len: Any = None
        self.input_cost: Any = None
        self.output_cost: Any = None
        self.request_cost: Any = None

    def fill(self, slot: str, metric: Any, *labels: str) -> Any:
        child = self._metrics.child(metric, *labels)
        setattr(self, slot, child)
        return child

    def status_child(self, status: str) -> Any:
        """The `llm_requests` child of `status` (model and endpoint are the series')."""
        m = self._metrics
        child = self.requests[status] = m.child(m.requests, self._model, self._ep, status)
        return child


class Metrics:
    """All metrics, registered on one registry (a fresh one per test)."""

    def child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, cached: the hot path looks up each series with one dict get.

        The cache holds exactly the children the registry already holds, so it is bounded by the
        same label caps.
        """
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def clear(self, metric: Any) -> None:
        """`metric.clear()`, and its cached children: one kept takes updates never scraped."""
        metric.clear()
        self.series.clear()  # it may hold one of them
        for key in [k for k in self._children if k[0] == id(metric)]:
            del self._children[key]

    def _length(self, name: str, direction: str) -> LoopHistogram:
        """A request's prompt or output length: measured counts only, by model."""
        return LoopHistogram(
            f"llm_request_{name}_tokens",
            f"Each request's {name} length in tokens, as the server reported "
            f"it (measured only: a request whose {direction} usage is unknown observes nothing).",
            ["model"],
            buckets=TOKEN_COUNT_BUCKETS,
            registry=self.registry,
        )

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        # (model, endpoint, user) -> the children the meter updates for it (bounded as the
        # children are: by the model and user label caps)
        self.series: dict[tuple[str, str, str], RequestSeries] = {}
        r = self.registry = registry or CollectorRegistry()
        counter, gauge = partial(Counter, registry=r), partial(Gauge, registry=r)
        loop_counter, loop_gauge = partial(LoopCounter, registry=r), partial(LoopGauge, registry=r)
        # a histogram of one value per request, by model and endpoint
        per_request = partial(LoopHistogram, labelnames=PER_REQUEST, registry=r)
        ep = PER_REQUEST
        # --- requests and tokens (sidecar core)
        self.requests = loop_counter(
            "llm_requests", "Proxied LLM requests by response status.", [*ep, "status_code"]
        )
        self.tokens = loop_counter(
            "llm_tokens",
            "Tokens reported by the server, by direction (reasoning: a part of output).",
            PER_TOKEN_TYPE,
        )
        self.cached_tokens = loop_counter(
            "llm_cached_input_tokens",
            "Input tokens served from the prefix cache (subset of input).",
            ["model", "api_endpoint", "user_id"],
        )
        self.audio_seconds = loop_counter(
            "llm_audio_seconds",
            "Seconds of input audio the server reported (speech-to-text routes).",
            ["model", "api_endpoint", "user_id"],
        )
        self.usage_unknown = loop_counter(
            "llm_usage_unknown",
            "Requests whose token usage could not be measured.",
            [*ep, "reason"],
        )
        self.duration = per_request(
            "llm_request_duration_seconds",
            "Time from request received to response complete.",
            buckets=DURATION_BUCKETS,
        )
        self.ttft = per_request(
            "llm_time_to_first_token_seconds",
            "Upstream send to first token event (streams only).",
            buckets=TTFT_BUCKETS,
        )
        self.tpot = per_request(
            "llm_time_per_output_token_seconds",
            "Decode time per output token after the first (streams only).",
            buckets=TPOT_BUCKETS,
        )
        self.prompt_tokens = self._length("prompt", "input")
        self.output_tokens = self._length("output", "output")
        self.finish_reasons = loop_counter(
            "llm_finish_reasons",
            "Choices finished, by the reason the server gave (stop, length, tool_calls...; the "
            f"first {MAX_FINISH_REASONS} distinct reasons, later ones __other__).",
            ["model", "finish_reason"],
        )
        self.reason_labels = LabelCap(MAX_FINISH_REASONS)
        self.in_flight = loop_gauge(
            "llm_in_flight_requests", "Requests being proxied now.", ["model"]
        )
        self.metering_errors = counter(
            "tollbooth_metering_errors",
            "Bugs or surprises in accounting; traffic was unaffected.",
            ["stage"],
        )
        self.unmetered = counter(
            "llm_unmetered_requests",
            "POSTs to routes that are neither metered nor free (served or refused).",
            ["endpoint_class"],
        )
        self.upstream_errors = counter(
            "tollbooth_upstream_errors", "Upstream failures answered by the sidecar.", ["reason"]
        )
        self.upstream_up = gauge(
            "tollbooth_upstream_up",
            "1 when the last background probe of the upstream got an answer below 500.",
        )
        self.connections_cut = counter(
            "tollbooth_connections_cut",
            "Client connections closed by the sidecar: no complete request headers in time "
            "(header_timeout) or kept alive without a request (idle_timeout).",
            ["listener", "reason"],
        )
        self.client_connections = gauge(
            "tollbooth_client_connections", "Client connections open now.", ["listener"]
        )
        self.requests_refused = counter(
            "tollbooth_requests_refused",
            "Requests the sidecar refused before reading their body: no room for it in memory "
            "(memory_total, memory_key: 503), or a Content-Encoding (content_encoding: 415).",
            ["reason"],
        )
        self.request_memory = gauge(
            "tollbooth_request_memory_bytes",
            "Memory reserved now for request bodies (their bytes, their parse): all connections.",
        )
        # --- cost
        self.cost = loop_counter(
            "llm_cost_usd", "Spend in USD from per-token prices.", PER_TOKEN_TYPE
        )
        self.request_cost = per_request(
            "llm_request_cost_usd", "Each request's total cost in USD.", buckets=COST_BUCKETS
        )
        self.cost_unknown = loop_counter(
            "llm_cost_unknown", "Requests whose cost is unknown.", ["model", "reason"]
        )
        self.spend_today = loop_gauge(
            "llm_spend_today_usd", "Spend since the start of the budget day.", ["user_id"]
        )
        self.team_spend_today = loop_gauge(
            "llm_team_spend_today_usd",
            "Spend since the start of the budget day by team (the keys file's team of the "
            "billed key; measured spend only; requests without a team are not in it).",
            ["team"],
        )
        self.ledger_errors = counter(
            "llm_ledger_errors",
            "Usage-ledger failures by stage: open and write (retried; rows wait in memory), row "
            "(a row refused as it was, written cleaned), kept (refused even cleaned: kept aside, "
            "not written), make (a row could not be made), ship_row and ship_kept (the same in "
            "PostgreSQL), ship (the shipper failed for another reason than the database).",
            ["stage"],
        )
        for stage in LEDGER_STAGES:  # every stage exported from 0: increase() sees the first
            self.ledger_errors.labels(stage)
        self.writer_failing = gauge(
            "tollbooth_writer_failing",
            "1 while a writer cannot write (ledger, shipper, access_log, audit); /readyz is not "
            "ready then. Read at scrape time from the writer's state.",
            ["writer"],
        )
        self.ledger_set_aside = gauge(
            "llm_ledger_rows_set_aside",
            "Ledger rows refused even cleaned, not written: `memory` (kept by the SQLite "
            "writer, lost at a restart), `quarantine` (in the outbox's quarantine table, "
            "missing from PostgreSQL).",
            ["where"],
        )
        self.ledger_reopens = counter(
            "llm_ledger_reopens",
            "Ledger file found deleted or replaced while open, and opened again at its path.",
        )
        self.ledger_dropped = counter(
            "llm_ledger_dropped_rows", "Ledger rows dropped because the pending queue was full."
        )
        self.budget_rejections = counter(
            "llm_budget_rejections",
            "Requests refused because their worst-case cost would exceed a daily budget.",
            ["scope"],
        )
        self.budget_refusals = counter(
            "llm_budget_refusals",
            "Requests refused by a daily budget (429), by the user refused, the scope whose "
            "budget it would exceed, and why: budget (over the limit) or capacity (the budget "
            "table is full of users).",
            ["user_id", "scope", "reason"],
        )
        self.budget_unpriced_refusals = counter(
            "llm_budget_unpriced_refusals",
            "Requests refused with 503 while budgets are enforced because the one model their "
            "server serves (upstream.model_name, else TGI's /info model_id) has no price in a "
            "book that prices by model: each would have been charged $0.",
            ["model"],
        )
        self.budget_unmeasured_charges = counter(
            "llm_budget_unmeasured_charges",
            "Requests that reached the server with no usage measured; their budget hold was "
            "charged (not exported as spend).",
        )
        # --- fleet: the shared budget store and the shipped ledger
        self.store_up = gauge(
            "llm_budget_store_up",
            "1 while the shared budget store answers; 0 while its circuit breaker is open.",
        )
        self.store_errors = counter(
            "llm_budget_store_errors", "Shared budget store calls that failed or timed out.", ["op"]
        )
        self.store_bypassed = counter(
            "llm_budget_store_bypassed",
            "Requests admitted without a budget check because the store was unavailable (open).",
        )
        self.store_refused = counter(
            "llm_budget_store_refused",
            "Requests refused with 503 because the store was unavailable (closed, or local "
            "without a known remainder).",
        )
        self.store_local = counter(
            "llm_budget_store_local_decisions",
            "Requests decided on this sidecar's share of the last known remainder (local).",
            ["outcome"],
        )
        self.holds_expired = counter(
            "llm_budget_holds_expired",
            "Holds whose lease ended (their sidecar stopped renewing them), charged in full.",
        )
        self.settles_pending = gauge(
            "llm_budget_settles_pending", "Settlements waiting to reach the store."
        )
        self.settles_dropped = counter(
            "llm_budget_settles_dropped",
            "Settlements dropped (queue full, or their budget day's keys expired).",
        )
        self.sidecars_alive = gauge(
            "llm_budget_sidecars_alive", "Sidecars with a recent heartbeat in the shared store."
        )
        self.store_reseeds = counter(
            "llm_budget_store_reseeds",
            "Times this sidecar seeded the store's day from the ledger.",
            ["outcome"],
        )
        self.ledger_shipped = counter(
            "llm_ledger_shipped_rows", "Ledger rows shipped to PostgreSQL.", ["table"]
        )
        self.ledger_ship_errors = counter(
            "llm_ledger_ship_errors", "Failed shipments to PostgreSQL (retried)."
        )
        self.ledger_renamed = counter(
            "llm_ledger_outbox_renamed",
            "Outbox renamed: its row numbers were taken in PostgreSQL by other rows (a copied "
            "or restored ledger file); its rows are shipped under the new name.",
            ["table"],
        )
        self.ledger_unshipped = gauge(
            "llm_ledger_unshipped_rows", "Rows in the local outbox not yet in PostgreSQL."
        )
        self.auth_rejections = counter(
            "llm_auth_rejections",
            "Requests refused with 401: a missing or unknown API key.",
            ["reason"],
        )
        # --- admission
        self.queue_wait = Histogram(
            "llm_queue_wait_seconds",
            "Time spent in the admission queue.",
            ["model"],
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.queue_depth = gauge("llm_queue_depth", "Requests waiting for admission.")
        self.queue_waiting_tokens = gauge(
            "llm_queue_waiting_tokens", "Estimated tokens of the requests waiting (an estimate)."
        )
        self.budget_in_use = gauge(
            "llm_budget_tokens_in_use", "Estimated tokens of admitted requests (an estimate)."
        )
        self.budget_limit = gauge("llm_budget_tokens_limit", "The admission token budget.")
        self.admission_rejections = counter(
            "llm_admission_rejections", "Requests refused by the admission queue.", ["reason"]
        )
        # --- GPU telemetry and attribution
        gpu = ("gpu", "uuid", "name")
        self.gpu_up = gauge("llm_gpu_telemetry_up", "1 when NVML telemetry is running.")
        self.gpu_util = gauge("llm_gpu_utilization_ratio", "GPU busy ratio (0-1).", gpu)
        self.gpu_mem_used = gauge("llm_gpu_memory_used_bytes", "GPU memory in use.", gpu)
        self.gpu_mem_total = gauge("llm_gpu_memory_total_bytes", "GPU memory in total.", gpu)
        self.gpu_power = gauge("llm_gpu_power_watts", "GPU power draw.", gpu)
        self.gpu_energy = counter(
            "llm_gpu_energy_joules", "GPU energy since the sidecar started.", gpu
        )
        self.gpu_temp = gauge("llm_gpu_temperature_celsius", "GPU temperature.", gpu)
        self.device_seconds = counter(
            "llm_device_seconds", "GPU-seconds attributed to requests.", PER_MODEL_USER
        )
        self.device_cost = counter(
            "llm_device_cost_usd",
            "GPU-time cost attributed to requests (gpu_hour_usd).",
            PER_MODEL_USER,
        )
        self.energy = counter("llm_energy_joules", "GPU energy attributed to requests.", ["model"])
        self.spans_dropped = counter(
            "tollbooth_spans_dropped", "Spans dropped because the export queue was full."
        )
        # --- audit
        self.audit_captures = counter(
            "llm_audit_captures", "Audit records written.", ["model", "reason"]
        )
        self.audit_errors = counter("tollbooth_audit_errors", "Audit records that failed to write.")
        self.access_log_errors = counter(
            "tollbooth_access_log_errors",
            "Access-log lines that could not be written, even cleaned.",
        )
        self.log_dropped = counter(
            "tollbooth_log_records_dropped",
            "Access-log lines and audit records dropped because the writer's queue was full.",
            ["log"],
        )


# The inference servers' own scheduler state, as vLLM (V1 engine) and TGI's router export it. The
# dashboards put it beside the sidecar's admission queue; the simulator exports the same names.
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"
VLLM_KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"  # the older (deprecated) name of the same gauge
VLLM_PREEMPTIONS = "vllm:num_preemptions_total"
TGI_QUEUE = "tgi_queue_size"
TGI_BATCH = "tgi_batch_current_size"
