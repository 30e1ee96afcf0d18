"""The idempotency records' Lua scripts, each with its KEYS/ARGV/returns contract.

A record is the hash ``<prefix>:idem:{<record key>}`` (one key: one slot on Cluster) with a
TTL. Its fields:

``status``        ``locked`` / ``completed`` / ``failed``
``fp``            the fingerprint of the call's arguments (HMAC, hex)
``owner``         the owner token of the execution holding it (``locked`` only)
``ns``, ``ver``   namespace and policy version (for operators; the key already binds them)
``result``        the recorded result as the serializer returned it (``completed`` only)
``ser``, ``ctype``, ``cenc``, ``b64``
                  serializer name, content type and encoding; ``b64`` "1" when ``result`` is
                  the base64 of a binary payload
``error``         the error type of the last failed execution (``failed`` only)
``created_ms``, ``locked_ms``, ``completed_ms``, ``failed_ms``, ``expires_ms``
                  Redis server times (``TIME``), ms
``attempts``      how many executions locked it

A field that does not apply to the status is the empty string (the scripts never use HDEL:
the least-privilege ACL of docs/acl.md does not grant it). Times come from Redis ``TIME``
inside the scripts, never from the workers' clocks; they are built as decimal strings
(seconds and the zero-padded milliseconds) so that no float formatting can round them.
"""

from __future__ import annotations

__all__ = ["BEGIN", "COMPLETE", "FAIL", "RELEASE", "EXTEND", "CACHE"]

_NOW = """
local t = redis.call('TIME')
local now = t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))
local function plus(ms) return string.format('%.0f', tonumber(now) + tonumber(ms)) end
"""

# KEYS[1] the record. ARGV: owner token, fingerprint, lock TTL ms, namespace, version.
# Returns one of
#   {"locked", created_ms, now_ms}                     the caller holds it now (new, failed
#                                                      before, or expired)
#   {"replay", result, ser, ctype, cenc, b64, created_ms, completed_ms, expires_ms}
#   {"reused", status}                                  locked/completed with another fingerprint
#   {"in_progress", pttl_ms}                            locked by another owner, same arguments
# A failed record is locked again whatever its fingerprint: nothing was recorded to replay.
BEGIN = (
    _NOW
    + """
local r = redis.call('HMGET', KEYS[1], 'status', 'fp', 'owner', 'result', 'ser', 'ctype',
                     'cenc', 'b64', 'created_ms', 'completed_ms', 'expires_ms', 'attempts')
local status = r[1]
if status == 'completed' or status == 'locked' then
  if r[2] ~= ARGV[2] then return {'reused', status} end
  if status == 'completed' then
    return {'replay', r[4] or '', r[5] or '', r[6] or '', r[7] or '', r[8] or '0',
            r[9] or '', r[10] or '', r[11] or ''}
  end
  if r[3] ~= ARGV[1] then
    return {'in_progress', tostring(redis.call('PTTL', KEYS[1]))}
  end
end
local created = r[9] or now
if status ~= 'failed' and status ~= 'locked' then created = now end
redis.call('HSET', KEYS[1], 'status', 'locked', 'fp', ARGV[2], 'owner', ARGV[1],
           'ns', ARGV[4], 'ver', ARGV[5], 'created_ms', created, 'locked_ms', now,
           'expires_ms', plus(ARGV[3]), 'attempts', tostring((tonumber(r[12]) or 0) + 1))
redis.call('HSET', KEYS[1], 'result', '', 'ser', '', 'ctype', '', 'cenc', '', 'b64', '0',
           'completed_ms', '', 'failed_ms', '', 'error', '')
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {'locked', created, now}
"""
)

# KEYS[1] the record. ARGV: owner, fingerprint, result, ser, ctype, cenc, b64, TTL ms,
# namespace, version. Records the completion when the caller still holds the record, or when
# the record is gone (its lock expired and nobody took it since: the body did run).
# Returns {1, completed_ms, expires_ms} recorded (2 instead of 1: recreated), {0, status}
# when another execution holds or completed it (nothing written).
COMPLETE = (
    _NOW
    + """
local r = redis.call('HMGET', KEYS[1], 'status', 'owner', 'created_ms', 'attempts')
local code = 1
if r[1] then
  if not (r[1] == 'locked' and r[2] == ARGV[1]) then return {0, r[1]} end
else
  code = 2
end
local expires = plus(ARGV[8])
redis.call('HSET', KEYS[1], 'status', 'completed', 'fp', ARGV[2], 'result', ARGV[3],
           'ser', ARGV[4], 'ctype', ARGV[5], 'cenc', ARGV[6], 'b64', ARGV[7],
           'ns', ARGV[9], 'ver', ARGV[10], 'created_ms', r[3] or now, 'completed_ms', now,
           'expires_ms', expires, 'attempts', r[4] or '1')
redis.call('HSET', KEYS[1], 'owner', '', 'error', '', 'failed_ms', '')
redis.call('PEXPIRE', KEYS[1], ARGV[8])
return {code, now, expires}
"""
)

# KEYS[1] the record. ARGV: owner, error type, TTL ms. The caller's locked record becomes
# failed (kept for operators, TTL ms; a failed record is locked again by the next call).
# Returns 1 when marked, 0 when the caller no longer holds it.
FAIL = (
    _NOW
    + """
local r = redis.call('HMGET', KEYS[1], 'status', 'owner')
if not (r[1] == 'locked' and r[2] == ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'status', 'failed', 'error', ARGV[2], 'failed_ms', now,
           'expires_ms', plus(ARGV[3]))
redis.call('HSET', KEYS[1], 'owner', '')
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""
)

# KEYS[1] the record. ARGV: owner. Deletes the caller's locked record (the body never ran).
# Returns 1 when deleted, 0 when the caller no longer holds it.
RELEASE = """
local r = redis.call('HMGET', KEYS[1], 'status', 'owner')
if not (r[1] == 'locked' and r[2] == ARGV[1]) then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""

# KEYS[1] the record. ARGV: owner, lock TTL ms. The heartbeat's renewal of a running body's
# record: the caller's locked record lives another lock TTL from now (``expires_ms`` and the
# key's TTL). Returns 1 when extended, 0 (nothing written) when the caller no longer holds it:
# completed, failed, invalidated, expired, or locked by another owner.
EXTEND = (
    _NOW
    + """
local r = redis.call('HMGET', KEYS[1], 'status', 'owner')
if not (r[1] == 'locked' and r[2] == ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'expires_ms', plus(ARGV[2]))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
)

# KEYS[1] the cache copy of a completed database record. ARGV: TTL ms, then field/value pairs.
# Replaces the copy (HSET of every field, PEXPIRE) in one step. Returns 1.
CACHE = """
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""
