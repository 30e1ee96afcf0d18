"""A lock name's history (celery_steplock.history, issue 30): what it costs an execution,
and the admin timeline with a million entries in Redis.

* Per execution (acquire + release of a task's lease: holder metadata, outcome on the
  release), the history on against off, on one throwaway redis-server and one connection:
  blocks of ``BLOCK`` cycles, the two stores interleaved block by block. Redis side:
  ``CONFIG RESETSTAT`` before each block, then ``INFO commandstats``: ``evalsha`` usec per
  cycle (Redis's time for the two scripts, their LPUSH and PEXPIRE included), and every
  command's usec summed. Client side: ``time.process_time()`` per cycle (this
  process's CPU: argument packing and reply parsing), and wall time. Figures are medians of
  the blocks; the ratios are medians of the per-round ratios (on / off within one round).
  A contended refusal is timed the same way (the first refusal of a grant writes an entry,
  the next only count).
* Worker share: the client CPU the history adds per execution against a StepLockedTask's
  worker CPU per task as measured by the e2e group (``docs/performance.json``,
  ``e2e.<db>.steplock.cpu`` and the in-process ``e2e.<db>.inproc.steplock.cpu`` when
  present; else the figure given with ``--task-cpu-us``).
* Admin timeline: 10,000 names x 100 entries (1,000,000; ``--quick``: 100,000) written
  in the library's format with pipelined ``RPUSH``, then the timeline page of one name
  (100 entries) with Django's test client and a superuser, in a child process: the first
  request of the process and the median of five more; ``celery steplock history NAME
  --json`` wall time; and ``RedisLeaseStore.history(name, 100)`` alone.

``python -m benchmarks.history --out /tmp/history.json [--quick]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import Recorder, median, rss_mb
from tests.support import servers

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "steplock"
BLOCK = 100


def _commandstats(client) -> dict[str, dict[str, float]]:
    return {k.removeprefix("cmdstat_"): v for k, v in client.info("commandstats").items()}


def measure_cycle(rec: Recorder, url: str, blocks: int) -> dict[str, float]:
    from celery_steplock.lock import RedisLeaseStore, holder_metadata, make_client

    client = make_client(url)
    admin = make_client(url)
    stores = {
        "on": RedisLeaseStore(client, prefix=PREFIX),
        "off": RedisLeaseStore(client, prefix=PREFIX, history=False),
    }
    meta = holder_metadata(str(uuid.uuid4()), "proj.tasks.charge", 0, worker="w1@box")
    figures: dict[str, dict[str, list[float]]] = {
        k: {"evalsha_us": [], "all_us": [], "cpu_us": [], "wall_us": [], "calls": []}
        for k in stores
    }
    ratios: dict[str, list[float]] = {"evalsha_us": [], "cpu_us": [], "wall_us": []}
    # Warm-up: scripts loaded, probe run.
    for store in stores.values():
        for _ in range(50):
            lease = store.acquire("warm", ttl=30.0, metadata=meta)
            store.release("warm", lease.owner, outcome="applied", task_id=lease.task_id)
    for round_ in range(blocks):
        order = ["on", "off"] if round_ % 2 == 0 else ["off", "on"]
        this_round: dict[str, dict[str, float]] = {}
        for kind in order:
            store = stores[kind]
            names = [f"order:{round_}:{i}" for i in range(BLOCK)]
            admin.config_resetstat()
            cpu0, wall0 = time.process_time(), time.perf_counter()
            for name in names:
                lease = store.acquire(name, ttl=30.0, metadata=meta)
                store.release(name, lease.owner, outcome="applied", task_id=lease.task_id)
            cpu = (time.process_time() - cpu0) / BLOCK * 1e6
            wall = (time.perf_counter() - wall0) / BLOCK * 1e6
            stats = _commandstats(admin)
            evalsha = stats.get("evalsha", {}).get("usec", 0) / BLOCK
            total = (
                sum(
                    v.get("usec", 0)
                    for k, v in stats.items()
                    if k not in ("config|resetstat", "info")
                )
                / BLOCK
            )
            calls = stats.get("evalsha", {}).get("calls", 0) / BLOCK
            row = {"evalsha_us": evalsha, "all_us": total, "cpu_us": cpu, "wall_us": wall}
            this_round[kind] = row
            for key, value in row.items():
                figures[kind][key].append(value)
            figures[kind]["calls"].append(calls)
        for key in ratios:
            if this_round["off"][key]:
                ratios[key].append(this_round["on"][key] / this_round["off"][key])
    out: dict[str, float] = {}
    for kind in stores:
        for key in ("evalsha_us", "all_us", "cpu_us", "wall_us", "calls"):
            value = round(median(figures[kind][key]), 2)
            out[f"{kind}.{key}"] = value
            unit = "calls" if key == "calls" else "us"
            rec.add(f"history.cycle.{kind}.{key}", value, unit, history=kind)
    for key, values in ratios.items():
        out[f"ratio.{key}"] = round(median(values), 3)
        rec.add(f"history.cycle.ratio.{key}", out[f"ratio.{key}"], "x")
    rec.say(
        "cycle (acquire + release), median of blocks: "
        + ", ".join(f"{k}={v}" for k, v in sorted(out.items()))
    )
    # A contended refusal: the first one of a grant writes an entry, the others count.
    for kind, store in stores.items():
        holder = store.acquire(f"busy:{kind}", ttl=60.0, metadata=meta)
        admin.config_resetstat()
        cpu0 = time.process_time()
        for i in range(BLOCK * 10):
            assert store.try_acquire(f"busy:{kind}", f"c{i}", 30.0, meta)[0] is None
        cpu = (time.process_time() - cpu0) / (BLOCK * 10) * 1e6
        stats = _commandstats(admin)
        us = stats.get("evalsha", {}).get("usec", 0) / (BLOCK * 10)
        rec.add(f"history.refusal.{kind}.evalsha_us", round(us, 2), "us", history=kind)
        rec.add(f"history.refusal.{kind}.cpu_us", round(cpu, 2), "us", history=kind)
        rec.say(f"refusal, history {kind}: evalsha {us:.2f} us, client CPU {cpu:.2f} us")
        store.release(f"busy:{kind}", holder.owner)
    client.close()
    admin.close()
    return out


def fill(url: str, names: int, per_name: int, batch: int = 10_000) -> float:
    """``names`` x ``per_name`` history entries in the library's format (one ``RPUSH`` of a
    name's entries and its TTL, pipelined); returns seconds."""
    import redis

    from celery_steplock.history import SEPARATOR

    client = redis.Redis.from_url(url)
    seconds, _micros = client.time()
    now_ms = int(seconds) * 1000
    t0 = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    queued = 0
    for n in range(names):
        key = f"{PREFIX}:history:{{order:{n}}}"
        entries = []
        for i in range(per_name):  # newest first: a release, then its grant, ...
            ms = str(now_ms - i * 1000)
            fence = str(1_700_000_000_000_000 + per_name - i // 2)
            owner = f"owner-{n}-{per_name - i // 2}"
            if i % 2 == 0:
                fields = [ms, "released", owner, fence, str(uuid.UUID(int=i)), "applied", "0"]
            else:
                fields = [ms, "acquired", owner, fence, str(uuid.UUID(int=i))]
            entries.append(SEPARATOR.join(fields))
        pipe.rpush(key, *entries)
        pipe.pexpire(key, 7 * 24 * 3600 * 1000)
        queued += per_name
        if queued >= batch:
            pipe.execute()
            queued = 0
    pipe.execute()
    client.close()
    return time.perf_counter() - t0


def child_env(url: str, sqlite: str, vardir: str) -> dict[str, str]:
    from benchmarks.operators import child_env as operators_env

    return operators_env(url, sqlite, vardir)


def run_child(op: str, env: dict[str, str], *extra: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.history", "--op", op, *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=900,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"history --op {op} failed: {proc.stderr.decode()[-2000:]}")
    return json.loads(proc.stdout.decode().strip().splitlines()[-1])


def op_setup() -> dict[str, Any]:
    from benchmarks.operators import op_setup as operators_setup

    return operators_setup()


def op_page(name: str) -> dict[str, Any]:
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.test import Client
    from django.urls import reverse

    client = Client()
    client.force_login(get_user_model().objects.get(username="bench"))
    url = reverse("admin:celery_steplock_lease_timeline") + f"?name={name}"
    rss_before = rss_mb()
    t0 = time.perf_counter()
    response = client.get(url)
    first = time.perf_counter() - t0
    rows = response.content.count(b'data-id="')
    warm = []
    for _ in range(5):
        t0 = time.perf_counter()
        again = client.get(url)
        warm.append(time.perf_counter() - t0)
        assert again.status_code == 200, again.status_code
    from celery_steplock.contrib.django.leases import lease_lock

    store = lease_lock()
    reads = []
    for _ in range(20):
        t0 = time.perf_counter()
        entries = store.history(name, 100)
        reads.append(time.perf_counter() - t0)
    return {
        "status": response.status_code,
        "rows": rows,
        "entries": len(entries),
        "first_s": first,
        "warm_s": median(warm),
        "read_s": median(reads),
        "rss_growth_mb": rss_mb() - rss_before,
    }


def task_cpu_us(default: float | None) -> list[tuple[str, float]]:
    """A StepLockedTask's worker CPU per task (``e2e.<db>.steplock.cpu``) and per in-process
    call (``e2e.<db>.inproc.steplock.cpu``: the stricter reference) from the e2e group's
    figures in docs/performance.json; ``[("--task-cpu-us", default)]`` when absent."""
    path = ROOT / "docs" / "performance.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    found = []
    for figure in data.get("figures", []):
        name = str(figure.get("name", ""))
        parts = name.split(".")
        if (
            parts[0] == "e2e"
            and name.endswith(".steplock.cpu")
            and isinstance(figure.get("value"), (int, float))
        ):
            found.append((f"docs/performance.json {name}", float(figure["value"])))
    if not found and default:
        found.append(("--task-cpu-us", default))
    return found


def run(quick: bool = False, task_cpu: float | None = None) -> dict[str, Any]:
    rec = Recorder("history")
    names, per_name = (1_000, 100) if quick else (10_000, 100)
    with tempfile.TemporaryDirectory(prefix="steplock-bench-history-") as tmp:
        with servers.RedisServer() as server:
            cycle = measure_cycle(rec, server.url, 10 if quick else 60)
            # The larger of the medians' difference and what the median of the rounds'
            # ratios gives (either may come out below zero on a loaded machine).
            added_cpu = max(
                cycle["on.cpu_us"] - cycle["off.cpu_us"],
                (cycle["ratio.cpu_us"] - 1.0) * cycle["off.cpu_us"],
                0.0,
            )
            rec.add("history.cycle.added_cpu_us", round(added_cpu, 2), "us")
            for source, reference in task_cpu_us(task_cpu):
                share = 100.0 * max(added_cpu, 0.0) / reference
                rec.add(
                    "history.worker_share",
                    round(share, 2),
                    "%",
                    reference_us=reference,
                    reference=source,
                )
                rec.note(
                    f"the history adds {added_cpu:.2f} us of client CPU per execution: "
                    f"{share:.2f}% of {reference:.0f} us ({source})"
                )
            admin_client = __import__("redis").Redis.from_url(server.url)
            admin_client.flushdb()
            admin_client.close()
            build = fill(server.url, names, per_name)
            rec.add("history.fill", round(build, 1), "s", entries=names * per_name)
            rec.say(f"{names * per_name} entries over {names} names written in {build:.1f} s")
            env = child_env(server.url, str(Path(tmp) / "h.sqlite3"), tmp)
            run_child("setup", env)
            page = run_child("page", env, "--name", f"order:{names // 2}")
            for key in ("first_s", "warm_s", "read_s"):
                rec.add(
                    f"history.page.{key.removesuffix('_s')}",
                    round(page[key] * 1000, 1),
                    "ms",
                    entries=names * per_name,
                    rows=page["rows"],
                )
            rec.say(f"admin timeline: {page}")
            walls = []
            for _ in range(3):
                t0 = time.perf_counter()
                out = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "celery",
                        "-A",
                        "django_app",
                        "steplock",
                        "history",
                        f"order:{names // 2}",
                        "--json",
                        "--count",
                        "100",
                    ],
                    cwd=ROOT,
                    env=env,
                    capture_output=True,
                    timeout=300,
                )
                walls.append(time.perf_counter() - t0)
                assert out.returncode == 0, out.stderr[-2000:]
                assert len(json.loads(out.stdout)) == 100
            rec.add("history.cli_wall", round(median(walls) * 1000), "ms")
            memory = __import__("redis").Redis.from_url(server.url).info("memory")
            rec.add(
                "history.redis_bytes_per_entry",
                round(memory["used_memory"] / (names * per_name), 1),
                "bytes",
            )
    return rec.result()


def main() -> int:
    parser = argparse.ArgumentParser(description="celery-steplock benchmark group history")
    parser.add_argument("--op", choices=["setup", "page"])
    parser.add_argument("--name")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--task-cpu-us", type=float, default=None)
    args = parser.parse_args()
    if args.op == "setup":
        print(json.dumps(op_setup(), default=str))
        return 0
    if args.op == "page":
        print(json.dumps(op_page(args.name), default=str))
        return 0
    from benchmarks.common import write_result

    return write_result(
        "history", lambda: run(quick=args.quick, task_cpu=args.task_cpu_us), args.out
    )


if __name__ == "__main__":
    raise SystemExit(main())
