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
