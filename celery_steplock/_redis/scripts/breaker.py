"""The circuit breaker's Lua scripts, each with its KEYS/ARGV/returns contract.

A breaker is the hash ``<prefix>:breaker:{<name>}`` and the sorted set of its half-open
probe permits ``<prefix>:breaker-probes:{<name>}`` (one hash tag: one Cluster slot; laid out
by :func:`celery_steplock.keys.breaker_keys`). The hash's fields: ``state`` (``closed``,
``open``, ``half_open``; absent: closed), ``gen`` (the generation, advanced at every state
change), ``opened_ms`` (Redis time it last opened, ms), ``ring`` (the rolling window, one
character per call, ``1`` a failure), ``successes`` (successful probes while half-open) and
``forced`` (``open`` while an operator forces it open).
"""

from __future__ import annotations

__all__ = ["ADMIT", "RECORD", "OVERRIDE", "READ"]

# The rolling window of a CLOSED breaker, shared by ADMIT (successes counted by a process's
# state cache, flushed at its refresh) and RECORD. append(ring, add, gen, size, threshold,
# mode, minimum, ttl): ``add`` (0s and 1s, oldest first) appended to ``ring``, the last
# ``size`` calls kept; the breaker trips (OPEN, generation gen + 1, window emptied, probes
# dropped) when the threshold is met. Returns opened (bool), failures, calls, now ms (0 when
# it did not trip). With a count threshold, successes before the first failure in the window
# are not written (they change nothing a count sees; ``calls`` counts from that failure).
_APPEND = """
local function append(ring, add, gen, size, threshold, mode, minimum, ttl)
  if mode ~= 'rate' and not string.find(ring, '1', 1, true) then
    local first = string.find(add, '1', 1, true)
    if not first then return false, 0, #ring, 0 end
    add = string.sub(add, first)
  end
  ring = ring .. add
  if #ring > size then ring = string.sub(ring, #ring - size + 1) end
  local _, fails = string.gsub(ring, '1', '')
  local open
  if mode == 'rate' then
    open = fails > 0 and #ring >= minimum and fails >= threshold * #ring
  else
    open = fails >= threshold
  end
  if open then
    local t = redis.call('TIME')
    local now = t[1] * 1000 + math.floor(t[2] / 1000)
    redis.call('HSET', KEYS[1], 'state', 'open', 'gen', gen + 1, 'opened_ms', now, 'ring', '',
               'successes', 0)
    redis.call('PEXPIRE', KEYS[1], ttl)
    redis.call('DEL', KEYS[2])
    return true, fails, #ring, now
  end
  redis.call('HSET', KEYS[1], 'ring', ring, 'gen', gen)
  redis.call('PEXPIRE', KEYS[1], ttl)
  return false, fails, #ring, 0
end
"""

