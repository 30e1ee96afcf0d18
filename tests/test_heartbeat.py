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
from celery_steplock.lease import drift
from celery_steplock.lock import RedisLeaseStore, make_client
from helpers import wait_until

pytestmark = pytest.mark.no_database  # runs once, in the SQLite pass


class ManualClock:
    """A monotonic clock that moves only when the test sets it.

    Setting it wakes the heartbeat's thread (under the lock it reads the clock with, so no
    wake-up is lost), which then looks at the new time at once.
    """

    def __init__(self, now: float = 1000.0):
        self.start = self.now = now

    def __call__(self) -> float:
        return self.now

    def set(self, hb: Heartbeat, since_start: float) -> None:
        """Move to ``since_start`` seconds after the start (exact sums of binary fractions:
        a time one rounding error short of a due time would never become due)."""
        with hb._cond:
            self.now = self.start + since_start
            hb._cond.notify_all()

    def advance(self, hb: Heartbeat, seconds: float) -> None:
        with hb._cond:
            self.now += seconds
            hb._cond.notify_all()


def finished_cycles(hb):
    """``(cycles, round_trips)`` read between two cycles, never while one is in flight."""
    with hb._cycle:
        return hb.cycles, hb.round_trips


def settle(hb, clock, timeout=10.0):
    """Wait until the thread has done every renewal due at the clock's time and waits for a
    later one; returns ``(cycles, round_trips)``, exact at that time."""

    def waiting():
        with hb._cond:
            # Waiting for the earliest renewal (or, with none, for a notify); its wake-up
            # time is 0 while a cycle is due or in flight, stale after a register.
            due = min((e.next_at for e in hb._entries.values()), default=float("inf"))
            return hb._wake_at == due and due > clock.now

    wait_until(waiting, timeout=timeout, interval=0.005, what="the heartbeat to settle")
    return finished_cycles(hb)


def wait_cycles(hb, n, timeout=10.0):
    """Wait until ``n`` renewal cycles have finished; returns ``(cycles, round_trips)``."""
    wait_until(
        lambda: finished_cycles(hb)[0] >= n,
        timeout=timeout,
        interval=0.005,
        what=f"{n} heartbeat cycles",
    )
    return finished_cycles(hb)


@pytest.fixture
def heartbeat():
    hb = Heartbeat()
    yield hb
    for lease in hb.leases:
        hb.unregister(lease)


@pytest.fixture
def clock():
    return ManualClock()


@pytest.fixture
def manual(redis_client, clock):
    """A heartbeat and a lease store on the manual clock. Redis's TTLs run in real time, so
    the leases given to it are long (30 s): only the clock decides when renewals are due."""
    hb = Heartbeat(clock=clock)
    store = RedisLeaseStore(redis_client, prefix="t", clock=clock)
    yield hb, store
    for lease in hb.leases:
        hb.unregister(lease)
    thread = hb.thread
    clock.advance(hb, hb.idle_timeout + 1)  # idle for longer than its timeout: it exits
    if thread is not None:
        thread.join(10)


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
    # Real time, real Redis TTL: the thread may stall up to TTL - interval (1.2 s) unharmed.
    lease = lock.acquire("hb", "o", 1.5)
    heartbeat.register(lease, lock, ratio=1 / 5)
    time.sleep(4.6)  # more than three TTLs
    assert lock.owned("hb", "o") is not None
    assert not lease.lost
    stored = redis_client.hgetall("t:lease:{hb}")
    # Still there 4.6 s after the acquire with a 1.5 s TTL: renewed within its last TTL,
    # which takes at least three renewals.
    assert int(stored["renewed_ms"]) - int(stored["acquired_ms"]) >= 4600 - 1500 - 5
    assert finished_cycles(heartbeat)[0] >= 3


