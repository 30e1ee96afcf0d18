"""The effects outbox's dispatch side (celery_steplock.contrib.django.outbox), with real parts:
an HTTP receiver on a loopback port (a ``http.server`` thread recording each request's
``Idempotency-Key``, answering 500/400/slowly on demand), the suite's Redis broker for
published tasks (the message read back from the queue), Django's locmem email backend, and a
callable registered with ``@effects.register``. Rows are made with the ORM (the write side
has its own tests)."""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import time

import pytest
from django.db import connections, transaction
from django.test import override_settings
from django.utils import timezone

from celery_steplock import effects
from celery_steplock.contrib.django import outbox
from celery_steplock.contrib.django.models import Effect, LeaseEvent
from celery_steplock.exceptions import OuterTransactionError
from celery_steplock.patterns.retry import NonRetryable
from tests.helpers import set_settings
from tests.support.http_receiver import Receiver

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def receiver():
    server = Receiver()
    yield server
    server.close()


@pytest.fixture(autouse=True)
def settings_(app):
    set_settings(app, steplock_effect_http_timeout=5.0)
    yield


_seq = iter(range(10**9))


def make(kind="http", target="", payload=None, *, attempts=0, due=-1.0, **fields):
    """An Effect row, due ``due`` seconds from now (negative: already due)."""
    n = next(_seq)
    now = timezone.now()
    return Effect.objects.create(
        key=fields.pop("key", f"shop.order:{n}:1:paid:0"),
        step=f"shop.order:{n}",
        fence=1,
        position=0,
        kind=kind,
        target=target,
        payload=payload if payload is not None else {"method": "POST", "json": {"n": n}},
        attempts=attempts,
        next_attempt_at=now + dt.timedelta(seconds=due),
        task_id="t-1",
        task_name="shop.pay",
        owner="owner-1",
        **fields,
    )


def fresh(effect):
    return Effect.objects.get(pk=effect.pk)


def named(events, name):
    return [kw for event, kw in events if event == name]


# -- HTTP: dispatched once, retried, dead ----------------------------------------------------


def test_a_due_effect_is_sent_once_with_its_key_and_marked(receiver, events):
    effect = make(target=receiver.url)
    report = outbox.relay()
    assert (report.dispatched, report.retried, report.dead, report.pending) == (1, 0, 0, 0)
    assert receiver.requests == [(effect.key, effect.payload["json"])]
    row = fresh(effect)
    assert (row.status, row.attempts, row.outcome, row.claimed_by) == (
        "dispatched",
        1,
        "HTTP 200",
        "",
    )
    assert row.dispatched_at is not None and row.last_error == ""
    [sent] = named(events, "effect_dispatched")
    assert (sent["key"], sent["kind"], sent["attempts"], sent["error"]) == (
        effect.key,
        "http",
        1,
        None,
    )
    assert outbox.relay().dispatched == 0  # marked: never sent again
    assert receiver.keys() == [effect.key]


def test_the_on_commit_path_claims_its_fresh_rows_the_relay_leaves_them(receiver):
    effect = make(target=receiver.url, due=30.0)  # fresh: the relay delay not over
    assert outbox.relay().dispatched == 0 and receiver.requests == []
    report = outbox.dispatch("default", [effect.pk])
    assert (report.dispatched, report.pending) == (1, 0)
    assert fresh(effect).status == "dispatched" and receiver.keys() == [effect.key]
    # Once claimed (attempts 1), the on-commit path never takes it again.
    assert outbox.dispatch("default", [effect.pk]).dispatched == 0
    assert receiver.keys() == [effect.key]


def test_dispatch_inside_a_transaction_waits_for_its_commit(receiver):
    effect = make(target=receiver.url, due=30.0)
    with transaction.atomic():
        assert outbox.dispatch("default", [effect.pk]).dispatched == 0
        assert receiver.requests == []
    assert fresh(effect).status == "dispatched" and receiver.keys() == [effect.key]


