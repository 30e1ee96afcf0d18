"""Group 4: blocking wait, time from a release to the next waiter holding the lease.

A chain of W+1 threads (W = 1 or 32 waiters) shares one name: the holder keeps the lease 10 ms
(long enough for the previous holder to be waiting again, so exactly W threads wait at every
release), notes the time and releases; the thread that gets the lease next notes the time it
holds it. One sample per hand-over; the first W+2 are dropped as warm-up. Variants: ours
(``acquire(wait=...)``, one waiter woken by BLPOP per release), redis-py ``Lock`` (100 ms sleep
loop, its default ``sleep=0.1``, as pottery's 0-200 ms one), python-redis-lock (BLPOP on a
signal list). Also the Redis commands per second while W threads wait on a lease held for 2 s
(what waiting costs the server), and overlaps (must be 0).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .common import (
    commands_processed,
    group_main,
    installed_variants,
    join_or_kill,
    peer_status,
    percentile,
    Recorder,
    servers,
)
from .lock_primitive import build_blocking

VARIANTS = {
    "ours": "celery-steplock acquire(wait=...) (BLPOP, one waiter woken per release)",
    "redis_py": "redis-py Lock, 100 ms sleep loop",
    "prl": "python-redis-lock (BLPOP signal)",
}
PEER_OF = {"redis_py": "redis", "prl": "python-redis-lock"}
HOLD = 0.010


def chain(url: str, variant: str, waiters: int, samples: int) -> dict[str, Any]:
    key = f"bench:wait:{variant}:{waiters}:{time.monotonic_ns()}"
    state = {
        "released_at": None,
        "holder": None,
        "samples": [],
        "overlaps": 0,
        "stop": False,
        "errors": 0,
    }
    guard = threading.Lock()
    handed_over = threading.Condition()
    inside = [0]
    wanted = samples + waiters + 2

    def worker(idx: int) -> None:
        try:
            acquire, release = build_blocking(variant, url, key)
            while True:
                handle = acquire()
                now = time.perf_counter()
                with guard:
                    inside[0] += 1
                    if inside[0] > 1:
                        state["overlaps"] += 1
                    if state["released_at"] is not None and state["holder"] != idx:
                        state["samples"].append(now - state["released_at"])
                    state["holder"] = idx
                    stop = state["stop"] or len(state["samples"]) >= wanted
                    state["stop"] = stop
                with handed_over:
                    handed_over.notify_all()
                if not stop:
                    time.sleep(HOLD)
                with guard:
                    inside[0] -= 1
                    state["released_at"] = time.perf_counter()
                release(handle)
                if stop:
                    return
                # Wait again only once another thread holds it: no barging, so exactly the
                # W others are waiting at every release (joining 10 ms before the next one).
                with handed_over:
                    handed_over.wait_for(
                        lambda: state["holder"] != idx or state["stop"], timeout=30
                    )
        except Exception:  # noqa: BLE001
            with guard:
                state["errors"] += 1
                state["stop"] = True
            with handed_over:
                handed_over.notify_all()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(waiters + 1)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    alive = sum(t.is_alive() for t in threads)
    data = state["samples"][waiters + 2 :]
    return {
        "p50": percentile(data, 50) * 1000,
        "p99": percentile(data, 99) * 1000,
        "mean": (sum(data) / len(data) * 1000) if data else None,
        "n": len(data),
        "overlaps": state["overlaps"],
        "errors": state["errors"] + alive,
        "elapsed": time.monotonic() - t0,
    }


def _proc_waiter(url, variant, key, idx, shared, wanted):
    (released_at, holder, count, stop, overlaps, inside, errors, samples, cond) = shared
    try:
        acquire, release = build_blocking(variant, url, key)
        while True:
            handle = acquire()
            now = time.perf_counter()  # CLOCK_MONOTONIC: one clock for every process
            with cond:
                inside.value += 1
                if inside.value > 1:
                    overlaps.value += 1
                if released_at.value > 0 and holder.value != idx and count.value < len(samples):
                    samples[count.value] = now - released_at.value
                    count.value += 1
                holder.value = idx
                if count.value >= wanted:
                    stop.value = 1
                halt = bool(stop.value)
                cond.notify_all()
            if not halt:
                time.sleep(HOLD)
            with cond:
                inside.value -= 1
                released_at.value = time.perf_counter()
            release(handle)
            if halt:
                return
            with cond:
                cond.wait_for(lambda: holder.value != idx or stop.value, timeout=30)
    except Exception:  # noqa: BLE001
        with cond:
            errors.value += 1
            stop.value = 1
            cond.notify_all()


def chain_procs(url: str, variant: str, waiters: int, samples: int) -> dict[str, Any]:
    """:func:`chain` with each waiter a process of its own (fork), as prefork workers wait:
    no GIL shared between the waiters."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    key = f"bench:waitp:{variant}:{waiters}:{time.monotonic_ns()}"
    wanted = samples + waiters + 2
    cond = ctx.Condition()
    shared = (
        ctx.Value("d", 0.0, lock=False),
        ctx.Value("i", -1, lock=False),
        ctx.Value("i", 0, lock=False),
        ctx.Value("b", 0, lock=False),
        ctx.Value("i", 0, lock=False),
        ctx.Value("i", 0, lock=False),
        ctx.Value("i", 0, lock=False),
        ctx.Array("d", wanted + 8, lock=False),
        cond,
    )
    procs = [
        ctx.Process(target=_proc_waiter, args=(url, variant, key, i, shared, wanted), daemon=True)
        for i in range(waiters + 1)
    ]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    alive = join_or_kill(procs, 120)
    n = shared[2].value
    data = list(shared[7][:n])[waiters + 2 :]
    return {
        "p50": percentile(data, 50) * 1000,
        "p99": percentile(data, 99) * 1000,
        "mean": (sum(data) / len(data) * 1000) if data else None,
        "n": len(data),
        "overlaps": shared[4].value,
        "errors": shared[6].value + alive,
        "elapsed": time.monotonic() - t0,
    }


