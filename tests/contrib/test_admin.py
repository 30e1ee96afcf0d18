"""The "Held leases" admin page and its force release (Django test client, real Redis).

Leases are acquired through RedisStepLock (the one the admin reads: ``get_lock(app)``); the
database is the test database of pytest-django.
"""
from __future__ import annotations

import re
import time
import uuid
from collections import Counter
from urllib.parse import parse_qs, urlsplit

import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.test import Client
from django.urls import NoReverseMatch, reverse

from celery_steplock import signals
from celery_steplock.contrib.django.admin import LeaseAdmin
from celery_steplock.contrib.django.models import Lease
from celery_steplock.keys import lease_key
from celery_steplock.lock import holder_metadata
from celery_steplock.task import get_lock
from django_app.workflows.models import Step
from django_app.workflows.tasks import advance, compensate
from tests.helpers import closed_port_url

pytestmark = pytest.mark.django_db

CHANGELIST = "admin:celery_steplock_lease_changelist"
RELEASE = "admin:celery_steplock_lease_release"
ADVANCE = advance.name  # a registered StepLockedTask of the example project


@pytest.fixture
def store(app, redis_client):
    """The RedisStepLock the admin reads (the app's settings), on a flushed Redis."""
    return get_lock(app)


def grab(store, name, task_name=ADVANCE, step=None, ttl=60.0, worker="w1@box"):
    """Acquire ``name`` with the metadata a StepLockedTask stores; returns the Lease."""
    lease = store.acquire(name, ttl=ttl, metadata=holder_metadata(
        uuid.uuid4().hex, task_name, 0, worker=worker, step=step))
    assert lease is not None
    return lease


def staff_user(django_user_model, username, *perms):
    user = django_user_model.objects.create_user(username, password="pw", is_staff=True)
    for perm in perms:
        app_label, codename = perm.split(".")
        user.user_permissions.add(Permission.objects.get(
            content_type__app_label=app_label, codename=codename))
    return user


@pytest.fixture
def viewer(django_user_model):
    return staff_user(django_user_model, "viewer", "celery_steplock.view_lease")


@pytest.fixture
def releaser(django_user_model):
    return staff_user(django_user_model, "releaser", "celery_steplock.view_lease",
                      "celery_steplock.force_release_lease")


def login(user, **kwargs):
    client = Client(**kwargs)
    client.force_login(user)
    return client


def names_on(response):
    return [row["lease"].name for row in response.context["rows"]]


def messages_of(response):
    return [str(m) for m in response.context["messages"]]


# -- access ----------------------------------------------------------------------------------

def test_anonymous_is_sent_to_the_login_page(client, store):
    url = reverse(CHANGELIST)
    response = client.get(url)
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("admin:login"))
    assert parse_qs(urlsplit(response["Location"]).query)["next"] == [url]


def test_staff_without_view_lease_gets_403(django_user_model, store):
    client = login(staff_user(django_user_model, "plain"))
    assert client.get(reverse(CHANGELIST)).status_code == 403
    assert client.get(reverse(RELEASE), {"name": "x"}).status_code == 403


def test_permissions_exist_and_there_is_no_delete_or_add_view(viewer):
    codenames = set(Permission.objects.filter(
        content_type=ContentType.objects.get_for_model(Lease)).values_list("codename",
                                                                           flat=True))
    assert codenames == {"view_lease", "force_release_lease"}
    for name in ("add", "change", "delete", "history"):
        with pytest.raises(NoReverseMatch):
            reverse(f"admin:celery_steplock_lease_{name}", args=("x",) if name != "add"
                    else ())
    assert LeaseAdmin(Lease, None).get_actions(None) == {}


def test_admin_index_lists_held_leases_for_a_viewer(viewer, store):
    response = login(viewer).get(reverse("admin:index"))
    assert response.status_code == 200
    assert reverse(CHANGELIST).encode() in response.content
    assert b"Held leases" in response.content


# -- the list --------------------------------------------------------------------------------

