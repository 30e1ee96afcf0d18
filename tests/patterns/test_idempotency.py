"""Idempotency records (celery_steplock.patterns.idempotency) on a real Redis: the decorator and the
plain API, the record's life (locked, completed, failed, expiry, invalidation), the key's
parts (namespace, resource, version), concurrent first calls, outages, and the task option
as the first admission gate."""

import threading
import time

import pytest
from kombu.serialization import dumps

from celery_steplock import patterns
from celery_steplock.patterns import idempotency
from celery_steplock import signals
from celery_steplock.exceptions import (
    IdempotencyError,
    IdempotencyInProgress,
    IdempotencyKeyReused,
    ImproperlyConfigured,
    LockStoreUnavailable,
    StepLockError,
)
from celery_steplock.patterns.idempotency import Idempotency, RedisRecords, idempotent, record_key
from celery_steplock.heartbeat import get_heartbeat
from celery_steplock.lock import make_client
from celery_steplock.task import StepLockedTask
from django_app.celery import app as celery_app
from django_app.workflows.models import Step
from tests.helpers import set_settings
from tests.support.idempotency import seen  # noqa: F401 - the fixture

SECRET = "s" * 40


def make(redis_client, **kwargs):
    calls = []

    @idempotent(
        key=kwargs.pop("key", "order:{order_id}"),
        client=redis_client,
        secret=SECRET,
        namespace=kwargs.pop("namespace", "tests.charge"),
        **kwargs,
    )
    def charge(order_id, amount, fail=False):
        calls.append((order_id, amount))
        if fail:
            raise ValueError("declined")
        return {"order": order_id, "charged": amount, "call": len(calls)}

    return charge, calls


pytestmark_nodb = pytest.mark.no_database


@pytest.mark.no_database
def test_a_completed_call_replays_its_result_without_running(redis_client, seen):
    charge, calls = make(redis_client)
    first = charge(1, 10)
    again = charge(1, 10)
    assert first == again == {"order": 1, "charged": 10, "call": 1}
    assert calls == [(1, 10)]
    assert [name for name, _ in seen] == [
        "idempotency_locked",
        "idempotency_completed",
        "idempotency_replayed",
    ]
    key = charge.record_key(1, 10)
    assert all(kw["key"] == key and kw["name"] == "tests.charge" for _, kw in seen)
    record = charge.idempotency.store.get(key)
    assert record.status == "completed" and record.serializer == "json"
    assert record.content_type == "application/json"
    assert record.fingerprint == idempotency.fingerprint(
        {"order_id": 1, "amount": 10, "fail": False}, secret=SECRET
    )
    assert record.created_at <= record.completed_at < record.expires_at
    assert record.expires_at - record.completed_at == pytest.approx(24 * 3600, abs=0.01)
    assert record.attempts == 1 and record.owner is None
    # Neither the arguments nor the resource key appear in Redis: only hashes and the result.
    dumped = redis_client.hgetall(charge.idempotency.store.redis_key(key))
    stored = "".join(str(x) for x in list(dumped) + list(dumped.values()))
    assert "order:1" not in stored and "fp" in stored


@pytest.mark.no_database
def test_an_error_is_never_recorded_and_the_call_runs_again(redis_client, seen):
    charge, calls = make(redis_client)
    with pytest.raises(ValueError):
        charge(2, 10, fail=True)
    record = charge.idempotency.store.get(charge.record_key(2, 10, fail=True))
    assert record.status == "failed" and record.error == "ValueError"
    assert record.payload is None
    with pytest.raises(ValueError):
        charge(2, 10, fail=True)  # failed: runs again (and fails again)
    assert len(calls) == 2
    assert [n for n, _ in seen].count("idempotency_failed") == 2
    # A failed record binds no arguments: the same key with others runs and completes.
    assert charge(2, 10) == {"order": 2, "charged": 10, "call": 3}
    assert charge(2, 10)["call"] == 3
    assert charge.idempotency.store.get(charge.record_key(2, 10)).attempts == 3


