"""A real browser on the operators' admin pages (issue 30): a lock name's timeline, "Rate
limits", "Concurrency limits", the circuit breakers and the idempotency records' summary.

Each page is filled with what production puts there (a step task run twice and contended,
limits used to the full with a waiting ticket and a waiting caller, an open breaker beside
one an operator overrode, records in every state, names as long as production ones), then a
superuser logs in through the admin login form and opens it in headless Chromium at
1400 x 900 with the navigation sidebar open. Measured on whatever Django version runs the
test: HTTP 200, no sideways scrolling (neither of the page nor of the content box, nor of
the changelist's results box), the sidebar beside the content, and every column header (and
each button and link in the rows) inside the viewport.

Screenshots are saved under the test's tmp dir before the layout is judged (the artifacts);
with ``STEPLOCK_UPDATE_SCREENSHOT=1`` each is also copied to
``docs/img/admin-<page>-django-<major>.<minor>.png`` (the operators' guide shows them).

The browser setup (Debian's chromium driven by Playwright; skipped without it, except with
``CI=true``) is test_browser.py's. The data is written before the browser starts:
Playwright's sync API runs an event loop in the test's thread, where Django refuses
database calls.
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from datetime import timedelta
from typing import Any

import django
import pytest
from django.utils import timezone

from celery_steplock.contrib.django.eventlog import LeaseEventBreakerAudit
from celery_steplock.contrib.django.idempotency import DatabaseRecords
from celery_steplock.exceptions import StepLockError
from celery_steplock.history import outcome_of
from celery_steplock.lock import get_lease_store, holder_metadata
from celery_steplock.ops import override_breaker
from celery_steplock.patterns.breaker import CircuitBreaker
from celery_steplock.patterns.concurrency import ConcurrencyLimit
from celery_steplock.patterns.idempotency import RedisRecords, Stored
from celery_steplock.patterns.ratelimit import SlidingWindow, TokenBucket
from django_app.workflows.models import Step
from django_app.workflows.tasks import advance
from tests.contrib.test_browser import CHROMIUM_ARGS, ROOT, VIEWPORT, chromium_path
from tests.contrib.test_browser import sync_playwright  # noqa: F401 - the fixture

pytestmark = pytest.mark.django_db(transaction=True)

DJANGO = "%d.%d" % django.VERSION[:2]
#: Long names, as production gives them: the rows that need the most room.
GATEWAY = "gateway:payments-api.eu-west-1.billing.internal:tenant-000042"
TASK = "proj.billing.tasks.reconcile_customer_invoices_for_period"
WORKER = "celery@billing-worker-7f9c4d8b6-x2lqp.eu-west-1.compute.internal"

# The page's boxes: the sidebar, the content, the table ``sel`` and its column headers,
# and the scroll sizes of the page, of #content and of the changelist's results box.
MEASURE = """(sel) => {
  const box = (el) => { if (!el) return null; const r = el.getBoundingClientRect();
    return {left: r.left, right: r.right, top: r.top, bottom: r.bottom, width: r.width}; };
  const q = (s) => document.querySelector(s);
  const scroll = (el) => el && {scrollWidth: el.scrollWidth, clientWidth: el.clientWidth};
  const table = q(sel);
  return {
    innerWidth: window.innerWidth, scrollWidth: document.documentElement.scrollWidth,
    sidebar: box(q("#nav-sidebar")), content: box(q("#content")), table: box(table),
    contentPaddingRight: q("#content") && parseFloat(getComputedStyle(q("#content")).paddingRight),
    contentScroll: scroll(q("#content")), resultsScroll: scroll(q("#changelist .results")),
    headers: table ? [...table.querySelectorAll("thead th")].map(
      (th) => ({text: th.innerText.trim(), ...box(th)})) : [],
    controls: table ? [...table.querySelectorAll("tbody a, tbody button, tbody input")]
      .filter((el) => el.type !== "hidden").map(
        (el) => ({text: (el.innerText || el.name || "").trim(), ...box(el)})) : [],
  };
}"""


def widths(m: dict) -> str:
    """One line of the measured widths (printed, and the report's figures)."""
    headers = m["headers"]
    results = m["resultsScroll"]
    return (
        f"Django {DJANGO}: innerWidth {m['innerWidth']}, page scrollWidth {m['scrollWidth']}, "
        f"#content {m['contentScroll']['scrollWidth']}/{m['contentScroll']['clientWidth']}"
        + (f", results {results['scrollWidth']}/{results['clientWidth']}" if results else "")
        + f", table {m['table']['left']:.0f}-{m['table']['right']:.0f} px, last header "
        f"{headers[-1]['text']!r} ends at {headers[-1]['right']:.0f} px"
    )


def assert_fits(m: dict) -> None:
    """The sidebar open beside the content, nothing scrolls sideways, and every header and
    every control of the rows ends inside the viewport."""
    assert m["sidebar"] and m["sidebar"]["width"] >= 200, m["sidebar"]
    assert m["sidebar"]["right"] <= m["content"]["left"] + 1, m
    assert m["table"], m
    assert m["scrollWidth"] <= m["innerWidth"], widths(m)
    assert m["contentScroll"]["scrollWidth"] <= m["contentScroll"]["clientWidth"], widths(m)
    if m["resultsScroll"]:
        assert m["resultsScroll"]["scrollWidth"] <= m["resultsScroll"]["clientWidth"], widths(m)
    assert m["headers"], m
    for header in m["headers"]:
        assert 0 <= header["left"] and header["right"] <= m["innerWidth"], (header, widths(m))
    # The table stays inside the content's padding (a cell's unbreakable text, e.g. an owner
    # token, pushes it out before anything scrolls).
    inner = m["content"]["right"] - m["contentPaddingRight"]
    assert m["table"]["right"] <= inner + 1, (inner, widths(m))
    for control in m["controls"]:
        assert 0 <= control["left"] and control["right"] <= m["innerWidth"], (control, widths(m))


def browse(
    sync_playwright,  # noqa: F811 - the fixture's value
    live_server,
    user,
    path,
    table,
    shot_name,
    tmp_path,
    check=None,
    judge=True,
):
    """Log ``user`` in through the admin login form, open ``path`` at 1400 x 900 with the
    sidebar open, save the screenshot (copied to docs/img/ with
    ``STEPLOCK_UPDATE_SCREENSHOT=1``), call ``check(page)`` and, with ``judge``, judge the
    layout of the table ``table`` (:func:`assert_fits`). Returns the measures."""
    url = live_server.url
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.goto(f"{url}/admin/login/?next=/admin/")
            page.fill("#id_username", user.username)
            page.fill("#id_password", "password")
            page.click("input[type=submit]")
            page.wait_for_url(f"{url}/admin/")
            response = page.goto(f"{url}{path}")
            assert response is not None and response.status == 200, path
            page.wait_for_load_state("load")
            assert page.locator("#nav-sidebar").is_visible()  # open, as Django opens it
            # Taken before the layout is judged: the artifact shows what failed.
            shot = tmp_path / f"admin-{shot_name}.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            if os.environ.get("STEPLOCK_UPDATE_SCREENSHOT") == "1":
                target = ROOT / "docs" / "img" / f"admin-{shot_name}-django-{DJANGO}.png"
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(shot, target)
            measures = page.evaluate(MEASURE, table)
            print(f"{shot_name}: {widths(measures)}")
            if check is not None:
                check(page)
            if judge:
                assert_fits(measures)
            return measures
        finally:
            browser.close()


@pytest.fixture
def store(app, redis_client):
    """The lease store the pages read (the app's settings), on a flushed Redis."""
    return get_lease_store(app)


def test_the_timeline_of_a_step_run_twice_and_contended(
    sync_playwright, live_server, admin_user, store, tmp_path
):
    """Step 42: its task applied, run again (a duplicate or a conflict), then held by a
    worker while another acquire is refused. Reached from the Held leases row's link."""
    step = Step.objects.create(pk=42, name="charge")
    name = f"step:{step.pk}"
    first = advance.apply(args=(step.pk,))
    assert first.successful(), first.traceback
    again = advance.apply(args=(step.pk,))
    assert again.successful(), again.traceback
    holder = store.acquire(
        name,
        ttl=120.0,
        metadata=holder_metadata(uuid.uuid4().hex, advance.name, 0, worker=WORKER),
    )
    assert holder is not None
    assert store.acquire(name, ttl=5.0) is None  # refused: contended
    events = [(e.event, e.outcome) for e in store.history(name)]
    assert events[0] == ("contended", None) and events[1] == ("acquired", None)
    assert events[2][0] == "released" and events[2][1] in ("duplicate", "conflict")
    committed = outcome_of(True, None, None)  # what an execution that applied records
    assert events[-2:] == [("released", committed), ("acquired", None)]

    def follow_the_link(page):
        page.goto(f"{live_server.url}/admin/celery_steplock/lease/")
        page.locator(f'tr[data-lease="{name}"] a.lease-history').click()
        page.wait_for_selector("#history-list")
        assert page.title().startswith(f"History of {name}")
        classes = page.locator("#history-list tbody tr").evaluate_all(
            "(rows) => rows.map((r) => r.className)"
        )
        assert classes[:2] == ["history-contended", "history-acquired"], classes
        text = page.locator("#history-list").inner_text()
        assert committed in text and ("duplicate" in text or "conflict" in text)

    browse(
        sync_playwright,
        live_server,
        admin_user,
        f"/admin/celery_steplock/lease/timeline/?name={name}",
        "#history-list",
        "timeline",
        tmp_path,
        check=follow_the_link,
    )
    store.release(name, holder.owner)


def test_the_rate_limits_page(sync_playwright, live_server, admin_user, app, store, tmp_path):
    """A window used to the full with one waiting ticket, a bucket half used, a long key."""
    window = SlidingWindow(3, 60.0, app=app)
    for _ in range(3):
        assert window.try_acquire(GATEWAY, app=app).allowed
    denied = window.try_acquire(GATEWAY, app=app, reserve=True)
    assert not denied.allowed and denied.ticket
    bucket = TokenBucket(1 / 3600, 10, app=app)  # one token an hour: no refill in the test
    for _ in range(5):
        assert bucket.try_acquire("mail:smtp-relay", app=app).allowed
    assert SlidingWindow(100, 3600.0, app=app).try_acquire("search", app=app).allowed

    def check(page):
        text = page.locator("#rate-limits").inner_text()
        assert GATEWAY in text and "mail:smtp-relay" in text and "search" in text, text
        gateway = page.locator("#rate-limits tbody tr", has_text=GATEWAY).inner_text()
        assert "3/60s window" in gateway and "3 / 3" in gateway and "1 (1)" in gateway

    browse(
        sync_playwright,
        live_server,
        admin_user,
        "/admin/celery_steplock/ratelimitstate/",
        "#rate-limits",
        "ratelimits",
        tmp_path,
        check=check,
    )


def test_the_concurrency_limits_page(
    sync_playwright, live_server, admin_user, app, store, tmp_path
):
    """Two slots of two held, a caller waiting for one; a second limit with a slot held."""
    limit = ConcurrencyLimit(2)
    reports = f"reports:{GATEWAY}"

    def take(limit, key):
        """A slot held as a worker's task holds it (the metadata the task's gate writes:
        its task name, id and worker, the limit)."""
        task_id = str(uuid.uuid4())
        metadata = holder_metadata(
            task_id, TASK, 0, worker=WORKER, kind="slot", limit=limit.limit, limit_key=key
        )
        return limit.try_acquire(
            store, key, owner=uuid.uuid4().hex, ticket=task_id, ttl=120.0, metadata=metadata
        )

    held = [take(limit, reports) for _ in range(2)]
    other = take(ConcurrencyLimit(5), "exports")
    waited: list = []

    def wait_for_a_slot():
        try:
            with limit.acquire(reports, app=app, wait=60.0):
                waited.append("granted")
        except StepLockError as exc:  # pragma: no cover - reported by the assertion below
            waited.append(exc)

    waiter = threading.Thread(target=wait_for_a_slot, daemon=True)
    waiter.start()

    def check(page):
        text = page.locator("#concurrency-limits").inner_text()
        assert "2 / 2" in text and "#0:" in text and "#1:" in text and "1 / 5" in text
        assert TASK in text and WORKER in text
        assert "1 (1)" in text, text  # the waiting caller

    try:
        browse(
            sync_playwright,
            live_server,
            admin_user,
            "/admin/celery_steplock/concurrencylimitstate/",
            "#concurrency-limits",
            "concurrency",
            tmp_path,
            check=check,
        )
    finally:
        for slot in (*held, other):
            assert slot.release()
        waiter.join(30)
    assert waited == ["granted"]


class ProviderDown(Exception):
    pass


def test_the_breakers_page(sync_playwright, live_server, admin_user, app, store, tmp_path):
    """One breaker opened by failures, one an operator forced open then closed."""
    breaker = CircuitBreaker(GATEWAY, failure_threshold=3, window=5, minimum_calls=3, app=app)

    def fail():
        raise ProviderDown("503 from the provider")

    for _ in range(3):
        with pytest.raises(ProviderDown):
            breaker.call(fail)
    assert breaker.state().state == "open"
    overridden = CircuitBreaker("smtp-relay", app=app)
    for action, reason in (("open", "provider incident INC-4711"), ("close", "provider back")):
        override_breaker(
            overridden,
            action,
            actor="ops",
            via="admin",
            reason=reason,
            auditor=LeaseEventBreakerAudit(),
        )

    def check(page):
        opened = page.locator("#circuit-breakers tr.breaker-open")
        assert opened.count() == 1 and GATEWAY in opened.inner_text()
        assert page.locator("#circuit-breakers button", has_text="Force open").count() >= 1
        text = page.locator("#circuit-breakers").inner_text()
        assert "smtp-relay" in text and "provider incident INC-4711" in text

    browse(
        sync_playwright,
        live_server,
        admin_user,
        "/admin/celery_steplock/circuitbreakerstate/",
        "#circuit-breakers",
        "breakers",
        tmp_path,
        check=check,
    )


def test_the_idempotency_records_page(
    sync_playwright, live_server, admin_user, app, store, tmp_path
):
    """Database records locked, completed and failed (one expired), and Redis records in
    the same states, written through the stores."""
    database = DatabaseRecords()
    redis_records = RedisRecords(store.client, store.prefix)
    stored = Stored.dump({"status": 201, "invoice": "INV-000042"}, "json")
    both: list[Any] = [database, redis_records]
    for records in both:
        for i, status in enumerate(("locked", "completed", "completed", "failed")):
            key = uuid.uuid4().hex * 2
            owner = uuid.uuid4().hex
            namespace = "billing.charge_invoice" if i % 2 else "mail.send_receipt"
            decision = records.begin(key, "f" * 64, owner, 600.0, namespace, "1")
            assert decision.outcome == "locked", decision
            if status == "completed":
                assert records.complete(key, owner, "f" * 64, stored, 3600.0, namespace, "1")
            elif status == "failed":
                assert records.fail(key, owner, "ProviderDown: 503 from the provider", 3600.0)
    from celery_steplock.contrib.django.models import IdempotencyRecord

    expired = IdempotencyRecord.objects.filter(status="completed").first()
    expired.expires_at = timezone.now() - timedelta(hours=1)
    expired.save(update_fields=["expires_at"])

    def check(page):
        summary = page.locator("#idempotency-summary").inner_text()
        assert "1 / 0" in summary and "1 / 1" in summary, summary
        assert page.locator("#result_list tbody tr").count() == 4

    measures = browse(
        sync_playwright,
        live_server,
        admin_user,
        "/admin/celery_steplock/idempotencyrecord/",
        "#result_list",
        "idempotency",
        tmp_path,
        check=check,
        judge=False,
    )
    assert measures["resultsScroll"] is not None  # Django's changelist, with its results box
    assert_fits(measures)


# The Activity page's charts: each inline <svg> inside the viewport, drawn (a line, a dot or
# a bar), and nothing scrolling sideways.
CHARTS = """() => {
  const svgs = [...document.querySelectorAll("#content-main figure.sl-chart svg")];
  return {
    innerWidth: window.innerWidth, scrollWidth: document.documentElement.scrollWidth,
    content: (() => { const c = document.querySelector("#content");
      return {scrollWidth: c.scrollWidth, clientWidth: c.clientWidth}; })(),
    sidebar: document.querySelector("#nav-sidebar").getBoundingClientRect().width,
    charts: svgs.map((svg) => { const r = svg.getBoundingClientRect();
      return {left: r.left, right: r.right, height: r.height,
        marks: svg.querySelectorAll("polyline, rect, circle").length,
        points: Math.max(0, ...[...svg.querySelectorAll("polyline")].map(
          (p) => p.getAttribute("points").trim().split(/\\s+/).length))}; }),
  };
}"""


def test_the_activity_page_draws_its_charts(
    sync_playwright, live_server, admin_user, app, store, redis_client, tmp_path
):
    """Real executions and rate-limit decisions counted by the process's aggregator and
    flushed to Redis; the page draws them as inline SVG within the admin's layout."""
    from celery_steplock import activity

    aggregator = activity.install()
    app.conf.steplock_activity = True
    aggregator.refresh()
    aggregator.flush()
    steps = [Step.objects.create(name=f"charge {n}") for n in range(6)]
    for step in steps:
        assert advance.apply(args=(step.pk,)).successful()
    assert advance.apply(args=(steps[0].pk,)).successful()  # a duplicate
    window = SlidingWindow(3, 60.0, app=app)
    decisions = [window.try_acquire(GATEWAY, app=app).allowed for _ in range(5)]
    assert decisions == [True, True, True, False, False]
    assert aggregator.flush() >= 1
    seen = {}

    def check(page):
        seen.update(page.evaluate(CHARTS))
        text = page.locator("#content-main").inner_text()
        assert advance.name in text and GATEWAY in text, text

    browse(
        sync_playwright,
        live_server,
        admin_user,
        "/admin/celery_steplock/activity/",
        "#content-main",
        "activity",
        tmp_path,
        check=check,
        judge=False,
    )
    assert seen["sidebar"] >= 200  # open, beside the content
    assert seen["scrollWidth"] <= seen["innerWidth"], seen
    assert seen["content"]["scrollWidth"] <= seen["content"]["clientWidth"], seen
    charts = seen["charts"]
    assert len(charts) >= 4, charts  # the task's wait, hold, counts; the limit's decisions
    for chart in charts:
        assert 0 <= chart["left"] and chart["right"] <= seen["innerWidth"], chart
        assert chart["height"] > 40, chart
    # A minute's value is a dot, a run of minutes a line; counts are bars.
    assert all(chart["marks"] >= 1 for chart in charts), charts
