"""What a worker logs at INFO: one ``execution_done`` line per execution outcome, the lease's
events at DEBUG; a lease lost to an operator's force release is a WARNING naming the
operator's record; a lease retry is a ``task-retried`` event for Celery's monitors."""

import asyncio
import json
import logging
import re
import threading
import time

import pytest
from celery.exceptions import Retry

from celery_steplock import signals
from celery_steplock.aio import AsyncRedisLeaseStore
from celery_steplock.clients import async_twin
from celery_steplock.contrib.django.steps import guarded_step
from celery_steplock.exceptions import LockContended, LockLost
from celery_steplock.heartbeat import Heartbeat
from celery_steplock.lock import (
    FORCED_FIELD_MAX,
    FORCED_MARK_TTL,
    forced_key,
    get_lease_store,
    lost_line,
)
from celery_steplock.ops import ReleaseAudit, force_release
from celery_steplock.outcomes import SAME_ID_HEADER
from celery_steplock.task import StepLockedTask
from django_app.celery import app as celery_app
from django_app.workflows.models import Step

pytestmark = pytest.mark.django_db(transaction=True)


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.logs.finish",
    lock_key="step:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
    max_retries=2,
)
def finish(self, step_id):
    return "done"


@pytest.fixture(autouse=True)
def fast_retries(app):
    app.conf.steplock_retry_backoff = 0.01


def lines(caplog, level=logging.INFO):
    """The ``celery_steplock`` lines at ``level`` and above, as ``(level name, message)``."""
    return [
        (r.levelname, r.getMessage())
        for r in caplog.records
        if r.name == "celery_steplock" and r.levelno >= level
    ]


SECONDS = r"\d+\.\d{1,6}"  # rounded to microseconds, fixed notation


def test_one_committed_execution_is_one_info_line(caplog):
    step = Step.objects.create(name="s")
    key = re.escape(f"steplock:lease:{{step:{step.pk}}}")
    with caplog.at_level(logging.DEBUG, logger="celery_steplock"):
        result = finish.apply(args=(step.pk,), task_id="t-1")
    assert result.get() == "done"
    [(level, line)] = lines(caplog)
    assert level == "INFO"
    assert re.fullmatch(
        rf"event=execution_done task_id=t-1 task_name=tests.logs.finish outcome=committed "
        rf"key={key} fence=\d+ step_id={step.pk} wait_seconds={SECONDS} "
        rf"hold_seconds={SECONDS} cas_seconds={SECONDS}",
        line,
    ), line
    [record] = [r for r in caplog.records if r.levelno == logging.INFO]
    fields = record.steplock
    assert fields["outcome"] == "committed" and fields["task_id"] == "t-1"
    for name in ("wait_seconds", "hold_seconds", "cas_seconds"):
        assert fields[name] == round(fields[name], 6) and 0 <= fields[name] < 5
    assert fields["cas_seconds"] <= fields["hold_seconds"]
    # The lease's own events are still written, at DEBUG.
    debug = [
        r.steplock["event"] for r in caplog.records if r.levelno == logging.DEBUG and r.steplock
    ]
    assert [e for e in debug if e != "lock_extended"] == [
        "lock_acquired",
        "transition_applied",
        "lock_released",
    ]


def test_a_duplicate_is_one_info_line(caplog):
    step = Step.objects.create(name="s")
    finish.apply(args=(step.pk,)).get()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="celery_steplock"):
        result = finish.apply(args=(step.pk,), task_id="t-2")
    assert result.get()["steplock"] == "duplicate"
    [(level, line)] = lines(caplog)
    assert level == "INFO"
    assert re.fullmatch(
        rf"event=execution_done task_id=t-2 task_name=tests.logs.finish outcome=duplicate "
        rf"key=\S+ fence=\d+ step_id={step.pk} wait_seconds={SECONDS} "
        rf"hold_seconds={SECONDS}",
        line,
    ), line


