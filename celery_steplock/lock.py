"""Owner-keyed Redis leases with fencing tokens.

A lease is a Redis hash ``<prefix>:lease:{<name>}`` with a TTL, holding the owner token of one
execution attempt and who that is (task id and name, hostname, pid, retries, acquisition and
renewal times in Redis server milliseconds). Acquire, release, extend and the ownership check
are each one Lua script, so no client can interleave between reading the owner and acting on
it (redis-py's ``Lock`` does the same for release and extend; a GET-then-DEL does not).

Every grant returns a **fencing token** (Kleppmann, "How to do distributed locking", 2016)
that strictly increases per name: ``max(previous + 1, Redis server time in microseconds)``.
The previous value lives in ``<prefix>:fence:{<name>}`` (TTL ``fence_ttl``, refreshed on
every grant), and the time floor keeps the sequence increasing when that counter expired or
was lost in a failover, as long as the Redis clock moves forward. The token orders holders; it is not a mutex, and the
database compare-and-swap (:mod:`celery_steplock.guard`) is what refuses a stale commit.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.retry import Retry

from .conf import Settings
from .exceptions import LockError, LockLost, LockStoreUnavailable
from .keys import fence_key, lease_key, name_from_key, wake_key, waiters_key

__all__ = ["Lease", "RedisStepLock", "new_owner_token", "make_client", "get_lease_store",
           "CLOCK_DRIFT_FACTOR"]

#: Share of the TTL held back from the local validity for clock drift (as in Redlock).
CLOCK_DRIFT_FACTOR = 0.01

# KEYS[1] lease hash, KEYS[2] fencing counter, KEYS[3] (when waiting) the waiters' sorted set.
# ARGV[1] owner token, ARGV[2] ttl ms, ARGV[3] fencing counter ttl ms, ARGV[4] ms the owner
# waits at most (with KEYS[3]), ARGV[5..] metadata field/value pairs stored beside the owner.
# Returns {1, fence, ttl_ms} when granted (or already held by this owner), else
# {0, holder owner token, holder's remaining ttl ms}; a refused waiter is added to KEYS[3]
# (scored by its deadline), a granted one removed from it.
ACQUIRE_LUA = """
local holder = redis.call('HGET', KEYS[1], 'owner')
if holder then
  if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {1, tonumber(redis.call('HGET', KEYS[1], 'fence')), tonumber(ARGV[2])}
  end
  if KEYS[3] then
    local t = redis.call('TIME')
    local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local wait_ms = tonumber(ARGV[4])
    redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_ms)
    redis.call('ZADD', KEYS[3], now_ms + wait_ms, ARGV[1])
    if redis.call('PTTL', KEYS[3]) < wait_ms then redis.call('PEXPIRE', KEYS[3], wait_ms) end
  end
  return {0, holder, redis.call('PTTL', KEYS[1])}
end
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local fence = tonumber(redis.call('GET', KEYS[2]) or '0') + 1
if now_us > fence then fence = now_us end
local fence_s = string.format('%d', fence)
local now_s = string.format('%d', math.floor(now_us / 1000))
redis.call('SET', KEYS[2], fence_s, 'PX', ARGV[3])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'fence', fence_s, 'acquired_ms', now_s,
           'renewed_ms', now_s, 'ttl_ms', ARGV[2], unpack(ARGV, 5))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if KEYS[3] then redis.call('ZREM', KEYS[3], ARGV[1]) end
return {1, fence, tonumber(ARGV[2])}
"""

# A deleted lease wakes one waiter, if any (RELEASE and REAP): KEYS[2] waiters' sorted set,
# KEYS[3] wake-up list, ARGV[1] owner token. The list keeps at most one element: the waiter
# blocked longest in BLPOP takes it, so a release wakes one waiter, not all.
_WAKE_ONE_LUA = """
  if redis.call('EXISTS', KEYS[2]) == 1 then
    redis.call('DEL', KEYS[3])
    redis.call('RPUSH', KEYS[3], ARGV[1])
    redis.call('PEXPIRE', KEYS[3], 60000)
  end
