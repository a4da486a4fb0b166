"""The aiohttp applications and the process around them.

Owns: `create_app(config)` (the proxy) and `create_admin_app()` (/metrics, /healthz, /readyz),
one cleanup context per resource (the upstream client and its probe, ledger, tracer, NVML poller,
audit writer),
signal handling (SIGTERM drains in-flight requests within a grace period, SIGHUP re-reads prices).
Never: pairs on_startup with on_cleanup; every resource is created before `yield`, closed after.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry, exposition
from prometheus_client.openmetrics import exposition as om_exposition

from ..config import Config, check_served_model, parse_hostport
from ..exchange import CleanupContext, Exchange, Gate, task_context
from ..metering.meter import Meter
from ..metering.pricing import PriceBook, load_pricing_file
from ..proxy.audio import AudioLimits
from ..proxy.edge import ConnectionGuard, listen
from ..proxy.finishers import PromptCounter
from ..proxy.handler import Proxy
from ..proxy.identity import Identity, upstream_authorization
from ..proxy.routes import routing_path
from ..proxy.settings import ProxyDeps, ProxySettings, SGLangDefault, TgiInfo
from ..proxy.upstream import Upstream
from ..telemetry import exposition as held
from ..telemetry.health import UpstreamProbe, readiness
from ..telemetry.metrics import OTHER, LabelCap, Metrics

if TYPE_CHECKING:  # set by wiring when configured; a single sidecar never loads psycopg
    from ..billing.admission import Admission
    from ..billing.audit import Audit
    from ..billing.budget import Budgets
    from ..billing.fleet_ledger import Shipper
    from ..billing.ledger import Ledger
    from ..telemetry.accesslog import AccessLog
    from ..telemetry.gpu import Attribution
    from ..telemetry.tracing import Tracing

log = logging.getLogger("tollbooth")


@dataclass
class Sidecar:
    """The process's shared state, reachable from both applications."""

    config: Config
    metrics: Metrics = field(default_factory=Metrics)
    pricing_path: str | None = None
    draining: bool = False
    proxy: Proxy | None = None
    extra_contexts: list[CleanupContext] = field(default_factory=list)
    gates: list[Gate] = field(default_factory=list)  # may refuse a request before the upstream
    on_start: list[Callable[[Exchange], None]] = field(default_factory=list)

    budgets: Budgets | None = None  # set by wiring
    probe: UpstreamProbe | None = None  # set by create_app
    ledger: Ledger | None = None  # when a ledger path is configured
    shipper: Shipper | None = None  # when ledger.postgres_url is configured
    admission: Admission | None = None  # unless the strategy is "none"
    attribution: Attribution | None = None  # when GPU telemetry is enabled
    tracing: Tracing | None = None  # when an OTLP endpoint is configured
    audit: Audit | None = None  # when audit capture is enabled
    access_log: AccessLog | None = None  # unless logging.access_log is "off"

    def __post_init__(self) -> None:
        pricing = self.config.pricing
        if self.pricing_path:
            pricing = load_pricing_file(self.pricing_path)
            check_served_model(self.config.upstream, pricing)
        self.prices = PriceBook(pricing)
        self.meter = Meter(self.metrics, self.prices)
        self.identity = Identity(self.config)  # reads the keys file: a bad one stops the start
        self.upstream_auth = upstream_authorization(self.config)
        self.users = LabelCap(self.config.metering.max_tracked_users)
        self.models = LabelCap(self.config.metering.max_tracked_models, max_len=128)
        # A model limit's name keeps its label first: a model scope is the request's model
        # label, and a name past a full cap is `__other__`, where no named limit applies.
        for lim in self.config.budgets.limits:
            if lim.scope == "model" and lim.name != "*":
                self.models(lim.name)
        self.teams = LabelCap(self.config.metering.max_tracked_teams)
        _init_label_sets(self)

    def reload(self) -> None:
        """SIGHUP: re-read the prices and the keys file; a bad file keeps the old table."""
        if self.identity.keys is not None:
            try:
                self.identity.reload()
                log.info("SIGHUP: %d API keys re-read", len(self.identity.keys))
            except Exception as exc:
                log.error("SIGHUP: API keys not changed: %s", exc)
            _init_label_sets(self)  # the new keys' users
        if not self.pricing_path:
            log.info("SIGHUP: no --pricing file given; prices unchanged")
            return
        try:
            pricing = load_pricing_file(self.pricing_path)
            check_served_model(self.config.upstream, pricing)
            self.prices.replace(pricing)
            _init_label_sets(self)
            log.info("SIGHUP: prices re-read from %s", self.pricing_path)
        except Exception as exc:  # keep the old prices rather than lose accounting
            log.error("SIGHUP: prices not changed: %s", exc)


