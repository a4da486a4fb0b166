"""Byte-exact edits to JSON text: find a member of an object, replace or remove it in place.

Owns: locating the members of one JSON object (key and value spans) without building a new
document, and the edits made from those spans. Every character outside an edit is kept, so a body
is never re-serialised (`1e999`, key order, spacing and escapes survive exactly); and the one
edit we make to a request (`with_usage_requested`: `stream_options.include_usage`, and vLLM's
running totals, spliced into UTF-8 JSON objects only).
Never: parses more than it must, or guesses: text that is not a well-formed object gives None.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .counts import lax_true

_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class Member:
    key: str
    start: int  # the key's opening quote
    value_start: int
    value_end: int  # one past the value's last character


def members(text: str, start: int = 0) -> list[Member] | None:
    """The members of the object whose `{` is the first non-space at or after `start`."""
    try:
        return _members(text, _WS.match(text, start).end())  # type: ignore[union-attr]
    except ValueError:
        return None


def _members(text: str, i: int) -> list[Member] | None:
    if not text.startswith("{", i):
        return None
    out: list[Member] = []
    i = _skip(text, i + 1)
    if text.startswith("}", i):
        return out
    while text.startswith('"', i):
        key, j = _DECODER.raw_decode(text, i)
        j = _skip(text, j)
        if not text.startswith(":", j):
            return None
        v = _skip(text, j + 1)
        _, end = _DECODER.raw_decode(text, v)
        out.append(Member(str(key), i, v, end))
        k = _skip(text, end)
        if text.startswith("}", k):
            return out
        if not text.startswith(",", k):
            return None
        i = _skip(text, k + 1)
    return None


def _skip(text: str, i: int) -> int:
    return _WS.match(text, i).end()  # type: ignore[union-attr]


def last(found: list[Member], key: str) -> Member | None:
    """The member a JSON reader keeps when a key repeats (Python's json and pydantic: the last)."""
    for m in reversed(found):
        if m.key == key:
            return m
    return None


def insert_first(text: str, brace: int, member: str) -> str:
    """`member` (`"k":v`) spliced in right after the `{` at `brace`, with a comma when needed."""
    rest = _skip(text, brace + 1)
    sep = "" if text.startswith("}", rest) else ","
    return text[: brace + 1] + member + sep + text[brace + 1 :]


def apply(text: str, edits: list[tuple[int, int, str]]) -> str:
    """Replace each span `[start, end)` by its string; spans must not overlap."""
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return text


def without(text: str, key: str) -> str | None:
    """The object in `text` without its top-level member `key` (and one comma), else None.

    Fast path for the usual case, the member last in the object (vLLM's chunks end with `usage`);
    otherwise the object is scanned member by member.
    """
    found = _last_member_fast(text, key)
    if found is not None:
        return found
    ms = members(text)
    if not ms:
        return None
    for idx, m in enumerate(ms):
        if m.key != key:
            continue
        if idx > 0:  # drop from the end of the previous value: its comma goes with this member
            return text[: ms[idx - 1].value_end] + text[m.value_end :]
        if len(ms) > 1:  # the first of several: drop up to the next key
            return text[: m.start] + text[ms[1].start :]
        return text[: m.start] + text[m.value_end :]
    return None


def _last_member_fast(text: str, key: str) -> str | None:
    """`text` without `,"key":value` when that member is the object's last, else None."""
    needle = f'"{key}":'
    at = text.rfind(needle)
    if at <= 0:
        return None
    try:
        _, end = _DECODER.raw_decode(text, _skip(text, at + len(needle)))
    except ValueError:
        return None
    if text[end:].strip() != "}":
        return None  # not the last member of the top-level object
    comma = text.rfind(",", 0, at)
    if comma < 0 or text[comma + 1 : at].strip():
        return None
    return text[:comma] + text[end:]


# --- the one edit we make to a request ----------------------------------------------------------


def with_usage_requested(
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
    # the server may now send per-chunk usage the client would not have seen: none without
    # include_usage on any server (Ollama's /v1/completions puts a zero `usage` on every chunk
    # once asked for it), and vLLM's running totals only with both
    return (
        body.encode("utf-8"),
        not asked_usage,
        not asked_usage or (want_running and not asked_running),
    )


def _splice_stream_options(text: str, obj: Mapping[str, Any], running: bool) -> str | None:
    """`text` with stream_options.include_usage (and continuous_usage_stats) set to true."""
    wanted = '"include_usage":true' + (',"continuous_usage_stats":true' if running else "")
    if "stream_options" not in obj:  # no member decodes to that key: the usual case, no scan
        return insert_first(text, text.index("{"), '"stream_options":{' + wanted + "}")
    # `members` reads the text as json.loads read `obj`: a member decodes to that key
    top = members(text)
    current = None if top is None else last(top, "stream_options")
    if current is None:
        return None
    if obj["stream_options"] is None:
        span = (current.value_start, current.value_end, "{" + wanted + "}")
        return apply(text, [span])
    inner = members(text, current.value_start)
    if inner is None:
        return None
    edits: list[tuple[int, int, str]] = []
    added: list[str] = []
    keys = ("include_usage", "continuous_usage_stats") if running else ("include_usage",)
    for key in keys:
        m = last(inner, key)
        if m is None:
            added.append(f'"{key}":true')
        elif not lax_true(obj["stream_options"].get(key)):
            edits.append((m.value_start, m.value_end, "true"))
    text = apply(text, edits)  # value edits lie after the object's `{`: it does not move
    if added:
        text = insert_first(text, current.value_start, ",".join(added))
    return text
