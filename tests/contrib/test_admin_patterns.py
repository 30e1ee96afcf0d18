"""The admin's live pages of the patterns (Django test client, real Redis): "Rate limits",
"Concurrency limits", the circuit breakers' overrides and the idempotency records' summary.

Each page is read as staff with the model's view permission only; each answers 200 with a
corrupt entry planted by the real Redis client (wrong type, not a number, a name that is not
UTF-8), the entry shown as "malformed"; each listing is bounded whatever Redis holds.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from celery_steplock import live
from celery_steplock.contrib.django.eventlog import LeaseEventBreakerAudit
from celery_steplock.contrib.django.models import IdempotencyRecord
from celery_steplock.keys import (
    breaker_key,
    concurrency_keys,
    idempotency_record_key,
    rate_limit_keys,
    slot_key,
)
from celery_steplock.lock import get_lease_store
from celery_steplock.ops import override_breaker
from celery_steplock.patterns.breaker import CircuitBreaker
from celery_steplock.patterns.concurrency import ConcurrencyLimit
from celery_steplock.patterns.ratelimit import SlidingWindow, TokenBucket
from tests.support.admin import staff

pytestmark = pytest.mark.django_db

RATES = "admin:celery_steplock_ratelimitstate_changelist"
SLOTS = "admin:celery_steplock_concurrencylimitstate_changelist"
BREAKERS = "admin:celery_steplock_circuitbreakerstate_changelist"
RECORDS = "admin:celery_steplock_idempotencyrecord_changelist"


@pytest.fixture
def store(app, redis_client):
    """The lease store the pages read (the app's settings), on a flushed Redis."""
    return get_lease_store(app)


def now_ms(client) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def rows_by_name(response):
    return {row["name"]: row for row in response.context["rows"]}


# -- permissions ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("page", "perm"),
    [
        (RATES, "celery_steplock.view_ratelimitstate"),
        (SLOTS, "celery_steplock.view_concurrencylimitstate"),
    ],
)
def test_a_live_page_needs_its_view_permission(django_user_model, store, page, perm):
    # the lease page's permission is not this page's
    other = staff(django_user_model, "other", "celery_steplock.view_lease")
    assert other.get(reverse(page)).status_code == 403
    viewer = staff(django_user_model, "viewer", perm)
    response = viewer.get(reverse(page))
    assert response.status_code == 200
    assert response.context["error"] is None
    # read-only: no add, change or delete view behind the page
    assert viewer.get(reverse(page) + "add/").status_code == 404


# -- rate limits ------------------------------------------------------------------------------


def test_rate_limits_page_shows_use_against_the_limit_and_waiting_tickets(
    app, django_user_model, store, redis_client
):
    window = SlidingWindow(3, 60.0, app=app)
    for _ in range(3):
        assert window.try_acquire("api", app=app).allowed
    denied = window.try_acquire("api", app=app, reserve=True)
    assert not denied.allowed and denied.ticket
    bucket = TokenBucket(1 / 3600, 5, app=app)  # one token an hour: no refill in the test
    for _ in range(2):
        assert bucket.try_acquire("mail", app=app).allowed

    page = staff(django_user_model, "viewer", "celery_steplock.view_ratelimitstate")
    response = page.get(reverse(RATES))
    assert response.status_code == 200
    rows = rows_by_name(response)
    api = rows["api"]
    assert (api["kind"], api["limit"], api["used"], api["capacity"], api["left"]) == (
        "window",
        "3/60s window",
        3,
        3,
        0,
    )
    assert (api["tickets"], api["queued"], api["malformed"]) == (1, 1, "")
    assert 0 <= api["oldest_wait"] < 30
    assert api["key"] == window.redis_key(store.prefix, "api")[0]
    mail = rows["mail"]
    assert mail["kind"] == "bucket" and mail["capacity"] == 5
    assert mail["left"] == pytest.approx(3, abs=0.01)
    assert mail["used"] == pytest.approx(2, abs=0.01)
    assert (mail["tickets"], mail["queued"], mail["oldest_wait"]) == (0, 0, None)
    html = response.content.decode()
    assert "3 / 3" in html and "3/60s window" in html
    assert response.context["listing"].complete


