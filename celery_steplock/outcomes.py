"""Terminal outcomes of a step task that did not do its step, and the same-id rule.

A duplicate that finds its step already past ``from_`` (the precheck, or a compare-and-swap
refused because the status moved on) does not do the step again. By default
(``on_conflict="return"``) it ends *successfully* with a small value that says so, so every
task id a caller holds reaches a terminal state: ``group()`` and ``chord()`` over duplicates
complete, a chain re-sent after it completed runs on, Flower shows the message done. The
same for ``on_contended="skip"``: the lease was busy, the task returns a "skipped" outcome.

The value is :meth:`StepOutcome.to_dict`, plain JSON (every serializer Celery offers can carry
it)::

    {"steplock": "duplicate",        # or "skipped"
     "task": "shop.charge",          # the task's name
     "step_id": 42,                  # the step_id_arg's value (str unless int/float/str/bool)
     "expected": "pending",          # from_ of the task's transition (None: no transition)
     "found": "charged",             # the status the step had (None for "skipped")
     "committed_by": "7c1e...",      # task id of the execution that wrote the step, if known
     "held_by": None}                # "skipped": task id of the lease's holder, if known

``committed_by`` comes from the step row's owner column (``lock_owner``): the owner token
of a task's execution carries its task id (24 random hex digits, ``":"``, the task id:
:func:`~celery_steplock.lease.new_owner_token`, :func:`~celery_steplock.lease.owner_task_id`).
A token without it (a task id over 39 characters or not visible ASCII, or a row written by
an earlier version, whose tokens carried only a digest of the task id) leaves it None
unless the event log is on (``steplock_event_log``: the ``transition_applied`` event of the
row's owner token names it). A same-id duplicate that stores its outcome (see below) names
its own id. :func:`is_outcome` and :meth:`StepOutcome.from_dict` read it back.

**The winner's result.** With ``on_conflict="return_winner"`` (task option, or the
``steplock_on_conflict`` setting) a duplicate returns the *winner's* stored result instead,
as celery-singleton's callers expect: ``AsyncResult.get()`` gives the winner's value and a
``chain()`` passes it on (:func:`winner_result`). It reads the result backend for the task
id ``committed_by`` names, when the step is in this task's own ``to`` status; a result not
stored yet (the winner commits before Celery stores its return value) is read again for up
to :data:`STORE_WAIT` seconds. It falls back to the outcome dict when there is no such
result: the winner unknown (``committed_by`` None), the disabled or the RPC backend, a
winner with ``ignore_result``, a result expired or not stored within :data:`STORE_WAIT`, a
stored ``FAILURE`` or ``REVOKED``, the step found in another status than ``to`` (another
task moved it), a ``result_extended`` state naming another task. The value
is the one the backend decodes (its ``result_serializer``: a JSON backend gives lists for
tuples), stored again as this task's result. The same-id rule comes first: a delivery of
the winner's own id still ends in ``Ignore``.

**Same task id.** A redelivery of the winner's own message (visibility timeout, a lease
retry, a re-sent message with the same ``task_id``) shares the winner's task id: the winner's
result is that id's terminal state, so that delivery ends in Celery's ``Ignore`` (nothing
stored) instead. It is recognised by the step row's owner column (owner tokens carry their
task id, or a digest of it, :func:`~celery_steplock.lease.owner_has_task_id`), by the
lease's holder (a contended delivery whose holder has its id is retried with the header
:data:`SAME_ID_HEADER`), and by the result backend already holding a ready state for the id.
When the row says the same id committed but the backend holds no result yet (the winner
released its lease and is about to store, or it was killed after its commit), the delivery
waits up to :data:`STORE_WAIT` seconds for that result: stored, it ends in ``Ignore``; still
missing, the winner is taken for dead and the delivery stores its outcome (``committed_by``
is then its own id), so the id still ends. With ``task_track_started`` every delivery of a
step task reads its id's stored state before Celery overwrites it with ``STARTED`` (one
result-backend read) and puts it back when it ends in ``Ignore``.

**Overlap guard.** A task's ``overlap`` option (``steplock_overlap``) makes periodic sends
of it never run at once, whichever scheduler (or how many) sent them: the guard is the run's
lease. ``"skip"``: a send finding the lease held ends with the "skipped" outcome
(``overlap_skipped``). ``"queue"``: it waits its turn (``on_contended="retry"``).
``"coalesce"``: at most one more run after the current one. A send finding the lease held
tries to become *the* follower: :data:`~celery_steplock._redis.scripts.overlap.CLAIM_FOLLOWER`
sets the marker ``<prefix>:overlap:{<lock name>}`` to its task id unless another send holds
it (``overlap_coalesced``); the follower is retried (:meth:`StepLockedTask.steplock_retry
<celery_steplock.task.StepLockedTask.steplock_retry>`, header :data:`FOLLOWER_HEADER`, its
countdown capped by the lease TTL) and refreshes the marker at each retry, until it holds
the lease: then it deletes its own marker (compare-and-delete) and runs. Any other send ends
"skipped" (``overlap_skipped``, ``reason="follower"``). The marker lives the follower's
countdown plus one lease TTL past each refresh, so a follower that died frees it then.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from celery import states
from celery.signals import task_prerun

from . import calls, signals
from ._jitter import backoff_ceiling, full_jitter
from ._redis.scripts.overlap import CLAIM_FOLLOWER, CLEAR_FOLLOWER
from ._redis.wire import Script
from .events import emit, lease_fields, log_event
from .exceptions import LockContended, LockStoreUnavailable
from .lease import _DIGEST_TOKEN, owner_has_task_id, owner_task_id
from .plan import is_step_locked

__all__ = [
    "StepOutcome",
    "DUPLICATE",
    "SKIPPED",
    "is_outcome",
    "SAME_ID_HEADER",
    "STORE_WAIT",
    "conflict_outcome",
    "RETURN_WINNER",
    "winner_result",
    "outcome_kind",
    "contended_outcome",
    "stored_state",
    "restore_stored_state",
    "FOLLOWER_HEADER",
    "overlap_key",
    "claim_follower",
    "clear_follower",
    "lease_retries",
    "overlap_contended",
    "follower_acquired",
]


#: ``kind`` of a duplicate that found its step already past ``from_``.
DUPLICATE = "duplicate"
#: ``kind`` of a task that found the lease busy under ``on_contended="skip"``.
SKIPPED = "skipped"

#: Message header of a lease retry whose lease was held by a delivery of its own task id.
SAME_ID_HEADER = "steplock_same_id"

#: Seconds a same-id duplicate waits for the winner's stored result (reads after 0, 0.05,
#: 0.15, 0.35, 0.75 and 1.55 s) before it takes the winner for dead and stores its outcome;
#: under ``on_conflict="return_winner"``, what a duplicate waits for the winner's result at
#: most before it returns its outcome dict instead.
STORE_WAIT = 1.55

#: The ``on_conflict`` policy that returns the winner's stored result (:func:`winner_result`).
RETURN_WINNER = "return_winner"

_KEYS = ("steplock", "task", "step_id", "expected", "found", "committed_by", "held_by")


def _plain(value: Any) -> Any:
    """``value`` if JSON carries it as itself, else its ``str`` (a UUID, a Decimal)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


