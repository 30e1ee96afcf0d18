"""Async Django views guarded by ``Idempotency-Key`` under a real ASGI server (issue 27).

A uvicorn subprocess (one worker, asyncio loop) serves ``tests.support.asgi_app`` on a free
loopback port; the tests send it concurrent requests from threads (urllib) and read the
run counts it keeps in the session's Redis: one body runs per key, the duplicates get the
replay or 409 (``Retry-After``), another body with the key 422, a key without a principal
403 - through the decorator on an ``async def`` view, through ``IdempotencyMiddleware``
(async under ASGI) and through a DRF async adapter view (adrf's ``APIView``, a test
requirement). The guard itself makes no thread hop (each ``SyncToAsync`` call is counted),
and the server's event loop never stalls while a view waits for a held lease (a task of
that loop measures its lag). In-process tests drive the async guard with ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from django.test import RequestFactory

from celery_steplock.contrib.django.idempotency import (
    REPLAYED_HEADER,
    IdempotencyMiddleware,
    idempotent_view,
)
from celery_steplock.lock import get_lease_store, new_owner_token
from django_app.celery import app as celery_app
from tests.support.processes import ProcessGroup, uvicorn_command
from tests.support.servers import free_port

pytestmark = pytest.mark.db_incidental

#: Duplicates sent at once with one key.
CONCURRENT = 20
#: The event loop's largest lag allowed while a view waits for a lease (seconds).
MAX_LAG = 0.05


@pytest.fixture(scope="module")
def server(redis_server_url, tmp_path_factory):
    """``uvicorn tests.support.asgi_app:application`` on a free loopback port (its base URL);
    stopped by its PID (its process group) at the end of the module."""
    port = free_port()
    log = tmp_path_factory.mktemp("uvicorn") / "uvicorn.log"
    process = ProcessGroup(
        uvicorn_command("tests.support.asgi_app:application", port),
        env={
            "DJANGO_SETTINGS_MODULE": "tests.support.asgi_settings",
            "REDIS_URL": redis_server_url,
        },
        logfile=log,
    ).start()
    try:
        process.wait_for_log(r"Uvicorn running on", timeout=60)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()


def send(url, body=None, key=None, client="alice", method="POST"):
    """One request: ``(status, headers with lower-case names, parsed JSON body or bytes)``."""
    headers = {"Content-Type": "application/json"}
    if client:
        headers["X-Client"] = client
    if key is not None:
        headers["Idempotency-Key"] = key
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, head, raw = response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        status, head, raw = error.code, error.headers, error.read()
    try:
        content = json.loads(raw)
    except ValueError:
        content = raw
    return status, {k.lower(): v for k, v in head.items()}, content


def at_once(n, call):
    """``call()`` from ``n`` threads released together; their results."""
    barrier = threading.Barrier(n)

    def one(_):
        barrier.wait()
        return call()

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def runs(redis_client, counter):
    return int(redis_client.get(f"asgi:runs:{counter}") or 0)


PATHS = ["/view/charge", "/mw/charge", "/drf/charge"]


@pytest.mark.parametrize("path", PATHS)
def test_one_body_runs_per_key_under_uvicorn(server, redis_client, path):
    """20 concurrent requests with one key: the body runs once; every other request gets
    409 with ``Retry-After`` (the first still runs) or the first's response replayed
    (``Idempotent-Replayed: true``, same status and body); later, a repeat replays, the
    key with another body gets 422, and a request without a principal 403."""
    counter = uuid.uuid4().hex
    url = f"{server}{path}?counter={counter}&hold=0.5"
    key = f"k-{counter}"
    answers = at_once(CONCURRENT, lambda: send(url, {"amount": 5}, key))

    assert runs(redis_client, counter) == 1
    ran = [a for a in answers if a[0] == 201 and REPLAYED_HEADER.lower() not in a[1]]
    assert len(ran) == 1, answers
    first = ran[0]
    assert first[2] == {"amount": 5, "run": 1}
    others = [a for a in answers if a is not first]
    for status, headers, content in others:
        if status == 409:
            assert int(headers["retry-after"]) >= 1
            assert "in progress" in content["error"]
        else:
            assert (status, headers[REPLAYED_HEADER.lower()], content) == (201, "true", first[2])
    # The 20 arrive while the body sleeps 0.5 s: most meet it in progress.
    assert sum(1 for a in others if a[0] == 409) >= 1

    status, headers, content = send(url, {"amount": 5}, key)
    assert (status, headers.get(REPLAYED_HEADER.lower()), content) == (201, "true", first[2])
    status, _, content = send(url, {"amount": 6}, key)
    assert status == 422 and "another request" in content["error"]
    assert send(url, {"amount": 5}, key, client=None)[0] in (401, 403)
    assert runs(redis_client, counter) == 1
    # Another client's same key is its own record: its body runs.
    assert send(url, {"amount": 5}, key, client="bob")[2] == {"amount": 5, "run": 2}


def test_the_guard_of_an_async_view_makes_no_thread_hop(server, redis_client):
    """The guard and the body of a decorated ``async def`` view (Redis store, a sync scope
    function that reads a header) run on the event loop: no ``SyncToAsync`` call between
    the view's start and its answer, for the run and for the replay."""
    counter = uuid.uuid4().hex
    url = f"{server}/view/counted?counter={counter}&hold=0"
    first = send(url, {"amount": 1}, f"h-{counter}")
    replay = send(url, {"amount": 1}, f"h-{counter}")
    assert (first[0], first[1]["x-hops"]) == (201, "0")
    assert (replay[0], replay[1][REPLAYED_HEADER.lower()], replay[1]["x-hops"]) == (
        201,
        "true",
        "0",
    )


