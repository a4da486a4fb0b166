"""The stream meter every SSE wire adapter builds on: bytes in, bytes for the client out.

Owns: the plain reference path of every SSE adapter (the upstream's bytes through the SSE parser,
each event's data decoded by `json.loads`, the object handed to the adapter's `_read`), dropping
or cutting the events the adapter says we caused, the state all readers share (model, id, error,
token events, finish reasons), the `event_too_large` rule, the wire fast path's loop
(`WireMeter`), which fast adapters use beside their reference path, and the meter of streams
whose every event carries its prompt's counts so far (`CountsStream`).
Never: touches sockets, clocks or metrics, or changes a byte the adapter did not ask to cut.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..exchange import Endpoint, Usage
from .counts import INVALID_USAGE, NO_COUNTS, Counts, error_type, summed, unmeasured
from .sse import DEFAULT_MAX_EVENT_BYTES, Event, LineParser, Oversized, SSEParser

# What a wire fast path found at a position: (the event's end, whether its text is not empty,
# where its usage member starts or -1).
WireEvent = tuple[int, bool, int]


def choice_index(obj: Mapping[str, Any], choices: int) -> int | None:
    """The choice (or prompt) an event's `index` names, read once here for every reader: an
    integer from 0 to `choices` - 1, absent being 0 (a server that streams one). None for any
    other (negative, past the choices asked for, huge, a float, a string, a bool, null): no
    choice of the request, so its counts are no choice's, neither folded into one nor added
    beside them (either lost one choice's tokens or counted some twice)."""
    index = obj.get("index", 0)
    return index if type(index) is int and 0 <= index < choices else None


def read_since(latest: Mapping[int, object], then: Mapping[int, object]) -> bool:
    """Was each of `latest`'s values (a choice's or a prompt's latest reading, replaced on every
    chunk that carries one) read after the last event over the limit? `then` is a copy of
    `latest` taken at that event: a reading taken since is another object (each is built anew,
    a decoded object or a slice of the bytes), one not taken again is the same object. Costs
    nothing per chunk: the copy is made once per event over the limit."""
    return all(value is not then.get(key) for key, value in latest.items())


@dataclass(slots=True)
class StreamState:
    model: str | None = None
    response_id: str | None = None
    error: str | None = None
    token_events: int = 0
    finish: dict[int, str] = field(default_factory=dict)


class SSEMeter:
    """Feed the upstream's bytes; get back the bytes for the client and the count of token events.

    With `strip_usage` (we injected include_usage) an event the reader says we caused is dropped;
    with `strip_chunk_usage` (we caused per-chunk usage) the usage member the reader marks is cut
    out of its event (`_cut_event`); otherwise the bytes pass through unchanged as they arrive.
    `choices` is how many choices the stream carries (to know when it is finished). `fast=False`
    parses with the reference SSE parser (`LineParser`); adapters with a fast path add theirs in
    a subclass, so this class is always the plain path: SSE parse, decode, read.
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
        fast: bool = True,
    ) -> None:
        self.endpoint = endpoint
        self._per_prompt = max(1, per_prompt)  # n: choices of one prompt have adjacent indexes
        self._strip = strip_usage
        self._strip_chunk = strip_chunk_usage
        self._rewrite = strip_usage or strip_chunk_usage
        self._cut = False  # the event just read carries a usage member to cut
        self._choices = choices
        # raw bytes only needed to rewrite; an event over max_event_bytes passes through unparsed
        parser = SSEParser if fast else LineParser
        self._parser = parser(keep_raw=self._rewrite, max_event_bytes=max_event_bytes)
        self._max_event = max_event_bytes  # the wire paths leave a longer event to the parser
        self._s = StreamState()
        # Events over the limit met so far, counted in their place among the events read (the
        # parser's `oversized` counts one as it parses a read, before the events that read
        # held ahead of it are read, so a reading stamped with that could be older than the
        # event). A reading stamped with `_skips` is after the last such event when `_skips`
        # is still that at the end.
        self._skips = 0
        self.done = False  # saw [DONE] or the wire's terminal event
        self.passthrough = False  # set after an accounting failure: forward, stop parsing

    @property
    def token_events(self) -> int:
        # an event over the limit is one the client got unread: it may have carried output
        # (SGLang's cumulative chunks outgrow the limit as the output grows), and the
        # unmeasured charge reads these as each at least one token (`Budgets.unmeasured_usd`)
        return self._s.token_events + self._skips

    def feed(self, chunk: bytes) -> bytes:
        if self.passthrough:
            return chunk
        return self._feed_events(chunk)

    def _feed_events(self, chunk: bytes) -> bytes:
        """SSE events parsed, each one read by `_on_event`."""
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
                out.append(self._cut_event(ev))  # running usage we asked for is cut out
            else:
                out.append(ev.raw)
        if not changed and not held and not self._parser.mid_event:
            return chunk  # nothing changed, and this chunk's events are exactly the chunk
        return b"".join(out)

    def _on_event(self, ev: Event) -> bool:
        """The reference path for one event: its data decoded, an error noted, the object read
        by the adapter (`_read`). True when it must not reach the client."""
        data = ev.data
        if data is None:
            if ev.__class__ is Oversized:
                self._skipped()
            return False
        if data == "[DONE]":
            self.done = True
            return False
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):  # no JSON, or nested past the parser's depth
            return False
        if not isinstance(obj, dict):
            return False
        if "error" in obj and obj.get("error") is not None:
            self._s.error = error_type(obj)
        return self._read(ev, obj)

    def _read(self, ev: Event, obj: Mapping[str, Any]) -> bool:
        """Read one decoded event (`ev` for its text and `event:` type, `obj` its data decoded);
        True to drop it, `_cut` set to cut it."""
        raise NotImplementedError

    def _cut_event(self, ev: Event) -> bytes:
        """The event's bytes without the usage the reader marked (`_cut`)."""
        return ev.raw

    def finish(self) -> tuple[bytes, Usage]:
        """The upstream stream ended. Returns bytes still held (an unterminated event) and usage."""
        tail = self._parser.finish()
        return (tail if self._rewrite else b""), self._usage()

    @property
    def finished(self) -> bool:
        """Generation is over: every choice has its finish reason (or the stream its terminal
        event). Only the usage may still be on its way."""
        return self.done or len(self._s.finish) >= self._choices

    def usage_so_far(self) -> Usage:
        """Usage of a stream the client cut short: what `finish` would say now."""
        return self._usage()

    def _skipped(self) -> None:
        """An event over the limit, unread, in its place among the events. An adapter whose
        readings are rare (usage chunks, final details) stamps each with `_skips` as it takes
        it; one whose readings replace each other on every chunk (running totals, counts so
        far) copies them here instead, once per such event, and tells later which were read
        since (`read_since`): no work per chunk either way."""
        self._skips += 1

    def _usage(self) -> Usage:
        usage = self._counted_usage()
        skipped = self._parser.oversized
        if skipped and not (
            skipped == self._skips and usage.unknown_reason is None and self._read_after_skips()
        ):
            # an event that was not read may have carried anything: a reading before it may
            # have been superseded by it, or a part of the usage joined by another
            return unmeasured(usage, "event_too_large")
        return usage

    def _read_after_skips(self) -> bool:
        """Is the usage built only from readings each of which supersedes every event before it
        (final totals, counts so far), all read after the last event over the limit (and, for
        parts added up, a part per choice, every one after it)? Then what the unread events
        carried is no part of it. False unless an adapter knows."""
        return False

    def _base(self) -> Usage:
        s = self._s
        return Usage(
            model=s.model,
            response_id=s.response_id,
            finish_reasons=tuple(s.finish[k] for k in sorted(s.finish)),
            error=s.error,
        )

    def _counted_usage(self) -> Usage:
        raise NotImplementedError


class CountsStream(SSEMeter):
    """A stream whose every event carries its prompt's (`index`) counts so far: the latest counts
    of each prompt are its usage (llama.cpp's and SGLang's native streams). The adapter reads an
    event's counts (`_counts_of`) and what else it says (`_step`)."""

    def __init__(self, endpoint: Endpoint, **options: Any) -> None:
        super().__init__(endpoint, **options)
        self._counts: dict[int, Counts] = {}  # per prompt: the latest counts read
        self._counts_then: dict[int, Counts] = {}  # `_counts` at the last event over the limit
        self._invalid = False

    def _read(self, ev: Event, obj: Mapping[str, Any]) -> bool:
        index = choice_index(obj, self._choices)
        read = self._counts_of(obj)
        if read is None or index is None:  # counts that are none, or of no prompt asked for
            self._invalid = True
            return False
        self._step(index, read, obj)
        if read[0] is not None or read[1] is not None:
            self._counts[index] = read
        return False

    def _skipped(self) -> None:
        super()._skipped()
        self._counts_then = dict(self._counts)

    def _read_after_skips(self) -> bool:
        # each prompt's counts so far supersede its earlier ones: every prompt's, read after
        # the last event over the limit (which may have been an event of any of them)
        return len(self._counts) >= self._choices and read_since(self._counts, self._counts_then)

    def _counts_of(self, obj: Mapping[str, Any]) -> Counts | None:
        """The event's counts; None when one was sent but is no count."""
        raise NotImplementedError

    def _step(self, index: int, read: Counts, obj: Mapping[str, Any]) -> None:
        """The rest of an event of prompt `index` (its counts `read`, not yet the prompt's)."""
        raise NotImplementedError

    def _counted_usage(self) -> Usage:
        base = self._base()
        if self._invalid:
            return replace(base, unknown_reason=INVALID_USAGE)
        # every prompt's counts; one asked for and never read leaves the sums unknown (one
        # NO_COUNTS stands for all: a loop over the choices asked for is the client's to size)
        counts = [*self._counts.values()]
        if len(counts) < self._choices:
            counts.append(NO_COUNTS)
        return replace(summed(counts, base.model, base.finish_reasons), error=base.error)


class WireMeter(SSEMeter):
    """The wire fast path's loop, for an adapter's fast meter: whole events of one known shape
    read on the bytes (`_wire_run`), never SSE-parsed nor decoded; everything else on the
    reference path. Differentially tested against the reference meter at every cut."""

    def _wire_at(self, chunk: bytes, pos: int) -> WireEvent | None:
        """An event of the known shape at `pos` in the bytes, or None."""
        raise NotImplementedError

    def _wire_event(self, data: bytes, found: WireEvent) -> bool:
        """An event the wire path recognised: counted; True when its usage is to be cut out."""
        raise NotImplementedError

    def _wire_run(self, chunk: bytes, pos: int, out: list[bytes], kept: int) -> tuple[int, int]:
        """Events of the known shape from `pos` read (one here; an adapter may read all that
        follow): (where they end, `kept`). What they cut is put in `out` (see `_feed_wire`).
        Returns `pos` itself when no event of the shape (short enough to be read) starts there."""
        found = self._wire_at(chunk, pos)
        if found is None or found[0] - pos > self._max_event:
            return pos, kept  # too long to be read: the parser passes it through, as in pieces
        end, _, cut = found
        if self._wire_event(chunk, found):
            out.append(chunk[kept:cut])
            kept = end - 3  # the object's closing brace and the blank line stay
        return end, kept

    def _feed_wire(self, chunk: bytes) -> bytes:
        """Whole events of one known shape (`_wire_run`), neither SSE-parsed nor decoded; any
        other event, and anything the parser holds from an earlier read, goes to the general
        path up to the end of that event.

        Relies on: `_wire_at` matching only events whose effect is known without decoding them,
        and a segment ending in a blank line leaving the parser holding nothing (its last `\\n`
        ends an empty line, which dispatches), so the next event starts where reading event by
        event would start it.
        """
        pos, size = 0, len(chunk)
        out: list[bytes] = []  # the bytes for the client, when they are not `chunk` as it came
        kept = 0  # chunk[kept:pos] goes to the client as it came
        general = self._parser.mid_event  # the parser holds part of an event: it goes on
        while pos < size:
            end = pos
            if not general:  # each position is tried once
                end, kept = self._wire_run(chunk, pos, out, kept)
            if end == pos:  # not an event of the shape, or the parser holds part of one
                end = chunk.find(b"\n\n", pos) + 2
                end = end if end > 1 else size
                got = self._feed_events(piece := chunk[pos:end])
                if got != piece:
                    out += (chunk[kept:pos], got)
                    kept = end
                general = self._parser.mid_event
            pos = end
        if not out:
            return chunk
        out.append(chunk[kept:])
        return b"".join(out)
