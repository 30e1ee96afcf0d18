"""Idempotency records in Django: the database store (the row is the truth, Redis a cache of
completed rows), the admin page, and the view decorator and middleware through Django's test
client (``Idempotency-Key`` as payment APIs use it)."""

import json
import os
import signal
import threading
import time

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import path

from celery_steplock.contrib.django.idempotency import (
    REPLAYED_HEADER,
    DatabaseRecords,
    idempotent_view,
)
from celery_steplock.contrib.django.models import IdempotencyRecord
from celery_steplock import signals
from celery_steplock.exceptions import (
    IdempotencyInProgress,
    IdempotencyKeyReused,
    LockStoreUnavailable,
)
from celery_steplock.heartbeat import get_heartbeat, heartbeat_for
from celery_steplock.patterns.idempotency import Idempotency, RedisRecords, idempotent
from celery_steplock.lock import RedisLeaseStore, make_client
from celery_steplock.task import StepLockedTask
from django_app.celery import app as celery_app
from tests.helpers import set_settings
from tests.support.servers import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

SECRET = "d" * 40
CALLS = []


def database_policy(redis_client, **kwargs):
    return Idempotency("tests.db", client=redis_client, secret=SECRET, store="database", **kwargs)


@pytest.fixture(autouse=True)
def calls():
    CALLS.clear()
    yield CALLS
    CALLS.clear()


def test_the_database_store_records_and_replays(redis_client):
    policy = database_policy(redis_client)
    with policy.call("r1", {"a": 1}) as call:
        call.result = {"total": 3}
    row = IdempotencyRecord.objects.get(key=policy.key("r1"))
    assert row.status == "completed" and json.loads(row.result) == {"total": 3}
    assert row.namespace == "tests.db" and row.version == "1" and row.owner == ""
    assert row.created_at <= row.completed_at < row.expires_at
    with policy.call("r1", {"a": 1}) as call:
        assert call.replayed and call.result == {"total": 3}
    with pytest.raises(IdempotencyKeyReused):
        policy.begin("r1", {"a": 2})


def test_a_cached_replay_costs_no_query_and_the_row_stays_the_truth(redis_client):
    policy = database_policy(redis_client)
    with policy.call("r2", {"a": 1}) as call:
        call.result = "first"
    cache = RedisRecords(redis_client, "steplock")
    assert cache.get(policy.key("r2")).status == "completed"  # the copy, after COMMIT
    with CaptureQueriesContext(connection) as queries:
        assert policy.begin("r2", {"a": 1}).result == "first"
    assert len(queries) == 0
    redis_client.flushdb()  # the cache is lost: the row still decides, and fills it again
    with CaptureQueriesContext(connection) as queries:
        assert policy.begin("r2", {"a": 1}).result == "first"
    assert len(queries) >= 1
    assert cache.get(policy.key("r2")).payload == '"first"'
    # Only completed rows are cached: a locked or failed one lives in the database alone.
    held = policy.begin("r3", {"a": 1})
    assert cache.get(policy.key("r3")) is None
    held.fail(ValueError("x"))
    assert cache.get(policy.key("r3")) is None
    assert IdempotencyRecord.objects.get(key=policy.key("r3")).status == "failed"


def test_invalidate_deletes_the_row_and_the_copy(redis_client):
    policy = database_policy(redis_client)
    with policy.call("r4", {"a": 1}) as call:
        call.result = 1
    assert policy.invalidate("r4") is True
    assert not IdempotencyRecord.objects.filter(key=policy.key("r4")).exists()
    assert RedisRecords(redis_client, "steplock").get(policy.key("r4")) is None
    again = policy.begin("r4", {"a": 1})
    assert not again.replayed
    again.release()  # ended: its renewals stop


