"""Operator actions, audited: force releases of leases and circuit breaker overrides.

Shared by the Django admin and ``celery steplock``. Imports the lease store, never the task
module, and no Django: the Django audit stores are registered by
``celery_steplock.contrib.django`` (:func:`register_audits`). The steps of a force release
and where its record goes: docs/security.md ("Operator actions are audited").
"""

from __future__ import annotations

import inspect
import logging
import sys
import warnings
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable

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

if TYPE_CHECKING:
    from .lock import RedisLeaseStore
    from .patterns.breaker import CircuitBreaker

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
    "MAX_BREAKERS",
    "task_breakers",
    "find_breakers",
    "breaker_rows",
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

    Attributes:
        name: The lock name.
        key: The lease's Redis key.
        owner: The owner token asked for.
        fence: The lease's fencing token (int or None).
        task_id: The holder's task id.
        task_name: The holder's task name.
        worker: The holder's Celery node.
        hostname: The holder's host.
        pid: The holder's pid (int or None).
        step: The step the lease guards.
        ttl: Seconds the lease had left when read.
        actor: Who asked: the Django user name, the OS user for the CLI.
        actor_host: Where from: the CLI's host, the admin client's address.
        via: Through what: ``"admin"``, ``"cli"``, ``"api"``.
        reason: Sent with the signal.
        lease: Every stored field of the lease as read.
        outcome: One of :data:`OUTCOMES`.
        audit: Where the durable record is (e.g. ``"LeaseEvent 42"``; None: the log only).
        audit_id: The audit store's id of the record.
        outcome_recorded: False when the outcome could not be recorded after the release
            (which stands; the durable record keeps outcome ``requested``).
        outcome_error: Why the outcome could not be recorded.
        detail: What a refusal or an error said.
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
        """The record for logs and signals.

        Returns:
            A flat dict of its fields, ``lease`` left out.
        """
        data = asdict(self)
        data.pop("lease", None)
        return data


class ReleaseAudit:
    """Where :func:`force_release` makes its records durable.

    Subclass it for a store of your own; the Django one is
    :class:`celery_steplock.contrib.django.eventlog.LeaseEventAudit`. This base class keeps
    nothing: the log line and the signal are the record.
    """

    def requested(self, record: ForcedRelease) -> None:
        """Make the record durable before the delete; return only once it is (committed).

        May set ``record.audit`` and ``record.audit_id``.

        Args:
            record: The record, outcome ``requested``.

        Raises:
            Exception: Anything: it stops the release (nothing is deleted) and becomes the
                cause of :class:`AuditRecordFailed`.
        """

    def finished(self, record: ForcedRelease) -> None:
        """Record the outcome (also of a refusal found at the first read, without
        :meth:`requested` before it).

        Args:
            record: The record, its outcome set.

        Raises:
            Exception: Anything: logged and reported in ``record.outcome_recorded``; the
                outcome stands.
        """


class LogAudit(ReleaseAudit):
    """The audit of an app without Django: the log line and the signal.

    The record is the ``celery_steplock`` logger's WARNING line: ship those lines to durable
    storage.
    """

    def requested(self, record: ForcedRelease) -> None:
        """Refuse unless the ``celery_steplock`` logger emits WARNING lines.

        Args:
            record: The record, outcome ``requested``.

        Raises:
            RuntimeError: The logger would not emit the line: not enabled for WARNING, or no
                handler reaching it (``logging.lastResort`` counts as one); the release is
                refused (:class:`AuditRecordFailed`).
        """
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


def default_audit(app: Any = None) -> ReleaseAudit:
    """The force releases' audit store of this process.

    Args:
        app: Unused (kept for stores chosen per Celery app).

    Returns:
        A :class:`~celery_steplock.contrib.django.eventlog.LeaseEventAudit` when Django is
        set up (its app registry ready) with ``celery_steplock.contrib.django`` installed,
        else a :class:`LogAudit` that keeps the log line and the signal only.
    """
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


