"""``delay_on_commit()`` / ``apply_async_on_commit()`` on ``base=StepLockedTask``: kept when the
app's task class is Celery's ``DjangoTask`` (a Django project on Celery 5.4+, as the example
project), published once the step database's transaction commits and never after a rollback.
Messages are counted on the real Redis broker's queue."""

from __future__ import annotations

import itertools
import json

import pytest
from celery import Celery
from celery.contrib.django.task import DjangoTask
from django.db import transaction

from celery_steplock import StepLockedTask
from celery_steplock.contrib.django.task import DjangoStepLockedTask

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "other"])

_names = itertools.count()


def register(app, **options):
    @app.task(
        bind=True,
        base=StepLockedTask,
        name=f"on_commit.task{next(_names)}",
        shared=False,
        **options,
    )
    def job(self, pk):
        return pk

    return job


def queued(redis_client):
    """The task names and arguments of the messages on the default queue, oldest first."""
    messages = [json.loads(raw) for raw in reversed(redis_client.lrange("celery", 0, -1))]
    return [(m["headers"]["task"], m["headers"]["argsrepr"]) for m in messages]


def test_the_example_projects_task_class_is_celerys_django_task(app):
    assert issubclass(app.Task, DjangoTask)


def test_step_locked_task_publishes_on_commit_only(app, redis_client):
    job = register(app)
    assert isinstance(job, StepLockedTask) and not isinstance(job, DjangoTask)
    with transaction.atomic():
        job.delay_on_commit(1)
        job.apply_async_on_commit(args=(2,))
        assert queued(redis_client) == []  # inside the transaction: nothing published
    assert queued(redis_client) == [(job.name, "(1,)"), (job.name, "(2,)")]


def test_nothing_is_published_after_a_rollback(app, redis_client):
    job = register(app)
    with pytest.raises(ZeroDivisionError):
        with transaction.atomic():
            job.delay_on_commit(3)
            1 / 0
    assert queued(redis_client) == []
    job.delay_on_commit(4)  # outside a transaction: at once
    assert queued(redis_client) == [(job.name, "(4,)")]


def test_it_waits_for_the_step_databases_commit(app, redis_client):
    """As DjangoStepLockedTask: the step model's write database (routing.Parcel: "other")."""
    job = register(app, step_model="routing.Parcel", step_id_arg="pk")
    with transaction.atomic(using="other"):
        job.delay_on_commit(5)
        assert queued(redis_client) == []
    assert queued(redis_client) == [(job.name, "(5,)")]
    with transaction.atomic(using="default"):  # not the step's database: published at once
        job.delay_on_commit(6)
        assert queued(redis_client) == [(job.name, "(5,)"), (job.name, "(6,)")]


def test_an_app_whose_task_class_is_not_djangos_has_no_delay_on_commit():
    plain = Celery(
        f"on_commit{next(_names)}", set_as_current=False, task_cls="celery.app.task:Task"
    )
    job = register(plain)
    assert not issubclass(plain.Task, DjangoTask)
    assert not hasattr(job, "delay_on_commit") and not hasattr(job, "apply_async_on_commit")
    with pytest.raises(AttributeError, match="use DjangoStepLockedTask"):
        job.delay_on_commit(1)

    # the Django variant keeps them whatever the app's task class
    @plain.task(
        bind=True, base=DjangoStepLockedTask, name=f"on_commit.task{next(_names)}", shared=False
    )
    def django_job(self, pk):
        return pk

    assert callable(django_job.delay_on_commit) and callable(django_job.apply_async_on_commit)
