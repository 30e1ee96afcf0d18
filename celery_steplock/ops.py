"""Operator actions on leases, shared by the Django admin and ``celery steplock``.

:func:`force_release` is the one force release, and the one audited one: the admin's
confirmation page and ``celery steplock release NAME --owner TOKEN`` both call it. It
imports the lease store (:mod:`celery_steplock.lock`), never the task module, and no Django
(the Django audit store is loaded only when Django is set up, see :func:`default_audit`).

A force release is owner-checked: the caller names the owner token it saw holding the lease,
and the lease is deleted by the store's compare-and-delete
(:meth:`~celery_steplock.lock.RedisLeaseStore.release`) only while that owner still holds it;
a lease taken meanwhile by another attempt is never touched. Every call is audited: a
:class:`ForcedRelease` record names the operator (``actor``, ``actor_host``, ``via``), the
lease, its owner and fencing token, and the ``outcome``. In order:

1. read the lease. Not held, or held by another owner: the record (outcome ``not_held`` /
   ``held_by_another``) goes to the audit store and the log, and :class:`LeaseNotHeld` /
   :class:`LeaseHeldByAnother` is raised: nothing released;
2. the record, outcome ``requested``, is logged (WARNING ``event=force_release_audit
   outcome=requested ...``), sent with :data:`~celery_steplock.signals.force_release_audit`
   and made durable by the audit store (``auditor.requested``: the Django store writes and
   *commits* a ``LeaseEvent`` row, and the admin its ``LogEntry``). If that fails, nothing is
   released: :class:`AuditRecordFailed` (its cause is the store's error). No record, no
   release;
3. the compare-and-delete;
4. the outcome is recorded (``auditor.finished``; logged and signalled as in 2):
   ``released``; ``not_held`` / ``held_by_another`` when the delete found the holder changed
   since 1 (then that refusal is raised); ``failed`` when Redis refused the delete (nothing
   released) and ``unknown`` when Redis could not be reached during it (it may have run):
   the store's error is raised, with the record as its ``forced_release`` attribute. When
   the outcome cannot be recorded after a release, the release still stands and is reported
   as such: ``record.outcome_recorded`` is False, ``record.outcome_error`` says why, an ERROR
   line ``event=force_release_outcome_unrecorded`` is logged, and the durable record keeps
   outcome ``requested`` (read it as "released or not: see the log");
5. ``lock_released`` with ``forced=True`` and its structured log line, handed to ``defer``
   (default: at once).

Where the record goes: always the ``celery_steplock`` logger (one logfmt line per stage,
the fields also in ``extra={"steplock": ...}``) and the ``force_release_audit`` signal; with
Django set up and ``celery_steplock.contrib.django`` installed, also a ``LeaseEvent`` row
(event ``force_release``) committed before the delete. Without Django (the CLI on a plain
Celery app) the log line is the record: ship the ``celery_steplock`` logger's WARNING lines
to durable storage, or pass an ``auditor`` of your own (:class:`ReleaseAudit`).
"""

from __future__ import annotations

import logging
import sys
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from . import signals
from .events import emit, log_event
from .exceptions import (
    AuditRecordFailed,
    ForceReleaseRefused,
    LeaseHeldByAnother,
    LeaseNotHeld,
    LockStoreUnavailable,
    StepLockError,
)
from .redact import redact, secrets_of

__all__ = [
    "ForcedRelease",
    "ForceReleaseRefused",
    "LeaseNotHeld",
    "LeaseHeldByAnother",
    "AuditRecordFailed",
    "ReleaseAudit",
    "LogAudit",
    "default_audit",
    "force_release",
    "OPS_SENDER",
    "OUTCOMES",
    "BreakerOverride",
    "BreakerAudit",
    "LogBreakerAudit",
    "default_breaker_audit",
    "override_breaker",
    "OVERRIDE_OUTCOMES",
]


#: Signal sender of a force release when the lease names no task this process knows.
OPS_SENDER = "celery_steplock.ops"

