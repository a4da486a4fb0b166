"""Plugs the optional components into a Sidecar: each one a gate, a sink or a cleanup context.

Owns: the order in which components see a request (gates: budgets, then admission, then the start
of GPU attribution; sinks: GPU attribution, spend, ledger, then logs). Never: holds state of its
own.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ..billing.admission import Admission
from ..billing.audit import Audit
from ..billing.budget import Budgets, max_scopes, month_start, today_by_user_and_team
from ..billing.budget_state import BudgetState
from ..billing.ledger import Ledger, ledger_context
from ..exchange import CleanupContext, closing_context, task_context
from ..telemetry import thresholds, tracing
from ..telemetry.accesslog import AccessLog
from ..telemetry.gpu import Attribution, GpuCollector, gpu_context
from ..telemetry.health import Writer
from ..telemetry.reconcile import Reconciler
from .app import Sidecar

if TYPE_CHECKING:  # imported when configured: a single sidecar never loads redis or psycopg
    from opentelemetry.sdk.metrics.export import MetricExporter
    from opentelemetry.sdk.trace.export import SpanExporter

    from ..billing.fleet_ledger import Shipper
    from ..billing.redis_store import RedisStore


def wire(
    sc: Sidecar,
    *,
    nvml: Any = None,
    span_exporter: SpanExporter | None = None,
    metric_exporter: MetricExporter | None = None,
) -> Sidecar:
    """Attach every component the config turns on. Returns `sc` for chaining.

    `nvml`, `span_exporter` and `metric_exporter` are the boundaries tests replace (a fake NVML
    module, in-memory exporters); by default the real ones are used.
    """
    cfg = sc.config
    if cfg.gpu.enabled:
        attribution = sc.attribution = Attribution(sc.metrics, sc.prices, cfg.admission)

        def up(c: GpuCollector) -> None:
            attribution.enable(len(c.devices))
            c.on_poll = attribution.poll_energy

        sc.extra_contexts.append(gpu_context(GpuCollector(cfg.gpu, sc.metrics, nvml), up))
        sc.meter.add_sink("gpu", attribution.end)  # first sink: device_seconds for the others
    if tracing.enabled(cfg) or span_exporter is not None:
        t = sc.tracing = tracing.Tracing(cfg, sc.metrics, span_exporter)
        sc.on_start.append(t.start)
        sc.meter.add_sink("tracing", t.finish)
        sc.extra_contexts.append(closing_context(t.shutdown))  # flushes what is queued
    if tracing.enabled(cfg, "metric") or metric_exporter is not None:  # GenAI metrics
        from ..telemetry.genai_metrics import GenAiMetrics

        genai = GenAiMetrics(cfg, metric_exporter)
        sc.meter.add_sink("genai_metrics", genai.finish)
        # exports what was recorded since the last export
        sc.extra_contexts.append(closing_context(genai.shutdown))
    if cfg.reconcile.enabled:
        _reconcile(sc)
    shipper = sc.shipper = _shipper(sc)
    store = _shared_store(sc, shipper)
    budgets = sc.budgets = Budgets(
        cfg.budgets, cfg.admission, sc.metrics, sc.users, sc.prices, store=store, teams=sc.teams
    )
    # the budgets' limits and what is left of them, read when scraped
    sc.metrics.registry.register(BudgetState(cfg.budgets, sc.metrics, budgets))
    if budgets.rules:  # before the queue: a request over budget never waits in it
        sc.gates.append(budgets.gate)
    if cfg.admission.strategy != "none":
        sc.admission = Admission(cfg.admission, sc.metrics)
        sc.gates.append(sc.admission.gate)
    sc.meter.add_sink("spend", budgets.settle)
    if cfg.ledger.path:
        ledger = sc.ledger = Ledger(cfg.ledger, sc.metrics)

        async def restore(opened: Ledger) -> None:
            day = budgets.day_start(budgets.clock())
            rows = await asyncio.to_thread(opened.spend_rows, day, month_start(day))
            if store is None:
                await budgets.restore(rows)
            else:  # the shared store seeds itself from the fleet's ledger
                budgets.restore_gauge(*today_by_user_and_team(rows))

        if shipper is not None:  # ships after the ledger's last rows; starts after its retention
            from ..billing.fleet_ledger import shipper_contexts

            outer, inner = shipper_contexts(shipper)
            sc.extra_contexts.append(outer)
        sc.extra_contexts.append(ledger_context(ledger, on_open=restore))
        if shipper is not None:
            sc.extra_contexts.append(inner)
        sc.meter.add_sink("ledger", ledger.append)
    if cfg.audit.enabled:
        audit = sc.audit = Audit(cfg.audit, thresholds.DEFAULT, sc.prices, sc.metrics, sc.ledger)
        sc.extra_contexts.append(_writer_context(audit))
        sc.meter.add_sink("audit", audit.check)  # before the access log: audited lines are kept
    if cfg.logging.access_log != "off":
        access = sc.access_log = AccessLog(cfg.logging, metrics=sc.metrics)
        sc.extra_contexts.append(_writer_context(access))
        sc.meter.add_sink("access_log", access.write)
    if sc.attribution is not None:  # the last gate: GPU time counts from admission, not arrival
        sc.gates.append(sc.attribution.admitted)
    _watch_writers(sc)
    return sc


def _reconcile(sc: Sidecar) -> None:
    """The engine's own token counters, scraped through the one upstream client; exported on
    the sidecar's registry under the same model labels (its LabelCap) as llm_tokens_total."""
    cfg = sc.config
    reconciler = Reconciler(
        lambda: sc.proxy.upstream if sc.proxy else None,
        path=cfg.upstream.metrics_path,
        interval_s=cfg.reconcile.interval_s,
        timeout_s=cfg.reconcile.timeout_s,
        default_model=cfg.upstream.model_name or "unknown",
        label=sc.models,
    )
    sc.metrics.registry.register(reconciler)
    # scrapes in the background (the first at once) until closed
    sc.extra_contexts.append(task_context("tollbooth-reconcile", reconciler.run))


