"""The reaper: remove leases whose holder is gone and recover the steps it left in flight.

A SIGKILL, a hard time limit or an OOM kill runs no ``finally``: the lease waits for its TTL
and a step already moved to an in-flight status stays there; a process that dies between a
step's COMMIT and the dispatch of its effects leaves them pending in the outbox. :func:`reap`
cleans up all three
(``manage.py reap_expired_leases``, ``celery steplock reap``, the
``celery_steplock.reap_expired_leases`` task), only ever by compare-and-delete or
compare-and-swap on what it observed. Unlike python-redis-lock's ``reset_all`` (``KEYS`` and
delete everything, live locks included), it never touches a live lease. Operating it:
docs/howto/operating.md; its two passes: docs/design.md ("Reaper").
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Callable, Iterable

from celery.utils.imports import symbol_by_name

from . import _django, signals
from ._checks import check_seconds
from .conf import Settings
from .events import emit, log_event
from .exceptions import OuterTransactionError, StepLockError
from .lock import RedisLeaseStore, get_lease_store
from .redact import printable

__all__ = [
    "ReapReport",
    "Reaper",
    "reap",
    "pid_alive",
    "REAPER_SENDER",
    "RENEWAL_GRACE_MS",
    "DEFAULT_PING_TIMEOUT",
    "DEFAULT_BATCH_SIZE",
    "MAX_RECORDS",
    "DEFAULT_STEP_RECOVERY",
    "relay_effects",
]

logger = logging.getLogger("celery_steplock")

#: Signal sender when the lease names no task (``signals`` documents the task name as sender).
REAPER_SENDER = "celery_steplock.reaper"
#: Milliseconds of slack added to 1.5 renewal intervals before a silent worker's lease counts
#: as no longer renewed (a heartbeat round trip can be late under load).
RENEWAL_GRACE_MS = 1000
#: Seconds to wait for ping replies (per attempt).
DEFAULT_PING_TIMEOUT = 1.0
#: Seconds allowed beyond the two ping rounds before the broker is declared unresponsive.
BROKER_GRACE = 5.0
#: SCAN ``COUNT`` hint and database chunk size.
DEFAULT_BATCH_SIZE = 500
#: Stale leases of not yet pinged workers held back at most before pinging them.
PING_BUFFER = 1000
#: Reaped leases and recovered steps listed in a report at most (the counts are complete).
MAX_RECORDS = 1000
#: The step recovery of pass 2 (a qualified name, ``"module:attribute"``): the Django one.
DEFAULT_STEP_RECOVERY = "celery_steplock.contrib.django.recovery:recover_steps"


def _listed(records: list[dict[str, Any]], info: dict[str, Any]) -> int:
    """Append ``info`` to ``records`` below :data:`MAX_RECORDS`; 1 when it is only counted."""
    if len(records) < MAX_RECORDS:
        records.append(info)
        return 0
    return 1


@dataclass
class ReapReport:
    """What one :func:`reap` run found and did.

    Attributes:
        leases_scanned: Leases seen by the scan (SCAN can return a key twice while Redis
            resizes its table; a key reaped at its first sighting is not seen again).
        leases_reaped: One dict per lease removed (or, with ``dry_run``, that would be):
            ``name``, ``key``, ``owner``, ``fence``, ``task_id``, ``task_name``,
            ``worker``, ``hostname``, ``pid``, ``step``, ``ttl`` (seconds it had left when
            observed), ``reason``. At most :data:`MAX_RECORDS`, sorted by key;
            :attr:`reaped_count` counts them all.
        leases_malformed: One dict per malformed lease seen (``name``, ``key``,
            ``malformed``: what is wrong, see :func:`~celery_steplock.lease.parse_lease`),
            skipped: never reaped, left to its TTL (at most :data:`MAX_RECORDS` listed).
        steps_recovered: One dict per step moved (or to move): ``model``
            (``"app_label.Model"``), ``pk``, ``from_``, ``to``, ``owner`` (the dead owner),
            ``lease`` (its lease name when reaped in this run, else None), ``reason``. At
            most :data:`MAX_RECORDS`, sorted by model and pk; :attr:`recovered_count`
            counts them all.
        errors: Messages; the run is a failure when there is any.
        dry_run: Whether nothing was changed.
        duration: Seconds the run took.
        effects: What pass 3 did with the effects outbox, or None when it did not run
            (``effects=False``, no Django, or ``celery_steplock.contrib.django`` not
            installed): ``relayed`` (effects dispatched), ``retried`` (failed, waiting for
            their next attempt), ``dead`` (failed for good in this run), ``pending`` (still
            pending after it) and ``oldest_pending_seconds`` (age of the oldest of them, None
            when none), as :class:`celery_steplock.contrib.django.outbox.RelayReport` gives
            them, and ``skipped`` (aliases of the databases the relay skipped: no table, or
            unreachable; its log lines say which); with ``dry_run`` nothing is relayed and
            the three counts are 0. Not a
            dataclass field: :meth:`as_dict` has the key ``effects`` only when it ran.
    """

    leases_scanned: int = 0
    leases_reaped: list[dict[str, Any]] = field(default_factory=list)
    leases_malformed: list[dict[str, Any]] = field(default_factory=list)
    steps_recovered: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    dry_run: bool = False
    duration: float = 0.0

    def __post_init__(self) -> None:
        self._reaped_unlisted = 0
        self._recovered_unlisted = 0
        self.effects: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        """True when the run met no error."""
        return not self.errors

    @property
    def reaped_count(self) -> int:
        """Leases reaped (or to reap), listed or not."""
        return len(self.leases_reaped) + self._reaped_unlisted

    @property
    def recovered_count(self) -> int:
        """Steps recovered (or to recover), listed or not."""
        return len(self.steps_recovered) + self._recovered_unlisted

    def add_reaped(self, info: dict[str, Any]) -> None:
        """List a reaped lease (counted only, beyond :data:`MAX_RECORDS`).

        Args:
            info: The lease's dict, as :attr:`leases_reaped` holds them.
        """
        self._reaped_unlisted += _listed(self.leases_reaped, info)

    def add_recovered(self, info: dict[str, Any]) -> None:
        """List a recovered step (counted only, beyond :data:`MAX_RECORDS`).

        Args:
            info: The step's dict, as :attr:`steps_recovered` holds them.
        """
        self._recovered_unlisted += _listed(self.steps_recovered, info)

    def as_dict(self) -> dict[str, Any]:
        """The report as data.

        Returns:
            A JSON-serialisable dict of every field, plus ``ok``, ``effects`` when pass 3
            ran, and ``leases_reaped_total`` / ``steps_recovered_total`` when a list is not
            complete.
        """
        data = asdict(self)
        data["ok"] = self.ok
        if self.effects is not None:
            data["effects"] = dict(self.effects)
        if self._reaped_unlisted:
            data["leases_reaped_total"] = self.reaped_count
        if self._recovered_unlisted:
            data["steps_recovered_total"] = self.recovered_count
        return data

    def detail_lines(self) -> list[str]:
        """The report's details, for people.

        Returns:
            One line per listed reaped lease, recovered step and skipped malformed lease.
        """
        verb_lease = "would reap" if self.dry_run else "reaped"
        verb_step = "would recover" if self.dry_run else "recovered"
        lines = []
        for lease in self.leases_reaped:
            task = (lease.get("task_name") or "?").rsplit(".", 1)[-1]
            lines.append(
                f"{verb_lease} lease {lease['name']} (owner {_short(lease['owner'])}, fence "
                f"{lease.get('fence')}, task {task}[{_short(lease.get('task_id'), 8)}], worker "
                f"{lease.get('worker') or '-'}, pid {lease.get('pid') or '-'}): "
                f"{lease['reason']}"
            )
        if self._reaped_unlisted:
            lines.append(f"... and {self._reaped_unlisted} more lease(s) not listed")
        for step in self.steps_recovered:
            lines.append(
                f"{verb_step} {step['model']} pk={step['pk']}: {step['from_']} -> "
                f"{step['to']} (owner {_short(step['owner'])}): {step['reason']}"
            )
        if self._recovered_unlisted:
            lines.append(f"... and {self._recovered_unlisted} more step(s) not listed")
        for lease in self.leases_malformed:
            lines.append(f"skipped malformed lease {lease['name']}: {lease['malformed']}")
        return lines

    def effects_line(self) -> str | None:
        """Pass 3's counts in one line, for people (the one summary of the effects outbox
        that ``celery steplock reap`` and ``manage.py reap_expired_leases`` print).

        Returns:
            ``"effects relayed: 3, retried: 1, dead: 0; still pending: 2 (oldest 12.3s)"``
            (with ``dry_run``: ``"effects pending: 2 (oldest 12.3s); dry run: none
            relayed"``), or None when pass 3 did not run.
        """
        effects = self.effects
        if effects is None:
            return None
        oldest = effects.get("oldest_pending_seconds")
        age = f" (oldest {oldest:.1f}s)" if isinstance(oldest, (int, float)) else ""
        skipped = effects.get("skipped") or []
        tail = f"; databases skipped: {', '.join(skipped)}" if skipped else ""
        if self.dry_run:
            return f"effects pending: {effects['pending']}{age}; dry run: none relayed{tail}"
        return (
            f"effects relayed: {effects['relayed']}, retried: {effects['retried']}, "
            f"dead: {effects['dead']}; still pending: {effects['pending']}{age}{tail}"
        )

    def human_lines(self) -> list[str]:
        """The report for people: what ``celery steplock reap`` and ``manage.py
        reap_expired_leases`` both print (the one format of the two commands).

        Returns:
            :meth:`detail_lines` then :meth:`summary_lines`, each through
            :func:`~celery_steplock.redact.printable` (a lease's fields are what Redis
            holds: a control character or a newline cannot forge a line).
        """
        return [printable(line) for line in (*self.detail_lines(), *self.summary_lines())]

    def summary_lines(self) -> list[str]:
        """The run's counts, for people (what ``make demo`` prints).

        Returns:
            One line per count, and the duration.
        """
        suffix = " (dry run: nothing changed)" if self.dry_run else ""
        would = "to reap" if self.dry_run else "reaped"
        to_recover = "to recover" if self.dry_run else "recovered"
        return [
            f"leases scanned: {self.leases_scanned}",
            f"leases {would}: {self.reaped_count}{suffix}",
            f"steps {to_recover}: {self.recovered_count}",
            *([line] if (line := self.effects_line()) is not None else []),
            *(
                [f"leases malformed (skipped): {len(self.leases_malformed)}"]
                if self.leases_malformed
                else []
            ),
            f"errors: {len(self.errors)}",
            f"duration: {self.duration:.2f}s",
        ]


def _short(value: Any, width: int = 12) -> str:
    text = str(value) if value else "-"
    return text if len(text) <= width else text[:width] + ".."


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether a process exists on this host and has not exited.

    ``os.kill(pid, 0)`` probes without signalling; a process owned by another user answers
    ``PermissionError`` and exists. A zombie (exited, not yet waited for by its parent) still
    owns its pid, so ``/proc/<pid>/stat`` is read where it exists and state ``Z``/``X`` counts
    as gone.

    Args:
        pid: The process id (0 and negatives, which address process groups, count as alive).

    Returns:
        False only when the process is known to be gone; anything unexpected answers True:
        doubt must never reap a lease.
    """
    if pid <= 0:
        return True  # 0 and negatives address process groups: never a holder's pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):  # OverflowError: beyond a C pid_t
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return not os.path.isdir("/proc/self")  # /proc exists but the pid left it: gone
    except OSError:
        return True
    # "pid (comm) state ...": comm may contain spaces and parentheses, so split at the last ")".
    fields = stat.rsplit(")", 1)[-1].split()
    return not (fields and fields[0] in ("Z", "X"))


def reap(
    app: Any,
    *,
    dry_run: bool = False,
    batch_size: int = DEFAULT_BATCH_SIZE,
    older_than: float | None = None,
    now: datetime | None = None,
    ping_timeout: float = DEFAULT_PING_TIMEOUT,
    check_pids: bool = True,
    lock: RedisLeaseStore | None = None,
    step_recovery: str | Callable[..., Any] | None = DEFAULT_STEP_RECOVERY,
    effects: bool = True,
) -> ReapReport:
    """Reap the leases of dead owners and recover the steps they left in flight.

    Pass 1, leases: one ``SCAN`` (never ``KEYS``), each batch judged and reaped as it comes,
    so memory stays flat. A lease is reaped only when it missed its renewals (not renewed
    for more than 1.5 of its holder's renewal intervals, ``renew_ms``, plus
    :data:`RENEWAL_GRACE_MS`, both on the Redis server clock: a heartbeat that keeps
    renewing proves the holder alive) *and* either it was taken on this host and its
    ``pid`` is gone (or a zombie), or its Celery node (``worker``) answers no ping (one
    ``app.control.ping`` for the nodes not asked yet in this run, the silent ones asked once
    more, bounded in time even when the broker hangs; the leases waiting for it buffered, at
    most :data:`PING_BUFFER`). A lease without worker/pid metadata is never touched. The
    delete (:meth:`~celery_steplock.lock.RedisLeaseStore.reap`, one pipelined round trip per
    batch) compares the owner *and* the renewal seen, so a lease renewed or re-acquired
    since survives. A holder only paused (SIGSTOP, a long GC or VM pause) is judged dead: it
    finds its lease lost when it wakes and its commit is refused. Each removal sends
    ``lock_expired`` and logs at DEBUG; each batch one DEBUG line, the run one INFO line.

    Pass 2, steps: for the models of ``steplock_reaper_recover``, in-flight rows whose owner
    holds no live lease (and that no live lease names as its ``step``) go back by
    compare-and-swap (see :class:`Reaper` for the step recovery); only after a complete scan,
    since without every live owner nothing can be called orphaned.

    Pass 3, effects (with Django, when ``celery_steplock.contrib.django`` is installed): one
    run of the effects outbox's relay
    (:func:`celery_steplock.contrib.django.outbox.relay`, every database with its table, at
    most ``batch_size`` effects): it dispatches the effects that their committing process
    left behind (pending and due: a fresh row is left to its process for
    ``steplock_effect_relay_delay`` seconds) and reports what is still pending
    (:attr:`ReapReport.effects`). It runs whatever passes 1 and 2 found (it needs neither
    Redis nor the scan). With ``dry_run`` it only counts the pending effects.

    Idempotent (a second run finds nothing more), and safe to run concurrently with itself
    and with the workers.

    Args:
        app: The Celery app (its ``steplock_*`` settings, its broker for the pings).
        dry_run: Find and report, change nothing, send no signal.
        batch_size: SCAN's ``COUNT`` hint and the database chunk size (> 0).
        older_than: Seconds a step must have been in flight before it is recovered
            (default the setting ``steplock_reaper_older_than``, 0).
        now: The reference time of that age (an aware datetime; default the current time).
        ping_timeout: Seconds per ping attempt.
        check_pids: Judge leases taken on this host by their pid. The pid check assumes
            one PID namespace per hostname; where that is not so (a pod's sidecar), a live
            holder is still safe, since it keeps renewing, but a dead one is judged by its
            worker's ping alone: False (``--no-pid-check``) makes that explicit. A reused
            pid makes a dead holder look alive, which leaves its lease to the TTL (the safe
            side).
        lock: The lease store (default ``lock.get_lease_store(app)``).
        step_recovery: The step recovery of pass 2, a callable or its qualified name
            (``"module:attribute"``, loaded with Celery's ``symbol_by_name``; default
            :data:`DEFAULT_STEP_RECOVERY`); None skips pass 2. Loaded only when
            ``steplock_reaper_recover`` names models; a name that cannot be loaded is an
            error of the report.
        effects: Run pass 3 (False: ``--no-effects``).

    Returns:
        A :class:`ReapReport`. Redis, broker and database errors and bad settings are in
        ``report.errors``, never raised, so callers can report them and exit non-zero.

    Raises:
        ValueError: An invalid ``batch_size``, ``older_than`` or ``ping_timeout`` (a
            caller's bug, not an operational error).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if older_than is not None:
        older_than = check_seconds(older_than, "older_than", allow_zero=True)
    ping_timeout = check_seconds(ping_timeout, "ping_timeout")
    started = time.monotonic()
    report = ReapReport(dry_run=dry_run)
    try:
        Reaper(
            app,
            report,
            dry_run=dry_run,
            batch_size=batch_size,
            older_than=older_than,
            now=now,
            ping_timeout=ping_timeout,
            check_pids=check_pids,
            lock=lock,
            step_recovery=step_recovery,
        ).run()
    except Exception as exc:  # noqa: BLE001 - the report is the contract: never raise
        log_event("reaper_failed", logging.ERROR, exc_info=True, error=exc)
        report.errors.append(f"reaper failed: {type(exc).__name__}: {exc}")
    if effects:
        relay_effects(app, report, limit=batch_size)
    report.duration = time.monotonic() - started
    level = logging.ERROR if report.errors else logging.INFO
    log_event(
        "reaper_run",
        level,
        dry_run=dry_run,
        scanned=report.leases_scanned,
        leases=report.reaped_count,
        steps=report.recovered_count,
        effects=report.effects_line(),
        errors=len(report.errors),
        duration=round(report.duration, 3),
    )
    return report


def relay_effects(app: Any, report: ReapReport, *, limit: int = DEFAULT_BATCH_SIZE) -> None:
    """Pass 3 of :func:`reap`: relay the effects outbox once and put its counts in
    ``report.effects``; nothing without Django or without ``celery_steplock.contrib.django``
    installed (the core imports no Django: the outbox is reached by name through
    :mod:`celery_steplock._django`).

    Args:
        app: The Celery app (what a ``task`` effect is sent with).
        report: The run's report; ``report.dry_run`` only counts the pending effects.
        limit: Due effects claimed at most per database (the rest wait for the next run or the periodic
            ``celery_steplock.relay_effects`` task).

    A failure (a database error) is an error of the report, never raised. Called inside a
    transaction (``reap()`` in the caller's ``atomic()`` block), it only counts: a send
    cannot be undone by that transaction's rollback; ``skipped`` says so.
    """
    if not _django.installed():
        return
    try:
        outbox = _django.contrib("outbox")
        if report.dry_run:
            pending, oldest = outbox.pending_stats()
            relayed = retried = dead = 0
            skipped: tuple[str, ...] = ()
        else:
            done = outbox.relay(limit=limit, app=app)
            relayed, retried, dead = done.dispatched, done.retried, done.dead
            pending, oldest = done.pending, done.oldest_pending_seconds
            skipped = tuple(done.skipped)
    except OuterTransactionError:
        # reap() called inside the caller's transaction (its recovery is the caller's to
        # commit): sends cannot be undone by a rollback, so the relay waits for a run
        # outside one (the periodic relay_effects task, the next reap). Not an error.
        try:
            pending, oldest = _django.contrib("outbox").pending_stats()
        except Exception:  # noqa: BLE001 - only counts
            pending, oldest = 0, None
        relayed = retried = dead = 0
        skipped = ("every database: reap() ran inside a transaction",)
    except Exception as exc:  # noqa: BLE001 - the report is the contract: never raise
        message = f"effects relay failed: {type(exc).__name__}: {exc}"
        log_event("reaper_error", logging.ERROR, exc_info=True, error=message)
        report.errors.append(message)
        return
    report.effects = {
        "relayed": relayed,
        "retried": retried,
        "dead": dead,
        "pending": pending,
        "oldest_pending_seconds": oldest,
        "skipped": list(skipped),
    }


class Reaper:
    """One run of :func:`reap`; holds the run's state so each step stays small.

    The core knows no ORM: pass 2 is a step recovery loaded by qualified name (default
    :data:`DEFAULT_STEP_RECOVERY`, the Django one in
    :mod:`celery_steplock.contrib.django.recovery`, which documents its rules), so this
    module imports no Django. A step recovery is a callable ``recover(run) -> obj | None``
    called with the run *before* the scan: it reads its rows then (a holder writes its owner
    into a row only while it holds the lease, so an owner live when the row is read is
    still seen by the scan that follows). ``obj.owners`` and ``obj.steps`` (sets of owner
    tokens and ``"app_label.model:pk"``) name what the scan must report on, and
    ``obj.recover(live_owners, live_steps, dead)`` runs once the scan completed (``dead``:
    the reaped leases' records by owner). It reports a problem with :meth:`error` and picks
    a signal sender with :meth:`sender`.

    Attributes:
        app: The Celery app.
        settings: A :class:`~celery_steplock.conf.Settings` snapshot.
        recover: The validated ``steplock_reaper_recover`` mapping.
        report: The :class:`ReapReport` (a recovery lists steps with
            :meth:`ReapReport.add_recovered`).
        dry_run: Change nothing.
        batch_size: The database chunk size.
        older_than: Seconds, or None for the setting.
        now: An aware datetime, or None.
    """

    def __init__(
        self,
        app: Any,
        report: ReapReport,
        *,
        dry_run: bool,
        batch_size: int,
        older_than: float | None,
        now: datetime | None,
        ping_timeout: float,
        check_pids: bool,
        lock: RedisLeaseStore | None,
        step_recovery: str | Callable[..., Any] | None = DEFAULT_STEP_RECOVERY,
    ) -> None:
        self.app = app
        self.report = report
        self.dry_run = dry_run
        self.batch_size = batch_size
        self.older_than = older_than
        self.now = now
        self.ping_timeout = ping_timeout
        self.check_pids = check_pids
        self.lock: RedisLeaseStore | None = lock
        self.step_recovery = step_recovery
        self.recover: dict[str, dict[str, str]] = {}
        self.settings = Settings(app, snapshot=True)
        self.host = socket.gethostname()
        self._default_interval: int | None = None
        # Pings: nodes that answered / stayed silent so far; None once pinging failed.
        self.answered: set[str] | None = set()
        self.silent: set[str] = set()
        # Pass 2 keeps only what concerns its candidate rows (see watch()).
        self.watched_owners: set[str] = set()
        self.watched_steps: set[str] = set()
        self.live_owners: set[str] = set()
        self.live_steps: dict[str, set[str]] = {}
        self.dead: dict[str, dict[str, Any]] = {}

    @property
    def store(self) -> RedisLeaseStore:
        """The lease store of the run: ``lock``, or the app's, resolved by :meth:`run`."""
        if self.lock is None:
            self.lock = get_lease_store(self.app)
        return self.lock

    def sender(self, task_name: str | None) -> Any:
        """The signal sender of a lease's events.

        Args:
            task_name: The lease's task name, when it has one.

        Returns:
            The task object when this app knows it (so receivers connected with
            ``sender=task`` see the reaper's events), else its name, else
            :data:`REAPER_SENDER`.
        """
        if not task_name:
            return REAPER_SENDER
        return self.app.tasks.get(task_name, task_name)

    def error(self, message: str) -> None:
        """Report a problem: an ERROR line and an entry of ``report.errors`` (a failed run).

        Args:
            message: What went wrong.
        """
        log_event("reaper_error", logging.ERROR, error=message)
        self.report.errors.append(message)

    def run(self) -> None:
        """Run both passes; errors go to the report."""
        recovery = self.start_recovery()  # before the scan: see the class docstring
        if self.lock is None:
            try:
                self.lock = get_lease_store(self.app)
            except StepLockError as exc:
                self.error(f"lock store not configured: {exc}")
                return
        if recovery is not None:
            self.watched_owners = set(recovery.owners)
            self.watched_steps = set(recovery.steps)
        if not self.reap_leases():
            return  # incomplete scan: nobody can be called orphaned
        self.report.leases_reaped.sort(key=lambda info: info["key"])
        if recovery is not None:
            dead = self.dead
            # A live lease that names a step (a new attempt holding it) protects the row even
            # if the row still shows the dead owner: that attempt will move it on.
            recovery.recover(
                self.live_owners - dead.keys(),
                {step for step, owners in self.live_steps.items() if owners - dead.keys()},
                dead,
            )

    def start_recovery(self) -> Any:
        """Start pass 2's step recovery for this run: its rows are read now.

        Returns:
            The step recovery's object, or None: no model to recover, no step recovery, or
            one that cannot be loaded (an error of the report).
        """
        try:
            self.recover = self.settings.reaper_recover
        except StepLockError as exc:
            self.error(str(exc))
            return None
        if not self.recover or self.step_recovery is None:
            return None
        factory = self.step_recovery
        if isinstance(factory, str):
            try:
                factory = symbol_by_name(factory)
            except Exception as exc:  # noqa: BLE001 - ImportError, AttributeError, ...
                self.error(
                    f"step recovery {self.step_recovery!r} could not be loaded, no "
                    f"step recovered: {type(exc).__name__}: {exc}"
                )
                return None
        return factory(self)

    # -- pass 1: leases ----------------------------------------------------------------------

    def redis_now_ms(self) -> int | None:
        """Redis server time in ms: the clock ``renewed_ms`` was written with."""
        try:
            seconds, micros = self.store.client.time()
        except Exception as exc:  # noqa: BLE001 - redis errors and OSError alike
            self.error(f"could not read the Redis server time: {exc}")
            return None
        return int(seconds) * 1000 + int(micros) // 1000

    def ping(self, workers: Iterable[str]) -> set[str] | None:
        """The worker nodes among ``workers`` that answer a ping; None when pinging failed.

        One broadcast for all of them (returning as soon as every node replied), then one more
        for the silent ones: a reply lost once must not condemn a live worker.
        """
        pending = sorted(set(workers))
        answered: set[str] = set()
        outcome: dict[str, Any] = {}

        def broadcast() -> None:
            nonlocal pending
            try:
                for _attempt in range(2):
                    if not pending:
                        break
                    replies = (
                        self.app.control.ping(
                            destination=pending, timeout=self.ping_timeout, limit=len(pending)
                        )
                        or []
                    )
                    for reply in replies:
                        answered.update(reply)
                    pending = [w for w in pending if w not in answered]
            except Exception as exc:  # noqa: BLE001 - kombu/redis/OSError: broker unreachable
                outcome["error"] = exc

        # A hung broker (accepting connections, never answering) would block kombu forever:
        # ping from a daemon thread and give up after a bounded wait.
        thread = threading.Thread(target=broadcast, name="steplock-reaper-ping", daemon=True)
        thread.start()
        thread.join(2 * self.ping_timeout + BROKER_GRACE)
        if thread.is_alive():
            outcome["error"] = (
                f"the broker did not answer within {2 * self.ping_timeout + BROKER_GRACE:g}s"
            )
        if "error" in outcome:
            self.error(
                f"could not ping the workers through the broker, no lease judged by "
                f"its worker: {outcome['error']}"
            )
            return None
        return answered

    def idle_ms(self, lease: dict[str, Any], now_ms: int | None) -> int | None:
        """Milliseconds since the lease was last renewed, when that is longer than its
        holder's heartbeat ever lets it go (1.5 renewal intervals + a grace): None while
        the lease is still being renewed (its holder is alive, whatever else we see)."""
        renewed = _int(lease.get("renewed_ms")) or _int(lease.get("acquired_ms"))
        if renewed is None or now_ms is None:
            return None
        interval = _int(lease.get("renew_ms"))
        if interval is None:  # leases taken before renew_ms was recorded
            ttl_ms = _int(lease.get("ttl_ms"))
            if ttl_ms:
                interval = int(ttl_ms * self.settings.renewal_ratio)
            else:
                if self._default_interval is None:
                    self._default_interval = int(
                        int(self.settings.default_ttl * 1000) * self.settings.renewal_ratio
                    )
                interval = self._default_interval
        idle = now_ms - renewed
        return idle if idle > 1.5 * interval + RENEWAL_GRACE_MS else None

    def verdict(
        self, lease: dict[str, Any], answered: set[str] | None, now_ms: int | None
    ) -> str | None:
        """Why ``lease``'s owner is gone, or None when it is (or may be) alive.

        Both tests need the missed renewals: a pid lookup can be wrong (a process in another
        PID namespace with our hostname, a pod sidecar), a ping can go unanswered by a paused
        or busy worker; a heartbeat that keeps renewing proves the holder alive.
        """
        idle = self.idle_ms(lease, now_ms)
        if idle is None:
            return None
        pid = _int(lease.get("pid"))
        if self.check_pids and pid is not None and pid > 0 and lease.get("hostname") == self.host:
            if pid_alive(pid):
                return None  # the holder process exists: never reap, whatever the ping says
            return (
                f"pid {pid} on {self.host} no longer exists and the lease was last "
                f"renewed {idle / 1000:.1f}s ago"
            )
        worker = lease.get("worker")
        if not worker or answered is None or worker in answered:
            return None
        return (
            f"worker {worker} did not answer a ping within {self.ping_timeout:g}s and the "
            f"lease was last renewed {idle / 1000:.1f}s ago"
        )

    def needs_ping(self, lease: dict[str, Any], now_ms: int | None) -> bool:
        """Whether ``lease`` is judged by a ping of its worker not asked yet in this run."""
        worker = lease.get("worker")
        return (
            bool(worker)
            and self.answered is not None
            and worker not in self.answered
            and worker not in self.silent
            and not (
                self.check_pids
                and lease.get("hostname") == self.host
                and (_int(lease.get("pid")) or 0) > 0
            )
            and self.idle_ms(lease, now_ms) is not None
        )

    def reap_leases(self) -> bool:
        """Pass 1, one SCAN batch at a time; False when the scan could not complete."""
        waiting: list[dict[str, Any]] = []  # stale leases whose worker is to be pinged
        waiting_now_ms: int | None = None
        cursor = 0
        while True:
            try:
                cursor, leases = self.store.scan(cursor, self.batch_size)
            except StepLockError as exc:
                self.error(f"lease scan failed, no step recovered: {exc}")
                return False
            self.report.leases_scanned += sum(
                1 for lease in leases if lease.get("owner") or lease.get("malformed")
            )
            leases = [
                lease for lease in leases if not self.malformed(lease) and lease.get("owner")
            ]
            if leases:
                now_ms = self.redis_now_ms()
                ready = []
                for lease in leases:
                    if self.needs_ping(lease, now_ms):
                        waiting.append(lease)
                        waiting_now_ms = now_ms
                    else:
                        ready.append(lease)
                self.judge(ready, now_ms)
            if waiting and (cursor == 0 or len(waiting) >= PING_BUFFER):
                answered = self.ping(lease["worker"] for lease in waiting)
                if answered is None:
                    self.answered = None
                else:
                    self.answered.update(answered)  # type: ignore[union-attr]
                    self.silent.update(
                        lease["worker"] for lease in waiting if lease["worker"] not in answered
                    )
                self.judge(waiting, waiting_now_ms)
                waiting = []
            if cursor == 0:
                return True

    def malformed(self, lease: dict[str, Any]) -> bool:
        """Whether ``lease`` is malformed (then skipped, listed in the report and logged):
        its holder cannot be judged from fields that are not what they claim to be. Such a
        lease is never reaped (its TTL still ends it) but its owner counts as live for pass
        2 when it names one, the safe side."""
        problems = lease.get("malformed")
        if not problems:
            return False
        log_event(
            "reaper_malformed_lease", logging.WARNING, key=lease.get("key"), problems=problems
        )
        if len(self.report.leases_malformed) < MAX_RECORDS:
            self.report.leases_malformed.append(
                {"name": lease.get("name"), "key": lease.get("key"), "malformed": problems}
            )
        if lease.get("owner"):
            self.keep_live(lease)
        return True

    def judge(self, leases: list[dict[str, Any]], now_ms: int | None) -> None:
        """Judge one batch of leases, reap the dead ones' in one round trip, and keep what
        pass 2 needs to know about them. A lease whose judging fails is an error of the
        report and is kept; the others of the batch are judged all the same."""
        dead = []
        for lease in leases:
            try:
                reason = self.verdict(lease, self.answered, now_ms)
            except Exception as exc:  # noqa: BLE001 - one lease must not stop the run
                self.error(
                    f"could not judge lease {lease.get('name')!r}, kept: "
                    f"{type(exc).__name__}: {exc}"
                )
                reason = None
            if reason is None:
                self.keep_live(lease)
            else:
                dead.append((lease, reason))
        if not dead:
            return
        if self.dry_run:
            results: list[Any] = [True] * len(dead)
        else:
            try:
                # Compare-and-delete on the owner and the renewal observed in the scan: a
                # lease re-acquired since, or renewed while we pinged, survives.
                results = self.store.reap_many(
                    (lease["name"], lease["owner"], lease.get("renewed_ms") or "")
                    for lease, _reason in dead
                )
            except StepLockError as exc:
                results = [exc] * len(dead)
        reaped = skipped = failed = 0
        for (lease, reason), released in zip(dead, results):
            if isinstance(released, Exception):
                failed += 1
                self.error(f"could not release lease {lease['name']}: {released}")
                self.keep_live(lease)  # recovered on the next run
                continue
            info = {
                "name": lease["name"],
                "key": lease["key"],
                "owner": lease["owner"],
                "fence": _int(lease.get("fence")),
                "task_id": lease.get("task_id"),
                "task_name": lease.get("task_name"),
                "worker": lease.get("worker"),
                "hostname": lease.get("hostname"),
                "pid": _int(lease.get("pid")),
                "step": lease.get("step"),
                "ttl": lease.get("ttl"),
                "reason": reason,
            }
            self.keep_dead(info)
            if not released:
                skipped += 1  # released or re-acquired since the scan: holds nothing now
                continue
            reaped += 1
            if not self.dry_run:
                sender = self.sender(lease.get("task_name"))
                held = {
                    k: info[k] for k in ("key", "name", "owner", "fence", "task_id", "task_name")
                }
                emit(
                    signals.lock_expired,
                    sender,
                    logging.DEBUG,
                    **held,
                    ttl=(_int(lease.get("ttl_ms")) or 0) / 1000.0 or None,
                    ttl_left=info["ttl"],
                    reason=f"reaped: {reason}",
                    worker=info["worker"],
                    hostname=info["hostname"],
                    pid=info["pid"],
                    step=info["step"],
                )
                if lease.get("kind") == "slot":  # a concurrency limit's slot (bulkhead)
                    emit(
                        signals.slot_expired,
                        sender,
                        logging.WARNING,
                        **held,
                        ttl=info["ttl"],
                        limit_key=lease.get("limit_key"),
                        reason=f"reaped: {reason}",
                    )
            self.report.add_reaped(info)
        log_event(
            "reaper_batch",
            logging.DEBUG,
            leases=len(leases),
            dead=len(dead),
            reaped=reaped,
            skipped=skipped,
            failed=failed,
            dry_run=self.dry_run,
        )

    def keep_live(self, lease: dict[str, Any]) -> None:
        owner, step = lease["owner"], lease.get("step")
        if owner in self.watched_owners:
            self.live_owners.add(owner)
        if step and step in self.watched_steps:
            self.live_steps.setdefault(step, set()).add(owner)

    def keep_dead(self, info: dict[str, Any]) -> None:
        if info["owner"] in self.watched_owners:
            self.dead[info["owner"]] = info


#: Deprecated alias of :class:`Reaper`.
_Reaper = Reaper
