"""The effects outbox's admin page (celery_steplock.contrib.django.admin.effects): the list,
its read-only detail, and the audited "Retry now" / "Discard" actions with their confirmation
page (Django test client, real database; rows made with the ORM)."""

from __future__ import annotations

import datetime as dt
import re

import pytest
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.db import connections
from django.urls import reverse
from django.utils import timezone

from celery_steplock.contrib.django.models import Effect, LeaseEvent
from tests.support.admin import login, staff_user

pytestmark = pytest.mark.django_db

CHANGELIST = "admin:celery_steplock_effect_changelist"


@pytest.fixture
def viewer(django_user_model):
    return login(staff_user(django_user_model, "viewer", "celery_steplock.view_effect"))


@pytest.fixture
def replayer(django_user_model):
    return login(
        staff_user(
            django_user_model,
            "replayer",
            "celery_steplock.view_effect",
            "celery_steplock.replay_effect",
        )
    )


def make(n, status="dead", *, kind="call", target="tests.admin.noop", payload=None, **extra):
    """An effect row as the outbox writes it (step ``workflows.step:<n>``, fence 7)."""
    values = dict(
        key=f"workflows.step:{n}:7:done:0",
        step=f"workflows.step:{n}",
        fence=7,
        position=0,
        kind=kind,
        target=target,
        payload={"args": [n], "kwargs": {}} if payload is None else payload,
        status=status,
        attempts=10 if status == "dead" else 0,
        last_error="ConnectionRefusedError: [Errno 111] " + "x" * 200 if status == "dead" else "",
        next_attempt_at=timezone.now() + dt.timedelta(hours=1),
        task_id=f"task-{n}",
        task_name="workflows.advance",
        owner="o" * 32,
    )
    values.update(extra)
    return Effect.objects.create(**values)


def action(client, name, effects, *, confirm=False, query="", meta=None, **extra):
    data = {
        "action": name,
        ACTION_CHECKBOX_NAME: [str(e.pk) for e in effects],
        **extra,
    }
    if confirm:
        data.update(post="yes", index="0")
    else:
        data["index"] = "0"
    return client.post(reverse(CHANGELIST) + query, data, **(meta or {}))


def messages_of(response):
    return [str(m) for m in response.wsgi_request._messages]


def test_list_shows_the_columns_filters_and_search(viewer):
    dead = make(1)
    make(2, status="pending", kind="http", target="https://hooks.example/charge")
    make(3, status="dispatched", dispatched_at=timezone.now())
    response = viewer.get(reverse(CHANGELIST))
    assert response.status_code == 200
    page = response.content.decode()
    for column in ("status", "kind", "target", "step", "key", "attempts", "next attempt"):
        assert f"column-{column.replace(' ', '_')}" in page or column in page.lower()
    assert dead.key in page and "https://hooks.example/charge" in page
    shorts = re.findall(r'<td class="field-short_error">([^<]*)</td>', page)
    assert sorted(shorts) == ["-", "-", "ConnectionRefusedError: [Errno 111] " + "x" * 43 + "…"]
    # Filters by status and kind; search by key, target, step.
    response = viewer.get(reverse(CHANGELIST), {"status__exact": "dead"})
    assert response.context["cl"].result_count == 1
    response = viewer.get(reverse(CHANGELIST), {"kind__exact": "http"})
    assert [e.step for e in response.context["cl"].result_list] == ["workflows.step:2"]
    response = viewer.get(reverse(CHANGELIST), {"q": "hooks.example"})
    assert response.context["cl"].result_count == 1
    response = viewer.get(reverse(CHANGELIST), {"q": "workflows.step:3"})
    assert [e.status for e in response.context["cl"].result_list] == ["dispatched"]
    # Read-only: no add view, no delete view; the detail page has no form field.
    assert viewer.get(reverse("admin:celery_steplock_effect_add")).status_code == 403
    detail = viewer.get(reverse("admin:celery_steplock_effect_change", args=(dead.pk,)))
    assert detail.status_code == 200 and b'name="key"' not in detail.content
    assert (
        viewer.post(reverse("admin:celery_steplock_effect_delete", args=(dead.pk,))).status_code
        == 403
    )


def test_without_replay_effect_the_actions_are_refused(viewer, django_user_model):
    dead = make(1)
    page = viewer.get(reverse(CHANGELIST)).content.decode()
    assert 'value="retry_now"' not in page and 'value="discard"' not in page
    for name in ("retry_now", "discard"):
        response = action(viewer, name, [dead], confirm=True)
        # The user has no action at all: Django's changelist ignores the POST (the list).
        assert response.status_code == 200 and "effect" not in " ".join(messages_of(response))
    dead.refresh_from_db()
    assert (dead.status, dead.attempts) == ("dead", 10)
    assert not LeaseEvent.objects.filter(event__startswith="effect_").exists()
    plain = login(staff_user(django_user_model, "plain"))
    assert plain.get(reverse(CHANGELIST)).status_code == 403


