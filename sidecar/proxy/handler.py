"""The reverse proxy: every method and path to the one configured upstream, metered on the way.

Owns: a request's path, in the order the methods below read: routed, identified, its body read
and its record made (request.py), gated, forwarded (headers minus hop-by-hop, X-Forwarded-*),
answered (relay.py; answers.py when it is not forwarded), and handed to the meter.
Never: buffers a stream, blocks the event loop, or lets an accounting failure fail a request.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import quote

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from ..exchange import (
    AUDIO_ROUTES,
    UNKNOWN_MODEL,
    Endpoint,
    Exchange,
    Gate,
    Refusal,
    RequestInfo,
    Usage,
)
from ..metering.tgi import runs_to_max_total
from ..telemetry.logs import REQUEST_CONTEXT
from . import answers, audio
from .finishers import tokenize_auth
from .headers import content_encoded, error_response, in_route_shape, request_headers
from .identity import Principal, Unauthorized
from .memory import NoRoom, RequestMemory, Reservation, TooLarge
from .relay import buffered, client_left, finish_later, relay, stream
from .request import inspect, log_context, memory_bucket, new_exchange, read_body, sent
from .routes import (
    GENERATING_METHODS,
    AmbiguousPath,
    anthropic_route,
    classify,
    endpoint_class,
    routing_path,
)
from .settings import ProxyDeps, ProxySettings
from .spend import SPEND_PATH, answer
from .upstream import UpstreamResponse

if TYPE_CHECKING:
    from prometheus_client import Gauge

log = logging.getLogger("tollbooth.proxy")

# Routes whose request names no model and whose server has no /info: llama.cpp's (the served
# alias comes back in the response only), held at `upstream.model_name`'s price when it is set.
_NAMED_BY_CONFIG = frozenset({Endpoint.LLAMA_COMPLETION, Endpoint.LLAMA_INFILL})
# Servers of one model that answer a request's `model` with the request's own string, whatever
# it names (SGLang's OpenAI and Anthropic routes: `serving_chat.py` `model=request.model`; TGI's
# chat route: `server.rs` `chat_completions`): every request to one is its one model's
# (`upstream.model_name`, TGI's /info), never the client's name (docs/traffic.md).
ONE_MODEL_APIS = frozenset({"sglang", "tgi"})
# Routes whose stream is NDJSON (Ollama's), metered by their adapter's line meter.
NDJSON_ROUTES = frozenset({Endpoint.OLLAMA_CHAT, Endpoint.OLLAMA_GENERATE})
# RFC 3986 pchar and "/": what may stand unencoded in a path.
_PATH_SAFE = "/:@!$&'()*+,;=-._~"
_URL_CACHE = 1024  # upstream URLs kept by (path, query): most requests share a few


class Proxy:
    def __init__(self, settings: ProxySettings, deps: ProxyDeps) -> None:
        self.s = settings
        self.deps = deps
        self.identity = deps.identity
        self.upstream = deps.upstream
        self.metrics = metrics = deps.metrics
        self.meter = deps.meter
        self.tgi_info = deps.tgi_info
        self.sglang_default = deps.sglang_default
        self.gates = deps.gates
        self.on_start = deps.on_start
        self.counter = deps.counter
        self._urls: dict[tuple[str, str], URL] = {}
        self.memory = RequestMemory(settings.max_buffered, settings.max_buffered_per_key)
        metrics.request_memory.set_function(lambda: self.memory.total)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            path = routing_path(request.rel_url.raw_path)
        except AmbiguousPath as exc:
            return error_response(400, "ambiguous_path", f"{exc}; send the path unencoded")
        if path == SPEND_PATH:  # the sidecar's own route: answered here, never forwarded
            return await answer(request, self.identity, self.deps.statement)
        resp = await self._route(request, path)
        return in_route_shape(resp) if anthropic_route(path) else resp

    async def _route(self, request: web.Request, path: str) -> web.StreamResponse:
        endpoint = classify(request.method, path)
        try:
            # Under verified keys the headers decide: an unknown client's body is never read.
            principal = (
                None if self.identity.needs_body else self.identity.resolve(request.headers, None)
            )
            if endpoint is None:  # a required key is checked, also here
                principal = principal or self.identity.resolve(request.headers, None)
                # Forwarded as is, unless it is a POST (PUT, PATCH) that may generate.
                if request.method not in GENERATING_METHODS or path in self.s.free_routes:
                    return await self._passthrough(request, path)
                return await self._unmetered(request, path, None, principal)
        except Unauthorized as exc:
            return answers.unauthorized(self.metrics, exc)
        if content_encoded(request.headers):
            return answers.encoded(self.metrics, request)
        held = Reservation(self.memory, memory_bucket(request.headers, principal))
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
            body = await read_body(request, held, self.s.max_body, self.s.body_timeout)
            info = await inspect(endpoint, body, held, self.s, self.metrics)
            if principal is None:
                principal = self.identity.resolve(request.headers, info.user)
        except (TooLarge, web.HTTPRequestEntityTooLarge, TimeoutError, NoRoom, Unauthorized) as exc:
            return answers.unread(self.metrics, request, exc, self.s.max_body, self.s.body_timeout)
        if info.endpoint is Endpoint.OTHER:  # /invocations with a body no route takes
            return await self._unmetered(request, path, info, principal, held)
        served = await self._served_model(info)
        model = served or info.model
        if model is None and info.endpoint in _NAMED_BY_CONFIG:
            model = self.tgi_info.configured  # priced (held) before the response names it
        ex = new_exchange(request, info, path, model, len(body), principal, self.s, self.deps)
        ex.served_model = served
        await self._server_limit(ex, info)
        return await self._metered(request, ex, held)

    async def _server_limit(self, ex: Exchange, info: RequestInfo) -> None:
        """The output limit of a request that sets none, where its server states its own: TGI's
        /info max_total_tokens, SGLang's /model_info default (docs/budgets.md); the hold's."""
        if runs_to_max_total(info, self.s.api):
            ex.server_limit = await self.tgi_info.max_total_tokens()
            ex.server_limit_unknown = ex.server_limit is None
        elif info.limit_beside_default is not None:  # SGLang's /generate
            auth = tokenize_auth(ex, self.s.authorization)
            default = await self.sglang_default.max_new_tokens(auth)
            ex.server_limit_unknown = default is None
            if default:  # 0: no limit of its own, held at the budget's default
                ex.server_limit = max(default, info.limit_beside_default)

    async def _served_model(self, info: RequestInfo) -> str | None:
        """The one model of a server that repeats whatever name a request sends (ONE_MODEL_APIS,
        and SGLang's /generate told by its body) or serves one and names none (TGI's native
        routes, on any upstream.api): `upstream.model_name`, else TGI's /info `model_id`, else
        UNKNOWN_MODEL (held at the book's dearest). None for any other server, whose requests
        are the model they name."""
        api = info.api or ("tgi" if info.endpoint.is_tgi_native else self.s.api)
        if api not in ONE_MODEL_APIS:
            return None
        name = await self.tgi_info.model() if api == "tgi" else self.tgi_info.configured
        return name or UNKNOWN_MODEL

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
            info = await audio.read_head(request, endpoint, self.s.audio, held.take)
            if principal is None:
                principal = self.identity.resolve(request.headers, None)
        except (TooLarge, TimeoutError, NoRoom, Unauthorized) as exc:
            return answers.unread(
                self.metrics, request, exc, self.s.audio.max_body, self.s.body_timeout
            )
        size = info.size if info.size is not None else len(info.body)
        # vLLM serves the request's model or, with none, its own: the one upstream.model_name
        # names (a model past the head is one vLLM serves, else it refuses the request).
        served = await self._served_model(info)
        model = served or info.model or self.tgi_info.configured
        ex = new_exchange(request, info, path, model, size, principal, self.s, self.deps)
        ex.served_model = served
        return await self._metered(request, ex, held)

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
        ex = new_exchange(request, info, path, None, size, principal, self.s, self.deps)
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
        context = REQUEST_CONTEXT.set(log_context(ex))
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
                ex.prompt_tokens = await self.counter.count(
                    ex.info, tokenize_auth(ex, self.s.authorization)
                )
            for gate in self.gates:
                release = await self._pass(gate, ex)
                if release is not None:
                    releases.append(release)
            return await self._exchange(request, ex)
        except Refusal as r:
            ex.status, ex.error = r.status, r.err_type
            return error_response(r.status, r.err_type, str(r), r.retry_after)
        except asyncio.CancelledError:
            client_left(ex)
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
        except Refusal:
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
        streaming = False
        try:
            up = await self._send(request, ex, headers)
            ex.status = up.status
            if ex.endpoint is Endpoint.OTHER:
                ex.usage = Usage(unknown_reason="unmetered_route")
                return await relay(request, up, ex)
            if up.content_type == "text/event-stream" or (
                up.content_type == "application/x-ndjson" and ex.endpoint in NDJSON_ROUTES
            ):
                streaming = True  # a client leaving from here on is `stream`'s to hand over
                return await stream(request, ex, up, self.s, self.deps)
            return await buffered(request, ex, up, self.s, self.deps)
        except (TimeoutError, aiohttp.ClientError) as exc:
            return answers.upstream_failed(self.metrics, self.s.upstream, ex, exc)
        except asyncio.CancelledError:
            # The client left while the upstream had the request (queued, prefilling, or
            # generating a non-streamed answer): cancel it, and count the prompt it was sent.
            if ex.finisher is None and not streaming and ex.endpoint is not Endpoint.OTHER:
                client_left(ex)
                finish_later(ex, up, None, self.s, self.deps)
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
            upload = audio.Upload(request, body, self.s.audio, functools.partial(sent, ex))
            try:
                return await self.upstream.request(
                    request.method, target, headers, upload, length=ex.info.size
                )
            except aiohttp.ClientError:
                if upload.late is not None:  # cut short by the sidecar: the server has nothing
                    raise Refusal(400, "ambiguous_request", upload.late) from None
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

    async def _passthrough(self, request: web.Request, path: str) -> web.StreamResponse:
        """Routes that generate nothing: both bodies streamed, nothing recorded but failures."""
        headers = self._upstream_headers(request)
        target = self._url(path, request).raw_path_qs
        try:
            up = await self._streamed(request, target, headers)
            try:
                return await relay(request, up)
            finally:
                up.release()
        except (TimeoutError, aiohttp.ClientError) as exc:
            return answers.upstream_failed(self.metrics, self.s.upstream, None, exc)

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