def test_lists_leases_with_holder_details_never_cached(viewer, store):
    step = Step.objects.create(name="s")
    one = grab(store, f"step:{step.pk}", step=f"workflows.step:{step.pk}")
    two = grab(store, "report:7", task_name="reports.build", worker="w2@other")
    response = login(viewer).get(reverse(CHANGELIST))
    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"] and "max-age=0" in response["Cache-Control"]
    assert sorted(names_on(response)) == sorted([one.name, two.name])
    html = response.content.decode().replace("<wbr>", "")  # dotted names may wrap
    for text in (one.name, ADVANCE, "reports.build", "w1@box", "w2@other",
                 str(one.fence), str(two.fence), f"workflows.step:{step.pk}", one.owner[:8]):
        assert text in html
    rows = {row["lease"].name: row for row in response.context["rows"]}
    lease = rows[one.name]["lease"]
    assert lease.fence == one.fence and lease.owner == one.owner
    assert lease.pid and lease.hostname and lease.acquired_at and lease.renewed_at
    assert 0 < lease.ttl_left <= 60 and 0 <= lease.age < 30
    # the viewer may not see steps or task results: no links, and no force release
    assert rows[one.name]["step_url"] is None and rows[one.name]["task_url"] is None
    assert "Force release" not in html


def test_superuser_gets_step_and_task_result_links(admin_client, store):
    step = Step.objects.create(name="s")
    one = grab(store, f"step:{step.pk}", step=f"workflows.step:{step.pk}")
    grab(store, "other", step="nosuchapp.model:3")
    response = admin_client.get(reverse(CHANGELIST))
    rows = {row["lease"].name: row for row in response.context["rows"]}
    assert rows[one.name]["step_url"] == reverse("admin:workflows_step_change",
                                                 args=(step.pk,))
    task_id = response.context["rows"][0]["lease"].task_id
    assert task_id
    task_url = rows[one.name]["task_url"]
    assert task_url.startswith(reverse("admin:django_celery_results_taskresult_changelist"))
    assert f"task_id={rows[one.name]['lease'].task_id}" in task_url
    assert rows["other"]["step_url"] is None  # an unknown model is shown, not linked
    html = response.content.decode()
    assert f'href="{rows[one.name]["step_url"]}"' in html
    assert admin_client.get(task_url).status_code == 200  # a valid changelist filter
    assert rows[one.name]["release_url"] and "Force release" in html


def test_search_by_task_name_step_id_and_filter_by_task_name(viewer, store):
    grab(store, "a", task_name="billing.charge", step="workflows.step:4")
    grab(store, "b", task_name="billing.refund", step="workflows.step:14")
    grab(store, "c", task_name="mail.send", step="workflows.step:40")
    client = login(viewer)
    url = reverse(CHANGELIST)
    assert sorted(names_on(client.get(url, {"q": "billing"}))) == ["a", "b"]
    assert names_on(client.get(url, {"q": "REFUND"})) == ["b"]
    assert names_on(client.get(url, {"q": "4"})) == ["a"]  # the step id, exactly
    grab(store, "step:4", task_name="other.task")
    assert sorted(names_on(client.get(url, {"q": "4"}))) == ["a", "step:4"]
    assert names_on(client.get(url, {"q": "workflows.step:40"})) == ["c"]
    assert names_on(client.get(url, {"task_name": "mail.send"})) == ["c"]
    assert names_on(client.get(url, {"task_name": "billing.charge", "q": "refund"})) == []
    task_id = store.inspect("c")["task_id"]
    assert names_on(client.get(url, {"q": task_id})) == ["c"]
    response = client.get(url, {"task_name": "mail.send"})
    # the filter sidebar offers the registered StepLockedTasks plus the active filter
    choices = {str(c["display"]).replace("<wbr>", ""): c
               for c in response.context["filter_choices"]}
    assert choices["mail.send"]["selected"] and ADVANCE in choices
    assert "task_name=mail.send" not in choices["All"]["query_string"]


def test_pagination_visits_every_lease_exactly_once(viewer, store, monkeypatch):
    monkeypatch.setattr(LeaseAdmin, "list_per_page", 40)
    names = {f"bulk:{i}" for i in range(250)}
    for name in names:
        grab(store, name)
    client = login(viewer)
    url, seen, pages = reverse(CHANGELIST), Counter(), 0
    query = "?"
    while query is not None:
        response = client.get(url + query)
        assert response.status_code == 200
        pages += 1
        seen.update(names_on(response))
        assert len(response.context["rows"]) <= 40 * 3
        query = response.context["next_url"]
        if query is not None:
            assert f'href="{query.replace("&", "&amp;")}"' in response.content.decode()
        assert pages < 50
    assert set(seen) == names and set(seen.values()) == {1}
    assert pages >= 3
    assert response.context["first_url"] == "?"  # a way back from the last page


