"""Activity per minute, for pictures: a per-process aggregator of the library's signals, its
flusher, and the reader the admin's "Activity" page draws from.

**What is counted.** :class:`Aggregator` sees every event of :mod:`celery_steplock.signals`
as :func:`celery_steplock.events.emit` sends it (:func:`install` adds it to
:data:`celery_steplock.events.TAPS`: a Celery signal receiver would cost several
microseconds more per event; the Django app installs it in ``ready()``, so the web process
and every worker of a Django project count). Per minute (the event's
``timestamp``, seconds since the epoch, ``// 60``) and per task name:

==================  ===================================================================
``exec``            executions that took their lease (``lock_acquired``)
``wait|<i>``        a histogram of those acquires' ``wait_seconds`` (bucket ``i`` of
                    :data:`BOUNDS`)
``hold|<i>``        a histogram of the holders' releases' ``hold_seconds``
                    (``lock_released``, operators' force releases left out)
``contended``       refused acquires (``lock_contended``)
``conflict``        compare-and-swaps that found the step moved on (``transition_conflict``)
``duplicate``       duplicates turned away: an idempotency record replayed or held by
                    another execution (``idempotency_replayed``, ``idempotency_conflict``)
==================  ===================================================================

Per rate limit (its ``name``): ``admitted`` and ``limited`` (``rate_limit_allowed``,
``rate_limited``). Per circuit breaker (its ``name``): ``state|<second>:<state>``, one per
transition (``circuit_opened``, ``circuit_half_opened``, ``circuit_closed``) at that second
of the minute. Counting is a dict increment under a lock (about a microsecond, see
tests/test_activity.py): nothing is sent to Redis on the caller's thread.

**Flushing.** A daemon thread per process (started on the first event, a new one after a
fork: the child starts with nothing counted) writes what was counted every
``steplock_activity_flush_interval`` seconds (default 10) in ONE pipelined round trip:
``HINCRBY <prefix>:activity:<minute> <subject>|<metric>|<bucket> <n>`` per field and one
``PEXPIRE`` per minute of :data:`RETENTION` (two hours). A minute is one key, so in a cluster
a flush touches the slot of each minute it holds (usually one). Off by default:
``steplock_activity`` (read by the flusher every interval) turns it on; while it is off an
event costs one attribute read, and what was counted before the flusher read it is dropped. Redis down or refusing: the batch is
dropped (:attr:`Aggregator.dropped` counts its fields), a WARNING line
``activity_dropped`` the first time, DEBUG after; nothing is ever raised into the caller.
The process's exit flushes once more (``atexit``; a prefork child that ends by ``os._exit``
loses at most one interval).

**Reading.** :func:`read` fetches the last ``minutes`` minute hashes (``HGETALL`` each, one
pipeline) and returns an :class:`Activity`: per task the executions, contention, conflicts
and duplicates per minute and the wait and hold p50/p95 read back from the histograms (the
upper bound of the bucket holding the quantile: within a factor ``sqrt(2)``); per limit the
admitted and limited per minute; per breaker its transitions. A field or value that no
flusher writes (another program's, a corrupt value, a key of another type) is counted in
``malformed`` and skipped, never raised.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time
from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from .events import TAPS, log_event

__all__ = [
    "BOUNDS",
    "RETENTION",
    "MAX_MINUTES",
    "MAX_SUBJECTS",
    "Aggregator",
    "Activity",
    "TaskSeries",
    "LimitSeries",
    "BreakerTimeline",
    "activity_key",
    "aggregator",
    "install",
    "uninstall",
    "read",
    "quantile",
]

#: Upper bounds, seconds, of the wait and hold histograms' buckets: 1 ms times powers of
#: ``sqrt(2)`` up to about 3.3 hours; a value above the last falls in an overflow bucket
#: (index ``len(BOUNDS)``), read back as the last bound.
BOUNDS: tuple[float, ...] = tuple(0.001 * 2 ** (i / 2) for i in range(48))

#: Seconds a minute's hash lives after its last flush (two hours: the page shows one).
RETENTION = 2 * 3600.0

#: The most minutes :func:`read` reads (its ``minutes`` argument is clamped to it).
MAX_MINUTES = 120

#: The most tasks, limits and breakers :func:`read` keeps each (the busiest tasks first);
#: the rest are counted in :attr:`Activity.left_out`.
MAX_SUBJECTS = 200

_TASK_COUNTERS = ("exec", "contended", "conflict", "duplicate")
_HISTOGRAMS = ("wait", "hold")
_LIMIT_COUNTERS = ("admitted", "limited")
_STATES = {
    "circuit_opened": "open",
    "circuit_half_opened": "half_open",
    "circuit_closed": "closed",
}
_BREAKER_STATES = frozenset(_STATES.values())


def activity_key(prefix: str, minute: int) -> str:
    """The hash of one minute: ``<prefix>:activity:<minute>`` (``minute``: Unix seconds // 60)."""
    return f"{prefix}:activity:{minute}"


class Aggregator:
    """Counts of one process, per minute, waiting for the flusher.

    Attributes:
        app: The Celery app whose settings and lease store the flusher uses; None: the app of
            the first event whose sender has one, else ``celery.current_app``.
        dropped: Fields dropped because Redis could not take them (since the process began).
        flushes: Flushes that wrote (one round trip each).
        flusher: False: no flusher thread is started; :meth:`flush` is called by the owner
            (tests, benchmarks).
    """

    def __init__(self, app: Any = None, *, flusher: bool = True) -> None:
        self.app = app
        self.flusher = flusher
        #: ``steplock_activity`` as the flusher last read it (None: not read yet, count).
        self.enabled: bool | None = None
        self.dropped = 0
        self.flushes = 0
        self._warned = False
        self._reset()

    def _reset(self) -> None:
        self.pid = os.getpid()
        self._lock = threading.Lock()
        # (minute, subject, metric, bucket) -> count
        self._counts: defaultdict[tuple[int, str, str, Any], int] = defaultdict(int)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- counting: the receiver -------------------------------------------------------------

    def receive(
        self, sender: Any = None, signal: Any = None, event: str | None = None, **fields: Any
    ) -> None:
        """A signal receiver's form of :meth:`count` (``event``: the signal's name)."""
        self.count(sender, event or str(getattr(signal, "name", "")), fields)

    def count(self, sender: Any, event: str, fields: dict[str, Any]) -> None:
        """Count one event (a tap of :func:`celery_steplock.events.emit`): one dict increment
        or two under a lock; never raises.

        Args:
            sender: The signal's sender (its ``app``, when it has one and none was given,
                is the one the flusher uses).
            event: The signal's name.
            fields: Its keyword arguments (``timestamp``: Unix seconds, default now).
        """
        try:
            kind = _KINDS.get(event)
            if kind is None or self.enabled is False:
                return
            stamp = fields.get("timestamp")
            if not isinstance(stamp, (int, float)):
                stamp = time.time()
            minute = int(stamp // 60)
            if kind == "exec":
                task = fields.get("task_name") or ""
                seconds = fields.get("wait_seconds")
                with self._lock:
                    counts = self._counts
                    counts[(minute, task, "exec", "")] += 1
                    if isinstance(seconds, (int, float)) and seconds >= 0:
                        counts[(minute, task, "wait", bisect_left(BOUNDS, seconds))] += 1
            elif kind == "hold":
                seconds = fields.get("hold_seconds")
                if fields.get("forced") or not isinstance(seconds, (int, float)) or seconds < 0:
                    return
                key: tuple[int, str, str, Any] = (
                    minute,
                    fields.get("task_name") or "",
                    "hold",
                    bisect_left(BOUNDS, seconds),
                )
                with self._lock:
                    self._counts[key] += 1
            elif kind == "breaker":
                key = (
                    minute,
                    fields.get("name") or "",
                    "state",
                    f"{int(stamp) % 60}:{_STATES[event]}",
                )
                with self._lock:
                    self._counts[key] += 1
            else:
                subject = (
                    fields.get("name") or fields.get("key") or ""
                    if kind in _LIMIT_COUNTERS
                    else fields.get("task_name") or ""
                )
                with self._lock:
                    self._counts[(minute, subject, kind, "")] += 1
            if self._thread is None and self.flusher:
                self._start(sender)
        except Exception:  # noqa: BLE001 - counting must never break locking
            pass

    def _start(self, sender: Any) -> None:
        with self._lock:
            if self._thread is not None:
                return
            app = getattr(sender, "app", None)
            if self.app is None and hasattr(app, "conf"):  # a task's Celery app
                self.app = app
            thread = threading.Thread(target=self._run, name="steplock-activity", daemon=True)
            self._thread = thread
        thread.start()

    def pending(self) -> dict[tuple[int, str], int]:
        """A copy of the counts not flushed yet: ``{(minute, field): count}``."""
        with self._lock:
            return {(m, f"{s}|{k}|{b}"): n for (m, s, k, b), n in self._counts.items()}

    # -- flushing ---------------------------------------------------------------------------

    def _settings(self) -> tuple[Any, Any]:
        from .conf import Settings

        app = self.app
        if app is None:
            from celery._state import get_current_app

            app = get_current_app()
        return app, Settings(app)

    def refresh(self) -> float:
        """Read ``steplock_activity`` into :attr:`enabled` and return
        ``steplock_activity_flush_interval`` (10.0, :attr:`enabled` unchanged, when the
        settings cannot be read: the settings check names an invalid one)."""
        try:
            settings = self._settings()[1]
            self.enabled = bool(settings.activity)
            return float(settings.activity_flush_interval)
        except Exception:  # noqa: BLE001 - never raises on the flusher thread
            return 10.0

    def _run(self) -> None:
        # The setting is read every interval: turned on at run time, counting starts within
        # one interval; off, each event costs one attribute read.
        while not self._stop.wait(self.refresh()):
            self.flush()

    def stop(self) -> None:
        """Stop the flusher thread (it flushes no more); a later event starts a new one."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
        with self._lock:
            self._thread = None
            self._stop = threading.Event()

    def flush(self, client: Any = None, prefix: str | None = None) -> int:
        """Write what was counted in one pipelined round trip; never raises.

        Args:
            client: The redis client (default: the app's lease store's).
            prefix: The key prefix (default: ``steplock_key_prefix``).

        Returns:
            The fields written (0: nothing counted, the setting off, or the batch dropped).
        """
        with self._lock:
            counts, self._counts = self._counts, defaultdict(int)
        if not counts:
            return 0
        try:
            if client is None or prefix is None:
                from .lock import get_lease_store

                app, settings = self._settings()
                self.enabled = bool(settings.activity)
                if not self.enabled:
                    return 0
                store = get_lease_store(app, settings)
                client = store.client if client is None else client
                prefix = store.prefix if prefix is None else prefix
            pipe = client.pipeline(transaction=False)
            minutes = set()
            for (minute, subject, metric, bucket), count in counts.items():
                minutes.add(minute)
                pipe.hincrby(activity_key(prefix, minute), f"{subject}|{metric}|{bucket}", count)
            ttl = int(RETENTION * 1000)
            for minute in sorted(minutes):
                pipe.pexpire(activity_key(prefix, minute), ttl)
            pipe.execute()
        except Exception as exc:  # noqa: BLE001 - Redis down or refusing: drop the batch
            self.dropped += len(counts)
            log_event(
                "activity_dropped",
                logging.DEBUG if self._warned else logging.WARNING,
                fields=len(counts),
                dropped=self.dropped,
                error=exc,
            )
            self._warned = True
            return 0
        self.flushes += 1
        return len(counts)


# event -> what it counts ("breaker": a state change).
_KINDS: dict[str, str] = {
    "lock_acquired": "exec",
    "lock_released": "hold",
    "lock_contended": "contended",
    "transition_conflict": "conflict",
    "idempotency_replayed": "duplicate",
    "idempotency_conflict": "duplicate",
    "rate_limit_allowed": "admitted",
    "rate_limited": "limited",
    **dict.fromkeys(_STATES, "breaker"),
}

_aggregator: Aggregator | None = None
_install_guard = threading.Lock()


def aggregator() -> Aggregator | None:
    """The process's installed :class:`Aggregator` (None before :func:`install`)."""
    return _aggregator


def install(app: Any = None) -> Aggregator:
    """Tap the process's aggregator into every event (:data:`celery_steplock.events.TAPS`:
    called by :func:`~celery_steplock.events.emit` before the signal is sent, which costs
    less than a signal receiver); idempotent.

    Args:
        app: The Celery app (default: the first event's sender's, else the current app).

    Returns:
        The :class:`Aggregator`.
    """
    global _aggregator
    with _install_guard:
        if _aggregator is None:
            _aggregator = Aggregator(app)
            TAPS.append(_aggregator.count)
        elif app is not None:
            _aggregator.app = app
        return _aggregator


def uninstall() -> None:
    """Remove the aggregator's tap and stop its flusher (what was counted is dropped)."""
    global _aggregator
    with _install_guard:
        if _aggregator is not None:
            if _aggregator.count in TAPS:
                TAPS.remove(_aggregator.count)
            _aggregator.stop()
        _aggregator = None


def _after_fork_in_child() -> None:
    if _aggregator is not None:
        _aggregator._reset()


def _at_exit() -> None:
    if _aggregator is not None:
        _aggregator.flush()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_at_exit)


# -- reading ----------------------------------------------------------------------------------


def quantile(histogram: list[int], q: float) -> float | None:
    """The upper bound (seconds) of the bucket holding quantile ``q`` (0 < q <= 1) of a
    histogram over :data:`BOUNDS` (plus the overflow bucket); None when it is empty."""
    total = sum(histogram)
    if total <= 0:
        return None
    rank = math.ceil(q * total)
    seen = 0
    for index, count in enumerate(histogram):
        seen += count
        if seen >= rank:
            return BOUNDS[min(index, len(BOUNDS) - 1)]
    return BOUNDS[-1]  # pragma: no cover - seen reaches total


@dataclass
class TaskSeries:
    """One task's minutes (lists of :attr:`Activity.minutes` items, oldest first); the
    quantiles in seconds, None for a minute without a sample."""

    name: str
    executions: list[int]
    contended: list[int]
    conflicts: list[int]
    duplicates: list[int]
    wait: list[list[int]] = field(repr=False)
    hold: list[list[int]] = field(repr=False)

    def _quantiles(self, histograms: list[list[int]], q: float) -> list[float | None]:
        return [quantile(h, q) for h in histograms]

    @property
    def wait_p50(self) -> list[float | None]:
        return self._quantiles(self.wait, 0.5)

    @property
    def wait_p95(self) -> list[float | None]:
        return self._quantiles(self.wait, 0.95)

    @property
    def hold_p50(self) -> list[float | None]:
        return self._quantiles(self.hold, 0.5)

    @property
    def hold_p95(self) -> list[float | None]:
        return self._quantiles(self.hold, 0.95)

    @property
    def total(self) -> int:
        """Executions, contention, conflicts and duplicates of the whole window."""
        return (
            sum(self.executions) + sum(self.contended) + sum(self.conflicts) + sum(self.duplicates)
        )


@dataclass
class LimitSeries:
    """One rate limit's admitted and limited executions per minute."""

    name: str
    admitted: list[int]
    limited: list[int]


@dataclass
class BreakerTimeline:
    """One breaker's state changes in the window: ``(seconds since the window's start,
    state)``, oldest first; ``state`` one of ``"open"``, ``"half_open"``, ``"closed"``."""

    name: str
    transitions: list[tuple[int, str]]


@dataclass
class Activity:
    """What :func:`read` returns.

    Attributes:
        start: The window's first minute (Unix seconds // 60); minute ``i`` of a series is
            ``start + i``.
        minutes: The window's length, minutes.
        tasks, limits, breakers: By name, busiest tasks first.
        malformed: Fields, values or keys that no flusher writes, skipped.
        left_out: Subjects beyond :data:`MAX_SUBJECTS`, not shown.
    """

    start: int
    minutes: int
    tasks: dict[str, TaskSeries]
    limits: dict[str, LimitSeries]
    breakers: dict[str, BreakerTimeline]
    malformed: int = 0
    left_out: int = 0


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read(client: Any, prefix: str, minutes: int = 60, now: float | None = None) -> Activity:
    """The last ``minutes`` minutes of activity, the current one included.

    Args:
        client: A redis client (any ``decode_responses``).
        prefix: The key prefix (``steplock_key_prefix``).
        minutes: The window, 1 to :data:`MAX_MINUTES` (clamped).
        now: Unix seconds (default: this host's clock).

    Returns:
        An :class:`Activity`.

    Raises:
        redis.RedisError: Redis could not be reached (the page shows it); a corrupt entry
            never raises (it is counted in ``malformed``).
    """
    minutes = max(1, min(int(minutes), MAX_MINUTES))
    last = int(time.time() if now is None else now) // 60
    start = last - minutes + 1
    pipe = client.pipeline(transaction=False)
    for minute in range(start, last + 1):
        pipe.hgetall(activity_key(prefix, minute))
    replies = pipe.execute(raise_on_error=False)
    size = len(BOUNDS) + 1
    counters: dict[str, dict[str, list[int]]] = {}
    histograms: dict[str, dict[str, list[list[int]]]] = {}
    limits: dict[str, dict[str, list[int]]] = {}
    breakers: dict[str, list[tuple[int, str]]] = {}
    malformed = 0
    for index, reply in enumerate(replies):
        if isinstance(reply, Exception) or not isinstance(reply, dict):
            malformed += 1  # WRONGTYPE: another program's key
            continue
        for raw_name, raw_value in reply.items():
            try:
                subject, metric, bucket = _text(raw_name).rsplit("|", 2)
                count = int(_text(raw_value))
                if count < 0:
                    raise ValueError(count)
                if metric in _TASK_COUNTERS:
                    if bucket:
                        raise ValueError(bucket)
                    series = counters.get(subject)
                    if series is None:
                        series = counters[subject] = {m: [0] * minutes for m in _TASK_COUNTERS}
                    series[metric][index] += count
                elif metric in _HISTOGRAMS:
                    slot = int(bucket)
                    if not 0 <= slot < size:
                        raise ValueError(bucket)
                    by_metric = histograms.get(subject)
                    if by_metric is None:
                        by_metric = histograms[subject] = {
                            m: [[0] * size for _ in range(minutes)] for m in _HISTOGRAMS
                        }
                    by_metric[metric][index][slot] += count
                elif metric in _LIMIT_COUNTERS:
                    if bucket:
                        raise ValueError(bucket)
                    limit = limits.get(subject)
                    if limit is None:
                        limit = limits[subject] = {m: [0] * minutes for m in _LIMIT_COUNTERS}
                    limit[metric][index] += count
                elif metric == "state":
                    second, state = bucket.split(":")
                    if state not in _BREAKER_STATES or not 0 <= int(second) < 60:
                        raise ValueError(bucket)
                    breakers.setdefault(subject, []).append((index * 60 + int(second), state))
                else:
                    raise ValueError(metric)
            except (ValueError, UnicodeDecodeError):
                malformed += 1
    empty = [0] * minutes
    tasks = {}
    for name in set(counters) | set(histograms):
        counts = counters.get(name, {})
        hists = histograms.get(name, {})
        tasks[name] = TaskSeries(
            name=name,
            executions=counts.get("exec", empty),
            contended=counts.get("contended", empty),
            conflicts=counts.get("conflict", empty),
            duplicates=counts.get("duplicate", empty),
            wait=hists.get("wait") or [[0] * size for _ in range(minutes)],
            hold=hists.get("hold") or [[0] * size for _ in range(minutes)],
        )
    ordered = sorted(tasks.values(), key=lambda t: (-t.total, t.name))
    left_out = max(0, len(ordered) - MAX_SUBJECTS)
    left_out += max(0, len(limits) - MAX_SUBJECTS) + max(0, len(breakers) - MAX_SUBJECTS)
    return Activity(
        start=start,
        minutes=minutes,
        tasks={t.name: t for t in ordered[:MAX_SUBJECTS]},
        limits={
            name: LimitSeries(name, v["admitted"], v["limited"])
            for name, v in sorted(limits.items())[:MAX_SUBJECTS]
        },
        breakers={
            name: BreakerTimeline(name, sorted(v))
            for name, v in sorted(breakers.items())[:MAX_SUBJECTS]
        },
        malformed=malformed,
        left_out=left_out,
    )
