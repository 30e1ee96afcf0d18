"""Models of celery_steplock.contrib.django: migrations, the Lease pseudo-model, the optional
lease event log (LeaseEvent, written after commit) and its retention clean-up."""

from __future__ import annotations

import datetime as dt
import io
import time

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import transaction
from django.utils import timezone

from celery_steplock import signals
from celery_steplock.contrib.django import eventlog
from celery_steplock.contrib.django.eventlog import prune_lease_events
from celery_steplock.contrib.django.models import Lease, LeaseEvent
from celery_steplock.events import emit
from celery_steplock.exceptions import ImproperlyConfigured
from django_app.workflows.models import Step
from django_app.workflows.tasks import advance
from tests.helpers import set_settings


@pytest.mark.django_db
def test_migrations_are_complete():
    # Exits with status 1 when a model change has no migration.
    call_command("makemigrations", "celery_steplock", "--check", "--dry-run", stdout=io.StringIO())


def test_lease_is_an_unmanaged_pseudo_model():
    opts = Lease._meta
    assert not opts.managed and opts.default_permissions == ("view",)
    assert ("force_release_lease", "Can force-release a held lease") in opts.permissions
    assert str(opts.verbose_name) == "held lease"
    lease = Lease.from_redis(
        {
            "name": "step:1",
            "key": "steplock:lease:{step:1}",
            "owner": "abc",
            "fence": "17",
            "task_id": "t1",
            "task_name": "x.y",
            "hostname": "box",
            "pid": "42",
            "retries": "0",
            "worker": "w1@box",
            "step": "workflows.step:1",
            "acquired_ms": "1700000000000",
            "renewed_ms": "1700000005000",
            "ttl_ms": "30000",
            "ttl": 12.5,
        },
        now_ms=1700000010000,
    )
    assert (lease.pk, lease.fence, lease.pid, lease.lease_ttl) == ("step:1", 17, 42, 30.0)
    assert lease.acquired_at == dt.datetime(2023, 11, 14, 22, 13, 20, tzinfo=dt.timezone.utc)
    assert (lease.age, lease.since_renewal, lease.ttl_left) == (10.0, 5.0, 12.5)
    assert lease.step_parts == ("workflows", "step", "1")
    assert Lease.from_redis({"name": "bare"}).step_parts is None


# -- the event log -------------------------------------------------------------------------------


def fire(signal=signals.lock_acquired, sender="some.task", **fields):
    payload = {
        "key": "steplock:lease:{step:1}",
        "name": "step:1",
        "owner": "o" * 32,
        "fence": 7,
        "task_id": "tid",
        "task_name": "some.task",
        "ttl": 30.0,
    }
    payload.update(fields)
    emit(signal, sender, **payload)


@pytest.fixture
def event_log(app):
    set_settings(app, steplock_event_log=True)
    yield app
    eventlog.flush()


@pytest.mark.django_db(transaction=True)
def test_event_log_is_off_by_default(app):
    fire()
    fire(signals.lock_released)
    assert not LeaseEvent.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_events_are_recorded_when_on(event_log):
    before = time.time()
    fire()
    fire(signals.lock_contended, owner=None, fence=None, holder="h" * 32)
    fire(
        signals.lock_released,
        forced=True,
        reason="force-released by ops",
        hostname="worker-host",
        pid=4242,
        step="workflows.step:1",
    )
    fire(signals.lock_extended)  # not a logged event
    fire(signals.lock_lost, reason="key gone")
    rows = list(LeaseEvent.objects.order_by("id"))
    assert [r.event for r in rows] == [
        "lock_acquired",
        "lock_contended",
        "lock_released",
        "lock_lost",
    ]
    acquired, contended, released, lost = rows
    assert (acquired.name, acquired.key, acquired.fence, acquired.task_id, acquired.task_name) == (
        "step:1",
        "steplock:lease:{step:1}",
        7,
        "tid",
        "some.task",
    )
    assert acquired.hostname and acquired.pid  # this process, for a worker's own events
    assert before - 1 <= acquired.created_at.timestamp() <= time.time() + 1
    assert contended.fence is None and contended.reason == f"held by {'h' * 32}"
    assert (released.reason, released.hostname, released.pid, released.step) == (
        "force-released by ops",
        "worker-host",
        4242,
        "workflows.step:1",
    )
    assert lost.reason == "key gone"


