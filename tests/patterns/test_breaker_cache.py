"""The circuit breaker's per-process state cache (``state_cache`` /
``steplock_breaker_state_cache``) against a real redis-server: a closed breaker's successful
calls send no command, an open one refuses without one, successes counted locally reach the
shared window (with the next failure, or at the refresh), a trip, an operator's override or
another worker's failure is seen within the staleness, exactly one half-open probe still runs,
late outcomes of an earlier generation are still ignored, a forked child starts with no
cache, and a Redis outage follows the outage policy once the cache expires.

Two clients in one process stand for two workers: the cache is per client, prefix and name.
"""

import os
import threading
import time

import pytest

from celery_steplock.exceptions import CircuitOpen, ImproperlyConfigured, LockStoreUnavailable
from celery_steplock.lock import make_client
from celery_steplock.patterns.breaker import CLOSED, OPEN, CircuitBreaker
from tests.helpers import set_settings
from tests.support import servers

pytestmark = pytest.mark.no_database  # runs once, in the SQLite pass

IGNORED = ("cmdstat_info", "cmdstat_config")


def make(client, name="dep", **kwargs):
    kwargs.setdefault("failure_threshold", 3)
    kwargs.setdefault("window", 5)
    kwargs.setdefault("recovery_timeout", 0.5)
    kwargs.setdefault("success_threshold", 1)
    kwargs.setdefault("state_cache", 30.0)
    return CircuitBreaker(name, client=client, prefix="c", **kwargs)


def fail():
    raise ConnectionError("down")


def ok():
    return "ok"


def commands(stats):
    """Commands the server ran since the last CONFIG RESETSTAT, by name (INFO and CONFIG,
    the test's own, left out)."""
    found = stats.info("commandstats")
    return {k: int(v["calls"]) for k, v in found.items() if k.split("|")[0] not in IGNORED}


@pytest.fixture
def private():
    """A redis-server of this test's own (its command counts are the breaker's alone)."""
    server = servers.RedisServer().start()
    clients = []

    def client():
        made = make_client(server.url)
        clients.append(made)
        return made

    try:
        yield server, client
    finally:
        for made in clients:
            made.close()
        server.stop()


def test_closed_successes_send_no_command_and_cache_0_sends_one_each(private):
    _, client = private
    stats = client()
    cached = make(client(), name="cached", failure_threshold=0.5, window=1000)
    uncached = make(client(), name="uncached", failure_threshold=0.5, window=1000, state_cache=0)
    cached.call(ok)  # the first call reads the state (one round trip)
    uncached.call(ok)
    stats.config_resetstat()
    for _ in range(200):
        assert cached.call(ok) == "ok"
    assert commands(stats) == {}
    for _ in range(200):
        assert uncached.call(ok) == "ok"
    # ADMIT and RECORD each call (INFO lists the commands the scripts ran too).
    assert commands(stats)["cmdstat_evalsha"] == 400
    # The counted successes are in the shared window once written (state() writes them).
    assert cached.state().calls == 201


def test_an_open_breaker_refuses_without_a_round_trip(private):
    _, client = private
    stats = client()
    breaker = make(client(), failure_threshold=1, window=1, recovery_timeout=5.0)
    with pytest.raises(ConnectionError):
        breaker.call(fail)  # written at once: it trips, and this process holds OPEN
    stats.config_resetstat()
    waits = []
    for _ in range(50):
        with pytest.raises(CircuitOpen) as caught:
            breaker.call(ok)
        waits.append(caught.value.retry_after)
        assert caught.value.context["state"] == OPEN
    assert commands(stats) == {}
    assert 4.0 < waits[-1] <= waits[0] <= 5.0  # from the cached opened_ms, Redis time
    redis_says = breaker.state().retry_after
    assert abs(redis_says - waits[-1]) < 0.5


def test_a_failure_carries_the_successes_counted_before_it(private):
    _, client = private
    raw = client()
    breaker = make(client(), failure_threshold=0.5, window=10, minimum_calls=10)
    for _ in range(3):
        breaker.call(ok)
    assert raw.exists("c:breaker:{dep}") == 0  # nothing written yet
    with pytest.raises(ConnectionError):
        breaker.call(fail)
    assert raw.hget("c:breaker:{dep}", "ring") == "0001"


def test_batched_successes_count_in_the_shared_window_for_a_rate(private):
    _, client = private
    # Worker A's successes dilute worker B's failures once written at A's refresh.
    a = make(client(), failure_threshold=0.6, window=5, minimum_calls=2, state_cache=0.3)
    b = make(client(), failure_threshold=0.6, window=5, minimum_calls=2, state_cache=0.3)
    for _ in range(3):
        a.call(ok)  # the first reads the state; all three are counted in A
    time.sleep(0.35)
    a.call(ok)  # A's refresh writes its 3 successes (this one is counted after)
    for _ in range(2):
        with pytest.raises(ConnectionError):
            b.call(fail)
    observer = make(client(), state_cache=0)
    state = observer.state()
    assert (state.state, state.failures, state.calls) == (CLOSED, 2, 5)  # 40 % < 60 %
    with pytest.raises(ConnectionError):
        b.call(fail)  # 3 of the last 5: 60 %
    assert observer.state().state == OPEN


