"""The HTTP idempotency workload of the fault suite: a real ASGI server for the
example project's ``/faults/http/`` views (``django_app/faults/http_views.py``) and a client
driver sending them requests with ``Idempotency-Key``; the rules are in ``http_rules.py``.

Server: ``uvicorn --factory django.core.asgi:get_asgi_application`` with the example project's
settings (``django_app.settings``), its lock store (and idempotency store) ``REDIS_URL``, and
``STEPLOCK_FAULTS=1`` with ``STEPLOCK_FAULTS_URL`` the control Redis, where each body writes
its ``http_body_start`` / ``http_body_end`` entries (``faults:history``). A sync view runs in
Django's thread (under ASGI), an async view on the loop; a client gone away cancels an async
view (its record is released) but not a sync one.

Client (:func:`drive`): threads that each pick a client (``alice`` and ``bob`` with a bearer
token, ``anon-1`` / ``anon-2`` without: the anonymous scope), a view kind (sync, async) and a
key from a sliding pool shared by every client on purpose (``alice`` and ``bob`` send the
same key strings, with the same request: method, path, query and body depend on the key only,
so a guard not scoped by principal would replay across them). A third of the keys have a
slow body (1 s); a fifth of the requests use a short client timeout (0.35 s) and a tenth
one that ends about when the body returns (the client leaves while the response is being
recorded), and retry after it, so the retry races the first request; a 409 is retried after its ``Retry-After``
(capped). Every response is recorded (shape: ``http_rules`` module docstring).

Variants: ``guarded`` (the normal run), ``shared`` (the guard with one scope for all: the
rules must find ``cross_principal``) and ``unguarded`` (no guard: ``second_body`` and
``concurrent_bodies``).

Standalone: ``python -m tests.support.faults.http_load --seconds 60 --variant guarded
--fault restart`` (or ``pause``) starts its own two redis-servers (store, control) and the
server, runs, prints the verdict as JSON and stops what it started (exit status 1 when the
guarded run has a violation, or a negative control has none).
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.faults import http_rules
from tests.support.processes import ProcessGroup, uvicorn_command
from tests.support.servers import RedisServer, free_port

VARIANTS = ("guarded", "shared", "unguarded")
KINDS = ("sync", "async")
#: client name -> (principal, bearer token or None)
CLIENTS = {
    "alice": ("user:alice", "alice-token"),
    "bob": ("user:bob", "bob-token"),
    "anon-1": ("anonymous", None),
    "anon-2": ("anonymous", None),
}
SLOW_HOLD = 1.0
FAST_HOLD = 0.15
SHORT_TIMEOUT = 0.35
#: Shares of the requests with the short timeout and with an edge timeout (the body's hold
#: plus up to EDGE_SPREAD seconds: the client leaves about when the body returns).
SHORT_SHARE = 0.2
EDGE_SHARE = 0.1
EDGE_SPREAD = 0.08
LONG_TIMEOUT = 15.0
#: Attempts per logical request (the first and its retries after a timeout or a 409).
ATTEMPTS = 4
#: Keys live in the pool for about this many seconds (new ones enter at KEYS_PER_SECOND).
KEY_WINDOW = 15.0
KEYS_PER_SECOND = 2.0
#: The views' lock TTL under STEPLOCK_FAULTS=1 (django_app/faults/patterns.py sets it from
#: STEPLOCK_FAULTS_IDEMPOTENCY_LOCK_TTL, default 8 s).
FAULTS_LOCK_TTL = 8.0
#: Seconds the ``pause`` fault keeps the store SIGSTOPped (default).
PAUSE = 3.0


class HttpServer:
    """uvicorn serving the example project (``django_app.settings``) on a free loopback port,
    in its own process group (stopped by its PID). ``redis_url`` is the store (``REDIS_URL``),
    ``control_url`` the history's Redis; ``env`` is merged last (the nemesis passes its
    workers' environment: ``STEPLOCK_REDIS_URL`` through its store proxy, ``DATABASE_URL``)."""

    def __init__(self, redis_url: str, control_url: str, logfile: Path, env: dict | None = None):
        self.port = free_port()
        self.process = ProcessGroup(
            uvicorn_command("django.core.asgi:get_asgi_application", self.port, factory=True),
            env={
                "DJANGO_SETTINGS_MODULE": "django_app.settings",
                "DJANGO_ALLOWED_HOSTS": "127.0.0.1,localhost",
                "REDIS_URL": redis_url,
                "STEPLOCK_FAULTS": "1",
                "STEPLOCK_FAULTS_URL": control_url,
                **(env or {}),
            },
            logfile=logfile,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> HttpServer:
        self.process.start()
        self.process.wait_for_log(r"Uvicorn running on", timeout=timeout)
        return self

    def stop(self) -> None:
        self.process.terminate()

    def __enter__(self) -> HttpServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def key_hold(key: str) -> float:
    """Seconds the body of ``key`` sleeps: :data:`SLOW_HOLD` for a third of the keys."""
    return SLOW_HOLD if zlib.crc32(key.encode()) % 3 == 0 else FAST_HOLD


def key_request(variant: str, kind: str, key: str) -> tuple[str, bytes]:
    """The path-and-query and JSON body of a request with ``key``: a function of the key only
    (every client sends the same request with a key)."""
    body = json.dumps({"amount": zlib.crc32(key.encode()) % 1000}).encode()
    return f"/faults/http/{variant}/{kind}?hold={key_hold(key)}", body


def send(
    base: str, variant: str, kind: str, key: str, client: str, timeout: float
) -> dict[str, Any]:
    """One request; the response record (``http_rules`` shape, plus ``client``)."""
    principal, token = CLIENTS[client]
    target, data = key_request(variant, kind, key)
    headers = {"Content-Type": "application/json", "Idempotency-Key": key}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(base + target, data=data, method="POST", headers=headers)
    record: dict[str, Any] = {
        "view": f"{variant}/{kind}",
        "key": key,
        "principal": principal,
        "client": client,
        "status": None,
        "payload": None,
        "replayed": False,
        "retry_after": None,
        "timeout": timeout,
        "t0": time.time(),
    }
    try:
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, head, raw = response.status, response.headers, response.read()
        except urllib.error.HTTPError as error:
            status, head, raw = error.code, error.headers, error.read()
    except (TimeoutError, socket.timeout, urllib.error.URLError, ConnectionError, OSError) as exc:
        record.update(t1=time.time(), error=type(exc).__name__)
        return record
    try:
        payload = json.loads(raw)
    except ValueError:
        payload = None
    record.update(
        t1=time.time(),
        status=status,
        payload=payload,
        replayed=(head.get("Idempotent-Replayed") or "").lower() == "true",
        retry_after=head.get("Retry-After"),
    )
    return record


@dataclass
class Driver:
    """The client threads of one run against ``base`` (see the module docstring)."""

    base: str
    variant: str = "guarded"
    threads: int = 6
    seed: int = 0
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    responses: list[dict[str, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _key(self, rng: random.Random, elapsed: float) -> str:
        newest = int(elapsed * KEYS_PER_SECOND)
        oldest = max(0, newest - int(KEY_WINDOW * KEYS_PER_SECOND))
        return f"{self.run_id}-k{rng.randint(oldest, newest)}"

    def _one(self, rng: random.Random, elapsed: float, request_id: str) -> None:
        client = rng.choice(sorted(CLIENTS))
        kind = rng.choice(KINDS)
        key = self._key(rng, elapsed)
        draw = rng.random()
        if draw < SHORT_SHARE:
            timeout = SHORT_TIMEOUT
        elif draw < SHORT_SHARE + EDGE_SHARE:  # gone as the body ends: while it is recorded
            timeout = key_hold(key) + rng.uniform(0.0, EDGE_SPREAD)
        else:
            timeout = LONG_TIMEOUT
        for attempt in range(ATTEMPTS):
            record = send(self.base, self.variant, kind, key, client, timeout)
            record.update(request=request_id, attempt=attempt)
            with self._lock:
                self.responses.append(record)
            if record["status"] is None:
                time.sleep(rng.uniform(0.0, 0.1))  # retry at once: it races the first
                continue
            if record["status"] in (409, 503):
                try:
                    wait = float(record["retry_after"] or 0.2)
                except ValueError:
                    wait = 0.2
                time.sleep(min(wait, 0.3))
                continue
            return

    def run(self, seconds: float, stop: threading.Event | None = None) -> list[dict[str, Any]]:
        """Send requests for ``seconds`` (or until ``stop`` is set); the responses."""
        stop = stop or threading.Event()
        started = time.monotonic()

        def worker(index: int) -> None:
            rng = random.Random(f"{self.seed}:{index}")
            count = 0
            while not stop.is_set() and time.monotonic() - started < seconds:
                self._one(rng, time.monotonic() - started, f"{index}-{count}")
                count += 1

        workers = [
            threading.Thread(target=worker, args=(i,), daemon=True) for i in range(self.threads)
        ]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()
        return self.responses


def collect_executions(control_url: str) -> dict[str, dict[str, Any]]:
    """The executions the server's bodies recorded in ``faults:history`` on the control Redis."""
    import redis

    client = redis.Redis.from_url(control_url, decode_responses=True)
    try:
        entries = [json.loads(raw) for raw in client.lrange("faults:history", 0, -1)]
    finally:
        client.close()
    return http_rules.executions_from_history(entries)


def run(
    seconds: float = 60.0,
    variant: str = "guarded",
    fault: str | None = None,
    threads: int = 6,
    seed: int = 0,
    workdir: Path | None = None,
    pause: float = PAUSE,
) -> dict[str, Any]:
    """Start a store Redis, a control Redis and the server; drive the load for ``seconds``
    (with ``fault="restart"``: restart the store Redis, losing its data, at half time;
    ``"pause"``: SIGSTOP it for ``pause`` seconds then) and check it. Returns the
    summary: ``variant``, ``fault``, ``store_lost_at``, ``store_down``, ``counts``,
    ``by_rule`` (violations per rule), ``excused`` (per rule) and the first few
    ``examples``."""
    workdir = Path(workdir) if workdir else Path(f"/tmp/steplock-http-load-{uuid.uuid4().hex[:6]}")
    workdir.mkdir(parents=True, exist_ok=True)
    store, control = RedisServer(), RedisServer()
    server: HttpServer | None = None
    lost: list[float] = []
    down: list[tuple[float, float]] = []
    try:
        store.start()
        control.start()
        server = HttpServer(store.url, control.url, workdir / "uvicorn.log").start()
        driver = Driver(server.url, variant=variant, threads=threads, seed=seed)
        load = threading.Thread(target=driver.run, args=(seconds,), daemon=True)
        load.start()
        if fault == "restart":
            time.sleep(seconds / 2)
            lost.append(time.time())
            store.restart()
        elif fault == "pause":
            time.sleep(seconds / 2)
            paused = time.time()
            store.pause()
            try:
                time.sleep(pause)
            finally:
                store.resume()
            down.append((paused, time.time()))
        load.join()
        executions = collect_executions(control.url)
    finally:
        if server is not None:
            server.stop()
        control.stop()
        store.stop()
    verdict = http_rules.check(
        executions,
        driver.responses,
        store_lost_at=lost,
        store_down=down,
        lock_ttl=FAULTS_LOCK_TTL,
    )
    excused: dict[str, int] = {}
    for finding in verdict.excused:
        excused[finding["rule"]] = excused.get(finding["rule"], 0) + 1
    summary = {
        "variant": variant,
        "fault": fault,
        "seconds": seconds,
        "store_lost_at": lost,
        "store_down": down,
        "counts": verdict.counts,
        "by_rule": verdict.by_rule(),
        "excused": excused,
        "examples": verdict.violations[:3],
    }
    (workdir / f"http-{variant}.json").write_text(
        json.dumps(
            {
                "summary": summary,
                "responses": driver.responses,
                "executions": list(executions.values()),
            },
            default=str,
        )
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--variant", choices=VARIANTS, default="guarded")
    parser.add_argument("--fault", choices=("restart", "pause"), default=None)
    parser.add_argument("--threads", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pause", type=float, default=PAUSE, help="seconds of the pause fault")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    summary = run(
        args.seconds, args.variant, args.fault, args.threads, args.seed, args.workdir, args.pause
    )
    sys.stdout.write(json.dumps(summary, indent=1, default=str) + "\n")
    if args.variant == "guarded":
        return 0 if not summary["by_rule"] else 1
    return 0 if summary["by_rule"] else 1  # a negative control must be caught


if __name__ == "__main__":
    sys.exit(main())
