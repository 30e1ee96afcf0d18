"""StepLockedTask: a Celery task that holds a lease on its step while it runs.

One execution, in :meth:`StepLockedTask.__call__` (``on_success``/``after_return`` run too late
or not at all on retry, so the lease lives in ``__call__`` with try/finally)::

    name  = lock name (keys.py)              # from the signature or lock_key
    lease = acquire(name, new owner, ttl)     # fencing token; contended -> on_contended
    heartbeat.register(lease)                 # renewed every ttl/3 by the process's thread
    precheck: step still in from_?           # else conflict, the body never runs
    with transaction.atomic():                # when a step model is set (Django)
        body                                  # self.lease, self.transition(...)
        CAS from_ -> to (+ fence guard)       # 0 rows -> TransitionConflict, rollback
        declared effects written              # celery_steplock.effects
        ownership check in Redis              # lost -> LockLost, rollback
    # a deadlock / serialization failure in it: rolled back, the step read again:
    # moved on -> TransitionConflict (duplicate), else LockContended (lease retry)
    # committed
    heartbeat.unregister(lease); release      # commit first, release after; in a worker
                                              # not waited for (steplock_release_wait):
                                              # 2 blocking round trips a task, not 3
    declared effects sent                     # after the release (without a lease, or
                                              # in a caller's transaction: at its COMMIT)

Nothing in this order can commit twice: a duplicate that slips past the lease (pause,
failover, expiry) finds the step no longer in ``from_`` and its CAS updates no row. Every step
and hook reads one :class:`~celery_steplock.execution.Execution` (``self.steplock_execution``);
which exception ends in which hook is one table, :data:`celery_steplock.execution.HOOKS`.

Task options (class attributes, or keywords of ``@app.task``); None means the setting's
default from :mod:`celery_steplock.conf`:

``lock_key``        str.format template over argument names, or a callable; default: task
                    name + HMAC-SHA256 of the bound arguments, keyed with the name secret
``lock_ttl``        lease TTL, seconds (``steplock_default_ttl``, 30)
``lock_wait``       seconds to wait for a busy lease (``steplock_lock_wait``, 0)
``lock_max_hold``   seconds after which renewal stops and the lease is lost (None: no cap)
``on_contended``    "retry" (Celery retry with a full-jitter countdown; no RETRY state is
                    stored, so a same-id duplicate never overwrites the winner's result),
                    "skip" (succeeds with a "skipped" outcome, :mod:`celery_steplock.outcomes`;
                    ``Ignore`` when the holder has this task id), "ignore" (Celery ``Ignore``:
                    no state update) or "raise" (LockContended)
``overlap``         periodic runs that never overlap (``steplock_overlap``, default None:
                    off): "skip" (a send finding the lease held ends "skipped"),
                    "coalesce" (at most one more run after the current one) or "queue"
                    (waits its turn); see :mod:`celery_steplock.outcomes`
``on_conflict``     "return" (default: succeeds with a "duplicate" outcome, so every task id
                    ends; a delivery of the winner's own task id ends in ``Ignore`` and never
                    replaces the winner's result, see :mod:`celery_steplock.outcomes`),
                    "return_winner" (as "return", but a duplicate returns the winner's
                    stored result when the result backend has it, so callers and
                    ``chain()`` get the winner's value; else the "duplicate" outcome),
                    "ignore" (Celery ``Ignore`` always: a loser with its own task id stores
                    nothing and stays PENDING) or "raise" (TransitionConflict, stored as
                    FAILURE)
``on_store_error``  "fail_closed" (body not run, retried) or "fail_open" (body runs unlocked;
                    the CAS still guards; ``lock_store_error`` is sent every time)
``step_model``      "app_label.Model" or model class of the step
``step_id_arg``     name of the argument holding the step's primary key
``transition``      ``(from_, to)`` applied by CAS after the body
``step_transitions`` optional ``{from_: [to, ...]}`` table of allowed transitions
``step_database``   database alias every step statement goes to (``steplock_step_database``,
                    default None: the step model's write database, ``router.db_for_write``)
``lock_precheck``   skip the body when the step already left ``from_`` (default True)
``lock_retry_max``  how many times a busy lease, an outage or a lost lease is retried
                    (``steplock_retry_max``, default None: until it clears; these retries
                    are counted apart from the task's own ``max_retries``)
``circuit_breaker`` a dependency name or a CircuitBreaker: the shared circuit breaker
                    the body's calls pass (:mod:`celery_steplock.patterns.breaker`)
``retry_policy``    a RetryPolicy retrying what the execution raised, through Celery's
                    ``retry`` (:mod:`celery_steplock.patterns.retry`)
"""

from __future__ import annotations

import contextvars
import logging
import sys
import time
import types
import warnings
from typing import TYPE_CHECKING, Any, Callable, NoReturn

from celery import Task
from celery.exceptions import Ignore, Retry
from celery.result import EagerResult
from celery.signals import worker_init, worker_process_shutdown, worker_shutdown
from kombu.utils.encoding import safe_repr

from . import _django, _startup, effects, outcomes, signals, tracing
from ._jitter import backoff_ceiling, full_jitter
from .conf import Settings, configuration_version
from .events import emit, lease_fields, log_event
from .exceptions import (
    AdmissionDenied,
    FenceAhead,
    ImproperlyConfigured,
    LockContended,
    LockLost,
    LockStoreMisconfigured,
    LockStoreUnavailable,
    TransitionConflict,
)
from .execution import Execution, current, fenced_cas, hook_for
from .heartbeat import announce_lost, get_heartbeat
from .history import outcome_of
from .lock import (
    Lease,
    RedisLeaseStore,
    drain_releases,
    get_lease_store,
    holder_metadata,
    release_after_commit,
)
from .patterns import gates as admission
from .plan import ExecutionPlan, build_plan, option_values
from .steps import StepStore, TransitionResult

__all__ = ["StepLockedTask", "backoff", "FENCE_AHEAD_RETRY_MAX"]

logger = logging.getLogger("celery_steplock")

# The lease retries an eager attempt asked for (their message headers), run by apply()'s loop
# once the attempt has ended; None outside StepLockedTask.apply().
_eager_retries: contextvars.ContextVar[list[dict[str, Any]] | None] = contextvars.ContextVar(
    "steplock_eager_retries", default=None
)

if TYPE_CHECKING:
    _TaskBase = Task[Any, Any]  # generic in celery-types only
else:
    _TaskBase = Task


def _is_django_task(task: Any) -> bool:
    """Whether ``task`` is, or its app's task class is, Celery's ``DjangoTask`` (what
    ``app.Task`` is in a Django project on Celery 5.4+), without importing Django."""
    try:
        app_task = task.app.Task  # imports the app's task class (DjangoTask's module)
    except Exception:  # noqa: BLE001 - an app that cannot build its task class: no
        app_task = None
    base = getattr(sys.modules.get("celery.contrib.django.task"), "DjangoTask", None)
    if base is None:
        return False
    return isinstance(task, base) or (isinstance(app_task, type) and issubclass(app_task, base))


