"""The optional durable lease event log: one :class:`~.models.LeaseEvent` row per event.

Off by default; turn it on with ``steplock_event_log = True`` (Django:
``CELERY_STEPLOCK_EVENT_LOG = True``). :func:`connect` (called by the app's ``ready()``)
connects one receiver to each logged signal; the receivers read the setting at every event,
so a change takes effect at once and an off log costs one attribute lookup per event.

Rows are written *after* the database transaction the event happened in, never inside it,
so a log write can neither slow down nor break the task's own commit:

* outside a transaction, at once;
* inside one, queued per thread and written by a ``transaction.on_commit`` callback;
* an event inside a transaction that rolls back (``transition_conflict``: the conflict *is*
  the rollback) is still a fact worth keeping, so its queued row is written by the next
  event of the thread that happens outside a transaction, or at the latest by Celery's
  ``task_postrun`` of the task that raised it.

A failing write is logged and dropped: the event log never breaks locking.

:class:`LeaseEventAudit` is the other writer of this table, and the opposite of the above:
the audit record of an operator's force release (:func:`celery_steplock.ops.force_release`),
one ``event="force_release"`` row written and *committed* before the lease is deleted, its
``outcome`` updated once the delete answered; written whatever ``steplock_event_log`` says,
and a failure to write it stops the release.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
from typing import Any, Callable

from django.db import router, transaction

from ... import signals
from ...conf import Settings
from ...events import log_event
from ...ops import BreakerAudit, BreakerOverride, ReleaseAudit

__all__ = [
    "LOGGED_SIGNALS",
    "LeaseEventAudit",
    "LeaseEventBreakerAudit",
    "connect",
    "disconnect",
    "enabled",
    "record",
    "flush",
    "prune_lease_events",
]

logger = logging.getLogger("celery_steplock")

LOGGED_SIGNALS = (
    signals.lock_acquired,
    signals.lock_contended,
    signals.lock_released,
    signals.lock_expired,
    signals.lock_lost,
    signals.transition_applied,
    signals.transition_conflict,
)

#: Rows queued in one thread at most while waiting for a transaction to end (the oldest are
#: dropped beyond it: a runaway loop must not grow memory without bound).
MAX_PENDING = 1000

_local = threading.local()


def _pending() -> list:
    rows = getattr(_local, "rows", None)
    if rows is None:
        rows = _local.rows = []
    return rows


def _app_of(sender: Any):
    app = getattr(sender, "app", None)
    if app is not None:
        return app
    from .leases import celery_app

    return celery_app()


def enabled(sender: Any = None) -> bool:
    """Whether ``steplock_event_log`` is on for the sender's Celery app (read through the
    running execution's settings snapshot when the sender is a StepLockedTask)."""
    try:
        settings = getattr(sender, "steplock_settings", None)
        if not isinstance(settings, Settings):
            settings = Settings(_app_of(sender))
        return settings.event_log
    except Exception:  # noqa: BLE001 - no app, no log
        return False


def _text(value: Any, limit: int) -> str:
    return "" if value is None else str(value)[:limit]


