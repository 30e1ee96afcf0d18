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
from redis.exceptions import RedisClusterException, RedisError, ResponseError

from . import _cluster, _lua, _wire
from .clients import ClientConfig, make_client
from .conf import Settings
from .exceptions import LockError, LockStoreMisconfigured, LockStoreUnavailable
from .keys import fence_key, lease_key, name_from_key, wake_key, waiters_key
from .redact import redact
from .lease import CLOCK_DRIFT_FACTOR, Lease, drift, holder_metadata, new_owner_token

__all__ = ["Lease", "RedisLeaseStore", "ClusterLeaseStore", "new_owner_token",
           "holder_metadata", "make_client", "get_lease_store", "CLOCK_DRIFT_FACTOR",
           "STORE_ERRORS", "store_error", "MAX_WAITERS"]

#: Leases renewed per EXTEND_MANY call: bounds how long one call blocks Redis.
EXTEND_CHUNK = 1000

#: What redis-py raises when Redis cannot be reached (a refusal is a ``ResponseError``, a
#: subclass of ``RedisError``, told apart where it matters; a ``RedisCluster`` raises
#: ``RedisClusterException`` when no node serves a slot).
STORE_ERRORS = (RedisError, OSError, RedisClusterException)

#: Default of ``max_waiters``: how many callers of one store may wait (``acquire(wait=...)``)
#: at once, each blocking one connection of the waiters' own pool.
MAX_WAITERS = 1000

#: Waiters that share the store's own pool (see :attr:`RedisLeaseStore.waiter_limit`) leave
#: a quarter of its connections, and at least this many, to renewals and releases.
WAITER_RESERVE = 8

#: The lease name the permission probe uses (``_lua.PROBE``); no task's lock name has it.
PROBE_NAME = "steplock-acl-probe"

#: Where the least-privilege ACL is documented (named by the permission errors).
ACL_DOC = "docs/acl.md"


def store_error(exc: BaseException, what: str, *, key: str | None = None,
                name: str | None = None, owner: str | None = None) -> LockError:
    """The library's error for ``exc`` raised by redis-py during ``what`` (e.g. "acquire"):
    :class:`LockStoreMisconfigured` when Redis refused our credentials, a permission or the
    TLS verification (naming the setting ``steplock_redis_url`` and the command refused, when
    known); :class:`LockError` when it refused the call otherwise (e.g. ``WRONGTYPE``);
    :class:`LockStoreUnavailable` when it could not be reached."""
    of = f" of {name!r}" if name is not None else ""
    # redis-py's text may quote a URL or connection options (a client factory's own).
    error = redact(exc)
    reason = _wire.misconfiguration(exc)
    if reason is not None:
        command = _wire.refused_command(exc)
        permissions = (command,) if command else ()
        setting = "steplock_redis_url"
        if reason == "permission refused":
            hint = (f"grant {'+' + command if command else 'the command'} (and the key "
                    f"pattern of steplock_key_prefix) to the Redis user of steplock_redis_url; "
                    f"the least-privilege ACL is in {ACL_DOC}")
        elif reason in (_wire.SENTINEL_AUTH, _wire.SENTINEL_UNKNOWN_MASTER):
            setting = "steplock_redis_transport_options"
            hint = ("fix the sentinels' password in sentinel_kwargs of "
                    "steplock_redis_transport_options" if reason == _wire.SENTINEL_AUTH else
                    "set master_name in steplock_redis_transport_options to the name the "
                    "sentinels monitor (SENTINEL MASTERS)")
        elif reason.startswith("TLS"):
            setting = "steplock_redis_use_ssl"
            hint = ("fix the TLS options (steplock_redis_use_ssl, or the ssl_* parameters of "
                    "a rediss:// steplock_redis_url): ssl_ca_certs must hold the CA that "
                    "signed the server's certificate" if "verification" in reason else
                    "fix the TLS options (steplock_redis_use_ssl, or the ssl_* parameters of "
                    "a rediss:// steplock_redis_url): ssl_certfile and ssl_keyfile must be "
                    "the PEM client certificate and its key (required by a server of mutual "
                    "TLS), ssl_ca_certs a PEM file of CA certificates")
        else:
            hint = "fix the credentials (user name, password) in steplock_redis_url"
        return LockStoreMisconfigured(
            f"lock store refused the {what}{of}: {reason} ({error}): {hint}", key=key,
            name=name, owner=owner, setting=setting, permissions=permissions)
    if isinstance(exc, ResponseError):
        # Redis answered and refused (e.g. WRONGTYPE: something else wrote our key): not
        # an outage, so never a reason to retry or to run fail-open.
        return LockError(f"lock store refused the {what}{of}: {error}"
                         f"{_cluster.redirect_hint(exc)}", key=key, name=name, owner=owner)
    return LockStoreUnavailable(f"lock store unavailable during {what}{of}: {error}", key=key,
                                name=name, owner=owner)