def test_a_failed_or_expired_row_runs_again(redis_client):
    policy = database_policy(redis_client, lock_ttl=0.2)
    first = policy.begin("r5", {"a": 1})
    first.fail(RuntimeError("x"))
    again = policy.begin("r5", {"a": 1})
    assert not again.replayed
    row = IdempotencyRecord.objects.get(key=policy.key("r5"))
    assert row.status == "locked" and row.attempts == 2
    # The holder crashed: its heartbeat stopped.
    heartbeat_for(policy.store).unregister(again.lease)
    time.sleep(0.3)  # and its lock expired
    third = policy.begin("r5", {"a": 1})
    assert again.complete("late") is False and third.complete("ok") is True
    assert policy.begin("r5", {"a": 1}).result == "ok"


def test_a_first_call_is_one_insert_and_one_update_in_autocommit(redis_client):
    """Issue 26: outside an atomic block, a new key costs two statements, each its own
    durable transaction (the lock row before the body, the result after): no savepoint, no
    SELECT; the row is committed (seen by another connection) before the body runs."""
    policy = database_policy(redis_client)
    key = policy.key("r10")
    with CaptureQueriesContext(connection) as queries:
        held = policy.begin("r10", {"a": 1})
        seen = _row_elsewhere(key)
        assert held.complete({"ok": True}) is True
    statements = [q["sql"].split()[0].upper() for q in queries.captured_queries]
    assert statements == ["INSERT", "UPDATE"]
    assert seen == ("locked", held.owner)
    row = IdempotencyRecord.objects.get(key=key)
    assert (row.status, row.owner, row.error, row.attempts) == ("completed", "", "", 1)
    assert (row.namespace, row.version, row.fingerprint) == ("tests.db", "1", held.fingerprint)
    assert json.loads(row.result) == {"ok": True} and row.result_b64 is False
    assert row.created_at == row.locked_at <= row.completed_at < row.expires_at
    assert row.failed_at is None and row.serializer == "json"
    assert policy.begin("r10", {"a": 1}).result == {"ok": True}


def _row_elsewhere(key):
    """The (status, owner) of ``key``'s row as another thread's connection sees it."""
    from django.db import connections

    seen = []

    def read():
        try:
            seen.extend(IdempotencyRecord.objects.filter(key=key).values_list("status", "owner"))
        finally:
            connections.close_all()

    thread = threading.Thread(target=read)
    thread.start()
    thread.join(10)
    return seen[0] if seen else None


def test_inside_an_atomic_block_the_row_is_the_callers_and_a_conflict_keeps_it_usable(
    redis_client,
):
    """Issue 26: inside ``atomic()`` the row joins the caller's transaction (a rollback
    leaves no record), and a refused key (held, reused) leaves that transaction usable."""
    from django.db import transaction

    policy = database_policy(redis_client)
    holder = policy.begin("r11", {"a": 1})
    with transaction.atomic():
        with pytest.raises(IdempotencyInProgress):
            policy.begin("r11", {"a": 1})
        with pytest.raises(IdempotencyKeyReused):
            policy.begin("r11", {"a": 2})
        inner = policy.begin("r12", {"a": 1})
        assert IdempotencyRecord.objects.filter(key=policy.key("r12")).count() == 1
        transaction.set_rollback(True)
    inner.release()  # its row went with the rollback: nothing to release
    assert not IdempotencyRecord.objects.filter(key=policy.key("r12")).exists()
    assert holder.complete(1) is True
    with transaction.atomic():
        replay = policy.begin("r11", {"a": 1})
        assert replay.replayed and replay.result == 1
        assert IdempotencyRecord.objects.filter(key=policy.key("r11")).count() == 1


