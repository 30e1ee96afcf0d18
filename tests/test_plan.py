"""The execution plan (celery_steplock.plan): resolved once per (task, configuration
version), rebuilt on a change, every invalid option reported."""

from __future__ import annotations

import itertools

import pytest
from celery import Celery

from celery_steplock import StepLockedTask
from celery_steplock.contrib.django.steps import DjangoStepStore
from celery_steplock.exceptions import ImproperlyConfigured
from celery_steplock.lock import get_lease_store
from celery_steplock.plan import ExecutionPlan, build_plan, option_problems

_names = itertools.count()


def make_task(app=None, **options):
    app = app or Celery(f"plan{next(_names)}", set_as_current=False)
    app.conf.broker_url = "redis://127.0.0.1:6379/0"

    def body(self, step_id):
        return step_id

    return app.task(
        bind=True, base=StepLockedTask, name=f"plan.task{next(_names)}", shared=False, **options
    )(body)


def test_plan_defaults_come_from_the_settings():
    task = make_task()
    task.app.conf.steplock_default_ttl = 12.0
    plan = task.steplock_plan
    assert isinstance(plan, ExecutionPlan)
    assert (
        plan.ttl,
        plan.wait,
        plan.max_hold,
        plan.on_contended,
        plan.on_conflict,
        plan.on_store_error,
        plan.precheck,
        plan.retry_max,
    ) == (12.0, 0.0, None, "retry", "return", "fail_closed", True, None)
    assert plan.renew_ms == 4000 and plan.steps is None
    assert plan.store is get_lease_store(task.app)


def test_the_plan_is_kept_while_nothing_changes():
    task = make_task(lock_ttl=5)
    first = task.steplock_plan
    assert task.steplock_plan is first and task.steplock_plan is first


def test_a_configuration_change_rebuilds_the_plan():
    task = make_task()
    first = task.steplock_plan
    task.app.conf.steplock_default_ttl = 9.0
    second = task.steplock_plan
    assert second is not first and second.ttl == 9.0
    assert task.steplock_plan is second


def test_assigning_an_option_rebuilds_the_plan():
    task = make_task(lock_ttl=5)
    first = task.steplock_plan
    task.lock_ttl = 6
    assert task.steplock_plan.ttl == 6.0 and task.steplock_plan is not first
    task.some_other_attribute = 1  # not an option: the plan stays
    kept = task.steplock_plan
    task.some_other_attribute = 2
    assert task.steplock_plan is kept


@pytest.mark.django_db
def test_the_step_store_is_built_once_with_the_settings_fields():
    task = make_task(
        step_model="workflows.Step",
        step_id_arg="step_id",
        transition=("pending", "done"),
        step_transitions={"pending": ["done"]},
    )
    plan = task.steplock_plan
    assert isinstance(plan.steps, DjangoStepStore)
    assert (plan.steps.status_field, plan.steps.owner_field, plan.steps.fence_field) == (
        "status",
        "lock_owner",
        "lock_fence",
    )
    assert plan.steps.transitions == {"pending": frozenset({"done"})}
    assert plan.transition == ("pending", "done")
    assert task.steplock_plan.steps is plan.steps


def test_the_step_store_factory_is_named_by_a_setting():
    built = []

    def factory(model, **fields):
        built.append((model, fields))
        return "store"

    task = make_task(step_model="any.Model")
    task.app.conf.steplock_step_store = factory
    assert task.steplock_plan.steps == "store"
    assert built == [
        (
            "any.Model",
            {
                "status_field": "status",
                "owner_field": "lock_owner",
                "fence_field": "lock_fence",
                "transitions": None,
            },
        )
    ]


def test_a_step_store_that_cannot_be_imported_names_the_setting():
    task = make_task(step_model="any.Model")
    task.app.conf.steplock_step_store = "no_such_package.steps:Store"
    with pytest.raises(ImproperlyConfigured) as info:
        build_plan(task)
    assert info.value.setting == "steplock_step_store"
    assert str(info.value).startswith(f"{task.name}: steplock_step_store=")


