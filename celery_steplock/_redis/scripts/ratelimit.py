"""The rate limits' Lua scripts, each with its KEYS/ARGV/returns contract.

A limit is three keys with one hash tag (one Cluster slot), laid out by
:func:`celery_steplock.keys.rate_limit_keys`: the state (a token bucket's hash ``tokens``,
``ts``; a sliding window's log, a sorted set of grant ids by Redis time, ms), the ticket
queue and the tickets' deadlines. Times are Redis ``TIME`` in ms, fractional. Numbers go
into Redis as Lua numbers, which Redis writes with every digit (``%.17g``, or the shortest
text that reads back the same); only a number concatenated into a string (an exclusive
range bound) or returned with a fraction is formatted in Lua, with ``%.17g`` (``tostring``
keeps 14 digits).

What a decision costs Redis is kept small, since every request of a limited task pays it:
while no ticket waits the queue costs one ``ZCARD``; a bucket's denial writes nothing (the
state it would write reads back to the same decisions); a window's denial reads one entry of
the log by rank, and only an admission trims the log. The reply is a short array, its now
the ``TIME`` reply's own two strings.
"""

from __future__ import annotations

__all__ = ["TOKEN_BUCKET", "SLIDING_WINDOW", "WINDOW_REFUND", "BUCKET_REFUND"]

# Shared by both scripts: the time, the ticket queue and the reply. KEYS[2] is the queue
# (sorted set: ticket -> the Redis time it was first given, ms), KEYS[3] the tickets'
# deadlines (ticket -> ms). ARGV[8] the clock skew tolerance (ms): a stored time further
# ahead of now than that was written by a clock that ran ahead (a failover to a primary whose
# clock is behind). It is clamped to now (a ticket's deadline moves back as much as its given
# time) and the largest skew is returned with the field it was found in. The queue's clamp,
# its expired tickets' removal and the ticket's rank run only when the queue is not empty
# (an empty queue holds no ticket: the one presented, if any, is gone).
#
# The reply (see each script): {admitted (1 or 0), figure, now, now_us, place in the queue,
# ticket given, skew ms, field}. now/now_us: the TIME reply's seconds and microseconds, or,
# when the decision's time was moved past TIME (a clock that went back: the limit counts
# from its last recorded moment), the time in ms (%.17g) and ''. The reply stops after now_us
# when nothing follows but a place 0 and no ticket (every admission, a denial with no ticket
# ahead and none given), else after the ticket given; all eight when a skew was clamped.
_QUEUE = """
local function num(x) return string.format('%.17g', x) end
local t = redis.call('TIME')
local now = t[1] * 1000 + t[2] / 1000
local shifted = false
local tol = tonumber(ARGV[8])
local skew, skewed = 0, ''
local function ahead(by, field)
  if by > skew then skew = by skewed = field end
end
local ticket = ARGV[3]
local rank = false
local pos = 0
local queued = redis.call('ZCARD', KEYS[2])
if queued > 0 then
  local given_at = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. num(now + tol), '+inf',
                              'WITHSCORES')
  for i = 1, #given_at, 2 do
    local by = tonumber(given_at[i + 1]) - now
    ahead(by, 'tickets')
    redis.call('ZADD', KEYS[2], now, given_at[i])
    local due = tonumber(redis.call('ZSCORE', KEYS[3], given_at[i]))
    if due then redis.call('ZADD', KEYS[3], due - by, given_at[i]) end
  end
  local gone = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
  for i = 1, #gone do queued = queued - redis.call('ZREM', KEYS[2], gone[i]) end
  if #gone > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now) end
  if ticket ~= '' and queued > 0 then rank = redis.call('ZRANK', KEYS[2], ticket) end
  pos = rank or queued
end
local function reply(admit, figure, given)
  local s, us = t[1], t[2]
  if shifted then s, us = num(now), '' end
  if skew > 0 then
    return {admit, figure, s, us, admit == 1 and 0 or pos, given, num(skew), skewed}
  end
  if admit == 1 or (pos == 0 and given == '') then return {admit, figure, s, us} end
  return {admit, figure, s, us, pos, given}
end
local function admitted(left)
  if rank then
    redis.call('ZREM', KEYS[2], ticket)
    redis.call('ZREM', KEYS[3], ticket)
  end
  return reply(1, left, '')
end
local function denied(wait)
  -- wait: ms until the quota of this place in the queue is due
  local given = ''
  if ARGV[5] == '1' and wait <= tonumber(ARGV[6]) then
    given = ticket
    if not rank then
      given = ARGV[4]
      redis.call('ZADD', KEYS[2], now, given)
    end
    redis.call('ZADD', KEYS[3], now + wait + tonumber(ARGV[7]), given)
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
  -- whole microseconds, rounded up: a retry at the figure never comes early
  local us = math.ceil(wait * 1000)
  if us < 0 then us = 0 end
  return reply(0, us, given)
end
"""

