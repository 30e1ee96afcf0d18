"""Cluster-wide rate limits against what a user would pick instead, side by side in one run.

    python -m benchmarks.ratelimit [--quick] [--out FILE]   (or benchmarks/run.py --only ratelimit)

Compared: our sliding window and token bucket (celery_steplock.patterns.ratelimit), the ``limits``
library's Redis storage (moving window, fixed window), Celery's per-worker ``rate_limit``
(kombu's token bucket, one per worker, as Celery keeps it), and a hand-written
``INCR`` + ``EXPIRE`` counter (the window starts at the first ``INCR``).

Figures:

* decision latency (p50, p99, microseconds): one process deciding back to back, limit 1000
  per second (most decisions in a tight loop are denials; the share admitted is printed);
* Redis server time per decision (microseconds): every top-level command's execution time
  from ``SLOWLOG`` (``slowlog-log-slower-than 0``; a script counts once, its inner commands
  included, and network and parsing are left out), summed and divided by the decisions
  (:func:`server_time`);
* Redis CPU per decision (microseconds): the server process's CPU time (``INFO cpu``:
  ``used_cpu_user + used_cpu_sys``, so its network reads and writes too) over back-to-back
  decisions, SLOWLOG off, the methods taken in turn for a few rounds (so a load on the shared
  machine falls on each alike), the median round (:func:`redis_cpu`); and its inverse, the
  decisions one Redis core can take per second;
* accuracy: 1, 2 and 8 worker processes each asking as fast as they can (a 2 ms pause after a
  denial) for a few seconds against one limit of 20 per second: the largest number of
  admissions certainly inside one 1 s window (:func:`proven_max`: a lower bound, so above 20
  proves a violation however late a loaded client reads its clock), for ours also the
  largest number by the decisions' own Redis times (exact,
  :func:`tests.support.oracles.max_in_window`), and the mean rate, against 20;
* an edge burst: one request opens a window, then two processes flood from 90 % of it on
  (what a fixed window lets through twice).

Writes ``docs/patterns/ratelimit.json`` (a full run; ``--quick`` writes
``var/bench-quick/ratelimit.json``) and prints the tables.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import Recorder, group_main, machine_context, percentile, version_of  # noqa: E402
from tests.support import servers  # noqa: E402

LIMIT, WINDOW = 20, 1.0  # accuracy runs: 20 per second
LATENCY_LIMIT = 1000  # latency runs: 1000 per second
#: Methods that ask no Redis (their Redis CPU per decision is 0, their decisions per core None).
NO_REDIS = frozenset({"celery"})
WORKERS = (1, 2, 8)

METHODS = {
    "ours_window": "ours: SlidingWindow (exact log, Lua)",
    "ours_bucket": "ours: TokenBucket (capacity 1, Lua)",
    "limits_moving": "limits: MovingWindowRateLimiter (Redis)",
    "limits_fixed": "limits: FixedWindowRateLimiter (Redis)",
    "celery": "Celery rate_limit (per worker)",
    "incr_expire": "hand-written INCR + EXPIRE",
}


def decider(
    method: str, url: str, limit: int, window: float, key: str
) -> Callable[[], tuple[bool, float | None]]:
    """A fresh decision function of ``method`` (its own client): ``(admitted, the Redis time
    of the decision in seconds, or None when the method does not tell it)``."""
    if method in ("ours_window", "ours_bucket"):
        from celery_steplock.lock import make_client
        from celery_steplock.patterns.ratelimit import SlidingWindow, TokenBucket

        client = make_client(url)
        limiter = (
            SlidingWindow(limit, window, client=client, prefix="bench")
            if method == "ours_window"
            else TokenBucket(limit / window, capacity=1, client=client, prefix="bench")
        )

        def decide() -> tuple[bool, float | None]:
            decision = limiter.try_acquire(key)
            return decision.allowed, decision.now

        return decide
    if method in ("limits_moving", "limits_fixed"):
        from limits import RateLimitItemPerSecond
        from limits.storage import storage_from_string
        from limits.strategies import FixedWindowRateLimiter, MovingWindowRateLimiter

        storage = storage_from_string(url)
        strategy = (
            MovingWindowRateLimiter if method == "limits_moving" else FixedWindowRateLimiter
        )(storage)
        item = RateLimitItemPerSecond(limit, int(window))
        return lambda: (strategy.hit(item, key), None)
    if method == "celery":
        from kombu.utils.limits import TokenBucket as KombuBucket

        bucket = KombuBucket(limit / window, capacity=1)  # what a worker keeps per task
        return lambda: (bucket.can_consume(1), None)
    if method == "incr_expire":
        import redis

        client = redis.Redis.from_url(url)
        ttl = max(1, int(window))
        name = f"bench:incr:{key}"

        def decide() -> tuple[bool, float | None]:
            count = client.incr(name)
            if count == 1:
                client.expire(name, ttl)
            return count <= limit, None

        return decide
    raise ValueError(method)


def _worker(
    method: str,
    url: str,
    key: str,
    start: float,
    seconds: float,
    queue,
    first: bool = False,
    pattern: str = "steady",
) -> None:
    decide = decider(method, url, LIMIT, WINDOW, key)
    times = []
    while time.time() < start:
        time.sleep(0.001)
    if pattern == "edge":
        # One request opens a window; the flood comes at 90 % of it and goes on past its end.
        began = time.time()
        if first:
            admitted, server = decide()
            if admitted:
                times.append((began, time.time(), server))
        start += 0.9 * WINDOW
        while time.time() < start:
            time.sleep(0.001)
    end = start + seconds
    while time.time() < end:
        began = time.time()
        admitted, server = decide()
        if admitted:
            times.append((began, time.time(), server))
        else:
            time.sleep(0.002)
    queue.put(times)


def accuracy(
    method: str, url: str, workers: int, seconds: float, run: int, pattern: str = "steady"
) -> list[tuple[float, float, float | None]]:
    """Admissions of ``workers`` processes on one limit for ``seconds``, each as ``(sent,
    answered, Redis time or None)``, seconds; ``pattern``
    "steady" (every process asks all along) or "edge" (one request, then every process
    floods from 90 % of the window on)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    start = time.time() + 1.5 + 0.2 * workers  # every process imported and connected
    procs = [
        ctx.Process(
            target=_worker,
            args=(method, url, f"acc{run}-{pattern}", start, seconds, queue, i == 0, pattern),
        )
        for i in range(workers)
    ]
    for proc in procs:
        proc.start()
    times = []
    for _ in procs:
        times.extend(queue.get(timeout=seconds + 60))
    for proc in procs:
        proc.join(10)
    return sorted(times)