# KEYS[1] the breaker hash, KEYS[2] the probe permits (sorted set: owner -> expiry ms).
# ARGV[1] caller's owner token, ARGV[2] recovery timeout ms, ARGV[3] half-open probes
# allowed, ARGV[4] probe permit lifetime ms, ARGV[5] idle TTL ms, ARGV[6] clock skew
# tolerance ms; the flush of a state cache (optional; absent or ARGV[7] '0': none): ARGV[7]
# successes counted locally since the last flush (at most the window), ARGV[8] the
# generation they were admitted in (ignored unless it is the stored one and CLOSED),
# ARGV[9] window, ARGV[10] failure threshold, ARGV[11] 'count' or 'rate', ARGV[12] calls a
# rate needs.
# Returns {verdict, generation, wait ms, moved, clean, skew ms, field, now ms, opened ms,
# tripped, failures, calls}: verdict 1 admitted (CLOSED), 2 admitted as a probe (HALF_OPEN;
# also when ARGV[1] already holds a permit), 0 refused (OPEN), -1 refused (HALF_OPEN, every
# permit taken), -2 refused (forced open by an operator); wait: ms until the earliest moment
# a call may pass; moved 1 when this call moved the breaker OPEN -> HALF_OPEN; clean 1 when
# CLOSED with no failure in the window (a success then changes nothing a count threshold
# sees, and the caller need not record it). skew and field ('' none): an ``opened_ms``
# ahead of now by more than the tolerance (written by a clock that ran ahead, then a
# failover to a primary whose clock is behind) counts from now, a probe permit expiring
# later than its lifetime from now expires then (field ``probes``); both written back, the
# largest skew returned. now: Redis TIME (0 when not read: CLOSED or forced, no flush trip);
# opened: ``opened_ms`` as the admission counted it (0 unless OPEN); tripped 1 when the
# flushed successes met a rate threshold (the breaker opened: verdict 0), with the window's
# failures and calls then.
# (``append`` is defined only when there is something to flush: a closure costs each call.)
ADMIT = (
    """
local s = redis.call('HMGET', KEYS[1], 'state', 'gen', 'opened_ms', 'forced', 'ring')
local gen = tonumber(s[2]) or 0
if s[4] then return {-2, gen, tonumber(ARGV[2]), 0, 0, 0, '', 0, 0, 0, 0, 0} end
local pending = tonumber(ARGV[7] or '0') or 0
if pending > 0 and (not s[1] or s[1] == 'closed') and tonumber(ARGV[8]) == gen then
"""
    + _APPEND
    + """
  local size = tonumber(ARGV[9])
  local opened, fails, calls, at = append(s[5] or '', string.rep('0', math.min(pending, size)),
                                          gen, size, tonumber(ARGV[10]), ARGV[11],
                                          tonumber(ARGV[12]), ARGV[5])
  if opened then
    return {0, gen + 1, tonumber(ARGV[2]), 0, 0, 0, '', at, at, 1, fails, calls}
  end
  s = redis.call('HMGET', KEYS[1], 'state', 'gen', 'opened_ms', 'forced', 'ring')
end
if not s[1] or s[1] == 'closed' then
  if not s[5] or not string.find(s[5], '1', 1, true) then
    return {1, gen, 0, 0, 1, 0, '', 0, 0, 0, 0, 0}
  end
  return {1, gen, 0, 0, 0, 0, '', 0, 0, 0, 0, 0}
end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local moved = 0
local tol = tonumber(ARGV[6])
local skew, skewed = 0, ''
if s[1] == 'open' then
  local opened = tonumber(s[3]) or 0
  if opened > now + tol then
    skew, skewed = opened - now, 'opened_ms'
    opened = now
    redis.call('HSET', KEYS[1], 'opened_ms', now)
  end
  local left = opened + tonumber(ARGV[2]) - now
  if left > 0 then return {0, gen, left, 0, 0, skew, skewed, now, opened, 0, 0, 0} end
  gen = gen + 1
  redis.call('HSET', KEYS[1], 'state', 'half_open', 'gen', gen, 'successes', 0)
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  redis.call('DEL', KEYS[2])
  moved = 1
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local horizon = now + tonumber(ARGV[4])
local late = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. (horizon + tol), '+inf', 'WITHSCORES')
for i = 1, #late, 2 do
  if tonumber(late[i + 1]) - horizon > skew then
    skew, skewed = tonumber(late[i + 1]) - horizon, 'probes'
  end
  redis.call('ZADD', KEYS[2], horizon, late[i])
end
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  return {2, gen, 0, moved, 0, skew, skewed, now, 0, 0, 0, 0}
end
if redis.call('ZCARD', KEYS[2]) < tonumber(ARGV[3]) then
  redis.call('ZADD', KEYS[2], horizon, ARGV[1])
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
  return {2, gen, 0, moved, 0, skew, skewed, now, 0, 0, 0, 0}
end
local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
return {-1, gen, math.max(1, tonumber(first[2]) - now), moved, 0, skew, skewed, now, 0, 0, 0, 0}
"""
)

