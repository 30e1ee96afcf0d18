"""AsyncRedisLeaseStore against a real redis-server (celery_steplock.aio.lock).

Two parts. (1) The sync store's suite, parametrized: the tests of tests/test_lock.py whose
semantics are the store's own (not its sync-only tools: reap, scan, release_later) run here
again, unchanged, against the async store behind a synchronous facade (each call a coroutine
run on one event loop of a thread of its own). (2) redis-py's asyncio lock tests
(tests/test_asyncio/test_lock.py of redis-py) mapped onto our store, and what only the async
form has: waiters on one loop, cancellation, ``async with store.lease(...)``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import threading
import time
from pathlib import Path

import pytest

from celery_steplock.aio import AsyncRedisLeaseStore, get_async_lease_store
from celery_steplock.clients import async_twin
from celery_steplock.exceptions import (
    InvalidArgument,
    LockContended,
    LockError,
    LockStoreMisconfigured,
    LockStoreUnavailable,
)
from celery_steplock.keys import lease_key, waiters_key, wake_key
from celery_steplock.lock import RedisLeaseStore, make_client

pytestmark = pytest.mark.no_database  # runs once, in the common pass


def _sync_suite():
    # tests/test_lock.py under a name of its own (this module's basename is the same).
    path = Path(__file__).resolve().parent.parent / "test_lock.py"
    spec = importlib.util.spec_from_file_location("sync_lock_suite", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


suite = _sync_suite()


class LoopThread:
    """An event loop running in a thread: ``run(coro)`` from any thread waits for it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class SyncFacade:
    """The async store's API as the sync store's: each coroutine method run to completion."""

    def __init__(self, store: AsyncRedisLeaseStore, runner: LoopThread) -> None:
        self.store = store
        self.runner = runner

    def __getattr__(self, name):
        value = getattr(self.store, name)
        if inspect.iscoroutinefunction(value):
            return lambda *args, **kwargs: self.runner.run(value(*args, **kwargs))
        return value


def _async_store(runner: LoopThread, url: str, **kwargs) -> AsyncRedisLeaseStore:
    async def build():
        return AsyncRedisLeaseStore(async_twin(make_client(url)), prefix="t", **kwargs)

    return runner.run(build())


@pytest.fixture
def runner():
    runner = LoopThread()
    yield runner
    runner.close()


@pytest.fixture
def lock(redis_client, redis_server_url, runner):
    """The async store, through the sync facade: what the reused sync tests call ``lock``."""
    store = _async_store(runner, redis_server_url)
    yield SyncFacade(store, runner)
    runner.run(_close(store))


async def _close(store: AsyncRedisLeaseStore) -> None:
    if store.waiter_client is not store.client:
        await store.waiter_client.aclose()
    await store.client.aclose()


# -- (1) the sync suite, run against the async store -----------------------------------------

SHARED = [
    "test_acquire_returns_a_lease_with_metadata",
    "test_second_owner_is_refused",
    "test_same_owner_reacquire_is_idempotent",
    "test_every_key_has_a_ttl",
    "test_non_owner_release_and_extend_change_nothing",
    "test_release_is_owner_checked_and_idempotent",
    "test_extend_resets_the_ttl_for_the_owner",
    "test_owned_reports_seconds_left_or_none",
    "test_fencing_token_strictly_increases_across_expiry_and_reacquire",
    "test_fencing_token_survives_loss_of_its_counter",
    "test_fencing_tokens_of_back_to_back_grants_differ",
    "test_wait_gets_the_lease_when_the_holder_releases",
    "test_wait_gives_up_after_the_deadline",
    "test_extend_many_renews_in_one_call",
    "test_extend_many_reloads_flushed_scripts",
    "test_inspect_shows_the_holder",
    "test_inspect_of_a_key_that_is_not_a_lease_hash_reads_as_none",
    "test_a_regrant_of_a_hash_with_no_readable_fence_is_a_typed_error",
    "test_a_refusal_is_not_an_outage",
    "test_extend_many_renews_each_lease_as_extend_would",
    "test_extend_many_reloads_a_script_redis_lost",
    "test_a_waiter_that_gives_up_leaves_nothing_behind",
    "test_wait_keys_expire",
    "test_fence_counter_ahead_of_the_clock_is_followed",
    "test_fence_increases_across_expiry_with_the_counter_kept",
    "test_refused_acquire_reports_the_holder_and_its_ttl",
    "test_a_flushed_script_is_loaded_again",
    "test_bad_lock_names_are_lock_name_errors",
    "test_the_probes_reserved_name_is_refused_by_every_call",
]
for _name in SHARED:
    globals()[_name] = getattr(suite, _name)

