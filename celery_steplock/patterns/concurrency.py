"""Cluster-wide concurrency limit (the bulkhead pattern): at most N executions per key at once, across
every worker of the cluster.

A limit of N on the key ``K`` is N possible **slots**, each an ordinary lease of the lease
store named ``"K}#i"`` (``i`` in ``0 .. N-1``), whose Redis key
``<prefix>:lease:{K}#i}`` has the hash tag ``K``: every slot of one limit, its fencing
counter and its waiters live in one Redis Cluster slot, so one script decides. A slot is
owner-keyed (a fresh owner token per execution), expires with its TTL, carries a fencing
token, is renewed by the process's heartbeat like any lease, listed by ``celery steplock ls``
and the admin (its metadata says ``kind=slot``, ``limit``, ``limit_key``), reaped when its
holder died, and can be force-released. A slot name holds ``}``, which no lock name may, so
slots and task leases never share a name.

Fairness: a denied caller that will come back (a re-queued task: its task id; a waiting
:meth:`ConcurrencyLimit.acquire`: its owner token) is a *waiter*, queued by the time it was
first denied. A free slot goes to one of the ``free`` oldest waiters, or to a newcomer only
when fewer callers wait than slots are free; a waiter that stops coming back for
``waiter_ttl`` seconds leaves the queue. So a newcomer never overtakes a waiter.

Keys (``prefix`` is ``steplock_key_prefix``): ``<prefix>:lease:{K}#i}`` (slot ``i``),
``<prefix>:bulkhead:{K}:fence`` (fencing counter), ``<prefix>:bulkhead:{K}:queue`` (waiters
by first-denied time, Redis ms) and ``<prefix>:bulkhead:{K}:alive`` (waiters by the Redis
ms their entry expires).

Async: the same :class:`ConcurrencyLimit` serves asyncio code on the same slots (a sync
holder and an async one share one limit): ``async with limit.acquire(...)``, ``await
limit.aacquire(...)`` / ``await slot.arelease()``, ``@limit.using(...)`` on an ``async
def``. Its slots are leases of the asyncio twin of the same lease store
(:class:`celery_steplock.aio.lock.AsyncRedisLeaseStore`), renewed across awaits by the
event loop's heartbeat (:func:`celery_steplock.aio.heartbeat.get_async_heartbeat`); a wait
pauses with ``asyncio.sleep``. The decision and the wait are written once as
:mod:`celery_steplock.calls` steps for both forms.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import calls, signals
from .._checks import CLOCK_SKEW_TOLERANCE, check_seconds, check_ttl, shown
from .._jitter import full_jitter
from .._loops import background
from .._redis import wire
from .._redis.scripts.concurrency import ACQUIRE_SLOT, LEAVE_QUEUE
from ..events import emit, lease_fields, log_event
from ..exceptions import (
    ConcurrencyLimited,
    ImproperlyConfigured,
    LockNameError,
    LockStoreUnavailable,
)
from ..keys import (
    MAX_NAME_LENGTH,
    argument_names,
    bind_arguments,
    check_name,
    concurrency_keys,
    parse_slot_name,
    render_template,
    slot_key,
    slot_name,
    template_fields,
)
from ..lease import Lease, drift, holder_metadata, new_owner_token
from ..lock import WAITS, RedisLeaseStore, pack_metadata
from ._base import check_on_store_error, clock_skew, outage, resolve_policy, target

__all__ = [
    "ConcurrencyLimit",
    "Slot",
    "SlotHold",
    "current_slot",
    "slot_name",
    "parse_slot_name",
    "OPTIONS",
    "gate",
    "MAX_LIMIT",
    "ACQUIRE_SLOT",
    "SLOT_KIND",
]

#: The task options of this gate (:mod:`celery_steplock.patterns.gates`).
OPTIONS = frozenset({"concurrency_limit", "concurrency_limit_key"})

#: The largest limit (slots per key): each decision reads every slot of its key.
MAX_LIMIT = 1000

#: ``kind`` in a slot's lease metadata.
SLOT_KIND = "slot"

#: Seconds at least a waiter's queue entry lives without the waiter coming back.
MIN_WAITER_TTL = 10.0

_current: contextvars.ContextVar[tuple] = contextvars.ContextVar("steplock_slots", default=())


def current_slot() -> Slot | None:
    """The :class:`Slot` the running task holds (its ``concurrency_limit``), or the innermost
    one of :meth:`ConcurrencyLimit.acquire`; None outside of either. A body that works in
    units calls ``current_slot().check()`` between them: a slot lost (its holder stopped past
    its TTL, or the heartbeat found it taken over) raises :class:`LockLost`."""
    held = _current.get()
    return held[-1] if held else None


@dataclass(eq=False)
class Slot:
    """One held slot of a :class:`ConcurrencyLimit`: ``key`` (the limit key), ``index``
    (0-based), ``lease`` (the slot's :class:`~celery_steplock.lease.Lease`: ``owner``,
    ``fence``, ``ttl`` seconds, ``lost``)."""

    limit: ConcurrencyLimit
    key: str
    index: int
    lease: Lease
    store: Any = field(repr=False)
    sender: Any = field(default=None, repr=False)
    released: bool = False
    #: The asyncio heartbeat renewing the slot (:meth:`ConcurrencyLimit.aacquire`), which
    #: :meth:`arelease` unregisters it from; None otherwise.
    heartbeat: Any = field(default=None, repr=False)

    @property
    def owner(self) -> str:
        return self.lease.owner

    @property
    def fence(self) -> int:
        return self.lease.fence

    @property
    def lost(self) -> bool:
        return self.lease.lost

    def check(self) -> None:
        """Raise :class:`LockLost` if the slot can no longer be trusted (see
        :meth:`celery_steplock.lease.Lease.check`)."""
        self.lease.check()

    def release(self) -> bool:
        """Give the slot back (owner-checked: a slot taken over since is left to its new
        holder). Returns whether this call freed it; never raises (a Redis error is logged:
        the TTL frees the slot). Emits ``slot_released``, or ``slot_expired`` when the slot
        was lost before. From a coroutine, use :meth:`arelease`."""
        if self.released:
            return False
        self.released = True
        freed = False
        error = None
        try:
            freed = self.store.release(self.lease.name, self.lease.owner)
        except Exception as exc:  # noqa: BLE001 - the TTL frees the slot
            error = exc
        return self._report(freed, error)

    async def arelease(self) -> bool:
        """:meth:`release` as a coroutine, on the ``redis.asyncio`` lease store (a slot
        taken by the sync API is released through its store's asyncio twin); first stops
        the asyncio heartbeat's renewals of it. The release is shielded: a caller cancelled
        meanwhile still frees the slot (the release finishes in the background). Returns
        whether this call freed it; never raises but ``CancelledError``."""
        if self.released:
            return False
        self.released = True
        if self.heartbeat is not None:
            self.heartbeat.unregister(self.lease)
        freed = False
        error = None
        try:
            store = _async_store(self.store)
            pending = background(store.release(self.lease.name, self.lease.owner))
            freed = await asyncio.shield(pending)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the TTL frees the slot
            error = exc
        return self._report(freed, error)

    def _report(self, freed: bool, error: BaseException | None) -> bool:
        if error is not None:
            log_event(
                "release_failed",
                logging.WARNING,
                key=self.lease.key,
                owner=self.lease.owner,
                error=error,
            )
        fields = self.limit._fields(self.key, self.lease, slot=self.index)
        if self.lease.lost or (not freed and error is None):
            emit(
                signals.slot_expired,
                self.sender,
                logging.WARNING,
                reason=self.lease.lost_reason or "the slot was gone or taken over at release",
                **fields,
            )
        else:
            emit(
                signals.slot_released,
                self.sender,
                logging.INFO,
                hold_seconds=self.lease.clock() - self.lease.acquired_at,
                **fields,
            )
        return bool(freed)

    async def __aenter__(self) -> Slot:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.arelease()


class ConcurrencyLimit:
    """At most ``limit`` executions per key across the cluster at once.

    ``limit``: int, 1 to :data:`MAX_LIMIT`. ``key``: the limit key: a :meth:`str.format`
    template over the task's (or decorated function's) argument names (plain names only,
    as ``lock_key``), a callable of the bound arguments returning a str, or None (one limit
    per task name; for the plain API, the ``key=`` given to :meth:`acquire` or the
    function's qualified name). ``ttl``: seconds (0.05 to 86400) a slot lives without
    renewal; None: the task's lease TTL (``lock_ttl``), or ``steplock_default_ttl`` for the
    plain API. ``on_store_error``: ``"fail_closed"`` (Redis down: the task is retried, the
    plain API raises :class:`LockStoreUnavailable`) or ``"fail_open"`` (it runs without a
    slot); None: ``steplock_concurrency_limit_on_store_error``. ``retry_after``: seconds at most a
    denied execution is told to wait (None: ``steplock_concurrency_limit_retry_after``).
    ``waiter_ttl``: seconds a waiter's place is kept without it coming back (None: ten
    times ``retry_after``, at least 10).

    Invalid values raise :class:`ImproperlyConfigured` naming ``concurrency_limit`` (the
    limit, ttl, on_store_error, retry_after, waiter_ttl) or ``concurrency_limit_key``.
    """

    def __init__(
        self,
        limit: int,
        key: str | Callable[..., str] | None = None,
        ttl: float | None = None,
        on_store_error: str | None = None,
        *,
        retry_after: float | None = None,
        waiter_ttl: float | None = None,
    ):
        option = "concurrency_limit"
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            raise ImproperlyConfigured(
                f"{option} must be an int from 1 to {MAX_LIMIT} (executions at once), or a "
                f"ConcurrencyLimit, got {shown(limit)}",
                setting=option,
            )
        self.limit = limit
        self.key = check_key_template(key)
        self.ttl = None if ttl is None else _option(check_ttl, ttl, f"{option} ttl")
        self.on_store_error = check_on_store_error(
            on_store_error, f"{option} on_store_error", setting=option
        )
        self.retry_after = (
            None
            if retry_after is None
            else _option(check_seconds, retry_after, f"{option} retry_after", maximum=3600.0)
        )
        self.waiter_ttl = (
            None
            if waiter_ttl is None
            else _option(check_seconds, waiter_ttl, f"{option} waiter_ttl", maximum=86400.0)
        )
        self._scripts: dict[int, tuple[Any, wire.Script, wire.Script]] = {}
        self._guard = threading.Lock()

    def __repr__(self) -> str:
        return f"ConcurrencyLimit({self.limit}, key={self.key!r})"

    def describe(self) -> str:
        return f"{self.limit} at once"

    # -- keys ---------------------------------------------------------------------------------

    def render(
        self, default: str, arguments: dict[str, Any] | None = None, template: Any = None
    ) -> str:
        """The limit key for these bound ``arguments``: ``template`` (or this limit's
        ``key``) formatted, or ``default`` without one. Raises :class:`LockNameError`."""
        template = self.key if template is None else template
        if template is None:
            return checked_key(default)
        if callable(template):
            return checked_key(template(**(arguments or {})))
        try:
            return checked_key(render_template(template, arguments or {}, "concurrency_limit_key"))
        except (KeyError, IndexError, AttributeError, ValueError) as exc:
            raise LockNameError(
                f"concurrency_limit_key {shown(template)} cannot format these arguments: {exc!r}"
            ) from None

    @staticmethod
    def redis_keys(prefix: str, key: str, limit: int) -> list[str]:
        """The KEYS of :data:`ACQUIRE_SLOT` for ``limit`` slots of ``key``."""
        return [slot_key(prefix, key, i) for i in range(limit)] + list(
            concurrency_keys(prefix, key)
        )

    # -- settings -----------------------------------------------------------------------------

    def policy(self, settings: Any = None) -> str:
        """The outage policy of this limit.

        Args:
            settings: the app's settings (None: no app).

        Returns:
            ``on_store_error``, else ``steplock_concurrency_limit_on_store_error``, else
            ``"fail_closed"``.
        """
        return resolve_policy(self.on_store_error, settings, "concurrency_limit_on_store_error")

    def max_retry_after(self, settings: Any = None) -> float:
        if self.retry_after is not None:
            return self.retry_after
        return settings.concurrency_limit_retry_after if settings is not None else 0.5

    def queue_ttl(self, settings: Any = None) -> float:
        if self.waiter_ttl is not None:
            return self.waiter_ttl
        return max(MIN_WAITER_TTL, 10 * self.max_retry_after(settings))

    def _outage_fields(self, exc: LockStoreUnavailable, key: str) -> dict[str, Any]:
        return {
            "pattern": "concurrency limit",
            "key": exc.key,
            "name": key,
            "limit_key": key,
            "limit": self.limit,
        }

    def _fields(self, key: str, lease: Lease | None, **extra: Any) -> dict[str, Any]:
        fields = lease_fields(lease)
        fields.update(limit_key=key, limit=self.limit, **extra)
        return fields

    # -- one decision -------------------------------------------------------------------------

    def _scripts_for(self, store: Any) -> tuple[wire.Script, wire.Script]:
        if not isinstance(store, RedisLeaseStore):
            # asyncio stores (one per event loop) share one pair: none is kept alive here
            store = None
        entry = self._scripts.get(id(store))
        if entry is None or entry[0] is not store:
            with self._guard:
                entry = (store, wire.Script(ACQUIRE_SLOT), wire.Script(LEAVE_QUEUE))
                self._scripts[id(store)] = entry
        return entry[1], entry[2]

    def try_acquire(
        self,
        store: Any,
        key: str,
        *,
        owner: str,
        ticket: str | None,
        ttl: float,
        metadata: dict[str, Any],
        settings: Any = None,
        sender: Any = None,
    ) -> Slot:
        """One decision on ``key`` through the lease store ``store``: the granted
        :class:`Slot` (not yet renewed by a heartbeat), or :class:`ConcurrencyLimited` with
        ``retry_after`` (seconds). ``ticket``: the caller's place in the waiters' queue
        (None: a newcomer that will not come back). Raises LockStoreUnavailable (Redis
        down), LockError (Redis refused). The coroutine form is :meth:`atry_acquire`."""
        steps = self._acquire_steps(store, key, owner, ticket, ttl, metadata, settings, sender)
        if not store._probed:
            store.check_permissions(what="slot acquire", key=slot_key(store.prefix, key, 0))
        return calls.run(steps, store.client)

    async def atry_acquire(
        self,
        store: Any,
        key: str,
        *,
        owner: str,
        ticket: str | None,
        ttl: float,
        metadata: dict[str, Any],
        settings: Any = None,
        sender: Any = None,
    ) -> Slot:
        """:meth:`try_acquire` as a coroutine: the same decision, keys and signals through
        an :class:`~celery_steplock.aio.lock.AsyncRedisLeaseStore` (a synchronous store is
        replaced by its asyncio twin on the running loop: same client settings, prefix,
        fencing). The granted :class:`Slot` is not renewed yet (register it with
        :func:`celery_steplock.aio.heartbeat.get_async_heartbeat`, or use :meth:`aacquire`).

        Raises:
            ConcurrencyLimited: No slot for this caller now (``retry_after`` seconds).
            LockStoreUnavailable: Redis does not answer.
            LockError: Redis refused the call.
        """
        store = _async_store(store)
        steps = self._acquire_steps(store, key, owner, ticket, ttl, metadata, settings, sender)
        await self._aprobe(store, key)
        return await calls.arun(steps, store.client)

    @staticmethod
    async def _aprobe(store: Any, key: str) -> None:
        if not getattr(store, "_probed", False):
            await store.check_permissions(what="slot acquire", key=slot_key(store.prefix, key, 0))

    def _acquire_steps(
        self,
        store: Any,
        key: str,
        owner: str,
        ticket: str | None,
        ttl: float,
        metadata: dict[str, Any],
        settings: Any,
        sender: Any,
    ) -> calls.Steps[Slot]:
        """One decision, written once (:mod:`celery_steplock.calls`) for both forms."""
        acquire, _leave = self._scripts_for(store)
        ttl_ms = max(1, int(ttl * 1000))
        keys = self.redis_keys(store.prefix, key, self.limit)
        args = [
            owner,
            str(ttl_ms),
            str(max(ttl_ms, int(store.fence_ttl * 1000))),
            ticket or "",
            str(int(self.queue_ttl(settings) * 1000)),
            pack_metadata(metadata),
            str(int(CLOCK_SKEW_TOLERANCE * 1000)),
        ]
        sent = store.clock()
        reply = yield calls.Eval(acquire, keys, args, "slot acquire", name=key)
        skew = int(reply[-1]) / 1000.0
        if skew > 0:
            clock_skew(
                skew,
                "waiters",
                pattern="concurrency limit",
                sender=sender,
                key=key,
                name=None,
                task_id=metadata.get("task_id"),
                task_name=metadata.get("task_name"),
                limit_key=key,
                limit=self.limit,
            )
        if int(reply[0]) == 1:
            index, fence = int(reply[1]), int(reply[2])
            lease = Lease(
                name=slot_name(key, index),
                key=keys[index],
                owner=owner,
                fence=fence,
                ttl=ttl,
                acquired_at=sent,
                valid_until=sent + ttl - drift(ttl),
                task_id=metadata.get("task_id"),
                task_name=metadata.get("task_name"),
                clock=store.clock,
                secret=store.name_secret,
            )
            slot = Slot(self, key, index, lease, store, sender)
            emit(
                signals.slot_acquired, sender, logging.INFO, **self._fields(key, lease, slot=index)
            )
            return slot
        free, waiting, rank, min_pttl = (int(x) for x in reply[1:5])
        cap = self.max_retry_after(settings)
        retry_after = cap if free or min_pttl < 0 else min(cap, min_pttl / 1000.0)
        retry_after = max(0.05, retry_after)
        fields = self._fields(
            key, None, task_id=metadata.get("task_id"), task_name=metadata.get("task_name")
        )
        emit(
            signals.concurrency_limited,
            sender,
            logging.INFO,
            retry_after=retry_after,
            free=free,
            waiting=waiting,
            rank=None if rank < 0 else rank,
            **{k: v for k, v in fields.items() if k not in ("key", "name", "owner", "fence")},
            key=key,
            name=None,
            owner=owner,
            fence=None,
        )
        raise ConcurrencyLimited(
            f"concurrency limit {key!r}: all {self.limit} slot(s) held"
            + (f" or kept for {waiting} older waiter(s)" if free else ""),
            retry_after=retry_after,
            option="concurrency_limit",
            key=key,
            limit=self.describe(),
            free=free,
            waiting=waiting,
            rank=rank,
        )

    def leave_queue(self, store: Any, key: str, ticket: str) -> None:
        """Remove ``ticket`` from ``key``'s waiters (a caller that gave up); never raises."""
        calls.run(self._leave_steps(store, key, ticket), store.client)

    async def aleave_queue(self, store: Any, key: str, ticket: str) -> None:
        """:meth:`leave_queue` as a coroutine (on ``store``'s asyncio twin); never raises."""
        store = _async_store(store)
        await calls.arun(self._leave_steps(store, key, ticket), store.client)

    def _leave_steps(self, store: Any, key: str, ticket: str) -> calls.Steps[None]:
        _acquire, leave = self._scripts_for(store)
        _fence, queue, alive = concurrency_keys(store.prefix, key)
        try:
            yield calls.Eval(leave, [queue, alive], [ticket], "slot queue leave", name=key)
        except Exception:  # noqa: BLE001 - the entry expires with its waiter TTL
            pass

    def _wait_steps(self, store: Any, hold: _Request) -> calls.Steps[Slot]:
        """Decide until a slot is granted or ``hold.wait`` seconds passed, pausing half
        to all of the denial's ``retry_after`` (jittered) between decisions: written once,
        the pause is ``time.sleep`` in the sync form, ``asyncio.sleep`` in the async one."""
        deadline = time.monotonic() + hold.wait
        waiting = None  # WAITS' token once denied: a wait really happens
        try:
            while True:
                try:
                    return (
                        yield from self._acquire_steps(
                            store,
                            hold.key,
                            hold.owner,
                            hold.owner if hold.wait > 0 else None,
                            hold.ttl,
                            hold.metadata,
                            hold.settings,
                            None,
                        )
                    )
                except ConcurrencyLimited as exc:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise
                    if waiting is None:
                        waiting = WAITS.start("concurrency", hold.key)
                    half = 0.5 * exc.retry_after
                    yield calls.Sleep(min(left, full_jitter(half, after=half)))
        finally:
            if waiting is not None:
                WAITS.end(waiting)

    # -- the plain API ------------------------------------------------------------------------

    def _store(self, app: Any, client: Any, prefix: str | None):
        if app is None and client is None:
            raise ImproperlyConfigured(
                "ConcurrencyLimit.acquire needs app= (a Celery app) or client= (a redis client)",
                setting="concurrency_limit",
            )
        where = target(app, client=client, prefix=prefix)
        if where.store is not None:
            return where.store, where.settings
        with self._guard:  # a bare client's slots are leases of a store of its own
            stores = self.__dict__.setdefault("_client_stores", {})
            store = stores.get((id(client), prefix))
            if store is None or store.client is not client:
                store = RedisLeaseStore(client, prefix=where.prefix)
                stores[(id(client), prefix)] = store
        return store, where.settings

    def _request(
        self,
        key: str | None,
        app: Any,
        client: Any,
        prefix: str | None,
        wait: float,
        ttl: float | None,
        arguments: dict[str, Any] | None,
        default_key: str | None,
    ) -> _Request:
        """The checked arguments of one :meth:`acquire` (nothing sent to Redis yet)."""
        store, settings = self._store(app, client, prefix)
        wait = _option(check_seconds, wait, "wait", allow_zero=True, maximum=86400.0)
        if key is not None:
            key = checked_key(key)
        elif self.key is not None and (arguments is not None or callable(self.key)):
            key = self.render("", arguments)
        elif default_key is not None and self.key is None:
            key = checked_key(default_key)
        else:
            raise ImproperlyConfigured(
                "ConcurrencyLimit.acquire needs key= (the limit key), "
                "or arguments= for its key template",
                setting="concurrency_limit_key",
            )
        ttl = ttl if ttl is not None else self.ttl
        if ttl is None:
            ttl = settings.default_ttl if settings is not None else 30.0
        ttl = _option(check_ttl, ttl, "ttl")
        ratio = settings.renewal_ratio if settings is not None else 1 / 3
        metadata = holder_metadata(
            renew_ms=int(ttl * ratio * 1000), kind=SLOT_KIND, limit=self.limit, limit_key=key
        )
        return _Request(store, settings, key, wait, ttl, ratio, new_owner_token(), metadata)

    def _held(self, hold: _Request) -> Slot | None:
        """The sync form of :meth:`aacquire`: a slot renewed by the process's heartbeat."""
        from ..heartbeat import get_heartbeat

        store = hold.store
        slot = None
        steps = self._wait_steps(store, hold)
        try:
            if not store._probed:
                store.check_permissions(
                    what="slot acquire", key=slot_key(store.prefix, hold.key, 0)
                )
            slot = calls.run(steps, store.client)
        except LockStoreUnavailable as exc:
            return outage(exc, self.policy(hold.settings), **self._outage_fields(exc, hold.key))
        finally:
            steps.close()  # its wait ends now, also when an exception cut the sleep short
            if slot is None and hold.wait > 0:
                self.leave_queue(store, hold.key, hold.owner)
        get_heartbeat().register(slot.lease, store, ratio=hold.ratio)
        return slot

    def acquire(
        self,
        key: str | None = None,
        *,
        app: Any = None,
        client: Any = None,
        prefix: str | None = None,
        wait: float = 0.0,
        ttl: float | None = None,
        arguments: dict[str, Any] | None = None,
        default_key: str | None = None,
    ) -> SlotHold:
        """Context manager: hold one slot of ``key`` (or this limit's template rendered over
        ``arguments``) for the block, renewed while it runs, released at exit.

        ``with limit.acquire(...) as slot:`` waits with ``time.sleep`` and is renewed by the
        process's heartbeat thread; ``async with limit.acquire(...) as slot:`` waits with
        ``asyncio.sleep`` and is renewed by the event loop's heartbeat
        (:func:`celery_steplock.aio.heartbeat.get_async_heartbeat`), on the asyncio twin of
        the same store (one slot set for both forms). Arguments are checked on entry.

        ``app``: a Celery app (its lease store and settings), or ``client``: a redis client
        (keys under ``prefix``, default ``"steplock"``). ``wait``: seconds to keep trying
        (0: one decision; a waiting caller keeps its place in the queue). ``ttl``: seconds.
        Yields the :class:`Slot` (None when Redis is down and the policy is fail_open).
        Raises :class:`ConcurrencyLimited` (``retry_after``) when no slot came within
        ``wait``, LockStoreUnavailable (fail_closed), ImproperlyConfigured."""
        return SlotHold(
            self,
            dict(
                key=key,
                app=app,
                client=client,
                prefix=prefix,
                wait=wait,
                ttl=ttl,
                arguments=arguments,
                default_key=default_key,
            ),
        )

    async def aacquire(
        self,
        key: str | None = None,
        *,
        app: Any = None,
        client: Any = None,
        prefix: str | None = None,
        wait: float = 0.0,
        ttl: float | None = None,
        arguments: dict[str, Any] | None = None,
        default_key: str | None = None,
    ) -> Slot | None:
        """Take one slot as :meth:`acquire` does under ``async with``, and return it: the
        caller gives it back with ``await slot.arelease()`` (or ``async with slot:``).
        Waits (``wait`` seconds) with ``asyncio.sleep``, never blocking the loop; the slot
        is renewed by the event loop's heartbeat until released. A caller cancelled while
        it waits leaves the queue; one cancelled while the slot's grant is in flight
        leaves that slot to its TTL (owner-keyed: never to another holder).

        Returns:
            The :class:`Slot`, or None when Redis is down and the policy is fail_open.

        Raises:
            ConcurrencyLimited: No slot came within ``wait`` (``retry_after`` seconds).
            LockStoreUnavailable: Redis does not answer and the policy is fail_closed.
            ImproperlyConfigured: A bad key, ``wait`` or ``ttl``; no ``app``/``client``.
        """
        hold = self._request(key, app, client, prefix, wait, ttl, arguments, default_key)
        return await self._aheld(hold)

    async def _forget(self, store: Any, hold: _Request) -> None:
        """After a cancelled :meth:`aacquire`: free whatever slot ``hold.owner`` may have
        been granted (owner-checked releases, one per slot name, concurrently) and its
        place in the queue. Never raises: what fails is left to the TTLs."""
        names = [slot_name(hold.key, index) for index in range(self.limit)]
        await asyncio.gather(
            *(store.release(name, hold.owner) for name in names), return_exceptions=True
        )
        if hold.wait > 0:
            await self.aleave_queue(store, hold.key, hold.owner)

    async def _aheld(self, hold: _Request) -> Slot | None:
        from ..aio.heartbeat import get_async_heartbeat

        store = _async_store(hold.store)
        slot = None
        cancelled = False
        try:
            await self._aprobe(store, hold.key)
            slot = await calls.arun(self._wait_steps(store, hold), store.client)
        except LockStoreUnavailable as exc:
            return outage(exc, self.policy(hold.settings), **self._outage_fields(exc, hold.key))
        except asyncio.CancelledError:
            # A grant may be in flight (its reply never read): in the background, release
            # any slot of this owner (owner-checked) and leave the queue.
            cancelled = True
            background(self._forget(store, hold))
            raise
        finally:
            if slot is None and hold.wait > 0 and not cancelled:
                await self.aleave_queue(store, hold.key, hold.owner)
        heartbeat = get_async_heartbeat()
        heartbeat.register(slot.lease, store, ratio=hold.ratio)
        slot.heartbeat = heartbeat
        return slot

    def __call__(self, function: Callable) -> Callable:
        """Decorator: each call of ``function`` holds a slot (:meth:`acquire`) of the key
        rendered over its bound arguments (the function's qualified name without a
        template). Give the store with ``@limit.using(app=...)`` or ``client=``."""
        return self.using()(function)

    def using(
        self, *, app: Any = None, client: Any = None, prefix: str | None = None, wait: float = 0.0
    ) -> Callable[[Callable], Callable]:
        """A decorator as :meth:`__call__`, with the store and ``wait`` of :meth:`acquire`.
        An ``async def`` gets a coroutine function holding its slot with ``async with``."""

        def decorate(function: Callable) -> Callable:
            default = f"{function.__module__}.{function.__qualname__}"

            def hold(args: tuple, kwargs: dict) -> SlotHold:
                arguments = bind_arguments(function, args, kwargs) if self.key else None
                target = app
                if target is None and client is None:
                    from celery import current_app

                    target = current_app
                return self.acquire(
                    app=target,
                    client=client,
                    prefix=prefix,
                    wait=wait,
                    arguments=arguments,
                    default_key=default,
                )

            if inspect.iscoroutinefunction(function):

                @functools.wraps(function)
                async def alimited(*args: Any, **kwargs: Any) -> Any:
                    async with hold(args, kwargs):
                        return await function(*args, **kwargs)

                return alimited

            @functools.wraps(function)
            def limited(*args: Any, **kwargs: Any) -> Any:
                with hold(args, kwargs):
                    return function(*args, **kwargs)

            return limited

        return decorate