@pytest.mark.no_database
def test_an_unserializable_result_is_not_recorded_and_says_so(redis_client, seen):
    calls = []

    @idempotent(key="obj:{n}", client=redis_client, secret=SECRET, namespace="tests.obj")
    def build(n):
        calls.append(n)
        return object()  # JSON cannot encode it

    build(1)
    build(1)
    assert calls == [1, 1]  # nothing recorded: the body runs again
    record = build.idempotency.store.get(build.record_key(1))
    assert record.status == "failed" and record.error == "unserializable"
    failed = [kw for name, kw in seen if name == "idempotency_failed"]
    assert [kw["reason"] for kw in failed] == ["unserializable", "unserializable"]


@pytest.mark.no_database
def test_a_result_above_max_result_bytes_is_not_recorded(redis_client, seen):
    calls = []

    @idempotent(
        key="big:{n}",
        client=redis_client,
        secret=SECRET,
        namespace="tests.big",
        max_result_bytes=2048,
    )
    def export(n):
        calls.append(n)
        return "x" * (4096 if n else 10)

    assert export(0) == export(0) == "x" * 10 and calls == [0]  # small: recorded, replayed
    assert len(export(1)) == len(export(1)) == 4096
    assert calls == [0, 1, 1]  # too large: never written, the key runs again
    record = export.idempotency.store.get(export.record_key(1))
    assert record.status == "failed" and record.error == "too_large"
    assert record.payload is None
    assert [kw["reason"] for n, kw in seen if n == "idempotency_failed"] == ["too_large"] * 2
    with pytest.raises(ImproperlyConfigured) as caught:
        idempotent(key="k", client=redis_client, secret=SECRET, max_result_bytes=10)(len)("x")
    assert caught.value.setting == "max_result_bytes"


@pytest.mark.no_database
def test_a_key_reused_with_other_arguments_is_refused(redis_client, seen):
    charge, calls = make(redis_client)
    charge(3, 10)
    with pytest.raises(IdempotencyKeyReused) as info:
        charge(3, 99)
    assert isinstance(info.value, IdempotencyError) and isinstance(info.value, StepLockError)
    assert info.value.key == charge.record_key(3, 10) and info.value.version == "1"
    assert calls == [(3, 10)]
    conflict = [kw for n, kw in seen if n == "idempotency_conflict"]
    assert conflict[0]["reason"] == "reused" and conflict[0]["current"] == "completed"


@pytest.mark.no_database
def test_a_version_bump_runs_again(redis_client):
    v1, calls1 = make(redis_client, version="1")
    v2, calls2 = make(redis_client, version=2)
    assert v1(4, 10)["call"] == 1
    assert v2(4, 10)["call"] == 1  # another key: v1's result is never replayed
    assert v1.record_key(4, 10) != v2.record_key(4, 10)
    assert v2(4, 10)["call"] == 1 and calls2 == [(4, 10)]
    assert v1(4, 10)["call"] == 1 and calls1 == [(4, 10)]


@pytest.mark.no_database
def test_the_key_is_deterministic_and_binds_every_part():
    key = record_key("ns", "order:1", "1", secret=SECRET)
    assert key == record_key("ns", "order:1", 1, secret=SECRET)
    assert len(key) == 64 and int(key, 16) >= 0
    others = {
        record_key("ns2", "order:1", "1", secret=SECRET),
        record_key("ns", "order:2", "1", secret=SECRET),
        record_key("ns", "order:1", "2", secret=SECRET),
        record_key("ns", "order:1", "1", secret="t" * 40),
    }
    assert key not in others and len(others) == 4


@pytest.mark.no_database
def test_invalidate_lets_the_call_run_again(redis_client):
    charge, calls = make(redis_client)
    charge(5, 10)
    assert charge.invalidate(5, 10) is True
    assert charge.invalidate(5, 10) is False
    assert charge(5, 10)["call"] == 2
    key = charge.record_key(5, 10)
    assert idempotency.invalidate(key, client=redis_client) is True
    assert charge(5, 10)["call"] == 3


@pytest.mark.no_database
def test_a_completed_record_expires_after_its_ttl(redis_client):
    charge, calls = make(redis_client, ttl=0.3)
    charge(6, 10)
    assert charge(6, 10)["call"] == 1
    pttl = redis_client.pttl(charge.idempotency.store.redis_key(charge.record_key(6, 10)))
    assert 0 < pttl <= 300
    time.sleep(0.4)
    assert charge(6, 10)["call"] == 2


