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

from .exceptions import LockError, LockLost, LockStoreUnavailable
from .keys import fence_key, lease_key, name_from_key

__all__ = ["Lease", "RedisStepLock", "new_owner_token", "make_client", "CLOCK_DRIFT_FACTOR"]

#: Share of the TTL held back from the local validity for clock drift (as in Redlock).
CLOCK_DRIFT_FACTOR = 0.01

# KEYS[1] lease hash, KEYS[2] fencing counter.
# ARGV[1] owner token, ARGV[2] ttl ms, ARGV[3] fencing counter ttl ms, ARGV[4..] metadata
# field/value pairs stored beside the owner.
# Returns {1, fence, ttl_ms} when granted (or already held by this owner), else
# {0, holder owner token, holder's remaining ttl ms}.
ACQUIRE_LUA = """
local holder = redis.call('HGET', KEYS[1], 'owner')
if holder then
  if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {1, tonumber(redis.call('HGET', KEYS[1], 'fence')), tonumber(ARGV[2])}
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
           'renewed_ms', now_s, 'ttl_ms', ARGV[2], unpack(ARGV, 4))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, fence, tonumber(ARGV[2])}
"""

# KEYS[1] lease hash. ARGV[1] owner token, ARGV[2] release channel.
# Returns 1 if deleted (and waiters were told on ARGV[2]), 0 if not the owner/absent.
RELEASE_LUA = """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], ARGV[1])
  return 1
end
return 0
"""

