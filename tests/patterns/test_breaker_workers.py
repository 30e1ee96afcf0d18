"""The circuit breaker and the retry policy across real ``celery worker`` processes (prefork)
on a real Redis broker and the test database: a breaker opened by one worker stops the calls
of another; exactly one half-open probe runs at a time across workers while many callers
compete; a non-retryable error is never retried, a retryable one is, up to max_attempts;
retries while the breaker is OPEN never call the dependency.

The tasks below are imported by the workers too (``-I test_breaker_workers``, this folder
on their path). The
"dependency" they call is a Redis counter, so the test reads what every process did.
"""

import os
import time

import pytest

from celery_steplock import signals
from celery_steplock.patterns.breaker import CircuitBreaker
from celery_steplock.lock import make_client
from celery_steplock.patterns.retry import RetryPolicy
from celery_steplock.task import StepLockedTask
from django_app.celery import app as celery_app

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

OPENED = CircuitBreaker("brk-open", failure_threshold=3, window=3, recovery_timeout=120)
PROBED = CircuitBreaker(
    "brk-probe",
    failure_threshold=1,
    window=1,
    recovery_timeout=1.0,
    success_threshold=3,
    probe_timeout=2.0,
)
RETRIED = CircuitBreaker("brk-retry", failure_threshold=50, window=50, recovery_timeout=60)
RETRIED_OPEN = CircuitBreaker("brk-retry-open", failure_threshold=2, window=2, recovery_timeout=60)
POLICY = RetryPolicy(max_attempts=4, backoff=0.1, backoff_max=0.2)
LONG_POLICY = RetryPolicy(max_attempts=10, backoff=0.1, backoff_max=0.2)

_clients = {}


def _redis():
    pid = os.getpid()
    if pid not in _clients:
        _clients[pid] = make_client(os.environ["REDIS_URL"])
    return _clients[pid]


def dependency(label, breaker_key):
    """The outbound call: counted, slow while the breaker is half-open (so overlapping probes
    would show), failing as ``brk:mode`` says."""
    r = _redis()
    r.incr(f"brk:calls:{label}")
    r.rpush(f"brk:callers:{label}", os.getpid())
    if r.hget(breaker_key, "state") == "half_open":
        r.rpush(f"brk:half_open_inflight:{label}", r.incr(f"brk:inflight:{label}"))
        try:
            time.sleep(0.4)
        finally:
            r.decr(f"brk:inflight:{label}")
    mode = r.get("brk:mode") or "ok"
    if mode == "fail":
        raise ConnectionError("the dependency is down")
    if mode == "reject":
        raise ValueError("the dependency rejected the request")
    r.incr(f"brk:done:{label}")
    return "ok"


def _counted(signal_name):
    def receiver(sender=None, **fields):
        r = _redis()
        r.rpush(
            f"brk:{signal_name}:{fields.get('name') or fields.get('task_name')}",
            f"{os.getpid()}:{fields.get('decision') or fields.get('state')}",
        )

    return receiver


if os.environ.get("BRK_WORKER") == "1":
    for _signal in (
        signals.circuit_rejected,
        signals.circuit_opened,
        signals.retry_policy_decided,
    ):
        _signal.connect(_counted(_signal.name), weak=False)


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="brk.opened",
    lock_key="brk-open:{n}",
    circuit_breaker=OPENED,
)
def opened_call(self, n):
    return dependency("open", "steplock:breaker:{brk-open}")


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="brk.probed",
    lock_key="brk-probe:{n}",
    circuit_breaker=PROBED,
)
def probed_call(self, n):
    return dependency("probe", "steplock:breaker:{brk-probe}")


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="brk.retried",
    lock_key="brk-retry:{n}",
    circuit_breaker=RETRIED,
    retry_policy=POLICY,
)
def retried_call(self, n):
    return dependency("retry", "steplock:breaker:{brk-retry}")


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="brk.retried_open",
    lock_key="brk-retry-open:{n}",
    circuit_breaker=RETRIED_OPEN,
    retry_policy=LONG_POLICY,
)
def retried_open_call(self, n):
    return dependency("retry-open", "steplock:breaker:{brk-retry-open}")


# -- the tests ---------------------------------------------------------------------------------

workers = pytest.mark.workers


def _spec(name, concurrency=1):
    """start_worker's arguments for a worker that imports this module's tasks."""
    return dict(
        name=name,
        concurrency=concurrency,
        BRK_WORKER=1,
        PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}",
        extra_args=("-I", "test_breaker_workers"),
    )


def _worker(start_worker, name, concurrency=1):
    return start_worker(**_spec(name, concurrency))


def _wait(predicate, what, timeout=60.0):
    from tests.helpers import wait_until

    return wait_until(predicate, timeout, 0.05, what)


def _ints(client, key):
    return [int(v) for v in client.lrange(key, 0, -1)]


