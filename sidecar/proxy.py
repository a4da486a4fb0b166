"""The reverse proxy: every method and path to the one configured upstream, metered on the way.

Owns: forwarding (headers minus hop-by-hop, X-Forwarded-*, bodies streamed), the upstream's
failures as OpenAI-shaped 502/504 errors, client disconnects, and handing each finished request to
the meter. The client gets the upstream's bytes; the only changes are listed in docs/traffic.md.
Never: buffers a stream, blocks the event loop, or lets an accounting failure fail a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import zlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from .identity import Identity, Unauthorized
from .logs import REQUEST_CONTEXT
from .meter import STATUS_CLIENT_CLOSED, Exchange, Meter, new_uid, price_cost
from .metrics import LabelCap, Metrics, sanitize
from .usage import (
    Endpoint,
    RequestInfo,
    StreamMeter,
    Usage,
    classify,
    inspect_request,
    usage_from_body,
)

log = logging.getLogger("tollbooth.proxy")

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
COST_HEADER = "x-tollbooth-cost-usd"
# A non-streaming body larger than this is forwarded as a stream and its usage marked unknown.
MAX_METERED_RESPONSE_BYTES = 64 * 1024 * 1024
# json.loads takes ~1 ms per 100 KB: above this a request body is parsed off the event loop.
PARSE_IN_THREAD_BYTES = 256 * 1024


class Refusal(Exception):
    """The sidecar answers the request itself (budget spent, queue full, never fits)."""

    def __init__(self, status: int, err_type: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.err_type, self.retry_after = status, err_type, retry_after


# --- pure helpers ---------------------------------------------------------------------------------


def _end_to_end(src: Mapping[str, str], also_drop: frozenset[str]) -> CIMultiDict[str]:
    """`src` without hop-by-hop headers (fixed, and those named in Connection) and `also_drop`."""
    drop = _connection_listed(src) | HOP_BY_HOP | also_drop
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in src.items():
        if k.lower() not in drop:
            out.add(k, v)
    return out


_NOT_FORWARDED = frozenset({"host", "content-length"})
_LENGTH = frozenset({"content-length"})


def request_headers(
    src: Mapping[str, str], *, peer: str | None, scheme: str, authorization: str | None = None
) -> CIMultiDict[str]:
    """Headers for the upstream: the client's minus hop-by-hop, Host and Content-Length; with an
    upstream key configured, its `Authorization` in place of the client's."""
    out = _end_to_end(src, _NOT_FORWARDED)
    if authorization is not None:
        out["Authorization"] = authorization
    if peer:
        prior = src.get("X-Forwarded-For")
        out["X-Forwarded-For"] = f"{prior}, {peer}" if prior else peer
    out["X-Forwarded-Proto"] = src.get("X-Forwarded-Proto", scheme)
    return out


def response_headers(src: Mapping[str, str], *, drop_length: bool) -> CIMultiDict[str]:
    return _end_to_end(src, _LENGTH if drop_length else frozenset())


def _connection_listed(headers: Mapping[str, str]) -> set[str]:
    value = headers.get("Connection", "")
    return {t.strip().lower() for t in value.split(",") if t.strip()}


def error_body(err_type: str, message: str) -> bytes:
    """OpenAI's error shape; `code` is the same machine-readable string as `type`."""
    return json.dumps({"error": {"message": message, "type": err_type, "code": err_type}}).encode()


def error_response(
    status: int, err_type: str, message: str, retry_after: float | None = None
) -> web.Response:
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after is not None else None
    return web.Response(
        status=status,
        body=error_body(err_type, message),
        content_type="application/json",
        headers=headers,
    )


def request_id(headers: Mapping[str, str], uid: str) -> str:
    """The client's X-Request-Id (sanitised: logs and the ledger join on it), or a new one."""
    given = headers.get("X-Request-Id")
    return sanitize(given, 64) if given else uid


def decoded(body: bytes, encoding: str | None) -> bytes:
    """A decompressed copy for metering; the client still gets the original bytes."""
    if encoding in ("gzip", "x-gzip"):
        return zlib.decompress(body, 16 + zlib.MAX_WBITS)
    if encoding == "deflate":
        return zlib.decompress(body)
    return body


# --- the upstream's model name for TGI's native routes -----------------------------------------


