"""Activity per minute (celery_steplock.activity): the aggregator's counts, the flusher's one
round trip, the reader's series and its handling of corrupt entries, against a real
redis-server."""

from __future__ import annotations

import logging
import os
import time
from bisect import bisect_left
import timeit

import pytest

from celery_steplock import activity, signals
from celery_steplock.activity import BOUNDS, Aggregator, activity_key, quantile, read
from celery_steplock.events import emit
from celery_steplock.lock import get_lease_store, make_client

pytestmark = pytest.mark.no_database  # runs once, in the SQLite pass

NOW = 1_800_000_000.0  # a minute boundary: 30_000_000 * 60
MINUTE = int(NOW) // 60


def send(agg, signal, at=NOW, **fields):
    agg.receive(None, signal=signal, event=signal.name, timestamp=at, **fields)


def test_bounds_are_log_spaced_from_one_millisecond():
    assert BOUNDS[0] == 0.001 and len(BOUNDS) == 48
    assert all(abs(b / a - 2**0.5) < 1e-9 for a, b in zip(BOUNDS, BOUNDS[1:]))
    assert quantile([0] * 49, 0.5) is None
    hist = [0] * 49
    hist[10], hist[20] = 19, 1  # 95 % at or below bucket 10
    assert quantile(hist, 0.5) == BOUNDS[10] and quantile(hist, 0.95) == BOUNDS[10]
    assert quantile(hist, 1.0) == BOUNDS[20]
    hist[48] = 100  # the overflow bucket reads back as the last bound
    assert quantile(hist, 0.95) == BOUNDS[-1]


def test_the_aggregator_counts_per_minute_task_and_bucket():
    agg = Aggregator()
    agg.flusher = False  # no flusher thread: the test flushes by hand
    send(agg, signals.lock_acquired, task_name="t.a", wait_seconds=0.0004)
    send(agg, signals.lock_acquired, task_name="t.a", wait_seconds=0.03)
    send(agg, signals.lock_acquired, at=NOW + 61, task_name="t.a", wait_seconds=0.0)
    send(agg, signals.lock_released, task_name="t.a", hold_seconds=1.5)
    send(agg, signals.lock_released, task_name="t.a", hold_seconds=1.5, forced=True)
    send(agg, signals.lock_contended, task_name="t.a", wait_seconds=0.1)
    send(agg, signals.transition_conflict, task_name="t.a")
    send(agg, signals.idempotency_replayed, task_name="t.a")
    send(agg, signals.rate_limit_allowed, name="api", key="p:rl:{api}")
    send(agg, signals.rate_limited, name="api", key="p:rl:{api}")
    send(agg, signals.circuit_opened, at=NOW + 7.9, name="pay", state="open")
    send(agg, signals.lock_extended, task_name="t.a")  # not counted
    assert agg.pending() == {
        (MINUTE, "t.a|exec|"): 2,
        (MINUTE, "t.a|wait|0"): 1,
        (MINUTE, "t.a|wait|10"): 1,  # 0.03 s: 0.0226 < x <= 0.032
        (MINUTE + 1, "t.a|exec|"): 1,
        (MINUTE + 1, "t.a|wait|0"): 1,
        (MINUTE, "t.a|hold|22"): 1,  # 1.5 s: 1.448 < x <= 2.048; the forced one left out
        (MINUTE, "t.a|contended|"): 1,
        (MINUTE, "t.a|conflict|"): 1,
        (MINUTE, "t.a|duplicate|"): 1,
        (MINUTE, "api|admitted|"): 1,
        (MINUTE, "api|limited|"): 1,
        (MINUTE, "pay|state|7:open"): 1,
    }
    assert BOUNDS[9] < 0.03 <= BOUNDS[10] and BOUNDS[21] < 1.5 <= BOUNDS[22]