def _int(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def _step(sender: Any, fields: dict[str, Any]) -> str:
    """``"app_label.model:pk"`` from the payload's ``step``, or from the sender's
    ``step_model`` and the payload's ``step_id``."""
    if fields.get("step"):
        return str(fields["step"])
    step_id = fields.get("step_id")
    model = getattr(sender, "step_model", None)
    if step_id is None or model is None:
        return ""
    if isinstance(model, str):
        label = model.lower()
    else:
        label = getattr(getattr(model, "_meta", None), "label_lower", "")
    return f"{label}:{step_id}" if label else f"{step_id}"


def _reason(event: str, fields: dict[str, Any]) -> str:
    parts = []
    if fields.get("reason"):
        parts.append(str(fields["reason"]))
    if event == "lock_released" and fields.get("forced") and not parts:
        parts.append("forced")
    if fields.get("holder"):
        parts.append(f"held by {fields['holder']}")
    if fields.get("from_") is not None or fields.get("to") is not None:
        move = f"{fields.get('from_')} -> {fields.get('to')}"
        if fields.get("current") is not None:
            move += f" (step is {fields['current']})"
        parts.append(move)
    return "; ".join(parts)


def build(event: str, sender: Any, fields: dict[str, Any]):
    """An unsaved LeaseEvent for one signal's keyword arguments."""
    from .models import LeaseEvent

    timestamp = fields.get("timestamp")
    created = (
        dt.datetime.fromtimestamp(timestamp, tz=dt.timezone.utc)
        if isinstance(timestamp, (int, float))
        else None
    )
    task_name = (
        fields.get("task_name")
        or getattr(sender, "name", None)
        or (sender if isinstance(sender, str) else None)
    )
    pid = _int(fields.get("pid"))
    return LeaseEvent(
        event=event,
        key=_text(fields.get("key"), 576),
        name=_text(fields.get("name"), 512),
        owner=_text(fields.get("owner"), 64),
        fence=_int(fields.get("fence")),
        task_id=_text(fields.get("task_id"), 255),
        task_name=_text(task_name, 255),
        step=_text(_step(sender, fields), 255),
        hostname=_text(fields.get("hostname") or socket.gethostname(), 255),
        pid=pid if pid is not None else os.getpid(),
        reason=_reason(event, fields),
        **({"created_at": created} if created else {}),
    )


def _write(rows: list) -> None:
    from .models import LeaseEvent

    try:
        LeaseEvent.objects.bulk_create(rows)
    except Exception:  # noqa: BLE001 - the event log never breaks locking
        log_event("event_log_write_failed", logging.WARNING, exc_info=True, rows=len(rows))


def flush() -> int:
    """Write this thread's queued rows if no transaction is open; returns how many."""
    from .models import LeaseEvent

    rows = _pending()
    if not rows:
        return 0
    using = router.db_for_write(LeaseEvent)
    if transaction.get_connection(using).in_atomic_block:
        return 0
    batch = rows[:]
    del rows[:]
    _write(batch)
    return len(batch)


def record(event: str, sender: Any, fields: dict[str, Any]) -> None:
    """Queue one event's row and write it as the module docstring describes."""
    from .models import LeaseEvent

    rows = _pending()
    rows.append(build(event, sender, fields))
    if len(rows) > MAX_PENDING:
        dropped = len(rows) - MAX_PENDING
        del rows[:dropped]
        log_event("event_log_overflow", logging.WARNING, dropped=dropped)
    using = router.db_for_write(LeaseEvent)
    if transaction.get_connection(using).in_atomic_block:
        # robust: a failure of this callback must not stop the others (e.g. the task's own
        # transition_applied signal, also sent on commit).
        transaction.on_commit(flush, using=using, robust=True)
    else:
        flush()


def _receiver(sender=None, event=None, **fields):
    if not event or not enabled(sender):
        return
    try:
        record(event, sender, fields)
    except Exception:  # noqa: BLE001 - the event log never breaks locking
        log_event("event_log_failed", logging.WARNING, exc_info=True, signal=event)


def _after_task(sender=None, **kwargs):
    # The end of a task is outside its transactions: write what a rolled-back one left.
    if getattr(_local, "rows", None):
        flush()


def connect() -> None:
    """Connect the event log receivers (idempotent; done by the app's ``ready()``)."""
    from celery.signals import task_postrun

    for signal in LOGGED_SIGNALS:
        uid = f"celery_steplock.eventlog.{signal.name}"  # type: ignore[attr-defined]
        signal.connect(_receiver, weak=False, dispatch_uid=uid)
    task_postrun.connect(_after_task, weak=False, dispatch_uid="celery_steplock.eventlog.flush")


def disconnect() -> None:
    """Undo :func:`connect`."""
    from celery.signals import task_postrun

    for signal in LOGGED_SIGNALS:
        uid = f"celery_steplock.eventlog.{signal.name}"  # type: ignore[attr-defined]
        signal.disconnect(_receiver, dispatch_uid=uid)
    task_postrun.disconnect(_after_task, dispatch_uid="celery_steplock.eventlog.flush")


def prune_lease_events(
    older_than_seconds: float | None = None,
    *,
    dry_run: bool = False,
    now: dt.datetime | None = None,
) -> int:
    """Delete LeaseEvent rows created more than ``older_than_seconds`` ago.

    ``older_than_seconds`` defaults to ``steplock_event_retention`` (7 days). Returns the
    number of rows deleted (with ``dry_run``: that would be deleted). Raises
    ImproperlyConfigured (celery_steplock's) for a negative or non-numeric age.
    """
    from django.utils import timezone

    from ..._checks import check_seconds
    from .leases import celery_app
    from .models import LeaseEvent

    if older_than_seconds is None:
        older_than_seconds = Settings(celery_app()).event_retention
    seconds = check_seconds(older_than_seconds, "older_than_seconds", allow_zero=True)
    cutoff = (now or timezone.now()) - dt.timedelta(seconds=seconds)
    old = LeaseEvent.objects.filter(created_at__lt=cutoff)
    if dry_run:
        return old.count()
    deleted, _per_model = old.delete()
    return deleted


class LeaseEventAudit(ReleaseAudit):
    """The Django audit store of force releases (see
    :class:`celery_steplock.ops.ReleaseAudit`): one ``LeaseEvent`` row per force release.

    :meth:`requested` creates the row (outcome ``requested``) and runs ``also(record)``
    (the admin writes its ``LogEntry`` there) in one durable transaction
    (``transaction.atomic(durable=True)``: it commits before returning, and refuses to run
    inside a caller's transaction, where a commit would not be one). :meth:`finished`
    writes the outcome to that row and runs ``after(record)``, in a transaction of its own;
    a refusal found before any request gets a row of its own (and no ``after``). ``using``: the
    database alias (default: the router's for LeaseEvent). ``event``: the rows' event (default
    ``"force_release"``; the effects outbox's operator actions,
    :func:`celery_steplock.contrib.django.outbox.retry_effects` and ``discard_effects``, are
    audited through these same steps as ``"effect_retried"`` / ``"effect_discarded"``).
    """

    def __init__(
        self,
        *,
        using: str | None = None,
        also: Callable[[Any], Any] | None = None,
        after: Callable[[Any], Any] | None = None,
        event: str = "force_release",
    ) -> None:
        self.using = using
        self.also = also
        self.after = after
        self.event = event

    def _alias(self) -> str:
        from .models import LeaseEvent

        return self.using or router.db_for_write(LeaseEvent)

    def _row(self, record):
        from .models import LeaseEvent

        reason = record.reason
        if record.detail:
            reason = f"{reason}; {record.detail}" if reason else record.detail
        return LeaseEvent(
            event=self.event,
            key=_text(record.key, 576),
            name=_text(record.name, 512),
            owner=_text(record.owner, 64),
            fence=record.fence,
            task_id=_text(record.task_id, 255),
            task_name=_text(record.task_name, 255),
            step=_text(record.step, 255),
            hostname=_text(record.hostname, 255),
            pid=record.pid,
            reason=reason,
            actor=_text(record.actor, 255),
            actor_host=_text(record.actor_host, 255),
            via=_text(record.via, 16),
            outcome=_text(record.outcome, 32),
        )

    def requested(self, record) -> None:
        using = self._alias()
        with transaction.atomic(using=using, durable=True):
            row = self._row(record)
            row.save(using=using)
            if self.also is not None:
                self.also(record)
        record.audit_id = row.pk
        record.audit = f"LeaseEvent {row.pk}"

    def finished(self, record) -> None:
        from .models import LeaseEvent

        using = self._alias()
        with transaction.atomic(using=using, durable=True):
            row = self._row(record)
            if record.audit_id is None:  # refused at the first read: nothing was requested
                row.save(using=using)
                record.audit_id = row.pk
                record.audit = f"LeaseEvent {row.pk}"
                return
            LeaseEvent.objects.using(using).filter(pk=record.audit_id).update(
                outcome=row.outcome, reason=row.reason
            )
            if self.after is not None:
                self.after(record)


class LeaseEventBreakerAudit(BreakerAudit):
    """With ``celery_steplock.contrib.django``: one ``LeaseEvent`` row (event
    ``circuit_override``) committed before the write, its outcome written after."""

    def requested(self, record: BreakerOverride) -> None:
        from .models import LeaseEvent

        using = router.db_for_write(LeaseEvent)
        with transaction.atomic(using=using, durable=True):
            row = LeaseEvent(
                event="circuit_override",
                key=record.key[:576],
                name=record.name[:512],
                reason=f"{record.action}: {record.reason}",
                actor=(record.actor or "")[:255],
                actor_host=(record.actor_host or "")[:255],
                via=record.via[:16],
                outcome=record.outcome,
            )
            row.save(using=using)
        record.audit_id, record.audit = row.pk, f"LeaseEvent {row.pk}"

    def finished(self, record: BreakerOverride) -> None:
        if record.audit_id is None:
            return
        from .models import LeaseEvent

        LeaseEvent.objects.using(router.db_for_write(LeaseEvent)).filter(
            pk=record.audit_id
        ).update(outcome=record.outcome)