@pytest.mark.no_database
def test_a_concurrent_holder_refuses_with_in_progress_and_a_crashed_lock_expires(redis_client):
    policy = Idempotency("tests.held", client=redis_client, secret=SECRET, lock_ttl=0.5)
    held = policy.begin("r", {"a": 1})
    assert not held.replayed and held.owner
    with pytest.raises(IdempotencyInProgress) as info:
        policy.begin("r", {"a": 1})
    assert 0 < info.value.retry_after <= 0.5 and info.value.option == "idempotency_key"
    with pytest.raises(IdempotencyKeyReused):  # other arguments while locked: refused too
        policy.begin("r", {"a": 2})
    get_heartbeat().unregister(held.lease)  # the holder "crashed": its heartbeat stops
    time.sleep(0.6)  # and its lock expires
    second = policy.begin("r", {"a": 1})
    assert not second.replayed
    assert held.complete("late") is False  # the old holder no longer owns it
    assert second.complete("on time") is True
    assert policy.begin("r", {"a": 1}).result == "on time"


@pytest.mark.no_database
def test_a_late_completion_is_kept_when_nobody_took_the_expired_lock(redis_client):
    policy = Idempotency("tests.late", client=redis_client, secret=SECRET, lock_ttl=0.2)
    held = policy.begin("r", {"a": 1})
    get_heartbeat().unregister(held.lease)  # a holder stalled past its lock TTL
    time.sleep(0.3)
    assert policy.get("r") is None
    assert held.complete({"done": True}) is True  # the body ran: its result is recorded
    assert policy.begin("r", {"a": 1}).result == {"done": True}


@pytest.mark.no_database
def test_a_body_longer_than_the_lock_ttl_keeps_its_record(redis_client, seen):
    """Issue 24: the heartbeat renews a running body's ``locked`` record, so a second call
    after the lock TTL is refused (in progress, or reused with other arguments) instead of
    running the body again; the record then completes once."""
    lock_ttl = 1.0
    started, finish = threading.Event(), threading.Event()
    calls, results = [], []

    @idempotent(
        key="order:{order_id}",
        client=redis_client,
        secret=SECRET,
        namespace="tests.long",
        lock_ttl=lock_ttl,
    )
    def charge(order_id, amount):
        calls.append((order_id, amount))
        started.set()
        finish.wait(30)
        return {"order": order_id, "charged": amount, "call": len(calls)}

    thread = threading.Thread(target=lambda: results.append(charge(1, 10)))
    thread.start()
    try:
        assert started.wait(10)
        held = charge.idempotency.store.get(charge.record_key(1, 10))
        assert held.status == "locked"
        since = time.monotonic()
        while time.monotonic() - since < 3 * lock_ttl:  # three lock TTLs of a running body
            with pytest.raises(IdempotencyInProgress):
                charge(1, 10)
            with pytest.raises(IdempotencyKeyReused):  # other arguments: refused, not run
                charge(1, 11)
            time.sleep(0.1)
        record = charge.idempotency.store.get(charge.record_key(1, 10))
        assert record.status == "locked" and record.owner == held.owner
        assert record.expires_at > held.expires_at  # renewed, not a new lock
        assert record.attempts == 1
    finally:
        finish.set()
        thread.join(30)
    assert calls == [(1, 10)] and results == [{"order": 1, "charged": 10, "call": 1}]
    assert charge(1, 10) == results[0]
    assert [name for name, _ in seen].count("idempotency_locked") == 1
    assert all(lease.name != held.key for lease in get_heartbeat().leases)  # renewal ended