def _writer_context(writer: Audit | AccessLog) -> CleanupContext:
    """Its writer thread started before the first request; stopped (what is pending written,
    the file closed) after the last."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        writer.start()
        yield
        writer.stop()

    return ctx


def _watch_writers(sc: Sidecar) -> None:
    """tollbooth_writer_failing{writer}: each writer's `problem` (what /readyz reads), read when
    scraped; nothing on the request path."""
    writers: dict[str, Writer | None] = {"ledger": sc.ledger, "shipper": sc.shipper}
    writers.update({"access_log": sc.access_log, "audit": sc.audit})
    for name, writer in writers.items():
        if writer is not None:
            failing = functools.partial(_failing, writer)
            sc.metrics.writer_failing.labels(name).set_function(failing)


def _failing(writer: Writer) -> float:
    return 0.0 if writer.problem is None else 1.0


def _shipper(sc: Sidecar) -> Shipper | None:
    cfg = sc.config.ledger
    if not (cfg.postgres_url and cfg.path):
        return None
    from ..billing.fleet_ledger import Shipper

    return Shipper(cfg, sc.metrics)


def _shared_store(sc: Sidecar, shipper: Shipper | None) -> RedisStore | None:
    """The Redis store when budgets.store is set; it seeds a day from PostgreSQL when the fleet
    ledger is configured, else from this sidecar's own ledger."""
    cfg = sc.config
    if not cfg.budgets.store:
        return None
    from ..billing.fleet_ledger import local_spend_rows
    from ..billing.redis_store import RedisStore, store_context

    path = cfg.ledger.path

    async def source(day: int) -> tuple[Mapping[str, int], float]:
        assert sc.budgets is not None
        month = month_start(day)
        if shipper is not None:
            rows, read_at = await asyncio.to_thread(shipper.spend_rows, day, month)
        else:
            assert path is not None
            read_at = time.time()
            rows = await asyncio.to_thread(local_spend_rows, path, day, month)
        return sc.budgets.spent_by_scope(rows), read_at

    def today() -> int:
        assert sc.budgets is not None  # made right after the store, before it is opened
        return sc.budgets.day_start(sc.budgets.clock())

    store = RedisStore(
        cfg.budgets,
        sc.metrics,
        today,
        source if path else None,
        max_scopes=max_scopes(cfg.budgets),
    )
    sc.extra_contexts.append(store_context(store))
    return store
