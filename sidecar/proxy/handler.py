"""The reverse proxy: every method and path to the one configured upstream, metered on the way.

Owns: forwarding (headers minus hop-by-hop, X-Forwarded-*, bodies streamed), the upstream's
failures as OpenAI-shaped 502/504 errors, client disconnects, and handing each finished request to
the meter. The client gets the upstream's bytes; the only changes are listed in docs/traffic.md.
Never: buffers a stream, blocks the event loop, or lets an accounting failure fail a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING
from urllib.parse import quote

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from ..credentials import API_KEY_HEADER, ConflictingKeys, bearer, key_id
from ..exchange import (
    AUDIO_ROUTES,
    STATUS_CLIENT_CLOSED,
    Endpoint,
    Exchange,
    Gate,
    Refusal,
    RequestInfo,
    Usage,
    new_uid,
)
from ..metering.meter import Meter, price_cost
from ..metering.wire import (
    StreamMeter,
    inspect_request,
    open_stream,
    usage_from_body,
    within_request,
)
from ..telemetry.logs import REQUEST_CONTEXT
from ..telemetry.metrics import LabelCap, Metrics, sanitize
from ..text import MODEL_CHARS, clean
from . import audio
from .audio import AudioLimits
from .finishers import Finishers, PromptCounter, stream_usage, with_prompt_count
from .headers import (
    BUDGET_HEADER,
    content_encoded,
    decoded,
    error_response,
    in_route_shape,
    request_headers,
    request_id,
    response_headers,
)
from .identity import Identity, Principal, Unauthorized
from .memory import (
    HELD_PER_BYTE,
    TOTAL,
    NoRoom,
    RequestMemory,
    Reservation,
    TooLarge,
    parse_cost,
)
from .routes import AmbiguousPath, anthropic_route, classify, endpoint_class, routing_path
from .spend import SPEND_PATH, Statement, answer
from .upstream import Upstream, UpstreamResponse

if TYPE_CHECKING:
    from prometheus_client import Gauge

log = logging.getLogger("tollbooth.proxy")

COST_HEADER = "x-tollbooth-cost-usd"
# A non-streaming body larger than this is forwarded as a stream and its usage marked unknown.
MAX_METERED_RESPONSE_BYTES = 64 * 1024 * 1024
# json.loads takes ~1 ms per 100 KB: above this a request body is parsed off the event loop.
PARSE_IN_THREAD_BYTES = 256 * 1024


# Principals whose sanitized user id is kept (a regular expression's pass a request otherwise):
# at most this many, of at most 256 characters each.
_USER_IDS_KEPT = 4096


# A request refused for want of memory may try again this much later: held bodies are read,
# parsed and answered within seconds, or cut off at server.body_timeout_s.
MEMORY_RETRY_AFTER_S = 1.0


# --- pure helpers ---------------------------------------------------------------------------------


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


# Routes whose request names no model and whose server has no /info: llama.cpp's (the served
# alias comes back in the response only), held at `upstream.model_name`'s price when it is set.
_NAMED_BY_CONFIG = frozenset({Endpoint.LLAMA_COMPLETION, Endpoint.LLAMA_INFILL})
# Routes whose stream is NDJSON (Ollama's), metered by their adapter's line meter.
NDJSON_ROUTES = frozenset({Endpoint.OLLAMA_CHAT, Endpoint.OLLAMA_GENERATE})


# --- the upstream's model name for TGI's native routes -----------------------------------------


def budget_header(headers: CIMultiDict[str], ex: Exchange | None) -> None:
    """The sidecar's own budget header: what its store decided for `ex` (`response_headers`
    never keeps the upstream's)."""
    if ex is not None and ex.budget_left_usd is not None:
        headers[BUDGET_HEADER] = f"{ex.budget_left_usd:.6f}"


