"""Logging, configured in one place: JSON lines (or text), trace-correlated.

Owns: the formatter, the per-request context (request, trace and span ids) that every log line
made inside a request carries, `setup()`, and `BatchWriter`, which turns per-request records
(access log, audit) into lines on a background thread. Never: prints, or logs a prompt,
completion or key.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import contextvars
import copy
import json
import logging
import logging.handlers
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import orjson

from ..text import clean

# Set by the proxy for the duration of a request; read by the formatter.
REQUEST_CONTEXT: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "tollbooth_request_context", default=None
)

_STD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
}


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a caller added to the record (`extra=`), but an access line's own."""
    items = record.__dict__.items()
    return {
        k: v for k, v in items if k not in _STD_ATTRS and not k.startswith("_") and k != "access"
    }


def _exception(f: logging.Formatter, record: logging.LogRecord) -> str | None:
    return f.formatException(record.exc_info) if record.exc_info else record.exc_text or None


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": iso_time(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(REQUEST_CONTEXT.get() or {})
        out.update(getattr(record, "access", None) or {})  # an access-log line: its fields, flat
        out.update(_extras(record))
        if (exception := _exception(self, record)) is not None:
            out["exception"] = exception
        return json.dumps(out, default=str, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = iso_time(record.created)
        line = f"{stamp} {record.levelname:<7} {record.name}: {record.getMessage()}"
        extras = {**(REQUEST_CONTEXT.get() or {}), **_extras(record)}
        extras.update(getattr(record, "access", None) or {})
        pairs = " ".join(f"{k}={v}" for k, v in extras.items() if v is not None)
        if pairs:
            line += " " + pairs
        if (exception := _exception(self, record)) is not None:
            line += "\n" + exception
        return line


_second: tuple[int, str] = (-1, "")  # the last second formatted: lines come many a second


def iso_time(ts: float) -> str:
    global _second
    if (last := _second)[0] != (whole := int(ts)):
        last = _second = (whole, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)))
    return f"{last[1]}.{int(ts % 1 * 1000):03d}Z"


# A credential can reach a log line without our code putting it there: aiohttp logs the start of a
# malformed header line ("Authorization: Bearer <key>   ...") when it refuses a request. Keys made
# by `tollbooth keys add` (tb-...) are redacted wherever they appear.
_CREDENTIAL = re.compile(
    r"(?i)(\b(?:authorization|api-key|x-api-key|cookie)\s*[:=]\s*(?:(?:bearer|basic|token)\s+)?"
    r"|\b(?:bearer|basic)\s+|\b(?=tb-))[^\s'\"\\,]+"
)


def redact_credentials(text: str) -> str:
    return _CREDENTIAL.sub(r"\1[redacted]", text)


class ContextQueueHandler(logging.handlers.QueueHandler):
    """Hands records to a writer thread. The request context (request, trace and span ids) is
    read here, in the emitting task, because the writer thread cannot see the contextvar."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        record = copy.copy(record)
        record.message = redact_credentials(record.getMessage())
        record.msg, record.args = record.message, None
        if record.exc_info:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        if record.exc_text:
            record.exc_text = redact_credentials(record.exc_text)
        for k, v in (REQUEST_CONTEXT.get() or {}).items():
            if not hasattr(record, k):
                setattr(record, k, v)
        return record


def setup(level: str, fmt: str) -> None:
    """Root logging to stderr in the chosen format, written off the event loop. Called once."""
    # Skip what no line of ours prints: the caller's file/line and thread/process names.
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    q: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    listener = logging.handlers.QueueListener(q, stream, respect_handler_level=True)
    listener.start()
    atexit.register(listener.stop)
    root = logging.getLogger()
    root.handlers[:] = [ContextQueueHandler(q)]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


# --- per-request records written in batches ------------------------------------------------------

T = TypeVar("T")
log = logging.getLogger("tollbooth.logs")


SAFE_LINE_CHARS = 1 << 20  # a string in a line written cleaned (audit text can be long)


def json_line(obj: dict[str, Any]) -> str:
    """One JSON line. orjson: measured 5-10x faster than json.dumps on access-log lines
    (benchmarks/encoders.py); values it cannot encode are written as str(), as before. A string
    orjson refuses (a lone surrogate from a path that skipped `text.clean`) makes the line
    written cleaned: every string in it through `clean`."""
    try:
        return orjson.dumps(obj, default=str).decode()
    except orjson.JSONEncodeError:
        return orjson.dumps(_cleaned(obj), default=lambda v: _cleaned(str(v))).decode()


def _cleaned(value: Any) -> Any:
    if isinstance(value, str):
        return clean(value, SAFE_LINE_CHARS)
    if isinstance(value, dict):
        return {_cleaned(str(k)): _cleaned(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_cleaned(v) for v in value]
    return value


class BatchWriter(Generic[T]):
    """Records appended on the event loop; a thread renders them and writes the lines in batches.

    The event loop's share is one `deque.append` (atomic, no lock, nothing woken). Every
    `interval_s` the thread takes what is pending, renders each record with `render` and hands all
    the lines to `write` at once (one write, one flush). At most `max_pending` records wait: past
    that the oldest is dropped and `on_drop` counts it. `stop()` writes what is pending, then ends.
    A batch that cannot be written is written line by line: a line refused as it is goes
    cleaned, one refused even then is lost and `on_error` counts it; `problem` says why the last
    write failed (None once one succeeds), for /readyz. No exception ends the thread.
    """

    def __init__(
        self,
        name: str,
        render: Callable[[T], str],
        write: Callable[[Sequence[str]], None],
        *,
        interval_s: float = 0.1,
        max_pending: int = 100_000,
        on_drop: Callable[[], None] | None = None,
        on_error: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self._render, self._write = render, write
        self.interval_s = interval_s
        self._pending: collections.deque[T] = collections.deque(maxlen=max_pending)
        self._on_drop, self._on_error = on_drop, on_error
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.problem: str | None = None

    def put(self, record: T) -> None:
        pending = self._pending
        if len(pending) == pending.maxlen and self._on_drop is not None:
            self._on_drop()  # the append below drops the oldest
        pending.append(record)

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._drain_safely()
        self._drain_safely()

    def _drain_safely(self) -> None:
        try:
            self.drain()
        except Exception as exc:  # drain catches what it expects; the thread outlives the rest
            log.exception("%s: drain failed", self.name)
            self.problem = f"drain failed: {exc!r}"[:300]
            self._error()

    def drain(self) -> None:
        """Render and write what is pending (the writer thread; tests may call it directly)."""
        pending = self._pending
        # popleft, not a swap of the deque: an append racing with the drain is never lost
        records = [pending.popleft() for _ in range(len(pending))]
        if not records:
            return
        lines = []
        for record in records:
            try:
                lines.append(self._render(record))
            except Exception:
                log.exception("%s: a record could not be rendered", self.name)
                self._error()
        try:
            self._write(lines)
        except Exception:
            self._write_each(lines)
        else:
            self.problem = None

    def _write_each(self, lines: Sequence[str]) -> None:
        """After a failed batch: each line, cleaned when refused as it is, counted when lost."""
        for line in lines:
            with contextlib.suppress(Exception):
                self._write([line])
                self.problem = None
                continue
            try:
                self._write([clean(line, SAFE_LINE_CHARS)])
                self.problem = None
            except Exception as exc:
                log.exception("%s: a line could not be written", self.name)
                self.problem = f"write failed: {exc!r}"[:300]
                self._error()

    def _error(self) -> None:
        if self._on_error is not None:
            self._on_error()
