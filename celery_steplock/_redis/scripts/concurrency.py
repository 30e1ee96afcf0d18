"""The concurrency limit's Lua scripts, each with its KEYS/ARGV/returns contract.

A slot is an ordinary lease hash (the fields of :mod:`celery_steplock._redis.scripts.lease`),
granted by the same :data:`~celery_steplock._redis.scripts.fragments.FENCE` and
:data:`~celery_steplock._redis.scripts.fragments.GRANT` as a lease; its renewal and release
are the lease scripts'. The keys are laid out by :func:`celery_steplock.keys.slot_key` and
:func:`celery_steplock.keys.concurrency_keys`.
"""

from __future__ import annotations

from .fragments import FENCE, GRANT

__all__ = ["ACQUIRE_SLOT", "LEAVE_QUEUE"]

# KEYS[1..n] the slot leases (n = the limit), KEYS[n+1] the fencing counter, KEYS[n+2] the
# waiters' queue (score: first-denied ms), KEYS[n+3] the waiters' liveness (score: expiry ms).
# ARGV[1] owner token, ARGV[2] slot TTL ms, ARGV[3] fencing counter period ms, ARGV[4] the
# caller's waiter ticket ('' : the caller does not come back, it never waits), ARGV[5]
# waiter entry TTL ms, ARGV[6] the slot's metadata JSON, ARGV[7] clock skew tolerance ms.
# Returns {1, slot index (0-based), fencing token, skew ms} when granted (or already held by
# ARGV[1]: only its TTL is reset), else {0, free slots, waiters, the caller's rank among
# them (-1: none), smallest remaining TTL ms of the held slots (-1: none held), skew ms}.
# skew: waiters stored by a clock that ran ahead (a failover to a primary whose clock is
# behind): a first-denied time ahead of now by more than the tolerance counts from now, a
# liveness past now + waiter TTL expires then (written back; the largest skew). A refused
# caller with a ticket is queued (first denial) and its entry's expiry pushed back; a
# granted one leaves the queue. Fencing token: max(counter + 1, Redis time in us); unlike a
# lease's, the counter's TTL is reset to two periods at every grant (refresh_counter).
ACQUIRE_SLOT = (
    """
local n = #KEYS - 3
local counter, queue, alive = KEYS[n + 1], KEYS[n + 2], KEYS[n + 3]
local t = redis.call('TIME')
local now_ms = t[1] * 1000 + math.floor(t[2] / 1000)
local tol = tonumber(ARGV[7])
local skew = 0
local horizon = now_ms + tonumber(ARGV[5])
local late = redis.call('ZRANGEBYSCORE', alive, '(' .. (horizon + tol), '+inf', 'WITHSCORES')
for i = 1, #late, 2 do
  skew = math.max(skew, tonumber(late[i + 1]) - horizon)
  redis.call('ZADD', alive, horizon, late[i])
end
local early = redis.call('ZRANGEBYSCORE', queue, '(' .. (now_ms + tol), '+inf', 'WITHSCORES')
for i = 1, #early, 2 do
  skew = math.max(skew, tonumber(early[i + 1]) - now_ms)
  redis.call('ZADD', queue, now_ms, early[i])
end
local first_free = nil
local free = 0
local min_pttl = -1
for i = 1, n do
  local holder = redis.call('HGET', KEYS[i], 'owner')
  if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[2])
    return {1, i - 1, tonumber(redis.call('HGET', KEYS[i], 'fence')), skew}
  elseif holder then
    local left = redis.call('PTTL', KEYS[i])
    if min_pttl < 0 or left < min_pttl then min_pttl = left end
  else
    free = free + 1
    if not first_free then first_free = i end
  end
end
local gone = redis.call('ZRANGEBYSCORE', alive, '-inf', now_ms, 'LIMIT', 0, 100)
if #gone > 0 then
  redis.call('ZREM', queue, unpack(gone))
  redis.call('ZREM', alive, unpack(gone))
end
local waiting = redis.call('ZCARD', queue)
local rank = nil
if ARGV[4] ~= '' then rank = redis.call('ZRANK', queue, ARGV[4]) end
local granted = false
if free > 0 then
  if rank then granted = rank < free else granted = waiting < free end
end
if not granted then
  if ARGV[4] ~= '' then
    local wttl = tonumber(ARGV[5])
    if not rank then
      redis.call('ZADD', queue, now_ms, ARGV[4])
      rank = waiting
      waiting = waiting + 1
    end
    redis.call('ZADD', alive, now_ms + wttl, ARGV[4])
    redis.call('PEXPIRE', queue, wttl * 2)
    redis.call('PEXPIRE', alive, wttl * 2)
  end
  return {0, free, waiting, rank or -1, min_pttl, skew}
end
if rank then
  redis.call('ZREM', queue, ARGV[4])
  redis.call('ZREM', alive, ARGV[4])
end
local lease, owner, ttl_ms, period_ms, meta = KEYS[first_free], ARGV[1], ARGV[2], ARGV[3], ARGV[6]
local refresh_counter = true
"""
    + FENCE
    + GRANT
    + """
return {1, first_free - 1, fence, skew}
"""
)

# KEYS[1] the waiters' queue, KEYS[2] their liveness. ARGV[1] the ticket. Returns the
# number of entries removed (a waiter that gave up leaves the queue at once).
LEAVE_QUEUE = """
redis.call('ZREM', KEYS[2], ARGV[1])
return redis.call('ZREM', KEYS[1], ARGV[1])
"""
