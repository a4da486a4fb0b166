"""The shared budget store's scripts against a real redis-server: the same rules as LocalStore,
plus leases, seeding once, an emptied Redis, and what a request gets while Redis is away."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from sidecar.billing import redis_store
from sidecar.billing.budget import DAY, Hold, Scope, to_micros
from sidecar.billing.redis_scripts import SIDECARS, day_keys
from sidecar.billing.redis_store import RedisStore
from sidecar.config import BudgetConfig
from sidecar.telemetry.metrics import Metrics
from tests import simulated as sim
from tests.conftest import StartSidecar
from tests.test_ollama import MODEL, MSGS_V1, STREAMED, ollama_v1_generating
from tests.waiting import TIMEOUT_S, wait_for

USER = Scope("user", "u", to_micros(1.0))
GLOBAL = Scope("global", "*", to_micros(1.5))
TODAY = int(time.time() // DAY * DAY)


def hold(rid: str, usd: float, *scopes: Scope) -> Hold:
    return Hold(rid, TODAY, to_micros(usd), scopes or (USER,))


MADE: list[RedisStore] = []
# A frozen Redis (SIGSTOP) answers nothing: each call waits out the store's timeout, so the tests
# that freeze it use a short one. A store with Redis up uses the suite's bounded TIMEOUT_S: five
# connections opened at once on a loaded machine took longer than 0.2 s (a CI run failed there).
OUTAGE_S = 0.5


@pytest.fixture(autouse=True)
async def _stores_closed() -> AsyncIterator[None]:
    """Every store a test made is closed, even when the test failed before its own `close()`:
    a store left open is garbage-collected later with its Redis connection open, and the
    ResourceWarning (an error here) then fails whichever test happens to be running."""
    yield
    while MADE:
        await MADE.pop().close()  # a second close() only connects and closes once more


def make(
    server: Any,
    mode: str = "local",
    lease: float = 60.0,
    source: Any = None,
    timeout: float = TIMEOUT_S,  # bounded; the tests that freeze Redis pass OUTAGE_S
) -> RedisStore:
    cfg = BudgetConfig(
        store=server.url,
        store_unavailable=mode,  # type: ignore[arg-type]
        lease_s=lease,
        store_timeout_s=timeout,
    )
    store = RedisStore(cfg, Metrics(), lambda: TODAY, source, max_scopes=10)
    store.breaker.cooldown_s = 0.1
    MADE.append(store)
    return store


def ints(server: Any, which: int) -> dict[str, int]:
    raw = server.client().hgetall(day_keys(TODAY)[which])
    return {k.decode(): int(v) for k, v in raw.items()}


def spent(server: Any) -> dict[str, int]:
    return ints(server, 0)


def held(server: Any) -> dict[str, int]:
    return ints(server, 1)


async def settled(store: RedisStore) -> None:
    """Until the queue is empty and the last batch taken off it was answered (the gauge is set
    to the queue's length on every enqueue, and to 0 only after a batch's replies)."""

    def done() -> bool:
        return not store.queue and value(store, "llm_budget_settles_pending") == 0

    await wait_for(done, "settlements to reach Redis")


def redis_ms(server: Any) -> int:
    """Redis's clock, which leases and heartbeats use (ms)."""
    seconds, micros = server.client().time()
    return int(seconds) * 1000 + int(micros) // 1000


async def redis_clock_past(server: Any, ms: float) -> None:
    await wait_for(lambda: redis_ms(server) > ms, f"Redis's clock to pass {ms} ms")


def window_ms(store: RedisStore) -> int:
    """How long a sidecar's heartbeat counts it alive (what `tick` passes the script)."""
    return math.ceil(store.interval * 3 * 1000)


def value(store: RedisStore, name: str, **labels: str) -> float:
    return store.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_reserve_is_atomic_over_scopes_and_settle_is_idempotent(redis_server: Any) -> None:
    store = make(redis_server)
    store.start()
    try:
        assert (await store.reserve(hold("a", 0.6, USER, GLOBAL))).admitted
        assert (await store.reserve(hold("a", 0.6, USER, GLOBAL))).admitted  # a retried call
        assert held(redis_server) == {"user:u": 600_000, "global:*": 600_000}
        refused = await store.reserve(hold("b", 0.6, USER, GLOBAL))
        assert not refused.admitted and refused.scope == USER and refused.reason == "budget"
        assert held(redis_server) == {"user:u": 600_000, "global:*": 600_000}
        a = store.open["a"]
        store.settle("a", to_micros(0.25))
        store._enqueue(a, to_micros(0.25))  # the same settlement sent twice counts once
        await settled(store)
        assert spent(redis_server) == {"user:u": 250_000, "global:*": 250_000}
        assert held(redis_server) == {"user:u": 0, "global:*": 0}
        assert (await store.reserve(hold("c", 0.75))).admitted  # 0.25 + 0.75 = the limit
        assert not (await store.reserve(hold("d", 0.000001))).admitted
        assert store.known["user:u"] == 0  # the remainder the last reply gave
    finally:
        await store.close()