@workers
@pytest.mark.django_db(transaction=True)
def test_a_breaker_opened_by_one_worker_stops_the_calls_of_another(start_worker, redis_client):
    redis_client.set("brk:mode", "fail")
    first = _worker(start_worker, "w1")
    results = [opened_call.delay(n) for n in range(3)]
    _wait(lambda: all(r.state == "FAILURE" for r in results), "three failures on w1")
    assert redis_client.hget("steplock:breaker:{brk-open}", "state") == "open"
    failed_by = set(_ints(redis_client, "brk:callers:open"))
    first.terminate()
    redis_client.set("brk:mode", "ok")  # the dependency is back: the breaker still refuses
    _worker(start_worker, "w2")
    later = [opened_call.delay(n) for n in range(3, 9)]
    _wait(
        lambda: redis_client.llen("brk:circuit_rejected:brk-open") >= 6, "w2 to refuse six calls"
    )
    assert redis_client.get("brk:calls:open") == "3"  # w2 never called the dependency
    refused_by = {
        int(v.split(":")[0]) for v in redis_client.lrange("brk:circuit_rejected:brk-open", 0, -1)
    }
    assert refused_by and refused_by.isdisjoint(failed_by)  # another process refused them
    assert [r.state for r in later] == ["PENDING"] * 6  # re-queued, no state stored
    opened_by = [
        v.split(":")[0] for v in redis_client.lrange("brk:circuit_opened:brk-open", 0, -1)
    ]
    assert len(opened_by) == 1 and int(opened_by[0]) in failed_by


@workers
@pytest.mark.django_db(transaction=True)
def test_exactly_one_half_open_probe_at_a_time_across_workers(
    start_workers, redis_client, celery_app_configured
):
    redis_client.set("brk:mode", "ok")
    start_workers(_spec("w1", concurrency=3), _spec("w2", concurrency=3))
    with pytest.raises(ConnectionError):  # opened from here: one failure of a window of one
        PROBED.bind(celery_app_configured).call(
            lambda: (_ for _ in ()).throw(ConnectionError("down"))
        )
    assert redis_client.hget("steplock:breaker:{brk-probe}", "state") == "open"
    time.sleep(1.05)  # past the recovery timeout: the next admission half-opens it
    results = [probed_call.delay(n) for n in range(24)]
    _wait(
        lambda: all(r.state == "SUCCESS" for r in results), "all 24 calls to succeed", timeout=90
    )
    overlap = _ints(redis_client, "brk:half_open_inflight:probe")
    assert overlap == [1, 1, 1]  # three probes (success_threshold), never two at once
    assert redis_client.get("brk:done:probe") == "24"
    assert redis_client.get("brk:calls:probe") == "24"  # every refused call ran once, later
    assert redis_client.llen("brk:circuit_rejected:brk-probe") >= 1
    assert redis_client.hget("steplock:breaker:{brk-probe}", "state") == "closed"


@workers
@pytest.mark.django_db(transaction=True)
def test_the_retry_policy_on_workers(start_worker, redis_client):
    _worker(start_worker, "w1")
    redis_client.set("brk:mode", "reject")
    rejected = retried_call.delay(1)
    _wait(lambda: rejected.state == "FAILURE", "the rejected call to fail")
    assert isinstance(rejected.result, ValueError)
    assert redis_client.get("brk:calls:retry") == "1"  # never retried
    assert redis_client.lrange("brk:retry_policy_decided:brk.retried", 0, -1)[-1].endswith(
        ":never"
    )
    redis_client.delete("brk:calls:retry", "brk:retry_policy_decided:brk.retried")
    redis_client.set("brk:mode", "fail")
    down = retried_call.delay(2)
    _wait(lambda: down.state == "FAILURE", "the retried call to give up")
    assert isinstance(down.result, ConnectionError)
    assert redis_client.get("brk:calls:retry") == "4"  # max_attempts
    decisions = [
        v.split(":")[1] for v in redis_client.lrange("brk:retry_policy_decided:brk.retried", 0, -1)
    ]
    assert decisions == ["retry", "retry", "retry", "give_up"]


@workers
@pytest.mark.django_db(transaction=True)
def test_retries_while_open_never_call_the_dependency(start_worker, redis_client):
    _worker(start_worker, "w1")
    redis_client.set("brk:mode", "fail")
    result = retried_open_call.delay(1)
    _wait(
        lambda: redis_client.llen("brk:circuit_rejected:brk-retry-open") >= 1,
        "the third attempt to meet the open breaker",
    )
    time.sleep(0.5)
    assert redis_client.get("brk:calls:retry-open") == "2"  # the third attempt never called
    state = redis_client.hgetall("steplock:breaker:{brk-retry-open}")
    assert state["state"] == "open" and state["ring"] == ""  # the refusal counted nothing
    assert result.state == "RETRY"  # stored by the 1st retry; the refusal stores nothing
    decisions = [
        v.split(":")[1]
        for v in redis_client.lrange("brk:retry_policy_decided:brk.retried_open", 0, -1)
    ]
    assert decisions == ["retry", "retry"]


@pytest.mark.no_database
def test_negative_control_the_overlap_record_sees_two_probes_at_once(redis_client):
    """The record the half-open test checks can fail: two calls made while the breaker
    reads half-open, the second starting while the first sleeps, leave [1, 2]."""
    import threading

    redis_client.hset("steplock:breaker:{brk-control}", "state", "half_open")
    redis_client.set("brk:mode", "ok")
    first = threading.Thread(target=dependency, args=("control", "steplock:breaker:{brk-control}"))
    first.start()
    _wait(lambda: redis_client.get("brk:inflight:control") == "1", "the first call to start")
    dependency("control", "steplock:breaker:{brk-control}")
    first.join()
    assert _ints(redis_client, "brk:half_open_inflight:control") == [1, 2]
