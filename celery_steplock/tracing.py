"""OpenTelemetry spans of one execution, through ``opentelemetry-api`` only.

Install the API and an SDK (``pip install 'celery-steplock[opentelemetry]'``) and set a tracer
provider; each execution of a :class:`~celery_steplock.task.StepLockedTask` then records::

    steplock.execution                 the whole __call__ (child of Celery's span, if any)
      steplock.wait                    acquiring the lease (lock_wait included)
      steplock.hold                    lease granted -> released
        steplock.body                  the task's own code (its spans are children of this)
          steplock.cas                 each compare-and-swap (self.transition in the body too)
        steplock.cas                   the plan's transition, after the body
        steplock.commit                COMMIT (steplock.rollback when the block rolled back)
        steplock.release               the release round trip

Attributes: ``steplock.task.name``, ``steplock.task.id``, ``steplock.lease.name``,
``steplock.lease.key``, ``steplock.lease.ttl`` (seconds), and once granted
``steplock.lease.owner`` and ``steplock.lease.fence``. Task arguments are never recorded (a
templated ``lock_key`` puts the values it names into the lease name, as in logs). An
exception is recorded by type only (``exception.type``, span status ERROR): its message
may quote arguments. Celery's ``Ignore`` and ``Retry`` are control flow, not errors: they
set ``steplock.control`` to ``"ignore"`` or ``"retry"``.

Without ``opentelemetry-api``, or while no tracer provider is set (the API's default proxy
or its no-op provider), no span is created: each phase costs two ``time.monotonic()`` reads
(the durations the signals carry: ``wait_seconds``, ``cas_seconds``, ``commit_seconds``).
"""

from __future__ import annotations

import contextvars
import time
from typing import Any, Callable, ContextManager, Literal, Mapping

from ._version import __version__

try:
    from opentelemetry import context as _context
    from opentelemetry import trace as _trace
except ImportError:  # the API is optional: tracing is then a no-op
    _context = None  # type: ignore[assignment]
    _trace = None  # type: ignore[assignment]

__all__ = [
    "TRACER_NAME",
    "Phase",
    "execution",
    "phase",
    "hold",
    "releasing",
    "committing",
    "commit_seconds",
    "enabled",
    "use_tracer_provider",
    "outcome",
]

TRACER_NAME = "celery_steplock"

# The signal payload fields that become span attributes; nothing else is ever recorded.
_ATTRIBUTES = {
    "task_name": "steplock.task.name",
    "task_id": "steplock.task.id",
    "name": "steplock.lease.name",
    "key": "steplock.lease.key",
    "ttl": "steplock.lease.ttl",
    "owner": "steplock.lease.owner",
    "fence": "steplock.lease.fence",
}

_CONTROL = {"Ignore": "ignore", "Retry": "retry", "Reject": "reject"}

_tracer_cache: tuple[Any, Any] = (None, None)
_provider: Any = None


def use_tracer_provider(provider: Any = None) -> None:
    """Record this library's spans with ``provider`` (an OpenTelemetry ``TracerProvider``)
    instead of the global one; None: the global one again (the default)."""
    global _provider
    _provider = provider


def _tracer():
    """The tracer of the current provider, or None when spans would record nothing."""
    global _tracer_cache
    if _trace is None:
        return None
    provider = _provider if _provider is not None else _trace.get_tracer_provider()
    cached_provider, tracer = _tracer_cache
    if provider is cached_provider:
        return tracer
    if isinstance(provider, (_trace.ProxyTracerProvider, _trace.NoOpTracerProvider)):
        tracer = None
    else:
        tracer = provider.get_tracer(TRACER_NAME, __version__)
    _tracer_cache = (provider, tracer)
    return tracer


def enabled() -> bool:
    """Whether an execution started now would record spans."""
    return _tracer() is not None


