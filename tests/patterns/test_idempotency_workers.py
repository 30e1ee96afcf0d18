"""Idempotency records across real ``celery worker`` processes: a completed call replays its
result in another worker and after a restart, a failed one runs again, a version bump runs
again, concurrent first calls of one key in two workers run the body once, and a worker
SIGKILLed while holding the record ``locked`` leaves it to its lock TTL, after which the
call runs again exactly once."""

import time

import pytest

from tests.support.servers import wait_until
from tests.patterns.idempotency_tasks import charge, flaky

pytestmark = pytest.mark.django_db(transaction=True)

INCLUDE = ("--include", "tests.patterns.idempotency_tasks")


def count(redis_client, name):
    return int(redis_client.get(name) or 0)


def test_a_completed_call_replays_across_workers_and_restarts(start_worker, redis_client):
    first_worker = start_worker("i1", concurrency=1, extra_args=INCLUDE)
    first = charge.apply_async((1, 10)).get(timeout=30)
    assert first["charged"] == 10 and first["pid"] in first_worker.children_pids()
    first_worker.terminate()
    second_worker = start_worker("i2", concurrency=1, extra_args=INCLUDE)  # a new process
    again = charge.apply_async((1, 10)).get(timeout=30)
    assert again == first  # the recorded result, the first worker's pid included
    assert first["pid"] not in second_worker.children_pids()
    assert count(redis_client, "idem:starts:1") == 1
    # A version bump: another key, so the body runs again (once).
    second_worker.terminate()
    start_worker("i3", concurrency=1, extra_args=INCLUDE, IDEM_VERSION="2")
    bumped = charge.apply_async((1, 10)).get(timeout=30)
    assert bumped["version"] == "2" and bumped["pid"] != first["pid"]
    assert charge.apply_async((1, 10)).get(timeout=30) == bumped
    assert count(redis_client, "idem:starts:1") == 2


def test_a_failed_call_runs_again_in_a_worker(start_worker, redis_client):
    start_worker("f1", concurrency=1, extra_args=INCLUDE)
    failed = flaky.apply_async((5,))
    with pytest.raises(ValueError):
        failed.get(timeout=30)
    assert flaky.apply_async((5,)).get(timeout=30) == {"order": 5, "attempt": 2}
    assert flaky.apply_async((5,)).get(timeout=30) == {"order": 5, "attempt": 2}
    assert count(redis_client, "idem:flaky:5") == 2


def test_concurrent_first_calls_in_two_workers_run_the_body_once(start_workers, redis_client):
    start_workers(
        dict(name="c1", concurrency=2, extra_args=INCLUDE),
        dict(name="c2", concurrency=2, extra_args=INCLUDE),
    )
    results = [charge.apply_async((2, 7), {"sleep": 1.0}) for _ in range(6)]
    values = [r.get(timeout=60) for r in results]
    assert count(redis_client, "idem:starts:2") == 1
    assert count(redis_client, "idem:done:2") == 1
    assert all(v == values[0] for v in values) and values[0]["charged"] == 7


def test_a_sigkilled_holder_leaves_the_record_to_its_lock_ttl_then_it_runs_once(
    start_worker, redis_client
):
    lock_ttl = 3.0
    doomed = start_worker(
        "k1", concurrency=1, extra_args=INCLUDE, IDEM_LOCK_TTL=lock_ttl, IDEM_SLEEP=60
    )
    charge.apply_async((3, 9))  # the same arguments as the calls below: one fingerprint
    wait_until(
        lambda: count(redis_client, "idem:starts:3") == 1, timeout=30, what="the body to start"
    )
    records = [k for k in redis_client.scan_iter("steplock:idem:*")]
    assert len(records) == 1
    assert redis_client.hget(records[0], "status") == "locked"
    assert 0 < redis_client.pttl(records[0]) <= lock_ttl * 1000
    doomed.kill()  # SIGKILL, the whole process group: nobody completes or releases it
    start_worker("k2", concurrency=2, extra_args=INCLUDE, IDEM_LOCK_TTL=lock_ttl)
    # Sent while the dead holder's record is still locked: re-queued until it expires.
    results = [charge.apply_async((3, 9)) for _ in range(4)]
    values = [r.get(timeout=60) for r in results]
    assert all(v == values[0] for v in values) and values[0]["charged"] == 9
    assert count(redis_client, "idem:starts:3") == 2  # the killed one, then exactly one more
    assert count(redis_client, "idem:done:3") == 1
    assert redis_client.hget(records[0], "status") == "completed"
    assert redis_client.hget(records[0], "attempts") == "1"  # expired, then a new record


