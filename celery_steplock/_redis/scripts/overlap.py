"""The overlap guard's Lua scripts (``overlap="coalesce"``), each with its KEYS/ARGV/returns
contract.

A lock name's follower marker is the string ``<prefix>:overlap:{<name>}``
(:func:`celery_steplock.outcomes.overlap_key`; the lease's hash slot on Cluster): its value is
the task id of the one send waiting to run after the current holder of the lease, its TTL
bounded (the follower refreshes it at each of its retries, so a follower that died frees it
when the TTL runs out). Plain commands (GET, SET, PEXPIRE, DEL): the ACL of docs/acl.md
allows them.
"""

from __future__ import annotations

__all__ = ["CLAIM_FOLLOWER", "CLEAR_FOLLOWER"]

# KEYS[1] the follower marker. ARGV[1] the caller's task id, ARGV[2] the marker's TTL, ms.
# Returns {1, ''} the caller became the follower (the marker was free: SET with PX), {2, id}
# the caller already was the follower (its TTL refreshed), or {0, id} another send (id) is
# the follower: nothing written.
CLAIM_FOLLOWER = """
local v = redis.call('GET', KEYS[1])
if not v then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return {1, ''}
end
if v == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {2, v}
end
return {0, v}
"""

# KEYS[1] the follower marker. ARGV[1] the caller's task id. Deletes the marker when the
# caller is the follower (compare-and-delete: a marker another send took after the caller's
# expired stays). Returns 1 deleted, 0 not the caller's (or gone).
CLEAR_FOLLOWER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
