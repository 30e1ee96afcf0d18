"""A step task whose step-database connection breaks before its body (the precheck read, or
the step transaction's BEGIN) is retried, as a lost connection at its CAS or COMMIT is:
nothing was written. It used to fail, and a worker with ``acks_late`` acknowledges a
failure: the step was never run again (found by the randomized run, seed 21, under
``pg_drop``).

Real PostgreSQL (``pg_terminate_backend`` ends the session as the fault proxy's drop does),
real Redis; the task runs eagerly, its retry too.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
from django.db import connection

from celery_steplock import signals
from celery_steplock.task import StepLockedTask
from django_app.celery import app as celery_app
from django_app.workflows.models import Step

pytestmark = pytest.mark.django_db(transaction=True)

RUNS: list[int] = []
KILL: list[bool] = []


@celery_app.task(
    name="tests.connection_before_body.step",
    bind=True,
    base=StepLockedTask,
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
    lock_key="before-body:{step_id}",
    acks_late=True,
    reject_on_worker_lost=True,
)
def step_task(self, step_id):
    RUNS.append(step_id)
    return step_id


def _end_the_session_once(sender=None, **kwargs):
    """lock_acquired is sent before the precheck: end this thread's database session."""
    if not KILL or getattr(sender, "name", None) != step_task.name:
        return
    KILL.clear()
    with contextlib.suppress(Exception), connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")


@pytest.fixture
def session_ended_once(app, caplog):
    app.conf.steplock_retry_backoff = 0.01
    caplog.set_level(logging.WARNING, logger="celery_steplock")
    RUNS.clear()
    KILL[:] = [True]
    signals.lock_acquired.connect(_end_the_session_once, weak=False, dispatch_uid="before-body")
    yield lambda: [
        r.steplock
        for r in caplog.records
        if getattr(r, "steplock", {}).get("event") == "commit_failed"
    ]
    signals.lock_acquired.disconnect(dispatch_uid="before-body")
    KILL.clear()
    connection.close()


@pytest.mark.postgresql
@pytest.mark.parametrize("precheck", [True, False], ids=["precheck", "begin"])
def test_a_lost_connection_before_the_body_is_retried_and_the_step_runs_once(
    session_ended_once, precheck
):
    step = Step.objects.create(name="s")
    step_task.lock_precheck = precheck
    try:
        result = step_task.apply(args=(step.pk,), task_id=f"before-body-{precheck}")
    finally:
        del step_task.lock_precheck
    assert (result.state, result.result) == ("SUCCESS", step.pk)
    assert RUNS == [step.pk]
    Step.objects.get(pk=step.pk)  # a fresh connection
    assert Step.objects.get(pk=step.pk).status == "done"
    lines = session_ended_once()
    assert [(line["phase"], line["step_id"]) for line in lines] == [("before_body", step.pk)]


def test_a_refused_statement_before_the_body_is_no_lost_connection(app, caplog):
    """SQLite raises a missing table as OperationalError, the type of a lost connection too;
    the connection still answers, so it is the task's error at once, never retried."""
    caplog.set_level(logging.WARNING, logger="celery_steplock")
    RUNS.clear()
    step = Step.objects.create(name="s")
    table = Step._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {table} RENAME TO {table}_away")
    try:
        result = step_task.apply(args=(step.pk,), task_id="before-body-schema")
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {table}_away RENAME TO {table}")
    assert result.state == "FAILURE" and RUNS == []
    assert "away" not in str(result.result) and table in str(result.result)
    assert [
        r for r in caplog.records if getattr(r, "steplock", {}).get("event") == "commit_failed"
    ] == []
