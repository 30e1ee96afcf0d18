"""Group 3: the heartbeat at scale.

1, 100, 1,000 and 10,000 leases, acquired with ``RedisLeaseStore.acquire`` and registered with
*one* :class:`~celery_steplock.heartbeat.Heartbeat` in this process (what one worker process
holding that many leases does: threads or a gevent pool). Leases have the default TTL of 30 s
and are registered with ``ratio=1/30`` so that they are renewed every second (the interval is
what matters, not the TTL). After a warm-up of 3 intervals (the renewal groups formed while a
burst of leases is being registered merge within an interval or two) the window is observed
for several intervals: round trips per interval (the Heartbeat's ``round_trips`` counter,
checked against Redis's EVALSHA count), time per renewal cycle (a subclass times
``_renew``), CPU seconds per second of the process (``time.process_time``), threads alive,
leases lost (must be 0). Also 1,000 leases taken one by one over 3 s (renewal phases spread,
as in a busy worker). For comparison, python-redis-lock's ``auto_renewal`` (a thread per lock).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .common import (
    Recorder,
    group_main,
    peer_status,
    percentile,
    profile_breakdown,
    profile_text,
    servers,
)

INTERVAL = 1.0
TTL = 30.0


def evalsha_calls(client) -> int:
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


#: Where a renewal cycle spends its time (profile categories; they may overlap).
CYCLE_CATEGORIES = {
    "encode_and_send": lambda f, fn: (
        f.endswith("celery_steplock/lock.py")
        and fn in ("calls", "_pack")
        or "/redis/" in f
        and fn == "send_packed_command"
    ),
    "read_replies": lambda f, fn: "/redis/" in f and fn == "read_response",
    "events": lambda f, fn: f.endswith("celery_steplock/events.py"),
    "lease_bookkeeping": lambda f, fn: (
        f.endswith("celery_steplock/lock.py") and fn in ("renewed", "lost", "drift", "remaining")
    ),
}


def measure_ours(
    rec: Recorder,
    url: str,
    count: int,
    window_intervals: int,
    profile: bool = False,
    profiles: dict | None = None,
    spread: float = 0.0,
) -> None:
    import redis

    from celery_steplock.heartbeat import Heartbeat
    from celery_steplock.lock import RedisLeaseStore, make_client

    class TimedHeartbeat(Heartbeat):
        def __init__(self):
            super().__init__()
            self.cycle_times: list[float] = []
            self.cycle_sizes: list[int] = []
            self.cycle_starts: list[tuple[float, int]] = []  # (monotonic, round trips)
            self.profile_next = False
            self.profile = None

        def _renew(self, due):
            if self.profile_next and len(due) == count:
                # One cycle under pyinstrument, after the window (it slows the cycle down).
                self.profile_next = False
                from pyinstrument import Profiler

                profiler = Profiler(interval=0.0005)
                profiler.start()
                try:
                    super()._renew(due)
                finally:
                    profiler.stop()
                    self.profile = profiler
                return
            t0 = time.perf_counter()
            started, rts = time.monotonic(), self.round_trips
            try:
                super()._renew(due)
            finally:
                self.cycle_times.append(time.perf_counter() - t0)
                self.cycle_sizes.append(len(due))
                self.cycle_starts.append((started, self.round_trips - rts))

    admin = redis.Redis.from_url(url)
    admin.flushdb()
    lock = RedisLeaseStore(make_client(url), prefix="hb")
    threads_before = threading.active_count()
    hb = TimedHeartbeat()
    if spread:
        # Leases taken one by one over `spread` seconds and registered at once, as a worker
        # takes tasks over time: their renewal phases differ.
        leases = []
        t0 = time.perf_counter()
        for i in range(count):
            lease = lock.acquire(f"lease:{i}", ttl=TTL)
            hb.register(lease, lock, ratio=INTERVAL / TTL)
            leases.append(lease)
            time.sleep(max(0.0, t0 + spread * (i + 1) / count - time.perf_counter()))
        acquire_s = time.perf_counter() - t0
        register_s = 0.0
    else:
        t0 = time.perf_counter()
        leases = [lock.acquire(f"lease:{i}", ttl=TTL) for i in range(count)]
        acquire_s = time.perf_counter() - t0
        assert all(leases), "a lease was not granted"
        t0 = time.perf_counter()
        for lease in leases:
            hb.register(lease, lock, ratio=INTERVAL / TTL)
        register_s = time.perf_counter() - t0
    # Warm-up: renewal groups formed while a burst of leases is registered merge within an
    # interval or two (each cycle takes whatever falls due within an interval).
    time.sleep(3 * INTERVAL)
    c0, rt0, n0 = hb.cycles, hb.round_trips, len(hb.cycle_times)
    ev0 = evalsha_calls(admin)
    cpu0, wall0 = time.process_time(), time.monotonic()
    max_threads = 0
    end = wall0 + window_intervals * INTERVAL
    while time.monotonic() < end:
        max_threads = max(max_threads, threading.active_count())
        time.sleep(0.05)
    cpu = time.process_time() - cpu0
    wall = time.monotonic() - wall0
    c1, rt1 = hb.cycles, hb.round_trips
    ev1 = evalsha_calls(admin)
    cycle_times = hb.cycle_times[n0:]
    intervals = wall / INTERVAL
    lost = sum(1 for lease in leases if lease.lost)
    labels = dict(leases=count, interval_s=INTERVAL, acquired_over_s=round(acquire_s, 2))
    p = f"heartbeat.{'ours_spread' if spread else 'ours'}.{count}"
    # Per interval between the first and the last cycle of the window: counting the cycles
    # inside a window of whole intervals gives N or N+1 depending on their phase.
    inside = [(t, rt) for t, rt in hb.cycle_starts if wall0 <= t <= wall0 + wall]
    if len(inside) >= 2 and inside[-1][0] > inside[0][0]:
        span = (inside[-1][0] - inside[0][0]) / INTERVAL
        rt_rate = sum(rt for _, rt in inside[1:]) / span
        cycle_rate = (len(inside) - 1) / span
    else:
        rt_rate, cycle_rate = (rt1 - rt0) / intervals, (c1 - c0) / intervals
    rec.add(f"{p}.round_trips_per_interval", round(rt_rate, 2), "round trips/interval", **labels)
    rec.add(f"{p}.cycles_per_interval", round(cycle_rate, 2), "cycles/interval", **labels)
    rec.add(
        f"{p}.renewals_per_interval", round((ev1 - ev0) / intervals), "EVALSHA/interval", **labels
    )
    rec.add(f"{p}.cycle_p50", round(percentile(cycle_times, 50) * 1000, 2), "ms", **labels)
    rec.add(f"{p}.cycle_max", round(max(cycle_times, default=0) * 1000, 2), "ms", **labels)
    rec.add(f"{p}.cpu", round(cpu / wall, 4), "CPU s/s", **labels)
    rec.add(
        f"{p}.threads",
        max_threads - threads_before + 1,
        "threads (heartbeat + this one)",
        **labels,
        process_threads=max_threads,
    )
    rec.add(f"{p}.lost", lost, "leases", **labels)
    rec.add(f"{p}.acquire_s", round(acquire_s, 2), "s", **labels)
    rec.add(f"{p}.register_s", round(register_s * 1000, 1), "ms", **labels)
    rec.say(
        f"{p}: {rt_rate:.2f} RT/interval, cycle p50 "
        f"{percentile(cycle_times, 50) * 1000:.1f} ms, cpu {cpu / wall:.3f} s/s, "
        f"threads {max_threads}, lost {lost}"
    )
    if profile:
        hb.profile_next = True
        deadline = time.monotonic() + 3 * INTERVAL
        while hb.profile is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if hb.profile is not None:
            profiles[f"heartbeat-{count}"] = profile_text(hb.profile)
            shares = profile_breakdown(hb.profile.last_session, CYCLE_CATEGORIES)
            for name, share in shares.items():
                if name != "total_s":
                    rec.add(
                        f"{p}.profile.{name}", round(share * 100, 1), "% of cycle", leases=count
                    )
    for lease in leases:
        hb.unregister(lease)
    deadline = time.monotonic() + 5
    while hb.thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    rec.add(f"{p}.thread_exits", hb.thread is None, "bool", **labels)
    return cycle_times


def measure_prl(
    rec: Recorder, url: str, count: int, window: float, default_pool: bool = False
) -> None:
    """python-redis-lock with auto_renewal: one renewal thread per held lock. The client's
    pool is large enough for every thread, unless ``default_pool`` (redis-py 8's default:
    100 connections)."""
    import redis
    import redis_lock

    admin = redis.Redis.from_url(url)
    admin.flushdb()
    client = (
        redis.StrictRedis.from_url(url)
        if default_pool
        else redis.StrictRedis.from_url(url, max_connections=count + 100)
    )
    # Renewal threads that die (an exception in python-redis-lock's _lock_renewer) are
    # counted, not printed.
    thread_errors: list[str] = []
    previous_hook = threading.excepthook

    def count_error(args):
        thread_errors.append(f"{args.exc_type.__name__}: {args.exc_value}")

    threading.excepthook = count_error
    threads_before = threading.active_count()
    expire = 3  # renewal every expire * 2/3 = 2 s
    locks = []
    for i in range(count):
        lk = redis_lock.Lock(client, f"prl:{i}", expire=expire, auto_renewal=True)
        lk.acquire(blocking=False)
        locks.append(lk)
    time.sleep(1.0)
    ev0 = evalsha_calls(admin)
    cpu0, wall0 = time.process_time(), time.monotonic()
    max_threads = 0
    end = wall0 + window
    while time.monotonic() < end:
        max_threads = max(max_threads, threading.active_count())
        time.sleep(0.05)
    cpu = time.process_time() - cpu0
    wall = time.monotonic() - wall0
    ev1 = evalsha_calls(admin)
    interval = expire * 2 / 3
    labels = dict(leases=count, interval_s=interval, pool=client.connection_pool.max_connections)
    prl = "prl_default_pool" if default_pool else "prl"
    rec.add(
        f"heartbeat.{prl}.{count}.round_trips_per_interval",
        round((ev1 - ev0) / (wall / interval), 1),
        "round trips/interval",
        **labels,
    )
    rec.add(f"heartbeat.{prl}.{count}.cpu", round(cpu / wall, 4), "CPU s/s", **labels)
    rec.add(
        f"heartbeat.{prl}.{count}.threads", max_threads - threads_before + 1, "threads", **labels
    )
    rec.say(
        f"python-redis-lock auto_renewal x{count}: threads {max_threads}, "
        f"cpu {cpu / wall:.3f} s/s, renewal threads died {len(thread_errors)}"
    )
    lost = 0
    for lk in locks:
        try:
            lk.release()
        except redis_lock.NotAcquired:
            lost += 1
    threading.excepthook = previous_hook
    rec.add(f"heartbeat.{prl}.{count}.lost", lost, "locks", **labels)
    rec.add(
        f"heartbeat.{prl}.{count}.thread_errors",
        len(thread_errors),
        "renewal threads died",
        **labels,
        first=thread_errors[0] if thread_errors else None,
    )
    if lost or thread_errors:
        rec.note(
            f"python-redis-lock auto_renewal with {count} locks (redis-py pool of "
            f"{client.connection_pool.max_connections}): {len(thread_errors)} "
            f"renewal threads died ({thread_errors[0] if thread_errors else ''}), "
            f"{lost} locks were lost before their release"
        )


def run(quick: bool = False) -> dict[str, Any]:
    rec = Recorder("heartbeat")
    peers = peer_status()
    scales = [1, 100, 1000] if quick else [1, 100, 1000, 10000]
    window = 2 if quick else 5
    profiles: dict[str, str] = {}
    with servers.RedisServer() as server:
        for count in scales:
            measure_ours(
                rec, server.url, count, window, profile=count == scales[-1], profiles=profiles
            )
        # Renewal phases spread over 3 intervals (the steady state of a busy worker).
        measure_ours(rec, server.url, 1000, window, spread=3.0 * INTERVAL)
        if peers["python-redis-lock"]["ok"]:
            for count in [100] if quick else [100, 1000]:
                measure_prl(rec, server.url, count, 2.0 if quick else 4.0)
            if not quick:
                measure_prl(rec, server.url, 1000, 4.0, default_pool=True)
        else:
            rec.note(f"python-redis-lock skipped: {peers['python-redis-lock'].get('error')}")
    rec.note(
        f"Leases use TTL {TTL:g} s and renewal ratio {INTERVAL / TTL:.4f} (interval "
        f"{INTERVAL:g} s); python-redis-lock locks expire=3 s (its thread renews every "
        f"2 s)."
    )
    return rec.result(peers=peers, profiles=profiles)


if __name__ == "__main__":
    raise SystemExit(group_main("heartbeat", run))