def test_rate_limits_of_the_tasks_options_are_listed_before_any_use(app, store):
    tasks = [
        SimpleNamespace(name="shop.charge", cluster_rate_limit="5/m", cluster_rate_limit_key=None),
        SimpleNamespace(
            name="shop.mail",
            cluster_rate_limit=[TokenBucket(2.0, 4)],
            cluster_rate_limit_key="mail:{customer}",
        ),
        SimpleNamespace(name="shop.plain", cluster_rate_limit=None),
    ]
    listing = live.rate_limit_rows(app, tasks=tasks)
    rows = {row["name"]: row for row in listing.rows}
    assert set(rows) == {"shop.charge"}  # the per-customer limit has no key until used
    charge = rows["shop.charge"]
    assert (charge["configured"], charge["tasks"], charge["used"], charge["left"]) == (
        True,
        ["shop.charge"],
        0,
        5,
    )
    TokenBucket(2.0, 4, app=app).try_acquire("mail:42", app=app)
    rows = {row["name"]: row for row in live.rate_limit_rows(app, tasks=tasks).rows}
    assert rows["mail:42"]["tasks"] == ["shop.mail (mail:{customer})"]
    assert not rows["mail:42"]["configured"]


def test_rate_limits_page_shows_corrupt_entries_as_malformed(
    app, django_user_model, store, redis_client
):
    prefix = store.prefix
    state, queue, due = rate_limit_keys(prefix, "tb", "1.0:10", "garbled")
    redis_client.hset(state, mapping={"tokens": "lots", "ts": "1e400"})
    redis_client.set(rate_limit_keys(prefix, "sw", "10:1.0", "stringy")[0], "not a log")
    redis_client.hset(rate_limit_keys(prefix, "sw", "10:1.0", "queue-hash")[1], "a", "b")
    redis_client.set(f"{prefix}:rate:nonsense", "x")
    redis_client.set(rate_limit_keys(prefix, "tb", "zero:0", "figures")[0], "x")
    # a name that is not UTF-8 (bytes are sent as they are)
    redis_client.execute_command(
        "SET", f"{prefix}:rate:sw:10:1.0:{{bad-\xff}}".encode("latin-1"), "x"
    )

    page = staff(django_user_model, "viewer", "celery_steplock.view_ratelimitstate")
    response = page.get(reverse(RATES))
    assert response.status_code == 200
    assert response.context["error"] is None
    rows = rows_by_name(response)
    garbled = rows["garbled"]
    assert "tokens: not a number ('lots')" in garbled["malformed"]
    assert "ts: not a number" in garbled["malformed"]
    assert garbled["left"] == 10  # read as the script reads it: no bucket, full
    assert rows["stringy"]["malformed"] == "key: a string, not a sorted set"
    assert rows["queue-hash"]["malformed"] == "ticket queue: a hash, not a sorted set"
    assert rows[f"{prefix}:rate:nonsense"]["malformed"] == "key: names no rate limit"
    assert "no bucket's figures" in rows["figures"]["malformed"]
    unreadable = [row for row in rows.values() if "not UTF-8" in row.get("malformed", "")]
    assert len(unreadable) == 1
    html = response.content.decode()
    assert html.count('class="rate-malformed errornote"') == 6
    assert unreadable[0]["key"].endswith("{bad-\ufffd}")  # shown, never read back


# -- concurrency limits ------------------------------------------------------------------------


