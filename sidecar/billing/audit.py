"""Audit capture of expensive requests: a record when a request's input cost or total cost is
over the limit (by default the per-request alert threshold, $0.10).

Owns: the decision (strictly above the limit), the record (access-log fields, request parameters,
prompt size, allow-listed headers, finish reasons, trace id; text only when `capture_text` is on,
truncated), the sinks (rotating JSONL, or the ledger's `audit` table), and `tollbooth audit`.
Never: delays or fails a request (a request only decides and appends; the record is made and
written by a background thread, errors counted), or captures text unless explicitly enabled.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import logging.handlers
import sqlite3
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import AuditConfig
from ..credentials import KEY_HEADERS, api_key_id
from ..exchange import Exchange, priced_model
from ..metering.pricing import PriceBook
from ..metering.sse import SSEParser
from ..telemetry.accesslog import fields
from ..telemetry.logs import BatchWriter, json_line
from ..telemetry.metrics import Metrics
from ..telemetry.thresholds import Thresholds
from ..text import clean
from .report import columns

if TYPE_CHECKING:
    from prometheus_client import Counter

    from .ledger import Ledger

log = logging.getLogger("tollbooth.audit")
# Request headers whose values a record keeps. Any other header keeps its name only: a deny-list
# cannot know every credential header (X-Auth-Token, X-Goog-Api-Key, OpenAI-Api-Key, ...).
RECORDED_HEADERS = frozenset(
    {
        "accept",
        "accept-encoding",
        "content-encoding",
        "content-length",
        "content-type",
        "host",
        "traceparent",
        "user-agent",
        "x-forwarded-for",
        "x-forwarded-proto",
        "x-real-ip",
        "x-request-id",
    }
)
REDACTED = "[redacted]"
MAX_HEADERS = 64  # names recorded per request; values are capped at 256 characters


def redact(headers: Mapping[str, str]) -> dict[str, str]:
    """The allow-listed headers' values; the API key as its id; every other value redacted."""
    out: dict[str, str] = {}
    for k, v in headers.items():
        if len(out) >= MAX_HEADERS:
            break
        # A plain str (aiohttp's header names are a subclass, which orjson refuses), made safe:
        # undecodable header bytes arrive as surrogates, which no JSON encoder takes.
        k = clean(str(k), 64)
        name = k.lower()
        if name in RECORDED_HEADERS:
            out[k] = clean(v, 256)
        elif name in KEY_HEADERS:  # Authorization, x-api-key: the key's id, never the key
            out[k] = f"{REDACTED} {api_key_id(v) or ''}".strip()
        else:
            out[k] = REDACTED
    return out


# Records waiting for the writer hold their exchange (request body included): few may wait.
MAX_PENDING = 1000
Pending = tuple[Exchange, list[str], float | None]  # (exchange, reasons, input cost)


