"""The sample shop's own tests: eager tasks, pytest-django's transactions, the plugin's
fixtures."""

import pytest
from django.db import transaction

from celery_steplock.exceptions import LockContended
from orders.models import Charge, Order
from orders.tasks import charge


@pytest.mark.django_db
def test_charge_commits_under_a_lease_and_releases_it(
    steplock_app, steplock_leases, steplock_key_prefix
):
    order = Order.objects.create()
    result = charge.delay(order.pk)
    assert result.get() == {
        "order": order.pk,
        "key": f"{steplock_key_prefix}:lease:{{order:{order.pk}}}",
    }
    order.refresh_from_db()
    assert order.status == "charged" and order.lock_fence == Charge.objects.get().fence
    assert steplock_leases.inspect(f"order:{order.pk}") is None


@pytest.mark.django_db
def test_delay_inside_my_own_atomic_block(steplock_app):
    with transaction.atomic():
        order = Order.objects.create()
        result = charge.delay(order.pk)
        assert result.successful()
        assert Order.objects.get(pk=order.pk).status == "charged"
    assert Order.objects.get(pk=order.pk).status == "charged"
    assert Charge.objects.filter(order=order).count() == 1


@pytest.mark.django_db
def test_my_block_rolling_back_takes_the_charge_with_it(steplock_app):
    with pytest.raises(ZeroDivisionError):
        with transaction.atomic():
            order = Order.objects.create()
            charge.delay(order.pk)
            1 / 0
    assert Order.objects.count() == 0 and Charge.objects.count() == 0


@pytest.mark.django_db
def test_a_failing_body_leaves_my_block_usable(steplock_app):
    with transaction.atomic():
        order = Order.objects.create()
        with pytest.raises(RuntimeError, match="gateway said no"):
            charge.delay(order.pk, fail=True)
        order.refresh_from_db()
        assert order.status == "pending"
    assert Charge.objects.count() == 0 and Order.objects.get().status == "pending"


@pytest.mark.django_db
def test_delay_on_commit_runs_once_the_callbacks_run(
    steplock_app, django_capture_on_commit_callbacks
):
    order = Order.objects.create()
    with django_capture_on_commit_callbacks(execute=True):
        with transaction.atomic():
            charge.delay_on_commit(order.pk)
            assert Order.objects.get(pk=order.pk).status == "pending"
    assert Order.objects.get(pk=order.pk).status == "charged" and Charge.objects.count() == 1


@pytest.mark.django_db
def test_a_second_delivery_charges_nothing(steplock_app):
    order = Order.objects.create()
    charge.delay(order.pk)
    second = charge.delay(order.pk)
    assert not second.failed()
    assert Charge.objects.count() == 1


@pytest.mark.django_db
def test_a_busy_lease_is_lock_contended_not_retry(steplock_app, steplock_leases):
    order = Order.objects.create()
    held = steplock_leases.acquire(f"order:{order.pk}", "another-worker", 30.0)
    with pytest.raises(LockContended) as info:
        charge.delay(order.pk)
    assert info.value.holder == "another-worker"
    assert Charge.objects.count() == 0 and Order.objects.get().status == "pending"
    assert steplock_leases.release(held.name, held.owner) is True


def test_my_keys_live_under_my_prefix(steplock_redis, steplock_key_prefix):
    steplock_redis.set(f"{steplock_key_prefix}:mine", "1")  # deleted after the test
    assert steplock_redis.get(f"{steplock_key_prefix}:mine") == "1"
