"""Mixed sync and async holders (issue 27): a real ``celery worker`` (prefork, its tasks in
tests/aio/mixed_tasks.py) and an asyncio loop in this process contend at the same time on
one lease, one rate limit, one concurrency slot set, one circuit breaker and one
idempotency key, on one redis-server; each test asserts the invariant with the figures
both sides recorded in Redis (``TIME`` seconds), read back here:

1. one lease name: at most one holder at a time across both sides, every body ran,
   fencing tokens strictly increasing in acquisition order;
2. one sliding window of N per minute: the worker's gate and the async callers together
   admitted exactly N;
3. one ``ConcurrencyLimit(2)``: the loop holding both slots refuses the worker's task and
   the worker's two tasks refuse the loop; then, contending, never more than 2 holders at
   once across both sides;
4. one breaker name: failures counted by either side open it for the other (and failures
   of both sides add up to the threshold);
5. one idempotency key, whichever side starts first: the body ran once; every other
   caller got the replay or IdempotencyInProgress.

Each side alone would exceed the figure asserted (K > 1 holders of the lease, more than N
callers of the limit, 2 worker processes and 6 coroutines for 2 slots), so a figure held
shows one shared state. The pattern objects of the two sides are distinct objects built
with equal arguments (the workers' on Celery's current app, ours on the test app).
"""

import asyncio
import json
import time

import pytest

from tests.aio import mixed_tasks as tasks

pytestmark = [
    pytest.mark.workers,
    pytest.mark.no_database,  # Redis-side subject: runs once, in the common pass
    pytest.mark.django_db(transaction=True),  # the workers' result backend
]

INCLUDE = ("-I", "tests.aio.mixed_tasks")


def _worker(start_worker, name, concurrency=2, **env):
    return start_worker(name=name, concurrency=concurrency, extra_args=INCLUDE, MX_WORKER=1, **env)


def _wait(predicate, what, timeout=45.0):
    from tests.support.processes import wait_until

    return wait_until(predicate, timeout, 0.05, what)


def max_overlap(intervals):
    """The most ``(start, end)`` intervals open at one instant (touching ones do not
    overlap: an end at the instant of a start closes first)."""
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, 0) for _, e in intervals])
    open_now = peak = 0
    for _, opening in edges:
        open_now += 1 if opening else -1
        peak = max(peak, open_now)
    return peak


def _runs(redis_client, what):
    return [json.loads(x) for x in redis_client.lrange(f"mx:runs:{what}", 0, -1)]


def _gauge(redis_client, what):
    return [int(x) for x in redis_client.lrange(f"mx:gauge:{what}", 0, -1)]


class Recorder:
    """The async side's twin of ``mixed_tasks.held``, on ``redis.asyncio``."""

    def __init__(self, url):
        import redis.asyncio as aredis

        self.r = aredis.Redis.from_url(url, decode_responses=True)

    async def now(self):
        seconds, micros = await self.r.time()
        return seconds + micros / 1e6

    async def held(self, what, n, fence, key, seconds):
        await self.r.rpush(f"mx:gauge:{what}", await self.r.incr(f"mx:in:{what}"))
        count = int(await self.r.get(f"mx:count:{what}") or 0)
        start = await self.now()
        await asyncio.sleep(seconds)
        end = await self.now()
        await self.r.set(f"mx:count:{what}", count + 1)
        await self.r.decr(f"mx:in:{what}")
        await self.r.rpush(f"mx:runs:{what}", json.dumps(["async", n, start, end, fence, key]))

    async def until(self, key, count=1, timeout=30.0):
        """Wait (on the loop) until the list ``key`` holds ``count`` items: the worker's
        side has begun, so what the loop does next contends with it."""
        deadline = time.monotonic() + timeout
        while await self.r.llen(key) < count:
            assert time.monotonic() < deadline, f"{key} stayed under {count} items"
            await asyncio.sleep(0.01)

    async def close(self):
        await self.r.aclose()


def time_together(first, second):
    """Seconds during which at least one interval of ``first`` and one of ``second`` were
    open at once."""
    edges = sorted(
        [(s, 1, 0) for s, _ in first]
        + [(e, 0, 0) for _, e in first]
        + [(s, 1, 1) for s, _ in second]
        + [(e, 0, 1) for _, e in second]
    )
    open_now, total, since = [0, 0], 0.0, None
    for at, opening, side in edges:
        if since is not None:
            total += at - since
        open_now[side] += 1 if opening else -1
        since = at if all(open_now) else None
    return total


def _switches(sides):
    return sum(1 for a, b in zip(sides, sides[1:]) if a != b)


# -- 1. one lease ---------------------------------------------------------------------------


