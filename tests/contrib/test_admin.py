"""The "Held leases" admin page and its force release (Django test client, real Redis).

Leases are acquired through RedisLeaseStore (the one the admin reads: ``get_lease_store(app)``);
the database is the test database of pytest-django. How many keys one SCAN step returns
depends on the Redis server's per-start hash seed (a step returns whole hash buckets), so the
page tests assert the bounds ``lease_page`` guarantees, never the figures of one run.
"""

from __future__ import annotations

import html as html_lib
from contextlib import contextmanager
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit

import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.admin.utils import quote
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.urls import NoReverseMatch, reverse

from celery_steplock import signals
from celery_steplock.contrib.django.admin import LeaseAdmin
from celery_steplock.contrib.django.leases import (
    STOP_BUDGET,
    STOP_COMPLETE,
    STOP_FULL,
    STOP_NO_ROOM,
    STOP_STEPS,
    lease_page,
)
from celery_steplock.contrib.django.models import Lease, LeaseEvent
from celery_steplock.keys import lease_key
from celery_steplock.lock import get_lease_store, holder_metadata
from django_app.workflows.models import Step
from django_app.workflows.tasks import advance, compensate
from tests.helpers import closed_port_url
from tests.support.admin import login, staff_user

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]
CHANGELIST = "admin:celery_steplock_lease_changelist"
RELEASE = "admin:celery_steplock_lease_release"
ADVANCE = advance.name  # a registered StepLockedTask of the example project


@pytest.fixture
def store(app, redis_client):
    """The RedisLeaseStore the admin reads (the app's settings), on a flushed Redis."""
    return get_lease_store(app)


def grab(store, name, task_name=ADVANCE, step=None, ttl=60.0, worker="w1@box"):
    """Acquire ``name`` with the metadata a StepLockedTask stores; returns the Lease."""
    lease = store.acquire(
        name,
        ttl=ttl,
        metadata=holder_metadata(uuid.uuid4().hex, task_name, 0, worker=worker, step=step),
    )
    assert lease is not None
    return lease


@pytest.fixture
def viewer(django_user_model):
    return staff_user(django_user_model, "viewer", "celery_steplock.view_lease")


@pytest.fixture
def releaser(django_user_model):
    return staff_user(
        django_user_model,
        "releaser",
        "celery_steplock.view_lease",
        "celery_steplock.force_release_lease",
    )


def fill(store, names, task_name=ADVANCE, ttl_ms=600_000):
    """Write leases ``names`` straight into Redis (HSET + PEXPIRE in one pipeline, the hash a
    StepLockedTask stores), far faster than acquiring them one by one."""
    seconds, micros = store.client.time()
    now = int(seconds) * 1000 + int(micros) // 1000
    pipe = store.client.pipeline(transaction=False)
    for i, name in enumerate(names):
        key = lease_key(store.prefix, name)
        pipe.hset(
            key,
            mapping={
                "owner": uuid.uuid4().hex,
                "task_name": task_name(i) if callable(task_name) else task_name,
                "task_id": str(uuid.uuid4()),
                "hostname": "box",
                "pid": 1000 + i,
                "worker": "w1@box",
                "fence": i + 1,
                "acquired_ms": now - i,
                "renewed_ms": now,
                "ttl_ms": ttl_ms,
            },
        )
        pipe.pexpire(key, ttl_ms)
        if i % 10_000 == 9_999:
            pipe.execute()
    pipe.execute()


def walk(client, query="?", max_pages=200):
    """Follow the "next page" links from ``query``; returns (Counter of lease names,
    responses)."""
    url, seen, responses = reverse(CHANGELIST), Counter(), []
    while query is not None:
        response = client.get(url + query)
        assert response.status_code == 200
        responses.append(response)
        seen.update(names_on(response))
        query = response.context["next_url"]
        if query is not None:  # the link on the page is the one in the context
            assert f'href="{html_lib.escape(query)}"' in response.content.decode()
        assert len(responses) < max_pages
    return seen, responses


