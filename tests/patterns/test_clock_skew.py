"""Stored Redis times ahead of Redis ``TIME`` (issue 24): the state was written by a primary
whose clock ran ahead, then a failover to one whose clock is behind. Each test writes the
state directly, in the exact format its script writes, with a time an hour ahead; then the
pattern must recover within its configured refill, window, recovery or permit lifetime
(never the skew), write the clamped state back, and send ``clock_skew`` once naming the skew.
Against a real redis-server."""

import time

import pytest

from celery_steplock import SlidingWindow, TokenBucket, signals
from celery_steplock._checks import CLOCK_SKEW_TOLERANCE
from celery_steplock.exceptions import CircuitOpen, ConcurrencyLimited
from celery_steplock.patterns.breaker import HALF_OPEN, OPEN, CircuitBreaker
from celery_steplock.patterns.concurrency import ConcurrencyLimit

pytestmark = pytest.mark.no_database  # runs once, in the SQLite pass

#: How far ahead the stored times are: an hour, far past every configured wait below.
SKEW = 3600.0
#: How long a test waits for a recovery the code bounds by well under a second (a loaded
#: machine's margin; the old code needed the whole hour).
DEADLINE = 15.0


def redis_ms(client) -> float:
    seconds, micros = client.time()
    return seconds * 1000.0 + micros / 1000.0


def num(value: float) -> str:
    """A number as the rate limit scripts write it (Lua ``%.17g``)."""
    return "%.17g" % value


def skews(events):
    return [kw for name, kw in events if name == "clock_skew"]


