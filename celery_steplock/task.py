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
        ownership check in Redis              # lost -> LockLost, rollback
    # committed
    heartbeat.unregister(lease); release      # commit first, release after

Nothing in this order can commit twice: a duplicate that slips past the lease (pause,
failover, expiry) finds the step no longer in ``from_`` and its CAS updates no row.

Task options (class attributes, or keywords of ``@app.task``); None means the setting's
default from :mod:`celery_steplock.conf`:

``lock_key``        str.format template over argument names, or a callable; default: task
                    name + SHA-256 of the bound arguments
``lock_ttl``        lease TTL, seconds (``steplock_default_ttl``, 30)
``lock_wait``       seconds to wait for a busy lease (``steplock_lock_wait``, 0)
``lock_max_hold``   seconds after which renewal stops and the lease is lost (None: no cap)
``on_contended``    "retry" (Celery retry with a full-jitter countdown; no RETRY state is
                    stored, so a same-id duplicate never overwrites the winner's result),
                    "skip" (no state update) or "raise" (LockContended)
``on_conflict``     "ignore" (Celery ``Ignore``: the task's stored result is not overwritten,
                    so a duplicate delivery never replaces the first outcome; a loser with
                    its own task id stores nothing and stays PENDING) or "raise"
                    (TransitionConflict, stored as FAILURE)
``on_store_error``  "fail_closed" (body not run, retried) or "fail_open" (body runs unlocked;
                    the CAS still guards; ``lock_store_error`` is sent every time)
``step_model``      "app_label.Model" or model class of the step
``step_id_arg``     name of the argument holding the step's primary key
``transition``      ``(from_, to)`` applied by CAS after the body
``step_transitions`` optional ``{from_: [to, ...]}`` table of allowed transitions
``lock_precheck``   skip the body when the step already left ``from_`` (default True)
``lock_retry_max``  how many times a busy lease, an outage or a lost lease is retried
                    (``steplock_retry_max``, default None: until it clears; these retries
                    are counted apart from the task's own ``max_retries``)
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import random
import threading
from dataclasses import dataclass
from typing import Any, Callable

from celery import Task
from celery.exceptions import Ignore, Retry
from celery.signals import worker_init

from . import signals
from .conf import ON_CONFLICT, ON_CONTENDED, ON_STORE_ERROR, Settings, check_bool, \
    check_choice, check_seconds, check_ttl
from .events import emit, lease_fields
from .exceptions import ImproperlyConfigured, LockContended, LockLost, LockStoreUnavailable, \
    OuterTransactionError, TransitionConflict
from .heartbeat import get_heartbeat
from .keys import bind_arguments, lease_key, name_from_arguments
from .lock import Lease, RedisStepLock, get_lease_store, holder_metadata, new_owner_token

#: Deprecated alias of :func:`celery_steplock.lock.get_lease_store`.
get_lock = get_lease_store

__all__ = ["StepLockedTask", "DjangoStepLockedTask", "get_lock", "validate_app"]

logger = logging.getLogger("celery_steplock")

# The lease of each task running in this context (thread / greenlet), by task name. A
# ContextVar rather than the request: a direct call shares Celery's default request across
# threads, and a nested call of the same task must restore the outer lease afterwards.
_current_leases: contextvars.ContextVar[dict[str, Lease | None]] = contextvars.ContextVar(
    "steplock_leases", default={})

# The settings snapshot of the execution running in this context (see Settings(snapshot=True)).
_current_settings: contextvars.ContextVar[Settings | None] = contextvars.ContextVar(
    "steplock_settings", default=None)

@dataclass(frozen=True)
class _Options:
    lock_key: str | Callable[..., str] | None
    ttl: float
    wait: float
    max_hold: float | None
    ratio: float
    on_contended: str
    on_conflict: str
    on_store_error: str
    transition: tuple[str, str] | None
    step_id_arg: str | None
    precheck: bool
    retry_max: int | None


class StepLockedTask(Task):
    """A task whose body runs under an owner-keyed Redis lease; see the module docstring.

    Inside the body, ``self.lease`` is the :class:`~celery_steplock.lock.Lease` (None when
    called with fail-open during an outage) and ``self.transition(step_id, from_, to)``
    applies a compare-and-swap guarded by the lease's fencing token.

    Raises (as the task's outcome): LockContended (on_contended="raise" or retries
    exhausted), LockStoreUnavailable (fail-closed, retries exhausted), LockLost (the lease
    was lost before the commit, or the step row carries a newer fencing token; nothing
    committed), a database connection error from COMMIT (retried first), TransitionConflict
    (on_conflict="raise"), ImproperlyConfigured and LockNameError (bad options/arguments).
    """

    lock_key: str | Callable[..., str] | None = None
    lock_ttl: float | None = None
    lock_wait: float | None = None
    lock_max_hold: float | None = None
    on_contended: str | None = None
    on_conflict: str | None = None
    on_store_error: str | None = None
    step_model: Any = None
    step_id_arg: str | None = None
    step_transition: tuple[str, str] | None = None
    step_transitions: dict | None = None
    lock_precheck: bool | None = None
    lock_retry_max: int | None = None

    #: Expected outcomes, logged without a traceback by the worker (Celery ``Task.throws``).
    throws = (LockContended, TransitionConflict)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # ``@app.task(transition=(from_, to))`` would shadow the transition() method: keep
        # the option under another name.
        spec = cls.__dict__.get("transition")
        if spec is not None and not callable(spec):
            cls.step_transition = tuple(spec)
            delattr(cls, "transition")

    # -- options -------------------------------------------------------------------------

    @property
    def steplock_settings(self) -> Settings:
        """The settings: the running execution's snapshot, else read afresh."""
        current = _current_settings.get()
        if current is not None and current.app is self.app:
            return current
        return Settings(self.app)

    def steplock_options(self) -> _Options:
        """This task's options resolved against the settings.

        Raises ImproperlyConfigured naming the task and the option or setting.
        """
        try:
            return self._resolve_options()
        except ImproperlyConfigured as exc:
            if str(exc).startswith(f"{self.name}:"):
                raise
            raise ImproperlyConfigured(f"{self.name}: {exc}", setting=exc.setting) from exc

    def _resolve_options(self) -> _Options:
        settings = self.steplock_settings
        transition = self.step_transition
        if transition is not None:
            if (not isinstance(transition, tuple) or len(transition) != 2
                    or not all(isinstance(s, str) for s in transition)):
                raise ImproperlyConfigured(
                    f"{self.name}: transition must be a (from_, to) pair of status strings, "
                    f"got {transition!r}", setting="transition")
            if self.step_model is None or not self.step_id_arg:
                raise ImproperlyConfigured(
                    f"{self.name}: transition needs step_model and step_id_arg",
                    setting="step_model" if self.step_model is None else "step_id_arg")
        ttl = (check_ttl(self.lock_ttl, "lock_ttl") if self.lock_ttl is not None
               else settings.default_ttl)
        ratio = settings.renewal_ratio
        return _Options(
            lock_key=self.lock_key,
            ttl=ttl,
            wait=(check_seconds(self.lock_wait, "lock_wait", allow_zero=True)
                  if self.lock_wait is not None else settings.lock_wait),
            max_hold=(check_seconds(self.lock_max_hold, "lock_max_hold")
                      if self.lock_max_hold is not None else settings.max_hold),
            ratio=ratio,
            on_contended=(check_choice(self.on_contended, "on_contended", ON_CONTENDED)
                          if self.on_contended is not None else settings.on_contended),
            on_conflict=(check_choice(self.on_conflict, "on_conflict", ON_CONFLICT)
                         if self.on_conflict is not None else settings.on_conflict),
            on_store_error=(check_choice(self.on_store_error, "on_store_error",
                                         ON_STORE_ERROR)
                            if self.on_store_error is not None else settings.on_store_error),
            transition=transition,
            step_id_arg=self.step_id_arg,
            precheck=(settings.precheck if self.lock_precheck is None
                      else check_bool(self.lock_precheck, "lock_precheck")),
            retry_max=(settings.retry_max if self.lock_retry_max is None
                       else self._retry_max_option()),
        )

    def _retry_max_option(self) -> int:
        value = self.lock_retry_max
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ImproperlyConfigured(f"lock_retry_max must be None or a whole number >= 0, "
                                       f"got {value!r}", setting="lock_retry_max")
        return value

    def steplock_guard(self):
        """The :class:`~celery_steplock.guard.StepTransitionGuard` of ``step_model``."""
        if self.step_model is None:
            raise ImproperlyConfigured(f"{self.name}: step_model is not set; "
                                       f"self.transition() needs it", setting="step_model")
        from .guard import StepTransitionGuard

        settings = self.steplock_settings
        memo = settings.memo
        if memo is not None:
            guard = memo.get(("guard", self))
            if guard is not None:
                return guard
        ident = (self.step_model, settings.status_field, settings.owner_field,
                 settings.fence_field)
        cached = self.__dict__.get("_steplock_guard")
        if cached is None or cached[0] != ident:
            try:
                guard = StepTransitionGuard(self.step_model, status_field=ident[1],
                                            owner_field=ident[2], fence_field=ident[3],
                                            transitions=self.step_transitions)
            except ImproperlyConfigured as exc:
                raise ImproperlyConfigured(f"{self.name}: {exc}", setting=exc.setting) from exc
            cached = (ident, guard)
            self._steplock_guard = cached
        if memo is not None:
            memo[("guard", self)] = cached[1]
        return cached[1]

    # -- inside the body --------------------------------------------------------------------

    @property
    def lease(self) -> Lease | None:
        """The lease of the execution running in this thread (None outside one)."""
        return _current_leases.get().get(self.name)

    def transition(self, step_id: Any, from_: str, to: str, **updates: Any):
        """Apply ``from_ -> to`` to step ``step_id`` by compare-and-swap, fenced by the
        current lease; ``updates`` are extra column values. Returns the TransitionResult.

        Raises LockLost when the lease is already lost, TransitionConflict when no row
        matched (the enclosing transaction then rolls back), InvalidTransition, StepNotFound.
        """
        lease = self.lease
        if lease is not None:
            lease.check()
        fields = lease_fields(lease) if lease is not None else {
            "key": None, "name": None, "owner": None, "fence": None,
            "task_id": self.request.id, "task_name": self.name, "ttl": None}
        guard = self.steplock_guard()
        try:
            result = guard.transition(
                step_id, from_, to, owner=lease.owner if lease else None,
                fence=lease.fence if lease else None, updates=updates)
        except TransitionConflict as exc:
            emit(signals.transition_conflict, self, step_id=step_id, from_=from_, to=to,
                 current=exc.current, **fields)
            if lease is not None and exc.current == from_:
                # The status matched, the fence did not: the row carries a newer fencing
                # token. Either a newer holder wrote it (this lease is stale), or the fence
                # source went backwards (a failover to a node whose clock is behind): retry
                # rather than ignore, so the step is never dropped silently.
                lease.mark_lost(f"the step row carries a newer fencing token than {lease.fence}")
                raise LockLost(f"{exc} (fence {lease.fence})", key=lease.key,
                               owner=lease.owner, fence=lease.fence) from exc
            raise
        except Exception as exc:
            if lease is None or not _lock_not_available(exc):
                raise
            # The row stayed locked past the lease's validity (set_deadline's lock_timeout):
            # another transaction, e.g. a stopped holder's, has it. Contention: back off.
            raise LockContended(
                f"step {step_id!r}: its row stayed locked by another transaction for the "
                f"lease's remaining validity", key=lease.key, holder=None) from exc
        self._on_commit(lambda: emit(signals.transition_applied, self, step_id=step_id,
                                     from_=from_, to=to, **fields))
        return result

    # -- the execution ------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        token = _current_settings.set(Settings(self.app, snapshot=True))
        try:
            return self._locked_call(args, kwargs)
        finally:
            _current_settings.reset(token)

    def _locked_call(self, args, kwargs):
        opts = self.steplock_options()
        arguments = bind_arguments(self.run, args, kwargs)
        name = name_from_arguments(self.name, arguments, opts.lock_key)
        step_id = None
        if opts.transition is not None:
            if opts.step_id_arg not in arguments:
                raise ImproperlyConfigured(
                    f"{self.name}: step_id_arg={opts.step_id_arg!r} is not an argument of the "
                    f"task (arguments: {', '.join(arguments)})", setting="step_id_arg")
            step_id = arguments[opts.step_id_arg]
        if self.step_model is not None:
            self.steplock_guard()  # an unknown model fails here, before any lease is taken
            self._check_not_nested()
        request = self.request
        lock = get_lease_store(self.app, self.steplock_settings)
        base = {"key": lease_key(lock.prefix, name), "name": name, "task_id": request.id,
                "task_name": self.name, "ttl": opts.ttl}
        step = (f"{self.steplock_guard().model._meta.label_lower}:{step_id}"
                if step_id is not None else None)
        try:
            lease = lock.acquire(name, new_owner_token(), opts.ttl, wait=opts.wait,
                                 metadata=holder_metadata(
                                     request.id, self.name, request.retries,
                                     worker=request.hostname, step=step,
                                     renew_ms=int(opts.ttl * opts.ratio * 1000)))
        except LockStoreUnavailable as exc:
            emit(signals.lock_store_error, self, logging.ERROR, reason=str(exc),
                 policy=opts.on_store_error, owner=None, fence=None, **base)
            if opts.on_store_error == "fail_open":
                return self._execute(None, lock, opts, step_id, args, kwargs)
            return self._steplock_retry(exc, opts)
        if lease is None:
            info = self._holder(lock, name)
            emit(signals.lock_contended, self, owner=None, fence=None,
                 holder=info.get("owner"), **base)
            who = (f"owner {info['owner']} (task {info.get('task_id')}, "
                   f"{info.get('hostname')} pid {info.get('pid')})" if info.get("owner")
                   else "another owner (released since)")
            return self._contended(LockContended(
                f"{name!r} is held by {who}", key=base["key"], holder=info.get("owner"),
                ttl=info.get("ttl"), holder_task_id=info.get("task_id")), opts)
        emit(signals.lock_acquired, self, **lease_fields(lease))
        heartbeat = get_heartbeat()
        try:
            heartbeat.register(lease, lock, ratio=opts.ratio, sender=self,
                               max_hold=opts.max_hold)
            return self._execute(lease, lock, opts, step_id, args, kwargs)
        finally:
            if not heartbeat.unregister(lease) and lease.lost:
                pass  # the heartbeat already reported the loss
            elif lease.lost:
                emit(signals.lock_lost, self, logging.ERROR, reason=lease.lost_reason,
                     **lease_fields(lease))
            self._release(lock, lease)

    def _execute(self, lease: Lease | None, lock: RedisStepLock, opts: _Options, step_id,
                 args, kwargs):
        token = _current_leases.set({**_current_leases.get(), self.name: lease})
        body_done = False
        try:
            if opts.transition is not None and opts.precheck:
                # Before the transaction: a read needs no write lock (SQLite's BEGIN
                # IMMEDIATE takes it), and the CAS, not this read, is what decides.
                current = self.steplock_guard().status(step_id)
                if current != opts.transition[0]:
                    exc = TransitionConflict(
                        f"step {step_id!r} is {current!r}, not {opts.transition[0]!r}: "
                        f"body skipped", step_id=step_id, from_=opts.transition[0],
                        to=opts.transition[1], current=current)
                    emit(signals.transition_conflict, self, step_id=step_id,
                         from_=exc.from_, to=exc.to, current=current,
                         **(lease_fields(lease) if lease else {}))
                    raise exc
            with self._atomic(opts):
                result = super().__call__(*args, **kwargs)
                body_done = True
                if lease is not None and self.step_model is not None \
                        and self.steplock_settings.db_deadline:
                    # From here to COMMIT the transaction lives no longer than the lease may:
                    # a holder stopped after its CAS can neither commit late nor hold the row.
                    self.steplock_guard().set_deadline(lease.remaining())
                if opts.transition is not None:
                    self.transition(step_id, *opts.transition)
                if lease is not None:
                    self._check_owned(lease, lock, opts)
            return result
        except TransitionConflict:
            if opts.on_conflict == "ignore":
                return self._ignore()
            raise
        except LockLost as exc:
            if opts.on_contended == "retry":
                return self._steplock_retry(exc, opts)
            raise
        except LockStoreUnavailable as exc:
            # Redis did not answer the pre-commit ownership check: nothing was committed.
            return self._steplock_retry(exc, opts)
        except LockContended as exc:
            return self._contended(exc, opts)  # the step's row, not the lease, was busy
        except Exception as exc:
            if not _lost_connection(exc) or not (
                    body_done or (lease is not None and (lease.lost or lease.remaining() <= 0))):
                raise
            # The connection broke in our part of the transaction (deadline, CAS, COMMIT: the
            # commit did not happen, or it did and its reply was lost), or the database ended
            # a session whose lease ran out (StepTransitionGuard.set_deadline): the retry
            # settles it, since its pre-check or CAS sees the step as it is. The body's own
            # database errors stay the body's (Celery's autoretry_for).
            logger.warning("event=commit_failed task_id=%s task_name=%s step_id=%s error=%r",
                           self.request.id, self.name, step_id, exc)
            return self._steplock_retry(exc, opts)
        finally:
            _current_leases.reset(token)

    def _check_owned(self, lease: Lease, lock: RedisStepLock, opts: _Options) -> None:
        """The pre-commit ownership check: local validity, then one round trip to Redis."""
        lease.check()
        try:
            left = lock.owned(lease.name, lease.owner)
        except LockStoreUnavailable as exc:
            emit(signals.lock_store_error, self, logging.ERROR, reason=str(exc),
                 policy=opts.on_store_error, **lease_fields(lease))
            if opts.on_store_error == "fail_open":
                return
            raise
        if left is None:
            lease.mark_lost("pre-commit check found the key gone or held by another owner")
            lease.check()

    def _atomic(self, opts: _Options):
        if self.step_model is None:
            return contextlib.nullcontext()
        from django.db import transaction

        # durable: the commit must really happen here, before the lease is released.
        return transaction.atomic(using=self.steplock_guard().using, durable=True)

    def _check_not_nested(self) -> None:
        """Refuse to run inside an outer ``transaction.atomic()`` (ATOMIC_REQUESTS, a caller's
        own block): its commit would come after our release. Django's TestCase blocks are
        allowed, as ``atomic(durable=True)`` allows them."""
        from django.db import transaction

        connection = transaction.get_connection(self.steplock_guard().using)
        if connection.in_atomic_block and connection.atomic_blocks and not getattr(
                connection.atomic_blocks[-1], "_from_testcase", False):
            raise OuterTransactionError(
                f"{self.name} was called inside transaction.atomic(): its transition would "
                f"commit after the lease is released. Call it outside the block, or with "
                f"delay_on_commit()/apply_async() (DjangoStepLockedTask).")

    def _on_commit(self, func: Callable[[], None]) -> None:
        if self.step_model is None:
            func()
            return
        from django.db import transaction

        transaction.on_commit(func, using=self.steplock_guard().using)

    def _release(self, lock: RedisStepLock, lease: Lease) -> None:
        """Release after the commit; errors are logged, never raised (the TTL frees it)."""
        try:
            released = lock.release(lease.name, lease.owner)
        except Exception as exc:  # noqa: BLE001 - must never mask the task's outcome
            logger.warning("event=release_failed key=%s owner=%s error=%s", lease.key,
                           lease.owner, exc)
            return
        if released:
            emit(signals.lock_released, self, forced=False, **lease_fields(lease))

    def _holder(self, lock: RedisStepLock, name: str) -> dict[str, Any]:
        try:
            return lock.inspect(name) or {}
        except LockStoreUnavailable:
            return {}

    # -- outcomes ---------------------------------------------------------------------------

    def _ignore(self):
        if self.request.called_directly:
            return None
        raise Ignore()

    def _contended(self, exc: LockContended, opts: _Options):
        if opts.on_contended == "skip":
            return self._ignore()
        if opts.on_contended == "raise":
            raise exc
        try:
            return self._steplock_retry(exc, opts)
        except LockContended:
            if exc.holder_task_id and exc.holder_task_id == self.request.id:
                # Retries exhausted while another delivery of this very task id holds the
                # lease: that delivery owns the outcome; storing FAILURE would overwrite it.
                return self._ignore()
            raise

    def _steplock_retry(self, exc: Exception, opts: _Options):
        """Retry after a full-jitter exponential countdown (steplock_retry_backoff, capped by
        steplock_retry_backoff_max), at most ``opts.retry_max`` times (None: no limit);
        raises ``exc`` once they are used up."""
        settings = self.steplock_settings
        request = self.request
        attempt = int(getattr(request, "steplock_retries", None)
                      or (request.headers or {}).get("steplock_retries") or 0)
        limit = opts.retry_max
        if limit is None and request.is_eager:
            limit = self.max_retries  # apply() retries inline: an unbounded loop would recurse
        if request.called_directly or (limit is not None and attempt >= limit):
            raise exc
        countdown = backoff(settings.retry_backoff, attempt, settings.retry_backoff_max)
        logger.info("event=retry_scheduled task_id=%s task_name=%s countdown=%.3f reason=%s",
                    request.id, self.name, countdown, type(exc).__name__)
        # Lease retries keep their own count in a message header, apart from the task's
        # retries/max_retries, which stay the body's.
        headers = {**(request.headers or {}), "steplock_retries": attempt + 1}
        if request.is_eager:
            retried = self.signature_from_request(request, countdown=countdown,
                                                  retries=request.retries or 0,
                                                  headers=headers)
            raise Retry(exc=exc, when=countdown, is_eager=True, sig=retried)
        # Publish the retry but store no RETRY state: a contended duplicate delivery shares
        # its task id with the winner and must not overwrite the winner's stored result.
        self.signature_from_request(request, countdown=countdown, headers=headers).apply_async()
        raise Ignore()


def _lock_not_available(exc: BaseException) -> bool:
    """PostgreSQL's lock_not_available (SQLSTATE 55P03), as raised through Django."""
    cause = exc.__cause__
    return getattr(cause, "sqlstate", None) == "55P03" or getattr(cause, "pgcode", None) == "55P03"


def _lost_connection(exc: BaseException) -> bool:
    """A database error that means the connection broke (Django's OperationalError or
    InterfaceError, or PostgreSQL's idle-in-transaction timeout, SQLSTATE 25P03, which Django
    raises as InternalError), as opposed to a refused statement."""
    from django.db import InterfaceError, InternalError, OperationalError

    if isinstance(exc, InternalError):
        return getattr(exc.__cause__, "sqlstate", None) == "25P03" \
            or getattr(exc.__cause__, "pgcode", None) == "25P03"
    return isinstance(exc, (OperationalError, InterfaceError))


def backoff(factor: float, retries: int, maximum: float) -> float:
    """Exponential backoff with full jitter, in seconds: uniform in
    ``[0, min(maximum, factor * 2**retries)]`` (Celery's ``get_exponential_backoff_interval``
    draws whole seconds only, too coarse for sub-second leases). Floor 0.05 s."""
    return max(0.05, random.uniform(0, min(maximum, factor * (2 ** min(retries, 32)))))


def validate_app(app) -> list[str]:
    """Check ``app``'s steplock settings and every StepLockedTask's options; returns the
    problems found, one message each (empty when all is well). Step models are resolved
    only once Django's app registry is ready."""
    problems = []
    try:
        Settings(app).validate()
    except ImproperlyConfigured as exc:
        problems.append(str(exc))
    try:
        from django.apps import apps as django_apps
        models_ready = django_apps.ready
    except ImportError:
        models_ready = False
    for task in list(app.tasks.values()):
        if not isinstance(task, StepLockedTask):
            continue
        try:
            task.steplock_options()
            if task.step_model is not None and models_ready:
                task.steplock_guard()
        except ImproperlyConfigured as exc:
            problems.append(str(exc))
    return problems


@worker_init.connect(weak=False)
def _refuse_to_start_misconfigured(sender=None, **kwargs) -> None:
    """A worker with invalid steplock settings or task options does not start (it would
    consume acks_late messages only to fail them)."""
    app = getattr(sender, "app", None)
    if app is None:
        return
    problems = validate_app(app)
    if problems:
        for problem in problems:
            logger.critical("event=improperly_configured %s", problem)
        raise SystemExit("celery-steplock: " + "; ".join(problems))


try:
    from celery.contrib.django.task import DjangoTask
except ImportError:  # pragma: no cover - Celery < 5.4
    DjangoTask = Task


class DjangoStepLockedTask(StepLockedTask, DjangoTask):
    """:class:`StepLockedTask` that keeps Celery's ``DjangoTask`` API
    (``delay_on_commit`` / ``apply_async_on_commit``)."""
