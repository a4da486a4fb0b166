"""What Meter.record counts per direction: each measured count on its own series, an unmeasured
direction as usage unknown, and the input spend of a request whose output is unknown (issue 21's
mutation run: these survived with test_meter.py alone)."""

from __future__ import annotations

import pytest

from sidecar.config import ModelPrice, PricingConfig
from sidecar.exchange import Usage
from sidecar.metering.meter import Meter, time_per_output_token
from sidecar.metering.pricing import PriceBook
from sidecar.telemetry.metrics import MAX_FINISH_REASONS, OTHER, Metrics
from tests.test_meter import exchange, streamed

EP = "/v1/chat/completions"
PRICE = ModelPrice(input_per_1m=1.0, output_per_1m=2.0)


def _record(usage: Usage, status: int = 200) -> Metrics:
    metrics = Metrics()
    Meter(metrics, PriceBook(PricingConfig(default=PRICE))).record(exchange(usage, status))
    return metrics


def _tokens(metrics: Metrics, kind: str) -> float | None:
    labels = {"model": "m", "token_type": kind, "api_endpoint": EP, "user_id": "u"}
    return metrics.registry.get_sample_value("llm_tokens_total", labels)


def _unknown(metrics: Metrics) -> float | None:
    labels = {"model": "m", "api_endpoint": EP, "reason": "unknown"}
    return metrics.registry.get_sample_value("llm_usage_unknown_total", labels)


def test_each_measured_direction_is_counted_and_no_other() -> None:
    both = _record(Usage(input_tokens=7, output_tokens=3, cached_input_tokens=2))
    assert (_tokens(both, "input"), _tokens(both, "output")) == (7, 3)
    cached = {"model": "m", "api_endpoint": EP, "user_id": "u"}
    assert both.registry.get_sample_value("llm_cached_input_tokens_total", cached) == 2
    assert not _unknown(both)
    only_input = _record(Usage(input_tokens=7))
    assert _tokens(only_input, "input") == 7
    assert not _tokens(only_input, "output")
    assert _unknown(only_input) == 1


def test_an_unknown_output_still_spends_the_measured_input() -> None:
    metrics = _record(Usage(input_tokens=1_000_000))
    labels = {"model": "m", "token_type": "input", "api_endpoint": EP, "user_id": "u"}
    assert metrics.registry.get_sample_value("llm_cost_usd_total", labels) == pytest.approx(1.0)


def test_no_time_per_output_token_without_a_first_token_or_a_duration() -> None:
    no_first = streamed(10, ("length",), None)
    no_first.first_token_at = None
    no_duration = streamed(10, ("length",), None)
    no_duration.duration_s = None
    assert time_per_output_token(no_first) is None
    assert time_per_output_token(no_duration) is None


def _length(metrics: Metrics, name: str, sample: str) -> float | None:
    return metrics.registry.get_sample_value(f"llm_request_{name}_tokens_{sample}", {"model": "m"})


def test_prompt_and_output_lengths_are_measured_counts_only() -> None:
    both = _record(Usage(input_tokens=7, output_tokens=300))
    assert (_length(both, "prompt", "count"), _length(both, "prompt", "sum")) == (1, 7)
    assert (_length(both, "output", "count"), _length(both, "output", "sum")) == (1, 300)
    labels = {"model": "m", "le": "256.0"}
    assert both.registry.get_sample_value("llm_request_output_tokens_bucket", labels) == 0
    labels["le"] = "512.0"
    assert both.registry.get_sample_value("llm_request_output_tokens_bucket", labels) == 1
    only_input = _record(Usage(input_tokens=7))
    assert _length(only_input, "prompt", "count") == 1
    assert _length(only_input, "output", "count") is None  # unknown: no observation, not 0
    nothing = _record(Usage())
    assert _length(nothing, "prompt", "count") is None
    assert _length(nothing, "output", "count") is None
    refused = _record(Usage(), status=429)
    assert _length(refused, "prompt", "count") is None


def _reasons(metrics: Metrics) -> dict[str, float]:
    fam = next(iter(metrics.finish_reasons.collect()))
    return {s.labels["finish_reason"]: s.value for s in fam.samples if s.name.endswith("_total")}


def test_finish_reasons_are_counted_per_choice_and_bounded() -> None:
    assert _reasons(_record(Usage(input_tokens=1, output_tokens=2))) == {}
    many = Usage(input_tokens=1, output_tokens=8, finish_reasons=("stop", "length", "stop"))
    assert _reasons(_record(many)) == {"stop": 2, "length": 1}
    metrics = Metrics()
    meter = Meter(metrics, PriceBook(PricingConfig(default=PRICE)))
    for i in range(MAX_FINISH_REASONS + 5):
        meter.record(exchange(Usage(input_tokens=1, output_tokens=1, finish_reasons=(f"r{i}",))))
    got = _reasons(metrics)
    assert len(got) == MAX_FINISH_REASONS + 1 and got[OTHER] == 5
    assert sum(got.values()) == MAX_FINISH_REASONS + 5  # every choice counted, none lost