# The sync store's argument checks, but those of its sync-only tools (reap, scan).
BAD_CALLS = [c for c in suite.BAD_CALLS if not c[0].startswith(("reap", "scan"))]


@pytest.mark.parametrize(
    "call, argument", [(c, a) for _, c, a in BAD_CALLS], ids=[i for i, _, _ in BAD_CALLS]
)
def test_bad_arguments_are_refused_by_name_and_nothing_is_written(
    lock, redis_client, call, argument
):
    suite.test_bad_arguments_are_refused_by_name_and_nothing_is_written(
        lock, redis_client, call, argument
    )


def test_errors_carry_the_lock_name_and_owner(lock, redis_client):
    # The sync test's calls, but reap (sync-only).
    redis_client.set("t:lease:{typed}", "not a hash", ex=5)
    for call in (
        lambda: lock.acquire("typed", "o7", 5.0),
        lambda: lock.release("typed", "o7"),
        lambda: lock.extend("typed", "o7", 5.0),
        lambda: lock.owned("typed", "o7"),
    ):
        with pytest.raises(LockError, match="refused") as info:
            call()
        err = info.value
        assert not isinstance(err, LockStoreUnavailable)
        assert (err.name, err.owner, err.key) == ("typed", "o7", "t:lease:{typed}")


def test_unreachable_store_errors_carry_the_lock_name_and_owner(runner):
    from helpers import closed_port_url

    store = SyncFacade(
        runner.run(_build(closed_port_url(), socket_timeout=0.5)),
        runner,
    )
    with pytest.raises(LockStoreUnavailable) as info:
        store.acquire("a", "o1", 5.0)
    assert (info.value.name, info.value.owner, info.value.key) == ("a", "o1", "t:lease:{a}")
    with pytest.raises(LockStoreUnavailable) as info:
        store.release("a", "o1")
    assert (info.value.name, info.value.owner) == ("a", "o1")


async def _build(url, **options):
    return AsyncRedisLeaseStore(async_twin(make_client(url, **options)), prefix="t")


def test_a_sync_and_an_async_holder_share_one_lease(lock, redis_client):
    sync = RedisLeaseStore(redis_client, prefix="t")
    held = sync.acquire("both", "celery-task", 5.0)
    lease, holder, _ttl = lock.try_acquire("both", "view", 5.0)
    assert lease is None and holder == "celery-task"
    assert sync.release("both", "celery-task") is True
    granted = lock.acquire("both", "view", 5.0)
    assert granted.fence > held.fence
    assert sync.try_acquire("both", "celery-task", 5.0)[1] == "view"


def test_the_async_store_refuses_a_sync_client(redis_client):
    with pytest.raises(InvalidArgument) as info:
        AsyncRedisLeaseStore(redis_client)
    assert info.value.argument == "client"


# -- (2) redis-py's asyncio lock tests, mapped onto the store --------------------------------
# redis-py's Lock is one key holding a token; ours is a hash holding the owner (and a
# fencing token) with a TTL always. Each test names the redis-py test it maps.


def test_lock_and_unlock(redis_client, redis_server_url):  # test_lock, test_lock_token
    async def main():
        store = await _build(redis_server_url)
        lease = await store.acquire("foo", "test", 10.0)
        assert lease is not None and redis_client.hget("t:lease:{foo}", "owner") == "test"
        assert 0 < redis_client.pttl("t:lease:{foo}") <= 10000  # never without a TTL
        assert await store.release("foo", "test") is True
        assert redis_client.exists("t:lease:{foo}") == 0
        await _close(store)

    asyncio.run(main())


