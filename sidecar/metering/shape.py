"""The fast path for OpenAI chunks, beside `openai.ChatStream` (the reference path it must equal).

Owns: learning the shape of the commonest chunk (one choice whose text is all that changes), and
reading later chunks of that shape without decoding them: on the wire (`_TokenShape.at`, a
compiled pattern per suffix) or as text (`carries`). `FastChatStream` is `ChatStream` with these
in front; `openai.OpenAIAdapter.stream(fast=False)` is the switch the differential tests use.
Why it is kept, and what it saves per chunk: docs/performance.md.
Never: reads a chunk differently from `ChatStream`: anything not of the learnt shape is decoded.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from ..exchange import Endpoint
from .counts import compared
from .openai import DELTA_OUTPUT, ChatStream
from .sse import Event
from .stream import WireEvent, WireMeter, choice_index


class FastChatStream(WireMeter, ChatStream):
    """`ChatStream`, with chunks of the learnt shape counted on the bytes."""

    def __init__(self, endpoint: Endpoint, **options: Any) -> None:
        super().__init__(endpoint, **options)
        self._shape = _TokenShape()
        self._held = False  # the parser's `mid_event` after the last read it was fed

    def feed(self, chunk: bytes) -> bytes:
        if self.passthrough:
            return chunk
        shape = self._shape
        head = shape.head  # none until the shape is wired: then `at` finds nothing, all decode
        if head and chunk.startswith(head) and not self._held and len(chunk) <= self._max_event:
            start = len(head)
            whole = shape.fast.fullmatch(chunk, start)
            if whole is None and shape.fast is not shape.tail:
                # running usage of other members than the learnt chunk's: the general tail
                shape.fast = shape.tail
                whole = shape.tail.fullmatch(chunk, start)
            if whole is not None:
                # the usual read, `_feed_wire` in short: exactly one whole event of the shape
                if whole.end(1) > start:  # its text is not empty
                    self._s.token_events += 1
                    shape.tries = _SHAPE_TRIES
                cut = whole.start(2)
                if cut < 0:
                    return chunk
                self._choice_usage[shape.index] = chunk[cut + _USAGE_KEY : -3]
                # the match ends the chunk with the object's brace and the blank line
                return chunk[:cut] + b"}\n\n" if self._strip_chunk else chunk
        elif chunk.find(b"\n") >= len(chunk) - 2 and not (head and chunk.startswith(shape.bare)):
            # a read of one event of one line (its first line ending is its end) that is not of
            # the shape (the role chunk, the finish, the usage, [DONE]; any before the shape is
            # wired): nothing for the wire path to find, so the parser reads it whole (the
            # reference path), as `_feed_wire` would after trying
            return self._parsed(self._feed_events, chunk)
        return self._parsed(self._feed_wire, chunk)

    def _parsed(self, path: Callable[[bytes], bytes], chunk: bytes) -> bytes:
        """`path`'s bytes for the chunk, with whether the parser now holds part of an event
        (`_held`): only the parser's paths change it, so the usual read asks an attribute, not
        the parser's `mid_event`."""
        try:
            return path(chunk)
        finally:
            self._held = self._parser.mid_event

    def _wire_at(self, chunk: bytes, pos: int) -> WireEvent | None:
        return self._shape.at(chunk, pos)

    def _wire_run(self, chunk: bytes, pos: int, out: list[bytes], kept: int) -> tuple[int, int]:
        """`WireMeter._wire_run` for every event of the shape from `pos` on, in one match: a busy
        server's read holds many. `_TokenShape.run` matches them (each head the first's), within
        `max_event_bytes` of `pos` so none is longer; then their tokens are counted and their
        running usage cut on the bytes (`_wire_event` for each, in short; the last usage kept).
        An event written `data:` without the space, or with empty text, is read alone (`at`)."""
        shape = self._shape
        head = shape.head
        if not head or not chunk.startswith(head, pos):
            return super()._wire_run(chunk, pos, out, kept)
        m = shape.run.match(chunk, pos, pos + self._max_event)
        if m is None:
            return super()._wire_run(chunk, pos, out, kept)
        end = m.end()
        # each event's text is not empty (`run`'s), and each ends in `}` and the blank line,
        # found nowhere else in one (none holds a newline); the head itself, whose last byte is
        # a quote, is slower to count (the search stops at every quote)
        self._s.token_events += chunk.count(b"}\n\n", pos, end)
        shape.tries = _SHAPE_TRIES
        # nowhere else in the shape: the last usage; the brace, as the totals may hold a member
        # of that name (`{"prompt_tokens":3,"usage":1}`), whose value is never an object
        at = chunk.rfind(b',"usage":{', pos, end)
        if at >= 0:
            self._choice_usage[shape.index] = chunk[at + _USAGE_KEY : chunk.index(b"}", at) + 1]
            if self._strip_chunk:
                out += (chunk[kept:pos], _RUNNING_USAGE.sub(b"", chunk[pos:end]))
                kept = end
        return end, kept

    def _wire_event(self, data: bytes, found: WireEvent) -> bool:
        """Its token counted, its running usage kept as bytes (decoded only if it is read)."""
        end, text, cut = found
        if text:
            self._s.token_events += 1
            self._shape.tries = _SHAPE_TRIES
        if cut < 0:
            return False
        self._choice_usage[self._shape.index] = data[cut + _USAGE_KEY : end - 3]
        return self._strip_chunk

    def _on_event(self, ev: Event) -> bool:
        if ev.data is None:
            return super()._on_event(ev)  # an event over the limit is noted there
        shape, raw = self._shape, ev.raw
        found = None
        if shape.head and raw.startswith((shape.head, shape.bare)):  # as `at` starts, inline
            found = shape.at(raw, 0)
        if found is not None and found[0] == len(raw):
            # the wire path's shape, met here (an event split across reads, or after another)
            self._cut = self._wire_event(raw, found)
            return False
        # the text path, only while no chunk carried running usage: with it on, every chunk
        # ends in its usage, the text never matches, and the try only adds to the decode
        if not self._choice_usage and (carries := shape.carries(ev.data)) is not None:
            self._s.token_events += carries
            return False
        return super()._on_event(ev)

    def _read(self, ev: Event, obj: Mapping[str, Any]) -> bool:
        assert ev.data is not None  # decoded: it has data
        self._shape.learn(ev.data, obj, self._choices)
        return super()._read(ev, obj)


