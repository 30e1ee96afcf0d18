"""The lease store's Lua scripts, each with its KEYS/ARGV/returns contract.

A lease is the hash ``<prefix>:lease:{<name>}`` with a TTL. Its fields:

``owner``        the owner token of the holder
``fence``        the fencing token granted with it
``acquired_ms``  Redis server time of the grant, ms
``renewed_ms``   Redis server time of the last grant or renewal, ms (the reaper's compare)
``ttl_ms``       the TTL last set, ms
``meta``         the holder's static metadata (task id and name, hostname, pid, retries,
                 worker, step, renewal interval) as one JSON object of strings, written once
                 per grant and unpacked by the readers (one field costs Redis less than eight);
                 absent when the holder gave none (the readers take a missing or empty
                 ``meta`` alike: one field less costs Redis less)

Leases written by earlier versions hold the metadata as fields of their own; the readers
accept both.

A name's history (:mod:`celery_steplock.history`) is the list ``<prefix>:history:{<name>}``,
in the lease's slot, newest entry first: each entry one string, its fields in a fixed order
joined by the unit separator (U+001F, which no owner token can hold): Redis time in ms,
event, owner token, fence, task id, outcome, refused acquires, holder's owner token, who
released it, reason (:data:`HISTORY_FIELDS`). A list, not a stream: a stream's first node
preallocates its listpack (about 4.4 KB a name on Redis 7.0, measured), a list of two
entries about 500 bytes, and most names (one a step) see one execution or two. The
history's writes go through ``redis.pcall``: a key of another type, or a user whose ACL
lacks ``LPUSH``, leaves the history unwritten, never the lease refused.

Scripts get numbers as decimal strings and hand Redis preformatted strings where a value is
larger than Lua's ``%.14g`` shows exactly (microsecond times). Times are spliced from the
strings of ``TIME`` (seconds, then the microseconds zero-padded) rather than computed: on
Redis 7.0 each string-to-number conversion (``strtod``) or ``string.format`` in a script
costs about as much as a command (callgrind: ~1,700 and ~2,000 instructions, a ``HGET`` of
a missing key ~3,200 with the script call's own overhead), and the grant runs at every
acquire. A granted acquire returns a bare integer (a re-grant the stored string): a table
reply costs Redis more to build than the rest of a release.
"""

from __future__ import annotations

from .fragments import FENCE, GRANT, WAKE_ONE


def _history_push(key: str, cap: str, age: str, entry: str) -> str:
    """Lua appending the entry ``entry`` (a Lua expression giving the string) to the history
    list ``key``: LPUSH, LTRIM only once over the cap ``cap`` (an ARGV, the length cap as a
    decimal string), PEXPIRE to ``age`` (an ARGV, ms); each through ``redis.pcall``."""
    return f"""
local n = redis.pcall('LPUSH', {key}, {entry})
if type(n) == 'number' then
  if n > tonumber({cap}) then redis.pcall('LTRIM', {key}, 0, {cap} - 1) end
  redis.pcall('PEXPIRE', {key}, {age})
end
"""


#: The fields of a history entry, in their order in the entry's string.
HISTORY_FIELDS = (
    "ms",
    "event",
    "owner",
    "fence",
    "task_id",
    "outcome",
    "contended",
    "holder",
    "by",
    "reason",
)

__all__ = [
    "HISTORY_FIELDS",
    "ACQUIRE",
    "RELEASE",
    "FORGET_WAITER",
    "REAP",
    "EXTEND",
    "EXTEND_MANY",
    "EXTEND_CHUNK",
    "OWNED",
    "SCAN_FIELDS",
    "PROBE",
    "HISTORY_ADD",
    "HISTORY_READ",
]

#: Leases renewed per EXTEND_MANY call: bounds how long one call blocks Redis.
EXTEND_CHUNK = 1000

# Redis checks a script's commands against the user's ACL one by one as they run and does
# not roll back the ones already run: a command refused halfway leaves the earlier writes.
# PROBE runs every command of the scripts below, with pcall, on the keys of one reserved
# name, before a store's first write; so a Redis user lacking a command or key pattern is
# told so (naming each) before any lease script can stop halfway. Should a permission be
# revoked later, the writes come in an order where a refusal leaves nothing a reader relies
# on: ACQUIRE advances the fencing counter (it only ever grows: an advance without a grant is
# harmless) and drops the caller's waiter entry before it writes the lease; RELEASE and REAP
# wake a waiter (who finds the lease held and waits again, if the delete is then refused)
# before they delete the lease, so a refused release leaves the lease as it was. The one
# write a refusal can leave half-done is the lease's PEXPIRE after its HSET; PEXPIRE ran on
# the fencing counter before it unless the grant falls in the counter's current period.

