"""Proxy mechanics as pure functions: which headers cross the proxy, and the errors it answers.

Owns: the hop-by-hop set and what else is never forwarded (Host, Content-Length, Expect), the
upstream's request headers (X-Forwarded-*, the upstream key in place of the client's), the
client's response headers, the request id, whether a body is content-encoded, the error bodies
the sidecar answers (OpenAI's shape, Anthropic's on its routes), and the decoded copy of a
compressed response body for metering.
Never: does I/O, or changes the bytes the client gets.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from ..credentials import API_KEY_HEADER
from ..telemetry.metrics import sanitize

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Trailers",
        "Transfer-Encoding",
        "Upgrade",
        "Proxy-Connection",
    )
)


def _end_to_end(src: Mapping[str, str], drop: frozenset[str]) -> CIMultiDict[str]:
    """`src` without the headers in `drop` (lower case) and those named in its Connection: the
    options of every Connection field line (RFC 9110 7.6.1: one list, however many lines)."""
    if "Connection" in src:
        listed = (_joined(src, "Connection") or "").split(",")
        drop = drop | {t.strip().lower() for t in listed if t.strip()}
    out: CIMultiDict[str] = CIMultiDict(src)  # a copy in C, then a dozen lookups: half the time
    for name in drop:
        if name in out:
            del out[name]
    return out


# Expect: the sidecar answers a 100-continue itself (aiohttp's server sends the 100 before the
# handler reads the body); upstream.py sends the body at once, so the upstream is asked for none.
_NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", "expect"}
# The header on each admitted response where limits apply: the least left of them after its
# hold. The sidecar's alone: an upstream's is never relayed (it would tell a client a budget
# figure no store decided, also where no limit applies).
BUDGET_HEADER = "x-tollbooth-budget-remaining-usd"
_RESPONSE = HOP_BY_HOP | {BUDGET_HEADER}
_RESPONSE_LENGTH = _RESPONSE | {"content-length"}


def request_headers(
    src: Mapping[str, str], *, peer: str | None, scheme: str, authorization: str | None = None
) -> CIMultiDict[str]:
    """Headers for the upstream: the client's minus hop-by-hop, Host, Content-Length and Expect;
    with an upstream key configured, its `Authorization` in place of the client's."""
    out = _end_to_end(src, _NOT_FORWARDED)
    if len(out) != len(out.keys() | ()):  # a name repeated (the keys' set is case-insensitive)
        out = _one_spelling(out)
    if authorization is not None:
        out["Authorization"] = authorization
        out.popall(API_KEY_HEADER, None)  # the client's key (Anthropic SDKs) stays here too
    if peer:
        prior = _joined(src, "X-Forwarded-For")
        out["X-Forwarded-For"] = f"{prior}, {peer}" if prior else peer
    out["X-Forwarded-Proto"] = src.get("X-Forwarded-Proto", scheme)
    return out


def _one_spelling(headers: CIMultiDict[str]) -> CIMultiDict[str]:
    """Every line of a repeated name spelt as its first, so the upstream reads one field under one
    name (RFC 9110 5.3). No value hangs on it (upstream.py writes each line as given); aiohttp's
    ClientSession, the client before, sent only `X-A: 2` of `x-a: 1` and `X-A: 2`."""
    first: dict[str, str] = {}
    return CIMultiDict((first.setdefault(k.lower(), k), v) for k, v in headers.items())


def _joined(headers: Mapping[str, str], name: str) -> str | None:
    """All the field lines of `name` as one list (RFC 9110 5.3), None when there are none."""
    getall = getattr(headers, "getall", None)  # a multidict's (not isinstance: an ABC's check)
    if getall is not None:
        values = getall(name, ())
        return ", ".join(values) if values else None
    return headers.get(name)


def response_headers(src: Mapping[str, str], *, drop_length: bool) -> CIMultiDict[str]:
    return _end_to_end(src, _RESPONSE_LENGTH if drop_length else _RESPONSE)


class SidecarError(web.Response):
    """An error the sidecar answers itself (never an upstream's), so that the route's own error
    shape can be chosen once the route is known (`in_route_shape`). OpenAI's shape; `code` is the
    same machine-readable string as `type`."""

    def __init__(self, status: int, err_type: str, message: str, **kwargs: Any) -> None:
        err = {"message": message, "type": err_type, "code": err_type}
        super().__init__(status=status, body=json.dumps({"error": err}).encode(), **kwargs)
        self.err_type, self.message = err_type, message


def error_response(
    status: int, err_type: str, message: str, retry_after: float | None = None
) -> web.Response:
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after is not None else None
    return SidecarError(status, err_type, message, content_type="application/json", headers=headers)


# Anthropic's error types by status (its API's "Errors" page): what its SDKs and Claude Code
# show. Our own type (budget_exceeded, ...) rides along as `code`, as in the OpenAI shape.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, err_type: str, message: str) -> bytes:
    """Anthropic's error shape: `{"type": "error", "error": {"type", "message"}}`."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    err = {"type": kind, "message": message, "code": err_type}
    return json.dumps({"type": "error", "error": err}).encode()


def in_route_shape(resp: web.StreamResponse) -> web.StreamResponse:
    """The sidecar's own error in the shape of the Anthropic Messages API, for its routes; an
    upstream's answer is never touched."""
    if isinstance(resp, SidecarError) and not resp.prepared:
        resp.body = anthropic_error_body(resp.status, resp.err_type, resp.message)
    return resp


def request_id(headers: Mapping[str, str], uid: str) -> str:
    """The client's X-Request-Id (sanitised: logs and the ledger join on it), or a new one."""
    given = headers.get("X-Request-Id")
    return sanitize(given, 64) if given else uid


def content_encoded(headers: Mapping[str, str]) -> bool:
    """The body is sent in a Content-Encoding (gzip, br, ...): every coding but `identity`."""
    value = _joined(headers, "Content-Encoding")
    return bool(value) and any(
        c.strip().lower() not in ("", "identity") for c in (value or "").split(",")
    )


def decoded(body: bytes, encoding: str | None) -> bytes:
    """A decompressed copy for metering; the client still gets the original bytes."""
    if encoding in ("gzip", "x-gzip"):
        return zlib.decompress(body, 16 + zlib.MAX_WBITS)
    if encoding == "deflate":
        return zlib.decompress(body)
    return body
