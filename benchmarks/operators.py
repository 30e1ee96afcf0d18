"""Group 5: the operators' paths with many leases in Redis.

Leases are written straight into a throwaway redis-server in the library's format
(``steplock:lease:{<name>}`` hashes with owner, fence, task id and name, worker, hostname, pid,
step, acquired/renewed times and TTL, each with a PEXPIRE), pipelined, for each scale (0, then
10,000 and 100,000). Every lease names this host and a pid that no longer exists (pids of
short-lived processes started and reaped here), so the reaper may remove every one of them.

Measured at each scale, each in a process of its own (so its peak RSS is its own):

* the first page of the Django admin's "Held leases" (``admin:celery_steplock_lease_changelist``)
  with Django's test ``Client`` and a superuser: the first request of the process and the
  median of the next five;
* ``celery -A django_app steplock ls --limit 100`` as a subprocess: wall time (median of 3,
  interpreter and imports included) and its peak RSS;
* ``celery_steplock.reaper.reap(app)`` on all of them: time, leases reaped, peak RSS.

Peak RSS that does not grow with the number of leases means the path pages with SCAN.

Then the "pages" section (issue 30: "With 100,000 leases and 1,000,000 history entries, each
page's first view stays under one second"): one Redis holding at once 100,000 leases, the
histories of 10,000 of their names (100 entries each: 1,000,000 entries), 100,000 keys of
each pattern (sliding-window rate limits, concurrency slots, circuit breakers, idempotency
records) and an hour of activity (60 minutes x 20 tasks), all planted with pipelines in the
library's key formats. Each admin page (Held leases, a name's timeline, Rate limits,
Concurrency limits, Circuit breakers, Idempotency records, Activity) is viewed first in a
process of its own (Django test client, superuser, ``steplock_activity`` on): the first
request's wall time, a second one's, and the Redis commands and server microseconds of the
first (``INFO commandstats`` around it, the INFO calls taken out), which do not move with
the machine's load. ``--section pages`` runs this section alone (``--section scales`` the
other one); ``--quick`` plants a tenth of everything.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from .common import (
    ROOT,
    Recorder,
    median,
    peak_rss_mb,
    profile_breakdown,
    profile_text,
    rss_mb,
    servers,
)

PREFIX = "steplock"

#: Where the reaper spends its time (profile categories; they may overlap).
REAP_CATEGORIES = {
    "scan": lambda f, fn: f.endswith("celery_steplock/lock.py") and fn in ("scan", "iter_leases"),
    "reap_round_trips": lambda f, fn: (
        f.endswith("celery_steplock/lock.py") and fn in ("release", "reap", "reap_many")
    ),
    "events_and_logging": lambda f, fn: f.endswith("celery_steplock/events.py"),
    "pid_checks": lambda f, fn: f.endswith("celery_steplock/reaper.py") and fn == "pid_alive",
}


def dead_pids(count: int) -> list[int]:
    """Pids of processes that ran and were reaped just now (Linux hands pids out in order,
    so they are not reused until the pid space wraps around)."""
    pids = []
    for _ in range(count):
        proc = subprocess.Popen(["true"])
        proc.wait()
        pids.append(proc.pid)
    return pids


def build_leases(url: str, count: int, batch: int = 5000) -> float:
    import redis

    client = redis.Redis.from_url(url)
    client.flushdb()
    host = socket.gethostname()
    pids = dead_pids(50)
    now_ms = int(time.time() * 1000)
    t0 = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for i in range(count):
        name = f"order:{i}"
        key = f"{PREFIX}:lease:{{{name}}}"
        pid = pids[i % len(pids)]
        pipe.hset(
            key,
            mapping={
                "owner": uuid.uuid4().hex,
                "fence": str(now_ms * 1000 + i),
                "task_id": str(uuid.uuid4()),
                "task_name": "shop.tasks.charge_order",
                "hostname": host,
                "pid": str(pid),
                "retries": "0",
                "worker": f"celery@{host}-gone-{pid}",
                "step": f"workflows.step:{i}",
                "acquired_ms": str(now_ms - 60000 + i % 1000),
                "renewed_ms": str(now_ms - 50000),
                "ttl_ms": "30000",
            },
        )
        pipe.pexpire(key, 3_600_000)
        if (i + 1) % batch == 0:
            pipe.execute()
    pipe.execute()
    elapsed = time.perf_counter() - t0
    client.close()
    return elapsed


def child_env(url: str, sqlite: str, vardir: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("DATABASE_URL", None)
    env.update(
        {
            "DJANGO_SETTINGS_MODULE": "django_app.settings",
            "REDIS_URL": url,
            "STEPLOCK_SQLITE": sqlite,
            "STEPLOCK_VAR_DIR": vardir,
            "STEPLOCK_LOG_LEVEL": os.environ.get("STEPLOCK_LOG_LEVEL", "INFO"),
            "DJANGO_ALLOWED_HOSTS": "localhost,127.0.0.1,testserver",
            "PYTHONPATH": str(ROOT),
        }
    )
    return env


def run_child(
    op: str, env: dict[str, str], extra: list[str] | None = None, stderr_path: Path | None = None
) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.operators", "--op", op, *(extra or [])]
    with open(stderr_path or os.devnull, "ab") as err:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, timeout=900
        )
    if proc.returncode != 0:
        tail = Path(stderr_path).read_text()[-2000:] if stderr_path else ""
        raise RuntimeError(f"operators --op {op} failed (exit {proc.returncode}): {tail}")
    return json.loads(proc.stdout.decode().strip().splitlines()[-1])


def run_ls(env: dict[str, str]) -> tuple[float, float, int]:
    """Wall time (s), peak RSS (MiB) and leases shown of ``celery steplock ls --limit 100``."""
    cmd = [sys.executable, "-m", "celery", "-A", "django_app", "steplock", "ls", "--limit", "100"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    out = proc.stdout.read()
    _pid, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    lines = out.decode(errors="replace").splitlines()
    shown = sum(1 for line in lines if line.startswith("order:"))
    if proc.returncode != 0:
        raise RuntimeError(f"steplock ls exited {proc.returncode}")
    return wall, usage.ru_maxrss / 1024.0, shown


# -- child operations (python -m benchmarks.operators --op ...) --------------------------------


def op_setup() -> dict[str, Any]:
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    user_model = get_user_model()
    if not user_model.objects.filter(username="bench").exists():
        user_model.objects.create_superuser("bench", "bench@example.com", "bench")
    return {"ok": True}


def op_admin() -> dict[str, Any]:
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.test import Client
    from django.urls import reverse

    client = Client()
    client.force_login(get_user_model().objects.get(username="bench"))
    url = reverse("admin:celery_steplock_lease_changelist")
    rss_before = rss_mb()
    t0 = time.perf_counter()
    response = client.get(url)
    first = time.perf_counter() - t0
    rows = response.content.count(b"<tr data-lease=")
    warm = []
    for _ in range(5):
        t0 = time.perf_counter()
        r = client.get(url)
        warm.append(time.perf_counter() - t0)
        assert r.status_code == 200, r.status_code
    return {
        "status": response.status_code,
        "rows": rows,
        "first_s": first,
        "warm_s": median(warm),
        "rss_before_mb": rss_before,
        "peak_rss_mb": peak_rss_mb(),
    }


def op_reap(profile: bool) -> dict[str, Any]:
    import django

    django.setup()
    from celery_steplock.reaper import reap
    from django_app.celery import app

    rss_before = rss_mb()
    profiler = None
    if profile:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.001)
        profiler.start()
    t0 = time.perf_counter()
    report = reap(app)
    elapsed = time.perf_counter() - t0
    out = {
        "elapsed_s": elapsed,
        "scanned": report.leases_scanned,
        "reaped": report.reaped_count,
        "errors": report.errors[:3],
        "rss_before_mb": rss_before,
        "peak_rss_mb": peak_rss_mb(),
    }
    if profiler is not None:
        profiler.stop()
        out["profile"] = profile_text(profiler)
        out["breakdown"] = profile_breakdown(profiler.last_session, REAP_CATEGORIES)
    return out


# -- the pages section: every pattern's keys in one Redis ----------------------------------------

#: The admin pages timed by the pages section: label -> URL name (the timeline gets ``?name=``).
PAGES = {
    "leases": "admin:celery_steplock_lease_changelist",
    "timeline": "admin:celery_steplock_lease_timeline",
    "rates": "admin:celery_steplock_ratelimitstate_changelist",
    "slots": "admin:celery_steplock_concurrencylimitstate_changelist",
    "breakers": "admin:celery_steplock_circuitbreakerstate_changelist",
    "records": "admin:celery_steplock_idempotencyrecord_changelist",
    "activity": "admin:celery_steplock_activity_changelist",
}

#: The name whose timeline is viewed: it holds a lease and 100 history entries.
TIMELINE_NAME = "order:0"


def plant(url: str, commands: Any, batch: int = 5000) -> tuple[int, float]:
    """Send ``commands`` (``(command, *args)`` tuples) pipelined, ``batch`` at a time.
    Returns how many were sent and the seconds it took."""
    import redis

    client = redis.Redis.from_url(url)
    t0 = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    sent = 0
    for command in commands:
        pipe.execute_command(*command)
        sent += 1
        if sent % batch == 0:
            pipe.execute()
    pipe.execute()
    client.close()
    return sent, time.perf_counter() - t0


def history_commands(names: int, per_name: int, now_ms: int) -> Any:
    """One ``RPUSH`` of ``per_name`` entries (newest first, as the lease scripts' ``LPUSH``
    leaves them: acquired / released pairs, a minute apart, within the last week) and one
    ``PEXPIRE`` per name of ``order:<i>``."""
    from celery_steplock.history import SEPARATOR
    from celery_steplock.keys import history_key

    for i in range(names):
        key = history_key(PREFIX, f"order:{i}")
        entries = []
        for n in range(per_name):
            execution = n // 2
            owner = f"{i:08x}{execution:024x}"
            ms = now_ms - (n * 60_000) - 1000
            fence = str(10_000_000 + i * per_name + per_name - execution)
            if n % 2 == 0:  # the newer entry of the pair: its release
                fields = [str(ms), "released", owner, fence, f"task-{i}-{execution}", "committed"]
            else:
                fields = [str(ms), "acquired", owner, fence, f"task-{i}-{execution}"]
            entries.append(SEPARATOR.join(fields))
        yield ("RPUSH", key, *entries)
        yield ("PEXPIRE", key, 7 * 24 * 3600 * 1000)


def pattern_commands(count: int, now_ms: int) -> dict[str, Any]:
    """``count`` keys of each pattern, as tests/contrib/test_admin_patterns.py plants them:
    a sliding window's log (``ZADD``), concurrency slots (two a limit), breakers and Redis
    idempotency records (``HSET``)."""
    from celery_steplock.keys import (
        breaker_key,
        idempotency_record_key,
        rate_limit_keys,
        slot_key,
    )

    owner = uuid.uuid4().hex
    meta = '{"kind":"slot","limit":"2","task_name":"shop.tasks.report"}'
    return {
        "rates": (
            ("ZADD", rate_limit_keys(PREFIX, "sw", "10:60.0", f"k{i}")[0], now_ms, f"g{i}")
            for i in range(count)
        ),
        "slots": (
            (
                "HSET",
                slot_key(PREFIX, f"lim{i // 2}", i % 2),
                "owner",
                owner,
                "fence",
                "1",
                "acquired_ms",
                str(now_ms),
                "meta",
                meta,
            )
            for i in range(count)
        ),
        "breakers": (
            ("HSET", breaker_key(PREFIX, f"b{i}"), "state", "closed") for i in range(count)
        ),
        "records": (
            (
                "HSET",
                idempotency_record_key(PREFIX, f"{i:064x}"),
                "status",
                "completed",
                "ns",
                "orders",
            )
            for i in range(count)
        ),
    }


def activity_commands(minutes: int, tasks: int, now_s: float) -> Any:
    """The last ``minutes`` minutes of ``tasks`` tasks, as tests/contrib/test_admin_activity.py
    plants them (every counter, 6 wait and 6 hold buckets a minute)."""
    from celery_steplock.activity import activity_key

    last = int(now_s) // 60
    for minute in range(last - minutes + 1, last + 1):
        fields: list[str] = []
        for task in range(tasks):
            name = f"shop.task_{task}"
            for metric in ("exec", "contended", "conflict", "duplicate"):
                fields += [f"{name}|{metric}|", str(1 + (minute + task) % 9)]
            for bucket in range(6):
                fields += [f"{name}|wait|{bucket * 3}", str(1 + bucket)]
                fields += [f"{name}|hold|{bucket * 4 + 10}", str(2 + bucket)]
        yield ("HSET", activity_key(PREFIX, minute), *fields)


def build_pages(url: str, leases: int, history_names: int, per_key: int) -> dict[str, Any]:
    """Flush, then plant everything the pages section reads. Returns what was planted
    (commands and seconds per kind) and Redis's ``used_memory`` after."""
    import redis

    out: dict[str, Any] = {"leases_s": build_leases(url, leases)}
    client = redis.Redis.from_url(url)
    seconds, micros = client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    sent, took = plant(url, history_commands(history_names, 100, now_ms), batch=200)
    out["history_s"] = took
    for kind, commands in pattern_commands(per_key, now_ms).items():
        sent, took = plant(url, commands)
        out[f"{kind}_s"] = took
    plant(url, activity_commands(60, 20, now_ms / 1000.0), batch=10)
    out["keys"] = client.dbsize()
    out["used_memory_mb"] = client.info("memory")["used_memory"] / 2**20
    client.close()
    return out