def _audit_line(record: Any, sender: Any, signal: Any, logged: tuple[str, ...]) -> None:
    """One audit line (WARNING, logfmt: the ``logged`` fields that have a value) and the
    audit ``signal`` with every field of ``record``."""
    event = signal.name
    data = record.fields()
    log_event(
        event, logging.WARNING, **{k: data[k] for k in logged if data.get(k) not in (None, "")}
    )
    try:
        signal.send(sender=sender, event=event, **data)
    except Exception:  # noqa: BLE001 - Celery's send is robust; this guards the rest
        log_event("receiver_failed", logging.ERROR, exc_info=True, signal=event)


def _record_outcome(auditor: Any, record: Any) -> Exception | None:
    """``auditor.finished(record)``; its error (None: recorded) is noted on ``record``:
    the outcome stands, its record failed."""
    try:
        auditor.finished(record)
    except Exception as exc:  # noqa: BLE001 - the outcome stands; its record failed
        record.outcome_recorded = False
        record.outcome_error = redact(f"{type(exc).__name__}: {exc}")
        return exc
    return None


def _log(record: ForcedRelease, sender: Any) -> None:
    _audit_line(record, sender, signals.force_release_audit, _LOGGED)


def _finish(auditor: ReleaseAudit, record: ForcedRelease, sender: Any) -> None:
    _log(record, sender)
    failed = _record_outcome(auditor, record)
    if failed is not None:
        log_event(
            "force_release_outcome_unrecorded",
            logging.ERROR,
            exc_info=failed,
            name=record.name,
            owner=record.owner,
            outcome=record.outcome,
            audit=record.audit,
            error=record.outcome_error,
        )


def _release_takes(store: Any, argument: str) -> bool:
    """Whether ``store.release`` takes the keyword ``argument`` (a store keeping a history;
    not one of another kind, nor a release replaced by a wrapper of the old signature)."""
    if getattr(store, "history_config", None) is None:
        return False
    try:
        return argument in inspect.signature(store.release).parameters
    except (TypeError, ValueError):
        return False