class _Run:
    """One traced execution: its tracer, root span and the attributes gathered so far."""

    __slots__ = ("tracer", "span", "attributes")

    def __init__(self, tracer, span):
        self.tracer = tracer
        self.span = span
        self.attributes: dict[str, Any] = {}

    def annotate(self, fields: Mapping[str, Any] | None) -> None:
        if not fields:
            return
        found = {
            _ATTRIBUTES[k]: v
            for k, v in fields.items()
            if k in _ATTRIBUTES and isinstance(v, (str, int, float, bool))
        }
        if found:
            self.attributes.update(found)
            self.span.set_attributes(found)


_run: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("steplock_trace", default=None)
_commit: contextvars.ContextVar[Phase | None] = contextvars.ContextVar(
    "steplock_commit", default=None
)
_committing: contextvars.ContextVar[_Committing | None] = contextvars.ContextVar(
    "steplock_committing", default=None
)


def _finish(span, exc: BaseException | None) -> None:
    if exc is None:
        return
    kind = type(exc).__name__
    if kind in _CONTROL:
        span.set_attribute("steplock.control", _CONTROL[kind])
        return
    span.set_attribute("exception.type", f"{type(exc).__module__}.{kind}")
    span.set_status(_trace.Status(_trace.StatusCode.ERROR, kind))


class Phase:
    """One phase of an execution, as a context manager (or :meth:`start` / :meth:`end`).

    ``seconds`` is its duration (``time.monotonic``) once ended, else None. Inside a traced
    execution it is also a span, the current span while it runs (so spans started inside it
    are its children)."""

    __slots__ = ("name", "fields", "started", "seconds", "_span", "_token")

    def __init__(self, name: str, fields: Mapping[str, Any] | None = None):
        self.name = name
        self.fields = fields
        self.started: float | None = None
        self.seconds: float | None = None
        self._span = None
        self._token: Any = None

    def start(self) -> Phase:
        run = _run.get()
        if run is not None:
            try:
                run.annotate(self.fields)
                span = run.tracer.start_span(f"steplock.{self.name}", attributes=run.attributes)
                self._token = _context.attach(_trace.set_span_in_context(span))
                self._span = span
            except Exception:  # noqa: BLE001 - tracing never breaks locking
                self._span = self._token = None
        self.started = time.monotonic()
        return self

    def end(self, exc: BaseException | None = None) -> None:
        """End the phase (once: a second call does nothing)."""
        if self.started is None or self.seconds is not None:
            return
        self.seconds = time.monotonic() - self.started
        span, self._span = self._span, None
        if span is not None:
            try:
                _finish(span, exc)
                if self._token is not None:
                    _context.detach(self._token)
                span.end()
            except Exception:  # noqa: BLE001 - tracing never breaks locking
                pass

    def __enter__(self) -> Phase:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        self.end(exc)
        return False


def phase(name: str, fields: Mapping[str, Any] | None = None) -> Phase:
    """A :class:`Phase` named ``name``; ``fields`` (signal payload fields such as ``name``,
    ``key``, ``owner``, ``fence``, ``task_name``, ``task_id``) become attributes of it, of the
    execution's span and of the phases after it."""
    return Phase(name, fields)


def hold(lease) -> Phase:
    """Start the hold phase of ``lease`` (ended by :func:`releasing`)."""
    return Phase("hold", {"owner": lease.owner, "fence": lease.fence}).start()


class _Releasing:
    __slots__ = ("held", "phase")

    def __init__(self, held: Phase):
        self.held = held
        self.phase = Phase("release")

    def __enter__(self) -> Phase:
        return self.phase.start()

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        try:
            self.phase.end(exc)
        finally:
            self.held.end(exc)
        return False


def releasing(held: Phase) -> _Releasing:
    """The release phase, a context manager: ends ``held`` (the hold phase) after itself."""
    return _Releasing(held)


