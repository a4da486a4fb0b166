"""The access log: one structured line per proxied request.

Owns: the line's fields, sampling of successful requests (errors and audited requests are always
logged), and where lines go (stdout, stderr, a file), written by a background thread.
Never: logs a prompt, a completion or an API key; users appear as the metrics see them.
"""

from __future__ import annotations

import logging
import logging.handlers
import random
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from .config import LoggingConfig
from .logs import formatter, queued
from .meter import Exchange, consumed


def fields(ex: Exchange) -> dict[str, Any]:
    u = ex.usage
    return {
        "request_id": ex.request_id,
        "trace_id": ex.trace_id,
        "span_id": ex.span_id,
        "user": ex.user_id,
        "team": ex.team,
        "end_user": ex.end_user,
        "model": ex.model,
        "endpoint": ex.endpoint.value,
        "status": ex.status_label,
        "stream": ex.info.stream,
        "input_tokens": u.input_tokens,
        "cached_input_tokens": u.cached_input_tokens,
        "output_tokens": u.output_tokens,
        "cost_usd": ex.cost.total_usd if ex.cost is not None else None,
        "queue_wait_s": _round(ex.queue_s),
        "ttft_s": _round(ex.ttft_s),
        "duration_s": _round(ex.duration_s),
        "bytes_in": ex.bytes_in,
        "bytes_out": ex.bytes_out,
        "upstream": ex.upstream,
        "error": ex.error,
        "usage_unknown": _unknown_reason(ex),
    }


def _unknown_reason(ex: Exchange) -> str | None:
    """Why usage is unmeasured, by the metric's rule: a refused request consumed nothing."""
    u = ex.usage
    if not consumed(ex) or (u.input_tokens is not None and u.output_tokens is not None):
        return None
    return u.unknown_reason or "unknown"


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 6)


class AccessLog:
    def __init__(self, config: LoggingConfig, rng: Callable[[], float] = random.random) -> None:
        self.config = config
        self.rng = rng
        self.logger = logging.getLogger("tollbooth.access")
        self.logger.propagate = False
        self.logger.setLevel(logging.INFO)
        self._listener: logging.handlers.QueueListener | None = None
        self._handler: logging.Handler | None = None

    def start(self) -> None:
        target = self.config.access_log
        if target == "stdout":
            handler: logging.Handler = logging.StreamHandler(sys.stdout)
        elif target == "stderr":
            handler = logging.StreamHandler(sys.stderr)
        else:
            handler = logging.FileHandler(target, encoding="utf-8")
        handler.setFormatter(formatter(self.config.format))
        self._handler = handler
        front, self._listener = queued(handler, copy_record=False)
        self.logger.handlers[:] = [front]

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.stop()  # drains what is queued
        handler, self._handler = self._handler, None
        if handler is not None:
            handler.close()
        self.logger.handlers[:] = []

    def write(self, ex: Exchange) -> None:
        """A sink."""
        if not (ex.failed or ex.audited) and self.rng() >= self.config.sample_success:
            return
        level = logging.WARNING if ex.failed else logging.INFO
        self.logger.log(level, "request", extra={"access": fields(ex)})


def access_log_context(log: AccessLog) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        log.start()
        yield
        log.stop()

    return ctx
