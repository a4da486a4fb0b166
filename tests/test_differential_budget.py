"""The shared budget store's scripts driven through RedisStore's public methods with what a hostile
review of the restructured Lua (191d86f against its successor) tried: a settlement sent twice, a
garbled hold record, a hold swept after its lease and then settled and renewed, and a request that
ended while Redis was away, counted by the ledger read that reseeded an emptied Redis."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from sidecar.billing.budget import Scope, to_micros
from sidecar.billing.redis_store import day_keys
from tests.test_budget_redis import (
    GLOBAL,
    MADE,
    TODAY,
    USER,
    Ledger,
    held,
    hold,
    make,
    redis_ms,
    settled,
    spent,
    value,
)
from tests.waiting import wait_for

MONTH = Scope("user", "u", to_micros(2.0), "month")


@pytest.fixture(autouse=True)
async def _stores_closed() -> Any:
    yield
    while MADE:
        await MADE.pop().close()


async def test_a_settlement_twice_counts_once_and_a_garbled_hold_is_refused_unchanged(
    redis_server: Any,
) -> None:
    store = make(redis_server)
    store.start()
    assert (await store.reserve(hold("a", 0.2, USER, GLOBAL, MONTH))).admitted
    assert (await store.reserve(hold("g", 0.1, USER, MONTH))).admitted
    store.settle("a", 50_000)
    store.settle("a", 90_000)  # a second settle of the same request: nothing left to settle
    # the hold's record garbled in Redis: an empty scope key
    redis_server.client().hset(day_keys(TODAY)[2], "g", '["h","100000",["user:u",""]]')
    store.settle("g", 70_000)
    await settled(store)
    assert spent(redis_server) == {"user:u": 50_000, "global:*": 50_000}
    assert held(redis_server) == {"user:u": 100_000, "global:*": 0}  # g's, untouched
    assert value(store, "tollbooth_metering_errors_total", stage="budget_store") == 1
    raw = redis_server.client().hget(day_keys(TODAY)[2], "g")
    assert raw == b'["h","100000",["user:u",""]]'  # left for its lease's end


async def test_a_hold_swept_after_its_lease_is_corrected_by_its_settlement_not_renewed(
    redis_server: Any,
) -> None:
    short, sweeper = make(redis_server, lease=0.2), make(redis_server)
    holds = [hold(f"e{i}", 0.1 * (i + 1), USER, GLOBAL, MONTH) for i in range(3)]
    for h in holds:
        assert (await short.reserve(h)).admitted
    start = redis_ms(redis_server)
    await wait_for(lambda: redis_ms(redis_server) > start + 300, "the leases to end")
    await sweeper.tick()  # every lease ended: each hold charged its full amount
    assert value(sweeper, "llm_budget_holds_expired_total") == 3
    assert spent(redis_server)["user:u"] == 600_000 and held(redis_server)["user:u"] == 0
    short.start()
    short.settle("e0", 11_000)  # the measured charge replaces the swept amount
    await settled(short)
    await short.tick()  # renews e1, e2: swept, so not held again
    assert held(redis_server) == {"user:u": 0, "global:*": 0}
    assert spent(redis_server)["user:u"] == 11_000 + 200_000 + 300_000
    short.settle("e1", 0)
    short.settle("e2", 10**9)  # more than it held: charged as measured
    await settled(short)
    assert spent(redis_server)["user:u"] == 11_000 + 0 + 10**9
    assert spent(redis_server)["global:*"] == spent(redis_server)["user:u"]


async def test_a_request_ended_in_an_outage_and_in_the_ledger_is_charged_once(
    redis_server: Any,
) -> None:
    ledger = Ledger({})
    store = make(redis_server, source=ledger)
    assert (await store.reserve(hold("a", 0.1))).admitted
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        assert (await store.reserve(hold("x", 0.1))).admitted  # against the local share
        store.settle("x", 40_000)  # x ends while Redis is away...
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    ledger.spent = {"user:u": 40_000}  # ...and its row reaches the ledger
    redis_server.client().flushall()  # Redis comes back without its data
    await wait_for(lambda: store.breaker.clock() >= store.breaker.retry_at, "the cooldown")
    x_ended = next(ms for h, _, ms in store.queue if h.request_id == "x")
    await wait_for(lambda: time.time() * 1000 > x_ended + 1, "a ledger read after x's end")
    assert (await store.reserve(hold("y", 0.001))).admitted  # x's day reseeded, with x
    store.start()  # x's settlement goes out
    await settled(store)
    assert held(redis_server) == {"user:u": 100_000 + 1_000}  # a and y run
    assert spent(redis_server) == {"user:u": 40_000}  # x once: the ledger's read has it


async def test_a_request_ended_in_an_outage_is_charged_before_the_next_decision(
    redis_server: Any,
) -> None:
    """Redis back with its data: the ended request's charge is in it before the next reservation
    is decided (not left to the settler), and once."""
    store = make(redis_server)
    assert (await store.reserve(hold("a", 0.1))).admitted
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        assert (await store.reserve(hold("x", 0.1))).admitted  # against the local share
        store.settle("x", 40_000)
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    await wait_for(lambda: store.breaker.clock() >= store.breaker.retry_at, "the cooldown")
    assert (await store.reserve(hold("y", 0.001))).admitted
    assert spent(redis_server) == {"user:u": 40_000}  # the settler was never started
    assert held(redis_server) == {"user:u": 100_000 + 1_000}
    assert not store.queue and not store.settling
    store.start()
    await settled(store)
    assert spent(redis_server) == {"user:u": 40_000}