def test_first_page_is_bounded_with_100000_leases(viewer, store):
    """SCAN, never KEYS: the first page reads a bounded number of keys whatever Redis holds."""
    client_ = store.client
    ttl_ms = 600_000
    for start in range(0, 100_000, 10_000):
        pipe = client_.pipeline(transaction=False)
        for i in range(start, start + 10_000):
            key = lease_key(store.prefix, f"load:{i}")
            pipe.hset(key, mapping={"owner": uuid.uuid4().hex, "fence": i + 1,
                                    "task_name": "load.task", "acquired_ms": 1,
                                    "renewed_ms": 1, "ttl_ms": ttl_ms, "pid": 1})
            pipe.pexpire(key, ttl_ms)
        pipe.execute()
    assert client_.dbsize() >= 100_000
    client = login(viewer)
    started = time.monotonic()
    response = client.get(reverse(CHANGELIST))
    elapsed = time.monotonic() - started
    page = response.context["page"]
    assert response.status_code == 200 and response.context["next_url"]
    assert LeaseAdmin.list_per_page <= len(response.context["rows"]) <= 3 * LeaseAdmin.list_per_page
    assert page.steps <= 3 and page.examined <= 3 * LeaseAdmin.list_per_page
    assert elapsed < 5.0, f"first page took {elapsed:.2f}s"
    # a search that matches nothing stops at the per-page budget and offers the next page
    response = client.get(reverse(CHANGELIST), {"q": "no-such-task"})
    page = response.context["page"]
    assert response.context["rows"] == [] and response.context["next_url"]
    assert page.steps == LeaseAdmin.max_scan_steps
    assert page.examined <= LeaseAdmin.max_scan_steps * LeaseAdmin.filtered_scan_count * 2
    assert "Later pages may still hold some" in response.content.decode()


def test_redis_unreachable_renders_an_error_not_a_500(app, viewer, releaser):
    app.conf.steplock_redis_url = closed_port_url()
    response = login(viewer).get(reverse(CHANGELIST))
    assert response.status_code == 200
    assert response.context["store_error"]
    assert any("could not be read" in m for m in messages_of(response))
    response = login(releaser).get(reverse(RELEASE), {"name": "x"}, follow=True)
    assert response.status_code == 200
    assert any("could not be read" in m for m in messages_of(response))
    response = login(releaser).post(reverse(RELEASE), {"name": "x", "owner": "y"},
                                    follow=True)
    assert any("nothing released" in m for m in messages_of(response))


# -- force release -----------------------------------------------------------------------------

@pytest.fixture
def released_signals():
    received = []

    def receiver(sender=None, **kwargs):
        received.append(dict(kwargs, sender=sender))

    signals.lock_released.connect(receiver, weak=False, dispatch_uid="test-admin-released")
    yield received
    signals.lock_released.disconnect(receiver, dispatch_uid="test-admin-released")


def csrf_token_of(response):
    match = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', response.content.decode())
    assert match, "no CSRF token on the page"
    return match.group(1)


def test_viewer_cannot_force_release(viewer, store):
    lease = grab(store, "step:1")
    client = login(viewer)
    assert client.get(reverse(RELEASE), {"name": lease.name}).status_code == 403
    response = client.post(reverse(RELEASE), {"name": lease.name, "owner": lease.owner})
    assert response.status_code == 403
    assert store.inspect(lease.name)["owner"] == lease.owner


def test_confirmation_page_shows_the_holder_and_get_never_releases(releaser, store):
    lease = grab(store, "step:1", step="workflows.step:1")
    response = login(releaser).get(reverse(RELEASE), {"name": lease.name})
    assert response.status_code == 200
    html = response.content.decode()
    for text in (lease.owner, ADVANCE, lease.task_id, "w1@box", str(lease.fence),
                 "workflows.step:1", 'method="post"'):
        assert text in html
    assert response.context["form"].initial["owner"] == lease.owner
    assert f'name="owner" value="{lease.owner}"' in html
    assert store.inspect(lease.name)["owner"] == lease.owner