def test_a_500_is_retried_later_with_the_backoff_then_sent(receiver, events):
    receiver.script = [500]
    effect = make(target=receiver.url)
    before = timezone.now()
    report = outbox.relay()
    assert (report.dispatched, report.retried, report.pending) == (0, 1, 1)
    row = fresh(effect)
    assert (row.status, row.attempts, row.claimed_by) == ("pending", 1, "")
    assert "HTTP 500" in row.last_error
    # RetryPolicy(backoff=1.0).countdown(1): full jitter under 1 s.
    assert before <= row.next_attempt_at <= timezone.now() + dt.timedelta(seconds=1)
    [retry] = named(events, "effect_retry")
    assert retry["attempts"] == 1 and 0 <= retry["countdown"] <= outbox.BACKOFF
    time.sleep(max(0.0, (row.next_attempt_at - timezone.now()).total_seconds()) + 0.01)
    report = outbox.relay()
    assert (report.dispatched, report.retried, report.pending) == (1, 0, 0)
    row = fresh(effect)
    assert (row.status, row.attempts, row.last_error) == ("dispatched", 2, "")
    assert receiver.keys() == [effect.key, effect.key]


def test_the_backoff_grows_with_the_attempts(receiver):
    receiver.script = [503]
    effect = make(target=receiver.url, attempts=6)  # the 7th attempt fails
    outbox.relay()
    row = fresh(effect)
    assert row.attempts == 7 and row.status == "pending"
    # Drawn under min(300, 2**6) = 64 s: in the future, and the relay leaves it there.
    assert row.next_attempt_at <= timezone.now() + dt.timedelta(seconds=64)
    Effect.objects.filter(pk=effect.pk).update(
        next_attempt_at=timezone.now() + dt.timedelta(seconds=60)
    )
    assert outbox.relay().dispatched == 0 and len(receiver.requests) == 1


@pytest.mark.parametrize("status", [408, 409, 425, 429, 502])
def test_transient_statuses_are_retried(receiver, status):
    receiver.script = [status]
    effect = make(target=receiver.url)
    assert outbox.relay().retried == 1
    assert fresh(effect).status == "pending"


@pytest.mark.parametrize("status", [302, 400, 404, 422])
def test_a_permanent_refusal_is_dead_at_once(receiver, events, status):
    receiver.script = [status]
    effect = make(target=receiver.url)
    report = outbox.relay()
    assert (report.dead, report.retried, report.pending) == (1, 0, 0)
    row = fresh(effect)
    assert (row.status, row.attempts) == ("dead", 1) and f"HTTP {status}" in row.last_error
    [dead] = named(events, "effect_dead")
    assert dead["reason"] == "permanent" and dead["key"] == effect.key
    assert outbox.relay().dead == 0 and len(receiver.requests) == 1


def test_the_last_attempt_makes_it_dead(receiver, events):
    receiver.script = [500, 500]
    effect = make(target=receiver.url, max_attempts=2)
    assert outbox.relay().retried == 1
    Effect.objects.filter(pk=effect.pk).update(next_attempt_at=timezone.now())
    report = outbox.relay()
    assert (report.dead, report.retried) == (1, 0)
    row = fresh(effect)
    assert (row.status, row.attempts) == ("dead", 2)
    assert [e["reason"] for e in named(events, "effect_dead")] == ["max_attempts"]
    assert receiver.keys() == [effect.key, effect.key]


def test_a_receiver_that_is_down_is_retried(app):
    from tests.helpers import free_port

    effect = make(target=f"http://127.0.0.1:{free_port()}/hook")
    assert outbox.relay().retried == 1
    assert "ConnectionRefusedError" in fresh(effect).last_error


def test_a_timeout_is_retried(receiver, app):
    set_settings(app, steplock_effect_http_timeout=0.3)
    receiver.script = [("slow", 1.0)]
    effect = make(target=receiver.url)
    assert outbox.relay().retried == 1
    assert "imeout" in fresh(effect).last_error


# -- claims ------------------------------------------------------------------------------------


def _racing(*targets):
    """Call the targets at once, each on a thread of its own; their results."""
    reports, errors = [], []
    barrier = threading.Barrier(len(targets))

    def run(target):
        try:
            barrier.wait()
            reports.append(target())
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(target,)) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    return reports


def test_two_relays_racing_send_each_effect_once(receiver):
    rows = [make(target=receiver.url) for _ in range(12)]
    reports = _racing(outbox.relay, outbox.relay)
    assert sum(r.dispatched for r in reports) == 12
    assert sorted(receiver.keys()) == sorted(r.key for r in rows)  # one request per row
    assert {(r.status, r.attempts) for r in Effect.objects.all()} == {("dispatched", 1)}


