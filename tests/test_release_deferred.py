"""The release after COMMIT written without waiting for its reply (``steplock_release_wait``
off; celery_steplock._redis.wire.Deferred, RedisLeaseStore.release_later), against a real
redis-server."""

import logging
import os
import select
import threading
import time
import uuid

import pytest
import redis

from celery_steplock._redis import wire
from celery_steplock.exceptions import LockError, LockStoreUnavailable
from celery_steplock.lock import (
    RedisLeaseStore,
    drain_releases,
    make_client,
    release_after_commit,
)
from celery_steplock.task import StepLockedTask
from helpers import set_settings, wait_until

pytestmark = pytest.mark.no_database


@pytest.fixture
def job(app):
    @app.task(
        bind=True,
        base=StepLockedTask,
        lock_key="deferred:{n}",
        name=f"tests.release_deferred.job.{uuid.uuid4().hex[:8]}",
        shared=False,
    )
    def job(self, n, inside=None):
        if inside is not None:
            inside(self)
        return self.lease.key

    return job


def as_worker(task, *args, **kwargs):
    """``task(*args)`` with the request a worker's tracer pushes (not eager, not direct)."""
    task.push_request(
        id=uuid.uuid4().hex, called_directly=False, is_eager=False, retries=0, hostname="w"
    )
    try:
        return task(*args, **kwargs)
    finally:
        task.pop_request()


@pytest.fixture
def reads(monkeypatch):
    """Replies read by this thread, as ``{"pool": n, "deferred": n}``: ``deferred`` on a
    Deferred's own connection, ``pool`` on any other (a blocking round trip)."""
    counts = {"pool": 0, "deferred": 0}
    me = threading.get_ident()
    own = set()
    real = redis.Connection.read_response

    def counting(self, *args, **kwargs):
        if threading.get_ident() == me and not connecting:
            deferred = any(self is d._conn for d in list(wire._deferreds))
            counts["deferred" if deferred else "pool"] += 1

        return real(self, *args, **kwargs)

    connecting = []
    real_connect = redis.Connection.on_connect_check_health

    def on_connect(self, *args, **kwargs):
        # A new connection's handshake (AUTH, CLIENT SETINFO) is not a call's round trip.
        connecting.append(1)
        try:
            return real_connect(self, *args, **kwargs)
        finally:
            connecting.pop()

    monkeypatch.setattr(redis.Connection, "read_response", counting)
    monkeypatch.setattr(redis.Connection, "on_connect_check_health", on_connect)
    counts["own"] = own
    return counts


def test_a_worker_task_waits_for_two_round_trips_not_three(app, job, reads, redis_client):
    set_settings(app, steplock_release_wait=False)
    for n in range(3):  # the permission probe (once per store), scripts loaded (NOSCRIPT)
        as_worker(job, n)
    reads["pool"] = 0
    for n in range(5):
        as_worker(job, n)
    assert reads["pool"] == 2 * 5  # acquire, ownership check
    set_settings(app, steplock_release_wait=True)
    reads["pool"] = 0
    for n in range(5):
        as_worker(job, n)
    assert reads["pool"] == 3 * 5  # and the release


def test_the_released_lease_is_gone_soon_after_the_task_returns(app, job, redis_client, events):
    set_settings(app, steplock_release_wait=False)
    key = as_worker(job, 1)
    wait_until(lambda: redis_client.exists(key) == 0, timeout=1.0, what="the release")
    wait_until(
        lambda: [n for n, _ in events].count("lock_released") == 1,
        timeout=1.0,
        what="lock_released, once its reply was read",
    )
    [released] = [kw for n, kw in events if n == "lock_released"]
    assert released["key"] == key and released["forced"] is False
    assert released["hold_seconds"] >= 0


def test_an_eager_call_still_waits(app, job, redis_client, events):
    set_settings(app, steplock_release_wait=False)
    key = job.apply((2,)).get()
    assert redis_client.exists(key) == 0
    assert [n for n, _ in events][-1] == "lock_released"


