"""The admission gates (celery_steplock.patterns.gates) around a real execution: entry order,
exit after COMMIT in reverse order, a denial re-queues without running the body, a replay
ends with the recorded result, a failing exit never masks the outcome. The gates here are a
test module of their own (``toy_gates``), the only ones in ``patterns.GATE_REGISTRY`` for
these tests."""

import sys
import types

import pytest
from celery.exceptions import Retry

from celery_steplock import patterns
from celery_steplock.patterns import gates as admission
from celery_steplock import plan as plan_module
from celery_steplock.exceptions import AdmissionDenied, ImproperlyConfigured, LockLost, RateLimited
from celery_steplock.task import StepLockedTask
from django_app.celery import app as celery_app
from django_app.workflows.models import Step

pytestmark = pytest.mark.django_db(transaction=True)

CALLS: list = []


class ToyGate:
    def __init__(self, option, behaviour):
        self.option = option
        self.behaviour = behaviour

    def enter(self, context):
        CALLS.append(
            (
                "enter",
                self.option,
                context.step_id,
                dict(context.arguments),
                context.lease is not None,
            )
        )
        if self.behaviour == "deny":
            raise RateLimited("toy: no quota", retry_after=2.5, option=self.option)
        if self.behaviour == "replay":
            raise admission.Replay({"replayed": True}, gate=self.option)
        if self.behaviour == "lose":  # the gate outlasted the lease (a slow Redis)
            context.lease.mark_lost("toy: the gate took longer than the lease")
        gate = self

        class Passed:
            def exit(self, exc, result):
                status = Step.objects.get(pk=context.step_id).status
                CALLS.append(
                    ("exit", gate.option, type(exc).__name__ if exc else None, result, status)
                )
                if gate.behaviour == "exit_fails":
                    raise RuntimeError("exit broke")

        return Passed()


def _gate_module(name, option):
    module = types.ModuleType(name)
    module.OPTIONS = frozenset({option})

    def gate(task, settings):
        value = getattr(task, option, None)
        if value is None:
            return None
        if value not in ("pass", "deny", "replay", "exit_fails", "lose"):
            raise ImproperlyConfigured(f"{option}={value!r} is not a toy", setting=option)
        return ToyGate(option, value)

    module.gate = gate
    return module


@pytest.fixture
def toy_gates(monkeypatch, app):  # app: the lease store on the session's Redis
    for name, option in (("toy_gates_first", "toy_first"), ("toy_gates_second", "toy_second")):
        monkeypatch.setitem(sys.modules, name, _gate_module(name, option))
    toys = {
        "toy_first": ("toy_gates_first", frozenset({"toy_first"})),
        "toy_second": ("toy_gates_second", frozenset({"toy_second"})),
    }
    # The plan's option names follow the registry (a new one, a new version).
    monkeypatch.setattr(patterns, "GATE_REGISTRY", toys)
    CALLS.clear()
    yield
    CALLS.clear()


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.admitted",
    lock_key="adm:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
    lock_retry_max=0,
)
def admitted(self, step_id, fail=False):
    CALLS.append(("body", step_id))
    if fail:
        raise ValueError("body failed")
    return "ran"


def _run(task, step_id, first, second, **kwargs):
    task.toy_first, task.toy_second = first, second
    try:
        return task.apply(args=(step_id,), kwargs=kwargs)
    finally:
        del task.toy_first, task.toy_second


def test_gates_enter_in_order_and_exit_in_reverse_after_commit(toy_gates):
    step = Step.objects.create(status="pending")
    result = _run(admitted, step.pk, "pass", "pass")
    assert result.get() == "ran"
    assert CALLS == [
        ("enter", "toy_first", step.pk, {"step_id": step.pk, "fail": False}, True),
        ("enter", "toy_second", step.pk, {"step_id": step.pk, "fail": False}, True),
        ("body", step.pk),
        ("exit", "toy_second", None, "ran", "done"),  # after COMMIT: the row says done
        ("exit", "toy_first", None, "ran", "done"),
    ]


