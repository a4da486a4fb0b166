"""Typed, immutable configuration, read once at start.

Owns: the schema (frozen, keyword-only dataclasses), loading YAML, applying command-line overrides,
and turning every mistake into one line that names the key, the value and what was expected.
Never: reads the environment at request time or mutates a config after it is built.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import parse_qsl, urlsplit

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is wrong; the message is one line naming the key."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class UpstreamConfig:
    url: str = "http://127.0.0.1:8000"
    # "vllm", "tgi" or "sglang": the server behind the sidecar (and the provider name on spans).
    # Metering recognises every wire format anyway, but set it: SGLang's and TGI's OpenAI routes
    # answer with whatever model a request names, so only with tgi or sglang is every request
    # priced as the one model the server serves (model_name, TGI's /info), never the name sent;
    # and /generate (TGI's and SGLang's path) is read as this server's, told from the body
    # otherwise (docs/traffic.md).
    api: Literal["vllm", "tgi", "sglang"] = "vllm"
    # The served model's name: what a request naming none is priced at (TGI's native routes when
    # /info cannot be read, llama.cpp's /completion, vLLM's audio), and on a server of one model
    # that repeats whatever name a request sends (api sglang; tgi, ahead of its /info) what
    # every request is priced at. Required with api sglang and prices by model, and then one
    # of pricing.models unless there is a pricing.default.
    model_name: str | None = None
    # How SGLang's /v1/messages counts a prompt's cache reads (api sglang only): "anthropic", as
    # current SGLang does (input_tokens excludes cache_read_input_tokens, which is added to it),
    # or "prompt", as older SGLang did (input_tokens is the whole prompt, the cache reads a part
    # of it). The answer cannot tell them apart; "anthropic" never bills less than was served
    # (an older SGLang's cache reads are then billed twice). docs/metrics.md.
    sglang_messages_usage: Literal["anthropic", "prompt"] = "anthropic"
    connect_timeout_s: float = 5.0
    # Longest silence between two reads of the upstream response (a slow prefill counts here).
    read_timeout_s: float = 600.0
    # Connections open to the upstream, at most, for every call: proxied requests, /tokenize and
    # /info calls, the readiness probe (one pool). Past it a request waits.
    max_connections: int = 1000
    # Name of an environment variable holding the upstream's API key (vLLM's --api-key). When set,
    # the sidecar sends `Authorization: Bearer <key>` upstream in place of the client's header.
    api_key_env: str | None = None
    # Readiness: a background probe of this path (any answer below 500 is up), never on a
    # request's path; /readyz is 503 while the last probe failed or is stale.
    probe_path: str = "/health"
    probe_interval_s: float = 5.0
    probe_timeout_s: float = 2.0
    # The engine's Prometheus endpoint, read for its own token counters (reconcile.*).
    # TensorRT-LLM serves it at /prometheus/metrics.
    metrics_path: str = "/metrics"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    listen: str = "127.0.0.1:8080"
    admin_listen: str = "127.0.0.1:9464"
    max_request_body_bytes: int = 16 * 1024 * 1024
    shutdown_grace_s: float = 30.0
    # A client that has not sent a request's complete headers this long after connecting (or
    # after starting its next request on a kept-alive connection) is cut off.
    header_timeout_s: float = 15.0
    # A kept-alive connection with no request for this long is closed.
    keepalive_timeout_s: float = 75.0
    # A metered request's body must have arrived this long after its headers: a client that
    # stops sending it is answered 408 and its connection closed. A total, not a gap between
    # reads, so a trickle cannot hold a handler either: a body of max_request_body_bytes (16 MiB)
    # then needs about 2.2 Mbit/s. Raise it for big bodies from slow links.
    body_timeout_s: float = 60.0
    # Memory for request bodies, across all connections: a request reserves twice its
    # Content-Length before its body is read (a chunked one as it arrives) and, while its JSON is
    # parsed, an estimate of what parsing allocates (sidecar/proxy/memory.py); it keeps the
    # reservation until it is recorded. A request that does not fit is answered 503 with
    # Retry-After (counted in tollbooth_requests_refused_total{reason="memory_total"}); one that
    # could never fit, 413.
    # With the defaults the process stays under 400 MiB (docs/traffic.md). 0: no limit.
    max_buffered_request_bytes: int = 256 * 1024 * 1024
    # The share one key may hold (the principal under identity.keys_file, else the presented key's
    # hash; requests without a key count only in the total): reason="memory_key". 0: no limit.
    max_buffered_request_bytes_per_key: int = 96 * 1024 * 1024
    # The audio routes' multipart bodies are streamed through, never held whole: a larger one
    # (by its Content-Length, or as a chunked one arrives) is refused with 413. vLLM's own limit
    # is VLLM_MAX_AUDIO_CLIP_FILESIZE_MB (25 MB).
    max_audio_body_bytes: int = 32 * 1024 * 1024
    # What of such a body is read (and held) before it is sent on, for its form fields (model,
    # stream, response_format): up to its file part, at most this many bytes. A model named
    # after the file, or past this, is not read: the request is the unknown model's.
    audio_form_bytes: int = 64 * 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeteringConfig:
    user_header: str = "X-Tollbooth-User"
    max_tracked_users: int = 500
    # Model names come from clients too (a typo is a new name): bound them like users.
    max_tracked_models: int = 100
    # Teams (from the keys file) with their own llm_team_spend_today_usd series; later share one.
    max_tracked_teams: int = 100
    # Ask streaming chat/completions for usage and strip the extra chunk before the client sees it.
    inject_stream_usage: bool = True
    # A counter series first exposed already carrying a value (one not published ahead: an
    # unforeseen user, model or status) reads 0 for this long first (docs/metrics.md): keep it
    # above the longest scrape_interval of every Prometheus scraping the sidecar (2 x 15 s here).
    # 0 turns the hold off (a Prometheus that ingests created timestamps needs none).
    new_series_hold_s: float = 30.0
    # Also ask vLLM for running totals on every chunk (continuous_usage_stats), cut back out of
    # each chunk, so a client that leaves mid-stream is billed the exact tokens generated so far.
    # Only sent when upstream.api is vllm (TGI has no such option). Metering cost per chunk: 3.1
    # against 1.9 us without it, in process (README, Overhead). Off: the output of a client that
    # leaves mid-stream is recorded as unknown, and a budget charges it its whole hold.
    continuous_usage: bool = True
    # POSTs that generate nothing, served without metering. Any other unmetered POST is counted
    # in llm_unmetered_requests_total and goes through the budget gate.
    free_routes: tuple[str, ...] = (
        "/tokenize",
        "/detokenize",
        "/chat_tokenize",
        "/v1/messages/count_tokens",  # Anthropic's: counts the prompt, generates nothing
        "/ping",
        "/health",
        "/version",
        "/v1/models",
        "/metrics",
        "/load",
        "/info",
    )
    # An unmetered POST that is not a free route: refused with 403 (refuse), or served with its
    # usage unknown (forward). See docs/traffic.md.
    unknown_routes: Literal["forward", "refuse"] = "refuse"
    # A client that leaves after the last token: read the upstream this long for the usage.
    drain_after_disconnect_s: float = 5.0
    # An upstream SSE event (or NDJSON line) longer than this is not parsed: its bytes go to the
    # client as they come and nothing of it is held. The stream's usage is unknown
    # (event_too_large; a budget charges its hold) unless every reading it is built from came
    # after the last such event and supersedes all before it (the final totals, counts so far;
    # parts added up: one per choice, all after it). Bounds what one stream holds and keeps a
    # flood linear (docs/traffic.md).
    # vLLM's and TGI's events are one chunk each: under 1 KB, TGI's last one with the whole
    # generated text about 4 bytes a token (128k tokens: 512 KB).
    max_event_bytes: int = 1 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelPrice:
    input_per_1m: float
    output_per_1m: float
    cached_input_per_1m: float | None = None
    # Reasoning tokens are a part of the output; null prices them as the rest of it.
    reasoning_per_1m: float | None = None
    # Speech-to-text (/v1/audio/*): USD per second of input audio the server reports; null: the
    # cost of such a request is unknown (its seconds are still counted).
    audio_per_second: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class PricingConfig:
    models: dict[str, ModelPrice] = dataclasses.field(default_factory=dict)
    default: ModelPrice | None = None
    gpu_hour_usd: float | None = None

    def listed(self, model: str) -> ModelPrice | None:
        """The model's own price, where `models` lists it. Ollama serves a name without a tag
        as its `:latest` (and says so in its answers): `llama3.2` and `llama3.2:latest` are one
        model, priced by whichever spelling the book lists."""
        if model in self.models:
            return self.models[model]
        other = model[: -len(LATEST)] if model.endswith(LATEST) else model + LATEST
        return self.models.get(other)


LATEST = ":latest"  # the tag Ollama gives a name written without one


@dataclasses.dataclass(frozen=True, kw_only=True)
class LedgerConfig:
    path: str | None = None
    flush_interval_s: float = 0.25
    retention_days: int = 90
    max_pending_rows: int = 100_000
    # Fleet ledger: rows still go to the SQLite file at `path` first (the outbox) and are shipped
    # to this PostgreSQL database in batches. No password in the URL: use PGPASSWORD/PGPASSFILE.
    postgres_url: str | None = None
    ship_interval_s: float = 1.0
    ship_batch_rows: int = 5000


@dataclasses.dataclass(frozen=True, kw_only=True)
class IdentityConfig:
    # YAML file of API keys by SHA-256: `keys: [{sha256: <64 hex>, user: alice, team: research}]`.
    # Re-read on SIGHUP. When set, the key's principal is the billed user.
    keys_file: str | None = None
    # An unknown or missing key: 401 ("reject"), or billed to "anonymous". Null: reject when a keys
    # file is set, anonymous otherwise.
    unknown_key: Literal["reject", "anonymous"] | None = None
    # Bill the user named in metering.user_header. Null: trusted only without a keys file (then a
    # gateway in front must set or strip that header).
    trust_user_header: bool | None = None
    # Chargeback, trusted-header mode only: headers a gateway sets to the principal's project and
    # its comma-separated tags (null: not read). Cleaned and bounded like the user header.
    project_header: str | None = None
    tags_header: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LimitConfig:
    """One budget limit (docs/budgets.md): `name` "*" is one limit for each user, team, project,
    tag or model; a named limit replaces the "*" one of its scope and window for that name."""

    scope: Literal["user", "team", "project", "tag", "model", "global"]
    name: str = "*"
    usd: float
    window: Literal["day", "month"] = "day"
    # Warn (llm_budget_used_ratio above llm_budget_soft_ratio: LLMBudgetSoftLimit) at this share.
    soft: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class BudgetConfig:
    # Limits by scope and window: [{scope: project, name: "*", usd: 500, window: month, soft: 0.8}].
    # The keys below are shorthands for day limits.
    limits: tuple[LimitConfig, ...] = ()
    global_daily_usd: float | None = None
    user_daily_usd: float | None = None
    users: dict[str, float] = dataclasses.field(default_factory=dict)
    team_daily_usd: float | None = None
    teams: dict[str, float] = dataclasses.field(default_factory=dict)
    # The budget day starts at this hour, UTC.
    day_start_hour_utc: int = 0
    # Output tokens reserved for a request that sets no max_tokens (its worst case is unbounded);
    # the server's own in its place where it reports one (TGI's /info max_total_tokens, the
    # default max_new_tokens of SGLang's /generate at its /model_info).
    default_max_output_tokens: int = 4096
    # An audio request's hold: its upload (Content-Length, else server.max_audio_body_bytes)
    # counted as one second of audio per this many bytes, at the model's audio price. 500 bytes
    # (4 kbit/s) is below the speech codecs' lowest bitrates (Opus at 6 kbit/s): no real upload
    # holds less audio than its hold counts.
    audio_bytes_per_second: int = 500
    # Users tracked in memory for per-user budgets; a new user beyond this is refused.
    max_tracked_users: int = 100_000
    # Shared store for a fleet of sidecars: redis://host:port/db (null: this process only).
    store: str | None = None
    # Name of an environment variable holding the store's password (never in the URL).
    store_password_env: str | None = None
    # When the store cannot be reached: refuse with 503 ("closed"), spend at most the last known
    # remainder divided by the sidecars alive ("local"), or admit and count ("open").
    store_unavailable: Literal["closed", "local", "open"] = "local"
    # Longest wait for one store call before the request is decided as `store_unavailable` says.
    store_timeout_s: float = 0.25
    # A hold's lease: renewed while its request runs; a hold whose sidecar stopped renewing it
    # (killed) is charged in full when the lease ends.
    lease_s: float = 60.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdmissionConfig:
    strategy: Literal["none", "serial", "fixed-batch", "token-budget"] = "none"
    token_budget: int = 32768
    max_batch: int = 8
    batch_window_s: float = 0.05
    max_queue_length: int = 1024
    max_queue_wait_s: float = 60.0
    chars_per_token: float = 4.0
    default_max_tokens: int = 256
    # Let a small request pass a large one waiting at the head. Off: strict FIFO, no starvation.
    allow_overtake: bool = False
    # Ask the upstream's /tokenize for the prompt size instead of the chars estimate, for admission
    # and budget holds (exact, but one more upstream call first; the estimate if it fails).
    tokenize: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuConfig:
    enabled: bool = True
    poll_interval_s: float = 1.0
    # Indices ("0") or UUIDs ("GPU-..."); empty: every visible GPU (and devices_file, if set).
    devices: tuple[str, ...] = ()
    # A file naming the engine's GPUs (UUIDs or indices, separated by commas or white space),
    # written by the engine's container from its own NVIDIA_VISIBLE_DEVICES (deploy/kubernetes):
    # only those are read and attributed, not every GPU the sidecar can see. Waited for at start
    # up to devices_file_wait_s; absent or naming no visible GPU: telemetry off, never all GPUs.
    devices_file: str | None = None
    devices_file_wait_s: float = 30.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReconcileConfig:
    # Read the engine's own token counters (vLLM, SGLang, TGI, llama.cpp, TensorRT-LLM) from
    # upstream.metrics_path and export them as llm_engine_tokens_total: traffic that reaches the
    # engine around the sidecar shows as the difference from llm_tokens_total. An engine that
    # does not answer leaves llm_engine_metrics_up at 0 and the counts absent, quietly.
    enabled: bool = True
    interval_s: float = 15.0
    timeout_s: float = 5.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TracingConfig:
    # Unset: spans are exported when OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT is set, the GenAI
    # metrics when OTEL_EXPORTER_OTLP_(METRICS_)ENDPOINT is. true: both (to those, else
    # localhost:4318); false: neither.
    enabled: bool | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    level: str = "INFO"
    format: Literal["json", "text"] = "json"
    # "stdout", "stderr", a file path, or "off".
    access_log: str = "stdout"
    # Fraction of successful requests logged; errors and audited requests are always logged.
    sample_success: float = 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class AuditConfig:
    enabled: bool = True
    # Defaults come from sidecar.telemetry.thresholds (the alerts' numbers) when left null.
    input_cost_usd: float | None = None
    total_cost_usd: float | None = None
    capture_text: bool = False
    max_text_chars: int = 4096
    sink: Literal["jsonl", "ledger"] = "jsonl"
    path: str = "tollbooth-audit.jsonl"
    max_bytes: int = 50 * 1024 * 1024
    backups: int = 5


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    upstream: UpstreamConfig = dataclasses.field(default_factory=UpstreamConfig)
    server: ServerConfig = dataclasses.field(default_factory=ServerConfig)
    metering: MeteringConfig = dataclasses.field(default_factory=MeteringConfig)
    pricing: PricingConfig = dataclasses.field(default_factory=PricingConfig)
    ledger: LedgerConfig = dataclasses.field(default_factory=LedgerConfig)
    identity: IdentityConfig = dataclasses.field(default_factory=IdentityConfig)
    budgets: BudgetConfig = dataclasses.field(default_factory=BudgetConfig)
    admission: AdmissionConfig = dataclasses.field(default_factory=AdmissionConfig)
    gpu: GpuConfig = dataclasses.field(default_factory=GpuConfig)
    reconcile: ReconcileConfig = dataclasses.field(default_factory=ReconcileConfig)
    tracing: TracingConfig = dataclasses.field(default_factory=TracingConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    audit: AuditConfig = dataclasses.field(default_factory=AuditConfig)


# --- building dataclasses from plain data, with errors that name the key -------------------------


def _fail(key: str, value: object, expected: str) -> typing.NoReturn:
    shown = repr(value) if not isinstance(value, str) else f"'{value}'"
    raise ConfigError(f"config '{key}' has value {shown}: {expected}")


def _convert(key: str, value: object, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        (inner,) = [o for o in options if o is not type(None)]
        return _convert(key, value, inner)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            _fail(key, value, "expected one of " + ", ".join(map(str, allowed)))
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            _fail(key, value, "expected a list")
        (inner, _) = typing.get_args(hint)
        return tuple(_convert(f"{key}[{i}]", v, inner) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, Mapping):
            _fail(key, value, "expected a mapping")
        _, inner = typing.get_args(hint)
        return {str(k): _convert(f"{key}.{k}", v, inner) for k, v in value.items()}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return build(hint, value, prefix=key)
    return _scalar(key, value, hint)


def _scalar(key: str, value: object, hint: Any) -> Any:
    if hint is bool:
        if not isinstance(value, bool):
            _fail(key, value, "not a boolean (true or false)")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(key, value, "not an integer")
        if value < 0:
            _fail(key, value, "must not be negative")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            _fail(key, value, "not a number")
        if not math.isfinite(value):  # YAML reads .inf and .nan: a price of inf costs NaN
            _fail(key, value, "not a finite number")
        if value < 0:
            _fail(key, value, "must not be negative")
        return float(value)
    if hint is str:
        if value is False and key.endswith("access_log"):
            return "off"  # YAML reads a bare `off` as false
        if not isinstance(value, str):
            _fail(key, value, "not a string")
        return value
    raise TypeError(f"unsupported config type {hint!r} at {key}")


def build(cls: type[T], data: object, *, prefix: str = "") -> T:
    """Build dataclass `cls` from a mapping; unknown keys and wrong types raise ConfigError."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        _fail(prefix or "<root>", data, "expected a mapping")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for k in data:
        if k not in names:
            raise ConfigError(
                f"config '{_join(prefix, str(k))}' is not a known key "
                f"(known: {', '.join(sorted(names))})"
            )
    kwargs = {k: _convert(_join(prefix, k), v, hints[k]) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        missing = [
            f.name
            for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            if f.name not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise ConfigError(f"config '{_join(prefix, missing[0])}' is required") from exc
        raise


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


# --- semantic checks ------------------------------------------------------------------------------


def parse_hostport(key: str, value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        _fail(key, value, "expected HOST:PORT")
    return host.strip("[]"), int(port)


def _check_url(key: str, value: str) -> None:
    """Errors name the key and the problem, never the value: a URL can carry a credential."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"config '{key}' must be an http:// or https:// URL with a host")
    if "@" in parts.netloc:
        raise ConfigError(
            f"config '{key}' carries credentials (user:password@): remove them and put the "
            "upstream's key in the variable named by upstream.api_key_env"
        )
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ConfigError(f"config '{key}': the port is not a number in 0-65535") from None
    if not parts.hostname:
        raise ConfigError(f"config '{key}' must be an http:// or https:// URL with a host")
    if parts.query or parts.fragment:
        raise ConfigError(f"config '{key}' must not carry a query or fragment")


def _check_store_url(key: str, value: str | None, schemes: tuple[str, ...], where: str) -> None:
    """Never echoes the value: it may carry a credential (in the URL, its query, or libpq's
    key=value form, which is refused)."""
    if value is None:
        return
    parts = urlsplit(value)  # the scheme comes back in lower case
    refused = f"config '{key}' carries a password: remove it and use {where}"
    if parts.password is not None:
        raise ConfigError(refused)
    if any(k.strip().lower() == "password" for k, _ in parse_qsl(parts.query, True)):
        raise ConfigError(refused)
    if parts.scheme not in schemes or not value.partition(":")[2].startswith("//"):
        if "password" in value.lower():
            raise ConfigError(refused)
        raise ConfigError(
            f"config '{key}': expected a URL starting with "
            + " or ".join(f"{s}://" for s in schemes)
        )


# The least value of the numbers that need one (`_scalar` has refused a negative one already).
_BOUNDS: dict[str, tuple[str, int]] = {
    "budgets.store_timeout_s": (">", 0),
    "budgets.lease_s": (">", 0),
    "ledger.ship_interval_s": (">", 0),
    "ledger.ship_batch_rows": (">=", 1),
    "server.header_timeout_s": (">", 0),
    "server.keepalive_timeout_s": (">", 0),
    "server.body_timeout_s": (">", 0),
    "upstream.probe_interval_s": (">", 0),
    "upstream.probe_timeout_s": (">", 0),
    "reconcile.interval_s": (">", 0),
    "reconcile.timeout_s": (">", 0),
    "server.max_audio_body_bytes": (">=", 1),
    "server.audio_form_bytes": (">=", 1),
    "budgets.audio_bytes_per_second": (">=", 1),
    "admission.chars_per_token": (">", 0),
    "admission.max_batch": (">=", 1),
    "metering.max_event_bytes": (">=", 1024),
    "metering.max_tracked_users": (">=", 1),
    "metering.max_tracked_teams": (">=", 1),
}


def _check_bounds(config: Config) -> None:
    for key, (op, least) in _BOUNDS.items():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if value < least or (op == ">" and value == least):
            _fail(key, value, f"must be {op} {least}")


# A limit's name by its scope, and what the error says it expects. A model limit applies to the
# request's model label (telemetry/metrics.py `sanitize`, at most 128 characters): a name the label
# would change (a comma, `=`, past 128) could never apply. Model names carry slashes (org/model);
# any other is a principal's name (identity), or *.
_MODEL_NAME = (
    re.compile(r"[A-Za-z0-9._:/@+-]{1,128}|\*"),
    "expected * or a model name of 1-128 of A-Z a-z 0-9 . _ : / @ + - (its label)",
)
_LIMIT_NAME = (
    re.compile(r"[A-Za-z0-9._:@+-]{1,64}|\*"),
    "expected * or a name of 1-64 of A-Z a-z 0-9 . _ : @ + -",
)


def limit_list(config: BudgetConfig) -> tuple[LimitConfig, ...]:
    """`budgets.limits`, with the day shorthands (global_daily_usd, user_daily_usd, users,
    team_daily_usd, teams) expanded into day limits in front of them."""
    c, out = config, []
    if c.global_daily_usd is not None:
        out.append(LimitConfig(scope="global", usd=c.global_daily_usd))
    if c.team_daily_usd is not None:
        out.append(LimitConfig(scope="team", usd=c.team_daily_usd))
    out += [LimitConfig(scope="team", name=t, usd=u) for t, u in c.teams.items()]
    if c.user_daily_usd is not None:
        out.append(LimitConfig(scope="user", usd=c.user_daily_usd))
    out += [LimitConfig(scope="user", name=n, usd=u) for n, u in c.users.items()]
    return (*out, *c.limits)


def _check_limits(b: BudgetConfig) -> None:
    seen: set[tuple[str, str, str]] = set()
    for i, lim in enumerate(b.limits):
        key = f"budgets.limits[{i}]"
        pattern, expected = _MODEL_NAME if lim.scope == "model" else _LIMIT_NAME
        if not pattern.fullmatch(lim.name):
            _fail(f"{key}.name", lim.name, expected)
        if lim.scope == "global" and lim.name != "*":
            _fail(f"{key}.name", lim.name, "a global limit has name '*'")
        if lim.soft is not None and not 0 < lim.soft <= 1:
            _fail(f"{key}.soft", lim.soft, "must be in (0, 1]")
        what = (lim.scope, lim.name, lim.window)
        if what in seen:
            _fail(key, f"{lim.scope}/{lim.name}/{lim.window}", "given twice")
        seen.add(what)
    for lim in limit_list(dataclasses.replace(b, limits=())):  # the shorthands' day limits
        if (lim.scope, lim.name, "day") in seen:
            _fail("budgets.limits", f"{lim.scope}/{lim.name}/day", "also set by a shorthand key")


def validate(config: Config) -> Config:
    _check_url("upstream.url", config.upstream.url)
    b, led = config.budgets, config.ledger
    _check_store_url("budgets.store", b.store, ("redis", "rediss"), "budgets.store_password_env")
    _check_store_url(
        "ledger.postgres_url", led.postgres_url, ("postgresql", "postgres"), "PGPASSWORD"
    )
    if led.postgres_url and not led.path:
        raise ConfigError("config 'ledger.postgres_url' needs ledger.path (the local outbox)")
    _check_bounds(config)
    parse_hostport("server.listen", config.server.listen)
    parse_hostport("server.admin_listen", config.server.admin_listen)
    if not config.upstream.probe_path.startswith("/"):
        _fail("upstream.probe_path", config.upstream.probe_path, "must start with /")
    if not config.upstream.metrics_path.startswith("/"):
        _fail("upstream.metrics_path", config.upstream.metrics_path, "must start with /")
    srv = config.server
    if srv.max_buffered_request_bytes_per_key > (srv.max_buffered_request_bytes or 1 << 62):
        _fail(
            "server.max_buffered_request_bytes_per_key",
            srv.max_buffered_request_bytes_per_key,
            "must not exceed server.max_buffered_request_bytes",
        )
    if not 0.0 <= config.logging.sample_success <= 1.0:
        _fail("logging.sample_success", config.logging.sample_success, "must be in [0, 1]")
    _check_limits(config.budgets)
    named_models = {lim.name for lim in config.budgets.limits if lim.scope == "model"} - {"*"}
    if len(named_models) > config.metering.max_tracked_models:
        _fail(
            "budgets.limits",
            f"{len(named_models)} named model limits",
            "more than metering.max_tracked_models: those past it could never apply",
        )
    if config.budgets.day_start_hour_utc > 23:
        _fail("budgets.day_start_hour_utc", config.budgets.day_start_hour_utc, "must be 0-23")
    for route in config.metering.free_routes:
        if not route.startswith("/"):
            _fail("metering.free_routes", route, "each route must start with '/'")
    if not config.metering.user_header.strip():
        _fail("metering.user_header", config.metering.user_header, "must not be empty")
    if config.identity.trust_user_header and config.identity.keys_file:
        _fail(
            "identity.trust_user_header",
            True,
            "a trusted header would let any key holder bill any user; with identity.keys_file "
            "the key decides",
        )
    if config.identity.unknown_key == "reject" and not config.identity.keys_file:
        _fail("identity.unknown_key", "reject", "needs identity.keys_file")
    if config.audit.enabled and config.audit.sink == "ledger" and not config.ledger.path:
        _fail("audit.sink", "ledger", "there is no ledger (set ledger.path or --ledger)")
    check_served_model(config.upstream, config.pricing)
    return config


def check_served_model(upstream: UpstreamConfig, pricing: PricingConfig) -> None:
    """SGLang serves one model and answers every request with the name the request sent: with
    prices by model name, only upstream.model_name can say which one a request was served by
    (TGI's is read from its /info), and every request is priced at it: a name the book does not
    list, with no default, would make every request's cost unknown and its budget charge $0."""
    if upstream.api != "sglang" or not pricing.models:
        return
    if not upstream.model_name:
        raise ConfigError(
            "config 'upstream.model_name' is required with upstream.api 'sglang' and prices "
            "by model (pricing.models): SGLang answers with whatever model name a request "
            "sends, so requests are priced as the model it serves; set it to that model's name"
        )
    if pricing.listed(upstream.model_name) is None and pricing.default is None:
        _fail(
            "upstream.model_name",
            upstream.model_name,
            "not a model of pricing.models, and there is no pricing.default: with upstream.api "
            "'sglang' every request is priced at it, so none would have a price",
        )


# --- entry points ---------------------------------------------------------------------------------


def load_yaml(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file '{path}' cannot be read: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file '{path}' is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping at the top level")
    return data


def set_path(data: dict[str, Any], dotted: str, value: object) -> None:
    """Set `a.b.c` in nested dicts, creating levels as needed (for command-line overrides)."""
    *parents, last = dotted.split(".")
    node = data
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value


def load(path: str | Path | None = None, overrides: Mapping[str, object] | None = None) -> Config:
    """Read the YAML file (if any), apply dotted-key overrides, validate, freeze."""
    data = load_yaml(path) if path else {}
    for dotted, value in (overrides or {}).items():
        if value is not None:
            set_path(data, dotted, value)
    return validate(build(Config, data))
