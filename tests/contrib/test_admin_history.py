"""A lock name's timeline in the admin (celery_steplock.contrib.django.admin.history), the
history's outcomes of task executions, and ``celery steplock history``."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from urllib.parse import urlencode

import pytest
from django.test import Client
from django.urls import reverse

from celery_steplock.contrib.django.models import LeaseEvent
from celery_steplock.keys import history_key
from celery_steplock.lock import get_lease_store, holder_metadata
from django_app.workflows.models import Step
from django_app.workflows.tasks import advance
from tests.support.admin import staff

pytestmark = pytest.mark.django_db

HISTORY = "admin:celery_steplock_lease_timeline"
CHANGELIST = "admin:celery_steplock_lease_changelist"


@pytest.fixture
def store(app, redis_client):
    return get_lease_store(app)


@pytest.fixture
def viewer(django_user_model):
    return staff(django_user_model, "viewer", "celery_steplock.view_lease")


def timeline(client, name, **extra):
    return client.get(reverse(HISTORY) + "?" + urlencode({"name": name, **extra}))


def grab(store, name):
    lease = store.acquire(
        name, ttl=60.0, metadata=holder_metadata(uuid.uuid4().hex, advance.name, 0)
    )
    assert lease is not None
    return lease


def test_the_timeline_lists_the_events_newest_first(store, viewer):
    lease = grab(store, "order:1")
    assert store.acquire("order:1", ttl=5.0) is None
    store.release("order:1", lease.owner, outcome="committed", task_id=lease.task_id)
    response = timeline(viewer, "order:1")
    assert response.status_code == 200
    page = response.content.decode()
    order = [page.index(f'class="history-{e}') for e in ("released", "contended", "acquired")]
    assert order == sorted(order)
    assert "committed" in page and str(lease.fence) in page and "1 refused acquire" in page


def test_the_held_leases_rows_and_the_event_log_link_the_timeline(
    store, viewer, django_user_model
):
    grab(store, "order:7")
    url = reverse(HISTORY) + "?" + urlencode({"name": "order:7"})
    page = viewer.get(reverse(CHANGELIST)).content.decode()
    assert f'class="lease-history" href="{url.replace("&", "&amp;")}"' in page
    LeaseEvent.objects.create(event="lock_acquired", name="order:7", owner="o", fence=1)
    superuser = django_user_model.objects.create_superuser("root", password="pw")
    client = Client()
    client.force_login(superuser)
    events = client.get(reverse("admin:celery_steplock_leaseevent_changelist"))
    assert events.status_code == 200 and url in events.content.decode()


def test_a_user_without_view_lease_is_refused(store, django_user_model):
    grab(store, "order:1")
    outsider = staff(django_user_model, "outsider", "celery_steplock.view_leaseevent")
    assert timeline(outsider, "order:1").status_code == 403


def test_a_corrupt_history_shows_malformed_never_a_500(store, viewer, redis_client):
    key = history_key(store.prefix, "order:1")
    seconds, _micros = redis_client.time()
    ms = str(seconds * 1000)
    redis_client.lpush(key, ms + "\x1fexploded")
    redis_client.lpush(key, ms + "\x1freleased\x1fo\x1fnope\x1f\x1f\x1fx")
    redis_client.lpush(key, ms + "\x1facquired\x1f<script>alert(1)</script>")
    response = timeline(viewer, "order:1")
    assert response.status_code == 200
    page = response.content.decode()
    assert page.count('class="errornote">malformed') == 2
    assert "<script>alert(1)" not in page
    redis_client.delete(key)
    redis_client.set(key, "a string")
    response = timeline(viewer, "order:1")
    assert response.status_code == 200 and "not a list" in response.content.decode()
    # A bad offset or lock name: a message, not an error.
    assert timeline(viewer, "order:1", offset="x").status_code == 200
    assert timeline(viewer, "order:1", offset="99999999").status_code == 200
    assert timeline(viewer, "").status_code == 200


@pytest.mark.parametrize("ms", ["9999999999999999999", "999999999999999", "99999999999999"])
def test_a_far_future_entry_is_a_malformed_row_never_a_500(store, viewer, redis_client, ms):
    """A time past year 9999 (datetime cannot show it) or over a day ahead of Redis time
    (the scripts stamp entries with it): a malformed row."""
    redis_client.lpush(history_key(store.prefix, "order:1"), ms + "\x1facquired\x1fo1")
    response = timeline(viewer, "order:1")
    assert response.status_code == 200
    assert response.content.decode().count('class="errornote">malformed') == 1


def test_the_timeline_escapes_a_hostile_name(store, viewer, redis_client):
    name = '<img src=x onerror=alert(1)>"'
    seconds, _micros = redis_client.time()
    redis_client.lpush(
        history_key(store.prefix, name),
        f"{seconds * 1000}\x1facquired\x1f<b>o</b>\x1f1\x1f<i>t</i>",
    )
    response = timeline(viewer, name)
    page = response.content.decode()
    assert response.status_code == 200
    assert "<img src=x" not in page and "<b>o</b>" not in page and "<i>t</i>" not in page


def test_the_timeline_pages_back(store, viewer, monkeypatch):
    from celery_steplock.contrib.django.admin import LeaseAdmin

    monkeypatch.setattr(LeaseAdmin, "timeline_per_page", 40)
    for _ in range(60):  # 120 entries, 100 kept (steplock_history_max_entries)
        lease = grab(store, "busy")
        store.release("busy", lease.owner)
    pages, query = [], "?" + urlencode({"name": "busy"})
    while query:
        response = viewer.get(reverse(HISTORY) + query)
        assert response.status_code == 200
        pages.append([row["entry"].id for row in response.context["rows"]])
        query = response.context["next_url"]
    assert [len(page) for page in pages] == [40, 40, 20]
    assert sum(pages, []) == [str(n) for n in range(100)]


def test_a_task_execution_records_its_outcome(store, redis_client):
    step = Step.objects.create(name="s")
    result = advance.apply(args=(step.pk,))
    assert result.successful(), result.traceback
    [key] = redis_client.keys(f"{store.prefix}:history:*")
    name = key.split("{", 1)[1].rsplit("}", 1)[0]
    released, acquired = store.history(name)
    assert (acquired.event, released.event, released.outcome) == (
        "acquired",
        "released",
        "committed",
    )
    assert released.task_id == acquired.task_id == result.id
    # The step moved on: a second execution ends as a duplicate (on_conflict="return") or
    # a conflict, and says so in the history.
    again = advance.apply(args=(step.pk,))
    assert store.history(name)[0].outcome in ("duplicate", "conflict")
    assert again.id == store.history(name)[0].task_id


@pytest.mark.django_db(transaction=True)
def test_the_cli_prints_typed_json(worker_env, store):
    lease = grab(store, "order:3")
    store.release("order:3", lease.owner, outcome="committed")

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "django_app", "steplock", *args],
            env=worker_env,
            cwd=worker_env["PYTHONPATH"],
            capture_output=True,
            text=True,
            timeout=120,
        )

    out = cli("history", "order:3", "--json")
    assert out.returncode == 0, out.stderr
    released, acquired = json.loads(out.stdout)
    assert released["event"] == "released" and released["outcome"] == "committed"
    assert isinstance(released["fence"], int) and released["fence"] == lease.fence
    assert isinstance(released["at"], float) and released["contended"] == 0
    assert acquired["event"] == "acquired" and acquired["owner"] == lease.owner
    table = cli("history", "order:3", "--count", "1")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["TIME", "(UTC)", "EVENT"] and len(lines) == 2
    assert "released" in lines[1] and "committed" in lines[1]
    empty = cli("history", "nothing-here")
    assert empty.returncode == 0 and "no history" in empty.stdout
