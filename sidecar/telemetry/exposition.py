"""What /metrics shows: the registry, with every cumulative series seen at 0 before its value.

Owns: the series published ahead (`publish_ahead`), the view the admin app renders, and carrying
the counters and histograms across a graceful restart.
Prometheus' increase() and rate() never count a series' first sample, so a
series first scraped already holding its first request's cost loses that cost: the whole first
spend of a user or model that appears mid-window, and of everything after a restart. So every
series that can be known ahead (per priced model, endpoint, status the sidecar produces, known
user) is created at 0 at start-up and on every reload: its first exposure is 0, it needs no hold,
and its first request shows on the next scrape. Only a series a scrape would first expose already
carrying a value (an unforeseen user, model or status) is shown as 0 from that exposure until
`hold_s` seconds later, then with its real value. Every Prometheus that scrapes more often than
`hold_s` (one server or an HA pair) so takes at least one sample of it at 0 and counts its first
increment in full. At a graceful restart the counters and histograms go on from their values in
the next process, so no scraper loses what it had not seen yet (docs/metrics.md, "Exact increases").
Never: changes a value in the registry (budgets, tests, the demo and `/metrics?hold=0` read the
truth), runs on the request path, or holds a gauge.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Iterator
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

from ..exchange import STATUS_CLIENT_CLOSED, CleanupContext, Endpoint
from .metrics import OTHER, LabelCap, Metrics

log = logging.getLogger("tollbooth.exposition")

# The `status_code` values the sidecar itself produces (its own answers, and how it records a
# request that ends in the stream or with the client gone): published ahead for every priced
# model, so a first error or refusal is on the next scrape. Other upstream statuses are held.
SIDECAR_STATUSES = (
    "200",
    "400",  # ambiguous path or request
    "401",  # unknown API key
    "413",  # body over max_request_body_bytes
    "429",  # budget
    str(STATUS_CLIENT_CLOSED),
    "502",  # upstream unreachable
    "503",  # admission queue, budget store, request memory
    "504",  # upstream timeout
    "stream_error",
)
TOKEN_TYPES = ("input", "output")
# Known users' series published ahead (tokens and cost, per priced model, endpoint and token
# type): at most this many, on top of the label caps; the users past it are held as unforeseen.
MAX_USER_SERIES_AHEAD = 20_000

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
        m.audio_seconds,
        m.usage_unknown,
        m.duration,
        m.ttft,
        m.tpot,
        m.prompt_tokens,
        m.output_tokens,
        m.finish_reasons,  # the upstream's words: not known ahead, held when first seen
        m.cost,
        m.request_cost,
        m.cost_unknown,
        m.budget_rejections,
        m.budget_refusals,
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


def endpoints_for(api: str) -> tuple[str, ...]:
    """The metered endpoints an upstream of this kind serves (`other` is never priced)."""
    skip = {Endpoint.OTHER, Endpoint.INVOCATIONS}
    return tuple(
        ep.label for ep in Endpoint if ep not in skip and (api == "tgi" or not ep.is_tgi_native)
    )


def publish_ahead(
    m: Metrics, models: Iterable[str], endpoints: Iterable[str], users: Iterable[str]
) -> int:
    """Create at 0 every series that can be known before a request; returns how many exist.

    `models` and `users` are labels already through the label caps. Per model and endpoint: the
    request series of every status in SIDECAR_STATUSES and the histograms the alerts and the
    latency panels read; per model, the prompt and output length histograms; per known user in
    addition: tokens and cost of each token type. (Finish reasons are the server's words, not
    known ahead.)
    """
    eps, n = tuple(endpoints), 0
    models, users = tuple(dict.fromkeys(models)), tuple(dict.fromkeys(users))
    for model in models:
        m.child(m.prompt_tokens, model)
        m.child(m.output_tokens, model)
        n += 2
        for ep in eps:
            for status in SIDECAR_STATUSES:
                m.child(m.requests, model, ep, status)
            for hist in (m.request_cost, m.duration, m.ttft, m.tpot):
                m.child(hist, model, ep)
            n += len(SIDECAR_STATUSES) + 4
    per_user = 2 * len(models) * len(eps) * len(TOKEN_TYPES)  # and one refusal series
    room = MAX_USER_SERIES_AHEAD // per_user if per_user else 0
    if len(users) > room:
        log.warning(
            "%d known users: the series of the first %d are published ahead, the others "
            "held when they first appear (MAX_USER_SERIES_AHEAD=%d)",
            len(users),
            room,
            MAX_USER_SERIES_AHEAD,
        )
    for user in users[:room]:
        for model in models:
            for ep in eps:
                for kind in TOKEN_TYPES:
                    m.child(m.tokens, model, kind, ep, user)
                    m.child(m.cost, model, kind, ep, user)
        m.child(m.budget_refusals, user, "user", "budget")
        n += per_user + 1
    return n


HELD_NOTE = (
    " A series first exposed already carrying a value reads 0 here for its first {hold:g} s"
    " (metering.new_series_hold_s), so rate() counts its first increment; /metrics?hold=0 shows"
    " the true values (docs/metrics.md, Exact increases)."
)


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
        self._note = HELD_NOTE.format(hold=hold_s)
        self._judged: dict[str, set[Labels]] = {}  # the series new at the last render

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
        # The HELP text says so on every render (a HELP that changed between scrapes would
        # read as a changed metric).
        out = Metric(fam.name, fam.documentation + self._note, fam.type, fam.unit)
        if not held:
            out.samples = fam.samples  # the usual case: nothing in its hold
            return out
        created = fam.name + "_created"
        # The exemplar stays: it is a real trace, and the link should not wait.
        out.samples = [
            s._replace(value=0.0) if s.name != created and _labels(s) in held else s
            for s in fam.samples
        ]
        return out

    def _holding(self, fam: Metric, now: float) -> dict[Labels, float]:
        """Note the series shown for the first time now; return those still in their hold.

        A series first shown at 0 has nothing to lose: it is not held (every series published
        ahead is one). One first shown carrying a value is.
        """
        exposed = self._exposed.setdefault(fam.name, {})
        shown_before = self._shown_before.pop(fam.name, set())  # only until the first render
        fresh = set(self._new(fam))
        # A series created at the very instant of the last render is seen as new again now: it
        # was judged then (`_judged`), and shown at 0 or held from then.
        new = fresh - shown_before - self._judged.get(fam.name, set())
        self._judged[fam.name] = fresh
        if new:
            carrying = _carrying(fam)
            for key in new:
                if key in carrying:
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
        carries its buckets (upper bounds and cumulative counts) and sum the same way: an
        observation made after the last scrape is not lost in the restart.
        """
        out: list[dict[str, Any]] = []
        for fam in self._registry.collect():
            if fam.name not in self._families or fam.type not in ("counter", "histogram"):
                continue
            young = set(self._exposed.get(fam.name, {})) | set(self._created_since_render(fam))
            if fam.type == "histogram":
                out += _histograms(fam, young)
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