def test_renewals_come_every_ttl_times_ratio(manual, clock, redis_client):
    hb, store = manual
    lease = store.acquire("hb", "o", 30.0)
    hb.register(lease, store, ratio=1 / 3)  # due every 10 s on the clock
    acquired_ms = redis_client.hget("t:lease:{hb}", "acquired_ms")
    time.sleep(0.01)  # so that a renewal's renewed_ms differs from acquired_ms
    for k in range(1, 10):  # three TTLs
        clock.set(hb, 10.0 * k - 0.25)
        assert settle(hb, clock) == (k - 1, k - 1)  # not due yet: nothing early
        clock.set(hb, 10.0 * k)
        assert settle(hb, clock) == (k, k)  # one renewal, not two
        assert not lease.lost
        # Sent at 10 s * k: the local validity counts from then.
        assert lease.valid_until == clock.start + 10.0 * k + 30.0 - drift(30.0)
    assert int(redis_client.hget("t:lease:{hb}", "renewed_ms")) > int(acquired_ms)
    assert store.owned("hb", "o") is not None
    assert finished_cycles(hb) == (9, 9)


def test_one_round_trip_per_interval_whatever_the_number_of_leases(manual, clock):
    hb, store = manual
    leases = []
    for i in range(200):
        if i % 50 == 0:  # registered at different times: still one batch per interval
            clock.set(hb, i / 100)
        lease = store.acquire(f"many{i}", f"o{i}", 30.0)
        hb.register(lease, store, ratio=1 / 3)
        leases.append(lease)
    for k in range(1, 6):
        clock.set(hb, 10.0 * k)
        assert settle(hb, clock) == (k, k)  # every lease in the one round trip of a cycle
        assert not any(lease.lost for lease in leases)
        assert {lease.valid_until for lease in leases} == {clock.now + 30.0 - drift(30.0)}
    assert len([t for t in threading.enumerate() if t.name == "steplock-heartbeat"]) >= 1
    assert hb.thread is not None


def test_stolen_key_is_noticed_within_one_interval(manual, clock, redis_client, received, caplog):
    hb, store = manual
    lease = store.acquire("steal", "o", 30.0)
    hb.register(lease, store, ratio=1 / 3, sender="sender-task")
    redis_client.hset("t:lease:{steal}", "owner", "thief")
    with caplog.at_level(logging.ERROR, logger="celery_steplock"):
        clock.set(hb, 10.0)  # one interval
        assert settle(hb, clock) == (1, 1)  # noticed by the first renewal
    assert lease.lost and "another owner" in lease.lost_reason
    lost = [kw for name, kw in received if name == "lock_lost"]
    assert len(lost) == 1 and lost[0]["owner"] == "o" and lost[0]["key"] == "t:lease:{steal}"
    assert any(
        "event=lock_lost" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records
    )
    assert redis_client.hget("t:lease:{steal}", "owner") == "thief"  # never overwritten
    assert lease not in hb.leases


def test_deleted_key_is_lost(manual, clock, redis_client):
    hb, store = manual
    lease = store.acquire("gone", "o", 30.0)
    hb.register(lease, store)
    redis_client.delete("t:lease:{gone}")
    clock.set(hb, 10.0)
    assert settle(hb, clock) == (1, 1)
    assert lease.lost and "gone" in lease.lost_reason
    assert lease not in hb.leases


def test_thread_exits_with_the_last_lease(lock, heartbeat):
    first = lock.acquire("x1", "o", 3.0)
    second = lock.acquire("x2", "o", 3.0)
    heartbeat.register(first, lock)
    heartbeat.register(second, lock)
    thread = heartbeat.thread
    assert thread.is_alive() and thread.daemon
    heartbeat.unregister(first)
    time.sleep(0.05)  # a chance to exit early, which it must not take
    assert thread.is_alive()
    assert heartbeat.unregister(second) is True
    thread.join(10)
    assert not thread.is_alive() and heartbeat.thread is None
    assert heartbeat.unregister(second) is False


def test_signal_payload_of_extended(manual, clock, received):
    hb, store = manual
    lease = store.acquire("sig", "o", 30.0)
    hb.register(lease, store, sender="s")
    clock.set(hb, 10.0)
    assert settle(hb, clock) == (1, 1)
    hb.unregister(lease)
    extended = [kw for name, kw in received if name == "lock_extended"]
    assert len(extended) == 1
    payload = extended[0]
    assert payload["owner"] == "o" and payload["fence"] == lease.fence
    assert payload["ttl"] == 30.0 and payload["key"] == "t:lease:{sig}"
    assert payload["timestamp"] > 1e9 and payload["monotonic"] > 0


