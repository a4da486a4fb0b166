"""The meter's derived figures: whether a finished request consumed the server at all (what budgets
and metrics count), and time per output token, per choice when a request has several."""

from __future__ import annotations

import time

import pytest

from sidecar.config import PricingConfig
from sidecar.exchange import STATUS_CLIENT_CLOSED, Endpoint, Exchange, RequestInfo, Usage, consumed
from sidecar.metering.meter import Meter, time_per_output_token
from sidecar.metering.pricing import PriceBook
from sidecar.telemetry.metrics import Metrics


def exchange(usage: Usage, status: int = 200, sent: bool = True) -> Exchange:
    ex = Exchange(
        request_id="r",
        endpoint=Endpoint.CHAT,
        info=RequestInfo(endpoint=Endpoint.CHAT, body=b"{}", parsed=True, model="m"),
        user="u",
        user_id="u",
        model="m",
        status=status,
        usage=usage,
    )
    ex.upstream_start = time.perf_counter() if sent else None
    return ex


def test_a_client_that_left_before_the_upstream_consumed_nothing() -> None:
    assert not consumed(exchange(Usage(), STATUS_CLIENT_CLOSED, sent=False))
    assert consumed(exchange(Usage(), STATUS_CLIENT_CLOSED, sent=True))


def streamed(out: int, finish: tuple[str, ...], n: int | None) -> Exchange:
    info = RequestInfo(endpoint=Endpoint.CHAT, body=b"{}", parsed=True, stream=True, n=n)
    ex = Exchange(
        request_id="r", endpoint=Endpoint.CHAT, info=info, user="u", user_id="u", model="m"
    )
    ex.status = 200
    ex.usage = Usage(input_tokens=5, output_tokens=out, finish_reasons=finish)
    ex.t0, ex.upstream_start, ex.first_token_at, ex.duration_s = 100.0, 100.0, 101.0, 10.0
    return ex  # 9 s of decoding after the first token


@pytest.mark.parametrize(
    "out,finish,n,expected",
    [
        (10, ("length",), None, 9 / 9),  # one choice: 9 s over the 9 tokens after the first
        (20, ("length", "length"), 2, 9 / 9),  # n=2: 10 tokens each, decoded side by side
        (40, ("stop",) * 4, None, 9 / 9),  # four prompts in one completions request
        (20, (), 2, 9 / 9),  # no finish reasons seen: the n asked for
        (2, ("length", "length"), 2, None),  # one token per choice: nothing after the first
    ],
)
def test_time_per_output_token_is_per_choice(
    out: int, finish: tuple[str, ...], n: int | None, expected: float | None
) -> None:
    assert time_per_output_token(streamed(out, finish, n)) == (
        None if expected is None else pytest.approx(expected)
    )


def test_the_histogram_observes_the_per_choice_figure() -> None:
    metrics = Metrics()
    Meter(metrics, PriceBook(PricingConfig())).record(streamed(20, ("length", "length"), 2))
    labels = {"model": "m", "api_endpoint": "/v1/chat/completions"}
    assert metrics.registry.get_sample_value(
        "llm_time_per_output_token_seconds_sum", labels
    ) == pytest.approx(1.0)
