"""The TGI wire: its native routes (/generate, /generate_stream, / and /vertex) and what its
OpenAI routes do differently from vLLM's (their limit fields and tokenizer routes).

Owns: which requests TGI runs to its own limit (`runs_to_max_total`), what a native request asks
for (`parameters`, stream as serde reads it), usage from native bodies and the
`x-prompt-tokens`/`x-generated-tokens` headers, usage from /generate_stream (the reference path,
and beside it the fast path for token events exactly as TGI writes them), and the /tokenize and
/chat_tokenize calls that count a prompt after a disconnect.
Never: invents a count: a stream counts its token events only because TGI sends exactly one per
generated token on /generate_stream; a count that cannot be read is None.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ..exchange import Endpoint, RequestInfo, Usage, held_output
from ..text import REASON_CHARS, USER_CHARS, clean_or_none
from . import reqsize
from .counts import (
    INVALID_USAGE,
    body_value,
    count,
    error_type,
    header_count,
    invalid,
    number,
)
from .openai import OpenAIAdapter, one_prompt
from .reqsize import body_size, prompt_chars
from .sse import Event
from .stream import SSEMeter, WireEvent, WireMeter


def runs_to_max_total(info: RequestInfo, api: str) -> bool:
    """Whether TGI serves the request and, as it sets no output limit, runs it to TGI's own:
    `max_total_tokens` less its prompt (router/src/validation.rs `validate_input`, since v3.0.0;
    `DEFAULT_GENERATION_LENGTH` only sizes each round). Every route TGI generates on hands it
    the request's limit or None: /generate, /generate_stream, / (`GenerateParameters`), each
    /vertex instance (vertex.rs), /v1/chat/completions (`ChatRequest::try_into_generate`) and
    /v1/completions (server.rs `completions`). `api`: upstream.api."""
    if held_output(info) is not None:
        return False
    if info.endpoint.is_tgi_native:
        return info.api is None  # not SGLang's /generate
    return api == "tgi" and info.endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS)


class TGIOpenAIAdapter(OpenAIAdapter):
    """TGI's OpenAI routes: read as vLLM's but for their limit fields and tokenizer routes."""

    api = "tgi"

    def tokenize_requests(self, info: RequestInfo) -> list[tuple[str, bytes]] | None:
        """TGI's /chat_tokenize takes the chat request; its completions generate from the prompt
        as given, which /tokenize counts as a generate request's `inputs`."""
        obj = body_value(info.body)
        if not isinstance(obj, dict):
            return None
        if info.endpoint is Endpoint.CHAT and isinstance(obj.get("messages"), list):
            return [("/chat_tokenize", info.body)]
        if info.endpoint is Endpoint.COMPLETIONS and (prompt := one_prompt(obj)) is not None:
            return [("/tokenize", json.dumps({"inputs": prompt}).encode())]
        return None


