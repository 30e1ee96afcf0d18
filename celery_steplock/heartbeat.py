"""The heartbeat: one renewal thread per worker process for every lease it holds (and
every ``locked`` idempotency record of a body it runs, :mod:`celery_steplock.patterns.idempotency`).

Like Redisson's lock watchdog, one scheduler renews all of the process's leases, each every
``ttl * renewal_ratio`` seconds, the due ones in one pipelined round trip; a lease a renewal
finds gone is lost (ERROR log, ``lock_lost``; WARNING naming the operator's record after an
operator's force release). The holder sees it through ``lease.lost`` /
``lease.check()``: no exception is ever injected into the task's thread (python-redis-lock's
pitfall list and Celery's own design both argue against it). A store whose renewals can block
for reasons outside Redis (the idempotency records' database store) says so with its
``renewal_lane`` and is renewed by a heartbeat of that lane, on a thread of its own: a database
that stops answering never delays the renewal of a Redis lease. Lifecycle, forks and loss:
docs/design.md ("Heartbeat"); under gevent and eventlet (a native thread, signals relayed to
the hub): docs/pools.md.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from celery.signals import worker_init

from . import _green, signals
from ._checks import MAX_RENEWAL_RATIO, MIN_RENEWAL_INTERVAL, shown
from .events import emit, lease_fields, listening, log_event
from .exceptions import InvalidArgument, LockStoreMisconfigured, LockStoreUnavailable
from .lease import Lease
from .lock import RedisLeaseStore, lost_line

__all__ = ["Heartbeat", "get_heartbeat", "heartbeat_for", "store_lane", "DEFAULT_LANE"]

#: The shortest pause between two renewal attempts of one lease, seconds.
MIN_RETRY_DELAY = 0.05
#: Seconds the thread stays up without any lease before it exits.
IDLE_TIMEOUT = 0.5
#: The lane of a store without a ``renewal_lane`` attribute: the Redis leases' own.
DEFAULT_LANE = "redis"
#: A lost hold's reason once its local validity ran out (as :attr:`Lease.lost` says it).
_RAN_OUT = "local validity ran out without a successful renewal"


@dataclass(eq=False)
class _Entry:
    lease: Lease
    # A RedisLeaseStore, or a store of other holds (idempotency records) with its
    # extend_many.
    lock: Any
    interval: float
    next_at: float
    sender: Any
    # None for a lease (lock_extended, lock_lost); else called instead of lock_lost.
    on_lost: Callable[[Lease], Any] | None = None
    # The error of the last renewal attempt when it failed, until one succeeds.
    failure: str | None = None


class Renewals:
    """The renewal cycle's decisions, shared by :class:`Heartbeat` (a thread) and
    :class:`celery_steplock.aio.heartbeat.AsyncHeartbeat` (an asyncio task): which due hold
    is renewed or lost, what a failed round trip or a refusal means for each, the signals
    and log lines sent. A subclass has ``clock``, ``round_trips`` and :meth:`_drop`."""

    clock: Callable[[], float]
    round_trips: int

    def _drop(self, lease: Lease) -> bool:
        """Remove ``lease``'s entry; whether it was registered."""
        raise NotImplementedError

    def _report(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Log or emit a renewal's event."""
        function(*args, **kwargs)

    def _sort(self, entry: _Entry, now: float, lost: list[tuple[_Entry, str | None]]) -> bool:
        """True when the due ``entry`` is to be renewed; else its loss is put in ``lost``."""
        lease = entry.lease
        if lease.max_hold_until is not None and now >= lease.max_hold_until:
            lost.append((entry, "max hold reached: renewal stopped"))
        elif (ran_out := self._ran_out(entry)) is not None:
            lost.append((entry, ran_out))
        elif lease.lost:
            lost.append((entry, None))
        else:
            return True
        return False

    def _failed(
        self,
        group: list[_Entry],
        renewing: list[_Entry],
        lost: list[tuple[_Entry, str | None]],
        exc: LockStoreUnavailable | LockStoreMisconfigured,
        sent: float,
    ) -> None:
        """A round trip of ``group`` failed: retried sooner, lost when validity ran out."""
        # A refused permission is retried like an outage (the lease is lost when its
        # validity runs out), logged as the configuration error it is.
        self.round_trips += 1
        self._report(
            log_event,
            "renewal_failed",
            logging.ERROR if isinstance(exc, LockStoreMisconfigured) else logging.WARNING,
            leases=len(group),
            error=exc,
        )
        dropped = {id(entry) for entry, _reason in lost}
        failure = f"{type(exc).__name__}: {exc}"
        # A cluster store reports what the nodes that answered did (None: unknown).
        partial = dict(zip(map(id, renewing), exc.context.get("results") or ()))
        for entry in group:
            if id(entry) in dropped:
                continue
            done = partial.get(id(entry))
            if done is not None:
                if done:
                    entry.failure = None
                    entry.lease.renewed(sent)
                    entry.next_at = _next(entry.lease, sent + entry.interval)
                else:
                    self._lose(entry, self._refused(entry, sent))
                continue
            entry.failure = failure
            ran_out = self._ran_out(entry)
            if ran_out is not None:
                self._lose(entry, ran_out)
            elif entry.lease.lost:
                self._lose(entry, entry.lease.lost_reason)
            else:
                entry.next_at = self.clock() + max(
                    MIN_RETRY_DELAY, min(entry.interval / 3, entry.lease.remaining() / 4)
                )

    def _succeeded(self, renewing: list[_Entry], results: list[bool], sent: float) -> None:
        """The replies of a round trip: each hold renewed (``lock_extended``) or lost."""
        if renewing:
            self.round_trips += 1
        announce = listening(signals.lock_extended, logging.DEBUG)
        stamp = {"monotonic": time.monotonic(), "timestamp": time.time()}
        for entry, ok in zip(renewing, results):
            if ok:
                entry.failure = None
                entry.lease.renewed(sent)
                entry.next_at = _next(entry.lease, sent + entry.interval)
                if announce and entry.on_lost is None:
                    self._report(
                        emit,
                        signals.lock_extended,
                        entry.sender,
                        logging.DEBUG,
                        **lease_fields(entry.lease),
                        **stamp,
                    )
            else:
                self._lose(entry, self._refused(entry, sent))

    def _ran_out(self, entry: _Entry) -> str | None:
        """The loss reason of a hold whose local validity ran out while its renewals failed,
        naming the failure (None: not that case; :attr:`Lease.lost` gives the plain one)."""
        lease = entry.lease
        if entry.failure is None or lease._lost.is_set() or lease.clock() < lease.valid_until:
            return None
        return f"{_RAN_OUT}: the store could not be reached ({entry.failure})"

    def _refused(self, entry: _Entry, sent: float) -> str:
        """The loss reason of a hold a renewal did not extend. When its local validity ran
        out before the answer came, the store expired it because it did not answer in time
        (an outage, a stopped server), which is not another owner taking it."""
        lease = entry.lease
        if lease._lost.is_set() or lease.clock() < lease.valid_until:
            return "renewal found the key gone or held by another owner"
        if entry.failure is not None:
            return (
                f"{_RAN_OUT}: the store could not be reached ({entry.failure}), then answered "
                f"too late"
            )
        took = self.clock() - sent
        return f"{_RAN_OUT}: the store did not answer in time (the renewal took {took:.1f} s)"

    def _lose(self, entry: _Entry, reason: str | None) -> None:
        lease = entry.lease
        present = self._drop(lease)
        lease.mark_lost(reason or "lost")
        if present and entry.on_lost is not None:
            self._report(entry.on_lost, lease)
        elif present:
            self._report(announce_lost, entry.lock, entry.sender, lease)


def announce_lost(store: Any, sender: Any, lease: Lease) -> None:
    """Send ``lock_lost`` for ``lease`` and log it: ERROR, or WARNING naming the operator's
    record when an operator's force release took it (:func:`celery_steplock.lock.lost_line`:
    one read of the store, here on the renewal thread, or on the hub under a green pool).
    The loss is appended to the name's history (one call; a failure is ignored: the line
    and the signal say it)."""
    level, forced = lost_line(store, lease)
    record = getattr(store, "record_history", None)
    # An async store's (a cancelled async holder's loss, reported from the thread): its
    # coroutine could not be awaited here.
    if record is not None and not inspect.iscoroutinefunction(record):
        try:
            record(lease.name, "lost", **lost_entry(lease))
        except Exception:  # noqa: BLE001 - the history never stops the report of a loss
            pass
    send_lost(sender, lease, level, forced)


def lost_entry(lease: Lease) -> dict[str, Any]:
    """The fields of a lost lease's history entry (``record_history``'s keywords)."""
    return {
        "owner": lease.owner,
        "fence": lease.fence,
        "task_id": lease.task_id,
        "reason": lease.lost_reason,
    }


def send_lost(sender: Any, lease: Lease, level: int, forced: dict[str, Any]) -> None:
    """Send ``lock_lost`` for ``lease`` and log it at ``level`` with ``forced`` (the
    operator's record of a force release, or nothing)."""
    emit(
        signals.lock_lost,
        sender,
        level,
        reason=lease.lost_reason,
        **forced,
        **lease_fields(lease),
    )


class Heartbeat(Renewals):
    """Renews the leases registered with it from one daemon thread.

    Use :func:`get_heartbeat` for the process's instance. The thread starts with the first
    registered lease and exits once it has had no lease for ``idle_timeout`` seconds
    (noticed at its next wake-up, so back-to-back tasks share one thread). It is a daemon (no
    process hangs at exit) and is re-created in a forked child (``os.register_at_fork``
    resets the registry and a pid check guards the rest). A Redis error does not stop it:
    the renewal is retried sooner, and a lease whose local validity runs out meanwhile is
    lost. Under a green pool (:mod:`celery_steplock._green`) the thread is a native OS
    thread renewing through a client with unpatched sockets, and its log lines and signals
    run on the hub (:class:`~celery_steplock._green.Relay`).

    Args:
        idle_timeout: Seconds the thread outlives its last lease (default
            :data:`IDLE_TIMEOUT`).
        lane: The ``renewal_lane`` of the stores it renews (default :data:`DEFAULT_LANE`:
            the stores without one); :func:`get_heartbeat` keeps one heartbeat per lane.
        clock: Schedules the renewals, in seconds (default :func:`time.monotonic`); it must
            be the clock of the leases registered (their store's ``clock``), since renewals
            are recorded on the lease in its readings.
    """

    def __init__(
        self,
        idle_timeout: float = IDLE_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
        lane: str = DEFAULT_LANE,
    ) -> None:
        self.pid = os.getpid()
        self.lane = _lane(lane)
        self.idle_timeout = idle_timeout
        self.clock = clock
        #: "gevent"/"eventlet" when the thread is a native one beside a green pool, else None.
        self.green = _green.green_pool()
        # Under a green pool: id(store) -> (store, its copy on an unpatched client).
        self._native_stores: dict[int, tuple[RedisLeaseStore, RedisLeaseStore]] = {}
        # Under a green pool: runs the native thread's log lines and signals on the hub.
        self._relay: _green.Relay | None = None
        if self.green:
            self._cond: Any = _green.NativeCondition()
            self._relay = _green.Relay()
        else:
            self._cond = threading.Condition(threading.Lock())
        self._entries: dict[int, _Entry] = {}
        self._thread: threading.Thread | None = None
        # When the waiting thread wakes up next (inf: not before a notify; 0: not waiting).
        self._wake_at = 0.0
        self._idle_since = 0.0
        # Held for a renewal round trip and its events; taken before _cond, never after.
        self._cycle = _green.native_lock() if self.green else threading.Lock()
        self.cycles = 0
        self.round_trips = 0

    def register(
        self,
        lease: Lease,
        lock: RedisLeaseStore,
        *,
        ratio: float = 1 / 3,
        sender: Any = None,
        max_hold: float | None = None,
        on_lost: Callable[[Lease], Any] | None = None,
    ) -> None:
        """Start renewing a lease every ``lease.ttl * ratio`` seconds.

        Renewals are at least :data:`~celery_steplock.conf.MIN_RENEWAL_INTERVAL` seconds
        apart.

        Args:
            lease: The lease.
            lock: The store it was granted by, which renews it: a
                :class:`~celery_steplock.lock.RedisLeaseStore`, or any store with its
                ``extend_many(items) -> list[bool]`` (owner-checked: True when extended),
                e.g. the idempotency records' stores, whose ``locked`` records are renewed
                like leases (``lease.name`` is then the record key). Its ``renewal_lane``
                (default :data:`DEFAULT_LANE`) must be this heartbeat's lane: register
                through :func:`heartbeat_for`.
            ratio: A finite number above 0 and at most
                :data:`~celery_steplock.conf.MAX_RENEWAL_RATIO`.
            sender: The sender of its ``lock_extended`` and ``lock_lost`` signals.
            max_hold: Seconds after the acquisition at which the renewals stop, or None.
            on_lost: For a hold that is not a lease of the lease store: called with the
                lease, from the renewal thread (on the hub under a green pool), when the
                hold is lost, instead of sending ``lock_lost``; no ``lock_extended`` is
                sent for it. None (the default): a lease.

        Raises:
            InvalidArgument: ``ratio`` is out of bounds (``argument`` ``"ratio"``), or
                ``lock`` belongs to another lane (``argument`` ``"lock"``), raised before
                anything is registered.
            GreenPoolUnsupported: Under a green pool, ``lock`` cannot be given a client with
                unpatched sockets.
        """
        check_ratio(ratio)
        lane = store_lane(lock)
        if lane != self.lane:
            # A store that can block elsewhere must never share the Redis leases' thread.
            raise InvalidArgument(
                f"lock {type(lock).__name__} renews on the {lane!r} lane, not on this "
                f"heartbeat's {self.lane!r} lane: register it with heartbeat_for(lock)",
                argument="lock",
            )
        entry = new_entry(lease, lock, ratio, sender, max_hold, on_lost)
        if self.green:
            self.renewal_store(lock)
            # The loss flag is set from the native thread: no green lock may guard it.
            if not isinstance(lease._lost, _green.NativeFlag):
                # NativeFlag has the part of threading.Event a lease uses.
                lease._lost = _green.NativeFlag(lease._lost.is_set())  # type: ignore[assignment]
        with self._cond:
            self._entries[id(lease)] = entry
            if self._thread is None:
                name = "steplock-heartbeat"
                if self.lane != DEFAULT_LANE:
                    name = f"{name}-{self.lane}"
                if self.green:
                    thread: Any = _green.NativeThread(self._run, name)
                else:
                    thread = threading.Thread(target=self._run, name=name, daemon=True)
                try:
                    thread.start()
                except BaseException:
                    del self._entries[id(lease)]
                    raise
                self._thread = thread
            elif entry.next_at < self._wake_at:
                self._cond.notify()

    def unregister(self, lease: Lease) -> bool:
        """Stop renewing a lease.

        Waits for a renewal cycle in flight, so that no ``lock_extended`` of this lease
        follows the caller's release, but at most one TTL: a cycle stuck in a
        ``lock_extended`` receiver must not hang the task too. Under a green pool, runs the
        log lines and signals pending on the hub first.

        Args:
            lease: The lease.

        Returns:
            False when the lease was not registered (e.g. the heartbeat already dropped it as
            lost, and so already sent ``lock_lost``), else True.
        """
        in_cycle = self._acquire_cycle(max(MIN_RETRY_DELAY, lease.ttl))
        try:
            with self._cond:
                present = self._entries.pop(id(lease), None) is not None
                if present and not self._entries:
                    self._idle_since = self.clock()
        finally:
            if in_cycle:
                self._cycle.release()
        if self._relay is not None:
            self._relay.drain()  # this lease's lock_extended before the caller's release
        if not in_cycle:
            log_event(
                "heartbeat_stuck",
                logging.WARNING,
                key=lease.key,
                owner=lease.owner,
                waited=lease.ttl,
                reason="a renewal cycle (a lock_extended receiver?) "
                "did not finish; unregistered anyway",
            )
        return present

    def _acquire_cycle(self, timeout: float) -> bool:
        if not self.green:
            return self._cycle.acquire(timeout=timeout)
        # A greenlet blocking on an OS lock would stall its whole hub for the native thread's
        # round trip: poll, yielding to the other greenlets in between.
        deadline = time.monotonic() + timeout
        while not self._cycle.acquire(False):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
        return True

    def renewal_store(self, lock: RedisLeaseStore) -> RedisLeaseStore:
        """The store the thread renews a store's leases through.

        Args:
            lock: The store the leases were granted by.

        Returns:
            ``lock`` itself, or under a green pool its copy on an unpatched client
            (:func:`celery_steplock._green.native_store`).

        Raises:
            GreenPoolUnsupported: Under a green pool, when there can be no such copy.
        """
        if not self.green or not hasattr(lock, "client"):
            return lock  # a store without a redis client (the database records) as it is
        pair = self._native_stores.get(id(lock))
        if pair is None or pair[0] is not lock:
            pair = (lock, _green.native_store(lock, self.green))
            self._native_stores[id(lock)] = pair
        return pair[1]

    @property
    def leases(self) -> list[Lease]:
        """The leases registered now."""
        with self._cond:
            return [e.lease for e in self._entries.values()]

    @property
    def thread(self) -> threading.Thread | _green.NativeThread | None:
        """The renewal thread, while it runs."""
        return self._thread

    def _due(self) -> list[_Entry] | None:
        """Wait for the next renewals that are due; None once idle for ``idle_timeout``."""
        with self._cond:
            while True:
                now = self.clock()
                if not self._entries:
                    wake_at = self._idle_since + self.idle_timeout
                    if now >= wake_at:
                        self._thread = None
                        self._wake_at = 0.0
                        return None
                    self._wake_at = float("inf")
                else:
                    entries = self._entries.values()
                    wake_at = min(e.next_at for e in entries)
                    if wake_at <= now:
                        # Coalesce: renew early whatever falls due within the shortest
                        # interval, so that leases registered at different times share one
                        # round trip from their first renewal on.
                        horizon = now + min(e.interval for e in entries)
                        self._wake_at = 0.0
                        return [e for e in entries if e.next_at <= horizon]
                    self._wake_at = wake_at
                self._cond.wait(wake_at - now)

    def _run(self) -> None:
        while True:
            due = self._due()
            if due is None:
                return
            try:
                with self._cycle:
                    with self._cond:
                        entries = self._entries
                        due = [e for e in due if entries.get(id(e.lease)) is e]
                    self._renew(due)
            except Exception as exc:  # noqa: BLE001 - the thread must survive anything
                self._report(
                    log_event,
                    "heartbeat_error",
                    logging.ERROR,
                    exc_info=exc,
                    reason="renewal cycle failed",
                )
                if self.green:
                    _green.native_sleep(MIN_RETRY_DELAY)
                else:
                    time.sleep(MIN_RETRY_DELAY)

    def _renew(self, due: list[_Entry]) -> None:
        self.cycles += 1
        now = self.clock()
        by_lock: dict[int, list[_Entry]] = {}
        for entry in due:
            group = by_lock.get(id(entry.lock))
            if group is None:
                group = by_lock[id(entry.lock)] = []
            group.append(entry)
        for group in by_lock.values():
            renewing: list[_Entry] = []
            lost: list[tuple[_Entry, str | None]] = []

            def items() -> Iterator[tuple[str, str, float]]:
                # Consumed while the first script calls already run in Redis.
                for entry in group:  # noqa: B023 - consumed in this iteration of the loop
                    if self._sort(entry, now, lost):  # noqa: B023
                        renewing.append(entry)  # noqa: B023
                        lease = entry.lease
                        yield lease.name, lease.owner, lease.ttl

            sent = self.clock()
            try:
                results = self.renewal_store(group[0].lock).extend_many(items())
            except (LockStoreUnavailable, LockStoreMisconfigured) as exc:
                self._failed(group, renewing, lost, exc, sent)
                results = None
            for entry, reason in lost:
                self._lose(entry, reason or entry.lease.lost_reason)
            if results is not None:
                self._succeeded(renewing, results, sent)

    def _report(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Log or emit from the renewal thread: at once, or under a green pool on the hub."""
        if self._relay is None:
            function(*args, **kwargs)
        else:
            self._relay.call(function, *args, **kwargs)

    def _drop(self, lease: Lease) -> bool:
        with self._cond:
            present = self._entries.pop(id(lease), None) is not None
            if present and not self._entries:
                self._idle_since = self.clock()
        return present


def _next(lease: Lease, renew_at: float) -> float:
    """The next time to look at ``lease``: its renewal, or its max hold if that comes first
    (so the loss is reported on time, not one interval late)."""
    if lease.max_hold_until is not None:
        return min(renew_at, lease.max_hold_until)
    return renew_at


def check_ratio(ratio: Any) -> float:
    """``ratio`` of a registration, validated: a finite number above 0 and at most
    :data:`~celery_steplock.conf.MAX_RENEWAL_RATIO`.

    Raises:
        InvalidArgument: Naming ``ratio``.
    """
    if (
        isinstance(ratio, bool)
        or not isinstance(ratio, (int, float))
        or not 0 < ratio <= MAX_RENEWAL_RATIO
    ):  # NaN compares false
        raise InvalidArgument(
            f"ratio must be a number above 0 and at most {MAX_RENEWAL_RATIO}, got {shown(ratio)}",
            argument="ratio",
        )
    return float(ratio)


def new_entry(
    lease: Lease,
    lock: Any,
    ratio: float,
    sender: Any,
    max_hold: float | None,
    on_lost: Callable[[Lease], Any] | None,
) -> _Entry:
    """The registration of ``lease`` (sets its ``max_hold_until``): renewed every
    ``ttl * ratio`` seconds, at least :data:`~celery_steplock.conf.MIN_RENEWAL_INTERVAL`."""
    if max_hold is not None:
        lease.max_hold_until = lease.acquired_at + max_hold
    interval = max(lease.ttl * ratio, MIN_RENEWAL_INTERVAL)
    return _Entry(
        lease, lock, interval, _next(lease, lease.acquired_at + interval), sender, on_lost
    )


def _lane(lane: Any) -> str:
    if not isinstance(lane, str) or not lane:
        raise InvalidArgument(
            f"lane must be a non-empty string, got {shown(lane)}", argument="lane"
        )
    return lane


def store_lane(lock: Any) -> str:
    """The renewal lane of a store: its ``renewal_lane`` attribute, else :data:`DEFAULT_LANE`.

    Raises:
        InvalidArgument: The attribute is not a non-empty string (``argument`` ``"lane"``).
    """
    return _lane(getattr(lock, "renewal_lane", DEFAULT_LANE))


_heartbeats: dict[str, Heartbeat] = {}
_heartbeat_guard = threading.Lock()


def get_heartbeat(lane: str = DEFAULT_LANE) -> Heartbeat:
    """The current process's heartbeat of one renewal lane.

    Each lane has its own renewal thread, so a store whose renewals can block for reasons
    outside Redis (``renewal_lane = "database"``) never delays the Redis leases'.

    Args:
        lane: The lane (default :data:`DEFAULT_LANE`, the Redis leases').

    Returns:
        Its :class:`Heartbeat` (a new one after a fork).

    Raises:
        InvalidArgument: ``lane`` is not a non-empty string (``argument`` ``"lane"``).
    """
    hb = _heartbeats.get(_lane(lane))
    if hb is None or hb.pid != os.getpid():
        with _heartbeat_guard:
            hb = _heartbeats.get(lane)
            if hb is None or hb.pid != os.getpid():
                hb = _heartbeats[lane] = Heartbeat(lane=lane)
    return hb


def heartbeat_for(lock: Any) -> Heartbeat:
    """The current process's heartbeat that renews ``lock``'s holds (its lane's).

    Args:
        lock: A store with ``extend_many`` (see :meth:`Heartbeat.register`).

    Returns:
        ``get_heartbeat(store_lane(lock))``.
    """
    return get_heartbeat(store_lane(lock))


def _after_fork_in_child() -> None:
    global _heartbeats, _heartbeat_guard
    _heartbeats = {}
    _heartbeat_guard = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


@worker_init.connect(weak=False)
def _refuse_green_pool_without_native_renewals(sender: Any = None, **kwargs: Any) -> None:
    """Under a green pool, a worker whose heartbeat could not renew from a native thread
    (see :mod:`celery_steplock._green`) does not start: its leases would be lost behind any
    body that computes for a TTL. Nothing is checked under prefork, threads or solo."""
    pool = _green.green_pool()
    app = getattr(sender, "app", None)
    if pool is None or app is None:
        return
    from .exceptions import ImproperlyConfigured
    from .lock import get_lease_store

    try:
        store = get_lease_store(app)
    except ImproperlyConfigured:
        return  # an invalid setting: the settings check stops the worker and names it
    try:
        _green.native_store(store, pool)
    except _green.GreenPoolUnsupported as exc:
        log_event("improperly_configured", logging.CRITICAL, pool=pool, error=exc)
        raise SystemExit(str(exc)) from exc
    log_event(
        "heartbeat_native",
        pool=pool,
        reason="the heartbeat renews leases from a native thread with unpatched sockets",
    )
