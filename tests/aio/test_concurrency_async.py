"""The concurrency limit's async form (celery_steplock.patterns.concurrency: ``atry_acquire``,
``aacquire``, ``async with limit.acquire(...)``, ``@limit.using`` on ``async def``,
``Slot.arelease``) against a real redis-server: the same slots, fences and denials as the
sync form (one slot set shared by sync and async holders), slots renewed across awaits by
the event loop's heartbeat, cancellation freeing a slot, the loop never stalled while a
caller waits, and the outage policy with Redis stopped. The sync suite is
tests/patterns/test_concurrency.py."""

import asyncio
import inspect
import threading
import time

import pytest

from celery_steplock.exceptions import ConcurrencyLimited, LockStoreUnavailable
from celery_steplock.keys import concurrency_keys, slot_key
from celery_steplock.lock import RedisLeaseStore, make_client
from celery_steplock.patterns.concurrency import ConcurrencyLimit, SlotHold, current_slot
from tests.support.loop import LagProbe

pytestmark = pytest.mark.no_database  # Redis only: runs once, in the SQLite pass


def run(coroutine):
    return asyncio.run(coroutine)


class Holders:
    """Counts concurrent holders (threads and coroutines alike) and keeps the maximum."""

    def __init__(self):
        self.now = 0
        self.max = 0
        self.done = 0
        self._guard = threading.Lock()

    def enter(self):
        with self._guard:
            self.now += 1
            self.max = max(self.max, self.now)

    def leave(self):
        with self._guard:
            self.now -= 1
            self.done += 1


@pytest.fixture
def store(redis_client):
    return RedisLeaseStore(redis_client, prefix="bk")


def _meta(key, limit):
    return {"kind": "slot", "limit": limit, "limit_key": key}


def test_the_async_decision_is_the_sync_one(store, redis_client):
    limit = ConcurrencyLimit(2)
    sync = limit.try_acquire(
        store, "api", owner="s0", ticket=None, ttl=5, metadata=_meta("api", 2)
    )

    async def scenario():
        granted = await limit.atry_acquire(
            store, "api", owner="a1", ticket=None, ttl=5, metadata=_meta("api", 2)
        )
        with pytest.raises(ConcurrencyLimited) as denied:
            await limit.atry_acquire(
                store, "api", owner="a2", ticket=None, ttl=5, metadata=_meta("api", 2)
            )
        # the same owner asking again gets its own slot back (a redelivery)
        again = await limit.atry_acquire(
            store, "api", owner="a1", ticket=None, ttl=5, metadata=_meta("api", 2)
        )
        released = await granted.arelease()
        return granted, denied.value, again, released

    granted, denied, again, released = run(scenario())
    assert (sync.index, granted.index) == (0, 1) and granted.fence > sync.fence
    assert granted.lease.key == slot_key("bk", "api", 1)  # the sync store's key layout
    assert (again.index, again.owner) == (1, "a1")
    assert denied.option == "concurrency_limit" and denied.key == "api"
    assert denied.context["free"] == 0 and 0.05 <= denied.retry_after <= 0.5
    assert released is True and not redis_client.exists(slot_key("bk", "api", 1))
    with pytest.raises(ConcurrencyLimited):  # the sync slot is still held: 1 free now
        limit.try_acquire(store, "api", owner="s9", ticket=None, ttl=5, metadata=_meta("api", 2))
        limit.try_acquire(store, "api", owner="s8", ticket=None, ttl=5, metadata=_meta("api", 2))
    assert sync.release() is True