#: Outcomes of a force release, as recorded: before the delete, ``requested``; after it,
#: ``released``, ``not_held``, ``held_by_another``, ``failed`` (Redis refused the delete:
#: nothing released) or ``unknown`` (Redis could not be reached during the delete).
OUTCOMES = ("requested", "released", "not_held", "held_by_another", "failed", "unknown")


@dataclass
class ForcedRelease:
    """The audit record of one :func:`force_release` (what it released, or is about to).

    ``name``, ``key``, ``owner`` (the owner token asked for), ``fence`` (int or None),
    ``task_id``, ``task_name``, ``worker``, ``hostname``, ``pid`` (int or None), ``step``,
    ``ttl`` (seconds it had left when read), ``actor`` (who asked: the Django user name, the
    OS user for the CLI), ``actor_host`` (where from: the CLI's host, the admin client's
    address), ``via`` (``"admin"``, ``"cli"``, ``"api"``), ``reason`` (sent with the
    signal), ``lease``: every stored field as read; ``outcome``: one of :data:`OUTCOMES`;
    ``audit``: where the durable record is (e.g. ``"LeaseEvent 42"``; None: the log only);
    ``audit_id``: the audit store's id of the record; ``outcome_recorded``: False when the
    outcome could not be recorded (``outcome_error`` says why).
    """

    name: str
    key: str
    owner: str
    fence: int | None = None
    task_id: str | None = None
    task_name: str | None = None
    worker: str | None = None
    hostname: str | None = None
    pid: int | None = None
    step: str | None = None
    ttl: float | None = None
    actor: str | None = None
    reason: str = ""
    lease: dict[str, Any] = field(default_factory=dict)
    actor_host: str | None = None
    via: str = "api"
    outcome: str = "requested"
    audit: str | None = None
    audit_id: Any = None
    outcome_recorded: bool = True
    outcome_error: str | None = None
    detail: str = ""

    def fields(self) -> dict[str, Any]:
        """The record as a flat dict of its fields (``lease`` left out), for logs and
        signals."""
        data = asdict(self)
        data.pop("lease", None)
        return data


class ReleaseAudit:
    """Where :func:`force_release` makes its records durable (subclass it for a store of
    your own; the Django one is
    :class:`celery_steplock.contrib.django.eventlog.LeaseEventAudit`).

    ``requested(record)`` is called before the delete and must return only once the record
    is durable (committed); whatever it raises stops the release (nothing is deleted) and
    becomes the cause of :class:`AuditRecordFailed`. It may set ``record.audit`` and
    ``record.audit_id``. ``finished(record)`` is called with the outcome set (also for a
    refusal found at the first read, without ``requested`` before it); what it raises is
    logged and reported in ``record.outcome_recorded``. This base class keeps nothing:
    the log line and the signal are the record.
    """

    def requested(self, record: ForcedRelease) -> None:
        """Make ``record`` (outcome ``requested``) durable before the delete."""

    def finished(self, record: ForcedRelease) -> None:
        """Record ``record.outcome``."""


class LogAudit(ReleaseAudit):
    """The audit of an app without Django: the WARNING log line of the ``celery_steplock``
    logger and the signal. ``requested`` raises RuntimeError (so the release is refused,
    :class:`AuditRecordFailed`) when that logger would not emit the line: not enabled for
    WARNING, or no handler reaching it (with ``logging.lastResort`` counted as one)."""

    def requested(self, record: ForcedRelease) -> None:
        """Refuse unless the ``celery_steplock`` logger emits WARNING lines."""
        logger = logging.getLogger("celery_steplock")
        if not logger.isEnabledFor(logging.WARNING) or not _reaches_a_handler(logger):
            raise RuntimeError(
                "the log line is the only audit record and the "
                "'celery_steplock' logger does not emit WARNING lines: enable "
                "it (level WARNING or lower, with a handler)"
            )