"""

# KEYS[1] lease hash, KEYS[2] waiters' sorted set, KEYS[3] wake-up list. ARGV[1] owner token,
# ARGV[2] release channel. Returns 1 if deleted, 0 if not the owner/absent. A deletion is
# announced on ARGV[2] and by one wake-up (_WAKE_ONE_LUA).
RELEASE_LUA = """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], ARGV[1])""" + _WAKE_ONE_LUA + """  return 1
end
return 0
"""

# KEYS and wake-up as RELEASE_LUA; ARGV[1] owner token, ARGV[2] renewed_ms observed, ARGV[3]
# channel. Deletes only if the owner AND the last renewal are still what was observed: the
# reaper's delete, which must spare a holder that renewed after it looked. 1 if deleted.
REAP_LUA = """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1]
   and redis.call('HGET', KEYS[1], 'renewed_ms') == ARGV[2] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[3], ARGV[1])""" + _WAKE_ONE_LUA + """  return 1
end
return 0
"""

# KEYS[1] lease hash. ARGV[1] owner token, ARGV[2] new ttl ms.
# Returns 1 if the TTL was reset, 0 if the key is gone or held by another owner.
EXTEND_LUA = """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  local t = redis.call('TIME')
  local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('HSET', KEYS[1], 'renewed_ms', string.format('%d', now_ms), 'ttl_ms', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS[1..n] lease hashes; ARGV[2i-1], ARGV[2i] owner token and new ttl ms of KEYS[i].
# EXTEND_LUA for each lease in one call (one TIME read for all). Returns a string of n
# characters, '1' where the TTL was reset, '0' where the key is gone or another owner's.
EXTEND_MANY_LUA = """
local t = redis.call('TIME')
local now_s = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
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

#: Leases renewed per EXTEND_MANY_LUA call: bounds how long one call blocks Redis.
EXTEND_CHUNK = 1000

# KEYS[1] lease hash. ARGV[1] owner token.
# Returns the remaining ttl ms when held by ARGV[1], -2 when absent, -3 when another owner.
OWNED_LUA = """
local holder = redis.call('HGET', KEYS[1], 'owner')
if not holder then return -2 end
if holder ~= ARGV[1] then return -3 end
return redis.call('PTTL', KEYS[1])
"""

# KEYS: the keys of one SCAN step. Returns, per key, the lease hash as a JSON object and its
# PTTL; '' and the key's type instead when it is gone ('none') or not a hash.
SCAN_FIELDS_LUA = """
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

STORE_ERRORS = (RedisError, OSError)

logger = logging.getLogger("celery_steplock")


def new_owner_token() -> str:
    """A fresh owner token: 32 random hex digits, unique per execution attempt."""
    return uuid.uuid4().hex


def make_client(url: str, socket_timeout: float = 5.0) -> redis.Redis:
    """A redis-py client for the lock store: ``socket_timeout`` seconds per attempt and one
    quick retry, so a hung Redis costs at most about twice the timeout per call.

    Retrying is safe because every script is idempotent for one owner token.
    """
    return redis.Redis.from_url(
        url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.2), 1),
        decode_responses=True, encoding_errors="replace")


def _pack(*parts: list[str]) -> bytes:
    """One command in RESP, from string arguments (redis-py's encoder costs several times
    more per argument, which counts when a renewal call carries thousands)."""
    count = sum(len(part) for part in parts)
    out = [f"*{count}\r\n"]
    for part in parts:
        for arg in part:
            out.append(f"${len(arg) if arg.isascii() else len(arg.encode())}\r\n{arg}\r\n")
    return "".join(out).encode()


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(eq=False)
class Lease:
    """One granted lease, as seen by its holder.

    ``ttl`` is in seconds. ``valid_until`` is a :func:`time.monotonic` deadline: the time the
    acquire (or last successful renewal) was *sent* plus the TTL less a drift allowance, so the
    holder stops trusting the lease before Redis can expire it. ``lost`` turns true when that
    deadline passes, when a renewal finds the key gone or owned by someone else, or when
    ``max_hold_until`` passes; it never turns back.
    """

    name: str
    key: str
    owner: str
    fence: int
    ttl: float
    acquired_at: float
    valid_until: float
    task_id: str | None = None
    task_name: str | None = None
    max_hold_until: float | None = None
    lost_reason: str | None = None
    _lost: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def lost(self) -> bool:
        """True once the lease can no longer be trusted (see the class docstring)."""
        if not self._lost.is_set():
            now = time.monotonic()
            if self.max_hold_until is not None and now >= self.max_hold_until:
                self.mark_lost("max hold reached: renewal stopped")
            elif now >= self.valid_until:
                self.mark_lost("local validity ran out without a successful renewal")
        return self._lost.is_set()

    def mark_lost(self, reason: str) -> bool:
        """Flag the lease lost; returns False if it already was."""
        if self._lost.is_set():
            return False
        self.lost_reason = reason
        self._lost.set()
        return True

    def renewed(self, sent_at: float, ttl: float | None = None) -> None:
        """Record a successful renewal sent at monotonic time ``sent_at``."""
        if ttl is not None:
            self.ttl = ttl
        self.valid_until = sent_at + self.ttl - drift(self.ttl)

    def remaining(self) -> float:
        """Seconds of local validity left (0.0 when lost)."""
        return 0.0 if self.lost else max(0.0, self.valid_until - time.monotonic())

    def check(self) -> None:
        """Raise :class:`LockLost` if the lease is lost; call it between units of work."""
        if self.lost:
            raise LockLost(f"lease {self.key} (owner {self.owner}, fence {self.fence}) is "
                           f"lost: {self.lost_reason}", key=self.key, owner=self.owner,
                           fence=self.fence)

    @property
    def idempotency_key(self) -> str:
        """``"<task name>:<lock name>"``: a key for effects outside the database (HTTP,
        e-mail, payments) that is the same for every attempt of this task on this step:
        retries, redeliveries and duplicates alike, so a system that deduplicates on it
        performs the effect once. Where that system can refuse stale writers, pass it
        ``fence`` too (Kleppmann 2016): it increases with every grant."""
        return f"{self.task_name}:{self.name}" if self.task_name else self.name