def test_a_rate_trip_at_the_refresh_refuses_that_call(private, events):
    _, client = private
    a = make(client(), failure_threshold=0.5, window=4, state_cache=0.3)
    b = make(client(), failure_threshold=0.5, window=4, state_cache=0)
    a.call(ok)  # counted in A
    for _ in range(3):
        with pytest.raises(ConnectionError):
            b.call(fail)  # 3 calls: fewer than minimum_calls (the window)
    time.sleep(0.35)
    with pytest.raises(CircuitOpen):
        a.call(ok)  # the refresh writes A's success: 3 of 4 failed, it opens
    opened = [kw for name, kw in events if name == "circuit_opened"]
    assert [(kw["failures"], kw["calls"]) for kw in opened] == [(3, 4)]


def test_a_failure_on_one_worker_opens_it_for_another_within_the_staleness(private):
    _, client = private
    a = make(client(), failure_threshold=1, window=1, recovery_timeout=30, state_cache=0.4)
    b = make(client(), failure_threshold=1, window=1, recovery_timeout=30, state_cache=0.4)
    assert b.call(ok) == "ok"  # B holds CLOSED
    started = time.monotonic()
    with pytest.raises(ConnectionError):
        a.call(fail)
    with pytest.raises(CircuitOpen):
        a.call(ok)  # A at once
    refused_at = None
    while time.monotonic() - started < 2.0:
        try:
            b.call(ok)
        except CircuitOpen as exc:
            refused_at = time.monotonic() - started
            assert 28 < exc.retry_after <= 30
            break
        time.sleep(0.01)
    assert refused_at is not None and refused_at <= 0.4 + 0.25  # polling under load


def test_an_operator_override_is_seen_within_the_staleness(private):
    _, client = private
    worker = make(client(), state_cache=0.3)
    operator = make(client(), state_cache=0.3)
    worker.call(ok)
    assert operator.override("open") == (CLOSED, False)
    with pytest.raises(CircuitOpen) as caught:
        operator.call(ok)  # the overriding process at once
    assert caught.value.context["forced"] is True
    time.sleep(0.35)
    with pytest.raises(CircuitOpen) as caught:
        worker.call(ok)
    assert caught.value.context["forced"] is True
    with pytest.raises(CircuitOpen):
        worker.call(ok)  # held: no round trip for a forced breaker either
    operator.override("close")
    time.sleep(0.35)
    assert worker.call(ok) == "ok"