@pytest.mark.no_database
def test_renewal_is_owner_checked_and_stops_when_the_record_is_taken(redis_client):
    """A renewal extends only its owner's ``locked`` record; a record completed, failed,
    invalidated or held by another owner is left as it is, and once the heartbeat finds it
    so, it sends ``idempotency_lost`` and stops renewing (the holder's thread is never
    interrupted: ``call.lease.lost`` says it)."""
    store = RedisRecords(redis_client, "steplock")
    assert store.begin("k1", "fp", "owner-1", 0.5).outcome == "locked"
    assert store.extend_many([("k1", "owner-1", 30.0)]) == [True]
    assert 29_000 < redis_client.pttl(store.redis_key("k1")) <= 30_000
    assert store.get("k1").expires_at - store.get("k1").locked_at == pytest.approx(30, abs=1)
    # Another owner, a completed, a failed and a missing record: nothing is touched.
    assert store.extend_many([("k1", "owner-2", 300.0)]) == [False]
    assert redis_client.pttl(store.redis_key("k1")) <= 30_000
    stored = idempotency.Stored.dump("done", "json")
    assert store.complete("k1", "owner-1", "fp", stored, 5.0) is True
    assert store.begin("k2", "fp", "owner-1", 5.0).outcome == "locked"
    assert store.fail("k2", "owner-1", "ValueError", 5.0) is True
    replies = store.extend_many(
        [("k1", "owner-1", 300.0), ("k2", "owner-1", 300.0), ("k3", "owner-1", 300.0)]
    )
    assert replies == [False, False, False]
    assert store.get("k1").status == "completed" and store.get("k2").status == "failed"
    assert redis_client.pttl(store.redis_key("k1")) <= 5_000
    assert redis_client.pttl(store.redis_key("k2")) <= 5_000
    assert not redis_client.exists(store.redis_key("k3"))
    assert store.extend_many([]) == []

    lost = []

    def receiver(sender=None, signal=None, **kw):
        lost.append(kw)

    signals.idempotency_lost.connect(receiver, weak=False)
    try:
        policy = Idempotency("tests.taken", client=redis_client, secret=SECRET, lock_ttl=0.3)
        held = policy.begin("r", {"a": 1})
        assert held.lease in get_heartbeat().leases
        policy.invalidate("r")  # an operator deletes it: the next call takes it over
        taker = policy.begin("r", {"a": 1})
        from tests.support.servers import wait_until

        wait_until(lambda: held.lease.lost, timeout=10, what="the renewal to find it taken")
        # The heartbeat marks the lease lost, then sends the signal: wait for both.
        wait_until(lambda: lost, timeout=10, what="idempotency_lost")
        assert held.lease not in get_heartbeat().leases and taker.lease in get_heartbeat().leases
        assert [kw["key"] for kw in lost] == [held.key]
        assert lost[0]["name"] == "tests.taken" and lost[0]["owner"] == held.owner
        assert "another owner" in lost[0]["reason"]
        record = policy.get("r")
        assert record.status == "locked" and record.owner == taker.owner
        assert held.complete("late") is False  # the taker's record is not overwritten
        assert taker.complete("ok") is True
        assert taker.lease not in get_heartbeat().leases
    finally:
        signals.idempotency_lost.disconnect(receiver)
    assert policy.begin("r", {"a": 1}).result == "ok"