@dataclass(frozen=True)
class _Request:
    """The checked arguments of one plain-API acquire (:meth:`ConcurrencyLimit._request`)."""

    store: Any
    settings: Any
    key: str
    wait: float
    ttl: float
    ratio: float
    owner: str
    metadata: dict[str, Any]


class SlotHold:
    """What :meth:`ConcurrencyLimit.acquire` returns: a context manager for ``with``
    (sync: the heartbeat thread renews the slot) and ``async with`` (asyncio: the event
    loop's heartbeat renews it). Entering takes the slot (or raises), sets
    :func:`current_slot`, and yields the :class:`Slot` (None: fail_open in an outage);
    exiting unregisters and releases it, whatever the block raised (a cancelled block
    too). One object may be entered again after it exited, not twice at once."""

    def __init__(self, limit: ConcurrencyLimit, arguments: dict[str, Any]):
        self.limit = limit
        self.arguments = arguments
        self._held: list[tuple[Slot | None, contextvars.Token | None]] = []

    def _request(self) -> _Request:
        return self.limit._request(**self.arguments)

    def __enter__(self) -> Slot | None:
        slot = self.limit._held(self._request())
        self._push(slot)
        return slot

    def __exit__(self, *exc_info: Any) -> None:
        from ..heartbeat import get_heartbeat

        slot, token = self._held.pop()
        if slot is None:
            return
        _current.reset(token)  # type: ignore[arg-type]
        get_heartbeat().unregister(slot.lease)
        slot.release()

    async def __aenter__(self) -> Slot | None:
        slot = await self.limit._aheld(self._request())
        self._push(slot)
        return slot

    async def __aexit__(self, *exc_info: Any) -> None:
        slot, token = self._held.pop()
        if slot is None:
            return
        try:
            _current.reset(token)  # type: ignore[arg-type]
        except ValueError:  # exited in another context: nothing of ours is set there
            pass
        await slot.arelease()

    def _push(self, slot: Slot | None) -> None:
        token = None if slot is None else _current.set((*_current.get(), slot))
        self._held.append((slot, token))


