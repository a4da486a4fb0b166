"""The upstream's response on its way to the client, metered as it passes.

Owns: the three ways back (`buffered`: a JSON answer read whole, metered from its body; `stream`:
SSE or NDJSON metered chunk by chunk; `relay`: bytes copied, unmetered), the sidecar's response
headers (budget left, cost), the usage measured (kept within what the request allowed), a client
that leaves mid-response (499), an upstream that breaks mid-stream (the client sees a broken
stream, not a clean end), and handing an exchange whose usage is not settled yet to a finisher.
Never: buffers a stream, changes the upstream's bytes beyond what docs/traffic.md lists, or lets
an accounting failure fail the response.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from ..exchange import STATUS_CLIENT_CLOSED, Endpoint, Exchange, Usage, prompt_choices
from ..metering.meter import price_cost
from ..metering.wire import (
    StreamMeter,
    open_stream,
    usage_api,
    usage_from_body,
    within_request,
)
from ..telemetry.metrics import LabelCap, Metrics
from .finishers import read_whole, stream_usage, tokenize_auth, with_prompt_count
from .headers import BUDGET_HEADER, decoded, response_headers
from .settings import ProxyDeps, ProxySettings
from .upstream import UpstreamResponse

log = logging.getLogger("tollbooth.proxy")

COST_HEADER = "x-tollbooth-cost-usd"
# A non-streaming body larger than this is forwarded as a stream and its usage marked unknown.
MAX_METERED_RESPONSE_BYTES = 64 * 1024 * 1024


def _headers(up: UpstreamResponse, ex: Exchange | None, drop_length: bool) -> CIMultiDict[str]:
    """The client's response headers, with the sidecar's own budget header: what its store
    decided for `ex` (`response_headers` never keeps the upstream's)."""
    headers = response_headers(up.headers, drop_length=drop_length)
    if ex is not None and ex.budget_left_usd is not None:
        headers[BUDGET_HEADER] = f"{ex.budget_left_usd:.6f}"
    return headers


def set_usage(ex: Exchange, usage: Usage, models: LabelCap) -> None:
    usage = within_request(usage, ex.info)
    ex.usage = usage
    if usage.model and ex.served_model is None:  # a server of one model only repeats the name
        ex.model = models(usage.model)
    if usage.error and ex.error is None:
        ex.error = usage.error  # e.g. an error event inside a 200 stream


def client_left(ex: Exchange) -> None:
    """The client went away before the response ended: 499, whatever the upstream did."""
    if ex.status < 400 or ex.status == 0:
        ex.status = STATUS_CLIENT_CLOSED
    ex.error = ex.error or "client_disconnected"


async def buffered(
    request: web.Request, ex: Exchange, up: UpstreamResponse, s: ProxySettings, deps: ProxyDeps
) -> web.StreamResponse:
    if up.content_length is not None and up.content_length > MAX_METERED_RESPONSE_BYTES:
        ex.usage = Usage(unknown_reason="response_too_large")
        return await relay(request, up, ex)
    body = await up.read()
    ex.bytes_out = len(body)
    if s.capture_bytes:
        ex.response_sample = body  # a reference to what is in memory anyway, not a copy
    try:
        plain = decoded(body, up.headers.get("Content-Encoding"))
        usage = usage_from_body(
            ex.endpoint,
            plain,
            up.headers,
            api=usage_api(ex.endpoint, ex.info.api or s.api, s.sglang_messages_usage),
            sequences=ex.info.choices,
            per_prompt=prompt_choices(ex.info),
        )
        set_usage(ex, usage, deps.models)
    except Exception:
        log.exception("could not read usage of request %s", ex.request_id)
        deps.metrics.metering_errors.labels("parse").inc()
        ex.usage = Usage(unknown_reason="parse_error")
    if ex.endpoint is Endpoint.TGI_VERTEX and 200 <= up.status < 300:
        finish_later(ex, up, None, s, deps)  # /vertex reports no counts: ask for the prompt's
    headers = _headers(up, ex, drop_length=True)
    try:
        cost = price_cost(deps.meter.prices, ex)
        if cost is not None:
            headers[COST_HEADER] = f"{cost.total_usd:.8f}"
    except Exception:
        log.exception("pricing failed for request %s", ex.request_id)
    return web.Response(status=up.status, reason=up.reason, body=body, headers=headers)


async def stream(
    request: web.Request, ex: Exchange, up: UpstreamResponse, s: ProxySettings, deps: ProxyDeps
) -> web.StreamResponse:
    info = ex.info
    meter = open_stream(
        ex.endpoint,
        strip_usage=info.injected_usage,
        strip_chunk_usage=info.strip_chunk_usage,
        choices=info.choices,
        per_prompt=prompt_choices(info),
        max_event_bytes=s.max_event_bytes,
        api=usage_api(ex.endpoint, info.api or s.api, s.sglang_messages_usage),
    )
    headers = _headers(up, ex, drop_length=True)
    resp = web.StreamResponse(status=up.status, reason=up.reason, headers=headers)
    try:
        writer = await resp.prepare(request)
    except ConnectionResetError:
        client_left(ex)
        finish_later(ex, up, meter, s, deps)
        return resp
    except asyncio.CancelledError:  # before any byte of it: as for a request still upstream
        client_left(ex)
        finish_later(ex, up, None, s, deps)
        raise
    assert writer is not None  # prepared just now
    # Per read, the loop calls what `iter_any` and `resp.write` call (`readany`, the payload
    # writer's `write`: its chunked framing and its drain) without their wrappers: each is a
    # coroutine a read, which `iter_any`'s `__anext__` also suspends and resumes when the read
    # waits. `resp.write` adds checks that cannot fail here (bytes, prepared, no EOF sent).
    capture, write, read = s.capture_bytes, writer.write, up.content.readany
    try:
        while chunk := await read():  # upstream failures raise here; b"" is the end...
            try:  # the meter, called here: this loop runs once per read of the upstream
                out = meter.feed(chunk)
            except Exception:
                out = _meter_failed(meter, chunk, ex, deps.metrics)
            if ex.first_token_at is None and meter.token_events:
                ex.first_token_at = time.perf_counter()
            if capture:
                _sample(ex, out, capture)
            if not out:
                continue
            # The client's leaving is caught here, where it happens: aiohttp's
            # ClientConnectionResetError is also a ClientConnectionError, the class the
            # upstream's failures are caught by below.
            try:
                await write(out)
            except ConnectionResetError:
                client_left(ex)
                finish_later(ex, up, meter, s, deps)  # the client left
                return resp
            ex.bytes_out += len(out)
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
        ex.error = "upstream_reset"
        deps.metrics.upstream_errors.labels("stream_interrupted").inc()
        log.warning("upstream stream of request %s broke: %r", ex.request_id, exc)
        _end_stream(ex, meter, deps)
        with contextlib.suppress(Exception):  # the client must see a broken stream, not a clean end
            if request.transport is not None:
                request.transport.abort()
        return resp
    except asyncio.CancelledError:  # the client left (the server cancels the handler)
        client_left(ex)
        finish_later(ex, up, meter, s, deps)
        raise
    tail = _end_stream(ex, meter, deps)
    with contextlib.suppress(ConnectionResetError):  # usage is known; leaving now is a 499
        if tail:
            await resp.write(tail)
            ex.bytes_out += len(tail)
        await resp.write_eof()
        return resp
    client_left(ex)
    return resp


async def relay(
    request: web.Request, up: UpstreamResponse, ex: Exchange | None = None
) -> web.StreamResponse:
    headers = _headers(up, ex, drop_length=False)
    resp = web.StreamResponse(status=up.status, reason=up.reason, headers=headers)
    try:
        await resp.prepare(request)
        async for chunk in up.content.iter_any():
            await resp.write(chunk)
            if ex is not None:
                ex.bytes_out += len(chunk)
        await resp.write_eof()
    except ConnectionResetError:  # the client left: not an upstream failure
        if ex is not None:
            client_left(ex)
    return resp


def finish_later(
    ex: Exchange,
    up: UpstreamResponse | None,
    meter: StreamMeter | None,
    s: ProxySettings,
    deps: ProxyDeps,
) -> None:
    """Hand the exchange to a background finisher, which owns `up` from now on and ends
    when the usage is settled; the meter records the exchange after it."""
    ex.finisher = deps.finishers.start(_finish(ex, up, meter, s, deps))
    if ex.finisher is None:  # too many already: cancel now, record what was measured
        log.warning("finishers at their limit; request %s recorded as is", ex.request_id)
        deps.metrics.metering_errors.labels("finisher_limit").inc()
        if up is not None:
            up.close()
        if meter is not None:
            usage = meter.usage_so_far()
            ex.output_events = meter.token_events
        elif ex.error == "client_disconnected":  # it left before a byte: none was measured
            usage = ex.usage
        else:
            return  # (TGI's /vertex, asking only for the prompt) the answer's usage stands
        if usage.input_tokens is None or usage.output_tokens is None:
            usage = replace(usage, unknown_reason="client_disconnected")
        set_usage(ex, usage, deps.models)


async def _finish(
    ex: Exchange,
    up: UpstreamResponse | None,
    meter: StreamMeter | None,
    s: ProxySettings,
    deps: ProxyDeps,
) -> None:
    left = ex.status == STATUS_CLIENT_CLOSED
    try:
        usage = ex.usage
        if up is not None and meter is not None:
            usage = await stream_usage(up, meter, s.drain_s)
            ex.output_events = meter.token_events
        if up is not None:
            up.release()  # closes the connection, cancelling a generation still running
        if usage.input_tokens is None and ex.prompt_tokens is not None:
            usage = replace(usage, input_tokens=ex.prompt_tokens)  # admission counted it
        auth = tokenize_auth(ex, s.authorization)
        usage = await with_prompt_count(usage, ex.info, deps.counter, auth, client_left=left)
        set_usage(ex, usage, deps.models)
    except Exception:
        log.exception("finishing request %s failed", ex.request_id)
        deps.metrics.metering_errors.labels("finish").inc()
    finally:
        if up is not None:
            up.release()


def _meter_failed(meter: StreamMeter, chunk: bytes, ex: Exchange, metrics: Metrics) -> bytes:
    """Accounting broke: stop metering this stream, keep forwarding the bytes unchanged."""
    log.exception("stream metering failed for request %s", ex.request_id)
    metrics.metering_errors.labels("stream").inc()
    meter.passthrough = True
    return chunk


def _end_stream(ex: Exchange, meter: StreamMeter, deps: ProxyDeps) -> bytes:
    try:
        tail, usage = meter.finish()
    except Exception:
        log.exception("stream finish failed for request %s", ex.request_id)
        deps.metrics.metering_errors.labels("stream").inc()
        return b""
    usage = read_whole(meter, usage)
    ex.output_events = meter.token_events
    if usage.unknown_reason and ex.error is None:
        if not meter.done:
            usage = replace(usage, unknown_reason="stream_truncated")
        elif not ex.info.utf8:
            usage = replace(usage, unknown_reason="body_not_utf8")  # never changed: no usage
    set_usage(ex, usage, deps.models)
    return tail


def _sample(ex: Exchange, data: bytes, limit: int) -> None:
    if ex.response_sample is None:
        ex.response_sample = bytearray()
    room = limit - len(ex.response_sample)
    if room > 0:
        ex.response_sample += data[:room]