class _DjangoTaskMethod:
    """``delay_on_commit`` / ``apply_async_on_commit`` of Celery's ``DjangoTask``, kept by
    ``base=StepLockedTask`` when the app's task class is ``DjangoTask``; elsewhere the
    attribute does not exist (``hasattr`` is False)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, task: Any, owner: type | None = None) -> Any:
        if task is None:
            return self
        if not _is_django_task(task):
            raise AttributeError(
                f"{type(task).__name__!r} object has no attribute {self.name!r}: the Celery "
                f"app's task class is not Celery's DjangoTask (use DjangoStepLockedTask)"
            )
        return types.MethodType(getattr(_django.contrib("task"), self.name), task)


class StepLockedTask(_TaskBase):
    """A task whose body runs under an owner-keyed Redis lease; see the module docstring.

    Inside the body, ``self.lease`` is the :class:`~celery_steplock.lease.Lease` (None when
    called with fail-open during an outage) and ``self.transition(step_id, from_, to)``
    applies a compare-and-swap guarded by the lease's fencing token;
    ``self.steplock_execution`` is the running :class:`~celery_steplock.execution.Execution`.

    Hooks (public, overridable; their defaults are the string policies, and each is called
    only where the flow meets that case): :meth:`handle_contended`,
    :meth:`handle_conflict`, :meth:`handle_store_error`, :meth:`handle_lost_lease`,
    :meth:`handle_denied`, :meth:`before_commit`. Which exception ends in which hook is one
    table, :data:`celery_steplock.execution.HOOKS`.

    Raises (as the task's outcome): LockContended (on_contended="raise" or retries
    exhausted; also for a step transaction the database rolled back with a deadlock or a
    serialization failure while the step stayed in ``from_``), LockStoreUnavailable (fail-closed, retries exhausted),
    LockStoreMisconfigured (Redis refused our credentials, a permission or the TLS
    verification, or ``steplock_max_waiters`` waiters already wait: never retried, never
    run fail-open; the body does not run, or its transaction rolls back), LockLost (the lease
    was lost before the commit, or the step row carries a newer fencing token; nothing
    committed), a database connection error from COMMIT (retried first), TransitionConflict
    (on_conflict="raise"), ImproperlyConfigured and LockNameError (bad options/arguments).
    """

    lock_key: str | Callable[..., str] | None = None
    lock_ttl: float | None = None
    lock_wait: float | None = None
    lock_max_hold: float | None = None
    on_contended: str | None = None
    overlap: str | None = None  # None | "skip" | "coalesce" | "queue" (steplock_overlap)
    on_conflict: str | None = None
    on_store_error: str | None = None
    step_model: Any = None
    step_id_arg: str | None = None
    step_transition: tuple[str, str] | None = None
    step_transitions: dict[str, Any] | None = None
    step_database: str | None = None
    lock_precheck: bool | None = None
    lock_retry_max: int | None = None
    circuit_breaker: Any = (
        None  # a dependency name or a CircuitBreaker (celery_steplock.patterns.breaker)
    )
    retry_policy: Any = None  # a RetryPolicy (celery_steplock.patterns.retry), applied in __call__

    #: Expected outcomes, logged without a traceback by the worker (Celery ``Task.throws``).
    throws = (LockContended, TransitionConflict, AdmissionDenied)

    #: Celery's DjangoTask API when the app's task class is DjangoTask (a Django project on
    #: Celery 5.4+): publish once the step database's transaction commits (see
    #: :class:`~celery_steplock.contrib.django.task.DjangoStepLockedTask`).
    delay_on_commit = _DjangoTaskMethod()
    apply_async_on_commit = _DjangoTaskMethod()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # ``@app.task(transition=(from_, to))`` would shadow the transition() method: keep
        # the option under another name.
        spec = cls.__dict__.get("transition")
        if spec is not None and not callable(spec):
            # A list becomes the (from_, to) tuple; anything else stays as given, for the plan
            # to refuse by name.
            cls.step_transition = tuple(spec) if isinstance(spec, list) else spec
            delattr(cls, "transition")

    # -- the plan ----------------------------------------------------------------------------

    @property
    def steplock_plan(self) -> ExecutionPlan:
        """The :class:`~celery_steplock.plan.ExecutionPlan` of this task for its app's current
        configuration: built on first use, rebuilt after ``app.conf`` changes or an option
        of the task (or of its class) changes. Raises ImproperlyConfigured naming the task and the option
        or setting."""
        plan: ExecutionPlan | None = self.__dict__.get("_steplock_plan")
        if (
            plan is None
            or plan.version is not configuration_version(self.app)
            or plan.options != option_values(self)
        ):
            plan = build_plan(self)
            self.__dict__["_steplock_plan"] = plan
        return plan

    @property
    def steplock_execution(self) -> Execution | None:
        """The execution of this task running in this context, from its ``__call__`` to its
        release (None outside one): its plan, bound arguments, lock name, step id, step
        store, lease (:class:`~celery_steplock.execution.Execution`)."""
        return current(self.name)

    def _current_plan(self) -> ExecutionPlan:
        """The running execution's plan (checked once, at its start), else
        :attr:`steplock_plan`."""
        execution = current(self.name)
        return execution.plan if execution is not None else self.steplock_plan

    @property
    def steplock_settings(self) -> Settings:
        """The settings the current plan was built from (read afresh when the options are
        invalid)."""
        try:
            return self._current_plan().settings
        except ImproperlyConfigured:
            return Settings(self.app)

    def steplock_options(self) -> ExecutionPlan:
        """Deprecated: :attr:`steplock_plan`."""
        warnings.warn(
            "StepLockedTask.steplock_options() is deprecated; use steplock_plan",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.steplock_plan

    def steplock_guard(self) -> StepStore:
        """The step store of ``step_model`` (deprecated name; :attr:`steplock_plan`'s
        ``steps``). Raises ImproperlyConfigured when ``step_model`` is not set."""
        warnings.warn(
            "StepLockedTask.steplock_guard() is deprecated; use steplock_plan.steps",
            DeprecationWarning,
            stacklevel=2,
        )
        return self._step_store()

    def _step_store(self) -> StepStore:
        steps = self.steplock_plan.steps
        if steps is None:
            raise ImproperlyConfigured(
                f"{self.name}: step_model is not set; self.transition() needs it",
                setting="step_model",
            )
        return steps

    # -- inside the body --------------------------------------------------------------------

    @property
    def lease(self) -> Lease | None:
        """The lease of the execution running in this context (None outside one)."""
        execution = current(self.name)
        return execution.running_lease if execution is not None else None

    def transition(self, step_id: Any, from_: str, to: str, **updates: Any) -> TransitionResult:
        """Apply ``from_ -> to`` to step ``step_id`` by compare-and-swap, fenced by the
        current lease: for bodies (a multi-phase step). The plan's own transition after the
        body takes a private path, through this method only when a subclass overrides it
        (to wrap the library's compare-and-swap, as the fault suite does).

        Args:
            step_id: The step's primary key.
            from_: The status the step must still have.
            to: The status to write.
            **updates: Extra column values written by the same statement.

        Returns:
            The :class:`~celery_steplock.steps.TransitionResult`.

        Raises:
            LockLost: The lease is already lost, or the row carries a newer fencing token.
            LockContended: The row stayed locked by another transaction past the lease's
                validity.
            TransitionConflict: No row matched (the enclosing transaction then rolls back).
            InvalidTransition: ``from_ -> to`` is not in ``step_transitions``.
            StepNotFound: No such step.
        """
        execution = current(self.name)
        final = execution is not None and execution.commit_cas
        return self._cas(execution, step_id, from_, to, updates, final=final)

    def _cas(
        self,
        execution: Execution | None,
        step_id: Any,
        from_: str,
        to: str,
        updates: dict[str, Any],
        *,
        final: bool,
    ) -> TransitionResult:
        """The library's compare-and-swap, for :meth:`transition` and the plan's own
        (``final``: it carries the deadline, from the statement to COMMIT)."""
        lease = execution.running_lease if execution is not None else None
        plan = execution.plan if execution is not None else self.steplock_plan
        steps = execution.steps if execution is not None else plan.steps
        if steps is None:
            steps = self._step_store()  # raises: no step_model
        deadline = None
        if lease is not None:
            assert execution is not None  # a lease comes only from an execution
            lease.check()
            if final:
                execution.commit_cas = False
                if plan.db_deadline and not execution.nested:
                    # From here to COMMIT the transaction lives no longer than the lease may:
                    # a holder stopped after its CAS can neither commit late nor hold the row.
                    deadline = lease.remaining()
        fields = lease_fields(lease, self.request.id, self.name)

        def stale(exc: TransitionConflict) -> BaseException | None:
            # The status matched, the fence did not. A row token no further ahead of ours
            # than the time since our grant is a newer holder's (this one paused past its
            # lease, or a split brain): the fence did its job, the plain LockLost, and a
            # retry's new token passes it. One further ahead is ahead of the store's clock
            # (a failover to a node whose clock is behind): a retry would be refused again,
            # so never ignored, never retried without end: FenceAhead.
            assert lease is not None
            return self._fence_ahead(
                lease,
                steps,
                step_id,
                f"{exc} (fence {lease.fence})",
                since_grant=lease.clock() - lease.acquired_at,
            )

        started = time.monotonic()
        result = fenced_cas(
            self,
            steps,
            step_id,
            from_,
            to,
            lease=lease,
            fields=fields,
            updates=updates,
            deadline=deadline,
            stale=stale,
        )
        if execution is not None:
            # The key of the transaction's effects names its last applied transition.
            execution.applied_to, execution.applied_step_id = to, step_id
            execution.cas_seconds = (execution.cas_seconds or 0.0) + (time.monotonic() - started)
        return result

    # -- hooks ------------------------------------------------------------------------------

    def handle_contended(self, exc: LockContended) -> Any:
        """Called when the lease (or the step's row) is held by someone else; the body has
        not run. Its return value is the task's. Default: the ``on_contended`` policy:
        "retry" (:meth:`steplock_retry`), "skip" (returns a "skipped"
        :class:`~celery_steplock.outcomes.StepOutcome` dict; ``Ignore`` when the holder is
        a delivery of this task id), "ignore" (Celery ``Ignore``, no state stored) or
        "raise" ``exc``."""
        execution = current(self.name)
        plan = execution.plan if execution is not None else self.steplock_plan
        policy = plan.on_contended
        same_id = outcomes.holder_has_task_id(exc, self.request.id)
        if plan.overlap in ("skip", "coalesce") and not same_id:
            return outcomes.overlap_contended(self, exc, plan, execution)
        if policy == "skip":
            outcome = outcomes.contended_outcome(
                self,
                exc,
                step_id=execution.step_argument if execution is not None else None,
                expected=plan.transition[0] if plan.transition else None,
            )
            return self.steplock_ignore() if outcome is None else outcome
        if policy == "ignore":
            return self.steplock_ignore()
        if policy == "raise":
            raise exc
        try:
            # A retry that later finds the step done knows its lease was held by its own id.
            return self.steplock_retry(
                exc, headers={outcomes.SAME_ID_HEADER: 1} if same_id else None
            )
        except LockContended:
            if outcomes.holder_has_task_id(exc, self.request.id):
                # Retries exhausted while another delivery of this very task id holds the
                # lease: that delivery owns the outcome; storing FAILURE would overwrite it.
                return self.steplock_ignore()
            raise

    def handle_conflict(self, exc: TransitionConflict) -> Any:
        """Called when the step already left ``from_`` (precheck or CAS); nothing committed.
        Default: the ``on_conflict`` policy: "return" (the task succeeds with a "duplicate"
        :class:`~celery_steplock.outcomes.StepOutcome` dict, or ends in ``Ignore`` when its
        task id's result is another execution's: the same-id rule of
        :mod:`celery_steplock.outcomes`), "return_winner" (as "return", but the winner's
        stored result when the result backend has it:
        :func:`~celery_steplock.outcomes.winner_result`), "ignore" (Celery ``Ignore``
        always: nothing stored) or "raise" ``exc`` (stored as FAILURE)."""
        execution = current(self.name)
        plan = execution.plan if execution is not None else self.steplock_plan
        if plan.on_conflict == "ignore":
            return self.steplock_ignore()
        if plan.on_conflict == "raise":
            raise exc
        steps = execution.steps if execution is not None else plan.steps
        outcome = outcomes.conflict_outcome(self, exc, steps)
        if outcome is None:
            return self.steplock_ignore()
        if plan.on_conflict == outcomes.RETURN_WINNER:
            return outcomes.winner_result(self, exc, outcome)
        return outcome

    def handle_store_error(self, exc: LockStoreUnavailable, lease: Lease | None) -> None:
        """Called when Redis does not answer at acquire (``lease`` None) or at the
        pre-commit ownership check. Return to go on without the lease's protection (fail
        open: the compare-and-swap still guards), raise to stop (fail closed: the task is
        retried when ``exc`` is raised). Default: the ``on_store_error`` policy."""
        if self._current_plan().on_store_error != "fail_open":
            raise exc

    def handle_lost_lease(self, exc: LockLost) -> Any:
        """Called when the lease was lost before the commit; nothing committed. Default:
        retried when ``on_contended`` is "retry", else ``exc`` is raised. A
        :class:`~celery_steplock.exceptions.FenceAhead` is retried after its skew at most
        :data:`FENCE_AHEAD_RETRY_MAX` times, and not at all when the skew exceeds
        ``steplock_retry_backoff_max``: then ``exc`` is raised."""
        plan = self._current_plan()
        if plan.on_contended != "retry":
            raise exc
        if not isinstance(exc, FenceAhead):
            return self.steplock_retry(exc)
        attempt = self._fence_ahead_attempts()
        if attempt >= FENCE_AHEAD_RETRY_MAX or (
            exc.skew is not None and exc.skew > plan.retry_backoff_max
        ):
            raise exc
        # Fences follow the store's clock: after the skew it grants one past the row's.
        wait = backoff(plan.retry_backoff, attempt, plan.retry_backoff_max)
        return self.steplock_retry(
            exc, headers={FENCE_AHEAD_HEADER: attempt + 1}, countdown=(exc.skew or 0.0) + wait
        )

    def _fence_ahead_attempts(self) -> int:
        """The FenceAhead retries of this message so far (its FENCE_AHEAD_HEADER)."""
        request = self.request
        value = getattr(request, FENCE_AHEAD_HEADER, None) or (request.headers or {}).get(
            FENCE_AHEAD_HEADER
        )
        try:
            return max(0, int(value or 0))
        except (TypeError, ValueError):
            return 0

    def _fence_ahead(
        self,
        lease: Lease,
        steps: StepStore,
        step_id: Any,
        cause: str,
        since_grant: float | None = None,
    ) -> FenceAhead | None:
        """The FenceAhead of a row whose fencing token is ahead of ``lease``'s (its
        ``fence_ahead`` signal sent), or None when the row's token is known and not ahead,
        or (``since_grant``: seconds since the lease's acquire was sent) ahead by no more
        than that: a token granted after ours by the store's clock, a newer holder's. The
        skew is then how far the row is ahead of the store's clock now (less
        ``since_grant``), what a retry must wait out. The row's token is read with the step
        store's ``writer()`` when it has one."""
        row_fence = None
        writer = getattr(steps, "writer", None)
        if writer is not None:
            try:
                value = writer(step_id).get("fence")
                row_fence = int(value) if value is not None else None
            except Exception:  # noqa: BLE001 - unread: reported without the figure
                row_fence = None
        if row_fence is not None and lease.fence is not None and row_fence <= lease.fence:
            return None
        skew = None
        if row_fence is not None and lease.fence is not None:
            skew = (row_fence - lease.fence) / 1_000_000  # fences are Redis microseconds
            if since_grant is not None:
                # how far the row is ahead of the store's clock now, not of our grant
                skew -= since_grant
                if skew <= 0:
                    return None
        if skew is None:
            ahead = "the row's fence is ahead of the granted one"
        else:
            than = "the granted one" if since_grant is None else "the lock store's clock"
            ahead = f"the row's fence {row_fence} is {skew:.3f} s ahead of {than}"
        reason = (
            f"{ahead}: the lock store's clock went back (a failover to a primary whose clock "
            f"is behind?) or another lock name writes this step"
        )
        attempt = self._fence_ahead_attempts()
        emit(
            signals.fence_ahead,
            self,
            logging.ERROR,
            step_id=step_id,
            row_fence=row_fence,
            skew=skew,
            attempt=attempt,
            reason=reason,
            **lease_fields(lease, self.request.id, self.name),
        )
        return FenceAhead(
            f"{cause}; {reason}",
            key=lease.key,
            name=lease.name,
            owner=lease.owner,
            fence=lease.fence,
            row_fence=row_fence,
            skew=skew,
            step_id=step_id,
        )

    def handle_denied(self, exc: AdmissionDenied) -> Any:
        """Called when an admission gate (a rate limit, a concurrency limit, an open circuit
        breaker: :mod:`celery_steplock.patterns.gates`) refused the execution for now; the body
        has not run and nothing is stored as the task's state. Its return value is the
        task's. Default: re-queued under the same task id with a countdown drawn uniformly
        from ``[retry_after, 2 * retry_after]`` (full jitter past the earliest moment the
        gate may admit it; at least 0.05 s), counted in the lease retries' budget
        (``lock_retry_max``); ``exc`` is raised once that is used up. The countdown is the
        denial's own (:meth:`AdmissionDenied.countdown`: a rate limit's ticket holder comes
        back at its turn) and ``exc.context["headers"]`` join the retry's message headers."""
        return self.steplock_retry(
            exc, headers=exc.context.get("headers"), countdown=exc.countdown()
        )

    def before_commit(self, lease: Lease | None, step_id: Any) -> None:
        """Called inside the transaction after the body, the compare-and-swap and the
        ownership check, just before COMMIT. Raising rolls everything back (the exception
        is the task's outcome, or a lost lease when it is LockLost). Default: nothing."""

    def _hook(self, exc: BaseException, *, gate: bool = False) -> Callable[[Any], Any] | None:
        """The hook :data:`celery_steplock.execution.HOOKS` names for ``exc`` (bound), or
        None: the one place the table is read."""
        name = hook_for(exc, gate=gate)
        if name is None:
            return None
        hook: Callable[[Any], Any] = getattr(self, name)
        return hook

    def _end(self, exc: Exception, *, gate: bool = False) -> Any:
        """End the execution stopped by ``exc`` with its hook; its return value is the
        task's."""
        hook = self._hook(exc, gate=gate)
        if hook is None:
            raise exc
        return hook(exc)

    # -- the execution ------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with tracing.execution(self):
            try:
                result = self._steplock_call(*args, **kwargs)
            except Exception as exc:
                # After the lease's release and the gates' exits (a circuit breaker has
                # recorded the failure): the retry is a new execution through every gate.
                if self.retry_policy is None or isinstance(exc, ImproperlyConfigured):
                    raise  # a bad option (retry_policy's own included) is never retried
                return self.retry_policy.retry_task(self, exc)
            kind = outcomes.outcome_kind(self, result)  # the winner's result: "duplicate"
            if kind is not None:
                tracing.outcome(kind)
            return result

    def _steplock_call(self, *args: Any, **kwargs: Any) -> Any:
        with Execution.start(self, self.steplock_plan, args, kwargs) as execution:
            try:
                result = self._acquire(execution)
            except BaseException as exc:
                self._execution_done(execution, None, exc)
                raise
            self._execution_done(execution, result, None)
            return result

    def _execution_done(
        self, execution: Execution, result: Any, exc: BaseException | None
    ) -> None:
        """The one INFO line of an execution, after its release: ``event=execution_done``
        with its ``outcome`` and durations (the lease's events are DEBUG lines).

        ``outcome`` is "committed" (the step's transition applied), "done" (the body ran, no
        transition), "duplicate" or "skipped" (:mod:`celery_steplock.outcomes`), "retry" (a
        lease retry scheduled, ``countdown`` seconds, ``reason`` the exception's type; or
        Celery's ``Retry``), "ignored" (Celery ``Ignore``: nothing stored) or "error"
        (``reason``: the exception's type, which Celery logs and stores). ``wait_seconds``,
        ``hold_seconds`` (granted to the release's write) and ``cas_seconds`` (seconds,
        rounded to microseconds in the line) are left out when the execution had none."""
        if not logger.isEnabledFor(logging.INFO):
            return
        reason = None
        countdown = execution.retry_countdown
        if exc is None:
            kind = outcomes.outcome_kind(self, result)
            if kind is not None:
                outcome = kind
                reason = execution.skip_reason if outcome == outcomes.SKIPPED else None
            else:
                outcome = "committed" if execution.applied_to is not None else "done"
        elif countdown is not None:
            outcome, reason = "retry", execution.retry_reason
        elif isinstance(exc, Retry):
            outcome, reason = "retry", type(exc.exc).__name__ if exc.exc is not None else None
        elif isinstance(exc, Ignore):
            outcome = "ignored"
        else:
            outcome, reason = "error", type(exc).__name__
        lease, wait, held = execution.lease, execution.wait, execution.held
        log_event(
            "execution_done",
            task_id=self.request.id,
            task_name=self.name,
            outcome=outcome,
            key=execution.fields.get("key"),
            fence=lease.fence if lease is not None else None,
            step_id=execution.step_id,
            wait_seconds=wait.seconds if wait is not None else None,
            hold_seconds=held.seconds if held is not None else None,
            cas_seconds=execution.cas_seconds,
            countdown=round(countdown, 3) if countdown is not None else None,
            reason=reason,
        )

    def _acquire(self, execution: Execution) -> Any:
        """Acquire the lease, then run (:meth:`_run`) and release; a busy lease or an outage
        ends in its hook."""
        plan, store, name = execution.plan, execution.plan.store, execution.name
        request = self.request
        try:
            with tracing.phase("wait", execution.fields) as execution.wait:
                lease = store.acquire(
                    name,
                    execution.owner,
                    plan.ttl,
                    wait=plan.wait,
                    metadata=holder_metadata(
                        request.id,
                        self.name,
                        request.retries,
                        worker=request.hostname,
                        step=execution.step,
                        renew_ms=plan.renew_ms,
                    ),
                )
        except LockStoreUnavailable as exc:
            try:
                self._store_error(execution, exc)
            except LockStoreUnavailable as refused:
                return self._end(refused)
            return self._run(execution)  # fail open: no lease, the CAS still guards
        except LockStoreMisconfigured as exc:
            # Not an outage: neither retried nor run fail-open; the task fails with it.
            log_event(
                "lock_store_misconfigured",
                logging.ERROR,
                task_id=request.id,
                task_name=self.name,
                key=execution.fields["key"],
                setting=exc.setting,
                error=exc,
            )
            raise
        if lease is None:
            return self._end(self._contended(execution))
        execution.lease = lease
        if plan.overlap == "coalesce":
            outcomes.follower_acquired(self, plan, name)  # clears this send's marker, if any
        heartbeat = get_heartbeat()
        held = execution.held = tracing.hold(lease)
        result: Any = None
        failed: BaseException | None = None
        try:
            # Renewed before any receiver of lock_acquired runs: one that blocks (the event
            # log's write on a locked SQLite file) must not let the lease expire before the
            # body.
            heartbeat.register(lease, store, ratio=plan.ratio, sender=self, max_hold=plan.max_hold)
            emit(
                signals.lock_acquired,
                self,
                logging.DEBUG,  # the execution's INFO line is its execution_done
                wait_seconds=execution.wait.seconds,
                **lease_fields(lease),
            )
            result = self._run(execution)
            return result
        except BaseException as exc:
            failed = exc
            raise
        finally:
            if not heartbeat.unregister(lease) and lease.lost:
                pass  # the heartbeat already reported the loss
            elif lease.lost:
                announce_lost(store, self, lease)  # WARNING after an operator's force release
            try:
                with tracing.releasing(held):
                    self._release(
                        store, lease, outcome=self._history_outcome(execution, result, failed)
                    )
            finally:
                if execution.outbox is not None:
                    execution.outbox.release_dispatch()

    def _history_outcome(
        self, execution: Execution, result: Any, failed: BaseException | None
    ) -> str | None:
        """The execution's outcome for its release's history entry
        (:func:`celery_steplock.history.outcome_of`); None, never an error, when it cannot
        be told: nothing may stop the release."""
        try:
            return outcome_of(
                execution.applied_to is not None,
                outcomes.outcome_kind(self, result) or result,
                failed,
            )
        except Exception:  # noqa: BLE001 - the release goes on without it
            return None

    def _contended(self, execution: Execution) -> LockContended:
        """The refusal of a busy lease, its holder read back (lock_contended sent)."""
        info = self._holder(execution.plan.store, execution.name)
        emit(
            signals.lock_contended,
            self,
            logging.DEBUG,  # the execution's INFO line is its execution_done
            owner=None,
            fence=None,
            holder=info.get("owner"),
            wait_seconds=execution.wait.seconds if execution.wait is not None else None,
            **execution.fields,
        )
        if info.get("owner"):
            where = ", ".join(
                f"{label} {info[field]}"
                for label, field in (("task", "task_id"), ("host", "hostname"), ("pid", "pid"))
                if info.get(field)
            )
            who = f"owner {info['owner']}" + (f" ({where})" if where else "")
        else:
            who = "another owner (released since)"
        return LockContended(
            f"{execution.name!r} is held by {who}",
            key=execution.fields["key"],
            holder=info.get("owner"),
            ttl=info.get("ttl"),
            holder_task_id=info.get("task_id"),
            name=execution.name,
        )

    def _store_error(self, execution: Execution, exc: LockStoreUnavailable) -> None:
        """Redis did not answer the lease store (at acquire, or the pre-commit ownership
        check): lock_store_error, then :meth:`handle_store_error` returns (go on) or raises
        (stop)."""
        emit(
            signals.lock_store_error,
            self,
            logging.ERROR,
            reason=str(exc),
            policy=execution.plan.on_store_error,
            **execution.lease_fields(),
        )
        self.handle_store_error(exc, execution.lease)

    def _run(self, execution: Execution) -> Any:
        """The precheck, the admission gates, the body and its commit (:meth:`_run_body`),
        the gates' exits; an exception that stops it ends in the hook the table names."""
        plan = execution.plan
        execution.running = True
        try:
            if plan.transition is not None and plan.precheck:
                self._precheck(execution, plan.transition)
            if not plan.gates:
                return self._run_body(execution)
            try:
                entered = admission.Entered.enter(
                    admission.AdmissionContext(
                        task=self,
                        plan=plan,
                        arguments=execution.arguments,
                        lease=execution.lease,
                        step_id=execution.step_id,
                    )
                )
            except admission.Replay as replay:
                return replay.result
            except AdmissionDenied as exc:
                return self._end(exc, gate=True)
            execution.entered = entered
            try:
                result = self._run_body(execution)
            except BaseException as exc:
                entered.exit(exc, None)
                raise
            entered.exit(None, result)
            return result
        except Exception as exc:
            hook = self._hook(exc)
            if hook is not None:
                return hook(exc)
            if not self._commit_failed(execution, exc):
                raise
            # The connection broke in our part of the execution (before the body: nothing
            # written; CAS, COMMIT: the commit did not happen, or it did and its reply was
            # lost), or the database ended a session whose lease ran out (the deadline):
            # the retry settles it, since its precheck or CAS sees the step as it is. The
            # body's own database errors stay the body's (Celery's autoretry_for).
            log_event(
                "commit_failed",
                logging.WARNING,
                task_id=self.request.id,
                task_name=self.name,
                step_id=execution.step_id,
                phase="commit" if execution.body_started else "before_body",
                error=exc,
            )
            reset = getattr(execution.steps, "close_if_unusable", None)
            if reset is not None:
                reset()  # an eager retry (or the thread's next task) gets a fresh connection
            return self.steplock_retry(exc)
        finally:
            execution.running = False

    def _precheck(self, execution: Execution, transition: tuple[str, str]) -> None:
        """Before the transaction: a read needs no write lock (SQLite's BEGIN IMMEDIATE
        takes it), and the CAS, not this read, is what decides. Raises TransitionConflict
        when the step already left ``from_``."""
        step_id, steps = execution.step_id, execution.steps
        assert steps is not None  # a transition needs a step model
        current_status = steps.status(step_id)
        if current_status != transition[0]:
            exc = TransitionConflict(
                f"step {step_id!r} is {current_status!r}, not {transition[0]!r}: body skipped",
                step_id=step_id,
                from_=transition[0],
                to=transition[1],
                current=current_status,
            )
            lease = execution.lease
            emit(
                signals.transition_conflict,
                self,
                logging.DEBUG,  # the execution's INFO line is its execution_done
                step_id=step_id,
                from_=exc.from_,
                to=exc.to,
                current=current_status,
                **(lease_fields(lease) if lease else {}),
            )
            raise exc
        lease = execution.lease
        if lease is not None and self._fence_ahead_attempts():
            # A retry after FenceAhead: while the row is still ahead of the new lease's
            # fence, the CAS would refuse again; the body does not run again.
            ahead = self._fence_ahead(lease, steps, step_id, f"step {step_id!r}: body skipped")
            if ahead is not None:
                lease.mark_lost(f"the step row carries a newer fencing token than {lease.fence}")
                raise ahead

    def _commit_failed(self, execution: Execution, exc: Exception) -> bool:
        """Whether ``exc`` is the step database's connection breaking in our part of the
        execution (before the body: the precheck, the fence read, BEGIN; after it: the CAS,
        COMMIT), or ending a session whose lease ran out. Celery's ``autoretry_for`` wraps
        only the body, and a failure before it would be acknowledged (``acks_late``) with
        the step never run."""
        lease = execution.lease
        return (
            execution.steps is not None
            and not execution.committed  # an on-commit callback's broken connection
            and execution.steps.is_lost_connection(exc)
            and (
                (not execution.body_started and self._connection_broke(execution))
                or execution.body_done
                or (lease is not None and (lease.lost or lease.remaining() <= 0))
            )
        )

    @staticmethod
    def _connection_broke(execution: Execution) -> bool:
        """Before the body, a lost-connection error is retried only when the step
        database's connection is really unusable (a refused statement, e.g. a missing
        table, classed with lost connections by its error type, would be retried without
        end), and never nested in a caller's transaction (the caller's to retry)."""
        if execution.nested:
            return False
        broke = getattr(execution.steps, "connection_unusable", None)
        return broke is None or bool(broke())

    def _run_body(self, execution: Execution) -> Any:
        """The body, then (with a step store) the compare-and-swap, the ownership check,
        :meth:`before_commit` and COMMIT; returns the body's result. A lease already known
        lost (the precheck or the admission gates outlasted it on a slow Redis) raises
        LockLost before the body runs: an idempotent body must not start twice at once."""
        lease, steps = execution.lease, execution.steps
        if lease is not None:
            lease.check()
        if steps is None:
            # No transaction to write effects in: declaring one raises EffectsUnavailable
            # naming the task (an outer task's outbox is hidden).
            no_steps = effects.Outbox(
                unavailable=f"the task {self.name} has no step_model (set step_model= and a "
                f"transition=(from_, to) on it, or declare them in a guarded_step block)"
            )
            with tracing.phase("body"), effects.collecting(no_steps):
                execution.body_started = True
                result = super().__call__(*execution.args, **execution.kwargs)
            execution.body_done = True
            if lease is not None:
                self._check_owned(execution, lease)
                self.before_commit(lease, execution.step_id)
            return result
        scope = steps.savepoint() if execution.nested else steps.atomic()  # type: ignore[attr-defined]
        committing = tracing.committing(scope, steps)
        outbox = effects.Outbox(
            unavailable=None
            if hasattr(steps, "write_effects")
            else f"the step store {type(steps).__name__} has no write_effects",
            scope=getattr(steps, "effect_scope", None),
        )
        if lease is not None and not execution.nested:
            # Sent once the lease is released (_acquire): the step's other deliveries end
            # as duplicates at once instead of waiting on a slow receiver.
            outbox.hold_dispatch()
        execution.outbox = outbox
        try:
            with committing, effects.collecting(outbox):
                with tracing.phase("body"):
                    execution.body_started = True
                    result = super().__call__(*execution.args, **execution.kwargs)
                execution.body_done = True
                self._commit_transition(execution, steps)
                self._write_effects(execution, steps, outbox)
                if lease is not None:
                    self._check_owned(execution, lease)
                self.before_commit(lease, execution.step_id)
        except Exception as exc:
            if committing.committed:
                # An on-commit callback's error: the transaction committed, nothing to redo.
                execution.committed = True
                raise
            # Rolled back, never committed: a deadlock or serialization failure anywhere in
            # the transaction (body, CAS, COMMIT) is contention. Nested in a caller's
            # transaction, it is the caller's to retry (MySQL rolled all of it back).
            transient = getattr(steps, "is_transient_conflict", None)
            if execution.nested or transient is None or not transient(exc):
                raise
            raise self._rolled_back(execution, exc) from exc
        return result

    def _rolled_back(self, execution: Execution, exc: Exception) -> Exception:
        """What a step transaction the database rolled back for another one's sake (``exc``:
        a deadlock or serialization failure) ends in. The step is read again once the
        winner's transaction has ended: past ``from_``, a TransitionConflict (the duplicate
        outcome, ``transition_conflict`` sent); else (or unread, or without a transition)
        a LockContended, which :meth:`handle_contended` retries (``lock_retry_max``).
        Logs ``step_transaction_conflict`` (WARNING)."""
        plan, steps, lease = execution.plan, execution.steps, execution.lease
        assert steps is not None  # a step transaction needs a step store
        step_id = execution.step_id
        code_of = getattr(steps, "error_code", None)
        code = code_of(exc) if code_of is not None else None
        found = unread = None
        if plan.transition is not None:
            wait = lease.remaining() if lease is not None else plan.ttl
            settled = getattr(steps, "settled_status", None)
            try:
                found = settled(step_id, max(0.0, wait)) if settled else steps.status(step_id)
            except Exception as error:  # noqa: BLE001 - unread: the lease retry decides
                unread = error
        duplicate = (
            found is not None and plan.transition is not None and found != plan.transition[0]
        )
        log_event(
            "step_transaction_conflict",
            logging.WARNING,
            task_id=self.request.id,
            task_name=self.name,
            step_id=step_id,
            code=code,
            current=found,
            decision="duplicate" if duplicate else "contended",
            error=exc,
            read_error=unread,
        )
        if duplicate:
            assert plan.transition is not None
            from_, to = plan.transition
            emit(
                signals.transition_conflict,
                self,
                logging.DEBUG,  # the execution's INFO line is its execution_done
                step_id=step_id,
                from_=from_,
                to=to,
                current=found,
                **execution.lease_fields(),
            )
            return TransitionConflict(
                f"step {step_id!r} is {found!r}, not {from_!r}: the database rolled back this "
                f"execution's transaction ({code}) for the one that moved it",
                step_id=step_id,
                from_=from_,
                to=to,
                current=found,
            )
        return LockContended(
            f"step {step_id!r}: the database rolled back this execution's transaction "
            f"({code}: a deadlock or serialization failure) for another one's",
            key=execution.fields["key"],
            holder=None,
            name=execution.name,
        )

    def _commit_transition(self, execution: Execution, steps: StepStore) -> None:
        """The plan's compare-and-swap after the body (when it has a transition), carrying
        the deadline: from the statement to COMMIT the transaction may live no longer than
        the lease. Without a library CAS to carry it (no transition: a multi-phase body; a
        ``transition()`` override that writes by itself) the deadline is its own
        statement."""
        plan, lease = execution.plan, execution.lease
        carried = False
        if plan.transition is not None:
            if getattr(self.transition, "__func__", None) is StepLockedTask.transition:
                self._cas(execution, execution.step_id, *plan.transition, {}, final=True)
                carried = True
            else:
                # A subclass's transition() wraps the library's CAS (the fault suite's
                # barriers do): the plan's CAS still goes through it, and the first library
                # CAS it reaches carries the deadline.
                execution.commit_cas = True
                self.transition(execution.step_id, *plan.transition)
                carried, execution.commit_cas = not execution.commit_cas, False
        if lease is not None and plan.db_deadline and not execution.nested and not carried:
            steps.set_deadline(lease.remaining())

    def _write_effects(
        self, execution: Execution, steps: StepStore, outbox: effects.Outbox
    ) -> None:
        """The effects the body declared, written in the step's transaction after its
        last transition and before the ownership check and COMMIT (dispatched once it
        commits): rows if and only if the fenced compare-and-swap commits. Their key's
        fence part is the lease's token, or ``"t<task id>"`` without a lease (fail open).
        Raises EffectsUnavailable when effects were declared but no transition applied."""
        lease = execution.lease
        task_id = self.request.id
        effects.write_declared(
            outbox,
            steps,
            step_id=execution.applied_step_id,
            to=execution.applied_to,
            fence=lease.fence if lease is not None else None,
            tag=f"t{task_id}" if task_id else f"o{execution.owner}",
            owner=lease.owner if lease is not None else execution.owner,
            task_id=task_id,
            task_name=self.name,
            on_commit=lambda send: tracing.after_commit(steps, send),
        )

    def _check_owned(self, execution: Execution, lease: Lease) -> None:
        """The pre-commit ownership check: local validity, then one round trip to Redis."""
        lease.check()
        try:
            left = execution.plan.store.owned(lease.name, lease.owner)
        except LockStoreUnavailable as exc:
            self._store_error(execution, exc)
            return
        if left is None:
            lease.mark_lost("pre-commit check found the key gone or held by another owner")
            lease.check()

    def _release(
        self, store: RedisLeaseStore, lease: Lease, *, outcome: str | None = None
    ) -> None:
        """Release after the commit; errors are logged, never raised (the TTL frees it).
        In a worker, without ``steplock_release_wait``, the release is written without
        waiting for its reply where the store can (:func:`~celery_steplock.lock.release_after_commit`);
        an eager or direct call always waits (its caller reads the lock store next).
        ``outcome``: the execution's, for the name's history
        (:func:`celery_steplock.history.outcome_of`)."""
        request = self.request
        wait = request.is_eager or request.called_directly or self.steplock_settings.release_wait
        release_after_commit(store, lease, self, wait=bool(wait), outcome=outcome)

    def _holder(self, store: RedisLeaseStore, name: str) -> dict[str, Any]:
        try:
            return store.inspect(name) or {}
        except LockStoreUnavailable:
            return {}

    # -- outcomes ---------------------------------------------------------------------------

    def apply(  # type: ignore[override]
        self,
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> EagerResult[Any]:
        """Celery's :meth:`~celery.app.task.Task.apply` (what ``delay()`` runs under
        ``task_always_eager``), with the lease retries a worker would receive (a busy lease,
        a Redis outage, a lost lease) run here, one after another without the countdown,
        under the same task id: at most ``lock_retry_max`` times, else the task's
        ``max_retries``, else 3. Returns the :class:`~celery.result.EagerResult` of the last
        attempt, so a busy lease ends as a worker's does (``LockContended`` once the retries
        are used up; raised when ``task_eager_propagates``), never as
        ``celery.exceptions.Retry``.

        Inside the caller's ``transaction.atomic()`` (not Django's TestCase blocks), an
        eager execution runs its body and compare-and-swap in a savepoint of the caller's
        transaction instead of refusing with OuterTransactionError: its writes commit with
        the caller's, after the lease is released. A direct call still refuses."""
        pending: list[dict[str, Any]] = []
        token = _eager_retries.set(pending)
        try:
            while True:
                result = super().apply(args, kwargs, **options)
                if not pending:
                    return result
                options = {**options, "task_id": result.id, "headers": pending.pop()}
        finally:
            _eager_retries.reset(token)

    def steplock_ignore(self) -> None:
        """End without storing a state (Celery ``Ignore``); None when called directly. A
        SUCCESS state that this delivery's ``STARTED`` overwrote (``task_track_started``) is
        put back first (:mod:`celery_steplock.outcomes`)."""
        if self.request.called_directly:
            return None
        outcomes.restore_stored_state(self)
        raise Ignore()

    def steplock_retry(
        self, exc: Exception, headers: dict[str, Any] | None = None, countdown: float | None = None
    ) -> NoReturn:
        """Retry after a full-jitter exponential countdown (``steplock_retry_backoff``, capped
        by ``steplock_retry_backoff_max``), at most ``lock_retry_max`` times (None: no
        limit); raises ``exc`` once they are used up or when called directly. Lease retries
        keep their own count in the ``steplock_retries`` message header, apart from the
        task's ``retries``/``max_retries``; no RETRY state is stored (a contended duplicate
        shares its task id with the winner and must not overwrite the winner's result).
        ``headers`` are added to the retry's message headers; ``countdown`` (seconds)
        replaces the backoff when given.

        In a worker, once the retry is sent, Celery's ``task-retried`` monitoring event is
        sent for the task id (what Flower's "Retried" view and ``celery events`` show), as
        Celery's own retries send it; no RETRY state is stored. Not sent for an execution
        whose task id another delivery holds (the ``steplock_same_id`` header: that id's
        events are the winner's) nor when the task's ``send_events`` is False."""
        plan = self._current_plan()
        request = self.request
        attempt = outcomes.lease_retries(request)
        limit = plan.retry_max
        if limit is None and request.is_eager:
            # apply() retries at once (eager mode has no later): bounded by max_retries, as
            # Celery's own eager retries are, and by EAGER_RETRY_MAX when that is None.
            limit = self.max_retries if self.max_retries is not None else EAGER_RETRY_MAX
        if request.called_directly or (limit is not None and attempt >= limit):
            raise exc
        if countdown is None:
            countdown = backoff(plan.retry_backoff, attempt, plan.retry_backoff_max)
        log_event(
            "retry_scheduled",
            logging.DEBUG,  # the execution's INFO line is its execution_done
            task_id=request.id,
            task_name=self.name,
            countdown=round(countdown, 3),
            reason=type(exc).__name__,
        )
        headers = {**(request.headers or {}), **(headers or {}), "steplock_retries": attempt + 1}
        pending = _eager_retries.get() if request.is_eager else None
        if pending is not None:
            # As in a worker: this attempt ends without a state, and apply() runs the retry
            # once it has (at once, without the countdown, as Celery's eager retries do).
            pending.append(headers)
            self._retry_scheduled(countdown, exc)
            raise Ignore()
        if request.is_eager:
            retried = self.signature_from_request(
                request, countdown=countdown, retries=request.retries or 0, headers=headers
            )
            self._retry_scheduled(countdown, exc)
            raise Retry(exc=exc, when=countdown, is_eager=True, sig=retried)  # type: ignore[arg-type]
        self.signature_from_request(request, countdown=countdown, headers=headers).apply_async()
        self._retry_scheduled(countdown, exc)
        if self.send_events and not headers.get(outcomes.SAME_ID_HEADER):
            self._send_retried_event(exc)
        raise Ignore()

    def _retry_scheduled(self, countdown: float, exc: Exception) -> None:
        """Note the lease retry on the current execution (its ``execution_done`` line)."""
        execution = current(self.name)
        if execution is not None:
            execution.retry_countdown, execution.retry_reason = countdown, type(exc).__name__

    def _send_retried_event(self, exc: Exception) -> None:
        """Celery's ``task-retried`` event for this task id, with the fields a Celery retry
        sends (``exception``: the repr of ``exc``; ``traceback``: empty, a lease retry has
        none); sent once, never retried, never raises (a failure is a DEBUG line,
        ``retry_event_failed``). Celery's :meth:`~celery.app.task.Task.send_event` publishes
        it whether or not the worker sends task events (a pool process cannot know whether
        a monitor enabled them); without a monitor the broker drops it."""
        try:
            self.send_event("task-retried", retry=False, exception=safe_repr(exc), traceback="")
        except Exception as error:  # noqa: BLE001 - monitoring must never stop a retry
            log_event(
                "retry_event_failed",
                logging.DEBUG,
                task_id=self.request.id,
                task_name=self.name,
                error=error,
            )


#: How many times a FenceAhead (the step row's fence ahead of the store's) is retried
#: before the task fails with it; each retry waits out the skew first.
FENCE_AHEAD_RETRY_MAX = 2
#: The message header counting those retries.
FENCE_AHEAD_HEADER = "steplock_fence_ahead"

#: Eager lease retries when neither ``lock_retry_max`` nor the task's ``max_retries`` bounds
#: them (Celery's default ``max_retries``).
EAGER_RETRY_MAX = 3


def backoff(factor: float, retries: int, maximum: float) -> float:
    """Exponential backoff with full jitter (:func:`celery_steplock._jitter.full_jitter`).

    Celery's ``get_exponential_backoff_interval`` draws whole seconds only, too coarse for
    sub-second leases.

    Args:
        factor: seconds, the ceiling of the first retry's wait.
        retries: the retries made so far.
        maximum: seconds, the largest ceiling.

    Returns:
        Seconds drawn uniformly from ``[0, min(maximum, factor * 2**retries)]``, at least
        0.05.
    """
    return max(0.05, full_jitter(backoff_ceiling(factor, retries, maximum, max_exponent=32)))


def validate_app(app: Any) -> list[str]:
    """Deprecated: :func:`celery_steplock.validate.problems`. The error messages of
    ``app``'s steplock settings and task options (empty when all is well)."""
    from .validate import problems

    warnings.warn(
        "celery_steplock.task.validate_app is deprecated; use celery_steplock.validate.problems",
        DeprecationWarning,
        stacklevel=2,
    )
    return [p.message for p in problems(app) if p.is_error]


@worker_init.connect(weak=False)
def _refuse_to_start_misconfigured(sender: Any = None, **kwargs: Any) -> None:
    """A worker with invalid steplock settings or task options does not start (it would
    consume acks_late messages only to fail them); warnings are logged. Then one PING of the
    lock store: a WARNING when it does not answer (the worker still starts)."""
    app = getattr(sender, "app", None)
    if app is None:
        return
    from .validate import refuse_to_start

    refuse_to_start(app)
    _startup.ping_lock_store(app)


@worker_process_shutdown.connect(weak=False)
def _drain_releases_at_process_exit(sender: Any = None, **kwargs: Any) -> None:
    """A prefork pool process's warm exit: the replies of its releases written without
    waiting are read (their ``lock_released``/``release_failed`` sent)."""
    drain_releases()


@worker_shutdown.connect(weak=False)
def _drain_releases_at_shutdown(sender: Any = None, **kwargs: Any) -> None:
    """A worker's warm shutdown (solo, threads, and the main process): as above."""
    drain_releases()


def __getattr__(name: str) -> Any:
    # Old names: DjangoStepLockedTask lives in contrib.django (its base imports Django).
    if name == "DjangoStepLockedTask":
        warnings.warn(
            "celery_steplock.task.DjangoStepLockedTask moved to "
            "celery_steplock.contrib.django.task (or import it from celery_steplock)",
            DeprecationWarning,
            stacklevel=2,
        )
        return _django.contrib("task").DjangoStepLockedTask
    if name == "get_lock":
        warnings.warn(
            "celery_steplock.task.get_lock is deprecated; use "
            "celery_steplock.lock.get_lease_store",
            DeprecationWarning,
            stacklevel=2,
        )
        return get_lease_store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