def test_post_without_csrf_token_is_rejected(releaser, store):
    lease = grab(store, "step:1")
    client = login(releaser, enforce_csrf_checks=True)
    response = client.post(reverse(RELEASE), {"name": lease.name, "owner": lease.owner})
    assert response.status_code == 403
    assert store.inspect(lease.name)["owner"] == lease.owner


def test_stale_owner_releases_nothing(releaser, store, released_signals):
    lease = grab(store, "step:1")
    client = login(releaser, enforce_csrf_checks=True)
    page = client.get(reverse(RELEASE), {"name": lease.name})
    shown = page.context["form"].initial["owner"]
    # the holder finishes and another attempt takes the lease before the operator confirms
    assert store.release(lease.name, lease.owner)
    newer = grab(store, lease.name, task_name=compensate.name)
    response = client.post(reverse(RELEASE), {"name": lease.name, "owner": shown,
                                              "csrfmiddlewaretoken": csrf_token_of(page)},
                           follow=True)
    assert response.status_code == 200
    [message] = messages_of(response)
    assert "now held by another owner" in message and "nothing released" in message
    assert newer.owner in message
    assert store.inspect(lease.name)["owner"] == newer.owner
    assert not LogEntry.objects.exists() and released_signals == []
    # and once it is gone altogether
    assert store.release(lease.name, newer.owner)
    response = client.post(reverse(RELEASE), {"name": lease.name, "owner": newer.owner,
                                              "csrfmiddlewaretoken": csrf_token_of(page)},
                           follow=True)
    [message] = messages_of(response)
    assert "already gone" in message and "nothing released" in message


def test_force_release_by_the_shown_owner(releaser, store, released_signals):
    lease = grab(store, "step:1", step="workflows.step:1")
    keep = grab(store, "step:2")
    client = login(releaser, enforce_csrf_checks=True)
    query = "?q=workflows&p=1"
    listing = client.get(reverse(CHANGELIST) + query)
    [row] = [r for r in listing.context["rows"] if r["lease"].name == lease.name]
    page = client.get(row["release_url"])
    assert page.status_code == 200
    form = page.context["form"].initial
    response = client.post(row["release_url"], {
        "name": form["name"], "owner": form["owner"],
        "changelist_filters": form["changelist_filters"],
        "csrfmiddlewaretoken": csrf_token_of(page)})
    assert response.status_code == 302
    assert response["Location"] == reverse(CHANGELIST) + "?q=workflows"  # filters kept
    assert store.inspect(lease.name) is None
    assert store.inspect(keep.name)["owner"] == keep.owner  # nothing else touched
    message = messages_of(client.get(response["Location"]))[0]
    assert "Force-released" in message and lease.owner in message
    entry = LogEntry.objects.get()
    assert entry.action_flag == DELETION and entry.user == releaser
    assert entry.content_type == ContentType.objects.get_for_model(Lease)
    assert entry.object_id == lease.name and entry.object_repr == lease.name
    assert lease.owner in entry.change_message and str(lease.fence) in entry.change_message
    [sent] = released_signals
    assert sent["forced"] is True and sent["event"] == "lock_released"
    assert sent["owner"] == lease.owner and sent["fence"] == lease.fence
    assert sent["name"] == lease.name and sent["key"] == lease.key
    assert sent["task_name"] == ADVANCE and sent["task_id"] == lease.task_id
    assert "releaser" in sent["reason"]
    # the sender is the holder's registered task when this process knows it
    assert getattr(sent["sender"], "name", None) == ADVANCE


def test_release_put_is_not_allowed(releaser, store):
    lease = grab(store, "step:1")
    response = login(releaser).put(reverse(RELEASE) + f"?name={lease.name}")
    assert response.status_code == 405
    assert store.inspect(lease.name)["owner"] == lease.owner


def test_lease_event_admin_is_read_only(admin_client):
    url = reverse("admin:celery_steplock_leaseevent_changelist")
    assert admin_client.get(url).status_code == 200
    assert admin_client.get(reverse("admin:celery_steplock_leaseevent_add")).status_code == 403
