"""The HTTP ``Idempotency-Key`` layer at its edges (issue 24): a replay only ever reaches the
principal (and host) that recorded it, a record completes only after the request's COMMIT,
TemplateResponse and Django REST framework responses are recorded once rendered, the
middleware's order is checked and its paths can be exempted. Django's test client, a real
redis-server, the suite's SQLite or PostgreSQL database."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import Group, User
from django.db import connections, transaction
from django.http import HttpResponse, JsonResponse
from django.template import engines
from django.template.response import TemplateResponse
from django.test import override_settings
from django.urls import path
from rest_framework.authentication import BaseAuthentication
from rest_framework.decorators import api_view, authentication_classes, permission_classes
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.permissions import IsAuthenticated
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.views import APIView
from rest_framework.viewsets import ViewSet

from celery_steplock.contrib.django.checks import check_idempotency_middleware
from celery_steplock.contrib.django.idempotency import (
    REPLAYED_HEADER,
    idempotency_exempt,
    idempotent_view,
)
from celery_steplock.exceptions import ImproperlyConfigured
from django_app.celery import app as celery_app
from tests.contrib.test_admin import failing_commit

pytestmark = pytest.mark.django_db(transaction=True)

CALLS: list = []
MIDDLEWARE = "celery_steplock.contrib.django.idempotency.IdempotencyMiddleware"
AUTH_MIDDLEWARE = "django.contrib.auth.middleware.AuthenticationMiddleware"
SESSION_MIDDLEWARE = "django.contrib.sessions.middleware.SessionMiddleware"


@pytest.fixture(autouse=True)
def calls(redis_client, celery_app_configured):
    CALLS.clear()
    yield CALLS
    CALLS.clear()


def api_user(request):
    """The user an ``X-Api-Key`` header names (the view's own authentication), or None."""
    name = request.headers.get("X-Api-Key")
    return User.objects.filter(username=name).first() if name else None


def principal_of(request):
    user = api_user(request)
    return None if user is None else f"key-user:{user.pk}"


def charge(request, n_from="n"):
    CALLS.append(request.headers.get("X-Api-Key"))
    return {"charged": json.loads(request.body)["amount"], n_from: len(CALLS)}


# -- views ----------------------------------------------------------------------------------


@idempotent_view(app=celery_app, namespace="tests.http.apikey")
def apikey_view(request):
    """An API key checked in the view: the decorator sees an anonymous request."""
    if api_user(request) is None:
        return JsonResponse({"error": "no key"}, status=401)
    return JsonResponse(charge(request), status=201)


@idempotent_view(app=celery_app, namespace="tests.http.scoped", scope=principal_of)
def scoped_view(request):
    if api_user(request) is None:
        return JsonResponse({"error": "no key"}, status=401)
    return JsonResponse(charge(request), status=201)


def broken_scope(request):
    raise RuntimeError("the scope's lookup failed")


@idempotent_view(app=celery_app, namespace="tests.http.broken", scope=broken_scope)
def broken_scope_view(request):
    CALLS.append(1)
    return HttpResponse("ran", status=201)


@idempotent_view(app=celery_app, namespace="tests.http.typo", scope=lambda request: 42)
def bad_scope_view(request):
    CALLS.append(1)
    return HttpResponse("ran", status=201)


class HeaderToken(BaseAuthentication):
    """DRF authentication by an ``X-Api-Key`` header (a token, as TokenAuthentication)."""

    def authenticate(self, request):
        name = request.headers.get("X-Api-Key")
        if not name:
            return None
        user = User.objects.filter(username=name).first()
        if user is None:
            raise AuthenticationFailed("unknown key")
        return (user, name)

    def authenticate_header(self, request):
        return "X-Api-Key"


class Payments(APIView):
    authentication_classes = [HeaderToken]
    permission_classes = [IsAuthenticated]
    renderer_classes = [JSONRenderer]

    @idempotent_view(app=celery_app, namespace="tests.http.drf")
    def post(self, request):
        CALLS.append(request.user.username)
        return Response({"charged": request.data["amount"], "n": len(CALLS)}, status=201)


class PaymentViewSet(ViewSet):
    authentication_classes = [HeaderToken]
    permission_classes = [IsAuthenticated]
    renderer_classes = [JSONRenderer]

    @idempotent_view(app=celery_app, namespace="tests.http.viewset")
    def create(self, request):
        CALLS.append(request.user.username)
        return Response({"n": len(CALLS)}, status=201)


@api_view(["POST"])
@authentication_classes([HeaderToken])
@permission_classes([IsAuthenticated])
@idempotent_view(app=celery_app, namespace="tests.http.drf_function")
def drf_function(request):
    CALLS.append(request.user.username)
    return Response({"charged": request.data["amount"], "n": len(CALLS)}, status=201)


@idempotent_view(app=celery_app, namespace="tests.http.anon", anonymous=True)
def anonymous_view(request):
    CALLS.append(1)
    return HttpResponse(f"n={len(CALLS)}", status=201)


def writes_then_answers(request):
    """Writes a row (the request's transaction under ATOMIC_REQUESTS) and answers 201."""
    CALLS.append(1)
    Group.objects.create(name=f"g{len(CALLS)}")
    if request.GET.get("rollback"):
        transaction.set_rollback(True)
    return JsonResponse({"n": len(CALLS)}, status=201)


commit_redis = idempotent_view(app=celery_app, namespace="tests.http.commit.redis")(
    writes_then_answers
)
commit_database = idempotent_view(
    app=celery_app, namespace="tests.http.commit.database", store="database"
)(writes_then_answers)

TEMPLATE = engines["django"].from_string("paid {{ amount }} n={{ n }}")
RENDER_FAILS = []


class Exploding:
    def __str__(self):
        if RENDER_FAILS:
            RENDER_FAILS.pop()
            raise RuntimeError("the template could not render")
        return "ok"


@idempotent_view(app=celery_app, namespace="tests.http.template")
def template_view(request):
    CALLS.append(1)
    return TemplateResponse(
        request, TEMPLATE, {"amount": Exploding(), "n": len(CALLS)}, status=201
    )


@idempotent_view(app=celery_app, namespace="tests.http.strict", required=True)
def strict_view(request):
    CALLS.append(1)
    return HttpResponse("ok", status=201)


def plain_view(request):
    CALLS.append(request.path)
    return HttpResponse(f"n={len(CALLS)}", status=201)


@idempotency_exempt
def exempt_view(request):
    CALLS.append(request.path)
    return HttpResponse(f"n={len(CALLS)}")


urlpatterns = [
    path("apikey", apikey_view),
    path("scoped", scoped_view),
    path("broken-scope", broken_scope_view),
    path("bad-scope", bad_scope_view),
    path("drf", Payments.as_view()),
    path("viewset", PaymentViewSet.as_view({"post": "create"})),
    path("drf-function", drf_function),
    path("anonymous", anonymous_view),
    path("commit/redis", commit_redis),
    path("commit/database", commit_database),
    path("template", template_view),
    path("strict", strict_view),
    path("mw/plain", plain_view),
    path("mw/exempt", exempt_view),
    path("admin-like/login/", plain_view),
]


def post(client, url, body, key, **headers):
    if key:
        headers["HTTP_IDEMPOTENCY_KEY"] = key
    return client.post(url, data=json.dumps(body), content_type="application/json", **headers)


@pytest.fixture
def users():
    return User.objects.create_user("alice"), User.objects.create_user("bob")


# -- 1. a replay only ever reaches the principal that recorded it ---------------------------


@override_settings(ROOT_URLCONF=__name__)
def test_header_authenticated_clients_never_share_a_scope(client, users):
    """The API key is checked in the view: the decorator sees no principal, so it refuses
    the key instead of guarding every client in one scope (bob used to get alice's 201)."""
    alice = post(client, "/apikey", {"amount": 5}, "k-1", HTTP_X_API_KEY="alice")
    bob = post(client, "/apikey", {"amount": 5}, "k-1", HTTP_X_API_KEY="bob")
    nobody = post(client, "/apikey", {"amount": 5}, "k-1")
    for response in (alice, bob, nobody):
        assert response.status_code == 403 and REPLAYED_HEADER not in response
        assert "authenticated" in response.json()["error"]
    assert CALLS == []  # refused before the view ran: nothing charged unguarded
    # Without a key the view runs unguarded, as before.
    assert post(client, "/apikey", {"amount": 5}, None, HTTP_X_API_KEY="alice").status_code == 201


@override_settings(ROOT_URLCONF=__name__)
def test_a_scope_function_separates_principals_and_fails_closed(client, users):
    first = post(client, "/scoped", {"amount": 5}, "k-1", HTTP_X_API_KEY="alice")
    assert first.status_code == 201 and first.json()["n"] == 1
    again = post(client, "/scoped", {"amount": 5}, "k-1", HTTP_X_API_KEY="alice")
    assert again[REPLAYED_HEADER] == "true" and again.json() == first.json()
    bob = post(client, "/scoped", {"amount": 5}, "k-1", HTTP_X_API_KEY="bob")
    assert bob.status_code == 201 and bob.json()["n"] == 2 and REPLAYED_HEADER not in bob
    nobody = post(client, "/scoped", {"amount": 5}, "k-1")  # scope None: no principal
    assert nobody.status_code == 403 and REPLAYED_HEADER not in nobody
    assert CALLS == ["alice", "bob"]
    client.raise_request_exception = True
    with pytest.raises(RuntimeError, match="lookup failed"):
        post(client, "/broken-scope", {"amount": 5}, "k-1")
    with pytest.raises(ImproperlyConfigured, match="scope"):
        post(client, "/bad-scope", {"amount": 5}, "k-1")
    assert CALLS == ["alice", "bob"]  # neither view ran


@override_settings(ROOT_URLCONF=__name__)
@pytest.mark.parametrize("url", ["/drf", "/drf-function"])
def test_drf_views_are_guarded_after_drfs_authentication(client, users, url):
    first = post(client, url, {"amount": 5}, "k-1", HTTP_X_API_KEY="alice")
    assert first.status_code == 201 and first.json() == {"charged": 5, "n": 1}
    again = post(client, url, {"amount": 5}, "k-1", HTTP_X_API_KEY="alice")
    assert again.status_code == 201 and again.json() == {"charged": 5, "n": 1}
    assert again[REPLAYED_HEADER] == "true"
    bob = post(client, url, {"amount": 5}, "k-1", HTTP_X_API_KEY="bob")
    assert bob.json() == {"charged": 5, "n": 2} and REPLAYED_HEADER not in bob
    nobody = post(client, url, {"amount": 5}, "k-1")
    assert nobody.status_code == 401 and REPLAYED_HEADER not in nobody  # DRF's own answer
    forged = post(client, url, {"amount": 5}, "k-1", HTTP_X_API_KEY="mallory")
    assert forged.status_code == 401 and REPLAYED_HEADER not in forged
    assert CALLS == ["alice", "bob"]
    assert post(client, url, {"amount": 6}, "k-1", HTTP_X_API_KEY="alice").status_code == 422


@override_settings(ROOT_URLCONF=__name__, ALLOWED_HOSTS=["a.example", "b.example"])
def test_the_host_is_part_of_the_scope(client, users):
    client.force_login(users[0])
    one = post(client, "/anonymous", {}, "k-1", HTTP_HOST="a.example")
    other = post(client, "/anonymous", {}, "k-1", HTTP_HOST="b.example")
    assert one.content == b"n=1" and other.content == b"n=2" and REPLAYED_HEADER not in other
    assert post(client, "/anonymous", {}, "k-1", HTTP_HOST="a.example")[REPLAYED_HEADER]


@override_settings(ROOT_URLCONF=__name__)
def test_an_anonymous_scope_is_an_explicit_opt_in(client):
    assert post(client, "/anonymous", {}, "k-1").content == b"n=1"
    assert post(client, "/anonymous", {}, "k-1")[REPLAYED_HEADER] == "true"
    assert post(client, "/strict", {}, "k-1").status_code == 403  # no opt-in: refused
    assert CALLS == [1]


@override_settings(
    ROOT_URLCONF=__name__,
    MIDDLEWARE=[SESSION_MIDDLEWARE, AUTH_MIDDLEWARE, MIDDLEWARE],
    STEPLOCK_IDEMPOTENCY_MIDDLEWARE={"app": celery_app},
)
def test_the_middleware_refuses_a_key_without_a_principal(client, users):
    assert post(client, "/mw/plain", {}, "k-1").status_code == 403
    assert CALLS == []
    # A DRF view guarded on its handler is left to that guard, which runs after DRF's
    # authentication: the client its header authenticates is the principal.
    for url in ("/drf", "/viewset"):  # a handler method, a ViewSet's action
        assert post(client, url, {"amount": 5}, "k-1", HTTP_X_API_KEY="alice").status_code == 201
        again = post(client, url, {"amount": 5}, "k-1", HTTP_X_API_KEY="alice")
        assert again[REPLAYED_HEADER] == "true"
    assert CALLS == ["alice", "alice"]
    CALLS.clear()
    client.force_login(users[0])
    assert post(client, "/mw/plain", {}, "k-1").content == b"n=1"
    assert post(client, "/mw/plain", {}, "k-1")[REPLAYED_HEADER] == "true"


# -- 2. a record completes only once the request's transaction committed --------------------


@pytest.fixture
def atomic_requests(monkeypatch, users, client):
    monkeypatch.setitem(connections["default"].settings_dict, "ATOMIC_REQUESTS", True)
    client.force_login(users[0])
    client.raise_request_exception = False
    return client


@override_settings(ROOT_URLCONF=__name__)
@pytest.mark.parametrize("store", ["redis", "database"])
def test_a_failed_commit_is_never_replayed(atomic_requests, store):
    client, url = atomic_requests, f"/commit/{store}"
    with failing_commit(Group._meta.db_table):
        assert post(client, url, {}, "c-1").status_code == 500  # the COMMIT failed
    assert not Group.objects.exists()
    retry = post(client, url, {}, "c-1")
    assert retry.status_code == 201 and REPLAYED_HEADER not in retry  # ran again, cleanly
    assert retry.json() == {"n": 2} and Group.objects.count() == 1
    replay = post(client, url, {}, "c-1")
    assert replay[REPLAYED_HEADER] == "true" and replay.json() == {"n": 2}
    assert len(CALLS) == 2


@override_settings(ROOT_URLCONF=__name__)
@pytest.mark.parametrize("store", ["redis", "database"])
def test_a_rolled_back_response_is_never_replayed(atomic_requests, store):
    client, url = atomic_requests, f"/commit/{store}"
    assert post(client, f"{url}?rollback=1", {}, "c-2").status_code == 201
    assert not Group.objects.exists()
    retry = post(client, f"{url}?rollback=1", {}, "c-2")
    assert retry.status_code == 201 and REPLAYED_HEADER not in retry and len(CALLS) == 2


@override_settings(ROOT_URLCONF=__name__)
@pytest.mark.parametrize("store", ["redis", "database"])
def test_a_committed_response_replays(atomic_requests, store):
    client, url = atomic_requests, f"/commit/{store}"
    assert post(client, url, {}, "c-3").json() == {"n": 1}
    assert post(client, url, {}, "c-3")[REPLAYED_HEADER] == "true"
    assert len(CALLS) == 1 and Group.objects.count() == 1


# -- 3. rendered responses are recorded once rendered; a recording error fails the record ---


@override_settings(ROOT_URLCONF=__name__)
def test_a_template_response_is_recorded_after_rendering(client, users):
    client.force_login(users[0])
    first = post(client, "/template", {}, "t-1")
    assert first.status_code == 201 and first.content == b"paid ok n=1"
    again = post(client, "/template", {}, "t-1")
    assert again.content == b"paid ok n=1" and again[REPLAYED_HEADER] == "true"
    assert CALLS == [1]


@override_settings(ROOT_URLCONF=__name__)
def test_an_error_while_rendering_fails_the_record(client, users):
    """The view ran, its rendering raised: the retry runs the view at once (it used to get
    409 for the lock TTL, then run the view a second time)."""
    client.force_login(users[0])
    client.raise_request_exception = False
    RENDER_FAILS.append(1)
    assert post(client, "/template", {}, "t-2").status_code == 500
    retry = post(client, "/template", {}, "t-2")
    assert retry.status_code == 201 and retry.content == b"paid ok n=2"
    assert post(client, "/template", {}, "t-2")[REPLAYED_HEADER] == "true"


# -- 4. the middleware's order and its exemptions -------------------------------------------


def test_a_check_catches_the_middleware_before_authentication():
    with override_settings(MIDDLEWARE=[SESSION_MIDDLEWARE, MIDDLEWARE, AUTH_MIDDLEWARE]):
        [error] = check_idempotency_middleware()
    assert error.id == "celery_steplock.E010" and "AuthenticationMiddleware" in error.msg
    with override_settings(MIDDLEWARE=[MIDDLEWARE]):
        [error] = check_idempotency_middleware()
    assert error.id == "celery_steplock.E010"
    with override_settings(MIDDLEWARE=[SESSION_MIDDLEWARE, AUTH_MIDDLEWARE, MIDDLEWARE]):
        assert check_idempotency_middleware() == []
    with override_settings(MIDDLEWARE=[SESSION_MIDDLEWARE, AUTH_MIDDLEWARE]):
        assert check_idempotency_middleware() == []


@override_settings(
    ROOT_URLCONF=__name__,
    MIDDLEWARE=[SESSION_MIDDLEWARE, AUTH_MIDDLEWARE, MIDDLEWARE],
    STEPLOCK_IDEMPOTENCY_MIDDLEWARE={
        "app": celery_app,
        "required": True,
        "exempt_paths": [r"^/admin-like/"],
    },
)
def test_required_keys_spare_exempt_views_and_paths(client, users):
    client.force_login(users[0])
    assert client.post("/mw/plain").status_code == 400  # required: no key, refused
    assert client.post("/mw/exempt").content == b"n=1"  # @idempotency_exempt
    assert client.post("/admin-like/login/").content == b"n=2"  # exempt_paths
    assert post(client, "/mw/exempt", {}, "k-1").content == b"n=3"  # never guarded
    assert post(client, "/mw/exempt", {}, "k-1").content == b"n=4"


@override_settings(
    ROOT_URLCONF=__name__,
    MIDDLEWARE=[SESSION_MIDDLEWARE, AUTH_MIDDLEWARE, MIDDLEWARE],
    STEPLOCK_IDEMPOTENCY_MIDDLEWARE={"app": celery_app, "required": True},
)
def test_a_view_with_its_own_guard_is_guarded_once_with_its_options(client, users, redis_client):
    client.force_login(users[0])
    # The middleware's "required" is not the view's: a request without a key runs.
    assert client.post("/commit/redis").status_code == 201
    first = post(client, "/commit/redis", {}, "k-own")
    again = post(client, "/commit/redis", {}, "k-own")
    assert first.content == again.content == b'{"n": 2}'
    assert again[REPLAYED_HEADER] == "true"
    # One record: the view's (the middleware took none of its own).
    assert len(list(redis_client.scan_iter("steplock:idem:*"))) == 1


def test_the_middlewares_setting_is_not_reported_as_unknown(app):
    """W005 said STEPLOCK_IDEMPOTENCY_MIDDLEWARE is never read, hinting at a setting that
    would drop the configuration."""
    from celery_steplock.contrib.django.checks import check_unknown_names

    with override_settings(STEPLOCK_IDEMPOTENCY_MIDDLEWARE={"required": True}):
        found = check_unknown_names(app)
    assert not [m for m in found if "IDEMPOTENCY_MIDDLEWARE" in m.msg]