def test_the_relay_and_the_committing_process_racing_send_once(receiver):
    rows = [make(target=receiver.url) for _ in range(8)]  # due and fresh (attempts 0)
    ids = [r.pk for r in rows]
    reports = _racing(outbox.relay, lambda: outbox.dispatch("default", ids))
    assert sum(r.dispatched for r in reports) == 8
    assert sorted(receiver.keys()) == sorted(r.key for r in rows)
    assert {r.status for r in Effect.objects.all()} == {"dispatched"}


_slow_calls: list = []


@effects.register("tests.outbox.slow")
def _slow(seconds, *, idempotency_key):
    _slow_calls.append(idempotency_key)
    if len(_slow_calls) == 1:
        time.sleep(seconds)


def test_a_claim_that_timed_out_is_taken_over_and_the_slow_mark_refused(
    receiver, app, events, caplog
):
    """One send per claim: the slow relay's claim times out, a second relay claims and sends
    again (the receiver dedupes on the key), and only the holder of the current claim marks.
    (A registered callable: an HTTP send's timeout is cut to half the claim, see
    tests/contrib/test_outbox_hostile.py.)"""
    _slow_calls.clear()
    set_settings(app, steplock_effect_claim_timeout=0.3)
    effect = make("call", "tests.outbox.slow", {"args": [2.0], "kwargs": {}})
    first = []
    slow = threading.Thread(target=lambda: (first.append(outbox.relay()), connections.close_all()))
    slow.start()
    deadline = time.monotonic() + 5
    while not _slow_calls and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.4)  # past the claim timeout, the slow send still running
    with caplog.at_level(logging.WARNING, logger="celery_steplock"):
        second = outbox.relay()
        slow.join(10)
    assert second.dispatched == 1 and first[0].dispatched == 0
    assert _slow_calls == [effect.key, effect.key]  # one per claim
    row = fresh(effect)
    assert (row.status, row.attempts) == ("dispatched", 2)
    assert len(named(events, "effect_dispatched")) == 1
    assert any(r.steplock["event"] == "effect_mark_lost" for r in caplog.records)


def test_a_crashed_committers_row_is_sent_by_the_relay(receiver):
    """COMMIT done, the process died before dispatch: attempts 0, past its relay delay."""
    effect = make(
        target=receiver.url, due=-5.0, created_at=timezone.now() - dt.timedelta(seconds=15)
    )
    assert outbox.pending_stats()[0] == 1 and outbox.pending_stats()[1] >= 15
    report = outbox.relay()
    assert report.dispatched == 1 and receiver.keys() == [effect.key]
    assert outbox.pending_stats() == (0, None)


def test_a_dead_relays_claim_is_taken_over_after_its_timeout(receiver):
    effect = make(target=receiver.url, attempts=1, claimed_by="gone:1:abc", due=-0.1)
    assert outbox.relay().dispatched == 1
    assert (fresh(effect).attempts, fresh(effect).claimed_by) == (2, "")


def test_relay_refuses_to_run_inside_a_transaction(receiver):
    make(target=receiver.url)
    with transaction.atomic():
        with pytest.raises(OuterTransactionError):
            outbox.relay()
    assert receiver.requests == []


# -- the other kinds ---------------------------------------------------------------------------


def test_a_task_effect_is_published_with_the_key_as_task_id(app, redis_client):
    effect = make(
        "task",
        "shop.notify",
        {"args": [7], "kwargs": {"why": "paid"}, "options": {"countdown": 60}},
    )
    assert outbox.relay(app=app).dispatched == 1
    [raw] = redis_client.lrange("celery", 0, -1)
    message = json.loads(raw)
    assert (message["headers"]["id"], message["headers"]["task"]) == (effect.key, "shop.notify")
    assert json.loads(message["headers"]["argsrepr"].replace("'", '"')) == [7]
    assert message["headers"]["eta"] is not None  # the options given at declaration
    row = fresh(effect)
    assert (row.status, row.outcome) == ("dispatched", effect.key)