async def test_two_sidecars_share_one_budget(redis_server: Any) -> None:
    a, b = make(redis_server), make(redis_server)
    assert (await a.reserve(hold("a1", 0.6))).admitted
    verdict = await b.reserve(hold("b1", 0.6))
    assert not verdict.admitted and verdict.reason == "budget"
    await a.close()
    await b.close()


async def test_an_expired_lease_is_charged_in_full_and_a_late_settle_corrects_it(
    redis_server: Any,
) -> None:
    a, b = make(redis_server, lease=0.3), make(redis_server, lease=0.3)
    assert (await a.reserve(hold("k", 0.5))).admitted
    # `a` renews nothing: it is as good as killed, and its lease ends
    await redis_clock_past(redis_server, redis_server.client().zscore(day_keys(TODAY)[3], "k"))
    await b.tick()
    assert spent(redis_server) == {"user:u": 500_000}
    assert held(redis_server) == {"user:u": 0}
    assert value(b, "llm_budget_holds_expired_total") == 1
    await b.tick()  # charged once
    assert spent(redis_server) == {"user:u": 500_000}
    # `a` was only cut off: its settlement arrives and the charge becomes the measured one
    replies = await a._settle_batch([(a.open.pop("k"), 200_000, int(time.time() * 1000))])
    assert replies == [b"corrected"]
    assert spent(redis_server) == {"user:u": 200_000}
    await a.close()
    await b.close()


async def test_a_running_request_keeps_its_hold_while_its_sidecar_renews_it(
    redis_server: Any,
) -> None:
    a, b = make(redis_server, lease=0.3), make(redis_server, lease=0.3)
    a.start()  # upkeep every 0.1 s renews the lease
    assert (await a.reserve(hold("k", 0.5))).admitted
    for _ in range(6):  # the time passing is what is tested: twice the lease, renewed meanwhile
        await asyncio.sleep(0.1)
        await b.tick()
    assert held(redis_server) == {"user:u": 500_000}
    assert value(b, "llm_budget_holds_expired_total") == 0
    await a.close()
    await b.close()


async def test_many_sidecars_seeding_at_once_add_the_ledger_once(redis_server: Any) -> None:
    stores = [make(redis_server) for _ in range(5)]
    await asyncio.gather(*(s.seed(TODAY, {"user:u": 400_000}) for s in stores))
    assert spent(redis_server) == {"user:u": 400_000}
    assert not (await stores[0].reserve(hold("a", 0.7))).admitted
    for s in stores:
        await s.close()


class Ledger:
    """Stands for the fleet ledger: the spend it holds and when it was read."""

    def __init__(self, spent: Mapping[str, int]) -> None:
        self.spent = dict(spent)
        self.reads: list[float] = []

    async def __call__(self, day: int) -> tuple[Mapping[str, int], float]:
        self.reads.append(time.time())
        return self.spent, self.reads[-1]


async def test_an_emptied_redis_is_reseeded_from_the_ledger_and_lost_holds_are_charged(
    redis_server: Any,
) -> None:
    ledger = Ledger({"user:u": 300_000})
    store = make(redis_server, source=ledger)
    assert (await store.reserve(hold("a", 0.2))).admitted  # cold start: seeded first
    assert spent(redis_server) == {"user:u": 300_000}
    a = store.open.pop("a")
    redis_server.client().flushall()
    assert (await store.reserve(hold("b", 0.6))).admitted  # reseeded: 0.3 + 0.6 <= 1.0
    assert len(ledger.reads) == 2
    assert not (await store.reserve(hold("c", 0.2))).admitted  # not reset to zero
    # `a` ended after the read: the ledger did not have it, its charge is added. So is `y`'s,
    # which ended in the read's millisecond: its row cannot have been flushed before the read.
    # A request that ended in an earlier millisecond is in the ledger's sum: not added again.
    read_ms = math.floor(ledger.reads[-1] * 1000)
    ended = [
        (a, 100_000, read_ms + 1),
        (hold("y", 0.02), 20_000, read_ms),
        (hold("z", 0.1), 50_000, read_ms - 1),
    ]
    assert await store._settle_batch(ended) == [b"charged", b"charged", b"in_seed"]
    assert spent(redis_server) == {"user:u": 420_000}
    await store.close()


