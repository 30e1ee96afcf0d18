"""Prometheus metrics of leases and transitions, from the library's signals.

``pip install 'celery-steplock[prometheus]'`` (brings ``prometheus_client``), then in the
module that creates the Celery app::

    from celery_steplock.contrib import prometheus
    prometheus.install(app, port=9808)     # port: serve /metrics from the worker's main process

Nothing is measured until :func:`install` is called: it connects receivers to the
signals of :mod:`celery_steplock.signals`, and costs nothing otherwise. The metrics
(``prefix`` ``"steplock"`` by default; ``task`` is the task name, never an argument):

==============================================================  =========  ============================================
``steplock_events_total{event, task}``                          counter    every signal sent (lock_acquired, ...)
``steplock_outcomes_total{task, outcome}``                      counter    ``committed`` (transition_applied),
                                                                           ``conflict``, ``contended``, ``lost``,
                                                                           ``store_error``, ``force_released``,
                                                                           ``reaped`` (lock_expired), ``replayed``,
                                                                           ``recorded``, ``idempotency_conflict``,
                                                                           ``idempotency_failed``,
                                                                           ``concurrency_limited``, ``slot_expired``
``steplock_idempotency_total{namespace, outcome}``              counter    idempotency decisions: ``locked``,
                                                                           ``replayed``, ``completed``, ``failed``,
                                                                           ``reused``, ``in_progress``
``steplock_wait_seconds{task}``                                 histogram  acquiring a lease (granted or contended)
``steplock_hold_seconds{task}``                                 histogram  a lease from its acquire to its release
``steplock_cas_seconds{task}``                                  histogram  a compare-and-swap that was committed
``steplock_commit_seconds{task}``                               histogram  its COMMIT
``steplock_leases_held{task}``                                  gauge      leases held now by this process (summed over
                                                                           live processes)
``steplock_circuit_transitions_total{breaker, state, manual}``  counter    a circuit breaker's state changes (open,
                                                                           half_open, closed)
``steplock_circuit_rejected_total{breaker}``                    counter    calls an open breaker refused
``steplock_retry_decisions_total{task, decision}``              counter    retry policy decisions (retry, give_up,
                                                                           never)
``steplock_slots_held{task}``                                   gauge      concurrency-limit slots held now (summed
                                                                           over live processes)
``steplock_rate_limit_decisions_total{task, limit, decision}``  counter    cluster-wide rate-limit decisions (allowed,
                                                                           limited)
``steplock_effects_total{kind, result}``                        counter    effects outbox dispatches: ``dispatched``,
                                                                           ``retry``, ``dead`` (the ``effect_*``
                                                                           signals; ``kind``: task, http, email, call)
``steplock_overlap_total{task, policy, decision}``              counter    periodic sends the overlap guard skipped
                                                                           or queued as the one follower
                                                                           (``skipped``, ``coalesced``)
``steplock_effects_pending``                                    gauge      effects waiting in the outbox (status
                                                                           pending), read at scrape
``steplock_effects_oldest_pending_seconds``                     gauge      age of the oldest of them (0 when none),
                                                                           read at scrape
``steplock_lease_waiting{task}``                                gauge      executions waiting for a lease now
                                                                           (``lock_wait``, past the first refusal;
                                                                           summed over live processes)
``steplock_lease_oldest_wait_start_timestamp_seconds{task}``    gauge      when the oldest of them started waiting
                                                                           (Unix time, min over live processes;
                                                                           absent when none waits)
``steplock_limit_waiting{kind, limit}``                         gauge      callers waiting in this process for a
                                                                           limit (``kind`` "concurrency": a slot of
                                                                           ``ConcurrencyLimit.acquire(wait=...)``,
                                                                           ``limit`` its key)
``steplock_limit_oldest_wait_start_timestamp_seconds``          gauge      when the oldest of them started
                                                                           (``kind``, ``limit``; as the lease's)
==============================================================  =========  ============================================

The wait gauges are set when a wait starts (the first refusal: an acquire granted at once
never touches them) and ends (:class:`celery_steplock.lock.WaitRegistry`). The age of the
oldest wait is computed where it is read: ``time() - steplock_lease_oldest_wait_start_timestamp_seconds``
in PromQL, right across processes and hosts (``min by (task)``). A rate limit never waits
in a process (a denied task is re-queued with a countdown, its ticket in Redis): its
denials are ``steplock_rate_limit_decisions_total{decision="limited"}``.

The two outbox gauges are read from the database at each scrape
(:func:`celery_steplock.contrib.django.outbox.pending_stats`: one indexed query per database
with the table), only when Django is set up with ``celery_steplock.contrib.django`` installed
(otherwise they are absent); a database error leaves them out of that scrape (a WARNING line
``metrics_effects_unavailable``), never fails it. A connection the scrape opened is closed
after it (the exporter's threads are not Django's request cycle).

Several processes on one host (prefork children, several workers, the web process's
workers): :func:`install` (without a ``registry``) puts the process in
``prometheus_client``'s multiprocess mode, each process writing its values to files of one
directory per host: ``PROMETHEUS_MULTIPROC_DIR`` when set, else
:func:`default_multiprocess_dir` (``<tempdir>/celery-steplock-prometheus-<uid>``, mode 0700;
a path that is not this user's private directory is refused, a WARNING line
``metrics_dir_unusable``, and the process stays in single-process mode). The first process
to start when no other one of the directory is alive empties the default directory (a new
run, as ``prometheus_client`` requires); a process that starts while siblings run removes
only the live-gauge files of dead pids. A directory you set yourself is created if missing
but never emptied (other programs may write there: empty it between runs yourself, as
before). The ``/metrics`` served by ``port`` (or :func:`serve`, or :func:`scrape_registry`
in your own exporter, or the Django view :func:`celery_steplock.contrib.django.metrics.metrics_view`)
aggregates the files: counters and histograms summed over every process that ever ran in
this run (children that exited included), the gauge over live processes only
(``livesum``; a child that exits has its gauge files removed on ``worker_process_shutdown``,
and the scrape leaves out the gauge of a process that is gone without it, e.g. SIGKILLed).

One exporter per host: with the same ``port`` in every worker (the app module is the
same), the first worker to bind ``addr:port`` serves every process's metrics and logs
``event=metrics_served url=http://127.0.0.1:9808/metrics``; each other worker logs
``event=metrics_served_by_sibling sibling=<pid>`` (no traceback, no second exporter whose
sums would double the host's when both are scraped) and retries the bind every
:data:`STANDBY_INTERVAL` seconds, so that a sibling takes over when the serving worker
stops. One scrape target per host, as for a gunicorn server in multiprocess mode: the
``instance`` label names the host, not a worker (a worker's own figures are not
separated; ``task`` still is). The address held by another program: a WARNING line
``metrics_address_in_use``.
"""

