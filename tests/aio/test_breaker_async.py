"""The circuit breaker's async form (celery_steplock.patterns.breaker: ``aadmit``, ``acall``,
``@breaker`` on ``async def``, ``async with``, ``astate``) against a real redis-server: one
Redis state shared with the sync form (a breaker tripped by async callers refuses sync ones,
and the other way), the cluster-wide half-open probe among async and sync callers at once,
the outage policy with Redis stopped. The sync suite is tests/patterns/test_breaker*.py."""

import asyncio
import inspect
import threading
import time

import pytest

from celery_steplock.exceptions import CircuitOpen, LockStoreUnavailable
from celery_steplock.lock import make_client
from celery_steplock.patterns.breaker import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    AdmittedCall,
)
from tests.patterns.test_breaker import fail, make  # the sync suite's breakers
from tests.support.busy import keep_busy

pytestmark = [
    pytest.mark.no_database,  # runs once, in the SQLite pass
    pytest.mark.usefixtures("no_cached_breaker_states"),
]


class Dependency:
    """An async dependency that fails with ``error`` (None: answers "ok"), counting calls."""

    def __init__(self, error=None):
        self.error = error
        self.calls = 0

    async def __call__(self, *args):
        self.calls += 1
        await asyncio.sleep(0)
        if self.error is not None:
            raise self.error
        return "ok"


@pytest.fixture
def other_client(redis_server_url):
    """A second client on the same Redis: its breakers share no process cache with
    ``redis_client``'s, only Redis."""
    client = make_client(redis_server_url)
    yield client
    client.close()


def trip(breaker):
    """Three failures through ``breaker``'s sync form: it opens (the threshold is 3)."""
    for _ in range(3):
        with pytest.raises(ConnectionError):
            breaker.call(fail)


async def atrip(breaker):
    """Three failures through ``breaker``'s async form: it opens."""
    for _ in range(3):
        with pytest.raises(ConnectionError):
            await breaker.acall(Dependency(ConnectionError("down")))


def test_the_decorator_of_an_async_def_is_a_coroutine_function(redis_client):
    breaker = make(redis_client)

    @breaker
    async def fetch(x):
        return x * 2

    assert inspect.iscoroutinefunction(fetch) and fetch.__name__ == "fetch"
    assert asyncio.run(fetch(21)) == 42
    # call() of a coroutine function hands back acall()'s coroutine
    assert asyncio.run(breaker.call(fetch, 4)) == 8


def test_async_failures_trip_the_breaker_and_another_object_refuses_a_sync_caller(
    redis_client, other_client
):
    dependency = Dependency(ConnectionError("down"))
    guarded = make(redis_client)(dependency)

    async def main():
        for _ in range(3):
            with pytest.raises(ConnectionError):
                await guarded()
        with pytest.raises(CircuitOpen) as refused:
            await guarded()
        return refused.value

    refusal = asyncio.run(main())
    assert dependency.calls == 3  # the 4th was refused without calling it
    assert refusal.context["state"] == OPEN and 0 < refusal.retry_after <= 0.3
    # The same breaker (name, prefix) as another object, on another client: Redis says OPEN.
    sync_breaker = make(other_client)
    called = []
    with pytest.raises(CircuitOpen):
        sync_breaker.call(called.append, 1)
    assert called == []
    state = sync_breaker.state()
    assert (state.state, state.forced, state.generation) == (OPEN, False, 1)


def test_sync_failures_trip_the_breaker_and_another_object_refuses_async_callers(
    redis_client, other_client
):
    sync_breaker = make(redis_client)
    trip(sync_breaker)
    async_breaker = make(other_client)
    dependency = Dependency()

    async def main():
        refused = []
        for attempt in (
            lambda: async_breaker.acall(dependency),
            lambda: make(other_client)(dependency)(),
            async_breaker.aadmit,
        ):
            with pytest.raises(CircuitOpen) as info:
                await attempt()
            refused.append(info.value.context["state"])
        with pytest.raises(CircuitOpen):
            async with async_breaker:
                await dependency()
        return refused, await async_breaker.astate()

    refused, state = asyncio.run(main())
    assert refused == [OPEN, OPEN, OPEN] and dependency.calls == 0
    assert (state.state, state.forced, state.generation) == (OPEN, False, 1)


