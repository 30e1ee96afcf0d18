"""The rate limits' async form (celery_steplock.patterns.ratelimit: ``atry_acquire``,
``async with``/``await limiter.acquire(key)``, ``@limiter.using`` on ``async def``) against
a real redis-server: the same decisions, Redis state and signals as the sync form (one limit
shared by sync and async callers), the outage policy with Redis stopped, and an event loop
that never stalls while async callers decide. The sync suite is
tests/patterns/test_ratelimit.py."""

import asyncio
import inspect
import threading
import time

import pytest

from celery_steplock import RateLimited, SlidingWindow, TokenBucket, signals
from celery_steplock.exceptions import LockStoreUnavailable
from celery_steplock.lock import make_client
from celery_steplock.patterns.ratelimit import Admission
from tests.support.loop import LagProbe

pytestmark = pytest.mark.no_database  # Redis only: runs once, in the SQLite pass


def run(coroutine):
    return asyncio.run(coroutine)


def _shape(decision):
    return (decision.allowed, decision.limit, decision.ticket is not None, decision.queued)


@pytest.mark.parametrize(
    "build",
    [lambda c: TokenBucket(0.5, capacity=3, client=c), lambda c: SlidingWindow(3, 60, client=c)],
    ids=["bucket", "window"],
)
def test_the_async_form_decides_as_the_sync_form(redis_client, build):
    limiter = build(redis_client)
    sync = [limiter.try_acquire("sync-key", reserve=k == 4) for k in range(5)]

    async def sequence():
        return [await limiter.atry_acquire("async-key", reserve=k == 4) for k in range(5)]

    asynchronous = run(sequence())
    assert [_shape(d) for d in sync] == [_shape(d) for d in asynchronous]
    assert [d.allowed for d in asynchronous] == [True, True, True, False, False]
    assert [d.remaining for d in asynchronous[:3]] == pytest.approx(
        [d.remaining for d in sync[:3]], abs=0.05
    )
    # a denial's wait is the same figure, measured from its own decision
    assert asynchronous[3].retry_after == pytest.approx(sync[3].retry_after, abs=0.1)
    assert asynchronous[4].ticket and asynchronous[4].queued == sync[4].queued == 0
    # the same key layout: the async decisions live where the sync ones do
    assert asynchronous[0].key == sync[0].key.replace("sync-key", "async-key")
    assert redis_client.exists(asynchronous[0].key)


def test_sync_and_async_callers_share_one_bucket(redis_client):
    """Capacity 5, refilled once a week: 3 sync + 3 async admissions asked for at once
    (threads and coroutines racing) -> exactly 5 admitted."""
    bucket = TokenBucket(1 / (7 * 24 * 3600.0), capacity=5, client=redis_client)
    results = []
    start = threading.Barrier(4)

    def sync_caller():
        start.wait()
        results.append(("sync", bucket.try_acquire("shared").allowed))

    async def async_callers():
        await asyncio.get_running_loop().run_in_executor(None, start.wait)
        decisions = await asyncio.gather(*(bucket.atry_acquire("shared") for _ in range(3)))
        results.extend(("async", d.allowed) for d in decisions)

    threads = [threading.Thread(target=sync_caller) for _ in range(3)]
    for thread in threads:
        thread.start()
    run(async_callers())
    for thread in threads:
        thread.join(10)
    assert len(results) == 6
    assert sum(allowed for _, allowed in results) == 5
    # and both forms now see the same empty bucket
    assert not bucket.try_acquire("shared").allowed
    assert not run(bucket.atry_acquire("shared")).allowed


def test_a_window_is_one_log_for_both_forms(redis_client):
    window = SlidingWindow(4, 60, client=redis_client)
    order = []

    async def interleave():
        for k in range(3):
            order.append(window.try_acquire("log").allowed)
            order.append((await window.atry_acquire("log")).allowed)

    run(interleave())
    assert order == [True, True, True, True, False, False]
    assert redis_client.zcard(window.redis_key("steplock", "log")[0]) == 4


def test_acquire_is_a_sync_and_an_async_context_manager_and_awaitable(redis_client):
    window = SlidingWindow(3, 5, client=redis_client)
    ran = []

    async def body():
        async with window.acquire("cm") as decision:
            ran.append(("async with", decision.remaining))
        decision = await window.acquire("cm")
        ran.append(("await", decision.remaining))
        with pytest.raises(RateLimited) as info:
            async with window.acquire("cm"):
                ran.append("never")
        return info.value

    assert isinstance(window.acquire("cm"), Admission)  # nothing decided until entered
    with window.acquire("cm") as decision:
        ran.append(("with", decision.remaining))
    denied = run(body())
    assert ran == [("with", 2.0), ("async with", 1.0), ("await", 0.0)]
    assert 4 < denied.retry_after <= 5 and denied.key.endswith(":{cm}")
    assert denied.limit == "3/5s window" and denied.option == "cluster_rate_limit"
    with pytest.raises(RateLimited):
        run(window.acquire("cm").__aenter__())


