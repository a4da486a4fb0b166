"""Plugs the optional components into a Sidecar: each one a gate, a sink or a cleanup context.

Owns: the order in which components see a request (gates: budgets, then admission; sinks: spend,
ledger, then logs). Never: holds state of its own.
"""

from __future__ import annotations

import asyncio
from typing import Any

from . import thresholds, tracing
from .accesslog import AccessLog, access_log_context
from .admission import Admission, UpstreamTokenizer
from .app import Sidecar
from .audit import Audit, audit_context
from .budget import Spend
from .gpu import Attribution, GpuCollector, gpu_context
from .ledger import Ledger, ledger_context


def wire(sc: Sidecar, *, nvml: Any = None, span_exporter: Any = None) -> Sidecar:
    """Attach every component the config turns on. Returns `sc` for chaining.

    `nvml` and `span_exporter` are the two boundaries tests replace (a fake NVML module, an
    in-memory exporter); by default the real ones are used.
    """
    cfg = sc.config
    if cfg.gpu.enabled:
        attribution = sc.attribution = Attribution(sc.metrics, sc.prices)
        collector = GpuCollector(cfg.gpu, sc.metrics, nvml)

        def up(c: GpuCollector) -> None:
            attribution.enable(len(c.devices))
            c.on_poll = attribution.poll_energy

        sc.extra_contexts.append(gpu_context(collector, up))
        sc.on_start.append(attribution.begin)
        sc.meter.add_sink("gpu", attribution.end)
    if tracing.enabled(cfg) or span_exporter is not None:
        t = sc.tracing = tracing.Tracing(cfg, sc.metrics, span_exporter)
        sc.on_start.append(t.start)
        sc.meter.add_sink("tracing", t.finish)
        sc.extra_contexts.append(tracing.tracing_context(t))
    spend = sc.spend = Spend(cfg.budgets, sc.metrics, sc.users)
    if spend.enforcing:
        sc.gates.append(spend.gate)
    if cfg.admission.strategy != "none":
        sc.admission = Admission(cfg.admission, sc.metrics)
        if cfg.admission.tokenize:
            sc.admission.counter = UpstreamTokenizer(
                lambda: sc.proxy.session if sc.proxy else None,
                sc.upstream_base,
                cfg.upstream.api,
                sc.metrics,
            )
        sc.gates.append(sc.admission.gate)
    sc.meter.add_sink("spend", spend.settle)
    if cfg.ledger.path:
        ledger = sc.ledger = Ledger(cfg.ledger, sc.metrics)

        async def restore(opened: Ledger) -> None:
            since = spend.day_start(spend.clock())
            spend.restore(await asyncio.to_thread(opened.spend_since, since))

        sc.extra_contexts.append(ledger_context(ledger, on_open=restore))
        sc.meter.add_sink("ledger", ledger.append)
    if cfg.audit.enabled:
        audit = sc.audit = Audit(cfg.audit, thresholds.DEFAULT, sc.prices, sc.metrics, sc.ledger)
        sc.extra_contexts.append(audit_context(audit))
        sc.meter.add_sink("audit", audit.check)  # before the access log: audited lines are kept
    if cfg.logging.access_log != "off":
        access = sc.access_log = AccessLog(cfg.logging, metrics=sc.metrics)
        sc.extra_contexts.append(access_log_context(access))
        sc.meter.add_sink("access_log", access.write)
    return sc
