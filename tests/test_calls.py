"""celery_steplock.calls: one generator of steps, driven by a sync and an asyncio client, gives
the same replies and the same translated errors; NOSCRIPT reloads; a cancellation closes the
generator; a pause never blocks the event loop. Real redis-server only."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import ResponseError

from celery_steplock import calls
from celery_steplock._redis import wire
from celery_steplock.clients import async_client_for, make_client
from celery_steplock.exceptions import LockError, LockStoreUnavailable
from tests.support.loop import LagProbe

pytestmark = pytest.mark.redis_shape

SET = wire.Script("return redis.call('SET', KEYS[1], ARGV[1], 'PX', 60000)")
INCR = wire.Script("return redis.call('INCR', KEYS[1])")


def operation(key: str):
    """Every kind of step once; returns what each sent back."""
    first = yield calls.Eval(SET, [key], ["v"], "test set", name=key)
    paused = yield calls.Sleep(0.001)
    many = yield calls.EvalMany(INCR, [([f"{key}:a"], []), ([key], [])], "test incr")
    got = yield calls.Command(("GET", key), "test get", key=key)
    return first, paused, many, got


def outage_tolerant(key: str):
    """The outage policy written once: an unreachable Redis gives a fallback."""
    try:
        reply = yield calls.Eval(INCR, [key], [], "test incr", name=key)
    except LockStoreUnavailable as exc:
        return ("fallback", exc.name)
    return ("reply", reply)


def both(steps_factory, sync_client, *args):
    """The results of the sync and the asyncio driver for the same operation."""
    sync = calls.run(steps_factory(*args), sync_client)

    async def main():
        return await calls.arun(steps_factory(*args), async_client_for(sync_client))

    return sync, asyncio.run(main())


def test_sync_and_async_drivers_give_the_same_replies(redis_client):
    sync, asynchronous = both(operation, redis_client, "calls:same")
    assert sync[0] == asynchronous[0] == "OK"
    assert sync[1] is None and asynchronous[1] is None
    assert sync[2][0] == 1 and asynchronous[2][0] == 2  # one counter, two runs
    assert isinstance(sync[2][1], ResponseError)  # INCR on a string: refused in place
    assert isinstance(asynchronous[2][1], ResponseError)
    assert str(sync[2][1]) == str(asynchronous[2][1])
    assert sync[3] == asynchronous[3] == "v"


def test_a_refused_eval_is_thrown_into_the_generator_translated(redis_client):
    redis_client.set("calls:string", "x")
    with pytest.raises(LockError) as sync:
        calls.run(outage_tolerant("calls:string"), redis_client)

    async def main():
        await calls.arun(outage_tolerant("calls:string"), async_client_for(redis_client))

    with pytest.raises(LockError) as asynchronous:
        asyncio.run(main())
    assert type(sync.value) is type(asynchronous.value)
    assert sync.value.name == asynchronous.value.name == "calls:string"
    assert "not an integer" in str(asynchronous.value)
    assert isinstance(asynchronous.value.__cause__, ResponseError)


def test_an_outage_reaches_the_generators_own_policy(private_redis):
    client = make_client(private_redis.url, socket_timeout=0.5)
    assert both(outage_tolerant, client, "calls:n") == (("reply", 1), ("reply", 2))
    private_redis.stop()
    assert both(outage_tolerant, client, "calls:n") == (
        ("fallback", "calls:n"),
        ("fallback", "calls:n"),
    )


def test_noscript_reloads_the_script_in_both_drivers(redis_client):
    script = wire.Script("return 'fresh-" + str(time.time_ns()) + "'")

    def one():
        return (yield calls.Eval(script, ["calls:k"], [], "test"))

    def many():
        return (yield calls.EvalMany(script, [(["calls:k"], []), (["calls:k"], [])], "test"))

    for _ in range(2):
        redis_client.script_flush()
        sync, asynchronous = both(one, redis_client)
        assert sync == asynchronous and sync.startswith("fresh-")
        redis_client.script_flush()
        sync, asynchronous = both(many, redis_client)
        assert sync == asynchronous == [sync[0], sync[0]]


def test_cancellation_closes_the_generator_and_propagates(redis_client):
    seen = []

    def held():
        try:
            yield calls.Eval(SET, ["calls:held"], ["v"], "test")
            yield calls.Sleep(30)
        finally:
            seen.append("finally")

    async def main():
        task = asyncio.create_task(calls.arun(held(), async_client_for(redis_client)))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert seen == ["finally"]
    assert redis_client.get("calls:held") == "v"


def test_an_async_pause_never_blocks_the_loop(redis_client):
    def pauses():
        for _ in range(10):
            yield calls.Sleep(0.05)
        return "done"

    async def main():
        async with LagProbe() as probe:
            result = await calls.arun(pauses(), async_client_for(redis_client))
        return result, probe

    result, probe = asyncio.run(main())
    assert result == "done"
    assert probe.ticks > 20  # the probe ran throughout the half second of pauses
    assert probe.max_lag < 0.05, probe.max_lag


def test_the_async_twin_is_cached_per_loop_and_client(redis_client):
    other = make_client("redis://127.0.0.1:1/0")

    async def twins():
        first = async_client_for(redis_client)
        assert async_client_for(first) is first  # an asyncio client is used as it is
        return first, async_client_for(redis_client), async_client_for(other)

    a1, a2, a3 = asyncio.run(twins())
    b1, _b2, _b3 = asyncio.run(twins())
    assert a1 is a2 and a1 is not a3
    assert a1 is not b1  # another loop, another client (connections belong to their loop)
    kwargs = a1.connection_pool.connection_kwargs
    sync_kwargs = redis_client.connection_pool.connection_kwargs
    for name in ("host", "port", "db", "socket_timeout", "decode_responses"):
        assert kwargs[name] == sync_kwargs[name], name
    assert a1.connection_pool.max_connections == redis_client.connection_pool.max_connections


def test_a_pooled_connection_the_server_closed_is_opened_again(private_redis):
    # A restart (or the server's idle timeout) closes a connection while it sits in the
    # pool: the next script call reopens it, as the sync pool does (redis-py 8's asyncio
    # pool keeps it when maintenance notifications are on, and the call would fail).
    # A client of the caller's, without the retries the settings' clients have.
    import redis.asyncio

    async def main():
        aclient = redis.asyncio.Redis.from_url(private_redis.url, decode_responses=True)
        try:
            first = await calls.arun(set_once("calls:stale"), aclient)
            await asyncio.to_thread(private_redis.restart)
            return first, await calls.arun(set_once("calls:stale"), aclient)
        finally:
            await aclient.aclose()

    assert asyncio.run(main()) == ("OK", "OK")


def set_once(key: str):
    """One script call."""
    return (yield calls.Eval(SET, [key], ["v"], "test set", name=key))