def test_async_with_records_the_outcome_and_a_cancellation_records_nothing(redis_client):
    breaker = make(redis_client, failure_threshold=2, window=2, state_cache=0)

    async def main():
        async with breaker as ticket:
            assert isinstance(ticket, AdmittedCall)
        with pytest.raises(ConnectionError):
            async with breaker:
                raise ConnectionError("down")
        after_one = await breaker.astate()
        with pytest.raises(asyncio.CancelledError):
            async with breaker:
                raise asyncio.CancelledError()
        task = asyncio.ensure_future(breaker.acall(asyncio.sleep, 10))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return after_one, await breaker.astate()

    after_one, after_cancels = asyncio.run(main())
    assert (after_one.state, after_one.failures) == (CLOSED, 1)
    # The cancellations were neither failures nor successes: the window is as it was.
    assert (after_cancels.state, after_cancels.failures, after_cancels.calls) == (
        CLOSED,
        1,
        after_one.calls,
    )


def test_an_async_ticket_records_through_the_asyncio_client(redis_client, other_client):
    breaker = make(redis_client, state_cache=0)

    async def main():
        for _ in range(3):
            ticket = await breaker.aadmit()
            await ticket.afailure(ConnectionError("down"))
            await ticket.afailure()  # once only
        return await breaker.astate()

    state = asyncio.run(main())
    assert (state.state, state.generation) == (OPEN, 1)
    assert make(other_client).state().state == OPEN


def test_half_open_admits_one_probe_among_async_and_sync_callers_at_once(
    redis_client, other_client
):
    opener = make(redis_client, recovery_timeout=0.3, probe_timeout=5)
    trip(opener)
    time.sleep(0.35)  # past the recovery time: the next admissions ask Redis for a probe
    async_breaker = make(redis_client, recovery_timeout=0.3, probe_timeout=5)
    sync_breakers = [make(other_client, recovery_timeout=0.3, probe_timeout=5) for _ in range(4)]
    start = threading.Barrier(len(sync_breakers) + 1)
    outcomes: list = []

    def sync_caller(breaker):
        start.wait()
        try:
            outcomes.append(("sync", breaker.admit()))
        except CircuitOpen as exc:
            outcomes.append(("sync", exc))

    threads = [threading.Thread(target=sync_caller, args=(b,)) for b in sync_breakers]
    for thread in threads:
        thread.start()

    async def main():
        start.wait()
        results = await asyncio.gather(
            *(async_breaker.aadmit() for _ in range(16)), return_exceptions=True
        )
        outcomes.extend(("async", result) for result in results)

    asyncio.run(main())
    for thread in threads:
        thread.join()
    assert len(outcomes) == 20
    admitted = [(form, o) for form, o in outcomes if isinstance(o, AdmittedCall)]
    refused = [o for _, o in outcomes if isinstance(o, CircuitOpen)]
    assert len(admitted) == 1 and len(refused) == 19
    assert admitted[0][1].probe is True
    assert {r.context["state"] for r in refused} == {HALF_OPEN}
    assert opener.state().probes == 1
    form, probe = admitted[0]
    if form == "async":
        asyncio.run(probe.asuccess())
    else:
        probe.success()
    state = opener.state()
    assert (state.state, state.probes) == (CLOSED, 0)


def test_a_released_async_probe_frees_its_permit(redis_client):
    breaker = make(redis_client, recovery_timeout=0.2, probe_timeout=5, state_cache=0)

    async def main():
        await atrip(breaker)
        await asyncio.sleep(0.25)
        probe = await breaker.aadmit()
        with pytest.raises(CircuitOpen):
            await breaker.aadmit()
        held = (await breaker.astate()).probes
        await probe.arelease()
        return probe.probe, held, await breaker.astate()

    was_probe, held, state = asyncio.run(main())
    assert was_probe and held == 1
    assert (state.state, state.probes) == (HALF_OPEN, 0)


def test_astate_writes_the_successes_sync_callers_counted(redis_client):
    # One process cache for sync and async callers: successes counted by sync calls admitted
    # from the cache are written by the async read, a failure then counts beside them.
    breaker = make(redis_client, failure_threshold=0.5, window=4, minimum_calls=4)
    breaker.call(lambda: None)  # the first admission asks Redis and fills the cache
    for _ in range(3):
        breaker.call(lambda: None)  # admitted from the cache, counted there

    state = asyncio.run(breaker.astate())
    assert (state.state, state.calls, state.failures) == (CLOSED, 4, 0)


