"""Ollama's native wire: `/api/chat`, `/api/generate` (NDJSON streams) and `/api/embed`.

Owns: what such a request asks for (`stream` true unless a JSON `false`; the limit
`options.num_predict`, none or below 1 meaning unbounded), usage from a complete body and from
an NDJSON stream (`OllamaStream`: one JSON object a line, the last `done: true` one holding
`prompt_eval_count` and `eval_count`), and the line buffering that stream needs (bounded).
Never: changes a byte, or counts lines as tokens: Ollama's partial lines carry no counts and a
line may hold several tokens, so a stream cut before its `done` line has no measured usage.
Formats: ollama `api/types.go` (`ChatResponse`, `GenerateResponse`, `Metrics`, `EmbedResponse`,
`Options.NumPredict`) and `server/routes.go` (`ChatHandler`, `GenerateHandler`, `EmbedHandler`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..exchange import Endpoint, RequestInfo, Usage
from ..text import MODEL_CHARS, REASON_CHARS, USER_CHARS, clean_or_none
from . import reqsize
from .counts import INVALID_USAGE, body_value, count, number
from .reqsize import prompt_chars
from .sse import DEFAULT_MAX_EVENT_BYTES

OLLAMA_ROUTES = (Endpoint.OLLAMA_CHAT, Endpoint.OLLAMA_GENERATE, Endpoint.OLLAMA_EMBED)


class OllamaAdapter(reqsize.ReadOnly):
    """Ollama's /api/chat, /api/generate and /api/embed (it has no tokenizer route)."""

    api = "ollama"

    def read(self, info: RequestInfo, obj: Mapping[str, Any]) -> None:
        options = obj.get("options")
        options = options if isinstance(options, dict) else {}
        # Go matches `Options` or `OPTIONS` to `options` too, merging a later one into it
        limit, info.unreadable = _num_predict(options)
        if twins := reqsize.case_twins(obj, ("options",)):
            limit, info.unreadable = None, twins
        messages = obj.get("messages")
        # `Stream *bool`: absent or null is a stream; Go refuses a non-boolean
        info.stream = info.endpoint is not Endpoint.OLLAMA_EMBED and obj.get("stream") is not False
        info.user = clean_or_none(obj.get("user"), USER_CHARS)
        info.max_tokens = info.output_cap = limit  # Ollama reads no other limit field
        if info.endpoint is Endpoint.OLLAMA_EMBED:
            info.output_cap = 0  # nothing is generated: no output held, none counted
        info.temperature = number(options.get("temperature"))
        info.tools = len(obj["tools"]) if isinstance(obj.get("tools"), list) else 0
        info.messages = len(messages) if isinstance(messages, list) else 0
        info.prompt_chars = prompt_chars(obj)

    def usage_from_body(
        self,
        endpoint: Endpoint,
        body: bytes,
        headers: Mapping[str, str],
        *,
        sequences: int = 1,
        per_prompt: int = 1,
    ) -> Usage:
        """Usage of a complete response: the one `done: true` object (or the embed response)."""
        obj = body_value(body)
        if not isinstance(obj, dict):
            return Usage(unknown_reason="no_usage")
        if isinstance(obj.get("error"), str):
            return Usage(error=_ERROR, unknown_reason="error_response")
        if endpoint is Endpoint.OLLAMA_EMBED:
            return _embed_usage(obj)
        if obj.get("done") is not True:
            return Usage(unknown_reason="no_usage")
        return _final_usage(obj)

    def stream(self, endpoint: Endpoint, *, fast: bool = True, **options: Any) -> OllamaStream:
        """The NDJSON line meter (one path: there is no fast one)."""
        return OllamaStream(endpoint, max_event_bytes=options.get("max_event_bytes"))


def _num_predict(options: Mapping[str, Any]) -> tuple[int | None, tuple[str, ...]]:
    """`options.num_predict` as Ollama's `Options.FromMap` reads an int field: a JSON number,
    truncated (a string or a boolean is refused); -1 (infinite), -2 (fill the context) and 0 are
    no limit of the request's own, so the default worst case applies."""
    value = options.get("num_predict")
    if value is None:
        return None, ()
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        return None, ("num_predict",)
    if isinstance(value, float) and abs(value) >= 2**62:
        return None, ("num_predict",)
    limit = int(value)
    return (limit if limit > 0 else None), ()


_ERROR = "error"  # Ollama's error is a free-text message: never a label


def _counted(obj: Mapping[str, Any], key: str) -> tuple[int | None, bool]:
    """(the count, whether it is invalid). The counts are Go `int`s, `omitempty` (api/types.go
    `Metrics`, `EmbedResponse`): a 0 is left out of the final object, so an absent count there
    is a zero that was measured. Ollama never writes `null` (nor anything but an integer) for
    one: that is no count, never a 0."""
    if key not in obj:
        return 0, False
    read = count(obj[key])
    return read, read is None