async def test_a_failed_ledger_read_leaves_the_day_unseeded(redis_server: Any) -> None:
    async def broken(day: int) -> tuple[Mapping[str, int], float]:
        raise OSError("database down")

    store = make(redis_server, mode="closed", source=broken)
    verdict = await store.reserve(hold("a", 0.1))
    assert not verdict.admitted and verdict.reason == "unavailable"
    assert not redis_server.client().exists(day_keys(TODAY)[4])  # a later read may seed it
    assert value(store, "llm_budget_store_reseeds_total", outcome="failed") == 1
    await store.close()


async def test_redis_lost_during_a_reseed_is_retried_later_and_not_a_failed_ledger_read(
    redis_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_store, "RESEED_RETRY_S", 3600.0)
    reads: list[int] = []

    async def read_then_lose_redis(day: int) -> tuple[Mapping[str, int], float]:
        reads.append(day)
        store.breaker.in_row, store.breaker.retry_at = store.breaker.failures, math.inf
        return {}, time.time()

    store = make(redis_server, mode="closed", source=read_then_lose_redis)
    verdict = await store.reserve(hold("a", 0.1))  # the seed script's call finds the breaker open
    assert not verdict.admitted and verdict.reason == "unavailable"
    assert not redis_server.client().exists(day_keys(TODAY)[4])
    # Redis was away, not the ledger: not a failed ledger read
    assert value(store, "llm_budget_store_reseeds_total", outcome="failed") == 0
    assert not await store.reseed(TODAY)  # within RESEED_RETRY_S of the failure: no second read
    assert reads == [TODAY]
    await store.close()


@pytest.mark.parametrize("mode", ["closed", "local", "open"])
async def test_redis_stopped_gives_each_store_unavailable_behaviour(
    redis_server: Any, mode: str
) -> None:
    store, other = make(redis_server, mode), make(redis_server, mode)
    await store.tick()
    await other.tick()
    await store.tick()  # two sidecars alive
    assert store.alive == 2
    assert (await store.reserve(hold("a", 0.2))).admitted  # known remainder: 0.8
    redis_server.stop()
    verdicts = [await store.reserve(hold(f"r{i}", 0.15)) for i in range(5)]
    admitted = [v.admitted for v in verdicts]
    if mode == "closed":
        assert admitted == [False] * 5 and {v.reason for v in verdicts} == {"unavailable"}
        assert value(store, "llm_budget_store_refused_total") == 5
    elif mode == "open":
        assert admitted == [True] * 5
        assert value(store, "llm_budget_store_bypassed_total") == 5
    else:  # this sidecar's share: 0.8 / 2 = 0.4, so two holds of 0.15
        assert admitted == [True, True, False, False, False]
        assert verdicts[2].reason == "budget" and verdicts[2].scope == USER
        new_user = await store.reserve(hold("n", 0.01, Scope("user", "new", 10**6)))
        assert new_user.reason == "unavailable"  # no known remainder: nothing to share
    # fast: after three failures the breaker is open and calls no longer try Redis
    errors = [value(store, "llm_budget_store_errors_total", op=op) for op in ("reserve", "renew")]
    assert sum(errors) == 3  # `renew`: putting the outage's holds into Redis before a decision
    assert value(store, "llm_budget_store_up") == 0
    await store.close()
    await other.close()


async def test_settlements_wait_for_an_unreachable_redis_and_then_count(
    redis_server: Any,
) -> None:
    store = make(redis_server, mode="open", timeout=OUTAGE_S)
    store.start()
    assert (await store.reserve(hold("a", 0.2))).admitted
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # unreachable: every call times out
    try:
        assert (await store.reserve(hold("b", 0.2))).admitted  # open: admitted, counted
        store.settle("a", 150_000)
        store.settle("b", 180_000)
        # sent, timed out, queued again (Redis may still run them)
        await wait_for(
            lambda: value(store, "llm_budget_store_errors_total", op="settle") >= 1,
            "a settlement to time out",
        )
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    await settled(store)
    assert spent(redis_server) == {"user:u": 330_000}
    assert held(redis_server) == {"user:u": 0}
    await store.close()


async def test_a_request_cancelled_during_a_store_call_is_cancelled(redis_server: Any) -> None:
    # a client that leaves cancels its request's task; the store must not swallow that
    # (redis-py 8.0 and 8.1 do, inside every command)
    store = make(redis_server)

    async def calls() -> None:
        end = time.monotonic() + 2  # bounded: a swallowed cancel ends it without one
        while time.monotonic() < end:
            await store._call("heartbeat", [SIDECARS], [store.id, 1000])

    task = asyncio.create_task(calls())
    # calls are running: the first heartbeat is in Redis
    await wait_for(lambda: redis_server.client().zscore(SIDECARS, store.id) is not None, "a call")
    task.cancel()
    await asyncio.wait({task})
    assert task.cancelled()
    await store.close()


