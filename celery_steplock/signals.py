"""Celery signals sent for every lease, transition and pattern event.

Each is a :class:`celery.utils.dispatch.Signal`; connect with ``@lock_acquired.connect`` (or
``connect(receiver, sender=task)`` for one task). Every one carries ``event``, ``key``,
``name``, ``owner``, ``fence``, ``task_id``, ``task_name``, ``ttl`` (seconds), ``monotonic``
and ``timestamp``; the ``#:`` comment above each declaration says what it adds (durations in
seconds, float) and is its entry in docs/reference/signals.md, which says who sends them and
on which thread. Task arguments are never sent; a receiver that raises is logged and ignored.
"""

from celery.utils.dispatch import Signal

__all__ = [
    "lock_acquired",
    "lock_contended",
    "lock_extended",
    "lock_released",
    "lock_expired",
    "lock_lost",
    "transition_applied",
    "transition_conflict",
    "lock_store_error",
    "fence_ahead",
    "clock_skew",
    "force_release_audit",
    "idempotency_locked",
    "idempotency_replayed",
    "idempotency_completed",
    "idempotency_failed",
    "idempotency_conflict",
    "idempotency_lost",
    "circuit_opened",
    "circuit_half_opened",
    "circuit_closed",
    "circuit_rejected",
    "circuit_override_audit",
    "retry_policy_decided",
    "slot_acquired",
    "slot_released",
    "slot_expired",
    "concurrency_limited",
    "rate_limit_allowed",
    "rate_limited",
    "overlap_skipped",
    "overlap_coalesced",
    "effect_dispatched",
    "effect_retry",
    "effect_dead",
    "ALL_SIGNALS",
]

#: A lease was granted (``wait_seconds``: the acquire, ``lock_wait`` included).
lock_acquired = Signal(name="lock_acquired")
#: Another owner holds the lease (``holder``: its owner token; ``wait_seconds``).
lock_contended = Signal(name="lock_contended")
#: The heartbeat renewed the lease (sent on the heartbeat thread between renewals, as is the
#: heartbeat's ``lock_lost``: keep receivers fast, hand slow work to a queue, or leases can
#: expire).
lock_extended = Signal(name="lock_extended")
#: The lease was released: by its holder (``hold_seconds``: from the request that was
#: granted, ``Lease.acquired_at``, to the release's reply) or by an operator (``forced``).
#: A worker task's release after COMMIT is not waited for (``steplock_release_wait`` off,
#: the default): this is then sent about 10 ms later from the thread that reads the reply,
#: so read the task from ``task_id``, not from ``sender.request``.
lock_released = Signal(name="lock_released")
#: The lease expired before its release (``reason``).
lock_expired = Signal(name="lock_expired")
#: The lease is no longer ours (``reason``); any commit that depended on it is refused.
#: Taken by an operator's force release: also ``forced=True`` and the operator's record,
#: ``actor``, ``actor_host``, ``via``, ``audit`` (its line a WARNING; any other loss: ERROR).
lock_lost = Signal(name="lock_lost")
#: The compare-and-swap committed (``step_id``, ``from_``, ``to``, ``cas_seconds``: the
#: compare-and-swap, ``commit_seconds``: the COMMIT that followed, None outside a task's own
#: transaction); sent after the commit.
transition_applied = Signal(name="transition_applied")
#: The compare-and-swap updated no row (``step_id``, ``from_``, ``to``, ``current``).
transition_conflict = Signal(name="transition_conflict")
#: Redis could not be reached; ``policy`` says whether the body was refused or ran unlocked.
lock_store_error = Signal(name="lock_store_error")
#: The step row's fencing token is ahead of the one the lock store just granted, the lease
#: still valid: the store's clock went back (a failover to a primary whose clock is behind)
#: or another lock name writes the row (``step_id``, ``row_fence``, ``skew``: seconds the
#: row is ahead, ``attempt``: the lease retries of this kind so far, ``reason``). Sent before
#: the task's ``FenceAhead`` (a ``LockLost``); the task is retried after the skew, a bounded
#: number of times.
fence_ahead = Signal(name="fence_ahead")
#: A pattern found a Redis time it stored ahead of Redis ``TIME`` by more than
#: ``CLOCK_SKEW_TOLERANCE`` (one second): the state was written by a primary whose clock ran
#: ahead, then a failover to one whose clock is behind. The time was clamped to now and
#: written back in the same script, so the wait is bounded by the configured refill, window,
#: recovery or lifetime, never by the skew. ``pattern`` ("rate limit", "circuit breaker",
#: "concurrency limit"), ``field`` (the clamped time: ``ts``, ``log``, ``tickets``,
#: ``opened_ms``, ``probes``, ``waiters``), ``skew`` (seconds ahead), ``reason``. Sent once
#: per clamp, as a WARNING line.
clock_skew = Signal(name="clock_skew")
#: An operator's force release (:func:`celery_steplock.ops.force_release`): sent once with
#: ``outcome="requested"`` before the delete, then once with its outcome; ``actor``,
#: ``actor_host``, ``via`` and ``audit`` besides the lease's fields.
force_release_audit = Signal(name="force_release_audit")