class TgiModelName:
    """`model_id` from the upstream's /info, fetched once and again after a failure."""

    RETRY_S = 5.0

    def __init__(self, session: aiohttp.ClientSession, base: str, configured: str | None):
        self._session, self._base = session, base
        self._name = configured
        self._lock = asyncio.Lock()
        self._failed_at = -1e9

    async def get(self) -> str | None:
        if self._name or time.monotonic() - self._failed_at < self.RETRY_S:
            return self._name
        async with self._lock:
            if not self._name:
                await self._fetch()
        return self._name

    async def _fetch(self) -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=2)
            async with self._session.get(self._base + "/info", timeout=timeout) as r:
                data = await r.json(content_type=None)
            name = data.get("model_id") if isinstance(data, dict) else None
            if isinstance(name, str) and name:
                self._name = name
                return
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("upstream /info unavailable (%s); TGI model name unknown for now", exc)
        self._failed_at = time.monotonic()


# --- the handler ----------------------------------------------------------------------------------

# Hooks that later stages plug in (budgets, admission, tracing); each may raise Refusal.
Gate = Callable[[Exchange], Awaitable[Callable[[], None] | None]]


@dataclass
class ProxySettings:
    upstream: str  # base URL without trailing slash
    inject_usage: bool
    max_body: int
    connect_timeout: float
    read_timeout: float
    capture_bytes: int = 0  # audit text capture: keep up to this many response bytes
    authorization: str | None = None  # the upstream's key (upstream.api_key_env), never logged


