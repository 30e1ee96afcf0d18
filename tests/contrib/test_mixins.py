"""LeaseFencedStep: the owner and fence columns the guard uses (contrib.django.mixins)."""

import pytest

from celery_steplock.contrib.django.mixins import LeaseFencedStep
from celery_steplock.contrib.django.steps import DjangoStepStore
from django_app.workflows.models import Step


def test_the_example_step_uses_the_mixin_columns():
    assert issubclass(Step, LeaseFencedStep) and LeaseFencedStep._meta.abstract
    owner = Step._meta.get_field("lock_owner")
    fence = Step._meta.get_field("lock_fence")
    assert (owner.max_length, owner.default, fence.null) == (64, "", True)
    guard = DjangoStepStore(Step)
    assert (guard.owner_field, guard.fence_field) == ("lock_owner", "lock_fence")


@pytest.mark.django_db(transaction=True)
def test_a_stale_fence_is_refused_through_the_mixin_columns():
    step = Step.objects.create(name="s")
    guard = DjangoStepStore(Step)
    assert guard.transition(step.pk, "pending", "running", owner="new", fence=9).applied
    stale = guard.transition(
        step.pk, "running", "done", owner="old", fence=3, raise_on_conflict=False
    )
    assert not stale.applied and stale.current == "running"
