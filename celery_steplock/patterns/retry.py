"""A retry policy: exponential backoff with full jitter, caps on attempts and on elapsed
time, ``Retry-After`` honoured, and a classifier so that what must not be retried never is.

``RetryPolicy(...)`` is used three ways:

- as the ``retry_policy`` task option of a :class:`~celery_steplock.task.StepLockedTask`:
  an exception out of the execution (the body's, after the lease is released and the gates
  exited, so the circuit breaker has recorded it) is classified; a retryable one is retried
  with Celery's ``self.retry(exc=..., countdown=..., max_retries=...)``, the time of the
  first attempt travelling in the ``steplock_first_attempt`` message header. The worker never
  sleeps in its slot: the countdown is the broker's;
- as a plain call, ``policy.call(fn, *args, **kwargs)``, sleeping between attempts, or
  ``await policy.acall(afn, *args, **kwargs)`` for a coroutine function, waiting with
  ``asyncio.sleep`` (never ``time.sleep``: the event loop runs on);
- as a decorator, ``@policy``, on a ``def`` or an ``async def`` (the wrapper is then a
  coroutine function). Under a circuit breaker's decorator (``@breaker`` above ``@policy``)
  the retries run inside the breaker: every attempt is admitted by it, as with
  ``RetryPolicy(breaker=...)``, and its refusal (CircuitOpen, control flow) is never retried.

Classification (:meth:`RetryPolicy.classify`; the first rule that applies wins):

1. the library's control exceptions (:class:`~celery_steplock.exceptions.StepLockError`:
   contention, a lost lease, a conflict, an admission denial, configuration) and Celery's
   ``Retry``/``Ignore``/``Reject``: ``"control"``, never touched (their own policies apply);
2. ``never_retry`` (exception types): ``"never"``;
3. ``retry_on`` (exception types): ``"retry"``;
4. ``classifier(exc)``: True ``"retry"``, False ``"never"``, None: go on;
5. an attribute ``exc.retryable`` (bool) set by the raiser;
6. an HTTP status (``exc.response.status_code`` of requests/httpx errors, or
   ``exc.status_code`` / ``exc.status``): 408, 429 and 5xx ``"retry"``, other 4xx ``"never"``;
7. transient transport errors (``ConnectionError``, ``TimeoutError``, requests'
   ``ConnectionError``/``Timeout``, httpx's ``TransportError``, found by module name: no
   hard dependency): ``"retry"``;
8. business errors: :class:`NonRetryable` (subclass it for a business rejection),
   ``ValueError``, ``TypeError``, ``LookupError``, ``PermissionError``, Django's
   ``ValidationError``, ``PermissionDenied``, ``ObjectDoesNotExist``: ``"never"``;
9. anything else: ``"unknown"``, retried only with ``retry_unknown=True`` (default False).
"""

from __future__ import annotations

import asyncio
import email.utils
import functools
import inspect
import logging
import sys
import time
import types
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from asgiref.sync import iscoroutinefunction

from .. import signals
from .._checks import MAX_RETRIES, MAX_SECONDS, check_count, check_seconds, shown
from .._jitter import backoff_ceiling, full_jitter
from ..events import emit
from ..exceptions import ImproperlyConfigured, StepLockError

__all__ = [
    "RetryPolicy",
    "NonRetryable",
    "RetryDecision",
    "Decision",
    "classify",
    "is_async_callable",
    "retry_after_of",
    "http_status_of",
    "FIRST_ATTEMPT_HEADER",
]

#: The message header holding the wall-clock time (seconds since the epoch) of a task's first
#: attempt, for ``max_elapsed``.
FIRST_ATTEMPT_HEADER = "steplock_first_attempt"

#: The decisions of :meth:`RetryPolicy.decide` (``retry_policy_decided``'s ``decision``).
DECISIONS = ("retry", "give_up", "never")


class NonRetryable(Exception):
    """Base class of business errors that must never be retried (a rejected payment, a
    refused order): the dependency answered, and asking again gives the same answer."""

    retryable = False


