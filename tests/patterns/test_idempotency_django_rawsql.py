"""Adversarial checks of the database store's raw-SQL first call (issue 26): the caller's
transaction with autocommit off, and the raw INSERT/UPDATE against the ORM's own writes of
the same values (read back through the ORM, field by field)."""

import datetime as dt

import pytest
from django.contrib.auth.models import User
from django.db import transaction
from django.test import override_settings
from django.utils import timezone

from celery_steplock.contrib.django.models import IdempotencyRecord
from celery_steplock.exceptions import LockStoreUnavailable
from celery_steplock.patterns.idempotency import Idempotency

pytestmark = pytest.mark.django_db(transaction=True)

SECRET = "e" * 40


def database_policy(redis_client, **kwargs):
    return Idempotency("tests.raw", client=redis_client, secret=SECRET, store="database", **kwargs)


@pytest.mark.postgresql
def test_with_autocommit_off_a_failed_first_call_leaves_the_callers_transaction_usable(
    redis_client,
):
    """With autocommit off (``transaction.set_autocommit(False)``, no atomic block) the
    caller is in a transaction: a database error of the first call (here a value the column
    refuses, as a lock or statement timeout would) raises LockStoreUnavailable and must not
    abort that transaction (the ORM path ran in a savepoint of it)."""
    policy = database_policy(redis_client)
    transaction.set_autocommit(False)
    try:
        User.objects.create(username="kept")
        with pytest.raises(LockStoreUnavailable):
            policy.begin("ac1", fingerprint="f" * 65)  # varchar(64): DataError
        assert User.objects.filter(username="kept").exists()
        transaction.commit()
    finally:
        transaction.rollback()
        transaction.set_autocommit(True)
    assert User.objects.filter(username="kept").exists()


_COMPARED = (
    "key",
    "namespace",
    "version",
    "status",
    "fingerprint",
    "owner",
    "serializer",
    "content_type",
    "content_encoding",
    "result",
    "result_b64",
    "error",
    "attempts",
    "created_at",
    "locked_at",
    "completed_at",
    "failed_at",
    "expires_at",
)


@pytest.mark.parametrize("use_tz", [True, False])
def test_raw_sql_rows_read_back_as_the_orms_rows(redis_client, monkeypatch, use_tz):
    """The raw INSERT (begin) and UPDATE (complete) write what the ORM writes for the same
    values: the rows read back through the ORM are equal field by field (datetimes with and
    without USE_TZ, the boolean, the text), and a row the ORM wrote (an old row) is decided
    on by the new path."""
    with override_settings(USE_TZ=use_tz):
        fixed = timezone.now().replace(microsecond=123456)
        monkeypatch.setattr(timezone, "now", lambda: fixed)
        policy = database_policy(redis_client, lock_ttl=60.0, ttl=3600.0)
        key = policy.key("raw1")
        held = policy.begin("raw1", {"a": 1})
        raw_locked = IdempotencyRecord.objects.filter(key=key).values(*_COMPARED).get()
        orm_locked = dict(
            raw_locked,
            key="0" * 64,
        )
        IdempotencyRecord.objects.create(
            key="0" * 64,
            namespace="tests.raw",
            version="1",
            status="locked",
            fingerprint=held.fingerprint,
            owner=held.owner,
            result_b64=False,
            attempts=1,
            created_at=fixed,
            locked_at=fixed,
            expires_at=fixed + dt.timedelta(seconds=60.0),
        )
        assert (
            IdempotencyRecord.objects.filter(key="0" * 64).values(*_COMPARED).get() == orm_locked
        )
        assert raw_locked["created_at"] == fixed and raw_locked[
            "expires_at"
        ] == fixed + dt.timedelta(seconds=60)
        assert held.complete({"v": "é\u2603", "n": 1}) is True
        raw_done = IdempotencyRecord.objects.filter(key=key).values(*_COMPARED).get()
        IdempotencyRecord.objects.filter(key="0" * 64).update(
            status="completed",
            owner="",
            serializer=raw_done["serializer"],
            content_type=raw_done["content_type"],
            content_encoding=raw_done["content_encoding"],
            result=raw_done["result"],
            completed_at=fixed,
            expires_at=fixed + dt.timedelta(seconds=3600.0),
        )
        orm_done = IdempotencyRecord.objects.filter(key="0" * 64).values(*_COMPARED).get()
        assert orm_done == dict(raw_done, key="0" * 64)
        assert raw_done["completed_at"] == fixed
        redis_client.flushdb()  # no cached copy: the row decides
        assert policy.begin("raw1", {"a": 1}).result == {"v": "é\u2603", "n": 1}
