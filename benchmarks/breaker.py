"""Group "breaker": the circuit breaker and the retry policy against what users pick instead.

On a redis-server of its own (loopback), one Python process, calls of a function that does
nothing, so what is measured is the guard's own cost:

* circuit breaker, success path (CLOSED): ours (``CircuitBreaker.call``) with its default
  state cache (``steplock_breaker_state_cache`` = 1 s: the state is read once per second
  per process, successes are counted locally and written with that read, so a successful
  call sends nothing in steady state) and with ``state_cache=0`` (every call runs the
  admission script; a success in a clean window is not written) vs ``pybreaker`` with its
  Redis storage (``CircuitRedisStorage``), all shared through the same Redis;
* circuit breaker, refusal path (OPEN): ours (cached, and ``state_cache=0``) vs pybreaker;
* retry policy, success at the first attempt and one retry (the sleep replaced by a no-op
  in both): ours (``RetryPolicy.call``) vs ``tenacity`` (``Retrying`` with
  ``wait_random_exponential`` and ``stop_after_attempt``); and ours with the breaker inside;
* a bare call, for the floor.

Per scenario: the overhead per call (p50/p99 of the call's wall time minus the bare call's
median, microseconds); round trips per call (commands clients sent, from ``INFO
commandstats``); Redis command time per call (their ``usec``: for scripts EVALSHA's, which
includes the commands the script ran); Redis CPU per call (``used_cpu_sys + used_cpu_user``
of the server over the measured calls: parsing, networking and execution), also unrounded as
``redis_cpu_us`` (0 when the calls sent no command: the CPU Redis used meanwhile was its own
background work) with ``decisions_per_redis_core_s`` (1e6 / ``redis_cpu_us``: calls decided
per second of one Redis core; ``null`` in the JSON, "n/a" in the table, when
``redis_cpu_us`` is 0: a decision that costs Redis nothing is not bounded by it). A cached
breaker's figures include its one refresh per second when the run crosses one. The table is printed and saved to
``docs/patterns/breaker.json`` (``--out`` elsewhere).
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from .common import ROOT, Recorder, group_main, percentile, servers, version_of

OUT = ROOT / "docs" / "patterns" / "breaker.json"
#: The library label of our breaker without its state cache.
UNCACHED = "celery-steplock (state_cache=0)"


def server_usec(client) -> tuple[float, int]:
    """(usec, calls) of the commands clients sent, from INFO commandstats: EVALSHA alone when
    scripts ran (Redis lists the commands a script runs under their own names too, and
    EVALSHA's time already includes them), else every command; INFO itself left out."""
    stats = {k: v for k, v in client.info("commandstats").items() if k != "cmdstat_info"}
    if "cmdstat_evalsha" in stats:
        stats = {"cmdstat_evalsha": stats["cmdstat_evalsha"]}
    usec = sum(float(v["usec"]) for v in stats.values())
    calls = sum(int(v["calls"]) for v in stats.values())
    return usec, calls


def server_cpu_us(client) -> float:
    cpu = client.info("cpu")
    return (float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])) * 1e6


def measure(client, fn: Callable[[], Any], n: int) -> dict[str, float]:
    for _ in range(min(200, n)):  # warm: scripts loaded, connections open
        fn()
    client.config_resetstat()
    cpu0 = server_cpu_us(client)
    samples = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        fn()
        samples.append((clock() - t0) / 1000.0)
    cpu = server_cpu_us(client) - cpu0
    usec, calls = server_usec(client)
    calls -= 1  # CONFIG RESETSTAT's reply is counted after it
    return {
        "p50_us": percentile(samples, 50),
        "p99_us": percentile(samples, 99),
        "server_us_per_call": usec / n,
        "commands_per_call": max(0, calls) / n,
        "server_cpu_us_per_call": cpu / n,
    }


