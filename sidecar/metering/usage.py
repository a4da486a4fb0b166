"""Token usage, read exactly from the wire of vLLM and TGI.

Owns: what a request asks for (model, stream as each server reads it, user, max tokens), the one
change we make to a request (`stream_options.include_usage`, and vLLM's running totals, spliced
into UTF-8 JSON objects only), reading `usage` from response bodies, headers and streams, and
removing from a stream exactly the usage we caused (the usage chunk, per-chunk running totals).
Routes and paths are `routes.py`'s.
Never: counts stream chunks as tokens on OpenAI routes, invents a count, or touches clocks, sockets
and metrics. A count that cannot be read is None, with the reason in `Usage.unknown_reason`.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..exchange import Endpoint, RequestInfo, Usage
from ..text import ID_CHARS, MODEL_CHARS, REASON_CHARS, USER_CHARS, clean, clean_or_none
from . import reqsize, splice
from .dispatch import AmbiguousBody, invocation_endpoint
from .reqsize import body_size as body_size
from .reqsize import lax_int as lax_int
from .sse import DEFAULT_MAX_EVENT_BYTES, Event, SSEParser

_INJECTABLE = (Endpoint.CHAT, Endpoint.COMPLETIONS)

# The largest token count read from an upstream, for any one count of one request and for a
# stream's totals: 1,000 times the longest context any server offers, and small enough that a
# count times any price stays a finite float and an exact micro-dollar amount (budget.MAX_MICROS).
# A count above it, negative, fractional, boolean or not a number is invalid usage: the usage of
# that response is unknown (INVALID_USAGE), charged its hold, never an exception (docs/budgets.md).
MAX_TOKEN_COUNT = 10**9
INVALID_USAGE = "invalid_usage"


# --- requests -------------------------------------------------------------------------------------


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
    text, obj = _parse(body)
    if endpoint is Endpoint.INVOCATIONS:
        try:
            endpoint = invocation_endpoint(obj, api) if isinstance(obj, dict) else Endpoint.OTHER
        except AmbiguousBody as exc:
            return RequestInfo(endpoint=Endpoint.OTHER, body=body, parsed=False, ambiguous=str(exc))
    if not isinstance(obj, dict):
        return RequestInfo(endpoint=endpoint, body=body, parsed=False, utf8=text is not None)
    if endpoint is Endpoint.TGI_VERTEX:
        return _vertex_info(body, obj)
    params = obj.get("parameters") if endpoint.is_tgi_native else obj
    params = params if isinstance(params, dict) else {}
    max_tokens, n, unreadable = _limits(endpoint, obj, params, api)
    text_chars, prompt_ids = body_size(obj)
    stream = _stream_flag(endpoint, obj)
    injected = None
    if inject_usage and stream and endpoint in _INJECTABLE and text is not None:
        injected = _with_usage_requested(text, obj, continuous_usage)
    sent, injected_usage, strip_chunk_usage = injected or (body, False, False)
    return RequestInfo(
        endpoint=endpoint,
        body=sent,
        parsed=True,
        stream=stream,
        injected_usage=injected_usage,
        strip_chunk_usage=strip_chunk_usage,
        model=clean_or_none(obj.get("model"), MODEL_CHARS),
        user=clean_or_none(obj.get("user"), USER_CHARS),
        max_tokens=max_tokens,
        temperature=_num(params.get("temperature")),
        n=n,
        tools=len(obj["tools"]) if isinstance(obj.get("tools"), list) else 0,
        messages=len(obj["messages"]) if isinstance(obj.get("messages"), list) else 0,
        prompt_chars=prompt_chars(obj),
        choices=_best_of(params)
        if endpoint in _BEST_OF
        else max(1, n or 1) * _prompts(endpoint, obj),
        utf8=text is not None,
        text_chars=text_chars,
        prompt_ids=prompt_ids,
        unreadable=unreadable,
        output_cap=reqsize.output_cap(max_tokens, obj, params),
    )


def loads(data: bytes, text: str | None = None) -> Any:
    """`json.loads(data)`: the value the server reads (vLLM parses bodies with json.loads).
    `text`, when given, is `data` decoded as UTF-8 (strict).

    Read from text where that is the same: `json.loads` of bytes first guesses the encoding (in
    Python, about a third of the time it takes for a small body), then decodes. Its guess is UTF-8
    unless the bytes open with a BOM or have a NUL in their first four; a BOM's bytes (but UTF-8's)
    are never valid UTF-8, and text that is valid UTF-8 decodes as strictly as with its
    `surrogatepass`. Anything else is read from the bytes.

    Not orjson: it caches object keys of up to 64 bytes by their XXH3-64 alone and never compares
    the text. A key one client sends (a 64-byte twin of "usage" took 45 s to find on two cores)
    is then returned for every later key with that hash, in every body, of every client
    (`test_loads_reads_each_key_as_it_is_written_whatever_was_read_before`).
    """
    if not _read_as_utf8(data):
        return json.loads(data)
    if text is None:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return json.loads(data)
    return json.loads(text)


def _read_as_utf8(data: bytes) -> bool:
    """Does `json.loads(data)` read the bytes as UTF-8? Not when they open with a BOM, nor with a
    NUL in their first four (it reads those as UTF-16 or UTF-32)."""
    return not data.startswith(b"\xef\xbb\xbf") and b"\0" not in data[:4]


def _parse(body: bytes) -> tuple[str | None, object]:
    """(the body as UTF-8 text or None, the parsed JSON or None).

    A body in another encoding is still read (the server reads UTF-16 and UTF-32 JSON too), but
    its text is None so it is never changed.
    """
    text: str | None = None
    if _read_as_utf8(body):  # else a BOM or UTF-16/32 (ASCII in those is valid UTF-8 too)
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:  # not contextlib.suppress: a context manager per request
            text = None
    try:  # as the server parses the bytes (`loads`), from the text where that is the same
        obj = (json.loads(body) if text is None else json.loads(text)) if body else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        obj = None
    return text, obj


def _vertex_info(body: bytes, obj: Mapping[str, Any]) -> RequestInfo:
    """TGI's /vertex: `instances`, each a generate request (`inputs`) or a chat request."""
    given = obj.get("instances")
    instances = [i for i in given if isinstance(i, dict)] if isinstance(given, list) else []
    read = [reqsize.vertex_limit(i) for i in instances]
    limits = [limit for limit, _ in read]
    text_chars, prompt_ids = body_size(obj)
    return RequestInfo(
        endpoint=Endpoint.TGI_VERTEX,
        body=body,
        parsed=True,
        # one limit for every instance (the largest): the hold multiplies it by the instances
        max_tokens=max(limits) if limits and None not in limits else None,  # type: ignore[type-var]
        messages=sum(len(i["messages"]) for i in instances if isinstance(i.get("messages"), list)),
        prompt_chars=sum(prompt_chars(i) for i in instances),
        n=max(1, len(instances)),  # estimates multiply the limit by n, as for n choices
        choices=max(1, sum(_instance_sequences(i) for i in instances)),
        text_chars=text_chars,
        prompt_ids=prompt_ids,
        unreadable=tuple(dict.fromkeys(k for _, bad in read for k in bad)),
    )


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


