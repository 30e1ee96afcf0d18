"""Every distributed pattern on every lock-store topology: one node, Sentinel (a primary, a
replica, three sentinels), Cluster (3 primaries, 3 replicas) and the least-privilege ACL user
(tests/support/acl.py), one parametrization over tests/support/topologies.py.

Each test configures the Celery app's lease store as a user would (``steplock_redis_url``
and the transport and cluster settings) and hands the pattern ``app=``: the pattern finds its
client and key prefix there. The servers start once per session; the pattern's own rules are
in the other modules of this folder, the topologies' lease cycle in tests/test_cluster.py,
tests/test_topologies_sentinel_tls.py and tests/test_acl.py.
"""

from __future__ import annotations

import time

import pytest
from redis.crc import key_slot

from celery_steplock.exceptions import CircuitOpen, ConcurrencyLimited, LockStoreMisconfigured
from celery_steplock.lock import get_lease_store
from celery_steplock.patterns.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from celery_steplock.patterns.concurrency import ConcurrencyLimit, current_slot
from celery_steplock.patterns.idempotency import Idempotency, idempotent
from celery_steplock.patterns.ratelimit import SlidingWindow, TokenBucket
from celery_steplock.task import StepLockedTask
from django_app.celery import app as celery_app
from tests.support import topologies

pytestmark = pytest.mark.redis_shape

#: The lease store's key prefix (the default ``steplock_key_prefix``): the ACL user's keys.
PREFIX = "steplock"
SECRET = "s" * 40


@pytest.fixture(params=topologies.TOPOLOGIES)
def topology(request, app):
    """The topology of the parameter, on a flushed database, with ``app`` pointed at it;
    ``topology.store`` is the app's lease store there (its client, its prefix)."""
    topology = topologies.build(request.param, request)
    topology.configure(app)
    topology.store = get_lease_store(app)
    assert topology.store.prefix == PREFIX
    yield topology
    topology.close()


def ours(topology) -> list[str]:
    """Every key of the topology, after checking that each is under the lease store's prefix
    (the only keys the ACL user may touch)."""
    keys = topology.keys()
    assert keys and all(k.startswith(f"{PREFIX}:") for k in keys), keys
    return keys


def fail():
    raise ConnectionError("dependency down")


# -- rate limits -------------------------------------------------------------------------------


def test_a_rate_limit_admits_then_refuses_within_the_window(topology, app):
    bucket = TokenBucket("1/h", capacity=2, max_wait=7200.0, app=app)
    first, second = bucket.try_acquire("tb"), bucket.try_acquire("tb")
    assert (first.allowed, second.allowed) == (True, True)
    # What is left after each: the tokens refill by a fraction meanwhile (1 an hour).
    assert 1.0 <= first.remaining < 1.01 and 0.0 <= second.remaining < 0.01
    denied = bucket.try_acquire("tb", reserve=True)  # ZCARD of the queue, a ticket given
    assert not denied.allowed and 0 < denied.retry_after <= 3600.0
    assert denied.ticket is not None and denied.queued == 0
    again = bucket.try_acquire("tb", ticket=denied.ticket, reserve=True)  # ZRANK of it
    assert not again.allowed and again.ticket == denied.ticket and again.queued == 0

    window = SlidingWindow(2, 3600.0, app=app)
    grants = [window.try_acquire("sw") for _ in range(2)]
    assert [(g.allowed, g.remaining) for g in grants] == [(True, 1.0), (True, 0.0)]
    refused = window.try_acquire("sw")  # ZRANGE of the log's oldest grant
    assert not refused.allowed and 3500.0 < refused.retry_after <= 3600.0
    assert topology.admin.zcard(window.redis_key(PREFIX, "sw")[0]) == 2
    assert topology.admin.exists(bucket.redis_key(PREFIX, "tb")[0]) == 1
    # The state, the queue and the deadlines of one limit share a slot (one script call).
    for limiter, name in ((bucket, "tb"), (window, "sw")):
        assert len({key_slot(k.encode()) for k in limiter.redis_key(PREFIX, name)}) == 1
    ours(topology)


# -- concurrency limits ------------------------------------------------------------------------