class TGIAdapter:
    """TGI's native routes and /vertex."""

    api = "tgi"

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
        """Read what the request asks for; nothing is ever added to a native request."""
        if endpoint is Endpoint.TGI_VERTEX:
            return _vertex_info(body, text, obj)
        params = obj.get("parameters")
        params = params if isinstance(params, dict) else {}
        limit, unreadable = reqsize.read_limit(reqsize.limit_fields(endpoint, "tgi"), params)
        info = RequestInfo(endpoint, body, True)  # by attribute, as `openai.inspect` builds it
        info.stream = _stream_flag(endpoint, obj)
        # no `info.model`: TGI's `GenerateRequest` (router/src/lib.rs) is `inputs` and
        # `parameters`, a body's `model` ignored; it serves its one model, named by its /info
        # (else upstream.model_name: Proxy), never by the client, who would name the cheapest
        info.user = clean_or_none(obj.get("user"), USER_CHARS)
        info.max_tokens = limit
        info.temperature = number(params.get("temperature"))
        info.tools = len(obj["tools"]) if isinstance(obj.get("tools"), list) else 0
        info.messages = len(obj["messages"]) if isinstance(obj.get("messages"), list) else 0
        info.prompt_chars = prompt_chars(obj)
        info.choices = _best_of(params) if endpoint in _BEST_OF else 1
        info.utf8 = text is not None
        info.text_chars, info.prompt_ids = body_size(obj)
        info.unreadable = unreadable
        info.output_cap = reqsize.output_cap(limit, obj, params)
        return info

    def usage_from_body(
        self,
        endpoint: Endpoint,
        body: bytes,
        headers: Mapping[str, str],
        *,
        sequences: int = 1,
        per_prompt: int = 1,
    ) -> Usage:
        """Usage of a complete (non-streaming) response. `sequences`: what the request's
        `choices` says it generates (on the generate routes, `best_of`)."""
        obj = body_value(body)
        if endpoint is not Endpoint.TGI_VERTEX:
            return _tgi_body_usage(obj, headers, sequences)
        # /vertex answers `{"predictions": [text, ...]}`: no token counts, no count headers
        if isinstance(obj, dict) and obj.get("error") is not None:
            return Usage(error=error_type(obj), unknown_reason="error_response")
        return Usage(unknown_reason="no_usage")

    def stream(self, endpoint: Endpoint, *, fast: bool = True, **options: Any) -> TGIStream:
        """The meter for /generate_stream; `fast` adds the token-event path (`FastTGIStream`)."""
        if fast:
            return FastTGIStream(endpoint, **options)
        return TGIStream(endpoint, fast=False, **options)

    def tokenize_requests(self, info: RequestInfo) -> list[tuple[str, bytes]] | None:
        """TGI's /tokenize takes a generate request, /chat_tokenize a chat request; /vertex asks
        once per instance."""
        obj = body_value(info.body)
        if not isinstance(obj, dict):
            return None
        if info.endpoint is Endpoint.TGI_VERTEX:
            instances = obj.get("instances")
            if not isinstance(instances, list) or not instances or len(instances) > 64:
                return None
            calls = [_tokenize(i) for i in instances]
            return None if None in calls else calls  # type: ignore[return-value]
        call = _tokenize(obj)
        return [call] if call else None

    def prompt_token_ids(self, info: RequestInfo) -> int | None:
        return None  # a native prompt is text


def _tokenize(obj: object) -> tuple[str, bytes] | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("inputs"), str):
        keep = {k: obj[k] for k in ("inputs", "parameters", "add_special_tokens") if k in obj}
        return ("/tokenize", json.dumps(keep).encode())
    if isinstance(obj.get("messages"), list):
        return ("/chat_tokenize", json.dumps(obj).encode())
    return None


def _stream_flag(endpoint: Endpoint, obj: Mapping[str, Any]) -> bool:
    if endpoint is Endpoint.TGI_GENERATE_STREAM:
        return True
    if endpoint is Endpoint.TGI_GENERATE:
        return False
    return obj.get("stream") is True  # TGI (serde) takes only a JSON boolean


def _vertex_info(body: bytes, text: str | None, obj: Mapping[str, Any]) -> RequestInfo:
    """TGI's /vertex: `instances`, each a generate request (`inputs`) or a chat request; `text`
    the body as UTF-8 (None when it is not), as for every other request."""
    given = obj.get("instances")
    instances = [i for i in given if isinstance(i, dict)] if isinstance(given, list) else []
    read = [reqsize.vertex_limit(i) for i in instances]
    limits = [limit for limit, _ in read]
    info = RequestInfo(Endpoint.TGI_VERTEX, body, True)
    # one limit for every instance (the largest): the hold multiplies it by the instances
    info.max_tokens = max(limits) if limits and None not in limits else None  # type: ignore[type-var]
    # TGI alone serves /vertex, and obeys the limits read (its answer counts no output to cap:
    # this is the unmeasured charge's limit, `Budgets.unmeasured_usd`)
    info.output_cap = info.max_tokens
    messages = [i.get("messages") for i in instances]
    info.messages = sum(len(m) for m in messages if isinstance(m, list))
    info.prompt_chars = sum(prompt_chars(i) for i in instances)
    info.n = max(1, len(instances))  # estimates multiply the limit by n, as for n choices
    info.choices = max(1, sum(_instance_sequences(i) for i in instances))
    info.utf8 = text is not None
    info.text_chars, info.prompt_ids = body_size(obj)
    info.unreadable = tuple(dict.fromkeys(k for _, bad in read for k in bad))
    return info


