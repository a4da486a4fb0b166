"""The fleet's budgets in Redis, server side: the key layout and the Lua scripts.

Owns: the keys of a budget day and of its month (their names, hash tags and how long they are
kept), the set of live sidecars, and the scripts (reserve, settle, sweep, renew, seed,
heartbeat: each one atomic over every scope of a hold). `redis_store` is the client that loads
and runs them.
Never: writes anything before every argument and every record it reads is checked (a script
answers 'invalid' having changed nothing), nor a total out of [0, MAX_MICROS]. The key layout,
the scripts' invariants and the bounds are in docs/fleet.md.
"""

from __future__ import annotations

from .budget import DAY, month_start

PREFIX = "tollbooth"
KEEP_S = 2 * DAY  # a day's keys expire two days after the day starts


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
