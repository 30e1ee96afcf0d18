"""Lua shared by more than one script, spliced in by string composition.

A fragment is not a script: it runs inside the script it is spliced into, reads the Lua
locals its contract names (the including script declares them first) and declares the
locals it says it defines. Two scripts that grant a lease (the lease store's
:data:`~celery_steplock._redis.scripts.lease.ACQUIRE` and a concurrency slot's
:data:`~celery_steplock._redis.scripts.concurrency.ACQUIRE_SLOT`) include :data:`FENCE` and
:data:`GRANT`, so a lease is granted by one text whichever holds it.
"""

from __future__ import annotations

__all__ = ["FENCE", "GRANT", "WAKE_ONE"]

# Advances a fencing counter and gives the fencing token: max(counter + 1, Redis time in us).
# Reads the locals t (the reply of TIME: two decimal strings), counter (the counter's key),
# period_ms (the counter's period, ms, a decimal string: fence_ttl, or the lease TTL when
# longer) and refresh_counter. Defines the locals fence (the token, a number), fence_s (the
# same as a decimal string) and now_s (Redis time, ms, a decimal string: the time's token
# less its last three digits, taken before any counter + 1).
# The strings are spliced from TIME's two strings (the microseconds zero-padded to six
# digits) rather than computed: in a script, a string turned into a number (strtod) or a
# number into a string (sprintf) costs Redis about as much as a command, and this runs at
# every grant. Numbers stay below 2^53 (exact in a Lua double).
# The counter is written with KEEPTTL (setting its TTL costs Redis about as much as the
# write) and given a TTL of two periods when it is new, when the grant is the first of a new
# period, when the clock lagged behind it, or at every grant when refresh_counter is true:
# so an idle counter lives at least one period after its last grant (two with
# refresh_counter; less the clock's lag, if it went back) and at most two.
FENCE = """
local fence_s = t[1] .. string.sub('00000' .. t[2], -6)
local now_s = string.sub(fence_s, 1, -4)
local fence = tonumber(fence_s)
local prev = redis.call('SET', counter, fence_s, 'KEEPTTL', 'GET')
if prev then prev = tonumber(prev) end
if prev and prev >= fence then
  fence = prev + 1
  fence_s = string.format('%d', fence)
  redis.call('SET', counter, fence_s, 'PX', period_ms * 2)
elseif refresh_counter or not prev or prev < fence - fence % (period_ms * 1000) then
  redis.call('PEXPIRE', counter, period_ms * 2)
end
"""

# Writes a granted lease: the hash's fields of a grant (see scripts/lease.py) and its TTL.
# Reads the locals t (the reply of TIME), lease (the lease hash's key), owner (the owner
# token), ttl_ms (the lease TTL, ms, a decimal string), meta (the static metadata JSON, ''
# none: then the hash has no meta field, which the readers take as none), fence_s and now_s
# (from FENCE: the token, and the grant's Redis time in ms for acquired_ms and renewed_ms).
GRANT = """
if meta == '' then
  redis.call('HSET', lease, 'owner', owner, 'fence', fence_s, 'acquired_ms', now_s,
             'renewed_ms', now_s, 'ttl_ms', ttl_ms)
else
  redis.call('HSET', lease, 'owner', owner, 'fence', fence_s, 'acquired_ms', now_s,
             'renewed_ms', now_s, 'ttl_ms', ttl_ms, 'meta', meta)
end
redis.call('PEXPIRE', lease, ttl_ms)
"""

# Wakes one waiter of a lease being deleted, when anyone waits: KEYS[2] the waiters' sorted
# set, KEYS[3] the wake-up list, ARGV[1] the value pushed (the releasing owner's token). The
# list keeps at most one element, which the waiter blocked longest in BLPOP takes; it lives
# 60 s.
WAKE_ONE = """
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('DEL', KEYS[3])
  redis.call('RPUSH', KEYS[3], ARGV[1])
  redis.call('PEXPIRE', KEYS[3], 60000)
end
"""
