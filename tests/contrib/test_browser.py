"""A real browser on the "Held leases" admin page: headless Chromium driven by Playwright.

A real celery worker holds leases; a superuser logs in through the admin login form, sees
them, force-releases one through the confirmation page, and the lease is gone from Redis.

The page's layout is measured, on whatever Django version runs the test: at 1400 x 900 with
the navigation sidebar open, the results table fills the changelist beside the filter, the
breadcrumbs look like those Django draws on its own app page, and the Force release link of
the row with the longest names is inside the viewport, with no sideways scrolling (neither
of the page nor of the results box).

Screenshots are saved under the test's tmp dir (the artifacts); with
``STEPLOCK_UPDATE_SCREENSHOT=1`` the list page is also copied to
``docs/img/admin-leases-django-<major>.<minor>.png``.

The browser is Debian's ``chromium`` (``scripts/bootstrap.sh`` installs it when run as root
with apt-get; ``STEPLOCK_CHROMIUM`` names another binary); Playwright only drives it
(``playwright install`` is never needed). Without either, the test skips, except with
``CI=true``, where it fails.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import django
import pytest
from django.apps import apps
from django.contrib.admin.models import DELETION, LogEntry

from celery_steplock.lock import get_lease_store, holder_metadata
from django_app.workflows.models import Step
from django_app.workflows.tasks import hold
from helpers import wait_until

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
DJANGO = "%d.%d" % django.VERSION[:2]
SCREENSHOT = ROOT / "docs" / "img" / f"admin-leases-django-{DJANGO}.png"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
HOLD = 30.0  # seconds the worker's tasks hold their leases (released earlier by the test)
VIEWPORT = {"width": 1400, "height": 900}
# A lease with names as long as production ones get: the row that needs the most room.
LONG = {
    "name": "billing.invoice:customer-000042:2026-12-01:attempt-3",
    "task_name": "proj.billing.tasks.reconcile_customer_invoices_for_period",
    "worker": "celery@billing-worker-7f9c4d8b6-x2lqp.eu-west-1.compute.internal",
}

# Boxes (getBoundingClientRect) and computed styles the layout assertions read.
MEASURE = """() => {
  const box = (el) => { if (!el) return null; const r = el.getBoundingClientRect();
    return {left: r.left, right: r.right, top: r.top, bottom: r.bottom, width: r.width,
            height: r.height}; };
  const q = (sel) => document.querySelector(sel);
  const results = q("#changelist .results");
  return {
    innerWidth: window.innerWidth, scrollWidth: document.documentElement.scrollWidth,
    sidebar: box(q("#nav-sidebar")),
    changelist: box(q("#changelist")), filter: box(q("#changelist-filter")),
    toolbar: box(q("#toolbar")), results: box(results), table: box(q("#result_list")),
    resultsScroll: results && {scrollWidth: results.scrollWidth,
                               clientWidth: results.clientWidth},
    headers: [...document.querySelectorAll("#result_list thead th")].map(box),
    filterTag: q("#changelist-filter") && q("#changelist-filter").tagName.toLowerCase(),
  };
}"""

BREADCRUMBS = """() => {
  const el = document.querySelector(".breadcrumbs");
  if (!el) return null;
  const style = getComputedStyle(el);
  const link = el.querySelector("a");
  return {tag: el.tagName.toLowerCase(), background: style.backgroundColor,
          paddingLeft: style.paddingLeft, paddingTop: style.paddingTop, color: style.color,
          fontSize: style.fontSize, display: style.display,
          linkColor: link && getComputedStyle(link).color,
          links: [...el.querySelectorAll("a")].map((a) => a.textContent.trim()),
          text: el.innerText.replace(/\\s+/g, " ").trim()};
}"""

# The body background, the breadcrumbs background and the link colour of Django's
# stylesheet, resolved.
DJANGO_COLOURS = """() => {
  const probe = document.createElement("div");
  document.body.appendChild(probe);
  probe.style.background = "var(--breadcrumbs-bg)";
  const breadcrumbs = getComputedStyle(probe).backgroundColor;
  probe.style.color = "var(--link-fg)";
  const link = getComputedStyle(probe).color;
  probe.remove();
  return {breadcrumbs, link, body: getComputedStyle(document.body).backgroundColor};
}"""


def unavailable(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(
            f"{reason}; CI=true requires the browser test (scripts/bootstrap.sh "
            f"installs Debian's chromium when run as root)",
            pytrace=False,
        )
    pytest.skip(reason)


def chromium_path() -> str | None:
    """``STEPLOCK_CHROMIUM``, else ``chromium`` on PATH, else /usr/bin/chromium; None when
    that is not an executable file."""
    path = os.environ.get("STEPLOCK_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


@pytest.fixture
def sync_playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("playwright is not installed (pip install -e '.[dev]')")
    if chromium_path() is None:
        unavailable(
            "chromium not found (Debian: apt-get install chromium, or set STEPLOCK_CHROMIUM)"
        )
    return sync_playwright


def assert_layout(m: dict) -> None:
    """The changelist laid out as Django lays out its own, and nothing off to the side."""
    table, filt, results = m["table"], m["filter"], m["results"]
    assert table and filt and results, m
    # The sidebar is open and takes its room beside the content.
    assert m["sidebar"] and m["sidebar"]["width"] >= 200, m["sidebar"]
    assert m["sidebar"]["right"] <= m["changelist"]["left"], m
    # The table fills the results box and, with the filter beside it, the changelist.
    assert table["width"] >= 0.98 * results["width"], m
    assert table["width"] + filt["width"] >= 0.9 * m["changelist"]["width"], m
    assert table["width"] >= 500, m  # never the ~280 px of a layout its CSS does not fit
    # The filter stands to the right of the table and of the search bar, in the same band
    # from the top; it is Django's own element for the version (a <search> from 6.0 on).
    assert filt["left"] >= table["right"] - 1 and filt["left"] >= m["toolbar"]["right"], m
    assert filt["top"] < table["bottom"] and filt["top"] <= results["top"], m
    assert m["filterTag"] == ("search" if django.VERSION >= (6, 0) else "nav"), m
    # No sideways scrolling: neither the page nor the results box (Django gives it
    # overflow-x: auto), and every column ends inside the viewport.
    assert m["scrollWidth"] <= m["innerWidth"], m
    assert m["resultsScroll"]["scrollWidth"] <= m["resultsScroll"]["clientWidth"], m
    assert m["headers"] and all(h["right"] <= m["innerWidth"] for h in m["headers"]), m
    assert m["headers"][-1]["right"] <= results["right"] + 1, m


def assert_breadcrumbs_like_djangos(ours: dict, djangos: dict, colours: dict) -> None:
    """Styled as on Django's own app page: same element, background, padding and colours."""
    assert ours and djangos, (ours, djangos)
    for key in (
        "tag",
        "background",
        "paddingLeft",
        "paddingTop",
        "color",
        "fontSize",
        "linkColor",
        "display",
    ):
        assert ours[key] == djangos[key], (key, ours, djangos)
    assert ours["background"] == colours["breadcrumbs"] != colours["body"], (ours, colours)
    assert ours["tag"] == ("ol" if django.VERSION >= (6, 1) else "div"), ours
    assert ours["paddingLeft"] not in ("", "0px") and ours["paddingTop"] not in ("", "0px")
    assert ours["linkColor"] != colours["link"], ours  # not the plain link colour