def test_aoverride_is_seen_by_sync_callers_of_the_process(redis_client):
    breaker = make(redis_client)
    assert breaker.call(lambda: "through") == "through"  # CLOSED, cached
    assert asyncio.run(breaker.aoverride("open")) == (CLOSED, False)
    with pytest.raises(CircuitOpen) as info:
        breaker.call(lambda: "never")
    assert info.value.context["forced"] is True
    assert asyncio.run(breaker.aoverride("close")) == (OPEN, True)
    assert asyncio.run(breaker.acall(Dependency())) == "ok"


def test_outage_policy_with_redis_stopped(private_redis, events):
    client = make_client(private_redis.url, socket_timeout=0.5)
    closed_breaker = make(client, name="down", state_cache=0)
    open_breaker = make(client, name="down", state_cache=0, on_store_error="fail_open")
    assert asyncio.run(closed_breaker.acall(Dependency())) == "ok"  # Redis up
    private_redis.stop()
    dependency = Dependency()

    async def main():
        with pytest.raises(LockStoreUnavailable):
            await closed_breaker.acall(dependency)
        calls_closed = dependency.calls
        through = await open_breaker.acall(dependency)
        ticket = await open_breaker.aadmit()
        await ticket.afailure(ConnectionError())  # unguarded: nothing to write, no error
        guarded = AdmittedCall(closed_breaker, 1, "", False)
        await guarded.afailure(ConnectionError())  # the write fails: logged, never raised
        with pytest.raises(LockStoreUnavailable):
            await closed_breaker.astate()
        return calls_closed, through, ticket.guarded

    calls_closed, through, guarded = asyncio.run(main())
    client.close()
    assert calls_closed == 0  # fail closed: the dependency is not called
    assert through == "ok" and dependency.calls == 1 and guarded is False
    outages = [kw for name, kw in events if name == "lock_store_error"]
    assert [kw["policy"] for kw in outages] == ["fail_closed", "fail_open", "fail_open"]
    assert all(kw["name"] == "down" and "circuit breaker" in kw["reason"] for kw in outages)


def evalshas(client):
    return client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)


def test_the_async_form_sends_the_commands_the_sync_form_sends(redis_client):
    # Server-side figures: one EVALSHA per admission asked of Redis and per written outcome,
    # none for what the process cache decides, whichever the form.
    def sequence(name, state_cache):
        return make(
            redis_client, name=name, failure_threshold=0.5, window=50, state_cache=state_cache
        )

    def sync_run(breaker):
        for i in range(30):
            try:
                breaker.call(
                    lambda: (_ for _ in ()).throw(ConnectionError()) if i % 10 == 9 else 1
                )
            except ConnectionError:
                pass
        breaker.state()

    async def async_run(breaker):
        async def attempt(i):
            if i % 10 == 9:
                raise ConnectionError()

        for i in range(30):
            try:
                await breaker.acall(attempt, i)
            except ConnectionError:
                pass
        await breaker.astate()

    sync_run(sequence("warm-up", 0))  # the scripts loaded (NOSCRIPT then EVALSHA again)
    sent = {}
    for state_cache in (0, 1.0):
        for form in ("sync", "async"):
            breaker = sequence(f"{form}-{state_cache}", state_cache)
            before = evalshas(redis_client)
            if form == "sync":
                sync_run(breaker)
            else:
                asyncio.run(async_run(breaker))
            sent[(form, state_cache)] = evalshas(redis_client) - before
    # no cache: 30 admissions + 30 outcomes + 1 read; cache: 1 admission + 3 failures + 1 read
    assert sent == {("sync", 0): 61, ("async", 0): 61, ("sync", 1.0): 5, ("async", 1.0): 5}


def test_a_cancelled_probe_gives_its_permit_back(redis_client):
    breaker = make(redis_client, recovery_timeout=0.2, probe_timeout=30, state_cache=0)

    async def main():
        await atrip(breaker)
        await asyncio.sleep(0.25)
        task = asyncio.ensure_future(breaker.acall(asyncio.sleep, 10))
        await asyncio.sleep(0.05)
        held = await breaker.astate()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return held, await breaker.astate(), await breaker.acall(Dependency())

    held, after, probe_result = asyncio.run(main())
    assert (held.state, held.probes) == (HALF_OPEN, 1)
    assert (after.state, after.probes) == (HALF_OPEN, 0)  # not a failure: no new opening
    assert probe_result == "ok"  # the next caller is the probe, at once


