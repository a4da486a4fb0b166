"""Budgets shared by a fleet of sidecars: the holds of `budget.LocalStore`, kept in Redis.

Owns: the client side of the scripts in `redis_scripts` (which hold the key layout): leases on
holds (renewed while their request runs; a hold whose sidecar stopped renewing it is charged in
full), seeding an empty day from the ledger, settlement in the background with retries, and what
a request gets while Redis cannot be reached (`budgets.store_unavailable`, short timeouts, a
circuit breaker).
Never: waits on a settlement in a request, lets one slow Redis call hold a request longer than
`store_timeout_s`, or loses a charge because Redis was away (settlements wait in a bounded queue
and are idempotent per hold). The key layout, the scripts' invariants and the bounds are in
docs/fleet.md.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import math
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from aiohttp import web
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from ..config import BudgetConfig, ConfigError
from ..exchange import CleanupContext
from ..telemetry.metrics import Metrics
from .budget import (
    DAY,
    MAX_MICROS,
    MONTH,
    Hold,
    LocalStore,
    Scope,
    Verdict,
)
from .redis_scripts import KEEP_S, SCRIPTS, SIDECARS, script_keys

log = logging.getLogger("tollbooth.budget")

MAX_CONNECTIONS = 64
SETTLE_QUEUE = 100_000  # settlements waiting for Redis; beyond this the oldest is dropped, counted
SETTLE_BATCH = 64  # settlements per pipelined round trip
RENEW_BATCH = 1000
SWEEP_BATCH = 500
HEARTBEAT_S = 5.0  # upkeep tick: heartbeat, lease renewal, sweep (shorter with a short lease)
RESEED_RETRY_S = 1.0  # after a failed read of the ledger, requests wait this long before the next
BREAKER_FAILURES = 3  # failed calls in a row that open the circuit
BREAKER_COOLDOWN_S = 2.0  # open this long, then one trial call
DRAIN_S = 2.0  # at shutdown, how long queued settlements may take to reach Redis

# spend by scope key since the start of `day`, and when it was read (unix seconds)
Source = Callable[[int], Awaitable[tuple[Mapping[str, int], float]]]


class StoreDown(Exception):
    """Redis did not answer (or the breaker is open). `sent`: the call may have run there."""

    def __init__(self, sent: bool) -> None:
        super().__init__("budget store unavailable")
        self.sent = sent


class Breaker:
    """Closed until `failures` calls in a row fail; then open (calls fail at once) for
    `cooldown_s`, after which one trial call at a time is let through."""

    def __init__(
        self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.failures, self.cooldown_s, self.clock = failures, cooldown_s, clock
        self.in_row = 0
        self.retry_at = 0.0

    @property
    def closed(self) -> bool:
        return self.in_row < self.failures

    def allow(self) -> bool:
        if self.closed:
            return True
        now = self.clock()
        if now < self.retry_at:
            return False
        self.retry_at = now + self.cooldown_s  # this call is the trial; others wait for it
        return True

    def success(self) -> bool:
        """Record a success; True when it closes an open circuit."""
        was_open = not self.closed
        self.in_row = 0
        return was_open

    def failure(self) -> bool:
        """Record a failure; True when it opens the circuit."""
        self.in_row += 1
        if self.in_row == self.failures or not self.closed:
            self.retry_at = self.clock() + self.cooldown_s
        return self.in_row == self.failures


def redis_client(config: BudgetConfig) -> Redis:
    """A client with short timeouts and no retries of its own (the store decides what follows)."""
    assert config.store is not None
    password = None
    if config.store_password_env:
        password = os.environ.get(config.store_password_env) or None
        if password is None:
            raise ConfigError(
                f"config 'budgets.store_password_env' names '{config.store_password_env}', "
                "which is unset or empty"
            )
    t = config.store_timeout_s
    pool = BlockingConnectionPool.from_url(
        config.store,
        max_connections=MAX_CONNECTIONS,
        timeout=t,
        socket_timeout=t,
        socket_connect_timeout=t,
        password=password,
        retry=Retry(NoBackoff(), 0),
    )
    return Redis.from_pool(pool)  # the client owns the pool: aclose() closes its connections


class RedisStore:
    """A `BudgetStore` in Redis, shared by every sidecar pointed at it."""

    def __init__(
        self,
        config: BudgetConfig,
        metrics: Metrics,
        today: Callable[[], int],
        source: Source | None = None,
        *,
        max_scopes: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config, self.metrics, self.today, self.source = config, metrics, today, source
        self.max_scopes = max_scopes
        self.clock = clock
        self.lease_ms = math.ceil(config.lease_s * 1000)
        self.interval = min(config.lease_s / 3, HEARTBEAT_S)
        self.id = secrets.token_hex(8)
        self.redis = redis_client(config)
        self.scripts = {name: self.redis.register_script(src) for name, src in SCRIPTS.items()}
        self.breaker = Breaker(BREAKER_FAILURES, BREAKER_COOLDOWN_S)
        self.open: dict[str, Hold] = {}  # held in Redis by this sidecar: leases to renew
        self.outage: dict[str, Hold] = {}  # admitted without Redis: put into it when it answers
        # admitted without Redis and ended, their settlement not yet answered by Redis
        self.settling: dict[str, Hold] = {}
        self._restoring = asyncio.Lock()
        self.known: dict[str, int] = {}  # last known remainder by scope key, for `known_day`
        self.known_day = -1
        self.seeds: dict[int, bytes] = {}  # the `seeded` marker this sidecar last saw, by day
        self.alive = 1
        self.local = LocalStore(max_scopes, metrics)  # this sidecar's share while Redis is away
        self.seen = LocalStore(max_scopes)  # spend by scope at this sidecar's last admission to it
        self.queue: collections.deque[tuple[Hold, int, int]] = collections.deque()
        self._sending: list[tuple[Hold, int, int]] = []  # the settler's batch in flight
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._reseed: asyncio.Task[bool] | None = None
        self._reseed_failed_at = -math.inf
        metrics.store_up.set(1)

    # --- calls through the breaker

    async def _call(self, op: str, keys: list[str], args: list[Any]) -> Any:
        return await self._guard(op, lambda: self.scripts[op](keys=keys, args=args))

    async def _guard(self, op: str, call: Callable[[], Awaitable[Any]]) -> Any:
        if not self.breaker.allow():
            raise StoreDown(sent=False)
        task = asyncio.current_task()
        cancelling = task.cancelling() if task is not None else 0
        try:
            # the socket timeouts bound each read; this bounds the whole call (pool wait included)
            async with asyncio.timeout(self.config.store_timeout_s * 4):
                result = await call()
        except (RedisError, OSError, TimeoutError) as exc:
            self.metrics.store_errors.labels(op).inc()
            if self.breaker.failure():
                log.warning("budget store unreachable (%s): %s", op, type(exc).__name__)
                self.metrics.store_up.set(0)
            raise StoreDown(sent=True) from exc
        if task is not None and task.cancelling() > cancelling:
            raise asyncio.CancelledError  # a client library swallowed it (redis-py 8.0, 8.1)
        if self.breaker.success():
            log.info("budget store reachable again")
            self.metrics.store_up.set(1)
            # a new outage needs a fresh remainder: this one's admissions go into Redis first
            self.local = LocalStore(self.max_scopes, self.metrics)
            self.known = {}
        return result

    # --- BudgetStore

    async def reserve(self, hold: Hold) -> Verdict:
        keys = script_keys(hold.day)
        try:
            if self.outage or self.settling:
                await self._restore()
            for _ in range(4):  # unseeded, seeded here, seen here, decided
                reply = await self._call("reserve", keys, self._reserve_args(hold))
                if reply[0] == b"unseeded":
                    if not await self.reseed(hold.day):
                        break
                elif reply[0] == b"reseeded":  # first seen, or Redis was emptied and seeded again
                    self.seeds[hold.day] = reply[1]
                    if len(self.seeds) > 2:
                        self.seeds.pop(min(self.seeds))
                    await self._renew()  # this sidecar's holds back before its next decision
                else:
                    break
            if reply[0] in (b"unseeded", b"reseeded"):  # no ledger read, or emptied again
                return await self._without_store(hold, sent=False)
        except StoreDown as down:
            return await self._without_store(hold, sent=down.sent)
        return self._verdict(hold, reply)

    def _reserve_args(self, hold: Hold) -> list[Any]:
        args: list[Any] = [
            hold.request_id,
            hold.amount,
            self.lease_ms,
            hold.day + KEEP_S,
            self.max_scopes,
            self.seeds.get(hold.day, b""),
        ]
        for s in hold.scopes:
            args += [s.key, s.limit]
        return args

    def _verdict(self, hold: Hold, reply: list[Any]) -> Verdict:
        status = reply[0]
        if status == b"invalid":  # a hold out of range: changed nothing there; never admit it free
            self._refused_by_script("reserve", hold)
            return Verdict(False, None, "unavailable")
        if status in (b"ok", b"again"):
            n = len(hold.scopes)
            lefts = [int(left) for left in reply[1 : 1 + n]]
            for s, left, was in zip(hold.scopes, lefts, reply[1 + n :], strict=False):
                self._remember(hold.day, s.key, left)
                self.seen.note(hold.day, s.key, int(was))
            self.open[hold.request_id] = hold
            return Verdict(True, left=min(lefts, default=None))
        scope = hold.scopes[int(reply[1]) - 1]
        if status == b"capacity":
            return Verdict(False, scope, "capacity")
        self._remember(hold.day, scope.key, int(reply[2]))
        return Verdict(False, scope, "budget")

    def _refused_by_script(self, op: str, hold: Hold | None, detail: object = "") -> None:
        """A script found an argument or a record out of range (a bug here: `to_micros` bounds
        every amount) and wrote nothing, or clamped a total that would have gone negative."""
        log.error(
            "budget store: %s refused or clamped (hold %s) %s",
            op,
            hold.request_id if hold is not None else "-",
            detail,
        )
        self.metrics.metering_errors.labels("budget_store").inc()

    def _remember(self, day: int, key: str, left: int) -> None:
        if day != self.known_day:
            self.known_day, self.known = day, {}
        if key in self.known or len(self.known) < self.max_scopes:
            self.known[key] = left

    def settle(self, request_id: str, charge: int) -> None:
        hold = self.open.pop(request_id, None)
        if hold is None:
            hold = self.outage.pop(request_id, None)
            if hold is None:
                return
            self.local.settle(request_id, charge)
            self.settling[request_id] = hold
        self._enqueue(hold, charge)

    async def seed(self, day: int, spent: Mapping[str, int]) -> None:
        await self._seed(day, spent, self.clock())

    async def _seed(self, day: int, spent: Mapping[str, int], read_at: float) -> bool:
        args: list[Any] = [math.floor(read_at * 1000), day + KEEP_S]
        for key, micros in spent.items():
            args += [key, micros]
        seeded = int(await self._call("seed", script_keys(day), args))
        if seeded < 0:
            self._refused_by_script("seed", None, f"day {day}")
        return seeded > 0

    async def usage(self, day: int, scopes: Sequence[Scope]) -> list[tuple[int, int]] | None:
        """Each scope's spent and held, read from Redis (None while it cannot be reached)."""
        if not scopes:
            return []
        day_spent, day_held, _, _, seeded, month_spent, month_held, _ = script_keys(day)

        async def read() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.exists(seeded)
                for s in scopes:
                    month = s.key.startswith(MONTH)
                    pipe.hget(month_spent if month else day_spent, s.key)
                    pipe.hget(month_held if month else day_held, s.key)
                return list(await pipe.execute())

        try:
            raw = await self._guard("usage", read)
            if not raw[0]:  # nothing read from the ledger yet today: read it first
                if not await self.reseed(day):
                    return None
                raw = await self._guard("usage", read)
        except StoreDown:
            return None
        return [(_micros(s), _micros(h)) for s, h in zip(raw[1::2], raw[2::2], strict=True)]

    def spent_now(self, day: int) -> Mapping[str, int]:
        return self.seen.spent_now(day)

    # --- without Redis

    async def _without_store(self, hold: Hold, *, sent: bool) -> Verdict:
        mode = self.config.store_unavailable
        if mode == "open":
            self.metrics.store_bypassed.inc()
            verdict = Verdict(True)
        elif mode == "local":
            verdict = await self._local(hold)
        else:
            self.metrics.store_refused.inc()
            verdict = Verdict(False, None, "unavailable")
        if verdict.admitted:
            self.outage[hold.request_id] = hold
        elif sent:  # the reservation may have run in Redis: release it
            self._enqueue(hold, 0)
        return verdict

    async def _restore(self) -> None:
        """Put every hold admitted without Redis into it (no limit check: they were admitted),
        before any new decision, so Redis counts them while they run. One that already ended
        is settled now, before any new decision, not put back as a hold: a hold's settlement
        adds its charge, so a reseed's ledger read, which holds the ended request's row, would
        have counted it a second time. Settled, it is charged unless that read has it."""
        async with self._restoring:
            running = list(self.outage.values())
            settling = self.settling  # mostly empty: the queue is read only when it is not
            # one in the settler's batch in flight too (sent twice: settle is idempotent per hold),
            # else the decision would not wait for it
            ended = (
                [item for item in (*self._sending, *self.queue) if item[0].request_id in settling]
                if settling
                else []
            )
            if not running and not ended:
                return
            await self._renew_holds(running)
            for h in running:
                if self.outage.pop(h.request_id, None) is not None:
                    self.open[h.request_id] = h
            if ended:
                await self._settle_now(ended)
            log.info("budget store: %d holds admitted without it put back", len(running))

    async def _settle_now(self, batch: list[tuple[Hold, int, int]]) -> None:
        """Send these queued settlements now (taken out of the queue; put back if Redis cannot
        be reached or the caller is cancelled, or if Redis answers that their day is not seeded
        yet)."""
        taken = {id(item) for item in batch}
        self.queue = collections.deque(item for item in self.queue if id(item) not in taken)
        for i in range(0, len(batch), SETTLE_BATCH):
            some = batch[i : i + SETTLE_BATCH]
            try:
                replies = await self._guard("settle", functools.partial(self._settle_batch, some))
            except BaseException:  # Redis away, or the reservation cancelled: none of them lost
                self._requeue(self._not_sending(batch[i:]))
                self._wake.set()  # the settler may have found the queue empty meanwhile
                raise
            if waiting := self._answered(some, replies):
                # the settler sends them after the reseed, not every request: the reseed's ledger
                # read, which any decision on an unseeded day waits for, counts them until then
                for hold, _, _ in waiting:
                    self.settling.pop(hold.request_id, None)
                self._requeue(self._not_sending(waiting))
                self._wake.set()
        self.metrics.settles_pending.set(len(self.queue))

    def _not_sending(self, items: list[tuple[Hold, int, int]]) -> list[tuple[Hold, int, int]]:
        """Those not in the settler's batch in flight (it puts its own back)."""
        theirs = {id(item) for item in self._sending}
        return [item for item in items if id(item) not in theirs]

    async def _local(self, hold: Hold) -> Verdict:
        """Reserve against this sidecar's share of the last known remainder of each scope."""
        share = []
        for s in hold.scopes:
            left = self.known.get(s.key) if hold.day == self.known_day else None
            if left is None:
                self.metrics.store_refused.inc()
                return Verdict(False, s, "unavailable")
            share.append(replace(s, limit=max(0, left) // max(1, self.alive)))
        verdict = await self.local.reserve(replace(hold, scopes=tuple(share)))
        self.metrics.store_local.labels("admitted" if verdict.admitted else "refused").inc()
        if verdict.admitted:  # against this sidecar's share: not what is left, so not shown
            return Verdict(True)
        if verdict.scope is None:
            return verdict
        return Verdict(False, hold.scopes[share.index(verdict.scope)], verdict.reason)

    # --- seeding a day from the ledger

    async def reseed(self, day: int) -> bool:
        """Seed `day` from the ledger unless another sidecar already has; one read at a time."""
        if self._reseed is None or self._reseed.done():
            if time.monotonic() - self._reseed_failed_at < RESEED_RETRY_S:
                return False
            self._reseed = asyncio.create_task(self._read_and_seed(day))
        return await asyncio.shield(self._reseed)

    async def _read_and_seed(self, day: int) -> bool:
        try:
            # no ledger: the day starts from zero
            spent, read_at = (
                await self.source(day) if self.source is not None else ({}, self.clock())
            )
            seeded = await self._seed(day, spent, read_at)
            await self._renew()  # holds lost with Redis's data come back before a decision
        except Exception as exc:
            if not isinstance(exc, StoreDown):  # Redis away: not a failed ledger read
                log.error("budget store: today's spend could not be read from the ledger: %s", exc)
                self.metrics.store_reseeds.labels("failed").inc()
            self._reseed_failed_at = time.monotonic()
            return False
        self.metrics.store_reseeds.labels("seeded" if seeded else "already_seeded").inc()
        if seeded:
            log.info("budget store: day %d seeded from the ledger (%d scopes)", day, len(spent))
        return True

    # --- settlement in the background

    def _enqueue(self, hold: Hold, charge: int) -> None:
        self.queue.append((hold, charge, math.floor(self.clock() * 1000)))
        if len(self.queue) > SETTLE_QUEUE:
            self.settling.pop(self.queue.popleft()[0].request_id, None)
            self.metrics.settles_dropped.inc()
        self.metrics.settles_pending.set(len(self.queue))
        self._wake.set()

    async def _settler(self) -> None:
        backoff = 0.05
        while True:
            if not self.queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = [self.queue.popleft() for _ in range(min(SETTLE_BATCH, len(self.queue)))]
            self._sending = batch
            try:
                replies = await self._guard("settle", functools.partial(self._settle_batch, batch))
            except StoreDown:
                self._sending = []
                self._requeue(batch)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BREAKER_COOLDOWN_S)
                continue
            backoff = 0.05
            self._sending = []
            await self._after_settle(batch, replies)
            self.metrics.settles_pending.set(len(self.queue))

    async def _settle_batch(self, batch: list[tuple[Hold, int, int]]) -> list[Any]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for hold, charge, ended_ms in batch:
                args: list[Any] = [hold.request_id, charge, ended_ms, hold.day + KEEP_S]
                args += [s.key for s in hold.scopes]
                await self.scripts["settle"](keys=script_keys(hold.day), args=args, client=pipe)
            return list(await pipe.execute())

    def _requeue(self, batch: list[tuple[Hold, int, int]]) -> None:
        self.queue.extendleft(reversed(batch))
        while len(self.queue) > SETTLE_QUEUE:
            self.settling.pop(self.queue.pop()[0].request_id, None)
            self.metrics.settles_dropped.inc()

    async def _after_settle(self, batch: list[tuple[Hold, int, int]], replies: list[Any]) -> None:
        """A settlement that found its day unseeded (Redis emptied) waits for the reseed."""
        if waiting := self._answered(batch, replies):
            self._requeue(waiting)
            if not await self.reseed(waiting[0][0].day):
                await asyncio.sleep(RESEED_RETRY_S)

    def _answered(
        self, batch: list[tuple[Hold, int, int]], replies: list[Any]
    ) -> list[tuple[Hold, int, int]]:
        """Note each reply; return the settlements that found today unseeded, to send again. One
        for a day whose keys are gone for good is dropped."""
        today, waiting = self.today(), []
        for item, r in zip(batch, replies, strict=True):
            hold, charge, _ = item
            if r == b"unseeded" and hold.day >= today:
                waiting.append(item)
                continue
            self.settling.pop(hold.request_id, None)
            if r == b"unseeded":
                self.metrics.settles_dropped.inc()
            elif isinstance(r, bytes) and (r == b"invalid" or r.endswith(b":clamped")):
                # invalid: nothing changed there; the hold's lease ends and the sweep charges it
                self._refused_by_script("settle", hold, f"charge {charge!r}: {r!r}")
        return waiting

    # --- upkeep: heartbeat, leases, sweep

    async def _maintain(self) -> None:
        while True:
            await self.tick()
            await asyncio.sleep(self.interval)

    async def tick(self) -> None:
        with contextlib.suppress(StoreDown):
            window = math.ceil(self.interval * 3 * 1000)
            alive = await self._call("heartbeat", [SIDECARS], [self.id, window])
            self.alive = max(1, int(alive))
            self.metrics.sidecars_alive.set(self.alive)
        with contextlib.suppress(StoreDown):
            await self._restore()
        with contextlib.suppress(StoreDown):
            await self._renew()
        with contextlib.suppress(StoreDown):
            today = self.today()
            for day in (today - DAY, today):
                charged = await self._call("sweep", script_keys(day), [SWEEP_BATCH])
                self.metrics.holds_expired.inc(int(charged))

    async def _renew(self) -> None:
        await self._renew_holds(list(self.open.values()))

    async def _renew_holds(self, holds: list[Hold]) -> None:
        """Push the lease of each hold; one Redis no longer has (emptied, restarted without
        persistence, or never had: admitted while it was away) is recorded again, with its
        amount on each of its scopes, no limit checked."""
        by_day: dict[int, list[Hold]] = {}
        for hold in holds:
            by_day.setdefault(hold.day, []).append(hold)
        for day, some in by_day.items():
            for i in range(0, len(some), RENEW_BATCH):
                args: list[Any] = [self.lease_ms, day + KEEP_S]
                for h in some[i : i + RENEW_BATCH]:
                    args += [h.request_id, h.amount, len(h.scopes), *(s.key for s in h.scopes)]
                made = int(await self._call("renew", script_keys(day), args))
                if made < 0:
                    self._refused_by_script("renew", None, f"day {day}")
                elif made:
                    log.warning("budget store: %d holds missing from Redis recorded again", made)

    # --- lifecycle

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._settler(), name="tollbooth-budget-settler"),
            asyncio.create_task(self._maintain(), name="tollbooth-budget-upkeep"),
        ]

    async def close(self) -> None:
        if self._tasks:
            self._tasks[1].cancel()  # upkeep stops; the settler drains the queue
        deadline = time.monotonic() + DRAIN_S
        while self.queue and self.breaker.closed and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.queue:
            log.error("budget store: %d settlements not sent at shutdown", len(self.queue))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.breaker.closed:
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                async with asyncio.timeout(self.config.store_timeout_s):
                    await self.redis.zrem(SIDECARS, self.id)
        await self.redis.aclose()


def _micros(raw: Any) -> int:
    """A stored total read back: an integer in [0, MAX_MICROS]; anything else (absent, garbled)
    reads as 0 here (the scripts clamp what they write)."""
    try:
        value = int(raw) if raw is not None else 0
    except ValueError:
        return 0
    return min(max(value, 0), MAX_MICROS)


def store_context(store: RedisStore) -> CleanupContext:
    """A cleanup context: background upkeep and settlement before the first request; queued
    settlements sent (for up to DRAIN_S) after the last."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        store.start()
        yield
        await store.close()

    return ctx