def assert_bounded(page, per_page, key_budget, max_steps):
    """What lease_page guarantees for one page, whatever the sizes of SCAN's steps."""
    assert page.read <= key_budget or page.overran, (page.read, key_budget)
    assert page.steps <= max_steps
    assert len(page.leases) <= per_page or page.overran
    assert page.examined <= page.read  # every row shown was read by this very page
    reasons = {
        STOP_COMPLETE: page.complete,
        STOP_FULL: len(page.leases) >= per_page - per_page // 20,
        STOP_NO_ROOM: not page.complete,
        # spent, or the next step's keys (declined) did not fit in what was left
        STOP_BUDGET: (page.read == key_budget or page.read + page.declined > key_budget)
        and not page.complete,
        STOP_STEPS: page.steps == max_steps and not page.complete,
    }
    assert page.stop in reasons and reasons[page.stop], (page.stop, page)


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
    codenames = set(
        Permission.objects.filter(
            content_type=ContentType.objects.get_for_model(Lease)
        ).values_list("codename", flat=True)
    )
    assert codenames == {"view_lease", "force_release_lease"}
    for name in ("add", "delete", "history"):
        with pytest.raises(NoReverseMatch):
            reverse(f"admin:celery_steplock_lease_{name}", args=("x",) if name != "add" else ())
    assert LeaseAdmin(Lease, None).get_actions(None) == {}


def test_the_change_url_is_only_a_search_for_the_lease(viewer, django_user_model, store):
    """Admin templates link an object to its change page (the force-release confirmation's
    breadcrumbs do): for a lease that is Held leases searching for its name, GET or POST."""
    lease = grab(store, "report:7/a b")
    url = reverse("admin:celery_steplock_lease_change", args=(quote(lease.name),))
    expected = reverse(CHANGELIST) + "?" + urlencode({"q": lease.name})
    client = login(viewer)
    for method in (client.get, client.post):
        response = method(url)
        assert response.status_code == 302 and response["Location"] == expected
    assert names_on(client.get(expected)) == [lease.name]
    assert store.inspect(lease.name)["owner"] == lease.owner
    assert login(staff_user(django_user_model, "plain")).get(url).status_code == 403


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
    for text in (
        one.name,
        ADVANCE,
        "reports.build",
        "w1@box",
        "w2@other",
        str(one.fence),
        str(two.fence),
        f"workflows.step:{step.pk}",
        one.owner[:8],
    ):
        assert text in html
    rows = {row["lease"].name: row for row in response.context["rows"]}
    lease = rows[one.name]["lease"]
    assert lease.fence == one.fence and lease.owner == one.owner
    assert lease.pid and lease.hostname and lease.acquired_at and lease.renewed_at
    assert 0 < lease.ttl_left <= 60 and 0 <= lease.age < 30
    # the viewer may not see steps or task results: no links, and no force release
    assert rows[one.name]["step_url"] is None and rows[one.name]["task_url"] is None
    assert "Force release" not in html


def test_pages_extend_djangos_own_admin_templates(admin_client, store):
    """The breadcrumbs, search bar, filter and footer come from Django's templates (each
    version's own markup); only the table and the cursor paginator are the project's."""
    lease = grab(store, "step:1", task_name="billing.charge")
    response = admin_client.get(reverse(CHANGELIST), {"task_name": "billing.charge"})
    used = [t.name for t in response.templates]
    for name in (
        "admin/celery_steplock/lease/change_list.html",
        "admin/change_list.html",
        "admin/base_site.html",
        "admin/search_form.html",
        "admin/filter.html",
        "admin/celery_steplock/lease/pagination.html",
    ):
        assert name in used, (name, used)
    assert "admin/pagination.html" not in used  # no numbered pages for a SCAN
    html = response.content.decode()
    assert 'id="changelist-filter"' in html and 'id="changelist-search"' in html
    assert 'class="breadcrumbs"' in html and "By task name" in html
    # Django's "Clear all filters" drops the filter and keeps the search.
    assert response.context["cl"].clear_all_filters_qs == "?"
    assert 'name="task_name" value="billing.charge"' in html  # the search keeps the filter
    response = admin_client.get(reverse(CHANGELIST), {"task_name": "billing.charge", "q": "step"})
    assert response.context["cl"].clear_all_filters_qs == "?q=step"
    response = admin_client.get(reverse(RELEASE), {"name": lease.name})
    used = [t.name for t in response.templates]
    assert "admin/delete_confirmation.html" in used, used
    change = reverse("admin:celery_steplock_lease_change", args=(quote(lease.name),))
    assert f'href="{change}"' in response.content.decode()  # the lease's breadcrumb