def _final_usage(obj: Mapping[str, Any]) -> Usage:
    inp, bad_in = _counted(obj, "prompt_eval_count")
    out, bad_out = _counted(obj, "eval_count")
    model = clean_or_none(obj.get("model"), MODEL_CHARS)
    reason = clean_or_none(obj.get("done_reason"), REASON_CHARS)
    reasons = (reason,) if reason else ()
    if bad_in or bad_out:
        return Usage(model=model, finish_reasons=reasons, unknown_reason=INVALID_USAGE)
    return Usage(input_tokens=inp, output_tokens=out, model=model, finish_reasons=reasons)


def _embed_usage(obj: Mapping[str, Any]) -> Usage:
    """/api/embed: `prompt_eval_count` (omitempty) beside the embeddings; nothing generated."""
    model = clean_or_none(obj.get("model"), MODEL_CHARS)
    if not isinstance(obj.get("embeddings"), list):
        return Usage(model=model, unknown_reason="no_usage")
    inp, bad = _counted(obj, "prompt_eval_count")
    if bad:
        return Usage(model=model, unknown_reason=INVALID_USAGE)
    return Usage(input_tokens=inp, output_tokens=0, model=model)


class OllamaStream:
    """An NDJSON stream: each line one object; `done: true` ends it with the counts. Bytes pass
    through unchanged; at most `max_event_bytes` of one line are held, a longer line is not read
    and makes the usage unknown (it may have been the final one) unless a `done` line was read
    after it: that line's counts are the request's, whatever came before."""

    def __init__(self, endpoint: Endpoint, *, max_event_bytes: int | None = None) -> None:
        self.endpoint = endpoint
        self.done = False
        self.passthrough = False
        self._max = max_event_bytes or DEFAULT_MAX_EVENT_BYTES
        self._line = bytearray()
        self._skipping = False  # inside a line over the limit: dropped up to its newline
        self._oversized = 0  # lines over the limit so far
        self._final_skips = 0  # lines over the limit before the `done` line
        self._events = 0
        self._final: Usage | None = None
        self._model: str | None = None
        self._error: str | None = None

    @property
    def token_events(self) -> int:
        return self._events + self._oversized  # a line over the limit may have carried output

    @property
    def finished(self) -> bool:
        return self.done

    def feed(self, chunk: bytes) -> bytes:
        if self.passthrough:
            return chunk
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            self._take(chunk[start:end])
            self._end_line()
            start = end + 1
        self._take(chunk[start:])
        return chunk

    def _take(self, piece: bytes) -> None:
        if self._skipping or not piece:
            return
        if len(self._line) + len(piece) > self._max:
            self._line.clear()
            self._skipping = True
            self._oversized += 1
            return
        self._line += piece

    def _end_line(self) -> None:
        line, self._skipping = bytes(self._line), False
        self._line.clear()
        if line.strip():
            self._read(line)

    def _read(self, line: bytes) -> None:
        try:
            obj = json.loads(line)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return
        if not isinstance(obj, dict):
            return
        if self._model is None:
            self._model = clean_or_none(obj.get("model"), MODEL_CHARS)
        if isinstance(obj.get("error"), str):
            self._error = _ERROR
            return
        if obj.get("done") is True:
            self._final = _final_usage(obj)
            self._final_skips = self._oversized
            self.done = True
            return
        message = obj.get("message")
        text = message.get("content") if isinstance(message, dict) else obj.get("response")
        if text or (
            isinstance(message, dict) and (message.get("tool_calls") or message.get("thinking"))
        ):
            self._events += 1

    def finish(self) -> tuple[bytes, Usage]:
        """The stream ended: a last line without its newline is read too (nothing is held back
        from the client: every byte was passed on as it came)."""
        if self._line and not self._skipping:
            self._end_line()
        return b"", self.usage_so_far()

    def usage_so_far(self) -> Usage:
        if self._oversized and not self._read_after_skips():
            return Usage(model=self._model, error=self._error, unknown_reason="event_too_large")
        if self._final is not None and self._error is None:
            return self._final
        reason = "no_usage" if self._final is None else "error_response"
        return Usage(model=self._model, error=self._error, unknown_reason=reason)

    def _read_after_skips(self) -> bool:
        """The `done` line, measured and read after the last line over the limit, with no error
        line read: the request's counts, which nothing before it adds to."""
        final = self._final
        if final is None or self._error is not None or final.unknown_reason is not None:
            return False
        return self._final_skips == self._oversized