def test_owned_and_locked(redis_server_url):  # test_locked, test_owned (decoded or not)
    async def main():
        store = await _build(redis_server_url)
        assert await store.owned("foo", "one") is None and await store.inspect("foo") is None
        await store.acquire("foo", "one", 10.0)
        assert await store.owned("foo", "one") > 0 and await store.inspect("foo") is not None
        assert await store.owned("foo", "two") is None
        await store.release("foo", "one")
        assert await store.owned("foo", "one") is None
        await store.acquire("foo", "two", 10.0)
        assert await store.owned("foo", "one") is None and await store.owned("foo", "two") > 0
        await store.release("foo", "two")
        assert await store.owned("foo", "two") is None
        await _close(store)

    asyncio.run(main())


def test_competing_locks(redis_server_url):  # test_competing_locks
    async def main():
        store = await _build(redis_server_url)
        assert await store.acquire("foo", "one", 10.0)
        assert await store.acquire("foo", "two", 10.0) is None
        await store.release("foo", "one")
        assert await store.acquire("foo", "two", 10.0)
        assert await store.acquire("foo", "one", 10.0) is None
        await store.release("foo", "two")
        await _close(store)

    asyncio.run(main())


def test_timeouts(redis_client, redis_server_url):  # test_timeout, test_float_timeout
    async def main():
        store = await _build(redis_server_url)
        await store.acquire("foo", "one", 10.0)
        assert 8000 < redis_client.pttl("t:lease:{foo}") <= 10000
        await store.acquire("bar", "one", 9.5)
        assert 8000 < redis_client.pttl("t:lease:{bar}") <= 9500
        await _close(store)

    asyncio.run(main())


def test_blocking_timeout(redis_server_url):  # test_blocking_timeout, test_high_sleep_...
    async def main():
        store = await _build(redis_server_url)
        await store.acquire("foo", "one", 10.0)
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await store.acquire("foo", "two", 10.0, wait=0.2) is None
        # Not before the wait ran out, and not much after (no poll interval to overshoot).
        assert 0.2 <= loop.time() - start < 1.0
        await _close(store)

    asyncio.run(main())


def test_context_manager(redis_client, redis_server_url):  # test_context_manager
    async def main():
        store = await _build(redis_server_url)
        async with store.lease("foo", ttl=10.0, wait=0.2) as lease:
            assert redis_client.hget("t:lease:{foo}", "owner") == lease.owner
        assert redis_client.exists("t:lease:{foo}") == 0
        await _close(store)

    asyncio.run(main())


def test_context_manager_raises_when_not_acquired(redis_client, redis_server_url):
    # test_context_manager_raises_when_locked_not_acquired: LockContended, a LockError.
    async def main():
        store = await _build(redis_server_url)
        await store.acquire("foo", "bar", 10.0)
        ran = []
        with pytest.raises(LockContended) as info:
            async with store.lease("foo", ttl=10.0, wait=0.1):
                ran.append(1)
        assert ran == [] and isinstance(info.value, LockError)
        assert info.value.holder == "bar" and 0 < info.value.ttl <= 10.0
        assert info.value.name == "foo" and info.value.key == "t:lease:{foo}"
        await _close(store)

    asyncio.run(main())


def test_releasing_an_unowned_lease(redis_client, redis_server_url):
    # test_releasing_unlocked_lock_raises_error, ..._no_longer_owned_raises_error: ours
    # returns False and changes nothing (a release twice is harmless), never deletes another's.
    async def main():
        store = await _build(redis_server_url)
        assert await store.release("foo", "one") is False
        await store.acquire("foo", "one", 10.0)
        redis_client.hset("t:lease:{foo}", "owner", "a")
        assert await store.release("foo", "one") is False
        assert redis_client.hget("t:lease:{foo}", "owner") == "a"
        await _close(store)

    asyncio.run(main())


def test_extend(redis_client, redis_server_url):
    # test_extend_lock(_float), test_extend_lock_replace_ttl, test_reacquire_lock: ours
    # always replaces the TTL (the heartbeat's renewal); test_extending_unlocked_lock_...,
    # ..._no_longer_owned_...: False, nothing changed.
    async def main():
        store = await _build(redis_server_url)
        await store.acquire("foo", "one", 10.0)
        redis_client.pexpire("t:lease:{foo}", 5000)
        assert await store.extend("foo", "one", 10.0) is True
        assert 8000 < redis_client.pttl("t:lease:{foo}") <= 10000
        assert await store.extend("foo", "one", 20.5) is True
        assert 19000 < redis_client.pttl("t:lease:{foo}") <= 20500
        assert await store.extend("nothing", "one", 10.0) is False
        redis_client.hset("t:lease:{foo}", "owner", "a")
        assert await store.extend("foo", "one", 30.0) is False
        assert redis_client.pttl("t:lease:{foo}") <= 20500
        await _close(store)

    asyncio.run(main())