def test_concurrency_page_shows_slots_holders_waiters_and_the_oldest_wait(
    app, django_user_model, store, redis_client
):
    limit = ConcurrencyLimit(3)
    _, queue, alive = concurrency_keys(store.prefix, "reports")
    with limit.acquire("reports", app=app) as first, limit.acquire("reports", app=app):
        # waiters, planted after the grants (a grant drops the waiters that are gone)
        now = now_ms(redis_client)
        redis_client.zadd(queue, {"t-old": now - 7000, "t-new": now - 1000})
        redis_client.zadd(alive, {"t-old": now + 60_000, "t-new": now - 1})  # t-new: gone
        page = staff(django_user_model, "viewer", "celery_steplock.view_concurrencylimitstate")
        response = page.get(reverse(SLOTS))
    assert response.status_code == 200
    row = rows_by_name(response)["reports"]
    assert (row["held"], row["limit"], row["queued"], row["waiting"]) == (2, 3, 2, 1)
    assert 7.0 <= row["oldest_wait"] < 30
    assert row["malformed"] == ""
    slots = row["slots"]
    assert [slot["index"] for slot in slots] == [0, 1]
    assert slots[0]["owner"] == first.lease.owner
    assert slots[0]["kind"] == "slot" and slots[0]["limit_key"] == "reports"
    assert 0 <= slots[0]["age"] < 30 and slots[0]["ttl"] > 0
    html = response.content.decode()
    assert "2 / 3" in html and "#0:" in html and "#1:" in html


def test_concurrency_limits_of_the_tasks_options_are_listed_before_any_use(app, store):
    tasks = [
        SimpleNamespace(name="shop.report", concurrency_limit=4, concurrency_limit_key=None),
        SimpleNamespace(
            name="shop.export",
            concurrency_limit=ConcurrencyLimit(2),
            concurrency_limit_key="export:{user}",
        ),
    ]
    listing = live.concurrency_rows(app, tasks=tasks)
    rows = {row["name"]: row for row in listing.rows}
    assert rows["shop.report"]["limit"] == 4 and rows["shop.report"]["held"] == 0
    assert rows["shop.report"]["tasks"] == ["shop.report"]
    assert listing.extra["templated"] == {"shop.export": (2, "export:{user}")}


def test_concurrency_page_shows_corrupt_entries_as_malformed(
    app, django_user_model, store, redis_client
):
    held = slot_key(store.prefix, "mangled", 0)
    redis_client.hset(
        held,
        mapping={
            "owner": "o" * 32,
            "fence": "x",
            "acquired_ms": "soon",
            "meta": '{"kind": "slot", "limit": "many", "task_name": ["a"]}',
        },
    )
    redis_client.set(slot_key(store.prefix, "mangled", 1), "a string where a slot belongs")
    redis_client.set(concurrency_keys(store.prefix, "queue-string")[1], "not a queue")
    page = staff(django_user_model, "viewer", "celery_steplock.view_concurrencylimitstate")
    response = page.get(reverse(SLOTS))
    assert response.status_code == 200
    assert response.context["error"] is None
    rows = rows_by_name(response)
    mangled = rows["mangled"]
    slots = {slot["index"]: slot for slot in mangled["slots"]}
    assert "fence: not an integer" in slots[0]["malformed"]
    assert "acquired_ms: not an integer" in slots[0]["malformed"]
    assert slots[0]["age"] is None
    assert slots[1]["malformed"] == "key: a string, not a hash"
    assert "limit: not an integer in a slot's metadata ('many')" in mangled["malformed"]
    assert mangled["limit"] is None
    assert rows["queue-string"]["malformed"] == "waiters' keys: not sorted sets"
    html = response.content.decode()
    assert html.count('class="slot-malformed errornote"') == 2
    assert html.count('class="concurrency-malformed errornote"') == 2


@pytest.mark.parametrize("limit", ["\u00b2", "\u0663", "\uff11"])
def test_a_non_ascii_digit_limit_in_a_slot_s_metadata_is_malformed_not_a_500(
    app, django_user_model, store, redis_client, limit
):
    """str.isdigit() is true for '²' (int() refuses it) and for Arabic-Indic and fullwidth
    digits (int() reads them): a slot's declared limit is ASCII digits only."""
    redis_client.hset(
        slot_key(store.prefix, "uni", 0),
        mapping={
            "owner": "o" * 32,
            "fence": "1",
            "acquired_ms": "1",
            "meta": '{"kind": "slot", "limit": "%s"}' % limit,
        },
    )
    page = staff(django_user_model, "viewer", "celery_steplock.view_concurrencylimitstate")
    response = page.get(reverse(SLOTS))
    assert response.status_code == 200
    row = rows_by_name(response)["uni"]
    assert "limit: not an integer in a slot's metadata" in row["malformed"]
    assert row["limit"] is None


