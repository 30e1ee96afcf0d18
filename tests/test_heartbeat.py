"""The per-process renewal thread (celery_steplock.heartbeat), against a real redis-server."""
import logging
import multiprocessing
import os
import subprocess
import sys
import threading
import time

import pytest

from celery_steplock import signals
from celery_steplock.heartbeat import Heartbeat, get_heartbeat
from celery_steplock.lock import RedisLeaseStore, make_client


@pytest.fixture
def heartbeat():
    hb = Heartbeat()
    yield hb
    for lease in hb.leases:
        hb.unregister(lease)


@pytest.fixture
def received():
    events = []

    def receiver(sender=None, signal=None, **kwargs):
        events.append((signal.name, kwargs))

    for sig in (signals.lock_extended, signals.lock_lost):
        sig.connect(receiver, weak=False)
    yield events
    for sig in (signals.lock_extended, signals.lock_lost):
        sig.disconnect(receiver)


def test_lease_survives_three_times_its_ttl(lock, heartbeat, redis_client):
    lease = lock.acquire("hb", "o", 0.6)
    heartbeat.register(lease, lock, ratio=1 / 3)
    time.sleep(1.9)
    assert not lease.lost
    assert lock.owned("hb", "o") is not None
    assert redis_client.hget("t:lease:{hb}", "renewed_ms") > \
        redis_client.hget("t:lease:{hb}", "acquired_ms")
    assert 7 <= heartbeat.cycles <= 12


def test_one_round_trip_per_interval_whatever_the_number_of_leases(lock, heartbeat):
    leases = []
    for i in range(200):
        lease = lock.acquire(f"many{i}", f"o{i}", 0.9)
        heartbeat.register(lease, lock, ratio=1 / 3)
        leases.append(lease)
        if i % 50 == 0:
            time.sleep(0.05)  # registered at different times: still one batch per interval
    time.sleep(2.0)
    assert not any(lease.lost for lease in leases)
    assert heartbeat.round_trips == heartbeat.cycles
    assert 5 <= heartbeat.cycles <= 9
    assert len([t for t in threading.enumerate() if t.name == "steplock-heartbeat"]) >= 1
    assert heartbeat.thread is not None


def test_stolen_key_is_noticed_within_one_interval(lock, heartbeat, redis_client, received,
                                                   caplog):
    lease = lock.acquire("steal", "o", 0.9)
    heartbeat.register(lease, lock, ratio=1 / 3, sender="sender-task")
    redis_client.hset("t:lease:{steal}", "owner", "thief")
    with caplog.at_level(logging.ERROR, logger="celery_steplock"):
        deadline = time.monotonic() + 0.3 + 0.05
        while not lease.lost and time.monotonic() < deadline + 0.5:
            time.sleep(0.01)
    assert lease.lost and "another owner" in lease.lost_reason
    lost = [kw for name, kw in received if name == "lock_lost"]
    assert len(lost) == 1 and lost[0]["owner"] == "o" and lost[0]["key"] == "t:lease:{steal}"
    assert any("event=lock_lost" in r.getMessage() and r.levelno == logging.ERROR
               for r in caplog.records)
    assert redis_client.hget("t:lease:{steal}", "owner") == "thief"  # never overwritten
    assert lease not in heartbeat.leases


def test_deleted_key_is_lost(lock, heartbeat, redis_client):
    lease = lock.acquire("gone", "o", 0.6)
    heartbeat.register(lease, lock)
    redis_client.delete("t:lease:{gone}")
    time.sleep(0.35)
    assert lease.lost and "gone" in lease.lost_reason


def test_thread_exits_with_the_last_lease(lock, heartbeat):
    first = lock.acquire("x1", "o", 1.0)
    second = lock.acquire("x2", "o", 1.0)
    heartbeat.register(first, lock)
    heartbeat.register(second, lock)
    thread = heartbeat.thread
    assert thread.is_alive() and thread.daemon
    heartbeat.unregister(first)
    time.sleep(0.05)
    assert thread.is_alive()
    assert heartbeat.unregister(second) is True
    thread.join(1.0)
    assert not thread.is_alive() and heartbeat.thread is None
    assert heartbeat.unregister(second) is False


