"""A real browser on the "Held leases" admin page: headless Chromium driven by Playwright.

A real celery worker holds leases; a superuser logs in through the admin login form, sees
them, force-releases one through the confirmation page, and the lease is gone from Redis.
Screenshots are saved under the test's tmp dir (the artifacts); with
``STEPLOCK_UPDATE_SCREENSHOT=1`` the list page is also copied to
``docs/img/admin-held-leases.png`` for the README.

The browser is Debian's ``chromium`` (``scripts/bootstrap.sh`` installs it when run as root
with apt-get; ``STEPLOCK_CHROMIUM`` names another binary); Playwright only drives it
(``playwright install`` is never needed). Without either, the test skips, except with
``CI=true``, where it fails.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from django.contrib.admin.models import DELETION, LogEntry

from celery_steplock.lock import get_lease_store
from django_app.workflows.models import Step
from django_app.workflows.tasks import hold
from helpers import wait_until

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
README_SCREENSHOT = ROOT / "docs" / "img" / "admin-held-leases.png"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
HOLD = 30.0  # seconds the worker's tasks hold their leases (released earlier by the test)


def unavailable(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI=true requires the browser test (scripts/bootstrap.sh "
                    f"installs Debian's chromium when run as root)", pytrace=False)
    pytest.skip(reason)


def chromium_path() -> str | None:
    """``STEPLOCK_CHROMIUM``, else ``chromium`` on PATH, else /usr/bin/chromium; None when
    that is not an executable file."""
    path = (os.environ.get("STEPLOCK_CHROMIUM") or shutil.which("chromium")
            or "/usr/bin/chromium")
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


@pytest.fixture
def sync_playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("playwright is not installed (pip install -e '.[dev]')")
    if chromium_path() is None:
        unavailable("chromium not found (Debian: apt-get install chromium, or set "
                    "STEPLOCK_CHROMIUM)")
    return sync_playwright


def test_force_release_a_running_workers_lease_in_the_browser(
        sync_playwright, live_server, admin_user, start_worker, app, redis_client, tmp_path):
    store = get_lease_store(app)
    worker = start_worker("w1", concurrency=3)
    # `hold` keeps no database transaction open while it holds its lease: on SQLite, a step
    # task sleeping inside its transaction would block the admin's session writes.
    steps = [Step.objects.create(name=name) for name in ("ingest", "charge", "refund")]
    for step in steps:
        hold.delay(step.pk, HOLD)
    names = [f"step:{step.pk}" for step in steps]
    holders = {name: wait_until(lambda name=name: store.inspect(name), what=f"{name} held")
               for name in names}
    target = names[0]
    victim = holders[target]
    assert int(victim["pid"]) in worker.children_pids(recursive=True)

    url = live_server.url
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(),
                                             args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 640})
            page.goto(f"{url}/admin/login/?next=/admin/celery_steplock/lease/")
            page.fill("#id_username", admin_user.username)
            page.fill("#id_password", "password")
            page.click("input[type=submit]")
            page.wait_for_url(f"{url}/admin/celery_steplock/lease/")
            assert page.title().startswith("Held leases")
            page.click("#toggle-nav-sidebar")  # more room for the table in the screenshots
            for name in names:
                row = page.locator(f'tr[data-lease="{name}"]')
                assert row.count() == 1, f"{name} is not listed"
                assert victim["worker"] in row.inner_text() or name != target
            row = page.locator(f'tr[data-lease="{target}"]')
            assert str(victim["fence"]) in row.inner_text()
            shot = tmp_path / "held-leases.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            if os.environ.get("STEPLOCK_UPDATE_SCREENSHOT") == "1":
                README_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(shot, README_SCREENSHOT)

            row.locator("a.force-release").click()
            page.wait_for_selector("#lease-holder")
            holder = page.locator("#lease-holder").inner_text()
            for text in (victim["owner"], victim["task_name"], victim["worker"],
                         victim["fence"]):
                assert str(text) in holder
            page.screenshot(path=str(tmp_path / "force-release-confirm.png"), full_page=True)
            page.click("input[type=submit]")
            page.wait_for_url(f"{url}/admin/celery_steplock/lease/")
            message = page.locator(".messagelist .success").inner_text()
            assert "Force-released" in message and victim["owner"] in message
            page.screenshot(path=str(tmp_path / "after-release.png"), full_page=True)
        finally:
            browser.close()

    # Gone from Redis: the worker's holder no longer owns it (its retry may take it again,
    # as a new owner with a higher fence).
    assert store.owned(target, victim["owner"]) is None
    now = store.inspect(target)
    assert now is None or (now["owner"] != victim["owner"]
                           and int(now["fence"]) > int(victim["fence"]))
    for name in names[1:]:  # the others are untouched
        assert store.inspect(name)["owner"] == holders[name]["owner"]
    entry = LogEntry.objects.get(object_id=target)
    assert entry.action_flag == DELETION and entry.user == admin_user
    # The worker noticed: its heartbeat flags the lease lost within a renewal interval.
    worker.wait_for_log(rf"event=lock_lost key=steplock:lease:\{{{target}\}}", timeout=10)
    print(f"screenshots: {tmp_path}")
    # Let the other holders go so the worker stops promptly.
    for name in names[1:]:
        store.release(name, holders[name]["owner"])
