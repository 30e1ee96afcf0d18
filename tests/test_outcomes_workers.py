"""Terminal outcomes with a real ``celery worker`` (prefork, 2 processes), the Redis broker and
django-celery-results' backend on the test database: ``group``, ``chord`` and a re-sent
``chain`` over duplicates complete, every task id ends SUCCESS, one commit per step, and a
delivery that shares the winner's task id never overwrites its result. The group/chord/chain
test runs on Celery's Redis result backend too (database 1 of the session's Redis).

One worker serves every case of a test (a worker start is most of a test's time).
"""

import time

import pytest
from celery import chain, chord, group, signature
from django_celery_results.models import TaskResult
from helpers import drained, stats, stats_settled, wait_until

from django_app.workflows.models import Step, TransitionRecord
from django_app.workflows.tasks import advance
from tests.support.result_backends import redis_result_backend

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]

TIMEOUT = 30.0  # the bound on every .get(): far above what a run takes


def start(start_worker, **env):
    return start_worker(
        "outcomes",
        concurrency=2,
        STEPLOCK_DEMO_STATS=1,
        STEPLOCK_RETRY_BACKOFF=0.05,
        STEPLOCK_EVENT_LOG=1,
        **env,
    )


def commits(step):
    return list(TransitionRecord.objects.filter(step=step).values_list("to_status", flat=True))


def duplicate_of(step, committed_by):
    return {
        "steplock": "duplicate",
        "task": "django_app.workflows.tasks.advance",
        "step_id": step.pk,
        "expected": "pending",
        "found": "done",
        "committed_by": committed_by,
        "held_by": None,
    }


def winner_and_losers(step, results, values):
    """The task id of the one winner among ``results`` (AsyncResults) and ``values``
    (their return values); asserts that every other value is the duplicate outcome naming it."""
    winners = [
        r.id for r, v in zip(results, values) if v == {"step_id": step.pk, "fence": v.get("fence")}
    ]
    assert len(winners) == 1, values
    losers = [v for v in values if v.get("steplock")]
    assert losers == [duplicate_of(step, winners[0])] * (len(values) - 1), values
    return winners[0]


@pytest.fixture(params=["django-db", pytest.param("redis", marks=pytest.mark.redis_shape)])
def result_backend(request, app, redis_server_url):
    """The result backend of the test and its workers: ``django-db`` (the project's), or
    ``redis``: database 1 of the session's Redis (fixtures flush database 0), flushed, as
    ``(name, client on that database or None, env for start_worker)``."""
    if request.param == "django-db":
        yield "django-db", None, {}
        return
    with redis_result_backend(app, redis_server_url) as (client, url):
        yield "redis", client, {"STEPLOCK_RESULT_BACKEND": url}


def stored_in(result_backend, task_ids):
    """Of ``task_ids``, those whose result is stored in ``result_backend``'s store."""
    name, client, _ = result_backend
    if name == "redis":
        return {i for i in task_ids if client.exists(f"celery-task-meta-{i}")}
    return set(TaskResult.objects.filter(task_id__in=task_ids).values_list("task_id", flat=True))


