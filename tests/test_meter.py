"""Whether a finished request consumed the server at all (what budgets and metrics count)."""

from __future__ import annotations

import time

from sidecar.meter import STATUS_CLIENT_CLOSED, Exchange, consumed
from sidecar.usage import Endpoint, RequestInfo, Usage


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