def _reaches_a_handler(logger: logging.Logger) -> bool:
    node: logging.Logger | None = logger
    while node is not None:
        if any(h.level <= logging.WARNING for h in node.handlers):
            return True
        if not node.propagate:
            return False
        node = node.parent
    last = logging.lastResort
    return last is not None and last.level <= logging.WARNING


def default_audit(app=None) -> ReleaseAudit:
    """The audit store of this process: a
    :class:`~celery_steplock.contrib.django.eventlog.LeaseEventAudit` when Django is set up
    (its app registry ready) with ``celery_steplock.contrib.django`` installed, else a
    :class:`LogAudit` that keeps the log line and the signal only. ``app`` is unused
    (kept for stores chosen per Celery app)."""
    durable = _durable_audits()
    return durable[0]() if durable else LogAudit()


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _refusal(
    name: str, key: str, owner: str, current: dict[str, Any] | None
) -> ForceReleaseRefused:
    if current is None:
        return LeaseNotHeld(
            f"lease {name!r} is not held: nothing released",
            name=name,
            key=key,
            owner=owner,
            current=None,
        )
    return LeaseHeldByAnother(
        f"lease {name!r} is held by another owner ({current.get('owner')}, task "
        f"{current.get('task_name') or '?'}, fence {current.get('fence')}): nothing released",
        name=name,
        key=key,
        owner=owner,
        current=current,
    )


_LOGGED = (
    "outcome",
    "actor",
    "actor_host",
    "via",
    "name",
    "key",
    "owner",
    "fence",
    "task_id",
    "task_name",
    "audit",
    "reason",
    "detail",
)


def _log(
    record: ForcedRelease,
    sender: Any,
    level: int = logging.WARNING,
    event: str = "force_release_audit",
) -> None:
    """One audit line (logfmt, every field quoted as needed) and the audit signal."""
    data = record.fields()
    log_event(event, level, **{k: data[k] for k in _LOGGED if data.get(k) not in (None, "")})
    if event == "force_release_audit":
        try:
            signals.force_release_audit.send(sender=sender, event=event, **data)
        except Exception:  # noqa: BLE001 - Celery's send is robust; this guards the rest
            log_event("receiver_failed", logging.ERROR, exc_info=True, signal=event)


def _finish(auditor: ReleaseAudit, record: ForcedRelease, sender: Any) -> None:
    _log(record, sender)
    try:
        auditor.finished(record)
    except Exception as exc:  # noqa: BLE001 - the outcome stands; its record failed
        record.outcome_recorded = False
        record.outcome_error = redact(f"{type(exc).__name__}: {exc}")
        log_event(
            "force_release_outcome_unrecorded",
            logging.ERROR,
            exc_info=True,
            name=record.name,
            owner=record.owner,
            outcome=record.outcome,
            audit=record.audit,
            error=record.outcome_error,
        )