def test_superuser_gets_step_and_task_result_links(admin_client, store):
    step = Step.objects.create(name="s")
    one = grab(store, f"step:{step.pk}", step=f"workflows.step:{step.pk}")
    grab(store, "other", step="nosuchapp.model:3")
    response = admin_client.get(reverse(CHANGELIST))
    rows = {row["lease"].name: row for row in response.context["rows"]}
    assert rows[one.name]["step_url"] == reverse("admin:workflows_step_change", args=(step.pk,))
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
    choices = {
        str(c["display"]).replace("<wbr>", ""): c for c in response.context["filter_choices"]
    }
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
        assert_bounded(
            response.context["page"], 40, LeaseAdmin.scan_key_budget, LeaseAdmin.max_scan_steps
        )
        query = response.context["next_url"]
        if query is not None:
            assert f'href="{query.replace("&", "&amp;")}"' in response.content.decode()
        assert pages < 50
    assert set(seen) == names and set(seen.values()) == {1}
    assert pages >= 3
    assert response.context["first_url"] == "?"  # a way back from the last page


PAGE_BOUNDS = (LeaseAdmin.list_per_page, LeaseAdmin.scan_key_budget, LeaseAdmin.max_scan_steps)


@pytest.mark.parametrize(
    "params",
    [{}, {"q": "bulk"}, {"q": "advance"}, {"task_name": compensate.name}],
    ids=["all", "search-matching-all", "search-half", "task-filter"],
)
def test_1050_leases_each_once_on_pages_of_at_most_100(viewer, store, params):
    """Whole SCAN steps, never more than list_per_page rows: the steps are sized to fit."""
    names = [f"bulk:{i}" for i in range(1050)]
    fill(store, names, task_name=lambda i: ADVANCE if i % 2 else compensate.name)
    expected = {n for i, n in enumerate(names) if params.get("q") != "advance" or i % 2}
    if "task_name" in params:
        expected = {n for i, n in enumerate(names) if not i % 2}
    seen, responses = walk(login(viewer), "?" + "&".join(f"{k}={v}" for k, v in params.items()))
    assert set(seen) == expected and set(seen.values()) == {1}
    pages = [r.context["page"] for r in responses]
    for page in pages:
        assert_bounded(page, *PAGE_BOUNDS)
    # every page but the last has its rows (100 less 5%) unless a bound ended it, and says so
    cut_short = sum(p.stop != STOP_FULL for p in pages[:-1])
    assert len(pages) <= len(expected) // 95 + 1 + cut_short
    last = responses[-1].context
    assert last["next_url"] is None and last["page"].complete
    assert last["page"].stop == STOP_COMPLETE
    assert last["scanned"] == 1050  # every lease key examined once over the walk
    assert "(end of the list)" in responses[-1].content.decode()


@pytest.mark.parametrize("budget", [1, 7, 60])
def test_the_key_budget_holds_on_every_page_of_a_walk(store, budget):
    """However SCAN's steps fall (their sizes follow Redis's hash seed), no page reads more
    lease hashes than its budget (a first step that cannot be cut, one hash bucket larger
    than a budget of 1, is the flagged exception), and the walk still visits every lease
    once."""
    names = {f"bulk:{i}" for i in range(400)}
    fill(store, sorted(names))
    cursor, seen, pages = 0, Counter(), []
    while True:
        page = lease_page(store, cursor, 50, key_budget=budget, max_steps=10)
        assert_bounded(page, 50, budget, 10)
        assert page.key_budget == budget
        pages.append(page)
        seen.update(info["name"] for info in page.leases)
        cursor = page.next_cursor
        if cursor == 0:
            break
        assert len(pages) < 2000
    assert set(seen) == names and set(seen.values()) == {1}
    # every lease was read by the page that shows it; none of it beyond a page's budget
    assert sum(p.read for p in pages) >= 400
    assert (
        len([p for p in pages if not p.overran]) * budget + sum(p.read for p in pages if p.overran)
        >= 400
    )
    assert sum(p.examined for p in pages) == 400


