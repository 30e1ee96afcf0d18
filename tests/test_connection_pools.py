"""Waiters block on a pool of their own: many blocked waiters in one process never take the
connections that its renewals and releases need (steplock_max_waiters)."""

from __future__ import annotations

import threading
import time

import pytest
import redis as redis_module

from celery_steplock._redis import route
from celery_steplock.conf import Settings
from celery_steplock.exceptions import ImproperlyConfigured, LockStoreMisconfigured
from celery_steplock.heartbeat import Heartbeat
from celery_steplock.lock import RedisLeaseStore, get_lease_store, make_client
from tests.helpers import set_settings, wait_until

pytestmark = pytest.mark.redis_shape

STORE_POOL = 100  # set explicitly: redis-py 5.0 defaults to 2**31 connections, 8.1 to 100
WAITERS = 150  # more than the store pool's connections


def fresh_client(redis_client, **kwargs):
    """A client of the library's own (make_client) on the test's Redis, with a new pool of at
    most STORE_POOL connections (set here: redis-py's default differs across versions)."""
    conn = redis_client.connection_pool.connection_kwargs
    client = make_client(f"redis://{conn['host']}:{conn['port']}/0", **kwargs)
    sized = route.derived_client(client, STORE_POOL)
    assert sized is not client
    client.close()
    return sized


def blocked(redis_client) -> int:
    return int(redis_client.info("clients")["blocked_clients"])


def start_waiters(store, count, name, wait, results, first=0):
    """``count`` threads waiting for ``name`` (owners ``waiter-<first>``...), each releasing it
    at once when granted."""

    def wait_for_it(i):
        try:
            lease = store.acquire(name, f"waiter-{i}", 30.0, wait=wait)
        except Exception as exc:  # noqa: BLE001 - recorded for the test's assertions
            results.append(exc)
            return
        results.append(lease)
        if lease is not None:
            store.release(name, lease.owner)

    threads = [
        threading.Thread(target=wait_for_it, args=(i,), daemon=True)
        for i in range(first, first + count)
    ]
    for thread in threads:
        thread.start()
    return threads


def hold_for(store, heartbeat, name, ttl, seconds):
    """Hold ``name`` for ``seconds`` under ``heartbeat``; returns the lease afterwards."""
    lease = store.acquire(name, ttl=ttl)
    assert lease is not None
    heartbeat.register(lease, store, ratio=1 / 3)
    try:
        time.sleep(seconds)
        return lease
    finally:
        heartbeat.unregister(lease)


def test_renewals_and_releases_do_not_wait_behind_150_waiters(redis_client):
    client = fresh_client(redis_client)
    store = RedisLeaseStore(client, prefix="t")
    assert client.connection_pool.max_connections == STORE_POOL
    holder = store.acquire("busy", "holder", 60.0)
    results: list = []
    before = blocked(redis_client)
    threads = start_waiters(store, WAITERS, "busy", 60.0, results)
    wait_until(
        lambda: blocked(redis_client) >= before + WAITERS,
        timeout=30,
        interval=0.02,
        what=f"{WAITERS} waiters to block",
    )
    heartbeat = Heartbeat()
    ttl = 1.0
    lease = hold_for(store, heartbeat, "mine", ttl, 3 * ttl)  # renewed 9 times or lost
    assert not lease.lost, lease.lost_reason
    assert store.owned("mine", lease.owner) is not None
    assert store.release("mine", lease.owner) is True
    # The waiters never touched the store's own pool: the holder, the heartbeat, this thread.
    assert client.connection_pool._created_connections <= 3
    assert store.waiter_client.connection_pool is not client.connection_pool
    # Still waiting (none was granted: checked below). Polled, not read once: a waiter whose
    # BLPOP slice just ended is unblocked for an instant before it blocks again.
    wait_until(
        lambda: blocked(redis_client) >= before + WAITERS,
        timeout=10,
        interval=0.02,
        what=f"{WAITERS} waiters to be blocked",
    )
    assert store.release("busy", holder.owner) is True
    for thread in threads:
        thread.join(60)
    assert [r for r in results if isinstance(r, Exception)] == []
    granted = [r for r in results if r is not None]
    assert len(granted) == WAITERS  # each release woke the next waiter
    fences = [lease.fence for lease in granted]
    assert fences == sorted(fences) and len(set(fences)) == WAITERS


