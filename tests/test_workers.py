"""Real ``celery worker`` processes (prefork) on a real Redis broker and the test database.

Each test starts its workers with ``tests/support/servers.py``; the workers count library signals in
Redis (``demo:stats:<event>``, django_app/workflows/receivers.py) so the test can read what
happened inside them.
"""

import random
import sys
import time

import helpers
import pytest
from helpers import drained, lease_key, stats, stats_settled

from celery_steplock.lock import unpack_fields
from django_app.workflows.models import Step, TransitionRecord
from django_app.workflows.tasks import advance, compensate, hold, retry_once

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]

TTL = 2.0  # STEPLOCK_TTL given to the workers by the worker_env fixture


def wait_until(predicate, timeout=60.0, interval=0.05, what="condition", client=None):
    describe = None
    if client is not None:

        def describe():
            return (
                f"queue {client.llen('celery')}, unacked {client.hlen('unacked')}, "
                f"leases {sorted(client.scan_iter(match='steplock:lease:*'))}, "
                f"stats {stats(client)}"
            )

    return helpers.wait_until(predicate, timeout, interval, what, describe)


def records(step):
    return list(TransitionRecord.objects.filter(step=step).values_list("to_status", flat=True))


def two_workers(start_worker, concurrency=1):
    return (
        start_worker("w1", concurrency=concurrency, STEPLOCK_DEMO_STATS=1),
        start_worker("w2", concurrency=concurrency, STEPLOCK_DEMO_STATS=1),
    )


def test_two_workers_on_one_step_commit_once(start_worker, redis_client):
    two_workers(start_worker)
    step = Step.objects.create(name="race")
    advance.apply_async((step.pk,), {"delay": 1.0})
    advance.apply_async((step.pk,), {"delay": 1.0})
    wait_until(
        lambda: drained(redis_client) and stats(redis_client).get("transition_conflict"),
        what="both deliveries to finish",
        client=redis_client,
    )
    step.refresh_from_db()
    assert step.status == "done" and records(step) == ["done"]
    counts = stats_settled(redis_client)
    assert counts["lock_contended"] >= 1  # the second worker met the lease and retried
    assert counts["transition_applied"] == 1
    assert counts["lock_acquired"] == counts["lock_released"]
    hosts = set(TransitionRecord.objects.values_list("pid", flat=True))
    assert len(hosts) == 1


def test_duplicate_delivery_of_one_task_id_commits_once(start_worker, redis_client):
    two_workers(start_worker)
    step = Step.objects.create(name="dup")
    first = advance.apply_async((step.pk,), {"delay": 1.0}, task_id="dup-task-id")
    advance.apply_async((step.pk,), {"delay": 1.0}, task_id="dup-task-id")
    wait_until(
        lambda: drained(redis_client) and stats(redis_client).get("transition_conflict"),
        what="the duplicate to finish",
        client=redis_client,
    )
    step.refresh_from_db()
    assert step.status == "done" and records(step) == ["done"]
    assert first.get(timeout=10)["step_id"] == step.pk  # the duplicate never overwrote it
    assert stats(redis_client)["transition_applied"] == 1


def test_sigkilled_worker_leaves_its_lease_to_the_ttl(start_worker, redis_client):
    worker = start_worker("doomed", concurrency=1, STEPLOCK_DEMO_STATS=1)
    step = Step.objects.create(name="kill")
    hold.apply_async((step.pk, 60))
    holder = wait_until(
        lambda: unpack_fields(redis_client.hgetall(lease_key(step))),
        timeout=30,
        what="the lease to be taken",
    )
    assert int(holder["pid"]) in worker.children_pids(recursive=True)
    assert int(holder["pid"]) != worker.pid  # held by the prefork child, not the main process
    worker.kill()  # returns once the whole process group is gone: nobody renews any more
    seen = []  # (renewed_ms, pttl) read together until the key is gone

    def expired():
        renewed_ms, pttl = (
            redis_client.pipeline(transaction=True)
            .hget(lease_key(step), "renewed_ms")
            .pttl(lease_key(step))
            .execute()
        )
        if pttl == -2:
            return True
        seen.append((renewed_ms, pttl))
        return False

    wait_until(expired, timeout=TTL + 30, interval=0.02, what="the lease to expire")
    assert seen and 0 < seen[0][1] <= TTL * 1000  # at most one TTL left at the kill
    # Then it only ran down: never renewed (same renewed_ms, no PTTL going up again), so it
    # expired within that one TTL.
    assert {renewed for renewed, _ in seen} == {seen[0][0]}
    assert all(b <= a for (_, a), (_, b) in zip(seen, seen[1:]))
    assert stats(redis_client).get("lock_released", 0) == 0  # expired, never released