# -- what only the async form has ----------------------------------------------------------


def test_waiters_on_one_loop_one_woken_per_release(redis_client, redis_server_url):
    async def main():
        store = AsyncRedisLeaseStore(
            async_twin(make_client(redis_server_url, socket_timeout=30.0)), prefix="t"
        )
        await store.acquire("m", "holder", 60.0)
        winners = []

        async def wait(i):
            lease = await store.acquire("m", f"w{i}", 60.0, wait=20.0)
            winners.append(lease.owner)

        tasks = [asyncio.create_task(wait(i)) for i in range(6)]
        while redis_client.zcard("t:waiters:{m}") < 6:
            await asyncio.sleep(0.005)
        redis_client.config_resetstat()
        owner = "holder"
        for k in range(1, 7):
            assert await store.release("m", owner) is True
            while len(winners) < k:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.05)
            assert len(winners) == k  # the others still wait
            owner = winners[-1]
        await asyncio.gather(*tasks)
        # One BLPOP per waiter woken: nobody polled.
        blpop = redis_client.info("commandstats").get("cmdstat_blpop", {})
        assert blpop.get("calls", 0) <= 6 + 5  # each waiter blocked again at most once
        assert redis_client.exists("t:waiters:{m}") == 0
        await _close(store)

    asyncio.run(main())


def test_max_waiters_is_a_bound(redis_client, redis_server_url):
    async def main():
        store = AsyncRedisLeaseStore(
            async_twin(make_client(redis_server_url)), prefix="t", max_waiters=2
        )
        await store.acquire("b", "holder", 60.0)
        waiters = [asyncio.create_task(store.acquire("b", f"w{i}", 5.0, wait=5.0)) for i in (1, 2)]
        while redis_client.zcard("t:waiters:{b}") < 2:
            await asyncio.sleep(0.005)
        with pytest.raises(LockStoreMisconfigured) as info:
            await store.acquire("b", "w3", 5.0, wait=5.0)
        assert info.value.setting == "steplock_max_waiters"
        await store.release("b", "holder")
        granted = await asyncio.gather(*waiters)
        assert sum(lease is not None for lease in granted) >= 1
        await _close(store)

    asyncio.run(main())


def test_a_cancelled_waiter_leaves_nothing_behind(redis_client, redis_server_url):
    async def main():
        store = await _build(redis_server_url)
        await store.acquire("c", "holder", 60.0)
        task = asyncio.create_task(store.acquire("c", "waiter", 5.0, wait=10.0))
        while redis_client.zscore("t:waiters:{c}", "waiter") is None:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):  # the cleanup task runs on the loop
            if not redis_client.exists("t:waiters:{c}"):
                break
            await asyncio.sleep(0.01)
        assert redis_client.exists("t:waiters:{c}") == 0
        assert redis_client.hget("t:lease:{c}", "owner") == "holder"
        await _close(store)

    asyncio.run(main())


def test_a_grant_whose_reply_a_cancellation_lost_is_released(redis_client, redis_server_url):
    # Cancel right after the acquire was written: whether Redis granted it or not, the
    # cancelled owner never keeps it.
    async def main():
        store = await _build(redis_server_url)
        await store.check_permissions()
        lost_replies = 0
        for i in range(20):
            fence = redis_client.get("t:fence:{g}")
            task = asyncio.create_task(store.acquire("g", f"o{i}", 30.0))
            for _ in range(i % 4):
                await asyncio.sleep(0)
            task.cancel()
            try:
                lease = await task
            except asyncio.CancelledError:
                lease = None
            for _ in range(200):
                if not any(t for t in asyncio.all_tasks() if t is not asyncio.current_task()):
                    break
                await asyncio.sleep(0.005)
            owner = redis_client.hget("t:lease:{g}", "owner")
            if lease is None:
                assert owner is None
                # Granted (the fencing counter moved) with the reply lost, then released.
                lost_replies += redis_client.get("t:fence:{g}") != fence
            else:
                assert owner == lease.owner
                await store.release("g", lease.owner)
        await _close(store)
        return lost_replies

    assert asyncio.run(main()) >= 1


