"""Bucket boundaries resolve the ranges LLM serving lives in, and keep what alerts and the
OpenTelemetry GenAI advice need (sidecar/telemetry/metrics.py)."""

from __future__ import annotations

import itertools

from sidecar.telemetry.metrics import (
    COST_BUCKETS,
    DURATION_BUCKETS,
    QUEUE_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
)
from sidecar.telemetry.thresholds import DEFAULT

# The semantic conventions' advised explicit buckets (gen-ai metrics).
OTEL_DURATION = (
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
)
OTEL_TTFT = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
OTEL_TPOT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


def test_the_advised_boundaries_are_kept() -> None:
    assert set(OTEL_DURATION) <= set(DURATION_BUCKETS)
    assert set(OTEL_TTFT) <= set(TTFT_BUCKETS)
    assert set(OTEL_TPOT) <= set(TPOT_BUCKETS)
    assert DEFAULT.request_cost_usd in COST_BUCKETS  # LLMRequestCostHigh reads this bucket


def test_sorted_and_distinct() -> None:
    for b in (DURATION_BUCKETS, TTFT_BUCKETS, TPOT_BUCKETS, QUEUE_BUCKETS, COST_BUCKETS):
        assert list(b) == sorted(set(b))


def test_duration_never_steps_more_than_half_again_from_160ms() -> None:
    """The 1.28 -> 2.56 s doubling put a 1.59 s p99 at 2.47 s."""
    steps = [hi / lo for lo, hi in itertools.pairwise(DURATION_BUCKETS) if lo >= 0.16]
    assert max(steps) <= 1.5


def test_fast_decode_and_instant_admission_are_resolved() -> None:
    assert sum(b < 0.01 for b in TPOT_BUCKETS) >= 4  # a fast GPU's ms per token
    assert sum(b < 0.001 for b in QUEUE_BUCKETS) >= 4  # admitted at once
