"""Plugs the optional components into a Sidecar: each one a gate, a sink or a cleanup context.

Owns: the order in which components see a request (gates: budgets, then admission; sinks: spend,
ledger, then logs). Never: holds state of its own.
"""

from __future__ import annotations

import asyncio

from .admission import Admission
from .app import Sidecar
from .budget import Spend
from .ledger import Ledger, ledger_context


def wire(sc: Sidecar) -> Sidecar:
    """Attach every component the config turns on. Returns `sc` for chaining."""
    cfg = sc.config
    spend = sc.spend = Spend(cfg.budgets, sc.metrics, sc.users)
    if spend.enforcing:
        sc.gates.append(spend.gate)
    if cfg.admission.strategy != "none":
        sc.admission = Admission(cfg.admission, sc.metrics)
        sc.gates.append(sc.admission.gate)
    sc.meter.add_sink("spend", spend.settle)
    if cfg.ledger.path:
        ledger = sc.ledger = Ledger(cfg.ledger, sc.metrics)

        async def restore(opened: Ledger) -> None:
            since = spend.day_start(spend.clock())
            spend.restore(await asyncio.to_thread(opened.spend_since, since))

        sc.extra_contexts.append(ledger_context(ledger, on_open=restore))
        sc.meter.add_sink("ledger", ledger.append)
    return sc
