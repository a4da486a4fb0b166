"""What /metrics shows: the registry, with every new cumulative series published at 0 first.

Owns: the view the admin app renders, and carrying the counters across a graceful restart.
Prometheus' increase() and rate() never count a series' first sample, so a
series first scraped already holding its first request's cost loses that cost: the whole first
spend of a user or model that appears mid-window, and of everything after a restart. Here each
counter or histogram series that a panel or rule reads is shown as 0 from the first time it is
exposed until `hold_s` seconds later, then with its real value. Every Prometheus that scrapes more
often than `hold_s` (one server or an HA pair) so takes at least one sample of it at 0 and counts
its first increment in full. At a graceful restart the counters go on from their values in the
next process, so no scraper loses what it had not seen yet (docs/metrics.md, "Exact increases").
Never: changes a value in the registry (budgets, tests and the demo read the truth), runs on the
request path, or holds a gauge.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

from .metrics import OTHER, LabelCap, Metrics

log = logging.getLogger("tollbooth.exposition")

Labels = tuple[str, ...]
# Saved series older than this are dropped (the counters start from 0: a reset): going on from them
# would put spend no scraper saw into a window long after it happened.
CARRY_MAX_AGE_S = 3600.0


def read_by_increase(m: Metrics) -> dict[str, Any]:
    """The families a dashboard panel or an alert rule reads with increase() or rate(), by name.

    tests/test_monitoring.py fails if a rule or panel reads a counter or histogram not listed here.
    Internal health counters are left out on purpose: they are shown as they are, at once.
    """
    read = (
        m.requests,
        m.tokens,
        m.cached_tokens,
        m.usage_unknown,
        m.duration,
        m.ttft,
        m.tpot,
        m.cost,
        m.request_cost,
        m.cost_unknown,
        m.budget_rejections,
        m.queue_wait,
        m.admission_rejections,
        m.device_seconds,
        m.device_cost,
        m.energy,
        # fleet mode: the latency dashboard's budget store panel
        m.store_bypassed,
        m.store_refused,
        m.store_local,
        m.holds_expired,
    )
    return {fam.name: c for c in read for fam in c.describe()}


class HeldView:
    """A collector over a registry for `generate_latest`: newly exposed cumulative series read 0."""

    def __init__(
        self,
        registry: CollectorRegistry,
        families: Collection[str],
        hold_s: float,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._registry = registry
        self._families = frozenset(families)
        self._hold_s = hold_s
        self._clock = clock or time.time  # the clock prometheus_client stamps `_created` with
        self._last_render = -math.inf
        self._exposed: dict[str, dict[Labels, float]] = {}  # held series: first shown at
        self._seen: dict[str, set[Labels]] = {}  # only when `_created` samples are switched off
        self._shown_before: dict[str, set[Labels]] = {}  # carried series the scrapers know

    def shown_before(self, family: str, labels: dict[str, str]) -> None:
        """A series carried from the previous process that scrapers have already seen above 0:
        it goes on at its value, not at 0 (a 0 would read as a reset, and count it twice)."""
        key = tuple(v for k, v in labels.items() if k != "le")
        self._shown_before.setdefault(family, set()).add(key)

    def collect(self) -> Iterator[Metric]:
        now = self._clock()
        for fam in self._registry.collect():
            if self._hold_s > 0 and fam.name in self._families:
                yield self._held(fam, now)
            else:
                yield fam
        self._last_render = now

    def _held(self, fam: Metric, now: float) -> Metric:
        held = self._holding(fam, now)
        if not held:
            return fam  # the usual case: every series has been shown for longer than the hold
        out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
        created = fam.name + "_created"
        # The exemplar stays: it is a real trace, and the link should not wait.
        out.samples = [
            s._replace(value=0.0) if s.name != created and _labels(s) in held else s
            for s in fam.samples
        ]
        return out

    def _holding(self, fam: Metric, now: float) -> dict[Labels, float]:
        """Note the series shown for the first time now; return those still in their hold."""
        exposed = self._exposed.setdefault(fam.name, {})
        shown_before = self._shown_before.pop(fam.name, set())  # only until the first render
        for key in self._new(fam):
            if key not in shown_before:
                exposed.setdefault(key, now)
        for key in [k for k, t in exposed.items() if now - t >= self._hold_s]:
            del exposed[key]
        return exposed

    def _new(self, fam: Metric) -> Iterator[Labels]:
        """Series never shown before: created since the last render."""
        created = fam.name + "_created"
        if not fam.samples or any(s.name == created for s in fam.samples):
            yield from self._created_since_render(fam)
            return
        seen = self._seen.setdefault(fam.name, set())  # PROMETHEUS_DISABLE_CREATED_SERIES
        for s in fam.samples:
            if (key := _labels(s)) not in seen:
                seen.add(key)
                yield key

    def carried(self) -> list[dict[str, Any]]:
        """Every series the view reads, for the next process (see `save`).

        A counter carries its value, and whether a scraper may have seen it above 0 (`shown`);
        the next process goes on from there, so the restart is no reset at all. A histogram
        carries its labels only: it goes on from 0 (a reset Prometheus handles).
        """
        out: list[dict[str, Any]] = []
        for fam in self._registry.collect():
            if fam.name not in self._families or fam.type not in ("counter", "histogram"):
                continue
            young = set(self._exposed.get(fam.name, {})) | set(self._created_since_render(fam))
            if fam.type == "histogram":
                out += [
                    {"family": fam.name, "labels": s.labels}
                    for s in fam.samples
                    if s.name == fam.name + "_count"
                ]
                continue
            out += [
                {
                    "family": fam.name,
                    "labels": s.labels,
                    "value": s.value,
                    "shown": _labels(s) not in young,
                }
                for s in fam.samples
                if s.name == fam.name + "_total" and s.value  # a 0 carries nothing
            ]
        return out

    def _created_since_render(self, fam: Metric) -> Iterator[Labels]:
        created = fam.name + "_created"
        for s in fam.samples:
            if s.name == created and s.value >= self._last_render:
                yield _labels(s)


def _labels(s: Sample) -> Labels:
    """The series a sample belongs to: a histogram's buckets share their child's labels."""
    return tuple(v for k, v in s.labels.items() if k != "le")


def published(m: Metrics, hold_s: float) -> tuple[CollectorRegistry, HeldView]:
    """The registry /metrics renders (`m`'s own, seen through a `HeldView`), and the view."""
    view = HeldView(m.registry, read_by_increase(m), hold_s)
    out = CollectorRegistry()
    out.register(view)
    return out, view


# --- carrying series across a graceful restart ---------------------------------------------------


def carry_path(ledger_path: str | None) -> Path | None:
    """Kept beside the ledger; without a ledger nothing is carried."""
    return Path(ledger_path + ".series.json") if ledger_path else None


def save(view: HeldView, path: Path, clock: Callable[[], float] = time.time) -> int:
    """At shutdown, after the last request was metered. Returns how many series were saved."""
    series = view.carried()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"saved_at": clock(), "series": series}))
    os.replace(tmp, path)
    return len(series)