def test_waiters_sharing_the_store_pool_would_starve_the_heartbeat(redis_client):
    """Why waiters have a pool of their own: on the store's own pool of STORE_POOL (100)
    connections, 100 blocked waiters leave none for the renewals, and the held lease is
    lost."""
    # A socket timeout of 30 s: each waiter stays in one BLPOP (at most 24 s) all along.
    client = fresh_client(redis_client, socket_timeout=30.0)
    store = RedisLeaseStore(client, prefix="t", waiter_client=client)
    holder = store.acquire("busy", "holder", 60.0)
    lease = store.acquire("mine2", ttl=1.0)
    heartbeat = Heartbeat()
    heartbeat.register(lease, store, ratio=1 / 3)
    results: list = []
    before = blocked(redis_client)
    threads: list = []
    try:
        # One waiter at a time until all 100 connections are blocked (a waiter that finds
        # none free while the heartbeat holds one gives up and is replaced).
        while blocked(redis_client) < before + STORE_POOL and len(threads) < 400:
            count = blocked(redis_client)
            [thread] = start_waiters(store, 1, "busy", 60.0, results, first=len(threads))
            threads.append(thread)
            wait_until(
                lambda: blocked(redis_client) > count or not thread.is_alive(),
                timeout=10,
                interval=0.002,
                what="the waiter to block or give up",
            )
        wait_until(  # polled: a waiter between two BLPOP slices is unblocked for an instant
            lambda: blocked(redis_client) == before + STORE_POOL,
            timeout=10,
            interval=0.02,
            what=f"{STORE_POOL} waiters to be blocked",
        )
        assert client.connection_pool._created_connections == STORE_POOL
        extra = start_waiters(store, 1, "busy", 60.0, results, first=len(threads))
        extra[0].join(10)
        assert "Too many connections" in str(results[-1])
        wait_until(lambda: lease.lost, timeout=10, interval=0.05, what="the lease to be lost")
    finally:
        heartbeat.unregister(lease)
        # On another client: this store's pool is full.
        RedisLeaseStore(redis_client, prefix="t").release("busy", holder.owner)
    assert lease.lost
    for thread in threads:
        thread.join(60)


def test_one_waiter_more_than_max_waiters_gets_a_clear_error(redis_client):
    store = RedisLeaseStore(redis_client, prefix="t", max_waiters=5)
    holder = store.acquire("busy", "holder", 60.0)
    results: list = []
    before = blocked(redis_client)
    threads = start_waiters(store, 5, "busy", 60.0, results)
    wait_until(
        lambda: blocked(redis_client) >= before + 5,
        timeout=10,
        interval=0.01,
        what="5 waiters to block",
    )
    with pytest.raises(LockStoreMisconfigured) as caught:
        store.acquire("busy", "sixth", 30.0, wait=5.0)
    assert caught.value.setting == "steplock_max_waiters"
    assert "steplock_max_waiters" in str(caught.value) and caught.value.name == "busy"
    assert redis_client.zscore("t:waiters:{busy}", "sixth") is None
    # A free lease is still granted at once: only waiting needs a waiter's connection.
    free = store.acquire("free", "sixth", 30.0, wait=5.0)
    assert free is not None and free.owner == "sixth"
    assert store.release("busy", holder.owner) is True
    for thread in threads:
        thread.join(30)
    assert len([r for r in results if r is not None and not isinstance(r, Exception)]) == 5
    # The slots are given back: a new waiter may wait again.
    again = store.acquire("busy", "seventh", 30.0, wait=5.0)
    assert again is not None and again.owner == "seventh"


def test_the_max_waiters_setting(app, redis_client):
    assert Settings(app).max_waiters == 1000
    app.conf.steplock_max_waiters = 7
    assert get_lease_store(app).max_waiters == 7
    for bad in (0, -1, 1.5, True, "10"):
        app.conf.steplock_max_waiters = bad
        with pytest.raises(ImproperlyConfigured) as caught:
            Settings(app).max_waiters
        assert caught.value.setting == "steplock_max_waiters"


def test_the_waiters_client_keeps_the_class_and_connection_options():
    import redis

    class MyRedis(redis.Redis):
        pass

    client = MyRedis.from_url(
        "rediss://user:pw@127.0.0.1:6390/3?ssl_cert_reqs=required",
        socket_timeout=2.5,
        decode_responses=True,
    )
    waiters = route.derived_client(client, 7)
    assert type(waiters) is MyRedis and waiters is not client
    pool = waiters.connection_pool
    assert pool is not client.connection_pool and pool.max_connections == 7
    assert pool.connection_class is client.connection_pool.connection_class is redis.SSLConnection
    own = {"maint_notifications_pool_handler"}  # redis-py 7+: each pool's own
    assert {k: v for k, v in pool.connection_kwargs.items() if k not in own} == {
        k: v for k, v in client.connection_pool.connection_kwargs.items() if k not in own
    }
    assert (pool.connection_kwargs["username"], pool.connection_kwargs["db"]) == ("user", 3)

    class OwnPool(redis.ConnectionPool):
        def __init__(self, special, **kwargs):
            super().__init__(**kwargs)

    odd = redis.Redis(connection_pool=OwnPool("x"))
    assert route.derived_client(odd, 7) is odd  # cannot be rebuilt: shared


class UnderivablePool(redis_module.ConnectionPool):
    """A pool class of a signature the library cannot rebuild (as a custom pool a client
    factory may return): the waiters' client is the store's own."""

    def __init__(self, tag, **kwargs):
        self.tag = tag
        super().__init__(**kwargs)


