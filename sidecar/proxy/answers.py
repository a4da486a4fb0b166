"""The sidecar's own answers to a request it will not or cannot forward, as plain functions.

Owns: for each such case the status, error type and message (the body's shape is
`headers.error_response`'s), the metric it counts in, the upstream failure's log line, and whether
the connection closes (an answer sent before the body was read closes it).
Never: reads a body, forwards anything, or answers a request the upstream could serve.
"""

from __future__ import annotations

import logging

import aiohttp
from aiohttp import web

from ..exchange import Exchange
from ..telemetry.metrics import Metrics
from .headers import error_response
from .identity import Unauthorized
from .memory import TOTAL, NoRoom

log = logging.getLogger("tollbooth.proxy")

# A request refused for want of memory may try again this much later: held bodies are read,
# parsed and answered within seconds, or cut off at server.body_timeout_s.
MEMORY_RETRY_AFTER_S = 1.0


def unread(
    metrics: Metrics, request: web.Request, exc: Exception, max_body: int, body_timeout: float
) -> web.Response:
    """The answer to a request whose body or identity could not be read."""
    if isinstance(exc, NoRoom):
        return no_room(metrics, request, exc)
    if isinstance(exc, Unauthorized):
        return unauthorized(metrics, exc)
    if isinstance(exc, TimeoutError):
        return too_slow(metrics, body_timeout)
    # TooLarge, or aiohttp's own
    return closes_unread(
        request, 413, "request_too_large", f"request body exceeds {max_body} bytes"
    )


def too_slow(metrics: Metrics, body_timeout: float) -> web.Response:
    """408, and the connection closed: the rest of the body may still come."""
    metrics.connections_cut.labels("proxy", "body_timeout").inc()
    resp = error_response(
        408,
        "request_timeout",
        f"the request body did not arrive within {body_timeout:g} s of its headers",
    )
    resp.force_close()
    return resp


def no_room(metrics: Metrics, request: web.Request, exc: NoRoom) -> web.Response:
    """503 + Retry-After: the memory for request bodies (or this key's share) is taken; 413
    for a body that needs more than the limit itself. Its bytes are never read."""
    per_key = exc.reason != TOTAL
    what = "this key's share of " if per_key else ""
    key = "server.max_buffered_request_bytes" + ("_per_key" if per_key else "")
    if exc.never:
        metrics.requests_refused.labels(exc.reason + "_never").inc()
        return closes_unread(
            request,
            413,
            "request_too_large",
            f"reading and parsing this body needs more memory than {key} allows",
        )
    metrics.requests_refused.labels(exc.reason).inc()
    return closes_unread(
        request,
        503,
        "request_memory_full",
        f"{what}the memory for request bodies is in use ({key}); retry later",
        MEMORY_RETRY_AFTER_S,
    )


def encoded(metrics: Metrics, request: web.Request) -> web.Response:
    """415: vLLM and TGI read only uncompressed JSON; a compressed body is never read,
    decoded or forwarded (its bytes could decode to far more than they are)."""
    metrics.requests_refused.labels("content_encoding").inc()
    return closes_unread(
        request,
        415,
        "unsupported_content_encoding",
        "request bodies with a Content-Encoding are not accepted on metered routes (the "
        "inference server reads uncompressed JSON only): send the body uncompressed",
    )


def unauthorized(metrics: Metrics, exc: Unauthorized) -> web.Response:
    metrics.auth_rejections.labels(str(exc).split()[0]).inc()
    return error_response(401, "invalid_api_key", str(exc))


def upstream_failed(
    metrics: Metrics, upstream: str, ex: Exchange | None, exc: TimeoutError | aiohttp.ClientError
) -> web.Response:
    """504 when the upstream did not answer in time, else 502."""
    timeout = isinstance(exc, TimeoutError)  # aiohttp's timeouts are TimeoutErrors too
    status, kind = (504, "upstream_timeout") if timeout else (502, "upstream_unreachable")
    log.warning("upstream %s: %s %r", upstream, kind, exc)
    metrics.upstream_errors.labels(kind).inc()
    if ex is not None:
        ex.status, ex.error = status, kind
    what = "did not answer in time" if timeout else "could not be reached"
    return error_response(status, kind, f"the inference server {what}")


def closes_unread(
    request: web.Request, status: int, err_type: str, message: str, retry_after: float | None = None
) -> web.Response:
    """An answer sent before the whole body was read closes the connection: the rest of the
    body may still be on its way, and is never read."""
    resp = error_response(status, err_type, message, retry_after)
    if not request.content.is_eof():
        resp.force_close()
    return resp
