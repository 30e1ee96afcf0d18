"""The asyncio form of idempotency records (celery_steplock.patterns.idempotency): ``abegin``,
``acall``, the ``a``-ends of a call and ``@idempotent`` on ``async def``, on the same records
as the sync form. Each scenario runs on both stores: ``redis`` (real redis-server) and
``database`` (the Django model on the pass's database, Redis as the cache of completed
rows). An async and a sync caller with one key run the body once; twenty concurrent async
callers too; a record held across awaits outlives its lock TTL (renewed); a cancelled
holder's record is released, never completed."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time

import pytest

from celery_steplock.exceptions import (
    IdempotencyInProgress,
    IdempotencyKeyReused,
    LockStoreUnavailable,
)
from celery_steplock.heartbeat import heartbeat_for
from celery_steplock.lock import make_client
from celery_steplock.patterns.idempotency import Idempotency, RedisRecords, Stored, idempotent
from tests.support.idempotency import seen  # noqa: F401 - the fixture
from tests.support.loop import LagProbe
from tests.support.busy import keep_busy

SECRET = "a" * 40

STORES = [
    pytest.param("redis", marks=pytest.mark.no_database, id="redis"),
    pytest.param("database", marks=pytest.mark.django_db(transaction=True), id="database"),
]


def closing(fun):
    """``fun`` for a thread of its own: the thread's database connection closed after it."""

    def run(*args, **kwargs):
        from django.db import connections

        try:
            return fun(*args, **kwargs)
        finally:
            connections.close_all()

    return run


def run(main):
    """``asyncio.run(main)``, then the connection of asgiref's sync thread closed (the
    database store's hops run there)."""
    try:
        return asyncio.run(main)
    finally:
        from asgiref.sync import sync_to_async
        from django.db import connections

        asyncio.run(sync_to_async(connections.close_all, thread_sensitive=True)())


async def until(predicate, timeout=10.0, what="the condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def renewing(store):
    """The leases the heartbeat of ``store``'s records holds: the running loop's asyncio
    heartbeat for the Redis store, the heartbeat thread's lane for the database store."""
    if isinstance(store, RedisRecords):
        from celery_steplock.aio.heartbeat import get_async_heartbeat

        return get_async_heartbeat().leases
    return heartbeat_for(store).leases


def options(redis_client, store, **kwargs):
    return dict(
        key="order:{order_id}",
        client=redis_client,
        secret=SECRET,
        namespace=kwargs.pop("namespace", "tests.aio.charge"),
        store=store,
        **kwargs,
    )


@pytest.mark.parametrize("store", STORES)
def test_an_async_and_a_sync_caller_with_one_key_run_the_body_once(redis_client, store):
    runs = []
    release = threading.Event()

    @idempotent(**options(redis_client, store))
    async def acharge(order_id, amount):
        runs.append(("async", order_id))
        await asyncio.to_thread(release.wait, 10)  # held across awaits
        return {"order": order_id, "by": "async"}

    @idempotent(**options(redis_client, store))
    def charge(order_id, amount):
        runs.append(("sync", order_id))
        return {"order": order_id, "by": "sync"}

    assert inspect.iscoroutinefunction(acharge) and not inspect.iscoroutinefunction(charge)
    assert acharge.record_key(1, 10) == charge.record_key(1, 10)  # one record

    async def main():
        holder = asyncio.create_task(acharge(1, 10))
        await until(lambda: runs, what="the async body")
        # The sync caller (a Celery task, a WSGI view) while the async one holds the key.
        with pytest.raises(IdempotencyInProgress) as refused:
            await asyncio.to_thread(closing(charge), 1, 10)
        assert 0 < refused.value.retry_after <= 1.0
        with pytest.raises(IdempotencyKeyReused):  # other arguments: refused, not run
            await asyncio.to_thread(closing(charge), 1, 11)
        release.set()
        first = await holder
        replay = await asyncio.to_thread(closing(charge), 1, 10)
        return first, replay

    first, replay = run(main())
    assert first == replay == {"order": 1, "by": "async"}
    assert runs == [("async", 1)]
    # The other way round: the sync caller runs it, the async one gets the replay.
    assert charge(2, 5) == {"order": 2, "by": "sync"}
    assert run(acharge(2, 5)) == {"order": 2, "by": "sync"}
    assert runs == [("async", 1), ("sync", 2)]


@pytest.mark.parametrize("store", STORES)
def test_twenty_concurrent_async_callers_with_one_key_run_the_body_once(redis_client, store, seen):
    runs = []

    @idempotent(**options(redis_client, store, namespace="tests.aio.twenty"))
    async def acharge(order_id, amount):
        runs.append(order_id)
        await asyncio.sleep(1.0)
        return {"order": order_id, "charged": amount}

    async def main():
        async with LagProbe() as probe:
            outcomes = await asyncio.gather(
                *(acharge(7, 70) for _ in range(20)), return_exceptions=True
            )
            replays = await asyncio.gather(*(acharge(7, 70) for _ in range(20)))
        return outcomes, replays, probe.max_lag

    outcomes, replays, lag = run(main())
    done = [o for o in outcomes if not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, IdempotencyInProgress)]
    assert runs == [7]
    assert done == [{"order": 7, "charged": 70}] and len(refused) == 19
    assert replays == done * 20
    names = [name for name, _ in seen]
    assert names.count("idempotency_locked") == 1
    assert names.count("idempotency_completed") == 1
    assert names.count("idempotency_conflict") == 19
    assert names.count("idempotency_replayed") == 20
    assert lag < 0.25, f"the event loop lagged {lag:.3f} s"