def test_sync_and_async_holders_share_one_limit_of_two(redis_client):
    limit = ConcurrencyLimit(2, ttl=5)
    holders = Holders()

    def sync_holder():
        with limit.acquire("shared", client=redis_client, wait=20) as slot:
            assert slot is not None and current_slot() is slot
            holders.enter()
            time.sleep(0.08)
            holders.leave()

    async def async_holder():
        async with limit.acquire("shared", client=redis_client, wait=20) as slot:
            assert slot is not None and current_slot() is slot
            holders.enter()
            await asyncio.sleep(0.08)
            holders.leave()

    async def async_side():
        await asyncio.gather(*(async_holder() for _ in range(5)))

    threads = [threading.Thread(target=sync_holder) for _ in range(5)]
    for thread in threads:
        thread.start()
    run(async_side())
    for thread in threads:
        thread.join(30)
    assert holders.done == 10
    assert holders.max == 2
    keys = [slot_key("steplock", "shared", i) for i in range(2)]
    assert redis_client.exists(*keys) == 0  # every slot given back
    _fence, queue, _alive = concurrency_keys("steplock", "shared")
    assert redis_client.zcard(queue) == 0  # no waiter left behind


def test_a_slot_is_renewed_across_awaits_longer_than_its_ttl(redis_client, events):
    limit = ConcurrencyLimit(1, ttl=0.3)

    async def scenario():
        async with limit.acquire("renewed", client=redis_client) as slot:
            await asyncio.sleep(1.0)  # over three TTLs
            held = redis_client.pttl(slot.lease.key)
            slot.check()  # not lost
            # meanwhile nobody else gets it, sync or async
            with pytest.raises(ConcurrencyLimited):
                with limit.acquire("renewed", client=redis_client):
                    pass
            with pytest.raises(ConcurrencyLimited):
                await limit.aacquire("renewed", client=redis_client)
        return slot, held

    slot, held = run(scenario())
    assert 0 < held <= 300 and slot.released and not slot.lost
    assert not redis_client.exists(slot.lease.key)
    names = [name for name, _ in events]
    renewals = [kw for name, kw in events if name == "lock_extended"]
    assert len(renewals) >= 3 and all(kw["key"] == slot.lease.key for kw in renewals)
    assert names.count("slot_acquired") == 1 and names.count("slot_released") == 1
    assert "lock_lost" not in names


def test_cancelling_a_holder_frees_its_slot(redis_client):
    limit = ConcurrencyLimit(1, ttl=30)
    entered = asyncio.Event

    async def scenario():
        inside = entered()

        async def holder():
            async with limit.acquire("cancel", client=redis_client):
                inside.set()
                await asyncio.sleep(60)

        task = asyncio.get_running_loop().create_task(holder())
        await inside.wait()
        assert redis_client.exists(slot_key("steplock", "cancel", 0))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the slot is free at once (not after its 30 s TTL): another caller takes it
        slot = await limit.aacquire("cancel", client=redis_client)
        await slot.arelease()
        return slot

    slot = run(scenario())
    assert slot is not None and slot.released
    assert not redis_client.exists(slot_key("steplock", "cancel", 0))


def test_cancelling_a_waiter_leaves_the_queue(redis_client):
    limit = ConcurrencyLimit(1, ttl=30)
    _fence, queue, _alive = concurrency_keys("steplock", "wq")

    async def scenario():
        held = await limit.aacquire("wq", client=redis_client)
        waiter = asyncio.get_running_loop().create_task(
            limit.aacquire("wq", client=redis_client, wait=30)
        )
        await asyncio.sleep(0.2)
        queued = redis_client.zcard(queue)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.sleep(0.1)  # the background clean-up
        left = redis_client.zcard(queue)
        await held.arelease()
        return queued, left

    assert run(scenario()) == (1, 0)
    assert not redis_client.exists(slot_key("steplock", "wq", 0))