from __future__ import annotations

import errno
import glob
import logging
import math
import os
import stat
import tempfile
import threading
import time
from typing import Any

from celery.signals import worker_process_init, worker_process_shutdown, worker_ready
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, multiprocess
from prometheus_client import start_http_server as _start_http_server
from prometheus_client import values as _values
from prometheus_client.core import GaugeMetricFamily

from .. import _django, signals
from ..events import log_event
from ..lock import WAITS

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock; the directory is never wiped
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "install",
    "uninstall",
    "serve",
    "scrape_registry",
    "multiprocess_dir",
    "default_multiprocess_dir",
    "Metrics",
    "MultiProcessCollector",
    "OutboxCollector",
    "OUTCOMES",
    "EFFECT_RESULTS",
]

#: The outcome each signal stands for (``steplock_outcomes_total``).
OUTCOMES = {
    "transition_applied": "committed",
    "transition_conflict": "conflict",
    "lock_contended": "contended",
    "lock_lost": "lost",
    "lock_store_error": "store_error",
    "lock_expired": "reaped",
    "idempotency_replayed": "replayed",
    "idempotency_completed": "recorded",
    "idempotency_conflict": "idempotency_conflict",
    "idempotency_failed": "idempotency_failed",
    "concurrency_limited": "concurrency_limited",
    "slot_expired": "slot_expired",
}

#: The result each effects outbox signal stands for (``steplock_effects_total``).
EFFECT_RESULTS = {
    "effect_dispatched": "dispatched",
    "effect_retry": "retry",
    "effect_dead": "dead",
}

WAIT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
DB_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


#: Seconds between a standby worker's attempts to bind the exporter's address, once the
#: sibling serving it is gone.
STANDBY_INTERVAL = 5.0

#: Seconds a worker whose bind failed waits for a sibling's marker before it reports the
#: address as taken by another program.
MARKER_WAIT = 2.0

#: Longest a fork of this process waits for a scrape in progress, in seconds; then it forks
#: anyway, and later forks do not wait for that same scrape again.
FORK_WAIT = 1.0