def test_transient_redis_error_does_not_kill_the_thread(private_redis, heartbeat, caplog):
    lock = RedisLeaseStore(make_client(private_redis.url, socket_timeout=0.2), prefix="t")
    lease = lock.acquire("pause", "o", 6.0)
    heartbeat.register(lease, lock, ratio=1 / 6)  # every second; 6 s of local validity
    wait_cycles(heartbeat, 1)

    def failures():
        return sum("event=renewal_failed" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.WARNING, logger="celery_steplock"):
        private_redis.pause()
        try:
            wait_until(
                lambda: failures() >= 2,
                timeout=10,
                interval=0.01,
                what="two failed renewal cycles",
            )
        finally:
            private_redis.resume()
    valid_until = lease.valid_until
    # Renewed again once Redis answers: only a successful reply moves the local validity.
    wait_until(
        lambda: lease.valid_until > valid_until,
        timeout=10,
        interval=0.01,
        what="a renewal after the outage",
    )
    assert heartbeat.thread is not None and heartbeat.thread.is_alive()
    assert not lease.lost
    assert 0 < lock.owned("pause", "o") <= 6.0


def test_outage_longer_than_the_ttl_loses_the_lease(private_redis, heartbeat, received):
    lock = RedisLeaseStore(make_client(private_redis.url, socket_timeout=0.1), prefix="t")
    lease = lock.acquire("outage", "o", 0.6)
    heartbeat.register(lease, lock, ratio=1 / 3)
    private_redis.pause()
    try:
        time.sleep(1.0)  # longer than the TTL: no renewal sent before the pause reaches this
        assert lease.lost and "local validity" in lease.lost_reason
    finally:
        private_redis.resume()
    wait_until(
        lambda: any(name == "lock_lost" for name, _ in received), timeout=10, what="lock_lost"
    )
    assert [kw["owner"] for name, kw in received if name == "lock_lost"] == ["o"]
    assert lease not in heartbeat.leases


def test_max_hold_stops_renewal(manual, clock, redis_client):
    hb, store = manual
    lease = store.acquire("hold", "o", 30.0)
    hb.register(lease, store, max_hold=25.0)  # renewals at 10 s and 20 s, then no more
    clock.set(hb, 10.0)
    assert settle(hb, clock) == (1, 1)
    clock.set(hb, 20.0)
    assert settle(hb, clock) == (2, 2)
    assert not lease.lost
    renewed_ms = redis_client.hget("t:lease:{hold}", "renewed_ms")
    time.sleep(0.01)  # a renewal now would write another renewed_ms
    clock.set(hb, 25.0)
    assert settle(hb, clock) == (3, 2)  # the cycle at max hold sends nothing
    clock.set(hb, 40.0)
    assert settle(hb, clock) == (3, 2)  # and none follows
    assert lease.lost and "max hold" in lease.lost_reason
    assert lease not in hb.leases
    # Left to expire by its TTL: never renewed again.
    assert redis_client.hget("t:lease:{hold}", "renewed_ms") == renewed_ms
    assert 0 < redis_client.pttl("t:lease:{hold}") <= 30_000


def _child_renews(url, queue):
    hb = get_heartbeat()
    lock = RedisLeaseStore(make_client(url), prefix="t")
    lease = lock.acquire("child", "child-owner", 3.0)
    hb.register(lease, lock)
    inherited = [l.owner for l in hb.leases if l.owner != "child-owner"]
    deadline = time.monotonic() + 20
    while finished_cycles(hb)[0] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    stored = lock.client.hgetall(lock.key("child"))
    queue.put(
        (
            hb.pid == os.getpid(),
            inherited,
            finished_cycles(hb)[0] >= 1,
            lease.lost,
            lock.owned("child", "child-owner") is not None,
            int(stored["renewed_ms"]) > int(stored["acquired_ms"]),
            hb.thread is not None and hb.thread.is_alive(),
        )
    )
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
        reported = queue.get(timeout=30)
        proc.join(10)
    finally:
        parent.unregister(lease)
    # own pid, nothing inherited, renewed by the child's thread, kept, alive
    assert reported == (True, [], True, False, True, True, True)
    assert proc.exitcode == 0