def test_the_database_store_renews_a_running_body_owner_checked(redis_client):
    """Issue 24: the heartbeat renews a ``locked`` row while its holder lives (its own
    connection, one owner-checked UPDATE), so the key stays refused past the lock TTL;
    a completed, deleted or foreign row is never extended, and a lost one is reported."""
    lock_ttl = 1.0
    policy = database_policy(redis_client, lock_ttl=lock_ttl)
    held = policy.begin("r8", {"a": 1})
    first = IdempotencyRecord.objects.get(key=policy.key("r8"))
    since = time.monotonic()
    while time.monotonic() - since < 3 * lock_ttl:
        with pytest.raises(IdempotencyInProgress):
            policy.begin("r8", {"a": 1})
        with pytest.raises(IdempotencyKeyReused):
            policy.begin("r8", {"a": 2})
        time.sleep(0.1)
    row = IdempotencyRecord.objects.get(key=policy.key("r8"))
    assert row.status == "locked" and row.owner == held.owner and row.attempts == 1
    assert row.expires_at > first.expires_at
    assert held.complete("done") is True
    assert held.lease not in heartbeat_for(policy.store).leases
    store = policy.store
    completed = IdempotencyRecord.objects.get(key=policy.key("r8"))
    assert store.extend_many([(policy.key("r8"), held.owner, 300.0)]) == [False]
    assert IdempotencyRecord.objects.get(key=policy.key("r8")).expires_at == completed.expires_at
    other = policy.begin("r9", {"a": 1})
    assert store.extend_many([(policy.key("r9"), "someone-else", 300.0)]) == [False]
    assert store.extend_many([(policy.key("r9"), other.owner, 300.0)]) == [True]
    lost = []
    receiver = lambda sender=None, **kw: lost.append(kw)  # noqa: E731
    signals.idempotency_lost.connect(receiver, weak=False)
    try:
        policy.invalidate("r9")  # deleted under its holder
        wait_until(lambda: other.lease.lost, timeout=20, what="the renewal to find it gone")
        # The heartbeat marks the lease lost, then sends the signal: wait for both.
        wait_until(lambda: lost, timeout=20, what="idempotency_lost")
        assert [kw["key"] for kw in lost] == [policy.key("r9")]
    finally:
        signals.idempotency_lost.disconnect(receiver)
    assert other.lease not in heartbeat_for(store).leases
    fresh = policy.begin("r9", {"a": 1})
    assert fresh.replayed is False and fresh.release() is True


def _postmaster_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SHOW data_directory")
        data_directory = cursor.fetchone()[0]
    with open(os.path.join(data_directory, "postmaster.pid")) as pidfile:
        return int(pidfile.readline())


@pytest.mark.postgresql  # stops the pass's PostgreSQL server for a few seconds
def test_a_database_that_stops_answering_never_delays_the_redis_leases(redis_client):
    """A renewal of the database store that hangs (the postmaster is stopped: each renewal
    opens a connection, CONN_MAX_AGE=0) runs on a thread of its own: the process's Redis
    leases are renewed all along, and the record, once its lock TTL has run out, is lost
    with a reason naming the store that did not answer, not "held by another owner"."""
    policy = database_policy(redis_client, lock_ttl=0.9)
    held = policy.begin("pg-pause", {"a": 1})
    assert held.lease in heartbeat_for(policy.store).leases
    assert heartbeat_for(policy.store) is not get_heartbeat()  # a renewal thread of its own
    store = RedisLeaseStore(redis_client, prefix="t-pg-pause")
    lease = store.acquire("pg-pause", "o", 2.0)
    get_heartbeat().register(lease, store)
    lost = []
    receiver = lambda sender=None, **kw: lost.append(kw)  # noqa: E731
    signals.idempotency_lost.connect(receiver, weak=False)
    postmaster = _postmaster_pid()
    try:
        wait_until(lambda: lease.valid_until > lease.acquired_at + 2.0, what="a renewal")
        os.kill(postmaster, signal.SIGSTOP)
        try:
            stopped_at = time.monotonic()
            while time.monotonic() - stopped_at < 4.0:  # twice the lease's TTL
                assert not lease.lost, lease.lost_reason
                time.sleep(0.1)
            assert store.owned("pg-pause", "o") is not None
        finally:
            os.kill(postmaster, signal.SIGCONT)
        wait_until(lambda: lost, timeout=20, what="the record's loss")
        reason = lost[0]["reason"]
        assert "another owner" not in reason, reason
        assert "did not answer" in reason or "could not be reached" in reason, reason
        assert not lease.lost and store.owned("pg-pause", "o") is not None
    finally:
        signals.idempotency_lost.disconnect(receiver)
        get_heartbeat().unregister(lease)
        store.release("pg-pause", "o")
        held.release()