def commandstats(client: Any) -> tuple[int, int]:
    """Calls and server microseconds of every command so far, ``INFO`` itself left out."""
    stats = client.info("commandstats")
    calls = sum(v["calls"] for k, v in stats.items() if k != "cmdstat_info")
    usec = sum(v["usec"] for k, v in stats.items() if k != "cmdstat_info")
    return calls, usec


def op_page(page: str) -> dict[str, Any]:
    """The first and second view of one admin page in this fresh process."""
    import django

    django.setup()
    import redis
    from django.contrib.auth import get_user_model
    from django.test import Client
    from django.urls import reverse

    from django_app.celery import app

    app.conf.steplock_activity = True  # the Activity page reads only when it is on
    client = Client()
    client.force_login(get_user_model().objects.get(username="bench"))
    url = reverse(PAGES[page])
    if page == "timeline":
        url += "?" + urlencode({"name": TIMELINE_NAME})
    stats_client = redis.Redis.from_url(os.environ["REDIS_URL"])
    calls0, usec0 = commandstats(stats_client)
    t0 = time.perf_counter()
    response = client.get(url)
    first = time.perf_counter() - t0
    calls1, usec1 = commandstats(stats_client)
    t0 = time.perf_counter()
    again = client.get(url)
    second = time.perf_counter() - t0
    stats_client.close()
    html = response.content
    return {
        "status": response.status_code,
        "status_again": again.status_code,
        "first_s": first,
        "second_s": second,
        "redis_commands": calls1 - calls0,
        "redis_usec": usec1 - usec0,
        "html_kib": len(html) / 1024.0,
        "rows": html.count(b"<tr"),
    }