class _ForkGate:
    """Scrapes and forks of this process, one at a time.

    A prefork worker's main process forks its children (at start, and to replace a child
    after ``--max-tasks-per-child``) while its exporter thread may be scraping. A child is a
    copy of that instant with only the forking thread: whatever the scraping thread held then
    (a module's import lock while Django imports the database backend's SQL compiler on the
    first read of the outbox, a lock of ``prometheus_client``'s values) stays held in the
    child, and the child's first use of it waits for ever. It happened: a replacement child
    hung in ``import django.db.backends.mysql.compiler`` with its lease renewed by its
    heartbeat. POSIX leaves a multithreaded process's child only async-signal-safe calls for
    that reason; ``os.register_at_fork`` makes a fork wait for the scrape in progress and a
    scrape wait while a fork runs.

    A scrape that hangs (a database that does not answer) delays one fork by at most
    :data:`FORK_WAIT` seconds; the forks after it go ahead at once until that scrape ends. A
    re-entrant lock: a fork from inside a scrape (a collector's subprocess) and a scrape
    inside a scrape do not wait on themselves. Each child starts with a gate of its own."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._mine = threading.local()  # per forking thread: whether it holds the gate
        self._given_up = False  # a fork stopped waiting for the scrape in progress

    def scraping(self) -> _GateHeld:
        """``with gate.scraping():`` around work a forked child must not inherit half done."""
        return _GateHeld(self)

    def before_fork(self) -> None:
        held = self._lock.acquire(timeout=0 if self._given_up else FORK_WAIT)
        if not held:
            self._given_up = True
        self._mine.held = held

    def after_in_parent(self) -> None:
        if getattr(self._mine, "held", False):
            self._mine.held = False
            self._lock.release()

    def after_in_child(self) -> None:
        # The parent's lock may be held by a thread the child does not have: a new one.
        self._lock = threading.RLock()
        self._mine = threading.local()
        self._given_up = False


class _GateHeld:
    def __init__(self, gate: _ForkGate) -> None:
        self._gate = gate
        self._lock = gate._lock

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc_info: Any) -> None:
        self._gate._given_up = False
        self._lock.release()


_FORK_GATE = _ForkGate()
if hasattr(os, "register_at_fork"):  # POSIX; Windows has no fork
    os.register_at_fork(
        before=_FORK_GATE.before_fork,
        after_in_parent=_FORK_GATE.after_in_parent,
        after_in_child=_FORK_GATE.after_in_child,
    )


class _GatedRegistry:
    """The registry the exporter serves, collected inside the fork gate: in single-process
    mode too, where the metrics' own values are read (``prometheus_client``'s locks)."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry

    def collect(self) -> Any:
        with _FORK_GATE.scraping():
            return iter(list(self._registry.collect()))

    def restricted_registry(self, names: Any) -> _GatedRegistry:
        return _GatedRegistry(self._registry.restricted_registry(names))


def multiprocess_dir() -> str | None:
    """``PROMETHEUS_MULTIPROC_DIR`` (None: single-process mode)."""
    legacy = os.environ.get("prometheus_multiproc_dir")  # noqa: SIM112 - the old spelling
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or legacy or None


def default_multiprocess_dir() -> str:
    """The directory :func:`install` uses when ``PROMETHEUS_MULTIPROC_DIR`` is unset: one per
    host and user, ``<tempfile.gettempdir()>/celery-steplock-prometheus-<uid>`` (``TMPDIR``
    moves it)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"celery-steplock-prometheus-{uid}")


def _private_dir(path: str) -> None:
    """Create ``path`` (mode 0700) unless it exists; raise OSError unless it is a directory
    (not a symlink) of this user that nobody else may write: a directory another local user
    made in the shared temporary directory must not receive, or feed, our metrics."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    uid = os.getuid() if hasattr(os, "getuid") else info.st_uid
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or info.st_mode & 0o022:
        raise OSError(errno.EPERM, "not a directory of this user that only it may write", path)


#: The descriptor holding this process's shared lock on the directory's ``.live.lock``
#: (held for the process's life, inherited by prefork children).
_live_fd: int | None = None