class _Rotating(logging.handlers.RotatingFileHandler):
    def __init__(self, path: str, max_bytes: int, backups: int, errors: Counter) -> None:
        super().__init__(
            path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8", delay=True
        )  # no file until the first record
        self._errors = errors
        self.problem: str | None = None  # why the last record could not be written

    def emit(self, record: logging.LogRecord) -> None:
        self.problem = None
        super().emit(record)  # a failure comes back through handleError

    def handleError(self, record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        self.problem = f"write failed: {exc!r}"[:300]
        self._errors.inc()


class Audit:
    def __init__(
        self,
        config: AuditConfig,
        thresholds: Thresholds,
        prices: PriceBook,
        metrics: Metrics,
        ledger: Ledger | None = None,
    ) -> None:
        self.config = config
        self.prices = prices
        self.metrics = metrics
        if config.sink == "ledger" and ledger is None:  # config.validate refuses it first
            raise ValueError("audit.sink is 'ledger' but there is no ledger")
        self.ledger = ledger
        default = thresholds.request_cost_usd
        self.input_limit = default if config.input_cost_usd is None else config.input_cost_usd
        self.total_limit = default if config.total_cost_usd is None else config.total_cost_usd
        self._writer: BatchWriter[Pending] | None = None
        self._handler: _Rotating | None = None

    # --- lifecycle

    def start(self) -> None:
        if self.config.sink != "jsonl":
            return  # the ledger's writer makes and writes the records
        handler = _Rotating(
            self.config.path, self.config.max_bytes, self.config.backups, self.metrics.audit_errors
        )
        handler.setFormatter(logging.Formatter("%(message)s"))

        def write(lines: Sequence[str]) -> None:
            for line in lines:  # few lines; one at a time keeps the rotation exact
                handler.handle(logging.makeLogRecord({"msg": line, "levelno": logging.INFO}))

        self._writer = BatchWriter(
            "tollbooth-audit",
            self.line,
            write,
            max_pending=MAX_PENDING,
            on_drop=self.metrics.log_dropped.labels("audit").inc,
            on_error=self.metrics.audit_errors.inc,
        )
        self._handler = handler
        self._writer.start()

    @property
    def problem(self) -> str | None:
        """Why the last record could not be written (None when it was): for /readyz. With the
        ledger sink, the ledger's own readiness says it."""
        writer, handler = self._writer, self._handler
        return (writer and writer.problem) or (handler and handler.problem) or None

    def stop(self) -> None:
        """Write what is pending, then close the file."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.stop()
        handler, self._handler = self._handler, None
        if handler is not None:
            handler.close()

    # --- the sink

    def reasons(self, ex: Exchange) -> tuple[list[str], float | None]:
        if ex.cost is not None:  # priced once already, by the meter
            input_cost: float | None = ex.cost.input_usd
        else:  # only the input may be measured
            input_cost = self.prices.input_cost(priced_model(ex), ex.usage)
        reasons = []
        if input_cost is not None and input_cost > self.input_limit:
            reasons.append("input_cost")
        if ex.cost is not None and ex.cost.total_usd > self.total_limit:
            reasons.append("total_cost")
        return reasons, input_cost

    def check(self, ex: Exchange) -> None:
        """A sink, on the event loop: decide, count, and hand the record to a writer."""
        reasons, input_cost = self.reasons(ex)
        if not reasons:
            return
        ex.audited = True
        reason = ",".join(reasons)
        self.metrics.audit_captures.labels(ex.model, reason).inc()
        if self.config.sink == "ledger" and self.ledger is not None:
            self.ledger.append_audit(functools.partial(self.ledger_row, (ex, reasons, input_cost)))
        elif self._writer is not None:
            self._writer.put((ex, reasons, input_cost))

    def line(self, pending: Pending) -> str:
        """The JSON line of an audit record (in a writer thread)."""
        return json_line(self.record(*pending))

    def ledger_row(self, pending: Pending) -> tuple[Any, ...]:
        """The ledger's `audit` row of a record (in the ledger's writer thread)."""
        ex, reasons, _ = pending
        reason = ",".join(reasons)
        return (
            ex.started_at,
            ex.request_id,
            ex.trace_id,
            ex.model,
            ex.user_id,
            reason,
            self.line(pending),
        )

    def record(self, ex: Exchange, reasons: list[str], input_cost: float | None) -> dict[str, Any]:
        info = ex.info
        out: dict[str, Any] = {
            "time": ex.started_at,
            **fields(ex),
            "reasons": reasons,
            "input_cost_usd": input_cost,
            "limits": {"input_cost_usd": self.input_limit, "total_cost_usd": self.total_limit},
            "request": {
                "model": info.model,
                "max_tokens": info.max_tokens,
                "temperature": info.temperature,
                "n": info.n,
                "stream": info.stream,
                "tools": info.tools,
            },
            "prompt": {
                "chars": info.prompt_chars,
                "messages": info.messages,
                "tokens": ex.usage.input_tokens,
            },
            "request_headers": redact(ex.request_headers),
            "finish_reasons": list(ex.usage.finish_reasons),
        }
        if self.config.capture_text:
            n = self.config.max_text_chars
            out["text"] = {
                "prompt": prompt_text(info.body)[:n],
                "completion": completion_text(ex.response_sample or b"")[:n],
                "truncated_to_chars": n,
            }
        return out


def prompt_text(body: bytes) -> str:
    try:
        obj = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(obj, dict):
        return ""
    parts = [obj.get(k) for k in ("prompt", "inputs", "input") if isinstance(obj.get(k), str)]
    for m in obj.get("messages") or []:
        if isinstance(m, dict) and isinstance(m.get("content"), str):
            parts.append(f"{m.get('role', '')}: {m['content']}")
    return "\n".join(p for p in parts if p)


def completion_text(sample: bytes | bytearray) -> str:
    """Text from a captured response: a JSON body or an SSE stream, whichever it is."""
    with contextlib.suppress(ValueError):
        return _text_of(json.loads(sample))
    parser, parts = SSEParser(), []
    for ev in parser.feed(bytes(sample)):
        if ev.data and ev.data != "[DONE]":
            with contextlib.suppress(ValueError):  # an event that is not JSON: no text
                parts.append(_text_of(json.loads(ev.data)))
    return "".join(parts)


def _text_of(obj: Any) -> str:
    if isinstance(obj, list):
        return "".join(_text_of(o) for o in obj)
    if not isinstance(obj, dict):
        return ""
    if isinstance(obj.get("token"), dict):
        return str(obj["token"].get("text") or "")
    if isinstance(obj.get("generated_text"), str):
        return str(obj["generated_text"])
    out = []
    for c in obj.get("choices") or []:
        if isinstance(c, dict):
            msg = c.get("message") or c.get("delta") or {}
            out.append(str(msg.get("content") or "") if isinstance(msg, dict) else "")
            out.append(str(c.get("text") or ""))
    return "".join(out)


# --- tollbooth audit ------------------------------------------------------------------------------


def read_records(
    since: float, path: str | None = None, ledger: str | None = None
) -> list[dict[str, Any]]:
    if ledger and ledger.lower().startswith(("postgresql://", "postgres://")):  # the fleet's ledger
        from .fleet_ledger import audit_records

        return [json.loads(r) for r in audit_records(ledger, since)]
    if ledger:
        with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as conn:
            rows = conn.execute("SELECT record FROM audit WHERE ts >= ? ORDER BY ts", (since,))
            return [json.loads(r[0]) for r in rows]
    assert path is not None
    files = [*sorted(Path(path).parent.glob(Path(path).name + ".*"), reverse=True), Path(path)]
    out = []
    for f in files:
        if not f.exists():
            continue
        for line in f.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("time", 0) >= since:
                out.append(rec)
    return sorted(out, key=lambda r: r.get("time", 0))


AUDIT_COLUMNS = [
    "time",
    "request_id",
    "user",
    "model",
    "reasons",
    "input_tokens",
    "cost_usd",
    "trace_id",
]


def render(records: list[dict[str, Any]], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(records, indent=2)
    if not records:
        return "(no audit records in this period)"
    return columns(AUDIT_COLUMNS, [[_cell(r, c) for c in AUDIT_COLUMNS] for r in records])


def _cell(r: dict[str, Any], col: str) -> str:
    v = r.get(col)
    if col == "time" and isinstance(v, int | float):
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(v))
    if col == "reasons" and isinstance(v, list):
        return ",".join(v)
    if col == "cost_usd":
        return "unknown" if v is None else f"${v:.4f}"
    return "-" if v is None else str(v)
