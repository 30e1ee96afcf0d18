"""The HTTP ``Idempotency-Key`` layer's bounds (issue 24): a refused request (4xx) leaves no
record, a principal holds at most ``max_records`` live records (429 beyond), the database
store's expired rows are pruned, the admin shows recorded responses only to who may change
them, and request bodies are fingerprinted without breaking the request (multipart, CSRF,
uploads above DATA_UPLOAD_MAX_MEMORY_SIZE: 413, never 500). Django's test client, a real
redis-server, the suite's SQLite or PostgreSQL database."""

from __future__ import annotations

import base64
import datetime as dt
import io
import json
import pickle
import re
import time

import pytest
from django.conf import settings
from django.contrib.auth.models import Permission, User
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.exceptions import PermissionDenied
from django.core.management import CommandError, call_command
from django.http import Http404, HttpResponse, JsonResponse, StreamingHttpResponse
from django.test import Client, override_settings
from django.urls import path, reverse
from django.utils import timezone
from django.views import View
from django.views.decorators.csrf import csrf_protect

from rest_framework.decorators import api_view
from rest_framework.exceptions import ValidationError

from celery_steplock.contrib.django.idempotency import REPLAYED_HEADER, idempotent_view
from celery_steplock.contrib.django.models import IdempotencyRecord
from celery_steplock.exceptions import (
    AdmissionDenied,
    IdempotencyError,
    IdempotencyQuotaExceeded,
    ImproperlyConfigured,
)
from django_app.celery import app as celery_app

pytestmark = pytest.mark.django_db(transaction=True)

CALLS: list = []


@pytest.fixture(autouse=True)
def calls(redis_client, celery_app_configured):
    CALLS.clear()
    yield CALLS
    CALLS.clear()


@pytest.fixture
def users():
    return User.objects.create_user("alice"), User.objects.create_user("bob")


def answers(status: int):
    def view(request):
        CALLS.append(status)
        return HttpResponse(f"status {status}", status=status)

    return view


def raises(exc: Exception):
    def view(request):
        CALLS.append(type(exc).__name__)
        raise exc

    return view


class OnlyPut(View):
    def put(self, request):
        return HttpResponse("put")


def refused_views(store: str):
    def guard(view, name):
        return idempotent_view(app=celery_app, namespace=f"tests.bounds.{name}", store=store)(view)

    return [
        path(f"{store}/404", guard(answers(404), "r404")),
        path(f"{store}/400", guard(answers(400), "r400")),
        path(f"{store}/422", guard(answers(422), "r422")),
        path(f"{store}/raise404", guard(raises(Http404("no such thing")), "raise404")),
        path(f"{store}/raise403", guard(raises(PermissionDenied("no")), "raise403")),
        path(
            f"{store}/drf400",  # inside DRF's dispatch: DRF answers its exception with 400
            api_view(["POST"])(guard(raises(ValidationError({"amount": "no"})), "drf400")),
        ),
        path(f"{store}/500", guard(answers(500), "r500")),
        path(f"{store}/405", guard(OnlyPut.as_view(), "r405")),
    ]


@idempotent_view(app=celery_app, namespace="tests.bounds.capped", max_records=3)
def capped_view(request):
    CALLS.append(request.user.username)
    return JsonResponse({"n": len(CALLS)}, status=201)


@idempotent_view(app=celery_app, namespace="tests.bounds.default_cap")
def default_cap_view(request):
    CALLS.append(request.user.username)
    return JsonResponse({"n": len(CALLS)}, status=201)


@idempotent_view(
    app=celery_app, namespace="tests.bounds.short", max_records=1, ttl=0.5, lock_ttl=0.5
)
def short_view(request):
    CALLS.append(1)
    return JsonResponse({"n": len(CALLS)}, status=201)


@idempotent_view(app=celery_app, namespace="tests.bounds.anon", anonymous=True, max_records=2)
def anonymous_capped_view(request):
    CALLS.append(1)
    return JsonResponse({"n": len(CALLS)}, status=201)


@idempotent_view(app=celery_app, namespace="tests.bounds.sometimes", max_records=2)
def sometimes_view(request):
    status = int(request.GET.get("status", "201"))
    CALLS.append(status)
    return JsonResponse({"n": len(CALLS)}, status=status)