def test_a_concurrency_limit_grants_n_slots_then_refuses(topology, app):
    limit = ConcurrencyLimit(2, ttl=30.0)
    with limit.acquire("bh", app=app) as first, limit.acquire("bh", app=app) as second:
        assert sorted((first.index, second.index)) == [0, 1]
        for slot in (first, second):
            assert slot.fence > 0
            assert topology.admin.hget(slot.lease.key, "owner") == slot.owner
        # A waiting caller queues (ZCARD, ZRANK, ZADD), is refused and leaves the queue.
        with pytest.raises(ConcurrencyLimited) as caught:
            with limit.acquire("bh", app=app, wait=0.3):
                pytest.fail("a third slot of a limit of 2")
        assert caught.value.retry_after > 0
        held = {first.index: first, second.index: second}
    assert all(slot.released for slot in held.values())
    assert [topology.admin.exists(slot.lease.key) for slot in held.values()] == [0, 0]
    with limit.acquire("bh", app=app) as later:
        assert later.index == 0 and later.fence > held[0].fence  # the GET of the counter
    assert topology.admin.zcard(f"{PREFIX}:bulkhead:{{bh}}:queue") == 0
    ours(topology)


# -- circuit breakers --------------------------------------------------------------------------


def test_a_breaker_opens_after_failures_and_allows_one_half_open_probe(topology, app):
    breaker = CircuitBreaker(
        "topo-dep",
        failure_threshold=2,
        window=4,
        recovery_timeout=0.3,
        success_threshold=1,
        app=app,
    )
    with pytest.raises(ConnectionError):
        breaker.call(fail)
    assert breaker.call(lambda: "ok") == "ok"
    state = breaker.state()
    assert (state.state, state.failures, state.calls) == (CLOSED, 1, 2)
    with pytest.raises(ConnectionError):
        breaker.call(fail)
    assert breaker.state().state == OPEN
    time.sleep(0.4)  # past the recovery timeout (Redis clock; the breaker's own rule)
    probe = breaker.admit()  # HALF_OPEN: ZSCORE, ZCARD, ZADD of the probe permit
    assert probe.probe is True and breaker.state().state == HALF_OPEN
    with pytest.raises(CircuitOpen) as caught:
        breaker.admit()  # the one permit is taken: ZRANGE of its expiry
    assert caught.value.context["state"] == HALF_OPEN and caught.value.retry_after > 0
    assert breaker.state().probes == 1  # ZCOUNT
    probe.record(None)  # HINCRBY of the successes: closes it
    assert breaker.state().state == CLOSED
    assert breaker.override("open") == (CLOSED, False)  # PERSIST: forced open
    assert breaker.state().forced
    with pytest.raises(CircuitOpen) as caught:
        breaker.call(lambda: "never run")
    assert caught.value.context["forced"] is True
    assert topology.admin.pttl(breaker.key) == -1
    assert breaker.override("close") == (OPEN, True)  # HDEL of the force
    assert breaker.call(lambda: "ok") == "ok"
    assert topology.admin.pttl(breaker.key) > 0
    ours(topology)


def test_breakers_of_many_names_each_keep_their_keys_in_one_slot(topology, app):
    keys = []
    for name in (f"dep-{i}" for i in range(12)):
        breaker = CircuitBreaker(name, failure_threshold=1, window=1, recovery_timeout=30, app=app)
        with pytest.raises(ConnectionError):
            breaker.call(fail)
        assert breaker.state().state == OPEN
        pair = [f"{PREFIX}:breaker:{{{name}}}", f"{PREFIX}:breaker-probes:{{{name}}}"]
        assert breaker.key == pair[0] and topology.admin.exists(pair[0]) == 1
        assert len({key_slot(k.encode()) for k in pair}) == 1
        keys.append(pair[0])
    nodes = topology.nodes_of(keys)
    if topology.cluster:
        assert len(nodes) > 1  # the names reach more than one primary
    else:
        assert nodes == {topology.name}


# -- idempotency records -----------------------------------------------------------------------