def proven_max(admissions, window: float) -> int:
    """The largest number of admissions that certainly fell in one window ``[a, a +
    window)``: each happened somewhere between its request's sending and its answer, and only
    those wholly inside the window are counted. A lower bound of the true largest count, so a
    figure above the limit proves the limit was exceeded (a busy client that answers late
    cannot fake it), while a figure at or below it proves nothing alone."""
    spans = sorted((sent, answered) for sent, answered, _ in admissions)
    best = 0
    for i, (start, _) in enumerate(spans):
        inside = sum(1 for sent, answered in spans[i:] if answered < start + window)
        best = max(best, inside)
    return best


def latency(method: str, url: str, count: int) -> dict[str, float]:
    import redis

    admin = redis.Redis.from_url(url)
    decide = decider(method, url, LATENCY_LIMIT, 1.0, f"lat-{method}")
    for _ in range(50):
        decide()  # connections made, scripts loaded
    samples, admitted = [], 0
    for _ in range(count):
        began = time.perf_counter()
        admitted += bool(decide()[0])
        samples.append(time.perf_counter() - began)
    server_us, commands = server_time(admin, decide, min(count, 1000))
    return {
        "p50_us": percentile(samples, 50) * 1e6,
        "p99_us": percentile(samples, 99) * 1e6,
        "server_us": server_us,
        "commands": commands,
        "admitted": admitted / count,
    }


def server_time(admin, decide: Callable[[], bool], count: int) -> tuple[float, float]:
    """Redis execution time per decision (microseconds) and top-level commands per decision,
    from SLOWLOG with every command logged. Redis 7 logs a script's inner commands too (each
    before its EVALSHA, whose duration includes theirs): in a decision that ran a script only
    the scripts count. An ``ECHO`` on another connection after each decision separates them."""
    admin.config_set("slowlog-log-slower-than", 0)
    admin.config_set("slowlog-max-len", 20 * count + 100)
    admin.slowlog_reset()
    try:
        for _ in range(count):
            decide()
            admin.echo("steplock-bench-mark")
        entries = sorted(admin.slowlog_get(20 * count + 100), key=lambda e: e["id"])
    finally:
        admin.config_set("slowlog-log-slower-than", 10000)
    total_us, total_commands, group = 0.0, 0, []
    for entry in entries:
        command = _command(entry).upper()
        if command.startswith(("SLOWLOG", "CONFIG")):
            continue
        if command.startswith("ECHO"):
            scripts = [e for e in group if _command(e).upper().startswith(("EVAL", "FCALL"))]
            counted = scripts or group
            total_us += sum(e["duration"] for e in counted)
            total_commands += len(counted)
            group = []
        else:
            group.append(entry)
    return total_us / count, total_commands / count