urlpatterns = [
    *refused_views("redis"),
    *refused_views("database"),
    path("capped", capped_view),
    path("default-cap", default_cap_view),
    path("short", short_view),
    path("anonymous", anonymous_capped_view),
    path("sometimes", sometimes_view),
    path("plain/500", answers(500)),  # no guard of its own: the middleware's
]


def post(client, url, body, key, **headers):
    if key:
        headers["HTTP_IDEMPOTENCY_KEY"] = key
    return client.post(url, data=json.dumps(body), content_type="application/json", **headers)


def live_records(redis_client, store: str) -> int:
    if store == "database":
        return IdempotencyRecord.objects.count()
    return sum(1 for _ in redis_client.scan_iter("steplock:idem:*"))


# -- 1. a refused request leaves no record; a principal's live records are capped ----------


@override_settings(ROOT_URLCONF=__name__)
@pytest.mark.parametrize("store", ["redis", "database"])
def test_a_refused_request_leaves_no_record(client, users, redis_client, store):
    """A 4xx answer (returned, or an Http404/PermissionDenied Django turns into one; a 405
    of a class-based view) is the request refused: its record is deleted at once. It used to
    stay ``failed`` for the record TTL (24 h), one per fresh key, for any client."""
    client.force_login(users[0])
    client.raise_request_exception = False
    for n, suffix in enumerate(["404", "400", "422", "raise404", "raise403", "drf400", "405"]):
        response = post(client, f"/{store}/{suffix}", {}, f"k-{n}")
        assert response.status_code in (400, 403, 404, 405, 422), suffix
        assert live_records(redis_client, store) == 0, suffix
    # The key runs again (nothing was recorded), as before.
    assert post(client, f"/{store}/404", {}, "k-0").status_code == 404
    # A server error still leaves its failed record for operators (it binds nothing).
    assert post(client, f"/{store}/500", {}, "k-500").status_code == 500
    assert live_records(redis_client, store) == 1
    assert post(client, f"/{store}/500", {}, "k-500").status_code == 500  # runs again


@override_settings(ROOT_URLCONF=__name__)
def test_live_records_per_principal_are_capped(client, users, redis_client):
    client.force_login(users[0])
    for n in range(3):
        assert post(client, "/capped", {}, f"k-{n}").status_code == 201
    refused = post(client, "/capped", {}, "k-3")
    assert refused.status_code == 429 and REPLAYED_HEADER not in refused
    assert int(refused["Retry-After"]) >= 1 and "max_records" in refused.json()["error"]
    assert CALLS == ["alice"] * 3  # the refused request did not run the view
    assert live_records(redis_client, "redis") == 3  # and left no record
    # The keys already counted still replay (and a retry of one is no new record).
    again = post(client, "/capped", {}, "k-1")
    assert again.status_code == 201 and again[REPLAYED_HEADER] == "true"
    # Another principal has its own cap.
    client.force_login(users[1])
    assert post(client, "/capped", {}, "k-3").status_code == 201


@override_settings(
    ROOT_URLCONF=__name__,
    MIDDLEWARE=[
        "django.contrib.sessions.middleware.SessionMiddleware",
        "django.contrib.auth.middleware.AuthenticationMiddleware",
        "celery_steplock.contrib.django.idempotency.IdempotencyMiddleware",
    ],
    STEPLOCK_IDEMPOTENCY_MIDDLEWARE={"app": celery_app, "max_records": 1},
)
def test_the_middleware_takes_max_records(client, users):
    client.force_login(users[0])
    assert post(client, "/plain/500", {}, "m-1").status_code == 500  # a failed record counts
    refused = post(client, "/plain/500", {}, "m-2")
    assert refused.status_code == 429 and CALLS == [500]


@override_settings(ROOT_URLCONF=__name__)
def test_refused_requests_do_not_count(client, users, redis_client):
    client.force_login(users[0])
    for n in range(5):
        assert post(client, "/sometimes?status=404", {}, f"r-{n}").status_code == 404
    assert post(client, "/sometimes", {}, "ok-1").status_code == 201
    assert post(client, "/sometimes", {}, "ok-2").status_code == 201
    assert post(client, "/sometimes", {}, "ok-3").status_code == 429


