"""Group 1: the lock primitive against the peers, on one throwaway redis-server.

Uncontended (one thread, one connection, one name): a cycle is acquire + release; each variant
runs ``cycles`` timed cycles per repetition after a warm-up, in blocks of 50 cycles with the
variants interleaved block by block in a rotating order (a *round* is one block of each
variant, back to back: a few ms), repeated ``reps`` times. Reported: p50 is the median over
the repetitions of the median of each repetition's block medians (a burst of load from this
shared machine's neighbours slows some blocks; the median of block medians moves less than
the median of all samples); p99 and cycles/s are over all of a repetition's samples. A ratio
a / b is the median over a repetition's rounds of (a's block median / b's block median), the
two blocks of a round having run under the same load, then the median over the repetitions
(each repetition's value in ``reps``).

The floors: "PING" (one round trip) and "two PINGs" (the physical floor of a cycle of two
round trips: the ratio ours / two PINGs is the cost of everything but the network) run the
*same* client code, sequential PINGs on a pooled connection of ``make_client``, packed as
our EVALSHA calls are, and differ only in the count. Each round trip waits for the previous
reply, as an acquire and its release do, so pipelining them would measure something else.
With one code path, two PINGs / one PING (``ratio.ping2_vs_ping``, just under 2: a cycle's
own timing overhead is counted once) and server-side (``ratio.ping2_vs_ping_server``: 2
commands against 1) check the floors; they once came from two clients (redis-py's
``Redis.ping`` for one PING), and a loaded run put two PINGs at 70 us against one at 53 us.
The round trips per cycle are counted once with ``MONITOR``; Redis's own time per cycle with
``INFO commandstats`` (``CONFIG RESETSTAT`` before each block of 100 cycles, the variants
interleaved block by block) over ``server_cycles`` cycles: ``server_us`` sums every command's
usec, scripts' inner commands included (counted twice: inside their script's EVALSHA and on
their own); ``server_us_top`` sums only the commands the client sent, which is Redis's
execution time per cycle; ``cpu_us`` is Redis's process CPU time (``INFO cpu``) per cycle,
network I/O and protocol parsing included. Each is the median of the blocks' figures (the
whole run's mean beside it), and the server-side ratios the median of the rounds' ratios:
``usec`` is wall time around each command, so a neighbour taking Redis's core for a few ms
lands on whichever command it interrupts, and sums over thousands of sub-microsecond PINGs
were at its mercy.

Contended: 8 and 64 processes (fork) loop on *one* name for a fixed time with each library's
own blocking acquire; inside the critical section a process-shared counter detects overlaps
(two holders at once: must be 0). Reported: acquisitions/s, overlaps, the busiest process's
share (fairness), Redis commands/s (what waiting costs the server).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import time
import uuid
from collections.abc import Callable
from typing import Any

from .common import (
    commands_processed,
    group_main,
    join_or_kill,
    median,
    MonitorCapture,
    peer_status,
    profile_breakdown,
    profile_text,
    rep_figures,
    Recorder,
    servers,
)

#: Uncontended variants, in table order: key -> label.
UNCONTENDED = {
    "ping": "PING (round-trip floor, 1 RT)",
    "ping2": "two PINGs (physical floor of a 2-RT cycle)",
    "raw": "raw SET NX PX + EVALSHA release",
    "redis_py": "redis-py Lock",
    "prl": "python-redis-lock",
    "prl_renewal": "python-redis-lock, auto_renewal=True",
    "pottery": "pottery Redlock (1 master)",
    "ours": "celery-steplock RedisLeaseStore",
    "ours_meta": "celery-steplock + holder metadata (as StepLockedTask)",
    "ours_task": "celery-steplock, a default task's 3 scripts (acquire, OWNED, release)",
}
#: Contended variants: key -> (label, how it waits).
CONTENDED = {
    "raw": ("raw SET NX PX + EVALSHA", "retry every 1 ms"),
    "redis_py": ("redis-py Lock", "poll every 100 ms (sleep=0.1 default)"),
    "prl": ("python-redis-lock", "BLPOP on a signal list"),
    "pottery": ("pottery Redlock", "poll, random 0-200 ms"),
    "ours": ("celery-steplock", "BLPOP, one waiter woken per release"),
}
PEER_OF = {
    "redis_py": "redis",
    "prl": "python-redis-lock",
    "prl_renewal": "python-redis-lock",
    "pottery": "pottery",
}

RAW_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
TTL = 30


def _plain_client(url: str):
    import redis

    return redis.Redis.from_url(url)


def _pings(url: str, n: int) -> Callable[[], None]:
    """``n`` sequential PINGs, each a round trip on a pooled connection of
    :func:`~celery_steplock.lock.make_client`, the command packed once: as our EVALSHA calls
    go out. The one-PING and two-PING floors share this path (only ``n`` differs), so their
    ratio is the cost of one more round trip and nothing of two clients' code paths (the
    one-PING floor was once redis-py's ``Redis.ping``, a heavier path than the two-PING one,
    which put one PING at 53 us against two at 70 us)."""
    from celery_steplock.lock import make_client

    pool = make_client(url).connection_pool
    ping = b"*1\r\n$4\r\nPING\r\n"

    def cycle():
        for _ in range(n):
            conn = pool.get_connection()
            try:
                conn.send_packed_command([ping])
                if conn.read_response() != "PONG":
                    raise AssertionError("ping: no PONG")
            finally:
                pool.release(conn)

    return cycle


def build_cycle(variant: str, url: str, key: str) -> Callable[[], None]:
    """An uncontended acquire + release cycle of ``variant`` on its own client and key."""
    if variant in ("ping", "ping2"):
        return _pings(url, 1 if variant == "ping" else 2)
    if variant == "raw":
        from celery_steplock.lock import make_client

        client = make_client(url)  # the same client settings as ours: the fair floor
        release = client.register_script(RAW_RELEASE)

        def cycle():
            token = uuid.uuid4().hex
            if not client.set(key, token, nx=True, px=TTL * 1000):
                raise AssertionError("raw: not acquired")
            if release(keys=[key], args=[token]) != 1:
                raise AssertionError("raw: not released")

        return cycle
    if variant == "redis_py":
        client = _plain_client(url)

        def cycle():
            lock = client.lock(key, timeout=TTL)
            if not lock.acquire(blocking=False):
                raise AssertionError("redis-py: not acquired")
            lock.release()

        return cycle
    if variant in ("prl", "prl_renewal"):
        import redis
        import redis_lock

        client = redis.StrictRedis.from_url(url)
        renewal = variant == "prl_renewal"

        def cycle():
            lock = redis_lock.Lock(client, key, expire=TTL, auto_renewal=renewal)
            if not lock.acquire(blocking=False):
                raise AssertionError("python-redis-lock: not acquired")
            lock.release()

        return cycle
    if variant == "pottery":
        from pottery import Redlock

        client = _plain_client(url)

        def cycle():
            lock = Redlock(key=key, masters={client}, auto_release_time=TTL)
            if not lock.acquire(blocking=False):
                raise AssertionError("pottery: not acquired")
            lock.release()

        return cycle
    if variant in ("ours", "ours_meta", "ours_task"):
        from celery_steplock.lock import RedisLeaseStore, holder_metadata, make_client

        lock = RedisLeaseStore(make_client(url), prefix="bench")
        meta = (
            holder_metadata(
                "6f1c2a47-3b7e-4d1a-9a55-0c9d8e7f6a5b",
                "bench.tasks.charge",
                0,
                worker="celery@bench",
                step="workflows.step:42",
                renew_ms=TTL * 1000 // 3,
            )
            if variant != "ours"
            else None
        )
        check = variant == "ours_task"

        def cycle():
            lease = lock.acquire(key, ttl=float(TTL), metadata=meta)
            if lease is None:
                raise AssertionError("ours: not acquired")
            if check and lock.owned(lease.name, lease.owner) is None:
                raise AssertionError("ours: not owned")
            lock.release(lease.name, lease.owner)

        return cycle
    raise ValueError(variant)


def build_blocking(variant: str, url: str, key: str):
    """``(acquire, release)`` with the variant's own way of waiting for a busy lock."""
    if variant == "raw":
        from celery_steplock.lock import make_client

        client = make_client(url)
        release_script = client.register_script(RAW_RELEASE)

        def acquire():
            token = uuid.uuid4().hex
            while not client.set(key, token, nx=True, px=TTL * 1000):
                time.sleep(0.001)
            return token

        def release(token):
            release_script(keys=[key], args=[token])

        return acquire, release
    if variant == "redis_py":
        client = _plain_client(url)

        def acquire():
            lock = client.lock(key, timeout=TTL, sleep=0.1)
            lock.acquire(blocking=True)
            return lock

        return acquire, lambda lock: lock.release()
    if variant in ("prl", "prl_renewal"):
        import redis
        import redis_lock

        client = redis.StrictRedis.from_url(url)

        def acquire():
            lock = redis_lock.Lock(client, key, expire=TTL, auto_renewal=variant == "prl_renewal")
            lock.acquire(blocking=True)
            return lock

        return acquire, lambda lock: lock.release()
    if variant == "pottery":
        from pottery import Redlock

        client = _plain_client(url)

        def acquire():
            lock = Redlock(key=key, masters={client}, auto_release_time=TTL)
            lock.acquire(blocking=True)
            return lock

        return acquire, lambda lock: lock.release()
    if variant == "ours":
        from celery_steplock.lock import RedisLeaseStore, make_client

        lock = RedisLeaseStore(make_client(url), prefix="bench")

        def acquire():
            lease = lock.acquire(key, ttl=float(TTL), wait=120.0)
            if lease is None:
                raise AssertionError("ours: wait timed out")
            return lease

        return acquire, lambda lease: lock.release(lease.name, lease.owner)
    raise ValueError(variant)


