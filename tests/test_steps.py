"""The step-store protocol and its factory (celery_steplock.steps): no database here, the
Django store has its own tests (tests/contrib/test_steps.py)."""

from __future__ import annotations

import pytest

from celery_steplock.exceptions import ImproperlyConfigured
from celery_steplock.steps import DEFAULT_STEP_STORE, StepStore, TransitionResult, load_step_store

pytestmark = pytest.mark.no_database  # runs once, in the SQLite pass


def test_the_factory_is_called_with_the_model_and_the_fields():
    calls = []

    def factory(model, **fields):
        calls.append((model, fields))
        return "a store"

    store = load_step_store(
        factory,
        "shop.Order",
        status_field="state",
        owner_field="o",
        fence_field="f",
        transitions={"a": ["b"]},
    )
    assert store == "a store"
    assert calls == [
        (
            "shop.Order",
            {
                "status_field": "state",
                "owner_field": "o",
                "fence_field": "f",
                "transitions": {"a": ["b"]},
            },
        )
    ]


def test_a_qualified_name_is_imported_and_a_bad_one_names_the_setting():
    store = load_step_store(
        "tests.test_steps:recording_factory",
        "m",
        status_field="s",
        owner_field="o",
        fence_field="f",
    )
    assert store == ("m", "s")
    with pytest.raises(ImproperlyConfigured) as info:
        load_step_store(
            "no_such_module.sub:Store", "m", status_field="s", owner_field="o", fence_field="f"
        )
    assert info.value.setting == "steplock_step_store" and "no_such_module" in str(info.value)
    with pytest.raises(ImproperlyConfigured) as info:
        load_step_store(42, "m", status_field="s", owner_field="o", fence_field="f")
    assert "factory" in str(info.value)


def recording_factory(model, *, status_field, **fields):
    return (model, status_field)


def test_the_default_names_the_django_store():
    assert DEFAULT_STEP_STORE == "celery_steplock.contrib.django.steps:DjangoStepStore"


def test_transition_result_is_truthy_when_applied():
    assert TransitionResult(True, 1, "a", "b")
    conflict = TransitionResult(False, 1, "a", "b", current="c")
    assert not conflict and conflict.current == "c"


def test_any_object_with_the_methods_is_a_step_store():
    class Memory:
        label, using = "memory.step", "memory"

        def status(self, step_id):
            return "pending"

        def step_ref(self, step_id):
            return f"memory.step:{step_id}"

        def transition(self, step_id, from_, to, **kw):
            return TransitionResult(True, step_id, from_, to)

        def set_deadline(self, seconds):
            return False

        def atomic(self):
            return None

        def on_commit(self, func):
            func()

        def check_not_nested(self, task_name):
            return None

        def is_lost_connection(self, exc):
            return False

        def is_lock_timeout(self, exc):
            return False

    assert isinstance(Memory(), StepStore)
    assert not isinstance(object(), StepStore)