@override_settings(ROOT_URLCONF=__name__)
def test_the_cap_comes_from_the_setting(client, users):
    client.force_login(users[0])
    try:
        celery_app.conf.steplock_idempotency_max_records = 2
        assert post(client, "/default-cap", {}, "k-1").status_code == 201
        assert post(client, "/default-cap", {}, "k-2").status_code == 201
        assert post(client, "/default-cap", {}, "k-3").status_code == 429
        celery_app.conf.steplock_idempotency_max_records = 0
        client.raise_request_exception = True
        with pytest.raises(ImproperlyConfigured, match="steplock_idempotency_max_records"):
            post(client, "/default-cap", {}, "k-4")
    finally:
        celery_app.conf.steplock_idempotency_max_records = None


def test_a_bad_cap_is_refused_at_decoration():
    for bad in (0, -1, "10", True, 2_000_000):
        with pytest.raises(ImproperlyConfigured, match="max_records"):
            idempotent_view(app=celery_app, max_records=bad)(lambda request: None)


@override_settings(ROOT_URLCONF=__name__)
def test_records_stop_counting_when_they_expire(client, users):
    client.force_login(users[0])
    assert post(client, "/short", {}, "k-1").status_code == 201
    assert post(client, "/short", {}, "k-2").status_code == 429
    deadline = time.monotonic() + 30
    while post(client, "/short", {}, "k-2").status_code == 429:
        assert time.monotonic() < deadline, "the expired record still counts"
        time.sleep(0.1)
    assert CALLS == [1, 1]


@override_settings(ROOT_URLCONF=__name__)
def test_the_anonymous_scope_is_one_principal(client):
    """Every anonymous client of a host shares the anonymous scope, so its cap too."""
    assert post(client, "/anonymous", {}, "a-1").status_code == 201
    assert post(client, "/anonymous", {}, "a-2", REMOTE_ADDR="10.0.0.2").status_code == 201
    assert post(client, "/anonymous", {}, "a-3", REMOTE_ADDR="10.0.0.3").status_code == 429
    assert post(client, "/anonymous", {}, "a-1")[REPLAYED_HEADER] == "true"


def test_the_quota_error_is_typed_and_pickles():
    exc = IdempotencyQuotaExceeded("full", retry_after=3.0, key="k", limit="3 live records")
    assert isinstance(exc, IdempotencyError) and isinstance(exc, AdmissionDenied)
    copy = pickle.loads(pickle.dumps(exc))
    assert (copy.retry_after, copy.key, copy.limit, str(copy)) == (
        3.0,
        "k",
        "3 live records",
        "full",
    )


# -- 2. the database store's expired rows are pruned, in batches ---------------------------


def make_rows(expired: int, live: int) -> None:
    now = timezone.now()
    for n in range(expired + live):
        ends = now - dt.timedelta(hours=1) if n < expired else now + dt.timedelta(hours=1)
        IdempotencyRecord.objects.create(
            key=f"{n:064x}",
            namespace="tests.prune",
            version="1",
            status=("completed", "failed", "locked")[n % 3],
            fingerprint="0" * 64,
            expires_at=ends,
        )


def test_the_prune_command_deletes_expired_rows_in_batches():
    make_rows(expired=5, live=2)
    out = io.StringIO()
    call_command("prune_idempotency_records", "--dry-run", stdout=out)
    assert "Would delete 5 expired idempotency record(s)" in out.getvalue()
    assert IdempotencyRecord.objects.count() == 7  # a dry run deletes nothing
    out = io.StringIO()
    call_command("prune_idempotency_records", "--batch-size", "2", stdout=out)
    assert "Deleted 5 expired idempotency record(s) in 3 batch(es)" in out.getvalue()
    assert IdempotencyRecord.objects.count() == 2
    assert not IdempotencyRecord.objects.filter(expires_at__lte=timezone.now()).exists()
    out = io.StringIO()
    call_command("prune_idempotency_records", stdout=out)
    assert "Deleted 0 expired" in out.getvalue()


def test_the_prune_commands_arguments_are_checked():
    for bad in (["--batch-size", "0"], ["--batch-size", "x"], ["--older-than", "-1"]):
        with pytest.raises(CommandError):
            call_command("prune_idempotency_records", *bad)


