"""The rate limits' Lua scripts, each with its KEYS/ARGV/returns contract.

A limit is three keys with one hash tag (one Cluster slot), laid out by
:func:`celery_steplock.keys.rate_limit_keys`: the state (a token bucket's hash ``tokens``,
``ts``; a sliding window's log, a sorted set of grant ids by Redis time, ms), the ticket
queue and the tickets' deadlines. Times are Redis ``TIME`` in ms, fractional; numbers cross
into Redis and back as ``%.17g`` strings.
"""

from __future__ import annotations

__all__ = ["TOKEN_BUCKET", "SLIDING_WINDOW", "WINDOW_REFUND", "BUCKET_REFUND"]

# Shared by both scripts: the ticket queue. KEYS[2] is the queue (sorted set: ticket -> the
# Redis time it was first given, ms), KEYS[3] the tickets' deadlines (ticket -> ms).
# ARGV[8] the clock skew tolerance (ms): a stored time further ahead of now than that was
# written by a clock that ran ahead (a failover to a primary whose clock is behind). It is
# clamped to now (a ticket's deadline moves back as much as its given time) and the largest
# skew is returned with the field it was found in.
_QUEUE = """
-- numbers cross into Redis and back as text with every digit (tostring keeps 14)
local function num(x) return string.format('%.17g', x) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local tol = tonumber(ARGV[8])
local skew, skewed = 0, ''
local function ahead(by, field)
  if by > skew then skew = by skewed = field end
end
local given_at = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. num(now + tol), '+inf', 'WITHSCORES')
for i = 1, #given_at, 2 do
  local by = tonumber(given_at[i + 1]) - now
  ahead(by, 'tickets')
  redis.call('ZADD', KEYS[2], num(now), given_at[i])
  local due = tonumber(redis.call('ZSCORE', KEYS[3], given_at[i]))
  if due then redis.call('ZADD', KEYS[3], num(due - by), given_at[i]) end
end
local gone = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', num(now))
for i = 1, #gone do redis.call('ZREM', KEYS[2], gone[i]) end
if #gone > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', num(now)) end
local ticket = ARGV[3]
local rank = false
if ticket ~= '' then rank = redis.call('ZRANK', KEYS[2], ticket) end
local pos = rank or redis.call('ZCARD', KEYS[2])
local function admitted()
  if rank then
    redis.call('ZREM', KEYS[2], ticket)
    redis.call('ZREM', KEYS[3], ticket)
  end
end
local function denied(wait)
  -- wait: ms until the quota of this place in the queue is due
  local given = ''
  if ARGV[5] == '1' and wait <= tonumber(ARGV[6]) then
    given = ticket
    if not rank then
      given = ARGV[4]
      redis.call('ZADD', KEYS[2], num(now), given)
    end
    redis.call('ZADD', KEYS[3], num(now + wait + tonumber(ARGV[7])), given)
    local keep = math.ceil(wait + tonumber(ARGV[7])) + 1000
    if redis.call('PTTL', KEYS[2]) < keep then
      redis.call('PEXPIRE', KEYS[2], keep)
      redis.call('PEXPIRE', KEYS[3], keep)
    end
  elseif rank and ARGV[5] == '1' then
    -- its turn is too far now: the place is given up
    redis.call('ZREM', KEYS[2], ticket)
    redis.call('ZREM', KEYS[3], ticket)
  elseif rank then
    given = ticket
  end
  return {0, num(wait), given, num(now), tostring(pos), num(skew), skewed}
end
"""