# KEYS[1] the breaker hash, KEYS[2] the probe permits.
# ARGV[1] outcome: '1' a failure, '0' a success, 'n' neither (the call did not reach the
# dependency: its probe permit, if any, is given back); ARGV[2] the generation the call was
# admitted in; ARGV[3] its probe owner token ('' not a probe); ARGV[4] window (calls);
# ARGV[5] failure threshold (a count, or a rate in (0, 1] with ARGV[6] 'rate');
# ARGV[6] 'count' or 'rate'; ARGV[7] calls the window must hold before a rate trips;
# ARGV[8] successful probes that close it; ARGV[9] idle TTL ms; ARGV[10] (optional, default
# 0) successes of the same generation a state cache counted before this outcome, written
# ahead of it (CLOSED only; at most the window).
# Returns {state, changed (1: this outcome changed the state), failures in the window (or
# successful probes when HALF_OPEN), calls in the window, generation after, now ms (the
# Redis TIME it opened at; 0 otherwise)}. Outcomes of another generation, of a forced
# breaker, or while OPEN change nothing.
RECORD = (
    _APPEND
    + """
local s = redis.call('HMGET', KEYS[1], 'state', 'gen', 'ring', 'forced')
local state = s[1] or 'closed'
local gen = tonumber(s[2]) or 0
if s[4] or tonumber(ARGV[2]) ~= gen or state == 'open' then return {state, 0, 0, 0, gen, 0} end
local function trip(next_gen)
  local t = redis.call('TIME')
  local now = t[1] * 1000 + math.floor(t[2] / 1000)
  redis.call('HSET', KEYS[1], 'state', 'open', 'gen', next_gen, 'opened_ms', now, 'ring', '',
             'successes', 0)
  redis.call('PEXPIRE', KEYS[1], ARGV[9])
  redis.call('DEL', KEYS[2])
  return now
end
if state == 'closed' then
  if ARGV[1] == 'n' then return {state, 0, 0, 0, gen, 0} end
  local size = tonumber(ARGV[4])
  local before = math.min(tonumber(ARGV[10] or '0') or 0, size)
  local opened, fails, calls, at = append(s[3] or '', string.rep('0', before) .. ARGV[1], gen,
                                          size, tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7]),
                                          ARGV[9])
  if opened then return {'open', 1, fails, calls, gen + 1, at} end
  return {state, 0, fails, calls, gen, 0}
end
if ARGV[3] == '' or redis.call('ZREM', KEYS[2], ARGV[3]) == 0 then
  return {state, 0, 0, 0, gen, 0}
end
if ARGV[1] == 'n' then return {state, 0, 0, 0, gen, 0} end
if ARGV[1] == '1' then
  return {'open', 1, 1, 1, gen + 1, trip(gen + 1)}
end
local n = redis.call('HINCRBY', KEYS[1], 'successes', 1)
if n >= tonumber(ARGV[8]) then
  redis.call('HSET', KEYS[1], 'state', 'closed', 'gen', gen + 1, 'ring', '', 'successes', 0)
  redis.call('PEXPIRE', KEYS[1], ARGV[9])
  redis.call('DEL', KEYS[2])
  return {'closed', 1, n, 0, gen + 1, 0}
end
return {state, 0, n, 0, gen, 0}
"""
)

# KEYS[1] the breaker hash, KEYS[2] the probe permits.
# ARGV[1] 'open' (forced open until closed: no TTL) or 'close' (CLOSED, window emptied),
# ARGV[2] idle TTL ms.
# Returns {state before, forced before ('' none), new generation}.
OVERRIDE = """
local s = redis.call('HMGET', KEYS[1], 'state', 'gen', 'forced')
local gen = (tonumber(s[2]) or 0) + 1
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('DEL', KEYS[2])
if ARGV[1] == 'open' then
  redis.call('HSET', KEYS[1], 'state', 'open', 'gen', gen, 'opened_ms', now, 'forced', 'open',
             'ring', '', 'successes', 0)
  redis.call('PERSIST', KEYS[1])
else
  redis.call('HDEL', KEYS[1], 'forced')
  redis.call('HSET', KEYS[1], 'state', 'closed', 'gen', gen, 'ring', '', 'successes', 0)
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return {s[1] or 'closed', s[3] or '', gen}
"""

# KEYS[1] the breaker hash, KEYS[2] the probe permits. ARGV (optional: none, or ARGV[1]
# '0'): the flush of a state cache first, as ADMIT's ARGV[7..12] and idle TTL: ARGV[1]
# successes counted, ARGV[2] their generation, ARGV[3] window, ARGV[4] failure threshold,
# ARGV[5] 'count' or 'rate', ARGV[6] calls a rate needs, ARGV[7] idle TTL ms.
# Returns {state, generation, opened_ms, ring, successes, forced, now_ms, live probe count,
# tripped (1: the flushed successes met a rate threshold), failures, calls (then)}.
READ = (
    """
local pending = tonumber(ARGV[1] or '0') or 0
local tripped, fails, calls = 0, 0, 0
if pending > 0 then
"""
    + _APPEND
    + """
  local f = redis.call('HMGET', KEYS[1], 'state', 'gen', 'ring', 'forced')
  local gen = tonumber(f[2]) or 0
  if not f[4] and (not f[1] or f[1] == 'closed') and tonumber(ARGV[2]) == gen then
    local size = tonumber(ARGV[3])
    local opened
    opened, fails, calls = append(f[3] or '', string.rep('0', math.min(pending, size)), gen,
                                  size, tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6]), ARGV[7])
    if opened then tripped = 1 end
  end
end
local s = redis.call('HMGET', KEYS[1], 'state', 'gen', 'opened_ms', 'ring', 'successes', 'forced')
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local probes = redis.call('ZCOUNT', KEYS[2], '(' .. now, '+inf')
return {s[1] or 'closed', s[2] or '0', s[3] or '', s[4] or '', s[5] or '0', s[6] or '',
        tostring(now), probes, tripped, fails, calls}
"""
)
