"""The retry policy (celery_steplock.patterns.retry): classification, backoff with full jitter,
Retry-After, the caps, the plain form through a circuit breaker (real Redis). The task form
with real workers is in test_breaker_workers.py."""

import email.utils
import time

import pytest

from celery_steplock.patterns.breaker import OPEN, CircuitBreaker
from celery_steplock.exceptions import CircuitOpen, ImproperlyConfigured, LockContended
from celery_steplock.patterns.retry import NonRetryable, RetryPolicy, classify, retry_after_of

pytestmark = pytest.mark.no_database  # runs once, in the SQLite pass


class Headers(dict):
    pass


class Response:
    def __init__(self, status, headers=None):
        self.status_code = status
        self.headers = Headers(headers or {})


class HTTPError(Exception):
    """Shaped as requests' / httpx's errors: the response on ``.response``."""

    def __init__(self, status, headers=None):
        super().__init__(f"HTTP {status}")
        self.response = Response(status, headers)


class ScriptedDependency:
    """A dependency answering with ``outcomes`` in turn (raising the exceptions), then "ok"."""

    def __init__(self, *outcomes):
        self.outcomes = list(outcomes)
        self.calls = 0

    def __call__(self):
        self.calls += 1
        outcome = self.outcomes.pop(0) if self.outcomes else "ok"
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def policy(**kwargs):
    slept = []
    kwargs.setdefault("backoff", 0.1)
    p = RetryPolicy(sleep=slept.append, **kwargs)
    return p, slept


@pytest.mark.parametrize(
    "exc,kind",
    [
        (ConnectionError(), "retry"),
        (TimeoutError(), "retry"),
        (HTTPError(500), "retry"),
        (HTTPError(503), "retry"),
        (HTTPError(408), "retry"),
        (HTTPError(429), "retry"),
        (HTTPError(400), "never"),
        (HTTPError(401), "never"),
        (HTTPError(403), "never"),
        (HTTPError(404), "never"),
        (HTTPError(409), "never"),
        (HTTPError(422), "never"),
        (ValueError(), "never"),
        (TypeError(), "never"),
        (KeyError(), "never"),
        (PermissionError(), "never"),
        (NonRetryable("declined"), "never"),
        (RuntimeError(), "unknown"),
        (Exception(), "unknown"),
        (LockContended("busy", key="k"), "control"),
        (CircuitOpen("x", retry_after=1), "control"),
    ],
)
def test_classification(exc, kind):
    assert classify(exc) == kind


def test_django_and_celery_exceptions_are_classified_by_name():
    from celery.exceptions import Ignore, Retry
    from django.core.exceptions import PermissionDenied, ValidationError

    assert classify(ValidationError("bad")) == classify(PermissionDenied()) == "never"
    assert classify(Retry()) == classify(Ignore()) == "control"


def test_the_raisers_flag_and_the_users_rules_come_first():
    flagged = RuntimeError("transient")
    flagged.retryable = True
    assert classify(flagged) == "retry"
    p = RetryPolicy(
        retry_on=(ValueError,),
        never_retry=(ConnectionError,),
        classifier=lambda exc: True if isinstance(exc, KeyError) else None,
    )
    assert p.classify(ValueError()) == "retry"
    assert p.classify(ConnectionError()) == "never"
    assert p.classify(KeyError()) == "retry"
    assert p.classify(TypeError()) == "never"


def test_retry_after_from_an_attribute_and_from_the_header():
    exc = ConnectionError()
    exc.retry_after = 7
    assert retry_after_of(exc) == 7.0
    assert retry_after_of(HTTPError(429, {"Retry-After": "12"})) == 12.0
    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 28 <= retry_after_of(HTTPError(503, {"Retry-After": when})) <= 30
    assert retry_after_of(HTTPError(503, {"Retry-After": "soon"})) is None
    assert retry_after_of(HTTPError(503)) is None


def test_retries_a_retryable_error_until_it_succeeds():
    p, slept = policy(max_attempts=5)
    fn = ScriptedDependency(ConnectionError(), HTTPError(503), "done")
    assert p.call(fn) == "done"
    assert fn.calls == 3 and len(slept) == 2
    assert 0 <= slept[0] <= 0.1 and 0 <= slept[1] <= 0.2  # full jitter under 0.1 * 2**n


def test_a_non_retryable_error_is_never_retried(events):
    p, slept = policy(max_attempts=5)
    for exc in (
        ValueError("bad input"),
        HTTPError(404),
        NonRetryable("declined"),
        PermissionError(),
    ):
        fn = ScriptedDependency(exc)
        with pytest.raises(type(exc)):
            p.call(fn)
        assert fn.calls == 1
    assert slept == []
    decided = [kw for name, kw in events if name == "retry_policy_decided"]
    assert [d["decision"] for d in decided] == ["never"] * 4


