"""Byte-exact edits to JSON text: find a member of an object, replace or remove it in place.

Owns: locating the members of one JSON object (key and value spans) without building a new
document, and the edits made from those spans. Every character outside an edit is kept, so a body
is never re-serialised (`1e999`, key order, spacing and escapes survive exactly).
Never: parses more than it must, or guesses: text that is not a well-formed object gives None.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

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