@dataclass(frozen=True)
class StepOutcome:
    """What a step task that did not do its step returns (see the module docstring).

    ``kind``: :data:`DUPLICATE` or :data:`SKIPPED`. ``task``: the task's name. ``step_id``,
    ``expected`` (``from_``), ``found`` (the status read), ``committed_by`` and ``held_by``
    (task ids): each None when unknown or not applicable.
    """

    kind: str
    task: str
    step_id: Any = None
    expected: str | None = None
    found: str | None = None
    committed_by: str | None = None
    held_by: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The task's return value: a dict of the seven keys, JSON-serialisable."""
        return {
            "steplock": self.kind,
            "task": self.task,
            "step_id": _plain(self.step_id),
            "expected": self.expected,
            "found": self.found,
            "committed_by": self.committed_by,
            "held_by": self.held_by,
        }

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> StepOutcome:
        """The outcome from a stored result; raises ValueError when ``value`` is not one."""
        if not is_outcome(value):
            raise ValueError(f"not a celery-steplock outcome: {value!r:.200}")
        return cls(
            kind=value["steplock"],
            task=value["task"],
            step_id=value["step_id"],
            expected=value["expected"],
            found=value["found"],
            committed_by=value["committed_by"],
            held_by=value["held_by"],
        )


def is_outcome(value: Any) -> bool:
    """Whether a task result is a :class:`StepOutcome` dict (a duplicate or a skip)."""
    return (
        isinstance(value, Mapping)
        and value.get("steplock") in (DUPLICATE, SKIPPED)
        and all(k in value for k in _KEYS)
    )