# KEYS[1] lease hash, KEYS[2] fencing counter, KEYS[3] (only when the caller waits) the
# waiters' sorted set, and last (only when the history is on) the name's history list.
# ARGV[1] owner token, ARGV[2] lease TTL ms, ARGV[3] fencing counter period ms (fence_ttl),
# ARGV[4] ms the caller waits at most (with KEYS[3]), ARGV[5] static metadata JSON ('' none);
# with the history on (absent or '': off) ARGV[6] its length cap, ARGV[7] its max age ms,
# ARGV[8] the caller's task id ('' none).
# Returns the fencing token: as an integer when this call granted the lease, as its decimal
# string (the stored field, unconverted) when ARGV[1] already held it (a re-grant: only the
# TTL is reset); else the table {holder's owner token, holder's remaining TTL ms}. A refused
# waiter is added to KEYS[3] (scored by its deadline), a granted one removed. The reply's
# type tells a cancelled asyncio caller's cleanup whether the grant is its own to release
# (celery_steplock.lock._fresh_grant); the readers take both as the token.
#
# With the history on, a grant appends an "acquired" entry; a refusal counts itself in the
# lease's ``contended`` field and the first refusal of a grant appends a "contended" entry
# (so retries and waiters add one entry a holder, not one an attempt).
#
# The grant is fragments.FENCE and fragments.GRANT (shared with a concurrency slot's grant):
# fencing token max(counter + 1, Redis time in us); the counter's TTL is reset only when it is
# new, when the grant is the first of a new period, or when the clock lagged behind it, so an
# idle name's counter lives at least one period after its last grant and at most two.
ACQUIRE = (
    """
local hist = ARGV[6] and ARGV[6] ~= '' and KEYS[#KEYS]
local waiters = KEYS[3]
if waiters == hist then waiters = nil end
local holder = redis.call('HGET', KEYS[1], 'owner')
if holder then
  if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return redis.call('HGET', KEYS[1], 'fence')
  end
  if hist and redis.pcall('HINCRBY', KEYS[1], 'contended', 1) == 1 then
    local c = redis.call('TIME')
    local entry = c[1] .. string.sub('00000' .. c[2], -6, -4) .. '\\31contended\\31' .. ARGV[1]
      .. '\\31' .. (redis.call('HGET', KEYS[1], 'fence') or '') .. '\\31' .. ARGV[8]
      .. '\\31\\31\\31' .. holder
"""
    + _history_push("hist", "ARGV[6]", "ARGV[7]", "entry")
    + """
  end
  if waiters then
    local t = redis.call('TIME')
    local now_ms = t[1] * 1000 + math.floor(t[2] / 1000)
    local wait_ms = tonumber(ARGV[4])
    redis.call('ZREMRANGEBYSCORE', waiters, '-inf', now_ms)
    redis.call('ZADD', waiters, now_ms + wait_ms, ARGV[1])
    if redis.call('PTTL', waiters) < wait_ms then redis.call('PEXPIRE', waiters, wait_ms) end
  end
  return {holder, redis.call('PTTL', KEYS[1])}
end
local t = redis.call('TIME')
local lease, counter, owner, ttl_ms, period_ms, meta =
  KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[5]
local refresh_counter = false
"""
    + FENCE
    + """
if waiters then redis.call('ZREM', waiters, ARGV[1]) end
"""
    + GRANT
    + """
if hist then
  local entry = now_s .. '\\31acquired\\31' .. owner .. '\\31' .. fence_s .. '\\31' .. ARGV[8]
"""
    + _history_push("hist", "ARGV[6]", "ARGV[7]", "entry")
    + """
end
return fence
"""
)

