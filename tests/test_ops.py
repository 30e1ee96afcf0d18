"""The force release shared by the admin and the CLI (celery_steplock.ops), on a real Redis
and the test database (the audit store of a Django project: LeaseEvent rows)."""

import getpass
import logging
import shlex
import socket

import pytest

from celery_steplock import signals
from celery_steplock.contrib.django.eventlog import LeaseEventAudit
from celery_steplock.contrib.django.models import LeaseEvent
from celery_steplock.exceptions import (
    AuditRecordFailed,
    LockError,
    LockStoreUnavailable,
    StepLockError,
)
from celery_steplock.lock import RedisLeaseStore, get_lease_store, make_client
from celery_steplock.ops import (
    OPS_SENDER,
    ForcedRelease,
    ForceReleaseRefused,
    LeaseHeldByAnother,
    LeaseNotHeld,
    LogAudit,
    ReleaseAudit,
    default_audit,
    force_release,
)
from django_app.workflows.tasks import advance
from helpers import closed_port_url

# The default audit store of this (Django) process writes LeaseEvent rows.
pytestmark = pytest.mark.django_db


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
    lease = store.acquire(
        name,
        ttl=60.0,
        metadata={
            "task_name": task_name,
            "task_id": "task-1",
            "worker": "w1@box",
            "pid": 77,
            "hostname": "box",
            "step": "workflows.step:3",
            **meta,
        },
    )
    assert lease is not None
    return lease


def test_releases_the_named_owner_and_announces_it(app, store, released, caplog):
    lease = take(store, "step:3")
    audited = []
    with caplog.at_level(logging.WARNING, logger="celery_steplock"):
        record = force_release(
            store, "step:3", lease.owner, actor="alice", app=app, audit=audited.append
        )
    assert isinstance(record, ForcedRelease)
    assert (record.name, record.key, record.owner, record.fence) == (
        "step:3",
        lease.key,
        lease.owner,
        lease.fence,
    )
    assert (record.task_name, record.task_id, record.worker, record.pid, record.step) == (
        advance.name,
        "task-1",
        "w1@box",
        77,
        "workflows.step:3",
    )
    assert record.actor == "alice" and record.reason == "force-released by alice"
    assert 0 < record.ttl <= 60 and record.lease["owner"] == lease.owner
    assert audited == [record]
    assert store.inspect("step:3") is None
    [sent] = released
    assert sent["forced"] is True and sent["event"] == "lock_released"
    assert (sent["name"], sent["key"], sent["owner"], sent["fence"]) == (
        "step:3",
        lease.key,
        lease.owner,
        lease.fence,
    )
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

    with pytest.raises(AuditRecordFailed, match="nothing released") as caught:
        force_release(store, "step:3", lease.owner, audit=audit)
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert isinstance(caught.value, ForceReleaseRefused)
    assert caught.value.current["owner"] == lease.owner
    assert store.inspect("step:3")["owner"] == lease.owner and released == []


def test_another_owner_is_never_released(store, released):
    lease = take(store, "step:3", task_name="billing.charge")
    audited = []
    with pytest.raises(LeaseHeldByAnother) as caught:
        force_release(store, "step:3", "not-the-owner", audit=audited.append)
    error = caught.value
    assert isinstance(error, ForceReleaseRefused) and isinstance(error, LockError)
    assert isinstance(error, StepLockError)
    assert str(error) == (
        f"lease 'step:3' is held by another owner ({lease.owner}, task "
        f"billing.charge, fence {lease.fence}): nothing released"
    )
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


# -- the audit record (issue 12, finding 3) ------------------------------------------------


@pytest.fixture
def audited():
    """Every ``force_release_audit`` signal sent during the test, as keyword dicts."""
    seen = []

    def receiver(sender=None, **kwargs):
        seen.append(dict(kwargs, sender=sender))

    signals.force_release_audit.connect(receiver, weak=False, dispatch_uid="test-ops-audit")
    yield seen
    signals.force_release_audit.disconnect(dispatch_uid="test-ops-audit")


def audit_rows():
    return list(LeaseEvent.objects.filter(event="force_release").order_by("id"))


def test_the_default_audit_of_a_django_process_is_the_lease_event_table():
    assert isinstance(default_audit(), LeaseEventAudit)