class _TokenShape:
    """The fast path of `ChatStream._on_event` for the commonest event on OpenAI routes: a chunk
    with one choice whose text is the only thing in it that changes.

    Relies on: a server writing those chunks with the same bytes around the text (vLLM and TGI
    do: same id, created, model, key order; only the token's text differs), and on
    `ChatStream._read` reading from a chunk only the model, id, error, usage, finish reasons and
    whether a choice carries output. The shape is learnt from a decoded chunk that sets nothing
    but the token count (its text not empty): its bytes before and after the text, the slot
    confirmed on the chunk's text or, where that cannot tell, by decoding it once more with other
    text there (`_is_the_slot`). A later chunk with that prefix and suffix whose text has no
    quote, backslash or control character tokenises exactly like the learnt one, so it decodes
    to the same object but for the text: the meter's only change is a token event when the text
    is not empty. Every other event is decoded.
    """

    __slots__ = (
        "bare",
        "fast",
        "head",
        "index",
        "members",
        "prefix",
        "run",
        "suffix",
        "tail",
        "tries",
        "wired",
    )

    def __init__(self) -> None:
        self.prefix = self.suffix = ""
        self.tries = _SHAPE_TRIES  # a failed learning costs a decode: stop on streams that vary
        self.head = b""  # the shape on the wire (see `at`); no head: not usable there
        self.bare = b""  # the head written `data:` without the space
        self.tail = self.run = self.fast = _NEVER
        self.wired = False  # `head` and `tail` made for this shape (see `wire`)
        self.index = 0  # the choice's index: running usage is kept per choice
        self.members: tuple[str, ...] = ()  # the names in the learnt chunk's running usage

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

    def learn(self, data: str, obj: Mapping[str, Any], choices: int) -> None:
        """Learn the shape of a decoded chunk that carries text and does nothing else (an empty
        text is not learnt: vLLM's role chunk, `"content":""`, is not its tokens' shape; nor is
        one of a choice the request did not ask for, which `ChatStream._read` must see)."""
        if self.tries <= 0 or (found := _text_slot(obj)) is None:
            return
        if (index := choice_index(obj["choices"][0], choices)) is None:
            return
        if isinstance(obj.get("usage"), dict) and (data := _without_running_usage(data)) == "":
            return
        usage = obj.get("usage")
        members = tuple(usage) if isinstance(usage, dict) else ()
        key, text = found
        at = data.find(marker := f'"{key}":"')
        if at < 0:
            at = data.find(marker := f'"{key}": "')
        start = at + len(marker)
        end = start + len(text)
        if at < 0 or data[start:end] != text or data[end : end + 1] != '"':
            return
        self.tries -= 1
        if _is_the_slot(data, start, end, key, text):
            suffix = data[end:]
            met_before = suffix == self.suffix or suffix in _WIRED
            self.prefix, self.suffix = data[:start], suffix
            self.index, self.members = index, members
            self.head, self.bare, self.tail, self.run = b"", b"", _NEVER, _NEVER
            self.fast = _NEVER
            self.wired = False
            if met_before:
                self.wire()

    def wire(self) -> None:
        """Make the shape's wire form, once it has been met twice (in this stream, or wired by
        another lately): a compiled pattern is worth it only for a shape that repeats (a chunk
        with logprobs has a new suffix every time)."""
        self.wired = True
        self.head, self.tail, self.run = _on_the_wire(self.prefix, self.suffix)
        self.fast = self.tail
        if self.head:
            self.bare = b"data:" + self.head[6:]
            members = self.members
            if 0 < len(members) <= _MEMBERS_MAX and all(map(_MEMBER.fullmatch, members)):
                self.fast = _named_tail(_WIRED[self.suffix][0], members)

    def at(self, chunk: bytes, pos: int) -> WireEvent | None:
        """The wire fast path: an event of the learnt shape at `pos` in the bytes, with optional
        running usage before its closing brace: (its end, whether its text is not empty, where
        its usage member starts or -1). None when it is not one.

        Relies on what `carries` relies on, in bytes: the text is printable ASCII but quote and
        backslash, or bytes of multi-byte characters (read with "replace" these never make a
        quote or a control character, nor an empty text), so the event decodes to the learnt
        chunk with other text in its slot. The usage member is the object's last, so it is the
        value a JSON reader keeps (the dict `ChatStream._read` keeps); it is what
        `openai._without_usage`
        cuts, as that regex's match must end on a brace followed by `}` and a newline, which
        only this flat member's closing brace is.
        """
        head = self.head
        if chunk.startswith(head, pos):
            start = pos + len(head)
        elif chunk.startswith(self.bare, pos):
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
# Possessive (`++`, `{0,17}+`, `*+`): what follows each part can never be a byte it takes, so
# giving one back never finds another match; without the states kept for that, the usage object
# matched in about 0.35 us against 0.5 us (once per chunk that carries running usage).
_USAGE_OBJECT = re.compile(
    rb'\{"[a-z_]++":(?:[1-9][0-9]{0,17}+|0|null)(?:,"[a-z_]++":(?:[1-9][0-9]{0,17}+|0|null))*+\}'
)
_USAGE_KEY = len(b',"usage":')
# A running usage member within events `_TokenShape.run` matched: there it is nothing else (no
# text holds a quote, and no shape with that key elsewhere gets a `run`) and its object is flat.
_RUNNING_USAGE = re.compile(rb',"usage":\{[^}]*+\}')
_RUNNING_USAGE_TEXT = re.compile(',"usage":' + _USAGE_OBJECT.pattern.decode() + r"\}$")
_NEVER = re.compile(rb"(?!)")
# The suffix part of the shapes wired lately, by any stream: (its bytes less the closing brace,
# `_tail`'s pattern for them, whether they hold a member named "usage"). A stream meeting one
# wires it at its first learnt chunk, not its second (another decode), and makes only the
# prefix's part. Bounded as the patterns' caches are: a client's shapes cannot grow it.
_WIRED: dict[str, tuple[bytes, re.Pattern[bytes], bool]] = {}
_WIRED_MAX = 64