def test_signal_payload_of_extended(lock, heartbeat, received):
    lease = lock.acquire("sig", "o", 0.3)
    heartbeat.register(lease, lock, sender="s")
    time.sleep(0.25)
    heartbeat.unregister(lease)
    extended = [kw for name, kw in received if name == "lock_extended"]
    assert extended
    payload = extended[0]
    assert payload["owner"] == "o" and payload["fence"] == lease.fence
    assert payload["ttl"] == 0.3 and payload["key"] == "t:lease:{sig}"
    assert payload["timestamp"] > 1e9 and payload["monotonic"] > 0


def test_transient_redis_error_does_not_kill_the_thread(private_redis, heartbeat):
    lock = RedisLeaseStore(make_client(private_redis.url, socket_timeout=0.2), prefix="t")
    lease = lock.acquire("pause", "o", 3.0)
    heartbeat.register(lease, lock, ratio=1 / 3)
    time.sleep(1.1)
    cycles = heartbeat.cycles
    private_redis.pause()
    time.sleep(1.2)
    private_redis.resume()
    time.sleep(1.5)
    assert heartbeat.thread is not None and heartbeat.thread.is_alive()
    assert not lease.lost
    assert heartbeat.cycles > cycles + 1
    assert 1.5 < lock.owned("pause", "o") <= 3.0


def test_outage_longer_than_the_ttl_loses_the_lease(private_redis, heartbeat, received):
    lock = RedisLeaseStore(make_client(private_redis.url, socket_timeout=0.1), prefix="t")
    lease = lock.acquire("outage", "o", 0.6)
    heartbeat.register(lease, lock, ratio=1 / 3)
    private_redis.pause()
    try:
        time.sleep(1.0)
        assert lease.lost and "local validity" in lease.lost_reason
    finally:
        private_redis.resume()
    time.sleep(0.3)
    assert [kw["owner"] for name, kw in received if name == "lock_lost"] == ["o"]


def test_max_hold_stops_renewal(lock, heartbeat, redis_client):
    lease = lock.acquire("hold", "o", 0.3)
    heartbeat.register(lease, lock, max_hold=0.5)
    time.sleep(0.9)
    assert lease.lost and "max hold" in lease.lost_reason
    assert redis_client.exists("t:lease:{hold}") == 0  # expired by TTL, never renewed again


def _child_renews(url, queue):
    hb = get_heartbeat()
    lock = RedisLeaseStore(make_client(url), prefix="t")
    lease = lock.acquire("child", "child-owner", 0.5)
    hb.register(lease, lock)
    inherited = [l.owner for l in hb.leases if l.owner != "child-owner"]
    time.sleep(1.6)
    queue.put((hb.pid == os.getpid(), inherited, lease.lost, lock.owned("child", "child-owner")
               is not None, hb.thread is not None and hb.thread.is_alive()))
    hb.unregister(lease)


def test_forked_child_gets_its_own_heartbeat(lock, redis_server_url):
    parent = get_heartbeat()
    lease = lock.acquire("parent", "parent-owner", 5.0)
    parent.register(lease, lock)
    try:
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        proc = ctx.Process(target=_child_renews, args=(redis_server_url, queue))
        proc.start()
        own_pid, inherited, lost, owned, alive = queue.get(timeout=10)
        proc.join(5)
    finally:
        parent.unregister(lease)
    assert (own_pid, inherited, lost, owned, alive) == (True, [], False, True, True)
    assert proc.exitcode == 0


def test_process_with_a_held_lease_exits_promptly(redis_server_url):
    code = (
        "from celery_steplock.lock import RedisLeaseStore, make_client\n"
        "from celery_steplock.heartbeat import get_heartbeat\n"
        f"lock = RedisLeaseStore(make_client({redis_server_url!r}), prefix='exit')\n"
        "lease = lock.acquire('x', 'o', 30.0)\n"
        "get_heartbeat().register(lease, lock)\n"
        "print('registered', flush=True)\n"
    )
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=20)
    assert out.returncode == 0 and "registered" in out.stdout
    assert time.monotonic() - started < 5


def test_max_hold_is_reported_on_time_not_one_interval_late(lock, heartbeat, received):
    lease = lock.acquire("hold-long-ttl", "o", 30.0)
    heartbeat.register(lease, lock, max_hold=0.4)  # renewals every 10 s
    time.sleep(0.55)
    assert lease.lost and "max hold" in lease.lost_reason
    assert [kw["owner"] for name, kw in received if name == "lock_lost"] == ["o"]


