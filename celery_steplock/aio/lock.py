"""The lease store on ``redis.asyncio``: :class:`AsyncRedisLeaseStore`.

The synchronous store's scripts (:mod:`celery_steplock._redis.scripts.lease`), key layouts
(:mod:`celery_steplock.keys`), fencing tokens, owner checks, argument bounds and typed errors,
with its methods as coroutines (redis-py's convention for ``redis.asyncio.lock.Lock``). The
arguments are built and the replies parsed by the helpers of :mod:`celery_steplock.lock` that
the synchronous store uses; each call is written once as steps (:mod:`celery_steplock.calls`)
and driven with :func:`celery_steplock.calls.arun`, so the event loop is never blocked: a
waiter blocks in ``BLPOP`` on a connection of its own, not in ``time.sleep``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import weakref
from typing import Any, Callable, Iterable, Mapping

from .. import _loops, calls
from .._checks import (
    MAX_SCAN_COUNT,
    check_count,
    shown,
)
from .._loops import background
from .._redis import aio, cluster, wire
from .._redis.scripts import lease as scripts
from .._redis.scripts.lease import EXTEND_CHUNK
from ..clients import aclose_client, async_client_for
from ..events import log_event
from ..exceptions import InvalidArgument, LockContended, LockError, LockStoreUnavailable
from ..history import DEFAULT_MAX_AGE as DEFAULT_HISTORY_MAX_AGE
from ..history import DEFAULT_MAX_ENTRIES as DEFAULT_HISTORY_MAX_ENTRIES
from ..keys import lease_key, lease_keys, waiters_key, wake_key
from ..lease import Lease, new_owner_token
from ..lock import (
    MAX_WAITERS,
    STORE_ERRORS,
    WAITER_RESERVE,
    WAITS,
    RedisLeaseStore,
    _acquire_request,
    _argument,
    _extend_many_calls,
    _extend_many_results,
    _FailoverGrace,
    _fresh_grant,
    _granted,
    _history_add_request,
    _history_store_argument,
    _inspected,
    _metadata,
    _name,
    _owned_seconds,
    _owner,
    _probe_error,
    _probe_keys,
    _probe_names,
    _release_request,
    _store_arguments,
    _ttl,
    _ttl_ms,
    _unavailable_unless_misconfigured,
    _wait_seconds,
    _wait_timeout,
    _waiters_full,
    forced_key,
    get_lease_store,
    parse_forced,
    store_error,
)
from .heartbeat import get_async_heartbeat

__all__ = ["AsyncRedisLeaseStore", "get_async_lease_store"]


def _derived(client: Any, max_connections: int) -> Any:
    """A client like ``client`` on a pool of its own of at most ``max_connections``
    connections, for waiters; ``client`` itself for a Cluster (a pool per node), a Sentinel
    pool or a pool of another class (the waiters then share its pool, capped)."""
    import redis.asyncio as aredis

    if aio.is_async_cluster(client):
        return client
    pool: Any = getattr(client, "connection_pool", None)
    if type(pool) not in (aredis.ConnectionPool, aredis.BlockingConnectionPool):
        return client
    return aredis.Redis(
        connection_pool=type(pool)(
            connection_class=pool.connection_class,
            max_connections=max_connections,
            **pool.connection_kwargs,
        )
    )


class AsyncRedisLeaseStore:
    """Acquire, extend, release and check owner-keyed leases from asyncio code.

    The asyncio form of :class:`celery_steplock.lock.RedisLeaseStore`: the same scripts,
    keys, fencing tokens, owner checks and bounds (``ttl`` within [0.05, 86400] seconds,
    ``wait`` within [0, 86400], names as lock names, owners non-empty printable strings of at
    most 256 characters), the same typed errors (:class:`LockStoreUnavailable` when Redis
    cannot be reached, :class:`LockStoreMisconfigured` when it refuses our credentials or a
    permission, :class:`LockError` when it refuses a call otherwise), and the same permission
    probe before the first write. A lease granted here is one the synchronous store sees
    (and the reverse): a Celery task and an async view contend on one lease.

    Waiters (``acquire(wait=...)``) block in ``BLPOP`` on ``waiter_client``, by default a
    client derived from ``client`` with a pool of its own of ``max_waiters`` connections; a
    caller that would be waiter number ``max_waiters + 1`` gets
    :class:`LockStoreMisconfigured` naming ``steplock_max_waiters``.

    One store serves one event loop (its client's connections belong to it):
    :func:`get_async_lease_store` gives the app's store for the running loop.

    Args:
        client: A ``redis.asyncio.Redis`` (single node, or a Sentinel's ``master_for``) or a
            ``redis.asyncio.cluster.RedisCluster``.
        prefix: Namespaces the keys (``steplock_key_prefix``).
        fence_ttl: Seconds an idle name's fencing counter is kept at least; default 7 days.
        clock: The clock of the leases' local validity, in seconds (default
            :func:`time.monotonic`).
        waiter_client: The client waiters block on; default one derived from ``client``.
        max_waiters: How many callers of this store may wait at once (default
            :data:`celery_steplock.lock.MAX_WAITERS`).
        name_secret: The HMAC key of the leases' ``idempotency_key`` (None: they raise).
        history, history_max_entries, history_max_age: The names' history, as the sync
            store's (:mod:`celery_steplock.history`): acquires and releases write it alike.

    Raises:
        InvalidArgument: An argument of the wrong type or out of its bounds (naming it).
    """

    def __init__(
        self,
        client: Any,
        prefix: str = "steplock",
        fence_ttl: float = 7 * 24 * 3600.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        waiter_client: Any = None,
        max_waiters: int = MAX_WAITERS,
        name_secret: bytes | str | None = None,
        history: bool = True,
        history_max_entries: int = DEFAULT_HISTORY_MAX_ENTRIES,
        history_max_age: float = DEFAULT_HISTORY_MAX_AGE,
    ) -> None:
        if not aio.is_async_client(client):
            raise InvalidArgument(
                f"client must be a redis.asyncio Redis or RedisCluster client, got "
                f"{shown(client)} (a synchronous client: use "
                f"celery_steplock.clients.async_client_for(client))",
                argument="client",
            )
        self.prefix, self.fence_ttl, self.max_waiters, self.clock, name_secret = _store_arguments(
            prefix, fence_ttl, max_waiters, clock, name_secret
        )
        #: The HMAC key of the idempotency keys of the leases it grants (None: they raise).
        self.name_secret = name_secret
        #: The bounds of the names' history (None: not written).
        self.history_config = _history_store_argument(
            history, history_max_entries, history_max_age
        )
        self.client = client
        self._waiter_client = waiter_client
        self._shares_pool = False
        self._waiter_limit: int | None = None
        self._waiting = 0
        self._probed = False
        self._acquire = wire.Script(scripts.ACQUIRE)
        self._release = wire.Script(scripts.RELEASE)
        self._forget_waiter = wire.Script(scripts.FORGET_WAITER)
        self._extend = wire.Script(scripts.EXTEND)
        self._extend_many = wire.Script(scripts.EXTEND_MANY)
        self._owned = wire.Script(scripts.OWNED)
        self._probe = wire.Script(scripts.PROBE)
        self._scan_fields = wire.Script(scripts.SCAN_FIELDS)
        self._history_add = wire.Script(scripts.HISTORY_ADD)

    def key(self, name: str) -> str:
        """The Redis key of a lease: ``<prefix>:lease:{<name>}`` (as the sync store's)."""
        return lease_key(self.prefix, name)

    @property
    def waiter_client(self) -> Any:
        """The client waiters block on (see the class docstring)."""
        if self._waiter_client is None:
            derived = _derived(self.client, self.max_waiters)
            self._shares_pool = derived is self.client
            self._waiter_client = derived
            if not self._shares_pool:
                # Its pool is ours: its connections end with the loop that opened them.
                _loops.room().on_close(functools.partial(aclose_client, derived))
        return self._waiter_client

    @property
    def waiter_limit(self) -> int:
        """How many callers of this store may wait at once: ``max_waiters``, capped as the
        sync store's :attr:`~celery_steplock.lock.RedisLeaseStore.waiter_limit` when the
        waiters share the store's pool."""
        if self._waiter_limit is None:
            client = self.waiter_client
            limit = self.max_waiters
            size = (
                None
                if aio.is_async_cluster(client)
                else getattr(getattr(client, "connection_pool", None), "max_connections", None)
            )
            if self._shares_pool and isinstance(size, int) and 0 < size < 2**31:
                limit = min(limit, max(0, size - max(WAITER_RESERVE, size // 4)))
            self._waiter_limit = limit
        return self._waiter_limit

    # -- steps: each Redis operation written once, driven by calls.arun --------------------

    def _probe_steps(
        self, what: str, key: str | None, name: str | None, owner: str | None
    ) -> calls.Steps[None]:
        for probe_name in _probe_names():
            keys = _probe_keys(self.prefix, probe_name)
            try:
                refused = yield calls.Eval(self._probe, keys, [], what, name=name, owner=owner)
            except LockError as exc:
                exc.key = key  # the call's key, as the sync store names it
                raise
            if refused != 1:
                break
        error = _probe_error(self.prefix, refused, keys, key=key, name=name, owner=owner)
        if error is not None:
            raise error
        self._probed = True

    def _call_steps(
        self,
        script: wire.Script,
        keys: list[str],
        args: list[str],
        what: str,
        name: str,
        owner: str | None,
        writes: bool = True,
    ) -> calls.Steps[Any]:
        # The probe guards scripts that write, as in the sync store.
        if writes and not self._probed:
            yield from self._probe_steps(what, keys[0], name, owner)
        return (yield calls.Eval(script, keys, args, what, name=name, owner=owner))

    def _try_steps(
        self,
        name: str,
        owner: str,
        ttl: float,
        metadata: Mapping[str, Any] | None,
        wait: float,
    ) -> calls.Steps[tuple[Lease | None, str | None, float | None]]:
        keys, args = _acquire_request(
            self.prefix, self.fence_ttl, name, owner, ttl, wait, metadata, self.history_config
        )
        sent = self.clock()
        reply = yield from self._call_steps(self._acquire, keys, args, "acquire", name, owner)
        return _granted(reply, self, name, keys[0], owner, ttl, sent, metadata)

    def _wait_steps(
        self,
        name: str,
        owner: str,
        ttl: float,
        wait: float,
        metadata: Mapping[str, Any] | None,
    ) -> calls.Steps[tuple[Lease | None, str | None, float | None]]:
        # The sync store's wait: a refused attempt records the waiter (same script), then
        # BLPOP on the wake-up list until a release pushes one wake-up (one waiter woken)
        # or the holder's TTL runs out; ZREM of the entry on giving up.
        deadline = time.monotonic() + wait
        wake = wake_key(self.prefix, name)
        cap = _socket_timeout(self.waiter_client)
        interrupted = False
        failover: _FailoverGrace | None = None
        waiting = None  # WAITS' token once refused
        try:
            try:
                while True:
                    left = deadline - time.monotonic()
                    try:
                        result = yield from self._try_steps(
                            name, owner, ttl, metadata, max(left, 0.001)
                        )
                    except LockStoreUnavailable as exc:
                        if failover is None and waiting is not None:
                            # Refused before, so Redis was there: a failover that lands on
                            # this attempt rather than on the BLPOP gets the same grace.
                            failover = _FailoverGrace()
                        pause = failover.pause(exc, deadline) if failover is not None else None
                        if pause is None:
                            raise
                        yield calls.Sleep(pause)
                        continue
                    if result[0] is not None or left <= 0:
                        break
                    if waiting is None:  # a wait really happens: the metrics count it
                        waiting = WAITS.start(
                            "lease", str((metadata or {}).get("task_name") or "")
                        )
                    try:
                        yield calls.Command(
                            ("BLPOP", wake, _wait_timeout(left, result[2], cap)),
                            "wait",
                            key=self.key(name),
                            name=name,
                            owner=owner,
                        )
                        interrupted = False
                    except LockError as exc:
                        if _dropped(exc) and not interrupted:
                            # One dropped wait (a failover) goes back to the acquire attempt,
                            # which reconnects, and keeps trying while the failover lasts (as
                            # the sync store's): it raises if Redis is really gone.
                            interrupted = True
                            failover = _FailoverGrace()
                            continue
                        raise
            except LockError:
                yield from self._forget_steps(name, owner)
                raise
            if result[0] is None:
                yield from self._forget_steps(name, owner)
        finally:  # also when the caller's cancellation closes these steps
            if waiting is not None:
                WAITS.end(waiting)
        return result

    def _forget_steps(self, name: str, owner: str) -> calls.Steps[None]:
        try:
            yield calls.Command(
                ("ZREM", waiters_key(self.prefix, name), owner),
                "wait",
                key=waiters_key(self.prefix, name),
                name=name,
                owner=owner,
            )
        except LockError:
            pass  # the entry expires with its deadline

    def _wake_keys(self, name: str) -> list[str]:
        return [self.key(name), waiters_key(self.prefix, name), wake_key(self.prefix, name)]

    def _release_steps(self, name: str, owner: str) -> calls.Steps[bool]:
        keys, args = _release_request(self.prefix, name, owner, self.history_config)
        reply = yield from self._call_steps(self._release, keys, args, "release", name, owner)
        return bool(reply)

    def _cancelled_steps(
        self, name: str, owner: str, waited: bool, granted: bool | None, generated: bool
    ) -> calls.Steps[None]:
        # After a cancelled acquire. granted: whether the ACQUIRE whose reply the cancellation
        # cut off granted the lease afresh (False: refused, a re-grant of a lease the owner
        # already held, or no ACQUIRE in flight; None: unknown, the call failed).
        # Only a grant of this call is released: a re-grant is the earlier holder's, whose
        # hold must outlive this call. An unknown outcome is released only for an owner
        # token this call generated (no one else can hold the lease with it); else the
        # grant, if any, runs out with its TTL, as after a failed uncancelled acquire.
        if granted or (granted is None and generated):
            yield from self._release_steps(name, owner)  # wakes a waiter when it deletes
        if waited and not granted:
            # Its waiter entry dropped, and a wake-up its cut-off BLPOP may have taken passed
            # on when the lease is free.
            yield from self._call_steps(
                self._forget_waiter, self._wake_keys(name), [owner], "wait", name, owner
            )

    # -- the API ---------------------------------------------------------------------------

    async def check_permissions(
        self,
        *,
        what: str = "permission check",
        key: str | None = None,
        name: str | None = None,
        owner: str | None = None,
    ) -> None:
        """Run the permission probe, as :meth:`RedisLeaseStore.check_permissions` (run once
        by itself before the store's first write).

        Raises:
            LockStoreMisconfigured: Naming every command (and key) refused.
            LockStoreUnavailable: Redis cannot be reached.
        """
        await calls.arun(self._probe_steps(what, key, name, owner), self.client)

    async def try_acquire(
        self,
        name: str,
        owner: str,
        ttl: float,
        metadata: Mapping[str, Any] | None = None,
        *,
        wait: float = 0.0,
    ) -> tuple[Lease | None, str | None, float | None]:
        """One acquire attempt, as :meth:`RedisLeaseStore.try_acquire`.

        Returns:
            ``(lease, None, None)`` when granted, else ``(None, holder_owner,
            holder_ttl_seconds)``.

        Raises:
            InvalidArgument, LockNameError, MetadataError: As the sync store.
        """
        name, owner, ttl = _name(name), _owner(owner), _ttl(ttl)
        metadata = _metadata(metadata)
        wait = _wait_seconds(wait)
        return await self._run_acquire(
            self._try_steps(name, owner, ttl, metadata, wait),
            self.client,
            name,
            owner,
            wait > 0,
            False,
        )

    async def acquire(
        self,
        name: str,
        owner: str | None = None,
        ttl: float = 30.0,
        *,
        wait: float = 0.0,
        metadata: Mapping[str, Any] | None = None,
    ) -> Lease | None:
        """Acquire a lease, waiting for it at most ``wait`` seconds without blocking the
        event loop (as :meth:`RedisLeaseStore.acquire`: a release wakes one waiter).

        A cancelled call (``asyncio.CancelledError``) leaves nothing behind: a task of the
        loop releases what the call may have been granted, drops its waiter entry and, when
        the lease is free and others wait, wakes one (the wake-up the cancelled wait may
        have taken). With an ``owner`` of the caller's, which may hold the lease already, an
        acquire script already sent runs to its end and the lease is released only if that
        script granted it afresh (a re-grant is left as it was; a reply lost to an error
        leaves any grant to its TTL). With a generated owner (None) no one else can hold
        the lease under that token, and it is released by owner.

        Args:
            name: The lock name.
            owner: The owner token; a fresh one when None.
            ttl: The lease's lifetime in seconds.
            wait: Seconds to wait for a lease another owner holds (default 0: one attempt).
            metadata: Stored beside the owner (see :func:`celery_steplock.lock.holder_metadata`).

        Returns:
            The :class:`~celery_steplock.lease.Lease`, or None when another owner holds it
            and ``wait`` seconds passed without it being released or expiring.

        Raises:
            InvalidArgument, LockNameError, MetadataError: As the sync store.
            LockStoreMisconfigured: Also when this caller would be one waiter more than
                the store allows (naming ``steplock_max_waiters``).
        """
        return (await self._acquire_for(name, owner, ttl, wait, metadata))[0]

    async def _acquire_for(
        self,
        name: str,
        owner: str | None,
        ttl: float,
        wait: float,
        metadata: Mapping[str, Any] | None,
    ) -> tuple[Lease | None, str | None, float | None]:
        generated = owner is None
        owner = new_owner_token() if owner is None else _owner(owner)
        name, ttl, metadata = _name(name), _ttl(ttl), _metadata(metadata)
        wait = _wait_seconds(wait)
        if wait <= 0:
            steps = self._try_steps(name, owner, ttl, metadata, 0.0)
            return await self._run_acquire(steps, self.client, name, owner, False, generated)
        limit = self.waiter_limit
        if self._waiting >= limit:
            steps = self._try_steps(name, owner, ttl, metadata, 0.0)
            result = await self._run_acquire(steps, self.client, name, owner, False, generated)
            if result[0] is not None:
                return result
            size = (
                self.client.connection_pool.max_connections if limit < self.max_waiters else None
            )
            raise _waiters_full(self, name, owner, limit, size)
        self._waiting += 1
        try:
            steps = self._wait_steps(name, owner, ttl, wait, metadata)
            return await self._run_acquire(steps, self.waiter_client, name, owner, True, generated)
        finally:
            self._waiting -= 1

    async def _run_acquire(
        self,
        steps: calls.Steps[tuple[Lease | None, str | None, float | None]],
        client: Any,
        name: str,
        owner: str,
        waited: bool,
        generated: bool,
    ) -> tuple[Lease | None, str | None, float | None]:
        # With a caller's owner token (which may hold the lease already), the ACQUIRE
        # script runs shielded (calls.Flight): once sent, a cancellation leaves it running,
        # and the cleanup reads its reply to release only a grant of this call. A token this
        # call generated holds nothing else: releasing by owner is right, and the shield's
        # task per call (some 30-40 us) is not paid.
        flight = None if generated else calls.Flight()
        try:
            return await calls.arun(steps, client, flight=flight)
        except asyncio.CancelledError:
            self._after_cancel(name, owner, waited, flight, generated)
            raise

    async def _in_flight_grant(self, flight: calls.Flight | None) -> bool | None:
        """Whether the ACQUIRE a cancellation cut off granted the lease afresh: False when
        none was in flight (or it refused, or re-granted), None when it failed or was not
        followed (no ``flight``)."""
        if flight is None:
            return None
        step, call = flight.step, flight.call
        if call is None or step is None or step.script is not self._acquire:
            return False
        try:
            reply = await call
        except Exception:  # noqa: BLE001 - what the script did is unknown
            return None
        return _fresh_grant(reply)

    def _after_cancel(
        self, name: str, owner: str, waited: bool, flight: calls.Flight | None, generated: bool
    ) -> None:
        async def clean() -> None:
            try:
                granted = await self._in_flight_grant(flight)
                steps = self._cancelled_steps(name, owner, waited, granted, generated)
                await calls.arun(steps, self.client)
            except Exception as exc:  # noqa: BLE001 - a background task: logged, left to the TTL
                log_event(
                    "release_failed",
                    logging.WARNING,
                    key=self.key(name),
                    owner=owner,
                    error=exc,
                    reason="after a cancelled acquire; the lease (if granted) expires with its TTL",
                )

        background(clean())

    async def release(self, name: str, owner: str) -> bool:
        """Delete the lease if ``owner`` holds it, and wake one waiter.

        Returns:
            True when deleted; False (nothing changed) when the key is gone or another owner
            holds it, so releasing twice is harmless.
        """
        name, owner = _name(name), _owner(owner)
        return await calls.arun(self._release_steps(name, owner), self.client)

    async def record_history(
        self,
        name: str,
        event: str,
        *,
        owner: str | None = None,
        fence: int | None = None,
        task_id: str | None = None,
        reason: str | None = None,
        by: str | None = None,
    ) -> str | None:
        """Append an event only a client sees (``lost``) to a name's history, as
        :meth:`RedisLeaseStore.record_history
        <celery_steplock.lock.RedisLeaseStore.record_history>` (one call).

        Returns:
            The history's key; None when this store keeps no history.

        Raises:
            InvalidArgument: ``event`` is not one of the events.
            LockStoreUnavailable: Redis cannot be reached.
            LockStoreMisconfigured: Redis refused the write (ACL: ``lpush``).
        """
        request = _history_add_request(
            self.prefix, self.history_config, name, event, owner, fence, task_id, reason, by
        )
        if request is None:
            return None
        keys, args = request
        steps = self._call_steps(self._history_add, keys, args, "history", _name(name), owner)
        await calls.arun(steps, self.client)
        return keys[0]

    async def forced(self, name: str, owner: str) -> dict[str, Any] | None:
        """The operator's record a force release of ``owner``'s lease left, or None: as
        :meth:`RedisLeaseStore.forced <celery_steplock.lock.RedisLeaseStore.forced>` (one
        GET).

        Raises:
            LockStoreUnavailable: Redis cannot be reached.
            LockStoreMisconfigured: Redis refused the read (ACL).
        """
        name, owner = _name(name), _owner(owner)
        key = forced_key(self.prefix, name)
        try:
            raw = await self.client.get(key)
        except STORE_ERRORS as exc:
            raise store_error(exc, "force release mark", key=key, name=name, owner=owner) from exc
        return parse_forced(raw, owner)

    async def extend(self, name: str, owner: str, ttl: float) -> bool:
        """Reset the lease's TTL to ``ttl`` seconds if ``owner`` holds it.

        Returns:
            True when extended; False (nothing changed) when the key is gone or another
            owner holds it.
        """
        name, owner, ttl = _name(name), _owner(owner), _ttl(ttl)
        steps = self._call_steps(
            self._extend, [self.key(name)], [owner, _ttl_ms(ttl)], "extend", name, owner
        )
        return bool(await calls.arun(steps, self.client))

    async def owned(self, name: str, owner: str) -> float | None:
        """Whether ``owner`` holds the lease, in one round trip (a read).

        Returns:
            Seconds left on the lease if ``owner`` holds it, else None.
        """
        name, owner = _name(name), _owner(owner)
        steps = self._call_steps(
            self._owned, [self.key(name)], [owner], "ownership check", name, owner, writes=False
        )
        return _owned_seconds(await calls.arun(steps, self.client))

    async def extend_many(
        self, items: Iterable[tuple[str, str, float]], chunk: int = EXTEND_CHUNK
    ) -> list[bool]:
        """Extend many leases in one pipelined round trip (the async heartbeat's renewals),
        ``chunk`` leases per script call; on a Cluster, one call per slot, one pipeline per
        node, all in flight at once.

        Args:
            items: ``(name, owner, ttl seconds)`` per lease.
            chunk: Leases per script call.

        Returns:
            One bool per item, as :meth:`extend`.

        Raises:
            LockStoreUnavailable: The round trip failed or Redis refused a call (on a
                Cluster, its ``context["results"]`` holds True/False for the items of the
                nodes that answered, None for the others).
            LockStoreMisconfigured: Redis refused a permission or our credentials.
        """
        checked = RedisLeaseStore._checked_items(items)
        chunk = _argument(check_count, chunk, "chunk", minimum=1, maximum=MAX_SCAN_COUNT)
        if not checked:
            return []
        return await calls.arun(self._extend_many_steps(checked, chunk), self.client)

    def _extend_many_steps(
        self, items: list[tuple[str, str, float]], chunk: int
    ) -> calls.Steps[list[bool]]:
        if not self._probed:
            yield from self._probe_steps("renewal", None, None, None)
        members: list[list[int]] | None = None
        if aio.is_async_cluster(self.client):
            members, batch = _by_slot(self.prefix, items, chunk)
        else:
            batch = list(_extend_many_calls(self.prefix, items, chunk))
        try:
            replies = yield calls.EvalMany(self._extend_many, batch, "renewal")
        except LockError as exc:
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            error = _unavailable_unless_misconfigured(cause, "renewal")
            if members is not None:
                error.context["results"] = [None] * len(items)
            raise error from cause
        if members is None:
            return _extend_many_results(replies)
        results: list[bool | None] = [None] * len(items)
        failed = None
        for part, reply in zip(members, replies):
            if isinstance(reply, BaseException):
                failed = failed or reply
                continue
            for n, c in zip(part, wire.text(reply)):
                results[n] = c == "1"
        if failed is not None:
            error = _unavailable_unless_misconfigured(failed, "renewal", refused=True)
            error.context["results"] = results
            raise error
        return results  # type: ignore[return-value]

    async def inspect(self, name: str) -> dict[str, Any] | None:
        """Read one lease (one script call), as :meth:`RedisLeaseStore.inspect`.

        Returns:
            The lease's stored fields plus ``name``, ``key`` and ``ttl`` (seconds left);
            None when not held.
        """
        key = self.key(_name(name))
        reply = await calls.arun(
            _one(calls.Eval(self._scan_fields, [key], [], "inspect", name=name)), self.client
        )
        return _inspected(self, key, name, reply)

    def lease(
        self,
        name: str,
        ttl: float = 30.0,
        *,
        wait: float = 0.0,
        owner: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        renew: bool = True,
        ratio: float = 1 / 3,
        sender: Any = None,
        max_hold: float | None = None,
    ) -> LeaseContext:
        """``async with store.lease(name, ttl=..., wait=...) as lease:`` hold a lease for
        the block.

        Acquires it (waiting at most ``wait`` seconds), has the running loop's
        :class:`~celery_steplock.aio.heartbeat.AsyncHeartbeat` renew it every
        ``ttl * ratio`` seconds when ``renew`` (so it may be held across awaits longer than
        its TTL; check ``lease.check()`` before a commit), and releases it when the block
        exits, however it exits. The release is sent from a task of its own, shielded: a
        cancellation of the block (or of the wait for the release) still sends it; when it
        cannot be sent (Redis unreachable) the lease is left to its TTL, never to another
        owner. A failed release is logged (``release_failed``), not raised.

        Args:
            name: The lock name.
            ttl: The lease's lifetime in seconds.
            wait: Seconds to wait for it (default 0: one attempt).
            owner: The owner token; a fresh one when None.
            metadata: Stored beside the owner.
            renew: Renew it while the block runs (default True).
            ratio: Renewal interval as a fraction of ``ttl`` (as the heartbeat's).
            sender: The sender of its ``lock_extended``/``lock_lost`` signals.
            max_hold: Seconds after the acquisition at which renewals stop, or None.

        Raises:
            LockContended: Another owner holds the lease (``holder``, ``ttl`` as known).
            InvalidArgument, LockNameError, MetadataError, LockStoreUnavailable,
            LockStoreMisconfigured: As :meth:`acquire`.
        """
        return LeaseContext(self, name, ttl, wait, owner, metadata, renew, ratio, sender, max_hold)


class LeaseContext:
    """The async context manager of :meth:`AsyncRedisLeaseStore.lease`; ``lease`` is the
    granted :class:`~celery_steplock.lease.Lease` once entered."""

    def __init__(
        self,
        store: AsyncRedisLeaseStore,
        name: str,
        ttl: float,
        wait: float,
        owner: str | None,
        metadata: Mapping[str, Any] | None,
        renew: bool,
        ratio: float,
        sender: Any,
        max_hold: float | None,
    ) -> None:
        self.store = store
        self.name = name
        self.ttl = ttl
        self.wait = wait
        self.owner = owner
        self.metadata = metadata
        self.renew = renew
        self.ratio = ratio
        self.sender = sender
        self.max_hold = max_hold
        self.lease: Lease | None = None

    async def __aenter__(self) -> Lease:
        store = self.store
        lease, holder, holder_ttl = await store._acquire_for(
            self.name, self.owner, self.ttl, self.wait, self.metadata
        )
        if lease is None:
            who = f"owner {holder}" if holder else "another owner (released since)"
            raise LockContended(
                f"{self.name!r} is held by {who}",
                key=store.key(_name(self.name)),
                holder=holder,
                ttl=holder_ttl,
                name=self.name,
            )
        if self.renew:
            try:
                get_async_heartbeat().register(
                    lease, store, ratio=self.ratio, sender=self.sender, max_hold=self.max_hold
                )
            except BaseException:
                background(_release(store, lease))
                raise
        self.lease = lease
        return lease

    async def __aexit__(self, *exc_info: Any) -> None:
        lease = self.lease
        if lease is None:
            return
        self.lease = None
        if self.renew:
            get_async_heartbeat().unregister(lease)
        # Shielded: a cancellation of this await leaves the release task running.
        await asyncio.shield(background(_release(self.store, lease)))


async def _release(store: AsyncRedisLeaseStore, lease: Lease) -> bool | None:
    """Release ``lease``; an error is logged (``release_failed``), the lease then expires."""
    try:
        return await store.release(lease.name, lease.owner)
    except Exception as exc:  # noqa: BLE001 - the holder's outcome must not be masked
        log_event("release_failed", logging.WARNING, key=lease.key, owner=lease.owner, error=exc)
        return None


def _one(step: calls.Step) -> calls.Steps[Any]:
    return (yield step)


def _dropped(error: LockError) -> bool:
    import redis

    return isinstance(error, LockStoreUnavailable) and isinstance(
        error.__cause__, redis.ConnectionError
    )


def _socket_timeout(client: Any) -> float | None:
    """The asyncio client's per-call socket timeout, seconds (None: none set)."""
    import redis.asyncio

    if aio.is_async_cluster(client):
        kwargs = client.get_connection_kwargs()
        return wire.effective_socket_timeout(
            kwargs, kwargs.get("connection_class", redis.asyncio.Connection)
        )
    pool = getattr(client, "connection_pool", None)
    if pool is None:
        return None
    return wire.effective_socket_timeout(pool.connection_kwargs, pool.connection_class)


def _by_slot(
    prefix: str, items: list[tuple[str, str, float]], chunk: int
) -> tuple[list[list[int]], list[wire.Call]]:
    """EXTEND_MANY calls of ``items`` for a Cluster: one per slot (at most ``chunk`` leases
    each), and the positions of the items of each call."""
    keys = lease_keys(prefix, [name for name, _owner, _ttl in items])
    members: list[list[int]] = []
    batch: list[wire.Call] = []
    for positions in cluster.by_slot(keys).values():
        for start in range(0, len(positions), chunk):
            part = positions[start : start + chunk]
            argv: list[str] = []
            for n in part:
                argv.append(items[n][1])
                argv.append(_ttl_ms(items[n][2]))
            batch.append(([keys[n] for n in part], argv))
            members.append(part)
    return members, batch


def get_async_lease_store(app: Any = None) -> AsyncRedisLeaseStore:
    """The app's lease store for the running event loop.

    The store of :func:`celery_steplock.lock.get_lease_store` (same ``prefix``,
    ``fence_ttl``, ``max_waiters``, ``name_secret`` and clock) on the ``redis.asyncio`` twin
    of its client (:func:`celery_steplock.clients.async_client_for`), one per loop.

    Args:
        app: The Celery app (default ``celery.current_app``).

    Returns:
        The :class:`AsyncRedisLeaseStore`.

    Raises:
        RuntimeError: No event loop is running.
        ImproperlyConfigured: A setting of the store is invalid (naming it).
    """
    if app is None:
        from celery import current_app

        app = current_app._get_current_object()  # type: ignore[attr-defined]
    return async_store_for(get_lease_store(app))


def async_store_for(store: Any) -> AsyncRedisLeaseStore:
    """The asyncio twin of a synchronous lease store for the running event loop: an
    :class:`AsyncRedisLeaseStore` on :func:`~celery_steplock.clients.async_client_for` of
    its client, with its ``prefix``, ``fence_ttl``, ``max_waiters``, ``name_secret`` and
    clock (so the same keys, fencing tokens and bounds), built once per loop and store.

    Args:
        store: A :class:`~celery_steplock.lock.RedisLeaseStore`, or an
            :class:`AsyncRedisLeaseStore` (returned as it is).

    Returns:
        The :class:`AsyncRedisLeaseStore`.

    Raises:
        RuntimeError: No event loop is running.
    """
    if isinstance(store, AsyncRedisLeaseStore):
        return store
    # In the loop's room, by the sync store's id with a weak reference to tell a reused id
    # apart; its client (the twin) is closed with the loop.
    stores = _loops.room().values
    found = stores.get(("store", id(store)))
    if found is not None and found[0]() is store:
        return found[1]
    twin = AsyncRedisLeaseStore(
        async_client_for(store.client),
        prefix=store.prefix,
        fence_ttl=store.fence_ttl,
        clock=store.clock,
        max_waiters=store.max_waiters,
        name_secret=store.name_secret,
        **_history_twin(store),
    )
    stores[("store", id(store))] = (weakref.ref(store), twin)
    return twin


def _history_twin(store: Any) -> dict[str, Any]:
    """The history arguments of a sync store's async twin: the same bounds, or off."""
    config = getattr(store, "history_config", None)
    if config is None:
        return {"history": False}
    return {"history_max_entries": config.max_entries, "history_max_age": config.max_age}
