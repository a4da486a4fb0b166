"""Server-sent events, parsed as a pure state machine fed bytes.

Owns: splitting a byte stream into events (any of the three line endings, split anywhere across
chunks), keeping each event's exact bytes so a caller can forward or drop whole events, and the
bound on an event's size: an event longer than `max_event_bytes` is not parsed but passed through
as it comes, in pieces with no data, the first an `Oversized` (`oversized` counts them), holding
nothing.
Never: touches sockets, clocks or metrics, holds more than `max_event_bytes` plus one chunk, or
reads a byte more than a bounded number of times (a long event split across many reads costs
time linear in its length). With `keep_raw` (the default) the concatenation of every event's
`raw` plus `finish()` equals the input, byte for byte.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from ..config import MeteringConfig

_EOL = re.compile(rb"\r\n|\r|\n")
# A blank line: a line ending right after another (a CR followed by LF is one ending, not two).
_BLANK = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r|\n)")
_CR_BLANK = b"\r\r"  # `_skip` state: the event ended at a CR; an LF right after is still its
DEFAULT_MAX_EVENT_BYTES = MeteringConfig.max_event_bytes


class Event(NamedTuple):  # a tuple: built once per event, the cheapest record Python has
    # the event's bytes, including the blank line that ended it; for an event over the size
    # limit, a piece of it as it came (its data and event None)
    raw: bytes
    data: str | None  # data lines joined by "\n"; None when the event had no data field
    event: str | None  # the `event:` field, if any


class Oversized(Event):
    """The first piece of an event over the size limit (`SSEParser.oversized` counts these), in
    its place among the events: a reader learns where in the stream the unread event was."""

    __slots__ = ()


class SSEParser:
    """Feed bytes, get complete events. An event is complete at its terminating blank line."""

    __slots__ = (
        "_buf",
        "_data",
        "_event",
        "_event_start",
        "_keep_raw",
        "_max",
        "_pos",
        "_scanned",
        "_skip",
        "oversized",
    )

    def __init__(
        self, *, keep_raw: bool = True, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES
    ) -> None:
        # keep_raw=False: events carry b"" as `raw`, for callers that forward chunks unchanged.
        self._keep_raw = keep_raw
        self._max = max_event_bytes
        self._buf = bytearray()
        self._pos = 0  # start of the next unread line
        self._scanned = 0  # `_buf[_pos:_scanned]` was searched: it holds no line ending
        self._event_start = 0  # start of the event being built
        self._data: list[str] = []
        self._event: str | None = None
        # Passing an event over the limit through: None when not; else how the bytes seen so far
        # ended: b"" inside a line, b"\n" after a line ending, b"\r" after a CR, `_CR_BLANK`.
        self._skip: bytes | None = None
        self.oversized = 0  # events over the limit, passed through unparsed

    def feed(self, chunk: bytes) -> list[Event]:
        if self._skip is not None:
            return self._skipping(chunk)
        if b"\r" in chunk:
            return self._feed_lines(chunk)
        if not self._buf:
            return self._feed_lf(chunk)
        # An event began in an earlier chunk: the general path reads up to the first `\n\n`
        # (reading in two pieces is reading in one). The second `\n` of it is a blank line that
        # dispatches, so nothing is held after it and the fast path can take the rest.
        end = chunk.find(b"\n\n") + 2
        if end < 2:
            return self._feed_lines(chunk)
        return self._feed_lines(chunk[:end]) + self._feed_lf(chunk[end:])

    def _feed_lf(self, chunk: bytes) -> list[Event]:
        """The fast path: whole events ended by `\n\n`, each found with one search.

        Relies on: nothing held from earlier chunks (an empty buffer: no event half built) and
        no CR in the chunk (`\n` is the only line ending). Then a segment up to the next `\n\n`
        that is not empty and does not start with `\n` is one event made of non-empty lines,
        which is what `_feed_lines` would make of it. At anything else (a blank line ending an
        event without fields, an unterminated rest) the rest of the chunk goes to `_feed_lines`,
        with the parser in the state reading line by line would have left it in.
        """
        last = len(chunk) - 2
        if (
            chunk.find(b"\n") == last
            and chunk[-1:] == b"\n"
            and chunk.startswith(b"data:")
            and len(chunk) <= self._max
        ):
            # the commonest chunk of all: one event, one data line (its raw is the chunk)
            data = chunk[6 if chunk[5] == 0x20 else 5 : last].decode("utf-8", "replace")
            return [Event(chunk if self._keep_raw else b"", data, None)]
        events: list[Event] = []
        pos = 0
        while (end := chunk.find(b"\n\n", pos)) > pos and chunk[pos] != 0x0A:
            raw = chunk[pos : end + 2] if self._keep_raw else b""
            if end + 2 - pos > self._max:
                self.oversized += 1
                events.append(Oversized(raw, None, None))  # too long: passed through unparsed
            elif chunk.startswith(b"data:", pos) and chunk.find(b"\n", pos, end) < 0:
                start = pos + 6 if chunk[pos + 5] == 0x20 else pos + 5  # one data line: usual
                events.append(Event(raw, chunk[start:end].decode("utf-8", "replace"), None))
            else:
                for line in chunk[pos:end].split(b"\n"):
                    self._field(line)
                text = "\n".join(self._data) if self._data else None
                event, self._data, self._event = self._event, [], None
                events.append(Event(raw, text, event))
            pos = end + 2
        if pos < len(chunk):
            events += self._feed_lines(chunk[pos:])
        return events

    def _feed_lines(self, chunk: bytes) -> list[Event]:
        """The general path: any line endings, events split anywhere across chunks.

        Each byte is searched for a line ending once: a line that spans reads is searched on from
        where the last search ended (`_scanned`), never from its start again. An event that grows
        past the limit is handed back as it is and the rest of it passed through (`_give_up`).
        """
        if self._skip is not None:
            return self._skipping(chunk)
        self._buf += chunk
        events: list[Event] = []
        buf = self._buf
        scan = self._scanned
        while True:
            m = _EOL.search(buf, max(self._pos, scan))
            if m is None:
                scan = len(buf)
                break
            if m.end() == len(buf) and m.end() - m.start() == 1 and buf[m.start()] == 0x0D:
                scan = m.start()  # a lone CR at the end may be the first half of CRLF: wait
                break
            line = bytes(buf[self._pos : m.start()])
            self._pos = m.end()
            if line:
                self._field(line)
                continue
            events.append(self._dispatch())
        if self._event_start:
            del buf[: self._event_start]
            self._pos -= self._event_start
            scan -= self._event_start
            self._event_start = 0
        self._scanned = scan
        if len(buf) > self._max:  # what is held is all one event: too long to parse
            events.append(self._give_up())
        return events

    def _give_up(self) -> Event:
        """The event being read is over the limit: hand back its bytes so far, unparsed, and pass
        the rest of it through as it comes (`_skipping`), holding nothing."""
        buf = self._buf
        rest = bytes(buf[self._pos :])  # the line being read: no line ending, but a last CR
        if not rest:
            self._skip = b"\n"  # it ended with a whole line ending
        elif rest == b"\r":
            self._skip = _CR_BLANK  # a CR after a line ending: the blank line that ends it
        else:
            self._skip = b"\r" if rest.endswith(b"\r") else b""
        raw = bytes(buf) if self._keep_raw else b""
        buf.clear()
        self._pos = self._scanned = self._event_start = 0
        self._data, self._event = [], None
        self.oversized += 1
        return Oversized(raw, None, None)

    def _skipping(self, chunk: bytes) -> list[Event]:
        """Bytes of an event over the limit: passed through up to its blank line, in pieces with
        no data; what follows is parsed as usual."""
        end = self._skipped_to(chunk) if chunk else -1
        if end < 0:
            return [Event(chunk, None, None)] if self._keep_raw and chunk else []
        self._skip = None
        head = [Event(chunk[:end], None, None)] if self._keep_raw and end else []
        return head + self.feed(chunk[end:]) if end < len(chunk) else head

    def _skipped_to(self, chunk: bytes) -> int:
        """Where the blank line that ends the skipped event ends in `chunk`, or -1 (the state
        for the next chunk kept in `_skip`). One search of the chunk: linear."""
        before = self._skip
        assert before is not None
        if before == _CR_BLANK:
            return 1 if chunk.startswith(b"\n") else 0
        if before and chunk[:1] in (b"\r", b"\n"):  # a blank line that began in the last chunk
            m = _BLANK.match(before + chunk[:3])
            if m is not None:
                return self._ended_at(chunk, m.end() - 1)
        m = _BLANK.search(chunk)
        if m is not None:
            return self._ended_at(chunk, m.end())
        last = chunk[-1:]
        self._skip = last if last in (b"\r", b"\n") else b""
        return -1

    def _ended_at(self, chunk: bytes, end: int) -> int:
        if end == len(chunk) and chunk[end - 1] == 0x0D:
            self._skip = _CR_BLANK  # a CR that ends it: the LF of a CRLF may follow
            return -1
        return end

    def finish(self) -> bytes:
        """The stream ended: return the bytes of an unterminated last event (never dispatched)."""
        tail = bytes(self._buf)
        self._buf.clear()
        self._pos = self._scanned = self._event_start = 0
        self._data, self._event = [], None
        self._skip = None
        return tail

    @property
    def pending(self) -> int:
        """Bytes held that do not yet form a complete event."""
        return len(self._buf)

    @property
    def mid_event(self) -> bool:
        """An event has begun and not ended: bytes are held, or one too long is passing through."""
        return bool(self._buf) or self._skip is not None

    def _field(self, line: bytes) -> None:
        if line.startswith(b":"):
            return  # comment
        name, sep, value = line.partition(b":")
        if sep and value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            self._data.append(value.decode("utf-8", "replace"))
        elif name == b"event":
            self._event = value.decode("utf-8", "replace")

    def _dispatch(self) -> Event:
        raw = bytes(self._buf[self._event_start : self._pos]) if self._keep_raw else b""
        ev: Event
        if self._pos - self._event_start > self._max:  # too long: passed through unparsed
            self.oversized += 1
            ev = Oversized(raw, None, None)
        else:
            data = "\n".join(self._data) if self._data else None
            ev = Event(raw, data, self._event)
        self._event_start = self._pos
        self._data, self._event = [], None
        return ev


class LineParser(SSEParser):
    """The reference parser: every chunk read line by line (`_feed_lines`), never by the `\n\n`
    fast path. What `SSEParser` must equal, event for event; a meter built with `fast=False`
    parses with it."""

    __slots__ = ()

    def feed(self, chunk: bytes) -> list[Event]:
        return self._feed_lines(chunk)
