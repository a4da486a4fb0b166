"""Bucket boundaries resolve the ranges LLM serving lives in, and keep what alerts and the
OpenTelemetry GenAI advice need (sidecar/telemetry/metrics.py)."""

from __future__ import annotations

import itertools

from sidecar.telemetry.metrics import (
    COST_BUCKETS,
    DURATION_BUCKETS,
    GENAI_DURATION_ADVICE,
    GENAI_TOKEN_ADVICE,
    GENAI_TPOT_ADVICE,
    GENAI_TTFT_ADVICE,
    QUEUE_BUCKETS,
    TOKEN_COUNT_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
)
from sidecar.telemetry.thresholds import DEFAULT


def test_the_advised_boundaries_are_kept() -> None:
    assert set(GENAI_DURATION_ADVICE) <= set(DURATION_BUCKETS)
    assert TTFT_BUCKETS == GENAI_TTFT_ADVICE  # the advice as it is
    assert set(GENAI_TPOT_ADVICE) <= set(TPOT_BUCKETS)
    assert set(GENAI_TOKEN_ADVICE) <= set(TOKEN_COUNT_BUCKETS)
    assert DEFAULT.request_cost_usd in COST_BUCKETS  # LLMRequestCostHigh reads this bucket


def test_the_advice_as_the_conventions_write_it() -> None:
    """Spot checks of the one copy of the advice against gen-ai-metrics.md."""
    ends = {
        "token": (GENAI_TOKEN_ADVICE[0], GENAI_TOKEN_ADVICE[-1], len(GENAI_TOKEN_ADVICE)),
        "duration": (
            GENAI_DURATION_ADVICE[0],
            GENAI_DURATION_ADVICE[-1],
            len(GENAI_DURATION_ADVICE),
        ),
        "ttft": (GENAI_TTFT_ADVICE[0], GENAI_TTFT_ADVICE[-1], len(GENAI_TTFT_ADVICE)),
        "tpot": (GENAI_TPOT_ADVICE[0], GENAI_TPOT_ADVICE[-1], len(GENAI_TPOT_ADVICE)),
    }
    assert ends == {
        "token": (1, 67108864, 14),
        "duration": (0.01, 81.92, 14),
        "ttft": (0.001, 10.0, 16),
        "tpot": (0.01, 2.5, 13),
    }
    assert all(b == a * 2 for a, b in itertools.pairwise(GENAI_DURATION_ADVICE))
    assert all(b == a * 4 for a, b in itertools.pairwise(GENAI_TOKEN_ADVICE))


def test_sorted_and_distinct() -> None:
    for b in (DURATION_BUCKETS, TTFT_BUCKETS, TPOT_BUCKETS, QUEUE_BUCKETS, COST_BUCKETS,
              TOKEN_COUNT_BUCKETS):  # fmt: skip
        assert list(b) == sorted(set(b))


def test_duration_never_steps_more_than_half_again_from_160ms() -> None:
    """The 1.28 -> 2.56 s doubling put a 1.59 s p99 at 2.47 s."""
    steps = [hi / lo for lo, hi in itertools.pairwise(DURATION_BUCKETS) if lo >= 0.16]
    assert max(steps) <= 1.5


def test_fast_decode_and_instant_admission_are_resolved() -> None:
    assert sum(b < 0.01 for b in TPOT_BUCKETS) >= 4  # a fast GPU's ms per token
    assert sum(b < 0.001 for b in QUEUE_BUCKETS) >= 4  # admitted at once


def test_lengths_are_resolved_within_a_factor_of_two() -> None:
    steps = [hi / lo for lo, hi in itertools.pairwise(TOKEN_COUNT_BUCKETS)]
    assert max(steps) == 2 and TOKEN_COUNT_BUCKETS[0] == 1 and TOKEN_COUNT_BUCKETS[-1] >= 2**26
