"""Numbers and JSON read from the upstream's and the client's bytes, as the server reads them.

Owns: the one UTF-8 rule for decoding JSON bodies (`parse`, `loads`), the token-count ceiling
(`MAX_TOKEN_COUNT`) and `INVALID_USAGE`, the range checks every count passes (`count`,
`header_count`), lax booleans as vLLM reads them, error types, and the sums of usage parts
(`summed`: the usage of results that each carry their prompt's `Counts`).
Every wire adapter reads its numbers through these.
Never: invents a count: one that cannot be read is None.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..exchange import Usage
from ..text import REASON_CHARS, clean

# The largest token count read from an upstream, for any one count of one request and for a
# stream's totals: 1,000 times the longest context any server offers, and small enough that a
# count times any price stays a finite float and an exact micro-dollar amount (budget.MAX_MICROS).
# A count above it, negative, fractional, boolean or not a number is invalid usage: the usage of
# that response is unknown (INVALID_USAGE), charged its hold, never an exception (docs/budgets.md).
MAX_TOKEN_COUNT = 10**9
INVALID_USAGE = "invalid_usage"

# (input, output, cached input) of one prompt's result, each read with `count`: what llama.cpp and
# SGLang send in every result and every stream event.
Counts = tuple[int | None, int | None, int | None]
NO_COUNTS: Counts = (None, None, None)


def body_value(body: bytes) -> Any:
    """The JSON value of a complete response body; None for an empty or undecodable one (the
    adapters then report `no_usage`, or read what they can)."""
    try:
        return loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        return None


def body_results(body: bytes) -> list[dict[str, Any]] | None:
    """The results of a complete body that is one object or a list of them (one per prompt);
    None for an empty or undecodable body, or one holding anything else."""
    obj = body_value(body)
    given = obj if isinstance(obj, list) else [obj]
    results = [r for r in given if isinstance(r, dict)]
    return results if results and len(results) == len(given) else None


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
    if text is None or not _read_as_utf8(data):
        text = utf8_text(data)
    return json.loads(data) if text is None else _loads_text(text)


_DECODER = json.JSONDecoder()  # json.loads' own decoder: no hooks


def _loads_text(text: str) -> Any:
    """`json.loads(text)`. A body opening with `{` or `[` and read to its last character is what
    `loads` returns after finding no leading whitespace and before finding no trailing data:
    read by `raw_decode` at once, without `loads`' and `decode`'s frames and their two
    whitespace scans (about 4k instructions a response). Anything else goes to `json.loads`."""
    if text.startswith(("{", "[")):
        obj, end = _DECODER.raw_decode(text)
        if end == len(text):
            return obj
    return json.loads(text)


def _read_as_utf8(data: bytes) -> bool:
    """Does `json.loads(data)` read the bytes as UTF-8? Not when they open with a BOM, nor with a
    NUL in their first four (it reads those as UTF-16 or UTF-32)."""
    return not data.startswith(b"\xef\xbb\xbf") and b"\0" not in data[:4]


def utf8_text(data: bytes) -> str | None:
    """The bytes as the text `json.loads` reads them from, when that is UTF-8; else None (a BOM,
    UTF-16/32, or bytes that are not UTF-8: never edited, only read)."""
    if not _read_as_utf8(data):
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:  # not contextlib.suppress: a context manager per request
        return None


def parse(body: bytes) -> tuple[str | None, object]:
    """(the body as UTF-8 text or None, the parsed JSON or None): `utf8_text` and `loads`.

    A body in another encoding is still read (the server reads UTF-16 and UTF-32 JSON too), but
    its text is None so it is never changed.
    """
    text = utf8_text(body)
    try:
        # `loads(body, text)`, without checking again what `utf8_text` just checked
        obj = (json.loads(text) if text is not None else loads(body)) if body else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        obj = None
    return text, obj


_TRUE_STRINGS = frozenset({"1", "on", "t", "true", "y", "yes"})


def lax_true(value: object) -> bool:
    """True as vLLM's request models read a boolean (pydantic's lax mode): `true`, `1`, `1.0`, or
    one of "1", "on", "t", "true", "y", "yes" in any case. Anything else is false or refused."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return value == 1
    return isinstance(value, str) and value.lower() in _TRUE_STRINGS


