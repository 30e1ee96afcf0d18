"""HTTP views of the fault suite's HTTP workload (``tests/support/faults/http_load.py``).

Each view is one body that records its execution in the fault history (``faults:history`` on
the control Redis, :func:`django_app.faults.probe.record`, so only with ``STEPLOCK_FAULTS=1``):
an ``http_body_start`` entry when it begins and an ``http_body_end`` entry when it ends
(``outcome`` ``"ok"`` with the ``status`` and ``payload`` it returned, or ``"cancelled"`` when
Django cancelled it because its client went away). Each entry has ``view`` (the variant below),
``key`` (the ``Idempotency-Key`` header), ``principal`` (whose request ran it) and ``body``
(a fresh uuid4 hex per execution). The answer is ``201`` with the JSON ``payload``: ``body``,
``principal``, ``key`` and the request's ``amount``; the body sleeps ``?hold=`` seconds
(default 0.5) before answering, so duplicates and retries meet it in progress.

Principals: ``Authorization: Bearer <token>`` with a token of :data:`TOKENS` is
``user:<name>`` (a header credential the scope authenticates, as the idempotency docs ask of
header authentication); no credential is :data:`ANONYMOUS_SCOPE` (``anonymous=True``: one
scope per host, docs/patterns/idempotency.md "Whose key it is"). An unknown token is refused
with 401 before the guard runs.

Served only with ``STEPLOCK_FAULTS=1`` (``django_app/urls.py``). Variants
(``/faults/http/<variant>/<sync|async>``): ``guarded`` (``@idempotent_view`` scoped by
principal), and the negative controls ``shared`` (guarded, but every request in one scope:
a key is not scoped by principal) and ``unguarded`` (no guard: every request runs its body).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from asgiref.sync import iscoroutinefunction
from django.http import JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

from celery_steplock.contrib.django.idempotency import ANONYMOUS_SCOPE, idempotent_view
from django_app.celery import app as celery_app

from . import probe

#: Bearer tokens of the workload's authenticated principals (an example project's fixtures).
TOKENS = {"alice-token": "alice", "bob-token": "bob"}
#: Seconds a body sleeps unless ``?hold=`` says otherwise.
DEFAULT_HOLD = 0.5
VARIANTS = ("guarded", "shared", "unguarded")


class _Unknown(Exception):
    """A bearer token that names no principal."""


def _principal(request) -> str:
    """``user:<name>`` for a known bearer token, :data:`ANONYMOUS_SCOPE` without one;
    raises :class:`_Unknown` for another token."""
    auth = request.headers.get("Authorization", "")
    if not auth:
        return ANONYMOUS_SCOPE
    scheme, _, token = auth.partition(" ")
    name = TOKENS.get(token.strip()) if scheme.lower() == "bearer" else None
    if name is None:
        raise _Unknown(auth)
    return f"user:{name}"


def principal_scope(request) -> str | None:
    """The ``scope`` of the guarded views: the authenticated principal, None when anonymous
    (the view's ``anonymous=True`` then scopes it per host)."""
    found = _principal(request)
    return None if found == ANONYMOUS_SCOPE else found


def shared_scope(request) -> str:
    """Negative control: one scope for every client (keys not scoped by principal)."""
    return "shared"


def _start(request, view: str) -> dict:
    entry = {
        "view": view,
        "key": request.headers.get("Idempotency-Key"),
        "principal": _principal(request),
        "body": uuid.uuid4().hex,
    }
    probe.record("http_body_start", **entry)
    return entry


def _answer(request, entry: dict) -> JsonResponse:
    amount = json.loads(request.body or b"{}").get("amount")
    payload = {
        "body": entry["body"],
        "principal": entry["principal"],
        "key": entry["key"],
        "amount": amount,
    }
    probe.record("http_body_end", outcome="ok", status=201, payload=payload, **entry)
    return JsonResponse(payload, status=201)


def _hold(request) -> float:
    return float(request.GET.get("hold", DEFAULT_HOLD))


def _sync_body(view: str):
    def body(request):
        entry = _start(request, view)
        time.sleep(_hold(request))
        return _answer(request, entry)

    body.__name__ = body.__qualname__ = f"{view.replace('/', '_')}"
    return body


def _async_body(view: str):
    async def body(request):
        entry = _start(request, view)
        try:
            await asyncio.sleep(_hold(request))
        except asyncio.CancelledError:
            probe.record("http_body_end", outcome="cancelled", **entry)
            raise
        return _answer(request, entry)

    body.__name__ = body.__qualname__ = f"{view.replace('/', '_')}"
    return body


def _authenticated(view):
    """401 for an unknown bearer token, before the guard (and its scope) runs."""
    if iscoroutinefunction(view):

        async def async_checked(request, *args, **kwargs):
            try:
                _principal(request)
            except _Unknown:
                return JsonResponse({"error": "unknown token"}, status=401)
            return await view(request, *args, **kwargs)

        return csrf_exempt(async_checked)

    def checked(request, *args, **kwargs):
        try:
            _principal(request)
        except _Unknown:
            return JsonResponse({"error": "unknown token"}, status=401)
        return view(request, *args, **kwargs)

    return csrf_exempt(checked)


def _views():
    views = {}
    for kind, make in (("sync", _sync_body), ("async", _async_body)):
        guarded = f"guarded/{kind}"
        views[guarded] = idempotent_view(
            make(guarded),
            app=celery_app,
            namespace=f"faults.http.{kind}",
            scope=principal_scope,
            anonymous=True,
        )
        shared = f"shared/{kind}"
        views[shared] = idempotent_view(
            make(shared),
            app=celery_app,
            namespace=f"faults.http.shared.{kind}",
            scope=shared_scope,
        )
        views[f"unguarded/{kind}"] = make(f"unguarded/{kind}")
    return {name: _authenticated(view) for name, view in views.items()}


VIEWS = _views()
urlpatterns = [path(f"{name}", view) for name, view in VIEWS.items()]