def test_an_email_effect_carries_the_key_and_a_deterministic_message_id(mailoutbox):
    payload = {
        "subject": "Shipped",
        "body": "on its way",
        "to": ["a@example.com"],
        "from_email": "shop@example.org",
        "headers": {"X-Order": "7"},
    }
    first = make("email", "a@example.com", payload)
    assert outbox.relay().dispatched == 1
    Effect.objects.filter(pk=first.pk).update(  # sent again
        status="pending", attempts=0, next_attempt_at=timezone.now()
    )
    assert outbox.relay().dispatched == 1
    assert len(mailoutbox) == 2
    for message in mailoutbox:
        assert message.to == ["a@example.com"] and message.subject == "Shipped"
        assert message.extra_headers["Idempotency-Key"] == first.key
        assert message.extra_headers["X-Order"] == "7"
    ids = {m.message()["Message-ID"] for m in mailoutbox}
    assert len(ids) == 1 and ids.pop().endswith("@example.org>")


_calls: list = []


@effects.register("tests.outbox.record")
def _record(order, *, idempotency_key, note=""):
    _calls.append((order, note, idempotency_key))
    return f"recorded {order}"


@effects.register("tests.outbox.refuse")
def _refuse(order, *, idempotency_key):
    raise NonRetryable(f"order {order} refused")


def test_a_call_effect_gets_the_key():
    _calls.clear()
    effect = make("call", "tests.outbox.record", {"args": [7], "kwargs": {"note": "n"}})
    assert outbox.relay().dispatched == 1
    assert _calls == [(7, "n", effect.key)]
    assert fresh(effect).outcome == "recorded 7"


def test_a_call_refused_for_good_is_dead_and_an_unknown_name_retried():
    refused = make("call", "tests.outbox.refuse", {"args": [7], "kwargs": {}})
    unknown = make("call", "tests.outbox.not_deployed_here", {"args": [], "kwargs": {}})
    report = outbox.relay()
    assert (report.dead, report.retried) == (1, 1)
    assert fresh(refused).status == "dead" and "NonRetryable" in fresh(refused).last_error
    assert fresh(unknown).status == "pending" and "not_deployed_here" in fresh(unknown).last_error


# -- operators ---------------------------------------------------------------------------------


def test_retry_and_discard_are_audited(receiver):
    dead = make(target=receiver.url, status="dead", attempts=10, last_error="HTTP 500")
    pending = make(target=receiver.url, due=3600.0)
    sent = make(target=receiver.url, status="dispatched", attempts=1)

    [retried] = outbox.retry_effects([dead.pk], "alice", "10.0.0.1", "admin", reason="fixed")
    assert retried.outcome == "done" and retried.audit_id is not None
    row = fresh(dead)
    assert (row.status, row.attempts) == ("pending", 0) and row.next_attempt_at <= timezone.now()
    audit = LeaseEvent.objects.get(pk=retried.audit_id)
    assert (audit.event, audit.actor, audit.actor_host, audit.via, audit.outcome) == (
        "effect_retried",
        "alice",
        "10.0.0.1",
        "admin",
        "done",
    )
    assert audit.key == dead.key and audit.step == dead.step and "fixed" in audit.reason

    [discarded, refused] = outbox.discard_effects(
        Effect.objects.filter(pk__in=[pending.pk, sent.pk]), "bob", None, "cli"
    )
    assert (discarded.outcome, refused.outcome) == ("done", "refused")
    assert fresh(pending).status == "discarded" and fresh(sent).status == "dispatched"
    rows = LeaseEvent.objects.filter(event="effect_discarded").order_by("pk")
    assert [(e.key, e.actor, e.via, e.outcome) for e in rows] == [
        (pending.key, "bob", "cli", "done"),
        (sent.key, "bob", "cli", "refused"),
    ]
    # The retried one goes out; the discarded one never does.
    assert outbox.relay().dispatched == 1 and receiver.keys() == [dead.key]


def test_an_effect_being_sent_is_not_changed_by_an_operator(receiver):
    busy = make(target=receiver.url, attempts=1, claimed_by="relay:1:x", due=30.0)
    [record] = outbox.discard_effects([busy.pk], "carol")
    assert record.outcome == "refused" and "being sent" in record.detail
    assert fresh(busy).status == "pending"
    assert LeaseEvent.objects.get(event="effect_discarded").outcome == "refused"


# -- databases ---------------------------------------------------------------------------------