# -- the result backend --------------------------------------------------------------------


def _result_backend(task) -> Any:
    """The task's result backend when it keeps results by task id (not the disabled or the
    RPC backend), else None."""
    backend = task.backend
    from celery.backends.base import DisabledBackend

    if isinstance(backend, DisabledBackend):
        return None
    try:
        from celery.backends.rpc import RPCBackend
    except ImportError:  # pragma: no cover - always there
        RPCBackend = ()  # type: ignore[assignment, misc]
    if isinstance(backend, RPCBackend):
        return None  # results are messages to the caller: nothing to read back
    return backend


def _readable_backend(task) -> Any:
    """The task's result backend when it keeps results by task id and this execution stores
    one (not eager, not ignore_result, not the disabled or the RPC backend), else None."""
    request = task.request
    if request.is_eager or request.called_directly:
        return None
    ignore = request.ignore_result if request.ignore_result is not None else task.ignore_result
    if ignore:
        return None
    return _result_backend(task)


def stored_state(task) -> dict[str, Any] | None:
    """The ready (SUCCESS, FAILURE, REVOKED) state the result backend holds for the running
    request's task id, as ``backend.get_task_meta`` gives it, else None (also when the
    backend cannot be read: a read error is logged, never raised)."""
    backend = _readable_backend(task)
    if backend is None:
        return None
    try:
        return _ready_meta(task, backend, task.request.id)
    except _BackendUnreadable:  # an unreadable backend decides nothing
        return None


class _BackendUnreadable(Exception):
    """The result backend raised on a read (logged by :func:`_ready_meta`)."""


def _ready_meta(task, backend, task_id: str) -> dict[str, Any] | None:
    """The ready (SUCCESS, FAILURE, REVOKED) state ``backend`` holds for ``task_id``, as
    ``backend.get_task_meta`` gives it, else None.

    Raises:
        _BackendUnreadable: The backend raised (logged: ``result_backend_unreadable``,
            WARNING, with the running request's task id and name).
    """
    try:
        meta = backend.get_task_meta(task_id)
    except Exception as exc:  # logged here, decided by the caller
        log_event(
            "result_backend_unreadable",
            logging.WARNING,
            task_id=task.request.id,
            task_name=task.name,
            error=exc,
        )
        raise _BackendUnreadable from exc
    return meta if meta and meta.get("status") in states.READY_STATES else None