def test_an_error_reply_is_logged_and_never_raised_into_the_next_call(lock, redis_client, caplog):
    lease = lock.acquire("e", "o1", 5.0)
    # Something else writes the lease's key: the release is refused with WRONGTYPE.
    redis_client.delete(lease.key)
    redis_client.set(lease.key, "not a hash")
    caplog.set_level(logging.WARNING, logger="celery_steplock")
    release_after_commit(lock, lease, None, wait=False)  # never raises
    assert lock.deferred.pending in (0, 1)
    # The next commands, on the pool and on the deferred connection, get their own replies.
    assert lock.owned("elsewhere", "nobody") is None
    other = lock.acquire("e2", "o2", 5.0)
    release_after_commit(lock, other, None, wait=False)
    drain_releases()
    failed = [r.getMessage() for r in caplog.records if "event=release_failed" in r.getMessage()]
    assert len(failed) == 1 and lease.key in failed[0] and "WRONGTYPE" in failed[0]
    assert redis_client.exists(other.key) == 0 and redis_client.get(lease.key) == "not a hash"


def test_noscript_runs_the_release_again_and_wakes_the_waiter(lock, redis_client):
    lease = lock.acquire("n", "o1", 5.0)
    assert lease is not None
    got = []
    waiter = threading.Thread(target=lambda: got.append(lock.acquire("n", "o2", 5.0, wait=3.0)))
    waiter.start()
    wait_until(lambda: redis_client.info("clients")["blocked_clients"] >= 1, timeout=2.0)
    redis_client.script_flush()
    done = []
    assert lock.release_later("n", "o1", lambda released, error: done.append((released, error)))
    waiter.join(timeout=3.0)
    assert got and got[0] is not None and got[0].owner == "o2"
    wait_until(lambda: done, timeout=1.0, what="the release's reply")
    assert done == [(True, None)]


def test_a_pending_reply_is_never_read_by_another_caller(lock, redis_client):
    assert lock.acquire("p", "o1", 5.0) is not None
    done = []
    wire.DRAIN_AFTER, before = 5.0, wire.DRAIN_AFTER  # the drainer thread keeps off
    try:
        deferred = lock.deferred
        if deferred._drainer is not None:
            deferred._wake = threading.Event()  # a thread already waiting keeps waiting
            deferred._drainer = None
        assert lock.release_later("p", "o1", lambda released, error: done.append(released))
        assert deferred.pending == 1
        conn = deferred._conn
        pool = lock.client.connection_pool
        assert conn not in pool._available_connections and conn not in pool._in_use_connections
        # Every other caller gets its own reply, on the pool's connections.
        assert lock.owned("p", "o1") is None  # released already: Redis read the command
        assert lock.client.ping() is True
        assert lock.acquire("q", "o2", 5.0) is not None
        assert done == []  # the release's reply is still unread
        assert deferred.drain() == 1
        assert done == [True]
    finally:
        wire.DRAIN_AFTER = before


def test_redis_down_hands_the_error_to_the_release(private_redis):
    client = make_client(private_redis.url)
    store = RedisLeaseStore(client, prefix="d")
    assert store.acquire("x", "o1", 5.0) is not None
    done = []
    private_redis.stop()
    assert store.release_later("x", "o1", lambda released, error: done.append((released, error)))
    wait_until(lambda: done, timeout=3.0, what="the failed release reported")
    [(released, error)] = done
    assert released is None and isinstance(error, LockStoreUnavailable)
    assert store.deferred.pending == 0


def test_a_forked_child_starts_without_the_parents_pending_replies(lock, redis_client):
    assert lock.acquire("f", "o1", 5.0) is not None
    wire.DRAIN_AFTER, before = 5.0, wire.DRAIN_AFTER
    try:
        assert lock.release_later("f", "o1", lambda released, error: None)
        pid = os.fork()
        if pid == 0:  # the child: its own connection, nothing pending
            code = 1
            try:
                deferred = lock.deferred
                ok = deferred.pending == 0 and deferred._conn is None
                assert lock.acquire("g", "c1", 5.0) is not None
                got = []
                lock.release_later("g", "c1", lambda released, error: got.append(released))
                deferred.drain()
                code = 0 if ok and got == [True] else 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert lock.deferred.pending == 1 and lock.deferred.drain() == 1
    finally:
        wire.DRAIN_AFTER = before


