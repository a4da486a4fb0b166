"""The types every part of the sidecar shares: the record of one proxied request and its pieces.

Owns: the metered routes (`Endpoint`), what a request asks (`RequestInfo`), what was measured
(`Usage`), its price (`Cost`), the `Exchange` itself with the verdicts read from it (`consumed`,
`priced_model`, `billed_model`), the hook types (`Sink`, `Gate`, `CleanupContext`, and the two
generic cleanup contexts `task_context` and `closing_context`), what a budget gate holds
(`BudgetHold`), the `Refusal` a gate raises, the output limit holds and estimates read
(`held_output`), and the token estimate admission and GPU attribution share (`estimate_tokens`).
Never: imports another part of the sidecar but `config` (a base module, as this one is), or does
I/O itself: these are values, pure functions and contexts that run only what they are handed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from .config import AdmissionConfig

if TYPE_CHECKING:
    from aiohttp import web


class Endpoint(StrEnum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    EMBEDDINGS = "/v1/embeddings"
    RESPONSES = "/v1/responses"
    MESSAGES = "/v1/messages"  # Anthropic Messages (metering/anthropic.py)
    TGI_GENERATE = "/generate"
    TGI_GENERATE_STREAM = "/generate_stream"
    TGI_COMPAT = "/"
    TGI_VERTEX = "/vertex"
    # vLLM's pooling and scoring routes (metering/pooling.py): input tokens only, nothing generated.
    POOLING = "/pooling"
    CLASSIFY = "/classify"
    SCORE = "/score"
    SCORE_V1 = "/v1/score"
    RERANK = "/rerank"
    RERANK_V1 = "/v1/rerank"
    RERANK_V2 = "/v2/rerank"
    # llama.cpp's native routes (metering/llamacpp.py)
    LLAMA_COMPLETION = "/completion"
    LLAMA_INFILL = "/infill"
    # Ollama's native routes (metering/ollama.py)
    OLLAMA_CHAT = "/api/chat"
    OLLAMA_GENERATE = "/api/generate"
    OLLAMA_EMBED = "/api/embed"
    # Dispatched by the body's shape (`inspect_request` resolves it to one of the above).
    # vLLM's speech-to-text routes (metering/audio.py): multipart bodies, billed per audio second.
    AUDIO_TRANSCRIPTIONS = "/v1/audio/transcriptions"
    AUDIO_TRANSLATIONS = "/v1/audio/translations"
    INVOCATIONS = "/invocations"
    # A POST that no metered route matches: forwarded (or refused) with its usage unknown.
    OTHER = "other"

    @functools.cached_property
    def is_tgi_native(self) -> bool:  # cached: a member's attribute after the first read
        return self in _TGI_NATIVE

    @functools.cached_property
    def label(self) -> str:
        """The value as a plain str (an Enum's `.value` is a property, read on every request)."""
        return str(self.value)

    @functools.cached_property
    def is_pooling(self) -> bool:
        """A route that reads its input and generates nothing (vLLM's pooling and scoring)."""
        return self in POOLING_ROUTES

    @property
    def operation(self) -> str:
        """The GenAI `gen_ai.operation.name` for this route."""
        if self in (Endpoint.CHAT, Endpoint.RESPONSES, Endpoint.MESSAGES, Endpoint.OLLAMA_CHAT):
            return "chat"
        if self in (Endpoint.EMBEDDINGS, Endpoint.OLLAMA_EMBED) or self.is_pooling:
            return "embeddings"
        if self is Endpoint.OTHER:
            return "other"
        return "text_completion"


# The model label (and ledger model) of a request whose model is not known.
UNKNOWN_MODEL = "unknown"
_TGI_NATIVE = frozenset(
    {Endpoint.TGI_GENERATE, Endpoint.TGI_GENERATE_STREAM, Endpoint.TGI_COMPAT, Endpoint.TGI_VERTEX}
)
RERANK_ROUTES = frozenset({Endpoint.RERANK, Endpoint.RERANK_V1, Endpoint.RERANK_V2})
SCORE_ROUTES = frozenset({Endpoint.SCORE, Endpoint.SCORE_V1})
POOLING_ROUTES = frozenset({Endpoint.POOLING, Endpoint.CLASSIFY, *SCORE_ROUTES, *RERANK_ROUTES})
# Their request bodies are multipart forms, streamed through (proxy/audio.py), never buffered.
AUDIO_ROUTES = frozenset({Endpoint.AUDIO_TRANSCRIPTIONS, Endpoint.AUDIO_TRANSLATIONS})


# Read-only once made, by convention (nothing assigns to a field; `replace` makes a changed copy),
# but not frozen: one or two are made for every request, and a frozen dataclass's __init__ (one
# object.__setattr__ per field) took 1.7 us here for its ten fields against 0.5 us. Cost likewise.
# Hashable as when frozen (unsafe_hash), so one can still be a field's shared default.
@dataclass(slots=True, unsafe_hash=True)
class Usage:
    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_input_tokens: int | None = None
    # Reasoning ("thinking") tokens: a part of output_tokens, never added to it (docs/metrics.md).
    reasoning_tokens: int | None = None
    model: str | None = None
    response_id: str | None = None
    finish_reasons: tuple[str, ...] = ()
    error: str | None = None  # error type reported by the upstream (in a body or inside a stream)
    unknown_reason: str | None = None  # why a count is None
    # Seconds of input audio the server reported (speech-to-text): measured usage of its own,
    # priced per second; the token counts stay None unless the server reported them too.
    audio_seconds: float | None = None


def measured(u: Usage) -> bool:
    """Usage measured in full: both token directions, or the seconds of an audio request."""
    return (u.input_tokens is not None and u.output_tokens is not None) or (
        u.audio_seconds is not None
    )


# Read-only once made, but not frozen: it is made for every request, and a frozen dataclass's
# __init__ (one object.__setattr__ per field) took 7.5 us here against 1.6 us.
@dataclass(slots=True)
class RequestInfo:
    endpoint: Endpoint
    body: bytes  # what is sent upstream (the client's bytes unless usage was injected)
    parsed: bool  # the body was a JSON object
    stream: bool = False
    model: str | None = None
    user: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    n: int | None = None
    tools: int = 0
    messages: int = 0
    prompt_chars: int = 0
    injected_usage: bool = False  # we added stream_options.include_usage; strip its chunk
    # The server will put usage on every chunk although the client did not ask for it (we asked
    # for continuous_usage_stats, or turned on include_usage under the client's own
    # continuous_usage_stats): remove that member from each chunk.
    strip_chunk_usage: bool = False
    choices: int = 1  # choices the stream will carry (n, times the prompts of a completion)
    # The choices of each prompt (adjacent indexes) where `n` is not that: llama.cpp's native
    # routes, whose `n` is every result (for the estimates), and whose `n_cmpl` completions of a
    # prompt share its one evaluation (`prompt_choices`).
    per_prompt: int | None = None
    # `echo` (vLLM's OpenAI routes): a chat whose last message is the assistant's has it sent
    # back as one more content event a choice, no token generated (`Budgets.unmeasured_usd`)
    echoed: bool = False
    utf8: bool = True  # the body is UTF-8 (only a UTF-8 JSON object is ever changed)
    # For the budget's worst case: characters of every string in the body (tools, instructions,
    # input items too; base64 media left out), token ids sent as a prompt, and the limits that
    # were present but are no integer the server would read.
    text_chars: int = 0
    prompt_ids: int = 0
    unreadable: tuple[str, ...] = ()
    # The most output one choice can have been asked for by any limit field in the body (the
    # route's limit and every other: a server may read another one), None when the route's limit
    # is absent, a chat request has no `max_tokens` (Ollama's /v1 reads no other field), or any
    # limit field is no positive integer (`reqsize.capping_limit`, `reqsize.output_cap`). 0 on a
    # route that generates nothing (embeddings, pooling): it holds no output (`held_output`).
    # Also the output an unmeasured request is charged at when its stream showed more output
    # than its hold's limit (`budget.Budgets.unmeasured_usd`).
    output_cap: int | None = None
    # SGLang's /generate with a prompt that sets no max_new_tokens (`max_tokens` then None): it
    # runs to the server's own default, which the proxy reads (`Exchange.server_limit`); this is
    # the largest limit its other prompts set, held beside that one (0: none sets one). None
    # when every prompt sets one, or one sets no limit at all.
    limit_beside_default: int | None = None
    ambiguous: str | None = None  # why no route can be told for this body (refused with 400)
    # The server a shared path's body was told to be for (SGLang's /generate is TGI's path): its
    # adapter reads the response. None: the configured `upstream.api`'s.
    api: str | None = None
    # A multipart body streamed through (the audio routes): `body` holds only the head read for
    # its form fields, the rest comes from the client as it is sent; `size` is its Content-Length
    # (None: chunked). `audio_bytes` is what its hold counts audio seconds from.
    streamed: bool = False
    size: int | None = None
    audio_bytes: int = 0


@dataclass(slots=True)
class Cost:
    input_usd: float
    output_usd: float

    @property
    def total_usd(self) -> float:
        return self.input_usd + self.output_usd


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


_NOTHING_MEASURED = Usage()  # a shared default: never assigned to (see Usage)


class BudgetHold(Protocol):
    """What the budget gate reserved for an exchange (sidecar/billing/budget.py's `Hold`); read
    back by the budget when the exchange settles."""

    @property
    def request_id(self) -> str: ...

    @property
    def day(self) -> int: ...

    @property
    def amount(self) -> int: ...

    @property
    def unpriced(self) -> bool: ...


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
    device_cost_usd: float | None = None  # device_seconds at pricing.gpu_hour_usd, when priced
    energy_j: float | None = None
    audited: bool = False
    response_sample: bytes | bytearray | None = None  # audit text capture only; bounded
    request_headers: Mapping[str, str] = field(default_factory=dict)  # the client's, read-only
    team: str | None = None  # the billed principal's team (keys file)
    project: str | None = None  # chargeback: the principal's project (keys file, trusted header)
    tags: tuple[str, ...] = ()  # chargeback: the principal's tags, sorted
    end_user: str | None = None  # the body's `user`: recorded, never billed when keys are verified
    key_id: str | None = None  # "key-" + 12 hex of the key's sha256; never the key
    prompt_tokens: int | None = None  # the prompt's exact size from the upstream's /tokenize
    budget_hold: BudgetHold | None = None  # reserved by the budget gate
    budget_left_usd: float | None = None  # the least left of its limits after its hold (header)
    # what its budgets were charged when it settled (at least the hold where usage was not
    # measured); the ledger keeps it so that a restart restores it (None: no hold)
    budget_charge_usd: float | None = None
    # The output limit its server applies to a request that sets none, as the server reported
    # it (TGI: /info's max_total_tokens, `metering.tgi.runs_to_max_total`; SGLang's /generate:
    # its default max_new_tokens, `metering.sglang.stated_default`, or the larger limit another
    # prompt of the batch sets): its budget hold's output limit in place of
    # budgets.default_max_output_tokens. `server_limit_unknown`: the server applies one it could
    # not be asked for now (refused while budgets are enforced).
    server_limit: int | None = None
    server_limit_unknown: bool = False
    # Events of its stream that carried output, when its usage was read from the meter
    # (`StreamMeter.token_events`): each holds at least one token, so more than its hold's limit
    # allows shows the server ignored that limit (`budget.Budgets.unmeasured_usd`).
    output_events: int = 0
    path: str = ""  # the normalised path: what was classified and forwarded
    # A streamed body (audio) still on its way when the request ended: the server never had a
    # whole request, so a client that left then consumed nothing.
    body_unsent: bool = False
    # Set when the client left and a background task settles the usage (drain, /tokenize);
    # the exchange is recorded once it is done.
    finisher: asyncio.Future[None] | None = None
    # The one model of a server that answers a request's `model` with the request's own string
    # (SGLang, TGI: `proxy/handler.py` ONE_MODEL_APIS), UNKNOWN_MODEL while its name is not known:
    # it prices, holds, labels and records the request, whatever the request or the answer names.
    # None on a server that refuses a model it does not serve (vLLM, Ollama).
    served_model: str | None = None

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


def consumed(ex: Exchange) -> bool:
    """Did the request use the server? A refused one (4xx/5xx, no usage) consumed nothing, nor
    did one whose client left before it was sent upstream."""
    u = ex.usage
    if u.input_tokens is not None or u.output_tokens is not None or u.audio_seconds is not None:
        return True
    if ex.status == STATUS_CLIENT_CLOSED:
        return ex.upstream_start is not None and not ex.body_unsent
    return 200 <= ex.status < 300


def priced_model(ex: Exchange) -> str | None:
    """The name prices are looked up by: the one model of a server that repeats whatever name
    it is sent, else the model the answer names, else the requested one."""
    if ex.served_model is not None:
        return ex.served_model if ex.served_model != UNKNOWN_MODEL else None
    return ex.usage.model or ex.info.model or (ex.model if ex.model != UNKNOWN_MODEL else None)


def billed_model(ex: Exchange) -> str:
    """The model the ledger records the request under: the one it was priced at, else its
    label (UNKNOWN_MODEL)."""
    return ex.served_model or ex.usage.model or ex.info.model or ex.model


class Refusal(Exception):
    """The sidecar answers the request itself (budget spent, queue full, never fits)."""

    def __init__(self, status: int, err_type: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.err_type, self.retry_after = status, err_type, retry_after


# Hooks that later stages plug in (budgets, admission, tracing); each may raise Refusal.
Gate = Callable[[Exchange], Awaitable[Callable[[], None] | None]]
# What each resource hands the aiohttp app (`cleanup_ctx`): opened before the yield, closed after.
CleanupContext = Callable[["web.Application"], AsyncIterator[None]]


def task_context(
    name: str,
    run: Callable[[], Coroutine[Any, Any, None]],
    first: Callable[[], Awaitable[object]] | None = None,
) -> CleanupContext:
    """`run()` as a background task (after `first()`, when given) until the app closes; then
    cancelled and awaited."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        if first is not None:
            await first()
        task = asyncio.create_task(run(), name=name)
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return ctx


def closing_context(close: Callable[[], object]) -> CleanupContext:
    """Nothing to open; `close()` in a thread when the app closes (it may block: a flush)."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(close)

    return ctx


def prompt_choices(info: RequestInfo) -> int:
    """The choices of each prompt of the request: `per_prompt` where the adapter set it, else
    `n` (an OpenAI-shaped request's choices per prompt)."""
    return info.per_prompt or info.n or 1


def held_output(info: RequestInfo) -> int | None:
    """The output limit one choice is held and estimated at: none on a route that generates
    nothing (`output_cap` 0: embeddings, pooling, Ollama's /api/embed), else its limit as the
    route's server reads it; None when it has none (the caller's default applies)."""
    if info.output_cap == 0:
        return 0
    return info.max_tokens


def estimate_tokens(
    config: AdmissionConfig,
    prompt_chars: int,
    max_tokens: int | None,
    n: int | None,
    prompt_tokens: int | None = None,
) -> int:
    """Peak tokens: the prompt (counted by the upstream when known, else chars / ratio) plus the
    output its `n` choices may generate. An estimate: it admits requests and splits GPU time."""
    if prompt_tokens is None:
        prompt_tokens = math.ceil(prompt_chars / config.chars_per_token)
    out = max_tokens if max_tokens is not None else config.default_max_tokens
    return prompt_tokens + out * max(1, n or 1)
