"""The admin's Activity page (Django test client, real Redis): real executions counted by the
process's aggregator, flushed, read back and drawn as inline SVG; 403 without the
permission; corrupt entries shown as malformed, never a 500."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse

from celery_steplock import activity
from celery_steplock.activity import activity_key
from celery_steplock.lock import get_lease_store
from celery_steplock.task import StepLockedTask
from django_app.celery import app as celery_app
from django_app.workflows.models import Step

pytestmark = pytest.mark.django_db(transaction=True)

PAGE = "admin:celery_steplock_activity_changelist"


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.activity_finish",
    lock_key="activity:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
)
def activity_finish(self, step_id):
    time.sleep(0.02)
    return step_id


def staff(django_user_model, username, *perms):
    user = django_user_model.objects.create_user(username, password="pw", is_staff=True)
    for perm in perms:
        app_label, codename = perm.split(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app_label, codename=codename)
        )
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def store(app, redis_client):
    return get_lease_store(app)


@pytest.fixture
def aggregator(app, redis_client):
    """The process's aggregator (installed by the app's ready()), turned on (the app
    fixture restores the setting: off, the default)."""
    agg = activity.install()
    app.conf.steplock_activity = True
    agg.refresh()
    agg.flush()
    redis_client.flushdb()  # what earlier tests counted
    return agg


def test_real_executions_are_counted_flushed_and_drawn(
    django_user_model, store, redis_client, aggregator
):
    steps = [Step.objects.create(name=f"s{i}") for i in range(5)]
    for step in steps:
        assert activity_finish.apply(args=(step.pk,)).successful()
    assert activity_finish.apply(args=(steps[0].pk,)).successful()  # a duplicate, no CAS
    aggregator.flush()
    data = activity.read(redis_client, store.prefix, minutes=2)
    series = data.tasks["tests.activity_finish"]
    assert sum(series.executions) == 6
    # Five holds of at least the body's 20 ms, the duplicate's of about a millisecond: the
    # p95 reads back the bucket of a 20 ms hold or above.
    assert sum(sum(h) for h in series.hold) == 6
    assert max(p for p in series.hold_p95 if p is not None) >= 0.02
    assert sum(sum(h) for h in series.wait) == 6

    client = staff(django_user_model, "viewer", "celery_steplock.view_activity")
    response = client.get(reverse(PAGE))
    assert response.status_code == 200
    html = response.content.decode()
    main = html[html.index('<div id="content-main">') : html.index('<footer id="footer">')]
    assert "<script" not in main  # the page adds no JavaScript (the admin's base has its own)
    assert html.count('role="img"') == 3  # wait, hold, counts of the one task
    assert "tests.activity_finish" in html and ("<polyline" in html or "<circle" in html)
    assert 'role="img"' in html and "<details>" in html and "var(--link-fg)" in html
    chart = response.context["tasks"][0]["charts"][2]
    assert sum(int(row[1]) for row in chart.rows) == 6  # the numbers table: executions


def test_the_page_says_when_the_setting_is_off(django_user_model, store):
    client = staff(django_user_model, "viewer", "celery_steplock.view_activity")
    html = client.get(reverse(PAGE)).content.decode()
    assert "set CELERY_STEPLOCK_ACTIVITY = True" in html


def test_the_page_needs_its_permission(django_user_model, store):
    assert staff(django_user_model, "nobody").get(reverse(PAGE)).status_code == 403
    assert (
        staff(django_user_model, "leases", "celery_steplock.view_lease")
        .get(reverse(PAGE))
        .status_code
        == 403
    )


def test_corrupt_entries_render_as_malformed_not_500(django_user_model, store, redis_client):
    minute = int(time.time()) // 60
    redis_client.hset(
        activity_key(store.prefix, minute),
        mapping={
            "t.a|exec|": "2",
            "t.a|hold|3": "not a number",
            "t.a|wait|999": "1",
            "<script>|exec|": "1",
            "pay|state|99:open": "1",
            "junk": "1",
        },
    )
    redis_client.rpush(activity_key(store.prefix, minute - 1), "a list")
    client = staff(django_user_model, "viewer", "celery_steplock.view_activity")
    response = client.get(reverse(PAGE))
    assert response.status_code == 200
    html = response.content.decode()
    assert response.context["activity"].malformed == 5
    assert "5 entries of the activity hashes are malformed" in html
    assert "<script>" not in html and "&lt;script&gt;" in html


def test_redis_down_is_an_error_note(django_user_model, app, store):
    from helpers import closed_port_url

    app.conf.steplock_redis_url = closed_port_url()
    client = staff(django_user_model, "viewer", "celery_steplock.view_activity")
    response = client.get(reverse(PAGE))
    assert response.status_code == 200
    assert "could not be read" in response.content.decode()


def test_breakers_and_limits_are_drawn(django_user_model, store, redis_client):
    minute = int(time.time()) // 60
    redis_client.hset(
        activity_key(store.prefix, minute - 2),
        mapping={"pay|state|5:open": "1", "api|admitted|": "7", "api|limited|": "3"},
    )
    redis_client.hset(
        activity_key(store.prefix, minute - 1), mapping={"pay|state|40:half_open": "1"}
    )
    client = staff(django_user_model, "viewer", "celery_steplock.view_activity")
    response = client.get(reverse(PAGE))
    html = response.content.decode()
    assert response.status_code == 200
    band = response.context["breakers"][0]["chart"]
    assert [b[0] for b in band.bands] == ["st-unknown", "st-open", "st-half_open"]
    assert [row[1] for row in band.rows] == ["open", "half-open"]
    limit = response.context["limits"][0]["chart"]
    assert [row[1:] for row in limit.rows] == [["7", "3"]]
    assert 'class="s-limited"' in html and 'class="st-open"' in html


def test_first_view_with_an_hour_of_twenty_tasks(django_user_model, store, redis_client):
    """60 minutes x 20 tasks (every counter, 6 wait and 6 hold buckets a minute): the
    page's time is printed, not asserted (a shared machine)."""
    now = int(time.time()) // 60
    pipe = redis_client.pipeline(transaction=False)
    for minute in range(now - 59, now + 1):
        mapping = {}
        for task in range(20):
            name = f"shop.task_{task}"
            for metric in ("exec", "contended", "conflict", "duplicate"):
                mapping[f"{name}|{metric}|"] = str(1 + (minute + task) % 9)
            for bucket in range(6):
                mapping[f"{name}|wait|{bucket * 3}"] = str(1 + bucket)
                mapping[f"{name}|hold|{bucket * 4 + 10}"] = str(2 + bucket)
        pipe.hset(activity_key(store.prefix, minute), mapping=mapping)
    pipe.execute()
    client = staff(django_user_model, "viewer", "celery_steplock.view_activity")
    url = reverse(PAGE)
    started = time.perf_counter()
    response = client.get(url)
    first = time.perf_counter() - started
    started = time.perf_counter()
    client.get(url)
    second = time.perf_counter() - started
    assert response.status_code == 200
    html = response.content.decode()
    assert html.count('role="img"') == 60 and len(response.context["tasks"]) == 20
    assert len(re.findall(r"<tr>", html)) > 20 * 60
    print(
        f"\nactivity page, 60 min x 20 tasks: first view {first * 1000:.0f} ms, "
        f"second {second * 1000:.0f} ms, {len(html) / 1024:.0f} KiB of HTML"
    )


