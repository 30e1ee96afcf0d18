"""``on_conflict="return_winner"`` with a real ``celery worker`` (prefork, 2 processes), the
Redis broker and django-celery-results' backend on the test database, the event log OFF:
a duplicate of a committed step (another task id) returns the winner's stored result, a
chain after it receives that result, ``committed_by`` names the winner from the step row's
owner token alone, and a winner whose result is not stored (``ignore_result``) leaves the
duplicate its "duplicate" outcome. Tasks: tests/support/winner_app.py.
"""

import time
import uuid

import pytest
from celery import chain, group
from helpers import wait_until

from celery_steplock.outcomes import STORE_WAIT
from django_app.workflows.models import Step
from tests.support.result_backends import redis_result_backend

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]

TIMEOUT = 30.0  # the bound on every .get(): far above what a run takes


@pytest.fixture(params=["django-db", pytest.param("redis", marks=pytest.mark.redis_shape)])
def backend_env(request, app, redis_server_url):
    """The result backend of the test and its worker: ``django-db`` (the project's) or
    Celery's Redis backend on database 1 of the session's Redis; yields the worker's env."""
    if request.param == "django-db":
        yield {}
        return
    with redis_result_backend(app, redis_server_url) as (_client, url):
        yield {"STEPLOCK_RESULT_BACKEND": url}


@pytest.fixture
def winner_app(start_worker, request):
    from tests.support import winner_app

    env = request.getfixturevalue("backend_env") if "backend_env" in request.fixturenames else {}
    # STEPLOCK_EVENT_LOG unset: the project's default (off), so committed_by can only come
    # from the step row's owner token.
    start_worker(
        "winner", concurrency=2, extra_args=("--include", "tests.support.winner_app"), **env
    )
    return winner_app


def duplicate_of(task, step, committed_by):
    return {
        "steplock": "duplicate",
        "task": task.name,
        "step_id": step.pk,
        "expected": "pending",
        "found": "done",
        "committed_by": committed_by,
        "held_by": None,
    }


def test_a_duplicate_returns_the_winner_s_result_and_a_chain_receives_it(backend_env, winner_app):
    charge, plain, echo = winner_app.charge, winner_app.charge_plain, winner_app.echo
    step = Step.objects.create(name="winner")
    first = charge.apply_async((step.pk,), task_id=str(uuid.uuid4()))
    value = first.get(timeout=TIMEOUT)
    assert value == {"step_id": step.pk, "by": first.id, "fence": value["fence"]}

    # Another task id, the option on: the winner's stored result, as this task's own.
    again = charge.apply_async((step.pk,))
    assert again.id != first.id
    assert again.get(timeout=TIMEOUT) == value and again.state == "SUCCESS"

    # The option off: the outcome dict, committed_by from the row (event log off).
    off = plain.apply_async((step.pk,))
    assert off.get(timeout=TIMEOUT) == duplicate_of(plain, step, first.id)

    # A chain after the duplicate receives the winner's result.
    chained = chain(charge.si(step.pk), echo.s()).apply_async()
    assert chained.get(timeout=TIMEOUT) == {"got": value}
    assert chained.parent.get(timeout=TIMEOUT) == value
    step.refresh_from_db()
    assert step.status == "done"


def test_racing_duplicates_all_return_the_winner_s_result(winner_app):
    """Two deliveries at once: the loser finds the step done before the winner has stored
    its result, and waits (at most STORE_WAIT) for it."""
    step = Step.objects.create(name="race")
    result = group(winner_app.charge.si(step.pk, delay=0.3) for _ in range(2)).apply_async()
    values = result.get(timeout=TIMEOUT)
    winners = {v["by"] for v in values}
    assert len(winners) == 1 and winners <= {r.id for r in result.results}, values
    assert values[0] == values[1]


def test_a_winner_without_a_stored_result_leaves_the_duplicate_outcome(winner_app):
    quietly, charge = winner_app.charge_quietly, winner_app.charge
    step = Step.objects.create(name="quiet")
    silent = quietly.apply_async((step.pk,))
    wait_until(
        lambda: Step.objects.get(pk=step.pk).status == "done",
        timeout=TIMEOUT,
        what="the quiet winner's commit",
    )
    began = time.monotonic()
    value = charge.apply_async((step.pk,)).get(timeout=TIMEOUT)
    waited = time.monotonic() - began
    assert value == duplicate_of(charge, step, silent.id)
    assert STORE_WAIT - 0.1 <= waited < STORE_WAIT + 10  # the bounded wait, then the dict
