"""Group ``aio`` (issue 27): the asyncio API against what an async user would pick instead.

    python -m benchmarks.aio [--quick] [--out FILE]   (or benchmarks/run.py --only aio)

Everything runs on one event loop of this process against one throwaway redis-server.

Lease cycle (acquire + release of a name nobody holds, then the same name again):

* ``ours``: :class:`celery_steplock.aio.lock.AsyncRedisLeaseStore` (``await acquire`` +
  ``await release``); ``ours_cm``: the same through ``async with store.lease(name)`` with
  its defaults (registered with the loop's heartbeat, released in ``finally``);
* ``raw``: the raw async pair, ``SET key token NX PX ttl`` then ``EVALSHA`` of a
  compare-and-delete script (loaded once), the floor of a lease with an owner check;
* ``redis_py``: redis-py's ``redis.asyncio.lock.Lock`` (``acquire(blocking=False)`` +
  ``release()``);
* ``ping2``: two sequential ``PING`` awaits, the physical floor of a two-round-trip cycle.

All four use the same ``redis.asyncio`` client: the twin of the library's own client
(:func:`celery_steplock.clients.async_twin` of :func:`celery_steplock.lock.make_client`:
decoded replies, one retry), so a ratio isolates the library's own cost.

Rate-limit decision (one ``await`` per decision, limit 1000 per second: in a tight loop most
decisions are denials, the admitted share is printed):

* ``ours_window`` / ``ours_bucket``: ``SlidingWindow(...).atry_acquire(key)`` /
  ``TokenBucket(...).atry_acquire(key)`` on the same client;
* ``limits_moving`` / ``limits_fixed``: the ``limits`` library's asyncio storage
  (``limits.aio.storage.RedisStorage("async+redis://...", implementation="redispy")``: its
  redis.asyncio bridge, so no ``coredis``) with ``limits.aio.strategies.
  MovingWindowRateLimiter`` / ``FixedWindowRateLimiter``, on the client it builds itself (as
  its users configure it).

Figures, every variant of a table interleaved with the others (this machine is shared):

* sequential: one task awaiting cycle after cycle, each timed; blocks of 50 per variant, the
  variants in a rotating order block by block (a *round*: one block of each); p50 is the
  median over repetitions of the median of the blocks' medians, p99 over all samples; a ratio
  a / b is the median over a repetition's rounds of a's block median / b's, then the median
  over the repetitions (each repetition's value in ``reps``) — as ``lock_primitive.py`` does;
* concurrent (lease only): ``N`` (50) tasks of one loop, each cycling on a name of its own,
  for ``per_task`` cycles; the wall time of the round over the cycles done (µs per cycle, and
  cycles/s), and this process's CPU per cycle (the event loop's own cost, which concurrency
  exposes: with 50 tasks in flight the client, not the round trip, is the bottleneck, so CPU
  per cycle is the figure that does not move with the neighbours' load, as the e2e group's
  CPU per task); many short rounds rotate the variants; ratios of each round's figures,
  median;
* Redis server µs per cycle / decision: ``INFO commandstats`` ``usec`` of the commands the
  client sent (found with ``MONITOR``; a script's inner commands are inside its ``EVALSHA``),
  after ``CONFIG RESETSTAT``, in blocks of 100, variants interleaved block by block, the
  median block; and Redis's process CPU (``INFO cpu``) per cycle likewise. Server figures do
  not move with the client's event loop or the neighbours' load as much as latencies do.

``ours`` is left out, with a note, when the async store or the limiter's ``atry_acquire`` is
not importable (then the issue-27 targets read "not measured").
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from .common import (
    MonitorCapture,
    Recorder,
    group_main,
    median,
    rep_figures,
    servers,
    version_of,
)

#: Lease-cycle variants, in table order: key -> label.
LEASE = {
    "ping2": "two PINGs (floor of a 2-round-trip cycle)",
    "raw": "raw async SET NX PX + EVALSHA release",
    "redis_py": "redis-py redis.asyncio.lock.Lock",
    "ours": "celery-steplock AsyncRedisLeaseStore",
    "ours_cm": "celery-steplock `async with store.lease(name)` (renewal on, the default)",
}
#: Rate-limit decision variants: key -> label.
DECISIONS = {
    "ours_window": "ours: SlidingWindow.atry_acquire (exact log, Lua)",
    "ours_bucket": "ours: TokenBucket.atry_acquire (capacity 1, Lua)",
    "limits_moving": "limits: async MovingWindowRateLimiter (redis.asyncio)",
    "limits_fixed": "limits: async FixedWindowRateLimiter (redis.asyncio)",
}
#: The ratios reported (a, b), per table.
LEASE_RATIOS = (
    ("ours", "raw"),
    ("ours", "redis_py"),
    ("ours_cm", "raw"),
    ("ours", "ping2"),
    ("raw", "ping2"),
)
DECISION_RATIOS = (("ours_window", "limits_moving"), ("ours_bucket", "limits_fixed"))

RAW_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
TTL = 30
LATENCY_LIMIT = 1000  # decisions: 1000 per second, as the sync ratelimit group
CONCURRENCY = 50

Cycle = Callable[[int], Awaitable[Any]]


def ours_missing() -> dict[str, str]:
    """Why each of our async sides cannot run (empty when both can): ``{"lease": why,
    "ratelimit": why}``."""
    missing = {}
    try:
        from celery_steplock.aio.lock import AsyncRedisLeaseStore  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - reported, never hidden
        missing["lease"] = f"{type(exc).__name__}: {exc}"
    try:
        from celery_steplock.patterns.ratelimit import SlidingWindow, TokenBucket
    except Exception as exc:  # noqa: BLE001
        missing["ratelimit"] = f"{type(exc).__name__}: {exc}"
        return missing
    if not all(hasattr(cls, "atry_acquire") for cls in (SlidingWindow, TokenBucket)):
        missing["ratelimit"] = "SlidingWindow/TokenBucket have no atry_acquire yet"
    return missing


def async_client(url: str):
    """The ``redis.asyncio`` twin of the library's client for ``url`` (decoded replies, one
    retry)."""
    from celery_steplock.clients import async_twin
    from celery_steplock.lock import make_client

    return async_twin(make_client(url))


async def build_lease(variant: str, aclient, prefix: str) -> Cycle:
    """An acquire + release cycle of ``variant``; the argument is the caller's slot (task)
    number, each slot cycling on a name of its own."""
    if variant == "ping2":

        async def cycle(slot: int) -> None:
            await aclient.execute_command("PING")
            await aclient.execute_command("PING")

        return cycle
    if variant == "raw":
        release = aclient.register_script(RAW_RELEASE)

        async def cycle(slot: int) -> None:
            key = f"{prefix}:raw:{slot}"
            token = uuid.uuid4().hex
            if not await aclient.set(key, token, nx=True, px=TTL * 1000):
                raise AssertionError("raw: not acquired")
            if await release(keys=[key], args=[token]) != 1:
                raise AssertionError("raw: not released")

        return cycle
    if variant == "redis_py":
        from redis.asyncio.lock import Lock

        async def cycle(slot: int) -> None:
            lock = Lock(aclient, f"{prefix}:redis_py:{slot}", timeout=TTL)
            if not await lock.acquire(blocking=False):
                raise AssertionError("redis-py: not acquired")
            await lock.release()

        return cycle
    if variant == "ours":
        from celery_steplock.aio.lock import AsyncRedisLeaseStore

        store = AsyncRedisLeaseStore(aclient, prefix=prefix)

        async def cycle(slot: int) -> None:
            lease = await store.acquire(f"ours:{slot}", ttl=float(TTL))
            if lease is None:
                raise AssertionError("ours: not acquired")
            await store.release(lease.name, lease.owner)

        return cycle
    if variant == "ours_cm":
        from celery_steplock.aio.lock import AsyncRedisLeaseStore

        store = AsyncRedisLeaseStore(aclient, prefix=prefix)

        async def cycle(slot: int) -> None:
            async with store.lease(f"ours_cm:{slot}", ttl=float(TTL)):
                pass

        return cycle
    raise ValueError(variant)


async def build_decision(variant: str, aclient, url: str, prefix: str) -> Cycle:
    """One rate-limit decision of ``variant`` (limit :data:`LATENCY_LIMIT` per second); the
    argument is a slot number (one key per slot); the decision returns whether it admitted.
    Ours run on ``aclient`` (``atry_acquire(client=...)`` takes a redis.asyncio client as
    it is); ``limits`` builds its own client from ``url``."""
    if variant in ("ours_window", "ours_bucket"):
        from celery_steplock.patterns.ratelimit import SlidingWindow, TokenBucket

        limiter = (
            SlidingWindow(LATENCY_LIMIT, 1.0, client=aclient, prefix=prefix)
            if variant == "ours_window"
            else TokenBucket(float(LATENCY_LIMIT), capacity=1, client=aclient, prefix=prefix)
        )

        async def decide(slot: int) -> bool:
            decision = await limiter.atry_acquire(f"{variant}-{slot}")
            return bool(decision.allowed)

        return decide
    if variant in ("limits_moving", "limits_fixed"):
        from limits import RateLimitItemPerSecond
        from limits.aio.storage import RedisStorage
        from limits.aio.strategies import FixedWindowRateLimiter, MovingWindowRateLimiter

        storage = RedisStorage(f"async+{url}", implementation="redispy", key_prefix=prefix)
        strategy = (
            MovingWindowRateLimiter if variant == "limits_moving" else FixedWindowRateLimiter
        )(storage)
        item = RateLimitItemPerSecond(LATENCY_LIMIT, 1)

        async def decide(slot: int) -> bool:
            return bool(await strategy.hit(item, f"{variant}-{slot}"))

        return decide
    raise ValueError(variant)


# -- sequential ------------------------------------------------------------------------------


async def sequential(
    rec: Recorder,
    table: str,
    cyc: dict[str, Cycle],
    cycles: int,
    reps: int,
    warmup: int,
    ratios: tuple[tuple[str, str], ...],
    labels: dict[str, str],
) -> dict[str, Any]:
    """One task, cycle after cycle, each timed; see the module docstring. Adds
    ``aio.<table>.<v>.p50|p99|rate|p50_reps`` and ``aio.<table>.ratio.<a>_vs_<b>``; returns
    ``{variant: {"p50", "p99", "rate", "admitted"}}``."""
    import gc

    variants = list(cyc)
    clock = time.perf_counter_ns
    block = 50
    for v in variants:
        for _ in range(warmup):
            await cyc[v](0)
    per_rep: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    rounds: list[list[dict[str, float]]] = []
    admitted = {v: 0 for v in variants}
    done = {v: 0 for v in variants}
    for rep in range(reps):
        samples: dict[str, list[int]] = {v: [] for v in variants}
        busy = {v: 0 for v in variants}
        rep_rounds: list[dict[str, float]] = []
        gc.collect()
        for blk in range(max(1, cycles // block)):
            k = (rep + blk) % len(variants)
            medians: dict[str, float] = {}
            for v in variants[k:] + variants[:k]:
                cycle = cyc[v]
                out: list[int] = []
                t_block = clock()
                for _ in range(block):
                    t0 = clock()
                    ok = await cycle(0)
                    out.append(clock() - t0)
                    admitted[v] += bool(ok)
                busy[v] += clock() - t_block
                done[v] += block
                samples[v].extend(out)
                medians[v] = median(out) / 1000.0
            rep_rounds.append(medians)
        rounds.append(rep_rounds)
        for v in variants:
            per_rep[v].append(rep_figures(rep_rounds, samples[v], busy[v], v))
        rec.say(
            f"{table} sequential rep {rep + 1}/{reps}: "
            + ", ".join(f"{v} p50 {per_rep[v][-1]['p50']:.0f}us" for v in variants)
        )
    out_rows: dict[str, Any] = {}
    for v in variants:
        rows = per_rep[v]
        row: dict[str, Any] = {
            "p50": median(r["p50"] for r in rows),
            "p99": median(r["p99"] for r in rows),
            "rate": median(r["rate"] for r in rows),
            "admitted": admitted[v] / done[v] if done[v] else None,
        }
        out_rows[v] = row
        lab = dict(variant=v, label=labels[v])
        rec.add(
            f"aio.{table}.{v}.p50",
            round(row["p50"], 1),
            "us",
            basis="median over repetitions of the median of 50-cycle blocks' medians",
            **lab,
        )
        rec.add(f"aio.{table}.{v}.p99", round(row["p99"], 1), "us", **lab)
        rec.add(f"aio.{table}.{v}.rate", round(row["rate"]), "per s", **lab)
        rec.add(f"aio.{table}.{v}.p50_reps", [round(r["p50"], 1) for r in rows], "us", variant=v)
        if table == "decision" and row["admitted"] is not None:
            rec.add(f"aio.{table}.{v}.admitted", round(row["admitted"], 3), "ratio", **lab)
    for a, b in ratios:
        if a in per_rep and b in per_rep:
            by_rep = [median(r[a] / r[b] for r in rep_rounds) for rep_rounds in rounds]
            rec.add(
                f"aio.{table}.ratio.{a}_vs_{b}",
                round(median(by_rep), 3),
                "x",
                reps=[round(r, 3) for r in by_rep],
                basis="block medians within each round, median per repetition, median",
            )
    return out_rows


# -- concurrent ------------------------------------------------------------------------------


async def concurrent(
    rec: Recorder,
    table: str,
    cyc: dict[str, Cycle],
    tasks: int,
    per_task: int,
    rounds: int,
    ratios: tuple[tuple[str, str], ...],
    labels: dict[str, str],
) -> dict[str, Any]:
    """``tasks`` tasks of this loop, each cycling ``per_task`` times on a slot of its own;
    each variant once per round, rounds rotating the order. Adds
    ``aio.<table>.concurrent.<v>.us_per_cycle|rate|cpu_us`` and
    ``aio.<table>.concurrent.ratio.<a>_vs_<b>`` (wall) and ``..._cpu`` (this process's CPU)."""
    variants = list(cyc)

    async def one(v: str) -> tuple[float, float]:
        cycle = cyc[v]

        async def worker(slot: int) -> None:
            for _ in range(per_task):
                await cycle(slot)

        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker(slot) for slot in range(1, tasks + 1)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        n = tasks * per_task
        return wall / n * 1e6, cpu / n * 1e6

    for v in variants:  # every connection of the pool opened, scripts loaded
        await one(v)
    results: list[dict[str, tuple[float, float]]] = []
    for r in range(rounds):
        k = r % len(variants)
        results.append({v: await one(v) for v in variants[k:] + variants[:k]})
    rec.say(
        f"{table} x{tasks} concurrent: "
        + ", ".join(f"{v} {median(x[v][0] for x in results):.1f}us/cycle" for v in variants)
    )
    out: dict[str, Any] = {}
    for v in variants:
        us = median(x[v][0] for x in results)
        cpu = median(x[v][1] for x in results)
        out[v] = {"us_per_cycle": us, "rate": 1e6 / us if us else None, "cpu_us": cpu}
        lab = dict(variant=v, label=labels[v], tasks=tasks, per_task=per_task)
        rec.add(
            f"aio.{table}.concurrent.{v}.us_per_cycle",
            round(us, 2),
            "us",
            basis="wall time of a round / its cycles, median over rounds",
            **lab,
        )
        rec.add(
            f"aio.{table}.concurrent.{v}.rate",
            round(out[v]["rate"] or 0),
            "per s",
            **lab,
        )
        rec.add(
            f"aio.{table}.concurrent.{v}.cpu_us",
            round(cpu, 2),
            "us",
            basis="this process's CPU time / cycles, median over rounds",
            **lab,
        )
    for a, b in ratios:
        if a in out and b in out:
            for i, suffix in ((0, ""), (1, "_cpu")):
                by_round = [x[a][i] / x[b][i] for x in results if x[b][i]]
                rec.add(
                    f"aio.{table}.concurrent.ratio.{a}_vs_{b}{suffix}",
                    round(median(by_round), 3),
                    "x",
                    rounds=[round(x, 3) for x in by_round],
                    tasks=tasks,
                )
    return out


# -- server side -----------------------------------------------------------------------------


def sent_commands(
    loop: asyncio.AbstractEventLoop, url: str, cyc: dict[str, Cycle], n: int = 20
) -> dict[str, dict[str, Any]]:
    """The commands each variant's client sends per cycle (``MONITOR``): ``{v: {"names":
    set, "per_cycle": float, "detail": {name: per cycle}, "script_commands": float}}``."""

    async def many(v: str) -> None:
        for _ in range(n):
            await cyc[v](0)

    with MonitorCapture(url) as mon:
        for v in cyc:
            mon.phase(v)
            loop.run_until_complete(many(v))
    out = {}
    for v in cyc:
        sent = mon.count(v)
        inner = mon.count(v, lua=True)
        out[v] = {
            "names": {name.lower() for name in sent},
            "per_cycle": sum(sent.values()) / n,
            "detail": {k: round(c / n, 2) for k, c in sorted(sent.items())},
            "script_commands": sum(inner.values()) / n,
        }
    return out


def server_side(
    rec: Recorder,
    table: str,
    loop: asyncio.AbstractEventLoop,
    url: str,
    cyc: dict[str, Cycle],
    cycles: int,
    ratios: tuple[tuple[str, str], ...],
    labels: dict[str, str],
) -> dict[str, Any]:
    """Redis's time per cycle of each variant (see the module docstring). Adds
    ``aio.<table>.<v>.commands|server_us|redis_cpu_us|per_redis_core_s`` and
    ``aio.<table>.ratio.<a>_vs_<b>_server``."""
    import redis

    sent = sent_commands(loop, url, cyc)
    admin = redis.Redis.from_url(url)
    variants = list(cyc)
    block = 100
    blocks_top: dict[str, list[float]] = {v: [] for v in variants}
    blocks_cpu: dict[str, list[float]] = {v: [] for v in variants}
    rounds: list[dict[str, tuple[float, float]]] = []

    def cpu_s() -> float:
        info = admin.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    async def run_block(cycle: Cycle) -> None:
        for _ in range(block):
            await cycle(0)

    for blk in range(max(1, cycles // block)):
        k = blk % len(variants)
        this_round: dict[str, tuple[float, float]] = {}
        for v in variants[k:] + variants[:k]:
            admin.config_resetstat()
            cpu0 = cpu_s()
            loop.run_until_complete(run_block(cyc[v]))
            used = (cpu_s() - cpu0) / block * 1e6
            stats = admin.info("commandstats")
            top = sum(
                int(st.get("usec", 0))
                for name, st in stats.items()
                if name.removeprefix("cmdstat_") in sent[v]["names"]
            )
            blocks_top[v].append(top / block)
            blocks_cpu[v].append(used)
            this_round[v] = (top / block, used)
        rounds.append(this_round)
    admin.close()
    out: dict[str, Any] = {}
    for v in variants:
        us, cpu = median(blocks_top[v]), median(blocks_cpu[v])
        out[v] = {
            "server_us": us,
            "redis_cpu_us": cpu,
            "commands": sent[v]["per_cycle"],
            "script_commands": sent[v]["script_commands"],
        }
        lab = dict(variant=v, label=labels[v])
        rec.add(
            f"aio.{table}.{v}.commands",
            round(sent[v]["per_cycle"], 2),
            "commands",
            detail=sent[v]["detail"],
            **lab,
        )
        rec.add(
            f"aio.{table}.{v}.server_us",
            round(us, 2),
            "us",
            basis="INFO commandstats usec of the commands sent, median of 100-cycle blocks",
            commands=sorted(sent[v]["names"]),
            **lab,
        )
        rec.add(f"aio.{table}.{v}.redis_cpu_us", round(cpu, 2), "us", basis="INFO cpu", **lab)
        if us > 0:
            rec.add(
                f"aio.{table}.{v}.per_redis_core_s",
                round(1e6 / us),
                "per s",
                basis="1e6 / server_us",
                **lab,
            )
    for a, b in ratios:
        if a in out and b in out:
            values = [r[a][0] / r[b][0] for r in rounds if r[b][0] > 0]
            rec.add(
                f"aio.{table}.ratio.{a}_vs_{b}_server",
                round(median(values), 3) if values else math.nan,
                "x",
                basis="server_us, ratio within each round, median",
            )
    return out


# -- the group -------------------------------------------------------------------------------


def run(quick: bool = False) -> dict[str, Any]:
    rec = Recorder("aio")
    missing = ours_missing()
    lease_variants = [v for v in LEASE if not (v.startswith("ours") and "lease" in missing)]
    decision_variants = [
        v
        for v in DECISIONS
        if not (v.startswith("ours_") and "ratelimit" in missing)
        and not (v.startswith("limits_") and version_of("limits") is None)
    ]
    for side, why in missing.items():
        rec.note(f"PLACEHOLDER: ours ({side}) not measured: {why}")
    if version_of("limits") is None:
        rec.note("the limits library is not installed (requirements/bench.txt): skipped")
    if quick:
        cycles, reps, warmup, per_task, c_rounds, server_cycles = 300, 2, 50, 10, 5, 1000
    else:
        # Concurrent rounds short (500 cycles a variant, ~0.2 s) and many: the variants of
        # a round then share the neighbours' load.
        cycles, reps, warmup, per_task, c_rounds, server_cycles = 2000, 5, 200, 10, 25, 10_000
    tables: dict[str, Any] = {}
    loop = asyncio.new_event_loop()
    try:
        with servers.RedisServer() as server:
            url = server.url
            rec.say(f"redis-server {url} (pid {server.pid})")

            async def build() -> tuple[dict[str, Cycle], dict[str, Cycle], Any]:
                aclient = async_client(url)
                lease = {v: await build_lease(v, aclient, "bench") for v in lease_variants}
                decide = {
                    v: await build_decision(v, aclient, url, "bench") for v in decision_variants
                }
                return lease, decide, aclient

            lease, decide, aclient = loop.run_until_complete(build())
            tables["lease"] = loop.run_until_complete(
                sequential(rec, "lease", lease, cycles, reps, warmup, LEASE_RATIOS, LEASE)
            )
            tables["lease_concurrent"] = loop.run_until_complete(
                concurrent(
                    rec, "lease", lease, CONCURRENCY, per_task, c_rounds, LEASE_RATIOS, LEASE
                )
            )
            tables["lease_server"] = server_side(
                rec, "lease", loop, url, lease, server_cycles, LEASE_RATIOS, LEASE
            )
            if decide:
                tables["decision"] = loop.run_until_complete(
                    sequential(
                        rec, "decision", decide, cycles, reps, warmup, DECISION_RATIOS, DECISIONS
                    )
                )
                tables["decision_server"] = server_side(
                    rec,
                    "decision",
                    loop,
                    url,
                    decide,
                    max(1000, server_cycles // 5),
                    DECISION_RATIOS,
                    DECISIONS,
                )
            loop.run_until_complete(aclient.aclose())
    finally:
        loop.close()
    rec.note(
        f"aio: one event loop; lease cycles on a name nobody holds, the same redis.asyncio "
        f"client (the async twin of make_client) for ours, the raw pair, redis-py's "
        f"asyncio Lock and the PING floor; {CONCURRENCY} concurrent tasks x {per_task} "
        f"cycles per round, {c_rounds} rounds. Decisions: limit {LATENCY_LIMIT}/s, "
        f"limits' async RedisStorage with implementation='redispy' (redis.asyncio, no "
        f"coredis) on its own client. Server µs: INFO commandstats usec of the commands "
        f"sent (MONITOR), median of 100-cycle blocks, variants interleaved."
    )
    text = render(tables)
    print(text, flush=True)
    return rec.result(missing=missing)


def render(tables: dict[str, Any]) -> str:
    lines = [
        "| lease cycle | p50 µs | p99 µs | x50 tasks µs/cycle | x50 client CPU µs/cycle "
        "| commands | Redis server µs |",
        "|---|---|---|---|---|---|---|",
    ]
    for v, row in tables.get("lease", {}).items():
        c = tables.get("lease_concurrent", {}).get(v, {})
        s = tables.get("lease_server", {}).get(v, {})
        lines.append(
            f"| {LEASE[v]} | {row['p50']:.1f} | {row['p99']:.1f} | "
            f"{c.get('us_per_cycle', math.nan):.1f} | {c.get('cpu_us', math.nan):.1f} | "
            f"{s.get('commands', math.nan):.2f} | {s.get('server_us', math.nan):.2f} |"
        )
    if tables.get("decision"):
        lines += [
            "",
            "| decision | p50 µs | p99 µs | admitted | commands | Redis server µs |",
            "|---|---|---|---|---|---|",
        ]
        for v, row in tables["decision"].items():
            s = tables.get("decision_server", {}).get(v, {})
            lines.append(
                f"| {DECISIONS[v]} | {row['p50']:.1f} | {row['p99']:.1f} | "
                f"{row['admitted'] or 0:.2f} | {s.get('commands', math.nan):.2f} | "
                f"{s.get('server_us', math.nan):.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(group_main("aio", run))