@pytest.mark.parametrize("store", STORES)
def test_a_record_held_across_awaits_is_renewed_past_its_lock_ttl(redis_client, store):
    lock_ttl = 1.0
    policy = Idempotency(
        "tests.aio.long", client=redis_client, secret=SECRET, store=store, lock_ttl=lock_ttl
    )

    async def main():
        held = await policy.abegin("order:1", {"order_id": 1})
        assert not held.replayed and held.lease is not None
        assert held.lease in renewing(policy.store)
        first = await policy.aget("order:1")
        assert first.status == "locked" and first.owner == held.owner
        since = time.monotonic()
        while time.monotonic() - since < 3 * lock_ttl:  # three lock TTLs of awaits
            with pytest.raises(IdempotencyInProgress):
                await policy.abegin("order:1", {"order_id": 1})
            with pytest.raises(IdempotencyKeyReused):
                await policy.abegin("order:1", {"order_id": 2})
            await asyncio.sleep(0.1)
        record = await policy.aget("order:1")
        assert record.status == "locked" and record.owner == held.owner
        assert record.expires_at > first.expires_at and record.attempts == 1  # renewed
        assert not held.lease.lost
        assert await held.acomplete({"done": True}) is True
        assert held.lease not in renewing(policy.store)  # renewals stopped
        assert await held.acomplete("again") is False  # ended once
        replay = await policy.abegin("order:1", {"order_id": 1})
        return replay

    replay = run(main())
    assert replay.replayed and replay.result == {"done": True}


@pytest.mark.parametrize("store", STORES)
def test_a_cancelled_holder_releases_its_record_never_completes_it(redis_client, store):
    started = asyncio.Event
    runs = []

    @idempotent(**options(redis_client, store, namespace="tests.aio.cancel", lock_ttl=60))
    async def acharge(order_id, amount):
        runs.append(order_id)
        await asyncio.sleep(30)
        return "never recorded"

    policy = Idempotency(
        "tests.aio.cancel.block", client=redis_client, secret=SECRET, store=store, lock_ttl=60
    )

    async def main():
        key = acharge.record_key(3, 30)
        task = asyncio.create_task(acharge(3, 30))
        await until(lambda: runs, what="the body")
        locked = await acharge.idempotency.store.aget(key)
        assert locked.status == "locked"
        leases = [lease for lease in renewing(acharge.idempotency.store) if lease.key == key]
        assert len(leases) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await acharge.idempotency.store.aget(key) is None  # released at once
        assert leases[0] not in renewing(acharge.idempotency.store)

        # The context manager form, cancelled inside the block.
        entered = started()

        async def block():
            async with policy.acall("r", {"a": 1}) as call:
                entered.set()
                await asyncio.sleep(30)
                call.result = "never recorded"

        task = asyncio.create_task(block())
        await entered.wait()
        assert (await policy.aget("r")).status == "locked"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await policy.aget("r") is None

        # The next calls run (nothing was recorded), and complete.
        runs.clear()
        second = asyncio.create_task(acharge(3, 30))
        await until(lambda: runs, what="the body again")
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        async with policy.acall("r", {"a": 1}) as call:
            assert not call.replayed
            call.result = "recorded"
        async with policy.call("r", {"a": 1}) as call:  # call() serves async with too
            assert call.replayed and call.result == "recorded"

    run(main())
    assert runs == [3]


