"""The lease store: owner-keyed Redis leases with fencing tokens.

A lease is a Redis hash ``<prefix>:lease:{<name>}`` with a TTL, holding the owner token of one
execution attempt and who that is (task id and name, hostname, pid, retries, acquisition and
renewal times in Redis server milliseconds; see :mod:`celery_steplock._lua` for the fields).
Acquire, release, extend and the ownership check are each one Lua script, so no client can
interleave between reading the owner and acting on it (redis-py's ``Lock`` does the same for
release and extend; a GET-then-DEL does not).

Every grant returns a **fencing token** (Kleppmann, "How to do distributed locking", 2016)
that strictly increases per name: ``max(previous + 1, Redis server time in microseconds)``.
The previous value lives in ``<prefix>:fence:{<name>}``, kept at least ``fence_ttl`` after
the name's last grant, and the time floor keeps the sequence increasing when that counter
expired or was lost in a failover, as long as the Redis clock moves forward. The token orders
holders; it is not a mutex, and the database compare-and-swap (the step store,
:mod:`celery_steplock.steps`) is what refuses a stale commit.

This module keeps re-exporting :class:`~celery_steplock.lease.Lease`, ``new_owner_token``,
``holder_metadata`` and ``CLOCK_DRIFT_FACTOR`` (they live in :mod:`celery_steplock.lease`).
"""
from __future__ import annotations

import json
import logging
import threading
import time
import warnings
from typing import Any, Callable, Iterable, Iterator, Mapping

import redis
from redis.backoff import FullJitterBackoff
from redis.exceptions import RedisError, ResponseError
from redis.retry import Retry

from . import _lua, _wire
from .conf import Settings
from .exceptions import LockError, LockStoreUnavailable
from .keys import fence_key, lease_key, name_from_key, wake_key, waiters_key
from .lease import CLOCK_DRIFT_FACTOR, Lease, drift, holder_metadata, new_owner_token

__all__ = ["Lease", "RedisLeaseStore", "new_owner_token", "holder_metadata",
           "make_client", "get_lease_store", "CLOCK_DRIFT_FACTOR", "STORE_ERRORS"]

#: Leases renewed per EXTEND_MANY call: bounds how long one call blocks Redis.
EXTEND_CHUNK = 1000

#: What redis-py raises when Redis cannot be reached (a refusal is a ``ResponseError``, a
#: subclass of ``RedisError``, told apart where it matters).
STORE_ERRORS = (RedisError, OSError)

logger = logging.getLogger("celery_steplock")


def make_client(url: str, socket_timeout: float = 5.0) -> redis.Redis:
    """A redis-py client for the lock store: ``socket_timeout`` seconds per attempt and one
    quick retry, so a hung Redis costs at most about twice the timeout per call.

    Retrying is safe because every script is idempotent for one owner token.
    """
    return redis.Redis.from_url(
        url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout,
        # The same delays as ExponentialWithJitterBackoff, which needs redis-py 5.3+.
        retry=Retry(FullJitterBackoff(cap=0.2, base=0.05), 1),
        decode_responses=True, encoding_errors="replace")


def pack_metadata(metadata: Mapping[str, Any] | None) -> str:
    """The ``meta`` field of a lease: ``metadata`` as one compact JSON object of strings
    (None becomes ``""``), or ``""`` when there is none."""
    if not metadata:
        return ""
    return _encode_meta({k: "" if v is None else str(v) for k, v in metadata.items()})


