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
           "lock_store_error", "force_release_audit", "ALL_SIGNALS"]

#: A lease was granted (``wait_seconds``: the acquire, ``lock_wait`` included).
lock_acquired = Signal(name="lock_acquired")
#: Another owner holds the lease (``holder``: its owner token; ``wait_seconds``).
lock_contended = Signal(name="lock_contended")
#: The heartbeat renewed the lease (sent on the heartbeat thread: keep receivers fast).
lock_extended = Signal(name="lock_extended")
#: The lease was released: by its holder (``hold_seconds``) or by an operator (``forced``).
lock_released = Signal(name="lock_released")
#: The lease expired before its release (``reason``).
lock_expired = Signal(name="lock_expired")
#: The lease is no longer ours (``reason``); any commit that depended on it is refused.
lock_lost = Signal(name="lock_lost")
#: The compare-and-swap committed (``step_id``, ``from_``, ``to``, ``cas_seconds``,
#: ``commit_seconds``); sent after the commit.
transition_applied = Signal(name="transition_applied")
#: The compare-and-swap updated no row (``step_id``, ``from_``, ``to``, ``current``).
transition_conflict = Signal(name="transition_conflict")
#: Redis could not be reached; ``policy`` says whether the body was refused or ran unlocked.
lock_store_error = Signal(name="lock_store_error")
#: An operator's force release: requested (before the delete), then its outcome.
force_release_audit = Signal(name="force_release_audit")

ALL_SIGNALS = (lock_acquired, lock_contended, lock_extended, lock_released, lock_expired,
               lock_lost, transition_applied, transition_conflict, lock_store_error,
               force_release_audit)
