"""One execution of a :class:`~celery_steplock.task.StepLockedTask`, and the one table from
exception to hook.

:meth:`Execution.start` resolves, once per ``__call__``, what every step of the flow and every
hook reads: the plan, the bound arguments, the lock name, the step id, the step store bound to
its database, the owner token; the flow adds the lease, the gates entered and the phases'
timing as it goes. :data:`HOOKS` says which hook ends an execution that stopped on an
exception. The flow itself is in :mod:`celery_steplock.task` and docs/design.md ("One
execution").
"""

from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType
from typing import Any, Callable, Mapping, NamedTuple

from celery import Task

from . import signals, tracing
from .events import emit, lease_fields
from .exceptions import (
    AdmissionDenied,
    ImproperlyConfigured,
    InvalidStepId,
    LockContended,
    LockLost,
    LockStoreUnavailable,
    TransitionConflict,
)
from .keys import bind_arguments, name_from_arguments
from .lock import Lease, new_owner_token
from .patterns.gates import Entered
from .plan import ExecutionPlan
from .steps import StepStore, TransitionResult
from .tracing import Phase

__all__ = ["Execution", "Hook", "HOOKS", "hook_for", "current", "fenced_cas"]


class Hook(NamedTuple):
    """One row of :data:`HOOKS`.

    Attributes:
        method: The name of the task's method called with the exception; its return value
            is the task's.
        gates_only: Only when an admission gate raised the exception on entry: the same
            exception from the body is the body's own outcome.
    """

    method: str
    gates_only: bool = False


#: The one table from exception to hook. An execution that stops on an instance of a key
#: (the most specific class along the exception's MRO) ends with that hook. A lease-store
#: outage at acquire or at the pre-commit ownership check first asks
#: :meth:`~celery_steplock.task.StepLockedTask.handle_store_error` whether to go on without
#: the lease (fail open); once the execution stops on it, its row here retries the task.
HOOKS: Mapping[type[Exception], Hook] = MappingProxyType(
    {
        LockContended: Hook("handle_contended"),
        TransitionConflict: Hook("handle_conflict"),
        LockLost: Hook("handle_lost_lease"),
        LockStoreUnavailable: Hook("steplock_retry"),
        AdmissionDenied: Hook("handle_denied", gates_only=True),
    }
)


def hook_for(exc: BaseException, *, gate: bool = False) -> str | None:
    """The hook :data:`HOOKS` names for ``exc``.

    Args:
        exc: The exception that stopped the execution.
        gate: Whether an admission gate raised it on entry.

    Returns:
        The name of the task's method to call with ``exc``, or None when no row applies
        (the exception is then the task's outcome).
    """
    for cls in type(exc).__mro__:
        hook = HOOKS.get(cls)
        if hook is not None:
            return hook.method if gate or not hook.gates_only else None
    return None


# The execution of each task running in this context (thread / greenlet), by task name. A
# ContextVar rather than the request: a direct call shares Celery's default request across
# threads, and a nested call of the same task must restore the outer execution afterwards.
_NO_EXECUTIONS: dict[str, Execution] = {}  # never mutated: set() gets a new dict
_executions: contextvars.ContextVar[dict[str, Execution]] = contextvars.ContextVar(
    "steplock_executions", default=_NO_EXECUTIONS
)


def current(task_name: str) -> Execution | None:
    """The execution of the task named ``task_name`` running in this context, or None."""
    return _executions.get().get(task_name)