def test_a_redis_outage_only_slows_the_database_store_down(redis_client):
    policy = database_policy(redis_client)
    with policy.call("r6", {"a": 1}) as call:
        call.result = "kept"
    dead = Idempotency(
        "tests.db",
        client=make_client("redis://127.0.0.1:1/0", socket_timeout=0.2),
        secret=SECRET,
        store="database",
    )
    assert dead.begin("r6", {"a": 1}).result == "kept"  # from the row


def test_a_database_outage_fails_closed(redis_client, monkeypatch):
    from django.db import OperationalError

    store = DatabaseRecords(cache=None)

    def broken(*args, **kwargs):
        raise OperationalError("server closed the connection")

    monkeypatch.setattr(store, "_begin", broken)
    policy = Idempotency("tests.db", store=store, secret=SECRET)
    with pytest.raises(LockStoreUnavailable):
        policy.begin("r7", {"a": 1})
    opened = Idempotency("tests.db", store=store, secret=SECRET, on_store_error="fail_open")
    assert opened.begin("r7", {"a": 1}).unguarded


@pytest.mark.postgresql  # SQLite serializes writers: the PostgreSQL pass shows the race
def test_concurrent_first_calls_on_the_database_store_run_once(redis_client):
    runs = []
    barrier = threading.Barrier(6)

    @idempotent(
        key="job:{n}",
        client=redis_client,
        secret=SECRET,
        store="database",
        namespace="tests.db.threads",
    )
    def job(n):
        runs.append(n)
        import time

        time.sleep(0.3)
        return n + 1

    outcomes = []

    def call():
        from django.db import connections

        barrier.wait()
        try:
            while True:
                try:
                    outcomes.append(job(1))
                    return
                except Exception as exc:  # noqa: BLE001
                    if type(exc).__name__ != "IdempotencyInProgress":
                        outcomes.append(repr(exc))
                        return
                    import time

                    time.sleep(0.05)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=call) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert runs == [1] and outcomes == [2] * 6


def test_the_task_option_with_the_database_store(app, redis_client):
    set_settings(app, steplock_idempotency_store="database")

    @celery_app.task(
        bind=True,
        base=StepLockedTask,
        name="tests.idem.db.task",
        lock_key="dbt:{n}",
        idempotency_key="n:{n}",
    )
    def counted(self, n):
        CALLS.append(n)
        return n * 10

    assert counted.apply(args=(4,)).get() == 40
    assert counted.apply(args=(4,)).get() == 40
    assert CALLS == [4]
    assert IdempotencyRecord.objects.get().status == "completed"


# -- the admin ------------------------------------------------------------------------------------


def test_the_admin_lists_filters_and_invalidates(client, redis_client, app):
    policy = Idempotency("tests.admin", app=app, store="database")
    with policy.call("a", {"x": 1}) as call:
        call.result = "a"
    failed = policy.begin("b", {"x": 1})
    failed.fail(ValueError("no"))
    admin = User.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(admin)
    page = client.get("/admin/celery_steplock/idempotencyrecord/?status__exact=completed")
    assert page.status_code == 200
    text = page.content.decode()
    assert policy.key("a")[:16] in text and policy.key("b")[:16] not in text
    row = IdempotencyRecord.objects.get(key=policy.key("a"))
    response = client.post(
        "/admin/celery_steplock/idempotencyrecord/",
        {"action": "invalidate", "_selected_action": [row.pk]},
    )
    assert response.status_code == 302
    assert not IdempotencyRecord.objects.filter(key=policy.key("a")).exists()
    assert RedisRecords(policy.store.cache.client, "steplock").get(policy.key("a")) is None
    again = policy.begin("a", {"x": 1})
    assert not again.replayed
    again.release()