def test_an_expired_row_pruned_under_a_request_is_no_error(monkeypatch):
    """A row pruned between a request's INSERT (refused: the key exists) and its SELECT FOR
    UPDATE: the request locks a new row (it used to raise DoesNotExist: 500)."""
    from django.db.models import QuerySet

    from celery_steplock.contrib.django.idempotency import DatabaseRecords

    make_rows(expired=1, live=0)
    key = f"{0:064x}"
    real = QuerySet.select_for_update
    pruned = []

    def prune_first(self, *args, **kwargs):
        if self.model is IdempotencyRecord and not pruned:
            pruned.append(IdempotencyRecord.objects.filter(key=key).delete())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(QuerySet, "select_for_update", prune_first)
    decision = DatabaseRecords().begin(key, "f" * 64, "owner-1", 60.0)
    assert pruned and decision.outcome == "locked"
    assert IdempotencyRecord.objects.get(key=key).owner == "owner-1"


# -- 3. the admin shows recorded responses only to who may change records ------------------

SECRET_BODY = b'{"card_token": "tok_secret_4242"}'


def recorded_row() -> IdempotencyRecord:
    snapshot = {
        "status": 201,
        "headers": [["Content-Type", "application/json"], ["X-Session-Hint", "hint-secret-77"]],
        "body": base64.b64encode(SECRET_BODY).decode(),
    }
    return IdempotencyRecord.objects.create(
        key="a" * 64,
        namespace="django:payments.create",
        version="1",
        status="completed",
        fingerprint="0" * 64,
        serializer="json",
        content_type="application/json",
        content_encoding="utf-8",
        result=json.dumps(snapshot),
        expires_at=timezone.now() + dt.timedelta(hours=1),
    )


def staff(username: str, *codenames: str) -> User:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    for codename in codenames:
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label="celery_steplock", codename=codename)
        )
    return user


def test_a_view_only_staff_user_sees_no_recorded_response(client):
    row = recorded_row()
    url = reverse("admin:celery_steplock_idempotencyrecord_change", args=(row.pk,))
    client.force_login(staff("viewer", "view_idempotencyrecord"))
    page = client.get(url)
    assert page.status_code == 200
    assert b"tok_secret_4242" not in page.content and b"hint-secret-77" not in page.content
    assert base64.b64encode(SECRET_BODY) not in page.content
    assert (
        b"HTTP 201" in page.content and f"body {len(SECRET_BODY)} bytes".encode() in page.content
    )
    assert b"change permission" in page.content
    listing = client.get(reverse("admin:celery_steplock_idempotencyrecord_changelist"))
    assert listing.status_code == 200 and b"tok_secret" not in listing.content
    # Who may change records (the permission that also guards the data) reads the response.
    client.force_login(staff("auditor", "view_idempotencyrecord", "change_idempotencyrecord"))
    page = client.get(url)
    assert page.status_code == 200
    assert base64.b64encode(SECRET_BODY) in page.content and b"hint-secret-77" in page.content


# -- 4. bodies are fingerprinted without breaking the request -------------------------------

CSRF_TOKEN = "A" * 16 + "b" * 16  # an unmasked CSRF secret: 32 letters


@idempotent_view(app=celery_app, namespace="tests.bounds.upload")
def upload_view(request):
    data = request.FILES["doc"].read()
    CALLS.append(request.POST["title"])
    return JsonResponse(
        {"title": request.POST["title"], "size": len(data), "n": len(CALLS)}, status=201
    )


@idempotent_view(app=celery_app, namespace="tests.bounds.raw")
def raw_view(request):
    CALLS.append(len(request.body))
    return JsonResponse({"size": len(request.body)}, status=201)


urlpatterns += [path("upload", csrf_protect(upload_view)), path("raw", raw_view)]


@pytest.fixture
def csrf_client(users):
    client = Client(enforce_csrf_checks=True)
    client.force_login(users[0])
    client.cookies[settings.CSRF_COOKIE_NAME] = CSRF_TOKEN
    return client


def upload(client, key, content: bytes, title="report", name="doc.bin"):
    document = SimpleUploadedFile(name, content, content_type="application/octet-stream")
    return client.post(
        "/upload",
        {"title": title, "doc": document, "csrfmiddlewaretoken": CSRF_TOKEN},
        HTTP_IDEMPOTENCY_KEY=key,
    )