def records(redis_client):
    return list(redis_client.scan_iter("steplock:idem:*"))


def test_a_body_longer_than_the_lock_ttl_keeps_its_record_in_a_worker(start_worker, redis_client):
    """Issue 24: a worker's heartbeat renews its running body's record, so deliveries of the
    key after the lock TTL are refused (other arguments: IdempotencyKeyReused; the same:
    re-queued, then the first's result) instead of running the body a second time."""
    lock_ttl = 1.0
    start_worker("l1", concurrency=2, extra_args=INCLUDE, IDEM_LOCK_TTL=lock_ttl, IDEM_SLEEP=6)
    first = charge.apply_async((4, 9))
    wait_until(
        lambda: count(redis_client, "idem:starts:4") == 1, timeout=30, what="the body to start"
    )
    since = time.monotonic()
    (record,) = records(redis_client)
    wait_until(lambda: time.monotonic() - since > 2 * lock_ttl, timeout=10, what="two lock TTLs")
    reused = charge.apply_async((4, 10))  # the other worker process takes it
    same = charge.apply_async((4, 9))
    reused.get(timeout=60, propagate=False)
    assert (reused.state, type(reused.result).__name__) == ("FAILURE", "IdempotencyKeyReused")
    assert redis_client.hget(record, "status") == "locked"  # renewed past its lock TTL
    value = first.get(timeout=60)
    assert same.get(timeout=60) == value  # re-queued while in progress, then replayed
    assert count(redis_client, "idem:starts:4") == 1
    assert count(redis_client, "idem:done:4") == 1
    assert redis_client.hget(record, "status") == "completed"
    assert redis_client.hget(record, "attempts") == "1"


def test_a_renewed_record_expires_after_its_lock_ttl_once_its_worker_is_killed(
    start_worker, redis_client
):
    """The renewals stop with the process: a worker SIGKILLed mid-body leaves its record to
    expire within one lock TTL, after which the key runs again, once."""
    lock_ttl = 1.0
    doomed = start_worker(
        "d1", concurrency=1, extra_args=INCLUDE, IDEM_LOCK_TTL=lock_ttl, IDEM_SLEEP=120
    )
    charge.apply_async((6, 9))
    wait_until(
        lambda: count(redis_client, "idem:starts:6") == 1, timeout=30, what="the body to start"
    )
    (record,) = records(redis_client)
    since = time.monotonic()
    while time.monotonic() - since < 3 * lock_ttl:  # three lock TTLs into the body
        assert redis_client.hget(record, "status") == "locked"
        time.sleep(0.1)
    doomed.kill()  # SIGKILL, the whole process group: no renewal, completion or release
    assert redis_client.pttl(record) <= lock_ttl * 1000  # at most one lock TTL left (-2: gone)
    wait_until(lambda: not redis_client.exists(record), timeout=30, what="the record to expire")
    start_worker("d2", concurrency=1, extra_args=INCLUDE, IDEM_LOCK_TTL=lock_ttl, IDEM_SLEEP=0)
    value = charge.apply_async((6, 9)).get(timeout=60)
    assert value["charged"] == 9 and charge.apply_async((6, 9)).get(timeout=60) == value
    assert count(redis_client, "idem:starts:6") == 2  # the killed body, then exactly one more
    assert count(redis_client, "idem:done:6") == 1
