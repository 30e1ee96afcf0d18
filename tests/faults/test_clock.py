"""The ``clock_ahead`` fault (tests/support/faults/clock.py): the state it leaves is the one
the library's scripts would have written with a clock ``skew`` ahead (every stored time and
fencing token moved, TTLs kept, no key added), and the library recovers from it as
docs/security.md rows 11, 15, 16 say: the patterns clamp and report ``clock_skew``, a row
ahead of its counter is ``FenceAhead``. Against a real redis-server and the test database."""

from __future__ import annotations

import random
import time

import pytest
import redis

from celery_steplock import SlidingWindow, keys
from celery_steplock.exceptions import CircuitOpen
from celery_steplock.lock import RedisLeaseStore
from celery_steplock.patterns.breaker import CircuitBreaker
from celery_steplock.patterns.concurrency import ConcurrencyLimit
from tests.support.faults import clock, nemesis

P = "steplock"
SKEW = 3.0


@pytest.fixture
def store(redis_server_url):
    client = redis.Redis.from_url(redis_server_url, decode_responses=True)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def _ms(client) -> float:
    return clock.redis_now_us(client) / 1000.0


def test_key_families_follow_the_library_key_layout():
    family = clock._family
    assert family(P, keys.fence_key(P, "step:1")) == "fence"
    assert family(P, keys.lease_key(P, "step:1")) == "lease"
    assert family(P, keys.slot_key(P, "slots", 0)) == "lease"
    fence, queue, alive = keys.concurrency_keys(P, "slots")
    assert [family(P, k) for k in (fence, queue, alive)] == [
        "slot_fence",
        "slot_queue",
        "slot_alive",
    ]
    log, tickets, due = SlidingWindow("5/s").redis_key(P, "nemesis")
    assert [family(P, k) for k in (log, tickets, due)] == ["rate_sw", "rate_queue", "rate_due"]
    assert family(P, keys.rate_limit_keys(P, "tb", "5:5", "n")[0]) == "rate_tb"
    assert [family(P, k) for k in keys.breaker_keys(P, "dep")] == ["breaker", "breaker_probes"]
    assert family(P, keys.idempotency_record_key(P, "idem:1")) == "idem"
    assert family(P, keys.idempotency_quota_key(P, "who")) is None
    assert family(P, "other:lease:{x}") is None
    assert clock.SKEW_MIN > 1.0  # above CLOCK_SKEW_TOLERANCE: every stored time is clamped
    # below the lab's steplock_retry_backoff_max (STEPLOCK_RETRY_BACKOFF_MAX=2): FenceAhead is
    # retried by the library itself (docs/howto/deployment.md)
    assert clock.SKEW_MAX < 2.0
    assert "clock_ahead" in nemesis.KINDS
    for store_kind in nemesis.STORES:
        assert "clock_ahead" in nemesis.kinds_of("patterns", store_kind)


def test_every_stored_time_moves_ahead_keeping_its_ttl(store, events):
    leases = RedisLeaseStore(store, prefix=P)
    lease = leases.acquire("step:x", ttl=30.0)
    window = SlidingWindow(2, 1.0, client=store)
    assert window.try_acquire("api").allowed
    log = window.redis_key(P, "api")[0]
    dep = CircuitBreaker(
        "dep", failure_threshold=1, window=1, recovery_timeout=0.3, client=store, prefix=P
    )
    with pytest.raises(ZeroDivisionError):
        dep.call(lambda: 1 / 0)
    _fence, queue, alive = ConcurrencyLimit(1, waiter_ttl=5.0).redis_keys(P, "slots", 1)[1:]
    now = int(_ms(store))
    store.zadd(queue, {"w": now})
    store.zadd(alive, {"w": now + 5000})
    store.pexpire(queue, 10_000)
    store.pexpire(alive, 10_000)
    idem = keys.idempotency_record_key(P, "k")
    store.hset(idem, mapping={"status": "completed", "created_ms": now, "locked_ms": ""})
    store.pexpire(idem, 60_000)
    before = {
        "fence": int(store.get(keys.fence_key(P, "step:x"))),
        "acquired": int(store.hget(lease.key, "acquired_ms")),
        "log": store.zrange(log, 0, -1, withscores=True)[0][1],
        "opened": int(store.hget(dep.key, "opened_ms")),
    }
    seen = set(store.scan_iter(match="*"))

    done = clock.leave_clock_ahead(store, SKEW, prefix=P)

    assert set(store.scan_iter(match="*")) == seen  # nothing added
    assert all(store.pttl(k) > 0 for k in seen), "a key lost its TTL"
    assert int(store.get(keys.fence_key(P, "step:x"))) == before["fence"] + 3_000_000
    assert int(store.hget(lease.key, "acquired_ms")) == before["acquired"] + 3000
    assert int(store.hget(lease.key, "fence")) == lease.fence  # the holder's token stays
    assert store.zrange(log, 0, -1, withscores=True)[0][1] == pytest.approx(
        before["log"] + 3000, abs=1e-3
    )
    assert int(store.hget(dep.key, "opened_ms")) == before["opened"] + 3000
    assert store.zscore(queue, "w") == now + 3000 and store.zscore(alive, "w") == now + 8000
    assert store.hget(idem, "created_ms") == str(now + 3000)
    assert store.hget(idem, "locked_ms") == ""  # an empty field stays empty
    assert done["changed"] == {
        "breaker_opened_ms": 1,
        "fence": 1,
        "idem_times": 1,
        "lease_times": 2,
        "rate_log": 1,
        "slot_alive": 1,
        "slot_queue": 1,
    }

    # a second fault leaves a clock SKEW ahead, not twice that: events stay, expiries move
    clock.leave_clock_ahead(store, SKEW, prefix=P)
    limit_us = clock.redis_now_us(store) + 3_000_000  # at most now + skew, never now + 2 skews
    assert before["fence"] + 3e6 <= int(store.get(keys.fence_key(P, "step:x"))) <= limit_us
    assert before["opened"] + 3000 <= int(store.hget(dep.key, "opened_ms")) <= limit_us / 1000
    assert store.zscore(alive, "w") == now + 11000

    # the library's recovery (docs/security.md rows 15, 16): clamped, reported once each
    events.clear()
    window.try_acquire("api")
    began = time.monotonic()
    while True:
        try:
            call = dep.admit(owner="probe")
            break
        except CircuitOpen:
            assert time.monotonic() - began < SKEW - 1.0, "the breaker stayed open for the skew"
            time.sleep(0.02)
    assert call.probe
    skews = {kw["field"]: kw["skew"] for name, kw in events if name == "clock_skew"}
    assert skews.keys() == {"log", "opened_ms"}, events
    assert all(s == pytest.approx(SKEW, abs=1.0) for s in skews.values())