def test_html_in_a_limit_key_or_owner_is_escaped(app, django_user_model, store, redis_client):
    redis_client.hset(
        slot_key(store.prefix, "<script>alert(1)</script>", 0),
        mapping={"owner": "<b>own</b>", "fence": "1", "acquired_ms": "1"},
    )
    page = staff(django_user_model, "viewer", "celery_steplock.view_concurrencylimitstate")
    response = page.get(reverse(SLOTS))
    html = response.content.decode()
    assert response.status_code == 200
    assert "<script>alert(1)" not in html and "<b>own</b>" not in html


# -- circuit breakers ------------------------------------------------------------------------------


def test_breakers_page_shows_the_generation_and_the_last_overrides_with_reasons(
    app, django_user_model, store, redis_client
):
    breaker = CircuitBreaker("payments", app=app)
    for action, reason in (("open", "provider incident"), ("close", "provider back")):
        override_breaker(
            breaker,
            action,
            actor="ops",
            via="admin",
            reason=reason,
            auditor=LeaseEventBreakerAudit(),
        )
    redis_client.hset(breaker_key(store.prefix, "junk"), mapping={"gen": "x", "ring": "abc"})
    reader = staff(
        django_user_model,
        "reader",
        "celery_steplock.view_circuitbreakerstate",
        "celery_steplock.view_leaseevent",
    )
    response = reader.get(reverse(BREAKERS))
    assert response.status_code == 200
    rows = rows_by_name(response)
    payments = rows["payments"]
    assert payments["state"] == "closed" and payments["generation"] == 2
    assert [event.reason for event in payments["overrides"]] == [
        "close: provider back",
        "open: provider incident",
    ]
    assert "gen: not an integer" in rows["junk"]["malformed"]
    assert rows["junk"]["overrides"] == []
    html = response.content.decode()
    assert "open: provider incident" in html and "State changes" in html
    # the audit rows are the event log's: not shown without its view permission
    viewer = staff(django_user_model, "viewer", "celery_steplock.view_circuitbreakerstate")
    response = viewer.get(reverse(BREAKERS))
    assert response.status_code == 200
    assert "provider incident" not in response.content.decode()
    assert "overrides" not in rows_by_name(response)["payments"]


# -- idempotency records ---------------------------------------------------------------------------


def test_idempotency_page_counts_records_by_status_and_shows_the_oldest_in_progress(
    app, django_user_model, store, redis_client
):
    now = now_ms(redis_client)
    prefix = store.prefix

    def record(key, **fields):
        redis_client.hset(idempotency_record_key(prefix, key), mapping=fields)

    record("a" * 64, status="locked", locked_ms=now - 90_000, ns="orders", attempts="2")
    record("b" * 64, status="locked", locked_ms=now - 5_000, ns="orders", attempts="1")
    record("c" * 64, status="completed", ns="orders")
    record("d" * 64, status="failed", ns="mail")
    # corrupt: a status no script writes, a time that is no number, a key of another type
    record("e" * 64, status="maybe")
    record("f" * 64, status="locked", locked_ms="yesterday")
    redis_client.rpush(idempotency_record_key(prefix, "0" * 64), "a list")
    expires = timezone.now() + timedelta(hours=1)
    for n, status in enumerate(("locked", "completed", "completed")):
        IdempotencyRecord.objects.create(
            key=f"{n:064d}",
            namespace="orders",
            version="1",
            status=status,
            fingerprint="f" * 64,
            expires_at=expires,
            locked_at=timezone.now() - timedelta(minutes=3) if status == "locked" else None,
        )
    IdempotencyRecord.objects.create(
        key="9" * 64,
        namespace="orders",
        version="1",
        status="locked",
        fingerprint="f" * 64,
        expires_at=timezone.now() - timedelta(hours=1),  # expired: absent
        locked_at=timezone.now() - timedelta(days=3),
    )
    page = staff(django_user_model, "viewer", "celery_steplock.view_idempotencyrecord")
    response = page.get(reverse(RECORDS))
    assert response.status_code == 200
    summary = response.context["summary"]
    database = summary["database"]
    assert database["error"] is None
    assert database["counts"] == {"completed": (2, 0), "locked": (1, 1)}
    assert database["oldest"]["record"].key == f"{0:064d}"
    assert 170 <= database["oldest"]["age"] < 300
    redis = summary["redis"]
    assert redis["error"] is None and redis["complete"]
    assert redis["counts"] == {"locked": 2, "completed": 1, "failed": 1, "malformed": 3}
    assert redis["oldest_locked"]["key"] == idempotency_record_key(prefix, "a" * 64)
    assert 90 <= redis["oldest_locked"]["age"] < 120
    problems = sorted(bad["malformed"] for bad in redis["malformed"])
    assert problems == [
        "key: a list, not a hash",
        "locked_ms: not an integer ('yesterday')",
        "status: not locked, completed or failed ('maybe')",
    ]
    html = response.content.decode()
    # The age the page shows is the one read above (the clock moved on meanwhile).
    shown = f"locked {redis['oldest_locked']['age']:.1f} s ago"
    assert 'id="idempotency-summary"' in html and shown in html
    # the list itself is Django's, as before
    assert len(response.context["cl"].result_list) == 4