def test_the_loop_never_stalls_while_a_view_waits_for_a_lease(server, redis_client, app):
    """The test holds a lease for 1.2 s; a view of the server waits for it with the async
    lease store while concurrent guarded requests come in. A task of the server's loop
    sleeping 5 ms at a time records its overshoot: the largest stays under 50 ms, and the
    view gets the lease once the test releases it (one waiter woken)."""
    store = get_lease_store(app)
    name = f"asgi-lag-{uuid.uuid4().hex}"
    lease = store.acquire(name, new_owner_token(), 10.0)
    started = time.monotonic()
    assert lease is not None
    counter = uuid.uuid4().hex
    url = f"{server}/view/charge?counter={counter}&hold=0.05"
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(send, f"{server}/lease/wait?name={name}&wait=5", method="GET")
        # Guarded requests one after another while the view waits (4 keys, each twice).
        load = [send(url, {"n": 1}, f"l-{i % 4}") for i in range(8)]
        time.sleep(max(0.0, 1.2 - (time.monotonic() - started)))
        assert store.release(name, lease.owner)
        status, _, answer = waiting.result(timeout=30)
    assert [a[0] for a in load] == [201] * 8
    assert [a[1].get(REPLAYED_HEADER.lower()) for a in load] == [None] * 4 + ["true"] * 4
    assert status == 200 and answer["acquired"] is True
    assert 0.8 <= answer["waited"] < 3.0, answer
    assert answer["ticks"] >= 50, answer
    print(
        f"event-loop lag while a view waited {answer['waited']:.3f} s for a lease: max "
        f"{answer['max_lag'] * 1000:.1f} ms over {answer['ticks']} ticks of 5 ms"
    )
    assert answer["max_lag"] < MAX_LAG, answer
    assert runs(redis_client, counter) == 4  # one body per key of the load


# -- in process: the async guard driven with asyncio.run ---------------------------------------


def scope_of(request):
    return request.headers.get("X-Client") or None


RAN: list = []
PAUSER: list = []  # a client of the session's Redis, for kind=pause


@idempotent_view(app=celery_app, namespace="tests.async.inproc", scope=scope_of)
async def inproc_view(request):
    RAN.append(request.GET.get("v"))
    kind = request.GET.get("kind")
    if kind == "refuse":
        return JsonResponse({"error": "no"}, status=400)
    if kind == "stream":
        return StreamingHttpResponse(iter([b"a", b"b"]))
    if kind == "raise":
        raise RuntimeError("boom")
    if kind == "slow":
        await asyncio.sleep(5)
    if kind == "pause":  # the lock store's writes wait 1 s: the guard's recording with them
        PAUSER[0].execute_command("CLIENT", "PAUSE", 1000, "WRITE")
    return HttpResponse(f"ran {len(RAN)}", status=201)


def request_for(query, key="k", client="alice", body=b"{}"):
    extra = {"HTTP_X_CLIENT": client} if client else {}
    if key is not None:
        extra["HTTP_IDEMPOTENCY_KEY"] = key
    return RequestFactory().post(
        f"/inproc?{query}", data=body, content_type="application/json", **extra
    )


@pytest.fixture
def ran(redis_client, celery_app_configured):
    RAN.clear()
    yield RAN
    RAN.clear()


def test_a_refused_streaming_or_failed_async_view_lets_its_key_run_again(ran):
    """The sync view's rules, on the async path: a 4xx answer releases the record, a
    streaming response is not recorded, an exception fails the record; each time the key
    runs again. A recorded one replays."""

    async def scenario():
        for kind in ("refuse", "stream", "raise"):
            for _ in range(2):
                try:
                    await inproc_view(request_for(f"kind={kind}", key=f"k-{kind}"))
                except RuntimeError:
                    assert kind == "raise"
        first = await inproc_view(request_for("kind=ok", key="k-ok"))
        again = await inproc_view(request_for("kind=ok", key="k-ok"))
        return first, again

    first, again = asyncio.run(scenario())
    assert len(ran) == 7  # 2 per refused/streamed/failed key, 1 for the recorded one
    assert (first.status_code, first.content) == (201, b"ran 7")
    assert (again.status_code, again.content, again[REPLAYED_HEADER]) == (201, b"ran 7", "true")


def test_a_cancelled_async_view_releases_its_record(ran):
    """Django cancels an async view whose client disconnected: its record is released,
    so the retry runs (never a 409 until the lock TTL, never a replay of nothing)."""

    async def scenario():
        task = asyncio.ensure_future(inproc_view(request_for("kind=slow", key="k-c")))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await inproc_view(request_for("kind=ok", key="k-c"))

    retry = asyncio.run(scenario())
    # Another query is another request: a record still locked would answer 422.
    assert (retry.status_code, len(ran)) == (201, 2)


