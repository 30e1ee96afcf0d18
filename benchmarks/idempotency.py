"""Idempotency records: ours (Redis store, database store with its Redis cache) against what
users write instead, a hand-written idempotency table (``INSERT ... ON CONFLICT DO NOTHING``
plus a result column), on PostgreSQL when it is installed (else SQLite).

For each variant, two decisions, each timed per call around a body that does nothing (so the
figure is the overhead): a *first call* (a new key: lock, run, record the result) and a
*replay* (a completed key: return the recorded result); the variants take turns every
``BLOCK`` (100) calls, so a change of the machine's load falls on all of them. Figures: p50
and p99 per call (µs), and the Redis server time per decision (``INFO commandstats`` usec
after ``CONFIG RESETSTAT``, summed over every command, divided by the calls; the
hand-written table uses no Redis). Also the bare call (no idempotency) as the floor.

Server CPU per decision, per variant: ``db_cpu_us`` (first call) and ``replay_db_cpu_us``,
the CPU µs the PostgreSQL server spent per call (user + system time of the postmaster and
every child, from ``/proc/<pid>/stat``, before and after the calls:
:func:`benchmarks.e2e.tree_cpu`; clock ticks of 10 ms, so a quick run is coarse; None on
SQLite, which runs inside this process), with ``decisions_per_db_core_s`` and
``replay_decisions_per_db_core_s`` (``1e6 / µs``: the decisions one database core would
serve); and ``redis_cpu_us`` / ``replay_redis_cpu_us`` with ``decisions_per_redis_core_s``
/ ``replay_decisions_per_redis_core_s``, the Redis server's CPU (``INFO cpu``,
``used_cpu_user + used_cpu_sys``, before and after). None where a variant used no CPU of
that server (too few to measure).

    python -m benchmarks.idempotency [--quick] [--out FILE]

A full run writes ``docs/patterns/idempotency.json`` (the figures and the context); a
``--quick`` run does not (its figures are in the ``--out`` result, under ``rows``). Prints
the table; registered in ``benchmarks/run.py`` as the group ``idempotency``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import ROOT, Recorder, group_main, machine_context, percentile, servers
from benchmarks.e2e import tree_cpu

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
    db_pid = None
    if servers.PostgresServer.available():
        pg = servers.PostgresServer().start()
        env["DATABASE_URL"] = pg.url
        database = "postgresql"
        db_pid = pg.pid
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
    return {
        "redis_url": redis_server.url,
        "database": database,
        "vendor": connection.vendor,
        "db_pid": db_pid,
    }


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


def redis_cpu(client) -> float:
    """CPU seconds the Redis server used so far (``INFO cpu``: user + system)."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _per_core(cpu_us: float | None) -> float | None:
    """Decisions one core serves at ``cpu_us`` CPU µs each (None when not measured)."""
    return 1e6 / cpu_us if cpu_us else None


#: Calls per block: the variants take turns block by block (first calls, then their
#: replays), so a change of the machine's load falls on every variant alike.
BLOCK = 100