def test_one_lease_one_holder_at_a_time_across_worker_and_loop(
    start_worker, redis_client, redis_server_url, app
):
    from celery_steplock.aio.lock import get_async_lease_store

    K, BODY = 6, 0.1
    _worker(start_worker, "mxl")  # two processes: two worker holders wait at once
    began = time.monotonic()
    for n in range(K):
        tasks.leased.delay(n, BODY)

    async def main():
        rec = Recorder(redis_server_url)
        store = get_async_lease_store(app)

        async def holder(n):
            await asyncio.sleep(0.02 * n)
            async with store.lease(tasks.LEASE, ttl=5.0, wait=30.0) as lease:
                await rec.held("lease", n, lease.fence, lease.key, BODY)

        try:
            # Once a worker task holds the lease (the other process waits for it), the K
            # holders of the loop arrive: all wait on one lease from then on.
            await rec.until("mx:gauge:lease")
            await asyncio.gather(*(holder(n) for n in range(K)))
        finally:
            await rec.close()
        return store.key(tasks.LEASE)

    key = asyncio.run(main())
    _wait(lambda: redis_client.llen("mx:runs:lease") == 2 * K, "every lease body")
    elapsed = time.monotonic() - began
    runs = _runs(redis_client, "lease")  # pushed inside the lease: acquisition order
    sides = [r[0] for r in runs]
    assert sorted(r[1] for r in runs if r[0] == "worker") == list(range(K))
    assert sorted(r[1] for r in runs if r[0] == "async") == list(range(K))
    assert {r[5] for r in runs} == {key}  # one lease key for both sides
    assert max(_gauge(redis_client, "lease")) == 1
    assert redis_client.get("mx:count:lease") == str(2 * K)  # no update lost
    assert max_overlap([(r[2], r[3]) for r in runs]) == 1
    fences = [r[4] for r in runs]
    assert all(a < b for a, b in zip(fences, fences[1:])), fences  # strictly increasing
    assert not redis_client.exists(key)  # released by the last holder
    print(
        f"one lease: {2 * K} bodies ({K} worker, {K} async), shared counter "
        f"{redis_client.get('mx:count:lease')}, max concurrency "
        f"{max(_gauge(redis_client, 'lease'))}, fences {fences[0]}..{fences[-1]} strictly "
        f"increasing, {_switches(sides)} worker/async hand-overs, {elapsed:.2f} s"
    )
    assert _switches(sides) >= 2  # the two sides interleaved: they contended


# -- 2. one rate limit -------------------------------------------------------------------------


def test_one_rate_limit_admits_exactly_n_across_worker_and_loop(start_worker, redis_client, app):
    from celery_steplock.exceptions import RateLimited
    from celery_steplock.patterns.ratelimit import SlidingWindow

    M, A = 8, 8  # each side alone asks for more than the limit
    _worker(start_worker, "mxr")
    limiter = SlidingWindow(tasks.RATE_LIMIT, tasks.RATE_WINDOW, key=tasks.RATE_KEY, app=app)
    for n in range(M):
        tasks.rated.delay(n)

    async def main():
        rec = Recorder(app.conf.steplock_redis_url)
        try:
            await rec.until("mx:rate:worker")  # the worker decides: contend now
        finally:
            await rec.close()

        async def caller(n):
            await asyncio.sleep(0.01 * n)
            if n % 2:
                decision = await limiter.atry_acquire(tasks.RATE_KEY)
                return bool(decision.allowed), decision.key
            try:
                async with limiter.acquire(tasks.RATE_KEY) as decision:
                    return True, decision.key
            except RateLimited as exc:
                return False, exc.key

        return await asyncio.gather(*(caller(n) for n in range(A)))

    mine = asyncio.run(main())
    _wait(lambda: redis_client.llen("mx:rate:worker") >= M, "the worker's first decisions")
    time.sleep(0.2)  # nothing more comes: the denied tasks' turns are a minute away
    theirs = [json.loads(x) for x in redis_client.lrange("mx:rate:worker", 0, -1)]
    assert len(theirs) == M
    key = limiter.redis_key("steplock", tasks.RATE_KEY)[0]
    assert {k for _, k in mine} == {k for _, _, k in theirs} == {key}  # one limit
    admitted_async = sum(1 for ok, _ in mine if ok)
    admitted_worker = sum(1 for outcome, _, _ in theirs if outcome == "allowed")
    bodies = redis_client.llen("mx:rate:bodies")
    print(
        f"one rate limit ({tasks.RATE_LIMIT}/{tasks.RATE_WINDOW:g}s): {M + A} asked, "
        f"admitted {admitted_worker} worker + {admitted_async} async = "
        f"{admitted_worker + admitted_async}"
    )
    assert admitted_worker + admitted_async == tasks.RATE_LIMIT
    assert bodies == admitted_worker  # a denied task did not run
    assert redis_client.zcard(key) == tasks.RATE_LIMIT  # the window's log of grants
    # A later caller of either form is still refused: the window is full for both.
    assert not asyncio.run(limiter.atry_acquire(tasks.RATE_KEY)).allowed
    assert not limiter.try_acquire(tasks.RATE_KEY).allowed


