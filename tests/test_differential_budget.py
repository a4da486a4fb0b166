"""The shared budget store's scripts driven through RedisStore's public methods with what a hostile
review of the restructured Lua (191d86f against its successor) tried: a settlement sent twice, a
garbled hold record, a hold swept after its lease and then settled and renewed, and a request that
ended while Redis was away, counted by the ledger read that reseeded an emptied Redis."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Mapping
from typing import Any

import pytest

from sidecar.billing.budget import Scope, to_micros
from sidecar.billing.redis_scripts import day_keys
from sidecar.billing.redis_store import SETTLE_BATCH
from tests.test_budget_redis import (
    GLOBAL,
    MADE,
    OUTAGE_S,
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


class Flaky(Ledger):
    """A ledger that can be down (its read fails) and come back."""

    down = False

    async def __call__(self, day: int) -> tuple[Mapping[str, int], float]:
        if self.down:
            raise OSError("ledger down")
        return await super().__call__(day)


@pytest.fixture(autouse=True)
async def _stores_closed() -> Any:
    yield
    while MADE:
        await MADE.pop().close()


async def ended_while_away(store: Any, server: Any, charges: dict[str, tuple[float, int]]) -> None:
    """Each request (id: its hold in USD, its charge in micro-USD) admitted against the local
    share and ended while Redis is stopped."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        for rid, (usd, charge) in charges.items():
            assert (await store.reserve(hold(rid, usd))).admitted
            store.settle(rid, charge)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


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
    store = make(redis_server, source=ledger, timeout=OUTAGE_S)
    assert (await store.reserve(hold("a", 0.1))).admitted
    await ended_while_away(
        store, redis_server, {"x": (0.1, 40_000)}
    )  # x ends while Redis is away...
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
    store = make(redis_server, timeout=OUTAGE_S)
    assert (await store.reserve(hold("a", 0.1))).admitted
    await ended_while_away(store, redis_server, {"x": (0.1, 40_000)})
    await wait_for(lambda: store.breaker.clock() >= store.breaker.retry_at, "the cooldown")
    assert (await store.reserve(hold("y", 0.001))).admitted
    assert spent(redis_server) == {"user:u": 40_000}  # the settler was never started
    assert held(redis_server) == {"user:u": 100_000 + 1_000}
    assert not store.queue and not store.settling
    store.start()
    await settled(store)
    assert spent(redis_server) == {"user:u": 40_000}


def gated(store: Any, first: int = 1) -> tuple[asyncio.Event, asyncio.Event, list[str]]:
    """Wrap the store's settle round trip: every hold id sent is recorded, and the first `first`
    calls wait for `gate` before anything is sent (`entered` set once one waits): a batch in
    flight, as long as the test wants, for a round trip that takes one."""
    gate, entered, sent = asyncio.Event(), asyncio.Event(), []
    real, calls = store._settle_batch, [0]

    async def slow(batch: list[tuple[Any, int, int]]) -> list[Any]:
        calls[0] += 1
        if calls[0] <= first:
            entered.set()
            await gate.wait()
        sent.extend(h.request_id for h, _, _ in batch)
        return list(await real(batch))

    store._settle_batch = slow
    return gate, entered, sent


async def test_a_reservation_cancelled_while_ended_requests_are_settled_loses_none_of_them(
    redis_server: Any,
) -> None:
    """A client that leaves cancels its reservation; the settlements of requests that ended while
    Redis was away, taken out of the queue for it, go back in: none lost, none left in
    `settling` (which made every later reservation scan the queue for them)."""
    store = make(redis_server, timeout=OUTAGE_S)
    assert (await store.reserve(hold("a", 0.1))).admitted
    n = SETTLE_BATCH + 6  # a second batch, never sent
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        for i in range(n):
            assert (await store.reserve(hold(f"x{i}", 0.001))).admitted  # the local share
            store.settle(f"x{i}", 1_000)
        await wait_for(lambda: store.breaker.clock() >= store.breaker.retry_at, "the cooldown")
        task = asyncio.create_task(store.reserve(hold("y", 0.001)))
        await wait_for(lambda: not store.queue, "the ended requests taken out to be settled")
        task.cancel()  # its first batch waits on the stopped Redis
        await asyncio.wait({task})
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert len(store.queue) == n
    await wait_for(lambda: store.breaker.clock() >= store.breaker.retry_at, "the cooldown")
    store.start()
    await wait_for(lambda: not store.settling, "every ended request settled")
    await settled(store)
    assert spent(redis_server) == {"user:u": n * 1_000}