def test_a_receiver_that_gets_garbage_never_raises():
    agg = Aggregator(flusher=False)
    agg.receive(None, event="lock_acquired", timestamp="soon", wait_seconds="x", task_name=None)
    agg.receive(None, event="circuit_closed", timestamp=object())
    agg.receive(None)
    assert (int(time.time()) // 60, "|exec|") in agg.pending()


def test_one_flush_is_one_round_trip_and_the_reader_returns_the_series(private_redis):
    client = make_client(private_redis.url)
    agg = Aggregator(flusher=False)
    for i in range(200):
        send(agg, signals.lock_acquired, task_name=f"t.{i % 20}", wait_seconds=0.002 * (i % 7))
        send(agg, signals.lock_released, task_name=f"t.{i % 20}", hold_seconds=0.05)
    send(agg, signals.lock_contended, at=NOW - 60, task_name="t.0")
    send(agg, signals.circuit_opened, at=NOW - 60 + 3, name="pay")
    send(agg, signals.circuit_half_opened, at=NOW + 30, name="pay")
    fields = len(agg.pending())
    client.config_resetstat()
    before = client.info("stats")["total_reads_processed"]
    assert agg.flush(client, "p") == fields and agg.flushes == 1
    after = client.info("stats")["total_reads_processed"]
    stats = client.info("commandstats")
    # One pipelined write, one wait for the replies: Redis reads a request 16 KiB at a time,
    # so a batch this size (20 tasks, about 10 KiB) is one read event or two on the server
    # (the INFO call after it is one more).
    print(f"\nflush: {fields} fields, {after - before - 1} read event(s) on the server")
    assert 1 <= after - before - 1 <= 2
    assert stats["cmdstat_hincrby"]["calls"] == fields
    assert stats["cmdstat_pexpire"]["calls"] == 2  # one per minute
    assert 0 < client.pttl(activity_key("p", MINUTE)) <= activity.RETENTION * 1000
    assert agg.flush(client, "p") == 0  # nothing counted since: nothing sent

    data = read(client, "p", minutes=60, now=NOW + 5)
    assert (data.start, data.minutes, data.malformed) == (MINUTE - 59, 60, 0)
    assert len(data.tasks) == 20 and sorted(data.tasks) == sorted(f"t.{i}" for i in range(20))
    t0 = data.tasks["t.0"]
    assert t0.executions[-1] == 10 and sum(t0.executions) == 10 and t0.contended[-2] == 1
    assert t0.hold_p50[-1] == BOUNDS[bisect_left(BOUNDS, 0.05)]
    assert t0.wait_p50[:-1] == [None] * 59
    assert data.breakers["pay"].transitions == [(58 * 60 + 3, "open"), (59 * 60 + 30, "half_open")]
    # A second process's counts add up in the same hash.
    other = Aggregator(flusher=False)
    send(other, signals.lock_acquired, task_name="t.0", wait_seconds=0.001)
    before = client.info("stats")["total_reads_processed"]
    assert other.flush(client, "p") == 2
    assert client.info("stats")["total_reads_processed"] - before - 1 == 1  # one round trip
    assert read(client, "p", now=NOW).tasks["t.0"].executions[-1] == 11
    client.close()


def test_corrupt_entries_are_counted_as_malformed_never_raised(redis_client):
    key = activity_key("p", MINUTE)
    redis_client.hset(
        key,
        mapping={
            "t.a|exec|": "3",
            "t.a|exec|x": "1",  # a counter with a bucket
            "t.a|wait|99": "1",  # no such bucket
            "t.a|wait|-1": "1",
            "t.a|hold|3": "lots",  # not a number
            "t.a|contended|": "-2",  # negative
            "no pipes": "1",
            "t.a|mystery|": "1",
            "pay|state|61:open": "1",
            "pay|state|3:melting": "1",
            "pay|state|3": "1",
            b"t.\xff|exec|": "1",  # not UTF-8: read with U+FFFD (the client's "replace")
        },
    )
    redis_client.set(activity_key("p", MINUTE - 1), "a string")  # WRONGTYPE for HGETALL
    data = read(redis_client, "p", minutes=5, now=NOW)
    assert data.malformed == 11
    assert list(data.tasks) == ["t.a", "t.\ufffd"] and data.tasks["t.a"].executions == [
        0,
        0,
        0,
        0,
        3,
    ]
    assert data.breakers == {} and data.limits == {}


def test_redis_down_drops_the_batch_and_warns_once(caplog, private_redis):
    client = make_client(private_redis.url, socket_timeout=0.5)
    private_redis.stop()
    agg = Aggregator(flusher=False)
    with caplog.at_level(logging.DEBUG, logger="celery_steplock"):
        send(agg, signals.lock_acquired, task_name="t.a", wait_seconds=0.0)
        assert agg.flush(client, "p") == 0
        send(agg, signals.transition_conflict, task_name="t.a")
        assert agg.flush(client, "p") == 0
    lines = [r for r in caplog.records if r.steplock["event"] == "activity_dropped"]
    assert [r.levelno for r in lines] == [logging.WARNING, logging.DEBUG]
    assert agg.dropped == 3 and agg.pending() == {}


def test_install_connects_once_and_the_flusher_thread_writes(app, redis_client):
    app.conf.steplock_activity_flush_interval = 1.0
    app.conf.steplock_activity = True
    activity.uninstall()
    agg = activity.install(app)
    try:
        assert activity.install() is agg
        before = redis_client.info("commandstats").get("cmdstat_hincrby", {}).get("calls", 0)
        emit(signals.lock_acquired, None, logging.DEBUG, task_name="t.thread", wait_seconds=0.01)
        emit(signals.lock_acquired, None, logging.DEBUG, task_name="t.thread", wait_seconds=0.01)
        assert agg._thread is not None and agg._thread.name == "steplock-activity"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not agg.flushes:
            time.sleep(0.05)
        assert agg.flushes == 1
        data = read(redis_client, get_lease_store(app).prefix, minutes=2)
        assert sum(data.tasks["t.thread"].executions) == 2
        after = redis_client.info("commandstats")["cmdstat_hincrby"]["calls"]
        assert after - before == 2  # exec and one wait bucket
        # The setting off: the counts are dropped at the flush, nothing written.
        app.conf.steplock_activity = False
        emit(signals.lock_acquired, None, logging.DEBUG, task_name="t.off", wait_seconds=0.0)
        assert agg.flush() == 0 and agg.pending() == {}
        assert "t.off" not in read(redis_client, get_lease_store(app).prefix, minutes=2).tasks
    finally:
        activity.uninstall()


def test_off_by_default_an_event_costs_an_attribute_read(app, redis_client):
    activity.uninstall()
    agg = activity.install(app)
    try:
        agg.flusher = False
        assert agg.enabled is None and agg.refresh() == 10.0 and agg.enabled is False
        emit(signals.lock_acquired, None, logging.DEBUG, task_name="t.off", wait_seconds=0.0)
        assert agg.pending() == {}
        app.conf.steplock_activity = True
        agg.refresh()
        emit(signals.lock_acquired, None, logging.DEBUG, task_name="t.on", wait_seconds=0.0)
        assert agg.flush() == 2 and redis_client.keys("steplock:activity:*")
    finally:
        activity.uninstall()


def test_a_forked_child_starts_with_nothing_counted():
    activity.uninstall()
    agg = activity.install()
    try:
        agg.flusher = False
        send(agg, signals.transition_conflict, task_name="t.parent")
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os.write(write_end, repr(len(agg.pending())).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(read_end, 16) == b"0"
        assert len(agg.pending()) == 1
    finally:
        activity.uninstall()


def test_cost_per_event_is_printed():
    agg = Aggregator(flusher=False)
    fields = {"task_name": "shop.charge", "wait_seconds": 0.0042, "timestamp": NOW}
    n = 50_000
    acquired = min(
        timeit.repeat(
            lambda: agg.count(None, "lock_acquired", fields),
            number=n,
            repeat=5,
        )
    )
    ignored = min(
        timeit.repeat(
            lambda: agg.count(None, "lock_extended", fields),
            number=n,
            repeat=5,
        )
    )
    print(
        f"\ntap: lock_acquired {acquired / n * 1e6:.2f} us/event "
        f"(two counters), an event not counted {ignored / n * 1e6:.2f} us/event"
    )
    assert agg.pending()[(MINUTE, "shop.charge|exec|")] == 5 * n


def test_cost_of_emit_with_the_aggregator_is_printed():
    """What a task's event costs more with the aggregator connected: emit() with it and
    without, interleaved (the other receivers of the process, e.g. the event log's, stay)."""
    activity.uninstall()
    fields = {"task_name": "shop.charge", "wait_seconds": 0.0042, "key": "k", "owner": "o"}

    def one():
        emit(signals.lock_acquired, None, logging.DEBUG, **fields)

    n, runs = 20_000, {"without": [], "with": []}
    try:
        for _ in range(3):
            runs["without"].append(timeit.timeit(one, number=n))
            agg = activity.install()
            agg.flusher = False
            runs["with"].append(timeit.timeit(one, number=n))
            activity.uninstall()
    finally:
        activity.uninstall()
    without, with_ = min(runs["without"]) / n * 1e6, min(runs["with"]) / n * 1e6
    print(f"\nemit(lock_acquired): {without:.2f} us without, {with_:.2f} us with the aggregator")
    assert with_ > 0
