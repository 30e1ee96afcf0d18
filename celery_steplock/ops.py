"""Operator actions on leases, shared by the Django admin and ``celery steplock``.

:func:`force_release` is the one force release: the admin's confirmation page and
``celery steplock release NAME --owner TOKEN`` both call it. It imports the lease store
(:mod:`celery_steplock.lock`), never the task module, and no Django.

A force release is owner-checked: the caller names the owner token it saw holding the lease,
and the lease is deleted by the store's compare-and-delete
(:meth:`~celery_steplock.lock.RedisLeaseStore.release`) only while that owner still holds it;
a lease taken meanwhile by another attempt is never touched. In order:

1. read the lease (its holder metadata goes into the record); not held, or held by another
   owner: :class:`LeaseNotHeld` / :class:`LeaseHeldByAnother`, nothing written;
2. ``audit(record)``, when given: the durable record comes *before* the release, so there is
   no release without its record (the Django admin writes its ``LogEntry`` here, inside the
   database transaction it opened around the call; an exception from the hook propagates and
   nothing is released);
3. the compare-and-delete; when it deletes nothing (the holder released, expired or changed
   between 1 and 3) the error of step 1 is raised, so a caller's transaction around the call
   rolls the record back: no record for a release that did not happen;
4. ``lock_released`` with ``forced=True`` and its structured log line (WARNING,
   ``event=lock_released ... forced=True reason=...``), handed to ``defer`` (default: at
   once; the admin passes ``transaction.on_commit`` so the event follows the record's
   commit).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from . import signals
from .events import emit
from .exceptions import ForceReleaseRefused, LeaseHeldByAnother, LeaseNotHeld

__all__ = ["ForcedRelease", "ForceReleaseRefused", "LeaseNotHeld", "LeaseHeldByAnother",
           "force_release", "OPS_SENDER"]

logger = logging.getLogger("celery_steplock")

#: Signal sender of a force release when the lease names no task this process knows.
OPS_SENDER = "celery_steplock.ops"


@dataclass
class ForcedRelease:
    """What :func:`force_release` released (or is about to, when handed to ``audit``).

    ``name``, ``key``, ``owner`` (the owner token released), ``fence`` (int or None),
    ``task_id``, ``task_name``, ``worker``, ``hostname``, ``pid`` (int or None), ``step``,
    ``ttl`` (seconds it had left when read), ``actor`` (who asked, e.g. a user name),
    ``reason`` (sent with the signal), ``lease``: every stored field as read.
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


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _refusal(name: str, key: str, owner: str, current: dict[str, Any] | None
             ) -> ForceReleaseRefused:
    if current is None:
        return LeaseNotHeld(f"lease {name!r} is not held: nothing released", name=name,
                            key=key, owner=owner, current=None)
    return LeaseHeldByAnother(
        f"lease {name!r} is held by another owner ({current.get('owner')}, task "
        f"{current.get('task_name') or '?'}, fence {current.get('fence')}): nothing released",
        name=name, key=key, owner=owner, current=current)


def force_release(store, name: str, owner: str, *, actor: str | None = None,
                  reason: str | None = None,
                  audit: Callable[[ForcedRelease], Any] | None = None, app=None,
                  sender: Any = None,
                  defer: Callable[[Callable[[], None]], Any] | None = None) -> ForcedRelease:
    """Delete the lease ``name`` if ``owner`` still holds it; returns the :class:`ForcedRelease`.

    ``store``: a :class:`~celery_steplock.lock.RedisLeaseStore` (``lock.get_lease_store(app)``).
    ``owner``: the owner token the operator saw holding it. ``actor``: who asks, for the
    record and the reason. ``reason``: the signal's ``reason`` (default ``"force-released by
    <actor>"``). ``audit``: called with the record before the release (see the module
    docstring). ``app``: a Celery app whose registered task named by the lease is the signal
    sender (so receivers connected with ``sender=task`` fire); else ``sender``, else the
    lease's task name, else :data:`OPS_SENDER`. ``defer``: called with a no-argument callable
    that sends the signal and logs (default: call it now).

    Raises :class:`LeaseNotHeld` or :class:`LeaseHeldByAnother` (nothing released), the
    store's :class:`~celery_steplock.exceptions.LockStoreUnavailable` (Redis unreachable) or
    :class:`~celery_steplock.exceptions.LockError` (Redis refused, e.g. a key that is not a
    lease hash), all naming the lease; whatever ``audit`` raises. Never releases a lease
    held by another owner.
    """
    key = store.key(name)
    current = store.inspect(name)
    if current is None or current.get("owner") != owner:
        raise _refusal(name, key, owner, current)
    actor_text = actor or "an operator"
    record = ForcedRelease(
        name=name, key=key, owner=owner, fence=_int(current.get("fence")),
        task_id=current.get("task_id") or None, task_name=current.get("task_name") or None,
        worker=current.get("worker") or None, hostname=current.get("hostname") or None,
        pid=_int(current.get("pid")), step=current.get("step") or None,
        ttl=current.get("ttl"), actor=actor,
        reason=reason or f"force-released by {actor_text}", lease=dict(current))
    if audit is not None:
        audit(record)
    if not store.release(name, owner):
        raise _refusal(name, key, owner, store.inspect(name))

    if sender is None:
        sender = record.task_name or OPS_SENDER
        if app is not None and record.task_name:
            try:
                sender = app.tasks.get(record.task_name) or sender
            except Exception:  # noqa: BLE001 - a sender is a nicety; the event must go out
                pass

    def announce() -> None:
        emit(signals.lock_released, sender, logging.WARNING, key=record.key, name=record.name,
             owner=record.owner, fence=record.fence, task_id=record.task_id,
             task_name=record.task_name,
             ttl=(_int(current.get("ttl_ms")) or 0) / 1000.0 or None, forced=True,
             reason=record.reason, user=actor, step=record.step, hostname=record.hostname,
             pid=record.pid, worker=record.worker)

    (defer or (lambda send: send()))(announce)
    return record