def drift(ttl: float) -> float:
    """Seconds of a ``ttl`` held back for clock drift and the acquire round trip."""
    return ttl * CLOCK_DRIFT_FACTOR + 0.002


class RedisStepLock:
    """Acquire, extend, release and inspect owner-keyed leases in one Redis.

    ``client`` is a ``redis.Redis`` (see :func:`make_client`); ``prefix`` namespaces the keys;
    ``fence_ttl`` (seconds, default 7 days) is how long an idle name's fencing counter is kept.
    Every method raises :class:`LockStoreUnavailable` when Redis cannot be reached.
    """

    def __init__(self, client: redis.Redis, prefix: str = "steplock",
                 fence_ttl: float = 7 * 24 * 3600.0):
        self.client = client
        self.prefix = prefix
        self.fence_ttl = fence_ttl
        self._acquire = client.register_script(ACQUIRE_LUA)
        self._release = client.register_script(RELEASE_LUA)
        self._reap = client.register_script(REAP_LUA)
        self._extend = client.register_script(EXTEND_LUA)
        self._extend_many = client.register_script(EXTEND_MANY_LUA)
        self._scan_fields = client.register_script(SCAN_FIELDS_LUA)
        self._owned = client.register_script(OWNED_LUA)

    def key(self, name: str) -> str:
        return lease_key(self.prefix, name)

    def _call(self, script, keys: list[str], args: list[Any], what: str, name: str):
        try:
            return self._evalsha(script, keys, [a if isinstance(a, str) else str(a)
                                                for a in args])
        except ResponseError as exc:
            # Redis answered and refused (e.g. WRONGTYPE: something else wrote our key): not
            # an outage, so never a reason to retry or to run fail-open.
            raise LockError(f"lock store refused the {what} of {name!r}: {exc}",
                            key=self.key(name)) from exc
        except STORE_ERRORS as exc:
            raise LockStoreUnavailable(f"lock store unavailable during {what} of {name!r}: "
                                       f"{exc}", key=self.key(name)) from exc

    def _evalsha(self, script, keys: list[str], args: list[str]) -> Any:
        """One ``EVALSHA``, on a connection of the client's pool with its retry policy, the
        command encoded by :func:`_pack` (a lock cycle is two of these: what redis-py adds
        around a command is most of the client's cost)."""
        pool = self.client.connection_pool
        conn = pool.get_connection()
        try:
            def send() -> Any:
                conn.send_packed_command(
                    [_pack(["EVALSHA", script.sha, str(len(keys))], keys, args)])
                return conn.read_response()

            def fail(_error: Exception) -> None:
                conn.disconnect()

            try:
                return conn.retry.call_with_retry(send, fail)
            except NoScriptError:
                script.sha = self.client.script_load(script.script)
                return conn.retry.call_with_retry(send, fail)
        except ResponseError:
            raise
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    def try_acquire(self, name: str, owner: str, ttl: float,
                    metadata: Mapping[str, Any] | None = None, *, wait: float = 0.0
                    ) -> tuple[Lease | None, str | None, float | None]:
        """One acquire attempt. Returns ``(lease, None, None)`` when granted, else
        ``(None, holder_owner, holder_ttl_seconds)``. With ``wait`` (seconds) a refused owner
        is recorded as waiting that long, so that the next release wakes a waiter."""
        ttl_ms = max(1, int(ttl * 1000))
        args: list[Any] = [owner, ttl_ms, max(ttl_ms, int(self.fence_ttl * 1000)),
                           max(1, int(wait * 1000)) if wait > 0 else 0]
        if metadata:
            for field_name, value in metadata.items():
                args += [field_name, "" if value is None else str(value)]
        keys = [self.key(name), fence_key(self.prefix, name)]
        if wait > 0:
            keys.append(waiters_key(self.prefix, name))
        sent = time.monotonic()
        granted, value, ttl_left = self._call(self._acquire, keys, args, "acquire", name)
        if not granted:
            return None, _text(value), (ttl_left / 1000.0 if ttl_left and ttl_left > 0 else None)
        meta = metadata or {}
        return Lease(name=name, key=keys[0], owner=owner, fence=int(value), ttl=ttl,
                     acquired_at=sent, valid_until=sent + ttl - drift(ttl),
                     task_id=meta.get("task_id"), task_name=meta.get("task_name")), None, None

    def channel(self, name: str) -> str:
        """Pub/sub channel on which a release of ``name`` is announced."""
        return f"{self.prefix}:released:{{{name}}}"

    def acquire(self, name: str, owner: str | None = None, ttl: float = 30.0, *,
                wait: float = 0.0, metadata: Mapping[str, Any] | None = None) -> Lease | None:
        """Acquire the lease ``name`` for ``owner`` (a fresh token when None) for ``ttl``
        seconds. Returns the :class:`Lease`, or None when another owner holds it and ``wait``
        seconds (default 0: one attempt) passed without it being released or expiring.
        ``metadata`` (task_id, task_name, hostname, pid, ...) is stored beside the owner.

        A waiter does not poll: a refused attempt records it as waiting (in the same script),
        and it blocks on the name's wake-up list (``BLPOP``). A release pushes one wake-up
        when anyone waits, which the waiter blocked longest takes, so a release wakes one
        waiter rather than all of them. A waiter also retries when the holder's TTL runs out
        (a dead holder announces nothing).
        """
        owner = owner or new_owner_token()
        if wait <= 0:
            return self.try_acquire(name, owner, ttl, metadata)[0]
        deadline = time.monotonic() + wait
        wake = wake_key(self.prefix, name)
        # BLPOP must return before the socket times out (a timeout would be retried).
        cap = self.client.connection_pool.connection_kwargs.get("socket_timeout")
        lease = None
        try:
            while True:
                left = deadline - time.monotonic()
                lease, _holder, holder_ttl = self.try_acquire(name, owner, ttl, metadata,
                                                              wait=max(left, 0.001))
                if lease is not None or left <= 0:
                    return lease
                timeout = min(left, holder_ttl) if holder_ttl else min(left, 0.01)
                if cap:
                    timeout = min(timeout, cap * 0.8)
                try:
                    self.client.blpop([wake], timeout=max(round(timeout, 3), 0.001))
                except STORE_ERRORS as exc:
                    raise LockStoreUnavailable(f"lock store unavailable while waiting for "
                                               f"{name!r}: {exc}", key=self.key(name)) from exc
        finally:
            if lease is None:
                try:
                    self.client.zrem(waiters_key(self.prefix, name), owner)
                except STORE_ERRORS:
                    pass  # the entry expires with its deadline

    def _wake_keys(self, name: str) -> list[str]:
        return [self.key(name), waiters_key(self.prefix, name), wake_key(self.prefix, name)]

    def release(self, name: str, owner: str) -> bool:
        """Delete the lease if ``owner`` holds it, and wake a waiter. Returns False (and
        changes nothing) when the key is gone or another owner holds it; so releasing twice
        is harmless."""
        return bool(self._call(self._release, self._wake_keys(name),
                               [owner, self.channel(name)], "release", name))

    def reap(self, name: str, owner: str, renewed_ms: str) -> bool:
        """Delete the lease only if ``owner`` still holds it and its ``renewed_ms`` field is
        still ``renewed_ms`` (as read before deciding its holder is dead), and wake a
        waiter. Returns False, changing nothing, when it was renewed, released or
        re-acquired since."""
        return bool(self._call(self._reap, self._wake_keys(name),
                               [owner, str(renewed_ms), self.channel(name)], "reap", name))

    def reap_many(self, items: Iterable[tuple[str, str, str]]) -> list[bool | LockError]:
        """:meth:`reap` for many leases ``(name, owner, renewed_ms)`` in one pipelined round
        trip. Returns, per item, whether it was deleted, or the :class:`LockError` of an item
        Redis refused. Raises LockStoreUnavailable when the round trip fails."""
        items = list(items)
        if not items:
            return []
        calls = [(self._wake_keys(name), [owner, str(renewed_ms), self.channel(name)])
                 for name, owner, renewed_ms in items]
        try:
            replies = self._eval_calls(self._reap, calls)
        except STORE_ERRORS as exc:
            raise LockStoreUnavailable(f"lock store unavailable during reap: {exc}") from exc
        return [LockError(f"lock store refused the reap of {item[0]!r}: {reply}",
                          key=self.key(item[0])) if isinstance(reply, Exception)
                else bool(reply) for item, reply in zip(items, replies)]

    def extend(self, name: str, owner: str, ttl: float) -> bool:
        """Reset the lease's TTL to ``ttl`` seconds if ``owner`` holds it. Returns False (and
        changes nothing) when the key is gone or another owner holds it."""
        return bool(self._call(self._extend, [self.key(name)], [owner, max(1, int(ttl * 1000))],
                               "extend", name))

    def owned(self, name: str, owner: str) -> float | None:
        """Seconds left on the lease if ``owner`` holds it, else None. One round trip."""
        result = self._call(self._owned, [self.key(name)], [owner], "ownership check", name)
        return result / 1000.0 if result is not None and result >= 0 else None

    def extend_many(self, items: Iterable[tuple[str, str, float]],
                    chunk: int = EXTEND_CHUNK) -> list[bool]:
        """Extend many leases ``(name, owner, ttl seconds)`` in one pipelined round trip.

        The leases go ``chunk`` at a time to one script call each, every call written to
        one connection before any reply is read (Redis runs the first call while the next
        is encoded), so Redis is never blocked for long by one call. Returns one bool per
        item, as :meth:`extend`. Raises LockStoreUnavailable when the round trip fails or
        Redis refuses a call.
        """
        prefix = f"{self.prefix}:lease:{{"

        def calls() -> Iterator[tuple[list[str], list[str]]]:
            keys: list[str] = []
            argv: list[str] = []
            for name, owner, ttl in items:
                keys.append(f"{prefix}{name}}}")
                argv.append(owner)
                argv.append(str(max(1, int(ttl * 1000))))
                if len(keys) >= chunk:
                    yield keys, argv
                    keys, argv = [], []
            if keys:
                yield keys, argv

        try:
            replies = self._eval_calls(self._extend_many, calls())
        except STORE_ERRORS as exc:
            raise LockStoreUnavailable(f"lock store unavailable during renewal: {exc}") from exc
        results: list[bool] = []
        for reply in replies:
            if isinstance(reply, Exception):
                raise LockStoreUnavailable(f"lock store refused a renewal: {reply}")
            results.extend([c == "1" for c in _text(reply)])
        return results

    def _eval_calls(self, script, calls: Iterable[tuple[list[str], list[str]]]) -> list[Any]:
        """:meth:`_evalsha_calls`, loading the script again if Redis lost it."""
        sent: list[tuple[list[str], list[str]]] = []
        replies = self._evalsha_calls(script, calls, sent)
        if any(isinstance(r, NoScriptError) for r in replies):
            script.sha = self.client.script_load(script.script)
            replies = self._evalsha_calls(script, sent, [])
        return replies

    def _evalsha_calls(self, script, calls: Iterable[tuple[list[str], list[str]]],
                       sent: list[tuple[list[str], list[str]]]) -> list[Any]:
        """Send ``EVALSHA script keys argv`` for each call on one connection as ``calls``
        yields it (appended to ``sent``), then read every reply (an error reply is returned
        as its exception, not raised)."""
        pool = self.client.connection_pool
        conn = pool.get_connection()
        try:
            for keys, argv in calls:
                conn.send_packed_command(
                    [_pack(["EVALSHA", script.sha, str(len(keys))], keys, argv)])
                sent.append((keys, argv))
            replies: list[Any] = []
            for _ in sent:
                try:
                    replies.append(conn.read_response())
                except ResponseError as exc:
                    replies.append(exc)
            return replies
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    def scan(self, cursor: int = 0, count: int = 500, match: str = "*"
             ) -> tuple[int, list[dict[str, Any]]]:
        """One ``SCAN`` step over the lease keys whose name matches the glob ``match``.

        Returns ``(next_cursor, leases)``: ``next_cursor`` is 0 when the scan is complete;
        each lease is a dict as :meth:`inspect` returns (the step's fields read by one
        script call, each hash as one JSON string: parsing thousands of small RESP replies
        in Python cost more than the scan itself). ``count`` is SCAN's hint of keys examined
        per step, not a page size; a step can return fewer or more leases. Never ``KEYS``:
        memory stays flat however many leases Redis holds.
        """
        pattern = lease_key(self.prefix, match)
        try:
            cursor, keys = self.client.scan(cursor=cursor, match=pattern, count=count)
            if not keys:
                return int(cursor), []
            keys = [_text(key) for key in keys]
            [replies] = self._eval_calls(self._scan_fields, [(keys, [])])
        except STORE_ERRORS as exc:
            raise LockStoreUnavailable(f"lock store unavailable during scan: {exc}") from exc
        if isinstance(replies, Exception):
            raise LockStoreUnavailable(f"lock store refused the scan: {replies}")
        leases = []
        for key, doc, pttl in zip(keys, replies[::2], replies[1::2]):
            doc = _text(doc)
            if not doc:
                if _text(pttl) != "none":
                    # A key under our prefix that is not a lease: skip it, so one stray key
                    # cannot blind the admin, `ls` and the reaper.
                    logger.warning("event=scan_skipped key=%s error=WRONGTYPE a %s, not a "
                                   "lease hash", key, _text(pttl))
                continue  # else expired between SCAN and the read
            info = json.loads(doc)
            if not info:
                continue
            info["key"] = key
            info["name"] = name_from_key(key)
            info["ttl"] = pttl / 1000.0 if pttl and pttl > 0 else None
            leases.append(info)
        return int(cursor), leases

    def iter_leases(self, match: str = "*", count: int = 1000) -> Iterator[dict[str, Any]]:
        """Every held lease matching ``match``, as :meth:`scan` returns them (a lease that is
        acquired or released during the iteration may or may not be seen, as with SCAN)."""
        cursor = 0
        while True:
            cursor, leases = self.scan(cursor, count, match)
            yield from leases
            if cursor == 0:
                return

    def inspect(self, name: str) -> dict[str, Any] | None:
        """The lease's stored fields plus ``ttl`` (seconds left), or None when not held."""
        key = self.key(name)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.hgetall(key)
            pipe.pttl(key)
            fields, pttl = pipe.execute()
        except STORE_ERRORS as exc:
            raise LockStoreUnavailable(f"lock store unavailable during inspect of {name!r}: "
                                       f"{exc}", key=key) from exc
        if not fields:
            return None
        info = {_text(k): _text(v) for k, v in fields.items()}
        info["name"] = name
        info["key"] = key
        info["ttl"] = pttl / 1000.0 if pttl and pttl > 0 else None
        return info