@override_settings(ROOT_URLCONF=__name__, DATA_UPLOAD_MAX_MEMORY_SIZE=10_000)
def test_a_multipart_upload_to_a_csrf_protected_view(csrf_client):
    """CSRF's check reads request.POST first: reading request.body then raised
    RawPostDataException (500). The form's fields and files are fingerprinted instead (the
    file in chunks, larger than DATA_UPLOAD_MAX_MEMORY_SIZE here), and the view reads them."""
    content = bytes(range(256)) * 200  # 51,200 bytes: above the limit, as a file is allowed
    first = upload(csrf_client, "u-1", content)
    assert first.status_code == 201, first.content[:300]
    assert first.json() == {"title": "report", "size": len(content), "n": 1}
    again = upload(csrf_client, "u-1", content)
    assert again.status_code == 201 and again[REPLAYED_HEADER] == "true"
    assert upload(csrf_client, "u-1", content[:-1] + b"x").status_code == 422  # another file
    assert upload(csrf_client, "u-1", content, title="other").status_code == 422
    assert CALLS == ["report"]
    # Without the CSRF token the request is refused before the layer (Django's 403).
    refused = csrf_client.post("/upload", {"title": "t"}, HTTP_IDEMPOTENCY_KEY="u-2")
    assert refused.status_code == 403 and CALLS == ["report"]


@override_settings(ROOT_URLCONF=__name__, DATA_UPLOAD_MAX_MEMORY_SIZE=10_000)
def test_a_body_above_the_upload_limit_gets_413(client, users):
    """Reading request.body above DATA_UPLOAD_MAX_MEMORY_SIZE raised RequestDataTooBig
    inside the layer; now a clear 413 before the view runs, and nothing recorded."""
    client.force_login(users[0])
    client.raise_request_exception = True
    big = post(client, "/raw", {"pad": "x" * 20_000}, "b-1")
    assert big.status_code == 413, big.content[:300]
    assert "DATA_UPLOAD_MAX_MEMORY_SIZE" in big.json()["error"] and CALLS == []
    small = post(client, "/raw", {"pad": "x" * 100}, "b-2")
    assert small.status_code == 201 and small.json()["size"] > 100
    assert post(client, "/raw", {"pad": "x" * 100}, "b-2")[REPLAYED_HEADER] == "true"


# -- 5. review findings: the host's port, completion, streaming, async views, refusals -------


@idempotent_view(app=celery_app, namespace="tests.bounds.slow", max_records=1, ttl=4, lock_ttl=0.5)
def slow_view(request):
    CALLS.append(1)
    time.sleep(2)  # four lock TTLs: the heartbeat keeps the record locked meanwhile
    return JsonResponse({"n": len(CALLS)}, status=201)


@idempotent_view(app=celery_app, namespace="tests.bounds.streams", max_records=1)
def streaming_view(request):
    CALLS.append(1)
    return StreamingHttpResponse(iter([b"a", b"b"]), status=201)


class UpstreamRefused(Exception):
    """An SDK's error for its upstream's 429: Django answers it with 500."""

    status_code = 429


@idempotent_view(app=celery_app, namespace="tests.bounds.upstream")
def upstream_view(request):
    CALLS.append(1)
    raise UpstreamRefused("the payment provider is rate limiting")


urlpatterns += [
    path("slow", slow_view),
    path("streams", streaming_view),
    path("upstream", upstream_view),
]


@override_settings(ROOT_URLCONF=__name__, ALLOWED_HOSTS=["a.example", "[::1]", "[2001:db8::1]"])
def test_the_port_and_a_trailing_dot_name_no_other_host(client):
    """Django accepts any digits as a port (``:1``, ``:01``): each port used to be another
    host, so a fresh cap and fresh keys (a retry through another port ran the view again)."""
    assert post(client, "/anonymous", {}, "a-1", HTTP_HOST="a.example").status_code == 201
    for host in ("a.example:1", "a.example:01", "A.EXAMPLE.", "a.example.:8080"):
        again = post(client, "/anonymous", {}, "a-1", HTTP_HOST=host)
        assert again.status_code == 201 and again[REPLAYED_HEADER] == "true", host
    assert post(client, "/anonymous", {}, "a-2", HTTP_HOST="a.example:2").status_code == 201
    assert post(client, "/anonymous", {}, "a-3", HTTP_HOST="a.example:3").status_code == 429
    assert CALLS == [1, 1]
    # IPv6 literals keep their colons: [::1] and [2001:db8::1] are two hosts.
    assert post(client, "/anonymous", {}, "v-1", HTTP_HOST="[::1]:8000").status_code == 201
    assert post(client, "/anonymous", {}, "v-1", HTTP_HOST="[::1]")[REPLAYED_HEADER] == "true"
    other = post(client, "/anonymous", {}, "v-1", HTTP_HOST="[2001:db8::1]:8000")
    assert other.status_code == 201 and REPLAYED_HEADER not in other


