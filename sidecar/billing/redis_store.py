"""Budgets shared by a fleet of sidecars: the holds of `budget.LocalStore`, kept in Redis.

Owns: the key layout per budget day, the Lua scripts (reserve, settle, sweep, renew, seed,
heartbeat: each one atomic over every scope of a hold), leases on holds (renewed while their
request runs; a hold whose sidecar stopped renewing it is charged in full), seeding an empty day
from the ledger, settlement in the background with retries, and what a request gets while Redis
cannot be reached (`budgets.store_unavailable`, short timeouts, a circuit breaker).
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
    month_start,
)

log = logging.getLogger("tollbooth.budget")

PREFIX = "tollbooth"
KEEP_S = 2 * DAY  # a day's keys expire two days after the day starts
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

# --- the scripts ----------------------------------------------------------------------------------
# Every day's keys share the hash tag {day}: one slot, so a script may touch them all.
# A hold record in `holds` is JSON: ["h", amount, [scope keys]] while held, ["x", amount, [...]]
# once its lease ended and the sweep charged it, ["s"] once settled. Integers are passed as
# strings and formatted with %d: Lua numbers are doubles and Redis would print big ones as 1e+15.
# All or nothing: each script checks every argument (and every record it reads) before it writes
# anything, and answers 'invalid' having changed nothing; Redis does not undo a script's writes
# when it fails half way, and a settlement retried after such a failure applied its first half
# again and again. An amount is a decimal integer from 0 to budget.MAX_MICROS (exact in a double);
# a total is written clamped into [0, MAX_MICROS], never negative (a negative hold is a bigger
# budget), and a settlement that had to clamp answers with ':clamped' (counted).

COMMON = """
local spent, held, holds, leases, seeded = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local mspent, mheld, mseeded = KEYS[6], KEYS[7], KEYS[8]
local MAX = 9007199254740991
local function int(s)
  if type(s) == 'number' then s = string.format('%d', s) end
  if type(s) ~= 'string' or #s == 0 or #s > 16 or not string.find(s, '^%d+$') then return nil end
  local n = tonumber(s)
  if n > MAX then return nil end
  return n
end
local function stored(hash, key)
  local v = tonumber(redis.call('HGET', hash, key)) or 0
  if v ~= v or v < 0 then return 0 end
  if v > MAX then return MAX end
  return v
end
local clamped = false
local function put(hash, key, v)
  if v < 0 then v, clamped = 0, true elseif v > MAX then v, clamped = MAX, true end
  redis.call('HSET', hash, key, string.format('%d', v))
end
-- a month window's scope key ('month:user:alice') lives in its month's hashes, a day's in the day's
local function pick(key, day_hash, month_hash)
  if month_hash and string.sub(key, 1, 6) == 'month:' then return month_hash end
  return day_hash
end
local MONTH_KEEP = 2678400  -- a month's keys outlive each write by 31 days (past the month's end)
local function expire_month(hash, at)
  if hash then redis.call('EXPIREAT', hash, string.format('%d', tonumber(at) + MONTH_KEEP)) end
end
local function record(rec)
  local ok, r = pcall(cjson.decode, rec)
  if not ok or type(r) ~= 'table' then return nil end
  if r[1] == 's' then return r end
  if (r[1] ~= 'h' and r[1] ~= 'x') or not int(r[2]) or type(r[3]) ~= 'table' then return nil end
  for _, key in ipairs(r[3]) do
    if type(key) ~= 'string' or key == '' then return nil end
  end
  return r
end
-- hold `id` of `amount` (a checked decimal string) on each of `scopes`, no limit checked
local function hold(id, amount, scopes, deadline)
  for _, key in ipairs(scopes) do
    local h = pick(key, held, mheld)
    put(h, key, stored(h, key) + int(amount))
    redis.call('HSETNX', pick(key, spent, mspent), key, 0)
  end
  redis.call('HSET', holds, id, cjson.encode({'h', amount, scopes}))
  redis.call('ZADD', leases, deadline, id)
end
-- a hold record's amount out of `held` and `charge` into `spent` on each of its scopes; an 'x'
-- record's amount is in `spent` already (the sweep moved it)
local function release(r, charge)
  local amount = int(r[2])
  for _, key in ipairs(r[3]) do
    local s, h = pick(key, spent, mspent), pick(key, held, mheld)
    if r[1] == 'h' then
      put(h, key, stored(h, key) - amount)
      put(s, key, stored(s, key) + charge)
    else
      put(s, key, stored(s, key) + charge - amount)
    end
  end