def test_lease_retries_are_one_info_line_each(app, caplog, monkeypatch):
    step = Step.objects.create(name="s")
    get_lease_store(app).acquire(f"step:{step.pk}", "other", 10.0)
    monkeypatch.setattr(finish, "on_contended", "retry")
    with caplog.at_level(logging.INFO, logger="celery_steplock"):
        result = finish.apply(args=(step.pk,), task_id="t-3")
    assert isinstance(result.result, LockContended)  # two retries (max_retries), then fails
    found = lines(caplog)
    assert [level for level, _ in found] == ["INFO"] * 3
    head = "event=execution_done task_id=t-3 task_name=tests.logs.finish"
    key = re.escape(f"key=steplock:lease:{{step:{step.pk}}}")
    retry = rf"{head} outcome=retry {key} step_id={step.pk} wait_seconds={SECONDS} "
    retry += r"countdown=\d+\.\d+ reason=LockContended"
    for _, line in found[:2]:
        assert re.fullmatch(retry, line), line
    assert re.fullmatch(
        rf"{head} outcome=error {key} step_id={step.pk} wait_seconds={SECONDS} "
        rf"reason=LockContended",
        found[2][1],
    ), found[2][1]


# -- a lease lost to an operator's force release ----------------------------------------------


class Recorded(ReleaseAudit):
    """An audit store that names its record (as the Django event log's row id)."""

    def requested(self, record):
        record.audit = "lease-event-42"

    def finished(self, record):
        pass


def test_marks_of_another_owner_or_not_json_give_error(lock, redis_client):
    lease = lock.acquire("m", "o1", 30.0)
    key = forced_key(lock.prefix, "m")
    for raw in (json.dumps({"owner": "o2", "actor": "x"}), "not json", "[1]", "\xff", "null"):
        redis_client.set(key, raw)
        assert lost_line(lock, lease) == (logging.ERROR, {})
    redis_client.delete(key)
    redis_client.hset(key, "a", "b")  # wrong type: GET refused
    assert lost_line(lock, lease) == (logging.ERROR, {})


def test_a_planted_mark_gives_only_short_texts_of_the_known_fields(lock, redis_client):
    """A mark is read from Redis: values that are not text are dropped, texts cut to
    FORCED_FIELD_MAX characters, unknown keys left out (the log line, the signal)."""
    lease = lock.acquire("m", "o1", 30.0)
    redis_client.set(
        forced_key(lock.prefix, "m"),
        json.dumps(
            {
                "owner": "o1",
                "actor": "a" * 1_000_000,
                "via": {"n": [1]},
                "audit": "x\nFAKE",
                "actor_host": 7,
                "extra": "no",
            }
        ),
    )
    level, fields = lost_line(lock, lease)
    assert level == logging.WARNING
    assert fields == {
        "forced": True,
        "actor": "a" * FORCED_FIELD_MAX,
        "actor_host": None,
        "via": None,
        "audit": "x\nFAKE",
    }


def test_a_force_released_lease_is_lost_with_a_warning_naming_the_record(app, caplog):
    store = get_lease_store(app)
    lease = store.acquire("logs:forced", "holder-1", 0.6)
    lost = threading.Event()

    def on_lost(sender=None, **kwargs):
        if kwargs.get("owner") == "holder-1":
            lost.set()

    signals.lock_lost.connect(on_lost, weak=False)
    heartbeat = Heartbeat()
    try:
        with caplog.at_level(logging.WARNING, logger="celery_steplock"):
            heartbeat.register(lease, store)
            force_release(
                store,
                "logs:forced",
                "holder-1",
                actor="alice",
                actor_host="ops-1",
                via="cli",
                auditor=Recorded(),
            )
            assert lost.wait(5)
    finally:
        signals.lock_lost.disconnect(on_lost)
        heartbeat.unregister(lease)
    [record] = [
        r for r in caplog.records if getattr(r, "steplock", {}).get("event") == "lock_lost"
    ]
    assert record.levelno == logging.WARNING
    assert re.fullmatch(
        r"event=lock_lost key=steplock:lease:\{logs:forced\} owner=holder-1 fence=\d+ "
        r"ttl=0.6 reason=\"renewal found the key gone or held by another owner\" "
        r"forced=True actor=alice actor_host=ops-1 via=cli audit=lease-event-42",
        record.getMessage(),
    ), record.getMessage()
    assert record.steplock["audit"] == "lease-event-42" and record.steplock["forced"] is True
    ttl = store.client.pttl(store.forced_key("logs:forced"))
    assert 0 < ttl <= FORCED_MARK_TTL * 1000


FORCED_BODIES = []


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.logs.forced_in_body",
    lock_key="step:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
    on_contended="raise",
)
def forced_in_body(self, step_id):
    FORCED_BODIES.append(self.lease.owner)
    # An operator force-releases the lease while the body runs.
    force_release(
        get_lease_store(self.app),
        self.lease.name,
        self.lease.owner,
        actor="bob",
        via="admin",
        auditor=Recorded(),
    )
    return "body done"