async def _until(condition, what: str, timeout: float = 10.0) -> None:
    """Poll ``condition()`` (a read of Redis) until true; fail naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.002)


async def _cleanups_done(*keep: asyncio.Task) -> None:
    """Wait until the loop runs no task but the current one and ``keep``: the cancelled
    calls' cleanups (and the scripts they wait for) have ended."""

    def others():
        return [
            t for t in asyncio.all_tasks() if t is not asyncio.current_task() and t not in keep
        ]

    deadline = time.monotonic() + 10.0
    while others():
        assert time.monotonic() < deadline, f"still running: {others()}"
        await asyncio.sleep(0.005)


def _blocked(redis_client) -> int:
    """Clients Redis holds blocked (in BLPOP, or postponed by CLIENT PAUSE)."""
    return redis_client.info("clients")["blocked_clients"]


@pytest.mark.parametrize("wait", [0.0, 5.0])
def test_a_cancelled_reentrant_acquire_keeps_the_owners_earlier_hold(
    redis_client, redis_server_url, wait
):
    # Owner O holds the lease; a second acquire by O (a re-grant) is cancelled before it is
    # sent, while it is sent, and with its script held by Redis (CLIENT PAUSE WRITE): the
    # earlier hold is never released, its fence and fields unchanged.
    async def main():
        store = await _build(redis_server_url, socket_timeout=30.0)
        held = await store.acquire("r", "O", 60.0)
        key = lease_key("t", "r")
        before = redis_client.hgetall(key)
        assert before["owner"] == "O" and int(before["fence"]) == held.fence
        outcomes = []
        for k in range(6):
            task = asyncio.create_task(store.acquire("r", "O", 30.0, wait=wait))
            for _ in range(k):
                await asyncio.sleep(0)
            task.cancel()
            try:
                lease = await task
                assert lease.fence == held.fence
                outcomes.append("returned")
            except asyncio.CancelledError:
                outcomes.append("cancelled")
            await _cleanups_done()
            assert redis_client.hgetall(key) == before, k
        # The script in flight, held in Redis: the cancellation lands before its reply.
        redis_client.execute_command("CLIENT", "PAUSE", 20000, "WRITE")
        try:
            task = asyncio.create_task(store.acquire("r", "O", 30.0, wait=wait))
            await _until(lambda: _blocked(redis_client) == 1, "the acquire held by the pause")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert redis_client.hgetall(key) == before
        finally:
            redis_client.execute_command("CLIENT", "UNPAUSE")
        await _cleanups_done()
        assert redis_client.hgetall(key) == before
        assert 0 < redis_client.pttl(key) <= 30000  # the re-grant ran (it resets the TTL)
        assert redis_client.exists(waiters_key("t", "r")) == 0
        assert await store.release("r", "O") is True
        await _close(store)
        return outcomes

    assert "cancelled" in asyncio.run(main())


def test_a_waiter_cancelled_in_blpop_keeps_its_owners_other_hold(redis_client, redis_server_url):
    # Two calls of owner O: one waits in BLPOP, the other gets the lease afresh (the holder's
    # lease vanished without a wake-up, as on expiry). Cancelling the waiter releases nothing.
    async def main():
        store = await _build(redis_server_url, socket_timeout=30.0)
        await store.acquire("s", "H", 60.0)
        waiter = asyncio.create_task(store.acquire("s", "O", 30.0, wait=30.0))
        await _until(lambda: _blocked(redis_client) == 1, "the waiter's BLPOP")
        redis_client.delete(lease_key("t", "s"))
        other = await store.acquire("s", "O", 30.0)
        before = redis_client.hgetall(lease_key("t", "s"))
        assert before["owner"] == "O" and int(before["fence"]) == other.fence
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await _cleanups_done()
        assert redis_client.hgetall(lease_key("t", "s")) == before
        assert redis_client.zscore(waiters_key("t", "s"), "O") is None
        await _close(store)

    asyncio.run(main())


