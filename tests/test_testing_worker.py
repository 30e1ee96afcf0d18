"""The plugin's fixtures with Celery's own pytest fixtures (``celery.contrib.pytest``, which
pytest-celery's plugin also provides): an in-process worker and an eager call of the same task
end alike."""

import pytest

from celery_steplock import StepLockedTask
from celery_steplock.exceptions import LockContended


@pytest.fixture(scope="module")
def celery_config(redis_server_url):
    return {
        "broker_url": redis_server_url,
        "result_backend": redis_server_url,
        "steplock_retry_backoff": 0.05,
        "steplock_retry_backoff_max": 0.1,
    }


@pytest.fixture(scope="session")
def steplock_redis_url(redis_server_url):
    return redis_server_url


@pytest.fixture
def steplock_celery_app(celery_app):
    return celery_app


def test_a_worker_and_an_eager_call_end_alike(
    steplock_app, steplock_leases, steplock_key_prefix, celery_worker
):
    @steplock_app.task(
        bind=True, base=StepLockedTask, name="parity.job", lock_key="job:{n}", lock_retry_max=1
    )
    def job(self, n):
        return {"n": n, "key": self.lease.key}

    celery_worker.reload()
    expected = {"n": 2, "key": f"{steplock_key_prefix}:lease:{{job:2}}"}
    assert job.delay(2).get(timeout=20) == expected == job.apply(args=(2,)).get()

    steplock_leases.acquire("job:3", "holder", 60.0)
    in_worker = job.delay(3)
    with pytest.raises(LockContended):
        in_worker.get(timeout=20)
    eager = job.apply(args=(3,))
    assert in_worker.state == eager.state == "FAILURE"
    assert isinstance(in_worker.result, LockContended) and isinstance(eager.result, LockContended)
    assert steplock_leases.inspect("job:3")["owner"] == "holder"