Relabel = Callable[[dict[str, str]], dict[str, str]]


def restore(
    m: Metrics,
    view: HeldView,
    path: Path,
    relabel: Relabel = dict,
    clock: Callable[[], float] = time.time,
) -> int:
    """At start, before the first request and the first scrape: every saved series goes on.

    A counter starts at its saved value, so a graceful restart is no reset: whatever a scraper had
    not seen yet (the last increments, a series still in its hold) it sees now, exactly once.
    `relabel` passes the labels through this process's caps. The file is removed first: a crash
    after this never counts a cost twice.
    """
    try:
        data = json.loads(path.read_text())
        path.unlink()
    except FileNotFoundError:
        return 0
    except (OSError, ValueError) as exc:
        log.error("series saved in %s not read: %s", path, exc)
        return 0
    if clock() - float(data.get("saved_at", 0)) > CARRY_MAX_AGE_S:
        log.warning("series saved in %s are over %.0fs old: dropped", path, CARRY_MAX_AGE_S)
        return 0
    families = read_by_increase(m)
    n = 0
    for s in data.get("series", []):
        try:
            labels = relabel(s["labels"])
            child = families[s["family"]].labels(**labels)
            if (value := float(s.get("value", 0.0))) > 0:
                child.inc(value)
            if s.get("shown"):
                view.shown_before(s["family"], labels)
            n += 1
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            log.error("saved series %r not restored: %s", s, exc)
    return n


def carry_context(
    m: Metrics, view: HeldView, path: Path, users: LabelCap, models: LabelCap
) -> Callable[[web.Application], AsyncIterator[None]]:
    """The admin app's cleanup context: restore before the listeners open; save after the proxy
    has drained (every request metered)."""

    def relabel(labels: dict[str, str]) -> dict[str, str]:
        out = dict(labels)
        for key, cap in (("user_id", users), ("model", models)):
            if key in out and out[key] != OTHER:
                out[key] = cap(out[key])  # the caps of this process bound the carried series too
        return out

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        if n := await asyncio.to_thread(restore, m, view, path, relabel):
            log.info("restored %d series from %s", n, path)
        yield
        await asyncio.to_thread(save, view, path)

    return ctx