def redis_cpu(url: str, methods: list[str], count: int, rounds: int) -> dict[str, float]:
    """Redis CPU time per decision of each method (microseconds): ``used_cpu_user +
    used_cpu_sys`` of ``INFO cpu`` (the server process, its network reads and writes
    included) before and after ``count`` back-to-back decisions, SLOWLOG at its default.
    The methods take turns, ``rounds`` times (each with its own client and key, made and
    warmed first), and each method's figure is its median round: a load on the shared
    machine falls on every method alike, and one unlucky round does not move the figure."""
    import statistics

    import redis

    admin = redis.Redis.from_url(url)
    deciders = {}
    for method in methods:
        decide = decider(method, url, LATENCY_LIMIT, 1.0, f"cpu-{method}")
        for _ in range(50):
            decide()  # connections made, scripts loaded
        deciders[method] = decide
    rounds_us: dict[str, list[float]] = {method: [] for method in methods}
    for _ in range(rounds):
        for method in methods:
            decide = deciders[method]
            before = _cpu_seconds(admin)
            for _ in range(count):
                decide()
            used = _cpu_seconds(admin) - before
            rounds_us[method].append(0.0 if method in NO_REDIS else used * 1e6 / count)
    return {method: statistics.median(figures) for method, figures in rounds_us.items()}


def _cpu_seconds(admin) -> float:
    cpu = admin.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def _command(entry: dict[str, Any]) -> str:
    command = entry.get("command", b"")
    return command.decode(errors="replace") if isinstance(command, bytes) else str(command)


def run(quick: bool = False) -> dict[str, Any]:
    from tests.support.oracles import bucket_excess, max_in_window

    rec = Recorder("ratelimit")
    count = 1000 if quick else 5000
    seconds = 2.0 if quick else 4.0
    workers = (1, 2) if quick else WORKERS
    methods = list(METHODS)
    if version_of("limits") is None:
        methods = [m for m in methods if not m.startswith("limits_")]
        rec.note("the limits library is not installed (requirements/bench.txt): skipped")
    tables: dict[str, Any] = {"latency": {}, "accuracy": {}}
    cpu_rounds = 3 if quick else 5
    with servers.RedisServer() as server:
        for method in methods:
            tables["latency"][method] = latency(method, server.url, count)
        cpu = redis_cpu(server.url, methods, count, cpu_rounds)
        for method in methods:
            figures = tables["latency"][method]
            figures["redis_cpu_us"] = cpu[method]
            figures["decisions_per_redis_core_s"] = (
                None if method in NO_REDIS or cpu[method] <= 0 else 1e6 / cpu[method]
            )
            for name, unit in (
                ("p50_us", "us"),
                ("p99_us", "us"),
                ("server_us", "us"),
                ("commands", "commands"),
                ("admitted", "ratio"),
                ("redis_cpu_us", "us"),
                ("decisions_per_redis_core_s", "per s"),
            ):
                if figures[name] is not None:
                    rec.add(
                        f"ratelimit.latency.{name}", round(figures[name], 3), unit, method=method
                    )
        for run_no, (method, n) in enumerate((m, n) for m in methods for n in workers):
            times = accuracy(method, server.url, n, seconds, run_no)
            servers_seen = [t[2] for t in times if t[2] is not None]
            row = {
                "workers": n,
                "admitted": len(times),
                "seconds": seconds,
                "mean_rate": len(times) / seconds,
                "configured_rate": LIMIT / WINDOW,
                "proven_max_in_window": proven_max(times, WINDOW),
                "limit": LIMIT,
                "redis_max_in_window": max_in_window(servers_seen, WINDOW)[0]
                if servers_seen
                else None,
                "redis_bucket_excess": round(bucket_excess(servers_seen, LIMIT / WINDOW, 1), 3)
                if servers_seen
                else None,
            }
            tables["accuracy"].setdefault(method, []).append(row)
            for name in ("mean_rate", "proven_max_in_window", "redis_max_in_window"):
                if row[name] is not None:
                    rec.add(
                        f"ratelimit.accuracy.{name}",
                        round(row[name], 3),
                        "per s" if name == "mean_rate" else "per window",
                        method=method,
                        workers=n,
                    )
            rec.say(
                f"{METHODS[method]}, {n} workers: at least {row['proven_max_in_window']} "
                f"in one {WINDOW:g} s window (Redis time: {row['redis_max_in_window']}; "
                f"limit {LIMIT}), mean {row['mean_rate']:.1f}/s"
            )
        for method in methods:
            times = accuracy(method, server.url, 2, 1.5 * WINDOW, 99, pattern="edge")
            most = proven_max(times, WINDOW)
            tables.setdefault("edge", {})[method] = {
                "workers": 2,
                "admitted": len(times),
                "proven_max_in_window": most,
                "limit": LIMIT,
            }
            rec.add("ratelimit.edge.proven_max_in_window", most, "per window", method=method)
            rec.say(f"{METHODS[method]}, edge burst: at least {most} in one {WINDOW:g} s")
    rec.note(
        f"Latency: {count} back-to-back decisions per method, limit {LATENCY_LIMIT}/s; "
        f"server time from SLOWLOG (every top-level command, a script once); Redis CPU "
        f"from INFO cpu (user + sys) over {count} decisions per method, {cpu_rounds} "
        f"interleaved rounds, the median. Accuracy: "
        f"limit {LIMIT} per {WINDOW:g} s, {seconds:g} s per run, a 2 ms pause after a "
        f"denial. Celery's rate_limit is kombu's per-worker token bucket (capacity 1) "
        f"in each process, as Celery keeps one per worker."
    )
    text = render(tables, methods, workers)
    print(text, flush=True)
    out = ROOT / ("var/bench-quick" if quick else "docs/patterns") / "ratelimit.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "context": machine_context(),
                "limit": LIMIT,
                "window": WINDOW,
                "latency_limit": LATENCY_LIMIT,
                "decisions": count,
                "seconds": seconds,
                "methods": METHODS,
                "tables": tables,
                "versions": {
                    "limits": version_of("limits"),
                    "celery": version_of("celery"),
                    "kombu": version_of("kombu"),
                    "redis": version_of("redis"),
                },
            },
            indent=1,
            default=str,
        )
    )
    return rec.result(tables=tables, text=text)