# TGI's non-streaming generate routes run `parameters.best_of` generations (its streams refuse
# best_of > 1) and report the count of the best one only (router/src/server.rs
# `generate_internal`): the others are generated, so held, and measured only when every one is
# in `details.best_of_sequences` (`_tgi_body_usage`).
_BEST_OF = frozenset({Endpoint.TGI_GENERATE, Endpoint.TGI_COMPAT})


def _best_of(params: Mapping[str, Any]) -> int:
    """The sequences a TGI generate request runs: `best_of` as serde reads an `Option<usize>` (a
    JSON integer; TGI refuses anything else), 1 when absent or not above 1."""
    value = params.get("best_of")
    return value if type(value) is int and value > 1 else 1


def _instance_sequences(instance: Mapping[str, Any]) -> int:
    """The sequences one /vertex instance runs: a generate instance's best_of, else 1."""
    params = instance.get("parameters")
    if isinstance(instance.get("inputs"), str) and isinstance(params, dict):
        return _best_of(params)
    return 1


def _tgi_body_usage(obj: object, headers: Mapping[str, str], sequences: int = 1) -> Usage:
    if isinstance(obj, list) and obj and isinstance(obj[0], dict):
        obj = obj[0]  # the compat route wraps one response in a list
    details = obj.get("details") if isinstance(obj, dict) else None
    details = details if isinstance(details, dict) else {}
    if isinstance(obj, dict) and "error" in obj and "generated_text" not in obj:
        return Usage(error=error_type(obj), unknown_reason="error_response")
    raw = (
        headers.get("x-prompt-tokens"),
        headers.get("x-generated-tokens"),
        details.get("generated_tokens"),
    )
    inp, out, generated = header_count(raw[0]), header_count(raw[1]), count(raw[2])
    reason = clean_or_none(details.get("finish_reason"), REASON_CHARS)
    reasons = (reason,) if reason else ()
    if any(invalid(v, n) for v, n in zip(raw, (inp, out, generated), strict=True)):
        return Usage(finish_reasons=reasons, unknown_reason=INVALID_USAGE)
    if out is None:
        out = generated
    if inp is None and isinstance(details.get("prefill"), list) and details["prefill"]:
        inp = count(len(details["prefill"]))
    if sequences > 1 and out is not None:
        out = _with_best_of(out, details.get("best_of_sequences"), sequences - 1)
        if out is None:
            return Usage(
                input_tokens=inp, finish_reasons=reasons, unknown_reason="best_of_unreported"
            )
    return Usage(
        input_tokens=inp,
        output_tokens=out,
        finish_reasons=reasons,
        unknown_reason=None if inp is not None and out is not None else "no_usage",
    )


def _with_best_of(best: int, others: object, expected: int) -> int | None:
    """The best sequence's count plus every other sequence's (`details.best_of_sequences`), or None
    unless exactly `expected` others are reported, each with a valid count."""
    if not isinstance(others, list) or len(others) != expected:
        return None
    total = best
    for seq in others:
        n = count(seq.get("generated_tokens")) if isinstance(seq, dict) else None
        if n is None:  # absent, or no count we can use (docs/budgets.md, Numbers)
            return None
        total += n
    return count(total)


# --- streams --------------------------------------------------------------------------------------