def error_type(obj: Mapping[str, Any]) -> str:
    """The error type of a vLLM (`{"error": {...}}`) or TGI (`{"error", "error_type"}`) body."""
    err = obj.get("error")
    if isinstance(err, dict):
        return _reason_text(err.get("type") or err.get("code"))
    return _reason_text(obj.get("error_type"))


def count(v: object) -> int | None:
    """A count in JSON: an integer from 0 to MAX_TOKEN_COUNT (not a bool, a float or a string)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v if 0 <= v <= MAX_TOKEN_COUNT else None
    return None


def header_count(v: str | None) -> int | None:
    """A count in a header (or a form field): its ASCII digits, from 0 to MAX_TOKEN_COUNT."""
    if v is not None and v.isascii() and v.isdigit() and len(v) < 19:
        return count(int(v))
    return None


def invalid(raw: object, read: int | None) -> bool:
    """A count was sent (not absent, not null) but is none we can use."""
    return raw is not None and read is None


def counts_of(raw: tuple[object, object, object]) -> Counts | None:
    """(input, output, cached input) as sent, read as `Counts`; None when one was sent but is no
    count, or the cached input (a part of the input) is more than the input or of none."""
    read = (count(raw[0]), count(raw[1]), count(raw[2]))
    if any(invalid(v, n) for v, n in zip(raw, read, strict=True)):
        return None
    if read[2] is not None and (read[0] is None or read[2] > read[0]):
        return None
    return read


def bounded(u: Usage) -> Usage:
    """A stream's totals (the sum of several usage objects) under the same ceiling."""
    counts = (u.input_tokens, u.output_tokens, u.cached_input_tokens, u.reasoning_tokens)
    if all(n is None or n <= MAX_TOKEN_COUNT for n in counts):
        return u
    return unmeasured(u, INVALID_USAGE)


def unmeasured(u: Usage, reason: str) -> Usage:
    """`u` with no token count at all (the parts, cached and reasoning, go with the whole), for
    `reason`: the one way usage is made unknown once read."""
    return replace(
        u,
        input_tokens=None,
        output_tokens=None,
        cached_input_tokens=None,
        reasoning_tokens=None,
        unknown_reason=reason,
    )


def number(v: object) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def compared(v: object) -> str | None:
    """A string the code only compares (an event's type): never kept, so not cleaned."""
    return v if isinstance(v, str) and v else None


def _reason_text(v: object) -> str:
    """An error type as safe, bounded text ("error" when there is none)."""
    return clean(v if isinstance(v, str) else str(v), REASON_CHARS) if v else "error"


def total(values: Iterable[int | None]) -> int | None:
    acc = 0
    for v in values:
        if v is None:
            return None
        acc += v
    return acc


def summed(counts: Sequence[Counts | None], model: str | None, reasons: tuple[str, ...]) -> Usage:
    """The usage of results taken together (one per prompt, each with its `Counts`, None where
    they were invalid): invalid usage if any was, or if their totals pass the ceiling."""
    read = [c for c in counts if c is not None]
    if len(read) != len(counts):
        return Usage(unknown_reason=INVALID_USAGE)
    inp, out = total(c[0] for c in read), total(c[1] for c in read)
    return bounded(
        Usage(
            input_tokens=inp,
            output_tokens=out,
            cached_input_tokens=total(c[2] for c in read),
            model=model,
            finish_reasons=reasons,
            unknown_reason=None if inp is not None and out is not None else "no_usage",
        )
    )


def total_present(values: Iterable[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None