def test_build_plan_raises_the_first_problem_naming_the_task():
    task = make_task(lock_ttl=-1, on_contended="wait")
    with pytest.raises(ImproperlyConfigured) as info:
        task.steplock_plan
    assert info.value.setting == "lock_ttl" and str(info.value).startswith(f"{task.name}: ")


def test_option_problems_lists_every_invalid_option():
    task = make_task(
        lock_ttl=-1,
        on_contended="wait",
        lock_precheck="no",
        lock_retry_max=-2,
        transition=("pending",),
    )
    found = option_problems(task, models_ready=False)
    assert [p.setting for p in found] == [
        "lock_ttl",
        "on_contended",
        "transition",
        "lock_precheck",
        "lock_retry_max",
    ]
    assert all(str(p).startswith(f"{task.name}: ") for p in found)
    assert option_problems(make_task(lock_ttl=3), models_ready=False) == []


def test_old_names_warn_and_still_work():
    import celery_steplock
    from celery_steplock import lock, task as task_module
    from celery_steplock.lock import RedisLeaseStore, get_lease_store

    with pytest.warns(DeprecationWarning, match="RedisLeaseStore"):
        assert celery_steplock.RedisStepLock is RedisLeaseStore
    with pytest.warns(DeprecationWarning, match="get_lease_store"):
        assert lock.get_lock is get_lease_store
    with pytest.warns(DeprecationWarning, match="get_lease_store"):
        assert task_module.get_lock is get_lease_store
    task = make_task(lock_ttl=4)
    with pytest.warns(DeprecationWarning, match="steplock_plan"):
        assert task.steplock_options() is task.steplock_plan
    with pytest.warns(DeprecationWarning, match="validate.problems"):
        assert task_module.validate_app(task.app) == []


def test_class_level_changes_deletion_and_mock_restores_rebuild_the_plan():
    from unittest import mock

    task = make_task(lock_ttl=30.0)
    assert task.steplock_plan.ttl == 30.0
    with mock.patch.object(task, "lock_ttl", 1.0):
        assert task.steplock_plan.ttl == 1.0
    assert task.steplock_plan.ttl == 30.0  # mock restored the class value with delattr
    task.__class__.lock_ttl = 12.0  # the class (``task`` is a proxy until the app finalizes)
    assert task.steplock_plan.ttl == 12.0
    task.lock_ttl = 11.0
    assert task.steplock_plan.ttl == 11.0
    del task.lock_ttl
    assert task.steplock_plan.ttl == 12.0


def test_options_checked_against_the_signature_and_the_transition_table():
    found = option_problems(
        make_task(step_id_arg="orderid", lock_key="x:{nope}"), models_ready=False
    )
    assert [(p.setting, "orderid" in str(p) or "'nope'" in str(p)) for p in found] == [
        ("lock_key", True),
        ("step_id_arg", True),
    ]
    found = option_problems(
        make_task(
            step_model="workflows.Step",
            step_id_arg="step_id",
            transition=("pending", "done"),
            step_transitions={"pending": ["running"]},
        ),
        models_ready=False,
    )
    assert [p.setting for p in found] == ["step_transitions"]
    assert "'pending' -> 'done' is not allowed" in str(found[0])
    for table in (["pending"], {"pending": "done"}):
        [problem] = option_problems(make_task(step_transitions=table), models_ready=False)
        assert problem.setting == "step_transitions"
    [problem] = option_problems(
        make_task(step_model="workflows.Step", step_id_arg="step_id", transition="pending->done"),
        models_ready=False,
    )
    assert problem.setting == "transition" and "'pending->done'" in str(problem)
    assert (
        option_problems(
            make_task(lock_key="s:{step_id}", step_id_arg="step_id"), models_ready=False
        )
        == []
    )


def test_a_package_alias_warns_once_at_the_caller():
    import warnings

    import celery_steplock

    celery_steplock.__dict__.pop("get_lock", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from celery_steplock import get_lock  # noqa: F401
    assert [w.filename for w in caught] == [__file__]