_encode_meta = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def unpack_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A lease hash's fields as readers see them: the ``meta`` JSON object spread into
    top-level string fields beside ``owner``, ``fence``, ``acquired_ms``... (a field of the
    hash wins over a metadata entry of the same name). Leases written before ``meta``
    existed hold those fields directly and come out the same."""
    info = {_wire.text(k): _wire.text(v) for k, v in fields.items()}
    meta = info.pop("meta", None)
    if meta:
        try:
            extra = json.loads(meta)
        except ValueError:
            logger.warning("event=lease_meta_unreadable meta=%.200r", meta)
        else:
            if isinstance(extra, dict):
                extra.update(info)
                info = extra
    return info


class RedisLeaseStore:
    """Acquire, extend, release, reap and inspect owner-keyed leases in one Redis.

    ``client`` is a ``redis.Redis`` (see :func:`make_client`); ``prefix`` namespaces the keys;
    ``fence_ttl`` (seconds, default 7 days) is how long an idle name's fencing counter is kept
    at least (at most twice that); ``clock`` (default :func:`time.monotonic`) is the clock of
    the leases' local validity. Every method raises :class:`LockStoreUnavailable` when Redis
    cannot be reached and :class:`LockError` when it refuses a call (e.g. ``WRONGTYPE``: a
    key of ours holds something else); both carry ``name`` (and ``owner``) where one lease is
    concerned.
    """

    def __init__(self, client: redis.Redis, prefix: str = "steplock",
                 fence_ttl: float = 7 * 24 * 3600.0,
                 clock: Callable[[], float] = time.monotonic):
        self.client = client
        self.prefix = prefix
        self.fence_ttl = fence_ttl
        self.clock = clock
        self._acquire = _wire.Script(_lua.ACQUIRE)
        self._release = _wire.Script(_lua.RELEASE)
        self._reap = _wire.Script(_lua.REAP)
        self._extend = _wire.Script(_lua.EXTEND)
        self._extend_many = _wire.Script(_lua.EXTEND_MANY)
        self._scan_fields = _wire.Script(_lua.SCAN_FIELDS)
        self._owned = _wire.Script(_lua.OWNED)

    def key(self, name: str) -> str:
        """The Redis key of the lease ``name``."""
        return lease_key(self.prefix, name)

    def _call(self, script: _wire.Script, keys: list[str], args: list[str], what: str,
              name: str, owner: str | None = None) -> Any:
        try:
            return _wire.evalsha(self.client, script, keys, args)
        except ResponseError as exc:
            # Redis answered and refused (e.g. WRONGTYPE: something else wrote our key): not
            # an outage, so never a reason to retry or to run fail-open.
            raise LockError(f"lock store refused the {what} of {name!r}: {exc}",
                            key=keys[0], name=name, owner=owner) from exc
        except STORE_ERRORS as exc:
            raise LockStoreUnavailable(f"lock store unavailable during {what} of {name!r}: "
                                       f"{exc}", key=keys[0], name=name, owner=owner) from exc

    def try_acquire(self, name: str, owner: str, ttl: float,
                    metadata: Mapping[str, Any] | None = None, *, wait: float = 0.0
                    ) -> tuple[Lease | None, str | None, float | None]:
        """One acquire attempt of ``name`` for ``owner`` for ``ttl`` seconds. Returns
        ``(lease, None, None)`` when granted, else ``(None, holder_owner,
        holder_ttl_seconds)``. With ``wait`` (seconds) a refused owner is recorded as waiting
        that long, so that the next release wakes a waiter."""
        ttl_ms = str(max(1, int(ttl * 1000)))
        args = [owner, ttl_ms, str(max(int(ttl_ms), int(self.fence_ttl * 1000))),
                str(max(1, int(wait * 1000)) if wait > 0 else 0), pack_metadata(metadata)]
        key = self.key(name)
        keys = [key, fence_key(self.prefix, name)]
        if wait > 0:
            keys.append(waiters_key(self.prefix, name))
        sent = self.clock()
        reply = self._call(self._acquire, keys, args, "acquire", name, owner)
        if isinstance(reply, list):
            holder, ttl_left = reply
            return None, _wire.text(holder), (ttl_left / 1000.0 if ttl_left and ttl_left > 0
                                              else None)
        meta = metadata or {}
        return Lease(name=name, key=key, owner=owner, fence=int(reply), ttl=ttl,
                     acquired_at=sent, valid_until=sent + ttl - drift(ttl),
                     task_id=meta.get("task_id"), task_name=meta.get("task_name"),
                     clock=self.clock), None, None

    def channel(self, name: str) -> str:
        """Deprecated: the pub/sub channel on which releases of ``name`` used to be announced.
        Nothing is published any more (waiters block on a wake-up list, see :meth:`acquire`)."""
        warnings.warn("RedisLeaseStore.channel(): releases are no longer published",
                      DeprecationWarning, stacklevel=2)
        return f"{self.prefix}:released:{{{name}}}"

    def acquire(self, name: str, owner: str | None = None, ttl: float = 30.0, *,
                wait: float = 0.0, metadata: Mapping[str, Any] | None = None) -> Lease | None:
        """Acquire the lease ``name`` for ``owner`` (a fresh token when None) for ``ttl``
        seconds. Returns the :class:`Lease`, or None when another owner holds it and ``wait``
        seconds (default 0: one attempt) passed without it being released or expiring.
        ``metadata`` (task_id, task_name, hostname, pid, ...; see :func:`holder_metadata`) is
        stored beside the owner and returned by :meth:`inspect` and :meth:`scan` as strings.

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
        cap = _wire.socket_timeout(self.client)
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
                    raise LockStoreUnavailable(
                        f"lock store unavailable while waiting for {name!r}: {exc}",
                        key=self.key(name), name=name, owner=owner) from exc
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
        return bool(self._call(self._release, self._wake_keys(name), [owner], "release",
                               name, owner))

    def reap(self, name: str, owner: str, renewed_ms: str) -> bool:
        """Delete the lease only if ``owner`` still holds it and its ``renewed_ms`` field is
        still ``renewed_ms`` (as read before deciding its holder is dead), and wake a
        waiter. Returns False, changing nothing, when it was renewed, released or
        re-acquired since."""
        return bool(self._call(self._reap, self._wake_keys(name), [owner, str(renewed_ms)],
                               "reap", name, owner))

    def reap_many(self, items: Iterable[tuple[str, str, str]]) -> list[bool | LockError]:
        """:meth:`reap` for many leases ``(name, owner, renewed_ms)`` in one pipelined round
        trip. Returns, per item, whether it was deleted, or the :class:`LockError` (with
        ``name``, ``owner``) of an item Redis refused. Raises LockStoreUnavailable when the
        round trip fails."""
        items = list(items)
        if not items:
            return []
        calls = [(self._wake_keys(name), [owner, str(renewed_ms)])
                 for name, owner, renewed_ms in items]
        try:
            replies = _wire.evalsha_many(self.client, self._reap, calls)
        except STORE_ERRORS as exc:
            raise LockStoreUnavailable(f"lock store unavailable during reap: {exc}") from exc
        return [LockError(f"lock store refused the reap of {name!r}: {reply}",
                          key=self.key(name), name=name, owner=owner)
                if isinstance(reply, Exception) else bool(reply)
                for (name, owner, _renewed), reply in zip(items, replies)]

    def extend(self, name: str, owner: str, ttl: float) -> bool:
        """Reset the lease's TTL to ``ttl`` seconds if ``owner`` holds it. Returns False (and
        changes nothing) when the key is gone or another owner holds it."""
        return bool(self._call(self._extend, [self.key(name)],
                               [owner, str(max(1, int(ttl * 1000)))], "extend", name, owner))

    def owned(self, name: str, owner: str) -> float | None:
        """Seconds left on the lease if ``owner`` holds it, else None. One round trip."""
        result = self._call(self._owned, [self.key(name)], [owner], "ownership check",
                            name, owner)
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
            replies = _wire.evalsha_many(self.client, self._extend_many, calls())
        except STORE_ERRORS as exc:
            raise LockStoreUnavailable(f"lock store unavailable during renewal: {exc}") from exc
        results: list[bool] = []
        for reply in replies:
            if isinstance(reply, Exception):
                raise LockStoreUnavailable(f"lock store refused a renewal: {reply}")
            results.extend([c == "1" for c in _wire.text(reply)])
        return results

    def scan_keys(self, cursor: int = 0, count: int = 500, match: str = "*"
                  ) -> tuple[int, list[str]]:
        """One ``SCAN`` step over the lease keys whose name matches the glob ``match``:
        ``(next_cursor, keys)``, key names only (``next_cursor`` 0: the scan is complete).
        ``count`` is SCAN's hint of keys examined per step. Never ``KEYS``."""
        try:
            cursor, keys = self.client.scan(cursor=cursor, match=lease_key(self.prefix, match),
                                            count=count)
        except STORE_ERRORS as exc:
            raise LockStoreUnavailable(f"lock store unavailable during scan: {exc}") from exc
        return int(cursor), [_wire.text(key) for key in keys]

    def read_leases(self, keys: list[str]) -> dict[str, dict[str, Any] | None]:
        """The leases of ``keys`` (as :meth:`inspect` returns them), read by one script call,
        each hash as one JSON string (parsing thousands of small RESP replies in Python cost
        more than the scan itself); None for a key gone since it was listed or not a lease
        hash (logged: one stray key cannot blind the admin, `ls` and the reaper)."""
        if not keys:
            return {}
        try:
            [replies] = _wire.evalsha_many(self.client, self._scan_fields, [(keys, [])])
        except STORE_ERRORS as exc:
            raise LockStoreUnavailable(f"lock store unavailable during scan: {exc}") from exc
        if isinstance(replies, Exception):
            raise LockStoreUnavailable(f"lock store refused the scan: {replies}")
        found: dict[str, dict[str, Any] | None] = {}
        for key, doc, pttl in zip(keys, replies[::2], replies[1::2]):
            doc = _wire.text(doc)
            fields = json.loads(doc) if doc else None
            if not fields:
                if not doc and _wire.text(pttl) != "none":
                    logger.warning("event=scan_skipped key=%s error=WRONGTYPE a %s, not a "
                                   "lease hash", key, _wire.text(pttl))
                found[key] = None  # else expired between the listing and the read
                continue
            info = unpack_fields(fields)
            info["key"] = key
            info["name"] = name_from_key(key)
            info["ttl"] = pttl / 1000.0 if isinstance(pttl, int) and pttl > 0 else None
            found[key] = info
        return found

    def scan(self, cursor: int = 0, count: int = 500, match: str = "*"
             ) -> tuple[int, list[dict[str, Any]]]:
        """One ``SCAN`` step over the lease keys whose name matches the glob ``match``.

        Returns ``(next_cursor, leases)``: ``next_cursor`` is 0 when the scan is complete;
        each lease is a dict as :meth:`inspect` returns (:meth:`scan_keys`, then
        :meth:`read_leases`). ``count`` is SCAN's hint of keys examined per step, not a page
        size; a step can return fewer or more leases. Never ``KEYS``: memory stays flat
        however many leases Redis holds.
        """
        cursor, keys = self.scan_keys(cursor, count, match)
        found = self.read_leases(keys)
        return cursor, [info for info in found.values() if info is not None]

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
        """The lease's stored fields (``owner``, ``fence``, ``acquired_ms``, ``renewed_ms``,
        ``ttl_ms`` and the metadata entries, all strings) plus ``name``, ``key`` and ``ttl``
        (seconds left, float), or None when not held."""
        key = self.key(name)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.hgetall(key)
            pipe.pttl(key)
            fields, pttl = pipe.execute()
        except STORE_ERRORS as exc:
            raise LockStoreUnavailable(f"lock store unavailable during inspect of {name!r}: "
                                       f"{exc}", key=key, name=name) from exc
        if not fields:
            return None
        info = unpack_fields(fields)
        info["name"] = name
        info["key"] = key
        info["ttl"] = pttl / 1000.0 if pttl and pttl > 0 else None
        return info


#: The store's former name, kept so that old imports keep working.


_stores: dict[tuple, RedisLeaseStore] = {}
_stores_guard = threading.Lock()


def get_lease_store(app, settings: Settings | None = None) -> RedisLeaseStore:
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
                store = RedisLeaseStore(make_client(ident[0], ident[1]), prefix=ident[2],
                                        fence_ttl=ident[3])
                _stores[ident] = store
    return store


#: Old names kept for one release; using one warns (DeprecationWarning).
_DEPRECATED = {"RedisStepLock": ("RedisLeaseStore", RedisLeaseStore),
               "get_lock": ("get_lease_store", get_lease_store)}


def __getattr__(name: str):
    if name in _DEPRECATED:
        new_name, value = _DEPRECATED[name]
        warnings.warn(f"celery_steplock.{name} is deprecated; use celery_steplock.{new_name}",
                      DeprecationWarning, stacklevel=2)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