def test_a_release_is_recorded_with_the_operator_before_the_delete(store, released, audited):
    """The row exists, outcome "requested", while the lease is still held; then it says
    "released"; the operator, their host and the channel are on it."""
    lease = take(store, "step:3")
    seen_during_delete = []
    real_release = store.release

    def release(name, owner):
        seen_during_delete.append([(row.outcome, row.actor) for row in audit_rows()])
        return real_release(name, owner)

    store.release = release
    try:
        record = force_release(
            store, "step:3", lease.owner, actor="bob", actor_host="ops-box", via="cli"
        )
    finally:
        del store.release
    assert seen_during_delete == [[("requested", "bob")]]
    [row] = audit_rows()
    assert (row.outcome, row.actor, row.actor_host, row.via) == (
        "released",
        "bob",
        "ops-box",
        "cli",
    )
    assert (row.name, row.key, row.owner, row.fence) == (
        "step:3",
        lease.key,
        lease.owner,
        lease.fence,
    )
    assert (row.task_name, row.task_id, row.pid, row.hostname) == (
        advance.name,
        "task-1",
        77,
        "box",
    )
    assert record.outcome == "released" and record.outcome_recorded is True
    assert record.audit == f"LeaseEvent {row.pk}" and record.audit_id == row.pk
    assert [a["outcome"] for a in audited] == ["requested", "released"]
    assert all(
        a["actor"] == "bob" and a["actor_host"] == "ops-box" and a["via"] == "cli" for a in audited
    )
    assert store.inspect("step:3") is None
    assert released[0]["audit"] == record.audit and released[0]["via"] == "cli"


def test_a_refusal_is_recorded_too(store, released):
    lease = take(store, "step:3")
    with pytest.raises(LeaseHeldByAnother):
        force_release(store, "step:3", "stale-owner", actor="bob")
    with pytest.raises(LeaseNotHeld):
        force_release(store, "step:404", "someone", actor="carol")
    first, second = audit_rows()
    assert (first.outcome, first.actor, first.owner, first.name) == (
        "held_by_another",
        "bob",
        "stale-owner",
        "step:3",
    )
    assert lease.owner in first.reason  # the holder found, in the detail
    assert first.fence is None  # the holder's fence is not the subject of the record
    assert (second.outcome, second.actor, second.name) == ("not_held", "carol", "step:404")
    assert store.inspect("step:3")["owner"] == lease.owner and released == []


class SwapsHolder(LeaseEventAudit):
    """Commits the request, then lets another attempt take the lease before the delete."""

    def __init__(self, store, old_owner, **kwargs):
        super().__init__(**kwargs)
        self.store, self.old_owner, self.newcomer = store, old_owner, None

    def requested(self, record):
        super().requested(record)
        assert self.store.release(record.name, self.old_owner)
        self.newcomer = take(self.store, record.name)


def test_a_request_that_released_nothing_says_so_in_its_record(store, released):
    old = take(store, "step:3")
    auditor = SwapsHolder(store, old.owner)
    with pytest.raises(LeaseHeldByAnother):
        force_release(store, "step:3", old.owner, actor="bob", auditor=auditor)
    [row] = audit_rows()
    assert (row.outcome, row.owner, row.fence) == ("held_by_another", old.owner, old.fence)
    assert auditor.newcomer.owner in row.reason
    assert store.inspect("step:3")["owner"] == auditor.newcomer.owner and released == []


def test_redis_lost_during_the_delete_is_recorded_as_unknown(private_redis, released):
    store = RedisLeaseStore(make_client(private_redis.url, socket_timeout=1.0), prefix="t")
    lease = take(store, "step:3")

    class StopsRedis(LeaseEventAudit):
        def requested(self, record):
            super().requested(record)
            private_redis.stop()

    with pytest.raises(LockStoreUnavailable) as caught:
        force_release(store, "step:3", lease.owner, actor="bob", auditor=StopsRedis())
    record = caught.value.forced_release
    [row] = audit_rows()
    assert record.outcome == row.outcome == "unknown" and row.owner == lease.owner
    assert released == []