@pytest.mark.no_database
def test_concurrent_first_calls_with_one_key_run_the_body_once(redis_client):
    runs = []
    barrier = threading.Barrier(8)

    @idempotent(key="job:{n}", client=redis_client, secret=SECRET, namespace="tests.threads")
    def job(n):
        runs.append(n)
        time.sleep(0.3)
        return n * 2

    outcomes = []

    def call():
        barrier.wait()
        while True:
            try:
                outcomes.append(job(21))
                return
            except IdempotencyInProgress as exc:
                time.sleep(min(exc.retry_after, 0.05))

    threads = [threading.Thread(target=call) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert runs == [21]
    assert outcomes == [42] * 8


@pytest.mark.no_database
def test_the_context_manager_form(redis_client):
    policy = Idempotency("tests.cm", client=redis_client, secret=SECRET)
    with policy.call("refund:1", {"refund": 1}) as call:
        assert not call.replayed
        call.result = ["refunded", 1]
    with policy.call("refund:1", {"refund": 1}) as call:
        assert call.replayed and call.result == ["refunded", 1]
    with pytest.raises(KeyError):
        with policy.call("refund:2", {"refund": 2}):
            raise KeyError("boom")
    assert policy.get("refund:2").status == "failed"


@pytest.mark.no_database
def test_a_planted_pickle_payload_is_never_loaded(redis_client):
    policy = Idempotency("tests.pickle", client=redis_client, secret=SECRET)
    with policy.call("r", {"a": 1}) as call:
        call.result = "ok"
    key = policy.store.redis_key(policy.key("r"))
    content_type, encoding, payload = dumps({"x": 1}, serializer="pickle")
    import base64

    redis_client.hset(
        key,
        mapping={
            "ctype": content_type,
            "cenc": encoding,
            "b64": "1",
            "result": base64.b64encode(payload),
        },
    )
    from kombu.exceptions import ContentDisallowed

    with pytest.raises(ContentDisallowed):
        policy.begin("r", {"a": 1})


@pytest.mark.no_database
def test_the_store_outage_fails_closed_by_default_and_open_when_asked():
    dead = make_client("redis://127.0.0.1:1/0", socket_timeout=0.2)
    closed = Idempotency("tests.outage", client=dead)
    with pytest.raises(LockStoreUnavailable):
        closed.begin("r", {"a": 1})
    opened = Idempotency("tests.outage", client=dead, on_store_error="fail_open")
    ticket = opened.begin("r", {"a": 1})
    assert ticket.unguarded and not ticket.replayed
    assert ticket.complete("x") is False  # nothing to record into


@pytest.mark.no_database
def test_bad_arguments_are_refused_by_name(redis_client):
    for kwargs, name in (
        ({"version": ""}, "version"),
        ({"version": True}, "version"),
        ({"ttl": 0}, "ttl"),
        ({"ttl": "1"}, "ttl"),
        ({"lock_ttl": 1e12}, "lock_ttl"),
        ({"serializer": "nope"}, "serializer"),
        ({"on_store_error": "open"}, "on_store_error"),
        ({"store": "memcached"}, "store"),
    ):
        with pytest.raises(ImproperlyConfigured) as info:
            Idempotency("tests.bad", client=redis_client, **kwargs)
        assert info.value.setting == name, kwargs
    with pytest.raises(ImproperlyConfigured) as info:
        idempotent(key="{x.y}", client=redis_client)
    assert info.value.setting == "key"
    with pytest.raises(ImproperlyConfigured):
        Idempotency("tests.bad")  # neither app nor client


@pytest.mark.no_database
def test_settings_are_validated_by_name(app):
    from celery_steplock.conf import Settings

    for name, value in (
        ("steplock_idempotency_store", "memcached"),
        ("steplock_idempotency_ttl", -1),
        ("steplock_idempotency_lock_ttl", "10"),
        ("steplock_idempotency_serializer", "nope"),
        ("steplock_idempotency_on_store_error", "open"),
    ):
        set_settings(app, **{name: value})
        problems = {p.setting for p in Settings(app).problems()}
        assert name in problems
        set_settings(app, **{name: None})


@pytest.mark.no_database
def test_one_lua_key_per_decision_with_a_hash_tag(redis_client):
    store = RedisRecords(redis_client, "pfx")
    key = record_key("ns", "r", secret=SECRET)
    assert store.redis_key(key) == f"pfx:idem:{{{key}}}"


# -- the task option ----------------------------------------------------------------------------

BODY = []


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.idem.pay",
    lock_key="pay:{order_id}",
    idempotency_key="order:{order_id}",
    lock_retry_max=0,
)
def pay(self, order_id, amount, fail=False):
    BODY.append((order_id, amount))
    if fail:
        raise ValueError("declined")
    return {"paid": amount, "n": len(BODY)}


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.idem.advance",
    lock_key="adv:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
    idempotency_key="advance:{step_id}",
)
def advance(self, step_id):
    BODY.append(step_id)
    return {"advanced": step_id}


@pytest.fixture
def body():
    BODY.clear()
    yield BODY
    BODY.clear()


@pytest.mark.django_db(transaction=True)
def test_the_task_option_replays_and_is_the_first_gate(app, redis_client, body, seen):
    assert patterns.GATES[0] == "celery_steplock.patterns.idempotency"
    assert pay.apply(args=(1, 10)).get() == {"paid": 10, "n": 1}
    assert pay.apply(args=(1, 10)).get() == {"paid": 10, "n": 1}
    assert body == [(1, 10)]
    assert seen[-1][0] == "idempotency_replayed" and seen[-1][1]["task_name"] == pay.name
    result = pay.apply(args=(1, 11))
    assert isinstance(result.result, IdempotencyKeyReused) and body == [(1, 10)]


@pytest.mark.django_db(transaction=True)
def test_a_failed_task_runs_again_and_a_version_bump_too(app, redis_client, body):
    assert pay.apply(args=(2, 10), kwargs={"fail": True}).failed()
    assert pay.apply(args=(2, 10)).get() == {"paid": 10, "n": 2}
    pay.idempotency_version = "2"
    try:
        assert pay.apply(args=(2, 10)).get() == {"paid": 10, "n": 3}
        assert pay.apply(args=(2, 10)).get() == {"paid": 10, "n": 3}
    finally:
        del pay.idempotency_version
    assert pay.apply(args=(2, 10)).get() == {"paid": 10, "n": 2}  # v1's record still stands
    assert len(body) == 3