# The then-branch of a compare-and-delete (RELEASE, REAP): wake one waiter, delete the lease
# (KEYS[1]), return 1; else return 0.
_DELETE_WAKING = (
    WAKE_ONE
    + """
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""
)

# KEYS[1] lease hash, KEYS[2] waiters' sorted set, KEYS[3] wake-up list, KEYS[4] (only when
# the history is on) the name's history list. ARGV[1] owner token; with KEYS[4]: ARGV[2]
# the history's length cap, ARGV[3] its max age ms, ARGV[4] the execution's outcome ('' none),
# ARGV[5] the holder's task id ('' none), ARGV[6] the event ("released", or "forced" for an
# operator's force release), ARGV[7] who released it ('' the holder).
# Returns 1 if the lease was deleted, 0 if it is absent or another owner's.
# A deletion wakes one waiter when anyone waits: the wake-up list keeps at most one element,
# which the waiter blocked longest in BLPOP takes. With KEYS[4], a deletion appends an entry
# with the lease's fence and its count of refused acquires (``contended``).
RELEASE = (
    """
local f = redis.call('HMGET', KEYS[1], 'owner', 'fence', 'contended')
if f[1] == ARGV[1] then
  if KEYS[4] then
    local t = redis.call('TIME')
    local entry = t[1] .. string.sub('00000' .. t[2], -6, -4) .. '\\31' .. ARGV[6] .. '\\31'
      .. ARGV[1] .. '\\31' .. (f[2] or '') .. '\\31' .. ARGV[5] .. '\\31' .. ARGV[4] .. '\\31'
      .. (f[3] or '0') .. '\\31\\31' .. ARGV[7]
"""
    + _history_push("KEYS[4]", "ARGV[2]", "ARGV[3]", "entry")
    + """
  end
"""
    + _DELETE_WAKING
)

# KEYS as RELEASE. ARGV[1] the owner token of a waiter that gave up (a cancelled asyncio
# acquire). Drops its waiter entry; then, when the lease is free and someone still waits,
# wakes one (WAKE_ONE, pushing ARGV[1]): the wake-up a cancelled BLPOP may have taken with its
# reply unread is passed on, so the others do not sleep until their BLPOP times out. A
# wake-up too many costs a waiter one refused attempt. Returns nothing.
FORGET_WAITER = (
    """
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then
"""
    + WAKE_ONE
    + """
end
"""
)

# KEYS as RELEASE. ARGV[1] owner token, ARGV[2] renewed_ms observed; with KEYS[4] (the
# history on) ARGV[3] the history's length cap, ARGV[4] its max age ms.
# Returns 1 if deleted (and wakes one waiter, as RELEASE), 0 otherwise. Deletes only if the
# owner AND the last renewal are still what was observed: the reaper's delete, which must
# spare a holder that renewed after it looked. With KEYS[4], a deletion appends a "reaped"
# entry (the task id matched out of ``meta``: a reap is rare, the grant's path stays bare).
REAP = (
    """
local f = redis.call('HMGET', KEYS[1], 'owner', 'renewed_ms', 'fence', 'meta')
if f[1] == ARGV[1] and f[2] == ARGV[2] then
  if KEYS[4] then
    local t = redis.call('TIME')
    local tid = f[4] and string.match(f[4], '"task_id":"([^"]*)"') or ''
    local entry = t[1] .. string.sub('00000' .. t[2], -6, -4) .. '\\31reaped\\31' .. ARGV[1]
      .. '\\31' .. (f[3] or '') .. '\\31' .. tid
"""
    + _history_push("KEYS[4]", "ARGV[3]", "ARGV[4]", "entry")
    + """
  end
"""
    + _DELETE_WAKING
)

# KEYS[1] a name's history list. ARGV[1] the first entry to read (0: the newest), ARGV[2]
# the last. Returns {Redis time's seconds, its microseconds, the key's type, the entries
# newest first (only when the type is 'list')}. A read: runs on a replica.
HISTORY_READ = """
local t = redis.call('TIME')
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'list' then return {t[1], t[2], kind} end
return {t[1], t[2], kind, redis.call('LRANGE', KEYS[1], ARGV[1], ARGV[2])}
"""

# KEYS[1] a name's history list. ARGV[1] its length cap, ARGV[2] its max age ms, ARGV[3] the
# entry less its time (from the event on, HISTORY_FIELDS joined by U+001F). Appends the entry
# with Redis time (the events only a client sees: lost); returns the list's length.
HISTORY_ADD = """
local t = redis.call('TIME')
local entry = t[1] .. string.sub('00000' .. t[2], -6, -4) .. '\\31' .. ARGV[3]
local n = redis.call('LPUSH', KEYS[1], entry)
if n > tonumber(ARGV[1]) then redis.call('LTRIM', KEYS[1], 0, ARGV[1] - 1) end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return n
"""

# KEYS[1] lease hash. ARGV[1] owner token, ARGV[2] new TTL ms.
# Returns 1 if the TTL was reset (and renewed_ms, ttl_ms written), 0 if the key is gone or
# held by another owner.
EXTEND = """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  local t = redis.call('TIME')
  local now_s = t[1] .. string.sub('00000' .. t[2], -6, -4)
  redis.call('HSET', KEYS[1], 'renewed_ms', now_s, 'ttl_ms', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS[1..n] lease hashes; ARGV[2i-1], ARGV[2i] owner token and new TTL ms of KEYS[i].
# EXTEND for each lease in one call (one TIME read for all). Returns a string of n
# characters: '1' where the TTL was reset, '0' where the key is gone or another owner's.
EXTEND_MANY = """
local t = redis.call('TIME')
local now_s = t[1] .. string.sub('00000' .. t[2], -6, -4)
local out = {}
for i = 1, #KEYS do
  local key, ttl = KEYS[i], ARGV[2 * i]
  if redis.call('HGET', key, 'owner') == ARGV[2 * i - 1] then
    redis.call('HSET', key, 'renewed_ms', now_s, 'ttl_ms', ttl)
    redis.call('PEXPIRE', key, ttl)
    out[i] = '1'
  else
    out[i] = '0'
  end
end
return table.concat(out)
"""

# KEYS[1] lease hash. ARGV[1] owner token.
# Returns the remaining TTL ms when held by ARGV[1], -2 when absent, -3 when another owner's.
OWNED = """
local holder = redis.call('HGET', KEYS[1], 'owner')
if not holder then return -2 end
if holder ~= ARGV[1] then return -3 end
return redis.call('PTTL', KEYS[1])
"""

# KEYS: the keys of one SCAN step. Returns, per key, two elements: the lease hash as a JSON
# object and its PTTL; or '' and the key's type when it is gone ('none') or not a hash.
SCAN_FIELDS = """
local out = {}
for i = 1, #KEYS do
  local kind = redis.call('TYPE', KEYS[i])['ok']
  if kind == 'hash' then
    local flat = redis.call('HGETALL', KEYS[i])
    local fields = {}
    for j = 1, #flat, 2 do fields[flat[j]] = flat[j + 1] end
    out[2 * i - 1] = cjson.encode(fields)
    out[2 * i] = redis.call('PTTL', KEYS[i])
  else
    out[2 * i - 1] = ''
    out[2 * i] = kind
  end
end
return out
"""

# KEYS[1..4] lease hash, fencing counter, waiters' sorted set and wake-up list of a name no
# lease uses. Runs every command of the scripts above, and of the patterns' scripts (rate
# limits, bulkhead slots, circuit breaker, idempotency records: the same kinds of keys under
# the same prefix), on them with pcall (each key is given a TTL of 10 s right after it is
# created, and again after the PERSIST, and deleted at the end) and returns the ones the
# ACL refused as a list of 'command key' strings ('command' alone for TIME); empty when all
# ran. Any other error (READONLY, OOM...) is returned as the script's error, as the lease
# scripts would meet it.
PROBE = """
local refused = {}
local other = nil
local acl = {'NOPERM', "can't run", "can't access", 'ACL', 'no permissions', 'No permissions'}
local function try(...)
  if other then return end
  local r = redis.pcall(...)
  if type(r) == 'table' and r.err then
    for _, word in ipairs(acl) do
      if string.find(r.err, word, 1, true) then
        local args = {...}
        refused[#refused + 1] = string.lower(args[1]) .. (args[2] and (' ' .. args[2]) or '')
        return
      end
    end
    other = r.err
  end
end
try('TIME')
local lease, fence, waiters, wake = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
-- The keys are a reserved name's, yet one may exist (a lease of an older version, a key
-- written by hand): then touch none (return 1, the caller probes another name); nor when
-- EXISTS is refused, since nothing then says the keys are free.
for _, key in ipairs(KEYS) do
  local found = redis.pcall('EXISTS', key)
  if type(found) == 'table' then
    try('EXISTS', key)
    if other then return redis.error_reply(other) end
    return refused
  end
  if found == 1 then return 1 end
end
try('HSET', lease, 'probe', '1')
try('PEXPIRE', lease, 10000)
try('HGET', lease, 'owner')
try('HMGET', lease, 'owner', 'renewed_ms')
try('HGETALL', lease)
try('TYPE', lease)
try('PTTL', lease)
try('HINCRBY', lease, 'count', 1)
try('HDEL', lease, 'count')
try('PERSIST', lease)
try('PEXPIRE', lease, 10000)
try('SET', fence, '1', 'PX', 10000)
try('SET', fence, '2', 'KEEPTTL', 'GET')
try('PEXPIRE', fence, 10000)
try('GET', fence)
try('ZADD', waiters, 1, 'probe')
try('PEXPIRE', waiters, 10000)
try('ZREMRANGEBYSCORE', waiters, '-inf', 0)
try('PTTL', waiters)
try('ZSCORE', waiters, 'probe')
try('ZRANK', waiters, 'probe')
try('ZCARD', waiters)
try('ZCOUNT', waiters, '-inf', '+inf')
try('ZRANGE', waiters, 0, 0, 'WITHSCORES')
try('ZRANGEBYSCORE', waiters, '-inf', '+inf', 'LIMIT', 0, 1)
try('ZREM', waiters, 'probe')
try('EXISTS', waiters)
try('RPUSH', wake, 'probe')
try('PEXPIRE', wake, 10000)
try('DEL', lease)
try('DEL', fence)
try('DEL', waiters)
try('DEL', wake)
if other then return redis.error_reply(other) end
return refused
"""