def render(tables: dict[str, Any], methods: list[str], workers) -> str:
    lines = [
        "| method | p50 µs | p99 µs | Redis server µs/decision | commands/decision "
        "| Redis CPU µs/decision | decisions per Redis core-second |",
        "|---|---|---|---|---|---|---|",
    ]
    for method in methods:
        f = tables["latency"][method]
        per_core = f.get("decisions_per_redis_core_s")
        lines.append(
            f"| {METHODS[method]} | {f['p50_us']:.0f} | {f['p99_us']:.0f} | "
            f"{f['server_us']:.1f} | {f['commands']:.2f} | {f.get('redis_cpu_us', 0.0):.1f} | "
            f"{'n/a' if per_core is None else f'{per_core:,.0f}'} |"
        )
    lines += [
        "",
        "| method | "
        + " | ".join(
            f"{n} worker{'s' if n > 1 else ''}: max in one {WINDOW:g} s / mean per s"
            for n in workers
        )
        + " |",
        "|---|" + "---|" * len(workers),
    ]
    for method in methods:
        cells = []
        for row in tables["accuracy"][method]:
            most = row["proven_max_in_window"]
            redis_most = row["redis_max_in_window"]
            cell = f"{most}{' **over**' if most > LIMIT else ''}"
            if redis_most is not None:
                cell += f" (Redis time: {redis_most})"
            cells.append(f"{cell} / {row['mean_rate']:.1f}")
        lines.append(f"| {METHODS[method]} | " + " | ".join(cells) + " |")
    if tables.get("edge"):
        lines += ["", f"| method | edge burst (2 workers): max in one {WINDOW:g} s |", "|---|---|"]
        for method in methods:
            most = tables["edge"][method]["proven_max_in_window"]
            lines.append(f"| {METHODS[method]} | {most}{' **over**' if most > LIMIT else ''} |")
    lines.append(
        f'\nconfigured: {LIMIT} per {WINDOW:g} s. "max in one window": admissions '
        f"whose request and answer both fell inside one window (a lower bound: above "
        f'{LIMIT} proves the limit was exceeded); "Redis time": the decisions\' own '
        f"times, where the method reports them (exact)."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(group_main("ratelimit", run))