def _join_run(path: str, managed: bool) -> tuple[bool, int]:
    """Join the host's run of processes writing to ``path``; returns ``(fresh, removed)``.

    Under an exclusive lock on ``.start.lock`` (one process starting at a time): when no
    other live process holds ``.live.lock`` (``fresh``), a ``managed`` directory (the
    default one, which only this library writes) is emptied of its ``*.db`` files, as
    ``prometheus_client`` requires between runs; otherwise only the live gauges' files
    (``gauge_live*_<pid>.db``) of dead processes and of this pid (a pid reused by a new
    process would carry the dead one's "leases held") are removed. Counters and histograms
    of exited processes are kept while a sibling runs: a sum that went down would be read
    by Prometheus as a counter reset. This process then holds a shared lock on
    ``.live.lock`` until it exits. A user's ``PROMETHEUS_MULTIPROC_DIR`` is never emptied
    (other programs may write there)."""
    global _live_fd
    if fcntl is None or _live_fd is not None:
        return False, 0
    fresh, removed = False, 0
    start = os.open(os.path.join(path, ".start.lock"), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(start, fcntl.LOCK_EX)
        live = os.open(os.path.join(path, ".live.lock"), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(live, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fresh = True
        except BlockingIOError:
            pass
        for name in os.listdir(path):
            if not name.endswith(".db"):
                continue
            pid = name[:-3].rsplit("_", 1)[-1]
            if (fresh and managed) or (
                name.startswith("gauge_live")
                and pid.isdigit()
                and (int(pid) == os.getpid() or not _alive(int(pid)))
            ):
                try:
                    os.unlink(os.path.join(path, name))
                    removed += 1
                except FileNotFoundError:
                    pass
        fcntl.flock(live, fcntl.LOCK_SH)  # under .start.lock: nobody takes it meanwhile
        _live_fd = live
    finally:
        os.close(start)
    return fresh, removed


def _multiprocess_mode() -> str | None:
    """Turn on ``prometheus_client``'s multiprocess mode for this process (and the
    processes it forks or starts) with :func:`default_multiprocess_dir` when
    ``PROMETHEUS_MULTIPROC_DIR`` is unset; returns the directory (None: it could not be
    used, a WARNING line ``metrics_dir_unusable``, single-process mode stays).

    ``prometheus_client`` chooses where a metric's values live when it creates them (at a
    labelled metric's first ``labels()``, in the process that calls it), from the value
    class it picked at its import. Ours are all labelled, and :func:`install` runs at the
    import of the Celery app's module, before the worker forks its children: this sets the
    variable and, if ``prometheus_client`` was imported without it, its value class, so
    that every value created afterwards is written to the directory."""
    path = multiprocess_dir()
    managed = path is None
    try:
        if path is None:
            path = default_multiprocess_dir()
            _private_dir(path)
        else:
            os.makedirs(path, exist_ok=True)
        fresh, removed = _join_run(path, managed)
    except OSError as exc:
        log_event(
            "metrics_dir_unusable",
            logging.WARNING,
            path=path,
            error=exc,
            reason="metrics stay in this process's memory (single-process mode)",
        )
        return None
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    if _values.ValueClass is _values.MutexValue:
        _values.ValueClass = _values.MultiProcessValue()
    log_event(
        "metrics_dir",
        logging.DEBUG,
        path=path,
        managed=managed,
        fresh=fresh,
        removed=removed,
        pid=os.getpid(),
    )
    return path


class Metrics:
    """The metric objects and the signal receivers of one :func:`install`."""

    def __init__(self, registry: CollectorRegistry | None = None, prefix: str = "steplock"):
        self.registry = REGISTRY if registry is None else registry
        self.prefix = prefix

        def metric(kind: Any, name: str, doc: str, labels: list[str], **options: Any) -> Any:
            return kind(f"{prefix}_{name}", doc, labels, registry=self.registry, **options)

        self.events = metric(
            Counter, "events", "celery-steplock signals sent, by event and task", ["event", "task"]
        )
        self.outcomes = metric(
            Counter,
            "outcomes",
            "Outcomes of lease and transition events, by task",
            ["task", "outcome"],
        )
        self.wait = metric(
            Histogram,
            "wait_seconds",
            "Time to acquire a lease (granted or contended), seconds",
            ["task"],
            buckets=WAIT_BUCKETS,
        )
        self.hold = metric(
            Histogram,
            "hold_seconds",
            "Time a lease was held, grant to release, seconds",
            ["task"],
            buckets=HOLD_BUCKETS,
        )
        self.cas = metric(
            Histogram,
            "cas_seconds",
            "Duration of a committed compare-and-swap, seconds",
            ["task"],
            buckets=DB_BUCKETS,
        )
        self.commit = metric(
            Histogram,
            "commit_seconds",
            "Duration of the COMMIT after a compare-and-swap, seconds",
            ["task"],
            buckets=DB_BUCKETS,
        )
        self.idempotency = metric(
            Counter,
            "idempotency",
            "Idempotency record decisions, by namespace (task, function or view) and outcome",
            ["namespace", "outcome"],
        )
        self.circuit_transitions = metric(
            Counter,
            "circuit_transitions",
            "Circuit breaker state changes, by breaker, new state and whether an operator made it",
            ["breaker", "state", "manual"],
        )
        self.circuit_rejected = metric(
            Counter, "circuit_rejected", "Calls refused by an open circuit breaker", ["breaker"]
        )
        self.retry_decisions = metric(
            Counter,
            "retry_decisions",
            "Retry policy decisions after a failed attempt",
            ["task", "decision"],
        )
        self.held = metric(
            Gauge,
            "leases_held",
            "Leases held by live processes",
            ["task"],
            multiprocess_mode="livesum",
        )
        self.slots = metric(
            Gauge,
            "slots_held",
            "Concurrency-limit slots held by live processes",
            ["task"],
            multiprocess_mode="livesum",
        )
        self._slots: dict[tuple[str, str], str] = {}
        self.rate_decisions = metric(
            Counter,
            "rate_limit_decisions",
            "Cluster-wide rate-limit decisions, by task, limit and decision (allowed, limited)",
            ["task", "limit", "decision"],
        )
        self.effects = metric(
            Counter,
            "effects",
            "Effects outbox dispatches, by kind and result (dispatched, retry, dead)",
            ["kind", "result"],
        )
        self.overlap = metric(
            Counter,
            "overlap",
            "Sends the overlap guard skipped or queued as the one follower, by task, policy "
            "and decision (skipped, coalesced)",
            ["task", "policy", "decision"],
        )
        self.lease_waiting = metric(
            Gauge,
            "lease_waiting",
            "Executions waiting for a lease now, in live processes",
            ["task"],
            multiprocess_mode="livesum",
        )
        self.lease_oldest = metric(
            Gauge,
            "lease_oldest_wait_start_timestamp_seconds",
            "Start of the oldest wait for a lease in progress, seconds since the epoch",
            ["task"],
            multiprocess_mode="livemin",
        )
        self.limit_waiting = metric(
            Gauge,
            "limit_waiting",
            "Callers waiting for a limit now (kind: concurrency), in live processes",
            ["kind", "limit"],
            multiprocess_mode="livesum",
        )
        self.limit_oldest = metric(
            Gauge,
            "limit_oldest_wait_start_timestamp_seconds",
            "Start of the oldest wait for a limit in progress, seconds since the epoch",
            ["kind", "limit"],
            multiprocess_mode="livemin",
        )
        # Read at scrape from the database (single-process mode: here; multi-process mode:
        # on the registry scrape_registry() builds).
        self.registry.register(OutboxCollector(prefix))
        # (key, owner) of the leases this process holds: a lease lost and then released (or
        # another process's lease released by an operator) is never counted twice.
        self._holding: dict[tuple[str, str], str] = {}
        self._holding_pid = os.getpid()
        self._lock = threading.Lock()

    def receive(
        self, sender: Any = None, signal: Any = None, event: str | None = None, **fields: Any
    ) -> None:
        """The receiver connected to every celery-steplock signal."""
        event = event or str(getattr(signal, "name", ""))
        task = fields.get("task_name") or ""
        self.events.labels(event, task).inc()
        outcome = OUTCOMES.get(event)
        if event == "lock_released" and fields.get("forced"):
            outcome = "force_released"
        if outcome is not None:
            self.outcomes.labels(task, outcome).inc()
        if event.startswith("idempotency_"):
            kind = event[len("idempotency_") :]
            if kind == "conflict":
                kind = str(fields.get("reason") or kind)
            self.idempotency.labels(str(fields.get("name") or ""), kind).inc()
        if event in ("rate_limit_allowed", "rate_limited"):
            self.rate_decisions.labels(
                task,
                fields.get("limit") or "",
                "allowed" if event == "rate_limit_allowed" else "limited",
            ).inc()
        if event in ("lock_acquired", "lock_contended"):
            self._observe(self.wait, task, fields.get("wait_seconds"))
        elif event == "lock_released":
            self._observe(self.hold, task, fields.get("hold_seconds"))
        elif event == "transition_applied":
            self._observe(self.cas, task, fields.get("cas_seconds"))
            self._observe(self.commit, task, fields.get("commit_seconds"))
        if event in ("circuit_opened", "circuit_half_opened", "circuit_closed"):
            self.circuit_transitions.labels(
                fields.get("name") or "",
                fields.get("state") or "",
                "true" if fields.get("manual") else "false",
            ).inc()
        elif event == "circuit_rejected":
            self.circuit_rejected.labels(fields.get("name") or "").inc()
        elif event == "retry_policy_decided":
            self.retry_decisions.labels(task, fields.get("decision") or "").inc()
        elif event in ("overlap_skipped", "overlap_coalesced"):
            self.overlap.labels(task, str(fields.get("policy") or ""), event[8:]).inc()
        elif event in EFFECT_RESULTS:
            self.effects.labels(str(fields.get("kind") or ""), EFFECT_RESULTS[event]).inc()
        if event == "lock_acquired":
            self._held(fields, task, add=True)
        elif event in ("lock_released", "lock_lost"):
            self._held(fields, task, add=False)
        if event == "slot_acquired":
            self._held(fields, task, add=True, gauge=self.slots, holding=self._slots)
        elif event in ("slot_released", "slot_expired"):
            self._held(fields, task, add=False, gauge=self.slots, holding=self._slots)

    def waits_changed(self, kind: str, label: str, count: int, oldest: float | None) -> None:
        """The :data:`~celery_steplock.lock.WAITS` listener: a wait of ``kind`` ("lease":
        ``label`` the task; else a limit, ``label`` its key) started or ended, ``count`` of
        them now in this process, the oldest started at ``oldest`` (None: none). With none,
        the start gauge is removed (single-process mode) or set to +Inf, which
        :class:`MultiProcessCollector` leaves out (the files keep a labelset's last value)."""
        labels: tuple[str, ...]
        if kind == "lease":
            waiting, start, labels = self.lease_waiting, self.lease_oldest, (label,)
        else:
            waiting, start, labels = self.limit_waiting, self.limit_oldest, (kind, label)
        waiting.labels(*labels).set(count)
        if oldest is not None:
            start.labels(*labels).set(oldest)
        elif multiprocess_dir() is None:
            start.remove(*labels)
        else:
            start.labels(*labels).set(math.inf)

    @staticmethod
    def _observe(histogram: Histogram, task: str, value: Any) -> None:
        if isinstance(value, (int, float)) and value >= 0:
            histogram.labels(task).observe(value)

    def _held(
        self,
        fields: dict[str, Any],
        task: str,
        add: bool,
        gauge: Any = None,
        holding: dict[tuple[str, str], str] | None = None,
    ) -> None:
        gauge = self.held if gauge is None else gauge
        key, owner = fields.get("key"), fields.get("owner")
        if key is None or owner is None:
            return
        lease: tuple[str, str] = (key, owner)
        with self._lock:
            if self._holding_pid != os.getpid():  # a forked child holds none of the parent's
                self._holding.clear()
                self._slots.clear()
                self._holding_pid = os.getpid()
            holding = self._holding if holding is None else holding
            if add:
                holding[lease] = task
                count = sum(1 for t in holding.values() if t == task)
            elif holding.pop(lease, None) is not None:
                count = sum(1 for t in holding.values() if t == task)
            else:
                return
            gauge.labels(task).set(count)


_installed: Metrics | None = None
_install_lock = threading.Lock()
_server_port: dict[str, Any] = {}


def install(
    app=None,
    *,
    registry: CollectorRegistry | None = None,
    port: int | None = None,
    addr: str = "127.0.0.1",
    prefix: str = "steplock",
) -> Metrics:
    """Start measuring: connect the receivers to every celery-steplock signal (once per
    process; a second call returns the first call's :class:`Metrics`).

    Without ``registry``, the process joins the host's multiprocess directory
    (``PROMETHEUS_MULTIPROC_DIR``, or when unset :func:`default_multiprocess_dir`, created
    and emptied at the start of a run by this library; see the module docstring):
    multiprocess mode is process-global and stays on after :func:`uninstall`. With a
    ``registry``, the metrics are registered there and nothing else changes (the in-process
    mode of tests and of your own exporter).

    ``port``: serve ``/metrics`` on ``addr:port`` from the worker's main process once it is
    ready (``worker_ready``): one exporter per host, the first worker to bind the address
    serves every process's metrics from the directory; the others log
    ``metrics_served_by_sibling`` and take the address over when it is freed (retried every
    :data:`STANDBY_INTERVAL` seconds). ``app`` is accepted for symmetry with Celery's own
    helpers and not needed. Raises ValueError for a ``port`` outside 0-65535."""
    global _installed
    if port is not None and not (isinstance(port, int) and 0 <= port <= 65535):
        raise ValueError(f"port must be an int in 0-65535, not {port!r}")
    with _install_lock:
        if _installed is None:
            if registry is None:
                _multiprocess_mode()
            metrics = Metrics(registry, prefix)
            for signal in signals.ALL_SIGNALS:
                signal.connect(metrics.receive, weak=False)
            WAITS.listener = metrics.waits_changed
            worker_process_init.connect(_child_started, weak=False)
            worker_process_shutdown.connect(_child_exited, weak=False)
            worker_ready.connect(_warn_without_multiprocess, weak=False)
            _installed = metrics
        if port is not None and not _server_port:
            _server_port.update(port=port, addr=addr)
            worker_ready.connect(_serve_when_ready, weak=False)
        return _installed


def uninstall() -> None:
    """Disconnect the receivers (the metrics stay registered; a later :func:`install`
    returns new ones only with another ``registry`` or ``prefix``)."""
    global _installed
    with _install_lock:
        if _installed is not None:
            for signal in signals.ALL_SIGNALS:
                signal.disconnect(_installed.receive)
            if WAITS.listener == _installed.waits_changed:
                WAITS.listener = None
            worker_process_init.disconnect(_child_started)
            worker_process_shutdown.disconnect(_child_exited)
            worker_ready.disconnect(_warn_without_multiprocess)
            _installed = None
        if _server_port:
            worker_ready.disconnect(_serve_when_ready)
            _server_port.clear()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


#: The metric types of the files ``prometheus_client`` writes in multiprocess mode.
_FILE_TYPES = frozenset(("counter", "gauge", "histogram", "summary"))


def _mergeable(collector: Any, path: str) -> bool:
    """Whether the file at ``path`` merges alone (not truncated or corrupt; not removed)."""
    try:
        collector.merge([path], accumulate=True)
    except Exception:  # noqa: BLE001 - any failure: the file is left out
        return False
    return True


class MultiProcessCollector(multiprocess.MultiProcessCollector):
    """``prometheus_client``'s collector, with two differences. A file that a starting
    process has created and not yet sized (a prefork child replaced by
    ``--max-tasks-per-child``, say) is left out of this scrape instead of failing it with
    HTTP 500 (it holds no sample yet). A live gauge (``livesum``) of a process that no longer
    exists is left out: a child killed by SIGKILL or the OOM killer runs no
    ``worker_process_shutdown``, and its last "leases held" would otherwise count forever
    (multiprocess mode is per host, so the pids are this host's). A wait's start gauge
    (``*_wait_start_timestamp_seconds``) at +Inf, which says no wait is in progress, is left
    out: the series is absent when nothing waits. A file whose name is not one
    ``prometheus_client`` writes (``<type>_<pid>.db``, ``gauge_<mode>_<pid>.db``: the
    directory may hold other programs' files) is left out, and so is a file that cannot be
    read, so one bad file never fails the scrape."""

    def collect(self):
        with _FORK_GATE.scraping():
            return self._collect()

    def _collect(self):
        files = []
        for path in glob.glob(os.path.join(self._path, "*.db")):
            parts = os.path.basename(path)[:-3].split("_")
            if len(parts) < (3 if parts[0] == "gauge" else 2) or parts[0] not in _FILE_TYPES:
                continue  # not a name prometheus_client writes
            if (
                parts[0] == "gauge"
                and parts[1].startswith("live")
                and parts[-1].isdigit()
                and not _alive(int(parts[-1]))
            ):
                continue
            try:
                if os.path.getsize(path) >= 8:  # the used-bytes header is written at creation
                    files.append(path)
            except OSError:  # removed since the listing (a dead process's live gauge)
                continue
        try:
            metrics = self.merge(files, accumulate=True)
        except Exception:  # noqa: BLE001 - one unreadable file: the scrape without it
            metrics = self.merge([f for f in files if _mergeable(self, f)], accumulate=True)
        for metric in metrics:
            if metric.name.endswith("_wait_start_timestamp_seconds"):
                metric.samples = [s for s in metric.samples if not math.isinf(s.value)]
        return metrics


class OutboxCollector:
    """The effects outbox's depth and age, read from the database at each scrape.

    ``<prefix>_effects_pending`` (effects with status pending, every database with the
    table) and ``<prefix>_effects_oldest_pending_seconds`` (the oldest one's age, 0 when
    none), from :func:`celery_steplock.contrib.django.outbox.pending_stats`. Nothing (the
    gauges absent) without Django set up and ``celery_steplock.contrib.django`` installed,
    or when the database fails (one WARNING line ``metrics_effects_unavailable``): a scrape
    never fails for them. A database connection the scrape opened in this thread is closed
    afterwards.

    Args:
        prefix: The metric names' prefix (``"steplock"``).
    """

    def __init__(self, prefix: str = "steplock"):
        self.prefix = prefix

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                f"{self.prefix}_effects_pending",
                "Effects waiting in the outbox (status pending), read at scrape",
            ),
            GaugeMetricFamily(
                f"{self.prefix}_effects_oldest_pending_seconds",
                "Age of the oldest pending effect in the outbox, seconds (0 when none)",
            ),
        )

    def describe(self) -> list[GaugeMetricFamily]:
        """The families without samples (registration reads no database)."""
        return list(self._families())

    def collect(self) -> list[GaugeMetricFamily]:
        """The two gauges, or none (see the class docstring)."""
        if not _django.installed():
            return []
        try:
            with _FORK_GATE.scraping(), _closing_new_connections():
                count, oldest = _django.contrib("outbox").pending_stats()
        except Exception as exc:  # noqa: BLE001 - a scrape never fails for the outbox
            log_event("metrics_effects_unavailable", logging.WARNING, error=exc)
            return []
        pending, age = self._families()
        pending.add_metric([], float(count))
        age.add_metric([], float(oldest or 0.0))
        return [pending, age]


class _closing_new_connections:
    """Close, on exit, the Django database connections this thread opened inside the block
    (an exporter thread's; a connection open before it, a request's, is left alone)."""

    def __enter__(self) -> None:
        from django.db import connections

        self.opened_before = {
            alias for alias in connections if connections[alias].connection is not None
        }

    def __exit__(self, *exc_info: Any) -> None:
        from django.db import connections

        for alias in connections:
            connection = connections[alias]
            if (
                alias not in self.opened_before
                and connection.connection is not None
                and not connection.in_atomic_block
            ):
                connection.close()


def scrape_registry() -> CollectorRegistry:
    """The registry to expose: in multi-process mode a new one that aggregates every
    process's files (and reads the effects outbox's gauges, :class:`OutboxCollector`, once
    :func:`install` ran), else ``prometheus_client.REGISTRY`` (or the ``registry`` given to
    :func:`install`)."""
    path = multiprocess_dir()
    if path is None:
        return _installed.registry if _installed is not None else REGISTRY
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)
    if _installed is not None:
        registry.register(OutboxCollector(_installed.prefix))
    return registry