class TgiModelName:
    """`model_id` from the upstream's /info, fetched once and again after a failure."""

    RETRY_S = 5.0

    def __init__(self, upstream: Upstream, configured: str | None):
        self._upstream = upstream
        self._name = configured
        self.configured = configured  # upstream.model_name, as the operator set it
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
            _, body = await self._upstream.fetch("GET", "/info", timeout=2.0)
            data = json.loads(body)
            name = data.get("model_id") if isinstance(data, dict) else None
            if isinstance(name, str) and name:
                self._name = clean(name, MODEL_CHARS)  # the upstream's text: made safe here
                return
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("upstream /info unavailable (%s); TGI model name unknown for now", exc)
        self._failed_at = time.monotonic()


# --- the handler ----------------------------------------------------------------------------------


@dataclass
class ProxySettings:
    upstream: str  # base URL without trailing slash
    inject_usage: bool
    max_body: int
    connect_timeout: float
    read_timeout: float
    capture_bytes: int = 0  # audit text capture: keep up to this many response bytes
    authorization: str | None = None  # the upstream's key (upstream.api_key_env), never logged
    api: str = "vllm"
    continuous_usage: bool = False  # ask vLLM for running totals on every chunk (cut back out)
    free_routes: frozenset[str] = frozenset()  # unmetered POSTs that generate nothing
    refuse_unknown_routes: bool = True
    drain_s: float = 5.0  # read a finished stream this long for its usage after the client left
    size_prompts: bool = False  # admission.tokenize: the exact prompt size before the gates
    body_timeout: float = 60.0  # a metered request's body arrives within this after its headers
    max_event_bytes: int = 1 << 20  # metering.max_event_bytes: a longer SSE event is not parsed
    max_buffered: int = 0  # request memory across all connections (server.max_buffered_...)
    max_buffered_per_key: int = 0
    audio: AudioLimits = field(default_factory=AudioLimits)


@dataclass(frozen=True, kw_only=True)
class ProxyDeps:
    """The parts the proxy calls, made once by the core (sidecar/core/app.py)."""

    upstream: Upstream  # every call to the inference server
    metrics: Metrics
    meter: Meter  # each finished exchange goes to it, and from it to the sinks
    identity: Identity  # who is billed: a verified key, or the body's user
    users: LabelCap
    models: LabelCap
    tgi_name: TgiModelName
    gates: list[Gate] = field(default_factory=list)  # budgets, admission: may refuse a request
    on_start: list[Callable[[Exchange], None]] = field(default_factory=list)  # e.g. open a span
    counter: PromptCounter | None = None  # exact prompt size when the wire lacked usage
    finishers: Finishers = field(default_factory=Finishers)  # work after the client left
    statement: Statement | None = None  # GET /v1/tollbooth/spend: the budgets' answer


