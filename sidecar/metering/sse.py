"""Server-sent events, parsed as a pure state machine fed bytes.

Owns: splitting a byte stream into events (any of the three line endings, split anywhere across
chunks), and keeping each event's exact bytes so a caller can forward or drop whole events.
Never: touches sockets, clocks or metrics. With `keep_raw` (the default) the concatenation of
every event's `raw` plus `finish()` equals the input, byte for byte.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_EOL = re.compile(rb"\r\n|\r|\n")


class Event(NamedTuple):  # a tuple: built once per event, the cheapest record Python has
    raw: bytes  # the event's bytes, including the blank line that ended it
    data: str | None  # data lines joined by "\n"; None when the event had no data field
    event: str | None  # the `event:` field, if any


class SSEParser:
    """Feed bytes, get complete events. An event is complete at its terminating blank line."""

    __slots__ = ("_buf", "_data", "_event", "_event_start", "_keep_raw", "_pos")

    def __init__(self, *, keep_raw: bool = True) -> None:
        # keep_raw=False: events carry b"" as `raw`, for callers that forward chunks unchanged.
        self._keep_raw = keep_raw
        self._buf = bytearray()
        self._pos = 0  # start of the next unread line
        self._event_start = 0  # start of the event being built
        self._data: list[str] = []
        self._event: str | None = None

    def feed(self, chunk: bytes) -> list[Event]:
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
        if chunk.find(b"\n") == last and chunk[-1:] == b"\n" and chunk.startswith(b"data:"):
            # the commonest chunk of all: one event, one data line (its raw is the chunk)
            data = chunk[6 if chunk[5] == 0x20 else 5 : last].decode("utf-8", "replace")
            return [Event(chunk if self._keep_raw else b"", data, None)]
        events: list[Event] = []
        pos = 0
        while (end := chunk.find(b"\n\n", pos)) > pos and chunk[pos] != 0x0A:
            if chunk.startswith(b"data:", pos) and chunk.find(b"\n", pos, end) < 0:
                start = pos + 6 if chunk[pos + 5] == 0x20 else pos + 5  # one data line: usual
                text: str | None = chunk[start:end].decode("utf-8", "replace")
                event = None
            else:
                for line in chunk[pos:end].split(b"\n"):
                    self._field(line)
                text = "\n".join(self._data) if self._data else None
                event, self._data, self._event = self._event, [], None
            events.append(Event(chunk[pos : end + 2] if self._keep_raw else b"", text, event))
            pos = end + 2
        if pos < len(chunk):
            events += self._feed_lines(chunk[pos:])
        return events

    def _feed_lines(self, chunk: bytes) -> list[Event]:
        """The general path: any line endings, events split anywhere across chunks."""
        self._buf += chunk
        events: list[Event] = []
        buf = self._buf
        while True:
            m = _EOL.search(buf, self._pos)
            if m is None:
                break
            if m.end() == len(buf) and m.end() - m.start() == 1 and buf[m.start()] == 0x0D:
                break  # a lone CR at the end may be the first half of CRLF: wait for more
            line = bytes(buf[self._pos : m.start()])
            self._pos = m.end()
            if line:
                self._field(line)
                continue
            events.append(self._dispatch())
        if self._event_start:
            del buf[: self._event_start]
            self._pos -= self._event_start
            self._event_start = 0
        return events

    def finish(self) -> bytes:
        """The stream ended: return the bytes of an unterminated last event (never dispatched)."""
        tail = bytes(self._buf)
        self._buf.clear()
        self._pos = self._event_start = 0
        self._data, self._event = [], None
        return tail

    @property
    def pending(self) -> int:
        """Bytes held that do not yet form a complete event."""
        return len(self._buf)

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
        data = "\n".join(self._data) if self._data else None
        ev = Event(raw, data, self._event)
        self._event_start = self._pos
        self._data, self._event = [], None
        return ev