def test_process_with_a_held_lease_exits_promptly(redis_server_url):
    # Renewals every 200 s: an exit that waited for the thread would outlast the timeout.
    code = (
        "from celery_steplock.lock import RedisLeaseStore, make_client\n"
        "from celery_steplock.heartbeat import get_heartbeat\n"
        f"lock = RedisLeaseStore(make_client({redis_server_url!r}), prefix='exit')\n"
        "lease = lock.acquire('x', 'o', 600.0)\n"
        "get_heartbeat().register(lease, lock)\n"
        "print('registered', get_heartbeat().thread.daemon, flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "registered True" in out.stdout


def test_max_hold_is_reported_on_time_not_one_interval_late(manual, clock, received):
    hb, store = manual
    lease = store.acquire("hold-long-ttl", "o", 30.0)
    hb.register(lease, store, max_hold=4.0)  # renewals every 10 s
    clock.set(hb, 3.75)
    assert settle(hb, clock) == (0, 0) and not received
    clock.set(hb, 4.0)  # the thread must wake for the max hold, not sleep until 10 s
    wait_until(
        lambda: any(name == "lock_lost" for name, _ in received),
        timeout=10,
        what="lock_lost at max hold",
    )
    assert lease.lost and "max hold" in lease.lost_reason
    assert [kw["owner"] for name, kw in received if name == "lock_lost"] == ["o"]
    assert finished_cycles(hb) == (1, 0)


def test_the_thread_idles_between_leases_and_exits_when_idle(redis_client, clock):
    hb = Heartbeat(idle_timeout=0.5, clock=clock)
    store = RedisLeaseStore(redis_client, prefix="t", clock=clock)
    first = store.acquire("idle1", "o", 30.0)
    hb.register(first, store)
    thread = hb.thread
    hb.unregister(first)
    clock.set(hb, 0.25)  # idle, but not for the idle timeout yet
    second = store.acquire("idle2", "o", 30.0)
    hb.register(second, store)  # within the idle timeout: the same thread takes it
    assert hb.thread is thread and thread.is_alive()
    clock.set(hb, 10.25)
    assert settle(hb, clock) == (1, 1)
    assert not second.lost
    hb.unregister(second)
    clock.set(hb, 10.25 + 0.75)  # idle for longer than the idle timeout
    thread.join(10)
    assert not thread.is_alive() and hb.thread is None
    third = store.acquire("idle3", "o", 30.0)
    hb.register(third, store)  # a new thread after the exit
    assert hb.thread is not None and hb.thread is not thread and hb.thread.is_alive()
    last = hb.thread
    hb.unregister(third)
    clock.advance(hb, 1.0)
    last.join(10)
    assert not last.is_alive()


def test_thousands_of_leases_one_round_trip_per_cycle(lock, heartbeat, redis_client):
    # Real time: a 6 s TTL renewed every second leaves room for acquiring 2,500 leases and
    # for stalls of a loaded machine.
    leases = [lock.acquire(f"bulk{i}", f"o{i}", 6.0) for i in range(2500)]
    acquired = redis_client.hget("t:lease:{bulk0}", "renewed_ms")
    for lease in leases:
        heartbeat.register(lease, lock, ratio=1 / 6)
    cycles, round_trips = wait_cycles(heartbeat, 2, timeout=30)
    assert not any(lease.lost for lease in leases)
    assert cycles >= 2 and round_trips == cycles
    assert int(redis_client.hget("t:lease:{bulk0}", "renewed_ms")) > int(acquired)
    assert int(redis_client.hget("t:lease:{bulk2499}", "renewed_ms")) > int(acquired)
    assert all(redis_client.pttl(f"t:lease:{{bulk{i}}}") > 1000 for i in (0, 1234, 2499))


def test_leases_registered_apart_share_one_cycle_after_their_first(manual, clock):
    hb, store = manual
    sizes = []
    renew = hb._renew

    def counted(due):
        sizes.append(len(due))
        renew(due)

    hb._renew = counted
    for i in range(3):  # phases 0, 1/3 and 2/3 of an interval apart
        clock.set(hb, 10.0 * i / 3)
        hb.register(store.acquire(f"phase{i}", "o", 30.0), store, ratio=1 / 3)
    clock.set(hb, 10.0)
    assert settle(hb, clock) == (1, 1)
    clock.set(hb, 20.0)
    assert settle(hb, clock) == (2, 2)
    assert sizes == [3, 3]


def test_an_unreachable_store_is_retried_at_a_bounded_pace(manual, clock):
    from helpers import closed_port_url

    hb, store = manual
    lease = store.acquire("refused", "o", 3.0)
    down = RedisLeaseStore(make_client(closed_port_url(), socket_timeout=0.2), prefix="t")
    hb.register(lease, down, ratio=1 / 3)  # renewals fail at once: connection refused
    clock.set(hb, 0.75)
    assert settle(hb, clock) == (0, 0)
    clock.set(hb, 1.0)  # the interval: the first attempt fails
    # Retried a third of the interval later: not sooner (no tight loop while the clock
    # stands still), not a whole interval later.
    assert settle(hb, clock) == (1, 1)
    retry = 1.0
    for k in (2, 3):
        clock.set(hb, retry + 1 / 3 - 0.01)
        assert settle(hb, clock) == (k - 1, k - 1)
        retry += 1 / 3 + 0.001
        clock.set(hb, retry)
        assert settle(hb, clock) == (k, k)
    assert not lease.lost


def test_a_stuck_lock_extended_receiver_does_not_hang_unregister(
    lock, heartbeat, caplog, redis_client
):
    """A receiver blocking the heartbeat thread (found by tests/faults heartbeat-frozen) stops
    renewals, but the task's unregister gives up after one TTL instead of waiting forever."""
    release = threading.Event()
    entered = threading.Event()

    def stuck(sender=None, **kwargs):
        entered.set()
        release.wait(30)

    signals.lock_extended.connect(stuck, weak=False)
    try:
        lease = lock.acquire("stuck", "o", 1.2)
        heartbeat.register(lease, lock, ratio=1 / 3)
        assert entered.wait(10)
        renewed_ms = redis_client.hget("t:lease:{stuck}", "renewed_ms")
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="celery_steplock"):
            assert heartbeat.unregister(lease) is True
        waited = time.monotonic() - started
        assert 1.15 <= waited < 10  # one TTL (1.2 s), not the receiver's 30 s
        assert "event=heartbeat_stuck" in caplog.text
        assert heartbeat.leases == []
        wait_until(lambda: lease.lost, timeout=10, what="the lease's local validity to end")
        # Nothing renewed it while the receiver was stuck in the first cycle: the key is as
        # that cycle left it, or already expired.
        assert "local validity" in lease.lost_reason and heartbeat.cycles == 1
        assert redis_client.hget("t:lease:{stuck}", "renewed_ms") in (renewed_ms, None)
    finally:
        release.set()
        signals.lock_extended.disconnect(stuck)