def run_pages(rec: Recorder, url: str, env: dict[str, str], tmpdir: Path, quick: bool) -> None:
    leases, history_names, per_key = (
        (10_000, 1_000, 10_000) if quick else (100_000, 10_000, 100_000)
    )
    labels = dict(leases=leases, history_entries=history_names * 100, keys_per_pattern=per_key)
    built = build_pages(url, leases, history_names, per_key)
    rec.add(
        "operators.pages.build",
        round(sum(v for k, v in built.items() if k.endswith("_s")), 1),
        "s",
        **labels,
        keys=built["keys"],
        used_memory_mb=round(built["used_memory_mb"]),
    )
    lines = []
    for page in PAGES:
        out = run_child("page", env, ["--page", page], stderr_path=tmpdir / f"page-{page}.err")
        first_ms = out["first_s"] * 1000
        rec.add(
            f"operators.pages.{page}.first",
            round(first_ms, 1),
            "ms",
            **labels,
            status=out["status"],
            under_1s=first_ms < 1000,
            html_kib=round(out["html_kib"]),
            rows=out["rows"],
        )
        rec.add(f"operators.pages.{page}.second", round(out["second_s"] * 1000, 1), "ms", **labels)
        rec.add(
            f"operators.pages.{page}.redis_commands", out["redis_commands"], "commands", **labels
        )
        rec.add(f"operators.pages.{page}.redis_server_us", out["redis_usec"], "us", **labels)
        lines.append(
            f"{page} {first_ms:.0f} ms (second {out['second_s'] * 1000:.0f}, "
            f"{out['redis_commands']} commands, {out['redis_usec']} us in Redis, "
            f"status {out['status']})"
        )
    rec.say(
        f"pages, {leases} leases + {history_names * 100} history entries + {per_key} keys of "
        f"each pattern ({built['keys']} keys, {built['used_memory_mb']:.0f} MiB): first views: "
        + "; ".join(lines)
    )
    rec.note(
        "Pages: each admin page's first view in a process of its own, one Redis holding the "
        "leases, the histories, the four patterns' keys and an hour of activity at once; "
        "issue 30 asks each under one second."
    )