def force_release(
    store,
    name: str,
    owner: str,
    *,
    actor: str | None = None,
    reason: str | None = None,
    audit: Callable[[ForcedRelease], Any] | None = None,
    app=None,
    sender: Any = None,
    defer: Callable[[Callable[[], None]], Any] | None = None,
    auditor: ReleaseAudit | None = None,
    actor_host: str | None = None,
    via: str = "api",
) -> ForcedRelease:
    """Delete the lease ``name`` if ``owner`` still holds it, audited; returns the
    :class:`ForcedRelease` record (outcome ``released``).

    ``store``: a :class:`~celery_steplock.lock.RedisLeaseStore` (``lock.get_lease_store(app)``).
    ``owner``: the owner token the operator saw holding it. ``actor``, ``actor_host``,
    ``via``: who asks, from where, through what (``"admin"``, ``"cli"``; default ``"api"``),
    for the record. ``reason``: the signal's ``reason`` (default ``"force-released by
    <actor>"``). ``auditor``: the audit store (a :class:`ReleaseAudit`; default
    :func:`default_audit`). ``audit``: deprecated, a callable called with the record before
    the release, inside the durable step (its failure also releases nothing). ``app``: a
    Celery app whose registered task named by the lease is the signal sender (so receivers
    connected with ``sender=task`` fire); else ``sender``, else the lease's task name, else
    :data:`OPS_SENDER`. ``defer``: called with a no-argument callable that sends
    ``lock_released`` and logs it (default: call it now).

    Raises :class:`LeaseNotHeld` or :class:`LeaseHeldByAnother` (nothing released, outcome
    recorded), :class:`AuditRecordFailed` (the record could not be made durable: nothing
    released), the store's :class:`~celery_steplock.exceptions.LockStoreUnavailable` (Redis
    unreachable; during the delete: outcome ``unknown``) or
    :class:`~celery_steplock.exceptions.LockError` (Redis refused, e.g. a key that is not a
    lease hash; during the delete: outcome ``failed``), all naming the lease; an error
    raised during the delete carries the record as ``forced_release``. Never releases a
    lease held by another owner. See the module docstring for the order of the steps.
    """
    if auditor is None:
        auditor = default_audit(app)
    key = store.key(name)
    current = store.inspect(name)
    actor_text = actor or "an operator"
    # The holder's fields only when it is the owner asked for: a refusal names the other
    # holder in its detail, never as the subject of the record.
    held = current if current is not None and current.get("owner") == owner else {}
    record = ForcedRelease(
        name=name,
        key=key,
        owner=owner,
        fence=_int(held.get("fence")),
        task_id=held.get("task_id") or None,
        task_name=held.get("task_name") or None,
        worker=held.get("worker") or None,
        hostname=held.get("hostname") or None,
        pid=_int(held.get("pid")),
        step=held.get("step") or None,
        ttl=held.get("ttl"),
        actor=actor,
        actor_host=actor_host,
        via=via,
        reason=reason or f"force-released by {actor_text}",
        lease=dict(held),
    )

    if sender is None:
        sender = record.task_name or OPS_SENDER
        if app is not None and record.task_name:
            try:
                sender = app.tasks.get(record.task_name) or sender
            except Exception:  # noqa: BLE001 - a sender is a nicety; the event must go out
                pass

    def refuse(now: dict[str, Any] | None) -> ForceReleaseRefused:
        refusal = _refusal(name, key, owner, now)
        record.outcome = "not_held" if now is None else "held_by_another"
        record.detail = (
            str(refusal)
            if now is None
            else f"held by {now.get('owner')} (fence {now.get('fence')})"
        )
        _finish(auditor, record, sender)
        return refusal

    if current is None or current.get("owner") != owner:
        raise refuse(current)

    _log(record, sender)
    try:
        if audit is not None:
            audit(record)
        auditor.requested(record)
    except Exception as exc:
        error = redact(f"{type(exc).__name__}: {exc}", secrets_of(app))
        log_event("force_release_aborted", logging.ERROR, name=name, owner=owner, error=error)
        raise AuditRecordFailed(
            f"lease {name!r}: the audit record of the force release could not be written "
            f"({error}): nothing released",
            name=name,
            key=key,
            owner=owner,
            current=current,
        ) from exc

    try:
        deleted = store.release(name, owner)
    except StepLockError as exc:
        record.outcome = "unknown" if isinstance(exc, LockStoreUnavailable) else "failed"
        record.detail = str(exc)
        _finish(auditor, record, sender)
        exc.forced_release = record  # type: ignore[attr-defined]
        raise
    if not deleted:
        try:
            now = store.inspect(name)
        except StepLockError:
            now = None
        raise refuse(now)

    record.outcome = "released"
    _finish(auditor, record, sender)

    def announce() -> None:
        emit(
            signals.lock_released,
            sender,
            logging.WARNING,
            key=record.key,
            name=record.name,
            owner=record.owner,
            fence=record.fence,
            task_id=record.task_id,
            task_name=record.task_name,
            ttl=(_int(held.get("ttl_ms")) or 0) / 1000.0 or None,
            forced=True,
            reason=record.reason,
            user=actor,
            actor_host=actor_host,
            via=via,
            step=record.step,
            hostname=record.hostname,
            pid=record.pid,
            worker=record.worker,
            audit=record.audit,
        )

    (defer or (lambda send: send()))(announce)
    return record