#: Idempotency records (celery_steplock.patterns.idempotency): ``key`` (the record key), ``name``
#: (the namespace), ``version``, ``task_id``/``task_name`` (None outside a task), ``reason``
#: (idempotency_conflict: "reused" or "in_progress"; idempotency_failed: the error's type).
#: This one: an execution took the record (``locked``) and runs the body.
idempotency_locked = Signal(name="idempotency_locked")
#: A completed record's result was returned without running the body.
idempotency_replayed = Signal(name="idempotency_replayed")
#: The execution's result was recorded (after its commit).
idempotency_completed = Signal(name="idempotency_completed")
#: The execution raised: the record was released (``reason``: the error's type); the key runs
#: again.
idempotency_failed = Signal(name="idempotency_failed")
#: The key is held by another execution or was reused with other arguments.
idempotency_conflict = Signal(name="idempotency_conflict")
#: The heartbeat found a running body's ``locked`` record completed, failed, invalidated,
#: expired or locked by another owner (``owner``: the body's owner token, ``reason``, ``ttl``:
#: the lock TTL), and stopped renewing it; sent as an ERROR line, on the heartbeat thread.
#: The body is not interrupted: its completion is refused if another execution took the key.
idempotency_lost = Signal(name="idempotency_lost")

ALL_SIGNALS: tuple[Signal, ...] = (
    lock_acquired,
    lock_contended,
    lock_extended,
    lock_released,
    lock_expired,
    lock_lost,
    transition_applied,
    transition_conflict,
    lock_store_error,
    fence_ahead,
    clock_skew,
    force_release_audit,
)
ALL_SIGNALS += (
    idempotency_locked,
    idempotency_replayed,
    idempotency_completed,
    idempotency_failed,
    idempotency_conflict,
    idempotency_lost,
)

#: Circuit breakers (celery_steplock.patterns.breaker): ``name`` (the dependency), ``key``,
#: ``state`` (after the event), ``reason``; opened/closed also ``failures``, ``calls``,
#: ``manual`` (an operator's override, then ``actor``), rejected also ``retry_after``
#: (seconds). This one: the failure threshold was reached (or an operator opened it).
circuit_opened = Signal(name="circuit_opened")
#: The recovery time passed: the next calls are half-open probes.
circuit_half_opened = Signal(name="circuit_half_opened")
#: Enough probes succeeded (or an operator closed it): calls pass again.
circuit_closed = Signal(name="circuit_closed")
#: A call was refused while the breaker is open or its probes are taken.
circuit_rejected = Signal(name="circuit_rejected")
#: An operator's override of a circuit breaker (open/close): ``action``, ``actor``,
#: ``actor_host``, ``via``, ``previous``, ``outcome``.
circuit_override_audit = Signal(name="circuit_override_audit")
#: A retry policy (celery_steplock.patterns.retry) decided after a failed attempt: ``decision``
#: ("retry", "give_up", "never"), ``reason``, ``kind``, ``attempt``, ``countdown``
#: (seconds, None unless retried), ``retry_after``, ``error`` (the exception's type name).
retry_policy_decided = Signal(name="retry_policy_decided")