async def test_ended_requests_that_found_their_day_unseeded_are_not_sent_by_every_reservation(
    redis_server: Any,
) -> None:
    """Redis emptied and the ledger down: the settlements of the outage's ended requests answer
    'unseeded' and wait for the reseed; every later reservation (and upkeep tick) sent them all
    again, ceil(n / 64) round trips each under the `_restoring` lock, n up to SETTLE_QUEUE."""
    ledger = Flaky({})
    store = make(redis_server, source=ledger, timeout=OUTAGE_S)
    assert (await store.reserve(hold("a", 0.1))).admitted
    await ended_while_away(store, redis_server, {f"x{i}": (0.01, 10_000) for i in range(3)})
    redis_server.client().flushall()
    ledger.down = True
    await wait_for(lambda: store.breaker.clock() >= store.breaker.retry_at, "the cooldown")
    _, _, sent = gated(store, first=0)
    for i in range(4):
        assert not (await store.reserve(hold(f"y{i}", 0.001))).admitted  # no ledger, no remainder
    assert sent.count("x0") == 1, sent  # by the first reservation only
    ledger.down, ledger.spent = False, {"user:u": 30_000}  # x's rows are in the ledger
    store.start()
    await wait_for(lambda: not store.settling and not store.queue, "x's settled")
    await settled(store)
    assert spent(redis_server) == {"user:u": 30_000}  # once: the ledger's read has them


async def test_an_ended_request_in_the_settlers_batch_is_counted_before_the_next_decision(
    redis_server: Any,
) -> None:
    """The settler took x's settlement off the queue and it is in flight when the next reservation
    comes: `_restore` saw it neither in the queue nor as a hold, and y was admitted past the
    limit (on 99d8e74 x was put back as a hold: refused). At every admission
    spent + held <= limit."""
    store = make(redis_server, timeout=OUTAGE_S)
    assert (await store.reserve(hold("a", 0.5))).admitted  # known remainder 0.5
    assert redis_server.proc is not None
    store.breaker.cooldown_s = 60.0  # x's reservation is not sent: never in Redis as a hold
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        await store.tick()  # its calls time out: the breaker opens
        assert not store.breaker.closed
        assert (await store.reserve(hold("x", 0.4))).admitted  # against the local share
        store.settle("x", 400_000)
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    store.breaker.retry_at = store.breaker.clock()
    await wait_for(lambda: store.breaker.clock() >= store.breaker.retry_at, "the cooldown")
    assert await store.usage(TODAY, [USER]) is not None  # Redis answers: the breaker closes
    gate, entered, _ = gated(store)
    store.start()
    await wait_for(entered.is_set, "x's settlement in flight")
    try:
        verdict = await store.reserve(hold("y", 0.3))  # 0.4 spent + 0.5 held + 0.3 > 1.0
    finally:
        gate.set()
    await settled(store)
    assert spent(redis_server) == {"user:u": 400_000}
    assert not verdict.admitted, (spent(redis_server), held(redis_server))


async def test_redis_stopped_between_the_batches_of_ended_requests_charges_each_once(
    redis_server: Any,
) -> None:
    """Redis stops after the first batch of the outage's ended requests is answered: the rest go
    back in the queue (still due before the next decision) and are charged once, the second
    batch's sent settlements, run by Redis when it resumes, answered 'again' when sent again."""
    store = make(redis_server, timeout=OUTAGE_S)
    assert (await store.reserve(hold("a", 0.1))).admitted
    n = SETTLE_BATCH + 6
    await ended_while_away(store, redis_server, {f"x{i}": (0.001, 1_000) for i in range(n)})
    pid = redis_server.proc.pid
    await wait_for(lambda: store.breaker.clock() >= store.breaker.retry_at, "the cooldown")
    real, calls = store._settle_batch, [0]

    async def stop_before_second(batch: list[tuple[Any, int, int]]) -> list[Any]:
        calls[0] += 1
        if calls[0] == 2:
            os.kill(pid, signal.SIGSTOP)
        return list(await real(batch))

    store._settle_batch = stop_before_second
    try:
        assert not (await store.reserve(hold("y", 0.001))).admitted  # no remainder known yet
    finally:
        os.kill(pid, signal.SIGCONT)
    assert len(store.settling) == 6 and {h.request_id for h, _, _ in store.queue} >= set(
        store.settling
    )
    await wait_for(lambda: store.breaker.clock() >= store.breaker.retry_at, "the cooldown")
    store.start()
    await wait_for(lambda: not store.settling, "every ended request settled")
    await settled(store)
    assert spent(redis_server) == {"user:u": n * 1_000}


async def test_two_reservations_at_once_after_an_outage_both_wait_for_the_ended_request(
    redis_server: Any,
) -> None:
    """Two reservations enter `_restore` together: one settles x, the other waits on the lock
    and finds nothing left to do; both are decided with x's charge in Redis, which has it once."""
    store = make(redis_server, timeout=OUTAGE_S)
    assert (await store.reserve(hold("a", 0.5))).admitted
    assert redis_server.proc is not None
    store.breaker.cooldown_s = 60.0  # x's reservation is not sent: never in Redis as a hold
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        await store.tick()
        assert not store.breaker.closed
        assert (await store.reserve(hold("x", 0.4))).admitted
        store.settle("x", 400_000)
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    store.breaker.retry_at = store.breaker.clock()
    _, _, sent = gated(store, first=0)
    small, big = await asyncio.gather(
        store.reserve(hold("y1", 0.05)), store.reserve(hold("y2", 0.3))
    )
    assert small.admitted and not big.admitted  # 0.4 + 0.5 + 0.3 > 1.0 in either order
    assert sent == ["x"] and not store.settling
    assert spent(redis_server) == {"user:u": 400_000}
    assert held(redis_server) == {"user:u": 550_000}