logger = logging.getLogger("celery_steplock")


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

    ``client`` is a ``redis.Redis`` or a ``redis.cluster.RedisCluster`` (see
    :func:`make_client`; a cluster client makes a :class:`ClusterLeaseStore`); ``prefix``
    namespaces the keys; ``fence_ttl`` (seconds, default 7 days) is how long an idle name's
    fencing counter is kept at least (at most twice that); ``clock`` (default
    :func:`time.monotonic`) is the clock of
    the leases' local validity. Every method raises :class:`LockStoreUnavailable` when Redis
    cannot be reached, :class:`LockStoreMisconfigured` when it refuses our credentials or a
    permission, and :class:`LockError` when it refuses a call otherwise (e.g. ``WRONGTYPE``:
    a key of ours holds something else); all carry ``name`` (and ``owner``) where one lease
    is concerned.

    Waiters (``acquire(wait=...)``) block on ``waiter_client``, by default a client derived
    from ``client`` with a pool of its own of ``max_waiters`` connections (default
    :data:`MAX_WAITERS`), so that renewals and releases never wait for a connection behind
    them; a caller that would be waiter number ``max_waiters + 1`` gets
    LockStoreMisconfigured naming ``steplock_max_waiters``. When no pool can be derived
    (a custom pool class from a client factory) the waiters share the store's pool,
    and are capped below its ``max_connections`` (see :attr:`waiter_limit`).
    """

    def __new__(cls, client: Any = None, *args: Any, **kwargs: Any):
        # A RedisCluster client gets the store whose multi-lease calls are split by slot.
        if cls is RedisLeaseStore and _cluster.is_cluster(client):
            cls = ClusterLeaseStore
        return super().__new__(cls)

    def __init__(self, client: redis.Redis, prefix: str = "steplock",
                 fence_ttl: float = 7 * 24 * 3600.0,
                 clock: Callable[[], float] = time.monotonic, *,
                 waiter_client: redis.Redis | None = None, max_waiters: int = MAX_WAITERS):
        self.client = client
        self.max_waiters = max_waiters
        self._waiter_client = waiter_client
        self._waiter_guard = threading.Lock()
        self._waiter_limit: int | None = None
        self._shares_pool = False
        self._waiting = 0
        self._waiting_guard = threading.Lock()
        self._probed = False
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
        self._probe = _wire.Script(_lua.PROBE)

    def key(self, name: str) -> str:
        """The Redis key of the lease ``name``."""
        return lease_key(self.prefix, name)

    @property
    def waiter_client(self) -> redis.Redis:
        """The client waiters block on (see the class docstring)."""
        if self._waiter_client is None:
            with self._waiter_guard:
                if self._waiter_client is None:
                    derived = _wire.derived_client(self.client, self.max_waiters)
                    self._shares_pool = derived is self.client
                    self._waiter_client = derived
        return self._waiter_client

    @property
    def waiter_limit(self) -> int:
        """How many callers of this store may wait at once: ``max_waiters``; but when the
        waiters' client could not be derived from the store's (it is the store's client
        itself, so the waiters share its pool), at most that pool's ``max_connections``
        minus a reserve of a quarter of them (at least :data:`WAITER_RESERVE`), which the
        renewals and releases keep. A ``waiter_client`` passed in is not capped."""
        if self._waiter_limit is None:
            client = self.waiter_client
            limit = self.max_waiters
            # A Cluster client is not capped (a pool per node), nor built here if deferred.
            size = None if _cluster.is_cluster(client) else getattr(
                getattr(client, "connection_pool", None), "max_connections", None)
            if self._shares_pool and isinstance(size, int) and size > 0:
                limit = min(limit, max(0, size - max(WAITER_RESERVE, size // 4)))
            self._waiter_limit = limit
        return self._waiter_limit

    def _enter_waiting(self) -> bool:
        limit = self.waiter_limit
        with self._waiting_guard:
            if self._waiting >= limit:
                return False
            self._waiting += 1
            return True

    def _leave_waiting(self) -> None:
        with self._waiting_guard:
            self._waiting -= 1

    def check_permissions(self, *, what: str = "permission check", key: str | None = None,
                          name: str | None = None, owner: str | None = None) -> None:
        """Run the permission probe (:data:`celery_steplock._lua.PROBE`): every command of the
        lease scripts on the keys of a reserved name under this prefix, each refusal
        collected. Done once per store before its first write, so that a Redis user lacking
        a permission is refused before any script can stop halfway. Raises
        LockStoreMisconfigured naming every command (and key) refused, LockStoreUnavailable
        when Redis cannot be reached; ``what``, ``key``, ``name``, ``owner`` describe the call
        the check comes before, for those errors."""
        keys = [lease_key(self.prefix, PROBE_NAME), fence_key(self.prefix, PROBE_NAME),
                waiters_key(self.prefix, PROBE_NAME), wake_key(self.prefix, PROBE_NAME)]
        try:
            refused = _wire.evalsha(self.client, self._probe, keys, [])
        except STORE_ERRORS as exc:
            raise store_error(exc, what, key=key, name=name, owner=owner) from exc
        if refused:
            refused = tuple(_wire.text(r) for r in refused)
            commands = sorted({r.split(" ")[0] for r in refused})
            raise LockStoreMisconfigured(
                f"the Redis user of steplock_redis_url may not run {', '.join(refused)} "
                f"(needed by the lease scripts): grant "
                f"{' '.join('+' + c for c in commands)} and the key pattern "
                f"~{self.prefix}:* (steplock_key_prefix); the least-privilege ACL is in "
                f"{ACL_DOC}", key=key, name=name, owner=owner, setting="steplock_redis_url",
                permissions=refused)
        self._probed = True

    def _call(self, script: _wire.Script, keys: list[str], args: list[str], what: str,
              name: str, owner: str | None = None, client: redis.Redis | None = None,
              writes: bool = True) -> Any:
        # The probe guards scripts that write; a read (the ownership check) never stops
        # halfway, and must work on a replica too.
        if writes and not self._probed:
            self.check_permissions(what=what, key=keys[0], name=name, owner=owner)
        try:
            return _wire.evalsha(client or self.client, script, keys, args)
        except STORE_ERRORS as exc:
            raise store_error(exc, what, key=keys[0], name=name, owner=owner) from exc

    def try_acquire(self, name: str, owner: str, ttl: float,
                    metadata: Mapping[str, Any] | None = None, *, wait: float = 0.0,
                    _client: redis.Redis | None = None
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
        reply = self._call(self._acquire, keys, args, "acquire", name, owner, _client)
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
        if not self._enter_waiting():
            lease = self.try_acquire(name, owner, ttl, metadata)[0]
            if lease is not None:
                return lease
            limit = self.waiter_limit
            if limit < self.max_waiters:
                size = self.client.connection_pool.max_connections
                raise LockStoreMisconfigured(
                    f"cannot wait for {name!r}: {limit} callers of this process already wait "
                    f"for leases, the most the store's pool allows (steplock_max_waiters, "
                    f"{self.max_waiters}, is capped to the pool's max_connections, {size}, "
                    f"minus {size - limit} kept for renewals and releases, because the "
                    f"waiters share that pool: no pool of their own could be derived from the "
                    f"store's client): give the pool more connections, lower lock_wait or the "
                    f"pool's concurrency", key=self.key(name), name=name, owner=owner,
                    setting="steplock_max_waiters")
            raise LockStoreMisconfigured(
                f"cannot wait for {name!r}: {self.max_waiters} callers of this process "
                f"already wait for leases (steplock_max_waiters; each blocks a connection "
                f"of the waiters' pool): raise steplock_max_waiters or lower lock_wait or "
                f"the pool's concurrency", key=self.key(name), name=name, owner=owner,
                setting="steplock_max_waiters")
        try:
            return self._wait(name, owner, ttl, wait, metadata)
        finally:
            self._leave_waiting()

    def _wait(self, name: str, owner: str, ttl: float, wait: float,
              metadata: Mapping[str, Any] | None) -> Lease | None:
        # Every command of a waiter goes through the waiters' pool: blocked in BLPOP or not,
        # waiters never take the connections that renewals and releases need.
        client = self.waiter_client
        deadline = time.monotonic() + wait
        wake = wake_key(self.prefix, name)
        # BLPOP must return before the socket times out (a timeout would be retried).
        cap = _wire.socket_timeout(client)
        lease = None
        interrupted = False
        try:
            while True:
                left = deadline - time.monotonic()
                lease, _holder, holder_ttl = self.try_acquire(name, owner, ttl, metadata,
                                                              wait=max(left, 0.001),
                                                              _client=client)
                if lease is not None or left <= 0:
                    return lease
                timeout = min(left, holder_ttl) if holder_ttl else min(left, 0.01)
                if cap:
                    timeout = min(timeout, cap * 0.8)
                try:
                    client.blpop([wake], timeout=max(round(timeout, 3), 0.001))
                    interrupted = False
                except STORE_ERRORS as exc:
                    if isinstance(exc, redis.ConnectionError) and not interrupted:
                        # One dropped wait (a failover closed the connection, or a demoted
                        # primary answered READONLY) goes back to the acquire attempt, which
                        # reconnects, and raises if Redis is really gone.
                        interrupted = True
                        continue
                    raise store_error(exc, "wait", key=self.key(name), name=name,
                                      owner=owner) from exc
        finally:
            if lease is None:
                try:
                    client.zrem(waiters_key(self.prefix, name), owner)
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
        if not self._probed:
            self.check_permissions(what="reap")
        calls = [(self._wake_keys(name), [owner, str(renewed_ms)])
                 for name, owner, renewed_ms in items]
        try:
            replies = _wire.evalsha_many(self.client, self._reap, calls)
        except STORE_ERRORS as exc:
            raise store_error(exc, "reap") from exc
        return [store_error(reply, "reap", key=self.key(name), name=name, owner=owner)
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
                            name, owner, writes=False)
        return result / 1000.0 if result is not None and result >= 0 else None

    def extend_many(self, items: Iterable[tuple[str, str, float]],
                    chunk: int = EXTEND_CHUNK) -> list[bool]:
        """Extend many leases ``(name, owner, ttl seconds)`` in one pipelined round trip.

        The leases go ``chunk`` at a time to one script call each, every call written to
        one connection before any reply is read (Redis runs the first call while the next
        is encoded), so Redis is never blocked for long by one call. Returns one bool per
        item, as :meth:`extend`. Raises LockStoreUnavailable when the round trip fails or
        Redis refuses a call, LockStoreMisconfigured when it refuses a permission or our
        credentials.
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
            if not self._probed:
                self.check_permissions(what="renewal")
            replies = _wire.evalsha_many(self.client, self._extend_many, calls())
        except STORE_ERRORS as exc:
            raise _unavailable_unless_misconfigured(exc, "renewal") from exc
        results: list[bool] = []
        for reply in replies:
            if isinstance(reply, Exception):
                raise _unavailable_unless_misconfigured(reply, "renewal", refused=True)
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
            raise _unavailable_unless_misconfigured(exc, "scan") from exc
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
            raise _unavailable_unless_misconfigured(exc, "scan") from exc
        if isinstance(replies, Exception):
            raise _unavailable_unless_misconfigured(replies, "scan", refused=True)
        return self._parse_scan_fields(keys, replies)

    def _parse_scan_fields(self, keys: list[str], replies: list[Any]
                           ) -> dict[str, dict[str, Any] | None]:
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
            error = _unavailable_unless_misconfigured(exc, f"inspect of {name!r}")
            error.key, error.name = key, name
            raise error from exc
        if not fields:
            return None
        info = unpack_fields(fields)
        info["name"] = name
        info["key"] = key
        info["ttl"] = pttl / 1000.0 if pttl and pttl > 0 else None
        return info