def _async_store(store: Any) -> Any:
    from ..aio.lock import async_store_for

    return async_store_for(store)


def checked_key(key: Any) -> str:
    """``key`` if it can be a limit key (a lock name short enough for its slot names), else
    :class:`LockNameError`."""
    key = check_name(key)
    if len(slot_name(key, MAX_LIMIT)) > MAX_NAME_LENGTH:
        raise LockNameError(
            f"a concurrency limit key is at most "
            f"{MAX_NAME_LENGTH - len(slot_name('', MAX_LIMIT))} characters, "
            f"got {len(key)}"
        )
    return key


def _option(check: Callable[..., Any], value: Any, name: str, **kwargs: Any) -> Any:
    try:
        return check(value, name, **kwargs)
    except ImproperlyConfigured as exc:
        raise ImproperlyConfigured(str(exc), setting="concurrency_limit") from None


def check_key_template(key: Any) -> Any:
    """``key`` if it can be a ``concurrency_limit_key`` (None, a callable, or a str.format
    template of plain argument names), else ImproperlyConfigured naming the option."""
    if key is None or callable(key):
        return key
    if not isinstance(key, str) or not key:
        raise ImproperlyConfigured(
            f"concurrency_limit_key must be a str.format template, a "
            f"callable or None, got {shown(key)}",
            setting="concurrency_limit_key",
        )
    try:
        template_fields(key)
    except LockNameError as exc:
        raise ImproperlyConfigured(
            str(exc).replace("lock_key", "concurrency_limit_key", 1),
            setting="concurrency_limit_key",
        ) from None
    if "{" not in key and "}" in key:
        raise ImproperlyConfigured(
            f"concurrency_limit_key {shown(key)} cannot contain braces",
            setting="concurrency_limit_key",
        )
    return key


