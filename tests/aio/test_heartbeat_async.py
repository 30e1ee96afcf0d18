"""The per-event-loop renewal task (celery_steplock.aio.heartbeat), against a real
redis-server: leases held across awaits, one round trip per cycle, loss, cancellation, and
an event loop that waiting never blocks."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from celery_steplock.aio import AsyncRedisLeaseStore, get_async_heartbeat
from celery_steplock.aio.heartbeat import CANCELLED, AsyncHeartbeat
from celery_steplock.clients import async_twin
from celery_steplock.exceptions import InvalidArgument, LockLost, LockStoreUnavailable
from celery_steplock.lock import make_client
from tests.support.loop import LagProbe

pytestmark = pytest.mark.no_database  # runs once, in the common pass


def _store(url: str, **options) -> AsyncRedisLeaseStore:
    return AsyncRedisLeaseStore(async_twin(make_client(url, **options)), prefix="t")


async def _close(store: AsyncRedisLeaseStore) -> None:
    if store._waiter_client is not None and store._waiter_client is not store.client:
        await store._waiter_client.aclose()
    await store.client.aclose()


async def _until(predicate, timeout: float = 10.0, what: str = "a condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def _evalsha_calls(client) -> int:
    return client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)


def test_a_lease_held_across_awaits_outlives_its_ttl(redis_client, redis_server_url, events):
    async def main():
        store = _store(redis_server_url)
        async with store.lease("long", ttl=0.3) as lease:
            for _ in range(8):  # 1.2 s: four TTLs
                await asyncio.sleep(0.15)
                lease.check()
            assert redis_client.hget("t:lease:{long}", "owner") == lease.owner
            assert await store.owned("long", lease.owner) > 0
        assert redis_client.exists("t:lease:{long}") == 0
        assert not lease.lost
        assert get_async_heartbeat().leases == []
        await _close(store)
        return lease

    lease = asyncio.run(main())
    extended = [kw for name, kw in events if name == "lock_extended"]
    assert len(extended) >= 3
    assert {(kw["key"], kw["owner"], kw["fence"]) for kw in extended} == {
        (lease.key, lease.owner, lease.fence)
    }


def test_one_round_trip_per_cycle_for_many_leases(redis_client, redis_server_url):
    async def main():
        store = _store(redis_server_url)
        hb = AsyncHeartbeat()
        leases = [await store.acquire(f"n{i}", f"o{i}", 0.6) for i in range(25)]
        for lease in leases:
            hb.register(lease, store)
        redis_client.config_resetstat()
        cycles0 = hb.cycles
        await asyncio.sleep(1.3)  # intervals of 0.2 s: about six cycles
        calls = _evalsha_calls(redis_client)
        cycles = hb.cycles - cycles0
        for lease in leases:
            assert hb.unregister(lease) is True
            assert not lease.lost and await store.owned(lease.name, lease.owner) is not None
        await _close(store)
        return calls, cycles, hb.round_trips

    calls, cycles, round_trips = asyncio.run(main())
    assert cycles >= 4
    # 25 leases, renewed together: one EXTEND_MANY per cycle (one pipelined round trip).
    assert calls == cycles and round_trips >= cycles


def test_a_lost_lease_is_reported_and_check_raises(redis_client, redis_server_url, events):
    async def main():
        store = _store(redis_server_url)
        lost = []
        async with store.lease("gone", ttl=0.3, sender="me") as lease:
            redis_client.hset("t:lease:{gone}", "owner", "thief")  # another owner took it
            await _until(lambda: lease.lost, what="the loss")
            with pytest.raises(LockLost) as info:
                lease.check()
            lost.append(info.value)
        # The release after loss leaves the other owner's lease alone.
        assert redis_client.hget("t:lease:{gone}", "owner") == "thief"
        await _close(store)
        return lease, lost[0]

    lease, error = asyncio.run(main())
    assert (error.name, error.owner, error.fence) == ("gone", lease.owner, lease.fence)
    [fields] = [kw for name, kw in events if name == "lock_lost"]
    assert fields["key"] == lease.key and fields["owner"] == lease.owner
    assert fields["fence"] == lease.fence
    assert fields["reason"] == "renewal found the key gone or held by another owner"


def test_a_cancelled_renewal_task_is_reported(redis_client, redis_server_url, events, caplog):
    async def main():
        store = _store(redis_server_url)
        hb = get_async_heartbeat()
        lease = await store.acquire("c", "o", 5.0)
        hb.register(lease, store, sender="me")
        task = hb.task
        assert task is not None
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert lease.lost and lease.lost_reason == CANCELLED
        with pytest.raises(LockLost):
            lease.check()
        assert hb.leases == [] and hb.unregister(lease) is False
        # A new registration starts a new task.
        again = await store.acquire("c2", "o", 5.0)
        hb.register(again, store)
        assert hb.task is not None and hb.task is not task
        hb.unregister(again)
        await _close(store)
        return lease

    with caplog.at_level(logging.ERROR, logger="celery_steplock"):
        lease = asyncio.run(main())
    [fields] = [kw for name, kw in events if name == "lock_lost"]
    assert fields["reason"] == CANCELLED and fields["owner"] == lease.owner
    assert any(getattr(r, "steplock", {}).get("reason") == CANCELLED for r in caplog.records)


def test_cancelling_a_holder_releases_its_lease(redis_client, redis_server_url):
    async def main():
        store = _store(redis_server_url)
        entered = asyncio.Event()
        held = []

        async def hold():
            async with store.lease("h", ttl=30.0) as lease:
                held.append(lease)
                entered.set()
                await asyncio.sleep(60)

        task = asyncio.create_task(hold())
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until(lambda: not redis_client.exists("t:lease:{h}"), what="the release")
        assert held[0].owner and get_async_heartbeat().leases == []
        await _close(store)

    asyncio.run(main())


def test_cancelling_a_waiter_never_leaves_it_the_lease(redis_client, redis_server_url):
    async def main():
        store = _store(redis_server_url, socket_timeout=30.0)
        await store.acquire("w", "holder", 60.0)

        async def wait():
            async with store.lease("w", ttl=30.0, wait=20.0, owner="waiter"):
                await asyncio.sleep(60)

        task = asyncio.create_task(wait())
        await _until(lambda: redis_client.zscore("t:waiters:{w}", "waiter") is not None)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until(lambda: not redis_client.exists("t:waiters:{w}"), what="the ZREM")
        assert await store.release("w", "holder") is True
        await asyncio.sleep(0.1)
        # Released by its holder: nobody (least of all the cancelled waiter) took it.
        assert redis_client.exists("t:lease:{w}") == 0
        await _close(store)

    asyncio.run(main())


class FlakyStore:
    """A store of holds (the heartbeat's protocol: ``async extend_many``) whose first
    ``failures`` renewals fail as an unreachable Redis does."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[float] = []

    async def extend_many(self, items):
        self.calls.append(time.monotonic())
        items = list(items)
        if len(self.calls) <= self.failures:
            raise LockStoreUnavailable("lock store unavailable during renewal: down")
        return [True] * len(items)


def _hold(ttl: float):
    from celery_steplock.lease import Lease, drift

    now = time.monotonic()
    return Lease(
        name="rec", key="rec", owner="o", fence=1, ttl=ttl, acquired_at=now,
        valid_until=now + ttl - drift(ttl),
    )  # fmt: skip


def test_a_redis_error_is_retried_sooner(caplog):
    async def main():
        store = FlakyStore(failures=2)
        hb = AsyncHeartbeat()
        hold = _hold(0.9)  # interval 0.3 s
        hb.register(hold, store, on_lost=lambda lease: None)
        await _until(lambda: len(store.calls) >= 4, what="four renewals")
        hb.unregister(hold)
        return store.calls, hold

    with caplog.at_level(logging.WARNING, logger="celery_steplock"):
        calls, hold = asyncio.run(main())
    assert not hold.lost
    # The retries came sooner than the 0.3 s interval; after a success, the interval again.
    assert calls[1] - calls[0] < 0.2 and calls[2] - calls[1] < 0.2
    assert calls[3] - calls[2] >= 0.25
    failed = [
        r for r in caplog.records if getattr(r, "steplock", {}).get("event") == "renewal_failed"
    ]
    assert len(failed) == 2


def test_a_hold_is_lost_when_its_validity_runs_out_unrenewed():
    async def main():
        store = FlakyStore(failures=10**6)
        hb = AsyncHeartbeat()
        hold = _hold(0.3)
        reported = []
        hb.register(hold, store, on_lost=reported.append)
        await _until(lambda: reported, what="the loss")
        return hold, reported, len(store.calls)

    hold, reported, calls = asyncio.run(main())
    assert reported == [hold] and hold.lost and calls >= 2
    assert hold.lost_reason.startswith("local validity ran out without a successful renewal")
    assert "LockStoreUnavailable" in hold.lost_reason


def test_max_hold_stops_the_renewals(redis_client, redis_server_url, events):
    async def main():
        store = _store(redis_server_url)
        async with store.lease("mh", ttl=0.3, max_hold=0.5) as lease:
            await _until(
                lambda: any(name == "lock_lost" for name, _kw in events), what="the max hold"
            )
        await _close(store)
        return lease

    lease = asyncio.run(main())
    assert lease.lost_reason == "max hold reached: renewal stopped"
    assert [kw["reason"] for name, kw in events if name == "lock_lost"] == [lease.lost_reason]


def test_register_refuses_a_bad_ratio_and_the_task_ends_when_idle(redis_server_url):
    async def main():
        store = _store(redis_server_url)
        hb = AsyncHeartbeat(idle_timeout=0.1)
        lease = await store.acquire("r", "o", 5.0)
        with pytest.raises(InvalidArgument) as info:
            hb.register(lease, store, ratio=0)
        assert info.value.argument == "ratio" and hb.task is None
        hb.register(lease, store)
        task = hb.task
        hb.unregister(lease)
        await asyncio.wait_for(task, 2.0)
        assert hb.task is None
        await _close(store)

    asyncio.run(main())


def test_one_heartbeat_per_loop():
    async def main():
        return get_async_heartbeat(), get_async_heartbeat()

    first, same = asyncio.run(main())
    other, _ = asyncio.run(main())
    assert first is same and other is not first
    with pytest.raises(RuntimeError):
        get_async_heartbeat()


def test_waiting_for_a_lease_never_blocks_the_loop(redis_server_url):
    async def main():
        store = _store(redis_server_url)
        await store.acquire("lag", "holder", 60.0)
        async with LagProbe() as probe:
            started = time.monotonic()
            assert await store.acquire("lag", "waiter", 5.0, wait=1.0) is None
            waited = time.monotonic() - started
        await _close(store)
        return waited, probe.max_lag, probe.ticks

    waited, worst, samples = asyncio.run(main())
    assert waited >= 1.0 and samples > 50
    assert worst < 0.05, f"loop lag {worst * 1000:.1f} ms while a waiter waited"


def test_an_async_holder_s_loss_is_recorded_in_the_history(redis_client, redis_server_url):
    """aannounce_lost appends ``lost`` as the sync announce_lost does (history.py: the
    holder appends it), with the lease's owner, fence and reason."""
    from celery_steplock.aio.heartbeat import aannounce_lost
    from celery_steplock.lock import RedisLeaseStore

    async def main():
        store = _store(redis_server_url)
        lease = await store.acquire("n", ttl=30.0)
        await store.client.delete("t:lease:{n}")
        lease.mark_lost("gone")
        await aannounce_lost(store, None, lease)
        await _close(store)
        return lease

    lease = asyncio.run(main())
    newest = RedisLeaseStore(redis_client, prefix="t").history("n")[0]
    assert (newest.event, newest.owner, newest.fence, newest.reason) == (
        "lost",
        lease.owner,
        lease.fence,
        "gone",
    )


def test_the_waits_registry_keeps_no_wait_that_ended(redis_client, redis_server_url):
    """A waiter cancelled, or cut by wait_for, leaves no entry in WAITS (the gauges)."""
    from celery_steplock.lock import WAITS

    async def main():
        store = _store(redis_server_url)
        assert await store.acquire("n", ttl=30.0) is not None
        task = asyncio.ensure_future(
            store.acquire("n", ttl=30.0, wait=20.0, metadata={"task_name": "t"})
        )
        await _until(lambda: [w for w in WAITS.current() if w[1] == "t"], what="the wait")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not [w for w in WAITS.current() if w[1] == "t"]
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(
                store.acquire("n", ttl=30.0, wait=20.0, metadata={"task_name": "t"}), 0.3
            )
        assert not [w for w in WAITS.current() if w[1] == "t"]
        await _close(store)

    asyncio.run(main())