# -- circuit breakers: operators' overrides ---------------------------------------------------

#: Outcomes of a breaker override, as recorded: ``requested`` before the write, then ``done``,
#: ``failed`` (Redis refused it: nothing changed) or ``unknown`` (Redis could not be reached
#: during it: it may have happened).
OVERRIDE_OUTCOMES = ("requested", "done", "failed", "unknown")


@dataclass
class BreakerOverride:
    """The audit record of one :func:`override_breaker`: ``name`` (the dependency), ``key``,
    ``action`` ("open": forced open until closed by hand, or "close"), ``actor``,
    ``actor_host``, ``via``, ``reason``, ``previous`` (the state before, once done),
    ``forced_before`` (it was forced open before), ``outcome`` (:data:`OVERRIDE_OUTCOMES`),
    ``audit`` / ``audit_id`` (where the durable record is), ``outcome_recorded``,
    ``outcome_error``."""

    name: str
    key: str
    action: str
    actor: str | None = None
    actor_host: str | None = None
    via: str = "api"
    reason: str = ""
    previous: str | None = None
    forced_before: bool | None = None
    outcome: str = "requested"
    audit: str | None = None
    audit_id: Any = None
    outcome_recorded: bool = True
    outcome_error: str | None = None

    def fields(self) -> dict[str, Any]:
        return asdict(self)


class BreakerAudit:
    """Where :func:`override_breaker` makes its records durable: ``requested(record)``
    before the write (what it raises refuses the override: :class:`AuditRecordFailed`),
    ``finished(record)`` with the outcome. This base keeps nothing (the log line and the
    ``circuit_override_audit`` signal are the record)."""

    def requested(self, record: BreakerOverride) -> None:
        """Make ``record`` durable."""

    def finished(self, record: BreakerOverride) -> None:
        """Record ``record.outcome``."""


class LogBreakerAudit(BreakerAudit):
    """Without Django: refuses (as :class:`LogAudit`) unless the ``celery_steplock`` logger
    emits the WARNING audit line."""

    # The same check (it reads nothing of the record): one refusal text for both.
    requested = LogAudit.requested  # type: ignore[assignment]


def default_breaker_audit(app=None) -> BreakerAudit:
    """The durable breaker audit registered by ``celery_steplock.contrib.django``
    (:class:`~celery_steplock.contrib.django.eventlog.LeaseEventBreakerAudit`) when Django is
    set up with it installed, else :class:`LogBreakerAudit`."""
    durable = _durable_audits()
    return durable[1]() if durable else LogBreakerAudit()


#: The durable audit stores (release, breaker override) that an installed Django app
#: registers in its ``ready()``: the operators' tools never import ``contrib``.
_registered: list[tuple[type[ReleaseAudit], type[BreakerAudit]]] = []


def register_audits(release: type[ReleaseAudit], breaker: type[BreakerAudit]) -> None:
    """Make ``release``/``breaker`` the audit stores of this process while Django's app
    registry is ready (called by ``celery_steplock.contrib.django``'s ``ready()``)."""
    _registered[:] = [(release, breaker)]


def _durable_audits() -> tuple[type[ReleaseAudit], type[BreakerAudit]] | None:
    django_apps = sys.modules.get("django.apps")
    registry = getattr(django_apps, "apps", None)
    if _registered and registry is not None and registry.ready:
        return _registered[0]
    return None


