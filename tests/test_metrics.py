"""The lock-free families the request path updates expose exactly what prometheus_client's do."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.openmetrics.exposition import generate_latest

from sidecar.telemetry.metrics import (
    COST_BUCKETS,
    DURATION_BUCKETS,
    LoopCounter,
    LoopGauge,
    LoopHistogram,
    Metrics,
)

LABELS = st.sampled_from([("m", "/v1/chat/completions"), ("m", "/generate"), ("other", "/x")])
AMOUNTS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1e-5, 0.01, 0.1, 5.12, 81.92, 100.0, -1.0]),
    st.integers(min_value=-3, max_value=10**6),
)
EXEMPLARS = st.one_of(st.none(), st.just({"trace_id": "4bf92f3577b34da6a3ce929d0e0e4736"}))
OPS = st.lists(st.tuples(LABELS, AMOUNTS, EXEMPLARS), max_size=30)


def _samples(registry: CollectorRegistry) -> list[tuple[Any, ...]]:
    """Every sample but the creation times, exemplars without their timestamps."""
    out = []
    for fam in registry.collect():
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            ex = (s.exemplar.labels, s.exemplar.value) if s.exemplar else None
            value = "nan" if math.isnan(s.value) else s.value
            out.append((fam.name, fam.type, s.name, s.labels, value, ex))
    return out


def _apply(update: Any, amount: float, exemplar: dict[str, str] | None) -> str:
    try:
        update(amount, exemplar) if exemplar is not None else update(amount)
    except ValueError as exc:
        return str(exc)
    return "ok"


def _pair(cls: type, loop_cls: type, **kw: Any) -> tuple[CollectorRegistry, Any, Any]:
    a, b = CollectorRegistry(), CollectorRegistry()
    return (
        a,
        cls("fam", "doc", ["model", "api_endpoint"], registry=a, **kw),
        b,
        loop_cls("fam", "doc", ["model", "api_endpoint"], registry=b, **kw),
    )


@given(OPS)
def test_counter_is_prometheus_clients(ops: list[Any]) -> None:
    a, plain, b, loop = _pair(Counter, LoopCounter)
    for labels, amount, exemplar in ops:
        assert _apply(plain.labels(*labels).inc, amount, exemplar) == _apply(
            loop.labels(*labels).inc, amount, exemplar
        )
    assert _samples(a) == _samples(b)


@given(OPS, st.sampled_from([DURATION_BUCKETS, COST_BUCKETS]))
def test_histogram_is_prometheus_clients(ops: list[Any], buckets: tuple[float, ...]) -> None:
    a, plain, b, loop = _pair(Histogram, LoopHistogram, buckets=buckets)
    for labels, amount, exemplar in ops:
        assert _apply(plain.labels(*labels).observe, amount, exemplar) == _apply(
            loop.labels(*labels).observe, amount, exemplar
        )
    assert _samples(a) == _samples(b)


@given(st.lists(st.tuples(LABELS, st.integers(-5, 5)), max_size=30))
def test_gauge_is_prometheus_clients(ops: list[tuple[tuple[str, str], int]]) -> None:
    a, plain, b, loop = _pair(Gauge, LoopGauge)
    for labels, amount in ops:
        for g in (plain.labels(*labels), loop.labels(*labels)):
            g.inc(amount) if amount >= 0 else g.dec(-amount)
    assert _samples(a) == _samples(b)


def test_the_exposition_text_is_the_same() -> None:
    """Creation times aside, the OpenMetrics text (with an exemplar) is byte for byte the same."""
    texts = []
    for counter, histogram in ((Counter, Histogram), (LoopCounter, LoopHistogram)):
        r = CollectorRegistry()
        c = counter("llm_cost_usd", "Spend.", ["model"], registry=r)
        h = histogram("llm_request_cost_usd", "Cost.", ["model"], buckets=COST_BUCKETS, registry=r)
        c.labels("m").inc(0.25)
        h.labels("m").observe(0.004)
        h.labels("m").observe(0.2, {"trace_id": "ab" * 16})
        lines = generate_latest(r).decode().splitlines()
        texts.append([line.split(" # ")[0] for line in lines if "_created" not in line])
        texts.append([line.split(" # ")[1].rsplit(" ", 1)[0] for line in lines if " # " in line])
    assert texts[0] == texts[2] and texts[1] == texts[3]
    assert texts[1] == ['{trace_id="' + "ab" * 16 + '"} 0.2']


def test_the_request_paths_families_are_lock_free() -> None:
    """What every request updates, and nothing a thread updates (GPU poller, writers)."""
    m = Metrics()
    loop = {n for n, v in vars(m).items() if isinstance(v, LoopCounter | LoopGauge | LoopHistogram)}
    assert loop == {
        "requests",
        "tokens",
        "cached_tokens",
        "audio_seconds",
        "usage_unknown",
        "duration",
        "ttft",
        "tpot",
        "prompt_tokens",
        "output_tokens",
        "finish_reasons",
        "in_flight",
        "cost",
        "request_cost",
        "cost_unknown",
        "spend_today",
        "team_spend_today",
    }