ALL_SIGNALS += (
    circuit_opened,
    circuit_half_opened,
    circuit_closed,
    circuit_rejected,
    circuit_override_audit,
    retry_policy_decided,
)

#: A slot of a concurrency limit (celery_steplock.patterns.concurrency) was granted, given
#: back, found expired or taken over (its holder stopped past the TTL, the reaper), or
#: refused: every slot held (``retry_after`` seconds, ``free``, ``waiting``, ``rank``).
#: Besides the lease fields of the slot (``key``, ``name``, ``owner``, ``fence``...):
#: ``limit_key``, ``limit``, ``slot`` (0-based index); ``concurrency_limited``'s ``key`` is
#: the limit key. This one: a slot was granted.
slot_acquired = Signal(name="slot_acquired")
#: A slot was given back by its holder.
slot_released = Signal(name="slot_released")
#: A slot was found expired or taken over (its holder stopped or died).
slot_expired = Signal(name="slot_expired")
#: Every slot was held: the execution was refused for now.
concurrency_limited = Signal(name="concurrency_limited")

ALL_SIGNALS += (slot_acquired, slot_released, slot_expired, concurrency_limited)

#: A cluster-wide rate limit admitted an execution (``key``, ``name``, ``limit``,
#: ``remaining``, ``granted_at``: the Redis time of the grant, seconds since the epoch).
rate_limit_allowed = Signal(name="rate_limit_allowed")
#: A cluster-wide rate limit refused an execution for now (``key``, ``name``, ``limit``,
#: ``retry_after`` seconds, ``ticket``: its place in the queue or None, ``queued``).
rate_limited = Signal(name="rate_limited")

ALL_SIGNALS += (rate_limit_allowed, rate_limited)

#: The overlap guard of periodic runs (a task's ``overlap`` option, ``steplock_overlap``):
#: ``policy`` ("skip" or "coalesce"), ``holder`` (task id of the run holding the lease, None
#: when unknown), ``follower`` (task id of the send that runs next, None: none). This one: a
#: send found the lease held and ended with the "skipped" outcome (``reason``: "held" under
#: skip; "follower" under coalesce, another send being the follower already).
overlap_skipped = Signal(name="overlap_skipped")
#: Under coalesce, a send found the lease held and became the one follower (``follower``:
#: its task id; ``countdown``: seconds until its retry): it runs once the lease is free.
overlap_coalesced = Signal(name="overlap_coalesced")

ALL_SIGNALS += (overlap_skipped, overlap_coalesced)

#: The effects outbox (celery_steplock.contrib.django.outbox): ``key`` (the effect's
#: deterministic key, given to its receiver), ``kind`` ("task", "http", "email", "call"),
#: ``target``, ``step``, ``attempts`` (dispatch attempts so far, this one included),
#: ``error`` (``"<type>: <message>"``, None on success), ``effect_id``, ``using`` (the
#: database alias). This one: the receiver accepted it (``outcome``: what it answered), sent
#: by the relay or the committing process, after its row was marked.
effect_dispatched = Signal(name="effect_dispatched")
#: A dispatch failed with a retryable error: the effect waits until its next attempt
#: (``countdown``: seconds, from the retry policy's backoff; ``next_attempt_at``).
effect_retry = Signal(name="effect_retry")
#: The effect will not be dispatched again without an operator (``reason``: "permanent" for a
#: refusal that asking again would not change, "max_attempts" when its attempts ran out).
effect_dead = Signal(name="effect_dead")

ALL_SIGNALS += (effect_dispatched, effect_retry, effect_dead)