@override_settings(ROOT_URLCONF=__name__)
def test_a_record_the_heartbeat_kept_counts_until_it_ends(client, users, redis_client):
    """A view running longer than its lock TTL (renewed by the heartbeat) completes late:
    its quota entry used to end ``lock_ttl + ttl`` after the first request, before the
    record; then a new key was admitted beyond max_records and the retry of the live key
    got 429 instead of its replay. The entry now counts ``ttl`` from completion."""
    client.force_login(users[0])
    started = time.time()
    assert post(client, "/slow", {}, "k-1").status_code == 201
    ends = (
        min(int(redis_client.pttl(key)) for key in redis_client.scan_iter("steplock:idem:*"))
        / 1000.0
        + time.time()
    )
    entry = redis_client.zrange(
        next(redis_client.scan_iter("steplock:idemq:*")), 0, -1, withscores=True
    )
    # The quota entry counts as long as the record lives (not lock_ttl + ttl from the start).
    assert len(entry) == 1 and entry[0][1] / 1000.0 >= ends - 1.0
    # Past the old end (first request + lock_ttl + ttl), while the record still lives:
    while time.time() < started + 0.5 + 4 + 0.3:
        time.sleep(0.1)
    assert time.time() < ends - 0.2, "the machine was too slow to see the record live"
    refused = post(client, "/slow", {}, "k-2")
    assert refused.status_code == 429, refused.content[:300]
    replay = post(client, "/slow", {}, "k-1")
    assert replay.status_code == 201 and replay[REPLAYED_HEADER] == "true"
    assert CALLS == [1]


@override_settings(ROOT_URLCONF=__name__)
def test_a_key_with_a_record_is_never_refused_by_the_cap(client, users, redis_client):
    """The cap only applies to a new key: a retry of a key that has a live record (replay,
    409, 422) gets its answer even when the principal's quota entries are gone."""
    client.force_login(users[0])
    assert post(client, "/capped", {}, "k-1").status_code == 201
    for quota in redis_client.scan_iter("steplock:idemq:*"):  # as if the entry had ended
        redis_client.zadd(quota, {"other-1": 2**50, "other-2": 2**50, "other-3": 2**50})
        redis_client.zremrangebyscore(quota, "-inf", 2**49)
    replay = post(client, "/capped", {}, "k-1")
    assert replay.status_code == 201 and replay[REPLAYED_HEADER] == "true", replay.content
    assert post(client, "/capped", {"other": 1}, "k-1").status_code == 422
    assert post(client, "/capped", {}, "k-2").status_code == 429
    assert CALLS == ["alice"]


@override_settings(ROOT_URLCONF=__name__)
def test_a_streaming_response_gives_its_slot_back(client, users, redis_client):
    """A streaming response is not recorded: its record is released, and now its place in
    the cap too (it used to hold the slot for lock_ttl + ttl)."""
    client.force_login(users[0])
    for n in range(3):
        response = post(client, "/streams", {}, f"s-{n}")
        assert response.status_code == 201 and b"".join(response.streaming_content) == b"ab"
    assert CALLS == [1, 1, 1] and live_records(redis_client, "redis") == 0


@override_settings(ROOT_URLCONF=__name__)
def test_an_exception_that_only_carries_a_status_code_is_a_server_error(
    client, users, redis_client
):
    """Django answers an exception of its own refusals (or DRF's APIException) with a 4xx;
    any other exception is a 500 whatever ``status_code`` it carries (an SDK's error for its
    upstream's 429). Its record used to be deleted as refused; it is now kept failed."""
    client.force_login(users[0])
    client.raise_request_exception = False
    assert post(client, "/upstream", {}, "u-1").status_code == 500
    assert live_records(redis_client, "redis") == 1
    record = next(redis_client.scan_iter("steplock:idem:*"))
    assert redis_client.hget(record, "status") in (b"failed", "failed")