def serve(port: int, addr: str = "127.0.0.1"):
    """Serve ``/metrics`` of :func:`scrape_registry` on ``addr:port`` from a daemon thread
    of this process; returns ``(server, thread)`` (``server.shutdown()`` stops it)."""
    return _start_http_server(port, addr=addr, registry=_GatedRegistry(scrape_registry()))


def _warn_without_multiprocess(sender=None, **kwargs) -> None:
    """A prefork worker without ``PROMETHEUS_MULTIPROC_DIR``: its children count in their own
    memory, which no scrape of the main process sees (an empty ``/metrics``, silently)."""
    pool = getattr(sender, "pool", None)
    if multiprocess_dir() is None and "prefork" in type(pool).__module__:
        log_event(
            "metrics_not_multiprocess",
            logging.WARNING,
            pool=type(pool).__name__,
            reason="set PROMETHEUS_MULTIPROC_DIR to an empty directory before the worker "
            "starts: the prefork children's metrics are not scraped without it",
        )


def _serve_when_ready(sender=None, **kwargs) -> None:
    if _server_port:
        _export(_server_port["port"], _server_port["addr"], standby=False)


def _exporter_file(path: str, port: int) -> str:
    return os.path.join(path, f"exporter-{port}.pid")


def _export(port: int, addr: str, standby: bool) -> bool:
    """Serve ``/metrics`` on ``addr:port`` unless the address is taken; returns whether this
    process serves it. One INFO line ``metrics_served`` (``url``) when it does. When a
    sibling of the same directory serves it (its pid in ``exporter-<port>.pid``, alive), one
    INFO line ``metrics_served_by_sibling``; another program, one WARNING line
    ``metrics_address_in_use``; either way no traceback, and in multiprocess mode a standby
    thread retries every :data:`STANDBY_INTERVAL` seconds (quietly) to take the address
    over once it is freed. Any other error of the bind (an address not of this host, a
    port the user may not bind): one WARNING line ``metrics_not_served``, no retry."""
    path = multiprocess_dir()
    try:
        server, _thread = serve(port, addr)
    except OSError as exc:
        if standby:
            _standby(port, addr)
            return False
        sibling = _sibling(path, port, wait=MARKER_WAIT) if exc.errno == errno.EADDRINUSE else None
        if sibling is not None:
            log_event(
                "metrics_served_by_sibling",
                addr=addr,
                port=port,
                sibling=sibling,
                path=path,
                pid=os.getpid(),
            )
        elif exc.errno == errno.EADDRINUSE:
            log_event(
                "metrics_address_in_use",
                logging.WARNING,
                addr=addr,
                port=port,
                error=exc,
                pid=os.getpid(),
            )
        else:  # EADDRNOTAVAIL, EACCES...: waiting would not help
            log_event("metrics_not_served", logging.WARNING, addr=addr, port=port, error=exc)
            return False
        if path is not None:
            _standby(port, addr)
        return False
    bound = server.server_address[1]
    if path is not None:
        try:
            target = _exporter_file(path, bound)
            with open(f"{target}.{os.getpid()}", "w") as file:
                file.write(str(os.getpid()))
            os.replace(f"{target}.{os.getpid()}", target)
        except OSError:  # the marker only names the server to its siblings
            pass
    host = f"[{addr}]" if ":" in addr else addr
    log_event(
        "metrics_served",
        url=f"http://{host}:{bound}/metrics",
        addr=addr,
        port=bound,
        path=path,
        pid=os.getpid(),
        took_over=standby or None,
    )
    return True