@pytest.mark.parametrize("store", STORES)
def test_errors_and_signals_are_the_sync_forms(redis_client, store, seen):
    """A failure is never recorded and runs again; the signals, their order and fields are
    the sync form's."""
    attempts = []

    def body(order_id, amount, fail=False):
        attempts.append(order_id)
        if fail:
            raise ValueError("declined")
        return {"order": order_id, "charged": amount}

    @idempotent(**options(redis_client, store, namespace="tests.aio.sig.sync"))
    def charge(order_id, amount, fail=False):
        return body(order_id, amount, fail)

    @idempotent(**options(redis_client, store, namespace="tests.aio.sig.async"))
    async def acharge(order_id, amount, fail=False):
        await asyncio.sleep(0)
        return body(order_id, amount, fail)

    def sync_story():
        with pytest.raises(ValueError):
            charge(1, 10, fail=True)
        assert charge(1, 10) == {"order": 1, "charged": 10}
        assert charge(1, 10) == {"order": 1, "charged": 10}
        with pytest.raises(IdempotencyKeyReused):
            charge(1, 11)

    async def async_story():
        with pytest.raises(ValueError):
            await acharge(1, 10, fail=True)
        assert await acharge(1, 10) == {"order": 1, "charged": 10}
        assert await acharge(1, 10) == {"order": 1, "charged": 10}
        with pytest.raises(IdempotencyKeyReused):
            await acharge(1, 11)

    sync_story()
    sync_seen = list(seen)
    seen.clear()
    run(async_story())
    assert attempts == [1, 1, 1, 1]  # each form: the failed run, then one completed run

    def shape(found):
        return [
            (name, sorted(k for k in kw if k not in ("signal",)), kw.get("reason"))
            for name, kw in found
        ]

    assert shape(seen) == shape(sync_seen)
    assert [name for name, _ in seen] == [
        "idempotency_locked",
        "idempotency_failed",
        "idempotency_locked",
        "idempotency_completed",
        "idempotency_replayed",
        "idempotency_conflict",
    ]
    assert seen[1][1]["reason"] == "ValueError"
    assert all(kw["name"] == "tests.aio.sig.async" for _, kw in seen)


@pytest.mark.no_database
def test_the_redis_store_async_calls_are_the_sync_calls(redis_client):
    """One script room: each ``a``-method gives what its sync twin gives, on one state."""
    store = RedisRecords(redis_client, "steplock")
    stored = Stored.dump({"x": 1}, "json")

    async def main():
        decision = await store.abegin("k" * 64, "fp", "owner-a", 30.0, "ns", "1")
        assert decision.outcome == "locked"
        sync_view = await asyncio.to_thread(store.get, "k" * 64)
        assert await store.aget("k" * 64) == sync_view
        assert sync_view.status == "locked" and sync_view.owner == "owner-a"
        busy = await asyncio.to_thread(store.begin, "k" * 64, "fp", "owner-b", 30.0, "ns", "1")
        assert busy.outcome == "in_progress" and 29 < busy.retry_after <= 30
        assert await store.aextend_many([("k" * 64, "owner-a", 60.0), ("k" * 64, "x", 60)]) == [
            True,
            False,
        ]
        assert await store.aextend_many([]) == []
        assert await store.acomplete("k" * 64, "owner-b", "fp", stored, 60.0, "ns", "1") is False
        assert await store.acomplete("k" * 64, "owner-a", "fp", stored, 60.0, "ns", "1") is True
        replay = await store.abegin("k" * 64, "fp", "owner-c", 30.0, "ns", "1")
        assert replay.outcome == "replay" and replay.record.result() == {"x": 1}
        assert replay == store.begin("k" * 64, "fp", "owner-c", 30.0, "ns", "1")
        reused = await store.abegin("k" * 64, "other", "owner-c", 30.0, "ns", "1")
        assert (reused.outcome, reused.status) == ("reused", "completed")
        assert await store.ainvalidate("k" * 64) is True
        assert await store.ainvalidate("k" * 64) is False
        assert (await store.abegin("k" * 64, "fp", "owner-d", 30.0)).outcome == "locked"
        assert await store.afail("k" * 64, "owner-d", "ValueError", 60.0) is True
        assert (await store.aget("k" * 64)).status == "failed"
        assert (await store.abegin("i" * 64, "fp", "owner-e", 30.0)).outcome == "locked"
        assert await store.arelease("i" * 64, "owner-x") is False
        assert await store.arelease("i" * 64, "owner-e") is True
        assert await store.aget("i" * 64) is None
        record = store.get("k" * 64)
        await store.acache(
            type(record)(
                **{
                    **record.__dict__,
                    "status": "completed",
                    "payload": '{"y": 2}',
                    "serializer": "json",
                    "content_type": "application/json",
                    "content_encoding": "utf-8",
                }
            ),
            60.0,
        )
        assert (await store.aget("k" * 64)).result("json") == {"y": 2}

    run(main())


