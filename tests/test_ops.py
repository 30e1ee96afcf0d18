"""The force release shared by the admin and the CLI (celery_steplock.ops), on a real Redis."""
import logging

import pytest

from celery_steplock import signals
from celery_steplock.exceptions import LockError, LockStoreUnavailable, StepLockError
from celery_steplock.lock import RedisLeaseStore, get_lease_store, make_client
from celery_steplock.ops import (OPS_SENDER, ForcedRelease, ForceReleaseRefused,
                                 LeaseHeldByAnother, LeaseNotHeld, force_release)
from django_app.workflows.tasks import advance
from helpers import closed_port_url


@pytest.fixture
def store(app, redis_client):
    return get_lease_store(app)


@pytest.fixture
def released():
    seen = []

    def receiver(sender=None, **kwargs):
        seen.append(dict(kwargs, sender=sender))

    signals.lock_released.connect(receiver, weak=False, dispatch_uid="test-ops-released")
    yield seen
    signals.lock_released.disconnect(dispatch_uid="test-ops-released")


def take(store, name, task_name=advance.name, **meta):
    lease = store.acquire(name, ttl=60.0, metadata={
        "task_name": task_name, "task_id": "task-1", "worker": "w1@box", "pid": 77,
        "hostname": "box", "step": "workflows.step:3", **meta})
    assert lease is not None
    return lease


def test_releases_the_named_owner_and_announces_it(app, store, released, caplog):
    lease = take(store, "step:3")
    audited = []
    with caplog.at_level(logging.WARNING, logger="celery_steplock"):
        record = force_release(store, "step:3", lease.owner, actor="alice", app=app,
                               audit=audited.append)
    assert isinstance(record, ForcedRelease)
    assert (record.name, record.key, record.owner, record.fence) == (
        "step:3", lease.key, lease.owner, lease.fence)
    assert (record.task_name, record.task_id, record.worker, record.pid, record.step) == (
        advance.name, "task-1", "w1@box", 77, "workflows.step:3")
    assert record.actor == "alice" and record.reason == "force-released by alice"
    assert 0 < record.ttl <= 60 and record.lease["owner"] == lease.owner
    assert audited == [record]
    assert store.inspect("step:3") is None
    [sent] = released
    assert sent["forced"] is True and sent["event"] == "lock_released"
    assert (sent["name"], sent["key"], sent["owner"], sent["fence"]) == (
        "step:3", lease.key, lease.owner, lease.fence)
    assert sent["sender"] is app.tasks[advance.name]  # per-task receivers fire
    assert sent["user"] == "alice" and sent["ttl"] == 60.0
    [line] = [r.getMessage() for r in caplog.records if "event=lock_released" in r.getMessage()]
    assert f"key={lease.key}" in line and f"owner={lease.owner}" in line
    assert "forced=True" in line and 'reason="force-released by alice"' in line


def test_the_audit_record_comes_before_the_release(store, released):
    lease = take(store, "step:3")
    holders = []

    def audit(record):
        holders.append(store.inspect("step:3")["owner"])  # still held while the record is made

    force_release(store, "step:3", lease.owner, audit=audit)
    assert holders == [lease.owner] and store.inspect("step:3") is None


def test_a_failing_audit_releases_nothing(store, released):
    lease = take(store, "step:3")

    def audit(record):
        raise RuntimeError("no database")

    with pytest.raises(RuntimeError, match="no database"):
        force_release(store, "step:3", lease.owner, audit=audit)
    assert store.inspect("step:3")["owner"] == lease.owner and released == []


def test_another_owner_is_never_released(store, released):
    lease = take(store, "step:3", task_name="billing.charge")
    audited = []
    with pytest.raises(LeaseHeldByAnother) as caught:
        force_release(store, "step:3", "not-the-owner", audit=audited.append)
    error = caught.value
    assert isinstance(error, ForceReleaseRefused) and isinstance(error, LockError)
    assert isinstance(error, StepLockError)
    assert str(error) == (f"lease 'step:3' is held by another owner ({lease.owner}, task "
                          f"billing.charge, fence {lease.fence}): nothing released")
    assert (error.name, error.key, error.owner) == ("step:3", lease.key, "not-the-owner")
    assert error.holder == lease.owner and error.current["owner"] == lease.owner
    assert error.fence == lease.fence
    assert store.inspect("step:3")["owner"] == lease.owner
    assert audited == [] and released == []


def test_a_lease_not_held_is_refused(store, released):
    with pytest.raises(LeaseNotHeld) as caught:
        force_release(store, "step:404", "someone")
    assert str(caught.value) == "lease 'step:404' is not held: nothing released"
    assert caught.value.name == "step:404" and caught.value.current is None
    assert released == []


def test_a_holder_that_changes_after_the_record_is_spared(store, released):
    """The compare-and-delete decides: the holder is replaced between the read and the
    delete (here, inside the audit hook); the newcomer keeps its lease, and the refusal lets
    the caller's transaction roll the record back."""
    old = take(store, "step:3")
    newcomer = []

    def audit(record):
        assert store.release("step:3", old.owner)
        newcomer.append(take(store, "step:3"))

    with pytest.raises(LeaseHeldByAnother) as caught:
        force_release(store, "step:3", old.owner, audit=audit)
    [new] = newcomer
    assert caught.value.holder == new.owner
    assert store.inspect("step:3")["owner"] == new.owner and released == []


def test_defer_holds_the_event_until_called(store, released):
    lease = take(store, "step:3")
    pending = []
    record = force_release(store, "step:3", lease.owner, defer=pending.append)
    assert store.inspect("step:3") is None and released == []
    [send] = pending
    send()
    [sent] = released
    assert sent["owner"] == record.owner and sent["forced"] is True
    # without an app the sender is the lease's task name, else the ops sender
    assert sent["sender"] == advance.name
    bare = store.acquire("bare", ttl=60.0)
    force_release(store, "bare", bare.owner)
    assert released[-1]["sender"] == OPS_SENDER and released[-1]["task_name"] is None


def test_redis_unreachable_names_the_lease():
    store = RedisLeaseStore(make_client(closed_port_url(), socket_timeout=0.5))
    with pytest.raises(LockStoreUnavailable) as caught:
        force_release(store, "step:3", "someone")
    assert "'step:3'" in str(caught.value)


def test_a_key_that_is_not_a_lease_is_refused_not_released(store, redis_client):
    redis_client.set(store.key("odd"), "x")
    with pytest.raises(LockError) as caught:
        force_release(store, "odd", "someone")
    assert "'odd'" in str(caught.value)
    assert redis_client.get(store.key("odd")) == "x"