def _prompts(endpoint: Endpoint, obj: Mapping[str, Any]) -> int:
    """A completion's prompt list gives one choice per prompt (times n); a token-id list is one."""
    prompt = obj.get("prompt")
    if endpoint is Endpoint.COMPLETIONS and isinstance(prompt, list) and prompt:
        return 1 if isinstance(prompt[0], int) else len(prompt)
    return 1


_TRUE_STRINGS = frozenset({"1", "on", "t", "true", "y", "yes"})


def lax_true(value: object) -> bool:
    """True as vLLM's request models read a boolean (pydantic's lax mode): `true`, `1`, `1.0`, or
    one of "1", "on", "t", "true", "y", "yes" in any case. Anything else is false or refused."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return value == 1
    return isinstance(value, str) and value.lower() in _TRUE_STRINGS


def _stream_flag(endpoint: Endpoint, obj: Mapping[str, Any]) -> bool:
    if endpoint is Endpoint.TGI_GENERATE_STREAM:
        return True
    if endpoint in (Endpoint.TGI_GENERATE, Endpoint.EMBEDDINGS, Endpoint.TGI_VERTEX):
        return False
    if endpoint.is_tgi_native:
        return obj.get("stream") is True  # TGI (serde) takes only a JSON boolean
    return lax_true(obj.get("stream"))


def _limits(
    endpoint: Endpoint, obj: Mapping[str, Any], params: Mapping[str, Any], api: str
) -> tuple[int | None, int | None, tuple[str, ...]]:
    """(the output limit as the route's server reads it, n, the limits present that are no
    integer the server would read). Only the fields that route reads (`reqsize.limit_fields`)."""
    limit, unreadable = reqsize.read_limit(reqsize.limit_fields(endpoint, api), params)
    if endpoint.is_tgi_native:
        return limit, None, unreadable
    n = obj.get("n")
    read_n = n if n is None or type(n) is int else lax_int(n)
    if n is not None and read_n is None:
        unreadable += ("n",)
    return limit, reqsize.positive(read_n), unreadable


def _with_usage_requested(
    text: str, obj: Mapping[str, Any], continuous: bool
) -> tuple[bytes, bool, bool] | None:
    """Ask for the usage the client did not, by splicing bytes; never by re-serialising.

    Returns (the body to send, injected_usage, strip_chunk_usage), or None to send it as it is.
    """
    opts = obj.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        return None  # the server refuses it anyway: forward untouched
    opts = opts or {}
    asked_usage = lax_true(opts.get("include_usage"))
    asked_running = lax_true(opts.get("continuous_usage_stats"))
    want_running = continuous or asked_running
    if asked_usage and (asked_running or not continuous):
        return None  # the client asked for everything we would add
    body = _splice_stream_options(text, obj, want_running)
    if body is None:
        return None
    # the server now sends per-chunk usage; the client would have seen it only if it asked for
    # both (vLLM sends running totals only together with include_usage)
    return (
        body.encode("utf-8"),
        not asked_usage,
        want_running and not (asked_usage and asked_running),
    )


def _splice_stream_options(text: str, obj: Mapping[str, Any], running: bool) -> str | None:
    """`text` with stream_options.include_usage (and continuous_usage_stats) set to true."""
    wanted = '"include_usage":true' + (',"continuous_usage_stats":true' if running else "")
    if "stream_options" not in obj:  # no member decodes to that key: the usual case, no scan
        return splice.insert_first(text, text.index("{"), '"stream_options":{' + wanted + "}")
    top = splice.members(text)
    if top is None:
        return None
    current = splice.last(top, "stream_options")
    if current is None:
        brace = text.index("{")
        return splice.insert_first(text, brace, '"stream_options":{' + wanted + "}")
    if obj["stream_options"] is None:
        span = (current.value_start, current.value_end, "{" + wanted + "}")
        return splice.apply(text, [span])
    inner = splice.members(text, current.value_start)
    if inner is None:
        return None
    edits: list[tuple[int, int, str]] = []
    added: list[str] = []
    keys = ("include_usage", "continuous_usage_stats") if running else ("include_usage",)
    for key in keys:
        m = splice.last(inner, key)
        if m is None:
            added.append(f'"{key}":true')
        elif not lax_true(obj["stream_options"].get(key)):
            edits.append((m.value_start, m.value_end, "true"))
    text = splice.apply(text, edits)  # value edits lie after the object's `{`: it does not move
    if added:
        text = splice.insert_first(text, current.value_start, ",".join(added))
    return text


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


def within_request(usage: Usage, info: RequestInfo) -> Usage:
    """`usage`, or invalid usage when it counts more output than the request can have asked for
    (`RequestInfo.output_cap` times its choices): the server stops there, so more is no
    measurement (an upstream answering a duplicated `completion_tokens` of 900,000,000 to
    `max_tokens: 5` drained the global budget for everyone). Charged the hold, as any invalid
    usage; a request without a cap keeps any count under the ceiling."""
    out, cap = usage.output_tokens, info.output_cap
    if out is None or cap is None or out <= cap * info.choices:
        return usage
    return replace(
        usage,
        input_tokens=None,
        output_tokens=None,
        cached_input_tokens=None,
        unknown_reason=INVALID_USAGE,
    )


# --- non-streaming responses ----------------------------------------------------------------------


def usage_from_body(
    endpoint: Endpoint, body: bytes, headers: Mapping[str, str], *, sequences: int = 1
) -> Usage:
    """Usage of a complete (non-streaming) response. `sequences`: what the request's `choices`
    says it generates (on TGI's generate routes, `best_of`)."""
    try:
        obj = loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        obj = None
    if endpoint is Endpoint.TGI_VERTEX:
        return _vertex_body_usage(obj)
    if endpoint.is_tgi_native:
        return _tgi_body_usage(obj, headers, sequences)
    if not isinstance(obj, dict):
        return Usage(unknown_reason="unparseable_response")
    if obj.get("error") is not None and "choices" not in obj:  # Responses bodies carry error: null
        return Usage(error=error_type(obj), unknown_reason="error_response")
    usage = obj.get("usage")
    model = clean_or_none(obj.get("model"), MODEL_CHARS)
    rid = clean_or_none(obj.get("id"), ID_CHARS)
    reasons = _finish_reasons(obj)
    if endpoint is Endpoint.RESPONSES:
        reasons = (s,) if (s := clean_or_none(obj.get("status"), REASON_CHARS)) else ()
    if not isinstance(usage, dict):
        return Usage(
            model=model, response_id=rid, finish_reasons=reasons, unknown_reason="no_usage"
        )
    return read_usage(usage, endpoint, model=model, response_id=rid, finish_reasons=reasons)


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
    inp, out, generated = _header_int(raw[0]), _header_int(raw[1]), _int(raw[2])
    reason = clean_or_none(details.get("finish_reason"), REASON_CHARS)
    reasons = (reason,) if reason else ()
    if any(_invalid(v, n) for v, n in zip(raw, (inp, out, generated), strict=True)):
        return Usage(finish_reasons=reasons, unknown_reason=INVALID_USAGE)
    if out is None:
        out = generated
    if inp is None and isinstance(details.get("prefill"), list) and details["prefill"]:
        inp = _int(len(details["prefill"]))
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
        count = _int(seq.get("generated_tokens")) if isinstance(seq, dict) else None
        if count is None:  # absent, or no count we can use (docs/budgets.md, Numbers)
            return None
        total += count
    return _int(total)


def _vertex_body_usage(obj: object) -> Usage:
    """TGI's /vertex answers `{"predictions": [text, ...]}`: no token counts, no count headers."""
    if isinstance(obj, dict) and obj.get("error") is not None:
        return Usage(error=error_type(obj), unknown_reason="error_response")
    return Usage(unknown_reason="no_usage")


def read_usage(
    usage: Mapping[str, Any],
    endpoint: Endpoint,
    *,
    model: str | None = None,
    response_id: str | None = None,
    finish_reasons: tuple[str, ...] = (),
) -> Usage:
    """An OpenAI-style `usage` object (chat/completions/embeddings or the Responses API's), with
    the response's other fields when they are known."""
    if endpoint is Endpoint.RESPONSES:
        raw_in, raw_out = usage.get("input_tokens"), usage.get("output_tokens")
        details = usage.get("input_tokens_details")
    else:
        raw_in, raw_out = usage.get("prompt_tokens"), usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details")
    raw_cached = details.get("cached_tokens") if isinstance(details, dict) else None
    inp, out, cached = _int(raw_in), _int(raw_out), _int(raw_cached)
    more_cached = cached is not None and inp is not None and cached > inp  # than there was
    if (
        _invalid(raw_in, inp)
        or _invalid(raw_out, out)
        or _invalid(raw_cached, cached)
        or more_cached
    ):
        return Usage(
            model=model,
            response_id=response_id,
            finish_reasons=finish_reasons,
            unknown_reason=INVALID_USAGE,
        )
    if out is None and endpoint is Endpoint.EMBEDDINGS and inp is not None:
        out = 0  # embeddings generate nothing: zero is what happened, not a guess
    missing = inp is None or out is None
    return Usage(
        input_tokens=inp,
        output_tokens=out,
        cached_input_tokens=cached,
        model=model,
        response_id=response_id,
        finish_reasons=finish_reasons,
        unknown_reason="incomplete_usage" if missing else None,
    )


def _finish_reasons(obj: Mapping[str, Any]) -> tuple[str, ...]:
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return ()
    return tuple(
        r
        for c in choices
        if isinstance(c, dict) and (r := clean_or_none(c.get("finish_reason"), REASON_CHARS))
    )


def error_type(obj: Mapping[str, Any]) -> str:
    """The error type of a vLLM (`{"error": {...}}`) or TGI (`{"error", "error_type"}`) body."""
    err = obj.get("error")
    if isinstance(err, dict):
        return _reason_text(err.get("type") or err.get("code"))
    return _reason_text(obj.get("error_type"))


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
    usage-only chunk (`choices: []`); with `strip_chunk_usage` (we caused per-chunk usage), each
    chunk's `usage` member is cut out of its bytes; otherwise the bytes pass through unchanged as
    they arrive. `choices` is how many choices the stream carries (to know when it is finished).
    """

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        strip_usage: bool = False,
        strip_chunk_usage: bool = False,
        choices: int = 1,
        per_prompt: int = 1,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    ) -> None:
        self.endpoint = endpoint
        self._per_prompt = max(1, per_prompt)  # n: choices of one prompt have adjacent indexes
        self._strip = strip_usage
        self._strip_chunk = strip_chunk_usage
        self._rewrite = strip_usage or strip_chunk_usage
        self._cut = False  # the event just parsed carries a usage member to cut
        self._choices = choices
        self._responses_idle = False  # Responses: the last output item is done, no delta since
        # raw bytes only needed to rewrite; an event over max_event_bytes passes through unparsed
        self._parser = SSEParser(keep_raw=self._rewrite, max_event_bytes=max_event_bytes)
        self._max_event = max_event_bytes  # the wire paths leave a longer event to the parser
        self._s = _StreamState()
        self._final_usage: list[Mapping[str, Any]] = []  # usage-only chunks: request totals
        # usage riding on a choice (vLLM's running totals, TGI); bytes from the wire fast path
        self._choice_usage: dict[int, Mapping[str, Any] | bytes] = {}
        self._tgi_tokens = 0
        self._tgi_details: Mapping[str, Any] | None = None
        self.done = False  # saw [DONE], a final TGI event or a terminal Responses event
        self.passthrough = False  # set after an accounting failure: forward, stop parsing
        openai = not (endpoint.is_tgi_native or endpoint is Endpoint.RESPONSES)
        self._shape = _TokenShape() if openai else None  # the fast paths for text-only chunks
        self._tgi_wire = _TGI_WIRE if endpoint.is_tgi_native else None

    @property
    def token_events(self) -> int:
        return self._s.token_events

    def feed(self, chunk: bytes) -> bytes:
        if self.passthrough:
            return chunk
        shape = self._shape
        at: Callable[[bytes, int], _WireEvent | None]
        if shape is not None and (head := shape.head):
            if (
                chunk.startswith(head)
                and not self._parser.mid_event
                and len(chunk) <= self._max_event
            ):
                whole = shape.tail.fullmatch(chunk, len(head))
                if whole is not None:  # the usual read: exactly one event of the shape
                    return self._one_event(chunk, whole, len(head))
            at = shape.at
        elif self._tgi_wire is not None:
            at = _tgi_at
        else:
            return self._feed_events(chunk)
        found = None if self._parser.mid_event else at(chunk, 0)
        return self._feed_wire(at, chunk, found)

    def _feed_wire(
        self, at: Callable[[bytes, int], _WireEvent | None], chunk: bytes, found: _WireEvent | None
    ) -> bytes:
        """The fast path of `feed`: whole events of one known shape (`at` recognises one on the
        bytes; `found` is what it found at the start, None when the parser holds part of an
        event), neither SSE-parsed nor decoded; any other event, and anything the parser holds
        from an earlier read, goes to the general path up to the end of that event.

        Relies on: `at` matching only events whose effect is known without decoding them (see
        `_TokenShape.at`, `_tgi_at`), and a segment ending in a blank line leaving the parser
        holding nothing (its last `\\n` ends an empty line, which dispatches), so the next event
        starts where reading event by event would start it.
        """
        pos, size = 0, len(chunk)
        out: list[bytes] = []  # the bytes for the client, when they are not `chunk` as it came
        kept = 0  # chunk[kept:pos] goes to the client as it came
        while pos < size:
            if found is not None and found[0] - pos > self._max_event:
                found = None  # too long to be read: the parser passes it through, as in pieces
            if found is None:  # not an event of the shape, or the parser holds part of one
                end = chunk.find(b"\n\n", pos) + 2
                end = end if end > 1 else size
                got = self._feed_events(piece := chunk[pos:end])
                if got != piece:
                    out += (chunk[kept:pos], got)
                    kept = end
            else:
                end, _, cut = found
                if self._wire_event(chunk, found):
                    out.append(chunk[kept:cut])
                    kept = end - 3  # the object's closing brace and the blank line stay
            pos = end
            # each position is tried once; what the parser holds goes on on the general path
            found = None if pos >= size or self._parser.mid_event else at(chunk, pos)
        if not out:
            return chunk
        out.append(chunk[kept:])
        return b"".join(out)

    def _one_event(self, chunk: bytes, whole: re.Match[bytes], start: int) -> bytes:
        """`_feed_wire` for the usual read, in short: exactly one whole event of the learnt
        shape, `whole` its tail (`_TokenShape.tail` matched from `start` to the chunk's end)."""
        shape = self._shape
        assert shape is not None
        if whole.end(1) > start:  # its text is not empty
            self._s.token_events += 1
            shape.tries = _SHAPE_TRIES
        cut = whole.start(2)
        if cut < 0:
            return chunk
        self._choice_usage[shape.index] = chunk[cut + _USAGE_KEY : -3]
        return chunk[:cut] + chunk[-3:] if self._strip_chunk else chunk

    def _wire_event(self, data: bytes, found: _WireEvent) -> bool:
        """An event the wire path recognised in `data`: its token counted, its running usage kept
        as bytes (decoded only if it is read). True when that usage is to be cut out."""
        end, text, cut = found
        shape = self._shape
        if text:
            self._s.token_events += 1
            if shape is None:
                self._tgi_tokens += 1
            else:
                shape.tries = _SHAPE_TRIES
        if cut < 0 or shape is None:
            return False
        self._choice_usage[shape.index] = data[cut + _USAGE_KEY : end - 3]
        return self._strip_chunk

    def _feed_events(self, chunk: bytes) -> bytes:
        """The general path: SSE events parsed, each one read by `_on_event`."""
        held = self._parser.mid_event
        events = self._parser.feed(chunk)
        if not self._rewrite:
            for ev in events:
                self._on_event(ev)
            return chunk
        out: list[bytes] = []
        changed = False
        for ev in events:
            if self._on_event(ev):
                changed = True  # an event we caused (the usage chunk) is dropped
            elif self._cut:
                self._cut = False
                changed = True
                out.append(_without_usage(ev))  # running usage we asked for is cut out
            else:
                out.append(ev.raw)
        if not changed and not held and not self._parser.mid_event:
            return chunk  # nothing changed, and this chunk's events are exactly the chunk
        return b"".join(out)

    def finish(self) -> tuple[bytes, Usage]:
        """The upstream stream ended. Returns bytes still held (an unterminated event) and usage."""
        tail = self._parser.finish()
        return (tail if self._rewrite else b""), self._usage()

    @property
    def finished(self) -> bool:
        """Generation is over: every choice has its finish reason (or the stream its terminal
        event). Only the usage may still be on its way."""
        if self.done:
            return True
        if self.endpoint is Endpoint.RESPONSES:
            return self._responses_idle
        return len(self._s.finish) >= self._choices

    def usage_so_far(self) -> Usage:
        """Usage of a stream the client cut short: the totals if they came; else vLLM's running
        totals (exact up to the last chunk received) or TGI's token events; else unknown."""
        running = self._choice_usage
        if (
            self._final_usage
            or len(running) < 2
            or self.endpoint.is_tgi_native
            or self._parser.oversized
        ):
            return self._usage()
        parts = {i: read_usage(_decoded(u), self.endpoint) for i, u in running.items()}
        inp = self._running_input(parts)
        reason = next((p.unknown_reason for p in parts.values() if p.unknown_reason), None)
        return _bounded(
            replace(
                self._usage(),
                input_tokens=inp,
                output_tokens=_sum(p.output_tokens for p in parts.values()),
                cached_input_tokens=None,
                unknown_reason=None if inp is not None else reason or "incomplete_usage",
            )
        )

    def _running_input(self, parts: Mapping[int, Usage]) -> int | None:
        """A chat's choices share one prompt. A batched completion's choice `i` belongs to prompt
        `i // n`, and each choice's running usage carries its own prompt's size: one per prompt,
        and only when every prompt was seen."""
        if None in (p.input_tokens for p in parts.values()):
            return None
        if self.endpoint is Endpoint.CHAT:
            return max(p.input_tokens or 0 for p in parts.values())
        prompts: dict[int, int] = {}
        for i, p in parts.items():
            prompts[i // self._per_prompt] = p.input_tokens or 0
        if len(prompts) * self._per_prompt < self._choices:
            return None
        return sum(prompts.values())

    # Returns True when the event must not reach the client.
    def _on_event(self, ev: Event) -> bool:
        if ev.data is None:
            return False
        shape = self._shape
        found = shape.at(ev.raw, 0) if shape is not None and shape.head and ev.raw else None
        if shape is not None and found is not None and found[0] == len(ev.raw):
            # the wire path's shape, met here (an event split across reads, or after another)
            self._cut = self._wire_event(ev.raw, found)
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
        s.model = s.model or clean_or_none(obj.get("model"), MODEL_CHARS)
        s.response_id = s.response_id or clean_or_none(obj.get("id"), ID_CHARS)
        choices = obj.get("choices")
        usage = obj.get("usage")
        if isinstance(choices, list) and choices:
            if any(_carries_output(c) for c in choices):
                s.token_events += 1
            for c in choices:
                if isinstance(c, dict) and (
                    r := clean_or_none(c.get("finish_reason"), REASON_CHARS)
                ):
                    s.finish[_int(c.get("index")) or 0] = r
            if isinstance(usage, dict):
                first = choices[0] if isinstance(choices[0], dict) else {}
                self._choice_usage[_int(first.get("index")) or 0] = usage
                self._cut = self._strip_chunk
            return False
        if isinstance(usage, dict) and isinstance(choices, list):
            self._final_usage.append(usage)
            return self._strip
        return False

    def _responses_event(self, obj: Mapping[str, Any]) -> None:
        kind = _str(obj.get("type")) or ""
        if kind.endswith(".delta"):
            self._s.token_events += 1
            self._responses_idle = False
        elif kind == "response.output_item.done":
            self._responses_idle = True
        response = obj.get("response")
        if not isinstance(response, dict):
            return
        self._s.model = self._s.model or clean_or_none(response.get("model"), MODEL_CHARS)
        self._s.response_id = self._s.response_id or clean_or_none(response.get("id"), ID_CHARS)
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            self.done = True
            if (status := clean_or_none(response.get("status"), REASON_CHARS)) is not None:
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
            if (r := clean_or_none(details.get("finish_reason"), REASON_CHARS)) is not None:
                self._s.finish[0] = r
        if obj.get("generated_text") is not None:
            self.done = True

    def _usage(self) -> Usage:
        if self._parser.oversized:  # an event that was not read may have carried anything
            return replace(
                self._counted_usage(),
                input_tokens=None,
                output_tokens=None,
                cached_input_tokens=None,
                unknown_reason="event_too_large",
            )
        return self._counted_usage()

    def _counted_usage(self) -> Usage:
        s = self._s
        base = Usage(
            model=s.model,
            response_id=s.response_id,
            finish_reasons=tuple(s.finish[k] for k in sorted(s.finish)),
            error=s.error,
        )
        if self.endpoint.is_tgi_native:
            return self._tgi_usage(base)
        totals: list[Mapping[str, Any] | bytes] = [*self._final_usage] or [
            *self._choice_usage.values()
        ]
        if not totals:
            return replace(base, unknown_reason="stream_without_usage")
        parts = [read_usage(_decoded(u), self.endpoint) for u in totals]
        return _bounded(
            replace(
                base,
                input_tokens=_sum(p.input_tokens for p in parts),
                output_tokens=_sum(p.output_tokens for p in parts),
                cached_input_tokens=_sum_present(p.cached_input_tokens for p in parts),
                unknown_reason=next((p.unknown_reason for p in parts if p.unknown_reason), None),
            )
        )

    def _tgi_usage(self, base: Usage) -> Usage:
        details = self._tgi_details or {}
        raw_out, raw_in = details.get("generated_tokens"), details.get("input_length")
        out, inp = _int(raw_out), _int(raw_in)
        if _invalid(raw_out, out) or _invalid(raw_in, inp):
            return replace(base, unknown_reason=INVALID_USAGE)
        if out is None and self._tgi_tokens:
            # TGI's /generate_stream sends exactly one event per generated token.
            out = _int(self._tgi_tokens)
        if out is None:  # no token event at all: not a stream of the shape we count
            reason: str | None = "no_token_events"
        else:
            reason = None if inp is not None else "no_input_length"
        return replace(base, input_tokens=inp, output_tokens=out, unknown_reason=reason)


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

    __slots__ = ("head", "index", "prefix", "suffix", "tail", "tries", "wired")

    def __init__(self) -> None:
        self.prefix = self.suffix = ""
        self.tries = _SHAPE_TRIES  # a failed learning costs a decode: stop on streams that vary
        self.head = b""  # the shape on the wire (see `at`); no head: not usable there
        self.tail = _NEVER
        self.wired = False  # `head` and `tail` made for this shape (see `wire`)
        self.index = 0  # the choice's index: running usage is kept per choice

    def carries(self, data: str) -> bool | None:
        """Does this chunk of the learnt shape carry output? None: not that shape, decode it."""
        p, s = self.prefix, self.suffix
        if not p or len(data) < len(p) + len(s) or not data.startswith(p):
            return None
        if not data.endswith(s) or not _plain(text := data[len(p) : len(data) - len(s)]):
            return None
        self.tries = _SHAPE_TRIES
        if not self.wired:
            self.wire()
        return text != ""

    def learn(self, data: str, obj: Mapping[str, Any]) -> None:
        if self.tries <= 0:
            return
        data, obj = _without_running_usage(data, obj)
        if (found := _text_slot(obj)) is None:
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
            met_before = data[end:] == self.suffix
            self.prefix, self.suffix = data[:start], data[end:]
            self.index = _int(obj["choices"][0].get("index")) or 0
            self.head, self.tail = b"", _NEVER
            self.wired = False
            if met_before:
                self.wire()

    def wire(self) -> None:
        """Make the shape's wire form, once it has been met twice: a compiled pattern is worth it
        only for a shape that repeats (a chunk with logprobs has a new suffix every time)."""
        self.wired = True
        self.head, self.tail = _on_the_wire(self.prefix, self.suffix)

    def at(self, chunk: bytes, pos: int) -> _WireEvent | None:
        """The wire fast path: an event of the learnt shape at `pos` in the bytes, with optional
        running usage before its closing brace: (its end, whether its text is not empty, where
        its usage member starts or -1). None when it is not one.

        Relies on what `carries` relies on, in bytes: the text is printable ASCII but quote and
        backslash, or bytes of multi-byte characters (read with "replace" these never make a
        quote or a control character, nor an empty text), so the event decodes to the learnt
        chunk with other text in its slot. The usage member is the object's last, so it is the
        value a JSON reader keeps (the dict `_openai_chunk` keeps); it is what `_without_usage`
        cuts, as that regex's match must end on a brace followed by `}` and a newline, which
        only this flat member's closing brace is.
        """
        head = self.head
        if chunk.startswith(head, pos):
            start = pos + len(head)
        elif chunk.startswith(head[6:], pos + 5) and chunk.startswith(b"data:", pos):
            start = pos + len(head) - 1  # `data:` without the space
        else:
            return None
        m = self.tail.match(chunk, start)
        if m is None:
            return None
        return m.end(), m.end(1) > start, m.start(2)


_SHAPE_TRIES = 8

# The running totals vLLM puts last on each chunk (`continuous_usage_stats`): a flat object of
# integers (or null), as pydantic writes it. Nothing else is learnt past or cut by the wire path.
_USAGE_OBJECT = re.compile(
    rb'\{"[a-z_]+":(?:[1-9][0-9]{0,17}|0|null)(?:,"[a-z_]+":(?:[1-9][0-9]{0,17}|0|null))*\}'
)
_USAGE_KEY = len(b',"usage":')
_RUNNING_USAGE_TEXT = re.compile(',"usage":' + _USAGE_OBJECT.pattern.decode() + r"\}$")
_NEVER = re.compile(rb"(?!)")
_WireEvent = tuple[int, bool, int]


def _without_running_usage(data: str, obj: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """A chunk ending in running usage, as the same chunk without it; any other as it is."""
    if not isinstance(obj.get("usage"), dict) or not (m := _RUNNING_USAGE_TEXT.search(data)):
        return data, obj
    base = data[: m.start()] + "}"
    if '"usage"' in base:  # another member of that name: the dict left out is not its value
        return data, obj
    return base, {k: v for k, v in obj.items() if k != "usage"}


# The longest suffix compiled into a wire pattern. A chunk's suffix is tens of bytes (vLLM's and
# TGI's); a long one (an echoed completion's prompt logprobs, per-token logprobs) is the client's
# to choose and rarely repeats, and compiling costs about 2 us per byte on the event loop (a
# 400 KB suffix: 0.7 s, and 2.6 MB held in `_tail`'s cache). Such shapes use the text fast path.
_WIRE_SUFFIX_MAX = 512


def _on_the_wire(prefix: str, suffix: str) -> tuple[bytes, re.Pattern[bytes]]:
    """(head, tail) for `_TokenShape.at`: `data: ` and the prefix; the text, the suffix and
    optional running usage before its closing brace. No head when the shape is not one `data:`
    line of a JSON object."""
    p, s = prefix.encode("utf-8"), suffix.encode("utf-8")
    if not s.endswith(b"}") or b"\n" in p + s or b"\r" in p + s or len(s) > _WIRE_SUFFIX_MAX:
        return b"", _NEVER
    return b"data: " + p, _tail(s[:-1])


@functools.lru_cache(maxsize=64)
def _tail(suffix: bytes) -> re.Pattern[bytes]:
    """The part of the shape after the prefix, compiled once per suffix. A chunk's suffix holds
    no id (vLLM's: `"},"logprobs":null,"finish_reason":null}]`), so streams share it."""
    text = rb"([ !#-\[\]-~\x80-\xff]*)"  # `_plain` text, and the other bytes of UTF-8
    usage = rb'(?:(,"usage":)' + _USAGE_OBJECT.pattern + b")?"
    return re.compile(text + re.escape(suffix) + usage + rb"\}\n\n")


# The fast path for TGI's /generate_stream: a token event that is not the last, exactly as TGI
# writes it (serde, compact, fields in this order, no top_tokens). Relies on the pattern
# admitting only valid JSON: plain or correctly escaped text, JSON numbers, ASCII digits, and no
# integer of more than 18 digits (`json.loads` refuses one of over 4300: such an event counts
# nothing on the general path). Such an event decodes to a dict with a `token` object, null
# `generated_text` and `details`, and no `error`: `_tgi_event` only counts it.
_TGI_TOKEN_EVENT = re.compile(
    r'\{"index":(?:0|[1-9][0-9]{0,17}),"token":\{"id":(?:0|[1-9][0-9]{0,17}),'
    r'"text":"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*",'
    r'"logprob":(?:-?(?:0|[1-9][0-9]{0,17})(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|null),'
    r'"special":(?:true|false)\},"generated_text":null,"details":null\}'
)


# `_TGI_TOKEN_EVENT` as a whole SSE event on the wire (read with "replace", a byte outside ASCII
# is a character the pattern admits, and never makes a quote, backslash or control character).
_TGI_WIRE = re.compile(rb"data: ?" + _TGI_TOKEN_EVENT.pattern.encode("ascii") + rb"\n\n")


def _tgi_at(chunk: bytes, pos: int) -> _WireEvent | None:
    """The wire fast path on /generate_stream: a token event at `pos`, or None."""
    m = _TGI_WIRE.match(chunk, pos)
    return (m.end(), True, -1) if m is not None else None


def _decoded(usage: Mapping[str, Any] | bytes) -> Mapping[str, Any]:
    """Running usage the wire fast path kept as bytes (an object of numbers), decoded."""
    if isinstance(usage, bytes):
        decoded: Mapping[str, Any] = json.loads(usage)
        return decoded
    return usage


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


# vLLM's chunk ends `,"usage":{...}}` (compact JSON, usage last; its values are numbers and one
# nested object). A raw newline cannot be inside a JSON string, nor an unescaped quote, so this
# can only match the top-level object's last member, right before the end of the data line.
_USAGE_LAST = re.compile(rb',"usage":\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}(?=\}[ \t]*[\r\n])')


def _without_usage(ev: Event) -> bytes:
    """The event's bytes with its JSON's `usage` member cut out, every other byte kept.

    Only a single-line `data:` event is cut (vLLM's shape); any other is forwarded as it came.
    """
    raw = ev.raw
    if raw.count(b"\ndata:") + raw.startswith(b"data:") != 1:
        return raw
    if (m := _USAGE_LAST.search(raw)) is not None:
        return raw[: m.start()] + raw[m.end() :]
    data = ev.data or ""
    cut = splice.without(data, "usage")
    encoded = data.encode("utf-8")
    at = raw.find(encoded)
    if cut is None or at < 0:
        return raw
    return raw[:at] + cut.encode("utf-8") + raw[at + len(encoded) :]


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
    """A count in JSON: an integer from 0 to MAX_TOKEN_COUNT (not a bool, a float or a string)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v if 0 <= v <= MAX_TOKEN_COUNT else None
    return None


def _header_int(v: str | None) -> int | None:
    """A count in a header: its ASCII digits, from 0 to MAX_TOKEN_COUNT."""
    if v is not None and v.isascii() and v.isdigit() and len(v) < 19:
        return _int(int(v))
    return None


def token_count(v: object) -> int | None:
    """A token count from the upstream (a /tokenize answer too): `_int`'s rule."""
    return _int(v)


def _invalid(raw: object, read: int | None) -> bool:
    """A count was sent (not absent, not null) but is none we can use."""
    return raw is not None and read is None


def _bounded(u: Usage) -> Usage:
    """A stream's totals (the sum of several usage objects) under the same ceiling."""
    counts = (u.input_tokens, u.output_tokens, u.cached_input_tokens)
    if all(n is None or n <= MAX_TOKEN_COUNT for n in counts):
        return u
    return replace(
        u,
        input_tokens=None,
        output_tokens=None,
        cached_input_tokens=None,
        unknown_reason=INVALID_USAGE,
    )


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _str(v: object) -> str | None:
    """A string the code only compares (an event's type): never kept, so not cleaned."""
    return v if isinstance(v, str) and v else None


def _reason_text(v: object) -> str:
    """An error type as safe, bounded text ("error" when there is none)."""
    return clean(v if isinstance(v, str) else str(v), REASON_CHARS) if v else "error"


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