async def async_function_view(request):
    return HttpResponse("async")


class AsyncView(View):
    async def post(self, request):
        return HttpResponse("async")


def test_an_async_view_is_guarded_as_a_coroutine_function():
    """An ``async def`` view was once called synchronously (its coroutine never awaited: a
    500 and a failed record counted against the cap), then refused at decoration; since
    issue 27 the decorator returns a coroutine function that awaits it
    (tests/contrib/test_async_views.py runs them under a real ASGI server)."""
    from asgiref.sync import iscoroutinefunction

    for view in (async_function_view, AsyncView.as_view(), AsyncView.post):
        assert iscoroutinefunction(idempotent_view(app=celery_app)(view))


@override_settings(
    ROOT_URLCONF=__name__,
    MIDDLEWARE=[
        "django.contrib.sessions.middleware.SessionMiddleware",
        "django.contrib.auth.middleware.AuthenticationMiddleware",
        "celery_steplock.contrib.django.idempotency.IdempotencyMiddleware",
    ],
    STEPLOCK_IDEMPOTENCY_MIDDLEWARE={"app": celery_app},
)
def test_the_middleware_guards_an_async_view(client, users):
    """The middleware is synchronous: Django adapts an async view under it, so it guards
    async views (what the decorator's refusal points to)."""
    client.force_login(users[0])
    first = post(client, "/async", {}, "a-1")
    assert first.status_code == 200 and first.content == b"async"
    assert post(client, "/async", {}, "a-1")[REPLAYED_HEADER] == "true"


urlpatterns += [path("async", async_function_view)]


@override_settings(ROOT_URLCONF=__name__)
def test_the_cap_is_shared_by_every_guarded_view(client, users):
    """The cap counts a principal's live records on a host across every guarded view (one
    count); each view checks its own ``max_records`` against it (documented)."""
    client.force_login(users[0])
    for n in range(3):
        assert post(client, "/default-cap", {}, f"d-{n}").status_code == 201
    assert post(client, "/capped", {}, "c-1").status_code == 429


# -- the middleware's setting and the decorator's arguments are checked once, up front --------

MIDDLEWARE_STACK = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "celery_steplock.contrib.django.idempotency.IdempotencyMiddleware",
]

BAD_MIDDLEWARE_SETTINGS = [
    ({"max_record": 5}, r'\["max_record"\]: unknown option; did you mean "max_records"\?'),
    ({"max_records": 0}, r'\["max_records"\]'),
    ({"ttl": -1}, r'\["ttl"\]'),
    ({"ttl": "60"}, r'\["ttl"\]'),
    ({"lock_ttl": 0}, r'\["lock_ttl"\]'),
    ({"version": [1]}, r'\["version"\]'),
    ({"exempt_paths": ["("]}, r'\["exempt_paths"\]'),
    ({"exempt_paths": "^/x"}, r'\["exempt_paths"\]'),
    (["bad"], r"STEPLOCK_IDEMPOTENCY_MIDDLEWARE must be a dict"),
    ({"required": "yes"}, r'\["required"\]'),
    ({"anonymous": 1}, r'\["anonymous"\]'),
    ({"methods": "POST"}, r'\["methods"\]'),
    ({"methods": ["POST", 1]}, r'\["methods"\]'),
    ({"header": ""}, r'\["header"\]'),
    ({"header": "Idempotency Key"}, r'\["header"\]'),
    ({"namespace": ""}, r'\["namespace"\]'),
    ({"scope": "myapp.scope"}, r'\["scope"\]'),
    ({"store": "memcached"}, r'\["store"\]'),
    ({"on_store_error": "open"}, r'\["on_store_error"\]'),
    ({"serializer": "nope"}, r'\["serializer"\]'),
    ({"max_result_bytes": 10}, r'\["max_result_bytes"\]'),
]