def test_unknown_errors_are_not_retried_unless_asked():
    p, _ = policy(max_attempts=3)
    fn = ScriptedDependency(RuntimeError(), "ok")
    with pytest.raises(RuntimeError):
        p.call(fn)
    assert fn.calls == 1
    p, _ = policy(max_attempts=3, retry_unknown=True)
    fn = ScriptedDependency(RuntimeError(), "ok")
    assert p.call(fn) == "ok" and fn.calls == 2


def test_max_attempts_caps_the_calls():
    p, slept = policy(max_attempts=3)
    fn = ScriptedDependency(*[ConnectionError()] * 10)
    with pytest.raises(ConnectionError):
        p.call(fn)
    assert fn.calls == 3 and len(slept) == 2


def test_retry_after_is_honoured_and_max_elapsed_gives_up():
    p, slept = policy(max_attempts=5)
    fn = ScriptedDependency(HTTPError(429, {"Retry-After": "2"}), "ok")
    assert p.call(fn) == "ok" and slept == [2.0]
    p, slept = policy(max_attempts=5, max_elapsed=1.0)
    fn = ScriptedDependency(HTTPError(429, {"Retry-After": "2"}), "ok")
    with pytest.raises(HTTPError):
        p.call(fn)
    assert fn.calls == 1 and slept == []
    assert p.decide(ConnectionError(), attempt=1, elapsed=1.2).decision == "give_up"
    bare = RetryPolicy(max_attempts=5, max_elapsed=1.0, backoff=0.1, jitter=None)
    assert bare.decide(ConnectionError(), attempt=1, elapsed=0.85).countdown == 0.1
    assert bare.decide(ConnectionError(), attempt=1, elapsed=0.95).decision == "give_up"


def test_the_backoff_is_exponential_and_capped():
    p = RetryPolicy(backoff=1.0, backoff_max=5.0, jitter=None)
    assert [p.countdown(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    jittered = RetryPolicy(backoff=1.0, backoff_max=5.0)
    draws = [jittered.countdown(3) for _ in range(200)]
    assert all(0 <= d <= 4.0 for d in draws) and max(draws) > 2.0 and min(draws) < 2.0


def test_retries_inside_the_breaker_never_call_an_open_dependency(redis_client):
    breaker = CircuitBreaker(
        "dep", failure_threshold=2, window=2, recovery_timeout=30, client=redis_client, prefix="t"
    )
    p, slept = policy(max_attempts=10, breaker=breaker)
    fn = ScriptedDependency(*[ConnectionError()] * 10)
    with pytest.raises(CircuitOpen):
        p.call(fn)
    assert fn.calls == 2 and len(slept) == 2  # opened by the 2nd attempt; the 3rd refused
    state = breaker.state()
    generation = state.generation
    assert state.state == OPEN
    with pytest.raises(CircuitOpen):  # more retries while OPEN: not failures
        p.call(fn)
    assert fn.calls == 2 and breaker.state().generation == generation


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"backoff": -1},
        {"jitter": "half"},
        {"retry_on": [3]},
        {"classifier": "x"},
        {"breaker": "payments"},
        {"max_elapsed": -2},
    ],
)
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ImproperlyConfigured):
        RetryPolicy(**kwargs)


class _Request:
    def __init__(self, retries=0, headers=None):
        self.retries, self.headers, self.id, self.called_directly = retries, headers, "t1", False


class _Task:
    """What retry_task reads of a Celery task, and a retry() that records its arguments."""

    name = "tests.retry.fake"

    def __init__(self, request):
        self.request = request
        self.retried = None

    def retry(self, **kwargs):
        self.retried = kwargs
        return "retried"


def test_the_task_form_carries_the_first_attempts_time_and_caps_elapsed():
    p = RetryPolicy(max_attempts=5, max_elapsed=60, backoff=0.1)
    task = _Task(_Request(retries=0, headers={"other": "kept"}))
    assert p.retry_task(task, ConnectionError()) == "retried"
    first = float(task.retried["headers"]["steplock_first_attempt"])
    assert abs(first - time.time()) < 5 and task.retried["headers"]["other"] == "kept"
    assert task.retried["max_retries"] == 4 and 0 <= task.retried["countdown"] <= 0.1
    late = _Task(_Request(retries=1, headers={"steplock_first_attempt": repr(time.time() - 61)}))
    with pytest.raises(ConnectionError):  # past max_elapsed: given up, not retried
        p.retry_task(late, ConnectionError())
    assert late.retried is None
    never = _Task(_Request())
    with pytest.raises(ValueError):
        p.retry_task(never, ValueError())
    assert never.retried is None