def available(variant: str, peers: dict[str, dict[str, Any]]) -> tuple[bool, str | None]:
    dist = PEER_OF.get(variant)
    if dist is None:
        return True, None
    info = peers[dist]
    return info["ok"], info.get("error")


# -- uncontended -------------------------------------------------------------------------------

#: Where one acquire + release of ours spends its time (categories may overlap).
CYCLE_CATEGORIES = {
    "socket_wait": lambda f, fn: (
        f.endswith(("redis/_parsers/socket.py", "socket.py"))
        and fn in ("_read_from_socket", "recv", "recv_into", "sendall")
    ),
    "redis_py": lambda f, fn: "/redis/" in f,
    "lease_object": lambda f, fn: f.endswith("celery_steplock/lease.py") and fn == "__init__",
    "owner_token": lambda f, fn: (
        f.endswith("celery_steplock/lease.py") and fn == "new_owner_token"
    ),
}


def uncontended(
    rec: Recorder,
    url: str,
    cycles: int,
    reps: int,
    warmup: int,
    variants: list[str],
    profiles: dict[str, str],
    server_cycles: int = 10_000,
) -> None:
    import gc

    cyc = {v: build_cycle(v, url, f"bench:uncontended:{v}") for v in variants}
    per_rep: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    # rounds[rep][i][v]: the median of variant v's block in round i of repetition rep; the
    # blocks of one round run back to back (a few ms), so they share the machine's load.
    rounds: list[list[dict[str, float]]] = []
    clock = time.perf_counter_ns
    block = 50  # cycles of one variant in a row: the variants interleave every few ms, so a
    #             change of load on this shared machine hits them all alike
    for v in variants:
        for _ in range(warmup):
            cyc[v]()
    for rep in range(reps):
        samples: dict[str, list[int]] = {v: [] for v in variants}
        busy: dict[str, int] = {v: 0 for v in variants}
        rep_rounds: list[dict[str, float]] = []
        gc.collect()
        for b in range(max(1, cycles // block)):
            k = (rep + b) % len(variants)
            medians: dict[str, float] = {}
            for v in variants[k:] + variants[:k]:
                cycle = cyc[v]
                out: list[int] = []
                t_block = clock()
                for _ in range(block):
                    t0 = clock()
                    cycle()
                    out.append(clock() - t0)
                busy[v] += clock() - t_block
                samples[v].extend(out)
                medians[v] = median(out) / 1000.0
            rep_rounds.append(medians)
        rounds.append(rep_rounds)
        for v in variants:
            per_rep[v].append(rep_figures(rep_rounds, samples[v], busy[v], v))
        rec.say(
            f"uncontended rep {rep + 1}/{reps}: "
            + ", ".join(f"{v} p50 {per_rep[v][-1]['p50']:.0f}us" for v in variants)
        )
    for v in variants:
        rows = per_rep[v]
        rec.add(
            f"lock.uncontended.{v}.p50",
            round(median(r["p50"] for r in rows), 1),
            "us",
            variant=v,
            label=UNCONTENDED[v],
            basis="median over repetitions of the median of 50-cycle blocks' medians",
        )
        rec.add(
            f"lock.uncontended.{v}.p99",
            round(median(r["p99"] for r in rows), 1),
            "us",
            variant=v,
            label=UNCONTENDED[v],
        )
        rec.add(
            f"lock.uncontended.{v}.rate",
            round(median(r["rate"] for r in rows)),
            "cycles/s",
            variant=v,
            label=UNCONTENDED[v],
        )
        rec.add(
            f"lock.uncontended.{v}.p50_reps", [round(r["p50"], 1) for r in rows], "us", variant=v
        )
    # Ratios of block medians within each round (the blocks of one round share the load),
    # their median per repetition, then the median over the repetitions.
    for a, b in (
        ("ours", "raw"),
        ("ours_meta", "raw"),
        ("ours", "redis_py"),
        ("ours", "prl"),
        ("ours", "pottery"),
        ("raw", "ping"),
        ("ours", "ping"),
        ("ours", "ping2"),
        ("ours_meta", "ping2"),
        ("raw", "ping2"),
        ("ping2", "ping"),
    ):
        if a in per_rep and b in per_rep:
            ratios = [median(r[a] / r[b] for r in rep_rounds) for rep_rounds in rounds]
            rec.add(
                f"lock.uncontended.ratio.{a}_vs_{b}",
                round(median(ratios), 3),
                "x",
                reps=[round(r, 3) for r in ratios],
            )

    # Where our cycle spends its time, client side.
    if "ours" in cyc:
        try:
            from pyinstrument import Profiler
        except ImportError:
            Profiler = None
        if Profiler is not None:
            profiler = Profiler(interval=0.0001)
            profiler.start()
            for _ in range(cycles):
                cyc["ours"]()
            profiler.stop()
            profiles["lock-ours-cycle"] = profile_text(profiler)
            for name, share in profile_breakdown(profiler.last_session, CYCLE_CATEGORIES).items():
                if name != "total_s":
                    rec.add(f"lock.profile.ours.{name}", round(share * 100, 1), "% of time")

    # Round trips per cycle (client commands; script-internal commands apart).
    n = 20
    with MonitorCapture(url) as mon:
        for v in variants:
            mon.phase(v)
            for _ in range(n):
                cyc[v]()
    sent_by: dict[str, set[str]] = {}
    for v in variants:
        sent = mon.count(v)
        inner = mon.count(v, lua=True)
        sent_by[v] = {name.lower() for name in sent}
        rec.add(
            f"lock.uncontended.{v}.commands",
            round(sum(sent.values()) / n, 2),
            "commands/cycle",
            variant=v,
            detail={k: round(c / n, 2) for k, c in sorted(sent.items())},
        )
        rec.add(
            f"lock.uncontended.{v}.script_commands",
            round(sum(inner.values()) / n, 2),
            "commands/cycle",
            variant=v,
        )

    # Server-side time per cycle (INFO commandstats usec after CONFIG RESETSTAT, INFO cpu).
    server_time(rec, url, cyc, variants, sent_by, server_cycles)


def server_time(
    rec: Recorder,
    url: str,
    cyc: dict[str, Callable[[], None]],
    variants: list[str],
    sent_by: dict[str, set[str]],
    n: int,
) -> None:
    """Redis's time per cycle of each variant over ``n`` cycles, in blocks of 100 with the
    variants interleaved block by block in a rotating order (a round: one block of each).
    ``server_us_top``: usec of the commands the client sent (``sent_by``); ``server_us``:
    every command's usec (inner commands of scripts counted twice); ``cpu_us``: the process's
    CPU time. Each is the median over the blocks of the block's figure per cycle (``mean``
    beside it: the whole run's sum per cycle); a ratio is the median over the rounds of the
    two blocks' ratio. ``usec`` is wall time around each command: a neighbour that takes
    Redis's core for a few ms adds them to the command it interrupts, and a sum over
    thousands of sub-microsecond PINGs is at the mercy of a few such interruptions, which
    the median of blocks is not."""
    import redis

    admin = redis.Redis.from_url(url)
    block = 100
    blocks_top: dict[str, list[float]] = {v: [] for v in variants}
    blocks_all: dict[str, list[float]] = {v: [] for v in variants}
    blocks_cpu: dict[str, list[float]] = {v: [] for v in variants}
    rounds: list[dict[str, tuple[float, float]]] = []
    top = {v: 0 for v in variants}
    summed = {v: 0 for v in variants}
    cpu = {v: 0.0 for v in variants}
    calls = {v: 0 for v in variants}
    by_command: dict[str, dict[str, int]] = {v: {} for v in variants}

    def cpu_s() -> float:
        info = admin.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    blocks = max(1, n // block)
    for b in range(blocks):
        k = b % len(variants)
        this_round: dict[str, tuple[float, float]] = {}
        for v in variants[k:] + variants[:k]:
            cycle = cyc[v]
            admin.config_resetstat()
            cpu0 = cpu_s()
            for _ in range(block):
                cycle()
            used = cpu_s() - cpu0
            cpu[v] += used
            stats = admin.info("commandstats")
            b_top = b_all = 0
            for name, st in stats.items():
                command = name.removeprefix("cmdstat_")
                if command.startswith(("config", "info")):
                    continue
                usec = int(st.get("usec", 0))
                b_all += usec
                by_command[v][command] = by_command[v].get(command, 0) + usec
                if command in sent_by.get(v, ()):
                    b_top += usec
                    calls[v] += int(st.get("calls", 0))
            top[v] += b_top
            summed[v] += b_all
            blocks_top[v].append(b_top / block)
            blocks_all[v].append(b_all / block)
            blocks_cpu[v].append(used / block * 1e6)
            this_round[v] = (b_top / block, used / block * 1e6)
        rounds.append(this_round)
    admin.close()
    cycles = blocks * block
    for v in variants:
        us_top = median(blocks_top[v])
        rec.add(
            f"lock.uncontended.{v}.server_us",
            round(median(blocks_all[v]), 2),
            "us/cycle",
            variant=v,
            cycles=cycles,
            mean=round(summed[v] / cycles, 2),
            detail={c: round(u / cycles, 2) for c, u in sorted(by_command[v].items())},
        )
        rec.add(
            f"lock.uncontended.{v}.server_us_top",
            round(us_top, 2),
            "us/cycle",
            variant=v,
            cycles=cycles,
            mean=round(top[v] / cycles, 2),
            calls=round(calls[v] / cycles, 2),
            commands=sorted(sent_by.get(v, ())),
        )
        if us_top > 0:
            rec.add(
                f"lock.uncontended.{v}.cycles_per_core_s",
                round(1e6 / us_top),
                "cycles/s",
                variant=v,
                basis="server_us_top",
            )
        cpu_us = median(blocks_cpu[v])
        rec.add(
            f"lock.uncontended.{v}.cpu_us",
            round(cpu_us, 2),
            "us/cycle",
            variant=v,
            mean=round(cpu[v] / cycles * 1e6, 2),
        )
        if cpu_us > 0:
            rec.add(
                f"lock.uncontended.{v}.cycles_per_core_s_cpu",
                round(1e6 / cpu_us),
                "cycles/s",
                variant=v,
                basis="cpu_us",
            )

    def ratio(a: str, b: str, i: int) -> float:
        values = [r[a][i] / r[b][i] for r in rounds if r[b][i] > 0]
        return round(median(values), 3) if values else math.nan

    if "ping" in variants and "ping2" in variants:
        rec.add(
            "lock.uncontended.ratio.ping2_vs_ping_server",
            ratio("ping2", "ping", 0),
            "x",
            basis="server_us_top",
            calls={v: round(calls[v] / cycles, 2) for v in ("ping", "ping2")},
        )
    for a in ("ours", "ours_meta", "ours_task"):
        if a in variants and "raw" in variants:
            rec.add(
                f"lock.uncontended.ratio.{a}_vs_raw_server",
                ratio(a, "raw", 0),
                "x",
                basis="server_us_top",
                mean=round(top[a] / top["raw"], 3) if top["raw"] else None,
            )
            rec.add(
                f"lock.uncontended.ratio.{a}_vs_raw_cpu",
                ratio(a, "raw", 1),
                "x",
                basis="cpu_us",
            )


# -- contended ---------------------------------------------------------------------------------


def _contender(
    variant, url, key, idx, ready, start, stop_at, inside, overlaps, counts, errors, hold, think
):
    try:
        acquire, release = build_blocking(variant, url, key)
    except Exception:  # noqa: BLE001
        with errors.get_lock():
            errors.value += 1
        ready.release()
        return
    ready.release()
    start.wait()
    deadline = stop_at.value
    n = 0
    try:
        while time.monotonic() < deadline:
            handle = acquire()
            with inside.get_lock():
                inside.value += 1
                if inside.value > 1:
                    overlaps.value += 1
            time.sleep(hold)
            with inside.get_lock():
                if inside.value > 1:
                    overlaps.value += 1
                inside.value -= 1
            release(handle)
            n += 1
            if think:
                time.sleep(think)
    except Exception:  # noqa: BLE001
        with errors.get_lock():
            errors.value += 1
    counts[idx] = n


def contended_once(
    url: str,
    variant: str,
    workers: int,
    duration: float,
    hold: float = 0.0002,
    think: float = 0.001,
) -> dict[str, Any]:
    import redis

    ctx = mp.get_context("fork")
    key = f"bench:contended:{variant}:{workers}:{uuid.uuid4().hex[:6]}"
    ready = ctx.Semaphore(0)
    start = ctx.Event()
    stop_at = ctx.Value("d", 0.0)
    inside = ctx.Value("i", 0)
    overlaps = ctx.Value("i", 0)
    errors = ctx.Value("i", 0)
    counts = ctx.Array("i", workers)
    procs = [
        ctx.Process(
            target=_contender,
            args=(
                variant,
                url,
                key,
                i,
                ready,
                start,
                stop_at,
                inside,
                overlaps,
                counts,
                errors,
                hold,
                think,
            ),
            daemon=True,
        )
        for i in range(workers)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.acquire(timeout=60)
    client = redis.Redis.from_url(url)
    before = commands_processed(client)
    stop_at.value = time.monotonic() + duration
    t0 = time.monotonic()
    start.set()
    time.sleep(duration)
    during = commands_processed(client) - before
    elapsed_cmd = time.monotonic() - t0
    stuck = join_or_kill(procs, 60)
    client.close()
    total = sum(counts)
    return {
        "acq_per_s": total / duration,
        "overlaps": overlaps.value,
        "errors": errors.value,
        "stuck": stuck,
        "max_share": (max(counts) / total) if total else None,
        "starved": sum(1 for c in counts if c == 0),
        "redis_cmds_per_s": during / elapsed_cmd,
    }


def contended(
    rec: Recorder, url: str, levels: list[int], duration: float, reps: int, variants: list[str]
) -> None:
    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for rep in range(reps):
        for workers in levels:
            order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
            for v in order:
                r = contended_once(url, v, workers, duration)
                results.setdefault((v, workers), []).append(r)
                rec.say(
                    f"contended rep {rep + 1}/{reps} {v} x{workers}: "
                    f"{r['acq_per_s']:.0f} acq/s, overlaps {r['overlaps']}, "
                    f"max share {r['max_share'] or 0:.2f}, {r['redis_cmds_per_s']:.0f} cmd/s"
                )
    for (v, workers), rows in results.items():
        label, waits = CONTENDED[v]
        labels = dict(variant=v, workers=workers, label=label, waits=waits)
        rec.add(
            f"lock.contended.{v}.{workers}.rate",
            round(median(r["acq_per_s"] for r in rows)),
            "acquisitions/s",
            **labels,
        )
        rec.add(
            f"lock.contended.{v}.{workers}.overlaps",
            sum(r["overlaps"] for r in rows),
            "overlaps",
            **labels,
        )
        rec.add(
            f"lock.contended.{v}.{workers}.max_share",
            round(median(r["max_share"] for r in rows if r["max_share"] is not None), 3),
            "share",
            **labels,
        )
        rec.add(
            f"lock.contended.{v}.{workers}.starved",
            round(median(r["starved"] for r in rows)),
            "processes",
            **labels,
        )
        rec.add(
            f"lock.contended.{v}.{workers}.redis_cmds",
            round(median(r["redis_cmds_per_s"] for r in rows)),
            "commands/s",
            **labels,
        )
        rec.add(
            f"lock.contended.{v}.{workers}.errors",
            sum(r["errors"] + r["stuck"] for r in rows),
            "processes",
            **labels,
        )


def run(quick: bool = False) -> dict[str, Any]:
    rec = Recorder("lock")
    peers = peer_status()
    uncontended_variants = []
    for v in UNCONTENDED:
        ok, why = available(v, peers)
        if ok:
            uncontended_variants.append(v)
        else:
            rec.note(f"{UNCONTENDED[v]} skipped: {why}")
    contended_variants = [v for v in CONTENDED if available(v, peers)[0]]
    profiles: dict[str, str] = {}
    with servers.RedisServer() as server:
        url = server.url
        rec.say(f"redis-server {url} (pid {server.pid})")
        if quick:
            uncontended(
                rec,
                url,
                cycles=300,
                reps=2,
                warmup=30,
                variants=uncontended_variants,
                profiles=profiles,
                server_cycles=1000,
            )
            contended(rec, url, levels=[8, 64], duration=0.5, reps=1, variants=contended_variants)
        else:
            uncontended(
                rec,
                url,
                cycles=2000,
                reps=5,
                warmup=200,
                variants=uncontended_variants,
                profiles=profiles,
                server_cycles=10_000,
            )
            contended(rec, url, levels=[8, 64], duration=2.0, reps=3, variants=contended_variants)
    rec.note(
        "Uncontended: peers use a default redis.Redis client; ours and the raw floor use "
        "celery_steplock.make_client (decode_responses=True, one retry), the same client "
        "for both so that their ratio isolates the library's own cost."
    )
    rec.note(
        "Contended: each process holds the lock 0.2 ms, then waits 1 ms before asking "
        "again; overlaps are counted with a process-shared counter inside the critical "
        "section."
    )
    return rec.result(peers=peers, profiles=profiles)


if __name__ == "__main__":
    raise SystemExit(group_main("lock", run))