class TGIStream(SSEMeter):
    """/generate_stream, the reference path: every event SSE-parsed, decoded and read. One event
    per generated token; the last carries `generated_text` and `details`."""

    def __init__(self, endpoint: Endpoint, **options: Any) -> None:
        super().__init__(endpoint, **options)
        self._details: Mapping[str, Any] | None = None
        self._details_skips = 0  # the events over the limit before the details were read

    def _read(self, ev: Event, obj: Mapping[str, Any]) -> bool:
        if isinstance(obj.get("token"), dict):
            self._s.token_events += 1
        details = obj.get("details")
        if isinstance(details, dict):
            self._details = details
            self._details_skips = self._skips
            if (r := clean_or_none(details.get("finish_reason"), REASON_CHARS)) is not None:
                self._s.finish[0] = r
        if obj.get("generated_text") is not None:
            self.done = True
        return False

    def _read_after_skips(self) -> bool:
        # the last event's details are the request's counts, when they hold the output's: the
        # token events counted instead may have been joined by one not read
        details = self._details
        if details is None or details.get("generated_tokens") is None:
            return False
        return self._details_skips == self._skips

    def _counted_usage(self) -> Usage:
        base = self._base()
        details = self._details or {}
        raw_out, raw_in = details.get("generated_tokens"), details.get("input_length")
        out, inp = count(raw_out), count(raw_in)
        if invalid(raw_out, out) or invalid(raw_in, inp):
            return replace(base, unknown_reason=INVALID_USAGE)
        if out is not None and out < self._s.token_events:
            # TGI's /generate_stream sends one event per generated token ("Yield event for
            # every new token", server.rs `generate_stream_internal`): fewer counted than the
            # token events read is a broken count (charged as unmeasured: a token an event)
            return replace(base, unknown_reason=INVALID_USAGE)
        if out is None and self._s.token_events:
            # TGI's /generate_stream sends exactly one event per generated token.
            out = count(self._s.token_events)
        if out is None:  # no token event at all: not a stream of the shape we count
            reason: str | None = "no_token_events"
        else:
            reason = None if inp is not None else "no_input_length"
        return replace(base, input_tokens=inp, output_tokens=out, unknown_reason=reason)


class FastTGIStream(WireMeter, TGIStream):
    """`TGIStream`, with token events exactly as TGI writes them counted on the bytes."""

    def feed(self, chunk: bytes) -> bytes:
        return chunk if self.passthrough else self._feed_wire(chunk)

    def _wire_at(self, chunk: bytes, pos: int) -> WireEvent | None:
        """A token event at `pos` (`_TGI_WIRE`), or None."""
        m = _TGI_WIRE.match(chunk, pos)
        return (m.end(), True, -1) if m is not None else None

    def _wire_event(self, data: bytes, found: WireEvent) -> bool:
        self._s.token_events += 1  # all that `_read` does with it
        return False

    def _on_event(self, ev: Event) -> bool:
        if ev.data is not None and TGI_TOKEN_EVENT.fullmatch(ev.data):
            self._s.token_events += 1
            return False
        return super()._on_event(ev)


# The fast path for TGI's /generate_stream: a token event that is not the last, exactly as TGI
# writes it (serde, compact, fields in this order, no top_tokens). Relies on the pattern
# admitting only valid JSON: plain or correctly escaped text, JSON numbers, ASCII digits, and no
# integer of more than 18 digits (`json.loads` refuses one of over 4300: such an event counts
# nothing on the general path). Such an event decodes to a dict with a `token` object, null
# `generated_text` and `details`, and no `error`: `TGIStream._read` only counts it.
TGI_TOKEN_EVENT = re.compile(
    r'\{"index":(?:0|[1-9][0-9]{0,17}),"token":\{"id":(?:0|[1-9][0-9]{0,17}),'
    r'"text":"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*",'
    r'"logprob":(?:-?(?:0|[1-9][0-9]{0,17})(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|null),'
    r'"special":(?:true|false)\},"generated_text":null,"details":null\}'
)


# `TGI_TOKEN_EVENT` as a whole SSE event on the wire (read with "replace", a byte outside ASCII
# is a character the pattern admits, and never makes a quote, backslash or control character).
_TGI_WIRE = re.compile(rb"data: ?" + TGI_TOKEN_EVENT.pattern.encode("ascii") + rb"\n\n")