def test_retry_now_confirms_then_sets_pending_due_now_and_audits(replayer):
    dead, other = make(1), make(2)
    page = replayer.get(reverse(CHANGELIST)).content.decode()
    assert 'value="retry_now"' in page and 'value="discard"' in page
    response = action(replayer, "retry_now", [dead])
    assert response.status_code == 200  # the confirmation page, nothing done yet
    confirmation = response.content.decode()
    assert "Retry these effects now?" in confirmation and dead.key in confirmation
    assert other.key not in confirmation and "dead: 1" in confirmation
    assert 'name="post" value="yes"' in confirmation
    dead.refresh_from_db()
    assert dead.status == "dead" and not LeaseEvent.objects.exists()

    before = timezone.now()
    response = action(
        replayer, "retry_now", [dead], confirm=True, meta={"REMOTE_ADDR": "192.0.2.7"}
    )
    after = timezone.now()
    assert response.status_code == 302
    assert messages_of(response) == ["1 effect will be dispatched again by the next relay."]
    dead.refresh_from_db()
    assert (dead.status, dead.attempts, dead.claimed_by) == ("pending", 0, "")
    assert before <= dead.next_attempt_at <= after
    other.refresh_from_db()
    assert other.status == "dead"
    audit = LeaseEvent.objects.get(event="effect_retried")
    assert (audit.actor, audit.actor_host, audit.via, audit.outcome) == (
        "replayer",
        "192.0.2.7",
        "admin",
        "done",
    )
    assert (audit.key, audit.step, audit.task_id) == (dead.key, dead.step, "task-1")


def test_discard_and_what_it_leaves_alone(replayer):
    dead = make(1)
    sent = make(2, status="dispatched", dispatched_at=timezone.now(), outcome="202")
    response = action(replayer, "discard", [dead, sent])
    assert response.status_code == 200
    page = response.content.decode()
    assert "Discard these effects?" in page
    assert "dead: 1" in page and "dispatched: 1" in page
    response = action(replayer, "discard", [dead, sent], confirm=True)
    assert response.status_code == 302
    assert messages_of(response) == [
        "1 effect discarded.",
        "1 effect(s) left as they were: status dispatched.",
    ]
    dead.refresh_from_db()
    sent.refresh_from_db()
    assert dead.status == "discarded" and sent.status == "dispatched"
    outcomes = dict(
        LeaseEvent.objects.filter(event="effect_discarded").values_list("key", "outcome")
    )
    assert outcomes == {dead.key: "done", sent.key: "refused"}


def test_select_across_retries_every_row_of_the_filter(replayer):
    dead = [make(n) for n in range(1, 4)]
    pending = make(9, status="pending")
    query = "?status__exact=dead"
    # The page's checkboxes carry one row; "select all" carries the filter.
    response = action(replayer, "retry_now", dead[:1], query=query, select_across="1")
    page = response.content.decode()
    assert response.status_code == 200 and "dead: 3" in page
    assert 'name="select_across" value="1"' in page
    response = action(
        replayer, "retry_now", dead[:1], confirm=True, query=query, select_across="1"
    )
    assert messages_of(response) == ["3 effects will be dispatched again by the next relay."]
    assert set(Effect.objects.values_list("status", flat=True)) == {"pending"}
    assert LeaseEvent.objects.filter(event="effect_retried").count() == 3
    pending.refresh_from_db()
    assert pending.attempts == 0


@pytest.mark.django_db(transaction=True)
def test_actions_work_under_atomic_requests(replayer, monkeypatch):
    """The audit rows commit in durable transactions before the change: the changelist is
    kept out of ATOMIC_REQUESTS' transaction, as the force release is."""
    monkeypatch.setitem(connections.settings["default"], "ATOMIC_REQUESTS", True)
    dead = make(1)
    response = action(replayer, "retry_now", [dead], confirm=True)
    assert messages_of(response) == ["1 effect will be dispatched again by the next relay."]
    dead.refresh_from_db()
    assert dead.status == "pending"
    assert LeaseEvent.objects.get(event="effect_retried").outcome == "done"


CORRUPT = [
    ["not", "an", "object"],
    "a bare string",
    42,
    {"headers": ["Authorization", "Bearer in-a-list"], "json": {"deep": [1, {"x": None}]}},
    {"args": "not a list", "kwargs": 5},
    {"headers": {"Authorization": "Bearer s3cret-token", "X-Api-Key": "k3y", "Accept": "a/b"}},
]


def test_corrupt_payloads_never_break_the_pages(replayer, viewer):
    rows = [
        make(n, kind="http", target="https://hooks.example/x", payload=payload)
        for n, payload in enumerate(CORRUPT, start=1)
    ]
    for client in (replayer, viewer):
        assert client.get(reverse(CHANGELIST)).status_code == 200
        for row in rows:
            response = client.get(reverse("admin:celery_steplock_effect_change", args=(row.pk,)))
            assert response.status_code == 200, row.payload
    masked = replayer.get(reverse("admin:celery_steplock_effect_change", args=(rows[-1].pk,)))
    text = masked.content.decode()
    assert "s3cret-token" not in text and "k3y" not in text and "a/b" in text
    hidden = viewer.get(reverse("admin:celery_steplock_effect_change", args=(rows[-1].pk,)))
    text = hidden.content.decode()
    assert "a/b" not in text and "hidden: reading it needs the permission" in text
    # The confirmation page lists them too.
    response = action(replayer, "discard", rows)
    assert response.status_code == 200 and f"dead: {len(rows)}" in response.content.decode()