def test_a_waiter_cancelled_as_its_wake_up_arrives_passes_it_on(redis_client, redis_server_url):
    # H (TTL 60 s) holds; W1 then W2 wait in BLPOP (timeouts ~30 s). H's release pushes the
    # one wake-up, which Redis hands to W1 (blocked longest) before the release's reply;
    # W1 is cancelled in the same loop iteration, before the loop reads its BLPOP reply.
    # W2 gets the lease at once, not when its BLPOP times out.
    async def main():
        store = await _build(redis_server_url, socket_timeout=30.0)
        sync = RedisLeaseStore(redis_client, prefix="t")
        await store.acquire("w", "H", 60.0)
        w1 = asyncio.create_task(store.acquire("w", "W1", 30.0, wait=30.0))
        await _until(lambda: _blocked(redis_client) == 1, "W1's BLPOP")
        w2 = asyncio.create_task(store.acquire("w", "W2", 30.0, wait=30.0))
        await _until(lambda: _blocked(redis_client) == 2, "W2's BLPOP")
        assert sync.release("w", "H") is True
        assert _blocked(redis_client) == 1  # W1's BLPOP returned: it took the wake-up
        assert redis_client.llen(wake_key("t", "w")) == 0
        w1.cancel()  # no await since the release: its reply is unread
        started = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await w1
        lease = await asyncio.wait_for(w2, 5.0)
        elapsed = time.monotonic() - started
        assert lease.owner == "W2"
        assert elapsed < 2.0, elapsed
        await _cleanups_done()
        assert redis_client.zscore(waiters_key("t", "w"), "W1") is None
        assert redis_client.hget(lease_key("t", "w"), "owner") == "W2"
        assert await store.release("w", "W2") is True
        await _close(store)
        return elapsed

    asyncio.run(main())


def test_a_cancelled_waiter_wakes_no_one_while_the_lease_is_held(redis_client, redis_server_url):
    # The wake-up is passed on only when the lease is free: a waiter cancelled while H still
    # holds leaves the wake-up list empty and the other waiter blocked.
    async def main():
        store = await _build(redis_server_url, socket_timeout=30.0)
        await store.acquire("h", "H", 60.0)
        w1 = asyncio.create_task(store.acquire("h", "W1", 30.0, wait=30.0))
        w2 = asyncio.create_task(store.acquire("h", "W2", 30.0, wait=30.0))
        await _until(lambda: _blocked(redis_client) == 2, "both BLPOPs")
        redis_client.config_resetstat()
        w1.cancel()
        with pytest.raises(asyncio.CancelledError):
            await w1
        await _cleanups_done(w2)
        assert redis_client.zrange(waiters_key("t", "h"), 0, -1) == ["W2"]
        assert redis_client.exists(wake_key("t", "h")) == 0
        assert _blocked(redis_client) == 1
        assert "cmdstat_rpush" not in redis_client.info("commandstats")  # no wake-up pushed
        assert await store.release("h", "H") is True
        assert (await asyncio.wait_for(w2, 5.0)).owner == "W2"
        await store.release("h", "W2")
        await _close(store)

    asyncio.run(main())


def test_get_async_lease_store_is_the_apps_store_per_loop(app, redis_client):
    from celery_steplock.lock import get_lease_store

    sync = get_lease_store(app)

    async def main():
        store = get_async_lease_store(app)
        assert store is get_async_lease_store(app)
        assert (store.prefix, store.fence_ttl, store.max_waiters, store.name_secret) == (
            sync.prefix,
            sync.fence_ttl,
            sync.max_waiters,
            sync.name_secret,
        )
        lease = await store.acquire("app", "async-owner", 5.0)
        assert sync.owned("app", "async-owner") is not None
        await store.release("app", lease.owner)
        return store

    first = asyncio.run(main())
    second = asyncio.run(main())
    assert first is not second  # one per loop


def test_a_cancellation_redis_py_swallows_is_still_honoured(redis_server_url):
    # redis-py 8.1 on Python 3.11 returns a command's reply to a task cancelled at the
    # command's start (the connection check's zero timeout converts the cancel): the
    # driver (calls.arun) sees the task's pending cancel request and raises it.
    async def main():
        store = await _build(redis_server_url)
        await store.owned("x", "o")  # connected, scripts loaded
        outcomes = []
        for _ in range(10):
            task = asyncio.create_task(store.owned("x", "o"))
            await asyncio.sleep(0)  # the task now awaits inside redis-py
            task.cancel()
            try:
                await task
                outcomes.append("returned")
            except asyncio.CancelledError:
                outcomes.append("cancelled")
        await _close(store)
        return outcomes

    assert asyncio.run(main()) == ["cancelled"] * 10