def _sibling(path: str | None, port: int, wait: float = 0.0) -> int | None:
    """The pid of the live process of this directory that serves ``port``, or None. A
    sibling writes its marker just after its bind: a worker that lost the bind to a sibling
    started at the same moment reads the marker again for up to ``wait`` seconds."""
    if path is None:
        return None
    deadline = time.monotonic() + wait
    while True:
        try:
            with open(_exporter_file(path, port)) as file:
                pid = int(file.read().strip())
        except (OSError, ValueError):
            pid = None
        if pid is not None and pid != os.getpid() and _alive(pid):
            return pid
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _standby(port: int, addr: str) -> None:
    timer = threading.Timer(STANDBY_INTERVAL, _export, args=(port, addr, True))
    timer.daemon = True
    timer.start()


def _child_started(sender=None, **kwargs) -> None:
    """A prefork child starts: a live gauge file its pid left from a dead process (pids are
    reused) goes before the child writes it, or it would show that process's values."""
    if multiprocess_dir() is not None:
        multiprocess.mark_process_dead(os.getpid())


def _child_exited(sender=None, pid=None, **kwargs) -> None:
    """A prefork child exits: its live gauge files go (counters and histograms stay)."""
    if multiprocess_dir() is not None:
        multiprocess.mark_process_dead(pid or os.getpid())