def test_force_release_a_running_workers_lease_in_the_browser(
    sync_playwright, live_server, admin_user, start_worker, app, redis_client, tmp_path
):
    store = get_lease_store(app)
    worker = start_worker("w1", concurrency=3)
    # `hold` keeps no database transaction open while it holds its lease: on SQLite, a step
    # task sleeping inside its transaction would block the admin's session writes.
    steps = [Step.objects.create(name=name) for name in ("ingest", "charge", "refund")]
    for step in steps:
        hold.delay(step.pk, HOLD)
    names = [f"step:{step.pk}" for step in steps]
    holders = {
        name: wait_until(lambda name=name: store.inspect(name), what=f"{name} held")
        for name in names
    }
    target = names[0]
    victim = holders[target]
    assert int(victim["pid"]) in worker.children_pids(recursive=True)
    long_step = Step.objects.create(name="reconcile")
    long_lease = store.acquire(
        LONG["name"],
        ttl=120.0,
        metadata=holder_metadata(
            uuid.uuid4().hex,
            LONG["task_name"],
            0,
            worker=LONG["worker"],
            step=f"workflows.step:{long_step.pk}",
        ),
    )
    assert long_lease is not None

    url = live_server.url
    list_url = f"{url}/admin/celery_steplock/lease/"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.goto(f"{url}/admin/login/?next=/admin/celery_steplock/lease/")
            page.fill("#id_username", admin_user.username)
            page.fill("#id_password", "password")
            page.click("input[type=submit]")
            page.wait_for_url(list_url)
            assert page.title().startswith("Held leases")
            # Django's own breadcrumbs, drawn by its app index page, are the reference.
            page.goto(f"{url}/admin/celery_steplock/")
            djangos = page.evaluate(BREADCRUMBS)
            colours = page.evaluate(DJANGO_COLOURS)
            page.goto(list_url)
            page.wait_for_load_state("load")
            assert page.locator("#nav-sidebar").is_visible()  # open, as Django opens it

            for name in names + [LONG["name"]]:
                row = page.locator(f'tr[data-lease="{name}"]')
                assert row.count() == 1, f"{name} is not listed"
                assert victim["worker"] in row.inner_text() or name != target
            row = page.locator(f'tr[data-lease="{target}"]')
            assert str(victim["fence"]) in row.inner_text()

            # Taken before the layout is judged: the artifact shows what failed.
            shot = tmp_path / "held-leases.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            if os.environ.get("STEPLOCK_UPDATE_SCREENSHOT") == "1":
                SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(shot, SCREENSHOT)

            layout = page.evaluate(MEASURE)
            assert_layout(layout)
            ours = page.evaluate(BREADCRUMBS)
            assert_breadcrumbs_like_djangos(ours, djangos, colours)
            app_name = str(apps.get_app_config("celery_steplock").verbose_name)
            assert djangos["links"] == ["Home"] and djangos["text"].endswith(app_name)
            assert ours["links"] == ["Home", app_name], ours
            assert ours["text"].endswith("Held leases"), ours
            # Django's filter markup: the choices as Django's filter.html draws them.
            assert (
                page.locator("#changelist-filter details summary").inner_text().strip()
                == "By task name"
            )
            assert page.locator("#changelist-filter li.selected").inner_text().strip() == "All"
            # Every control a person acts on, in every row, is inside the viewport.
            width = layout["innerWidth"]
            for name in names + [LONG["name"]]:
                row = page.locator(f'tr[data-lease="{name}"]')
                for link in row.locator("a").all():
                    box = link.bounding_box()
                    assert box and box["x"] >= 0 and box["x"] + box["width"] <= width, (
                        name,
                        link.inner_text(),
                        box,
                        width,
                    )
                release = row.locator("a.force-release")
                assert release.count() == 1 and release.is_visible()
                box = release.bounding_box()
                assert box["x"] + box["width"] <= layout["results"]["right"] + 1, (name, box)
            print(
                f"Django {DJANGO} at {width} px, sidebar open: table "
                f"{layout['table']['left']:.0f}-{layout['table']['right']:.0f} px, filter "
                f"{layout['filter']['left']:.0f}-{layout['filter']['right']:.0f} px (top "
                f"{layout['filter']['top']:.0f} vs table {layout['table']['top']:.0f}), last "
                f"Force release ends at {box['x'] + box['width']:.0f} px, page scrollWidth "
                f"{layout['scrollWidth']}"
            )

            page.locator(f'tr[data-lease="{target}"] a.force-release').click()
            page.wait_for_selector("#lease-holder")
            holder = page.locator("#lease-holder").inner_text()
            for text in (victim["owner"], victim["task_name"], victim["worker"], victim["fence"]):
                assert str(text) in holder
            crumbs = page.evaluate(BREADCRUMBS)
            assert_breadcrumbs_like_djangos(crumbs, djangos, colours)
            assert crumbs["links"] == ["Home", app_name, "Held leases", target], crumbs
            assert page.evaluate("document.documentElement.scrollWidth <= innerWidth")
            page.screenshot(path=str(tmp_path / "force-release-confirm.png"), full_page=True)
            page.click("input[type=submit]")
            page.wait_for_url(list_url)
            message = page.locator(".messagelist .success").inner_text()
            assert "Force-released" in message and victim["owner"] in message
            page.screenshot(path=str(tmp_path / "after-release.png"), full_page=True)
        finally:
            browser.close()

    # Gone from Redis: the worker's holder no longer owns it (its retry may take it again,
    # as a new owner with a higher fence).
    assert store.owned(target, victim["owner"]) is None
    now = store.inspect(target)
    assert now is None or (
        now["owner"] != victim["owner"] and int(now["fence"]) > int(victim["fence"])
    )
    for name in names[1:]:  # the others are untouched
        assert store.inspect(name)["owner"] == holders[name]["owner"]
    assert store.inspect(LONG["name"])["owner"] == long_lease.owner
    entry = LogEntry.objects.get(object_id=target)
    assert entry.action_flag == DELETION and entry.user == admin_user
    # The worker noticed: its heartbeat flags the lease lost within a renewal interval.
    worker.wait_for_log(rf"event=lock_lost key=steplock:lease:\{{{target}\}}", timeout=10)
    print(f"screenshots: {tmp_path}")
    # Let the other holders go so the worker stops promptly.
    for name in names[1:]:
        store.release(name, holders[name]["owner"])
    store.release(LONG["name"], long_lease.owner)