_NEVER_BUILTIN = (
    NonRetryable,
    ValueError,
    TypeError,
    LookupError,
    PermissionError,
    NotImplementedError,
    AssertionError,
)
_NEVER_BY_NAME = (
    ("django.core.exceptions", "ValidationError"),
    ("django.core.exceptions", "PermissionDenied"),
    ("django.core.exceptions", "ObjectDoesNotExist"),
    ("django.core.exceptions", "SuspiciousOperation"),
)
_TRANSIENT_BUILTIN = (ConnectionError, TimeoutError)
_TRANSIENT_BY_NAME = (
    ("requests.exceptions", "ConnectionError"),
    ("requests.exceptions", "Timeout"),
    ("httpx", "TransportError"),
)
_CONTROL_BY_NAME = (
    ("celery.exceptions", "Retry"),
    ("celery.exceptions", "Ignore"),
    ("celery.exceptions", "Reject"),
)


def _loaded(pairs) -> tuple[type, ...]:
    """The classes of ``(module, name)`` pairs whose module is already imported."""
    found = []
    for module, name in pairs:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def is_async_callable(fn: Any) -> bool:
    """Whether calling ``fn`` gives a coroutine to await: a coroutine function (also a
    ``functools.partial`` of one, or one marked with asgiref's ``markcoroutinefunction``,
    as Django's decorators do), or an object whose class's ``__call__`` is one."""
    if type(fn) is types.FunctionType:  # the common case, fast: a plain def, unmarked
        if fn.__code__.co_flags & inspect.CO_COROUTINE:
            return True
        if not fn.__dict__:
            return False
    if iscoroutinefunction(fn):
        return True
    if isinstance(fn, (types.FunctionType, types.MethodType, types.BuiltinFunctionType, type)):
        return False
    return callable(fn) and iscoroutinefunction(type(fn).__call__)  # an async __call__


def is_control(exc: BaseException) -> bool:
    """Whether ``exc`` is the library's or Celery's control flow, not a dependency's error."""
    return isinstance(
        exc, (StepLockError, KeyboardInterrupt, SystemExit, *_loaded(_CONTROL_BY_NAME))
    )


def http_status_of(exc: BaseException) -> int | None:
    """The HTTP status an exception carries (``exc.response.status_code``,
    ``exc.status_code`` or ``exc.status``), or None."""
    response = getattr(exc, "response", None)
    for value in (
        getattr(response, "status_code", None),
        getattr(exc, "status_code", None),
        getattr(exc, "status", None),
    ):
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value
    return None


def _header(response: Any, name: str) -> Any:
    headers = getattr(response, "headers", None)
    if headers is None:
        return None
    try:
        return headers.get(name)
    except Exception:  # noqa: BLE001 - a headers object without get()
        return None


def retry_after_of(exc: BaseException, now: float | None = None) -> float | None:
    """Seconds the raiser asked to wait, or None: ``exc.retry_after`` (a number of seconds),
    else the ``Retry-After`` header of ``exc.response`` (delta-seconds or an HTTP date)."""
    value = getattr(exc, "retry_after", None)
    if value is None:
        value = _header(getattr(exc, "response", None), "Retry-After")
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return max(0.0, float(value)) if value == value else None
    text = str(value).strip()
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def classify(
    exc: BaseException,
    *,
    retry_on: tuple[type, ...] = (),
    never_retry: tuple[type, ...] = (),
    classifier: Callable[[BaseException], bool | None] | None = None,
) -> str:
    """``"control"``, ``"never"``, ``"retry"`` or ``"unknown"`` for ``exc`` (the rules of
    the module docstring)."""
    if is_control(exc):
        return "control"
    if never_retry and isinstance(exc, never_retry):
        return "never"
    if retry_on and isinstance(exc, retry_on):
        return "retry"
    if classifier is not None:
        verdict = classifier(exc)
        if verdict is not None:
            return "retry" if verdict else "never"
    flag = getattr(exc, "retryable", None)
    if isinstance(flag, bool):
        return "retry" if flag else "never"
    status = http_status_of(exc)
    if status is not None:
        if status in (408, 429) or status >= 500:
            return "retry"
        if 400 <= status < 500:
            return "never"
    if isinstance(exc, _TRANSIENT_BUILTIN + _loaded(_TRANSIENT_BY_NAME)):
        return "retry"
    if isinstance(exc, _NEVER_BUILTIN + _loaded(_NEVER_BY_NAME)):
        return "never"
    return "unknown"


@dataclass(frozen=True)
class RetryDecision:
    """What :meth:`RetryPolicy.decide` concluded: ``decision`` ("retry", "give_up",
    "never"), ``countdown`` (seconds before the next attempt; None unless "retry"),
    ``attempt`` (1-based number of the attempt that failed), ``kind`` (the classification),
    ``reason`` (why, in a few words), ``retry_after`` (what the raiser asked, seconds)."""

    decision: str
    countdown: float | None
    attempt: int
    kind: str
    reason: str
    retry_after: float | None = None