# -- 3. one concurrency limit -------------------------------------------------------------------


def test_one_concurrency_limit_never_more_than_two_across_worker_and_loop(
    start_worker, redis_client, redis_server_url, app
):
    from celery_steplock.exceptions import ConcurrencyLimited
    from celery_steplock.keys import slot_key
    from celery_steplock.patterns.concurrency import ConcurrencyLimit

    W, A, BODY = 6, 6, 0.25
    _worker(start_worker, "mxc")  # two processes: two worker holders at once
    limit = ConcurrencyLimit(tasks.SLOTS)

    async def each_refused_by_the_other():
        rec = Recorder(redis_server_url)
        try:
            # The loop holds every slot: the worker's task is refused, and runs once they
            # are given back.
            mine = [await limit.aacquire(tasks.SLOTS_KEY, app=app) for _ in range(tasks.SLOTS)]
            await asyncio.to_thread(tasks.slotted.delay, 100, 0.05, "slots-x")
            await rec.until("mx:slots:refused")
            refused = json.loads(await rec.r.lindex("mx:slots:refused", 0))
            early = await rec.r.llen("mx:runs:slots-x")
            for slot in mine:
                await slot.arelease()
            await rec.until("mx:runs:slots-x")
            # The worker's two tasks hold every slot: the loop is refused.
            await asyncio.to_thread(
                lambda: [tasks.slotted.delay(n, 1.0, "slots-y") for n in (101, 102)]
            )
            await rec.until("mx:gauge:slots-y", 2)
            holding = await rec.r.get("mx:in:slots-y")
            with pytest.raises(ConcurrencyLimited) as here:
                async with limit.acquire(tasks.SLOTS_KEY, app=app):
                    raise AssertionError("a third holder")
            await rec.until("mx:runs:slots-y", 2)
            return refused[1], early, holding, here.value.retry_after
        finally:
            await rec.close()

    free, early, holding, retry_after = asyncio.run(each_refused_by_the_other())
    assert (free, early) == (0, 0)  # the worker met no free slot, and waited
    assert holding == "2" and retry_after > 0  # the loop met the worker's two holders
    redis_client.delete("mx:slots:refused")
    print(
        "one concurrency limit: the loop holding both slots -> the worker's task refused "
        f"(free {free}), ran after; the worker holding both -> the loop refused "
        f"(ConcurrencyLimited, retry_after {retry_after:.2f} s)"
    )

    for n in range(W):  # bodies of unequal lengths: the holders do not move in pairs
        tasks.slotted.delay(n, BODY - 0.1 if n % 2 else BODY + 0.1)

    async def main():
        rec = Recorder(redis_server_url)

        async def holder(n):
            await asyncio.sleep(0.05 * n)
            async with limit.acquire(tasks.SLOTS_KEY, app=app, wait=30.0) as slot:
                await rec.held("slots", n, slot.fence, slot.lease.key, BODY + 0.05 * (n % 3))

        try:
            await rec.until("mx:gauge:slots")  # a worker task holds a slot: contend now
            await asyncio.gather(*(holder(n) for n in range(A)))
        finally:
            await rec.close()

    asyncio.run(main())
    _wait(lambda: redis_client.llen("mx:runs:slots") == W + A, "every slotted body", 60)
    runs = _runs(redis_client, "slots")
    worker = [r for r in runs if r[0] == "worker"]
    mine = [r for r in runs if r[0] == "async"]
    assert sorted(r[1] for r in worker) == list(range(W))
    assert sorted(r[1] for r in mine) == list(range(A))
    slots = {slot_key("steplock", tasks.SLOTS_KEY, i) for i in range(tasks.SLOTS)}
    assert {r[5] for r in worker} <= slots and {r[5] for r in mine} <= slots
    observed = max_overlap([(r[2], r[3]) for r in runs])
    gauge = max(_gauge(redis_client, "slots"))
    # The two sides ran in one stretch of time (contending), not one after the other.
    together = min(max(r[3] for r in worker), max(r[3] for r in mine)) - max(
        min(r[2] for r in worker), min(r[2] for r in mine)
    )
    per_side = (
        max_overlap([(r[2], r[3]) for r in worker]),
        max_overlap([(r[2], r[3]) for r in mine]),
    )
    both = time_together([(r[2], r[3]) for r in worker], [(r[2], r[3]) for r in mine])
    # The worker's refusals with every slot held (``free`` 0 in the script's reply) while
    # the worker's own tasks held fewer than all: the loop's holders held the others, so the
    # worker counted them as its own limit's.
    refused = [json.loads(x) for x in redis_client.lrange("mx:slots:refused", 0, -1)]

    def holding(side, t):
        return sum(r[2] < t < r[3] for r in side)

    by_loop = [
        t
        for t, free in refused
        if free == 0 and holding(worker, t) < tasks.SLOTS and holding(mine, t) >= 1
    ]
    print(
        f"one concurrency limit ({tasks.SLOTS}): {W} worker + {A} async bodies, at most "
        f"{observed} at once (gauge {gauge}); per side {per_side}; a worker and an async "
        f"holder held slots together for {both:.2f} s; sides' spans overlapped "
        f"{together:.2f} s; fences distinct: {len({r[4] for r in runs})}; worker refused "
        f"{len(refused)} times, {len(by_loop)} with all slots held, some by the loop; "
        f"the unguarded read-modify-write counter kept {redis_client.get('mx:count:slots')} "
        f"of {W + A} (2 holders at once lose updates)"
    )
    assert observed <= tasks.SLOTS and gauge <= tasks.SLOTS
    assert together > 0
    assert len({r[4] for r in runs}) == W + A  # one grant each
    assert not any(redis_client.exists(k) for k in slots)  # all released


