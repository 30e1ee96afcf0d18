"""Headless Chromium on the "Held leases" admin page with hostile data (issue 12): a lease
hash corrupted in Redis is shown as malformed beside the others (no error page), and a force
release whose audit record fails at COMMIT releases nothing and says so.

The browser setup (Debian's chromium driven by Playwright; skipped without it, except with
``CI=true``) is test_browser.py's.
"""

from __future__ import annotations

import uuid

import pytest
from django.contrib.admin.models import LogEntry

from celery_steplock.contrib.django.models import LeaseEvent
from celery_steplock.lock import get_lease_store, holder_metadata
from tests.contrib.test_admin import failing_commit
from tests.contrib.test_browser import CHROMIUM_ARGS, VIEWPORT, chromium_path
from tests.contrib.test_browser import sync_playwright  # noqa: F401 - the fixture

pytestmark = pytest.mark.django_db(transaction=True)


def log_in(page, url, user):
    list_url = f"{url}/admin/celery_steplock/lease/"
    page.goto(f"{url}/admin/login/?next=/admin/celery_steplock/lease/")
    page.fill("#id_username", user.username)
    page.fill("#id_password", "password")
    page.click("input[type=submit]")
    page.wait_for_url(list_url)
    return list_url


def grab(store, name):
    lease = store.acquire(
        name,
        ttl=60.0,
        metadata=holder_metadata(uuid.uuid4().hex, "proj.tasks.charge", 0, worker="w1@box"),
    )
    assert lease is not None
    return lease


def test_corrupt_lease_and_failed_audit_commit_in_the_browser(
    sync_playwright, live_server, admin_user, app, redis_client, tmp_path
):  # noqa: F811
    store = get_lease_store(app)
    good = grab(store, "step:1")
    grab(store, "step:2")
    redis_client.hset(store.key("step:2"), mapping={"acquired_ms": "not-a-time", "pid": "9" * 40})
    # Installed before the browser starts: Playwright's sync API runs an event loop in this
    # thread, where Django refuses database calls. Only the admin's LogEntry table refuses
    # its commits (the login and the session are written elsewhere).
    with failing_commit(LogEntry._meta.db_table), sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            list_url = log_in(page, live_server.url, admin_user)
            assert page.title().startswith("Held leases")  # not an error page
            bad_row = page.locator('tr[data-lease="step:2"]')
            assert bad_row.count() == 1
            assert "malformed: acquired_ms: not an integer" in bad_row.inner_text()
            good_row = page.locator('tr[data-lease="step:1"]')
            assert "malformed" not in good_row.inner_text()
            page.screenshot(path=str(tmp_path / "malformed-lease.png"), full_page=True)

            good_row.locator("a.force-release").click()
            page.wait_for_selector("#lease-holder")
            page.click("input[type=submit]")
            page.wait_for_url(list_url)
            message = page.locator(".messagelist .error").inner_text()
            assert "audit record could not be written" in message
            assert "nothing released" in message
            assert page.locator('tr[data-lease="step:1"]').count() == 1  # still listed
            page.screenshot(path=str(tmp_path / "audit-commit-failed.png"), full_page=True)
        finally:
            browser.close()
    assert store.inspect("step:1")["owner"] == good.owner
    assert not LogEntry.objects.exists()
    assert not LeaseEvent.objects.filter(event="force_release").exists()