# -- hostile review, finding 4: a ratio that makes a renewal busy loop -------------------------

from celery_steplock.exceptions import InvalidArgument  # noqa: E402


@pytest.mark.parametrize(
    "ratio", [0, -0.5, 0.76, 1.5, float("nan"), float("inf"), "0.3", None, True]
)
def test_register_refuses_a_bad_ratio_before_registering(redis_client, heartbeat, ratio):
    lock = RedisLeaseStore(redis_client, prefix="t")
    lease = lock.acquire("hb-bad", "o", 30.0)
    with pytest.raises(InvalidArgument) as info:
        heartbeat.register(lease, lock, ratio=ratio)
    assert info.value.argument == "ratio" and "at most 0.75" in str(info.value)
    assert heartbeat.leases == [] and heartbeat.thread is None


def commands_run(client, name="evalsha"):
    return client.info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0)


def test_a_tiny_ratio_renews_at_most_every_ten_milliseconds(redis_client, heartbeat):
    """ratio 1e-6 of a 1 s TTL: 1 us on the landed code (a busy loop of renewals);
    the interval is floored at MIN_RENEWAL_INTERVAL (0.01 s)."""
    from celery_steplock import conf

    lock = RedisLeaseStore(redis_client, prefix="t")
    lease = lock.acquire("hb-tiny", "o", 1.0)
    lock.extend("hb-tiny", "o", 1.0)  # the store's permission probe runs before counting
    before, started = commands_run(redis_client), time.monotonic()
    heartbeat.register(lease, lock, ratio=1e-6)
    time.sleep(0.5)
    wait_until(
        lambda: commands_run(redis_client) > before, timeout=10.0, interval=0.05, what="a renewal"
    )
    assert heartbeat.unregister(lease) is True
    elapsed, renewals = time.monotonic() - started, commands_run(redis_client) - before
    assert 1 <= renewals <= elapsed / 0.01 + 2, f"{renewals} renewals in {elapsed:.2f} s"
    assert conf.MIN_RENEWAL_INTERVAL == 0.01
    assert not lease.lost and lock.owned("hb-tiny", "o") is not None