@pytest.mark.no_database
def test_an_unreachable_store_fails_closed_by_default_and_open_when_asked():
    dead = make_client("redis://127.0.0.1:1/0", socket_timeout=0.5)
    closed = Idempotency("tests.aio.dead", client=dead, secret=SECRET)
    opened = Idempotency("tests.aio.dead", client=dead, secret=SECRET, on_store_error="fail_open")
    runs = []

    @idempotent(client=dead, secret=SECRET, on_store_error="fail_open")
    async def body(x):
        runs.append(x)
        return x

    async def main():
        with pytest.raises(LockStoreUnavailable):
            await closed.abegin("r", {"a": 1})
        call = await opened.abegin("r", {"a": 1})
        assert call.unguarded and not call.replayed and call.lease is None
        assert await call.acomplete("x") is False  # nothing to record
        assert await body(1) == 1 and await body(1) == 1

    asyncio.run(main())
    assert runs == [1, 1]  # unguarded: it ran each time


# -- a cancellation that lands while the begin's reply is in flight ----------------------------


def _ours(task, keep) -> bool:
    """A task of a cancelled begin (its round trip, the release after it): not ``keep``'s
    (the tasks that ran before), nor the heartbeat's (its loop, its wake-up wait)."""
    coro = task.get_coro()
    name = getattr(coro, "__qualname__", "")
    heartbeat = task.get_name().startswith("steplock-") or name == "Event.wait"
    return task not in keep and not heartbeat


async def _cleanups_done(keep, timeout: float = 5.0) -> None:
    """Wait until the loop runs no task of a cancelled begin: the begins' round trips and
    the releases after them have ended."""
    deadline = time.monotonic() + timeout
    current = asyncio.current_task()
    while others := [t for t in asyncio.all_tasks() if t is not current and _ours(t, keep)]:
        assert time.monotonic() < deadline, f"still running: {others}"
        await asyncio.sleep(0.005)


async def _reply_lost(url, begin):
    """Run ``begin`` (a coroutine) while Redis is busy (:func:`keep_busy`): its script is sent
    but not read yet; cancel it there (CancelledError at once), then let Redis go on: the
    script runs, its reply going to nobody. Returns the tasks that ran before (for
    :func:`_cleanups_done`)."""
    keep = set(asyncio.all_tasks())
    thread = keep_busy(url, 1.0)
    task = asyncio.create_task(begin)
    await asyncio.sleep(0.1)  # the script is written to the socket; Redis reads nothing yet
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.to_thread(thread.join)
    return keep


def _record_hash(redis_client, policy, resource):
    return redis_client.hgetall(policy.store.redis_key(policy.key(resource)))


