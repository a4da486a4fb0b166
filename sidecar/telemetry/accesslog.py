"""The access log: one structured line per proxied request.

Owns: the line's fields, sampling of successful requests (errors and audited requests are always
logged), and where lines go (stdout, stderr, a file). A request's share is taking its fields (a
few scalars) and one append; a background thread formats the lines and writes them in batches.
Never: logs a prompt, a completion or an API key; users appear as the metrics see them.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from ..config import LoggingConfig
from ..exchange import Exchange, consumed, measured
from .logs import BatchWriter, iso_time, json_line
from .metrics import Metrics

LOGGER = "tollbooth.access"  # the `logger` of every line, as if written through logging
# What a request appends: its time, whether it failed, and `snapshot(ex)`.
Snapshot = tuple[Any, ...]
Record = tuple[float, bool, Snapshot]


def snapshot(ex: Exchange) -> Snapshot:
    """What the line needs, taken on the event loop: a tuple of scalars and two frozen objects
    (usage, cost); the dict and the rounding are left to the writer thread (`fields_of`)."""
    return (
        ex.request_id,
        ex.trace_id,
        ex.span_id,
        ex.user_id,
        ex.team,
        ex.end_user,
        ex.model,
        ex.endpoint,
        ex.status_label,
        ex.info.stream,
        ex.usage,
        ex.cost,
        ex.queue_s,
        ex.ttft_s,
        ex.duration_s,
        ex.bytes_in,
        ex.bytes_out,
        ex.upstream,
        ex.error,
        _unknown_reason(ex),
    )


_NO_HEAD: dict[str, Any] = {}


def fields_of(s: Snapshot, head: dict[str, Any] = _NO_HEAD) -> dict[str, Any]:
    """The record's fields, after `head`'s (one dict, made in one step)."""
    rid, trace, span, user, team, end_user, model, endpoint, status, stream, u, cost, *rest = s
    queue, ttft, dur, bytes_in, bytes_out, upstream, error, unknown = rest
    return {
        **head,
        "request_id": rid,
        "trace_id": trace,
        "span_id": span,
        "user": user,
        "team": team,
        "end_user": end_user,
        "model": model,
        "endpoint": endpoint.label,  # the value as a plain str (`.value` is a property)
        "status": status,
        "stream": stream,
        "input_tokens": u.input_tokens,
        "cached_input_tokens": u.cached_input_tokens,
        "output_tokens": u.output_tokens,
        "reasoning_tokens": u.reasoning_tokens,
        "audio_seconds": u.audio_seconds,
        "cost_usd": cost.total_usd if cost is not None else None,
        "queue_wait_s": _round(queue),
        "ttft_s": _round(ttft),
        "duration_s": _round(dur),
        "bytes_in": bytes_in,
        "bytes_out": bytes_out,
        "upstream": upstream,
        "error": error,
        "usage_unknown": unknown,
    }


def _unknown_reason(ex: Exchange) -> str | None:
    """Why usage is unmeasured, by the metric's rule: a refused request consumed nothing."""
    u = ex.usage
    if not consumed(ex) or measured(u):
        return None
    return u.unknown_reason or "unknown"


def fields(ex: Exchange) -> dict[str, Any]:
    return fields_of(snapshot(ex))


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 6)


def render_json(record: Record) -> str:
    """The JSON line: `line_of`'s dict, encoded."""
    return json_line(line_of(record))


def line_of(record: Record) -> dict[str, Any]:
    """The line's dict: the head (time, level, logger, message), then `fields_of`'s fields, made
    as one dict (the head merged into a copy of `fields_of`'s dict cost about 1 us a line more,
    benchmarks/writers.py); tests/test_logs_audit.py checks it equals that merge."""
    ts, failed, s = record
    level = "warning" if failed else "info"
    return fields_of(
        s, {"time": iso_time(ts), "level": level, "logger": LOGGER, "message": "request"}
    )


def render_text(record: Record) -> str:
    ts, failed, snap = record
    f = fields_of(snap)
    line = f"{iso_time(ts)} {'WARNING' if failed else 'INFO':<7} {LOGGER}: request"
    pairs = " ".join(f"{k}={v}" for k, v in f.items() if v is not None)
    return f"{line} {pairs}" if pairs else line


class AccessLog:
    def __init__(
        self,
        config: LoggingConfig,
        rng: Callable[[], float] = random.random,
        metrics: Metrics | None = None,
    ) -> None:
        self.config = config
        self.rng = rng
        self.metrics = metrics
        self._file: TextIO | None = None
        self._writer: BatchWriter[Record] | None = None

    def start(self) -> None:
        target = self.config.access_log
        if target in ("stdout", "stderr"):
            stream = sys.stdout if target == "stdout" else sys.stderr
        else:
            stream = self._file = open(target, "a", encoding="utf-8")  # noqa: SIM115 - closed in stop()

        def write(lines: Sequence[str]) -> None:
            stream.write("\n".join(lines) + "\n")
            stream.flush()

        render = render_json if self.config.format == "json" else render_text
        dropped = self.metrics.log_dropped.labels("access").inc if self.metrics else None
        errors = self.metrics.access_log_errors.inc if self.metrics else None
        self._writer = BatchWriter(
            "tollbooth-access-log", render, write, on_drop=dropped, on_error=errors
        )
        self._writer.start()

    @property
    def problem(self) -> str | None:
        """Why the last line could not be written (None when it was): for /readyz."""
        return self._writer.problem if self._writer is not None else None

    def stop(self) -> None:
        """Write what is pending, then close."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.stop()
        file, self._file = self._file, None
        if file is not None:
            file.close()

    def write(self, ex: Exchange) -> None:
        """A sink: on the event loop, so it only takes a snapshot and appends it."""
        failed = ex.failed
        if not (failed or ex.audited) and self.rng() >= self.config.sample_success:
            return
        if self._writer is not None:
            self._writer.put((time.time(), failed, snapshot(ex)))