def poll(attempt, deadline=DEADLINE):
    """Call ``attempt`` until it returns a truthy value (returned) or ``deadline`` passes
    (None)."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        result = attempt()
        if result:
            return result
        time.sleep(0.02)
    return None


def test_the_signal_is_declared_and_documented():
    assert signals.clock_skew in signals.ALL_SIGNALS
    assert signals.clock_skew.name == "clock_skew"
    assert 0 < CLOCK_SKEW_TOLERANCE <= 5


# -- token bucket --------------------------------------------------------------------------------


def test_a_bucket_refilled_in_the_future_refills_from_now(redis_client, events):
    bucket = TokenBucket(10.0, capacity=2, client=redis_client)
    key = bucket.redis_key("steplock", "api")[0]
    ahead = redis_ms(redis_client) + SKEW * 1000
    redis_client.hset(key, mapping={"tokens": num(0.0), "ts": num(ahead)})

    first = bucket.try_acquire("api")
    # denied for one token's refill (0.1 s), never for the hour
    assert not first.allowed and first.retry_after <= 1 / bucket.rate + 1e-6
    stored = float(redis_client.hget(key, "ts"))
    assert stored <= redis_ms(redis_client) + 1.0  # clamped and written back
    admitted = poll(lambda: bucket.try_acquire("api").allowed)
    assert admitted, "the bucket admitted nothing: it waits for the skewed refill time"

    sent = skews(events)
    assert len(sent) == 1, sent
    assert sent[0]["pattern"] == "rate limit" and sent[0]["key"] == key
    assert sent[0]["name"] == "api" and sent[0]["field"] == "ts"
    assert sent[0]["skew"] == pytest.approx(SKEW, abs=5.0)


def test_a_bucket_a_little_ahead_stays_monotonic_and_silent(redis_client, events):
    """Within the tolerance it is ordinary jitter of a clock that went back a little: the
    bucket keeps its time (never refilling twice) and no signal is sent."""
    bucket = TokenBucket(10.0, capacity=2, client=redis_client)
    key = bucket.redis_key("steplock", "calm")[0]
    ahead = redis_ms(redis_client) + CLOCK_SKEW_TOLERANCE * 1000 / 2
    redis_client.hset(key, mapping={"tokens": num(0.0), "ts": num(ahead)})
    assert not bucket.try_acquire("calm").allowed
    assert float(redis_client.hget(key, "ts")) == pytest.approx(ahead, abs=1e-3)
    assert skews(events) == []


# -- sliding window ------------------------------------------------------------------------------


def test_a_window_of_future_grants_counts_them_from_now(redis_client, events):
    window = SlidingWindow(2, 0.5, client=redis_client)
    log = window.redis_key("steplock", "api")[0]
    ahead = redis_ms(redis_client) + SKEW * 1000
    redis_client.zadd(log, {"a": num(ahead), "b": num(ahead + 1)})

    first = window.try_acquire("api")
    assert not first.allowed and first.retry_after <= window.window + 1e-6
    scores = [score for _m, score in redis_client.zrange(log, 0, -1, withscores=True)]
    assert max(scores) <= redis_ms(redis_client) + 1.0  # clamped and written back
    assert poll(lambda: window.try_acquire("api").allowed), "the window admitted nothing"

    sent = skews(events)
    assert len(sent) == 1, sent
    assert (sent[0]["pattern"], sent[0]["key"], sent[0]["field"]) == ("rate limit", log, "log")
    assert sent[0]["skew"] == pytest.approx(SKEW, abs=5.0)


def test_tickets_given_in_the_future_do_not_hold_the_quota_for_the_skew(redis_client, events):
    """Tickets of holders that never come back, given by the clock that ran ahead: their
    deadlines are an hour away, and every newcomer is counted behind them. They live at most
    ``max_wait + ticket_grace`` from now."""
    bucket = TokenBucket(10.0, capacity=1, max_wait=0.5, ticket_grace=0.2, client=redis_client)
    _state, queue, deadlines = bucket.redis_key("steplock", "q")
    ahead = redis_ms(redis_client) + SKEW * 1000
    redis_client.zadd(queue, {"ghost-1": num(ahead), "ghost-2": num(ahead)})
    redis_client.zadd(deadlines, {"ghost-1": num(ahead + 500), "ghost-2": num(ahead + 500)})
    redis_client.pexpire(queue, int(SKEW * 1000))
    redis_client.pexpire(deadlines, int(SKEW * 1000))

    assert not bucket.try_acquire("q").allowed  # two tickets ahead, one token
    limit = redis_ms(redis_client) + (0.5 + 0.2) * 1000 + 1.0
    assert max(s for _m, s in redis_client.zrange(deadlines, 0, -1, withscores=True)) <= limit
    assert poll(lambda: bucket.try_acquire("q").allowed), "ghost tickets held the quota"
    sent = skews(events)
    assert len(sent) == 1 and sent[0]["field"] == "tickets", sent
    assert sent[0]["skew"] == pytest.approx(SKEW, abs=5.0)


# -- circuit breaker -----------------------------------------------------------------------------


def breaker(client, **kwargs):
    kwargs.setdefault("recovery_timeout", 0.3)
    kwargs.setdefault("success_threshold", 1)
    return CircuitBreaker(
        "dep", failure_threshold=1, window=1, client=client, prefix="t", **kwargs
    )


def test_a_breaker_opened_in_the_future_half_opens_after_its_recovery_from_now(
    redis_client, events
):
    dep = breaker(redis_client)
    ahead = int(redis_ms(redis_client) + SKEW * 1000)
    # as RECORD's trip writes it: a Lua integer-valued number, so plain digits
    redis_client.hset(
        dep.key,
        mapping={"state": "open", "gen": "1", "opened_ms": str(ahead), "ring": "", "successes": 0},
    )

    with pytest.raises(CircuitOpen) as refused:
        dep.call(lambda: None)
    assert refused.value.retry_after <= dep.recovery_timeout + 1e-6
    assert int(redis_client.hget(dep.key, "opened_ms")) <= redis_ms(redis_client) + 1
    assert dep.state().retry_after <= dep.recovery_timeout

    def probe():
        try:
            return dep.admit(owner="p")
        except CircuitOpen:
            return None

    admitted = poll(probe)
    assert admitted is not None, "the breaker stayed open for the skew"
    assert admitted.probe and dep.state().state == HALF_OPEN

    sent = skews(events)
    assert len(sent) == 1, sent
    assert sent[0]["pattern"] == "circuit breaker" and sent[0]["key"] == dep.key
    assert (sent[0]["name"], sent[0]["field"]) == ("dep", "opened_ms")
    assert sent[0]["skew"] == pytest.approx(SKEW, abs=5.0)


def test_a_probe_permit_expiring_in_the_future_lives_its_lifetime_from_now(redis_client, events):
    """A prober that died holding a permit given by the clock that ran ahead: the permit
    frees after ``probe_timeout`` from now, not after the skew."""
    dep = breaker(redis_client, probe_timeout=0.3)
    probes = dep._keys("t")[1]
    now = redis_ms(redis_client)
    redis_client.hset(
        dep.key, mapping={"state": "half_open", "gen": "2", "ring": "", "successes": 0}
    )
    redis_client.zadd(probes, {"dead-prober": int(now + SKEW * 1000 + 300)})

    with pytest.raises(CircuitOpen) as refused:
        dep.admit(owner="live")
    assert refused.value.context["state"] == HALF_OPEN
    assert refused.value.retry_after <= dep.probe_timeout + 1e-6

    def probe():
        try:
            return dep.admit(owner="live")
        except CircuitOpen:
            return None

    admitted = poll(probe)
    assert admitted is not None and admitted.probe, "the dead prober's permit held for the skew"
    sent = skews(events)
    assert len(sent) == 1 and sent[0]["field"] == "probes", sent
    assert sent[0]["skew"] == pytest.approx(SKEW, abs=5.0)


def test_a_breaker_opened_a_moment_ahead_is_left_alone(redis_client, events):
    dep = breaker(redis_client)
    ahead = int(redis_ms(redis_client) + CLOCK_SKEW_TOLERANCE * 1000 / 2)
    redis_client.hset(dep.key, mapping={"state": OPEN, "gen": "1", "opened_ms": str(ahead)})
    with pytest.raises(CircuitOpen):
        dep.call(lambda: None)
    assert int(redis_client.hget(dep.key, "opened_ms")) == ahead
    assert skews(events) == []


# -- concurrency limit ---------------------------------------------------------------------------


def test_waiters_queued_in_the_future_do_not_hold_free_slots_for_the_skew(redis_client, events):
    """Waiters of the clock that ran ahead that never come back: their liveness is an hour
    away. A caller that does not wait is counted behind them; they live at most the waiter
    TTL from now."""
    from celery_steplock.lock import RedisLeaseStore

    store = RedisLeaseStore(redis_client, prefix="t")
    limit = ConcurrencyLimit(1, waiter_ttl=0.3)
    _fence, queue, alive = limit.redis_keys("t", "exports", 1)[1:]
    ahead = redis_ms(redis_client) + SKEW * 1000
    redis_client.zadd(queue, {"ghost": int(ahead)})
    redis_client.zadd(alive, {"ghost": int(ahead + 300)})
    redis_client.pexpire(queue, int(SKEW * 1000))
    redis_client.pexpire(alive, int(SKEW * 1000))

    def grant():
        try:
            return limit.try_acquire(
                store, "exports", owner="o", ticket=None, ttl=5.0, metadata={}
            )
        except ConcurrencyLimited:
            return None

    slot = poll(grant)
    assert slot is not None, "a ghost waiter held the free slot for the skew"
    slot.release()
    assert max(s for _m, s in redis_client.zrange(alive, 0, -1, withscores=True) or [(0, 0)]) <= (
        redis_ms(redis_client) + 300 + 1
    )
    sent = skews(events)
    assert len(sent) == 1 and sent[0]["pattern"] == "concurrency limit", sent
    assert sent[0]["skew"] == pytest.approx(SKEW, abs=5.0)


def test_a_task_decision_reports_the_skew_with_the_task(events):
    """The gate reports for a task (sender, ``task_id``, ``task_name``) as the plain API
    does without one."""
    from celery_steplock.patterns.ratelimit import RateDecision, _announce

    decision = RateDecision(
        False, 0.1, "k", "10/s bucket of 2", now=1.0, skew=SKEW, skew_field="ts"
    )
    _announce(decision, "a task", "api", None, task_id="t-1", task_name="tasks.api")
    sent = skews(events)
    assert len(sent) == 1 and (sent[0]["task_id"], sent[0]["task_name"]) == ("t-1", "tasks.api")
    assert [name for name, _kw in events] == ["clock_skew", "rate_limited"]