async def test_holds_admitted_while_redis_was_away_go_into_it_before_any_new_decision(
    redis_server: Any,
) -> None:
    a, b = make(redis_server, timeout=OUTAGE_S), make(redis_server, timeout=OUTAGE_S)
    assert (await a.reserve(hold("a", 0.2))).admitted  # a's known remainder: 0.8
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        outage = [await a.reserve(hold(f"o{i}", 0.3)) for i in range(3)]
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert [v.admitted for v in outage] == [True, True, False]  # its share: 0.8
    await wait_for(lambda: a.breaker.clock() >= a.breaker.retry_at, "the breaker's cooldown")
    await a.tick()  # Redis answers: both running outage holds are recorded there, leased
    assert held(redis_server)["user:u"] == 800_000 and {"o0", "o1"} <= set(a.open)
    assert not (await b.reserve(hold("b", 0.5))).admitted  # not the full remainder again
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # a second outage: a fresh remainder needed
    try:
        again = await a.reserve(hold("o3", 0.1))
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert not again.admitted and again.reason == "unavailable"
    await a.close()
    await b.close()


async def test_holds_lost_with_redis_data_are_recorded_again(redis_server: Any) -> None:
    ledger = Ledger({})
    a = make(redis_server, source=ledger)
    assert (await a.reserve(hold("a", 0.6))).admitted
    redis_server.client().flushall()
    assert not (await a.reserve(hold("b", 0.6))).admitted  # reseeded, then a's hold put back
    redis_server.client().flushall()
    await a.tick()  # every upkeep tick puts them back too
    assert held(redis_server) == {"user:u": 600_000}
    redis_server.client().flushall()
    b = make(redis_server, source=ledger)
    assert (await b.reserve(hold("c", 0.1))).admitted  # b reseeds; a's hold is not back yet
    assert not (await a.reserve(hold("d", 0.6))).admitted  # a sees the new seed: back first
    assert held(redis_server) == {"user:u": 700_000}
    await a.close()
    await b.close()


async def test_sidecars_with_different_leases_count_each_other(redis_server: Any) -> None:
    short, long = make(redis_server, lease=0.3), make(redis_server, lease=60.0)
    await long.tick()
    # longer than the short lease's window since long's heartbeat, shorter than the long's
    beat = redis_server.client().zscore(SIDECARS, long.id) - window_ms(long)
    await redis_clock_past(redis_server, beat + window_ms(short))
    assert redis_ms(redis_server) < beat + window_ms(long)
    await short.tick()
    assert short.alive == 2
    await short.close()
    await long.close()


@pytest.mark.parametrize(("limit", "worst"), [(1, True), (100, False)])
async def test_the_redis_store_settles_an_unmeasured_stream_as_the_local_store_does(
    start_sidecar: StartSidecar,
    aiohttp_server: Any,
    tmp_path: Path,
    redis_server: Any,
    limit: int,
    worst: bool,
) -> None:
    """The fleet's settle goes through `Budgets.charge` as the local store's does (`settle` hands
    the Redis store the charge): a client leaving Ollama's chat after 100 one-token chunks with
    `max_completion_tokens: 1` (which Ollama ignores) is charged the default worst case; with
    `max_completion_tokens: 100` the 100 chunks fit the limit the hold read, so its hold."""
    release = asyncio.Event()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", ollama_v1_generating(release))
    up = await aiohttp_server(app)
    db = tmp_path / "ledger.db"
    run = await start_sidecar(
        {
            "pricing": sim.prices(MODEL),
            "ledger": {"path": str(db), "flush_interval_s": 0.05},
            "budgets": {"user_daily_usd": 50.0, "store": redis_server.url},
        },
        upstream_url=str(up.make_url("")).rstrip("/"),
    )
    body = {"model": MODEL, "messages": MSGS_V1, "max_completion_tokens": limit, "stream": True}
    today = day_keys(run.sc.budgets.day_start(time.time()))[0]

    def spent() -> int:
        return int(redis_server.client().hget(today, "user:red") or 0)

    try:
        async with aiohttp.ClientSession() as s:
            headers = {"X-Tollbooth-User": "red"}
            r = await s.post(run.url + "/v1/chat/completions", json=body, headers=headers)
            got = 0
            while got < STREAMED:
                got += (await r.content.readline()).startswith(b"data:")
            r.close()
        await wait_for(lambda: len(sim.ledger_rows(db, "status")) == 1, "the ledger row")
        await wait_for(lambda: spent() > 0, "the charge in Redis")
    finally:
        release.set()
    if worst:
        assert spent() / 1e6 > sim.token_cost(0, 4096)
    else:
        assert spent() / 1e6 <= sim.token_cost(len(json.dumps(body)), limit)
