"""An ASGI app for a real server (``uvicorn tests.support.asgi_app:application``), run by
tests/contrib/test_async_views.py: async views guarded by ``idempotent_view`` and by
``IdempotencyMiddleware``, a DRF async adapter view (adrf), and a view that
waits for a held lease while a task of the same event loop measures the loop's lag.

Each guarded body counts its runs in Redis (``INCR asgi:runs:<counter>``, through the
asyncio client) and sleeps ``?hold=`` seconds (default 0.3) with the record locked, so the
concurrent duplicates of a test meet it in progress.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.support.asgi_settings")

import django  # noqa: E402

django.setup()

from asgiref.sync import SyncToAsync  # noqa: E402
from django.core.asgi import get_asgi_application  # noqa: E402
from django.http import JsonResponse  # noqa: E402
from django.urls import path  # noqa: E402

from celery_steplock.aio.lock import get_async_lease_store  # noqa: E402
from celery_steplock.clients import async_client_for  # noqa: E402
from celery_steplock.contrib.django.idempotency import idempotent_view  # noqa: E402
from celery_steplock.lock import get_lease_store, new_owner_token  # noqa: E402
from django_app.celery import app as celery_app  # noqa: E402
from tests.support.asgi_settings import client_scope  # noqa: E402
from tests.support.loop import LagProbe  # noqa: E402

#: ``SyncToAsync`` calls made while a guarded view's guard ran (``X-Hops`` of its answer).
_hops = {"n": 0}
_original_call = SyncToAsync.__call__


async def _counted_call(self, *args, **kwargs):
    _hops["n"] += 1
    return await _original_call(self, *args, **kwargs)


SyncToAsync.__call__ = _counted_call  # type: ignore[method-assign]


async def _body(request, counter: str) -> JsonResponse:
    client = async_client_for(get_lease_store(celery_app).client)
    runs = await client.incr(f"asgi:runs:{counter}")
    await asyncio.sleep(float(request.GET.get("hold", "0.3")))
    payload = json.loads(request.body or b"{}")
    return JsonResponse({"amount": payload.get("amount"), "run": runs}, status=201)


@idempotent_view(app=celery_app, namespace="tests.asgi.charge", scope=client_scope)
async def charge(request):
    return await _body(request, request.GET.get("counter", "charge"))


async def _hops_of(view, request):
    before = _hops["n"]
    response = await view(request)
    response["X-Hops"] = str(_hops["n"] - before)
    return response


async def counted_charge(request):
    """``charge``, answering with the number of thread hops its guard and body made."""
    return await _hops_of(charge, request)


async def mw_charge(request):
    """Guarded by IdempotencyMiddleware (async under ASGI), not by the decorator."""
    return await _body(request, request.GET.get("counter", "mw"))


async def wait_for_lease(request):
    """Wait (up to ``?wait=`` seconds) for the lease ``?name=`` that the test holds, with
    the async lease store, while a task of this loop measures its lag. Answers how long the
    wait took, whether the lease came, and the loop's largest lag meanwhile."""
    store = get_async_lease_store(celery_app)
    # A full collection now, not in the window: a CPython GC pause of the server's heap
    # (tens of ms after the module's other tests) is no blocking call of ours.
    gc.collect()
    async with LagProbe() as probe:
        started = time.perf_counter()
        lease = await store.acquire(
            request.GET["name"], new_owner_token(), 5.0, wait=float(request.GET.get("wait", "5"))
        )
        waited = time.perf_counter() - started
        if lease is not None:
            await store.release(lease.name, lease.owner)
        await asyncio.sleep(0.05)  # a few more probe ticks after the wait
    return JsonResponse(
        {
            "acquired": lease is not None,
            "waited": waited,
            "max_lag": probe.max_lag,
            "ticks": probe.ticks,
        }
    )


urlpatterns = [
    path("view/charge", charge),
    path("view/counted", counted_charge),
    path("mw/charge", mw_charge),
    path("lease/wait", wait_for_lease),
]

# a DRF async adapter (adrf's APIView awaits an ``async def`` handler)
from adrf.views import APIView  # type: ignore[import-not-found]  # noqa: E402
from rest_framework.authentication import BaseAuthentication  # noqa: E402
from rest_framework.permissions import IsAuthenticated  # noqa: E402
from rest_framework.renderers import JSONRenderer  # noqa: E402
from rest_framework.response import Response  # noqa: E402


class HeaderUser:
    """A user DRF authenticated from the ``X-Client`` header (no database)."""

    is_authenticated = True

    def __init__(self, name: str):
        self.pk = name


class HeaderAuthentication(BaseAuthentication):
    def authenticate(self, request):
        name = request.headers.get("X-Client")
        return (HeaderUser(name), name) if name else None

    def authenticate_header(self, request):
        return "X-Client"


class Payments(APIView):
    authentication_classes = [HeaderAuthentication]
    permission_classes = [IsAuthenticated]
    renderer_classes = [JSONRenderer]

    @idempotent_view(app=celery_app, namespace="tests.asgi.drf")
    async def post(self, request):
        client = async_client_for(get_lease_store(celery_app).client)
        runs = await client.incr(f"asgi:runs:{request.GET.get('counter', 'drf')}")
        await asyncio.sleep(float(request.GET.get("hold", "0.3")))
        return Response({"amount": request.data["amount"], "run": runs}, status=201)


urlpatterns.append(path("drf/charge", Payments.as_view()))

application = get_asgi_application()