#: Token bucket decision.
#: KEYS[1] the bucket (hash: tokens, ts in ms), KEYS[2] the ticket queue, KEYS[3] the
#: tickets' deadlines (same hash tag). ARGV: rate (tokens per ms), capacity, the ticket held
#: ('' none), a new ticket id, reserve ('1' to take a ticket when denied), max wait (ms),
#: ticket grace (ms), clock skew tolerance (ms). Returns {1, tokens left (%.17g), now,
#: now_us} when admitted, else {0, wait (whole us, an integer), now, now_us, place in the
#: queue (integer), ticket given ('' none)}, the last two left off when 0 and ''; both
#: followed by {skew ms, field} (the place 0 and the ticket '' filled in) when a stored time
#: (``ts``, ``tickets``) was clamped; now and now_us as the shared reply above says. A ``ts`` ahead of now by more than the
#: tolerance counts from now: the bucket refills from now, its tokens kept. A stored state no
#: decision writes reads as the nearest one that could be (a field no number or NaN: no
#: bucket; tokens below 0: 0, written back; above the capacity: the capacity). A denial writes
#: nothing unless it clamped ``ts``: the refilled state it would write (and its TTL, the
#: moment it is full again) is what the stored one reads as at any later time.
TOKEN_BUCKET = (
    _QUEUE
    + """
local rate = tonumber(ARGV[1])
local cap = tonumber(ARGV[2])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1])
local ts = tonumber(state[2])
local write = false
-- what no decision writes is not trusted: a field that is no number (or NaN) reads as no
-- bucket; tokens below zero as none left (written back: a denial that writes nothing would
-- keep them, and a wait from them overflows the integer reply), above the capacity as full
if tokens == nil or ts == nil or tokens ~= tokens or ts ~= ts then
  tokens = cap ts = now
elseif tokens < 0 then
  tokens = 0
  write = true
elseif tokens > cap then
  tokens = cap -- a capacity lowered since (or inf): what a refill would leave
end
if ts > now + tol then
  ahead(ts - now, 'ts')
  ts = now
  write = true
end
if now > ts then
  tokens = math.min(cap, tokens + (now - ts) * rate)
  ts = now
end
-- a clock that went back (a failover to a primary behind) never refills twice
if ts > now then
  now = ts
  shifted = true
end
local admit = tokens >= pos + 1
if admit then tokens = tokens - 1 end
if admit or write then
  redis.call('HSET', KEYS[1], 'tokens', tokens, 'ts', ts)
  -- idle until full, then the bucket is as good as absent
  redis.call('PEXPIRE', KEYS[1], math.ceil((cap - tokens) / rate) + 1000)
end
if admit then return admitted(num(tokens)) end
return denied((pos + 1 - tokens) / rate)
"""
)

#: Sliding window (exact log) decision.
#: KEYS[1] the log (sorted set: grant id -> Redis time of the grant, ms), KEYS[2] the ticket
#: queue, KEYS[3] the tickets' deadlines (same hash tag). ARGV: limit, window (ms), the
#: ticket held ('' none), a new id (the grant's log member, or the new ticket), reserve,
#: max wait (ms), ticket grace (ms), clock skew tolerance (ms). Returns {1, grants left
#: (integer), now, now_us} when admitted, else {0, wait (whole us), now, now_us, place in
#: the queue, ticket given}, shortened and followed by {skew ms, field} as
#: :data:`TOKEN_BUCKET`'s (field ``log`` or ``tickets``). A grant at ``g`` counts in every
#: window (g - window, g]; a denial writes nothing to the log. Grants ahead of now by more
#: than the tolerance (field ``log``) count as granted now: each for one window from now.
#:
#: With ``pos`` tickets ahead, this place's quota is held exactly when the log's
#: ``(limit - pos)``-th latest grant is inside the window: then it is denied on that one
#: entry (read by rank, O(log n)), and that grant's expiry is when the quota frees. Anything
#: else (an admission, a grant that ran ahead of the clock, more tickets ahead than the
#: limit) takes the whole path: the latest grant (a clock that ran ahead is clamped, one that
#: went back counts from it), the trim of the log to the window and the count (a log shorter
#: than that rank is only counted: it holds at most ``limit`` entries untrimmed).
SLIDING_WINDOW = (
    _QUEUE
    + """
local limit = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local k = limit - pos
-- short: the log holds fewer than k <= limit grants, so this place is free, and the log
-- needs no trim to stay within limit + 1 entries
local short = false
if k >= 1 then
  local kth = redis.call('ZRANGE', KEYS[1], -k, -k, 'WITHSCORES')
  local g = tonumber(kth[2])
  if g and g > now - window and g <= now + tol then return denied(g + window - now) end
  short = g == nil
end
-- a clock that went back (a failover to a primary behind) counts from the last grant
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if last[2] and tonumber(last[2]) > now + tol then
  ahead(tonumber(last[2]) - now, 'log')
  local future = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. num(now), '+inf')
  for i = 1, #future do redis.call('ZADD', KEYS[1], now, future[i]) end
  last[2] = nil
end
if last[2] and tonumber(last[2]) > now then
  now = tonumber(last[2])
  shifted = true
end
local n
if short then
  n = redis.call('ZCOUNT', KEYS[1], '(' .. num(now - window), '+inf')
else
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
  n = redis.call('ZCARD', KEYS[1])
end
local free = limit - n
if free > pos then
  redis.call('ZADD', KEYS[1], now, ARGV[4])
  redis.call('PEXPIRE', KEYS[1], math.ceil(window) + 1000)
  return admitted(free - 1)
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
