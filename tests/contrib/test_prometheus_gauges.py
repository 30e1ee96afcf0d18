"""celery_steplock.contrib.prometheus: the wait gauges (executions waiting for a lease or a
limit now, and the start of the oldest wait), on a real redis-server: with threads of this
process (single-process mode), and across real processes in multiprocess mode, one of them
SIGKILLed while it waits."""

import signal
import sys
import textwrap
import threading
import time

import pytest
from celery import Celery
from prometheus_client import CollectorRegistry

from celery_steplock.contrib import prometheus
from celery_steplock.lease import holder_metadata
from celery_steplock.lock import WAITS
from celery_steplock.patterns.concurrency import ConcurrencyLimit
from celery_steplock.task import StepLockedTask
from tests.support import ROOT
from tests.support.processes import ProcessGroup, wait_until

pytestmark = pytest.mark.no_database

TASK = "tests.gauges.waiter"
WAITING = "steplock_lease_waiting"
OLDEST = "steplock_lease_oldest_wait_start_timestamp_seconds"


@pytest.fixture
def metrics(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv("prometheus_multiproc_dir", raising=False)
    prometheus.uninstall()
    metrics = prometheus.install(registry=CollectorRegistry())
    yield metrics
    prometheus.uninstall()


def value(registry, name, **labels):
    return registry.get_sample_value(name, labels)


class Waiter(threading.Thread):
    """Runs ``call`` on a thread; ``.result`` is what it returned, ``.error`` what it raised."""

    def __init__(self, call):
        super().__init__(daemon=True)
        self.call, self.result, self.error = call, None, None

    def run(self):
        try:
            self.result = self.call()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def test_a_thread_waiting_for_a_held_lease_shows_in_the_gauges_until_it_acquires(metrics, lock):
    registry = metrics.registry
    holder = lock.acquire("gauges-busy", ttl=30)
    assert value(registry, WAITING, task=TASK) is None  # nothing waited yet
    before = time.time()
    waiter = Waiter(
        lambda: lock.acquire(
            "gauges-busy", ttl=30, wait=20, metadata=holder_metadata("tid-1", TASK)
        )
    )
    waiter.start()
    wait_until(lambda: value(registry, WAITING, task=TASK) == 1, timeout=10, what="1 waiting")
    started = value(registry, OLDEST, task=TASK)
    assert before <= started <= time.time()
    assert [(kind, label) for kind, label, _ in WAITS.current()] == [("lease", TASK)]
    assert lock.release("gauges-busy", holder.owner)
    waiter.join(10)
    assert waiter.error is None and waiter.result is not None  # it got the lease
    assert value(registry, WAITING, task=TASK) == 0
    assert value(registry, OLDEST, task=TASK) is None  # no wait in progress: no series
    assert WAITS.current() == []


def test_an_asyncio_waiter_is_counted_until_it_acquires_or_is_cancelled(
    metrics, lock, redis_server_url
):
    """The event loop's store waits as the thread's: counted from its first refusal, and
    forgotten when it acquires or when its caller is cancelled."""
    import asyncio

    from celery_steplock.aio import AsyncRedisLeaseStore
    from celery_steplock.clients import async_twin

    registry = metrics.registry
    holder = lock.acquire("gauges-async", ttl=30)
    seen = []

    async def main():
        astore = AsyncRedisLeaseStore(async_twin(lock.client), prefix=lock.prefix)
        try:
            meta = holder_metadata("tid-a", TASK)
            cancelled = asyncio.ensure_future(
                astore.acquire("gauges-async", "waiter-1", 30, wait=20, metadata=meta)
            )
            waiter = asyncio.ensure_future(
                astore.acquire("gauges-async", "waiter-2", 30, wait=20, metadata=meta)
            )
            deadline = time.monotonic() + 10
            while value(registry, WAITING, task=TASK) != 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            seen.append(value(registry, WAITING, task=TASK))
            cancelled.cancel()
            await asyncio.gather(cancelled, return_exceptions=True)
            seen.append(value(registry, WAITING, task=TASK))
            assert lock.release("gauges-async", holder.owner)
            lease = await asyncio.wait_for(waiter, 10)
            seen.append(value(registry, WAITING, task=TASK))
            await astore.release(lease.name, lease.owner)
        finally:
            await astore.client.aclose()

    asyncio.run(main())
    assert seen == [2, 1, 0]
    assert WAITS.current() == []


def test_a_task_waiting_in_lock_wait_is_counted_under_its_name(metrics, redis_server_url):
    """A real StepLockedTask with ``lock_wait``: the second execution of one key waits (the
    path a worker runs, ``apply()`` on threads), counted under the task's name."""
    app = Celery("gauges", set_as_current=False)
    app.conf.update(
        broker_url=redis_server_url,
        steplock_redis_url=redis_server_url,
        steplock_key_prefix="gauges",
    )
    gate = threading.Event()

    def body(self):
        assert gate.wait(20)
        return "ran"

    task = app.task(
        bind=True,
        base=StepLockedTask,
        name="tests.gauges.locked",
        shared=False,
        lock_key="gauges-one",
        lock_wait=20,
    )(body)
    registry = metrics.registry
    first = Waiter(lambda: task.apply().get())
    first.start()
    wait_until(
        lambda: value(registry, "steplock_leases_held", task=task.name) == 1,
        timeout=10,
        what="the first execution holding the lease",
    )
    before = time.time()
    second = Waiter(lambda: task.apply().get())
    second.start()
    wait_until(lambda: value(registry, WAITING, task=task.name) == 1, timeout=10, what="1 waiting")
    assert before <= value(registry, OLDEST, task=task.name) <= time.time()
    gate.set()
    first.join(20)
    second.join(20)
    assert (first.error, first.result, second.error, second.result) == (None, "ran", None, "ran")
    assert value(registry, WAITING, task=task.name) == 0
    assert value(registry, OLDEST, task=task.name) is None
    waited = registry.get_sample_value("steplock_wait_seconds_count", {"task": task.name})
    assert waited == 2  # the histogram saw both acquires, the wait included


def test_a_wait_that_times_out_leaves_the_gauges_and_an_acquire_granted_at_once_never_touches_them(
    metrics, lock
):
    calls = []
    listener = WAITS.listener
    WAITS.listener = lambda *args: (calls.append(args), listener(*args))
    try:
        for _ in range(3):  # free: granted by the first attempt, with or without wait
            lease = lock.acquire("gauges-free", ttl=5, wait=5, metadata=holder_metadata("t", TASK))
            assert lease is not None and lock.release("gauges-free", lease.owner)
        assert calls == []
        holder = lock.acquire("gauges-free", ttl=30)
        assert lock.acquire("gauges-free", wait=0.3, metadata=holder_metadata("t", TASK)) is None
        assert [args[:3] for args in calls] == [("lease", TASK, 1), ("lease", TASK, 0)]
        assert calls[1][3] is None
        assert value(metrics.registry, WAITING, task=TASK) == 0
        assert value(metrics.registry, OLDEST, task=TASK) is None
        lock.release("gauges-free", holder.owner)
    finally:
        WAITS.listener = listener


def test_a_thread_waiting_for_a_concurrency_slot_shows_in_the_limit_gauges(metrics, redis_client):
    registry = metrics.registry
    limit = ConcurrencyLimit(1, retry_after=0.2)
    labels = {"kind": "concurrency", "limit": "gauges-pool"}
    first = limit.acquire("gauges-pool", client=redis_client, prefix="t", ttl=30)
    slot = first.__enter__()
    assert slot is not None
    try:
        before = time.time()

        def wait_for_a_slot():
            with limit.acquire("gauges-pool", client=redis_client, prefix="t", wait=20) as got:
                return got.index

        waiter = Waiter(wait_for_a_slot)
        waiter.start()
        wait_until(
            lambda: value(registry, "steplock_limit_waiting", **labels) == 1,
            timeout=10,
            what="1 waiting for a slot",
        )
        started = value(registry, "steplock_limit_oldest_wait_start_timestamp_seconds", **labels)
        assert before <= started <= time.time()
    finally:
        first.__exit__(None, None, None)
    waiter.join(10)
    assert waiter.error is None and waiter.result == 0  # it got the slot
    assert value(registry, "steplock_limit_waiting", **labels) == 0
    assert value(registry, "steplock_limit_oldest_wait_start_timestamp_seconds", **labels) is None


CHILD = textwrap.dedent(
    """
    import sys, time
    from celery_steplock.contrib import prometheus
    prometheus.install()  # PROMETHEUS_MULTIPROC_DIR is set: multiprocess mode
    import redis
    from celery_steplock.lease import holder_metadata
    from celery_steplock.lock import RedisLeaseStore
    store = RedisLeaseStore(redis.Redis.from_url(sys.argv[1]), prefix="t")
    print("waiting", flush=True)
    lease = store.acquire("gauges-mp", ttl=30, wait=60, metadata=holder_metadata("t", sys.argv[2]))
    print("acquired", lease is not None, flush=True)
    time.sleep(120)
    """
)


def scrape(path):
    registry = CollectorRegistry()
    prometheus.MultiProcessCollector(registry, path=str(path))
    return registry


def test_waiters_of_several_processes_are_summed_the_oldest_is_the_min_and_a_killed_one_leaves(
    redis_server_url, lock, tmp_path
):
    """Two processes wait (multiprocess mode, one directory): the count is their sum, the
    oldest start the first one's; the first one SIGKILLed (no shutdown hook ran, its files
    stay) leaves both gauges at once; the second one acquiring leaves no series of a start."""
    directory = tmp_path / "prometheus"
    directory.mkdir()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(directory), "PYTHONPATH": str(ROOT)}
    holder = lock.acquire("gauges-mp", ttl=60)
    children = []

    def child(name):
        process = ProcessGroup(
            [sys.executable, "-c", CHILD, redis_server_url, TASK],
            env=env,
            cwd=ROOT,
            logfile=tmp_path / f"{name}.log",
        ).start()
        children.append(process)
        process.wait_for_log("waiting", timeout=30)
        return process

    try:
        before = time.time()
        first = child("first")
        wait_until(lambda: value(scrape(directory), WAITING, task=TASK) == 1, what="1 waiting")
        first_started = value(scrape(directory), OLDEST, task=TASK)
        assert before <= first_started <= time.time()
        second = child("second")
        wait_until(lambda: value(scrape(directory), WAITING, task=TASK) == 2, what="2 waiting")
        assert value(scrape(directory), OLDEST, task=TASK) == first_started  # livemin

        first.signal(signal.SIGKILL)
        wait_until(lambda: not first.alive(), timeout=10, what="the first waiter gone")
        assert (directory / f"gauge_livesum_{first.pid}.db").exists()  # never cleaned up
        assert (directory / f"gauge_livemin_{first.pid}.db").exists()
        after_kill = scrape(directory)
        assert value(after_kill, WAITING, task=TASK) == 1
        second_started = value(after_kill, OLDEST, task=TASK)
        assert first_started < second_started <= time.time()

        assert lock.release("gauges-mp", holder.owner)
        second.wait_for_log("acquired True", timeout=30)
        done = scrape(directory)
        assert value(done, WAITING, task=TASK) == 0
        assert value(done, OLDEST, task=TASK) is None  # +Inf in the file: left out
    finally:
        for process in children:
            if process.alive():
                process.signal(signal.SIGKILL)