def force_release(
    store: RedisLeaseStore,
    name: str,
    owner: str,
    *,
    actor: str | None = None,
    reason: str | None = None,
    audit: Callable[[ForcedRelease], Any] | None = None,
    app: Any = None,
    sender: Any = None,
    defer: Callable[[Callable[[], None]], Any] | None = None,
    auditor: ReleaseAudit | None = None,
    actor_host: str | None = None,
    via: str = "api",
) -> ForcedRelease:
    """Delete a lease if the owner the operator saw still holds it, audited.

    Never releases a lease held by another owner: the delete is the store's
    compare-and-delete. The record (outcome ``requested``) is logged (WARNING
    ``event=force_release_audit``), sent with
    :data:`~celery_steplock.signals.force_release_audit` and made durable by ``auditor``
    before the delete: no record, no release. Then the outcome is recorded the same way,
    and ``lock_released`` (``forced=True``) is sent. The steps in full: docs/security.md.

    Args:
        store: A :class:`~celery_steplock.lock.RedisLeaseStore`
            (``lock.get_lease_store(app)``).
        name: The lock name.
        owner: The owner token the operator saw holding it.
        actor: Who asks, for the record.
        reason: The signal's ``reason`` (default ``"force-released by <actor>"``).
        audit: Deprecated: a callable called with the record before the release, inside
            the durable step (its failure also releases nothing).
        app: A Celery app whose registered task named by the lease is the signal sender
            (so receivers connected with ``sender=task`` fire).
        sender: The signal sender without such a task; else the lease's task name, else
            :data:`OPS_SENDER`.
        defer: Called with a no-argument callable that sends ``lock_released`` and logs it
            (default: call it now).
        auditor: The audit store (a :class:`ReleaseAudit`; default :func:`default_audit`).
        actor_host: Where the actor asks from, for the record.
        via: Through what: ``"admin"``, ``"cli"``; default ``"api"``.

    Returns:
        The :class:`ForcedRelease` record, outcome ``released``.

    Raises:
        LeaseNotHeld: The lease is not held (nothing released, outcome recorded).
        LeaseHeldByAnother: Another owner holds it (nothing released, outcome recorded).
        AuditRecordFailed: The record could not be made durable: nothing released.
        LockStoreUnavailable: Redis unreachable; during the delete: outcome ``unknown``
            (it may have run).
        LockError: Redis refused, e.g. a key that is not a lease hash; during the delete:
            outcome ``failed``. An error raised during the delete carries the record as
            ``forced_release``; all name the lease.
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
        # Before the delete: the holder, finding its lease gone, reads the operator's record
        # (its lock_lost a WARNING naming it, not an ERROR). A mark not written changes
        # only that line's level: the release goes on.
        store.mark_forced(name, owner, record.fields())
    except Exception:  # noqa: BLE001 - StepLockError, or a store without marks
        pass
    try:
        # The name's history records it as "forced", naming the operator (a store without
        # a history, or a release without the history's arguments, takes (name, owner)).
        if _release_takes(store, "forced_by"):
            deleted = store.release(
                name, owner, task_id=record.task_id, forced_by=actor or via or "operator"
            )
        else:
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
    """The audit record of one :func:`override_breaker`.

    Attributes:
        name: The dependency's name.
        key: The breaker's Redis key.
        action: ``"open"`` (forced open until closed by hand) or ``"close"``.
        actor: Who asked.
        actor_host: Where from.
        via: Through what (``"admin"``, ``"cli"``, ``"api"``).
        reason: Why, as given.
        previous: The state before, once done.
        forced_before: Whether it was forced open before, once done.
        outcome: One of :data:`OVERRIDE_OUTCOMES`.
        audit: Where the durable record is.
        audit_id: The audit store's id of the record.
        outcome_recorded: False when the outcome could not be recorded.
        outcome_error: Why it could not.
    """

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
        """The record for logs and signals.

        Returns:
            A flat dict of its fields.
        """
        return asdict(self)


class BreakerAudit:
    """Where :func:`override_breaker` makes its records durable.

    This base keeps nothing: the log line and the ``circuit_override_audit`` signal are the
    record.
    """

    def requested(self, record: BreakerOverride) -> None:
        """Make the record durable before the write.

        Args:
            record: The record, outcome ``requested``.

        Raises:
            Exception: Anything: it refuses the override (:class:`AuditRecordFailed`).
        """

    def finished(self, record: BreakerOverride) -> None:
        """Record the outcome.

        Args:
            record: The record, its outcome set.
        """


class LogBreakerAudit(BreakerAudit):
    """The breaker audit without Django: the log line and the signal.

    Refuses (as :class:`LogAudit`) unless the ``celery_steplock`` logger emits the WARNING
    audit line.
    """

    # The same check (it reads nothing of the record): one refusal text for both.
    requested = LogAudit.requested  # type: ignore[assignment]


def default_breaker_audit(app: Any = None) -> BreakerAudit:
    """The breaker overrides' audit store of this process.

    Args:
        app: Unused (kept for stores chosen per Celery app).

    Returns:
        The durable one registered by ``celery_steplock.contrib.django``
        (:class:`~celery_steplock.contrib.django.eventlog.LeaseEventBreakerAudit`) when
        Django is set up with it installed, else a :class:`LogBreakerAudit`.
    """
    durable = _durable_audits()
    return durable[1]() if durable else LogBreakerAudit()


#: The durable audit stores (release, breaker override) that an installed Django app
#: registers in its ``ready()``: the operators' tools never import ``contrib``.
_registered: list[tuple[type[ReleaseAudit], type[BreakerAudit]]] = []


def register_audits(release: type[ReleaseAudit], breaker: type[BreakerAudit]) -> None:
    """Register the durable audit stores, used while Django's app registry is ready.

    Called by ``celery_steplock.contrib.django``'s ``ready()``.

    Args:
        release: The force releases' audit store class.
        breaker: The breaker overrides' audit store class.
    """
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
    _audit_line(record, sender, signals.circuit_override_audit, _OVERRIDE_LOGGED)


def override_breaker(
    breaker: CircuitBreaker,
    action: str,
    *,
    actor: str | None = None,
    actor_host: str | None = None,
    via: str = "api",
    reason: str = "",
    auditor: BreakerAudit | None = None,
    sender: Any = None,
    app: Any = None,
) -> BreakerOverride:
    """Force a circuit breaker open or close it, audited.

    The record (outcome ``requested``) is logged (WARNING ``event=circuit_override_audit``),
    sent with ``circuit_override_audit`` and made durable by ``auditor`` before Redis is
    written; then the outcome, and ``circuit_opened`` / ``circuit_closed`` (``manual``).

    Args:
        breaker: The :class:`~celery_steplock.patterns.breaker.CircuitBreaker`.
        action: ``"open"`` (it stays open until closed here, whatever its recovery
            timeout) or ``"close"`` (its window emptied).
        actor: Who asks, for the record.
        actor_host: From where.
        via: Through what (default ``"api"``).
        reason: Why, for the record and the signal.
        auditor: The audit store (default :func:`default_breaker_audit`).
        sender: The signal sender (default :data:`OPS_SENDER`).
        app: Passed to :func:`default_breaker_audit`.

    Returns:
        The :class:`BreakerOverride` record.

    Raises:
        ValueError: ``action`` is neither ``"open"`` nor ``"close"``.
        AuditRecordFailed: The record cannot be made durable: nothing changed.
        LockStoreUnavailable: Redis unreachable (outcome ``unknown``).
        StepLockError: Another error from Redis (outcome ``failed``).
    """
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
        if _record_outcome(auditor, record) is not None:
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


# -- circuit breakers: which exist, and their state ------------------------------------------

#: Circuit breakers :func:`find_breakers` returns at most by default (the tasks' breakers
#: first, then what SCAN finds): the admin's page and ``celery steplock breaker ls``.
MAX_BREAKERS = 500


def task_breakers(tasks: Any) -> dict[str, CircuitBreaker | None]:
    """The circuit breakers that tasks name in their ``circuit_breaker`` option.

    Args:
        tasks: Task objects (the app's StepLockedTasks).

    Returns:
        ``{name: CircuitBreaker bound to the task's app}`` for a breaker given as an object,
        ``{name: None}`` for one given by name.
    """
    from .patterns.breaker import CircuitBreaker

    found: dict[str, CircuitBreaker | None] = {}
    for task in tasks:
        value = getattr(task, "circuit_breaker", None)
        if isinstance(value, CircuitBreaker):
            found.setdefault(value.name, value.bind(task.app))
        elif isinstance(value, str) and value:
            found.setdefault(value, None)
    return found


def _steplocked_tasks(app: Any) -> list[Any]:
    # The task module is never imported from here: when nothing imported it, no task of the
    # app can be a StepLockedTask.
    task_module = sys.modules.get("celery_steplock.task")
    if task_module is None:
        return []
    base = task_module.StepLockedTask
    return [task for _, task in sorted(app.tasks.items()) if isinstance(task, base)]


def find_breakers(
    app: Any,
    limit: int = MAX_BREAKERS,
    *,
    tasks: Any = None,
    malformed: dict[str, str] | None = None,
) -> dict[str, CircuitBreaker]:
    """The circuit breakers there are: those the app's tasks name, then those Redis holds
    (SCAN of ``<prefix>:breaker:{*}``, never KEYS), at most ``limit``, sorted by name. The
    one listing of the Django admin's breaker page and ``celery steplock breaker ls``.

    Args:
        app: The Celery app (its lease store's client and prefix).
        limit: Breakers at most (the malformed keys count too).
        tasks: Task objects whose ``circuit_breaker`` option names breakers (default: the
            StepLockedTasks of ``app.tasks`` as registered now).
        malformed: When given, each key that names no possible breaker (its name was not
            UTF-8, or holds a brace or a control character) is put there, its name escaped
            (:func:`~celery_steplock.redact.printable`) -> what is wrong; otherwise it is
            left out.

    Returns:
        ``{name: CircuitBreaker}``.

    Raises:
        LockStoreUnavailable: Redis could not be reached.
        LockStoreMisconfigured: Redis refused our credentials or the SCAN.
    """
    from .keys import breaker_key, breaker_name_from_key, glob_escape
    from .lock import get_lease_store
    from .patterns._base import translated
    from .patterns.breaker import CircuitBreaker
    from .redact import printable

    found = task_breakers(_steplocked_tasks(app) if tasks is None else tasks)
    store = get_lease_store(app)
    with translated("circuit breaker scan", key=breaker_key(store.prefix, "*")):
        for key in store.client.scan_iter(
            match=breaker_key(glob_escape(store.prefix), "*"), count=1000
        ):
            if len(found) >= limit:
                break
            # A client that does not decode gives bytes; a name that was not UTF-8 then
            # reads with U+FFFD, as the library's own clients decode it.
            key = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
            name = breaker_name_from_key(store.prefix, key)
            if name is not None:
                found.setdefault(name, None)
    shown: dict[str, CircuitBreaker] = {}
    for name, breaker in sorted(found.items())[:limit]:
        problem = None
        if breaker is not None:
            shown[name] = breaker
        elif "\ufffd" in name:
            problem = "key: not UTF-8 (cannot be read back)"
        else:
            try:
                shown[name] = CircuitBreaker(name, app=app)
            except StepLockError as exc:
                problem = f"name: {exc}"
        if problem is not None and malformed is not None:
            malformed[printable(name)] = printable(problem)
    return shown


def breaker_rows(
    app: Any, limit: int = MAX_BREAKERS, *, tasks: Any = None
) -> list[dict[str, Any]]:
    """Every breaker of :func:`find_breakers` with its state as Redis holds it now, sorted by
    name: what the admin's page and ``celery steplock breaker ls`` show.

    Args:
        app: The Celery app.
        limit: Breakers at most.
        tasks: As :func:`find_breakers`.

    Returns:
        One dict per breaker: :meth:`BreakerState.as_dict
        <celery_steplock.patterns.breaker.BreakerState.as_dict>` (typed: ints, floats,
        a bool ``forced``; ``malformed`` says what is wrong with its keys) plus ``limits``
        (:meth:`~celery_steplock.patterns.breaker.CircuitBreaker.describe`); for a key that
        names no possible breaker, or a breaker whose read Redis refused alone, only
        ``name``, ``key`` and ``malformed`` (the error, its secrets masked).

    Raises:
        LockStoreUnavailable: Redis could not be reached.
        LockStoreMisconfigured: Redis refused our credentials or the SCAN.
    """
    from .exceptions import LockStoreMisconfigured
    from .keys import breaker_key
    from .lock import get_lease_store
    from .redact import printable

    unnamed: dict[str, str] = {}
    rows: list[dict[str, Any]] = []
    for name, breaker in find_breakers(app, limit, tasks=tasks, malformed=unnamed).items():
        try:
            rows.append(breaker.state().as_dict() | {"limits": breaker.describe()})
        except (LockStoreUnavailable, LockStoreMisconfigured):
            raise
        except StepLockError as exc:  # Redis refused this breaker's read alone
            malformed = redact(exc, secrets_of(app))
            rows.append({"name": name, "key": breaker.key, "malformed": malformed})
    prefix = get_lease_store(app).prefix
    rows.extend(
        {"name": name, "key": printable(breaker_key(prefix, name)), "malformed": why}
        for name, why in unnamed.items()
    )
    rows.sort(key=lambda row: row["name"])
    return rows