# -- 4. one breaker ------------------------------------------------------------------------------


def test_one_breaker_opened_by_either_side_refuses_the_other(start_worker, redis_client, app):
    from celery_steplock.exceptions import CircuitOpen
    from celery_steplock.patterns.breaker import CircuitBreaker

    _worker(start_worker, "mxb")
    redis_client.set("mx:mode", "fail")

    async def failing(label):
        import redis.asyncio as aredis

        r = aredis.Redis.from_url(app.conf.steplock_redis_url, decode_responses=True)
        try:
            await r.incr(f"mx:calls:{label}")
        finally:
            await r.aclose()
        raise ConnectionError("the dependency is down")

    # (a) Async failures open it; the worker's next call is refused.
    opened = CircuitBreaker("mx-brk-a", app=app, **tasks.BREAKER)

    async def open_it():
        outcomes = []
        for _ in range(3):
            try:
                await opened.acall(failing, "mx-brk-a")
            except ConnectionError as exc:
                outcomes.append(type(exc).__name__)
        return outcomes, (await opened.astate()).state

    assert asyncio.run(open_it()) == (["ConnectionError"] * 3, "open")
    refused = tasks.through_breaker.delay("mx-brk-a").get(timeout=30)
    assert refused == {"refused": "CircuitOpen", "state": "open"}
    assert redis_client.get("mx:calls:mx-brk-a") == "3"  # the worker never called it

    # (b) Failures of both sides, at the same time, add up: 2 async + 1 worker = the
    # threshold of 3, which neither side reached alone; then both are refused.
    mixed = CircuitBreaker("mx-brk-mix", app=app, **tasks.BREAKER)

    async def both():
        async def one():
            try:
                await mixed.acall(failing, "mx-brk-mix")
            except ConnectionError:
                return "failed"

        worker_call = tasks.through_breaker.delay("mx-brk-mix")
        mine = await asyncio.gather(one(), one())
        theirs = await asyncio.to_thread(worker_call.get, timeout=30)
        return mine, theirs

    mine, theirs = asyncio.run(both())
    assert mine == ["failed", "failed"] and theirs == {"failed": "the dependency is down"}
    assert redis_client.get("mx:calls:mx-brk-mix") == "3"
    assert mixed.state().state == "open"
    assert tasks.through_breaker.delay("mx-brk-mix").get(timeout=30)["refused"] == "CircuitOpen"

    async def refused_here(breaker, label):
        with pytest.raises(CircuitOpen) as first:
            await breaker.acall(failing, label)
        with pytest.raises(CircuitOpen):
            async with breaker:
                raise AssertionError("admitted while open")
        return first.value.context["state"]

    assert asyncio.run(refused_here(mixed, "mx-brk-mix")) == "open"
    assert redis_client.get("mx:calls:mx-brk-mix") == "3"

    # (c) The worker's gated task (``circuit_breaker=``) opens it; the async caller is
    # refused.
    gated = CircuitBreaker("mx-brk-gate", app=app, **tasks.BREAKER)
    results = [tasks.gated_breaker.delay(n) for n in range(3)]
    _wait(lambda: all(r.state == "FAILURE" for r in results), "three gated failures")
    assert redis_client.get("mx:calls:mx-brk-gate") == "3"
    assert asyncio.run(refused_here(gated, "mx-brk-gate")) == "open"
    assert redis_client.get("mx:calls:mx-brk-gate") == "3"  # the async side never called it
    later = tasks.gated_breaker.delay(3)
    _wait(lambda: redis_client.llen("mx:rejected:mx-brk-gate") >= 1, "the gate's refusal")
    assert later.state == "PENDING"  # re-queued, never ran
    assert redis_client.get("mx:calls:mx-brk-gate") == "3"
    print(
        "one breaker: 3 async failures -> worker refused (CircuitOpen); 2 async + 1 worker "
        "failures -> open for both; 3 worker (gate) failures -> async refused"
    )