class _Committing:
    """Wraps the step store's ``atomic()``: the commit phase is its exit, up to the first
    on-commit callback (registered on entry, so it runs before the body's own callbacks)."""

    __slots__ = ("atomic", "steps", "phase", "committed", "after", "_token", "_current")

    def __init__(self, atomic, steps):
        self.atomic = atomic
        self.steps = steps
        self.phase = Phase("commit")
        #: The COMMIT happened (its first on-commit callback ran): an error from the exit now
        #: is an on-commit callback's, not the transaction's.
        self.committed = False
        #: The library's own callbacks (:func:`after_commit`): run by the first on-commit
        #: callback, before the body's, which a raising one would skip.
        self.after: list[Callable[[], None]] = []

    def __enter__(self):
        entered = self.atomic.__enter__()
        try:
            self.steps.on_commit(self._committed)
        except Exception:
            self.atomic.__exit__(None, None, None)
            raise
        self._token = _commit.set(self.phase)
        self._current = _committing.set(self)
        return entered

    def _committed(self) -> None:
        self.committed = True
        self.phase.end()  # never raises: a raising callback would stop Django's others
        for func in self.after:
            func()

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.phase.name = "rollback"
        self.phase.start()
        try:
            return self.atomic.__exit__(exc_type, exc, tb)
        except BaseException as error:
            self.phase.end(error)
            raise
        finally:
            self.phase.end(exc)
            _commit.reset(self._token)
            _committing.reset(self._current)


def committing(atomic, steps) -> _Committing:
    """``with committing(steps.atomic(), steps):`` is ``with steps.atomic():`` with its
    COMMIT timed (and traced as ``steplock.commit``)."""
    return _Committing(atomic, steps)


def after_commit(steps, func: Callable[[], None]) -> None:
    """Run ``func`` once the step's transaction commits: inside :func:`committing`, from its
    first on-commit callback (before any the body registered, so a body's raising callback
    cannot skip it); elsewhere ``steps.on_commit(func)``. ``func`` must not raise (as
    :func:`celery_steplock.events.emit` never does): it would stop the callbacks after it."""
    current = _committing.get()
    if current is not None and current.steps is steps:
        current.after.append(func)
    else:
        steps.on_commit(func)


def commit_seconds() -> float | None:
    """Inside an on-commit callback of the current execution: how long its COMMIT took."""
    current = _commit.get()
    return current.seconds if current is not None else None


class _NoExecution:
    __slots__ = ()

    def __enter__(self):
        return None

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        return False


_NO_EXECUTION = _NoExecution()


class _Execution:
    __slots__ = ("tracer", "task", "span", "token", "run_token")

    def __init__(self, tracer, task):
        self.tracer = tracer
        self.task = task

    def __enter__(self) -> _Run | None:
        self.span = self.run_token = None
        try:
            request = self.task.request
            self.span = self.tracer.start_span("steplock.execution")
            self.token = _context.attach(_trace.set_span_in_context(self.span))
            run = _Run(self.tracer, self.span)
            run.annotate({"task_name": self.task.name, "task_id": request.id})
            self.run_token = _run.set(run)
            return run
        except Exception:  # noqa: BLE001 - tracing never breaks locking
            return None

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        if self.span is None:
            return False
        try:
            if self.run_token is not None:
                _run.reset(self.run_token)
            _finish(self.span, exc)
            _context.detach(self.token)
            self.span.end()
        except Exception:  # noqa: BLE001 - tracing never breaks locking
            pass
        return False


def outcome(kind: str) -> None:
    """Mark the current execution's span with ``steplock.outcome`` (``"duplicate"`` or
    ``"skipped"``: :mod:`celery_steplock.outcomes`); nothing outside a traced execution."""
    run = _run.get()
    if run is not None:
        try:
            run.span.set_attribute("steplock.outcome", kind)
        except Exception:  # noqa: BLE001 - tracing never breaks locking
            pass


def execution(task: Any) -> ContextManager[Any]:
    """The span of one execution of ``task``, a context manager; a shared no-op when
    nothing would be recorded."""
    tracer = _tracer()
    if tracer is None:
        return _NO_EXECUTION
    return _Execution(tracer, task)