class UnreachableStore:
    """A store of other holds on a lane of its own, like the idempotency records' database
    store, whose database does not answer: a renewal blocks until ``answer`` is set, then
    raises the store's outage error."""

    renewal_lane = "test-unreachable"

    def __init__(self):
        self.answer = threading.Event()
        self.calls = 0

    def extend_many(self, items):
        list(items)
        self.calls += 1
        self.answer.wait(30)
        from celery_steplock.exceptions import LockStoreUnavailable

        raise LockStoreUnavailable("the database did not answer (OperationalError)", key="rec")


def _hold(ttl):
    from celery_steplock.lease import Lease

    now = time.monotonic()
    return Lease("rec", "rec", "owner", 0, ttl, now, now + ttl - drift(ttl))


def test_a_store_that_blocks_renews_on_its_own_lane(lock):
    """A store whose renewals block outside Redis never delays the Redis leases: it has a
    heartbeat (and thread) of its own lane; its hold, once its validity ran out, is lost with
    a reason naming the outage (not "held by another owner")."""
    from celery_steplock.heartbeat import heartbeat_for

    store = UnreachableStore()
    records = heartbeat_for(store)
    assert records is get_heartbeat("test-unreachable") and records is not get_heartbeat()
    with pytest.raises(InvalidArgument) as refused:
        get_heartbeat().register(_hold(0.6), store)  # the Redis leases' lane: refused
    assert refused.value.argument == "lock" and "test-unreachable" in str(refused.value)
    lost = []
    hold = _hold(0.6)
    records.register(hold, store, on_lost=lost.append)
    lease = lock.acquire("beside-a-blocked-store", "o", 1.0)
    get_heartbeat().register(lease, lock)
    try:
        wait_until(lambda: store.calls >= 1, what="the blocked renewal")
        blocked_at = time.monotonic()
        while time.monotonic() - blocked_at < 2.5:  # more than twice the lease's TTL
            assert not lease.lost, lease.lost_reason
            time.sleep(0.05)
        assert lock.owned("beside-a-blocked-store", "o") is not None
        assert records.thread is not get_heartbeat().thread
        store.answer.set()
        wait_until(lambda: lost, what="the hold's loss")
        assert lost == [hold] and "another owner" not in hold.lost_reason
        assert "could not be reached" in hold.lost_reason, hold.lost_reason
        assert "did not answer" in hold.lost_reason
    finally:
        store.answer.set()
        records.unregister(hold)
        get_heartbeat().unregister(lease)
        lock.release("beside-a-blocked-store", "o")


def test_get_heartbeat_refuses_a_lane_that_is_no_name():
    for lane in ("", None, 3, ["redis"]):
        with pytest.raises(InvalidArgument) as refused:
            get_heartbeat(lane)
        assert refused.value.argument == "lane"
