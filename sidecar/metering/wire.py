"""Wire adapters: one per wire family, behind one protocol; the registry picks one per request.

Owns: the `WireAdapter` protocol (what a request asks, the one edit we may make, usage from a
body or headers, a meter for a stream, the prompt count after a disconnect), the `StreamMeter`
protocol every stream meter implements, and the registry from a route (and the server, `api`)
to its adapter. `inspect_request`, `usage_from_body`, `open_stream` and `tokenize_requests` are
what the proxy calls; they resolve `/invocations` and hand the rest to the adapter.
Never: reads a wire itself. A new wire family (Anthropic Messages, Ollama's NDJSON, ...) is a new
module implementing `WireAdapter` (and a `StreamMeter`: SSE ones build on `stream.SSEMeter`,
NDJSON ones feed their own line reader) and one `register` call; the adapters here are not
touched.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from ..exchange import AUDIO_ROUTES, POOLING_ROUTES, Endpoint, RequestInfo, Usage
from .anthropic import AnthropicAdapter
from .audio import AudioAdapter
from .counts import INVALID_USAGE, parse, unmeasured
from .dispatch import AmbiguousBody, generate_api, invocation_endpoint
from .llamacpp import LlamaCppAdapter
from .ollama import OLLAMA_ROUTES, OllamaAdapter
from .openai import OpenAIAdapter
from .pooling import PoolingAdapter
from .reqsize import case_twins
from .sglang import SGLangAdapter
from .shape import FastChatStream
from .sse import DEFAULT_MAX_EVENT_BYTES
from .tgi import TGIAdapter, TGIOpenAIAdapter


class StreamMeter(Protocol):
    """A per-request meter for a streamed response, fed the upstream's bytes as they come.

    `feed` returns the bytes for the client (the input, less exactly what we caused); `finish`
    the bytes still held and the usage; `usage_so_far` what a client that left is billed.
    `token_events` counts events that carried output (the first one is the TTFT); `finished` is
    true once generation is over (only usage may follow), `done` once the wire's terminal event
    came. After an accounting failure the proxy sets `passthrough`: bytes then pass unread.
    """

    endpoint: Endpoint
    done: bool
    passthrough: bool

    @property
    def token_events(self) -> int: ...

    @property
    def finished(self) -> bool: ...

    def feed(self, chunk: bytes) -> bytes: ...

    def finish(self) -> tuple[bytes, Usage]: ...

    def usage_so_far(self) -> Usage: ...


class WireAdapter(Protocol):
    """One wire family (the routes of one server that read alike)."""

    def inspect(
        self,
        endpoint: Endpoint,
        body: bytes,
        text: str | None,
        obj: Mapping[str, Any],
        *,
        inject_usage: bool,
        continuous_usage: bool = False,
    ) -> RequestInfo:
        """What a JSON-object request asks for (`text`: the body as UTF-8, None if it is not),
        with the one edit the adapter may make, when `inject_usage` asks for it, in its body."""
        ...

    def usage_from_body(
        self,
        endpoint: Endpoint,
        body: bytes,
        headers: Mapping[str, str],
        *,
        sequences: int = 1,
        per_prompt: int = 1,
    ) -> Usage:
        """Usage of a complete (non-streaming) response; `sequences`: how many the request's
        `choices` says are generated (where the wire reports only the best of them);
        `per_prompt`: the choices of each prompt, adjacent by index (`exchange.prompt_choices`)."""
        ...

    def stream(self, endpoint: Endpoint, *, fast: bool = True, **options: Any) -> StreamMeter:
        """A meter for one streamed response. `fast=False`: the plain reference path alone."""
        ...

    def tokenize_requests(self, info: RequestInfo) -> list[tuple[str, bytes]] | None:
        """(path, JSON body) upstream calls whose counts add up to the prompt's tokens."""
        ...

    def prompt_token_ids(self, info: RequestInfo) -> int | None:
        """The prompt's size when the request gives it as token ids, counted without asking."""
        ...


# The registry: (route, server) -> adapter; a server of None is any server. A new wire family
# registers its routes (and, where it shares a path with another, its server: SGLang's /generate
# is TGI's path) and touches nothing else.
_ROUTES: dict[tuple[Endpoint, str | None], WireAdapter] = {}
# The Messages usage of an SGLang that built it from its chat usage as it is (`input_tokens` the
# whole prompt, the cache reads a part of it), registered as a server of its own: an operator
# names it with `upstream.sglang_messages_usage: prompt` (`usage_api`). Current SGLang follows
# Anthropic's rule (docs/metrics.md).
SGLANG_PROMPT_USAGE = "sglang/prompt-usage"
_OPENAI_ROUTES = (Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.EMBEDDINGS, Endpoint.RESPONSES)
_TGI_ROUTES = tuple(e for e in Endpoint if e.is_tgi_native)


def register(adapter: WireAdapter, routes: Iterable[Endpoint], api: str | None = None) -> None:
    """Read `routes` with `adapter` (on server `api`, or on any server when None)."""
    for route in routes:
        _ROUTES[route, api] = adapter