def test_rare_search_pages_say_how_many_keys_were_examined(viewer, store, monkeypatch):
    monkeypatch.setattr(LeaseAdmin, "scan_key_budget", 300)
    monkeypatch.setattr(LeaseAdmin, "filtered_scan_count", 100)  # at least list_per_page
    names = [f"bulk:{i}" for i in range(1050)]
    fill(store, names)
    seen, responses = walk(login(viewer), "?q=777")
    assert seen == Counter({"bulk:777": 1})
    # each page read at most 300 lease hashes: at least 1050 / 300 pages
    assert len(responses) >= 4
    scanned = 0
    for response in responses:
        page = response.context["page"]
        assert_bounded(page, LeaseAdmin.list_per_page, 300, LeaseAdmin.max_scan_steps)
        scanned += page.examined
        assert response.context["scanned"] == scanned
        text = re.sub(r"\s+", " ", response.content.decode())
        if not page.complete:
            assert page.stop in (STOP_BUDGET, STOP_STEPS) and page.short
            assert "next page" in text
            assert (
                f"Each page reads at most 300 lease keys: this one examined "
                f"{page.examined} lease keys in {page.steps} SCAN round trips, and "
                f"{len(page.leases)} of them match"
            ) in text
            assert f"{scanned} lease keys examined so far" in text
            assert f"the Redis database holds {store.client.dbsize()} keys" in text
        assert f"({page.read} read, of at most 300)" in text
    assert scanned == 1050
    # a new search starts over: the count of a previous walk is not carried along
    choices = responses[-1].context["filter_choices"]
    assert all(
        "scanned=" not in c["query_string"] and "cursor=" not in c["query_string"] for c in choices
    )


@pytest.mark.db_incidental  # Redis paging: one pass
def test_first_page_is_bounded_with_100000_leases(viewer, store):
    """SCAN, never KEYS: whatever Redis holds and however SCAN's steps fall (whole hash
    buckets, sized by the server's per-start hash seed), one request reads at most
    ``scan_key_budget`` lease hashes in at most ``max_scan_steps`` SCAN round trips and shows
    at most ``list_per_page`` rows, filtered or not; a page that ends at a bound says which,
    and offers the next page."""
    fill(
        store,
        [f"load:{i}" for i in range(100_000)],
        task_name=lambda i: ADVANCE if i % 2 else compensate.name,
    )
    assert store.client.dbsize() >= 100_000
    client = login(viewer)
    figures = {}
    for params in (
        {},
        {"q": "load"},
        {"q": "advance"},
        {"task_name": ADVANCE},
        {"q": "no-such-task"},
    ):
        response = client.get(reverse(CHANGELIST), params)
        assert response.status_code == 200 and response.context["next_url"]
        page = response.context["page"]
        assert_bounded(page, *PAGE_BOUNDS)
        assert page.stop != STOP_COMPLETE and page.next_cursor != 0
        assert len(response.context["rows"]) == len(page.leases)
        figures[params.get("q") or params.get("task_name") or "all"] = (
            page.read,
            page.steps,
            page.rescans,
            len(page.leases),
            page.stop,
        )
    print(f"\nfirst page of 100000 leases (read, SCAN steps, rescans, rows, stop): {figures}")
    # a search that matches nothing ends at a bound, and says so
    read, steps, _rescans, rows, stop = figures["no-such-task"]
    assert rows == 0 and stop in (STOP_BUDGET, STOP_STEPS)
    html = re.sub(r"\s+", " ", response.content.decode())
    assert response.context["rows"] == []
    assert "Later pages may still hold some" in html
    assert f"{page.examined} lease keys examined so far" in html
    assert "Each page reads at most 5000 lease keys" in html


def test_a_fresh_web_process_lists_the_autodiscovered_tasks(store):
    """``autodiscover_tasks()`` is lazy: a web process that never imported the tasks modules
    still offers the project's StepLockedTasks in the "By task name" filter."""
    script = """if True:
        import json, sys
        import django
        django.setup()
        assert "django_app.workflows.tasks" not in sys.modules
        from django.contrib import admin
        from django.contrib.auth.models import User
        from django.test import RequestFactory
        from celery_steplock.contrib.django.models import Lease, LeaseEvent
        request = RequestFactory().get("/admin/celery_steplock/lease/")
        request.user = User(username="su", is_superuser=True, is_staff=True, is_active=True)
        response = admin.site._registry[Lease].changelist_view(request)
        response.render()
        print(json.dumps({
            "choices": [str(c["display"]).replace("<wbr>", "")
                        for c in response.context_data["filter_choices"]],
            "imported": "django_app.workflows.tasks" in sys.modules}))
    """
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "django_app.settings", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout.strip().splitlines()[-1])
    assert shown["imported"]
    assert ADVANCE in shown["choices"] and compensate.name in shown["choices"]