def test_the_store_is_rewritten_in_a_round_trip_per_batch_of_keys(store, monkeypatch):
    """A 30-minute run leaves tens of thousands of idempotency records; one round trip per
    key kept the controller, and the heals of the faults it runs, busy for a minute."""
    n = 2 * clock.BATCH + 7
    now = int(_ms(store))
    pipe = store.pipeline(transaction=False)
    for i in range(n):
        key = keys.idempotency_record_key(P, f"many:{i}")
        pipe.hset(key, mapping={"status": "completed", "created_ms": now})
        pipe.pexpire(key, 60_000)
    pipe.execute()
    executes = []
    real = redis.client.Pipeline.execute
    monkeypatch.setattr(
        redis.client.Pipeline,
        "execute",
        lambda self, *a, **kw: executes.append(len(self.command_stack)) or real(self, *a, **kw),
    )

    done = clock.leave_clock_ahead(store, SKEW, prefix=P)

    assert done["changed"] == {"idem_times": n}
    assert len(executes) == 3 and max(executes) == 2 * clock.BATCH  # two scripts a record
    last = keys.idempotency_record_key(P, f"many:{n - 1}")
    assert store.hget(last, "created_ms") == str(now + 3000)
    assert 0 < store.pttl(last) <= 60_000


@pytest.mark.django_db(transaction=True)
def test_rows_ahead_of_their_counter_are_the_fence_ahead_state(store):
    from django_app.workflows.models import Step

    kept = Step.objects.create(name="kept")
    lost = Step.objects.create(name="lost", lock_fence=5)
    finished = Step.objects.create(name="done", status="done", lock_fence=7)
    leases = RedisLeaseStore(store, prefix=P)
    for step in (kept, lost):
        lease = leases.acquire(f"step:{step.pk}", ttl=30.0)
        leases.release(lease.name, lease.owner)
    now_us = clock.redis_now_us(store)

    class Picks(random.Random):
        """rows: everything; lost counters: the second row only."""

        draws = iter([0.0, 0.0, 0.9, 0.0])

        def random(self):
            return next(self.draws)

    done = clock.leave_clock_ahead(
        store, 30.0, steps=[kept.pk, lost.pk, finished.pk], prefix=P, rng=Picks(), row_ahead_s=SKEW
    )
    assert done["rows"] == [kept.pk, lost.pk] and done["counters_lost"] == [lost.pk]
    for step in (kept, lost):
        step.refresh_from_db()
        assert now_us + 3_000_000 <= step.lock_fence < now_us + 4_000_000
    finished.refresh_from_db()
    assert finished.lock_fence == 7  # a terminal step is never written again: left alone
    # the counter the failover kept grants past its row; the lost one grants behind it
    assert int(store.get(keys.fence_key(P, f"step:{kept.pk}"))) == kept.lock_fence
    assert leases.acquire(f"step:{kept.pk}", ttl=5.0).fence > kept.lock_fence
    assert leases.acquire(f"step:{lost.pk}", ttl=5.0).fence < lost.lock_fence


def reissue_history(first: float, loss_t: float, second: float, lag: float = 0.5) -> list[dict]:
    fence = 9_000_000  # 9 s of Redis time: ahead of both grants (a counter a clock_ahead left)
    return [
        {"ev": "fault", "t": 0.5, "kind": "clock_ahead", "skew": 1.5},
        {"ev": "acquired", "t": first, "step": 5, "owner": "a", "fence": fence},
        {"ev": "fault", "t": loss_t, "kind": "redis_failover", "lag": lag},
        {"ev": "acquired", "t": second, "step": 5, "owner": "b", "fence": fence},
    ]


PROBLEM = "step 5: one fencing token 9000000 written by 2 owners (a, b)"


def test_a_token_given_again_after_a_failover_lost_its_grant_is_a_data_loss():
    [excused] = clock.reissued_tokens([PROBLEM], reissue_history(2.0, 2.3, 3.0))
    assert excused.startswith(PROBLEM + "; after clock_ahead at 0.500 and redis_failover at")


@pytest.mark.parametrize(
    "first, loss_t, second",
    [
        (2.0, 9.0, 3.0),  # no loss between the two grants
        (2.0, 7.0, 8.0),  # the first grant replicated long before the failover (lag 0.5 s)
        (7.5, 7.0, 8.0),  # both grants after the failover, on the same primary
    ],
    ids=["no-loss-between", "replicated-before", "both-after"],
)
def test_a_token_given_twice_that_no_data_loss_explains_stays_a_violation(first, loss_t, second):
    assert clock.reissued_tokens([PROBLEM], reissue_history(first, loss_t, second)) == []