# -- views ----------------------------------------------------------------------------------------


@idempotent_view(namespace="tests.views.pay", app=celery_app, lock_ttl=5, anonymous=True)
def pay_view(request):
    CALLS.append(request.body)
    if request.GET.get("fail"):
        return JsonResponse({"error": "declined"}, status=402)
    if request.GET.get("crash"):
        raise RuntimeError("view crashed")
    response = JsonResponse(
        {"paid": json.loads(request.body)["amount"], "n": len(CALLS)}, status=201
    )
    response["Location"] = "/payments/1"
    response.set_cookie("session", "secret")
    return response


@idempotent_view(app=celery_app, required=True)
def strict_view(request):
    CALLS.append(1)
    return HttpResponse("ok")


LONG = {"started": threading.Event(), "finish": threading.Event()}


def long_body(request):
    CALLS.append(request.body)
    LONG["started"].set()
    LONG["finish"].wait(30)
    return JsonResponse({"paid": json.loads(request.body)["amount"], "n": len(CALLS)}, status=201)


def stream_view(request):
    CALLS.append(1)
    return StreamingHttpResponse(iter([b"a", b"b"]))


def plain_view(request):
    CALLS.append(request.path)
    return HttpResponse(f"n={len(CALLS)}")


urlpatterns = [
    path("pay", pay_view),
    path("strict", strict_view),
    path("stream", idempotent_view(app=celery_app, anonymous=True)(stream_view)),
    path(
        "long/redis",
        idempotent_view(namespace="tests.views.long", app=celery_app, lock_ttl=1, anonymous=True)(
            long_body
        ),
    ),
    path(
        "long/database",
        idempotent_view(
            namespace="tests.views.long_db",
            app=celery_app,
            lock_ttl=1,
            anonymous=True,
            store="database",
        )(long_body),
    ),
    path("mw/a", plain_view),
    path("mw/b", plain_view),
]


def post(client, url, body, key, **extra):
    headers = {"HTTP_IDEMPOTENCY_KEY": key} if key else {}
    return client.post(
        url, data=json.dumps(body), content_type="application/json", **headers, **extra
    )


@override_settings(ROOT_URLCONF=__name__)
def test_a_view_replays_the_same_request_and_refuses_another(client, redis_client):
    first = post(client, "/pay", {"amount": 5}, "k-1")
    assert first.status_code == 201 and first.json() == {"paid": 5, "n": 1}
    assert REPLAYED_HEADER not in first
    again = post(client, "/pay", {"amount": 5}, "k-1")
    assert again.status_code == 201 and again.json() == {"paid": 5, "n": 1}
    assert again[REPLAYED_HEADER] == "true" and again["Location"] == "/payments/1"
    assert "session" not in again.cookies  # Set-Cookie is never recorded
    other = post(client, "/pay", {"amount": 6}, "k-1")
    assert other.status_code == 422 and len(CALLS) == 1
    assert post(client, "/pay", {"amount": 6}, "k-2").json() == {"paid": 6, "n": 2}
    assert post(client, "/pay", {"amount": 6}, None).json() == {"paid": 6, "n": 3}  # no key


@override_settings(ROOT_URLCONF=__name__)
def test_error_responses_and_exceptions_are_not_recorded(client, redis_client):
    assert post(client, "/pay?fail=1", {"amount": 5}, "e-1").status_code == 402
    assert post(client, "/pay?fail=1", {"amount": 5}, "e-1").status_code == 402
    assert len(CALLS) == 2
    client.raise_request_exception = True
    with pytest.raises(RuntimeError):
        post(client, "/pay?crash=1", {"amount": 5}, "e-2")
    with pytest.raises(RuntimeError):
        post(client, "/pay?crash=1", {"amount": 5}, "e-2")
    assert len(CALLS) == 4


