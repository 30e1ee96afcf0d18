"""The Lua scripts of the HTTP idempotency layer's cap of live records per principal, with
their KEYS/ARGV/returns contracts.

A principal's live records are the sorted set ``<prefix>:idemq:{<principal hash>}``
(:func:`celery_steplock.keys.idempotency_quota_key`; one key: one slot on Cluster): one
member per record key, scored with the Redis server time (ms) at which it stops counting
(its first lock plus the lock TTL and the record TTL; once the record completes, its
completion plus the record TTL: no earlier than the record's own end, even when the
heartbeat kept the record locked past its lock TTL). The set's TTL ends with its last
member. Members are removed with ZREM when a record is released (a refused request, a
streaming response).
"""

from __future__ import annotations

__all__ = ["ADMIT", "COMPLETED"]

# KEYS[1] the principal's set. ARGV: record key, cap (count), hold ms (how long it counts).
# Returns {1, 0} admitted (a new member, or one already counted: its score only grows), or
# {0, wait_ms} refused: the set holds the cap of live members; wait_ms until the oldest ends.
ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local until_ms = now + tonumber(ARGV[3])
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {0, math.max(0, tonumber(first[2]) - now)}
end
if not score or tonumber(score) < until_ms then
  redis.call('ZADD', KEYS[1], string.format('%.0f', until_ms), ARGV[1])
end
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', KEYS[1], string.format('%.0f', math.max(1, tonumber(last[2]) - now)))
return {1, 0}
"""

# KEYS[1] the principal's set. ARGV: record key, record TTL ms. The record completed now: it
# counts until now + TTL (never shorter than it already counted; a member that stopped
# counting meanwhile, its view having run past lock TTL + TTL, counts again: its record
# lives). Returns 1.
COMPLETED = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local until_ms = now + tonumber(ARGV[2])
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) < until_ms then
  redis.call('ZADD', KEYS[1], string.format('%.0f', until_ms), ARGV[1])
end
if redis.call('PTTL', KEYS[1]) < until_ms - now then
  redis.call('PEXPIRE', KEYS[1], string.format('%.0f', math.max(1, until_ms - now)))
end
return 1
"""