def test_a_lease_force_released_during_the_body_is_a_warning_at_the_commit(caplog):
    """The pre-commit ownership check finds the lease gone: nothing committed, and the loss
    (reported by the execution, not the heartbeat) is a WARNING naming the record."""
    FORCED_BODIES.clear()
    step = Step.objects.create(name="s")
    with caplog.at_level(logging.INFO, logger="celery_steplock"):
        result = forced_in_body.apply(args=(step.pk,), task_id="t-8")
    step.refresh_from_db()
    assert step.status == "pending" and result.state == "FAILURE"  # on_contended="raise"
    [owner] = FORCED_BODIES
    ours = [r for r in caplog.records if r.name == "celery_steplock"]
    [lost] = [r for r in ours if r.steplock["event"] == "lock_lost"]
    assert lost.levelno == logging.WARNING and lost.steplock["owner"] == owner
    assert lost.getMessage().endswith("forced=True actor=bob via=admin audit=lease-event-42")
    assert [r.steplock["event"] for r in ours if r.levelno >= logging.ERROR] == []
    [done] = [r for r in ours if r.steplock["event"] == "execution_done"]
    assert done.steplock["outcome"] == "error" and done.steplock["reason"] == "LockLost"


def test_a_guarded_block_logs_its_outcome_at_info_and_the_lease_at_debug(app, caplog):
    """A block outside Celery has no execution_done: its INFO line is its transition."""
    step = Step.objects.create(name="s")
    with caplog.at_level(logging.DEBUG, logger="celery_steplock"):
        with guarded_step(Step, step.pk, lock_name=f"logs:guarded:{step.pk}") as block:
            block.transition("pending", "done")
    events = {r.steplock["event"]: r.levelname for r in caplog.records if hasattr(r, "steplock")}
    assert events["transition_applied"] == "INFO"
    assert events["lock_acquired"] == "DEBUG" and events["lock_released"] == "DEBUG"
    assert [e for e, level in events.items() if level == "INFO"] == ["transition_applied"]


def test_a_guarded_block_whose_lease_is_force_released_warns_naming_the_record(app, caplog):
    step = Step.objects.create(name="s")
    name = f"logs:guarded-forced:{step.pk}"
    with caplog.at_level(logging.INFO, logger="celery_steplock"):
        with pytest.raises(LockLost):
            with guarded_step(Step, step.pk, lock_name=name) as block:
                force_release(
                    get_lease_store(app),
                    name,
                    block.lease.owner,
                    actor="carol",
                    via="cli",
                    auditor=Recorded(),
                )
                block.transition("pending", "done")
    step.refresh_from_db()
    assert step.status == "pending"
    [lost] = [r for r in caplog.records if getattr(r, "steplock", {}).get("event") == "lock_lost"]
    assert lost.levelno == logging.WARNING
    assert lost.getMessage().endswith("forced=True actor=carol via=cli audit=lease-event-42")


def test_an_async_lease_force_released_is_lost_with_a_warning(app, caplog):
    """The event loop's heartbeat reads the operator's mark with the async client."""
    store = get_lease_store(app)
    events = []

    def on_lost(sender=None, **kwargs):
        events.append(kwargs)

    async def main():
        astore = AsyncRedisLeaseStore(async_twin(store.client), prefix=store.prefix)
        try:
            async with astore.lease("logs:async-forced", ttl=0.6) as lease:
                force_release(
                    store, lease.name, lease.owner, actor="dave", via="api", auditor=Recorded()
                )
                deadline = time.monotonic() + 5
                while not events and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                return lease
        finally:
            await astore.client.aclose()

    signals.lock_lost.connect(on_lost, weak=False)
    try:
        with caplog.at_level(logging.WARNING, logger="celery_steplock"):
            lease = asyncio.run(main())
    finally:
        signals.lock_lost.disconnect(on_lost)
    [fields] = events
    assert fields["owner"] == lease.owner and fields["forced"] is True
    assert (fields["actor"], fields["via"], fields["audit"]) == ("dave", "api", "lease-event-42")
    [lost] = [r for r in caplog.records if getattr(r, "steplock", {}).get("event") == "lock_lost"]
    assert lost.levelno == logging.WARNING


