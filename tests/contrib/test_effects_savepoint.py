"""An effect declared inside an inner ``transaction.atomic()``
block that rolls back (the body caught the IntegrityError, or any error, of that block) is
not written: its work did not commit, so neither does its effect. The ones declared outside
that block are written, their positions following each other (0, 1, ...)."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, transaction

from celery_steplock import effects
from celery_steplock.contrib.django.models import Effect
from celery_steplock.contrib.django.steps import guarded_step
from celery_steplock.task import StepLockedTask
from django_app.celery import app as celery_app
from django_app.workflows import tasks as _registers  # noqa: F401 - workflows.effect_seen
from django_app.workflows.models import Step

pytestmark = pytest.mark.django_db(transaction=True)


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.effects_savepoint.body",
    lock_key="step:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
)
def body(self, step_id):
    effects.call("workflows.effect_seen", "kept-0")
    try:
        with transaction.atomic():
            Step.objects.create(name="made in the savepoint")
            effects.call("workflows.effect_seen", "rolled-back")
            raise IntegrityError("duplicate key (the body catches it)")
    except IntegrityError:
        pass
    with transaction.atomic():  # a savepoint that commits: its effect stays
        effects.call("workflows.effect_seen", "kept-1")
    return self.lease.fence


@pytest.fixture
def effects_app(app, redis_client):
    app.conf.steplock_retry_backoff = 0.01
    return app


def payloads():
    return [r.payload["args"][0] for r in Effect.objects.order_by("position")]


def test_a_task_body_effect_in_a_rolled_back_savepoint_is_not_written(effects_app):
    step = Step.objects.create(name="s")
    fence = body.apply(args=[step.pk]).get()
    assert payloads() == ["kept-0", "kept-1"]
    assert sorted(Effect.objects.values_list("key", flat=True)) == [
        f"workflows.step:{step.pk}:{fence}:done:{n}" for n in range(2)
    ]
    assert not Step.objects.filter(name="made in the savepoint").exists()


def test_a_guarded_step_effect_in_a_rolled_back_savepoint_is_not_written(effects_app):
    step = Step.objects.create(name="s")
    with guarded_step(Step, step.pk, lock_name=f"step:{step.pk}", actor="t") as guarded:
        guarded.transition("pending", "done")
        try:
            with transaction.atomic():
                effects.call("workflows.effect_seen", "rolled-back")
                raise RuntimeError("the block's inner work failed")
        except RuntimeError:
            pass
        effects.call("workflows.effect_seen", "kept-0")
    assert payloads() == ["kept-0"]
    assert Effect.objects.get().position == 0