def test_an_idempotent_function_runs_then_replays(topology, app):
    runs = []

    @idempotent("topo:{n}", app=app, store="redis", secret=SECRET)
    def charge(n):
        runs.append(n)
        return {"charged": n}

    assert charge(7) == {"charged": 7}
    assert charge(7) == {"charged": 7}  # replayed from the record
    assert runs == [7]
    assert charge.idempotency.get("topo:7").status == "completed"
    record = charge.idempotency.store.redis_key(charge.record_key(7))
    assert record.startswith(f"{PREFIX}:") and topology.admin.exists(record) == 1
    assert charge.invalidate(7) is True
    assert charge(7) == {"charged": 7} and runs == [7, 7]
    ours(topology)


def test_every_idempotency_transition(topology, app):
    policy = Idempotency("tests.topologies", app=app, secret=SECRET)
    failed = policy.begin("a", {"x": 1})
    assert failed.fail(ValueError("x")) is True
    again = policy.begin("a", {"x": 1})
    assert again.complete({"ok": 1}) is True
    assert policy.begin("a", {"x": 1}).result == {"ok": 1}
    assert policy.get("a").status == "completed"
    released = policy.begin("b", {"x": 1})
    assert released.release() is True and policy.get("b") is None
    policy.store.cache(policy.get("a"), 10)  # the database store's cache copy
    assert policy.get("a").payload == '{"ok": 1}'
    # The heartbeat's renewal (issue 24): records in two slots, one round trip, owner-checked.
    first, second = policy.begin("d", {"x": 1}), policy.begin("e", {"x": 1})
    items = [
        (first.key, first.owner, 30.0),
        (second.key, "not-the-owner", 30.0),
        (second.key, second.owner, 30.0),
        (policy.key("a"), "not-the-owner", 30.0),  # completed: never extended
    ]
    assert policy.store.extend_many(items) == [True, False, True, False]
    assert 0 < topology.admin.pttl(policy.store.redis_key(first.key)) <= 30_000
    assert first.release() is True and second.release() is True
    ours(topology)
    assert policy.invalidate("a") is True and policy.get("a") is None
    if topology.name == "acl":  # the user's keys are <prefix>:* only
        client = topology.store.client
        other = Idempotency("tests.topologies", client=client, secret=SECRET, prefix="other")
        with pytest.raises(LockStoreMisconfigured):
            other.begin("c", {})


# -- every gate of one task --------------------------------------------------------------------

GATED_BREAKER = CircuitBreaker(
    "topo-gated", failure_threshold=2, window=4, recovery_timeout=30, app=celery_app
)
GATED_RUNS: list = []


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.topologies.gated",
    lock_key="topo-gated:{n}",
    idempotency_key="topo-gated:{n}",
    circuit_breaker=GATED_BREAKER,
    concurrency_limit=1,
    cluster_rate_limit="5/h",
    lock_retry_max=0,
)
def gated(self, n):
    GATED_RUNS.append(n)
    return {"n": n, "fence": self.lease.fence, "slot": current_slot().index}


def test_a_task_passes_every_gate_then_replays(topology, app):
    GATED_RUNS.clear()
    first = gated.apply(args=(1,))
    assert first.successful(), first.traceback
    assert first.result["n"] == 1 and first.result["slot"] == 0 and first.result["fence"] > 0
    replayed = gated.apply(args=(1,))  # the first gate: the recorded result, no other gate
    assert replayed.successful(), replayed.traceback
    assert replayed.result == first.result
    second = gated.apply(args=(2,))
    assert second.successful(), second.traceback
    assert second.result["n"] == 2 and second.result["slot"] == 0
    assert GATED_RUNS == [1, 2]
    store = topology.store
    assert store.inspect("topo-gated:1") is None and store.inspect("topo-gated:2") is None
    keys = ours(topology)
    [log] = [k for k in keys if ":rate:" in k and topology.admin.type(k) == "zset"]
    assert topology.admin.zcard(log) == 2  # two executions admitted; the replay took none
    assert not [k for k in keys if ":lease:" in k]  # the leases and the slots released
    # The breaker gate reads the same store: forced open there, it refuses the next run.
    assert GATED_BREAKER.override("open") == (CLOSED, False)
    assert topology.admin.exists(GATED_BREAKER.key) == 1
    refused = gated.apply(args=(3,))
    assert isinstance(refused.result, CircuitOpen), refused.result  # lock_retry_max=0
    assert refused.result.context["forced"] is True and GATED_RUNS == [1, 2]