def test_any_other_loss_stays_an_error(app):
    store = get_lease_store(app)
    lease = store.acquire("logs:stolen", "holder-2", 5.0)
    store.client.delete(store.key("logs:stolen"))
    assert lost_line(store, lease) == (logging.ERROR, {})
    # A mark left for another owner of the name is not this holder's.
    store.mark_forced("logs:stolen", "holder-3", {"actor": "bob"})
    assert lost_line(store, lease) == (logging.ERROR, {})
    store.client.set(store.forced_key("logs:stolen"), "not json")
    assert lost_line(store, lease) == (logging.ERROR, {})


# -- a lease retry is a task-retried event --------------------------------------------------------


#: Where the lease retries these tests send go (a list no worker reads, deleted after).
NOWHERE = "tests.logs.nowhere"


@pytest.fixture
def nowhere(redis_client):
    yield
    redis_client.delete(NOWHERE)


def worker_request(task, task_id, headers=None):
    task.push_request(
        id=task_id,
        args=(1,),
        kwargs={},
        retries=0,
        is_eager=False,
        called_directly=False,
        delivery_info={"exchange": "", "routing_key": NOWHERE},
        hostname="w1@box",
        headers=headers or {},
    )


def test_a_lease_retry_sends_celery_task_retried_event(app, redis_client, nowhere):
    """What Flower's "Retried" view reads: a ``task-retried`` event on the broker, for the
    task id, while no RETRY state is stored."""
    received, failed, ready = [], [], threading.Event()

    def capture():
        with app.connection_for_read() as connection:

            def on_event(event):
                if event["type"] == "task-retried":
                    received.append(event)
                    receiver.should_stop = True

            receiver = app.events.Receiver(connection, handlers={"*": on_event})
            ready.set()
            try:
                receiver.capture(limit=None, timeout=10)
            except Exception as exc:  # noqa: BLE001 - the assertion below says what arrived
                failed.append(exc)

    thread = threading.Thread(target=capture, daemon=True)
    thread.start()
    assert ready.wait(5)
    # Retried until the receiver, subscribing in its thread, has caught one event.
    deadline = time.monotonic() + 10
    while not received and thread.is_alive() and time.monotonic() < deadline:
        worker_request(finish, "t-4")
        try:
            with pytest.raises(Exception) as ended:
                finish.steplock_retry(LockContended("busy", key="k"))
        finally:
            finish.pop_request()
        assert type(ended.value).__name__ == "Ignore", ended.getrepr()  # no state stored
        time.sleep(0.2)
    thread.join(10)
    assert failed == [] and received, "no task-retried event arrived"
    event = received[0]
    assert event["type"] == "task-retried" and event["uuid"] == "t-4"
    assert event["hostname"] == "w1@box"
    assert event["exception"] == "LockContended('busy')" and event["traceback"] == ""
    assert finish.AsyncResult("t-4").state == "PENDING"


def test_a_same_id_retry_and_an_eager_one_send_no_event(app, monkeypatch, nowhere):
    sent = []
    monkeypatch.setattr(finish, "send_event", lambda *a, **kw: sent.append((a, kw)))
    worker_request(finish, "t-5", headers={SAME_ID_HEADER: 1})
    try:
        with pytest.raises(Exception) as ended:
            finish.steplock_retry(LockContended("busy", key="k"))
    finally:
        finish.pop_request()
    assert type(ended.value).__name__ == "Ignore" and sent == []
    finish.push_request(
        id="t-6", args=(1,), kwargs={}, retries=0, is_eager=True, called_directly=False
    )
    try:
        with pytest.raises(Retry):
            finish.steplock_retry(LockContended("busy", key="k"))
    finally:
        finish.pop_request()
    assert sent == []


def test_a_failed_event_never_stops_the_retry(app, monkeypatch, caplog, nowhere):
    def refuse(*args, **kwargs):
        raise OSError("broker gone")

    monkeypatch.setattr(finish, "send_event", refuse)
    worker_request(finish, "t-7")
    try:
        with caplog.at_level(logging.DEBUG, logger="celery_steplock"):
            with pytest.raises(Exception) as ended:
                finish.steplock_retry(LockContended("busy", key="k"))
    finally:
        finish.pop_request()
    assert type(ended.value).__name__ == "Ignore", ended.getrepr()
    [line] = [r.getMessage() for r in caplog.records if "retry_event_failed" in r.getMessage()]
    assert line == (
        'event=retry_event_failed task_id=t-7 task_name=tests.logs.finish error="OSError: '
        'broker gone"'
    )