@pytest.mark.django_db(transaction=True)
def test_the_task_records_after_commit_and_replays_without_the_step(app, redis_client, body):
    step = Step.objects.create(status="pending")
    assert advance.apply(args=(step.pk,)).get() == {"advanced": step.pk}
    assert Step.objects.get(pk=step.pk).status == "done"
    Step.objects.filter(pk=step.pk).update(status="pending")  # a replay does not look at it
    assert advance.apply(args=(step.pk,)).get() == {"advanced": step.pk}
    assert body == [step.pk]
    assert Step.objects.get(pk=step.pk).status == "pending"


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_commit_is_not_recorded(app, redis_client, body, monkeypatch):
    step = Step.objects.create(status="pending")

    def refuse(self, lease, step_id):
        raise RuntimeError("before_commit refused")

    monkeypatch.setattr(type(celery_app.tasks[advance.name]), "before_commit", refuse)
    assert advance.apply(args=(step.pk,)).failed()
    monkeypatch.undo()
    policy = advance.steplock_plan.gates[0].policy
    assert policy.get(f"advance:{step.pk}").status == "failed"
    assert advance.apply(args=(step.pk,)).get() == {"advanced": step.pk}
    assert body == [step.pk, step.pk]


@pytest.mark.django_db(transaction=True)
def test_an_in_progress_key_re_queues_the_task(app, redis_client, body):
    policy = pay.steplock_plan.gates[0].policy
    held = policy.begin("order:3", {"order_id": 3, "amount": 10, "fail": False})
    result = pay.apply(args=(3, 10))
    assert isinstance(result.result, IdempotencyInProgress)  # lock_retry_max=0: no budget
    assert result.result.retry_after <= idempotency.IN_PROGRESS_RETRY and body == []
    held.complete({"paid": 10, "n": 0})
    assert pay.apply(args=(3, 10)).get() == {"paid": 10, "n": 0}


def test_bad_task_options_are_reported_by_name(app):
    from celery import Celery

    from celery_steplock import plan as plan_module

    # An app of its own: the example app's registry is validated whole by other tests.
    private = Celery("tests-idem-bad", set_as_current=False)
    private.conf.broker_url = app.conf.broker_url

    def echo(self, x):
        return x

    for option, value in (
        ("idempotency_key", 42),
        ("idempotency_key", "{nope}"),
        ("idempotency_version", ""),
        ("idempotency_ttl", 0),
    ):
        task = private.task(
            bind=True,
            base=StepLockedTask,
            shared=False,
            name=f"tests.idem.bad.{option}.{value!r}",
            **({"idempotency_key": "k"} if option != "idempotency_key" else {}),
            **{option: value},
        )(echo)
        problems = plan_module.option_problems(task)
        assert [p.setting for p in problems] == [option], (option, value, problems)


@pytest.mark.no_database
def test_prometheus_counts_the_decisions(redis_client):
    from prometheus_client import CollectorRegistry

    from celery_steplock.contrib.prometheus import Metrics

    registry = CollectorRegistry()
    metrics = Metrics(registry=registry)
    sigs = (
        signals.idempotency_locked,
        signals.idempotency_replayed,
        signals.idempotency_completed,
        signals.idempotency_failed,
        signals.idempotency_conflict,
    )
    for sig in sigs:
        sig.connect(metrics.receive, weak=False)
    try:
        charge, _ = make(redis_client, namespace="tests.metrics")
        charge(1, 1)
        charge(1, 1)
        with pytest.raises(IdempotencyKeyReused):
            charge(1, 2)
    finally:
        for sig in sigs:
            sig.disconnect(metrics.receive)

    def value(outcome):
        return registry.get_sample_value(
            "steplock_idempotency_total", {"namespace": "tests.metrics", "outcome": outcome}
        )

    assert [value(o) for o in ("locked", "completed", "replayed", "reused")] == [1, 1, 1, 1]
    assert (
        registry.get_sample_value("steplock_outcomes_total", {"task": "", "outcome": "replayed"})
        == 1
    )