def test_shapes_that_cannot_defer_keep_waiting(redis_server_url):
    ssl_client = redis.Redis(
        connection_pool=redis.ConnectionPool(connection_class=redis.SSLConnection)
    )
    assert wire.deferred_for(ssl_client) is None
    store = RedisLeaseStore(make_client(redis_server_url), prefix="s")
    assert store.deferred is not None
    assert isinstance(LockError("x"), Exception)


def test_a_store_not_probed_yet_does_not_defer(redis_client):
    store = RedisLeaseStore(redis_client, prefix="u")
    assert store.release_later("a", "o", lambda released, error: None) is False


def test_many_pending_replies_are_read_before_more_are_written(lock, redis_client):
    assert lock.acquire("m", "o", 5.0) is not None
    done = []
    for n in range(wire.MAX_PENDING + 10):
        lock.release_later(f"m{n}", "o", lambda released, error: done.append(released))
    assert lock.deferred.pending <= wire.MAX_PENDING
    lock.deferred.drain()
    assert len(done) == wire.MAX_PENDING + 10 and not any(done)
    time.sleep(0)


def test_a_warm_shutdown_reads_the_pending_replies(lock, redis_client, events):
    from celery.signals import worker_process_shutdown

    lease = lock.acquire("w", "o1", 5.0)
    wire.DRAIN_AFTER, before = 5.0, wire.DRAIN_AFTER
    try:
        deferred = lock.deferred
        if deferred._drainer is not None:
            deferred._wake = threading.Event()
            deferred._drainer = None
        release_after_commit(lock, lease, "sender", wait=False)
        assert deferred.pending == 1 and not [n for n, _ in events if n == "lock_released"]
        worker_process_shutdown.send(sender=None, pid=os.getpid(), exitcode=0)
        assert deferred.pending == 0
        [released] = [kw for n, kw in events if n == "lock_released"]
        assert released["key"] == lease.key
    finally:
        wire.DRAIN_AFTER = before


def _kill(client, conn):
    """The server closes ``conn`` (as its idle ``timeout``, a CLIENT KILL or a restart
    would); its close has reached this side when this returns."""
    host, port = conn._sock.getsockname()[:2]
    assert client.client_kill(f"{host}:{port}")
    deadline = time.monotonic() + 10.0
    while not select.select([conn._sock], [], [], 0.05)[0]:  # the close (EOF) is readable
        assert time.monotonic() < deadline, "the server's close never arrived"


def test_a_connection_the_server_closed_while_idle_still_releases(lock, redis_client):
    assert lock.acquire("idle1", "o1", 5.0) is not None
    got = []
    assert lock.release_later("idle1", "o1", lambda released, error: got.append(released))
    lock.deferred.drain()
    assert got == [True]
    conn = lock.deferred._conn
    _kill(redis_client, conn)
    lease = lock.acquire("idle2", "o2", 5.0)
    done = []
    assert lock.release_later(
        "idle2", "o2", lambda released, error: done.append((released, error))
    )
    lock.deferred.drain()
    assert done == [(True, None)]
    assert redis_client.exists(lease.key) == 0  # not left to its TTL


def test_a_release_run_again_after_noscript_is_waited_for_by_a_same_name_acquire(
    lock, redis_client, monkeypatch
):
    # The drainer thread reads NOSCRIPT and runs the release again: an acquire of the same
    # name in this process meanwhile must wait for that run, not find its own lease busy.
    real = wire.evalsha
    running = threading.Event()

    def slow(client, script, keys, args):
        if threading.current_thread().name == "steplock-deferred-replies":
            running.set()
            time.sleep(0.3)
        return real(client, script, keys, args)

    assert lock.acquire("ns", "o1", 5.0) is not None
    lock.release("ns", "o1")
    assert lock.acquire("ns", "o1", 5.0) is not None
    monkeypatch.setattr(wire, "evalsha", slow)
    redis_client.script_flush()
    assert lock.release_later("ns", "o1", lambda released, error: None)
    assert running.wait(2.0)  # the drainer thread read NOSCRIPT and runs it again
    lease, holder, _ = lock.try_acquire("ns", "o2", 5.0)
    assert holder is None and lease is not None and lease.owner == "o2"