@pytest.mark.django_db(transaction=True)
def test_events_inside_a_transaction_are_written_after_commit(event_log):
    with transaction.atomic():
        fire()
        assert not LeaseEvent.objects.exists()  # not inside the transaction
    assert LeaseEvent.objects.get().event == "lock_acquired"


@pytest.mark.django_db(transaction=True)
def test_a_conflict_in_a_rolled_back_transaction_is_still_recorded(event_log):
    with pytest.raises(RuntimeError):
        with transaction.atomic():
            fire(
                signals.transition_conflict,
                step_id=1,
                from_="pending",
                to="done",
                current="cancelled",
            )
            raise RuntimeError("the CAS conflict rolls the transaction back")
    assert not LeaseEvent.objects.exists()
    fire(signals.lock_released)  # the next event outside a transaction writes both
    rows = list(LeaseEvent.objects.order_by("id"))
    assert [r.event for r in rows] == ["transition_conflict", "lock_released"]
    assert rows[0].reason == "pending -> done (step is cancelled)"


@pytest.mark.django_db(transaction=True)
def test_a_failing_write_never_breaks_the_sender(event_log, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("database down")

    monkeypatch.setattr(LeaseEvent.objects, "bulk_create", broken)
    fire()  # logged, not raised


@pytest.mark.django_db(transaction=True)
def test_a_real_task_run_records_its_events(event_log, redis_client):
    step = Step.objects.create(name="logged")
    result = advance.apply(args=(step.pk,))
    assert result.successful(), result.traceback
    events = list(LeaseEvent.objects.order_by("id").values_list("event", "step"))
    assert [e for e, _ in events] == ["lock_acquired", "transition_applied", "lock_released"]
    assert events[1][1] == f"workflows.step:{step.pk}"
    fences = set(LeaseEvent.objects.values_list("fence", flat=True))
    assert len(fences) == 1 and None not in fences
    # a second run finds the step done: the conflict is recorded although it rolled back
    LeaseEvent.objects.all().delete()
    advance.apply(args=(step.pk,))
    events = list(LeaseEvent.objects.order_by("id").values_list("event", "reason"))
    assert [e for e, _ in events] == ["lock_acquired", "transition_conflict", "lock_released"]
    assert events[1][1] == "pending -> done (step is done)"


# -- retention ---------------------------------------------------------------------------------


def make_events(ages_seconds):
    now = timezone.now()
    LeaseEvent.objects.bulk_create(
        [
            LeaseEvent(
                event="lock_acquired", name=f"n{i}", created_at=now - dt.timedelta(seconds=s)
            )
            for i, s in enumerate(ages_seconds)
        ]
    )


@pytest.mark.django_db
def test_prune_deletes_only_old_events(app):
    make_events([10, 3600 * 2, 86400 * 8, 86400 * 30])
    assert prune_lease_events(3600, dry_run=True) == 3
    assert LeaseEvent.objects.count() == 4
    assert prune_lease_events(3600) == 3
    assert list(LeaseEvent.objects.values_list("name", flat=True)) == ["n0"]
    assert prune_lease_events(3600) == 0  # idempotent


@pytest.mark.django_db
def test_prune_defaults_to_the_retention_setting(app):
    make_events([10, 86400 * 8])
    assert prune_lease_events() == 1  # default retention: 7 days
    make_events([7200])
    app.conf.steplock_event_retention = 3600
    assert prune_lease_events() == 1
    with pytest.raises(ImproperlyConfigured):
        prune_lease_events(-1)


@pytest.mark.django_db
def test_prune_command(app):
    make_events([10, 86400 * 2, 86400 * 10])
    out = io.StringIO()
    call_command("prune_lease_events", "--days", "1", "--dry-run", stdout=out)
    assert out.getvalue().strip() == "Would delete 2 lease event(s)."
    assert LeaseEvent.objects.count() == 3
    out = io.StringIO()
    call_command("prune_lease_events", "--days", "2.5", stdout=out)
    assert out.getvalue().strip() == "Deleted 1 lease event(s)."
    out = io.StringIO()
    call_command("prune_lease_events", stdout=out)  # the retention setting: 7 days
    assert out.getvalue().strip() == "Deleted 0 lease event(s)."
    assert LeaseEvent.objects.count() == 2
    with pytest.raises(CommandError):
        call_command("prune_lease_events", "--days", "-1")