# -- the group --------------------------------------------------------------------------------


#: The sections of the group, in the order they run.
SECTIONS = ("scales", "pages")


def run(quick: bool = False, sections: tuple[str, ...] = SECTIONS) -> dict[str, Any]:
    import redis

    rec = Recorder("operators")
    scales = [0, 2000, 10000] if quick else [0, 10000, 100000]
    profiles: dict[str, str] = {}
    with (
        tempfile.TemporaryDirectory(prefix="steplock-bench-ops-") as tmp,
        servers.RedisServer() as server,
    ):
        tmpdir = Path(tmp)
        env = child_env(server.url, str(tmpdir / "ops.sqlite3"), str(tmpdir))
        run_child("setup", env, stderr_path=tmpdir / "setup.err")
        client = redis.Redis.from_url(server.url)
        if "scales" in sections:
            for count in scales:
                build_s = build_leases(server.url, count)
                labels = dict(leases=count)
                rec.add(f"operators.{count}.build", round(build_s, 2), "s", **labels)
                admin = run_child("admin", env, stderr_path=tmpdir / "admin.err")
                rec.add(
                    f"operators.{count}.admin_first",
                    round(admin["first_s"] * 1000, 1),
                    "ms",
                    **labels,
                    status=admin["status"],
                    rows=admin["rows"],
                )
                rec.add(
                    f"operators.{count}.admin_warm",
                    round(admin["warm_s"] * 1000, 1),
                    "ms",
                    **labels,
                )
                rec.add(
                    f"operators.{count}.admin_rss_growth",
                    round(admin["peak_rss_mb"] - admin["rss_before_mb"], 1),
                    "MiB",
                    **labels,
                )
                rec.add(
                    f"operators.{count}.admin_peak_rss",
                    round(admin["peak_rss_mb"], 1),
                    "MiB",
                    **labels,
                )
                ls_runs = [run_ls(env) for _ in range(3)]
                rec.add(
                    f"operators.{count}.ls_wall",
                    round(median(r[0] for r in ls_runs) * 1000),
                    "ms",
                    **labels,
                    shown=ls_runs[0][2],
                )
                rec.add(
                    f"operators.{count}.ls_peak_rss",
                    round(median(r[1] for r in ls_runs), 1),
                    "MiB",
                    **labels,
                )
                reap_out = run_child("reap", env, stderr_path=tmpdir / f"reap-{count}.err")
                left = sum(1 for _ in client.scan_iter(match=f"{PREFIX}:lease:*", count=1000))
                rec.add(
                    f"operators.{count}.reap",
                    round(reap_out["elapsed_s"], 2),
                    "s",
                    **labels,
                    reaped=reap_out["reaped"],
                    scanned=reap_out["scanned"],
                    left=left,
                    errors=reap_out["errors"],
                )
                rec.add(
                    f"operators.{count}.reap_rss_growth",
                    round(reap_out["peak_rss_mb"] - reap_out["rss_before_mb"], 1),
                    "MiB",
                    **labels,
                )
                rec.add(
                    f"operators.{count}.reap_peak_rss",
                    round(reap_out["peak_rss_mb"], 1),
                    "MiB",
                    **labels,
                )
                rec.add(f"operators.{count}.reaped", reap_out["reaped"], "leases", **labels)
                log_lines = sum(1 for _ in open(tmpdir / f"reap-{count}.err", errors="replace"))
                rec.add(f"operators.{count}.reap_log_lines", log_lines, "lines", **labels)
                rec.say(
                    f"{count} leases: built in {build_s:.1f}s; admin first "
                    f"{admin['first_s'] * 1000:.0f} ms ({admin['rows']} rows), warm "
                    f"{admin['warm_s'] * 1000:.0f} ms; ls {median(r[0] for r in ls_runs):.2f}s; "
                    f"reap {reap_out['elapsed_s']:.2f}s ({reap_out['reaped']} reaped, "
                    f"{left} left), reap RSS +"
                    f"{reap_out['peak_rss_mb'] - reap_out['rss_before_mb']:.0f} MiB"
                )
            # A profile of the reaper on the middle scale (profiling slows it down).
            count = scales[1]
            build_leases(server.url, count)
            prof = run_child(
                "reap", {**env, "BENCH_PROFILE": "1"}, stderr_path=tmpdir / "reap-profile.err"
            )
            profiles[f"reaper-{count}"] = prof.get("profile", "")
            for name, share in (prof.get("breakdown") or {}).items():
                if name != "total_s":
                    rec.add(
                        f"operators.profile.reap.{name}",
                        round(share * 100, 1),
                        "% of time",
                        leases=count,
                    )
        if "pages" in sections:
            run_pages(rec, server.url, env, tmpdir, quick)
        client.close()
    rec.note(
        "The reaper and the admin run with the example project's settings "
        "(django_app.settings, celery_steplock logging at INFO, to stderr, here a file: "
        "the reaper logs one summary line, and a reaped lease at DEBUG only)."
    )
    return rec.result(profiles=profiles)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", choices=["setup", "admin", "reap", "page"])
    parser.add_argument("--page", choices=list(PAGES))
    parser.add_argument(
        "--section", action="append", choices=SECTIONS, help="run only these (default: all)"
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.op is None:
        from .common import group_main

        sys.argv = (
            [sys.argv[0]]
            + (["--quick"] if args.quick else [])
            + (["--out", args.out] if args.out else [])
        )
        sections = tuple(args.section or SECTIONS)
        return group_main("operators", functools.partial(run, sections=sections))
    if args.op == "setup":
        result = op_setup()
    elif args.op == "admin":
        result = op_admin()
    elif args.op == "page":
        result = op_page(args.page)
    else:
        result = op_reap(profile=os.environ.get("BENCH_PROFILE") == "1")
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