end
"""

RESERVE = """
local id, amount = ARGV[1], int(ARGV[2])
local n = (#ARGV - 6) / 2
if not (amount and int(ARGV[3]) and int(ARGV[4]) and int(ARGV[5])) or n ~= math.floor(n) then
  return {'invalid'}
end
local scopes = {}
for i = 1, n do
  scopes[i] = ARGV[5 + 2 * i]
  if scopes[i] == '' or not int(ARGV[6 + 2 * i]) then return {'invalid'} end
end
local read = redis.call('GET', seeded)
if not read then return {'unseeded'} end
if read ~= ARGV[6] then return {'reseeded', read} end
if redis.call('HEXISTS', holds, id) == 1 then return {'again'} end
local new, first_new = 0, 0
for i, key in ipairs(scopes) do
  if redis.call('HEXISTS', pick(key, spent, mspent), key) == 0 then
    new = new + 1
    if first_new == 0 then first_new = i end
  end
end
local tracked = redis.call('HLEN', spent)
if mspent then tracked = tracked + redis.call('HLEN', mspent) end
if new > 0 and tracked + new > int(ARGV[5]) then
  return {'capacity', first_new}
end
local out = {'ok'}
for i, key in ipairs(scopes) do
  local was = stored(pick(key, spent, mspent), key)
  local left = int(ARGV[6 + 2 * i]) - was - stored(pick(key, held, mheld), key)
  if amount > left then return {'budget', i, string.format('%d', left)} end
  out[i + 1] = string.format('%d', left - amount)
  out[n + i + 1] = string.format('%d', was)  -- spent before this hold: the used-ratio gauge
end
local t = redis.call('TIME')
local deadline = t[1] * 1000 + math.floor(t[2] / 1000) + int(ARGV[3])
hold(id, ARGV[2], scopes, string.format('%d', deadline))
expire_month(mspent, ARGV[4])
expire_month(mheld, ARGV[4])
for i = 1, 4 do redis.call('EXPIREAT', KEYS[i], ARGV[4]) end
return out
"""

SETTLE = """
local id, charge, ended = ARGV[1], int(ARGV[2]), int(ARGV[3])
if not (charge and ended and int(ARGV[4])) then return 'invalid' end
for i = 5, #ARGV do
  if ARGV[i] == '' then return 'invalid' end
end
local rec = redis.call('HGET', holds, id)
if rec then
  local r = record(rec)
  if not r then return 'invalid' end
  if r[1] == 's' then return 'again' end
  release(r, charge)
  redis.call('ZREM', leases, id)
  redis.call('HSET', holds, id, '["s"]')
  local status = r[1] == 'h' and 'settled' or 'corrected'
  if clamped then return status .. ':clamped' end
  return status
end
local read = redis.call('GET', seeded)
if not read then return 'unseeded' end
redis.call('HSET', holds, id, '["s"]')
-- a month key counts it unless its month's seed (the ledger read) already did
-- (a marker that is absent or not a number reads as the day's: never an error half way)
local mread = mseeded and tonumber(redis.call('GET', mseeded) or '') or nil
if not mread then mread = tonumber(read) end
for i = 5, #ARGV do
  local key = ARGV[i]
  local s = pick(key, spent, mspent)
  if ended >= (s == spent and tonumber(read) or mread) then
    put(s, key, stored(s, key) + charge)
  end
end
-- after the writes: EXPIREAT on a key that does not exist yet is a no-op
for i = 1, 3 do redis.call('EXPIREAT', KEYS[i], ARGV[4]) end
expire_month(mspent, ARGV[4])
if ended < tonumber(read) then return 'in_seed' end
if clamped then return 'charged:clamped' end
return 'charged'
"""

SWEEP = """
local most = int(ARGV[1])
if not most then return 0 end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local due = redis.call('ZRANGEBYSCORE', leases, '-inf', string.format('%d', now),
  'LIMIT', 0, most)
local charged = 0
for _, id in ipairs(due) do
  local rec = redis.call('HGET', holds, id)
  local r = rec and record(rec)
  if r and r[1] == 'h' then
    release(r, int(r[2]))
    r[1] = 'x'
    redis.call('HSET', holds, id, cjson.encode(r))
    charged = charged + 1
  end
  redis.call('ZREM', leases, id)
end
return charged
"""

RENEW = """
if not (int(ARGV[1]) and int(ARGV[2])) then return -1 end
local groups, i = {}, 3  -- each: id, amount, scope keys
while i <= #ARGV do
  local n = int(ARGV[i + 2])
  if not (n and int(ARGV[i + 1])) or i + 2 + n > #ARGV then return -1 end
  local scopes = {}
  for j = 1, n do
    scopes[j] = ARGV[i + 2 + j]
    if scopes[j] == '' then return -1 end
  end
  groups[#groups + 1] = {ARGV[i], ARGV[i + 1], scopes}
  i = i + 3 + n
end
local t = redis.call('TIME')
local deadline = string.format('%d', t[1] * 1000 + math.floor(t[2] / 1000) + int(ARGV[1]))
local made = 0
for _, g in ipairs(groups) do
  if redis.call('HEXISTS', holds, g[1]) == 1 then
    redis.call('ZADD', leases, 'XX', deadline, g[1])
  else
    hold(g[1], g[2], g[3], deadline)
    made = made + 1
  end
end
if made > 0 then
  for k = 1, 4 do redis.call('EXPIREAT', KEYS[k], ARGV[2]) end
  expire_month(mspent, ARGV[2])
  expire_month(mheld, ARGV[2])
end
return made
"""

SEED = """
if not (int(ARGV[1]) and int(ARGV[2])) or #ARGV % 2 ~= 0 then return -1 end
for i = 3, #ARGV, 2 do
  if ARGV[i] == '' or not int(ARGV[i + 1]) then return -1 end
end
if redis.call('EXISTS', seeded) == 1 then return 0 end
-- month keys go in only when their month is not seeded yet: else its total runs on from Redis
local month_open = mspent and redis.call('EXISTS', mseeded) == 0
for i = 3, #ARGV, 2 do
  local h = pick(ARGV[i], spent, mspent)
  if h == spent or month_open then redis.call('HSET', h, ARGV[i], ARGV[i + 1]) end
end
redis.call('SET', seeded, ARGV[1])
redis.call('EXPIREAT', spent, ARGV[2])
redis.call('EXPIREAT', seeded, ARGV[2])
if month_open then
  redis.call('SET', mseeded, ARGV[1])
  expire_month(mspent, ARGV[2])
  expire_month(mseeded, ARGV[2])
end
return 1
"""

HEARTBEAT = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local window = tonumber(ARGV[2])
if not window or window ~= window or window < 0 then return -1 end
redis.call('ZADD', KEYS[1], string.format('%d', now + window), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('(%d', now))
if redis.call('PTTL', KEYS[1]) < window then redis.call('PEXPIRE', KEYS[1], window) end
return redis.call('ZCARD', KEYS[1])
"""

# COMMON goes first in every script but the heartbeat (each takes `script_keys`): the keys' names,
# the checks of numbers, the clamped writes, and a hold's record written and released.
SCRIPTS = {
    "reserve": COMMON + RESERVE,
    "settle": COMMON + SETTLE,
    "sweep": COMMON + SWEEP,
    "renew": COMMON + RENEW,
    "seed": COMMON + SEED,
    "heartbeat": HEARTBEAT,
}


def day_keys(day: int) -> list[str]:
    """spent, held, holds, leases, seeded: the keys of one budget day."""
    tag = f"{PREFIX}:{{{day}}}"
    return [f"{tag}:{name}" for name in ("spent", "held", "holds", "leases", "seeded")]


def month_keys(day: int) -> list[str]:
    """spent, held, seeded of the budget month of day `day`: its month-window scopes. Another
    hash tag than the day's: one Redis server (not a cluster) runs a script over both."""
    tag = f"{PREFIX}:{{month:{month_start(day)}}}"
    return [f"{tag}:{name}" for name in ("spent", "held", "seeded")]


def script_keys(day: int) -> list[str]:
    """The day's five keys and its month's three: the KEYS of every script but the heartbeat."""
    return [*day_keys(day), *month_keys(day)]


SIDECARS = f"{PREFIX}:sidecars"


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
        except StoreDown:
            self._reseed_failed_at = time.monotonic()
            return False
        except Exception as exc:
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