def _read_until_ready(read: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
    """``read()`` until it returns a state, for :data:`STORE_WAIT` seconds at most (reads
    after 0, 0.05, 0.15, 0.35, 0.75 and 1.55 s: the pause doubles, the last one cut to the
    deadline); the last read's value (None when none was ready)."""
    deadline = time.monotonic() + STORE_WAIT
    pause = 0.05
    while True:
        meta = read()
        remaining = deadline - time.monotonic()
        if meta is not None or remaining <= 0:
            return meta
        time.sleep(min(pause, remaining))
        pause *= 2


def _wait_for_stored_state(task) -> dict[str, Any] | None:
    if _readable_backend(task) is None:
        return None
    return _read_until_ready(lambda: stored_state(task))


def _header(request, name: str) -> Any:
    return getattr(request, name, None) or (request.headers or {}).get(name)


@task_prerun.connect(weak=False, dispatch_uid="celery_steplock.outcomes.remember")
def _remember_stored_state(sender=None, task=None, **kwargs) -> None:
    # Runs before Celery stores STARTED (task_track_started), which a backend without a
    # SUCCESS guard (django-celery-results) writes over the winner's result.
    task = task or sender
    if not getattr(task, "track_started", False):
        return
    if not is_step_locked(task):
        return
    # Every delivery, not only redeliveries and lease retries: a message re-sent by hand with
    # a finished task's id is neither. One result-backend read, with track_started only.
    request = task.request
    meta = stored_state(task)
    if meta is not None and meta.get("status") == states.SUCCESS:
        request.steplock_stored_state = meta


def restore_stored_state(task) -> bool:
    """Put back the SUCCESS state this delivery's ``STARTED`` overwrote (see
    :func:`_remember_stored_state`); True when it did."""
    request = task.request
    meta = getattr(request, "steplock_stored_state", None)
    if meta is None:
        return False
    backend = _readable_backend(task)
    if backend is None:
        return False
    try:
        current = backend.get_task_meta(request.id, cache=False)
        if current.get("status") in states.READY_STATES:
            return False  # the backend kept it (a SUCCESS guard) or the winner stored anew
        backend.store_result(request.id, meta.get("result"), states.SUCCESS, request=request)
    except Exception as exc:  # noqa: BLE001 - the outcome is Ignore either way
        log_event(
            "result_restore_failed",
            logging.WARNING,
            task_id=request.id,
            task_name=task.name,
            error=exc,
        )
        return False
    return True


# -- deciding ------------------------------------------------------------------------------


def _writer(task, steps, step_id) -> dict[str, Any]:
    """``{"owner", "fence", "task_id"}`` of the step row's last writer, each None when the
    store cannot tell (a store without ``writer()``, a model without the columns)."""
    writer = getattr(steps, "writer", None) if steps is not None else None
    if writer is None or step_id is None:
        return {}
    try:
        return writer(step_id, event_log=task.steplock_settings.event_log) or {}
    except Exception as exc:  # noqa: BLE001 - who committed is information, not a decision
        log_event(
            "step_writer_unreadable",
            logging.WARNING,
            task_id=task.request.id,
            task_name=task.name,
            error=exc,
        )
        return {}


def conflict_outcome(task, exc, steps=None) -> dict[str, Any] | None:
    """The return value of a duplicate whose step is already past ``from_`` (``exc``, a
    TransitionConflict), or None when the delivery must end in ``Ignore`` because its task
    id's result is, or is about to be, another execution's (the same-id rule)."""
    request = task.request
    writer = _writer(task, steps, exc.step_id)
    if writer.get("owner"):  # the row's own word is better than the lease's of a retry ago
        same_id = owner_has_task_id(writer["owner"], request.id)
    else:
        same_id = bool(_header(request, SAME_ID_HEADER))
    if (
        getattr(request, "steplock_stored_state", None) is not None
        or stored_state(task) is not None
    ):
        return None  # a result is stored for this id (before our STARTED overwrote it)
    if same_id:
        if _readable_backend(task) is None:
            return None  # nothing is stored for this id: nothing to end either
        if _wait_for_stored_state(task) is not None:
            return None
        log_event(
            "winner_result_missing",
            logging.WARNING,
            task_id=request.id,
            task_name=task.name,
            waited=round(STORE_WAIT, 2),
        )
    if same_id:
        committed_by = request.id
    else:  # the row's owner token carries it (None for older tokens): else the event log's
        committed_by = owner_task_id(writer.get("owner")) or writer.get("task_id")
    return StepOutcome(
        DUPLICATE,
        task.name,
        step_id=exc.step_id,
        expected=exc.from_,
        found=exc.current,
        committed_by=committed_by,
    ).to_dict()


def _winner_meta(task, backend, task_id: str) -> dict[str, Any] | None:
    """The ready state ``backend`` holds for ``task_id``, read again until it is ready or
    :data:`STORE_WAIT` has passed (the winner commits before it stores); None when none is
    ready then, or the backend cannot be read (logged, never raised)."""
    try:
        return _read_until_ready(lambda: _ready_meta(task, backend, task_id))
    except _BackendUnreadable:  # an unreadable backend: the outcome dict
        return None


def winner_result(task, exc, outcome: dict[str, Any]) -> Any:
    """What a duplicate returns under ``on_conflict="return_winner"``: the result the
    result backend stores for the winner (``outcome["committed_by"]``), else ``outcome``.

    Args:
        task: The duplicate (a bound step task, its request pushed).
        exc: Its TransitionConflict (``to``: the status the task would have written;
            ``current``: the status found).
        outcome: What :func:`conflict_outcome` returned (not None: the same-id rule's
            ``Ignore`` comes first).

    Returns:
        The winner's return value, as the backend decodes it, when the winner's task id is
        known and is not this one, the step is in the task's own ``to`` status (the last
        writer did this step, not a later one), the backend keeps results by task id (not
        the disabled or the RPC backend) and holds a ``SUCCESS`` for that id, of a task of
        this name, within :data:`STORE_WAIT` seconds. The name is read from the stored
        state, so the winner's result is returned only with Celery's ``result_extended``
        on (without it the state names no task, and another task that wrote the same
        transition would hand over its own result: the check
        ``celery_steplock.W012`` warns). Else ``outcome``, the "duplicate" dict: a winner
        with ``ignore_result``, a result expired or never stored, a stored state that
        names no task or another one, a winner whose stored state is a ``FAILURE`` or
        ``REVOKED``, a backend that cannot be read (``result_backend_unreadable``,
        WARNING), or a ``committed_by`` unknown (an owner token without its task id and
        the event log off). A missing result costs the duplicate up to
        :data:`STORE_WAIT` seconds of reads; a stored one, one read.

    Trust: the winner's task id is read from the step row's owner column
    (``lock_owner``), which the library writes with a token of
    :func:`~celery_steplock.lease.new_owner_token`; a row written by another writer (SQL,
    a migration, ``lock(owner=...)`` with a caller-chosen owner of the carrying form) can
    name any task id. The name check bounds that to the results of tasks of this name;
    whoever can write the step table is trusted with the rest.
    """
    winner = outcome.get("committed_by")
    if not winner or winner == task.request.id:
        return outcome  # unknown, or this id's own (the same-id rule's last resort)
    if exc.to is None or exc.current != exc.to:
        return outcome  # another task moved the step on: its result is not this task's
    backend = _result_backend(task)
    if backend is None:
        return outcome
    meta = _winner_meta(task, backend, winner)
    if meta is None or meta.get("status") != states.SUCCESS:
        return outcome
    name = meta.get("name") or meta.get("task_name")  # result_extended: Redis, django-db
    if name != task.name:
        return outcome  # another task's result, or a result that names no task
    task.request.steplock_outcome = DUPLICATE
    return meta.get("result")


def outcome_kind(task, result: Any) -> str | None:
    """:data:`DUPLICATE` or :data:`SKIPPED` when ``result``, the task's return value, is a
    :class:`StepOutcome` dict or the winner's result a duplicate returned
    (:func:`winner_result`); else None (the body's own result)."""
    if is_outcome(result):
        return result["steplock"]
    return getattr(task.request, "steplock_outcome", None)


def holder_has_task_id(exc, task_id: str | None) -> bool:
    """Whether the holder of a busy lease (``exc``, a LockContended) is a delivery of
    ``task_id``.

    Decided by the holder's owner token (``exc.holder``,
    :func:`~celery_steplock.lease.owner_has_task_id`) when it is one of
    :func:`~celery_steplock.lease.new_owner_token`'s forms (the task id carried, or its
    digest): the holder's metadata (``exc.holder_task_id``) is display text, its control
    characters escaped and a task id over 255 characters cut
    (:func:`~celery_steplock.lock.bounded_text`), so two ids can read alike there and one
    id can differ from its own. The metadata's task id, compared exactly, decides only
    when no such token is known (no holder read, or a caller-chosen owner)."""
    if not task_id:
        return False
    holder = exc.holder
    if holder and (owner_task_id(holder) is not None or _DIGEST_TOKEN.fullmatch(holder)):
        return owner_has_task_id(holder, task_id)
    return bool(exc.holder_task_id) and exc.holder_task_id == task_id


def contended_outcome(task, exc, step_id=None, expected=None) -> dict[str, Any] | None:
    """The return value of ``on_contended="skip"`` for ``exc`` (LockContended), or None
    when the lease's holder is a delivery of this very task id (it owns the outcome:
    :func:`holder_has_task_id`)."""
    holder = exc.holder_task_id
    if holder_has_task_id(exc, task.request.id):
        return None
    return StepOutcome(
        SKIPPED, task.name, step_id=step_id, expected=expected, held_by=holder or None
    ).to_dict()


# -- the overlap guard ---------------------------------------------------------------------

#: Message header of a coalesce follower's retries (it holds the follower marker).
FOLLOWER_HEADER = "steplock_overlap_follower"

_claim = Script(CLAIM_FOLLOWER)
_clear = Script(CLEAR_FOLLOWER)


def overlap_key(prefix: str, name: str) -> str:
    """The follower marker of lock name ``name``: ``<prefix>:overlap:{<name>}`` (the
    lease's hash slot)."""
    return f"{prefix}:overlap:{{{name}}}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _claim_steps(key: str, task_id: str, ttl_ms: int, name: str) -> calls.Steps[Any]:
    reply = yield calls.Eval(
        _claim, [key], [task_id, str(ttl_ms)], "overlap follower claim", name=name
    )
    return int(reply[0]), (_text(reply[1]) or None)


def _clear_steps(key: str, task_id: str, name: str) -> calls.Steps[bool]:
    reply = yield calls.Eval(_clear, [key], [task_id], "overlap follower clear", name=name)
    return bool(int(reply))


def claim_follower(store: Any, name: str, task_id: str, ttl: float) -> tuple[int, str | None]:
    """Try to make ``task_id`` the follower of lock name ``name``, in one round trip.

    Args:
        store: The lease store (a :class:`~celery_steplock.lock.RedisLeaseStore`: its
            ``client`` and ``prefix``).
        name: The lock name.
        task_id: The send's task id.
        ttl: Seconds the marker lives (from now; at least 1 ms).

    Returns:
        ``(1, None)`` it became the follower, ``(2, task_id)`` it already was (the marker's
        TTL refreshed), ``(0, other)`` the task id ``other`` is the follower.

    Raises:
        LockStoreUnavailable, LockStoreMisconfigured: Redis did not answer or refused.
    """
    key = overlap_key(store.prefix, name)
    return calls.run(_claim_steps(key, task_id, max(1, int(ttl * 1000)), name), store.client)


def clear_follower(store: Any, name: str, task_id: str) -> bool:
    """Delete the follower marker of ``name`` if ``task_id`` holds it (compare-and-delete);
    True when it did. Raises as :func:`claim_follower`."""
    key = overlap_key(store.prefix, name)
    return calls.run(_clear_steps(key, task_id, name), store.client)


def lease_retries(request: Any) -> int:
    """The lease retries this delivery follows (the ``steplock_retries`` message header,
    counted apart from the task's own ``retries``; 0 on a first delivery)."""
    return int(
        getattr(request, "steplock_retries", None)
        or (request.headers or {}).get("steplock_retries")
        or 0
    )


def overlap_contended(task: Any, exc: LockContended, plan: Any, execution: Any = None) -> Any:
    """What a busy lease ends in under ``overlap="skip"`` or ``"coalesce"`` (the holder is
    not a delivery of this task id: that case is the ``on_contended`` policy's): a retry as
    the follower (coalesce; ``Ignore`` raised by the retry) or the "skipped" outcome dict.
    Raises ``exc`` when a follower's retries (``lock_retry_max``) are used up (its marker
    deleted first)."""
    request = task.request
    fields = (
        execution.lease_fields()
        if execution is not None
        else lease_fields(None, request.id, task.name)
    )
    name = exc.name or fields.get("name")
    holder = exc.holder_task_id or None
    follower = None
    reason = "held"
    if plan.overlap == "coalesce" and name:
        # The follower polls at most a lease TTL apart: a run is followed within one.
        attempt = lease_retries(request)
        ceiling = backoff_ceiling(
            plan.retry_backoff, attempt, min(plan.retry_backoff_max, plan.ttl), max_exponent=32
        )
        countdown = max(0.05, full_jitter(ceiling))
        try:
            state, follower = claim_follower(plan.store, name, request.id, countdown + plan.ttl)
        except LockStoreUnavailable as error:
            log_event(
                "overlap_marker_failed",
                logging.WARNING,
                task_id=request.id,
                task_name=task.name,
                key=fields.get("key"),
                error=error,
            )
            return task.steplock_retry(exc, countdown=countdown)  # as "queue" until it answers
        if state:
            if state == 1:
                emit(
                    signals.overlap_coalesced,
                    task,
                    logging.DEBUG,  # the execution's INFO line is its execution_done (retry)
                    policy="coalesce",
                    holder=holder,
                    follower=request.id,
                    countdown=round(countdown, 3),
                    **fields,
                )
            try:
                return task.steplock_retry(exc, headers={FOLLOWER_HEADER: 1}, countdown=countdown)
            except LockContended:
                _clear_quietly(task, plan, name)
                raise
        reason = "follower"
    if execution is not None:
        execution.skip_reason = f"overlap_{reason}"
    emit(
        signals.overlap_skipped,
        task,
        logging.DEBUG,  # the execution's INFO line is its execution_done (skipped)
        policy=plan.overlap,
        holder=holder,
        follower=follower,
        reason=reason,
        **fields,
    )
    return StepOutcome(
        SKIPPED,
        task.name,
        step_id=execution.step_argument if execution is not None else None,
        expected=plan.transition[0] if plan.transition else None,
        held_by=holder,
    ).to_dict()


def _clear_quietly(task: Any, plan: Any, name: str) -> bool:
    try:
        return clear_follower(plan.store, name, task.request.id)
    except Exception as error:  # noqa: BLE001 - the marker's TTL frees it
        log_event(
            "overlap_marker_failed",
            logging.WARNING,
            task_id=task.request.id,
            task_name=task.name,
            key=overlap_key(plan.store.prefix, name),
            error=error,
        )
        return False


def follower_acquired(task: Any, plan: Any, name: str) -> None:
    """A coalesce send was granted the lease: when it is the follower (its message carries
    :data:`FOLLOWER_HEADER`), its marker is deleted (compare-and-delete, one round trip), so
    that the next send may follow this run. Never raises (the marker's TTL frees it)."""
    if _header(task.request, FOLLOWER_HEADER):
        _clear_quietly(task, plan, name)