class Measure:
    """The timings and server costs of one variant, accumulated block by block."""

    def __init__(self, variant: str, call: Callable, client, db_pid: int | None):
        self.variant, self.call, self.client, self.db_pid = variant, call, client, db_pid
        self.times: dict[str, list[float]] = {"first": [], "replay": []}
        self.server = {"first": 0.0, "replay": 0.0}
        # CPU seconds of the database and Redis servers, per decision kind.
        self.cpu = {"first_db": 0.0, "replay_db": 0.0, "first_redis": 0.0, "replay_redis": 0.0}

    def phase(self, kind: str, keys: list[str]) -> None:
        client, call, times = self.client, self.call, self.times[kind]
        client.config_resetstat()
        db0 = tree_cpu(self.db_pid)["total"]
        redis0 = redis_cpu(client)
        for i, key in enumerate(keys):
            t0 = time.perf_counter()
            call(key, i)
            times.append(time.perf_counter() - t0)
        self.cpu[f"{kind}_db"] += tree_cpu(self.db_pid)["total"] - db0
        self.cpu[f"{kind}_redis"] += redis_cpu(client) - redis0
        self.server[kind] += server_usec(client)

    def row(self, rec: Recorder | None) -> dict[str, Any]:
        total = len(self.times["first"])
        per_call = {
            name: (value / total * 1e6 if value > 0 else None) for name, value in self.cpu.items()
        }
        if self.db_pid is None:
            per_call["first_db"] = per_call["replay_db"] = None
        firsts, replays = self.times["first"], self.times["replay"]
        row = {
            "variant": self.variant,
            "first_p50_us": percentile(firsts, 50) * 1e6,
            "first_p99_us": percentile(firsts, 99) * 1e6,
            "replay_p50_us": percentile(replays, 50) * 1e6,
            "replay_p99_us": percentile(replays, 99) * 1e6,
            "first_server_us": self.server["first"] / total,
            "replay_server_us": self.server["replay"] / total,
            "db_cpu_us": per_call["first_db"],
            "decisions_per_db_core_s": _per_core(per_call["first_db"]),
            "replay_db_cpu_us": per_call["replay_db"],
            "replay_decisions_per_db_core_s": _per_core(per_call["replay_db"]),
            "redis_cpu_us": per_call["first_redis"],
            "decisions_per_redis_core_s": _per_core(per_call["first_redis"]),
            "replay_redis_cpu_us": per_call["replay_redis"],
            "replay_decisions_per_redis_core_s": _per_core(per_call["replay_redis"]),
        }
        if rec is not None:
            for name, value in row.items():
                if name != "variant":
                    unit = "1/s" if name.endswith("core_s") else "us"
                    shown = None if value is None else round(value, 2)
                    rec.add(f"idempotency.{name}", shown, unit, variant=self.variant)
        return row


def measure(
    rec: Recorder | None,
    measures: list[Measure],
    calls: int,
    reps: int,
    tag: str,
) -> list[dict[str, Any]]:
    """``calls`` first calls and their replays per variant and repetition, the variants
    taking turns every :data:`BLOCK` calls; one row per variant (figures added to ``rec``)."""
    for rep in range(reps):
        for start in range(0, calls, BLOCK):
            block = range(start, min(calls, start + BLOCK))
            for kind in ("first", "replay"):
                for m in measures:
                    m.phase(kind, [f"{tag}:{m.variant}:{rep}:{i}" for i in block])
    return [m.row(rec) for m in measures]


def run(quick: bool = False) -> dict[str, Any]:
    rec = Recorder("idempotency")
    setup = _setup()
    from celery_steplock.lock import make_client

    client = make_client(setup["redis_url"])
    calls, reps = (200, 2) if quick else (2000, 3)
    db_pid = setup["db_pid"]
    calls_of = {variant: build(variant, client) for variant in VARIANTS}
    measure(None, [Measure(v, c, client, db_pid) for v, c in calls_of.items()], 50, 1, "warm")
    measures = [Measure(v, c, client, db_pid) for v, c in calls_of.items()]
    rows = measure(rec, measures, calls, reps, "run")
    for row in rows:
        rec.say(f"{row['variant']}: {row}")
    rec.note(
        f"{calls} calls x {reps} repetitions per decision, the variants taking turns every "
        f"{BLOCK} calls; database {setup['database']}; body does nothing (the figures are "
        f"the overhead)"
    )
    table = render(rows, setup["database"])
    print(table, flush=True)
    if quick:  # a smoke run never replaces the docs' figures
        return rec.result(table=table, rows=rows)
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
    return rec.result(table=table, rows=rows)


def render(rows: list[dict[str, Any]], database: str) -> str:
    head = (
        "| variant | first call p50 / p99 (µs) | replay p50 / p99 (µs) | Redis server µs "
        "per first call | per replay | database CPU µs per first call / replay | Redis CPU "
        "µs per first call / replay |"
    )
    lines = [head, "|---|---|---|---|---|---|---|"]

    def cpu(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['first_p50_us']:.0f} / {r['first_p99_us']:.0f} | "
            f"{r['replay_p50_us']:.0f} / {r['replay_p99_us']:.0f} | "
            f"{r['first_server_us']:.1f} | {r['replay_server_us']:.1f} | "
            f"{cpu(r['db_cpu_us'])} / {cpu(r['replay_db_cpu_us'])} | "
            f"{cpu(r['redis_cpu_us'])} / {cpu(r['replay_redis_cpu_us'])} |"
        )
    return "\n".join(lines) + f"\n\n(database: {database})"


if __name__ == "__main__":
    raise SystemExit(group_main("idempotency", run))