class Proxy:
    def __init__(
        self,
        settings: ProxySettings,
        session: aiohttp.ClientSession,
        metrics: Metrics,
        meter: Meter,
        users: LabelCap,
        models: LabelCap,
        tgi_name: TgiModelName,
        gates: list[Gate],
        on_start: list[Callable[[Exchange], None]],
        identity: Identity,
    ) -> None:
        self.s = settings
        self.identity = identity
        self.session = session
        self.metrics = metrics
        self.meter = meter
        self.users = users
        self.models = models
        self.tgi_name = tgi_name
        self.gates = gates  # budgets, admission: may refuse a request before the upstream
        self.on_start = on_start  # e.g. open a span, set the upstream's traceparent
        self.timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=settings.connect_timeout, sock_read=settings.read_timeout
        )

    async def handle(self, request: web.Request) -> web.StreamResponse:
        endpoint = classify(request.method, request.path)
        try:
            # Under verified keys the headers decide: an unknown client's body is never read.
            principal = (
                None if self.identity.needs_body else self.identity.resolve(request.headers, None)
            )
            if endpoint is None:
                if principal is None:
                    self.identity.resolve(request.headers, None)  # a required key is checked
                return await self._passthrough(request)
            try:
                body = await request.read()  # bounded by the app's client_max_size
            except web.HTTPRequestEntityTooLarge:
                return self._too_large()
            info = await self._inspect(endpoint, body)
            if principal is None:
                principal = self.identity.resolve(request.headers, info.user)
        except Unauthorized as exc:
            self.metrics.auth_rejections.labels(str(exc).split()[0]).inc()
            return error_response(401, "invalid_api_key", str(exc))
        user_id = sanitize(principal.user, 128)
        model = info.model or (await self.tgi_name.get() if endpoint.is_tgi_native else None)
        uid = new_uid()
        ex = Exchange(
            uid=uid,
            request_id=request_id(request.headers, uid),
            endpoint=endpoint,
            info=info,
            user=self.users(user_id),
            user_id=user_id,
            model=self.models(model or "unknown"),
            bytes_in=len(body),
            upstream=self.s.upstream,
            request_headers=request.headers,
            team=principal.team,
            end_user=sanitize(info.user, 128) if info.user else None,
            key_id=principal.key_id,
        )
        return await self._metered(request, ex)

    async def _inspect(self, endpoint: Endpoint, body: bytes) -> RequestInfo:
        """Parse the request; a large body is parsed in a thread so the loop keeps serving."""
        if len(body) < PARSE_IN_THREAD_BYTES:
            return inspect_request(endpoint, body, inject_usage=self.s.inject_usage)
        return await asyncio.to_thread(
            inspect_request, endpoint, body, inject_usage=self.s.inject_usage
        )

    async def _metered(self, request: web.Request, ex: Exchange) -> web.StreamResponse:
        in_flight = self.metrics.child(self.metrics.in_flight, ex.model)
        in_flight.inc()
        releases: list[Callable[[], None]] = []
        for hook in self.on_start:  # before the gates: a span covers the queue wait too
            try:
                hook(ex)
            except Exception:
                log.exception("start hook failed for request %s", ex.request_id)
                self.metrics.metering_errors.labels("start").inc()
        context = REQUEST_CONTEXT.set(_log_context(ex))
        try:
            for gate in self.gates:
                release = await self._pass(gate, ex)
                if release is not None:
                    releases.append(release)
            return await self._exchange(request, ex)
        except Refusal as r:
            ex.status, ex.error = r.status, r.err_type
            return error_response(r.status, r.err_type, str(r), r.retry_after)
        except asyncio.CancelledError:
            ex.status = ex.status if ex.status >= 400 else STATUS_CLIENT_CLOSED
            ex.error = ex.error or "client_disconnected"
            raise
        finally:
            for release in reversed(releases):
                release()
            in_flight.dec()
            ex.finish()
            self.meter.record(ex)
            REQUEST_CONTEXT.reset(context)

    async def _pass(self, gate: Gate, ex: Exchange) -> Callable[[], None] | None:
        """Run a gate. A Refusal is the gate's answer; any other failure is a bug in accounting:
        logged and counted, and the request goes on."""
        try:
            return await gate(ex)
        except (Refusal, asyncio.CancelledError):
            raise
        except Exception:
            log.exception("gate failed for request %s", ex.request_id)
            self.metrics.metering_errors.labels("gate").inc()
            return None

    async def _exchange(self, request: web.Request, ex: Exchange) -> web.StreamResponse:
        headers = self._upstream_headers(request)
        headers.update(ex.trace_headers)
        ex.upstream_start = time.perf_counter()
        try:
            async with self.session.request(
                request.method,
                self._url(request),
                headers=headers,
                data=ex.info.body,
                allow_redirects=False,
                timeout=self.timeout,
            ) as up:
                ex.status = up.status
                if up.content_type == "text/event-stream":
                    return await self._stream(request, ex, up)
                return await self._buffered(request, ex, up)
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            return self._upstream_failed(ex, 504, "upstream_timeout", exc)
        except aiohttp.ClientError as exc:
            return self._upstream_failed(ex, 502, "upstream_unreachable", exc)

    async def _buffered(
        self, request: web.Request, ex: Exchange, up: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        if up.content_length is not None and up.content_length > MAX_METERED_RESPONSE_BYTES:
            ex.usage = Usage(unknown_reason="response_too_large")
            return await self._relay(request, up, ex)
        body = await up.read()
        ex.bytes_out = len(body)
        if self.s.capture_bytes:
            ex.response_sample = body  # a reference to what is in memory anyway, not a copy
        try:
            plain = decoded(body, up.headers.get("Content-Encoding"))
            self._set_usage(ex, usage_from_body(ex.endpoint, plain, up.headers))
        except Exception:
            log.exception("could not read usage of request %s", ex.request_id)
            self.metrics.metering_errors.labels("parse").inc()
            ex.usage = Usage(unknown_reason="parse_error")
        headers = response_headers(up.headers, drop_length=True)
        cost = self._cost_now(ex)
        if cost is not None:
            headers[COST_HEADER] = f"{cost:.8f}"
        return web.Response(status=up.status, reason=up.reason, body=body, headers=headers)

    async def _stream(
        self, request: web.Request, ex: Exchange, up: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        meter = StreamMeter(ex.endpoint, strip_usage=ex.info.injected_usage)
        resp = web.StreamResponse(
            status=up.status,
            reason=up.reason,
            headers=response_headers(up.headers, drop_length=True),
        )
        await resp.prepare(request)
        try:
            async for chunk in up.content.iter_any():  # upstream failures raise here...
                out = self._feed(meter, chunk, ex)
                if self.s.capture_bytes:
                    _sample(ex, out, self.s.capture_bytes)
                if out and not await self._write(resp, out, ex, meter):
                    return resp  # the client left; leaving the block closes the upstream
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
            ex.error = "upstream_reset"
            self.metrics.upstream_errors.labels("stream_interrupted").inc()
            log.warning("upstream stream of request %s broke: %r", ex.request_id, exc)
            self._end_stream(ex, meter)
            _abort(request)  # the client must see a broken stream, not a clean end
            return resp
        except asyncio.CancelledError:
            self._end_stream(ex, meter)
            raise
        tail = self._end_stream(ex, meter)
        if tail and not await self._write(resp, tail, ex, None):
            return resp
        await resp.write_eof()
        return resp

    async def _write(
        self, resp: web.StreamResponse, data: bytes, ex: Exchange, meter: StreamMeter | None
    ) -> bool:
        """Write to the client. False when it went away: the request ends as 499.

        Caught here, where it happens, because aiohttp's ClientConnectionResetError is also a
        ClientConnectionError, the class the upstream's failures are caught by.
        """
        try:
            await resp.write(data)
        except ConnectionResetError:
            ex.status, ex.error = STATUS_CLIENT_CLOSED, "client_disconnected"
            if meter is not None:
                self._end_stream(ex, meter)
            return False
        ex.bytes_out += len(data)
        return True

    def _feed(self, meter: StreamMeter, chunk: bytes, ex: Exchange) -> bytes:
        try:
            out = meter.feed(chunk)
        except Exception:
            # Accounting broke: stop metering this stream, keep forwarding the bytes unchanged.
            log.exception("stream metering failed for request %s", ex.request_id)
            self.metrics.metering_errors.labels("stream").inc()
            meter.passthrough = True
            return chunk
        if ex.first_token_at is None and meter.token_events:
            ex.first_token_at = time.perf_counter()
        return out

    def _end_stream(self, ex: Exchange, meter: StreamMeter) -> bytes:
        try:
            tail, usage = meter.finish()
        except Exception:
            log.exception("stream finish failed for request %s", ex.request_id)
            self.metrics.metering_errors.labels("stream").inc()
            return b""
        if not meter.done and ex.error is None and usage.unknown_reason:
            usage = replace(usage, unknown_reason="stream_truncated")
        self._set_usage(ex, usage)
        return tail

    def _set_usage(self, ex: Exchange, usage: Usage) -> None:
        ex.usage = usage
        if usage.model:
            ex.model = self.models(usage.model)
        if usage.error and ex.error is None:
            ex.error = usage.error  # e.g. an error event inside a 200 stream

    def _cost_now(self, ex: Exchange) -> float | None:
        try:
            cost = price_cost(self.meter.prices, ex)
        except Exception:
            log.exception("pricing failed for request %s", ex.request_id)
            return None
        return cost.total_usd if cost is not None else None

    async def _relay(
        self, request: web.Request, up: aiohttp.ClientResponse, ex: Exchange | None = None
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=up.status,
            reason=up.reason,
            headers=response_headers(up.headers, drop_length=False),
        )
        await resp.prepare(request)
        async for chunk in up.content.iter_any():
            await resp.write(chunk)
            if ex is not None:
                ex.bytes_out += len(chunk)
        await resp.write_eof()
        return resp

    async def _passthrough(self, request: web.Request) -> web.StreamResponse:
        """Unmetered routes: both bodies streamed, nothing recorded but failures."""
        headers = self._upstream_headers(request)
        data = request.content if request.body_exists else None
        try:
            async with self.session.request(
                request.method,
                self._url(request),
                headers=headers,
                data=data,
                allow_redirects=False,
                timeout=self.timeout,
            ) as up:
                return await self._relay(request, up)
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            return self._upstream_failed(None, 504, "upstream_timeout", exc)
        except aiohttp.ClientError as exc:
            return self._upstream_failed(None, 502, "upstream_unreachable", exc)

    def _upstream_failed(
        self, ex: Exchange | None, status: int, kind: str, exc: BaseException
    ) -> web.Response:
        log.warning("upstream %s: %s %r", self.s.upstream, kind, exc)
        self.metrics.upstream_errors.labels(kind).inc()
        if ex is not None:
            ex.status, ex.error = status, kind
        what = "did not answer in time" if status == 504 else "could not be reached"
        return error_response(status, kind, f"the inference server {what}")

    def _too_large(self) -> web.Response:
        return error_response(
            413, "request_too_large", f"request body exceeds {self.s.max_body} bytes"
        )

    def _upstream_headers(self, request: web.Request) -> CIMultiDict[str]:
        return request_headers(
            request.headers,
            peer=request.remote,
            scheme=request.scheme,
            authorization=self.s.authorization,
        )

    def _url(self, request: web.Request) -> str:
        return self.s.upstream + request.rel_url.raw_path_qs


def _sample(ex: Exchange, data: bytes, limit: int) -> None:
    if ex.response_sample is None:
        ex.response_sample = bytearray()
    room = limit - len(ex.response_sample)
    if room > 0:
        ex.response_sample += data[:room]


def _log_context(ex: Exchange) -> dict[str, str]:
    ctx = {"request_id": ex.request_id}
    if ex.trace_id:
        ctx["trace_id"] = ex.trace_id
    if ex.span_id:
        ctx["span_id"] = ex.span_id
    return ctx


def _abort(request: web.Request) -> None:
    with contextlib.suppress(Exception):
        if request.transport is not None:
            request.transport.abort()