def test_a_denial_exits_the_entered_gates_and_never_runs_the_body(toy_gates):
    step = Step.objects.create(status="pending")
    result = _run(admitted, step.pk, "pass", "deny")
    assert isinstance(result.result, RateLimited)  # lock_retry_max=0: the budget is used up
    assert result.result.retry_after == 2.5 and result.result.option == "toy_second"
    assert [c[:3] for c in CALLS] == [
        ("enter", "toy_first", step.pk),
        ("enter", "toy_second", step.pk),
        ("exit", "toy_first", "RateLimited"),
    ]
    assert CALLS[-1][3] is admission.NOT_RUN
    assert Step.objects.get(pk=step.pk).status == "pending"


def test_a_denial_re_queues_with_a_countdown_past_retry_after(toy_gates, monkeypatch):
    step = Step.objects.create(status="pending")
    countdowns = []
    real = StepLockedTask.steplock_retry

    def spy(self, exc, headers=None, countdown=None):
        countdowns.append(countdown)
        return real(self, exc, headers=headers, countdown=countdown)

    monkeypatch.setattr(StepLockedTask, "steplock_retry", spy)
    admitted.lock_retry_max = 2
    try:
        result = _run(admitted, step.pk, "deny", None)
    finally:
        del admitted.lock_retry_max
    assert isinstance(result.result, RateLimited)
    assert len(countdowns) == 3  # two re-queues, then the budget is used up
    assert all(2.5 <= c <= 5.0 for c in countdowns)
    assert not [c for c in CALLS if c[0] == "body"]


def test_a_lease_lost_in_the_gates_never_runs_the_body(toy_gates):
    step = Step.objects.create(status="pending")
    result = _run(admitted, step.pk, "pass", "lose")
    assert isinstance(result.result, LockLost)  # lock_retry_max=0: no retry left
    assert [c[:3] for c in CALLS if c[0] != "exit"] == [
        ("enter", "toy_first", step.pk),
        ("enter", "toy_second", step.pk),
    ]
    assert [c[:3] for c in CALLS if c[0] == "exit"] == [
        ("exit", "toy_second", "LockLost"),
        ("exit", "toy_first", "LockLost"),
    ]
    assert Step.objects.get(pk=step.pk).status == "pending"


def test_a_replay_ends_with_its_result_without_the_body(toy_gates):
    step = Step.objects.create(status="pending")
    result = _run(admitted, step.pk, "pass", "replay")
    assert result.get() == {"replayed": True}
    assert [c[:2] for c in CALLS] == [
        ("enter", "toy_first"),
        ("enter", "toy_second"),
        ("exit", "toy_first"),
    ]
    assert Step.objects.get(pk=step.pk).status == "pending"


def test_a_body_error_reaches_every_exit_and_stays_the_outcome(toy_gates):
    step = Step.objects.create(status="pending")
    result = _run(admitted, step.pk, "exit_fails", "pass", fail=True)
    assert isinstance(result.result, ValueError)
    exits = [c for c in CALLS if c[0] == "exit"]
    assert exits == [
        ("exit", "toy_second", "ValueError", None, "pending"),
        ("exit", "toy_first", "ValueError", None, "pending"),
    ]


def test_a_failing_exit_is_logged_and_never_masks_success(toy_gates, caplog):
    step = Step.objects.create(status="pending")
    result = _run(admitted, step.pk, "exit_fails", None)
    assert result.get() == "ran"
    assert [r for r in caplog.records if "admission_exit_failed" in r.getMessage()]


def test_gate_options_are_plan_options_and_bad_values_name_the_option(toy_gates):
    assert {"toy_first", "toy_second"} <= plan_module.OPTION_NAMES
    admitted.toy_first = "nonsense"
    try:
        problems = plan_module.option_problems(admitted)
    finally:
        del admitted.toy_first
    assert [p.setting for p in problems] == ["toy_first"]
    assert "tests.admitted: toy_first='nonsense' is not a toy" in str(problems[0])


def test_admission_denied_is_retryable_and_carries_its_figures():
    from celery_steplock.exceptions import RETRYABLE_ERRORS

    exc = AdmissionDenied("x", retry_after=-1, option="o", key="k", limit="10/s", extra=1)
    assert isinstance(exc, RETRYABLE_ERRORS)
    assert (exc.retry_after, exc.option, exc.key, exc.limit, exc.context) == (
        0.0,
        "o",
        "k",
        "10/s",
        {"extra": 1},
    )
    assert Retry  # the eager path never surfaces celery's Retry (apply() loop)