#: The former name of :class:`RetryDecision`, kept for one release.
Decision = RetryDecision


def _types(value: Any, name: str) -> tuple[type, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, (tuple, list, set, frozenset)) else (value,)
    for item in items:
        if not (isinstance(item, type) and issubclass(item, BaseException)):
            raise ImproperlyConfigured(
                f"RetryPolicy({name}=) must be exception types, got {shown(item)}",
                setting="retry_policy",
            )
    return tuple(items)


class RetryPolicy:
    """Exponential backoff with full jitter; see the module docstring.

    ``max_attempts`` (int >= 1, default 3: the first call and two retries), ``max_elapsed``
    (seconds from the first attempt after which no retry is started, None: no cap; default
    None), ``backoff`` (seconds, the base: attempt n waits uniform in
    ``[0, min(backoff_max, backoff * 2**(n-1))]``; default 1.0), ``backoff_max`` (seconds,
    default 60.0), ``jitter`` ("full", or None for the bare exponential), ``retry_on`` /
    ``never_retry`` (exception types), ``classifier`` (``exc -> True | False | None``),
    ``retry_unknown`` (retry what no rule knows; default False), ``honor_retry_after``
    (wait at least what the raiser asked; default True; a wait past ``max_elapsed`` gives
    up), ``sleep`` (the plain form's sleep function, default :func:`time.sleep`),
    ``asleep`` (the async form's, a coroutine function, default :func:`asyncio.sleep`:
    the event loop is never blocked), ``breaker`` (a
    :class:`~celery_steplock.patterns.breaker.CircuitBreaker` every plain attempt passes,
    sync or async: an open circuit raises CircuitOpen at once, without calling ``fn``, and
    is never retried in the plain form). Raises ImproperlyConfigured for a bad value.
    """

    def __init__(
        self,
        max_attempts: int = 3,
        max_elapsed: float | None = None,
        *,
        backoff: float = 1.0,
        backoff_max: float = 60.0,
        jitter: str | None = "full",
        retry_on: Any = None,
        never_retry: Any = None,
        classifier: Callable[[BaseException], bool | None] | None = None,
        retry_unknown: bool = False,
        honor_retry_after: bool = True,
        sleep: Callable[[float], Any] = time.sleep,
        breaker: Any = None,
        asleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ):
        self.max_attempts = check_count(
            max_attempts, "RetryPolicy(max_attempts=)", minimum=1, maximum=MAX_RETRIES
        )
        self.max_elapsed = check_seconds(max_elapsed, "RetryPolicy(max_elapsed=)", allow_none=True)
        self.backoff = check_seconds(backoff, "RetryPolicy(backoff=)", allow_zero=True)
        self.backoff_max = check_seconds(
            backoff_max, "RetryPolicy(backoff_max=)", allow_zero=True, maximum=MAX_SECONDS
        )
        if jitter not in ("full", None):
            raise ImproperlyConfigured(
                f"RetryPolicy(jitter=) must be 'full' or None, got {shown(jitter)}",
                setting="retry_policy",
            )
        self.jitter = jitter
        self.retry_on = _types(retry_on, "retry_on")
        self.never_retry = _types(never_retry, "never_retry")
        if classifier is not None and not callable(classifier):
            raise ImproperlyConfigured(
                f"RetryPolicy(classifier=) must be callable, got {shown(classifier)}",
                setting="retry_policy",
            )
        self.classifier = classifier
        self.retry_unknown = bool(retry_unknown)
        self.honor_retry_after = bool(honor_retry_after)
        self.sleep = sleep
        if not callable(asleep):
            raise ImproperlyConfigured(
                f"RetryPolicy(asleep=) must be a coroutine function, got {shown(asleep)}",
                setting="retry_policy",
            )
        self.asleep = asleep
        # Duck-typed: the breaker module sits above this one (it imports the classifier).
        if breaker is not None and not callable(getattr(breaker, "call", None)):
            raise ImproperlyConfigured(
                f"RetryPolicy(breaker=) must be a CircuitBreaker, got {shown(breaker)}",
                setting="retry_policy",
            )
        self.breaker = breaker

    def __repr__(self) -> str:
        return (
            f"RetryPolicy(max_attempts={self.max_attempts}, max_elapsed={self.max_elapsed}, "
            f"backoff={self.backoff}, backoff_max={self.backoff_max})"
        )

    # -- deciding ---------------------------------------------------------------------------

    def classify(self, exc: BaseException) -> str:
        """``"control"``, ``"never"``, ``"retry"`` or ``"unknown"`` (module docstring)."""
        return classify(
            exc, retry_on=self.retry_on, never_retry=self.never_retry, classifier=self.classifier
        )

    def countdown(self, attempt: int) -> float:
        """Seconds to wait after a failed attempt, before Retry-After.

        Args:
            attempt: the failed attempt (1-based).

        Returns:
            ``min(backoff_max, backoff * 2**(attempt - 1))``, or with ``jitter="full"`` a
            time drawn uniformly under it (:func:`celery_steplock._jitter.full_jitter`).
        """
        ceiling = backoff_ceiling(self.backoff, attempt - 1, self.backoff_max)
        return full_jitter(ceiling) if self.jitter == "full" else ceiling

    def decide(self, exc: BaseException, attempt: int, elapsed: float) -> RetryDecision:
        """Whether to retry after attempt ``attempt`` (1-based) failed with ``exc``,
        ``elapsed`` seconds after the first attempt started."""
        kind = self.classify(exc)
        if kind == "control":
            return RetryDecision("never", None, attempt, kind, "control flow")
        if kind == "never" or (kind == "unknown" and not self.retry_unknown):
            return RetryDecision(
                "never",
                None,
                attempt,
                kind,
                "non-retryable" if kind == "never" else "unknown error",
            )
        if attempt >= self.max_attempts:
            return RetryDecision("give_up", None, attempt, kind, "max_attempts reached")
        wait = self.countdown(attempt)
        asked = retry_after_of(exc) if self.honor_retry_after else None
        if asked is not None:
            wait = max(wait, asked)
        if self.max_elapsed is not None and elapsed + wait > self.max_elapsed:
            return RetryDecision("give_up", None, attempt, kind, "max_elapsed reached", asked)
        return RetryDecision("retry", wait, attempt, kind, "retryable", asked)

    def _announce(
        self, decision: RetryDecision, exc: BaseException, sender: Any = None, **fields: Any
    ) -> None:
        emit(
            signals.retry_policy_decided,
            sender,
            logging.INFO if decision.decision == "retry" else logging.WARNING,
            decision=decision.decision,
            reason=decision.reason,
            kind=decision.kind,
            attempt=decision.attempt,
            countdown=decision.countdown,
            retry_after=decision.retry_after,
            error=type(exc).__name__,
            **fields,
        )

    # -- the plain form ---------------------------------------------------------------------

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn(*args, **kwargs)``, retrying as decided, sleeping between attempts;
        returns its result or raises its last exception (CircuitOpen from ``breaker``).
        A coroutine function ``fn`` gets :meth:`acall`'s coroutine (await it)."""
        if is_async_callable(fn):
            return self.acall(fn, *args, **kwargs)
        return self._call(fn, args, kwargs, ())

    async def acall(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        """``await fn(*args, **kwargs)``, retrying as :meth:`call` decides (the same
        :meth:`decide`, :meth:`countdown` and ``retry_policy_decided`` signal), waiting with
        ``asleep`` (default :func:`asyncio.sleep`: the event loop is never blocked). Each
        attempt passes ``breaker`` (its :meth:`~celery_steplock.patterns.breaker.CircuitBreaker.acall`)
        when one is set; CircuitOpen is control flow, never retried.

        Returns:
            What ``fn`` returned.

        Raises:
            Exception: The last attempt's exception, at once for one that is not retried
                (non-retryable, unknown without ``retry_unknown``, control flow).
        """
        return await self._acall(fn, args, kwargs, ())

    def _through(self, fn: Callable[..., Any], breakers: tuple[Any, ...], method: str) -> Any:
        """``fn`` as an attempt calls it: through the breakers every attempt passes,
        outermost first (the decorators' above this policy's, ``@breaker`` over
        ``@policy``, then its own ``breaker``), each by its ``method`` (``"call"``, or
        ``"acall"`` for a coroutine function)."""
        chain = (*breakers, self.breaker) if self.breaker is not None else breakers
        for breaker in reversed(chain):
            fn = functools.partial(getattr(breaker, method), fn)
        return fn

    def _failed(self, exc: BaseException, attempt: int, started: float, fn: Any) -> RetryDecision:
        decision = self.decide(exc, attempt, time.monotonic() - started)
        if decision.kind != "control":
            self._announce(decision, exc, task_name=getattr(fn, "__qualname__", None))
        return decision

    def _call(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        breakers: tuple[Any, ...],
    ) -> Any:
        attempt_fn = self._through(fn, breakers, "call")
        started = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                return attempt_fn(*args, **kwargs)
            except Exception as exc:
                decision = self._failed(exc, attempt, started, fn)
                if decision.decision != "retry":
                    raise
            self.sleep(decision.countdown or 0.0)  # a "retry" decision always has one

    async def _acall(
        self,
        fn: Callable[..., Awaitable[Any]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        breakers: tuple[Any, ...],
    ) -> Any:
        attempt_fn: Callable[..., Awaitable[Any]] = self._through(fn, breakers, "acall")
        started = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                return await attempt_fn(*args, **kwargs)
            except Exception as exc:
                decision = self._failed(exc, attempt, started, fn)
                if decision.decision != "retry":
                    raise
            await self.asleep(decision.countdown or 0.0)

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator form of :meth:`call` (of :meth:`acall` for an ``async def``: the
        wrapper is a coroutine function). A circuit breaker decorating the result
        (``@breaker`` above ``@policy``) is passed by every attempt, as ``breaker`` is."""
        return _wrap(self, fn, ())

    # -- the task form ----------------------------------------------------------------------

    def retry_task(self, task: Any, exc: Exception) -> Any:
        """Called by :class:`~celery_steplock.task.StepLockedTask` with the exception that
        ended an execution: raises Celery's ``Retry`` (through ``task.retry``) when the
        exception is retried, else re-raises ``exc``."""
        request = task.request
        headers = dict(request.headers or {})
        first: Any = getattr(request, FIRST_ATTEMPT_HEADER, None) or headers.get(
            FIRST_ATTEMPT_HEADER
        )
        try:
            first = float(first)
        except (TypeError, ValueError):
            first = None
        now = time.time()
        if first is None:
            first = now
        attempt = int(request.retries or 0) + 1
        decision = self.decide(exc, attempt, max(0.0, now - first))
        if decision.kind == "control":
            raise exc
        self._announce(decision, exc, task, task_id=request.id, task_name=task.name)
        if decision.decision != "retry" or request.called_directly:
            raise exc
        headers[FIRST_ATTEMPT_HEADER] = repr(first)
        return task.retry(
            exc=exc,
            countdown=decision.countdown,
            max_retries=self.max_attempts - 1,
            headers=headers,
        )


def check_policy(value: Any, option: str = "retry_policy") -> RetryPolicy | None:
    """``value`` if it is None or a :class:`RetryPolicy`, else ImproperlyConfigured."""
    if value is None or isinstance(value, RetryPolicy):
        return value
    raise ImproperlyConfigured(
        f"{option}={shown(value)} must be a RetryPolicy(...) object", setting=option
    )


@dataclass(frozen=True, eq=False)
class _Composed:
    """What a :class:`RetryPolicy` decorator wraps: ``policy`` retrying ``fn`` through
    ``breakers`` (outermost first); ``wrapper`` the decorated function it describes (a copy
    of the attribute made by another decorator's ``functools.wraps`` is not it)."""

    policy: RetryPolicy
    fn: Callable[..., Any]
    breakers: tuple[Any, ...]
    wrapper: Callable[..., Any]

    def through(self, breaker: Any) -> Callable[..., Any]:
        """The decorated function with every attempt also passing ``breaker`` (outermost)."""
        return _wrap(self.policy, self.fn, (breaker, *self.breakers))


def _wrap(
    policy: RetryPolicy, fn: Callable[..., Any], breakers: tuple[Any, ...]
) -> Callable[..., Any]:
    """``fn`` decorated by ``policy``, every attempt passing ``breakers``: a coroutine
    function for a coroutine function."""
    wrapper: Callable[..., Any]
    if is_async_callable(fn):

        @functools.wraps(fn)
        async def awrapper(*args: Any, **kwargs: Any) -> Any:
            return await policy._acall(fn, args, kwargs, breakers)

        wrapper = awrapper
    else:

        @functools.wraps(fn)
        def swrapper(*args: Any, **kwargs: Any) -> Any:
            return policy._call(fn, args, kwargs, breakers)

        wrapper = swrapper
    marked: Any = wrapper
    marked.__steplock_retry__ = _Composed(policy, fn, breakers, wrapper)
    return wrapper
