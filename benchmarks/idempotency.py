"""Idempotency records: ours (Redis store, database store with its Redis cache) against what
users write instead, a hand-written idempotency table (``INSERT ... ON CONFLICT DO NOTHING``
plus a result column), on PostgreSQL when it is installed (else SQLite).

For each variant, two decisions, each timed per call around a body that does nothing (so the
figure is the overhead): a *first call* (a new key: lock, run, record the result) and a
*replay* (a completed key: return the recorded result). Figures: p50 and p99 per call (µs),
and the Redis server time per decision (``INFO commandstats`` usec after ``CONFIG
RESETSTAT``, summed over every command, divided by the calls; the hand-written table uses no
Redis). Also the bare call (no idempotency) as the floor.

    python -m benchmarks.idempotency [--quick] [--out FILE]

Writes ``docs/patterns/idempotency.json`` (the figures and the context) and prints the table;
registered in ``benchmarks/run.py`` as the group ``idempotency``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import ROOT, Recorder, group_main, machine_context, percentile, servers

SECRET = "b" * 40
VARIANTS = ("bare", "ours_redis", "ours_database", "handmade_table")


def _setup() -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="bench-idem-"))
    redis_server = servers.RedisServer(workdir=workdir / "redis").start()
    env = {
        "DJANGO_SETTINGS_MODULE": "django_app.settings",
        "REDIS_URL": redis_server.url,
        "STEPLOCK_VAR_DIR": str(workdir),
        "STEPLOCK_LOG_LEVEL": "WARNING",
    }
    database = "sqlite"
    if servers.PostgresServer.available():
        pg = servers.PostgresServer().start()
        env["DATABASE_URL"] = pg.url
        database = "postgresql"
    else:
        os.environ.pop("DATABASE_URL", None)
        env["STEPLOCK_SQLITE"] = str(workdir / "bench.sqlite3")
    os.environ.update(env)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TABLE IF NOT EXISTS handmade_idem (key varchar(64) PRIMARY KEY, "
            "fingerprint varchar(64) NOT NULL, status varchar(16) NOT NULL, "
            "result text, created_at timestamp NOT NULL, expires_at timestamp "
            "NOT NULL)"
        )
    return {"redis_url": redis_server.url, "database": database, "vendor": connection.vendor}


def handmade(fun: Callable, ttl: float = 86400.0) -> Callable:
    """What a team writes by hand: a row per key, inserted first (the unique key decides who
    runs), the result written after the body; a repeat reads the row."""
    import datetime as dt
    import hashlib

    from django.db import connection, transaction
    from kombu.utils.json import dumps, loads

    def wrapper(key: str, *args):
        fingerprint = hashlib.sha256(dumps(args).encode()).hexdigest()
        now = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO handmade_idem (key, fingerprint, status, created_at, "
                "expires_at) VALUES (%s, %s, 'locked', %s, %s) ON CONFLICT (key) "
                "DO NOTHING RETURNING key",
                [key, fingerprint, now, now + dt.timedelta(seconds=ttl)],
            )
            inserted = cursor.fetchone() is not None
            if not inserted:
                cursor.execute(
                    "SELECT status, fingerprint, result FROM handmade_idem WHERE key = %s", [key]
                )
                status, stored, result = cursor.fetchone()
                if stored != fingerprint:
                    raise ValueError("key reused")
                if status == "completed":
                    return loads(result)
                raise RuntimeError("in progress")
        result = fun(*args)
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE handmade_idem SET status = 'completed', result = %s WHERE key = %s",
                [dumps(result), key],
            )
        return result

    return wrapper


def body(n):
    return {"n": n, "ok": True}


def build(variant: str, client) -> Callable[[str, int], Any]:
    from celery_steplock.patterns.idempotency import Idempotency

    if variant == "bare":
        return lambda key, n: body(n)
    if variant == "handmade_table":
        return handmade(body)
    store = "redis" if variant == "ours_redis" else "database"
    policy = Idempotency("bench.charge", client=client, secret=SECRET, store=store)

    def call(key: str, n: int):
        ticket = policy.begin(key, {"n": n})
        if ticket.replayed:
            return ticket.result
        result = body(n)
        ticket.complete(result)
        return result

    return call


def server_usec(client) -> float:
    stats = client.info("commandstats")
    return float(
        sum(
            v.get("usec", 0)
            for k, v in stats.items()
            if k.startswith("cmdstat_") and k not in ("cmdstat_config", "cmdstat_info")
        )
    )


def measure(
    rec: Recorder, variant: str, call: Callable, client, calls: int, reps: int, tag: str
) -> dict[str, Any]:
    firsts: list[float] = []
    replays: list[float] = []
    first_server = replay_server = 0.0
    for rep in range(reps):
        keys = [f"{tag}:{variant}:{rep}:{i}" for i in range(calls)]
        client.config_resetstat()
        for i, key in enumerate(keys):
            t0 = time.perf_counter()
            call(key, i)
            firsts.append(time.perf_counter() - t0)
        first_server += server_usec(client)
        client.config_resetstat()
        for i, key in enumerate(keys):
            t0 = time.perf_counter()
            call(key, i)
            replays.append(time.perf_counter() - t0)
        replay_server += server_usec(client)
    total = calls * reps
    row = {
        "variant": variant,
        "first_p50_us": percentile(firsts, 50) * 1e6,
        "first_p99_us": percentile(firsts, 99) * 1e6,
        "replay_p50_us": percentile(replays, 50) * 1e6,
        "replay_p99_us": percentile(replays, 99) * 1e6,
        "first_server_us": first_server / total,
        "replay_server_us": replay_server / total,
    }
    for name, value in row.items():
        if name != "variant":
            rec.add(f"idempotency.{name}", round(value, 2), "us", variant=variant)
    return row


def run(quick: bool = False) -> dict[str, Any]:
    rec = Recorder("idempotency")
    setup = _setup()
    from celery_steplock.lock import make_client

    client = make_client(setup["redis_url"])
    calls, reps = (200, 2) if quick else (2000, 3)
    rows = []
    for variant in VARIANTS:
        call = build(variant, client)
        measure(rec, variant, call, client, 50, 1, "warmup")
        rows.append(measure(rec, variant, call, client, calls, reps, "run"))
        rec.say(f"{variant}: {rows[-1]}")
    rec.note(
        f"{calls} calls x {reps} repetitions per decision; database {setup['database']}; "
        f"body does nothing (the figures are the overhead)"
    )
    table = render(rows, setup["database"])
    print(table, flush=True)
    out = ROOT / "docs" / "patterns" / "idempotency.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    context = machine_context()
    out.write_text(
        json.dumps(
            {
                "context": {
                    **context,
                    "database": setup["database"],
                    "calls": calls,
                    "reps": reps,
                    "quick": quick,
                },
                "rows": rows,
            },
            indent=1,
            default=str,
        )
        + "\n"
    )
    return rec.result(table=table)


def render(rows: list[dict[str, Any]], database: str) -> str:
    head = (
        "| variant | first call p50 / p99 (µs) | replay p50 / p99 (µs) | Redis server µs "
        "per first call | per replay |"
    )
    lines = [head, "|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['first_p50_us']:.0f} / {r['first_p99_us']:.0f} | "
            f"{r['replay_p50_us']:.0f} / {r['replay_p99_us']:.0f} | "
            f"{r['first_server_us']:.1f} | {r['replay_server_us']:.1f} |"
        )
    return "\n".join(lines) + f"\n\n(database: {database})"


if __name__ == "__main__":
    raise SystemExit(group_main("idempotency", run))