def test_the_charts_in_a_real_browser_light_and_dark(
    live_server, admin_user, app, store, redis_client, tmp_path
):
    """Headless Chromium (as tests/contrib/test_browser.py drives it) at 1400 x 900 with the
    sidebar open: the charts fit (no sideways scrolling), and their colours are the admin's
    CSS variables in the light and in the dark theme."""
    from tests.contrib.test_browser import CHROMIUM_ARGS, VIEWPORT, chromium_path

    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed")
    if chromium_path() is None:
        pytest.skip("chromium not found")
    now = int(time.time()) // 60
    for minute in range(now - 59, now + 1):
        mapping = {"api|admitted|": str(5 + minute % 7), "api|limited|": str(minute % 3)}
        for task in ("shop.tasks.charge_customer_invoice", "shop.tasks.ship", "mail.send"):
            mapping[f"{task}|exec|"] = str(3 + (minute + len(task)) % 5)
            mapping[f"{task}|contended|"] = str(minute % 2)
            mapping[f"{task}|wait|{2 + minute % 5}"] = "3"
            mapping[f"{task}|wait|{12 + minute % 3}"] = "1"
            mapping[f"{task}|hold|{20 + minute % 4}"] = "4"
        redis_client.hset(activity_key(store.prefix, minute), mapping=mapping)
    redis_client.hset(activity_key(store.prefix, now - 40), "pay|state|10:open", "1")
    redis_client.hset(activity_key(store.prefix, now - 35), "pay|state|12:half_open", "1")
    redis_client.hset(activity_key(store.prefix, now - 34), "pay|state|50:closed", "1")
    app.conf.steplock_activity = True  # no "off" note above the charts
    url = live_server.url
    # The artifacts: the test's tmp dir, or STEPLOCK_SCREENSHOT_DIR when set.
    shots = Path(os.environ.get("STEPLOCK_SCREENSHOT_DIR") or tmp_path)
    measure = """() => {
        const line = document.querySelector('polyline.s-p50');
        const probe = document.createElement('div');
        probe.style.color = 'var(--link-fg)';
        document.body.appendChild(probe);
        return {
            scroll: document.documentElement.scrollWidth, width: window.innerWidth,
            charts: document.querySelectorAll('svg[role=img]').length,
            stroke: getComputedStyle(line).stroke, primary: getComputedStyle(probe).color,
            sidebar: !!document.querySelector('#nav-sidebar') &&
                getComputedStyle(document.querySelector('#nav-sidebar')).display !== 'none',
        };
    }"""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.goto(f"{url}/admin/login/?next=/admin/celery_steplock/activity/")
            page.fill("#id_username", admin_user.username)
            page.fill("#id_password", "password")
            page.click("input[type=submit]")
            page.wait_for_url(f"{url}/admin/celery_steplock/activity/")
            seen = {}
            for scheme in ("light", "dark"):
                page.emulate_media(color_scheme=scheme)
                page.reload()
                seen[scheme] = page.evaluate(measure)
                page.screenshot(path=str(shots / f"activity-{scheme}.png"), full_page=True)
        finally:
            browser.close()
    for scheme, m in seen.items():
        assert m["sidebar"] and m["charts"] == 3 * 3 + 1 + 1, (scheme, m)
        assert m["scroll"] <= m["width"], (scheme, m)
        assert m["stroke"] == m["primary"], (scheme, m)
    assert seen["light"]["stroke"] != seen["dark"]["stroke"]
    print(f"\nscreenshots: {shots}")
