"""What a finished request is charged, and whether it consumed the server at all."""

from __future__ import annotations

import time

import pytest

from sidecar.config import ModelPrice, PricingConfig
from sidecar.meter import STATUS_CLIENT_CLOSED, Exchange, consumed, measured_cost_usd
from sidecar.pricing import PriceBook
from sidecar.usage import Endpoint, RequestInfo, Usage

PRICES = PriceBook(PricingConfig(models={"m": ModelPrice(input_per_1m=1.0, output_per_1m=2.0)}))


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


def test_a_client_that_left_is_charged_what_was_measured() -> None:
    both = exchange(Usage(input_tokens=1000, output_tokens=500), STATUS_CLIENT_CLOSED)
    assert measured_cost_usd(PRICES, both) == pytest.approx(0.002)
    prompt_only = exchange(
        Usage(input_tokens=1000, unknown_reason="client_disconnected"), STATUS_CLIENT_CLOSED
    )
    assert prompt_only.cost is None and measured_cost_usd(PRICES, prompt_only) == pytest.approx(
        0.001
    )  # never $0 for a request the server took; the total stays unknown
    assert measured_cost_usd(PRICES, exchange(Usage(), STATUS_CLIENT_CLOSED)) is None


def test_a_client_that_left_before_the_upstream_consumed_nothing() -> None:
    assert not consumed(exchange(Usage(), STATUS_CLIENT_CLOSED, sent=False))
    assert consumed(exchange(Usage(), STATUS_CLIENT_CLOSED, sent=True))