def test_group_chord_and_re_sent_chain_over_duplicates_complete(
    start_worker, redis_client, result_backend
):
    start(start_worker, **result_backend[2])
    timings = {}
    task_ids = []

    # group() of three duplicates of one step, each with its own task id
    step = Step.objects.create(name="group")
    began = time.monotonic()
    result = group(advance.si(step.pk, delay=0.3) for _ in range(3)).apply_async()
    values = result.get(timeout=TIMEOUT)
    timings["group"] = time.monotonic() - began
    winner_and_losers(step, result.results, values)
    assert [r.state for r in result.results] == ["SUCCESS"] * 3
    task_ids += [r.id for r in result.results]
    assert commits(step) == ["done"]

    # chord() over three duplicates: the callback runs with every header's outcome
    step = Step.objects.create(name="chord")
    began = time.monotonic()
    header = [advance.si(step.pk, delay=0.3) for _ in range(3)]
    result = chord(header)(signature("celery.accumulate", kwargs={"index": 0}))
    values = result.get(timeout=TIMEOUT)
    timings["chord"] = time.monotonic() - began
    parts = result.parent.results
    winner_and_losers(step, parts, values)
    assert [r.state for r in parts] == ["SUCCESS"] * 3 and result.state == "SUCCESS"
    task_ids += [r.id for r in parts] + [result.id]
    assert commits(step) == ["done"]

    # a chain re-sent after it completed runs to its end again, committing nothing
    first, second = Step.objects.create(name="c1"), Step.objects.create(name="c2")
    done = chain(advance.si(first.pk), advance.si(second.pk)).apply_async()
    assert done.get(timeout=TIMEOUT) == {"step_id": second.pk, "fence": done.result["fence"]}
    began = time.monotonic()
    again = chain(advance.si(first.pk), advance.si(second.pk)).apply_async()
    assert again.get(timeout=TIMEOUT) == duplicate_of(second, done.id)
    timings["chain"] = time.monotonic() - began
    assert again.parent.get(timeout=TIMEOUT) == duplicate_of(first, done.parent.id)
    assert commits(first) == ["done"] and commits(second) == ["done"]
    task_ids += [done.parent.id, done.id, again.parent.id, again.id]

    wait_until(lambda: drained(redis_client), timeout=TIMEOUT, what="the queue to drain")
    counts = stats_settled(redis_client)
    assert counts["transition_applied"] == 4  # group, chord, the chain's two steps
    assert counts["lock_acquired"] == counts["lock_released"]
    # Every result is in the chosen backend's store, and none in the other's.
    assert stored_in(result_backend, task_ids) == set(task_ids)
    if result_backend[0] == "redis":
        assert not TaskResult.objects.filter(task_id__in=task_ids).exists()
    spent = ", ".join(f"{k} {v:.2f} s" for k, v in timings.items())
    print(f"\noutcomes ({result_backend[0]}): wall time {spent}")


def test_same_task_id_never_overwrites_the_winner_s_result(start_worker, redis_client):
    start(start_worker)
    step = Step.objects.create(name="same-id")
    # Both deliveries of one task id run at once: the second meets its own id on the lease,
    # retries, and ends in Ignore once the first has stored its result.
    first = advance.apply_async((step.pk,), {"delay": 1.0}, task_id="outcomes-same-id")
    advance.apply_async((step.pk,), {"delay": 1.0}, task_id="outcomes-same-id")
    value = first.get(timeout=TIMEOUT)
    assert value == {"step_id": step.pk, "fence": value["fence"]}
    wait_until(
        lambda: drained(redis_client) and stats(redis_client).get("transition_conflict", 0) >= 1,
        timeout=TIMEOUT,
        what="the second delivery to end",
    )
    stored = TaskResult.objects.get(task_id="outcomes-same-id")
    assert (stored.status, first.backend.get_task_meta(first.id, cache=False)["result"]) == (
        "SUCCESS",
        value,
    )
    assert stats(redis_client)["lock_contended"] >= 1  # it did meet its own id's lease

    # A third delivery after the end: the precheck finds the step done; nothing is stored.
    advance.apply_async((step.pk,), task_id="outcomes-same-id")
    wait_until(
        lambda: drained(redis_client) and stats(redis_client).get("transition_conflict", 0) >= 2,
        timeout=TIMEOUT,
        what="the third delivery to end",
    )
    again = TaskResult.objects.get(task_id="outcomes-same-id")
    assert (again.status, again.date_done) == ("SUCCESS", stored.date_done)
    assert first.backend.get_task_meta(first.id, cache=False)["result"] == value
    assert commits(step) == ["done"]
    assert stats(redis_client)["transition_applied"] == 1
