"""``/metrics`` from the Django web process: the metrics of :mod:`celery_steplock.contrib.prometheus`.

The web process counts what it does itself (idempotent views' decisions, the admin's
operator actions, outbox dispatches on commit) once :func:`~celery_steplock.contrib.prometheus.install`
ran in it: in a Celery-Django project it does, since Django imports the project's Celery app
(``proj/__init__.py``) where ``install()`` is called. The view serves
:func:`~celery_steplock.contrib.prometheus.scrape_registry`: in multiprocess mode (the
default of ``install()``) the sum over every process of the host's directory, the web
process's workers and the host's Celery workers alike; encoded by ``prometheus_client``
(the text format, or OpenMetrics when the scraper asks for it).

In ``urls.py``::

    from celery_steplock.contrib.django.metrics import metrics_view

    urlpatterns = [
        path("metrics", metrics_view, {"bearer_token": os.environ.get("METRICS_TOKEN")}),
    ]

Access: metrics name tasks, breakers, rate limits and views, so the view is not public.
A request is served when its user is an active staff member (a browser session), or when it
carries ``Authorization: Bearer <bearer_token>`` (the option of ``path()``, compared in
constant time; Prometheus sends it with ``authorization: {credentials: ...}`` in its scrape
config); otherwise 401 (no credentials; ``WWW-Authenticate: Bearer`` when a token is
configured) or 403. Without a ``bearer_token`` (None or ``""``) only staff are served.
GET and HEAD only (405 otherwise); never guarded by the idempotency middleware.

Scrape either this view or a worker's ``port`` on a host, not both: both serve the same
directory, and Prometheus would sum the host twice.
"""

from __future__ import annotations

import hmac

from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_safe
from prometheus_client.exposition import choose_encoder

from .. import prometheus
from .idempotency import idempotency_exempt

__all__ = ["metrics_view", "allowed"]


def allowed(request: HttpRequest, bearer_token: str | None = None) -> bool:
    """Whether ``request`` may read the metrics: its user is active and staff, or its
    ``Authorization`` header is ``Bearer <bearer_token>`` (a non-empty token)."""
    user = getattr(request, "user", None)
    if user is not None and user.is_active and user.is_staff:
        return True
    if not bearer_token:
        return False
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        credentials.strip().encode(), bearer_token.encode()
    )


@idempotency_exempt
@require_safe
def metrics_view(request: HttpRequest, bearer_token: str | None = None) -> HttpResponse:
    """The metrics in Prometheus's text format (OpenMetrics when the ``Accept`` header asks
    for it), for staff or a request with the bearer token (see the module docstring); 401
    or 403 otherwise.

    Args:
        request: The request.
        bearer_token: The token a scraper sends as ``Authorization: Bearer <token>``;
            None or ``""``: staff only.

    Returns:
        200 with the exposition, 401 without credentials, 403 with wrong ones.
    """
    if not allowed(request, bearer_token):
        anonymous = not getattr(getattr(request, "user", None), "is_authenticated", False)
        if anonymous and "Authorization" not in request.headers:
            response = HttpResponse("authentication required\n", status=401)
            if bearer_token:
                response["WWW-Authenticate"] = 'Bearer realm="metrics"'
            return response
        return HttpResponse("forbidden\n", status=403)
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    response = HttpResponse(encoder(prometheus.scrape_registry()), content_type=content_type)
    response["Cache-Control"] = "no-store"
    return response