@override_settings(ROOT_URLCONF=__name__)
def test_an_in_progress_key_gets_409_with_retry_after(client, redis_client):
    policy = pay_view.idempotency.policy
    from celery_steplock.contrib.django.idempotency import _request_fingerprint
    from django.test import RequestFactory

    request = RequestFactory().post(
        "/pay", data=json.dumps({"amount": 5}), content_type="application/json"
    )
    held = policy.begin(
        pay_view.idempotency.resource(request, "busy"),
        fingerprint=_request_fingerprint(request, policy.secret),
    )
    response = post(client, "/pay", {"amount": 5}, "busy")
    assert response.status_code == 409 and 1 <= int(response["Retry-After"]) <= 5
    held.release()
    assert post(client, "/pay", {"amount": 5}, "busy").status_code == 201


@pytest.mark.parametrize("store", ["redis", "database"])
@override_settings(ROOT_URLCONF=__name__)
def test_a_view_longer_than_its_lock_ttl_answers_409_to_a_repeat(client, redis_client, store):
    """Issue 24: a request whose view runs past the lock TTL keeps its record (the
    heartbeat renews it), so a repeat gets 409 (422 with another body), never a second 201."""
    from django.db import connections
    from django.test import Client

    lock_ttl = 1.0
    url = f"/long/{store}"
    LONG["started"].clear()
    LONG["finish"].clear()
    first = []

    def run():
        try:
            first.append(post(Client(), url, {"amount": 5}, "slow"))
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert LONG["started"].wait(20)
        since = time.monotonic()
        while time.monotonic() - since < 3 * lock_ttl:
            again = post(client, url, {"amount": 5}, "slow")
            assert again.status_code == 409, (again.status_code, again.content)
            time.sleep(0.2)
        assert post(client, url, {"amount": 6}, "slow").status_code == 422
    finally:
        LONG["finish"].set()
        thread.join(30)
    assert first[0].status_code == 201 and first[0].json() == {"paid": 5, "n": 1}
    replay = post(client, url, {"amount": 5}, "slow")
    assert replay[REPLAYED_HEADER] == "true" and replay.json() == {"paid": 5, "n": 1}
    assert len(CALLS) == 1


@override_settings(ROOT_URLCONF=__name__)
def test_keys_are_per_user_and_the_header_can_be_required(client, redis_client):
    assert post(client, "/pay", {"amount": 1}, "shared").json()["n"] == 1
    client.force_login(User.objects.create_user("u1", password="pw"))
    assert post(client, "/pay", {"amount": 1}, "shared").json()["n"] == 2  # another scope
    assert client.post("/strict").status_code == 400 and CALLS == [b'{"amount": 1}'] * 2
    assert client.post("/strict", HTTP_IDEMPOTENCY_KEY="s").status_code == 200
    assert client.post("/strict", HTTP_IDEMPOTENCY_KEY="s")[REPLAYED_HEADER] == "true"
    assert client.get("/strict").status_code == 200  # GET is not guarded


@override_settings(ROOT_URLCONF=__name__)
def test_a_streaming_response_is_released_not_recorded(client, redis_client):
    for _ in range(2):
        assert client.post("/stream", HTTP_IDEMPOTENCY_KEY="st").status_code == 200
    assert len(CALLS) == 2


@override_settings(
    ROOT_URLCONF=__name__,
    STEPLOCK_IDEMPOTENCY_MIDDLEWARE={"app": celery_app, "anonymous": True},
    MIDDLEWARE=["celery_steplock.contrib.django.idempotency.IdempotencyMiddleware"],
)
def test_the_middleware_guards_every_view_per_path(client, redis_client):
    assert client.post("/mw/a", HTTP_IDEMPOTENCY_KEY="m").content == b"n=1"
    assert client.post("/mw/a", HTTP_IDEMPOTENCY_KEY="m").content == b"n=1"
    assert client.post("/mw/b", HTTP_IDEMPOTENCY_KEY="m").content == b"n=2"  # another path
    assert client.post("/mw/a").content == b"n=3"  # no key: not guarded