# -- 5. one idempotency key -------------------------------------------------------------------


@pytest.mark.parametrize("first", ["worker", "async"])
def test_one_idempotency_key_runs_the_body_once_across_worker_and_loop(
    first, start_worker, redis_client, redis_server_url, app
):
    """``first``: the side whose body starts first (the other side's calls come while it
    runs, then once more after it ended)."""
    import os

    from celery_steplock.exceptions import IdempotencyInProgress
    from celery_steplock.patterns.idempotency import idempotent

    ORDER, AMOUNT, W, A = 7, 10, 3, 4
    _worker(start_worker, "mxi", MX_IDEM_SLEEP=1.0)

    @idempotent(key=tasks.IDEM_KEY, namespace="mx.charge", app=app)  # the task's record
    async def charge(order, amount):
        import redis.asyncio as aredis

        r = aredis.Redis.from_url(redis_server_url, decode_responses=True)
        try:
            await r.incr(f"mx:idem:starts:{order}")
            await r.rpush(f"mx:idem:began:{order}", "async")
            await asyncio.sleep(1.0)
            await r.incr(f"mx:idem:done:{order}")
        finally:
            await r.aclose()
        return {"order": order, "charged": amount, "by": "async", "pid": os.getpid()}

    async def main():
        rec = Recorder(redis_server_url)

        async def caller(n):
            await asyncio.sleep(0.1 * n)
            try:
                return await charge(ORDER, AMOUNT)
            except IdempotencyInProgress as exc:
                return ("in progress", exc.retry_after)

        def send():
            return [tasks.charge.delay(ORDER, AMOUNT) for _ in range(W)]

        try:
            if first == "worker":
                results = await asyncio.to_thread(send)
                await rec.until(f"mx:idem:began:{ORDER}")  # the worker's body runs
                mine = await asyncio.gather(*(caller(n) for n in range(A)))
            else:
                calls = [asyncio.ensure_future(caller(n)) for n in range(A)]
                await rec.until(f"mx:idem:began:{ORDER}")  # our body runs
                results = await asyncio.to_thread(send)
                mine = await asyncio.gather(*calls)
        finally:
            await rec.close()
        return results, mine

    results, mine = asyncio.run(main())
    values = [r.get(timeout=45) for r in results]
    winner = values[0]
    assert winner["by"] == first and winner["charged"] == AMOUNT
    assert all(v == winner for v in values)  # every worker task: the one result
    assert redis_client.lrange(f"mx:idem:began:{ORDER}", 0, -1) == [first]  # one body ran
    assert redis_client.get(f"mx:idem:done:{ORDER}") == "1"
    replayed = [v for v in mine if isinstance(v, dict)]
    waiting = [v for v in mine if isinstance(v, tuple)]
    assert all(v == winner for v in replayed)
    assert all(v[0] == "in progress" and v[1] > 0 for v in waiting)
    if first == "worker":
        assert waiting  # the loop's first call met the worker's record locked
    assert len(replayed) + len(waiting) == A
    # After it ended, both forms get the replay.
    assert asyncio.run(charge(ORDER, AMOUNT)) == winner
    assert tasks.charge.delay(ORDER, AMOUNT).get(timeout=30) == winner
    assert redis_client.get(f"mx:idem:starts:{ORDER}") == "1"
    records = list(redis_client.scan_iter("steplock:idem:*"))
    assert len(records) == 1 and redis_client.hget(records[0], "status") == "completed"
    print(
        f"one idempotency key ({first} first): 1 body run (by the {winner['by']}) for "
        f"{W + 1} worker tasks and {A + 1} async calls; the loop saw {len(replayed)} "
        f"replays, {len(waiting)} IdempotencyInProgress"
    )
