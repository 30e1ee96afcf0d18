"""Real ``celery worker`` processes (prefork) on a real rabbitmq-server broker.

The worker tests that are about the broker, again on AMQP: duplicates of one step and the
lease-contention retries (countdown messages the worker holds unacknowledged until their
ETA), the redelivery of a killed prefork child's and a SIGKILLed worker's message
(``acks_late`` + ``reject_on_worker_lost``), ``group`` and ``chord`` over duplicates, and what
RabbitMQ's ``consumer_timeout`` does to a delivery held past it. The lease store, the demo
counters and the test's view of them stay on the session's Redis; results go to
django-celery-results on the test database. The broker is the session's rabbitmq-server
(tests/support/rabbitmq.py), started the first time one of these tests runs; they run once,
in the SQLite pass.
"""

import os
import signal

import pytest
from celery import chord, group, signature
from django_celery_results.models import TaskResult
from helpers import lease_key, stats, stats_settled, wait_until

from celery_steplock.lock import unpack_fields
from django_app.workflows.models import Step, TransitionRecord
from django_app.workflows.tasks import advance
from tests.support.rabbitmq import purge_queue, use_broker

pytestmark = [pytest.mark.workers, pytest.mark.rabbitmq, pytest.mark.django_db(transaction=True)]

TIMEOUT = 30.0  # the bound on every wait: far above what a run takes
#: Lease retries every 0.2-0.5 s (their countdowns below the 2 s consumer_timeout of the last
#: test), so a redelivery resumes soon after the lease it met is gone.
FAST_RETRIES = dict(
    STEPLOCK_DEMO_STATS=1, STEPLOCK_RETRY_BACKOFF=0.2, STEPLOCK_RETRY_BACKOFF_MAX=0.5
)


def _use_rabbitmq(server, worker_env, app, redis_url):
    """Point the workers (CELERY_BROKER_URL, which Celery reads before its configuration)
    and this process's producers at ``server``; the lease store stays on ``redis_url``."""
    purge_queue(server.url)
    worker_env.update(CELERY_BROKER_URL=server.url, STEPLOCK_REDIS_URL=redis_url)
    return use_broker(app, server.url)


@pytest.fixture
def on_rabbitmq(rabbitmq_server, worker_env, celery_app_configured, redis_server_url):
    """The test's workers and producers on the session's rabbitmq-server."""
    before = _use_rabbitmq(rabbitmq_server, worker_env, celery_app_configured, redis_server_url)
    yield rabbitmq_server
    use_broker(celery_app_configured, before)


def commits(step):
    return list(TransitionRecord.objects.filter(step=step).values_list("to_status", flat=True))


def no_lease(redis_client):
    return not list(redis_client.scan_iter(match="steplock:lease:*"))


def holder_of(redis_client, step):
    return wait_until(
        lambda: unpack_fields(redis_client.hgetall(lease_key(step))),
        timeout=TIMEOUT,
        what="the lease to be taken",
    )


def test_duplicates_group_and_chord_commit_once_with_countdown_retries(
    on_rabbitmq, start_worker, redis_client
):
    start_worker("w1", concurrency=2, **FAST_RETRIES)

    # Two deliveries of one task id and one of another id, on two prefork children.
    step = Step.objects.create(name="dup")
    first = advance.apply_async((step.pk,), {"delay": 1.0}, task_id="amqp-dup")
    advance.apply_async((step.pk,), {"delay": 1.0}, task_id="amqp-dup")
    other = advance.apply_async((step.pk,), {"delay": 1.0})
    values = [first.get(timeout=TIMEOUT), other.get(timeout=TIMEOUT)]
    wait_until(
        lambda: stats(redis_client).get("transition_conflict", 0) >= 2 and no_lease(redis_client),
        timeout=TIMEOUT,
        what="every duplicate to end",
    )
    winners = [v for v in values if "steplock" not in v]
    assert len(winners) == 1 and winners[0]["step_id"] == step.pk
    assert commits(step) == ["done"]
    # The children met each other's lease: countdown retries through the broker.
    assert stats(redis_client)["lock_contended"] >= 1

    # group() of three duplicates of one step, and a chord over three more.
    step = Step.objects.create(name="group")
    result = group(advance.si(step.pk, delay=0.3) for _ in range(3)).apply_async()
    values = result.get(timeout=TIMEOUT)
    assert [r.state for r in result.results] == ["SUCCESS"] * 3
    assert sorted("steplock" in v for v in values) == [False, True, True]
    assert {v["steplock"] for v in values if "steplock" in v} == {"duplicate"}
    assert commits(step) == ["done"]

    step = Step.objects.create(name="chord")
    header = [advance.si(step.pk, delay=0.3) for _ in range(3)]
    result = chord(header)(signature("celery.accumulate", kwargs={"index": 0}))
    values = result.get(timeout=TIMEOUT)
    assert [r.state for r in result.parent.results] == ["SUCCESS"] * 3
    assert result.state == "SUCCESS"
    assert sorted("steplock" in v for v in values) == [False, True, True]
    assert commits(step) == ["done"]

    wait_until(lambda: no_lease(redis_client), timeout=TIMEOUT, what="every lease released")
    counts = stats_settled(redis_client)
    assert counts["transition_applied"] == 3
    assert counts["lock_acquired"] == counts["lock_released"]


