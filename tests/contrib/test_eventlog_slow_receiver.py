"""A slow receiver of ``lock_acquired`` (the event log's write on a locked SQLite database,
or any receiver of the project's) never lets the lease expire before the body runs: the
lease is renewed by the heartbeat before the signal is sent (StepLockedTask._acquire).

Real Redis, the test database (SQLite: the file another connection locks; PostgreSQL: only
the receiver case), a short lease TTL and a receiver that blocks longer than the TTL."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest
from django.db import connection

from celery_steplock import signals
from celery_steplock.contrib.django import eventlog
from celery_steplock.contrib.django.models import LeaseEvent
from celery_steplock.lock import get_lease_store
from celery_steplock.task import StepLockedTask
from django_app.celery import app as celery_app
from django_app.workflows.models import Step
from helpers import set_settings

pytestmark = pytest.mark.django_db(transaction=True)

#: The lease TTL of the task below, seconds; every block is longer.
TTL = 1.0
BLOCK = 2.0

#: What the body saw of its lease: (fence, owner Redis holds, owner of the lease, TTL left).
SEEN: list[tuple] = []


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.slow_receiver_step",
    lock_key="slow:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
    lock_ttl=TTL,
    max_retries=0,
)
def slow_receiver_step(self, step_id):
    held = get_lease_store(self.app).inspect(self.lease.name) or {}
    SEEN.append((self.lease.fence, held.get("owner"), self.lease.owner, held.get("ttl")))
    self.lease.check()
    return self.lease.fence


@pytest.fixture(autouse=True)
def clean(app, redis_client):
    SEEN.clear()
    yield
    eventlog.flush()


def assert_ran_once_under_a_live_lease(result, step, events):
    assert result.successful(), result.traceback
    assert len(SEEN) == 1, SEEN
    fence, holder, owner, ttl_left = SEEN[0]
    assert holder == owner and ttl_left is not None and ttl_left > 0
    step.refresh_from_db()
    assert (step.status, step.lock_fence) == ("done", fence)
    names = [name for name, _ in events if name != "lock_extended"]
    assert names == ["lock_acquired", "transition_applied", "lock_released"]


def test_a_receiver_slower_than_the_ttl_never_expires_the_lease(app, events):
    def slow(sender=None, **fields):
        if getattr(sender, "name", None) == slow_receiver_step.name:
            time.sleep(BLOCK)

    signals.lock_acquired.connect(slow, weak=False)
    try:
        step = Step.objects.create(name="slow receiver")
        result = slow_receiver_step.apply(args=(step.pk,))
    finally:
        signals.lock_acquired.disconnect(slow)
    assert_ran_once_under_a_live_lease(result, step, events)
    acquired = next(fields for name, fields in events if name == "lock_acquired")
    assert acquired["fence"] == SEEN[0][0] and acquired["owner"] == SEEN[0][2]
    assert "wait_seconds" in acquired


@pytest.mark.sqlite  # the write lock of an SQLite file is the slow write
def test_an_event_log_write_blocked_past_the_ttl_never_expires_the_lease(app, events):
    set_settings(app, steplock_event_log=True)
    step = Step.objects.create(name="slow event log")
    locked, release = threading.Event(), threading.Event()

    def hold_the_write_lock():
        other = sqlite3.connect(connection.settings_dict["NAME"], timeout=30)
        try:
            other.execute("BEGIN IMMEDIATE")  # SQLite's one writer: every INSERT waits
            locked.set()
            release.wait(BLOCK)
            other.rollback()
        finally:
            other.close()

    holder = threading.Thread(target=hold_the_write_lock)
    holder.start()
    try:
        assert locked.wait(10)
        started = time.monotonic()
        result = slow_receiver_step.apply(args=(step.pk,))
        waited = time.monotonic() - started
    finally:
        release.set()
        holder.join()
    assert waited >= BLOCK - 0.2  # the lock_acquired row did wait for the write lock
    assert_ran_once_under_a_live_lease(result, step, events)
    rows = list(LeaseEvent.objects.order_by("id").values_list("event", flat=True))
    assert rows == ["lock_acquired", "transition_applied", "lock_released"]


def test_a_slow_receiver_never_expires_the_lease_of_a_guarded_transition(app, events):
    from celery_steplock.contrib.django.steps import guarded_step

    def slow(sender=None, **fields):
        if fields.get("task_name") == "slow-writer":
            time.sleep(BLOCK)

    step = Step.objects.create(name="guarded")
    signals.lock_acquired.connect(slow, weak=False)
    try:
        with guarded_step(
            Step, step.pk, lock_name=f"slow:g{step.pk}", ttl=TTL, actor="slow-writer"
        ) as guarded:
            held = get_lease_store(app).inspect(f"slow:g{step.pk}") or {}
            assert held.get("owner") == guarded.lease.owner and held.get("ttl")
            guarded.transition("pending", "done")
    finally:
        signals.lock_acquired.disconnect(slow)
    step.refresh_from_db()
    assert step.status == "done"
    names = [name for name, _ in events if name != "lock_extended"]
    assert names == ["lock_acquired", "transition_applied", "lock_released"]
