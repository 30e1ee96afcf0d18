"""The retry policy's async form (celery_steplock.patterns.retry: ``acall``, ``@policy`` on
``async def``): attempts and decisions as the sync form's, waits with asyncio.sleep (the
event loop runs on: a loop-lag probe), a non-retryable error raised after one attempt, and
the composition with the circuit breaker (retries inside it: every attempt admitted by it,
its refusal never retried), sync and async, against a real redis-server."""

import asyncio
import inspect
import time

import pytest

from celery_steplock.exceptions import CircuitOpen
from celery_steplock.patterns.breaker import OPEN, CircuitBreaker
from celery_steplock.patterns.retry import NonRetryable, RetryPolicy, classify
from tests.support.loop import LagProbe

pytestmark = [
    pytest.mark.no_database,  # runs once, in the SQLite pass
    pytest.mark.usefixtures("no_cached_breaker_states"),
]


class Dependency:
    """Fails with ``outcomes`` in turn (exceptions raised), then answers "ok"; async."""

    def __init__(self, *outcomes):
        self.outcomes = list(outcomes)
        self.calls = 0
        self.started: list[float] = []

    async def __call__(self, *args, **kwargs):
        self.calls += 1
        self.started.append(time.monotonic())
        await asyncio.sleep(0)
        if self.outcomes:
            raise self.outcomes.pop(0)
        return ("ok", args, kwargs)


def decisions(events):
    return [kw["decision"] for name, kw in events if name == "retry_policy_decided"]


def test_async_attempts_are_counted_and_retried_as_decided(events):
    policy = RetryPolicy(max_attempts=4, backoff=0.01, backoff_max=0.02)
    dependency = Dependency(ConnectionError("a"), TimeoutError("b"))
    decorated = policy(dependency)
    assert inspect.iscoroutinefunction(decorated)
    assert asyncio.run(decorated(1, k=2)) == ("ok", (1,), {"k": 2})
    assert dependency.calls == 3
    assert decisions(events) == ["retry", "retry"]
    attempts = [kw["attempt"] for name, kw in events if name == "retry_policy_decided"]
    assert attempts == [1, 2]


def test_async_gives_up_after_max_attempts(events):
    policy = RetryPolicy(max_attempts=3, backoff=0.0)
    dependency = Dependency(*[ConnectionError("down")] * 5)
    with pytest.raises(ConnectionError):
        asyncio.run(policy.acall(dependency))
    assert dependency.calls == 3
    assert decisions(events) == ["retry", "retry", "give_up"]


def test_the_backoff_waits_with_asyncio_sleep_and_never_blocks_the_loop():
    policy = RetryPolicy(max_attempts=2, backoff=0.5, jitter=None)
    assert policy.countdown(1) == 0.5
    dependency = Dependency(ConnectionError("down"))

    async def main():
        async with LagProbe() as probe:
            await asyncio.sleep(0.02)
            return await policy.acall(dependency), probe

    answer, probe = asyncio.run(main())
    assert answer[0] == "ok"
    assert dependency.calls == 2
    gap = dependency.started[1] - dependency.started[0]
    assert 0.5 <= gap < 0.6
    assert probe.ticks >= 40  # the loop ran the probe all along the backoff
    assert probe.max_lag < 0.05, probe.max_lag


def test_a_cancelled_backoff_stops_the_retries():
    policy = RetryPolicy(max_attempts=5, backoff=5.0, jitter=None)
    dependency = Dependency(*[ConnectionError("down")] * 5)

    async def main():
        task = asyncio.ensure_future(policy.acall(dependency))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    started = time.monotonic()
    asyncio.run(main())
    assert dependency.calls == 1 and time.monotonic() - started < 1.0


@pytest.mark.parametrize(
    "error", [ValueError("bad"), NonRetryable("declined"), PermissionError("no")]
)
def test_a_non_retryable_error_is_raised_at_once_after_one_attempt(error, events):
    policy = RetryPolicy(max_attempts=5, backoff=1.0, retry_unknown=True)
    dependency = Dependency(error, error)
    started = time.monotonic()
    with pytest.raises(type(error)):
        asyncio.run(policy.acall(dependency))
    assert dependency.calls == 1 and time.monotonic() - started < 0.5
    assert decisions(events) == ["never"]


def test_circuit_open_is_control_flow_never_retried_by_either_form():
    refusal = CircuitOpen("open", retry_after=1.0, option="circuit_breaker")
    policy = RetryPolicy(max_attempts=5, retry_unknown=True, retry_on=(Exception,))
    assert classify(refusal) == "control"
    assert policy.decide(refusal, 1, 0.0).decision == "never"
    calls = []

    def sync_refused():
        calls.append("sync")
        raise refusal

    async def async_refused():
        calls.append("async")
        raise refusal

    with pytest.raises(CircuitOpen):
        policy.call(sync_refused)
    with pytest.raises(CircuitOpen):
        asyncio.run(policy.acall(async_refused))
    assert calls == ["sync", "async"]


def make_breaker(client):
    return CircuitBreaker(
        "dep", failure_threshold=2, window=2, recovery_timeout=30, client=client, prefix="t"
    )


@pytest.mark.parametrize("order", ["breaker_outside", "policy_outside", "policy_option"])
def test_async_retries_inside_the_breaker_never_call_an_open_dependency(
    order, redis_client, events
):
    breaker = make_breaker(redis_client)
    dependency = Dependency(*[ConnectionError("down")] * 10)
    if order == "breaker_outside":
        guarded = breaker(RetryPolicy(max_attempts=10, backoff=0.0)(dependency))
    elif order == "policy_outside":
        guarded = RetryPolicy(max_attempts=10, backoff=0.0)(breaker(dependency))
    else:
        guarded = RetryPolicy(max_attempts=10, backoff=0.0, breaker=breaker)(dependency)
    assert inspect.iscoroutinefunction(guarded)
    with pytest.raises(CircuitOpen):
        asyncio.run(guarded())
    # Opened by the 2nd attempt; the 3rd refused by the breaker, not retried.
    assert dependency.calls == 2
    assert decisions(events) == ["retry", "retry"]
    state = breaker.state()
    assert (state.state, state.generation) == (OPEN, 1)
    with pytest.raises(CircuitOpen):  # more calls while OPEN: refused, not failures
        asyncio.run(guarded())
    assert dependency.calls == 2 and breaker.state().generation == state.generation


def test_sync_breaker_over_policy_admits_every_attempt(redis_client):
    breaker = make_breaker(redis_client)
    calls = []

    @breaker
    @RetryPolicy(max_attempts=10, backoff=0.0)
    def charge():
        calls.append(1)
        raise ConnectionError("down")

    with pytest.raises(CircuitOpen):
        charge()
    assert len(calls) == 2 and breaker.state().state == OPEN


def test_a_success_after_retries_is_recorded_once_per_attempt(redis_client):
    breaker = CircuitBreaker(
        "dep", failure_threshold=3, window=5, client=redis_client, prefix="t", state_cache=0
    )
    dependency = Dependency(ConnectionError("a"), ConnectionError("b"))

    @breaker
    @RetryPolicy(max_attempts=3, backoff=0.0)
    async def call_payment_api(amount):
        return await dependency(amount)

    assert asyncio.run(call_payment_api(10))[0] == "ok"
    state = breaker.state()
    # two failed attempts and one success, each admitted and recorded
    assert (state.state, state.failures, state.calls) == ("closed", 2, 3)