async def _freed(predicate, bound: float = 2.0) -> float:
    """Seconds until ``predicate()`` (a read of the record) holds; fails after ``bound``."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < bound, "the record is still locked"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


@pytest.mark.no_database
def test_a_begin_cancelled_with_its_reply_in_flight_leaves_the_record_free(
    redis_client, redis_server_url
):
    # The script locks the record for the cancelled call (Redis runs it once no longer
    # busy); its reply goes to nobody. Before the fix the record stayed locked for lock_ttl (600 s).
    policy = Idempotency("tests.aio.lost", client=redis_client, secret=SECRET, lock_ttl=600)

    async def main():
        warm = await policy.abegin("warm", {"a": 0})  # connected, scripts loaded
        await warm.arelease()
        fired = redis_client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
        keep = await _reply_lost(redis_server_url, policy.abegin("r", {"a": 1}))
        waited = await _freed(lambda: not _record_hash(redis_client, policy, "r"))
        await _cleanups_done(keep)
        # the begin and the release after it ran (the begin's reply went to its own task)
        stats = redis_client.info("commandstats")["cmdstat_evalsha"]["calls"]
        assert stats - fired >= 2
        # the next call with the key runs at once
        call = await policy.abegin("r", {"a": 1})
        assert not call.replayed and call.lease is not None
        await call.acomplete("done")
        return waited

    assert run(main()) < 2.0


@pytest.mark.no_database
def test_the_store_abegin_cancelled_in_flight_releases_what_it_locked(
    redis_client, redis_server_url
):
    # RedisRecords.abegin itself (the store's coroutine, called directly).
    store = RedisRecords(redis_client, "steplock")

    async def main():
        assert (await store.abegin("w" * 64, "fp", "warm", 30.0)).outcome == "locked"
        keep = await _reply_lost(redis_server_url, store.abegin("s" * 64, "fp", "o-1", 600.0))
        await _freed(lambda: not redis_client.exists(store.redis_key("s" * 64)))
        await _cleanups_done(keep)
        assert await store.aget("s" * 64) is None

    run(main())


@pytest.mark.no_database
def test_a_cancelled_begin_never_releases_another_callers_record(redis_client, redis_server_url):
    # A holds the record (its abegin completed); B's begin, cancelled in flight, was told
    # "in progress": nothing of A's is released. Same for the store's abegin with A's record.
    policy = Idempotency("tests.aio.owner", client=redis_client, secret=SECRET, lock_ttl=600)
    store = policy.store

    async def main():
        held = await policy.abegin("r", {"a": 1})
        before = _record_hash(redis_client, policy, "r")
        assert before["status"] == "locked" and before["owner"] == held.owner
        keep = await _reply_lost(redis_server_url, policy.abegin("r", {"a": 1}))
        key = policy.key("r")
        await _reply_lost(redis_server_url, store.abegin(key, held.fingerprint, "b", 60.0))
        await _cleanups_done(keep)
        after = _record_hash(redis_client, policy, "r")
        assert (after["status"], after["owner"]) == ("locked", held.owner)
        assert after["expires_ms"] == before["expires_ms"]
        assert await held.acomplete("done") is True
        # a completed record is not touched either: the cancelled begin replayed it
        keep = await _reply_lost(redis_server_url, policy.abegin("r", {"a": 1}))
        await _cleanups_done(keep)
        assert _record_hash(redis_client, policy, "r")["status"] == "completed"
        replay = await policy.abegin("r", {"a": 1})
        assert replay.replayed and replay.result == "done"

    run(main())


@pytest.mark.django_db(transaction=True)
def test_a_database_begin_cancelled_on_its_thread_leaves_the_row_free(redis_client):
    # The database store's begin hops to a thread, which a cancellation does not stop: the
    # row is locked on that thread after the caller was cancelled. It is released then.
    from celery_steplock.contrib.django.idempotency import DatabaseRecords

    entered, go = threading.Event(), threading.Event()

    class Held(DatabaseRecords):
        def _begin_in_database(self, *args):
            decision = super()._begin_in_database(*args)
            entered.set()
            go.wait(10)  # the row is locked (committed); the caller is cancelled meanwhile
            return decision

    store = Held()
    policy = Idempotency("tests.aio.dbcancel", client=redis_client, secret=SECRET, store=store)
    rows = store.model.objects

    async def main():
        keep = set(asyncio.all_tasks())
        task = asyncio.create_task(policy.abegin("r", {"a": 1}))
        await until(entered.is_set, what="the row locked on the store's thread")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        go.set()
        start = time.monotonic()
        while await policy.aget("r") is not None:
            assert time.monotonic() - start < 2.0, "the row is still locked"
            await asyncio.sleep(0.01)
        await _cleanups_done(keep)
        call = await policy.abegin("r", {"a": 1})  # runs at once
        assert not call.replayed
        await call.arelease()
        assert not await asyncio.to_thread(closing(rows.filter(key=policy.key("r")).exists))

    try:
        run(main())
    finally:
        go.set()


@pytest.mark.no_database
def test_a_block_cancelled_while_its_result_is_recorded_still_records_it(redis_client):
    """The block ended and its result is being written when the caller's task is cancelled:
    the write finishes (shielded), so the next call replays the result. Cut short, it left
    the record locked and renewed while the loop lived: every later call was refused as in
    progress."""
    policy = Idempotency("tests.aio.cancel.record", client=redis_client, secret=SECRET)

    async def main():
        async def block():
            async with policy.acall("r", {"a": 1}) as call:
                # the lock store's writes wait 1 s: the record's completion with them
                redis_client.execute_command("CLIENT", "PAUSE", 1000, "WRITE")
                call.result = {"charged": 1}

        task = asyncio.create_task(block())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(1.5)  # the pause is over
        async with policy.acall("r", {"a": 1}) as again:
            return await policy.store.aget(policy.key("r")), again.replayed, again.result

    record, replayed, result = run(main())
    assert (record.status, replayed, result) == ("completed", True, {"charged": 1})