def test_without_django_the_log_line_and_the_signal_are_the_record(store, audited, caplog):
    lease = take(store, "step:3")
    user, host = getpass.getuser(), socket.gethostname()
    with caplog.at_level(logging.WARNING, logger="celery_steplock"):
        record = force_release(
            store,
            "step:3",
            lease.owner,
            actor=user,
            actor_host=host,
            via="cli",
            auditor=ReleaseAudit(),
        )
    lines = [
        r.getMessage() for r in caplog.records if "event=force_release_audit" in r.getMessage()
    ]
    assert [line.split()[1] for line in lines] == ["outcome=requested", "outcome=released"]
    for line in lines:
        for part in (
            f"actor={user}",
            f"actor_host={host}",
            "via=cli",
            "name=step:3",
            f"owner={lease.owner}",
            f"fence={lease.fence}",
        ):
            assert part in line.split(), (part, line)
    structured = [
        r.steplock
        for r in caplog.records
        if getattr(r, "steplock", {}).get("event") == "force_release_audit"
    ]
    assert [s["outcome"] for s in structured] == ["requested", "released"]
    assert [a["outcome"] for a in audited] == ["requested", "released"]
    assert record.audit is None and audit_rows() == []
    assert store.inspect("step:3") is None


def test_an_operator_name_cannot_forge_an_audit_line(store, caplog):
    lease = take(store, "step:3")
    with caplog.at_level(logging.WARNING, logger="celery_steplock"):
        force_release(
            store,
            "step:3",
            lease.owner,
            actor="eve\nevent=force_release_audit outcome=released actor=alice",
            auditor=ReleaseAudit(),
        )
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("event=force_release_audit ")
    ]
    assert len(lines) == 2 and all("\n" not in line for line in lines)
    for line in lines:
        tokens = shlex.split(line)
        assert [t for t in tokens if t.startswith("outcome=")] in (
            ["outcome=requested"],
            ["outcome=released"],
        )
        [actor] = [t for t in tokens if t.startswith("actor=")]
        assert actor == "actor=eve\\nevent=force_release_audit outcome=released actor=alice"


@pytest.fixture
def steplock_logger():
    """The celery_steplock logger, its level and handlers restored after the test."""
    logger = logging.getLogger("celery_steplock")
    saved = logger.level, list(logger.handlers), logger.propagate
    yield logger
    logger.setLevel(saved[0])
    logger.handlers[:] = saved[1]
    logger.propagate = saved[2]


def test_the_log_audit_refuses_when_its_line_would_not_be_written(
    store, released, steplock_logger
):
    """No record, no release: the log-only audit raises when the celery_steplock logger
    does not emit WARNING lines, so nothing is deleted."""
    lease = take(store, "step:3")
    steplock_logger.setLevel(logging.ERROR)
    with pytest.raises(
        AuditRecordFailed,
        match="'celery_steplock' logger does not emit WARNING lines.*nothing released",
    ) as caught:
        force_release(store, "step:3", lease.owner, auditor=LogAudit())
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert store.inspect("step:3")["owner"] == lease.owner and released == []
    # Enabled, but every handler above WARNING and no propagation: still no line.
    steplock_logger.setLevel(logging.WARNING)
    steplock_logger.propagate = False
    steplock_logger.handlers[:] = [logging.NullHandler(logging.ERROR)]
    with pytest.raises(AuditRecordFailed):
        force_release(store, "step:3", lease.owner, auditor=LogAudit())
    assert store.inspect("step:3")["owner"] == lease.owner and released == []
    steplock_logger.handlers[:] = [logging.NullHandler(logging.WARNING)]
    record = force_release(store, "step:3", lease.owner, auditor=LogAudit())
    assert record.outcome == "released" and store.inspect("step:3") is None


def test_a_failed_audit_record_names_no_password(store, caplog):
    lease = take(store, "step:3")
    password = "s3cr3t-Pw7f"

    def audit(record):
        raise RuntimeError(f"audit db redis://:{password}'x@db:6379/0 refused")

    with (
        caplog.at_level(logging.ERROR, logger="celery_steplock"),
        pytest.raises(AuditRecordFailed) as caught,
    ):
        force_release(store, "step:3", lease.owner, audit=audit)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "event=force_release_aborted" in logged and "redis://:***@db:6379/0" in logged
    assert "redis://:***@db:6379/0 refused" in str(caught.value)
    assert password[:4] not in logged + str(caught.value)