def _init_label_sets(sc: Sidecar) -> None:
    """Every series known ahead is created at 0 now (start-up, and every reload): the priced
    models' request, error, cost and latency series, and the keys file's users' token and cost
    series, through the label caps. Published at 0, they need no hold: a first request or a
    first error shows on the next scrape (telemetry/exposition.py)."""
    models = [sc.models(model) for model in sc.prices.config.models]
    known = sc.identity.keys.users() if sc.identity.keys is not None else []
    users = [u for u in (sc.users(user) for user in known) if u != OTHER]
    eps = held.endpoints_for(sc.config.upstream.api)
    n = held.publish_ahead(sc.metrics, [m for m in models if m != OTHER], eps, users)
    log.info("%d series published ahead: %d models, %d known users", n, len(models), len(users))


SIDECAR = web.AppKey("sidecar", Sidecar)
PUBLISHED = web.AppKey("published", CollectorRegistry)


def create_app(sidecar: Sidecar | Config) -> web.Application:
    sc = sidecar if isinstance(sidecar, Sidecar) else Sidecar(sidecar)
    app = web.Application(client_max_size=sc.config.server.max_request_body_bytes)
    app[SIDECAR] = sc
    app.cleanup_ctx.append(_proxy_ctx)
    sc.probe = UpstreamProbe(  # readiness: the upstream probed in the background
        sc.config.upstream, sc.metrics, lambda: sc.proxy.upstream if sc.proxy else None
    )
    # one probe before the first request, then one every interval
    app.cleanup_ctx.append(task_context("tollbooth-upstream-probe", sc.probe.run, sc.probe.once))
    app.cleanup_ctx.extend(sc.extra_contexts)
    app.cleanup_ctx.append(_finishers_ctx)  # last: closed first, while sinks still take records
    app.router.add_route("*", "/{tail:.*}", _handle)
    return app


async def _handle(request: web.Request) -> web.StreamResponse:
    proxy = request.app[SIDECAR].proxy
    assert proxy is not None
    return await proxy.handle(request)


# Options for the server (the AppRunner) of every proxy app. auto_decompress off: aiohttp's server
# would otherwise decode a request body sent with a Content-Encoding, and a route whose body is
# streamed would reach the upstream decoded under the client's Content-Encoding header. Metered
# routes refuse such a body before reading it (415, docs/traffic.md).
PROXY_SERVER_OPTIONS: dict[str, Any] = {"auto_decompress": False}


async def _proxy_ctx(app: web.Application) -> AsyncIterator[None]:
    sc = app[SIDECAR]
    up = sc.config.upstream
    base = up.url.rstrip("/")  # request paths are appended to it
    metering = sc.config.metering
    settings = ProxySettings(
        upstream=base,
        inject_usage=metering.inject_stream_usage,
        max_body=sc.config.server.max_request_body_bytes,
        body_timeout=sc.config.server.body_timeout_s,
        max_buffered=sc.config.server.max_buffered_request_bytes,
        max_buffered_per_key=sc.config.server.max_buffered_request_bytes_per_key,
        authorization=sc.upstream_auth,
        # SSE framing costs ~100 bytes per token: keep enough stream to recover the text
        capture_bytes=(
            max(65536, sc.config.audit.max_text_chars * 128)
            if sc.config.audit.enabled and sc.config.audit.capture_text
            else 0
        ),
        api=up.api,
        sglang_messages_usage=up.sglang_messages_usage,
        continuous_usage=metering.continuous_usage and up.api == "vllm",
        free_routes=frozenset(routing_path(r) for r in metering.free_routes),
        refuse_unknown_routes=metering.unknown_routes == "refuse",
        drain_s=metering.drain_after_disconnect_s,
        max_event_bytes=metering.max_event_bytes,
        audio=AudioLimits(
            head_bytes=sc.config.server.audio_form_bytes,
            max_body=sc.config.server.max_audio_body_bytes,
            timeout=sc.config.server.body_timeout_s,
        ),
        size_prompts=sc.config.admission.tokenize,
    )
    # Every call to the upstream goes through one pool (sidecar/proxy/upstream.py).
    upstream = Upstream(
        base,
        connect_timeout=up.connect_timeout_s,
        read_timeout=up.read_timeout_s,
        limit=up.max_connections,
        authorization=sc.upstream_auth,
    )
    deps = ProxyDeps(
        upstream=upstream,
        metrics=sc.metrics,
        meter=sc.meter,
        identity=sc.identity,
        users=sc.users,
        models=sc.models,
        tgi_info=TgiInfo(upstream, up.model_name),
        sglang_default=SGLangDefault(upstream),
        gates=sc.gates,
        on_start=sc.on_start,
        counter=PromptCounter(upstream, up.api, sc.metrics),
        statement=sc.budgets.statement if sc.budgets is not None else None,
    )
    sc.proxy = Proxy(settings, deps)
    yield
    await upstream.close()