def _without_running_usage(data: str) -> str:
    """A chunk ending in running usage, as the same chunk without it; "" for any other."""
    # the last such member: the running totals are flat, so none holds another (`_USAGE_OBJECT`)
    at = data.rfind(',"usage":{')
    if at < 0 or not _RUNNING_USAGE_TEXT.match(data, at):
        return ""
    base = data[:at] + "}"
    # another member of that name: the dict left out is not its value. A key may be written
    # with escapes (`"\\u0075sage"`), and a learnt chunk's text has none: one in `base` is in its
    # other members, which are then left as they are
    if '"usage"' in base or "\\" in base:
        return ""
    return base


# The longest suffix compiled into a wire pattern. A chunk's suffix is tens of bytes (vLLM's and
# TGI's); a long one (an echoed completion's prompt logprobs, per-token logprobs) is the client's
# to choose and rarely repeats, and compiling costs about 2 us per byte on the event loop (a
# 400 KB suffix: 0.7 s, and 2.6 MB held in `_tail`'s cache). Such shapes use the text fast path.
_WIRE_SUFFIX_MAX = 512


def _on_the_wire(prefix: str, suffix: str) -> tuple[bytes, re.Pattern[bytes], re.Pattern[bytes]]:
    """(head, tail, run) for `_TokenShape.at` and `FastChatStream._wire_run`: `data: ` and the
    prefix; the text, the suffix and optional running usage before its closing brace; events of
    the shape one after another. No head when the shape is not one `data:` line of an object."""
    known = _WIRED.get(suffix) or _wired_suffix(suffix)
    if known is None or "\n" in prefix or "\r" in prefix:
        return b"", _NEVER, _NEVER
    s, tail, named_usage = known
    p = prefix.encode("utf-8")
    # `run`'s events are cut by searching their bytes for the running usage: only where no
    # other member of that name (`"usage":null`, a choice's own) is in the shape
    run = _NEVER if named_usage or '"usage"' in prefix else _run(len(p) + 6, s)
    return b"data: " + p, tail, run