def test_redis_unreachable_renders_an_error_not_a_500(app, viewer, releaser):
    app.conf.steplock_redis_url = closed_port_url()
    response = login(viewer).get(reverse(CHANGELIST))
    assert response.status_code == 200
    assert response.context["store_error"]
    assert any("could not be read" in m for m in messages_of(response))
    response = login(releaser).get(reverse(RELEASE), {"name": "x"}, follow=True)
    assert response.status_code == 200
    assert any("could not be read" in m for m in messages_of(response))
    response = login(releaser).post(reverse(RELEASE), {"name": "x", "owner": "y"}, follow=True)
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


def test_force_release_without_view_permission_is_refused(django_user_model, store):
    """The confirmation page shows any lease's owner token, task, host and step: the force
    release permission alone opens neither it nor the POST."""
    lease = grab(store, "step:1", step="workflows.step:1")
    user = staff_user(django_user_model, "blind", "celery_steplock.force_release_lease")
    client = login(user)
    response = client.get(reverse(RELEASE), {"name": lease.name})
    assert response.status_code == 403
    assert lease.owner not in response.content.decode()
    response = client.post(reverse(RELEASE), {"name": lease.name, "owner": lease.owner})
    assert response.status_code == 403
    assert client.get(reverse(CHANGELIST)).status_code == 403
    assert store.inspect(lease.name)["owner"] == lease.owner
    assert not LogEntry.objects.exists()


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
    for text in (
        lease.owner,
        ADVANCE,
        lease.task_id,
        "w1@box",
        str(lease.fence),
        "workflows.step:1",
        'method="post"',
    ):
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
    response = client.post(
        reverse(RELEASE),
        {"name": lease.name, "owner": shown, "csrfmiddlewaretoken": csrf_token_of(page)},
        follow=True,
    )
    assert response.status_code == 200
    [message] = messages_of(response)
    assert "now held by another owner" in message and "nothing released" in message
    assert newer.owner in message
    assert store.inspect(lease.name)["owner"] == newer.owner
    assert not LogEntry.objects.exists() and released_signals == []
    # and once it is gone altogether
    assert store.release(lease.name, newer.owner)
    response = client.post(
        reverse(RELEASE),
        {"name": lease.name, "owner": newer.owner, "csrfmiddlewaretoken": csrf_token_of(page)},
        follow=True,
    )
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
    response = client.post(
        row["release_url"],
        {
            "name": form["name"],
            "owner": form["owner"],
            "changelist_filters": form["changelist_filters"],
            "csrfmiddlewaretoken": csrf_token_of(page),
        },
        REMOTE_ADDR="192.0.2.7",
    )
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
    # the audit record shared with `celery steplock release`
    [record] = LeaseEvent.objects.filter(event="force_release")
    assert (record.actor, record.actor_host, record.via, record.outcome) == (
        "releaser",
        "192.0.2.7",
        "admin",
        "released",
    )
    assert (record.name, record.owner, record.fence, record.task_name) == (
        lease.name,
        lease.owner,
        lease.fence,
        ADVANCE,
    )
    [sent] = released_signals
    assert sent["forced"] is True and sent["event"] == "lock_released"
    assert sent["owner"] == lease.owner and sent["fence"] == lease.fence
    assert sent["name"] == lease.name and sent["key"] == lease.key
    assert sent["task_name"] == ADVANCE and sent["task_id"] == lease.task_id
    assert "releaser" in sent["reason"] and sent["audit"] == f"LeaseEvent {record.pk}"
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


# -- the audit record commits before the delete (issue 12, finding 3) -----------------------


