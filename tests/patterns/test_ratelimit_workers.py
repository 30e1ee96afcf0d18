"""Cluster-wide rate limits across real workers: two ``celery worker`` instances (one
prefork, one threads pool; two processes or threads each) run rate-limited tasks, every
execution appends its grant and start times (Redis TIME) to a list, and the checkers of
tests/support/oracles.py judge the whole history: no window of the configured length holds
more starts than the limit, no interval more than ``capacity + rate * t``. The negative
control runs the same checker on Celery's own per-worker ``rate_limit`` with the same
figures, which the two workers together exceed."""

import json
import time

import pytest

from tests.support.oracles import bucket_excess, max_in_window

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.no_database]

LIMIT, WINDOW = 5, 1.0  # sliding window: 5 per second
RATE, CAPACITY = 5.0, 2  # token bucket: 5 per second, bursts of 2
TASKS = 20
QUEUES = ("q.rl-prefork", "q.rl-threads")


@pytest.fixture
def workers(worker_env, tmp_path):
    from tests.conftest import ROOT
    from tests.support import servers

    env = {
        **worker_env,
        "RL_LIMIT": str(LIMIT),
        "RL_WINDOW": str(WINDOW),
        "RL_RATE": str(RATE),
        "RL_CAPACITY": str(CAPACITY),
        "RL_HISTORY": "rl:history",
    }
    started = []
    try:
        # A queue each, so that both certainly run their share of every limit; started side
        # by side, then waited for.
        for name, pool in (("rl-prefork", "prefork"), ("rl-threads", "threads")):
            started.append(
                servers.celery_worker(
                    app="tests.support.ratelimit_app",
                    name=name,
                    concurrency=2,
                    pool=pool,
                    env=env,
                    logfile=tmp_path / f"{name}.log",
                    cwd=ROOT,
                    extra_args=("-Q", f"q.{name}"),
                    wait=False,
                )
            )
        for worker in started:
            worker.wait_ready()
        yield started
    finally:
        for worker in started:
            worker.kill()  # the test is over: no warm shutdown (tests/conftest.py)


def _history(redis_client, count, timeout=45.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if redis_client.llen("rl:history") >= count:
            break
        time.sleep(0.2)
    records = [json.loads(x) for x in redis_client.lrange("rl:history", 0, -1)]
    assert len(records) == count, f"{len(records)} of {count} ran in {timeout} s"
    return records


def test_cluster_limits_hold_across_prefork_and_threads_workers(workers, redis_client):
    from tests.support import ratelimit_app

    for i in range(TASKS):
        queue = QUEUES[i % 2]
        ratelimit_app.window.apply_async((i,), queue=queue)
        ratelimit_app.bucket.apply_async((i,), queue=queue)
    records = _history(redis_client, 2 * TASKS)
    window = [r for r in records if r["kind"] == "window"]
    bucket = [r for r in records if r["kind"] == "bucket"]
    assert sorted(r["i"] for r in window) == sorted(r["i"] for r in bucket) == list(range(TASKS))
    # Both workers ran each kind (the limit is shared, not per worker).
    assert {r["worker"].split("@")[0] for r in window} == {"rl-prefork", "rl-threads"}
    assert {r["worker"].split("@")[0] for r in bucket} == {"rl-prefork", "rl-threads"}

    # The grants, by Redis TIME: exact.
    most, _ = max_in_window([r["granted"] for r in window], WINDOW)
    assert most == LIMIT  # it admitted up to the limit, never past it
    assert bucket_excess([r["granted"] for r in bucket], RATE, CAPACITY) <= 1e-3
    # The bodies' own starts lag their grants by the dispatch (a few ms): the same bound
    # holds over windows shortened by the largest lag measured.
    lag = max(r["start"] - r["granted"] for r in window + bucket)
    assert 0 <= lag < 0.5
    assert max_in_window([r["start"] for r in window], WINDOW - lag)[0] <= LIMIT
    # Denied tasks were re-queued (not slept in their slots) and came back with a ticket.
    assert max(r["retries"] for r in window) >= 1 and max(r["retries"] for r in bucket) >= 1
    assert all(r["ticket"] for r in window + bucket if r["retries"])
    assert not any(r["ticket"] for r in window + bucket if not r["retries"])
    print(
        f"window: {most} in one {WINDOW:g} s (limit {LIMIT}); bucket excess "
        f"{bucket_excess([r['granted'] for r in bucket], RATE, CAPACITY):.4f}; lag "
        f"{lag * 1000:.1f} ms; retries up to {max(r['retries'] for r in window + bucket)}"
    )
    # The run took as long as the limit says: 20 at 5 per second.
    starts = sorted(r["granted"] for r in window)
    assert starts[-1] - starts[0] >= (TASKS - LIMIT) / LIMIT * WINDOW - 0.01
    # Every ticket was found again by its own re-queued message (bound to its task id,
    # arguments and limit) and used up: none is left waiting in a queue.
    from celery_steplock.patterns.ratelimit import SlidingWindow, TokenBucket

    for limiter, name in (
        (SlidingWindow(LIMIT, WINDOW), "rl.window"),
        (TokenBucket(RATE, CAPACITY), "rl.bucket"),
    ):
        queue = limiter.redis_key(ratelimit_app.window.steplock_plan.store.prefix, name)[1]
        assert redis_client.zcard(queue) == 0, redis_client.zrange(queue, 0, -1)


def test_a_forged_ticket_header_is_no_ticket_on_a_real_worker(workers, redis_client, tmp_path):
    from celery_steplock.patterns.ratelimit import TICKETS_HEADER
    from tests.support import ratelimit_app

    prefix = ratelimit_app.window.steplock_plan.store.prefix
    key = ratelimit_app.SlidingWindow(LIMIT, WINDOW).redis_key(prefix, "rl.window")[0]
    forged = ["forged", {key: ["x"]}, {key: 12345}, {key: "f" * 100_000}]
    for i, header in enumerate(forged):
        ratelimit_app.window.apply_async(
            (i,), queue=QUEUES[i % 2], headers={TICKETS_HEADER: header}
        )
    records = _history(redis_client, len(forged), timeout=30.0)
    # Each ran (admitted as a newcomer), on both workers; none failed with a raw error.
    assert sorted(r["i"] for r in records) == list(range(len(forged)))
    assert {r["worker"].split("@")[0] for r in records} == {"rl-prefork", "rl-threads"}
    # And each was logged as a structured event, the value never whole.
    deadline = time.monotonic() + 15
    while True:
        lines = [
            line
            for log in tmp_path.glob("rl-*.log")
            for line in log.read_text(errors="replace").splitlines()
            if "event=rate_limit_ticket_refused" in line
        ]
        if len(lines) >= len(forged) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(lines) == len(forged), lines
    assert all(len(line) < 1000 for line in lines)


def test_negative_control_celerys_per_worker_rate_limit_exceeds(workers, redis_client):
    from tests.support import ratelimit_app

    for i in range(TASKS):
        ratelimit_app.celery_limited.apply_async((i,), queue=QUEUES[i % 2])
    records = _history(redis_client, TASKS)
    assert {r["worker"].split("@")[0] for r in records} == {"rl-prefork", "rl-threads"}
    most, _ = max_in_window([r["start"] for r in records], WINDOW)
    # "5/s" per worker: two workers run up to twice that in a second; the checker flags it.
    print(f"celery rate_limit, 2 workers: {most} in one {WINDOW:g} s (limit {LIMIT})")
    assert most > LIMIT
