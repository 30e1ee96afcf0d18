"""celery_steplock._loops: what the asyncio API keeps per event loop ends with the loop (its
connections closed, the loop itself collectable), whether the loop ends in ``asyncio.run``,
in asgiref's ``async_to_sync`` or without ``shutdown_asyncgens``. Real redis-server only."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest
from asgiref.sync import async_to_sync

from celery_steplock import _loops
from celery_steplock.aio import get_async_heartbeat
from celery_steplock.aio.lock import async_store_for
from celery_steplock.clients import async_client_for, make_client
from celery_steplock.lock import RedisLeaseStore

pytestmark = pytest.mark.redis_shape

NAME = "loops-test"


def connections(client) -> int:
    """How many connections of the server carry this test's client name."""
    return sum(1 for c in client.client_list() if c.get("name") == NAME)


@pytest.fixture
def named(redis_server_url):
    client = make_client(redis_server_url)
    client.connection_pool.connection_kwargs["client_name"] = NAME
    yield client
    client.close()


def cycle(store: RedisLeaseStore, loops: list, observer=None):
    """One lease taken and released on the running loop's store, with the loop's heartbeat
    made (everything a room holds); ``observer`` (a sync client) sees the twin's connection
    open while the loop runs."""

    async def main():
        loops.append(weakref.ref(asyncio.get_running_loop()))
        twin = async_store_for(store)
        assert get_async_heartbeat() is get_async_heartbeat()
        async with twin.lease("loops:one", ttl=5) as lease:
            assert lease.fence >= 1
            # A wait behind it: the store's waiter client (a pool of its own) connects too.
            assert await twin.acquire("loops:one", ttl=5, wait=0.05) is None
        if observer is not None:
            assert connections(observer) >= 1
        return async_client_for(store.client)

    return main


def test_twenty_finished_loops_leave_no_connection_and_no_loop(named, redis_client):
    store = RedisLeaseStore(named)
    before = _loops.rooms()
    loops: list = []
    for _ in range(20):
        asyncio.run(cycle(store, loops, redis_client)())
    for _ in range(20):
        async_to_sync(cycle(store, loops, redis_client))()
    assert connections(redis_client) == 0  # closed with their loops, not by the collector
    gc.collect()
    assert _loops.rooms() == before
    assert [ref for ref in loops if ref() is not None] == []


def test_a_loop_closed_without_shutting_down_its_async_generators_is_dropped(named, redis_client):
    store = RedisLeaseStore(named)
    loops: list = []
    loop = asyncio.new_event_loop()
    loop.run_until_complete(cycle(store, loops)())
    loop.close()  # no shutdown_asyncgens: the room is not closed
    del loop
    held = _loops.rooms()
    asyncio.run(cycle(store, loops)())  # the next room drops the closed loop's
    assert _loops.rooms() == held - 1
    gc.collect()
    assert loops[0]() is None
    assert connections(redis_client) == 0


def test_a_room_is_one_per_loop_and_keeps_its_values():
    async def main():
        first = _loops.room()
        first.values["k"] = 1
        return first, _loops.room()

    a, b = asyncio.run(main())
    assert a is b
    assert a.values == {}  # cleared when its loop shut down
    c, _ = asyncio.run(main())
    assert c is not a


def test_the_cleanups_of_callers_cancelled_by_the_loops_end_are_finished(named, redis_client):
    # asyncio.run cancels the tasks still running when main returns: a waiter's cleanup
    # (its waiter entry dropped) runs before the loop's connections are closed.
    store = RedisLeaseStore(named)
    holder = RedisLeaseStore(redis_client)  # its connection is not one of the counted
    holder.acquire("loops:held", "holder", 30.0)

    async def main():
        twin = async_store_for(store)
        waiter = asyncio.ensure_future(twin.acquire("loops:held", "waiter", 5.0, wait=20.0))
        while not redis_client.zscore("steplock:waiters:{loops:held}", "waiter"):
            await asyncio.sleep(0.01)
        return waiter

    waiter = asyncio.run(main())
    assert waiter.cancelled()
    assert redis_client.zscore("steplock:waiters:{loops:held}", "waiter") is None
    assert connections(redis_client) == 0
    assert redis_client.hget("steplock:lease:{loops:held}", "owner") == "holder"
    holder.release("loops:held", "holder")