def test_exactly_one_probe_under_many_concurrent_callers(private):
    _, client = private
    shared = client()
    breakers = [make(client(), failure_threshold=1, window=1, state_cache=5.0) for _ in range(8)]
    breakers += [make(shared, failure_threshold=1, window=1, state_cache=5.0) for _ in range(8)]
    for breaker in breakers:
        breaker.call(ok)  # every cache holds CLOSED
    with pytest.raises(ConnectionError):
        breakers[0].call(fail)
    for breaker in breakers[1:]:
        breaker._cache(breaker._target())[0].invalidate()  # they learn it is OPEN
        with pytest.raises(CircuitOpen):
            breaker.call(ok)
    time.sleep(0.55)  # past the recovery time: the cached OPEN sends them to Redis
    barrier = threading.Barrier(len(breakers))
    admitted = []
    refused = []

    def caller(breaker):
        barrier.wait()
        for _ in range(20):
            try:
                admitted.append(breaker.admit())
            except CircuitOpen as exc:
                refused.append(exc.context["state"])

    threads = [threading.Thread(target=caller, args=(b,)) for b in breakers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(admitted) == 1 and admitted[0].probe
    assert len(refused) == 20 * len(breakers) - 1
    admitted[0].success()  # closes it (success_threshold 1)
    assert breakers[3].call(ok) == "ok"  # a half-open cache asks Redis: closed


def test_late_outcomes_of_an_earlier_generation_are_ignored(private):
    _, client = private
    raw = client()
    a = make(client(), failure_threshold=0.5, window=10, state_cache=0.3)
    operator = make(client(), state_cache=0)
    late_success, late_failure = a.admit(), a.admit()  # CLOSED, generation 0, from A's cache
    operator.override("open")
    operator.override("close")  # generation 2
    late_success.success()  # counted by A against generation 0
    late_failure.failure(ConnectionError("late"))  # sent: Redis ignores generation 0
    time.sleep(0.35)
    a.call(ok)  # the refresh writes generation 0's success: ignored
    assert raw.hget("c:breaker:{dep}", "ring") == ""
    state = operator.state()
    assert (state.state, state.failures, state.generation) == (CLOSED, 0, 2)


def test_threads_count_every_success(private):
    _, client = private
    breaker = make(client(), failure_threshold=0.5, window=1000, minimum_calls=1000)
    breaker.call(ok)

    def calls():
        for _ in range(100):
            breaker.call(ok)

    threads = [threading.Thread(target=calls) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert breaker.state().calls == 801


def test_a_forked_child_starts_without_the_parents_cache(private):
    server, client = private
    raw = client()
    breaker = make(client(), failure_threshold=0.5, window=10)
    for _ in range(3):
        breaker.call(ok)  # counted in the parent, not written
    pid = os.fork()
    if pid == 0:  # the child: its state() must not write the parent's successes
        code = 1
        try:
            child = make_client(server.url)
            state = make(child, failure_threshold=0.5, window=10).state()
            breaker.state()  # the parent's object: its memo is stale after the fork
            code = 0 if state.calls == 0 and raw.hget("c:breaker:{dep}", "ring") is None else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert breaker.state().calls == 3  # the parent's, written once, by the parent


def test_an_outage_admits_by_the_cache_until_it_expires_then_follows_the_policy(private):
    server, client = private
    closed = make(client(), name="closed", state_cache=0.3)
    opened = make(client(), name="opened", state_cache=0.3, on_store_error="fail_open")
    closed.call(ok)
    opened.call(ok)
    server.stop()
    assert closed.call(ok) == "ok"  # within the staleness: no round trip
    with pytest.raises(ConnectionError):
        closed.call(fail)  # its write fails (logged); the call's own error is raised
    time.sleep(0.35)
    with pytest.raises(LockStoreUnavailable):
        closed.call(ok)  # fail closed
    ticket = opened.admit()
    assert ticket.guarded is False  # fail open: unguarded


def test_the_setting_and_the_argument(app, redis_client):
    set_settings(app, steplock_breaker_state_cache=0)
    breaker = CircuitBreaker("setting", app=app)
    assert breaker._cache(breaker._target()) == (None, 0)
    set_settings(app, steplock_breaker_state_cache=2.5)
    breaker = CircuitBreaker("setting", app=app)
    assert breaker._cache(breaker._target())[1] == 2.5
    assert CircuitBreaker("arg", client=redis_client, state_cache=0)._cache(
        CircuitBreaker("arg", client=redis_client)._target()
    ) == (None, 0)
    assert CircuitBreaker("default", client=redis_client)._cache(
        CircuitBreaker("default", client=redis_client)._target()
    )[1] == pytest.approx(1.0)
    for bad in (-1, 61, "1", True):
        with pytest.raises(ImproperlyConfigured):
            CircuitBreaker("bad", client=redis_client, state_cache=bad)


def test_a_shorter_staleness_is_not_stretched_by_a_longer_one_on_the_same_copy(private):
    # Two breakers of one name in one process share the cached copy: the one with the
    # shorter state_cache must not trust a copy older than its own staleness because the
    # other one (longer) made the last refresh.
    _, client = private
    mine = client()
    slow = make(mine, name="shared", failure_threshold=1, window=1, state_cache=30.0)
    fast = make(mine, name="shared", failure_threshold=1, window=1, state_cache=0.2)
    other = make(client(), name="shared", failure_threshold=1, window=1, state_cache=0)
    assert slow.call(ok) == "ok"  # the copy: CLOSED, refreshed by the 30 s breaker
    with pytest.raises(ConnectionError):
        other.call(fail)  # another worker trips it
    time.sleep(0.3)
    with pytest.raises(CircuitOpen):
        fast.call(ok)  # older than 0.2 s: asks Redis


def test_a_trip_or_override_by_an_uncached_breaker_of_the_process_is_seen_at_once(private):
    # "a trip or an override made by the process itself at once", whichever of the
    # process's breaker objects of that name made it.
    _, client = private
    mine = client()
    cached = make(mine, name="own", failure_threshold=1, window=1, state_cache=30.0)
    direct = make(mine, name="own", failure_threshold=1, window=1, state_cache=0)
    assert cached.call(ok) == "ok"  # held CLOSED for 30 s
    direct.override("open")
    with pytest.raises(CircuitOpen):
        cached.call(ok)
    direct.override("close")
    assert cached.call(ok) == "ok"
    with pytest.raises(ConnectionError):
        direct.call(fail)  # trips it
    with pytest.raises(CircuitOpen):
        cached.call(ok)


def test_its_own_trip_is_held_when_a_later_sent_admission_was_applied_first():
    """Threads share one copy: thread A's failing RECORD trips the breaker (generation 5)
    while thread B's admission, sent just after it on another connection, ran in Redis just
    before it (CLOSED, generation 4) and its reply was applied first. The process still
    refuses at once after its own trip (found by the randomized run's breaker rule)."""
    from celery_steplock.patterns.breaker import _CachedState

    cache = _CachedState()
    record_sent = time.monotonic()
    cache.apply(record_sent + 0.001, 30.0, CLOSED, 4, now_ms=1)
    cache.recorded(record_sent, OPEN, True, 5, 1)
    assert (cache.state, cache.generation) == (OPEN, 5)
    assert cache.expires > time.monotonic()  # held: the next admission refuses without Redis
    # An older reply of an earlier generation still never replaces a newer one.
    cache.apply(record_sent - 1.0, 30.0, CLOSED, 4, now_ms=1)
    assert (cache.state, cache.generation) == (OPEN, 5)