def test_the_thread_idles_between_leases_and_exits_when_idle(lock):
    hb = Heartbeat(idle_timeout=0.3)
    first = lock.acquire("idle1", "o", 1.0)
    hb.register(first, lock)
    thread = hb.thread
    hb.unregister(first)
    time.sleep(0.1)
    second = lock.acquire("idle2", "o", 1.0)
    hb.register(second, lock)  # within the idle timeout: the same thread takes it
    assert hb.thread is thread and thread.is_alive()
    time.sleep(0.45)
    assert not second.lost and hb.cycles >= 1
    hb.unregister(second)
    thread.join(1.0)
    assert not thread.is_alive() and hb.thread is None
    third = lock.acquire("idle3", "o", 1.0)
    hb.register(third, lock)  # a new thread after the exit
    assert hb.thread is not None and hb.thread is not thread and hb.thread.is_alive()
    hb.unregister(third)


def test_thousands_of_leases_one_round_trip_per_cycle(lock, heartbeat, redis_client):
    leases = [lock.acquire(f"bulk{i}", f"o{i}", 1.5) for i in range(2500)]
    acquired = redis_client.hget("t:lease:{bulk0}", "renewed_ms")
    for lease in leases:
        heartbeat.register(lease, lock, ratio=1 / 3)
    time.sleep(1.3)
    assert not any(lease.lost for lease in leases)
    with heartbeat._cycle:  # between two cycles: one may be in flight on a loaded machine
        cycles, round_trips = heartbeat.cycles, heartbeat.round_trips
    assert cycles >= 2 and round_trips == cycles
    assert int(redis_client.hget("t:lease:{bulk0}", "renewed_ms")) > int(acquired)
    assert int(redis_client.hget("t:lease:{bulk2499}", "renewed_ms")) > int(acquired)
    assert all(redis_client.pttl(f"t:lease:{{bulk{i}}}") > 1000 for i in (0, 1234, 2499))


def test_leases_registered_apart_share_one_cycle_after_their_first(lock, heartbeat):
    sizes = []
    renew = heartbeat._renew

    def counted(due):
        sizes.append(len(due))
        renew(due)

    heartbeat._renew = counted
    for i in range(3):  # phases 0, 1/3 and 2/3 of an interval apart
        heartbeat.register(lock.acquire(f"phase{i}", "o", 1.2), lock, ratio=1 / 3)
        time.sleep(0.4 / 3)
    time.sleep(1.2)
    assert sizes and sizes[-1] == 3 and sizes[-2] == 3


def test_an_unreachable_store_is_retried_at_a_bounded_pace(lock, heartbeat):
    from helpers import closed_port_url

    lease = lock.acquire("refused", "o", 3.0)
    down = RedisLeaseStore(make_client(closed_port_url(), socket_timeout=0.2), prefix="t")
    heartbeat.register(lease, down, ratio=1 / 3)  # renewals fail at once: connection refused
    time.sleep(1.8)
    assert not lease.lost
    assert 2 <= heartbeat.cycles <= 10  # retried every interval / 3, not in a tight loop


def test_a_stuck_lock_extended_receiver_does_not_hang_unregister(lock, heartbeat, caplog):
    """A receiver blocking the heartbeat thread (found by tests/faults heartbeat-frozen) stops
    renewals, but the task's unregister gives up after one TTL instead of waiting forever."""
    release = threading.Event()
    entered = threading.Event()

    def stuck(sender=None, **kwargs):
        entered.set()
        release.wait(10)

    signals.lock_extended.connect(stuck, weak=False)
    try:
        lease = lock.acquire("stuck", "o", 0.6)
        heartbeat.register(lease, lock, ratio=1 / 3)
        assert entered.wait(2)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="celery_steplock"):
            assert heartbeat.unregister(lease) is True
        waited = time.monotonic() - started
        assert 0.55 <= waited < 1.5  # one TTL (0.6 s), not the receiver's 10 s
        assert "event=heartbeat_stuck" in caplog.text
        assert heartbeat.leases == []
        time.sleep(0.8)
        assert lease.lost  # nothing renewed it while the receiver was stuck
    finally:
        release.set()
        signals.lock_extended.disconnect(stuck)