register(OpenAIAdapter(fast_chat=FastChatStream), _OPENAI_ROUTES, "vllm")
register(TGIOpenAIAdapter(fast_chat=FastChatStream), _OPENAI_ROUTES, "tgi")
register(TGIAdapter(), _TGI_ROUTES)
register(AnthropicAdapter(), (Endpoint.MESSAGES,))  # the same wire on every server, SGLang's too
register(AnthropicAdapter(cache_in_input=True), (Endpoint.MESSAGES,), SGLANG_PROMPT_USAGE)
register(PoolingAdapter(), POOLING_ROUTES)  # vLLM's; on any server (none other serves them)
register(AudioAdapter(), AUDIO_ROUTES)  # multipart requests: read by proxy/audio.py
register(LlamaCppAdapter(), (Endpoint.LLAMA_COMPLETION, Endpoint.LLAMA_INFILL))
register(OllamaAdapter(), OLLAMA_ROUTES)
register(SGLangAdapter(), [Endpoint.TGI_GENERATE], "sglang")
# Any other route (OTHER, a server not named) is read as vLLM's OpenAI routes are, as before.
_FALLBACK = _ROUTES[Endpoint.CHAT, "vllm"]


def adapter_for(endpoint: Endpoint, api: str = "vllm") -> WireAdapter:
    """The adapter that reads `endpoint` on server `api` ("vllm" or "tgi")."""
    return _ROUTES.get((endpoint, api)) or _ROUTES.get((endpoint, None)) or _FALLBACK


def usage_api(endpoint: Endpoint, api: str, sglang_messages_usage: str = "anthropic") -> str:
    """The server whose adapter reads the usage of `endpoint` on server `api`: `api` itself, but
    SGLANG_PROMPT_USAGE for SGLang's /v1/messages when `upstream.sglang_messages_usage` says
    `prompt`."""
    older = api == "sglang" and sglang_messages_usage == "prompt"
    return SGLANG_PROMPT_USAGE if older and endpoint is Endpoint.MESSAGES else api


def inspect_request(
    endpoint: Endpoint,
    body: bytes,
    *,
    inject_usage: bool,
    continuous_usage: bool = False,
    api: str = "vllm",
) -> RequestInfo:
    """Read what the request asks for. Malformed JSON is forwarded untouched, not rejected.

    `/invocations` is resolved to the route its body is dispatched to (`Endpoint.OTHER` when
    none). With `inject_usage`, a streaming chat/completions body that is a UTF-8 JSON object gets
    `include_usage` (and, with `continuous_usage`, vLLM's running totals on every chunk).
    """
    text, obj = parse(body)
    try:
        if endpoint is Endpoint.INVOCATIONS:
            endpoint = invocation_endpoint(obj, api) if isinstance(obj, dict) else Endpoint.OTHER
        if not isinstance(obj, dict):
            return RequestInfo(endpoint=endpoint, body=body, parsed=False, utf8=text is not None)
        if endpoint is Endpoint.TGI_GENERATE:
            api = generate_api(obj, api)
    except AmbiguousBody as exc:  # no route (or server) can be told for the body
        return RequestInfo(endpoint=Endpoint.OTHER, body=body, parsed=False, ambiguous=str(exc))
    info = adapter_for(endpoint, api).inspect(
        endpoint, body, text, obj, inject_usage=inject_usage, continuous_usage=continuous_usage
    )
    if api == "sglang" and endpoint is Endpoint.TGI_GENERATE:
        info.api = api  # the response is SGLang's too, whatever upstream.api says
    if twins := case_twins(obj, ("model",)):
        # Go's encoding/json (Ollama) reads `MODEL` as `model`, the last one winning: the model
        # held and priced would not be the one served
        info.ambiguous = f"the key '{twins[0]}' is 'model' in another case; send 'model' once"
    return info


def usage_from_body(
    endpoint: Endpoint,
    body: bytes,
    headers: Mapping[str, str],
    *,
    api: str = "vllm",
    sequences: int = 1,
    per_prompt: int = 1,
) -> Usage:
    """Usage of a complete response on `endpoint` of server `api`."""
    return adapter_for(endpoint, api).usage_from_body(
        endpoint, body, headers, sequences=sequences, per_prompt=per_prompt
    )


def within_request(usage: Usage, info: RequestInfo) -> Usage:
    """`usage`, or invalid usage when it counts more output than the request can have asked for
    (`RequestInfo.output_cap` times its choices): the server stops there, so more is no
    measurement (an upstream answering a duplicated `completion_tokens` of 900,000,000 to
    `max_tokens: 5` drained the global budget for everyone). Charged the hold, as any invalid
    usage; a request without a cap keeps any count under the ceiling."""
    out, cap = usage.output_tokens, info.output_cap
    if out is None or cap is None or out <= cap * info.choices:
        return usage
    return unmeasured(usage, INVALID_USAGE)


def open_stream(
    endpoint: Endpoint,
    *,
    strip_usage: bool = False,
    strip_chunk_usage: bool = False,
    choices: int = 1,
    per_prompt: int = 1,
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    fast: bool = True,
    api: str = "vllm",
) -> StreamMeter:
    """The meter for a streamed response on `endpoint` (see `SSEMeter` for the options).
    `fast=False` gives the adapter's plain reference path: what its fast path must equal."""
    return adapter_for(endpoint, api).stream(
        endpoint,
        fast=fast,
        strip_usage=strip_usage,
        strip_chunk_usage=strip_chunk_usage,
        choices=choices,
        per_prompt=per_prompt,
        max_event_bytes=max_event_bytes,
    )


def tokenize_requests(info: RequestInfo, api: str) -> list[tuple[str, bytes]] | None:
    """The upstream calls that count this request's prompt exactly as its generation did; None
    when no call can."""
    return adapter_for(info.endpoint, api).tokenize_requests(info)


def prompt_token_ids(info: RequestInfo, api: str = "vllm") -> int | None:
    """A prompt given as token ids, counted without asking anyone."""
    return adapter_for(info.endpoint, api).prompt_token_ids(info)
