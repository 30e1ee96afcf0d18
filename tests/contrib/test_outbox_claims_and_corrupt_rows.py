"""The effects outbox's dispatch side under attack: a batch claim that
times out while the committing process is still sending, a receiver timeout longer than
the claim, rows whose stored shape is corrupt, and keys that are not valid HTTP header
values. Real loopback HTTP receiver, real database; rows made with the ORM."""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest
from django.db import connections
from django.utils import timezone

from celery_steplock.contrib.django import outbox
from celery_steplock.contrib.django.models import Effect
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


def make(target, payload=None, *, kind="http", due=-1.0, key=None):
    n = next(_seq)
    return Effect.objects.create(
        key=key or f"shop.order:h{n}:1:paid:0",
        step=f"shop.order:h{n}",
        fence=1,
        position=0,
        kind=kind,
        target=target,
        payload={"method": "POST", "json": {"n": n}} if payload is None else payload,
        next_attempt_at=timezone.now() + dt.timedelta(seconds=due),
        task_id="t-1",
        task_name="shop.pay",
        owner="owner-1",
    )


def test_the_on_commit_batch_never_sends_a_row_whose_claim_another_relay_took(receiver, app):
    """dispatch() claims its rows at once; while it is slow on the first, the claim of the
    second times out and the periodic relay takes that row over and sends it. The committing
    process must not send it a second time without a claim."""
    set_settings(app, steplock_effect_claim_timeout=0.4)
    first, second = make(receiver.url, due=30.0), make(receiver.url, due=30.0)
    receiver.slow[first.key] = 1.5
    thread = threading.Thread(
        target=lambda: (outbox.dispatch("default", [first.pk, second.pk]), connections.close_all())
    )
    thread.start()
    deadline = time.monotonic() + 5
    while not receiver.keys() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # the batch claim is over; the first send still running
    receiver.slow.pop(first.key)  # the relay's own send of the first row is quick
    outbox.relay()
    thread.join(10)
    assert receiver.keys().count(second.key) == 1
    assert Effect.objects.get(pk=second.pk).status == "dispatched"


def test_an_http_timeout_longer_than_the_claim_is_cut_to_fit_it(receiver, app):
    """A payload timeout of 30 s with a 0.5 s claim: the send gives up within the claim
    (retried later), instead of a second relay sending the same row while it waits."""
    set_settings(app, steplock_effect_claim_timeout=0.5)
    effect = make(receiver.url, {"method": "POST", "json": {}, "timeout": 30.0})
    receiver.slow[effect.key] = 3.0
    started = time.monotonic()
    report = outbox.relay()
    assert time.monotonic() - started < 2.0
    assert report.retried == 1
    row = Effect.objects.get(pk=effect.pk)
    assert row.status == "pending" and "timed out" in row.last_error


@pytest.mark.parametrize(
    "kind,target,payload,error",
    [
        ("http", "URL", ["not", "a", "dict"], "payload is a list, not a dict"),
        ("call", "x.y", "text", "payload is a str, not a dict"),
        ("http", "URL", {"headers": ["a"]}, "payload's headers is a list, not a dict"),
        ("task", "x.y", {"args": 5}, "payload's args is a int, not a list"),
        ("email", "a@example.com", {"subject": "s", "to": "a@example.com"}, "payload's to"),
        ("http", "", {}, "target is empty"),
    ],
)
def test_a_corrupt_row_goes_dead_at_once_with_a_clear_error(
    receiver, kind, target, payload, error
):
    effect = make(receiver.url if target == "URL" else target, payload, kind=kind)
    report = outbox.relay()
    row = Effect.objects.get(pk=effect.pk)
    assert (report.dead, row.status, row.attempts) == (1, "dead", 1)
    assert "corrupt effect row" in row.last_error and error in row.last_error
    assert receiver.keys() == []


@pytest.mark.parametrize("status", ["terminé", "完了", "paid\r\nX-Injected: 1"])
def test_a_key_that_is_not_a_header_value_is_sent_percent_encoded(receiver, status):
    """A step status with non-ASCII letters (or a CR/LF) in the key: the header carries the
    key percent-encoded (deterministic, ASCII), the row is dispatched, nothing is injected."""
    from urllib.parse import quote

    key = f"shop.order:1:7:{status}:0"
    effect = make(receiver.url, key=key)
    report = outbox.relay()
    assert report.dispatched == 1, Effect.objects.get(pk=effect.pk).last_error
    assert receiver.keys() == [quote(key, safe=":/@.-_~")]


def test_a_stored_http_target_with_credentials_goes_dead_unsent(receiver):
    port = receiver.url.split(":")[2].split("/")[0]
    effect = make(f"http://alice:s3cretpw@127.0.0.1:{port}/hook")
    assert outbox.relay().dead == 1
    row = Effect.objects.get(pk=effect.pk)
    assert "target carries credentials" in row.last_error and "s3cretpw" not in row.last_error
    assert receiver.keys() == []


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_a_step_on_a_database_without_the_outbox_table_is_refused_by_name(app):
    """routing.Parcel lives on "other" only (django_app/routers.py); the Effect table is on
    "default" only, and the relay visits only the databases the router allows it on. A step
    there declaring effects gets a clear EffectsUnavailable, before any statement."""
    from django.db import transaction

    from celery_steplock import effects
    from celery_steplock.exceptions import EffectsUnavailable

    declared = [effects.Declared("call", "x.y", {"args": [], "kwargs": {}}, 0)]
    with transaction.atomic(using="other"):
        with pytest.raises(EffectsUnavailable) as raised:
            outbox.write(
                "other",
                declared,
                step="routing.parcel:1",
                fence=3,
                key_base="routing.parcel:1:3:done",
                owner="o",
                task_id="t",
                task_name="n",
                app=app,
            )
    assert "'other'" in str(raised.value) and "migrate --database other" in str(raised.value)
    assert "other" not in outbox.databases()