def _unavailable_unless_misconfigured(exc: BaseException, what: str, *,
                                      refused: bool = False) -> LockError:
    # These paths report any Redis error as LockStoreUnavailable (a renewal, a scan are
    # retried), except a refused permission or credentials: a configuration error.
    error = store_error(exc, what)
    if isinstance(error, LockStoreMisconfigured):
        return error
    if refused:
        return LockStoreUnavailable(f"lock store refused the {what}: {redact(exc)}")
    return LockStoreUnavailable(f"lock store unavailable during {what}: {redact(exc)}")


class ClusterLeaseStore(_cluster.ClusterStoreMixin, RedisLeaseStore):
    """:class:`RedisLeaseStore` over a ``redis.cluster.RedisCluster``: renewals, reaps and
    reads of many leases split by slot and pipelined per node, scans walking every primary
    (see :mod:`celery_steplock._cluster`). ``RedisLeaseStore(cluster_client)`` makes one."""


#: The store's former name, kept so that old imports keep working.


_stores: dict[tuple, RedisLeaseStore] = {}
_stores_guard = threading.Lock()


def get_lease_store(app, settings: Settings | None = None) -> RedisLeaseStore:
    """The lease store for ``app``'s settings (``steplock_redis_url``, the transport, TLS and
    client-factory settings of :mod:`celery_steplock.clients`, ``steplock_redis_cluster``,
    ``steplock_socket_timeout``, ``steplock_key_prefix``, ``steplock_fence_ttl``,
    ``steplock_max_waiters``), one per distinct configuration and shared by every task,
    heartbeat and operator tool of the process.

    Raises ImproperlyConfigured naming the setting when one of them is invalid.
    """
    settings = settings or Settings(app)
    config = ClientConfig(settings)
    ident = (config.identity, settings.key_prefix, settings.fence_ttl, settings.max_waiters)
    store = _stores.get(ident)
    if store is None:
        with _stores_guard:
            store = _stores.get(ident)
            if store is None:
                store = RedisLeaseStore(config.client(), prefix=ident[1], fence_ttl=ident[2],
                                        waiter_client=config.waiter_client(),
                                        max_waiters=ident[3])
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
