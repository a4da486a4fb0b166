"""Logging, configured in one place: JSON lines (or text), trace-correlated.

Owns: the formatter, the per-request context (request, trace and span ids) that every log line
made inside a request carries, and `setup()`. Never: prints, or logs a prompt, completion or key.
"""

from __future__ import annotations

import atexit
import contextvars
import copy
import json
import logging
import logging.handlers
import queue
import re
import sys
import time
from typing import Any

# Set by the proxy for the duration of a request; read by the formatter.
REQUEST_CONTEXT: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "tollbooth_request_context", default=None
)

_STD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": _iso(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        ctx = REQUEST_CONTEXT.get()
        if ctx:
            out.update(ctx)
        access = getattr(record, "access", None)
        if access is not None:  # an access-log line: its fields, flat
            out.update(access)
        for key, value in record.__dict__.items():
            if key not in _STD_ATTRS and not key.startswith("_") and key != "access":
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        return json.dumps(out, default=str, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"{_iso(record.created)} {record.levelname:<7} {record.name}: {record.getMessage()}"
        extras = {
            k: v
            for k, v in record.__dict__.items()
            if k not in _STD_ATTRS and not k.startswith("_") and k != "access"
        }
        extras.update(getattr(record, "access", None) or {})
        ctx = REQUEST_CONTEXT.get() or {}
        pairs = " ".join(f"{k}={v}" for k, v in {**ctx, **extras}.items() if v is not None)
        if pairs:
            line += " " + pairs
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        elif record.exc_text:
            line += "\n" + record.exc_text
        return line


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"


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

    def __init__(self, q: queue.SimpleQueue[logging.LogRecord], *, copy_record: bool = True):
        super().__init__(q)
        self.copy_record = copy_record  # off where this handler is the record's only consumer

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        if self.copy_record:
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


def queued(
    handler: logging.Handler, *, copy_record: bool = True
) -> tuple[logging.Handler, logging.handlers.QueueListener]:
    """A handler for the caller's logger whose writes happen on a background thread."""
    q: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    listener = logging.handlers.QueueListener(q, handler, respect_handler_level=True)
    listener.start()
    return ContextQueueHandler(q, copy_record=copy_record), listener


def formatter(fmt: str) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else TextFormatter()


def setup(level: str = "INFO", fmt: str = "json") -> None:
    """Root logging to stderr in the chosen format, written off the event loop. Called once."""
    # Skip what no line of ours prints: the caller's file/line and thread/process names.
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(formatter(fmt))
    handler, listener = queued(stream)
    atexit.register(listener.stop)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