def _wired_suffix(suffix: str) -> tuple[bytes, re.Pattern[bytes], bool] | None:
    """A suffix's part of the wire form, kept in `_WIRED`; None when it can have none."""
    s = suffix.encode("utf-8")
    if not s.endswith(b"}") or b"\n" in s or b"\r" in s or len(s) > _WIRE_SUFFIX_MAX:
        return None
    known = _WIRED[suffix] = (s[:-1], _tail(s[:-1]), b'"usage"' in s)
    if len(_WIRED) > _WIRED_MAX:
        del _WIRED[next(iter(_WIRED))]  # the oldest
    return known


@functools.lru_cache(maxsize=64)
def _tail(suffix: bytes) -> re.Pattern[bytes]:
    """The part of the shape after the prefix, compiled once per suffix. A chunk's suffix holds
    no id (vLLM's: `"},"logprobs":null,"finish_reason":null}]`), so streams share it."""
    usage = rb'(?:(,"usage":)' + _USAGE_OBJECT.pattern + b")?"
    return re.compile(b"(" + _TEXT + b"*+)" + re.escape(suffix) + usage + rb"\}\n\n")


@functools.lru_cache(maxsize=64)
def _run(head: int, suffix: bytes) -> re.Pattern[bytes]:
    """Events of the shape with text (an empty one is read alone, by `at`) one after another,
    the first's head (`head` bytes, checked by the caller) repeated by reference: compiled once
    per head length and suffix, not per stream (a head holds the stream's id)."""
    event = (
        _TEXT + b"++" + re.escape(suffix) + rb'(?:,"usage":' + _USAGE_OBJECT.pattern + rb")?+\}\n\n"
    )
    return re.compile(rb"((?s:.{%d}))" % head + event + rb"(?:\1" + event + rb")*+")