def waiting_load(url: str, variant: str, waiters: int, hold: float = 2.0) -> float:
    """Redis commands per second while ``waiters`` threads wait ``hold`` seconds."""
    import redis

    key = f"bench:waitload:{variant}:{waiters}:{time.monotonic_ns()}"
    acquire, release = build_blocking(variant, url, key)
    handle = acquire()
    done = threading.Event()

    def waiter():
        acq, rel = build_blocking(variant, url, key)
        h = acq()
        rel(h)
        done.set()

    threads = [threading.Thread(target=waiter, daemon=True) for _ in range(waiters)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # let them all start waiting
    client = redis.Redis.from_url(url)
    c0, t0 = commands_processed(client), time.monotonic()
    time.sleep(hold)
    rate = (commands_processed(client) - c0 - 1) / (time.monotonic() - t0)
    release(handle)
    for t in threads:
        t.join(timeout=60)
    client.close()
    return rate


def run(quick: bool = False) -> dict[str, Any]:
    rec = Recorder("wait")
    variants = installed_variants(rec, VARIANTS, PEER_OF)
    samples = 30 if quick else 200
    with servers.RedisServer() as server:
        for waiters in (1, 32):
            for v in variants:
                r = chain(server.url, v, waiters, samples)
                labels = dict(variant=v, label=VARIANTS[v], waiters=waiters, samples=r["n"])
                rec.add(f"wait.{v}.{waiters}.p50", round(r["p50"], 3), "ms", **labels)
                rec.add(f"wait.{v}.{waiters}.p99", round(r["p99"], 3), "ms", **labels)
                rec.add(
                    f"wait.{v}.{waiters}.mean",
                    round(r["mean"], 3) if r["mean"] else None,
                    "ms",
                    **labels,
                )
                rec.add(f"wait.{v}.{waiters}.overlaps", r["overlaps"], "overlaps", **labels)
                rec.add(f"wait.{v}.{waiters}.errors", r["errors"], "threads", **labels)
                rec.say(
                    f"{v} x{waiters}: p50 {r['p50']:.2f} ms, p99 {r['p99']:.2f} ms "
                    f"({r['n']} samples, {r['elapsed']:.1f}s, overlaps {r['overlaps']})"
                )
        for v in variants:
            r = chain_procs(server.url, v, 32, samples)
            labels = dict(
                variant=v, label=VARIANTS[v], waiters=32, samples=r["n"], waiters_are="processes"
            )
            rec.add(f"wait.{v}.32p.p50", round(r["p50"], 3), "ms", **labels)
            rec.add(f"wait.{v}.32p.p99", round(r["p99"], 3), "ms", **labels)
            rec.add(f"wait.{v}.32p.overlaps", r["overlaps"], "overlaps", **labels)
            rec.add(f"wait.{v}.32p.errors", r["errors"], "processes", **labels)
            rec.say(
                f"{v} x32 processes: p50 {r['p50']:.2f} ms, p99 {r['p99']:.2f} ms "
                f"({r['n']} samples, {r['elapsed']:.1f}s, overlaps {r['overlaps']})"
            )
        for v in variants:
            rate = waiting_load(server.url, v, 32, hold=1.0 if quick else 2.0)
            rec.add(
                f"wait.{v}.32.idle_commands",
                round(rate, 1),
                "commands/s",
                variant=v,
                label=VARIANTS[v],
                waiters=32,
            )
            rec.say(f"{v}: {rate:.0f} Redis commands/s while 32 threads wait")
    rec.note(
        f"Each holder keeps the lease {HOLD * 1000:g} ms; a sample is measured from the "
        f"moment the holder calls release to the moment the next holder's acquire "
        f"returns (threads of one process, one perf_counter clock)."
    )
    return rec.result(peers=peer_status())


if __name__ == "__main__":
    raise SystemExit(group_main("wait", run))
