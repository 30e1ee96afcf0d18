"""The asyncio heartbeat: one task per event loop renews every lease of that loop.

The asyncio form of :class:`celery_steplock.heartbeat.Heartbeat`, for leases held across
``await``s: a task of the running loop renews every registered hold that is due in one
pipelined round trip per store (its ``async extend_many``), each every ``ttl * ratio``
seconds; it starts with the first registration and ends once idle. Its decisions (which hold
is renewed or lost, retry sooner after a Redis error, lost when the local validity runs out,
max hold) and its signals (``lock_extended``, ``lock_lost`` with the same fields, or the
hold's ``on_lost``) are the thread's own (:class:`celery_steplock.heartbeat.Renewals`).

A cancelled renewal task (the loop shutting down with holds registered, or a task
cancelled by hand) marks every hold it renewed lost (``reason`` says the renewal was
cancelled) and reports each (``lock_lost``/``on_lost``), so a commit checking the lease
refuses.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import Any, Callable

from .. import _loops
from ..events import log_event
from ..exceptions import LockStoreMisconfigured, LockStoreUnavailable
from ..heartbeat import (
    IDLE_TIMEOUT,
    MIN_RETRY_DELAY,
    Renewals,
    _Entry,
    announce_lost,
    check_ratio,
    lost_entry,
    new_entry,
    send_lost,
)
from ..lease import Lease
from ..lock import forced_line

__all__ = ["AsyncHeartbeat", "get_async_heartbeat", "CANCELLED"]

#: The loss reason of the holds of a cancelled renewal task.
CANCELLED = "renewal task cancelled: the lease is no longer renewed"


class AsyncHeartbeat(Renewals):
    """Renews the leases registered with it from one task of one event loop.

    Use :func:`get_async_heartbeat` for the running loop's instance. :meth:`register` and
    :meth:`unregister` are plain methods, called from the loop's thread.

    Args:
        loop: The event loop whose task renews (default: the running one).
        idle_timeout: Seconds the task outlives its last lease (default
            :data:`celery_steplock.heartbeat.IDLE_TIMEOUT`).
        clock: Schedules the renewals, in seconds (default :func:`time.monotonic`); the
            clock of the leases registered.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None = None,
        idle_timeout: float = IDLE_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self.idle_timeout = idle_timeout
        self.clock = clock
        self._entries: dict[int, _Entry] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._idle_since = 0.0
        self.cycles = 0
        self.round_trips = 0

    def register(
        self,
        lease: Lease,
        store: Any,
        *,
        ratio: float = 1 / 3,
        sender: Any = None,
        max_hold: float | None = None,
        on_lost: Callable[[Lease], Any] | None = None,
    ) -> None:
        """Start renewing a lease every ``lease.ttl * ratio`` seconds (at least
        :data:`~celery_steplock.conf.MIN_RENEWAL_INTERVAL` apart).

        Args:
            lease: The lease.
            store: The store it was granted by: an
                :class:`~celery_steplock.aio.lock.AsyncRedisLeaseStore`, or any store with
                ``async extend_many(items) -> list[bool]`` (owner-checked).
            ratio: A finite number above 0 and at most
                :data:`~celery_steplock.conf.MAX_RENEWAL_RATIO`.
            sender: The sender of its ``lock_extended`` and ``lock_lost`` signals.
            max_hold: Seconds after the acquisition at which the renewals stop, or None.
            on_lost: For a hold that is not a lease of the lease store: called with the
                lease, from the renewal task, when it is lost, instead of ``lock_lost``.

        Raises:
            InvalidArgument: ``ratio`` is out of bounds (``argument`` ``"ratio"``).
        """
        check_ratio(ratio)
        entry = new_entry(lease, store, ratio, sender, max_hold, on_lost)
        self._entries[id(lease)] = entry
        if self._task is None or self._task.done():
            task = self._task = self.loop.create_task(self._run(), name="steplock-heartbeat")
            task.add_done_callback(self._finished)
        else:
            self._wake.set()

    def unregister(self, lease: Lease) -> bool:
        """Stop renewing a lease; no ``lock_extended`` of it follows (a renewal in flight is
        not applied to it).

        Returns:
            False when the lease was not registered (e.g. already dropped as lost, and so
            already reported), else True.
        """
        present = self._drop(lease)
        self._wake.set()
        return present

    @property
    def leases(self) -> list[Lease]:
        """The leases registered now."""
        return [e.lease for e in self._entries.values()]

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The renewal task, while it runs."""
        return self._task if self._task is not None and not self._task.done() else None

    def _drop(self, lease: Lease) -> bool:
        present = self._entries.pop(id(lease), None) is not None
        if present and not self._entries:
            self._idle_since = self.clock()
        return present

    def _current(self, entry: _Entry) -> bool:
        return self._entries.get(id(entry.lease)) is entry

    async def _due(self) -> list[_Entry] | None:
        """Wait for the next renewals that are due; None once idle for ``idle_timeout``."""
        while True:
            now = self.clock()
            if not self._entries:
                wake_at = self._idle_since + self.idle_timeout
                if now >= wake_at:
                    return None
            else:
                entries = self._entries.values()
                wake_at = min(e.next_at for e in entries)
                if wake_at <= now:
                    # Coalesce as the thread does: whatever falls due within the shortest
                    # interval shares this round trip.
                    horizon = now + min(e.interval for e in entries)
                    return [e for e in entries if e.next_at <= horizon]
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), wake_at - now)
            except asyncio.TimeoutError:
                pass

    async def _run(self) -> None:
        while True:
            due = await self._due()
            if due is None:
                return
            try:
                await self._renew(due)
            except Exception as exc:  # noqa: BLE001 - the task must survive anything
                log_event(
                    "heartbeat_error",
                    logging.ERROR,
                    exc_info=exc,
                    reason="renewal cycle failed",
                )
                await asyncio.sleep(MIN_RETRY_DELAY)

    def _finished(self, task: asyncio.Task[None]) -> None:
        # A done callback: runs for a task cancelled before its first step too.
        if self._task is task:
            self._task = None
        if task.cancelled():
            self._cancelled()

    async def aclose(self) -> None:
        """Cancel the renewal task, if running, and wait for it (the loop is shutting
        down): its holds are marked lost, as for any cancellation."""
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])

    def _report(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """As the thread's, but a loss's ``lock_lost`` reads the force release's mark with
        the async store, in a task of its own: the loop is never blocked on Redis."""
        if function is announce_lost and _on_a_loop() and args[2].lost_reason != CANCELLED:
            _loops.background(aannounce_lost(*args, **kwargs))
        else:  # a cancellation is no force release: its ERROR line needs no read
            function(*args, **kwargs)

    def _cancelled(self) -> None:
        entries = list(self._entries.values())
        if entries:
            log_event("heartbeat_error", logging.ERROR, leases=len(entries), reason=CANCELLED)
        for entry in entries:
            self._lose(entry, CANCELLED)

    async def _renew(self, due: list[_Entry]) -> None:
        self.cycles += 1
        now = self.clock()
        groups: dict[int, list[_Entry]] = {}
        for entry in due:
            groups.setdefault(id(entry.lock), []).append(entry)
        for group in groups.values():
            renewing: list[_Entry] = []
            lost: list[tuple[_Entry, str | None]] = []
            for entry in group:
                if self._sort(entry, now, lost):
                    renewing.append(entry)
            items = [(e.lease.name, e.lease.owner, e.lease.ttl) for e in renewing]
            sent = self.clock()
            results: list[bool] | None = None
            try:
                if items:
                    results = await group[0].lock.extend_many(items)
                else:
                    results = []
            except (LockStoreUnavailable, LockStoreMisconfigured) as exc:
                # Holds unregistered during the await are left alone.
                keep = [self._current(e) for e in renewing]
                self._failed(
                    [e for e in group if self._current(e)],
                    [e for e, k in zip(renewing, keep) if k],
                    lost,
                    _kept(exc, keep),
                    sent,
                )
            for entry, reason in lost:
                self._lose(entry, reason or entry.lease.lost_reason)
            if results is not None:
                pairs = [(e, ok) for e, ok in zip(renewing, results) if self._current(e)]
                self._succeeded([e for e, _ in pairs], [ok for _, ok in pairs], sent)


def _on_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def alost_line(store: Any, lease: Lease) -> tuple[int, dict[str, Any]]:
    """The level and extra fields of the ``lock_lost`` line of ``lease``, read with the
    async store's ``forced`` (one GET): WARNING naming the operator's record after a force
    release, else ERROR (:func:`celery_steplock.lock.lost_line`). Never raises."""
    forced = getattr(store, "forced", None)
    if forced is None or not inspect.iscoroutinefunction(forced):
        return logging.ERROR, {}
    try:
        record = await forced(lease.name, lease.owner)
    except Exception:  # noqa: BLE001 - the loss is reported either way
        record = None
    return forced_line(record)


async def aannounce_lost(store: Any, sender: Any, lease: Lease) -> None:
    """Send ``lock_lost`` for ``lease`` and log it, as
    :func:`celery_steplock.heartbeat.announce_lost` with the async store's read: ERROR, or
    WARNING naming the operator's record after a force release. The loss is appended to
    the name's history (the store's ``record_history``, one call; a failure is ignored: the
    line and the signal say it). Never raises."""
    level, forced = await alost_line(store, lease)
    record = getattr(store, "record_history", None)
    if record is not None:
        try:
            await record(lease.name, "lost", **lost_entry(lease))
        except Exception:  # noqa: BLE001 - the history never stops the report of a loss
            pass
    send_lost(sender, lease, level, forced)


def _kept(
    exc: LockStoreUnavailable | LockStoreMisconfigured, keep: list[bool]
) -> LockStoreUnavailable | LockStoreMisconfigured:
    # A cluster store's partial results, for the holds still registered only.
    results = exc.context.get("results")
    if results:
        exc.context["results"] = [r for r, k in zip(results, keep) if k]
    return exc


def get_async_heartbeat() -> AsyncHeartbeat:
    """The running event loop's :class:`AsyncHeartbeat` (one per loop).

    Raises:
        RuntimeError: No event loop is running.
    """
    kept = _loops.room()
    hb = kept.values.get("heartbeat")
    if hb is None:
        hb = kept.values["heartbeat"] = AsyncHeartbeat(asyncio.get_running_loop())
        kept.on_close(hb.aclose)
    return hb
