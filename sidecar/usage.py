"""Token usage, read exactly from the wire of vLLM and TGI.

Owns: which routes are metered, what a request asks for (model, stream, user, max tokens), the one
change we make to a request (`stream_options.include_usage` on streams that did not ask), reading
`usage` from response bodies, headers and streams, and dropping the usage chunk we caused.
Never: counts stream chunks as tokens on OpenAI routes, invents a count, or touches clocks, sockets
and metrics. A count that cannot be read is None, with the reason in `Usage.unknown_reason`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from .sse import Event, SSEParser


class Endpoint(StrEnum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    EMBEDDINGS = "/v1/embeddings"
    RESPONSES = "/v1/responses"
    TGI_GENERATE = "/generate"
    TGI_GENERATE_STREAM = "/generate_stream"
    TGI_COMPAT = "/"

    @property
    def is_tgi_native(self) -> bool:
        return self in (Endpoint.TGI_GENERATE, Endpoint.TGI_GENERATE_STREAM, Endpoint.TGI_COMPAT)

    @property
    def operation(self) -> str:
        """The GenAI `gen_ai.operation.name` for this route."""
        if self in (Endpoint.CHAT, Endpoint.RESPONSES):
            return "chat"
        if self is Endpoint.EMBEDDINGS:
            return "embeddings"
        return "text_completion"


_ROUTES = {e.value: e for e in Endpoint}
_INJECTABLE = (Endpoint.CHAT, Endpoint.COMPLETIONS)


def classify(method: str, path: str) -> Endpoint | None:
    """The metered route for a request, or None for anything that is only forwarded."""
    if method != "POST":
        return None
    if len(path) > 1:
        path = path.rstrip("/")
    return _ROUTES.get(path)


@dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_input_tokens: int | None = None
    model: str | None = None
    response_id: str | None = None
    finish_reasons: tuple[str, ...] = ()
    error: str | None = None  # error type reported by the upstream (in a body or inside a stream)
    unknown_reason: str | None = None  # why a count is None


@dataclass(frozen=True, slots=True)
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


# --- requests -------------------------------------------------------------------------------------


def inspect_request(endpoint: Endpoint, body: bytes, *, inject_usage: bool) -> RequestInfo:
    """Read what the request asks for. Malformed JSON is forwarded untouched, not rejected."""
    try:
        obj = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        obj = None
    if not isinstance(obj, dict):
        return RequestInfo(endpoint=endpoint, body=body, parsed=False)
    params = obj.get("parameters") if endpoint.is_tgi_native else obj
    params = params if isinstance(params, dict) else {}
    info = RequestInfo(
        endpoint=endpoint,
        body=body,
        parsed=True,
        stream=_stream_flag(endpoint, obj),
        model=_str(obj.get("model")),
        user=_str(obj.get("user")),
        max_tokens=_max_tokens(endpoint, obj, params),
        temperature=_num(params.get("temperature")),
        n=_int(params.get("n")) if not endpoint.is_tgi_native else None,
        tools=len(obj["tools"]) if isinstance(obj.get("tools"), list) else 0,
        messages=len(obj["messages"]) if isinstance(obj.get("messages"), list) else 0,
        prompt_chars=prompt_chars(obj),
    )
    if inject_usage and info.stream and endpoint in _INJECTABLE and _wants_injection(obj):
        info = replace(info, body=_inject_include_usage(body, obj), injected_usage=True)
    return info


def _stream_flag(endpoint: Endpoint, obj: Mapping[str, Any]) -> bool:
    if endpoint is Endpoint.TGI_GENERATE_STREAM:
        return True
    if endpoint is Endpoint.TGI_GENERATE or endpoint is Endpoint.EMBEDDINGS:
        return False
    return obj.get("stream") is True


def _max_tokens(
    endpoint: Endpoint, obj: Mapping[str, Any], params: Mapping[str, Any]
) -> int | None:
    if endpoint.is_tgi_native:
        return _int(params.get("max_new_tokens"))
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        if (v := _int(obj.get(key))) is not None:
            return v
    return None


def _wants_injection(obj: Mapping[str, Any]) -> bool:
    opts = obj.get("stream_options")
    return not (isinstance(opts, dict) and opts.get("include_usage") is True)


def _inject_include_usage(body: bytes, obj: dict[str, Any]) -> bytes:
    """Add include_usage, changing as few bytes as possible.

    Without an existing `stream_options` the member is spliced in after the opening brace, so every
    other byte of the client's body is preserved. Otherwise the object is re-serialised.
    """
    if "stream_options" not in obj:
        start = body.index(b"{") + 1
        rest = body[start:].lstrip()
        sep = b"" if rest.startswith(b"}") else b","
        return body[:start] + b'"stream_options":{"include_usage":true}' + sep + body[start:]
    opts = obj["stream_options"] if isinstance(obj["stream_options"], dict) else {}
    merged = {**obj, "stream_options": {**opts, "include_usage": True}}
    return json.dumps(merged, ensure_ascii=False, separators=(",", ":")).encode()


def prompt_chars(obj: Mapping[str, Any]) -> int:
    """Characters of prompt text in a request (for admission estimates and audit sizes only)."""
    total = 0
    for key in ("prompt", "inputs", "input"):
        total += _text_len(obj.get(key))
    messages = obj.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict):
                total += _text_len(m.get("content"))
    return total


def _text_len(value: object) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_text_len(v.get("text") if isinstance(v, dict) else v) for v in value)
    return 0


# --- non-streaming responses ----------------------------------------------------------------------


def usage_from_body(endpoint: Endpoint, body: bytes, headers: Mapping[str, str]) -> Usage:
    """Usage of a complete (non-streaming) response."""
    try:
        obj = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        obj = None
    if endpoint.is_tgi_native:
        return _tgi_body_usage(obj, headers)
    if not isinstance(obj, dict):
        return Usage(unknown_reason="unparseable_response")
    if "error" in obj and "choices" not in obj:
        return Usage(error=error_type(obj), unknown_reason="error_response")
    usage = obj.get("usage")
    model = _str(obj.get("model"))
    rid = _str(obj.get("id"))
    reasons = _finish_reasons(obj)
    if endpoint is Endpoint.RESPONSES:
        reasons = (s,) if (s := _str(obj.get("status"))) else ()
    if not isinstance(usage, dict):
        return Usage(
            model=model, response_id=rid, finish_reasons=reasons, unknown_reason="no_usage"
        )
    return replace(
        read_usage(usage, endpoint), model=model, response_id=rid, finish_reasons=reasons
    )


def _tgi_body_usage(obj: object, headers: Mapping[str, str]) -> Usage:
    if isinstance(obj, list) and obj and isinstance(obj[0], dict):
        obj = obj[0]  # the compat route wraps one response in a list
    details = obj.get("details") if isinstance(obj, dict) else None
    details = details if isinstance(details, dict) else {}
    if isinstance(obj, dict) and "error" in obj and "generated_text" not in obj:
        return Usage(error=error_type(obj), unknown_reason="error_response")
    inp = _int(headers.get("x-prompt-tokens"))
    out = _int(headers.get("x-generated-tokens"))
    if out is None:
        out = _int(details.get("generated_tokens"))
    if inp is None and isinstance(details.get("prefill"), list) and details["prefill"]:
        inp = len(details["prefill"])
    reason = _str(details.get("finish_reason"))
    return Usage(
        input_tokens=inp,
        output_tokens=out,
        finish_reasons=(reason,) if reason else (),
        unknown_reason=None if inp is not None and out is not None else "no_usage",
    )


def read_usage(usage: Mapping[str, Any], endpoint: Endpoint) -> Usage:
    """An OpenAI-style `usage` object (chat/completions/embeddings or the Responses API's)."""
    if endpoint is Endpoint.RESPONSES:
        inp, out = _int(usage.get("input_tokens")), _int(usage.get("output_tokens"))
        details = usage.get("input_tokens_details")
    else:
        inp, out = _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details")
        if out is None and endpoint is Endpoint.EMBEDDINGS and inp is not None:
            out = 0  # embeddings generate nothing: zero is what happened, not a guess
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
    missing = inp is None or out is None
    return Usage(
        input_tokens=inp,
        output_tokens=out,
        cached_input_tokens=cached,
        unknown_reason="incomplete_usage" if missing else None,
    )


def _finish_reasons(obj: Mapping[str, Any]) -> tuple[str, ...]:
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return ()
    return tuple(r for c in choices if isinstance(c, dict) and (r := _str(c.get("finish_reason"))))


def error_type(obj: Mapping[str, Any]) -> str:
    """The error type of a vLLM (`{"error": {...}}`) or TGI (`{"error", "error_type"}`) body."""
    err = obj.get("error")
    if isinstance(err, dict):
        return str(err.get("type") or err.get("code") or "error")[:64]
    return str(obj.get("error_type") or "error")[:64]


# --- streaming responses --------------------------------------------------------------------------


@dataclass(slots=True)
class _StreamState:
    model: str | None = None
    response_id: str | None = None
    error: str | None = None
    token_events: int = 0
    finish: dict[int, str] = field(default_factory=dict)


class StreamMeter:
    """Feed the upstream's bytes; get back the bytes for the client and the count of token events.

    When `strip_usage` is set (we injected include_usage), whole events are forwarded except the
    usage-only chunk (`choices: []`); otherwise the bytes pass through unchanged as they arrive.
    """

    def __init__(self, endpoint: Endpoint, *, strip_usage: bool = False) -> None:
        self.endpoint = endpoint
        self._strip = strip_usage
        self._parser = SSEParser(keep_raw=strip_usage)  # raw bytes only needed to strip
        self._s = _StreamState()
        self._final_usage: list[Mapping[str, Any]] = []  # usage-only chunks: request totals
        self._choice_usage: dict[int, Mapping[str, Any]] = {}  # usage riding on a choice (TGI)
        self._tgi_tokens = 0
        self._tgi_details: Mapping[str, Any] | None = None
        self.done = False  # saw [DONE], a final TGI event or a terminal Responses event
        self.passthrough = False  # set after an accounting failure: forward, stop parsing
        openai = not (endpoint.is_tgi_native or endpoint is Endpoint.RESPONSES)
        self._shape = _TokenShape() if openai else None  # the fast path for text-only chunks

    @property
    def token_events(self) -> int:
        return self._s.token_events

    def feed(self, chunk: bytes) -> bytes:
        if self.passthrough:
            return chunk
        held = self._parser.pending
        events = self._parser.feed(chunk)
        if not self._strip:
            for ev in events:
                self._on_event(ev)
            return chunk
        kept = [ev.raw for ev in events if not self._on_event(ev)]
        if len(kept) == len(events) and not held and not self._parser.pending:
            return chunk  # nothing dropped, and this chunk's events are exactly the chunk
        return b"".join(kept)

    def finish(self) -> tuple[bytes, Usage]:
        """The upstream stream ended. Returns bytes still held (an unterminated event) and usage."""
        tail = self._parser.finish()
        return (tail if self._strip else b""), self._usage()

    # Returns True when the event must not reach the client.
    def _on_event(self, ev: Event) -> bool:
        if ev.data is None:
            return False
        if self._shape is not None and (carries := self._shape.carries(ev.data)) is not None:
            self._s.token_events += carries
            return False
        if self.endpoint.is_tgi_native and _TGI_TOKEN_EVENT.fullmatch(ev.data):
            self._tgi_tokens += 1  # all that `_tgi_event` does with it
            self._s.token_events += 1
            return False
        if ev.data == "[DONE]":
            self.done = True
            return False
        try:
            obj = json.loads(ev.data)
        except ValueError:
            return False
        if not isinstance(obj, dict):
            return False
        if "error" in obj and obj.get("error") is not None:
            self._s.error = error_type(obj)
        if self.endpoint is Endpoint.RESPONSES:
            self._responses_event(obj)
            return False
        if self.endpoint.is_tgi_native:
            self._tgi_event(obj)
            return False
        if self._shape is not None:
            self._shape.learn(ev.data, obj)
        return self._openai_chunk(obj)

    def _openai_chunk(self, obj: Mapping[str, Any]) -> bool:
        s = self._s
        s.model = s.model or _str(obj.get("model"))
        s.response_id = s.response_id or _str(obj.get("id"))
        choices = obj.get("choices")
        usage = obj.get("usage")
        if isinstance(choices, list) and choices:
            if any(_carries_output(c) for c in choices):
                s.token_events += 1
            for c in choices:
                if isinstance(c, dict) and (r := _str(c.get("finish_reason"))):
                    s.finish[_int(c.get("index")) or 0] = r
            if isinstance(usage, dict):
                first = choices[0] if isinstance(choices[0], dict) else {}
                self._choice_usage[_int(first.get("index")) or 0] = usage
            return False
        if isinstance(usage, dict) and isinstance(choices, list):
            self._final_usage.append(usage)
            return self._strip
        return False

    def _responses_event(self, obj: Mapping[str, Any]) -> None:
        kind = _str(obj.get("type")) or ""
        if kind.endswith(".delta"):
            self._s.token_events += 1
        response = obj.get("response")
        if not isinstance(response, dict):
            return
        self._s.model = self._s.model or _str(response.get("model"))
        self._s.response_id = self._s.response_id or _str(response.get("id"))
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            self.done = True
            if (status := _str(response.get("status"))) is not None:
                self._s.finish[0] = status
            if isinstance(response.get("usage"), dict):
                self._final_usage.append(response["usage"])
            if kind == "response.failed":
                self._s.error = self._s.error or "response.failed"

    def _tgi_event(self, obj: Mapping[str, Any]) -> None:
        if isinstance(obj.get("token"), dict):
            self._tgi_tokens += 1
            self._s.token_events += 1
        details = obj.get("details")
        if isinstance(details, dict):
            self._tgi_details = details
            if (r := _str(details.get("finish_reason"))) is not None:
                self._s.finish[0] = r
        if obj.get("generated_text") is not None:
            self.done = True

    def _usage(self) -> Usage:
        s = self._s
        base = Usage(
            model=s.model,
            response_id=s.response_id,
            finish_reasons=tuple(s.finish[k] for k in sorted(s.finish)),
            error=s.error,
        )
        if self.endpoint.is_tgi_native:
            return self._tgi_usage(base)
        totals = self._final_usage or list(self._choice_usage.values())
        if not totals:
            return replace(base, unknown_reason="stream_without_usage")
        parts = [read_usage(u, self.endpoint) for u in totals]
        return replace(
            base,
            input_tokens=_sum(p.input_tokens for p in parts),
            output_tokens=_sum(p.output_tokens for p in parts),
            cached_input_tokens=_sum_present(p.cached_input_tokens for p in parts),
            unknown_reason=next((p.unknown_reason for p in parts if p.unknown_reason), None),
        )

    def _tgi_usage(self, base: Usage) -> Usage:
        details = self._tgi_details or {}
        out = _int(details.get("generated_tokens"))
        if out is None:
            # TGI's /generate_stream sends exactly one event per generated token.
            out = self._tgi_tokens
        inp = _int(details.get("input_length"))
        return replace(
            base,
            input_tokens=inp,
            output_tokens=out,
            unknown_reason=None if inp is not None else "no_input_length",
        )


class _TokenShape:
    """The fast path of `StreamMeter._on_event` for the commonest event on OpenAI routes: a chunk
    with one choice whose text is the only thing in it that changes.

    Relies on: a server writing those chunks with the same bytes around the text (vLLM and TGI
    do: same id, created, model, key order; only the token's text differs), and on
    `_openai_chunk` reading from a chunk only the model, id, error, usage, finish reasons and
    whether a choice carries output. The shape is learnt from a decoded chunk that sets nothing
    but the token count: its bytes before and after the text, confirmed by decoding it once more
    with other text in the slot. A later chunk with that prefix and suffix whose text has no
    quote, backslash or control character tokenises exactly like the learnt one, so it decodes
    to the same object but for the text: the meter's only change is a token event when the text
    is not empty. Every other event is decoded.
    """

    __slots__ = ("prefix", "suffix", "tries")

    def __init__(self) -> None:
        self.prefix = self.suffix = ""
        self.tries = _SHAPE_TRIES  # a failed learning costs a decode: stop on streams that vary

    def carries(self, data: str) -> bool | None:
        """Does this chunk of the learnt shape carry output? None: not that shape, decode it."""
        p, s = self.prefix, self.suffix
        if not p or len(data) < len(p) + len(s) or not data.startswith(p):
            return None
        if not data.endswith(s) or not _plain(text := data[len(p) : len(data) - len(s)]):
            return None
        self.tries = _SHAPE_TRIES
        return text != ""

    def learn(self, data: str, obj: Mapping[str, Any]) -> None:
        if self.tries <= 0 or (found := _text_slot(obj)) is None:
            return
        key, text = found
        at = data.find(marker := f'"{key}":"')
        if at < 0:
            at = data.find(marker := f'"{key}": "')
        start = at + len(marker)
        end = start + len(text)
        if at < 0 or data[start:end] != text or data[end : end + 1] != '"':
            return
        self.tries -= 1
        if _is_the_slot(data[:start], data[end:], key, text):
            self.prefix, self.suffix = data[:start], data[end:]


_SHAPE_TRIES = 8

# The fast path for TGI's /generate_stream: a token event that is not the last, exactly as TGI
# writes it (serde, compact, fields in this order, no top_tokens). Relies on the pattern
# admitting only valid JSON: plain or correctly escaped text, JSON numbers, ASCII digits. Such an
# event decodes to a dict with a `token` object, null `generated_text` and `details`, and no
# `error`: `_tgi_event` only counts it.
_TGI_TOKEN_EVENT = re.compile(
    r'\{"index":(?:0|[1-9][0-9]*),"token":\{"id":(?:0|[1-9][0-9]*),'
    r'"text":"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*",'
    r'"logprob":(?:-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|null),'
    r'"special":(?:true|false)\},"generated_text":null,"details":null\}'
)


def _plain(text: str) -> bool:
    """Text a JSON string holds as it is: no quote, backslash or control character."""
    return '"' not in text and "\\" not in text and text.isprintable()


def _text_slot(obj: Mapping[str, Any]) -> tuple[str, str] | None:
    """("content" or "text", the text) of a chunk whose only effect is a token event, else None."""
    choices = obj.get("choices")
    if obj.get("error") is not None or isinstance(obj.get("usage"), dict):
        return None
    if not (isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict)):
        return None
    choice = choices[0]
    if _str(choice.get("finish_reason")) is not None:
        return None
    delta = choice.get("delta")
    if isinstance(delta, dict):
        if any(delta.get(k) for k in _DELTA_OUTPUT if k != "content"):
            return None
        key, text = "content", delta.get("content")
    else:
        key, text = "text", choice.get("text")
    return (key, text) if isinstance(text, str) and _plain(text) else None