@contextmanager
def failing_commit(table, on="INSERT"):
    """While inside, the COMMIT of a transaction that wrote ``table`` (``on``: INSERT or
    UPDATE) fails on the test database, as a real database refuses a commit: PostgreSQL
    through a deferred constraint trigger, SQLite through a deferred foreign key (Django
    creates them DEFERRABLE INITIALLY DEFERRED) that a trigger breaks. Only the commit
    fails: the statements themselves succeed.

    MariaDB/MySQL have no deferred constraint: a trigger there marks the session (a user
    variable), and at that session's COMMIT a second session kills it (``KILL CONNECTION``)
    and waits until the server has ended it and rolled its transaction back, so the COMMIT
    fails as on a connection lost at the commit (an OperationalError)."""
    from django.db import connection

    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "CREATE OR REPLACE FUNCTION steplock_test_refuse() RETURNS trigger "
                "AS $$ BEGIN RAISE EXCEPTION 'the database refused the commit'; "
                "END $$ LANGUAGE plpgsql"
            )
            cursor.execute(
                f"CREATE CONSTRAINT TRIGGER steplock_test_refuse AFTER {on} ON "
                f"{table} DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE "
                f"PROCEDURE steplock_test_refuse()"
            )
        elif connection.vendor == "mysql":
            cursor.execute(
                f"CREATE TRIGGER steplock_test_refuse AFTER {on} ON {table} "
                f"FOR EACH ROW SET @steplock_refuse_commit = 1"
            )
        else:
            cursor.execute(
                f"CREATE TRIGGER steplock_test_refuse AFTER {on} ON {table} BEGIN "
                f"INSERT INTO django_admin_log (action_time, object_id, "
                f"object_repr, action_flag, change_message, user_id) VALUES "
                f"(CURRENT_TIMESTAMP, 'x', 'x', 1, '', -1); END"
            )
    restore = _kill_at_marked_commits() if connection.vendor == "mysql" else None
    try:
        yield
    finally:
        if restore is not None:
            restore()
        with connection.cursor() as cursor:
            cursor.execute(
                f"DROP TRIGGER IF EXISTS steplock_test_refuse"
                f"{' ON ' + table if connection.vendor == 'postgresql' else ''}"
            )
            if connection.vendor == "postgresql":
                cursor.execute("DROP FUNCTION IF EXISTS steplock_test_refuse()")


def _kill_at_marked_commits():
    """MariaDB/MySQL half of :func:`failing_commit`: every connection's commit (the test's and
    the live server's threads alike, so the backend's class) first asks its session whether
    the trigger marked it; a marked session is killed from a second one before the COMMIT is
    sent. Returns the function that undoes it."""
    import MySQLdb
    from django.db.backends.mysql.base import DatabaseWrapper

    original = DatabaseWrapper._commit

    def _commit(self):
        if self.connection is not None:
            with self.connection.cursor() as cursor:
                cursor.execute("SELECT @steplock_refuse_commit, CONNECTION_ID()")
                marked, victim = cursor.fetchone()
            if marked:
                killer = MySQLdb.connect(**self.get_connection_params())
                try:
                    with killer.cursor() as cursor:
                        cursor.execute("KILL CONNECTION %s", (victim,))
                        for _ in range(500):  # until the server has ended it (10 s at most)
                            cursor.execute(
                                "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
                                "WHERE ID = %s",
                                (victim,),
                            )
                            if cursor.fetchone()[0] == 0:
                                break
                            time.sleep(0.02)
                        else:
                            raise AssertionError(f"session {victim} outlived KILL CONNECTION")
                finally:
                    killer.close()
        return original(self)

    DatabaseWrapper._commit = _commit

    def restore():
        DatabaseWrapper._commit = original

    return restore


def post_release(client, lease):
    page = client.get(reverse(RELEASE), {"name": lease.name})
    return client.post(
        reverse(RELEASE),
        {"name": lease.name, "owner": lease.owner, "csrfmiddlewaretoken": csrf_token_of(page)},
        follow=True,
    )


@pytest.mark.django_db(transaction=True)
def test_a_record_that_fails_at_commit_releases_nothing(releaser, store, released_signals):
    """The admin's LogEntry commit fails: the lease is still held, no record, and the page
    says nothing was released, which is true (the landed code deleted the lease first)."""
    lease = grab(store, "step:1")
    client = login(releaser, enforce_csrf_checks=True)
    with failing_commit(LogEntry._meta.db_table):
        response = post_release(client, lease)
    assert response.status_code == 200
    [message] = messages_of(response)
    assert "audit record could not be written" in message and "nothing released" in message
    assert store.inspect(lease.name)["owner"] == lease.owner  # no record, no release
    assert not LogEntry.objects.exists()
    assert not LeaseEvent.objects.filter(event="force_release").exists()
    assert released_signals == []