# -- bounds: 10,000 keys of each pattern ----------------------------------------------------------


def plant(redis_client, pairs):
    pipe = redis_client.pipeline(transaction=False)
    for n, (command, args) in enumerate(pairs, 1):
        pipe.execute_command(command, *args)
        if n % 2000 == 0:
            pipe.execute()
    pipe.execute()


def timed_get(client, url):
    started = time.perf_counter()
    response = client.get(url)
    return response, (time.perf_counter() - started) * 1000


def test_each_live_page_stays_bounded_with_ten_thousand_keys_of_its_pattern(
    app, django_user_model, store, redis_client, capsys
):
    prefix, now = store.prefix, now_ms(redis_client)
    owner = uuid.uuid4().hex
    n = 10_000
    plant(
        redis_client,
        [
            ("ZADD", (rate_limit_keys(prefix, "sw", "10:60.0", f"k{i}")[0], now, "g"))
            for i in range(n)
        ],
    )
    plant(
        redis_client,
        [
            (
                "HSET",
                (
                    slot_key(prefix, f"lim{i // 2}", i % 2),
                    "owner",
                    owner,
                    "fence",
                    "1",
                    "acquired_ms",
                    str(now),
                    "meta",
                    '{"kind":"slot","limit":"2","task_name":"t"}',
                ),
            )
            for i in range(n)
        ],
    )
    plant(
        redis_client,
        [("HSET", (breaker_key(prefix, f"b{i}"), "state", "closed")) for i in range(n)],
    )
    plant(
        redis_client,
        [
            ("HSET", (idempotency_record_key(prefix, f"{i:064x}"), "status", "completed"))
            for i in range(n)
        ],
    )
    admin = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    client = Client()
    client.force_login(admin)
    timings = {}
    for name, url in (
        ("rates", RATES),
        ("slots", SLOTS),
        ("breakers", BREAKERS),
        ("records", RECORDS),
    ):
        response, ms = timed_get(client, reverse(url))
        again, ms_again = timed_get(client, reverse(url))
        assert response.status_code == again.status_code == 200
        timings[name] = (round(ms), round(ms_again))
        if name == "rates":
            assert len(response.context["rows"]) == live.MAX_LIMITS
            assert not response.context["listing"].complete
        elif name == "slots":
            rows = response.context["rows"]
            assert len(rows) <= live.MAX_LIMITS
            assert sum(len(row["slots"]) for row in rows) <= live.MAX_SLOTS
            # a walk cut between two slots of a limit still shows both (its size is known)
            planted = [row for row in rows if row["name"].startswith("lim")]
            assert planted and {(row["held"], row["limit"]) for row in planted} == {(2, 2)}
            assert not response.context["listing"].complete
        elif name == "records":
            redis = response.context["summary"]["redis"]
            assert redis["records"] == live.MAX_RECORDS and not redis["complete"]
            assert redis["counts"]["completed"] == live.MAX_RECORDS
    with capsys.disabled():
        print(f"\nlive pages, 4 x {n} keys planted: first / second view ms {timings}")