def _histograms(fam: Metric, young: set[Labels]) -> list[dict[str, Any]]:
    """Each child of a histogram family: labels, bucket bounds and cumulative counts, sum."""
    out: dict[Labels, dict[str, Any]] = {}
    for s in fam.samples:
        key = _labels(s)
        if s.name == fam.name + "_count":
            out[key] = {"family": fam.name, "labels": s.labels, "shown": key not in young}
    for s in fam.samples:
        if (entry := out.get(_labels(s))) is None:
            continue
        if s.name == fam.name + "_bucket":
            entry.setdefault("le", []).append(float(s.labels["le"]))
            entry.setdefault("buckets", []).append(s.value)
        elif s.name == fam.name + "_sum":
            entry["sum"] = s.value
    return list(out.values())


def _go_on(child: Any, saved: dict[str, Any]) -> None:
    """A restored histogram child goes on from its saved buckets and sum, where its bounds are
    the saved ones (other bounds: it goes on from 0, a reset)."""
    bounds, counts = saved.get("le"), saved.get("buckets")
    if bounds is None or counts is None or [float(b) for b in child._upper_bounds] != bounds:
        return
    below = 0.0
    for cell, cumulative in zip(child._buckets, counts, strict=True):
        if (n := float(cumulative) - below) > 0:
            cell.inc(n)
        below = float(cumulative)
    child._sum.inc(float(saved.get("sum", 0.0)))


def _carrying(fam: Metric) -> set[Labels]:
    """The series of a family with a value above 0 (a histogram: its count or sum)."""
    created = fam.name + "_created"
    return {_labels(s) for s in fam.samples if s.value and s.name != created}


def _labels(s: Sample) -> Labels:
    """The series a sample belongs to: a histogram's buckets share their child's labels."""
    return tuple(v for k, v in s.labels.items() if k != "le")


def published(m: Metrics, hold_s: float) -> tuple[CollectorRegistry, HeldView]:
    """The registry /metrics renders (`m`'s own, seen through a `HeldView`), and the view."""
    view = HeldView(m.registry, read_by_increase(m), hold_s)
    if hold_s > 0:
        log.info(
            "/metrics: a new series first exposed carrying a value reads 0 for %g s "
            "(metering.new_series_hold_s; series known ahead are not held); true values at "
            "/metrics?hold=0",
            hold_s,
        )
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


def restore(
    m: Metrics,
    view: HeldView,
    path: Path,
    relabel: Callable[[dict[str, str]], dict[str, str]] = dict,
    clock: Callable[[], float] = time.time,
) -> int:
    """At start, before the first request and the first scrape: every saved series goes on.

    A counter starts at its saved value (a histogram at its saved buckets and sum), so a graceful
    restart is no reset: whatever a scraper had not seen yet (the last increments, a series still in
    its hold) it sees now, exactly once. `relabel` passes the labels through this process's caps.
    The file is removed first: a crash after this never counts a cost twice.
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
            family = families[s["family"]]
            child = family.labels(**labels) if labels else family  # an unlabelled family
            if "buckets" in s:
                _go_on(child, s)
            elif (value := float(s.get("value", 0.0))) > 0:
                child.inc(value)
            if s.get("shown"):
                view.shown_before(s["family"], labels)
            n += 1
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            log.error("saved series %r not restored: %s", s, exc)
    return n


def carry_context(
    m: Metrics, view: HeldView, path: Path, users: LabelCap, models: LabelCap
) -> CleanupContext:
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
