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
"""

from __future__ import annotations

import argparse
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


# -- the group --------------------------------------------------------------------------------


def run(quick: bool = False) -> dict[str, Any]:
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
                f"operators.{count}.admin_warm", round(admin["warm_s"] * 1000, 1), "ms", **labels
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
        client.close()
    rec.note(
        "The reaper and the admin run with the example project's settings "
        "(django_app.settings, celery_steplock logging at INFO, to stderr, here a file: "
        "the reaper logs one summary line, and a reaped lease at DEBUG only)."
    )
    return rec.result(profiles=profiles)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", choices=["setup", "admin", "reap"])
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
        return group_main("operators", run)
    if args.op == "setup":
        result = op_setup()
    elif args.op == "admin":
        result = op_admin()
    else:
        result = op_reap(profile=os.environ.get("BENCH_PROFILE") == "1")
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
