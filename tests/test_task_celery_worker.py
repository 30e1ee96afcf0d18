"""StepLockedTask under Celery's own pytest fixtures (``celery.contrib.pytest``): an
in-process worker thread consuming from the real Redis broker."""

import pytest

from celery_steplock import DjangoStepLockedTask, StepLockedTask, signals
from helpers import wait_until


@pytest.fixture(scope="module")
def celery_config(redis_server_url):
    return {
        "broker_url": redis_server_url,
        "result_backend": redis_server_url,
        "steplock_redis_url": redis_server_url,
        "steplock_key_prefix": "fixture",
        "steplock_default_ttl": 5.0,
    }


@pytest.fixture
def events():
    seen = []

    def receiver(sender=None, signal=None, **kw):
        seen.append((signal.name, kw["task_name"]))

    for sig in (signals.lock_acquired, signals.lock_released):
        sig.connect(receiver, weak=False)
    yield seen
    for sig in (signals.lock_acquired, signals.lock_released):
        sig.disconnect(receiver)


def test_in_process_worker_runs_the_task_under_a_lease(
    celery_app, celery_worker, redis_client, events
):
    @celery_app.task(bind=True, base=StepLockedTask, lock_key="job:{n}", name="fixture.job")
    def job(self, n):
        return {"n": n, "key": self.lease.key, "held": redis_client.hget(self.lease.key, "owner")}

    celery_worker.reload()
    result = job.delay(7).get(timeout=20)
    assert result["key"] == "fixture:lease:{job:7}" and result["held"]
    # In a worker the release is not waited for (steplock_release_wait off): Redis runs it
    # as it reads it (on a connection of its own, so not necessarily before the result's
    # write), and lock_released follows once its reply is read, milliseconds later.
    wait_until(
        lambda: redis_client.exists("fixture:lease:{job:7}") == 0, timeout=2.0, what="release"
    )
    wait_until(lambda: len(events) == 2, timeout=2.0, what="lock_released")
    assert events == [("lock_acquired", "fixture.job"), ("lock_released", "fixture.job")]


def test_django_variant_keeps_delay_on_commit(celery_app):
    @celery_app.task(bind=True, base=DjangoStepLockedTask, name="fixture.django_job")
    def django_job(self, n):
        return n

    assert isinstance(django_job, StepLockedTask)
    assert callable(django_job.delay_on_commit) and callable(django_job.apply_async_on_commit)
