"""What the core hands the proxy once, at start (sidecar/core/app.py).

Owns: the proxy's settings (`ProxySettings`), the parts it calls (`ProxyDeps`), the model name
of an upstream whose requests name none and TGI's own output limit (`TgiInfo`: TGI's /info, or
`upstream.model_name`), and SGLang's default max_new_tokens (`SGLangDefault`: its /model_info).
Never: changes after start, reads config files or the environment, or answers a request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import aiohttp

from ..exchange import Exchange, Gate
from ..metering.meter import Meter
from ..metering.sglang import stated_default
from ..telemetry.metrics import LabelCap, Metrics
from ..text import MODEL_CHARS, clean
from .audio import AudioLimits
from .finishers import Finishers, PromptCounter
from .identity import Identity
from .spend import Statement
from .upstream import Upstream

log = logging.getLogger("tollbooth.proxy")

# The most of TGI's /info or SGLang's /model_info read: each states a dozen of the server's
# arguments (about 1 KB). A longer answer is no such server's, and is not read: parsed whole on the
# event loop, 50 MB took 1.9 s of every request's time, again every RETRY_S while unreadable.
INFO_BYTES = 1 << 20


class TgiInfo:
    """TGI's /info: the model it serves (`model_id`) and the longest sequence it runs
    (`max_total_tokens`: a request that sets no output limit may generate up to it, less its
    prompt; router/src/validation.rs `validate_input`). Read on first need and again after a
    failure (not within RETRY_S of it); each again once it is FRESH_S old (a TGI restarted
    behind a running sidecar, with a longer --max-total-tokens or another --model-id), the last
    one read kept while a new read fails."""

    RETRY_S = 5.0
    FRESH_S = 60.0

    def __init__(self, upstream: Upstream, configured: str | None):
        self._upstream = upstream
        self._name = configured
        self.configured = configured  # upstream.model_name, as the operator set it
        self._total: int | None = None
        self._lock = asyncio.Lock()
        self._read_at = -1e9
        self._name_at = -1e9
        self._failed_at = -1e9

    async def model(self) -> str | None:
        """The served model: upstream.model_name when set, else /info's `model_id`."""
        if self.configured:
            return self.configured
        if not self._name_fresh() and not self._resting():
            await self._read(lambda: not self._name_fresh())
        return self._name

    def _name_fresh(self) -> bool:
        return self._name is not None and time.monotonic() - self._name_at < self.FRESH_S

    async def max_total_tokens(self) -> int | None:
        """/info's `max_total_tokens`, or None while it cannot be read (or is no positive
        integer)."""
        if not self._fresh() and not self._resting():
            await self._read(lambda: not self._fresh())
        return self._total

    def _fresh(self) -> bool:
        return self._total is not None and time.monotonic() - self._read_at < self.FRESH_S

    def _resting(self) -> bool:
        return time.monotonic() - self._failed_at < self.RETRY_S

    async def _read(self, needed: Callable[[], bool]) -> None:
        async with self._lock:
            if needed() and not self._resting():  # not read (or failed) while this one waited
                await self._fetch()

    async def _fetch(self) -> None:
        try:
            _, body = await self._upstream.fetch("GET", "/info", timeout=2.0, limit=INFO_BYTES)
            data = json.loads(body)
        except (aiohttp.ClientError, TimeoutError, ValueError, RecursionError) as exc:
            log.warning("upstream /info unavailable (%r); TGI model name and limit unknown", exc)
            self._failed_at = time.monotonic()
            return
        data = data if isinstance(data, dict) else {}
        name, total = data.get("model_id"), data.get("max_total_tokens")
        # the upstream's text: made safe here
        name = clean(name, MODEL_CHARS) if isinstance(name, str) else ""
        if not self.configured and name:
            self._name, self._name_at = name, time.monotonic()
        if type(total) is int and total > 0:  # serde's usize: a JSON integer
            self._total, self._read_at = total, time.monotonic()
        # a part not read is a failure, also beside a name read before (kept): else, once that
        # name is FRESH_S old, every request would ask /info again
        if not (self.configured or name) or type(total) is not int or total <= 0:
            self._failed_at = time.monotonic()