def holder_metadata(task_id: str | None = None, task_name: str | None = None,
                    retries: int | None = None, **extra: Any) -> dict[str, Any]:
    """The metadata stored beside an owner token: who holds the lease, for people and for
    the reaper (``worker`` is the Celery node name, e.g. ``celery@host``; ``step`` is
    ``"<app_label>.<model>:<pk>"`` of the step the lease guards; ``renew_ms`` the holder's
    renewal interval in milliseconds)."""
    meta = {"task_id": task_id, "task_name": task_name, "hostname": socket.gethostname(),
            "pid": os.getpid(), "retries": retries}
    meta.update(extra)
    return {k: v for k, v in meta.items() if v is not None}


_stores: dict[tuple, RedisStepLock] = {}
_stores_guard = threading.Lock()


def get_lease_store(app, settings: Settings | None = None) -> RedisStepLock:
    """The lease store for ``app``'s settings (``steplock_redis_url``, ``steplock_socket_timeout``,
    ``steplock_key_prefix``, ``steplock_fence_ttl``), one per distinct configuration and shared
    by every task, heartbeat and operator tool of the process.

    Raises ImproperlyConfigured naming the setting when one of them is invalid.
    """
    settings = settings or Settings(app)
    ident = (settings.redis_url, settings.socket_timeout, settings.key_prefix,
             settings.fence_ttl)
    store = _stores.get(ident)
    if store is None:
        with _stores_guard:
            store = _stores.get(ident)
            if store is None:
                store = RedisStepLock(make_client(ident[0], ident[1]), prefix=ident[2],
                                      fence_ttl=ident[3])
                _stores[ident] = store
    return store
