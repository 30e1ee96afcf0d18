"""The heartbeat: one renewal thread per worker process for every lease it holds.

Like Redisson's lock watchdog, a single scheduler renews all of the process's leases, each
every ``ttl * renewal_ratio`` seconds (default ttl/3), sending all renewals that are due in one
pipelined round trip. The thread starts lazily with the first registered lease and exits once
it has had no lease for :data:`IDLE_TIMEOUT` seconds (noticed at its next wake-up, so a worker
that runs one task after another keeps one thread rather than starting one per task). It is a
daemon (no process hangs at exit) and is re-created in a forked child (a prefork pool child
never inherits the parent's thread or its registry: ``os.register_at_fork`` resets it and a
pid check guards the rest).

A renewal that finds the key gone or owned by someone else marks the lease lost, logs at ERROR
and sends ``lock_lost``; it is then no longer renewed. A Redis error does not stop the thread:
the renewal is retried sooner, and a lease whose local validity runs out meanwhile is lost.
``max_hold`` (seconds) caps how long a lease is renewed at all. The holder observes all of this
through ``lease.lost`` / ``lease.check()``; no exception is ever injected into the task's
thread (python-redis-lock's pitfall list and Celery's own design both argue against it).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from . import signals
from .events import emit, lease_fields, listening, logger
from .exceptions import LockStoreMisconfigured, LockStoreUnavailable
from .lease import Lease
from .lock import RedisLeaseStore

__all__ = ["Heartbeat", "get_heartbeat"]

#: The shortest pause between two renewal attempts of one lease, seconds.
MIN_RETRY_DELAY = 0.05
#: Seconds the thread stays up without any lease before it exits.
IDLE_TIMEOUT = 0.5


@dataclass(eq=False)
class _Entry:
    lease: Lease
    lock: RedisLeaseStore
    interval: float
    next_at: float
    sender: Any


class Heartbeat:
    """Renews the leases registered with it from one daemon thread; see the module docstring.

    Use :func:`get_heartbeat` for the process's instance. ``idle_timeout`` (seconds) is
    how long the thread outlives its last lease. ``clock`` (default :func:`time.monotonic`,
    seconds) schedules the renewals; it must be the clock of the leases registered (their
    store's ``clock``), since renewals are recorded on the lease in its readings.
    """

    def __init__(self, idle_timeout: float = IDLE_TIMEOUT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pid = os.getpid()
        self.idle_timeout = idle_timeout
        self.clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._entries: dict[int, _Entry] = {}
        self._thread: threading.Thread | None = None
        # When the waiting thread wakes up next (inf: not before a notify; 0: not waiting).
        self._wake_at = 0.0
        self._idle_since = 0.0
        # Held for a renewal round trip and its events; taken before _cond, never after.
        self._cycle = threading.Lock()
        self.cycles = 0
        self.round_trips = 0

    def register(self, lease: Lease, lock: RedisLeaseStore, *, ratio: float = 1 / 3,
                 sender: Any = None, max_hold: float | None = None) -> None:
        """Start renewing ``lease`` every ``lease.ttl * ratio`` seconds through ``lock``;
        ``max_hold`` (seconds) stops the renewals that long after the acquisition."""
        if max_hold is not None:
            lease.max_hold_until = lease.acquired_at + max_hold
        interval = lease.ttl * ratio
        entry = _Entry(lease, lock, interval, _next(lease, lease.acquired_at + interval), sender)
        with self._cond:
            self._entries[id(lease)] = entry
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="steplock-heartbeat",
                                          daemon=True)
                try:
                    thread.start()
                except BaseException:
                    del self._entries[id(lease)]
                    raise
                self._thread = thread
            elif entry.next_at < self._wake_at:
                self._cond.notify()

    def unregister(self, lease: Lease) -> bool:
        """Stop renewing ``lease``.

        Returns False when the lease was not registered (e.g. the heartbeat already dropped it
        as lost, and so already sent ``lock_lost``). Waits for a renewal cycle in flight, so
        that no ``lock_extended`` of this lease follows the caller's release, but at most one
        TTL: a cycle stuck in a ``lock_extended`` receiver must not hang the task too.
        """
        in_cycle = self._cycle.acquire(timeout=max(MIN_RETRY_DELAY, lease.ttl))
        try:
            with self._cond:
                present = self._entries.pop(id(lease), None) is not None
                if present and not self._entries:
                    self._idle_since = self.clock()
        finally:
            if in_cycle:
                self._cycle.release()
        if not in_cycle:
            logger.warning("event=heartbeat_stuck key=%s owner=%s waited=%.3f: a renewal cycle "
                           "(a lock_extended receiver?) did not finish; unregistered anyway",
                           lease.key, lease.owner, lease.ttl)
        return present

    @property
    def leases(self) -> list[Lease]:
        with self._cond:
            return [e.lease for e in self._entries.values()]

    @property
    def thread(self) -> threading.Thread | None:
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
            except Exception:  # noqa: BLE001 - the thread must survive anything
                logger.exception("event=heartbeat_error renewal cycle failed")
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

            def items():
                # Consumed while the first script calls already run in Redis.
                for entry in group:
                    lease = entry.lease
                    if lease.max_hold_until is not None and now >= lease.max_hold_until:
                        lost.append((entry, "max hold reached: renewal stopped"))
                    elif lease.lost:
                        lost.append((entry, None))
                    else:
                        renewing.append(entry)
                        yield lease.name, lease.owner, lease.ttl

            sent = self.clock()
            try:
                results = group[0].lock.extend_many(items())
            except (LockStoreUnavailable, LockStoreMisconfigured) as exc:
                # A refused permission is retried like an outage (the lease is lost when its
                # validity runs out), logged as the configuration error it is.
                self.round_trips += 1
                logger.log(logging.ERROR if isinstance(exc, LockStoreMisconfigured)
                           else logging.WARNING,
                           "event=renewal_failed leases=%d error=%s", len(group), exc)
                dropped = {id(entry) for entry, _reason in lost}
                for entry in group:
                    if id(entry) in dropped:
                        continue
                    if entry.lease.lost:
                        self._lose(entry, entry.lease.lost_reason)
                    else:
                        entry.next_at = self.clock() + max(
                            MIN_RETRY_DELAY, min(entry.interval / 3, entry.lease.remaining() / 4))
                results = None
            for entry, reason in lost:
                self._lose(entry, reason or entry.lease.lost_reason)
            if results is None:
                continue
            if renewing:
                self.round_trips += 1
            announce = listening(signals.lock_extended, logging.DEBUG)
            stamp = {"monotonic": time.monotonic(), "timestamp": time.time()}
            for entry, ok in zip(renewing, results):
                if ok:
                    entry.lease.renewed(sent)
                    entry.next_at = _next(entry.lease, sent + entry.interval)
                    if announce:
                        emit(signals.lock_extended, entry.sender, logging.DEBUG,
                             **lease_fields(entry.lease), **stamp)
                else:
                    self._lose(entry, "renewal found the key gone or held by another owner")

    def _lose(self, entry: _Entry, reason: str | None) -> None:
        lease = entry.lease
        with self._cond:
            present = self._entries.pop(id(lease), None) is not None
            if present and not self._entries:
                self._idle_since = self.clock()
        lease.mark_lost(reason or "lost")
        if present:
            emit(signals.lock_lost, entry.sender, logging.ERROR, reason=lease.lost_reason,
                 **lease_fields(lease))


def _next(lease: Lease, renew_at: float) -> float:
    """The next time to look at ``lease``: its renewal, or its max hold if that comes first
    (so the loss is reported on time, not one interval late)."""
    if lease.max_hold_until is not None:
        return min(renew_at, lease.max_hold_until)
    return renew_at


_heartbeat: Heartbeat | None = None
_heartbeat_guard = threading.Lock()


def get_heartbeat() -> Heartbeat:
    """The current process's :class:`Heartbeat` (a new one after a fork)."""
    global _heartbeat
    hb = _heartbeat
    if hb is None or hb.pid != os.getpid():
        with _heartbeat_guard:
            if _heartbeat is None or _heartbeat.pid != os.getpid():
                _heartbeat = Heartbeat()
            hb = _heartbeat
    return hb


def _after_fork_in_child() -> None:
    global _heartbeat, _heartbeat_guard
    _heartbeat = None
    _heartbeat_guard = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