@pytest.mark.parametrize("config, message", BAD_MIDDLEWARE_SETTINGS)
def test_a_bad_middleware_setting_is_refused_at_load_naming_the_option(config, message):
    from celery_steplock.contrib.django.idempotency import IdempotencyMiddleware

    with override_settings(STEPLOCK_IDEMPOTENCY_MIDDLEWARE=config):
        with pytest.raises(ImproperlyConfigured, match=message) as caught:
            IdempotencyMiddleware(lambda request: HttpResponse())
    assert "STEPLOCK_IDEMPOTENCY_MIDDLEWARE" in str(caught.value)
    assert caught.value.setting == "STEPLOCK_IDEMPOTENCY_MIDDLEWARE"


@pytest.mark.parametrize("config, message", BAD_MIDDLEWARE_SETTINGS)
def test_a_bad_middleware_setting_is_check_e011(config, message):
    from celery_steplock.contrib.django.checks import check_idempotency_settings

    with override_settings(STEPLOCK_IDEMPOTENCY_MIDDLEWARE=config):
        [error] = check_idempotency_settings()
    assert error.id == "celery_steplock.E011" and error.obj == "STEPLOCK_IDEMPOTENCY_MIDDLEWARE"
    assert re.search(message, error.msg)


def test_a_good_middleware_setting_passes_the_check():
    from celery_steplock.contrib.django.checks import check_idempotency_settings

    good = {
        "app": celery_app,
        "ttl": 60,
        "lock_ttl": 30.5,
        "version": 2,
        "methods": ["post", "PUT"],
        "header": "X-Request-Id",
        "required": True,
        "anonymous": False,
        "max_records": 10,
        "exempt_paths": [r"^/login/"],
        "namespace": "api",
        "store": "database",
        "on_store_error": "fail_open",
    }
    for config in (good, {}, None):
        with override_settings(STEPLOCK_IDEMPOTENCY_MIDDLEWARE=config):
            assert check_idempotency_settings() == []


@override_settings(ROOT_URLCONF=__name__, MIDDLEWARE=MIDDLEWARE_STACK)
def test_a_misspelled_middleware_option_fails_before_any_request(client, users):
    client.force_login(users[0])
    client.raise_request_exception = True
    with override_settings(STEPLOCK_IDEMPOTENCY_MIDDLEWARE={"app": celery_app, "max_record": 5}):
        with pytest.raises(ImproperlyConfigured, match="max_record"):
            post(client, "/capped", {}, None)  # no key: it used to pass, and keyed ones 500
    assert CALLS == []


@pytest.mark.parametrize(
    "arguments, name",
    [
        ({"ttl": -1}, "ttl"),
        ({"ttl": "60"}, "ttl"),
        ({"lock_ttl": 10**12}, "lock_ttl"),
        ({"version": [1]}, "version"),
        ({"required": "yes"}, "required"),
        ({"methods": "POST"}, "methods"),
        ({"header": "a b"}, "header"),
        ({"store": "memcached"}, "store"),
        ({"on_store_error": "open"}, "on_store_error"),
        ({"max_result_bytes": 1}, "max_result_bytes"),
        ({"ttll": 5}, "ttll"),
    ],
)
def test_bad_decorator_arguments_are_refused_at_decoration(arguments, name):
    with pytest.raises(ImproperlyConfigured, match=name):
        idempotent_view(app=celery_app, **arguments)(lambda request: None)


def test_an_unknown_decorator_argument_is_a_type_error_with_a_suggestion():
    with pytest.raises(TypeError, match=r"ttll.*did you mean 'ttl'"):
        idempotent_view(app=celery_app, ttll=5)(lambda request: None)


# -- an empty key is a bad key, not no key ----------------------------------------------------


@override_settings(ROOT_URLCONF=__name__)
@pytest.mark.parametrize("value", ["", " ", "\t "])
def test_an_empty_key_gets_400(client, users, value):
    client.force_login(users[0])
    response = client.post(
        "/capped", data="{}", content_type="application/json", HTTP_IDEMPOTENCY_KEY=value
    )
    assert response.status_code == 400
    assert "must be 1 to 255 printable characters" in response.json()["error"]
    assert CALLS == []


# -- prune_idempotency_records --database ------------------------------------------------------


def test_the_prune_command_names_an_unknown_database():
    with pytest.raises(CommandError, match=r"--database 'nope'.*default"):
        call_command("prune_idempotency_records", "--database", "nope")