def test_the_loop_never_stalls_while_a_caller_waits_for_a_slot(redis_client):
    limit = ConcurrencyLimit(1, ttl=5)
    ready = threading.Event()

    def sync_holder():
        with limit.acquire("lag", client=redis_client):
            ready.set()
            time.sleep(0.5)

    thread = threading.Thread(target=sync_holder)
    thread.start()
    ready.wait(10)

    async def scenario():
        # warm up: the first async call of a process imports redis.asyncio on the loop
        with pytest.raises(ConcurrencyLimited):
            await limit.aacquire("lag", client=redis_client)
        async with LagProbe() as probe:
            started = time.perf_counter()
            async with limit.acquire("lag", client=redis_client, wait=5) as slot:
                waited = time.perf_counter() - started
        return probe, waited, slot

    probe, waited, slot = run(scenario())
    thread.join(10)
    assert slot is not None and 0.2 < waited < 3.0
    assert probe.ticks > 20
    assert probe.max_lag < 0.05, f"the loop stalled {probe.max_lag * 1000:.1f} ms"


def test_using_decorates_an_async_def(redis_client):
    limit = ConcurrencyLimit(1, key="render:{doc}")
    holders = Holders()

    @limit.using(client=redis_client, wait=10)
    async def render(doc):
        holders.enter()
        assert current_slot() is not None and current_slot().key == f"render:{doc}"
        await asyncio.sleep(0.05)
        holders.leave()
        return doc

    assert inspect.iscoroutinefunction(render) and render.__name__ == "render"

    async def scenario():
        return await asyncio.gather(*(render("a") for _ in range(3)))

    assert run(scenario()) == ["a"] * 3
    assert holders.max == 1 and holders.done == 3

    @limit.using(client=redis_client)
    async def busy(doc):
        await asyncio.sleep(0.3)

    async def refused():
        first = asyncio.get_running_loop().create_task(busy("b"))
        await asyncio.sleep(0.1)
        with pytest.raises(ConcurrencyLimited):
            await busy("b")
        await first

    run(refused())


def test_a_sync_slot_can_be_released_from_a_coroutine(redis_client, store):
    limit = ConcurrencyLimit(1)
    slot = limit.try_acquire(
        store, "mixed", owner="o", ticket=None, ttl=5, metadata=_meta("mixed", 1)
    )
    assert isinstance(limit.acquire("mixed", client=redis_client), SlotHold)
    assert run(slot.arelease()) is True
    assert run(slot.arelease()) is False  # released twice: harmless
    assert not redis_client.exists(slot.lease.key)


@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
def test_the_outage_policy_with_redis_stopped(private_redis, policy, events):
    client = make_client(private_redis.url, socket_timeout=0.5)
    limit = ConcurrencyLimit(1, ttl=5, on_store_error=policy)

    async def once():
        async with limit.acquire("down", client=client) as slot:
            return slot

    first = run(once())
    assert first is not None and first.released
    private_redis.stop()
    try:
        if policy == "fail_closed":
            with pytest.raises(LockStoreUnavailable):
                run(once())
            with pytest.raises(LockStoreUnavailable):
                run(limit.aacquire("down", client=client))
        else:
            assert run(once()) is None  # the block ran without a slot
            assert run(limit.aacquire("down", client=client)) is None
        outages = [kw for name, kw in events if name == "lock_store_error"]
        assert len(outages) == 2 and outages[0]["policy"] == policy
        assert outages[0]["reason"].startswith("concurrency limit: ")
        assert (outages[0]["limit"], outages[0]["limit_key"]) == (1, "down")
    finally:
        private_redis.restart()
    assert run(once()) is not None
    client.close()


def test_the_apps_store_serves_both_forms(app, redis_client):
    limit = ConcurrencyLimit(1, ttl=5)

    async def scenario():
        async with limit.acquire("app-slot", app=app) as slot:
            with pytest.raises(ConcurrencyLimited):  # the sync form sees the async holder
                with limit.acquire("app-slot", app=app):
                    pass
            return slot

    from celery_steplock.lock import get_lease_store

    slot = run(scenario())
    assert slot.released and slot.lease.key == slot_key(get_lease_store(app).prefix, "app-slot", 0)
    assert not redis_client.exists(slot.lease.key)
    with limit.acquire("app-slot", app=app) as again:
        assert again is not None and again.lease.key == slot.lease.key
