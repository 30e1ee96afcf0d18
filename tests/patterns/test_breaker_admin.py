"""The Django admin's "Circuit breakers" page (celery_steplock.contrib.django): live state
from Redis, and the audited override (open / close) for users with the permission."""

import pytest
from django.contrib.auth.models import Permission
from django.urls import reverse

from celery_steplock.patterns.breaker import CLOSED, OPEN, CircuitBreaker
from celery_steplock.contrib.django.models import LeaseEvent

pytestmark = pytest.mark.django_db(transaction=True)

CHANGELIST = "admin:celery_steplock_circuitbreakerstate_changelist"
OVERRIDE = "admin:celery_steplock_circuitbreakerstate_override"


def staff(django_user_model, *codenames):
    user = django_user_model.objects.create_user("ops", password="pw", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    return user


def test_the_page_shows_breakers_and_overrides_them_audited(
    client, django_user_model, app, redis_client
):
    breaker = CircuitBreaker("admin-payments", failure_threshold=1, window=1, app=app)
    with pytest.raises(ConnectionError):
        breaker.call(lambda: (_ for _ in ()).throw(ConnectionError("down")))
    client.force_login(
        staff(django_user_model, "view_circuitbreakerstate", "override_circuitbreakerstate")
    )
    page = client.get(reverse(CHANGELIST))
    assert page.status_code == 200
    html = page.content.decode()
    assert "admin-payments" in html and 'class="breaker-open"' in html
    done = client.post(
        reverse(OVERRIDE),
        {"name": "admin-payments", "action": "close", "reason": "provider fixed"},
    )
    assert done.status_code == 302
    assert breaker.state().state == CLOSED
    client.post(reverse(OVERRIDE), {"name": "admin-payments", "action": "open"})
    state = breaker.state()
    assert (state.state, state.forced) == (OPEN, True)
    rows = list(LeaseEvent.objects.filter(event="circuit_override").order_by("id"))
    assert [(r.name, r.via, r.actor, r.outcome) for r in rows] == [
        ("admin-payments", "admin", "ops", "done")
    ] * 2
    assert rows[0].reason == "close: provider fixed"


def test_viewing_without_the_override_permission(client, django_user_model, app, redis_client):
    client.force_login(staff(django_user_model, "view_circuitbreakerstate"))
    page = client.get(reverse(CHANGELIST))
    assert page.status_code == 200 and "Force open" not in page.content.decode()
    refused = client.post(reverse(OVERRIDE), {"name": "x", "action": "open"})
    assert refused.status_code == 403
    assert CircuitBreaker("x", app=app).state().forced is False
    other = django_user_model.objects.create_user("nobody", password="pw", is_staff=True)
    client.force_login(other)
    assert client.get(reverse(CHANGELIST)).status_code == 403


def binary_client(redis_client):
    """A client on the same database that writes and reads raw bytes (no decoding)."""
    import redis as redis_py

    raw = redis_client.connection_pool.connection_kwargs
    return redis_py.Redis(host=raw["host"], port=raw["port"], db=raw.get("db", 0))


def corrupt_breakers(app, redis_client):
    """One healthy breaker and one of every corruption, as written by a foreign client:
    ``{name: key}`` of the corrupt ones."""
    from celery_steplock.keys import breaker_key, breaker_probes_key
    from celery_steplock.lock import get_lease_store

    prefix = get_lease_store(app).prefix
    healthy = CircuitBreaker("healthy", failure_threshold=1, window=1, app=app)
    with pytest.raises(ConnectionError):
        healthy.call(lambda: (_ for _ in ()).throw(ConnectionError("down")))
    key = {
        name: breaker_key(prefix, name)
        for name in ("missing", "words", "string", "list", "huge", "bytes", "probes", "state")
    }
    redis_client.hset(key["missing"], mapping={"state": "open"})  # no gen, opened_ms
    redis_client.hset(
        key["words"],
        mapping={
            "state": "open",
            "gen": "x",
            "opened_ms": "yesterday",
            "successes": "many",
            "ring": "1a0",
        },
    )
    redis_client.set(key["string"], "not a hash")
    redis_client.rpush(key["list"], "a", "b")
    redis_client.hset(
        key["huge"], mapping={"state": "closed", "gen": "9" * 5000, "ring": "1" * 200_000}
    )
    redis_client.hset(key["state"], mapping={"state": "banana", "forced": "yes"})
    redis_client.hset(key["probes"], mapping={"state": "half_open", "gen": "2"})
    redis_client.set(breaker_probes_key(prefix, "probes"), "not a sorted set")
    raw = binary_client(redis_client)
    raw.hset(key["bytes"], mapping={"state": b"\xff\xfeopen", "gen": b"1", "ring": b"1\xff"})
    # Names no breaker may have: not UTF-8, a control character, a brace.
    raw.hset(f"{prefix}:breaker:{{".encode() + b"caf\xe9}", "state", "open")
    raw.close()
    redis_client.hset(f"{prefix}:breaker:{{esc\x1bape}}", "state", "open")
    redis_client.hset(f"{prefix}:breaker:{{a}}b}}", "state", "open")
    return key


def test_corrupt_breakers_are_rows_marked_malformed_never_a_500(
    client, django_user_model, app, redis_client
):
    corrupt_breakers(app, redis_client)
    client.force_login(
        staff(django_user_model, "view_circuitbreakerstate", "override_circuitbreakerstate")
    )
    page = client.get(reverse(CHANGELIST))
    assert page.status_code == 200
    assert page.context["error"] is None
    rows = {row["name"]: row for row in page.context["rows"]}
    # Beside the test project's tasks' breakers (never used: closed, not malformed).
    assert set(rows) >= {
        "healthy",
        "missing",
        "words",
        "string",
        "list",
        "huge",
        "bytes",
        "probes",
        "state",
        "caf\ufffd",
        "esc\\x1bape",
        "a}b",
    }
    assert rows["healthy"]["malformed"] == "" and rows["healthy"]["state"] == OPEN
    expected = {
        "missing": "opened_ms: missing",
        "words": "gen: not an integer",
        "string": "a string, not a hash",
        "list": "a list, not a hash",
        "huge": "gen: out of range",
        "bytes": "state: not UTF-8",
        "probes": "a string, not a sorted set",
        "state": "state: not closed, open or half_open",
        "caf\ufffd": "not UTF-8",
        "esc\\x1bape": "name:",
        "a}b": "name:",
    }
    for name, problem in expected.items():
        assert problem in rows[name]["malformed"], (name, rows[name]["malformed"])
        assert rows[name]["key"], name
    assert "opened_ms: not an integer" in rows["words"]["malformed"]
    assert "successes: not an integer" in rows["words"]["malformed"]
    assert "ring: not 0s and 1s" in rows["words"]["malformed"]
    assert "ring: longer than" in rows["huge"]["malformed"]
    html = page.content.decode()
    assert html.count('class="breaker-malformed errornote"') == len(expected)
    assert "\x1b" not in html
    # An override of a healthy breaker still works beside them.
    done = client.post(reverse(OVERRIDE), {"name": "healthy", "action": "close"})
    assert done.status_code == 302
    assert CircuitBreaker("healthy", app=app).state().state == CLOSED


def test_the_state_reader_returns_a_malformed_marker_never_raises(app, redis_client):
    keys = corrupt_breakers(app, redis_client)
    for name in keys:
        state = CircuitBreaker(name, app=app).state()
        assert state.malformed, name
        assert state.state in (CLOSED, OPEN, "half_open"), name
        assert isinstance(state.generation, int) and isinstance(state.successes, int)
    assert CircuitBreaker("healthy", app=app).state().malformed == ""
    assert CircuitBreaker("never-used", app=app).state().malformed == ""
