"""The circuit_breaker gate and the retry_policy option on StepLockedTask executions (eager,
real Redis and database): the gate's exit records the body's outcome after COMMIT, an open
breaker re-queues without running the body, a refusal by a later gate gives the probe permit
back, bad values are named by the checks, and the retry policy retries through Celery."""

import pytest

from celery_steplock import patterns
from celery_steplock.patterns import gates as admission
from celery_steplock import plan as plan_module
from celery_steplock.patterns.breaker import (
    CLOSED,
    OPEN,
    BreakerGate,
    CircuitBreaker,
    forget_cached_states,
)
from celery_steplock.exceptions import CircuitOpen, RateLimited
from celery_steplock.patterns.retry import RetryPolicy
from celery_steplock.task import StepLockedTask
from django_app.celery import app as celery_app
from django_app.workflows.models import Step

pytestmark = pytest.mark.django_db(transaction=True)

CALLS = []

GUARDED = CircuitBreaker("tasks-dep", failure_threshold=2, window=2, recovery_timeout=30)
RETRYING = CircuitBreaker("tasks-retry", failure_threshold=10, window=10)


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.breaker.guarded",
    lock_key="brk-task:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
    lock_retry_max=0,
    circuit_breaker=GUARDED,
)
def guarded(self, step_id, fail=None):
    CALLS.append(step_id)
    if fail == "down":
        raise ConnectionError("dependency down")
    if fail == "rejected":
        raise ValueError("rejected")
    return "ran"


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.breaker.retrying",
    lock_key="brk-retrying:{n}",
    circuit_breaker=RETRYING,
    retry_policy=RetryPolicy(max_attempts=3, backoff=0.01),
)
def retrying(self, n, error="down"):
    CALLS.append(n)
    raise ConnectionError("down") if error == "down" else ValueError("rejected")


@pytest.fixture(autouse=True)
def clean(app, redis_client):
    CALLS.clear()
    forget_cached_states()  # Redis was flushed: what this process cached is gone too
    yield
    CALLS.clear()


def test_the_gate_is_registered_in_its_slot():
    assert "celery_steplock.patterns.breaker" in patterns.GATES
    assert {"circuit_breaker", "retry_policy"} <= plan_module.OPTION_NAMES
    assert [type(g) for g in guarded.steplock_plan.gates] == [BreakerGate]


def test_failures_of_the_body_open_it_and_then_the_body_never_runs(redis_client):
    steps = [Step.objects.create(status="pending") for _ in range(3)]
    for step in steps[:2]:
        assert isinstance(guarded.apply(args=(step.pk, "down")).result, ConnectionError)
    assert GUARDED.state().state == OPEN
    result = guarded.apply(args=(steps[2].pk,))
    assert isinstance(result.result, CircuitOpen)  # lock_retry_max=0: not re-queued
    assert 29 < result.result.retry_after <= 30
    assert CALLS == [steps[0].pk, steps[1].pk]
    assert Step.objects.get(pk=steps[2].pk).status == "pending"


def test_a_success_after_commit_and_a_business_error_are_not_failures():
    first = Step.objects.create(status="pending")
    assert isinstance(guarded.apply(args=(first.pk, "down")).result, ConnectionError)
    step = Step.objects.create(status="pending")
    assert guarded.apply(args=(step.pk,)).get() == "ran"
    assert Step.objects.get(pk=step.pk).status == "done"
    other = Step.objects.create(status="pending")
    assert isinstance(guarded.apply(args=(other.pk, "rejected")).result, ValueError)
    state = GUARDED.state()
    assert (state.state, state.failures, state.calls) == (CLOSED, 0, 2)  # window of 2


def test_a_later_gates_refusal_gives_the_probe_permit_back(redis_client):
    breaker = CircuitBreaker(
        "tasks-probe", failure_threshold=1, window=1, recovery_timeout=0.01, app=celery_app
    )
    with pytest.raises(ConnectionError):
        breaker.call(lambda: (_ for _ in ()).throw(ConnectionError()))
    import time

    time.sleep(0.03)
    gate = BreakerGate(breaker, "fail_closed")
    admitted = gate.enter(
        admission.AdmissionContext(task=guarded, plan=None, arguments={}, lease=None)
    )
    assert breaker.state().probes == 1
    admitted.exit(RateLimited("later gate", retry_after=1), admission.NOT_RUN)
    assert breaker.state().probes == 0 and breaker.state().calls == 0


def test_a_retryable_error_is_retried_through_celery_up_to_max_attempts():
    result = retrying.apply(args=(1,))
    assert isinstance(result.result, ConnectionError)
    assert CALLS == [1, 1, 1]
    assert RETRYING.state().failures == 3  # each attempt passed the breaker


def test_a_non_retryable_error_is_not_retried():
    result = retrying.apply(args=(2, "rejected"))
    assert isinstance(result.result, ValueError)
    assert CALLS == [2]


@pytest.mark.parametrize(
    "option,value,fragment",
    [
        ("circuit_breaker", 42, "circuit_breaker=42 must be a dependency name"),
        ("circuit_breaker", "", "circuit_breaker=''"),
        ("retry_policy", {"max_attempts": 3}, "must be a RetryPolicy"),
    ],
)
def test_bad_values_are_named_by_the_checks(option, value, fragment):
    setattr(guarded, option, value)
    try:
        problems = plan_module.option_problems(guarded)
    finally:
        guarded.__dict__.pop(option, None)
    assert [p.setting for p in problems] == [option]
    assert fragment in str(problems[0])


def test_a_bad_retry_policy_fails_the_execution_with_its_own_error():
    """The option's check, not an AttributeError of the retry hook, is the outcome."""
    from celery_steplock.exceptions import ImproperlyConfigured

    guarded.retry_policy = 5
    try:
        result = guarded.apply(args=(Step.objects.create(status="pending").pk,))
    finally:
        guarded.__dict__.pop("retry_policy", None)
    assert isinstance(result.result, ImproperlyConfigured)
    assert result.result.setting == "retry_policy"
    assert "must be a RetryPolicy" in str(result.result)
    assert CALLS == []