@dataclass(eq=False)
class Execution:
    """One execution of a step-locked task, from its ``__call__`` to its release.

    Created by :meth:`start`; ``with execution:`` makes it the current execution of its task
    in this context (:func:`current`, ``task.steplock_execution``).

    Attributes:
        task: The task.
        plan: Its :class:`~celery_steplock.plan.ExecutionPlan`, read once at the start.
        args: The positional arguments of the call.
        kwargs: The keyword arguments of the call.
        arguments: The arguments bound to the task's signature, defaults applied.
        name: The lock name.
        step_id: The ``step_id_arg`` argument's value when the task has a transition, else
            None.
        steps: The step store, bound to one database for the whole execution (None without
            ``step_model``).
        nested: Eager, inside the caller's transaction: the body and the compare-and-swap
            run in a savepoint of it.
        owner: The owner token the lease is asked for.
        fields: The signal payload fields known before the lease is granted (``key``,
            ``name``, ``task_id``, ``task_name``, ``ttl``).
        step: The step as the store's rows spell it (``"<label>:<key>"``), stored beside
            the lease for the reaper; None without a step id.
        lease: The lease once granted (None before, when refused, and when running fail
            open through an outage).
        running: From the precheck to the end of the outcome's hook: the window in which
            ``task.lease`` is :attr:`lease`.
        entered: The admission gates entered (None without gates or before entering them).
        wait: The phase of acquiring the lease (its ``seconds`` once ended).
        held: The phase of holding the lease, granted to released.
        body_started: The body was called: a lost connection before it (the precheck, the
            fence read, the transaction's BEGIN) wrote nothing and is retried.
        body_done: The body returned: a lost connection after it is our CAS's or COMMIT's.
        commit_cas: Set while a subclass's own ``transition()`` makes the plan's
            compare-and-swap: the first library compare-and-swap it reaches is the plan's
            and carries the deadline.
        committed: The step's transaction committed, and an on-commit callback raised:
            neither a rollback nor a broken COMMIT, nothing to redo.
        applied_to: The ``to`` of the last transition applied in the step's transaction
            (the plan's or the body's; None before one): the key of its effects
            (:mod:`celery_steplock.effects`).
        applied_step_id: The step id of that transition.
        outbox: The step transaction's :class:`~celery_steplock.effects.Outbox` (None
            before the body, and without a step store): with a lease, its on-commit sends
            wait for the release (:meth:`~celery_steplock.effects.Outbox.release_dispatch`).
        cas_seconds: Seconds the library's compare-and-swap statements of this execution
            took, summed (None before one): its ``execution_done`` line's.
        retry_countdown: Seconds until the lease retry this execution scheduled
            (:meth:`~celery_steplock.task.StepLockedTask.steplock_retry`; None: none).
        retry_reason: The type name of the exception that lease retry is for.
        skip_reason: Why the execution ended "skipped" when the outcome itself does not say
            (``overlap_held``, ``overlap_follower``: the overlap guard's), for its
            ``execution_done`` line.
    """

    task: Task[Any, Any]
    plan: ExecutionPlan
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    arguments: dict[str, Any]
    name: str
    step_id: Any
    steps: StepStore | None
    nested: bool
    owner: str
    fields: dict[str, Any]
    step: str | None = None
    lease: Lease | None = None
    running: bool = False
    entered: Entered | None = None
    wait: Phase | None = None
    held: Phase | None = None
    body_started: bool = False
    body_done: bool = False
    commit_cas: bool = False
    committed: bool = False
    applied_to: str | None = None
    applied_step_id: Any = None
    outbox: Any = None
    cas_seconds: float | None = None
    retry_countdown: float | None = None
    retry_reason: str | None = None
    skip_reason: str | None = None
    _token: contextvars.Token[dict[str, Execution]] | None = field(
        default=None, init=False, repr=False
    )

    @classmethod
    def start(
        cls,
        task: Task[Any, Any],
        plan: ExecutionPlan,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Execution:
        """Resolve what the execution of ``task`` with these arguments needs, before any
        lease is asked for.

        Args:
            task: The running task.
            plan: Its current plan.
            args: The call's positional arguments.
            kwargs: The call's keyword arguments.

        Returns:
            The execution; not yet current (``with execution:``).

        Raises:
            LockNameError: The arguments do not match the signature or cannot name a lock.
            ImproperlyConfigured: ``step_id_arg`` is not an argument of the call.
            OuterTransactionError: Called inside a caller's transaction (not eager).
            InvalidStepId: The step id is not a key the step model can have.
        """
        arguments = bind_arguments(task.run, args, kwargs)
        name = name_from_arguments(
            task.name, arguments, plan.lock_key, secret=plan.store.name_secret
        )
        step_id = None
        if plan.transition is not None:
            if plan.step_id_arg not in arguments:
                raise ImproperlyConfigured(
                    f"{task.name}: step_id_arg={plan.step_id_arg!r} is not an argument of the "
                    f"task (arguments: {', '.join(arguments)})",
                    setting="step_id_arg",
                )
            step_id = arguments[plan.step_id_arg]
        request = task.request
        steps = plan.steps
        nested = False
        if steps is not None:
            # One database for the whole execution: the router is asked once, here.
            bind = getattr(steps, "bind", None)
            steps = bind() if bind is not None else steps
            nested = bool(request.is_eager) and _in_caller_transaction(steps)
            if not nested:
                steps.check_not_nested(task.name)
        fields: dict[str, Any] = {
            "key": plan.store.key(name),
            "name": name,
            "task_id": request.id,
            "task_name": task.name,
            "ttl": plan.ttl,
        }
        step = None
        if step_id is not None and steps is not None:
            try:
                step = steps.step_ref(step_id)  # fails before the lease
            except InvalidStepId as exc:
                raise InvalidStepId(
                    f"{task.name}: {plan.step_id_arg}={step_id!r}: {exc}",
                    step_id=step_id,
                    argument=plan.step_id_arg,
                ) from exc
        return cls(
            task=task,
            plan=plan,
            args=args,
            kwargs=kwargs,
            arguments=arguments,
            name=name,
            step_id=step_id,
            steps=steps,
            nested=nested,
            owner=new_owner_token(request.id, max_length=getattr(steps, "owner_max_length", None)),
            fields=fields,
            step=step,
        )

    @property
    def running_lease(self) -> Lease | None:
        """:attr:`lease` while the execution runs (see :attr:`running`), else None."""
        return self.lease if self.running else None

    @property
    def step_argument(self) -> Any:
        """The ``step_id_arg`` argument's value, with or without a transition (None without
        the option): the step id an outcome reports."""
        return self.arguments.get(self.plan.step_id_arg) if self.plan.step_id_arg else None

    def lease_fields(self) -> dict[str, Any]:
        """The signal payload fields of :attr:`lease`, or, without one, :attr:`fields` with
        no owner and no fence."""
        if self.lease is None:
            return {"owner": None, "fence": None, **self.fields}
        return lease_fields(self.lease)

    def __enter__(self) -> Execution:
        self._token = _executions.set({**_executions.get(), self.task.name: self})
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._token is not None:
            _executions.reset(self._token)
            self._token = None


def _in_caller_transaction(steps: StepStore) -> bool:
    """Whether the step store's database is inside a caller's transaction that an eager
    execution may join as a savepoint (the store's optional ``in_outer_transaction()``; a
    store without it or without ``savepoint()`` keeps refusing)."""
    probe = getattr(steps, "in_outer_transaction", None)
    return callable(probe) and callable(getattr(steps, "savepoint", None)) and bool(probe())


def fenced_cas(
    sender: Any,
    steps: StepStore,
    step_id: Any,
    from_: str,
    to: str,
    *,
    lease: Lease | None,
    fields: dict[str, Any],
    updates: Mapping[str, Any] | None = None,
    deadline: float | None = None,
    stale: Callable[[TransitionConflict], BaseException | None] | None = None,
    level: int = logging.DEBUG,
) -> TransitionResult:
    """The fenced compare-and-swap of a step, with its signals: one path for a task's
    transitions and for a guarded transition outside Celery.

    ``transition_conflict`` is sent when the step left ``from_``; ``transition_applied`` once
    the transaction commits. A refusal by the fence alone (the status matched, a newer
    fencing token is on the row) loses the lease, as in Kleppmann 2016.

    Args:
        sender: The signals' sender (the task, or the guarded step).
        steps: The step store.
        step_id: The step.
        from_: The status the step must still have.
        to: The status to write.
        lease: The lease held (None: a fail-open execution, no guard columns written).
        fields: The lease fields of the signals.
        updates: Extra column values of the same statement.
        deadline: Seconds the transaction may live from the statement to COMMIT (None:
            none set here).
        stale: Called on a refusal by the fence, before ``transition_conflict`` is sent:
            the exception to raise instead of the plain :class:`LockLost`, or None.
        level: The logging level of the two lines: DEBUG for a task (its INFO line is its
            ``execution_done``), INFO for a guarded block (it has no other).

    Returns:
        The applied transition.

    Raises:
        TransitionConflict: The step left ``from_``.
        LockLost: The row carries a newer fencing token (or what ``stale`` returned).
        LockContended: The row stayed locked by another transaction for the lease's
            remaining validity (the deadline's lock timeout, PostgreSQL), or past the
            database's own lock wait bound (MySQL's ``innodb_lock_wait_timeout``).
    """
    try:
        with tracing.phase("cas") as cas:
            result = steps.transition(
                step_id,
                from_,
                to,
                owner=lease.owner if lease else None,
                fence=lease.fence if lease else None,
                updates=updates,
                deadline=deadline,
            )
    except TransitionConflict as exc:
        instead = stale(exc) if lease is not None and exc.stale_fence and stale else None
        emit(
            signals.transition_conflict,
            sender,
            level,
            step_id=step_id,
            from_=from_,
            to=to,
            current=exc.current,
            **fields,
        )
        if lease is not None and exc.stale_fence:
            lease.mark_lost(f"the step row carries a newer fencing token than {lease.fence}")
            if instead is not None:
                raise instead from exc
            raise LockLost(
                f"{exc} (fence {lease.fence})",
                key=lease.key,
                name=lease.name,
                owner=lease.owner,
                fence=lease.fence,
            ) from exc
        raise
    except Exception as exc:
        if lease is None or not steps.is_lock_timeout(exc):
            raise
        # Another transaction (e.g. a stopped holder's) kept the row: contention, back off.
        raise LockContended(
            f"step {step_id!r}: its row stayed locked by another transaction for as long as "
            f"the wait for a row lock may last (on PostgreSQL, the lease's remaining validity)",
            key=lease.key,
            holder=None,
            name=lease.name,
        ) from exc
    tracing.after_commit(
        steps,
        lambda: emit(
            signals.transition_applied,
            sender,
            level,
            step_id=step_id,
            from_=from_,
            to=to,
            cas_seconds=cas.seconds,
            commit_seconds=tracing.commit_seconds(),
            **fields,
        ),
    )
    return result
