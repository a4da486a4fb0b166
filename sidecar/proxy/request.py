"""A request on its way in: its body read and inspected, and the record (`Exchange`) it starts as.

Owns: whose share of request memory a body counts in, reading the body (within `max_body` and the
body timeout, every piece reserved before it is kept), parsing it for the meter (in memory reserved
for what parsing allocates; a large body in a thread), and the record a request starts as (its
ids, its user and model as bounded labels, whom it is billed to, its log context).
Never: reads a body before its memory is reserved, keeps it on the request (`request.read()`),
lets a failure to parse it fail the request, or records the exchange (the meter does).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from aiohttp import web

from ..credentials import ConflictingKeys, bearer, key_id
from ..exchange import Endpoint, Exchange, RequestInfo, new_uid
from ..metering.wire import inspect_request
from ..telemetry.metrics import Metrics, sanitize
from .headers import request_id
from .identity import Principal
from .memory import HELD_PER_BYTE, Reservation, TooLarge, parse_cost
from .settings import ProxyDeps, ProxySettings

log = logging.getLogger("tollbooth.proxy")

# json.loads takes ~1 ms per 100 KB: above this a request body is parsed off the event loop.
PARSE_IN_THREAD_BYTES = 256 * 1024


def memory_bucket(headers: Mapping[str, str], principal: Principal | None) -> str | None:
    """Whose share of request memory a body counts in: the principal resolved from the headers
    (its key, or the one "anonymous" of unknown keys), else the presented key; None (the total
    only) when there is neither."""
    if principal is not None:
        return principal.key_id or principal.user
    try:
        return key_id(bearer(headers))
    except ConflictingKeys:
        return None


async def read_body(
    request: web.Request, held: Reservation, max_body: int, timeout: float
) -> bytes:
    """The whole body, in memory reserved before it is read (by its Content-Length, or as a
    chunked body arrives), bounded in size by `max_body` and in time by `timeout`. A body that is
    here already (most are: they come with the headers) is read without a timer."""
    length = request.content_length
    if length is not None:
        if length > max_body:
            raise TooLarge
        held.take(HELD_PER_BYTE * length)
    if request.content.is_eof():
        return await _read_all(request, max_body, None if length is not None else held)
    async with asyncio.timeout(timeout):
        return await _read_all(request, max_body, None if length is not None else held)


async def _read_all(request: web.Request, max_body: int, grow: Reservation | None) -> bytes:
    """The body from the request's stream. Not `request.read()`: aiohttp keeps what that
    returns on the request, and a kept-alive connection keeps its last request until the
    next one comes, so every idle connection held its last body (out of any count). With
    `grow` (no Content-Length to reserve by) each piece is reserved as it arrives: a body
    that grows past the room left is cut off (NoRoom) with the rest unread."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > max_body:
            raise TooLarge
        if grow is not None:
            grow.take(HELD_PER_BYTE * len(chunk))
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def inspect(
    endpoint: Endpoint, body: bytes, held: Reservation, s: ProxySettings, metrics: Metrics
) -> RequestInfo:
    """Parse the request, in memory reserved for what parsing allocates (NoRoom when it does
    not fit); a large body is parsed in a thread so the loop keeps serving. A failure to read
    it is a bug in accounting: logged, counted, and the body forwarded as it is, metered
    like one that is not JSON (its usage from the response, its hold from its size)."""
    parsing = parse_cost(body)
    held.take(parsing)
    try:
        if len(body) < PARSE_IN_THREAD_BYTES:
            # a plain call either way: a `functools.partial` cost more than the call (counted)
            return _inspect(endpoint, body, s)
        return await asyncio.to_thread(_inspect, endpoint, body, s)
    except Exception:
        log.exception("could not read a %s request body", endpoint.value)
        metrics.metering_errors.labels("inspect").inc()
        resolved = Endpoint.OTHER if endpoint is Endpoint.INVOCATIONS else endpoint
        return RequestInfo(endpoint=resolved, body=body, parsed=False)
    finally:
        held.give_back(parsing)


# Principals whose sanitized user id is kept (a regular expression's pass a request otherwise):
# at most this many, of at most 256 characters each. `sanitize` is pure, so one memo serves all.
_USER_IDS_KEPT = 4096
_user_ids: dict[str, str] = {}


def _inspect(endpoint: Endpoint, body: bytes, s: ProxySettings) -> RequestInfo:
    """The adapter's reading of the request, with the proxy's settings for it."""
    return inspect_request(
        endpoint, body, inject_usage=s.inject_usage, continuous_usage=s.continuous_usage, api=s.api
    )


def new_exchange(
    request: web.Request,
    info: RequestInfo,
    path: str,
    model: str | None,
    size: int,
    principal: Principal,
    s: ProxySettings,
    deps: ProxyDeps,
) -> Exchange:
    """The record of one request, metered or not, billed to `principal`."""
    user_id = _user_ids.get(principal.user)
    if user_id is None:
        user_id = sanitize(principal.user, 128)
        if len(_user_ids) < _USER_IDS_KEPT and len(principal.user) <= 256:
            _user_ids[principal.user] = user_id
    uid = new_uid()
    ex = Exchange(
        uid=uid,
        request_id=request_id(request.headers, uid),
        endpoint=info.endpoint,
        info=info,
        user=deps.users(user_id),
        user_id=user_id,
        model=deps.models(model or "unknown"),
    )
    # The rest by attribute: a class call passes its keyword arguments in a dict that
    # `__init__` unpacks again, about 500 instructions each (counted).
    ex.bytes_in = size
    ex.upstream = s.upstream
    ex.request_headers = request.headers
    ex.team = principal.team
    ex.project = principal.project
    ex.tags = principal.tags
    ex.end_user = sanitize(info.user, 128) if info.user else None
    ex.key_id = principal.key_id
    ex.path = path
    return ex


def sent(ex: Exchange) -> None:
    """A streamed body's last byte went upstream: the server has the whole request."""
    ex.body_unsent = False


def log_context(ex: Exchange) -> dict[str, str]:
    ctx = {"request_id": ex.request_id}
    if ex.trace_id:
        ctx["trace_id"] = ex.trace_id
    if ex.span_id:
        ctx["span_id"] = ex.span_id
    return ctx