def test_a_view_cancelled_while_its_response_is_recorded_still_records_it(ran, redis_client):
    """The view ran and its response is being recorded when Django cancels the request (the
    client disconnected): the recording finishes anyway, so the key replays that response.
    Cut short, it left the record in progress, renewed while the process lived: every retry
    got 409 and the key never ran nor replayed (found by the fault run's HTTP load)."""
    PAUSER[:] = [redis_client]

    async def scenario():
        task = asyncio.ensure_future(inproc_view(request_for("kind=pause", key="k-r")))
        await asyncio.sleep(0.3)  # the body ran; the recording waits on the paused writes
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(1.5)  # the pause is over
        return await inproc_view(request_for("kind=pause", key="k-r"))

    try:
        retry = asyncio.run(scenario())
    finally:
        PAUSER.clear()
    assert (retry.status_code, retry.content, len(ran)) == (201, b"ran 1", 1), retry.content
    assert retry[REPLAYED_HEADER] == "true"


def test_the_middleware_is_async_under_an_async_handler(settings):
    """Django builds the middleware with an async ``get_response`` under ASGI: it is then
    a coroutine function (Django awaits it, no adapter); with a sync one it stays sync."""
    from asgiref.sync import iscoroutinefunction

    settings.STEPLOCK_IDEMPOTENCY_MIDDLEWARE = {"app": celery_app}

    async def get_response(request):
        return HttpResponse()

    assert IdempotencyMiddleware.async_capable and IdempotencyMiddleware.sync_capable
    assert iscoroutinefunction(IdempotencyMiddleware(get_response))
    assert not iscoroutinefunction(IdempotencyMiddleware(lambda request: HttpResponse()))


@idempotent_view(app=celery_app, namespace="tests.async.db", scope=scope_of, store="database")
async def database_view(request):
    RAN.append(1)
    return HttpResponse(f"ran {len(RAN)}", status=201)


@idempotent_view(app=celery_app, namespace="tests.async.template", scope=scope_of)
async def template_view(request):
    from django.template import engines
    from django.template.response import TemplateResponse

    RAN.append(1)
    template = engines["django"].from_string("rendered {{ n }}")
    return TemplateResponse(request, template, {"n": len(RAN)}, status=201)


@pytest.mark.django_db(transaction=True)
def test_an_async_view_with_the_database_store_runs_once_and_replays(ran):
    """``store="database"``: the async guard uses ``DatabaseRecords``' async forms (each a
    thread hop: Django's ORM has no async transaction); the answers are the same."""

    async def scenario():
        first = await database_view(request_for("", key="db-1"))
        again = await database_view(request_for("", key="db-1"))
        other = await database_view(request_for("", key="db-1", body=b'{"x": 1}'))
        return first, again, other

    first, again, other = asyncio.run(scenario())
    assert (first.status_code, first.content) == (201, b"ran 1")
    assert (again.content, again[REPLAYED_HEADER]) == (b"ran 1", "true")
    assert other.status_code == 422 and ran == [1]


def test_a_response_rendered_after_an_async_view_is_recorded_once_rendered(ran):
    """A ``TemplateResponse`` is rendered by Django after the view, in a thread
    (``sync_to_async(response.render)``): its record completes from that thread on the
    view's loop, and the replay carries the rendered body."""
    from asgiref.sync import sync_to_async

    async def scenario():
        response = await template_view(request_for("", key="t-1"))
        assert not response.is_rendered
        await sync_to_async(response.render, thread_sensitive=True)()
        again = await template_view(request_for("", key="t-1"))
        return response, again

    first, again = asyncio.run(scenario())
    assert first.content == b"rendered 1" and ran == [1]
    assert (again.status_code, again.content, again[REPLAYED_HEADER]) == (
        201,
        b"rendered 1",
        "true",
    )


@idempotent_view(app=celery_app, namespace="tests.async.capped", scope=scope_of, max_records=1)
async def capped_view(request):
    RAN.append(1)
    return HttpResponse(f"ran {len(RAN)}", status=201)


def test_the_cap_holds_on_the_async_path(ran):
    """``max_records`` through the cap's async script calls: a second live key of the
    principal gets 429 with ``Retry-After`` and the view does not run; the first key still
    replays; another principal has a cap of its own."""

    async def scenario():
        return [
            await capped_view(request_for("", key="cap-1")),
            await capped_view(request_for("", key="cap-2")),
            await capped_view(request_for("", key="cap-1")),
            await capped_view(request_for("", key="cap-2", client="bob")),
        ]

    first, refused, replay, bob = asyncio.run(scenario())
    assert first.status_code == 201 and bob.status_code == 201
    assert refused.status_code == 429 and int(refused["Retry-After"]) >= 1
    assert (replay.content, replay[REPLAYED_HEADER]) == (b"ran 1", "true")
    assert ran == [1, 1]