# -- the gate (celery_steplock.patterns.gates) ---------------------------------------------------


class _Held:
    def __init__(self, slot: Slot, token: contextvars.Token):
        self.slot = slot
        self.token = token

    def exit(self, exc: BaseException | None, result: Any) -> None:
        from ..heartbeat import get_heartbeat

        try:
            _current.reset(self.token)
        except ValueError:  # exited from another context: nothing of ours is set there
            pass
        get_heartbeat().unregister(self.slot.lease)
        self.slot.release()


class ConcurrencyLimitGate:
    """The ``concurrency_limit`` gate of one task: a slot taken after the step lease,
    renewed by the heartbeat with the lease, released after COMMIT."""

    option = "concurrency_limit"

    def __init__(self, task: Any, limit: ConcurrencyLimit, key: Any):
        self.task_name = task.name
        self.limit = limit
        self.key = key

    def enter(self, context: Any) -> _Held | None:
        from ..heartbeat import get_heartbeat

        task, plan = context.task, context.plan
        settings = getattr(plan, "settings", None)
        if settings is None:
            from ..conf import Settings

            settings = Settings(task.app)
        store = plan.store
        key = self.limit.render(self.task_name, context.arguments, self.key)
        request = task.request
        ttl = self.limit.ttl or plan.ttl
        metadata = holder_metadata(
            request.id,
            task.name,
            request.retries,
            worker=request.hostname,
            kind=SLOT_KIND,
            renew_ms=int(max(ttl * plan.ratio, 0.01) * 1000),
            limit=self.limit.limit,
            limit_key=key,
        )
        try:
            slot = self.limit.try_acquire(
                store,
                key,
                owner=new_owner_token(request.id),
                ticket=request.id,
                ttl=ttl,
                metadata=metadata,
                settings=settings,
                sender=task,
            )
        except LockStoreUnavailable as exc:
            fields = self.limit._outage_fields(exc, key)
            return outage(exc, self.limit.policy(settings), sender=task, **fields)
        get_heartbeat().register(
            slot.lease, store, ratio=plan.ratio, sender=task, max_hold=plan.max_hold
        )
        token = _current.set((*_current.get(), slot))
        return _Held(slot, token)


