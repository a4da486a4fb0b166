"""vLLM's speech-to-text routes: `/v1/audio/transcriptions`, `/v1/audio/translations`
(vllm/entrypoints/openai/speech_to_text/: protocol.py, speech_to_text.py, api_router.py).

Owns: reading the head of a multipart/form-data request for its small form fields (`FormHead`:
fed the bytes as they arrive, it stops at the first file part, at the form's end, or at a cap),
what such a request asks for (`audio_request`), and the usage of its answer: a transcription's
`usage: {"type": "duration", "seconds": N}` (vLLM answers response_format json and text alike,
as JSON, the seconds rounded up; srt and vtt it refuses), the `duration` of a verbose_json
answer (a string of seconds, for translations too), a stream's token `usage` chunk (sent only
when the form asked `stream_include_usage`). A plain-text answer (another server's `text`) has
none.
Never: reads or holds the file part (the proxy streams it through as it comes), changes a byte
of the request or of the answer, or invents seconds: an answer without them (translation json,
text, a stream) has no audio seconds, and its cost is from tokens, or unknown.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Mapping
from email.message import Message
from typing import Any

from ..exchange import Endpoint, RequestInfo, Usage
from ..text import ID_CHARS, MODEL_CHARS, clean, clean_or_none
from .counts import INVALID_USAGE, body_value, error_type, header_count, lax_true
from .openai import ChatStream, OpenAIAdapter

# The most seconds of audio one answer may report: 10 million (115 days of audio). More, a
# negative, NaN or non-number is invalid usage (charged its hold), as for token counts.
MAX_AUDIO_SECONDS = 10_000_000.0
# The form fields kept from a head: what the meter reads (the rest are skipped).
READ_FIELDS = frozenset(
    {"model", "stream", "response_format", "stream_include_usage", "max_completion_tokens"}
)
_CRLF2 = b"\r\n\r\n"


def boundary(content_type: str | None) -> bytes | None:
    """The boundary of a multipart/form-data Content-Type; None for any other body, and for a
    form whose fields are not read as this reads them: one naming its boundary twice, or a
    `charset` other than UTF-8 (Starlette, vLLM's form parser, decodes the fields' names and
    values with the last `charset` given: in UTF-7 the bytes `+AHc-hisper` are `whisper`)."""
    if not content_type:
        return None
    msg = Message()
    msg["content-type"] = content_type
    if msg.get_content_type() != "multipart/form-data":
        return None
    params = msg.get_params([])
    if [k.lower() for k, _ in params].count("boundary") != 1:
        return None
    if not all(_utf8(v) for k, v in params if k.lower() == "charset"):
        return None
    value = msg.get_param("boundary")
    if not isinstance(value, str) or not 1 <= len(value) <= 70 or not value.isascii():
        return None  # RFC 2046: 1 to 70 characters
    return value.encode("ascii")


def _utf8(charset: object) -> bool:
    """Is `charset` a name Python decodes as UTF-8 (as Starlette's `bytes.decode(charset)`)?"""
    if not isinstance(charset, str):
        return False  # RFC 2231-encoded: not a name
    try:
        return codecs.lookup(charset.strip()).name == "utf-8"
    except LookupError:
        return False


class FormHead:
    """The form fields that come before the first file part of a multipart body.

    `feed(chunk)` returns True once the head is over: a file part begins (`reached_file`), the
    form ends, or `cap` bytes were fed without either (`capped`: what was not read is unknown).
    `fields` holds the READ_FIELDS found, each once: a field sent twice is `duplicate` (which
    one the server reads is its parser's choice, so neither is taken).
    A pure object: no I/O, no clock.
    """

    def __init__(self, boundary: bytes, cap: int) -> None:
        self._delim = b"--" + boundary
        self._cap = cap
        self._buf = bytearray()
        self._pos: int | None = None  # where the next part's headers begin, once found
        self.fields: dict[str, str] = {}
        self.duplicate: str | None = None
        self.done = self.reached_file = self.capped = self.ended = self.malformed = False

    def feed(self, chunk: bytes) -> bool:
        if self.done:
            return True
        self._buf += chunk[: self._cap + 1 - len(self._buf)]  # never more than cap + 1 held
        while not self.done and self._step():
            pass
        if not self.done and len(self._buf) > self._cap:
            self.done = self.capped = True
        return self.done

    def _step(self) -> bool:
        """Read one more piece of the head; False when more bytes are needed."""
        if self._pos is None:
            return self._opening()
        buf = self._buf
        end = buf.find(_CRLF2, self._pos)
        if end < 0:
            return False
        try:
            name, filename = _disposition(bytes(buf[self._pos : end]))
        except UnclearPart:
            return self._malformed()
        if filename is not None or name is None:
            self.reached_file = filename is not None
            self.done = True
            return False
        close = buf.find(b"\r\n" + self._delim, end + 4)
        if close < 0:
            return False
        self._field(name, bytes(buf[end + 4 : close]))
        after = close + 2 + len(self._delim)
        if len(buf) < after + 2:
            return False
        if buf[after : after + 2] == b"--":
            self.done = self.ended = True
            return False
        if buf[after : after + 2] != b"\r\n":
            return self._malformed()  # padding after a delimiter: read by no rule of ours
        self._pos = after + 2  # past the CRLF ending the delimiter line
        return True

    def _malformed(self) -> bool:
        """A head this reader does not take exactly as RFC 7578 writes it: none of it is used
        (another parser may read it otherwise, and a model read wrongly is billed wrongly)."""
        self.fields.clear()
        self.done = self.malformed = True
        return False

    def _opening(self) -> bool:
        """The first delimiter (a preamble before it is skipped, as RFC 2046 says)."""
        buf = self._buf
        at = buf.find(self._delim)
        if at < 0 or len(buf) < at + len(self._delim) + 2:
            return False
        if buf[at + len(self._delim) : at + len(self._delim) + 2] != b"\r\n":
            return self._malformed()
        self._pos = at + len(self._delim) + 2
        return True

    def _field(self, name: str, value: bytes) -> None:
        if name not in READ_FIELDS:
            return
        if name in self.fields:
            self.duplicate = name
        try:
            self.fields[name] = value.decode("utf-8")
        except UnicodeDecodeError:
            self.fields[name] = ""  # a name the server reads as no such model


class UnclearPart(ValueError):
    """A part whose name depends on the parser: two Content-Disposition headers, or a `name`
    parameter given twice (Starlette, vLLM's form parser, takes the last of each;
    `email.message` the first). A `filename` given twice (`filename` and RFC 2231's
    `filename*`, as some clients send a non-ASCII name) is a file to both."""


def _disposition(head: bytes) -> tuple[str | None, str | None]:
    """(name, filename) of a part, from its Content-Disposition header. Raises UnclearPart."""
    msg = Message()
    for line in head.decode("latin-1").split("\r\n"):
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() == "content-disposition":
            if "content-disposition" in msg:
                raise UnclearPart("a part has two Content-Disposition headers")
            msg["content-disposition"] = value.strip()
    keys = [k.lower() for k, _ in msg.get_params([], header="content-disposition")]
    if keys.count("name") > 1:
        raise UnclearPart("a part gives its name twice")
    name = msg.get_param("name", header="content-disposition")
    filename = msg.get_param("filename", header="content-disposition")
    return (
        name if isinstance(name, str) else None,
        filename if isinstance(filename, str) else None,
    )


class LateField(ValueError):
    """A form field the meter reads comes twice, the second past the head (where the head
    reader does not look): vLLM's parser takes the later one, so the request is not the one
    the head priced; or a part past the head is named two ways."""


class FormScan:
    """The names of a multipart body's parts, read from the whole body as it streams through.

    `feed(chunk)` raises LateField at the second part named as one of READ_FIELDS (the head
    refuses one sent twice within it: this finds the second past it), or one named two ways.
    Holds no more than a delimiter's length of a part's content and one part's headers (at
    most `cap` bytes: longer ones are not a form this reads, and raise too).
    A pure object: no I/O, no clock.
    """

    def __init__(self, boundary: bytes, cap: int) -> None:
        self._delim = b"\r\n--" + boundary
        self._cap = cap
        self._named: set[str] = set()  # the READ_FIELDS met so far
        self._buf = bytearray(b"\r\n")  # the first delimiter has no CRLF before it
        self._in_headers = False
        self.ended = False

    def feed(self, chunk: bytes) -> None:
        if self.ended:
            return  # python-multipart reads nothing past the form's end
        self._buf += chunk
        while not self.ended and self._step():
            pass

    def _step(self) -> bool:
        buf = self._buf
        if self._in_headers:
            end = buf.find(_CRLF2)
            if end < 0:
                if len(buf) > self._cap:
                    raise LateField("a part's headers are longer than the form head")
                return False
            try:
                name, _ = _disposition(bytes(buf[:end]))
            except UnclearPart as exc:
                raise LateField(str(exc)) from None
            if name in self._named:
                raise LateField(f"the form field '{name}' comes again after the file")
            if name in READ_FIELDS:
                self._named.add(name)
            del buf[: end + 4]
            self._in_headers = False
            return True
        at = buf.find(self._delim)
        if at < 0:
            del buf[: max(0, len(buf) - len(self._delim) - 1)]  # a delimiter may be cut here
            return False
        if len(buf) < at + len(self._delim) + 2:
            del buf[:at]
            return False
        after = at + len(self._delim)
        mark = bytes(buf[after : after + 2])
        # python-multipart: a delimiter is followed by CRLF (a part) or `--` (the end); any
        # other bytes after it are the part's content
        self.ended, self._in_headers = mark == b"--", mark == b"\r\n"
        del buf[: after + 2 if self.ended or self._in_headers else at + 1]
        return not self.ended


def audio_request(
    endpoint: Endpoint, head: bytes, form: FormHead, size: int | None, audio_bytes: int
) -> RequestInfo:
    """What an audio request asks, from its head: the model (None unless read before the file,
    once), a stream, the output limit; `audio_bytes` is what its hold counts seconds from."""
    fields = {} if form.duplicate else form.fields
    model = fields.get("model")
    limit = header_count(fields.get("max_completion_tokens", "").strip())
    return RequestInfo(
        endpoint=endpoint,
        body=head,
        parsed=True,
        stream=lax_true(fields.get("stream", "")),
        model=clean(model, MODEL_CHARS) if model else None,
        max_tokens=limit,
        streamed=True,
        size=size,
        audio_bytes=audio_bytes,
        ambiguous=f"the form field '{form.duplicate}' is sent twice" if form.duplicate else None,
    )


def audio_seconds(value: object) -> float | None:
    """Seconds as the server wrote them (a number, or verbose_json's string), range-checked."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    seconds = float(value)
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_AUDIO_SECONDS:
        return None
    return seconds


class AudioAdapter(OpenAIAdapter):
    """The answers of the audio routes; their requests are read by `audio_request`. No call
    counts an audio prompt (the OpenAI adapter's are for chat and completions only)."""

    def usage_from_body(
        self,
        endpoint: Endpoint,
        body: bytes,
        headers: Mapping[str, str],
        *,
        sequences: int = 1,
        per_prompt: int = 1,
    ) -> Usage:
        """Usage of a json or verbose_json answer."""
        obj = body_value(body)
        if not isinstance(obj, dict):  # response_format text (or srt, vtt): no usage in it
            return Usage(unknown_reason="no_usage")
        if obj.get("error") is not None:
            return Usage(error=error_type(obj), unknown_reason="error_response")
        rid = clean_or_none(obj.get("id"), ID_CHARS)
        usage = obj.get("usage")
        if isinstance(usage, dict) and usage.get("type") == "duration":
            raw = usage.get("seconds")
        elif "duration" in obj:  # verbose_json: the audio's duration, as a string
            raw = obj.get("duration")
        else:
            return Usage(response_id=rid, unknown_reason="no_usage")
        seconds = audio_seconds(raw)
        if seconds is None:
            return Usage(response_id=rid, unknown_reason=INVALID_USAGE)
        return Usage(audio_seconds=seconds, response_id=rid)

    def stream(self, endpoint: Endpoint, *, fast: bool = True, **options: Any) -> ChatStream:
        """vLLM's transcription.chunk / translation.chunk events read as chat chunks do: the
        deltas, and the token `usage` chunk at the end when the form asked for it."""
        return ChatStream(endpoint, fast=False, **options)