@pytest.mark.django_db(transaction=True)
def test_an_outcome_that_fails_at_commit_is_reported_as_a_release(
    releaser, store, released_signals
):
    """The request committed, the lease was deleted, then the outcome's commit fails: the
    page says it was released and that its record still says "requested"."""
    lease = grab(store, "step:1")
    client = login(releaser, enforce_csrf_checks=True)
    with failing_commit(LeaseEvent._meta.db_table, on="UPDATE"):
        response = post_release(client, lease)
    [message] = messages_of(response)
    assert "Force-released" in message and lease.owner in message
    assert "outcome could not be recorded" in message and "requested" in message
    assert store.inspect(lease.name) is None
    [record] = LeaseEvent.objects.filter(event="force_release")
    assert (record.outcome, record.actor, record.owner) == ("requested", "releaser", lease.owner)
    assert f"LeaseEvent {record.pk}" in message
    entry = LogEntry.objects.get()
    assert entry.action_flag == DELETION and lease.owner in entry.change_message
    [sent] = released_signals
    assert sent["owner"] == lease.owner


def test_a_holder_changed_after_the_request_leaves_both_records(releaser, store, monkeypatch):
    """Between the committed request and the delete another attempt takes the lease: it is
    spared, the LeaseEvent row says so and a CHANGE LogEntry follows the DELETION one."""
    from django.contrib.admin.models import CHANGE

    from celery_steplock.contrib.django import eventlog

    lease = grab(store, "step:1")
    newcomer = []
    requested = eventlog.LeaseEventAudit.requested

    def swap(self, record):
        requested(self, record)
        assert store.release(lease.name, lease.owner)
        newcomer.append(grab(store, lease.name, task_name=compensate.name))

    monkeypatch.setattr(eventlog.LeaseEventAudit, "requested", swap)
    response = post_release(login(releaser, enforce_csrf_checks=True), lease)
    [message] = messages_of(response)
    assert "now held by another owner" in message and "nothing released" in message
    [new] = newcomer
    assert store.inspect(lease.name)["owner"] == new.owner
    [record] = LeaseEvent.objects.filter(event="force_release")
    assert record.outcome == "held_by_another" and new.owner in record.reason
    first, second = LogEntry.objects.order_by("id")
    assert (first.action_flag, second.action_flag) == (DELETION, CHANGE)
    assert "did not release it: held_by_another" in second.change_message


# -- corrupt leases (issue 12, finding 5) --------------------------------------------------


def corrupt(redis_client, store, name, **fields):
    """Overwrite fields of the lease hash ``name`` as a buggy or hostile writer would."""
    redis_client.hset(store.key(name), mapping=fields)


def test_malformed_leases_are_shown_as_such_never_a_500(viewer, releaser, store, redis_client):
    good = grab(store, "step:1")
    grab(store, "step:2")
    corrupt(
        redis_client, store, "step:2", acquired_ms="yesterday", renewed_ms="soon", pid="9" * 40
    )
    grab(store, "step:3")
    corrupt(redis_client, store, "step:3", meta='{"task_name": ["not", "a", "string"]}')
    raw = redis_client.connection_pool.connection_kwargs.copy()
    import redis as redis_py

    binary = redis_py.Redis(host=raw["host"], port=raw["port"], db=raw.get("db", 0))
    binary.hset(
        store.key("step:4"),
        mapping={"owner": b"\xff\xfeowner", "fence": b"1", "meta": b'{"task_name": "caf\xe9"}'},
    )
    binary.pexpire(store.key("step:4"), 60000)
    binary.close()
    redis_client.hset(store.key("step:5"), mapping={"fence": "12"})  # no owner at all
    redis_client.pexpire(store.key("step:5"), 60000)
    for user in (viewer, releaser):
        response = login(user).get(reverse(CHANGELIST))
        assert response.status_code == 200
        rows = {row["lease"].name: row["lease"] for row in response.context["rows"]}
        assert set(rows) == {"step:1", "step:2", "step:3", "step:4", "step:5"}
        assert rows["step:1"].malformed == "" and rows["step:1"].owner == good.owner
        assert "acquired_ms: not an integer" in rows["step:2"].malformed
        assert "pid: out of range" in rows["step:2"].malformed
        assert rows["step:2"].pid is None and rows["step:2"].acquired_at is None
        assert "task_name: not a string" in rows["step:3"].malformed
        assert "not UTF-8" in rows["step:4"].malformed
        assert "owner: missing" in rows["step:5"].malformed
        html = response.content.decode()
        assert html.count('class="sub lease-malformed') == 4
    # the confirmation page of a malformed lease opens too
    page = login(releaser).get(reverse(RELEASE), {"name": "step:2"})
    assert page.status_code == 200 and page.context["lease"].malformed