# -- an admission cancelled while its reply is in flight -----------------------------------------


async def _until(predicate, what: str, timeout: float = 10.0) -> float:
    """Seconds until ``predicate()`` holds; fails naming ``what`` after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)
    return time.monotonic() - start


async def _reply_lost(url, admission):
    """Run ``admission`` (an ``aadmit()`` coroutine) while Redis is busy (:func:`keep_busy`):
    its script is sent but not read yet; cancel it there (CancelledError at once), then let
    Redis go on: the script runs, its reply going to nobody."""
    thread = keep_busy(url, 1.0)
    task = asyncio.create_task(admission)
    await asyncio.sleep(0.1)  # the script is written to the socket; Redis reads nothing yet
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.to_thread(thread.join)


def _calls(redis_client, command) -> int:
    """Calls of ``command`` Redis served (INFO commandstats)."""
    return redis_client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)


def test_a_probe_admission_cancelled_with_its_reply_in_flight_gives_the_permit_back(
    redis_client, redis_server_url
):
    # Half-open: the admission script grants the cancelled call the one probe permit, its
    # reply going to nobody. Before the fix the permit was held for probe_timeout (30 s).
    breaker = make(redis_client, recovery_timeout=0.2, probe_timeout=30, state_cache=0)
    probes = breaker._keys("t")[1]

    async def main():
        await atrip(breaker)
        await asyncio.sleep(0.25)  # past the recovery time: the next admission is a probe
        fired, removed = _calls(redis_client, "evalsha"), _calls(redis_client, "zrem")
        await _reply_lost(redis_server_url, breaker.aadmit())
        # the admission ran (it took the permit), then the permit was given back
        await _until(lambda: _calls(redis_client, "evalsha") > fired, "the admission")
        freed = await _until(lambda: redis_client.zcard(probes) == 0, "the permit back", 2.0)
        assert _calls(redis_client, "evalsha") == fired + 1
        assert _calls(redis_client, "zrem") == removed + 1  # the give-back
        state = await breaker.astate()
        probe = await breaker.aadmit()  # the next caller probes at once
        await probe.asuccess()
        return freed, state, await breaker.astate()

    freed, state, after = asyncio.run(main())
    assert freed < 2.0
    assert (state.state, state.probes) == (HALF_OPEN, 0)  # given back, not a failure
    assert after.state == CLOSED


def test_a_cancelled_admission_never_gives_back_another_callers_permit(
    redis_client, redis_server_url
):
    # A's aadmit completed (A holds a probe permit). B's admission, cancelled in flight,
    # is refused (one probe allowed), or granted its own permit (two allowed) and gives
    # back only that one: A's stays.
    async def scenario(allowed):
        breaker = make(
            redis_client,
            name=f"dep{allowed}",
            recovery_timeout=0.2,
            probe_timeout=30,
            half_open_probes=allowed,
            state_cache=0,
        )
        probes = breaker._keys("t")[1]
        await atrip(breaker)
        await asyncio.sleep(0.25)
        held = await breaker.aadmit()
        assert held.probe and redis_client.zscore(probes, held.owner) is not None
        fired, removed = _calls(redis_client, "evalsha"), _calls(redis_client, "zrem")
        await _reply_lost(redis_server_url, breaker.aadmit())
        await _until(lambda: _calls(redis_client, "evalsha") > fired, "the admission")
        await _until(lambda: _calls(redis_client, "zrem") > removed, "the give-back")
        await _until(lambda: redis_client.zcard(probes) == 1, "B's permit back", 2.0)
        await asyncio.sleep(0.1)  # nothing more is given back
        assert redis_client.zrange(probes, 0, -1) == [held.owner]
        state = await breaker.astate()
        assert (state.state, state.probes) == (HALF_OPEN, 1)
        await held.asuccess()
        assert (await breaker.astate()).state == CLOSED

    async def main():
        await scenario(1)
        await scenario(2)

    asyncio.run(main())