def test_a_killed_child_and_a_sigkilled_worker_are_redelivered_and_commit_once(
    on_rabbitmq, start_workers, redis_client
):
    workers = start_workers(
        dict(name="w1", concurrency=1, **FAST_RETRIES),
        dict(name="w2", concurrency=1, **FAST_RETRIES),
    )

    def owner_of(pid):
        [worker] = [w for w in workers if pid in w.children_pids(recursive=True)]
        return worker

    # The prefork child dies mid-body: reject_on_worker_lost requeues the message, and its
    # redelivery waits out the dead child's lease (at most one TTL) before it commits.
    step = Step.objects.create(name="child")
    child_killed = advance.apply_async((step.pk,), {"delay": 1.5})
    pid = int(holder_of(redis_client, step)["pid"])
    owner = owner_of(pid)
    os.kill(pid, signal.SIGKILL)
    assert child_killed.get(timeout=TIMEOUT) == {
        "step_id": step.pk,
        "fence": child_killed.result["fence"],
    }
    assert child_killed.state == "SUCCESS" and commits(step) == ["done"]
    assert owner.alive()

    # The whole worker is SIGKILLed: RabbitMQ requeues the message as its connection drops,
    # and the other worker commits it.
    step = Step.objects.create(name="worker")
    worker_killed = advance.apply_async((step.pk,), {"delay": 1.5})
    doomed = owner_of(int(holder_of(redis_client, step)["pid"]))
    doomed.kill()
    value = worker_killed.get(timeout=TIMEOUT)
    assert value == {"step_id": step.pk, "fence": value["fence"]}
    assert worker_killed.state == "SUCCESS" and commits(step) == ["done"]
    redone = TransitionRecord.objects.get(step=step)
    assert redone.hostname.startswith([w for w in workers if w is not doomed][0].name + "@")

    counts = stats(redis_client)
    assert counts["redelivered"] >= 2  # RabbitMQ's redelivered flag on both
    assert counts["lock_contended"] >= 2  # each redelivery met the dead holder's lease
    assert counts["transition_applied"] == 2


def test_a_delivery_held_past_consumer_timeout_is_redelivered_while_it_runs(
    on_rabbitmq, start_workers, redis_client
):
    """consumer_timeout 2 s, checked every second, and a body of 5 s: RabbitMQ closes the
    holder's channel at 2-3 s and requeues the message, the other worker gets it (flagged
    redelivered) while the first run still holds the lease, so it meets that lease and
    retries (its countdowns capped at 0.5 s, below the timeout) until the step is done. One
    commit; the task id keeps the first run's result. Celery 5.x treats the channel error
    as unrecoverable: the holder's worker stops once its task ends."""
    server = on_rabbitmq
    server.configure(consumer_timeout=2, tick_interval=1)  # for the workers' channels
    try:
        options = dict(concurrency=1, **FAST_RETRIES)
        workers = start_workers(dict(name="w1", **options), dict(name="w2", **options))
        step = Step.objects.create(name="held")
        result = advance.apply_async((step.pk,), {"delay": 5.0}, task_id="amqp-held")
        holder = holder_of(redis_client, step)
        [first] = [w for w in workers if int(holder["pid"]) in w.children_pids(recursive=True)]
        wait_until(
            lambda: stats(redis_client).get("lock_contended", 0) >= 1,
            timeout=TIMEOUT,
            what="the redelivered duplicate to meet the lease",
        )
        assert stats(redis_client)["redelivered"] >= 1
        # Still the first run's lease: the duplicate ran while it did.
        assert unpack_fields(redis_client.hgetall(lease_key(step)))["owner"] == holder["owner"]
        value = result.get(timeout=TIMEOUT)
        assert value == {"step_id": step.pk, "fence": value["fence"]}
        wait_until(
            lambda: stats(redis_client).get("transition_conflict", 0) >= 1,
            timeout=TIMEOUT,
            what="the duplicate to end",
        )
        assert commits(step) == ["done"]
        assert TaskResult.objects.get(task_id="amqp-held").status == "SUCCESS"
        assert result.backend.get_task_meta(result.id, cache=False)["result"] == value
        assert "delivery acknowledgement on channel 1 timed out" in server.node_log()
        assert "PRECONDITION_FAILED - delivery acknowledgement" in first.log_text()
    finally:
        server.configure(consumer_timeout=None, tick_interval=None)