def test_using_decorates_an_async_def(redis_client):
    per_user = TokenBucket(1.0, capacity=1, client=redis_client)
    calls = []

    @per_user.using("user:{user}")
    async def fetch(user, payload=None):
        await asyncio.sleep(0)
        calls.append(user)
        return f"fetched {user}"

    assert inspect.iscoroutinefunction(fetch) and fetch.__name__ == "fetch"

    async def scenario():
        results = [await fetch("ann"), await fetch("bob")]
        with pytest.raises(RateLimited):
            await fetch("ann")
        return results

    assert run(scenario()) == ["fetched ann", "fetched bob"]
    assert calls == ["ann", "bob"]  # the denied call's body never ran
    assert redis_client.exists("steplock:rate:tb:1.0:1:{user:ann}")


def test_the_async_form_sends_the_sync_forms_signals(redis_client):
    seen = []

    def receiver(signal=None, sender=None, **fields):
        seen.append((signal.name, sender, fields))

    for signal in (signals.rate_limit_allowed, signals.rate_limited):
        signal.connect(receiver, weak=False)
    try:
        limiter = SlidingWindow(1, 5, client=redis_client)
        limiter.try_acquire("sig-sync")
        limiter.try_acquire("sig-sync")

        async def decide():
            await limiter.atry_acquire("sig-async")
            await limiter.atry_acquire("sig-async")

        run(decide())
    finally:
        for signal in (signals.rate_limit_allowed, signals.rate_limited):
            signal.disconnect(receiver)
    assert [(n, s) for n, s, _ in seen] == [
        ("rate_limit_allowed", None),
        ("rate_limited", None),
    ] * 2
    for sync, asynchronous in ((seen[0], seen[2]), (seen[1], seen[3])):
        assert sorted(sync[2]) == sorted(asynchronous[2])  # the same fields
        assert asynchronous[2]["name"] == "sig-async"
        assert asynchronous[2]["limit"] == sync[2]["limit"] == "1/5s window"
    assert 4 < seen[3][2]["retry_after"] <= 5


def test_the_loop_never_stalls_while_async_callers_decide(redis_client):
    bucket = TokenBucket(50.0, capacity=20, client=redis_client)

    async def scenario():
        # warm up: the first async call of a process imports redis.asyncio on the loop
        await bucket.atry_acquire("lag-warm-up")
        async with LagProbe() as probe:
            admitted = 0
            deadline = time.perf_counter() + 0.6
            while time.perf_counter() < deadline:
                decisions = await asyncio.gather(
                    *(bucket.atry_acquire(f"lag{k % 3}") for k in range(6))
                )
                admitted += sum(d.allowed for d in decisions)
        return probe, admitted

    probe, admitted = run(scenario())
    assert probe.ticks > 20 and admitted > 20
    assert probe.max_lag < 0.05, f"the loop stalled {probe.max_lag * 1000:.1f} ms"


@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
def test_the_outage_policy_with_redis_stopped(private_redis, policy, events):
    client = make_client(private_redis.url, socket_timeout=0.5)
    limiter = SlidingWindow(1, 60, client=client, on_store_error=policy)

    async def before():
        return (await limiter.atry_acquire("down")).allowed

    assert run(before()) is True
    private_redis.stop()
    try:

        async def during():
            return [await limiter.atry_acquire("down") for _ in range(2)]

        if policy == "fail_closed":
            with pytest.raises(LockStoreUnavailable):
                run(during())
        else:
            decisions = run(during())
            assert [(d.allowed, d.now) for d in decisions] == [(True, 0.0)] * 2
        outages = [kw for name, kw in events if name == "lock_store_error"]
        assert outages and outages[0]["policy"] == policy
        assert outages[0]["reason"].startswith("rate limit: ")
        assert outages[0]["key"] == "steplock:rate:sw:1:60.0:{down}"
    finally:
        private_redis.restart()
    # back (a fresh server, without the old log): the async form decides again
    assert [run(before()), run(before())] == [True, False]
    client.close()


def test_a_dead_client_fails_closed_by_default_and_open_when_asked():
    from tests.helpers import closed_port_url

    dead = make_client(closed_port_url())
    with pytest.raises(LockStoreUnavailable):
        run(SlidingWindow(1, 1, client=dead).atry_acquire("down"))
    opened = SlidingWindow(1, 1, client=dead, on_store_error="fail_open")

    async def three():
        return [(await opened.atry_acquire("down")).allowed for _ in range(3)]

    assert run(three()) == [True] * 3


def test_the_apps_store_serves_both_forms(app, redis_client):
    """Without a client: the app's lease store (its prefix), its asyncio twin for the
    async form: one limit."""
    limiter = TokenBucket(1 / (7 * 24 * 3600.0), capacity=2)
    assert limiter.try_acquire("app-key", app=app).allowed

    async def two():
        return [(await limiter.atry_acquire("app-key", app=app)).allowed for _ in range(2)]

    assert run(two()) == [True, False]
    assert not limiter.try_acquire("app-key", app=app).allowed