def test_prefork_child_keeps_its_lease_over_three_ttls(start_worker, redis_client):
    # A TTL of its own, twice the suite's: a renewal is lost only when the child's heartbeat
    # gets no CPU for a whole TTL, which a loaded 2-core machine running the suite's passes
    # side by side did once at 2 s (that is a lease lost, which the rest of the suite
    # exercises: here the claim is that the renewals keep it)
    ttl = 2 * TTL
    worker = start_worker("renewer", concurrency=2, STEPLOCK_DEMO_STATS=1, STEPLOCK_TTL=ttl)
    step = Step.objects.create(name="long")
    result = hold.apply_async((step.pk, ttl * 3.5))
    holder = wait_until(
        lambda: unpack_fields(redis_client.hgetall(lease_key(step))),
        timeout=30,
        what="the lease to be taken",
    )
    renewed = wait_until(
        lambda: (lambda h: h if h and h["renewed_ms"] > h["acquired_ms"] else None)(
            redis_client.hgetall(lease_key(step))
        ),
        timeout=ttl,
        what="a renewal",
    )
    assert renewed["owner"] == holder["owner"]
    value = result.get(timeout=60)
    assert value["owner"] == holder["owner"] and value["pid"] in worker.children_pids()
    counts = stats_settled(redis_client)
    assert counts["lock_extended"] >= 8  # every ttl/3 for 3.5 ttl
    assert counts.get("lock_lost", 0) == 0 and counts["lock_released"] == 1


def test_compensation_racing_the_forward_flow(start_worker, redis_client):
    two_workers(start_worker, concurrency=2)
    rng = random.Random(7)
    steps = [Step.objects.create(name=f"c{i}") for i in range(12)]
    for step in steps:
        pair = [(advance, {"delay": 0.2}), (compensate, {"delay": 0.2})]
        rng.shuffle(pair)
        for task, kwargs in pair:
            task.apply_async((step.pk,), kwargs)
    wait_until(
        lambda: (
            drained(redis_client)
            and stats(redis_client).get("transition_conflict", 0) >= len(steps)
        ),
        timeout=90,
        what="every race to finish",
        client=redis_client,
    )
    outcomes = []
    for step in steps:
        step.refresh_from_db()
        assert records(step) == [step.status], step
        outcomes.append(step.status)
    assert set(outcomes) <= {"done", "cancelled"}
    assert stats(redis_client)["transition_applied"] == len(steps)


def test_resume_racing_a_retry_commits_once(start_worker, redis_client):
    two_workers(start_worker)
    step = Step.objects.create(name="resume")
    retry_once.apply_async((step.pk,), {"countdown": 1.0})
    wait_until(lambda: stats(redis_client).get("lock_released"), what="the first attempt")
    advance.apply_async((step.pk,), {"delay": 0.5})  # the manual resume
    wait_until(
        lambda: drained(redis_client) and stats(redis_client).get("transition_conflict"),
        timeout=60,
        what="the retry and the resume to finish",
        client=redis_client,
    )
    step.refresh_from_db()
    assert step.status == "done" and records(step) == ["done"]
    assert stats(redis_client)["transition_applied"] == 1


def test_contended_retries_stop_at_the_lease_retry_budget(start_worker, redis_client):
    from celery_steplock.lock import RedisLeaseStore

    start_worker(
        "w1",
        concurrency=1,
        STEPLOCK_DEMO_STATS=1,
        STEPLOCK_RETRY_MAX=2,
        STEPLOCK_RETRY_BACKOFF=0.05,
    )
    step = Step.objects.create(name="busy")
    RedisLeaseStore(redis_client).acquire(
        f"step:{step.pk}", "squatter", 60.0, metadata={"task_id": "someone-else"}
    )
    result = advance.apply_async((step.pk,))
    wait_until(
        lambda: result.state == "FAILURE",
        timeout=30,
        what="retries to run out",
        client=redis_client,
    )
    assert type(result.result).__name__ == "LockContended"
    assert stats(redis_client)["lock_contended"] == 3  # the first try + steplock_retry_max=2
    step.refresh_from_db()
    assert step.status == "pending" and records(step) == []


def test_worker_with_an_invalid_setting_refuses_to_start(worker_env, tmp_path):
    from tests.support import servers

    env = {**worker_env, "STEPLOCK_TTL": "0"}
    worker = servers.ProcessGroup(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "django_app",
            "worker",
            "-l",
            "INFO",
            "-c",
            "1",
            "-n",
            "bad@%h",
            "--without-mingle",
            "--without-gossip",
        ],
        env=env,
        cwd=servers.ROOT,
        logfile=tmp_path / "bad.log",
    ).start()
    deadline = time.monotonic() + 60
    while worker.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert not worker.alive()
        log = worker.log_text()
        assert "steplock_default_ttl" in log and "CELERY_STEPLOCK_DEFAULT_TTL" in log
        assert " ready." not in log
    finally:
        worker.terminate()