# The running usage's members a tail names (`_named_tail`): vLLM's are three.
_MEMBERS_MAX = 8
_MEMBER = re.compile(r"[a-z_]+")


@functools.lru_cache(maxsize=64)
def _named_tail(suffix: bytes, members: tuple[str, ...]) -> re.Pattern[bytes]:
    """`_tail` with the running usage's members named as the learnt chunk's were, which is
    cheaper for the engine than reading each name by its class (docs/performance.md). It
    matches a part of what `_tail` matches, with the same groups; any other event of the shape
    (members added, left out, reordered) is left to `_tail` (`FastChatStream.feed`)."""
    value = rb"(?:[1-9][0-9]{0,17}+|0|null)"
    named = b",".join(b'"%s":%s' % (name.encode(), value) for name in members)
    usage = rb'(?:(,"usage":)\{' + named + rb"\})?"
    return re.compile(b"(" + _TEXT + b"*+)" + re.escape(suffix) + usage + rb"\}\n\n")


_TEXT = rb"[ !#-\[\]-~\x80-\xff]"  # a byte of `_plain` text, or of UTF-8's others; no quote


def _plain(text: str) -> bool:
    """Text a JSON string holds as it is: no quote, backslash or control character."""
    return '"' not in text and "\\" not in text and text.isprintable()


def _text_slot(obj: Mapping[str, Any]) -> tuple[str, str] | None:
    """("content" or "text", the text) of a chunk whose only effect is a token event (but for
    running usage, which `learn` takes off), else None. The text first: most chunks that are
    not learnt are the role chunk, whose text is empty."""
    choices = obj.get("choices")
    if not (isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict)):
        return None
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        key, text = "content", delta.get("content")
    else:
        key, text = "text", choice.get("text")
    if not (isinstance(text, str) and text and _plain(text)):
        return None
    if obj.get("error") is not None or compared(choice.get("finish_reason")) is not None:
        return None
    # a token's delta holds its content alone (vLLM's, TGI's): no other output to look for
    if isinstance(delta, dict) and len(delta) > 1:
        others = (delta.get(k) for k in DELTA_OUTPUT if k != "content")
        if any(others):
            return None
    return key, text


def _is_the_slot(data: str, start: int, end: int, key: str, text: str) -> bool:
    """Other text in place of `data[start:end]` (the choice's text, read as `key`) lands in the
    choice's text slot.

    The span is a whole JSON string (it follows `":"`, holds plain text and ends at a quote),
    so other plain text there changes that one string of the decoded chunk and nothing else;
    the question is whether it is the string the chunk's text was read from. Without a backslash
    in the chunk every string is written as it reads, so a key that reads `key` is written
    `"key"`, and a quote always opens or closes a string (what follows a closing one is never a
    letter): if `"key"` is in the chunk once, that is the only such key, the one the text was
    read from. Otherwise (a repeated key, one written with escapes, a key or value that holds
    the key's name quoted) the chunk is decoded again with other text there.
    """
    if "\\" not in data and data.count(f'"{key}"') == 1:
        return True
    other = "y" if text == "x" else "x"
    try:
        choice = json.loads(data[:start] + other + data[end:])["choices"][0]
        return bool((choice["delta"] if key == "content" else choice)[key] == other)
    except (ValueError, LookupError, TypeError):
        return False