async def _finishers_ctx(app: web.Application) -> AsyncIterator[None]:
    """Requests whose client left are finished in the background (bounded: the drain and
    /tokenize deadlines); on shutdown they get that long to reach the meter."""
    yield
    proxy = app[SIDECAR].proxy
    if proxy is not None:
        cfg = app[SIDECAR].config.metering
        await proxy.deps.finishers.close(cfg.drain_after_disconnect_s + PromptCounter.TIMEOUT_S)


# --- admin ----------------------------------------------------------------------------------------


def create_admin_app(sc: Sidecar) -> web.Application:
    app = web.Application()
    app[SIDECAR] = sc
    app[PUBLISHED], view = held.published(sc.metrics, sc.config.metering.new_series_hold_s)
    carry = held.carry_path(sc.config.ledger.path)
    if carry is not None:  # series survive a graceful restart
        app.cleanup_ctx.append(held.carry_context(sc.metrics, view, carry, sc.users, sc.models))
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    return app


async def _metrics(request: web.Request) -> web.Response:
    registry = request.app[PUBLISHED]  # new series read 0 first: sidecar/telemetry/exposition.py
    if request.query.get("hold") == "0":  # for people and scripts: the registry's true values
        registry = request.app[SIDECAR].metrics.registry
    if "application/openmetrics-text" in request.headers.get("Accept", ""):
        # OpenMetrics carries exemplars (trace ids on the cost and duration histograms).
        body = om_exposition.generate_latest(registry)  # type: ignore[no-untyped-call]
        ctype = om_exposition.CONTENT_TYPE_LATEST
    else:
        body = exposition.generate_latest(registry)
        ctype = exposition.CONTENT_TYPE_LATEST
    return web.Response(body=body, headers={"Content-Type": ctype})


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    """Ready: serving, the upstream answered its last background probe, every writer writes."""
    sc = request.app[SIDECAR]
    status, body = readiness(
        starting=sc.proxy is None,
        draining=sc.draining,
        probe=sc.probe,
        ledger=sc.ledger,
        writers={"shipper": sc.shipper, "access_log": sc.access_log, "audit": sc.audit},
    )
    return web.json_response(body, status=status)


# --- the process ----------------------------------------------------------------------------------


async def serve(sc: Sidecar) -> None:
    """Run the proxy and admin listeners until SIGTERM/SIGINT; drain, then close resources."""
    cfg = sc.config.server
    grace = cfg.shutdown_grace_s
    proxy_guard = ConnectionGuard(cfg, sc.metrics, "proxy")  # slow and idle clients are cut off
    admin_guard = ConnectionGuard(cfg, sc.metrics, "admin")
    proxy_app, admin_app = create_app(sc), create_admin_app(sc)  # `listen` puts them behind
    proxy_runner = web.AppRunner(
        proxy_app,
        **PROXY_SERVER_OPTIONS,
        handler_cancellation=True,
        shutdown_timeout=grace,
        access_log=None,
        keepalive_timeout=proxy_guard.backstop_s,
    )
    admin_runner = web.AppRunner(
        admin_app, access_log=None, keepalive_timeout=admin_guard.backstop_s
    )
    await proxy_runner.setup()
    await admin_runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    with contextlib.suppress(NotImplementedError, AttributeError):
        loop.add_signal_handler(signal.SIGHUP, sc.reload)
    listeners: list[asyncio.AbstractServer] = []
    try:
        host, port = parse_hostport("server.listen", cfg.listen)
        listeners.append(await listen(proxy_runner, proxy_guard, host, port))
        ahost, aport = parse_hostport("server.admin_listen", cfg.admin_listen)
        listeners.append(await listen(admin_runner, admin_guard, ahost, aport))
        log.info(
            "tollbooth listening on %s, admin on %s, upstream %s",
            cfg.listen,
            cfg.admin_listen,
            sc.config.upstream.url,
        )
        await stop.wait()
        log.info("shutting down: draining in-flight requests (grace %.0fs)", grace)
        sc.draining = True
    finally:
        for listener in listeners:
            listener.close()  # stop accepting; the runners drain what is in flight
        await proxy_runner.cleanup()  # waits for handlers up to the grace period
        await admin_runner.cleanup()
        log.info("stopped")