def _is_the_slot(prefix: str, suffix: str, key: str, text: str) -> bool:
    """Other text between `prefix` and `suffix` lands in the choice's text slot.

    The span is a whole JSON string (it follows `":"`, holds plain text and ends at a quote),
    so other plain text there changes that one string of the decoded chunk and nothing else.
    """
    other = "y" if text == "x" else "x"
    try:
        choice = json.loads(prefix + other + suffix)["choices"][0]
        return bool((choice["delta"] if key == "content" else choice)[key] == other)
    except (ValueError, LookupError, TypeError):
        return False


_DELTA_OUTPUT = (
    "content",
    "reasoning_content",
    "reasoning",
    "tool_calls",
    "function_call",
    "refusal",
)


def _carries_output(choice: object) -> bool:
    """Does this chunk carry generated output? vLLM's first chat chunk (the role, empty content)
    is sent before prefill finishes, so it must not count as the first token."""
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return any(delta.get(k) for k in _DELTA_OUTPUT)
    return bool(choice.get("text"))


# --- small readers --------------------------------------------------------------------------------


def _int(v: object) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v if v >= 0 else None
    if isinstance(v, str) and v.isdigit():
        return int(v)
    return None


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _str(v: object) -> str | None:
    return v if isinstance(v, str) and v else None


def _sum(values: Any) -> int | None:
    total = 0
    for v in values:
        if v is None:
            return None
        total += v
    return total


def _sum_present(values: Any) -> int | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None