def run(quick: bool = False) -> dict[str, Any]:
    import pybreaker
    import redis
    import tenacity

    from celery_steplock.patterns.breaker import CircuitBreaker
    from celery_steplock.exceptions import CircuitOpen
    from celery_steplock.patterns.retry import RetryPolicy

    rec = Recorder("breaker")
    n = 500 if quick else 5000
    server = servers.RedisServer().start()
    ours_client = redis.Redis.from_url(server.url, decode_responses=True)
    raw_client = redis.Redis.from_url(server.url)  # pybreaker's storage wants bytes
    stats_client = redis.Redis.from_url(server.url, decode_responses=True)

    def noop():
        return None

    class Transient(ConnectionError):
        pass

    def flaky_factory():
        state = {"n": 0}

        def flaky():
            state["n"] += 1
            if state["n"] % 2:
                raise Transient("first attempt fails")

        return flaky

    ours = CircuitBreaker(
        "bench",
        failure_threshold=5,
        window=10,
        recovery_timeout=3600,
        client=ours_client,
        prefix="bench",
    )
    ours_uncached = CircuitBreaker(
        "bench-uncached",
        failure_threshold=5,
        window=10,
        recovery_timeout=3600,
        state_cache=0,
        client=ours_client,
        prefix="bench",
    )
    theirs = pybreaker.CircuitBreaker(
        fail_max=5,
        reset_timeout=3600,
        name="bench",
        state_storage=pybreaker.CircuitRedisStorage(
            pybreaker.STATE_CLOSED, raw_client, namespace="bench-pybreaker"
        ),
    )
    ours_open = CircuitBreaker(
        "bench-open",
        failure_threshold=1,
        window=1,
        recovery_timeout=3600,
        client=ours_client,
        prefix="bench",
    )
    ours_open.override("open")
    ours_open_uncached = CircuitBreaker(
        "bench-open-uncached",
        failure_threshold=1,
        window=1,
        recovery_timeout=3600,
        state_cache=0,
        client=ours_client,
        prefix="bench",
    )
    ours_open_uncached.override("open")
    theirs_open = pybreaker.CircuitBreaker(
        fail_max=1,
        reset_timeout=3600,
        name="bench-open",
        state_storage=pybreaker.CircuitRedisStorage(
            pybreaker.STATE_OPEN, raw_client, namespace="bench-pybreaker-open"
        ),
    )
    theirs_open.open()

    def refused(call):
        def attempt():
            try:
                call(noop)
            except (CircuitOpen, pybreaker.CircuitBreakerError):
                return
            raise AssertionError("the open breaker let a call through")

        return attempt

    policy = RetryPolicy(max_attempts=3, backoff=0.001, sleep=lambda s: None)
    policy_breaker = RetryPolicy(
        max_attempts=3,
        backoff=0.001,
        sleep=lambda s: None,
        breaker=CircuitBreaker(
            "bench-retry", failure_threshold=100, window=100, client=ours_client, prefix="bench"
        ),
    )
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(3),
        wait=tenacity.wait_random_exponential(multiplier=0.001),
        retry=tenacity.retry_if_exception_type(ConnectionError),
        sleep=lambda s: None,
        reraise=True,
    )
    flaky_ours, flaky_tenacity, flaky_both = flaky_factory(), flaky_factory(), flaky_factory()

    scenarios = [
        ("bare call", "floor", lambda: noop()),
        ("breaker, closed (success)", "celery-steplock", lambda: ours.call(noop)),
        (
            "breaker, closed (success)",
            UNCACHED,
            lambda: ours_uncached.call(noop),
        ),
        ("breaker, closed (success)", "pybreaker+redis", lambda: theirs.call(noop)),
        ("breaker, open (refused)", "celery-steplock", refused(ours_open.call)),
        ("breaker, open (refused)", UNCACHED, refused(ours_open_uncached.call)),
        ("breaker, open (refused)", "pybreaker+redis", refused(theirs_open.call)),
        ("retry, success at once", "celery-steplock", lambda: policy.call(noop)),
        ("retry, success at once", "tenacity", lambda: retrying(noop)),
        ("retry, one retry", "celery-steplock", lambda: policy.call(flaky_ours)),
        ("retry, one retry", "tenacity", lambda: retrying(flaky_tenacity)),
        ("retry + breaker, one retry", "celery-steplock", lambda: policy_breaker.call(flaky_both)),
    ]
    rows = []
    floor = None
    for scenario, library, fn in scenarios:
        figures = measure(stats_client, fn, n)
        if floor is None:
            floor = figures["p50_us"]
        # No command sent: what Redis burnt meanwhile was its own background work.
        cpu_us = figures["server_cpu_us_per_call"] if figures["commands_per_call"] else 0.0
        row = {
            "scenario": scenario,
            "library": library,
            "calls": n,
            "overhead_p50_us": round(figures["p50_us"] - floor, 1),
            "overhead_p99_us": round(figures["p99_us"] - floor, 1),
            "redis_commands_per_call": round(figures["commands_per_call"], 2),
            "redis_server_us_per_call": round(figures["server_us_per_call"], 2),
            "redis_cpu_us_per_call": round(figures["server_cpu_us_per_call"], 1),
            "redis_cpu_us": round(cpu_us, 3),
            "decisions_per_redis_core_s": per_core_second(cpu_us),
        }
        rows.append(row)
        for key in (
            "overhead_p50_us",
            "overhead_p99_us",
            "redis_commands_per_call",
            "redis_server_us_per_call",
            "redis_cpu_us_per_call",
            "redis_cpu_us",
        ):
            rec.add(
                f"breaker.{key}",
                row[key],
                "count" if "commands" in key else "us",
                scenario=scenario,
                library=library,
            )
    ours_client.close()
    raw_client.close()
    stats_client.close()
    server.stop()
    table = render(rows)
    print(table, flush=True)
    versions = {
        "pybreaker": version_of("pybreaker"),
        "tenacity": version_of("tenacity"),
        "redis": version_of("redis"),
    }
    document = {
        "quick": quick,
        "calls_per_scenario": n,
        "versions": versions,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
        "table": table,
    }
    if not quick:
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(document, indent=1) + "\n")
    rec.note(
        "breaker: overhead = call time minus the bare call's median; Redis server time "
        "from INFO commandstats over the measured calls"
    )
    return rec.result(table=table, versions=versions)


def per_core_second(cpu_us: float) -> int | None:
    """Decisions one Redis core second makes at ``cpu_us`` µs each; None (JSON ``null``)
    when no CPU was measured (the figure is unbounded: Redis is not what limits it)."""
    return round(1e6 / cpu_us) if cpu_us > 0 else None


def render(rows: list[dict[str, Any]]) -> str:
    head = (
        "| scenario | library | overhead p50 (µs) | overhead p99 (µs) | round trips "
        "per call | Redis command µs per call | Redis CPU µs per call | decisions per "
        "Redis core-second |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        per_core = r.get("decisions_per_redis_core_s")
        lines.append(
            f"| {r['scenario']} | {r['library']} | {r['overhead_p50_us']} | "
            f"{r['overhead_p99_us']} | {r['redis_commands_per_call']} | "
            f"{r['redis_server_us_per_call']} | {r['redis_cpu_us_per_call']} | "
            f"{'n/a' if per_core is None else per_core} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(group_main("breaker", run))