def _task_option(task: Any, name: str) -> Any:
    value = getattr(task, name, None)
    if inspect.ismethod(value) and value.__self__ is task:
        value = value.__func__  # a function given as a class attribute or a keyword
    return value


def gate(task: Any, settings: Any) -> ConcurrencyLimitGate | None:
    """The task's gate, or None without ``concurrency_limit``. Raises ImproperlyConfigured
    naming ``concurrency_limit`` or ``concurrency_limit_key``; a setting of this pattern
    that is invalid (``steplock_concurrency_limit_*``) raises naming it."""
    value = _task_option(task, "concurrency_limit")
    key = _task_option(task, "concurrency_limit_key")
    if value is None:
        if key is not None:
            check_key_template(key)
            raise ImproperlyConfigured(
                f"{task.name}: concurrency_limit_key is set but concurrency_limit is not",
                setting="concurrency_limit",
            )
        return None
    limit = value if isinstance(value, ConcurrencyLimit) else ConcurrencyLimit(value)
    key = check_key_template(key) if key is not None else limit.key
    if isinstance(key, str):
        names = argument_names(task.run)
        if names is not None:
            declared, var_keyword = names
            missing = [f for f in template_fields(key) if f not in declared]
            if missing and not var_keyword:
                raise ImproperlyConfigured(
                    f"{task.name}: concurrency_limit_key {shown(key)} names {missing[0]!r}, "
                    f"which is not an argument of the task",
                    setting="concurrency_limit_key",
                )
    settings.concurrency_limit_on_store_error  # noqa: B018 - an invalid setting names itself here
    settings.concurrency_limit_retry_after  # noqa: B018
    return ConcurrencyLimitGate(task, limit, key)


#: Former name, kept one release.
BulkheadGate = ConcurrencyLimitGate