class Proxy:
    def __init__(self, settings: ProxySettings, deps: ProxyDeps) -> None:
        self.s = settings
        self.identity = deps.identity
        self.upstream = deps.upstream
        self.metrics = metrics = deps.metrics
        self.meter = deps.meter
        self.users = deps.users
        self.models = deps.models
        self.tgi_name = deps.tgi_name
        self.gates = deps.gates
        self.on_start = deps.on_start
        self.counter = deps.counter
        self.finishers = deps.finishers
        self.statement = deps.statement
        self._urls: dict[tuple[str, str], URL] = {}
        self._user_ids: dict[str, str] = {}  # principal.user -> sanitized, the first few only
        self.memory = RequestMemory(settings.max_buffered, settings.max_buffered_per_key)
        metrics.request_memory.set_function(lambda: self.memory.total)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            path = routing_path(request.rel_url.raw_path)
        except AmbiguousPath as exc:
            return error_response(400, "ambiguous_path", f"{exc}; send the path unencoded")
        if path == SPEND_PATH:  # the sidecar's own route: answered here, never forwarded
            return await answer(request, self.identity, self.statement)
        resp = await self._route(request, path)
        return in_route_shape(resp, True) if anthropic_route(path) else resp

    async def _route(self, request: web.Request, path: str) -> web.StreamResponse:
        endpoint = classify(request.method, path)
        try:
            # Under verified keys the headers decide: an unknown client's body is never read.
            principal = (
                None if self.identity.needs_body else self.identity.resolve(request.headers, None)
            )
            if endpoint is None:  # a required key is checked, also here
                principal = principal or self.identity.resolve(request.headers, None)
                return await self._not_metered(request, path, principal)
        except Unauthorized as exc:
            return self._unauthorized(exc)
        if content_encoded(request.headers):
            return self._encoded(request)
        held = self.memory.reserve(memory_bucket(request.headers, principal))
        try:
            if endpoint in AUDIO_ROUTES:
                return await self._read_audio(request, path, endpoint, principal, held)
            return await self._read_and_meter(request, path, endpoint, principal, held)
        finally:
            if not held.handed_over:  # else the exchange releases it once it is recorded
                held.release()

    async def _read_and_meter(
        self,
        request: web.Request,
        path: str,
        endpoint: Endpoint,
        principal: Principal | None,
        held: Reservation,
    ) -> web.StreamResponse:
        """A metered route: its body read into memory reserved for it, parsed, then metered."""
        try:
            body = await self._read_body(request, held)
            info = await self._inspect(endpoint, body, held)
            if principal is None:
                principal = self.identity.resolve(request.headers, info.user)
        except (TooLarge, web.HTTPRequestEntityTooLarge, TimeoutError, NoRoom, Unauthorized) as exc:
            return self._unread(request, exc, self.s.max_body)
        if info.endpoint is Endpoint.OTHER:  # /invocations with a body no route takes
            return await self._unmetered(request, path, info, principal, held)
        tgi = info.endpoint.is_tgi_native and info.api is None
        model = info.model or (await self.tgi_name.get() if tgi else None)
        if model is None and (info.endpoint in _NAMED_BY_CONFIG or info.api == "sglang"):
            model = self.tgi_name.configured  # priced (held) before the response names it
        ex = self._new_exchange(request, info, path, model, len(body), principal)
        return await self._metered(request, ex, held)

    async def _read_audio(
        self,
        request: web.Request,
        path: str,
        endpoint: Endpoint,
        principal: Principal | None,
        held: Reservation,
    ) -> web.StreamResponse:
        """An audio route: its form's head read for the model (proxy/audio.py), then metered
        with the rest of its body streamed through once the gates let it."""
        try:
            info = await audio.read_head(
                request, endpoint, self.s.audio, functools.partial(self._room, held)
            )
            if principal is None:
                principal = self.identity.resolve(request.headers, None)
        except (TooLarge, TimeoutError, NoRoom, Unauthorized) as exc:
            return self._unread(request, exc, self.s.audio.max_body)
        size = info.size if info.size is not None else len(info.body)
        # vLLM serves the request's model or, with none, its own: the one upstream.model_name
        # names (a model past the head is one vLLM serves, else it refuses the request).
        model = info.model or self.tgi_name.configured
        ex = self._new_exchange(request, info, path, model, size, principal)
        return await self._metered(request, ex, held)

    def _unread(self, request: web.Request, exc: Exception, max_body: int) -> web.StreamResponse:
        """The answer to a request whose body or identity could not be read."""
        if isinstance(exc, NoRoom):
            return self._no_room(request, exc)
        if isinstance(exc, Unauthorized):
            return self._unauthorized(exc)
        if isinstance(exc, TimeoutError):
            return self._too_slow()
        return self._too_large(request, max_body)  # TooLarge, or aiohttp's own

    async def _read_body(self, request: web.Request, held: Reservation) -> bytes:
        """The whole body, in memory reserved before it is read (by its Content-Length, or as a
        chunked body arrives), bounded in size by max_body and in time by `body_timeout`. A body
        that is here already (most are: they come with the headers) is read without a timer."""
        length = request.content_length
        if length is not None:
            if length > self.s.max_body:
                raise TooLarge
            self._room(held, HELD_PER_BYTE * length)
        if request.content.is_eof():
            return await self._read_all(request, None if length is not None else held)
        async with asyncio.timeout(self.s.body_timeout):
            return await self._read_all(request, None if length is not None else held)

    async def _read_all(self, request: web.Request, grow: Reservation | None) -> bytes:
        """The body from the request's stream. Not `request.read()`: aiohttp keeps what that
        returns on the request, and a kept-alive connection keeps its last request until the
        next one comes, so every idle connection held its last body (out of any count). With
        `grow` (no Content-Length to reserve by) each piece is reserved as it arrives: a body
        that grows past the room left is cut off (NoRoom) with the rest unread."""
        chunks: list[bytes] = []
        size = 0
        while chunk := await request.content.readany():
            size += len(chunk)
            if size > self.s.max_body:
                raise TooLarge
            if grow is not None:
                self._room(grow, HELD_PER_BYTE * len(chunk))
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _room(self, held: Reservation, n: int) -> None:
        """Reserve `n` more bytes of request memory for `held`, or raise NoRoom."""
        reason = held.add(n)
        if reason is not None:
            ceiling = self.memory.limit if reason == TOTAL else self.memory.per_key
            raise NoRoom(reason, never=held.held + n > ceiling)

    async def _inspect(self, endpoint: Endpoint, body: bytes, held: Reservation) -> RequestInfo:
        """Parse the request, in memory reserved for what parsing allocates (NoRoom when it does
        not fit); a large body is parsed in a thread so the loop keeps serving. A failure to read
        it is a bug in accounting: logged, counted, and the body forwarded as it is, metered
        like one that is not JSON (its usage from the response, its hold from its size)."""
        parsing = parse_cost(body)
        self._room(held, parsing)
        try:
            return await self._parse(endpoint, body)
        finally:
            held.give_back(parsing)

    async def _parse(self, endpoint: Endpoint, body: bytes) -> RequestInfo:
        inspect = functools.partial(
            inspect_request,
            endpoint,
            body,
            inject_usage=self.s.inject_usage,
            continuous_usage=self.s.continuous_usage,
            api=self.s.api,
        )
        try:
            if len(body) < PARSE_IN_THREAD_BYTES:
                return inspect()
            return await asyncio.to_thread(inspect)
        except Exception:
            log.exception("could not read a %s request body", endpoint.value)
            self.metrics.metering_errors.labels("inspect").inc()
            resolved = Endpoint.OTHER if endpoint is Endpoint.INVOCATIONS else endpoint
            return RequestInfo(endpoint=resolved, body=body, parsed=False)

    def _new_exchange(
        self,
        request: web.Request,
        info: RequestInfo,
        path: str,
        model: str | None,
        size: int,
        principal: Principal,
    ) -> Exchange:
        """The record of one request, metered or not, billed to `principal`."""
        user_id = self._user_ids.get(principal.user)
        if user_id is None:
            user_id = sanitize(principal.user, 128)
            if len(self._user_ids) < _USER_IDS_KEPT and len(principal.user) <= 256:
                self._user_ids[principal.user] = user_id
        uid = new_uid()
        return Exchange(
            uid=uid,
            request_id=request_id(request.headers, uid),
            endpoint=info.endpoint,
            info=info,
            user=self.users(user_id),
            user_id=user_id,
            model=self.models(model or "unknown"),
            bytes_in=size,
            upstream=self.s.upstream,
            request_headers=request.headers,
            team=principal.team,
            project=principal.project,
            tags=principal.tags,
            end_user=sanitize(info.user, 128) if info.user else None,
            key_id=principal.key_id,
            path=path,
        )

    async def _not_metered(
        self, request: web.Request, path: str, principal: Principal
    ) -> web.StreamResponse:
        """Not a metered route: forwarded as is, unless it is a POST that may generate."""
        if request.method != "POST" or path in self.s.free_routes:
            return await self._passthrough(request, path)
        return await self._unmetered(request, path, None, principal)

    async def _unmetered(
        self,
        request: web.Request,
        path: str,
        info: RequestInfo | None,
        principal: Principal,
        held: Reservation | None = None,
    ) -> web.StreamResponse:
        """A POST no metered route matches: counted, gated like any request, then refused or
        forwarded with its usage unknown (`metering.unknown_routes`)."""
        self.metrics.unmetered.labels(endpoint_class(path)).inc()
        info = info or RequestInfo(endpoint=Endpoint.OTHER, body=b"", parsed=False)
        size = len(info.body) or request.content_length or 0
        ex = self._new_exchange(request, info, path, None, size, principal)
        return await self._metered(request, ex, held)

    async def _metered(
        self, request: web.Request, ex: Exchange, held: Reservation | None = None
    ) -> web.StreamResponse:
        in_flight = self.metrics.child(self.metrics.in_flight, ex.model)
        in_flight.inc()
        releases: list[Callable[[], None]] = []
        if held is not None:  # the body's memory is released once the meter has the record
            held.handed_over = True
            releases.append(held.release)
        for hook in self.on_start:  # before the gates: a span covers the queue wait too
            try:
                hook(ex)
            except Exception:
                log.exception("start hook failed for request %s", ex.request_id)
                self.metrics.metering_errors.labels("start").inc()
        context = REQUEST_CONTEXT.set(_log_context(ex))
        try:
            if ex.info.ambiguous:
                raise Refusal(400, "ambiguous_request", ex.info.ambiguous)
            if ex.endpoint is Endpoint.OTHER and self.s.refuse_unknown_routes:
                raise Refusal(
                    403,
                    "route_not_metered",
                    f"POST {ex.path} is not a metered route; the operator can allow it with "
                    "metering.free_routes or metering.unknown_routes: forward",
                )
            if self.s.size_prompts and self.counter is not None and ex.info.parsed:
                # budgets and admission both use it; the finisher reuses it for a client that left
                ex.prompt_tokens = await self.counter.count(ex.info, self._tokenize_auth(ex))
            for gate in self.gates:
                release = await self._pass(gate, ex)
                if release is not None:
                    releases.append(release)
            return await self._exchange(request, ex)
        except Refusal as r:
            ex.status, ex.error = r.status, r.err_type
            return error_response(r.status, r.err_type, str(r), r.retry_after)
        except asyncio.CancelledError:
            _client_left(ex)
            raise
        finally:
            ex.finish()
            done = functools.partial(self._complete, ex, releases, in_flight)
            if ex.finisher is not None:  # the meter hears of it once the finisher is through
                ex.finisher.add_done_callback(lambda _: done())
            else:
                done()
            REQUEST_CONTEXT.reset(context)

    def _complete(self, ex: Exchange, releases: list[Callable[[], None]], in_flight: Gauge) -> None:
        for release in reversed(releases):
            release()
        in_flight.dec()
        self.meter.record(ex)

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
        up: UpstreamResponse | None = None
        try:
            up = await self._send(request, ex, headers)
            ex.status = up.status
            if ex.endpoint is Endpoint.OTHER:
                ex.usage = Usage(unknown_reason="unmetered_route")
                return await self._relay(request, up, ex)
            if up.content_type == "text/event-stream" or (
                up.content_type == "application/x-ndjson" and ex.endpoint in NDJSON_ROUTES
            ):
                return await self._stream(request, ex, up)
            return await self._buffered(request, ex, up)
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            return self._upstream_failed(ex, 504, "upstream_timeout", exc)
        except aiohttp.ClientError as exc:
            return self._upstream_failed(ex, 502, "upstream_unreachable", exc)
        except asyncio.CancelledError:
            # The client left while the upstream had the request (queued, prefilling, or
            # generating a non-streamed answer): cancel it, and count the prompt it was sent.
            if ex.finisher is None and ex.endpoint is not Endpoint.OTHER:
                _client_left(ex)
                self._finish_later(ex, up, None)
            raise
        finally:
            if up is not None and ex.finisher is None:
                up.release()  # closes the connection (cancelling the upstream) if unread

    async def _send(
        self, request: web.Request, ex: Exchange, headers: CIMultiDict[str]
    ) -> UpstreamResponse:
        target = self._url(ex.path, request).raw_path_qs
        body = ex.info.body
        if ex.info.streamed:  # the head read for its form fields, then the rest as it comes
            ex.body_unsent = True
            stream = audio.Upload(request, body, self.s.audio, functools.partial(_sent, ex))
            try:
                return await self.upstream.request(
                    request.method, target, headers, stream, length=ex.info.size
                )
            except aiohttp.ClientError:
                if stream.late is not None:  # cut short by the sidecar: the server has nothing
                    raise Refusal(400, "ambiguous_request", stream.late) from None
                raise
        if body or ex.endpoint is not Endpoint.OTHER or not request.body_exists:
            return await self.upstream.request(request.method, target, headers, body)
        return await self._streamed(request, target, headers)  # an unmetered body is never read

    async def _streamed(
        self, request: web.Request, target: str, headers: CIMultiDict[str]
    ) -> UpstreamResponse:
        """Send the request with its body streamed from the client as it arrives."""
        body = request.content.iter_any() if request.body_exists else b""
        length = request.content_length if request.body_exists else None
        return await self.upstream.request(request.method, target, headers, body, length=length)

    async def _buffered(
        self, request: web.Request, ex: Exchange, up: UpstreamResponse
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
            usage = usage_from_body(
                ex.endpoint,
                plain,
                up.headers,
                api=ex.info.api or self.s.api,
                sequences=ex.info.choices,
            )
            self._set_usage(ex, usage)
        except Exception:
            log.exception("could not read usage of request %s", ex.request_id)
            self.metrics.metering_errors.labels("parse").inc()
            ex.usage = Usage(unknown_reason="parse_error")
        if ex.endpoint is Endpoint.TGI_VERTEX and 200 <= up.status < 300:
            self._finish_later(ex, up, None)  # /vertex reports no counts: ask for the prompt's
        headers = response_headers(up.headers, drop_length=True)
        budget_header(headers, ex)
        cost = self._cost_now(ex)
        if cost is not None:
            headers[COST_HEADER] = f"{cost:.8f}"
        return web.Response(status=up.status, reason=up.reason, body=body, headers=headers)

    async def _stream(
        self, request: web.Request, ex: Exchange, up: UpstreamResponse
    ) -> web.StreamResponse:
        info = ex.info
        meter = open_stream(
            ex.endpoint,
            strip_usage=info.injected_usage,
            strip_chunk_usage=info.strip_chunk_usage,
            choices=info.choices,
            per_prompt=info.n or 1,
            max_event_bytes=self.s.max_event_bytes,
            api=info.api or self.s.api,
        )
        headers = response_headers(up.headers, drop_length=True)
        budget_header(headers, ex)
        resp = web.StreamResponse(status=up.status, reason=up.reason, headers=headers)
        try:
            await resp.prepare(request)
        except ConnectionResetError:
            _client_left(ex)
            self._finish_later(ex, up, meter)
            return resp
        capture, write = self.s.capture_bytes, resp.write
        try:
            async for chunk in up.content.iter_any():  # upstream failures raise here...
                try:  # the meter, called here: this loop runs once per read of the upstream
                    out = meter.feed(chunk)
                except Exception:
                    out = self._meter_failed(meter, chunk, ex)
                if ex.first_token_at is None and meter.token_events:
                    ex.first_token_at = time.perf_counter()
                if capture:
                    _sample(ex, out, capture)
                if not out:
                    continue
                try:  # `_write`, inlined: this loop runs once per read of the upstream
                    await write(out)
                except ConnectionResetError:
                    _client_left(ex)
                    self._finish_later(ex, up, meter)  # the client left
                    return resp
                ex.bytes_out += len(out)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
            ex.error = "upstream_reset"
            self.metrics.upstream_errors.labels("stream_interrupted").inc()
            log.warning("upstream stream of request %s broke: %r", ex.request_id, exc)
            self._end_stream(ex, meter)
            _abort(request)  # the client must see a broken stream, not a clean end
            return resp
        except asyncio.CancelledError:  # the client left (the server cancels the handler)
            _client_left(ex)
            self._finish_later(ex, up, meter)
            raise
        tail = self._end_stream(ex, meter)
        if tail and not await self._write(resp, tail, ex):
            return resp
        with contextlib.suppress(ConnectionResetError):  # usage is known; leaving now is a 499
            await resp.write_eof()
            return resp
        _client_left(ex)
        return resp

    async def _write(self, resp: web.StreamResponse, data: bytes, ex: Exchange) -> bool:
        """Write to the client. False when it went away: the request ends as 499.

        Caught here, where it happens, because aiohttp's ClientConnectionResetError is also a
        ClientConnectionError, the class the upstream's failures are caught by.
        """
        try:
            await resp.write(data)
        except ConnectionResetError:
            _client_left(ex)
            return False
        ex.bytes_out += len(data)
        return True

    def _finish_later(
        self, ex: Exchange, up: UpstreamResponse | None, meter: StreamMeter | None
    ) -> None:
        """Hand the exchange to a background finisher, which owns `up` from now on and ends
        when the usage is settled; the meter records the exchange after it."""
        ex.finisher = self.finishers.start(self._finish(ex, up, meter))
        if ex.finisher is None:  # too many already: cancel now, record what was measured
            log.warning("finishers at their limit; request %s recorded as is", ex.request_id)
            self.metrics.metering_errors.labels("finisher_limit").inc()
            if up is not None:
                up.close()
            if meter is not None:
                usage = meter.usage_so_far()
                if usage.input_tokens is None or usage.output_tokens is None:
                    usage = replace(usage, unknown_reason="client_disconnected")
                self._set_usage(ex, usage)

    async def _finish(
        self, ex: Exchange, up: UpstreamResponse | None, meter: StreamMeter | None
    ) -> None:
        left = ex.status == STATUS_CLIENT_CLOSED
        try:
            usage = ex.usage
            if up is not None and meter is not None:
                usage = await stream_usage(up, meter, self.s.drain_s)
            if up is not None:
                up.release()  # closes the connection, cancelling a generation still running
            if usage.input_tokens is None and ex.prompt_tokens is not None:
                usage = replace(usage, input_tokens=ex.prompt_tokens)  # admission counted it
            self._set_usage(
                ex,
                await with_prompt_count(
                    usage, ex.info, self.counter, self._tokenize_auth(ex), client_left=left
                ),
            )
        except Exception:
            log.exception("finishing request %s failed", ex.request_id)
            self.metrics.metering_errors.labels("finish").inc()
        finally:
            if up is not None:
                up.release()

    def _meter_failed(self, meter: StreamMeter, chunk: bytes, ex: Exchange) -> bytes:
        """Accounting broke: stop metering this stream, keep forwarding the bytes unchanged."""
        log.exception("stream metering failed for request %s", ex.request_id)
        self.metrics.metering_errors.labels("stream").inc()
        meter.passthrough = True
        return chunk

    def _end_stream(self, ex: Exchange, meter: StreamMeter) -> bytes:
        try:
            tail, usage = meter.finish()
        except Exception:
            log.exception("stream finish failed for request %s", ex.request_id)
            self.metrics.metering_errors.labels("stream").inc()
            return b""
        if usage.unknown_reason and ex.error is None:
            if not meter.done:
                usage = replace(usage, unknown_reason="stream_truncated")
            elif not ex.info.utf8:
                usage = replace(usage, unknown_reason="body_not_utf8")  # never changed: no usage
        self._set_usage(ex, usage)
        return tail

    def _set_usage(self, ex: Exchange, usage: Usage) -> None:
        usage = within_request(usage, ex.info)
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
        self, request: web.Request, up: UpstreamResponse, ex: Exchange | None = None
    ) -> web.StreamResponse:
        headers = response_headers(up.headers, drop_length=False)
        budget_header(headers, ex)
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
                _client_left(ex)
        return resp

    async def _passthrough(self, request: web.Request, path: str) -> web.StreamResponse:
        """Routes that generate nothing: both bodies streamed, nothing recorded but failures."""
        headers = self._upstream_headers(request)
        target = self._url(path, request).raw_path_qs
        try:
            up = await self._streamed(request, target, headers)
            try:
                return await self._relay(request, up)
            finally:
                up.release()
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

    def _too_slow(self) -> web.Response:
        """408, and the connection closed: the rest of the body may still come."""
        self.metrics.connections_cut.labels("proxy", "body_timeout").inc()
        resp = error_response(
            408,
            "request_timeout",
            f"the request body did not arrive within {self.s.body_timeout:g} s of its headers",
        )
        resp.force_close()
        return resp

    def _too_large(self, request: web.Request, limit: int | None = None) -> web.Response:
        return _unread_closes(
            request,
            error_response(
                413,
                "request_too_large",
                f"request body exceeds {limit or self.s.max_body} bytes",
            ),
        )

    def _no_room(self, request: web.Request, exc: NoRoom) -> web.Response:
        """503 + Retry-After: the memory for request bodies (or this key's share) is taken; 413
        for a body that needs more than the limit itself. Its bytes are never read."""
        per_key = exc.reason != TOTAL
        what = "this key's share of " if per_key else ""
        key = "server.max_buffered_request_bytes" + ("_per_key" if per_key else "")
        if exc.never:
            self.metrics.requests_refused.labels(exc.reason + "_never").inc()
            resp = error_response(
                413,
                "request_too_large",
                f"reading and parsing this body needs more memory than {key} allows",
            )
        else:
            self.metrics.requests_refused.labels(exc.reason).inc()
            resp = error_response(
                503,
                "request_memory_full",
                f"{what}the memory for request bodies is in use ({key}); retry later",
                MEMORY_RETRY_AFTER_S,
            )
        return _unread_closes(request, resp)

    def _encoded(self, request: web.Request) -> web.Response:
        """415: vLLM and TGI read only uncompressed JSON; a compressed body is never read,
        decoded or forwarded (its bytes could decode to far more than they are)."""
        self.metrics.requests_refused.labels("content_encoding").inc()
        resp = error_response(
            415,
            "unsupported_content_encoding",
            "request bodies with a Content-Encoding are not accepted on metered routes (the "
            "inference server reads uncompressed JSON only): send the body uncompressed",
        )
        return _unread_closes(request, resp)

    def _unauthorized(self, exc: Unauthorized) -> web.Response:
        self.metrics.auth_rejections.labels(str(exc).split()[0]).inc()
        return error_response(401, "invalid_api_key", str(exc))

    def _tokenize_auth(self, ex: Exchange) -> dict[str, str]:
        """The sidecar's own /tokenize calls authenticate as the proxied request did: the upstream
        client adds the upstream key when one is configured, else the client's key is passed on."""
        if self.s.authorization:
            return {}
        got = ex.request_headers
        return {k: v for k in ("Authorization", API_KEY_HEADER) if (v := got.get(k))}

    def _upstream_headers(self, request: web.Request) -> CIMultiDict[str]:
        return request_headers(
            request.headers,
            peer=request.remote,
            scheme=request.scheme,
            authorization=self.s.authorization,
        )

    def _url(self, path: str, request: web.Request) -> URL:
        """The upstream URL for exactly the path that was classified (already normalised, so the
        client library has nothing left to change), with the client's query string as sent."""
        query = request.rel_url.raw_query_string
        key = (path, query)
        url = self._urls.get(key)
        if url is None:
            target = self.s.upstream + quote(path, safe=_PATH_SAFE) + ("?" + query if query else "")
            url = URL(target, encoded=True)
            if len(self._urls) >= _URL_CACHE:  # bounded: odd paths and queries come and go
                self._urls.clear()
            self._urls[key] = url
        return url


# RFC 3986 pchar and "/": what may stand unencoded in a path.
_PATH_SAFE = "/:@!$&'()*+,;=-._~"
_URL_CACHE = 1024  # upstream URLs kept by (path, query): most requests share a few


def _client_left(ex: Exchange) -> None:
    """The client went away before the response ended: 499, whatever the upstream did."""
    if ex.status < 400 or ex.status == 0:
        ex.status = STATUS_CLIENT_CLOSED
    ex.error = ex.error or "client_disconnected"


def _sent(ex: Exchange) -> None:
    """A streamed body's last byte went upstream: the server has the whole request."""
    ex.body_unsent = False


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


def _unread_closes(request: web.Request, resp: web.Response) -> web.Response:
    """An answer sent before the whole body was read closes the connection: the rest of the
    body may still be on its way, and is never read."""
    if not request.content.is_eof():
        resp.force_close()
    return resp


def _abort(request: web.Request) -> None:
    with contextlib.suppress(Exception):
        if request.transport is not None:
            request.transport.abort()