# -- topologies: a Cluster (calls split by slot) and a Sentinel group ------------------------


async def _lease_cycle(store: AsyncRedisLeaseStore, names: list[str]) -> None:
    """Acquire, refuse, renew in one batch, wait for a release, and release, on ``store``."""
    leases = [await store.acquire(name, f"o-{name}", 5.0) for name in names]
    assert all(lease is not None for lease in leases)
    assert await store.acquire(names[0], "other", 5.0) is None
    items = [(name, f"o-{name}" if n % 3 else "wrong", 7.0) for n, name in enumerate(names)]
    assert await store.extend_many(items) == [bool(n % 3) for n in range(len(names))]
    assert 6.0 < await store.owned(names[1], f"o-{names[1]}") <= 7.0
    waiter = asyncio.create_task(store.acquire(names[0], "waiter", 5.0, wait=10.0))
    await asyncio.sleep(0.2)
    assert await store.release(names[0], f"o-{names[0]}") is True
    granted = await asyncio.wait_for(waiter, 10.0)
    assert granted is not None and granted.fence > leases[0].fence
    async with store.lease(names[-1] + "-cm", ttl=1.0) as lease:
        assert await store.owned(lease.name, lease.owner) is not None
    assert await store.owned(lease.name, lease.owner) is None
    for name in names[1:]:
        await store.release(name, f"o-{name}")


@pytest.mark.redis_shape
def test_async_store_on_a_cluster(redis_cluster):
    from celery_steplock._redis import aio
    from celery_steplock._redis.cluster import make_client as cluster_client

    redis_cluster.wait_ok()
    sync = cluster_client(redis_cluster.url)
    for node in sync.get_primaries():
        sync.get_redis_connection(node).flushdb()

    async def main():
        store = AsyncRedisLeaseStore(async_twin(sync), prefix="ct")
        assert aio.is_async_cluster(store.client)
        # Names over many slots: EXTEND_MANY goes once per slot, pipelined per node.
        await _lease_cycle(store, [f"cl-{i}" for i in range(24)])
        await store.client.aclose()

    asyncio.run(main())
    sync.close()


@pytest.mark.redis_shape
def test_async_store_through_sentinel(app, sentinel_group):
    from tests.helpers import set_settings

    set_settings(
        app,
        steplock_redis_url=sentinel_group.url,
        steplock_redis_transport_options=sentinel_group.transport_options,
        steplock_socket_timeout=2.0,
    )
    primary = sentinel_group.node_client(sentinel_group.primary_port())
    primary.flushdb()

    async def main():
        store = get_async_lease_store(app)
        assert type(store.client.connection_pool).__name__ == "SentinelConnectionPool"
        await _lease_cycle(store, [f"se-{i}" for i in range(6)])
        return store.prefix

    from helpers import all_keys_have_ttl

    prefix = asyncio.run(main())
    keys, without = all_keys_have_ttl(primary, f"{prefix}:*")
    assert keys and without == []
    primary.close()


def test_an_async_waiter_rides_out_a_primary_that_is_gone_for_a_second(private_redis):
    # As the sync store's waiter (tests/test_lock.py): after a dropped wait, the acquire
    # attempts are tried again while no primary answers, for at most FAILOVER_GRACE seconds.
    sync = RedisLeaseStore(make_client(private_redis.url), prefix="t")
    sync.acquire("ride", "holder", 30.0)

    async def main():
        store = AsyncRedisLeaseStore(async_twin(sync.client), prefix="t")
        waiter = asyncio.ensure_future(store.acquire("ride", "waiter", 5.0, wait=20.0))
        probe = make_client(private_redis.url)
        while probe.zscore("t:waiters:{ride}", "waiter") is None:
            await asyncio.sleep(0.02)
        probe.close()
        await asyncio.to_thread(private_redis.kill)
        await asyncio.sleep(1.5)
        await asyncio.to_thread(private_redis.start)
        try:
            return await asyncio.wait_for(waiter, 15)
        finally:
            await store.client.aclose()

    lease = asyncio.run(main())
    assert lease is not None and lease.owner == "waiter"
    sync.client.close()