# KEYS[1] lease hash. ARGV[1] owner token, ARGV[2] renewed_ms observed, ARGV[3] channel.
# Deletes only if the owner AND the last renewal are still what was observed: the reaper's
# delete, which must spare a holder that renewed after it looked. Returns 1 if deleted.
REAP_LUA = """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1]
   and redis.call('HGET', KEYS[1], 'renewed_ms') == ARGV[2] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[3], ARGV[1])
  return 1
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

# KEYS[1] lease hash. ARGV[1] owner token.
# Returns the remaining ttl ms when held by ARGV[1], -2 when absent, -3 when another owner.
OWNED_LUA = """
local holder = redis.call('HGET', KEYS[1], 'owner')
if not holder then return -2 end
if holder ~= ARGV[1] then return -3 end
return redis.call('PTTL', KEYS[1])
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
        self._owned = client.register_script(OWNED_LUA)

    def key(self, name: str) -> str:
        return lease_key(self.prefix, name)

    def _call(self, script, keys, args, what: str, name: str):
        try:
            return script(keys=keys, args=args)
        except ResponseError as exc:
            # Redis answered and refused (e.g. WRONGTYPE: something else wrote our key): not
            # an outage, so never a reason to retry or to run fail-open.
            raise LockError(f"lock store refused the {what} of {name!r}: {exc}",
                            key=self.key(name)) from exc
        except STORE_ERRORS as exc:
            raise LockStoreUnavailable(f"lock store unavailable during {what} of {name!r}: "
                                       f"{exc}", key=self.key(name)) from exc

    def try_acquire(self, name: str, owner: str, ttl: float,
                    metadata: Mapping[str, Any] | None = None
                    ) -> tuple[Lease | None, str | None, float | None]:
        """One acquire attempt. Returns ``(lease, None, None)`` when granted, else
        ``(None, holder_owner, holder_ttl_seconds)``."""
        ttl_ms = max(1, int(ttl * 1000))
        args: list[Any] = [owner, ttl_ms, max(ttl_ms, int(self.fence_ttl * 1000))]
        for field_name, value in (metadata or {}).items():
            args += [field_name, "" if value is None else str(value)]
        sent = time.monotonic()
        granted, value, ttl_left = self._call(
            self._acquire, [self.key(name), fence_key(self.prefix, name)], args,
            "acquire", name)
        if not granted:
            return None, _text(value), (ttl_left / 1000.0 if ttl_left and ttl_left > 0 else None)
        meta = metadata or {}
        return Lease(name=name, key=self.key(name), owner=owner, fence=int(value), ttl=ttl,
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

        A waiter does not poll: it subscribes to the release channel, so it retries as soon
        as the holder releases, and otherwise when the holder's TTL runs out (a dead holder
        announces nothing).
        """
        owner = owner or new_owner_token()
        lease, _holder, holder_ttl = self.try_acquire(name, owner, ttl, metadata)
        if lease is not None or wait <= 0:
            return lease
        deadline = time.monotonic() + wait
        try:
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            # Subscribe before the next attempt, so a release between them is not missed.
            pubsub.subscribe(self.channel(name))
        except STORE_ERRORS as exc:
            raise LockStoreUnavailable(f"lock store unavailable while waiting for {name!r}: "
                                       f"{exc}", key=self.key(name)) from exc
        try:
            while True:
                lease, _holder, holder_ttl = self.try_acquire(name, owner, ttl, metadata)
                if lease is not None:
                    return lease
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                timeout = min(left, holder_ttl) if holder_ttl else min(left, 0.01)
                try:
                    pubsub.get_message(timeout=max(timeout, 0.001))
                except STORE_ERRORS as exc:
                    raise LockStoreUnavailable(f"lock store unavailable while waiting for "
                                               f"{name!r}: {exc}", key=self.key(name)) from exc
        finally:
            pubsub.close()

    def release(self, name: str, owner: str) -> bool:
        """Delete the lease if ``owner`` holds it, and wake its waiters. Returns False (and
        changes nothing) when the key is gone or another owner holds it; so releasing twice
        is harmless."""
        return bool(self._call(self._release, [self.key(name)], [owner, self.channel(name)],
                               "release", name))

    def reap(self, name: str, owner: str, renewed_ms: str) -> bool:
        """Delete the lease only if ``owner`` still holds it and its ``renewed_ms`` field is
        still ``renewed_ms`` (as read before deciding its holder is dead), and wake its
        waiters. Returns False, changing nothing, when it was renewed, released or
        re-acquired since."""
        return bool(self._call(self._reap, [self.key(name)],
                               [owner, str(renewed_ms), self.channel(name)], "reap", name))

    def extend(self, name: str, owner: str, ttl: float) -> bool:
        """Reset the lease's TTL to ``ttl`` seconds if ``owner`` holds it. Returns False (and
        changes nothing) when the key is gone or another owner holds it."""
        return bool(self._call(self._extend, [self.key(name)], [owner, max(1, int(ttl * 1000))],
                               "extend", name))

    def owned(self, name: str, owner: str) -> float | None:
        """Seconds left on the lease if ``owner`` holds it, else None. One round trip."""
        result = self._call(self._owned, [self.key(name)], [owner], "ownership check", name)
        return result / 1000.0 if result is not None and result >= 0 else None

    def extend_many(self, items: Iterable[tuple[str, str, float]]) -> list[bool]:
        """Extend many leases ``(name, owner, ttl)`` in one pipelined round trip.

        Returns one bool per item, as :meth:`extend`. Raises LockStoreUnavailable when the
        round trip fails as a whole.
        """
        items = list(items)
        if not items:
            return []
        sha = self._extend.sha

        def send() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for name, owner, ttl in items:
                pipe.evalsha(sha, 1, self.key(name), owner, max(1, int(ttl * 1000)))
            return pipe.execute(raise_on_error=False)

        try:
            results = send()
            if any(isinstance(r, NoScriptError) for r in results):
                self._extend.sha = sha = self.client.script_load(EXTEND_LUA)
                results = send()
        except STORE_ERRORS as exc:
            raise LockStoreUnavailable(f"lock store unavailable during renewal: {exc}") from exc
        errors = [r for r in results if isinstance(r, ResponseError)]
        if errors:
            raise LockStoreUnavailable(f"lock store refused a renewal: {errors[0]}")
        return [bool(r) for r in results]

    def scan(self, cursor: int = 0, count: int = 500, match: str = "*"
             ) -> tuple[int, list[dict[str, Any]]]:
        """One ``SCAN`` step over the lease keys whose name matches the glob ``match``.

        Returns ``(next_cursor, leases)``: ``next_cursor`` is 0 when the scan is complete;
        each lease is a dict as :meth:`inspect` returns (fields read in one pipelined round
        trip). ``count`` is SCAN's hint of keys examined per step, not a page size; a step
        can return fewer or more leases. Never ``KEYS``: memory stays flat however many
        leases Redis holds.
        """
        pattern = lease_key(self.prefix, match)
        try:
            cursor, keys = self.client.scan(cursor=cursor, match=pattern, count=count)
            if not keys:
                return int(cursor), []
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.hgetall(key)
                pipe.pttl(key)
            replies = pipe.execute(raise_on_error=False)
        except STORE_ERRORS as exc:
            raise LockStoreUnavailable(f"lock store unavailable during scan: {exc}") from exc
        leases = []
        for key, fields, pttl in zip(keys, replies[::2], replies[1::2]):
            if isinstance(fields, Exception) or isinstance(pttl, Exception):
                # A key under our prefix that is not a lease (WRONGTYPE): skip it, so one
                # stray key cannot blind the admin, `ls` and the reaper.
                logger.warning("event=scan_skipped key=%s error=%s", _text(key),
                               fields if isinstance(fields, Exception) else pttl)
                continue
            if not fields:
                continue  # expired between SCAN and HGETALL
            info = {_text(k): _text(v) for k, v in fields.items()}
            info["key"] = _text(key)
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
