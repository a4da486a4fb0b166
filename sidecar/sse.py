"""Server-sent events, parsed as a pure state machine fed bytes.

Owns: splitting a byte stream into events (any of the three line endings, split anywhere across
chunks), and keeping each event's exact bytes so a caller can forward or drop whole events.
Never: touches sockets, clocks or metrics. With `keep_raw` (the default) the concatenation of
every event's `raw` plus `finish()` equals the input, byte for byte.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_EOL = re.compile(rb"\r\n|\r|\n")


@dataclass(frozen=True, slots=True)
class Event:
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
        ev = Event(raw=raw, data=data, event=self._event)
        self._event_start = self._pos
        self._data, self._event = [], None
        return ev