def test_waiters_sharing_an_underivable_pool_are_capped_below_its_size(redis_client):
    conn = redis_client.connection_pool.connection_kwargs
    pool = UnderivablePool(
        "factory's",
        host=conn["host"],
        port=conn["port"],
        db=0,
        max_connections=40,
        socket_timeout=30.0,
        decode_responses=True,
    )
    client = redis_module.Redis(connection_pool=pool)
    store = RedisLeaseStore(client, prefix="t")
    assert store.waiter_client is client
    # 40 connections, a quarter (10) kept for renewals and releases: 30 waiters at most.
    assert store.waiter_limit == 30 and store.max_waiters == 1000
    holder = store.acquire("busy", "holder", 60.0)
    mine = store.acquire("mine", "renewer", 60.0)
    results: list = []
    before = blocked(redis_client)
    threads = start_waiters(store, 30, "busy", 60.0, results)
    wait_until(
        lambda: blocked(redis_client) >= before + 30,
        timeout=20,
        interval=0.01,
        what="30 waiters to block",
    )
    with pytest.raises(LockStoreMisconfigured) as caught:
        store.acquire("busy", "one-more", 30.0, wait=5.0)
    assert caught.value.setting == "steplock_max_waiters" and caught.value.name == "busy"
    message = str(caught.value)
    assert "30 callers" in message and "max_connections, 40" in message
    assert "minus 10 kept for renewals and releases" in message
    assert redis_client.zscore("t:waiters:{busy}", "one-more") is None
    # The reserve serves the renewals and releases while the waiters block.
    assert store.extend_many([("mine", "renewer", 60.0), ("busy", "holder", 60.0)]) == [True, True]
    assert store.release("mine", "renewer") is True
    assert store.release("busy", holder.owner) is True
    for thread in threads:
        thread.join(60)
    assert [r for r in results if isinstance(r, Exception)] == []
    assert len([r for r in results if r is not None]) == 30
    assert mine.owner == "renewer"


@pytest.mark.parametrize("size, limit", [(100, 75), (32, 24), (20, 12), (8, 0)])
def test_the_reserve_is_a_quarter_of_a_shared_pool_and_at_least_8(size, limit):
    pool = UnderivablePool("x", host="127.0.0.1", port=1, max_connections=size)
    store = RedisLeaseStore(redis_module.Redis(connection_pool=pool), prefix="t")
    assert store.waiter_limit == limit


def test_derived_or_given_waiters_clients_are_not_capped(redis_client):
    derived = RedisLeaseStore(fresh_client(redis_client), prefix="t", max_waiters=500)
    assert derived.waiter_client is not derived.client and derived.waiter_limit == 500
    client = fresh_client(redis_client)
    given = RedisLeaseStore(client, prefix="t", waiter_client=client)
    assert given.waiter_limit == 1000  # the caller chose to share: as documented


def test_a_factory_s_sentinel_client_gets_a_waiters_pool_of_its_own(app, tmp_path):
    """A Sentinel client from a client factory, on a pool of 10 connections: the waiters'
    pool is rebuilt on the same sentinels and service name, so 20 waiters block without
    taking the connections the renewals and releases use."""
    from redis.sentinel import Sentinel, SentinelConnectionPool

    from celery_steplock.clients import connection_options
    from tests.support.sentinel import SentinelGroup

    group = SentinelGroup(workdir=tmp_path / "sentinel").start()
    try:

        def factory(settings):
            sentinel = Sentinel([("127.0.0.1", s.port) for s in group.sentinels], socket_timeout=1)
            return sentinel.master_for(
                group.master_name, max_connections=10, **connection_options(30.0)
            )

        set_settings(app, steplock_redis_client_factory=factory)
        set_settings(app, steplock_key_prefix="sentinel-waiters")
        store = get_lease_store(app, Settings(app))
        main, waiters = store.client.connection_pool, store.waiter_client.connection_pool
        assert type(waiters) is SentinelConnectionPool and waiters is not main
        assert (waiters.service_name, waiters.sentinel_manager, waiters.max_connections) == (
            group.master_name,
            main.sentinel_manager,
            1000,
        )
        assert waiters.connection_class is main.connection_class
        assert store.waiter_limit == 1000
        holder = store.acquire("busy", "holder", 60.0)
        mine = store.acquire("mine", "renewer", 60.0)
        primary = store.client
        results: list = []
        before = blocked(primary)
        threads = start_waiters(store, 20, "busy", 60.0, results)
        wait_until(
            lambda: blocked(primary) >= before + 20,
            timeout=20,
            interval=0.01,
            what="20 waiters to block",
        )
        assert store.extend_many([("mine", "renewer", 60.0), ("busy", "holder", 60.0)]) == [
            True,
            True,
        ]
        assert store.release("mine", mine.owner) is True
        assert main._created_connections <= 3
        assert store.release("busy", holder.owner) is True
        for thread in threads:
            thread.join(60)
        assert [r for r in results if isinstance(r, Exception)] == []
        assert len([r for r in results if r is not None]) == 20
    finally:
        group.stop()


def test_a_cluster_store_s_waiters_are_not_capped_and_a_deferred_client_not_built():
    from tests.helpers import closed_port_url

    down = RedisLeaseStore(
        make_client(closed_port_url(), 0.3, cluster=True), prefix="t", max_waiters=50
    )
    assert down.waiter_limit == 50  # no node reached to find a pool size
    assert down.waiter_client is down.client
