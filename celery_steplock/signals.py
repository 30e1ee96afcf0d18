"""Celery signals sent for every lease and transition event.

Each is a :class:`celery.utils.dispatch.Signal`; connect with ``@lock_acquired.connect`` (or
``connect(receiver, sender=task)`` for one task). The sender is the task instance (the
heartbeat and the reaper send with the task name when no instance is at hand). Every signal
carries these keyword arguments:

``event`` (str), ``key`` (Redis key), ``name`` (lock name), ``owner`` (owner token), ``fence``
(int or None), ``task_id``, ``task_name``, ``ttl`` (seconds), ``monotonic``
(:func:`time.monotonic` of the event), ``timestamp`` (wall-clock seconds since the epoch),

plus, where it applies: ``holder`` (lock_contended: the current owner), ``reason``
(lock_lost, lock_expired), ``forced`` (lock_released by an operator), ``step_id``,
``from_``, ``to``, ``current`` (transition_*), ``policy`` (lock_store_error), and the
durations, in seconds (float): ``wait_seconds`` (lock_acquired, lock_contended: the acquire,
``lock_wait`` included), ``hold_seconds`` (lock_released by the holder: from the request that was granted,
``Lease.acquired_at``, to the release's reply),
``cas_seconds`` and ``commit_seconds`` (transition_applied: its compare-and-swap and the
COMMIT that followed; ``commit_seconds`` None outside a task's own transaction).
``force_release_audit`` is the audit trail of an operator's force release
(:mod:`celery_steplock.ops`): sent once with ``outcome="requested"`` before the delete and
once with its outcome, with ``actor``, ``actor_host``, ``via`` and ``audit`` besides the
lease's fields. Task arguments are never sent. A receiver that raises is logged and ignored: it never breaks locking.
``lock_extended`` and the heartbeat's ``lock_lost`` run on the heartbeat thread, between
renewals: keep those receivers fast (hand slow work to a queue), or leases can expire.
"""
from celery.utils.dispatch import Signal

__all__ = ["lock_acquired", "lock_contended", "lock_extended", "lock_released",
           "lock_expired", "lock_lost", "transition_applied", "transition_conflict",
           "lock_store_error", "force_release_audit", "rate_limit_allowed", "rate_limited",
           "ALL_SIGNALS"]

lock_acquired = Signal(name="lock_acquired")
lock_contended = Signal(name="lock_contended")
lock_extended = Signal(name="lock_extended")
lock_released = Signal(name="lock_released")
lock_expired = Signal(name="lock_expired")
lock_lost = Signal(name="lock_lost")
transition_applied = Signal(name="transition_applied")
transition_conflict = Signal(name="transition_conflict")
#: Redis could not be reached; ``policy`` says whether the body was refused or ran unlocked.
lock_store_error = Signal(name="lock_store_error")
#: An operator's force release: requested (before the delete), then its outcome.
force_release_audit = Signal(name="force_release_audit")

#: A cluster-wide rate limit admitted an execution (``key``, ``name``, ``limit``,
#: ``remaining``, ``granted_at``: the Redis time of the grant, seconds since the epoch).
rate_limit_allowed = Signal(name="rate_limit_allowed")
#: A cluster-wide rate limit refused an execution for now (``key``, ``name``, ``limit``,
#: ``retry_after`` seconds, ``ticket``: its place in the queue or None, ``queued``).
rate_limited = Signal(name="rate_limited")

ALL_SIGNALS = (lock_acquired, lock_contended, lock_extended, lock_released, lock_expired,
               lock_lost, transition_applied, transition_conflict, lock_store_error,
               force_release_audit, rate_limit_allowed, rate_limited)