class SGLangDefault:
    """The max_new_tokens SGLang's /generate gives a prompt that sets none, as its GET
    /model_info states it (`metering.sglang.stated_default`; an SGLang without that path is
    asked /get_model_info, its older name). Read on first need, again once FRESH_S old (an
    SGLang restarted with other --preferred-sampling-params), not within RETRY_S of a failure;
    the last value read is kept while a new read fails."""

    RETRY_S = 5.0
    FRESH_S = 60.0

    def __init__(self, upstream: Upstream):
        self._upstream = upstream
        self._value: int | None = None
        self._lock = asyncio.Lock()
        self._read_at = -1e9
        self._failed_at = -1e9

    async def max_new_tokens(self, auth: Mapping[str, str] | None = None) -> int | None:
        """The default (0: no limit of its own), or None while it cannot be read. `auth`: the
        request's own key (`finishers.tokenize_auth`): an SGLang started with --api-key asks it
        on every path but /health and /metrics (utils `add_api_key_middleware`), /model_info
        too, and the sidecar may have none of its own."""
        if not self._fresh() and time.monotonic() - self._failed_at >= self.RETRY_S:
            async with self._lock:
                if not self._fresh() and time.monotonic() - self._failed_at >= self.RETRY_S:
                    await self._fetch(auth)
        return self._value

    def _fresh(self) -> bool:
        return self._value is not None and time.monotonic() - self._read_at < self.FRESH_S

    async def _fetch(self, auth: Mapping[str, str] | None) -> None:
        value, why, rest = None, "answered 404", True
        try:
            for path in ("/model_info", "/get_model_info"):
                status, body = await self._upstream.fetch(
                    "GET", path, timeout=2.0, headers=auth, limit=INFO_BYTES
                )
                # Asked with a client's key (none of the sidecar's own), a refusal of it says
                # nothing of the server: another client's key may be taken, so it is not rested
                # (one client's wrong key would refuse everyone's requests for RETRY_S).
                rest = status not in (401, 403) or bool(self._upstream.own_headers)
                if status != 404:
                    value = stated_default(body) if status == 200 else None
                    why = f"{path} answered {status}" + (" unreadable" if status == 200 else "")
                    break
        except (aiohttp.ClientError, TimeoutError) as exc:
            why = f"unavailable ({exc!r})"
        if value is None:
            log.warning("upstream /model_info %s; SGLang's default max_new_tokens unknown", why)
            if rest:
                self._failed_at = time.monotonic()
        else:
            self._value, self._read_at = value, time.monotonic()


@dataclass(frozen=True, kw_only=True)
class ProxySettings:
    upstream: str  # base URL without trailing slash
    inject_usage: bool
    max_body: int
    capture_bytes: int  # audit text capture: keep up to this many response bytes
    authorization: str | None  # the upstream's key (upstream.api_key_env), never logged
    api: str
    sglang_messages_usage: str  # "anthropic" or "prompt": SGLang's Messages usage rule
    continuous_usage: bool  # ask vLLM for running totals on every chunk (cut back out)
    free_routes: frozenset[str]  # unmetered POSTs that generate nothing
    refuse_unknown_routes: bool
    drain_s: float  # read a finished stream this long for its usage after the client left
    size_prompts: bool  # admission.tokenize: the exact prompt size before the gates
    body_timeout: float  # a metered request's body arrives within this after its headers
    max_event_bytes: int  # metering.max_event_bytes: a longer SSE event is not parsed
    max_buffered: int  # request memory across all connections (server.max_buffered_...)
    max_buffered_per_key: int
    audio: AudioLimits


@dataclass(frozen=True, kw_only=True)
class ProxyDeps:
    """The parts the proxy calls, made once by the core (sidecar/core/app.py)."""

    upstream: Upstream  # every call to the inference server
    metrics: Metrics
    meter: Meter  # each finished exchange goes to it, and from it to the sinks
    identity: Identity  # who is billed: a verified key, or the body's user
    users: LabelCap
    models: LabelCap
    tgi_info: TgiInfo  # TGI's served model and max_total_tokens
    sglang_default: SGLangDefault  # SGLang's default max_new_tokens
    gates: list[Gate] = field(default_factory=list)  # budgets, admission: may refuse a request
    on_start: list[Callable[[Exchange], None]] = field(default_factory=list)  # e.g. open a span
    counter: PromptCounter | None = None  # exact prompt size when the wire lacked usage
    finishers: Finishers = field(default_factory=Finishers)  # work after the client left
    statement: Statement | None = None  # GET /v1/tollbooth/spend: the budgets' answer