#: Token bucket decision.
#: KEYS[1] the bucket (hash: tokens, ts in ms), KEYS[2] the ticket queue, KEYS[3] the
#: tickets' deadlines (same hash tag). ARGV: rate (tokens per ms), capacity, the ticket held
#: ('' none), a new ticket id, reserve ('1' to take a ticket when denied), max wait (ms),
#: ticket grace (ms), clock skew tolerance (ms). Returns {1, tokens left, '', now ms, 0, skew
#: ms, field} when admitted, else {0, wait ms, ticket given ('' none), now ms, place in the
#: queue, skew ms, field}; numbers as strings; skew 0 and field '' unless a stored time
#: (``ts``, ``tickets``) was clamped. A ``ts`` ahead of now by more than the tolerance
#: counts from now: the bucket refills from now, its tokens kept.
TOKEN_BUCKET = (
    _QUEUE
    + """
local rate = tonumber(ARGV[1])
local cap = tonumber(ARGV[2])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1])
local ts = tonumber(state[2])
if tokens == nil or ts == nil then tokens = cap ts = now end
if ts > now + tol then
  ahead(ts - now, 'ts')
  ts = now
end
if now > ts then
  tokens = math.min(cap, tokens + (now - ts) * rate)
  ts = now
end
-- a clock that went back (a failover to a primary behind) never refills twice
now = ts
local admit = tokens >= pos + 1
if admit then tokens = tokens - 1 end
redis.call('HSET', KEYS[1], 'tokens', num(tokens), 'ts', num(ts))
-- idle until full, then the bucket is as good as absent
redis.call('PEXPIRE', KEYS[1], math.ceil((cap - tokens) / rate) + 1000)
if admit then
  admitted()
  return {1, num(tokens), '', num(now), '0', num(skew), skewed}
end
return denied((pos + 1 - tokens) / rate)
"""
)

#: Sliding window (exact log) decision.
#: KEYS[1] the log (sorted set: grant id -> Redis time of the grant, ms), KEYS[2] the ticket
#: queue, KEYS[3] the tickets' deadlines (same hash tag). ARGV: limit, window (ms), the
#: ticket held ('' none), a new id (the grant's log member, or the new ticket), reserve,
#: max wait (ms), ticket grace (ms), clock skew tolerance (ms). Returns {1, grants left, '',
#: now ms, 0, skew ms, field} when admitted, else {0, wait ms, ticket given, now ms, place in
#: the queue, skew ms, field}; numbers as strings. A grant at ``g`` counts in every window
#: (g - window, g]; a denial writes nothing to the log. Grants ahead of now by more than the
#: tolerance (field ``log``) count as granted now: each for one window from now.
SLIDING_WINDOW = (
    _QUEUE
    + """
local limit = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
-- a clock that went back (a failover to a primary behind) counts from the last grant
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if last[2] and tonumber(last[2]) > now + tol then
  ahead(tonumber(last[2]) - now, 'log')
  local future = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. num(now), '+inf')
  for i = 1, #future do redis.call('ZADD', KEYS[1], num(now), future[i]) end
  last[2] = nil
end
if last[2] and tonumber(last[2]) > now then now = tonumber(last[2]) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', num(now - window))
local n = redis.call('ZCARD', KEYS[1])
local free = limit - n
if free > pos then
  redis.call('ZADD', KEYS[1], num(now), ARGV[4])
  redis.call('PEXPIRE', KEYS[1], math.ceil(window) + 1000)
  admitted()
  return {1, tostring(free - 1), '', num(now), '0', num(skew), skewed}
end
-- the grant whose expiry frees this place's quota; past the log, whole windows later
local need = pos + 1 - free
local wait
if n == 0 then
  wait = window
else
  local laps = math.floor((need - 1) / n)
  local idx = (need - 1) % n
  local entry = redis.call('ZRANGE', KEYS[1], idx, idx, 'WITHSCORES')
  wait = tonumber(entry[2]) + window * (laps + 1) - now
end
if wait < 0 then wait = 0 end
return denied(wait)
"""
)

#: Give back an unused grant of the sliding window (a later limit of the same task refused).
#: KEYS[1] the log; ARGV[1] the grant's id. Returns the number removed.
WINDOW_REFUND = "return redis.call('ZREM', KEYS[1], ARGV[1])"

#: Give back an unused token of the bucket. KEYS[1] the bucket; ARGV[1] capacity. Returns 1
#: when a token went back, 0 when the bucket is gone (it refilled to full and expired).
BUCKET_REFUND = """
local tokens = tonumber(redis.call('HGET', KEYS[1], 'tokens'))
if tokens == nil then return 0 end
local back = math.min(tonumber(ARGV[1]), tokens + 1)
redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', back))
return 1
"""