def test_every_redis_backed_page_survives_corrupt_data(
    app, django_user_model, store, redis_client
):
    """Corrupt data in every key family the library writes (a lease, a concurrency slot, a
    key of the wrong type where a lease belongs, breakers, an idempotency record's Redis copy,
    rate-limit keys): every admin page of the app answers 200, a corrupt lease, slot or
    breaker is a row marked malformed with its key, and the operator actions still work."""
    from datetime import timedelta

    from django.utils import timezone

    from celery_steplock.contrib.django.models import IdempotencyRecord
    from celery_steplock.keys import breaker_key, idempotency_record_key, rate_limit_keys
    from celery_steplock.patterns.concurrency import ConcurrencyLimit

    grab(store, "step:1")
    corrupt(redis_client, store, "step:1", acquired_ms="soon")
    redis_client.set(store.key("stray"), "a string where a lease hash belongs", ex=60)
    redis_client.hset(
        breaker_key(store.prefix, "pay"), mapping={"state": "open", "gen": "7" * 10_000}
    )
    redis_client.rpush(breaker_key(store.prefix, "mail"), "a list")
    redis_client.set(breaker_key(store.prefix, "sms\x1b"), "not a hash")
    record = "ab" * 32
    IdempotencyRecord.objects.create(
        key=record,
        namespace="orders",
        version="1",
        status="completed",
        fingerprint="f" * 64,
        expires_at=timezone.now() + timedelta(hours=1),
    )
    redis_client.rpush(idempotency_record_key(store.prefix, record), "a list")
    for rate_key in rate_limit_keys(store.prefix, "tb", "t", "api"):
        redis_client.set(rate_key, "\xff" * 100)
    admin = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    client = login(admin)
    with ConcurrencyLimit(2).acquire("reports", app=app) as held:
        corrupt(redis_client, store, held.lease.name, fence="x", limit="many")
        pages = [
            "admin:celery_steplock_lease_changelist",
            "admin:celery_steplock_circuitbreakerstate_changelist",
            "admin:celery_steplock_idempotencyrecord_changelist",
            "admin:celery_steplock_leaseevent_changelist",
        ]
        responses = {page: client.get(reverse(page)) for page in pages}
        assert {page: r.status_code for page, r in responses.items()} == dict.fromkeys(pages, 200)
        leases = {row["lease"].name: row["lease"] for row in responses[pages[0]].context["rows"]}
        assert "acquired_ms: not an integer" in leases["step:1"].malformed
        assert "fence: not an integer" in leases[held.lease.name].malformed
        assert "stray" not in leases  # a key of another type: skipped and logged, as before
        breakers = {row["name"]: row for row in responses[pages[1]].context["rows"]}
        assert responses[pages[1]].context["error"] is None
        assert "gen: out of range" in breakers["pay"]["malformed"]
        assert breakers["mail"]["malformed"] == "key: a list, not a hash"
        assert breakers["mail"]["key"] == breaker_key(store.prefix, "mail")
        assert breakers["sms\\x1b"]["malformed"].startswith("name: ")
        assert "\x1b" not in responses[pages[1]].content.decode()
    invalidated = client.post(
        reverse(pages[2]),
        {
            "action": "invalidate",
            "_selected_action": [IdempotencyRecord.objects.get(key=record).pk],
        },
    )
    assert invalidated.status_code == 302
    assert not IdempotencyRecord.objects.filter(key=record).exists()
    assert not redis_client.exists(idempotency_record_key(store.prefix, record))
