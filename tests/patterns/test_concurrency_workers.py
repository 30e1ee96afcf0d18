"""Evidence for the concurrency limit (celery_steplock.patterns.concurrency) with real workers: a
prefork and a threads worker (four executions at once) never run more than N bodies of one
key at a time, by a checker over the recorded (start, end) of every unit of work (Redis
``TIME``), which flags the same run without the limit (the negative control); a holder
SIGKILLed leaves its slot to the TTL and the next waiter runs; a holder SIGSTOPped past its
TTL loses its slot to the next one, stops counting as a holder when it resumes, and its
release leaves the new holder's slot alone. Tasks: tests/patterns/concurrency_tasks.py."""

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.patterns import concurrency_tasks as tasks
from tests.support.processes import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

INCLUDE = ("-I", "tests.patterns.concurrency_tasks")
TTL = 2.0  # the workers' lease TTL (STEPLOCK_TTL in worker_env): the slots' too


def max_overlap(intervals):
    """The most intervals ``(start, end)`` open at one instant (an end at the same instant
    as a start closes first: touching intervals do not overlap)."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, 0) for _, end in intervals])
    open_now = peak = 0
    for _, opening in edges:
        open_now += 1 if opening else -1
        peak = max(peak, open_now)
    return peak


@pytest.mark.no_database
def test_the_checker_counts_overlaps():
    assert max_overlap([]) == 0
    assert max_overlap([(0, 1), (1, 2), (2, 3)]) == 1
    assert max_overlap([(0, 3), (1, 2), (1.5, 4), (3.5, 5)]) == 3


def runs(redis_client, group):
    return [json.loads(x) for x in redis_client.lrange(f"bk:runs:{group}", 0, -1)]


def done(redis_client, group):
    return sorted(int(x) for x in redis_client.lrange(f"bk:done:{group}", 0, -1))


def holder(redis_client, group, n):
    value = redis_client.get(f"bk:holder:{group}:{n}")
    return json.loads(value) if value else None


def test_never_more_than_n_at_once_on_prefork_and_threads_workers(start_workers, redis_client):
    start_workers(
        dict(name="bkp", concurrency=2, extra_args=INCLUDE),
        dict(name="bkt", concurrency=2, pool="threads", extra_args=INCLUDE),
    )
    count = 10
    for n in range(count):
        tasks.limited.delay("lim", n, units=1, unit_seconds=0.3)
    wait_until(
        lambda: len(done(redis_client, "lim")) == count,
        timeout=90,
        what="every limited task",
        describe=lambda: done(redis_client, "lim"),
    )
    recorded = runs(redis_client, "lim")
    assert sorted(r[0] for r in recorded) == list(range(count))
    observed = max_overlap([(r[1], r[2]) for r in recorded])
    print(f"concurrency_limit=2: {count} executions, at most {observed} at once")
    assert observed <= 2  # concurrency_limit=2
    fences = [r[4] for r in recorded]
    assert len(set(fences)) == count  # one grant each, every fencing token distinct
    assert not list(redis_client.scan_iter(match="steplock:lease:{bk:lim}*"))  # all released

    # The negative control: the same body without the limit, on the same four executors,
    # waiting for three of them to have started. The checker must flag it.
    for n in range(4):
        tasks.unlimited.delay("free", n, barrier=3, units=1, unit_seconds=0.3)
    wait_until(
        lambda: len(done(redis_client, "free")) == 4, timeout=60, what="every unlimited task"
    )
    control = max_overlap([(r[1], r[2]) for r in runs(redis_client, "free")])
    print(f"negative control (no limit): at most {control} at once, flagged: {control > 2}")
    assert control >= 3 > 2


def test_a_sigkilled_holder_leaves_its_slot_to_the_ttl_and_the_waiter_runs(
    start_workers, redis_client
):
    doomed, _ = start_workers(
        dict(name="bkdoomed", concurrency=1, extra_args=(*INCLUDE, "-Q", "bkdoomed")),
        dict(name="bknext", concurrency=2, pool="threads", extra_args=INCLUDE),
    )
    tasks.single.apply_async(("kill", 0), {"units": 100, "unit_seconds": 0.1}, queue="bkdoomed")
    held = wait_until(lambda: holder(redis_client, "kill", 0), timeout=30, what="the first holder")
    assert held["pid"] in doomed.children_pids(recursive=True)  # a prefork child holds it
    wait_until(lambda: runs(redis_client, "kill"), what="a unit of the holder")
    tasks.single.delay("kill", 1, units=1, unit_seconds=0.1)
    wait_until(
        lambda: redis_client.zcard("steplock:bulkhead:{bk:kill}:queue"),
        timeout=30,
        what="the second task to wait",
    )
    os.kill(held["pid"], signal.SIGKILL)
    killed_at = tasks.now(redis_client)
    wait_until(
        lambda: done(redis_client, "kill") == [1],
        timeout=60,
        what="the waiter to run after the holder died",
    )
    recorded = runs(redis_client, "kill")
    # (acks_late: the killed task is redelivered and runs again later, as a newcomer that
    # the waiter, queued first, precedes.)
    first = [r for r in recorded if r[3] == held["pid"]]
    second = [r for r in recorded if r[0] == 1]
    assert len(second) == 1
    # The killed holder held its slot until it died; the waiter started after that, and
    # after the slot's TTL ran out (it was renewed at most TTL / 3 before the kill).
    assert second[0][1] >= killed_at
    intervals = [(r[1], r[2]) for r in recorded] + [(first[-1][2], killed_at)]
    assert max_overlap(intervals) == 1
    assert second[0][4] > first[0][4]  # a later grant, a larger fencing token


def test_a_sigstopped_holder_loses_its_slot_and_its_release_frees_nothing(
    start_workers, redis_client
):
    stopped, _ = start_workers(
        dict(name="bkstopped", concurrency=1, extra_args=(*INCLUDE, "-Q", "bkstop")),
        dict(name="bkrunner", concurrency=2, pool="threads", extra_args=INCLUDE),
    )
    tasks.single.apply_async(("stop", 0), {"units": 60, "unit_seconds": 0.1}, queue="bkstop")
    first = wait_until(
        lambda: holder(redis_client, "stop", 0), timeout=30, what="the first holder"
    )
    assert first["pid"] in stopped.children_pids(recursive=True)
    wait_until(lambda: runs(redis_client, "stop"), what="a unit of the holder")
    os.kill(first["pid"], signal.SIGSTOP)
    try:
        tasks.single.delay("stop", 1, units=40, unit_seconds=0.1)
        second = wait_until(
            lambda: holder(redis_client, "stop", 1),
            timeout=TTL * 10,
            what="the slot to pass to the second task",
        )
        wait_until(
            lambda: [r for r in runs(redis_client, "stop") if r[0] == 1],
            what="a unit of the second holder",
        )
        assert second["key"] == first["key"]  # the same slot, taken over after its TTL
    finally:
        os.kill(first["pid"], signal.SIGCONT)
    # Resumed, the first holder finds its slot lost at its next check: it stops counting.
    wait_until(
        lambda: redis_client.lrange("bk:lost:stop", 0, -1) == ["0"],
        timeout=30,
        what="the resumed holder to see its slot lost",
    )
    # Its release (owner-keyed) left the second holder's slot in place.
    assert redis_client.hget(second["key"], "owner") == second["owner"]
    assert 1 not in done(redis_client, "stop")  # the second holder still runs
    wait_until(
        lambda: done(redis_client, "stop") == [1], timeout=30, what="the second holder to finish"
    )
    recorded = runs(redis_client, "stop")
    assert max_overlap([(r[1], r[2]) for r in recorded]) == 1
    assert {r[0] for r in recorded} == {0, 1}


def test_slots_are_listed_and_force_released_by_the_cli(worker_env, app, redis_client):
    from celery_steplock.patterns.concurrency import ConcurrencyLimit
    from celery_steplock.lock import get_lease_store

    limit = ConcurrencyLimit(3)
    slot = limit.try_acquire(
        get_lease_store(app),
        "cli",
        owner="o" * 32,
        ticket=None,
        ttl=60.0,
        metadata={"kind": "slot", "limit": 3, "limit_key": "cli", "task_name": "t.x"},
    )

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "django_app", "steplock", *args],
            env=worker_env,
            cwd=worker_env["PYTHONPATH"],
            capture_output=True,
            text=True,
            timeout=120,
        )

    listed = cli("ls", "--json")
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)
    assert (row["name"], row["kind"], row["limit"], row["limit_key"]) == (
        "cli}#0",
        "slot",
        3,  # typed JSON: a number
        "cli",
    )
    released = cli("release", "cli}#0", "--owner", slot.owner)
    assert released.returncode == 0, released.stdout + released.stderr
    assert redis_client.exists(slot.lease.key) == 0


def test_the_admin_lists_a_slot_and_offers_its_force_release(admin_client, app, redis_client):
    from django.urls import reverse

    from celery_steplock.patterns.concurrency import ConcurrencyLimit
    from celery_steplock.lock import get_lease_store

    slot = ConcurrencyLimit(2).try_acquire(
        get_lease_store(app),
        "adm",
        owner="a" * 32,
        ticket=None,
        ttl=60.0,
        metadata={"kind": "slot", "limit": 2, "limit_key": "adm", "task_name": "t.x"},
    )
    response = admin_client.get(reverse("admin:celery_steplock_lease_changelist"))
    assert response.status_code == 200
    rows = {row["lease"].name: row for row in response.context["rows"]}
    assert set(rows) == {"adm}#0"} and rows["adm}#0"]["lease"].owner == slot.owner
    confirm = admin_client.get(reverse("admin:celery_steplock_lease_release"), {"name": "adm}#0"})
    assert confirm.status_code == 200
    assert slot.owner in confirm.content.decode()
