"""Benchmark group ``bulkhead``: the concurrency limit (celery_steplock.patterns.concurrency).

- decision latency (one client, round trip included), p50 and p99, of a granted slot (acquire
  and release) and of a refused one, for limits of 1, 10 and 100 slots; Redis server time per
  decision (``INFO commandstats``, ``evalsha`` microseconds per call: for a granted slot the
  mean of its acquire and its release);
- accuracy: 1, 2 and 8 processes, each taking a slot of one key (limit 4) with
  ``acquire(wait=...)``, working 20 ms and giving it back, record every hold (Redis ``TIME``);
  the most holds open at one instant, against the limit, and the same run without the limit
  (the negative control).

``python -m benchmarks.bulkhead --out FILE [--quick]``.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from typing import Any

import redis

from benchmarks.common import Recorder, group_main, percentile
from tests.support import servers

LIMIT = 4
HOLD = 0.02


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, 0) for _, e in intervals])
    open_now = peak = 0
    for _, opening in edges:
        open_now += 1 if opening else -1
        peak = max(peak, open_now)
    return peak


def evalsha_usec(client: redis.Redis) -> float | None:
    stats = client.info("commandstats")
    entry = stats.get("cmdstat_evalsha")
    return None if not entry else float(entry["usec_per_call"])


def measure_latency(rec: Recorder, url: str, limit: int, rounds: int) -> None:
    from celery_steplock.patterns.concurrency import ConcurrencyLimit
    from celery_steplock.lock import RedisLeaseStore

    client = redis.Redis.from_url(url)
    client.flushdb()
    store = RedisLeaseStore(client, prefix="bench")
    bulkhead = ConcurrencyLimit(limit)
    meta = {"kind": "slot", "limit": limit, "limit_key": "k"}
    for _ in range(50):  # warm up: script cache, connection
        store.release(
            bulkhead.try_acquire(
                store, "k", owner="warm", ticket=None, ttl=30.0, metadata=meta
            ).lease.name,
            "warm",
        )
    client.config_resetstat()
    granted = []
    for i in range(rounds):
        started = time.perf_counter()
        slot = bulkhead.try_acquire(
            store, "k", owner=f"o{i}", ticket=None, ttl=30.0, metadata=meta
        )
        granted.append(time.perf_counter() - started)
        store.release(slot.lease.name, slot.owner)
    server = evalsha_usec(client)
    for n in range(limit):
        bulkhead.try_acquire(store, "k", owner=f"holder{n}", ticket=None, ttl=30.0, metadata=meta)
    client.config_resetstat()
    refused = []
    for i in range(rounds):
        started = time.perf_counter()
        try:
            bulkhead.try_acquire(store, "k", owner=f"r{i}", ticket=None, ttl=30.0, metadata=meta)
        except Exception:  # noqa: BLE001 - ConcurrencyLimited, expected
            pass
        refused.append(time.perf_counter() - started)
    refused_server = evalsha_usec(client)
    for name, values in (("granted", granted), ("refused", refused)):
        rec.add(f"bulkhead.latency.{name}.p50", percentile(values, 50) * 1000, "ms", limit=limit)
        rec.add(f"bulkhead.latency.{name}.p99", percentile(values, 99) * 1000, "ms", limit=limit)
    rec.add("bulkhead.server.granted", server, "us/evalsha", limit=limit)
    rec.add("bulkhead.server.refused", refused_server, "us/evalsha", limit=limit)
    rec.say(
        f"limit {limit}: granted p50 {percentile(granted, 50) * 1000:.3f} ms p99 "
        f"{percentile(granted, 99) * 1000:.3f} ms (server {server} us per script call, "
        f"acquire and release); "
        f"refused p50 {percentile(refused, 50) * 1000:.3f} ms (server {refused_server} us)"
    )
    client.close()


def _holder(url: str, limited: bool, seconds: float, out_key: str) -> None:
    from celery_steplock.patterns.concurrency import ConcurrencyLimit

    client = redis.Redis.from_url(url)
    bulkhead = ConcurrencyLimit(LIMIT, retry_after=0.01, waiter_ttl=10.0)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if limited:
            with bulkhead.acquire("acc", client=client, prefix="bench", wait=30):
                start = client.time()
                time.sleep(HOLD)
                end = client.time()
        else:
            start = client.time()
            time.sleep(HOLD)
            end = client.time()
        client.rpush(out_key, json.dumps([start[0] + start[1] / 1e6, end[0] + end[1] / 1e6]))
    client.close()


def measure_accuracy(rec: Recorder, url: str, processes: int, seconds: float) -> None:
    client = redis.Redis.from_url(url)
    for limited in (True, False):
        client.flushdb()
        key = "bench:acc:runs"
        ctx = multiprocessing.get_context("spawn")
        procs = [
            ctx.Process(target=_holder, args=(url, limited, seconds, key))
            for _ in range(processes)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(seconds + 60)
        intervals = [tuple(json.loads(x)) for x in client.lrange(key, 0, -1)]
        peak = max_overlap(intervals)
        label = "limited" if limited else "unlimited"
        rec.add(
            f"bulkhead.accuracy.{label}.max_concurrent",
            peak,
            "executions",
            processes=processes,
            configured=LIMIT if limited else None,
        )
        rec.add(f"bulkhead.accuracy.{label}.holds", len(intervals), "holds", processes=processes)
        rec.say(
            f"{processes} processes, {label}: {len(intervals)} holds, at most {peak} at "
            f"once (limit {LIMIT if limited else '-'})"
        )
    client.close()


def run(quick: bool = False) -> dict[str, Any]:
    rec = Recorder("bulkhead")
    rounds = 300 if quick else 3000
    with servers.RedisServer() as server:
        for limit in (1, 10, 100):
            measure_latency(rec, server.url, limit, rounds)
        for processes in (1, 2, 8):
            measure_accuracy(rec, server.url, processes, 1.0 if quick else 3.0)
    rec.note(
        f"Accuracy: each process holds a slot of one key (limit {LIMIT}) for {HOLD * 1000:g}"
        f" ms at a time with acquire(wait=...), holds recorded with Redis TIME; the "
        f"unlimited run is the same loop without the limit."
    )
    return rec.result()


if __name__ == "__main__":
    raise SystemExit(group_main("bulkhead", run))
