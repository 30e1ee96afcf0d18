"""Settings of the ASGI app of tests/contrib/test_async_views.py (tests.support.asgi_app):
the example project's, with the app's own URLs and ``IdempotencyMiddleware`` in front of
the paths under ``/mw/`` (the decorated views' paths are exempt). No authentication
middleware: a client names itself with an ``X-Client`` header (no database query)."""

from django_app.settings import *  # noqa: F403 - the example project's settings, amended

ROOT_URLCONF = "tests.support.asgi_app"
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
MIDDLEWARE = [
    "django.middleware.common.CommonMiddleware",
    "celery_steplock.contrib.django.idempotency.IdempotencyMiddleware",
]


def client_scope(request):
    """The principal an ``X-Client`` header names (None without one: the key is refused)."""
    return request.headers.get("X-Client") or None


STEPLOCK_IDEMPOTENCY_MIDDLEWARE = {
    "namespace": "tests.asgi.middleware",
    "scope": client_scope,
    "exempt_paths": [r"^/(?!mw/)"],
}