def __getattr__(name: str) -> Any:
    # Moved beside LeaseEventAudit (it writes LeaseEvent rows); kept here one release.
    if name == "LeaseEventBreakerAudit":
        import importlib

        warnings.warn(
            "celery_steplock.ops.LeaseEventBreakerAudit moved to "
            "celery_steplock.contrib.django.eventlog",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(
            "celery_steplock.contrib.django.eventlog"
        ).LeaseEventBreakerAudit
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_OVERRIDE_LOGGED = (
    "outcome",
    "action",
    "actor",
    "actor_host",
    "via",
    "name",
    "key",
    "previous",
    "audit",
    "reason",
)


def _log_override(record: BreakerOverride, sender: Any) -> None:
    data = record.fields()
    log_event(
        "circuit_override_audit",
        logging.WARNING,
        **{k: data[k] for k in _OVERRIDE_LOGGED if data.get(k) not in (None, "")},
    )
    try:
        signals.circuit_override_audit.send(sender=sender, event="circuit_override_audit", **data)
    except Exception:  # noqa: BLE001 - Celery's send is robust; this guards the rest
        log_event("receiver_failed", logging.ERROR, exc_info=True, signal="circuit_override_audit")


def override_breaker(
    breaker,
    action: str,
    *,
    actor: str | None = None,
    actor_host: str | None = None,
    via: str = "api",
    reason: str = "",
    auditor: BreakerAudit | None = None,
    sender: Any = None,
    app=None,
) -> BreakerOverride:
    """Force the circuit breaker ``breaker`` (a
    :class:`~celery_steplock.patterns.breaker.CircuitBreaker`) "open" (it stays open until closed
    here, whatever its recovery timeout) or "close" it (its window emptied), audited: the
    record (outcome ``requested``) is logged (WARNING ``event=circuit_override_audit``), sent
    with ``circuit_override_audit`` and made durable by ``auditor`` (default
    :func:`default_breaker_audit`) before Redis is written; then the outcome. Returns the
    :class:`BreakerOverride`. Raises :class:`AuditRecordFailed` (nothing changed) when the
    record cannot be made durable, LockStoreUnavailable (outcome ``unknown``) or another
    StepLockError (outcome ``failed``) from Redis."""
    from .patterns.breaker import CLOSED, OPEN

    if action not in ("open", "close"):
        raise ValueError(f"action must be 'open' or 'close', got {action!r}")
    auditor = auditor if auditor is not None else default_breaker_audit(app)
    sender = sender if sender is not None else OPS_SENDER
    record = BreakerOverride(
        name=breaker.name,
        key=breaker.key,
        action=action,
        actor=actor,
        actor_host=actor_host,
        via=via,
        reason=reason or "",
    )
    _log_override(record, sender)
    try:
        auditor.requested(record)
    except Exception as exc:
        log_event(
            "circuit_override_aborted", logging.ERROR, name=record.name, action=action, error=exc
        )
        raise AuditRecordFailed(
            f"circuit breaker {record.name!r}: the audit record could "
            f"not be written: nothing changed",
            name=record.name,
            key=record.key,
            owner="",
            current=None,
        ) from exc
    try:
        record.previous, record.forced_before = breaker.override(action)
        record.outcome = "done"
    except LockStoreUnavailable:
        record.outcome = "unknown"
        raise
    except StepLockError:
        record.outcome = "failed"
        raise
    finally:
        _log_override(record, sender)
        try:
            auditor.finished(record)
        except Exception as exc:  # noqa: BLE001 - the outcome stands; its record failed
            record.outcome_recorded = False
            record.outcome_error = redact(f"{type(exc).__name__}: {exc}")
            log_event(
                "circuit_override_outcome_unrecorded",
                logging.ERROR,
                name=record.name,
                action=action,
                outcome=record.outcome,
                error=record.outcome_error,
            )
    signal = signals.circuit_opened if action == "open" else signals.circuit_closed
    emit(
        signal,
        sender,
        logging.WARNING,
        key=record.key,
        name=record.name,
        state=OPEN if action == "open" else CLOSED,
        manual=True,
        actor=actor,
        reason=f"{action} by {actor or 'an operator'} via {via}"
        + (f": {reason}" if reason else ""),
    )
    return record