class EffectsEverywhere:
    """Lets the celery_steplock tables be on "other" too (whose test database was created
    without them)."""

    def allow_migrate(self, db, app_label, model_name=None, **hints):
        if app_label == "celery_steplock":
            return db in ("default", "other")
        return None


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_a_database_without_the_table_is_skipped_with_a_line(receiver, caplog):
    effect = make(target=receiver.url)
    with override_settings(DATABASE_ROUTERS=[EffectsEverywhere()]):
        assert outbox.databases() == ["default", "other"]
        with caplog.at_level(logging.WARNING, logger="celery_steplock"):
            report = outbox.relay()
            stats = outbox.pending_stats()
    assert (report.dispatched, report.skipped) == (1, ("other",))
    assert receiver.keys() == [effect.key] and stats == (0, None)
    skipped = [r.steplock for r in caplog.records if r.steplock["event"] == "effect_relay_skipped"]
    assert skipped and all(s["using"] == "other" for s in skipped)
    assert "no celery_steplock_effect table" in skipped[0]["reason"]
    assert outbox.databases() == ["default"]  # the project's router: the table on default only


def test_the_beat_task_relays(receiver, app):
    from celery_steplock.contrib.django.tasks import relay_effects

    effect = make(target=receiver.url)
    result = relay_effects.apply(kwargs={"limit": 10}).get()
    assert result == {
        "dispatched": 1,
        "retried": 0,
        "dead": 0,
        "pending": 0,
        "oldest_pending_seconds": None,
        "skipped": [],
    }
    assert receiver.keys() == [effect.key]


# -- write ---------------------------------------------------------------------------------------


def test_write_inserts_pending_rows_that_a_rollback_takes_back(app):
    declared = [
        effects.Declared("http", "https://example.com/a", {"method": "POST"}, 0),
        effects.Declared("call", "tests.outbox.record", {"args": [1], "kwargs": {}}, 1),
    ]
    fields = dict(
        step="shop.order:9",
        fence=4,
        key_base="shop.order:9:4:paid",
        owner="o",
        task_id="t",
        task_name="shop.pay",
    )
    with pytest.raises(ZeroDivisionError):
        with transaction.atomic():
            assert len(outbox.write("default", declared, **fields)) == 2
            1 / 0
    assert Effect.objects.count() == 0
    before = timezone.now()
    with transaction.atomic():
        ids = outbox.write("default", declared, **fields, app=app)
    rows = [Effect.objects.get(pk=pk) for pk in ids]
    assert [r.key for r in rows] == ["shop.order:9:4:paid:0", "shop.order:9:4:paid:1"]
    assert {(r.status, r.attempts, r.max_attempts) for r in rows} == {("pending", 0, 10)}
    assert all(r.next_attempt_at >= before + dt.timedelta(seconds=10) for r in rows)


def test_no_audit_row_no_change(receiver, monkeypatch):
    from celery_steplock.contrib.django import eventlog
    from celery_steplock.exceptions import AuditRecordFailed

    dead = make(target=receiver.url, status="dead", attempts=3)

    def refuse(self, record):
        raise RuntimeError("database refused the audit row")

    monkeypatch.setattr(eventlog.LeaseEventAudit, "requested", refuse)
    with pytest.raises(AuditRecordFailed, match="nothing changed"):
        outbox.retry_effects([dead.pk], "alice")
    assert (fresh(dead).status, fresh(dead).attempts) == ("dead", 3)


def test_the_admins_hooks_run_in_the_audit_transaction_and_after(receiver):
    dead = make(target=receiver.url, status="dead", attempts=3)
    seen = []
    [record] = outbox.retry_effects(
        [dead.pk],
        "alice",
        also=lambda r: seen.append(("also", r.outcome)),
        after=lambda r: seen.append(("after", r.outcome)),
    )
    assert seen == [("also", "requested"), ("after", "done")] and record.outcome == "done"


def test_effects_without_the_librarys_app_installed_name_the_fix():
    """The outbox is a model of celery_steplock.contrib.django: without that app the error
    says so (not Django's RuntimeError about another model)."""
    from django.test import override_settings

    from celery_steplock.contrib.django import outbox
    from celery_steplock.exceptions import EffectsUnavailable

    apps_without = ["django.contrib.contenttypes", "django.contrib.auth", "django_app.workflows"]
    with override_settings(INSTALLED_APPS=apps_without):
        with pytest.raises(EffectsUnavailable) as caught:
            outbox.write(
                "default",
                [object()],
                step="s",
                fence=1,
                key_base="s:1:done",
                owner="o",
                task_id="t",
                task_name="n",
            )
    assert "add it to INSTALLED_APPS" in str(caught.value)
    assert "'celery_steplock.contrib.django'" in str(caught.value)
