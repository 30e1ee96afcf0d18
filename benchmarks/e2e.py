"""Group 2: end to end through a real ``celery worker`` (prefork, concurrency 2, Redis broker).

For SQLite and PostgreSQL (each in a process of its own, since Django's database is chosen at
import): a broker redis-server and a lock-store redis-server, the database migrated, one
``celery -A benchmarks.e2e_app worker -c 2 -P prefork`` started with ``scripts.servers``.

A batch: N tasks of one kind are published to ``bench.q`` while the worker does not consume
it (plus an end marker), then ``add_consumer`` starts the clock and the batch counts as drained
when the marker ran and no message is left unacknowledged. Around the drain, the CPU time
(user + system) of the worker's processes is read from ``/proc`` (the main process and its
prefork children, each with the time of its waited-for children), plus the lock-store Redis's
(``INFO cpu``) and, on PostgreSQL, the database server's processes. CPU seconds per task is the
primary figure: on a shared machine the drain rate moves with the neighbours' load, the CPU a
task costs much less. The kinds are interleaved in a rotating order (A B C, B C A, ...) for
at least 5 repetitions; each figure is the median with its spread (min..max and the
interquartile range), and a comparison is the ratio of the medians (the ratios within each
repetition are kept beside it). Then a counting pass: K tasks of each kind under ``MONITOR`` on
the lock store (commands sent at publish and in the worker, and inside scripts), and the SQL
statements per task counted in the worker (``benchmarks.e2e_app``; only for the counting
pass's tasks, so the throughput batches run uninstrumented).

``python -m benchmarks.e2e --db sqlite --profile steplock handwritten_full`` profiles task
bodies called in this process (pyinstrument) without starting a worker, for looking at where
an execution's time goes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from .common import (
    ROOT,
    installed_variants,
    median,
    MonitorCapture,
    peer_status,
    percentile,
    profile_breakdown,
    profile_text,
    Recorder,
    servers,
    spread,
    write_result,
)

KINDS = {
    "plain": "plain Task (baseline)",
    "once": "celery-once QueueOnce",
    "singleton": "celery-singleton Singleton",
    "handwritten": "hand-written lease + ORM CAS + shared heartbeat",
    "handwritten_full": "hand-written, the default's work (fenced lease, precheck, fenced CAS, "
    "deadline, ownership check)",
    "steplock": "StepLockedTask, transition pending->done",
    "steplock_noprecheck": "StepLockedTask, lock_precheck=False",
    "steplock_wait": "StepLockedTask, waiting for the release's reply (steplock_release_wait)",
}
STEP_KINDS = (
    "handwritten",
    "handwritten_full",
    "steplock",
    "steplock_noprecheck",
    "steplock_wait",
)
#: Short names of the three compared in the targets.
SHORT = {"steplock": "(a)", "handwritten": "(b)", "handwritten_full": "(c)"}
PEER_OF = {"once": "celery-once", "singleton": "celery-singleton"}
QUEUE = "bench.q"
#: Counted apart from the statements: transaction control and connections.
TXN_KINDS = ("BEGIN", "COMMIT", "ROLLBACK", "CONNECT")

#: Where a StepLockedTask execution spends its time (profile categories; they may overlap).
TASK_PROFILE_CATEGORIES = {
    "settings": lambda f, fn: f.endswith("celery_steplock/conf.py"),
    "redis": lambda f, fn: "/redis/" in f,
    "django_orm": lambda f, fn: "/django/db/" in f,
    "heartbeat_thread_start": lambda f, fn: f.endswith("threading.py") and fn == "start",
    "events": lambda f, fn: f.endswith("celery_steplock/events.py"),
    "lock_name": lambda f, fn: f.endswith("celery_steplock/keys.py"),
}


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _proc_table() -> dict[int, tuple[int, float]]:
    """pid -> (ppid, CPU seconds: utime + stime + cutime + cstime) of every process."""
    table: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                data = fh.read()
        except OSError:
            continue  # exited meanwhile
        fields = data[data.rindex(b")") + 2 :].split()
        # After the command: state, ppid, ..., utime (14th field of the line), stime,
        # cutime, cstime (in clock ticks).
        ticks = sum(int(x) for x in fields[11:15])
        table[int(entry)] = (int(fields[1]), ticks / _CLK_TCK)
    return table


def tree_cpu(
    root: int | None, table: dict[int, tuple[int, float]] | None = None
) -> dict[str, float]:
    """CPU seconds used so far by process ``root`` and its descendants: ``{"total", "root",
    "children"}``. A child that exited and was waited for is counted in its parent's cutime
    and cstime, so deltas stay continuous when a child is replaced."""
    if root is None:
        return {"total": 0.0, "root": 0.0, "children": 0.0}
    table = table if table is not None else _proc_table()
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _cpu) in table.items():
        kids.setdefault(ppid, []).append(pid)
    children = 0.0
    stack = list(kids.get(root, []))
    while stack:
        pid = stack.pop()
        children += table[pid][1]
        stack.extend(kids.get(pid, []))
    own = table.get(root, (0, 0.0))[1]
    return {"total": own + children, "root": own, "children": children}


def _quartiles(values: list[float]) -> tuple[float, float]:
    data = sorted(values)
    if len(data) < 2:
        return (data[0], data[0]) if data else (math.nan, math.nan)
    q = statistics.quantiles(data, n=4, method="inclusive")
    return q[0], q[2]


def summary(values: list[float], digits: int = 1) -> dict[str, Any]:
    """Median, min, max, interquartile range and every value, rounded, as figure labels."""
    lo, hi = spread(values)
    q1, q3 = _quartiles(values)
    r = lambda x: round(x, digits)  # noqa: E731
    return {
        "value": r(median(values)),
        "min": r(lo),
        "max": r(hi),
        "q1": r(q1),
        "q3": r(q3),
        "all": [r(v) for v in values],
    }


class Bench:
    def __init__(self, rec: Recorder, db: str, workdir: Path, lock_latency_ms: float = 0.0):
        #: Round-trip latency (ms) added between the worker and the lock store by a
        #: userspace proxy (benchmarks/latency_proxy.py): a lock store in another zone.
        self.lock_latency_ms = lock_latency_ms
        self.proxy: Any = None
        self.rec = rec
        self.db = db
        self.workdir = workdir
        self.batch_no = 0
        self.arg_base = 0
        self.profiles: dict[str, str] = {}

    # -- setup ----------------------------------------------------------------------------

    def start(self, worker: bool = True) -> None:
        self.broker = servers.RedisServer().start()
        self.lockstore = servers.RedisServer().start()
        lock_url = self.lockstore.url
        if self.lock_latency_ms:
            from benchmarks.latency_proxy import LatencyProxy

            # Half the added round trip each way; MONITOR and INFO stay direct.
            self.proxy = LatencyProxy(
                ("127.0.0.1", self.lockstore.port), self.lock_latency_ms / 2000
            ).start()
            lock_url = self.proxy.url
        env = {
            "DJANGO_SETTINGS_MODULE": "benchmarks.e2e_settings",
            "REDIS_URL": self.broker.url,
            "STEPLOCK_REDIS_URL": lock_url,
            "STEPLOCK_VAR_DIR": str(self.workdir),
            "STEPLOCK_LOG_LEVEL": "WARNING",
            "BENCH_SQL_DIR": str(self.workdir / "sql"),
            "PYTHONPATH": str(ROOT),
        }
        (self.workdir / "sql").mkdir()
        if self.db == "sqlite":
            env["STEPLOCK_SQLITE"] = str(self.workdir / "bench.sqlite3")
            os.environ.pop("DATABASE_URL", None)
        else:
            self.pg = servers.PostgresServer().start()
            env["DATABASE_URL"] = self.pg.url
        os.environ.update(env)
        self.env = env
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        from benchmarks import e2e_app

        self.app = e2e_app.app
        self.tasks = {
            name: e2e_app.app.tasks[f"bench.{name}"]
            for name in KINDS
            if f"bench.{name}" in e2e_app.app.tasks
        }
        self.mark = e2e_app.app.tasks["bench.mark"]
        import redis

        self.broker_client = redis.Redis.from_url(self.broker.url)
        self.lock_client = redis.Redis.from_url(self.lockstore.url)
        if not worker:
            return
        self.worker = servers.celery_worker(
            app="benchmarks.e2e_app",
            name="bench",
            concurrency=2,
            pool="prefork",
            env=env,
            logfile=self.workdir / "worker.log",
            extra_args=("-Q", "bench.ctl"),
            cwd=ROOT,
        )
        self.node = f"bench@{socket.gethostname()}"
        self.rec.say(
            f"{self.db}: worker pid {self.worker.pid}, broker {self.broker.url}, "
            f"lock store {self.lockstore.url}"
        )

    def stop(self) -> None:
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.terminate()
        if self.proxy is not None:
            self.proxy.stop()
        for name in ("pg", "lockstore", "broker"):
            server = getattr(self, name, None)
            if server is not None:
                server.stop()

    # -- one batch --------------------------------------------------------------------------

    def make_args(self, kind: str, n: int) -> list[Any]:
        if kind in STEP_KINDS:
            from django_app.workflows.models import Step

            steps = Step.objects.bulk_create(
                [Step(name=f"bench-{kind}-{self.batch_no}-{i}") for i in range(n)]
            )
            ids = [s.pk for s in steps]
            if any(i is None for i in ids):  # a backend that returns no primary keys
                ids = list(
                    Step.objects.filter(
                        name__startswith=f"bench-{kind}-{self.batch_no}-"
                    ).values_list("pk", flat=True)
                )
            return ids
        base = self.arg_base
        self.arg_base += n
        return list(range(base, base + n))

    def run_batch(self, kind: str, n: int) -> dict[str, float]:
        self.batch_no += 1
        batch = f"{os.getpid()}-{self.batch_no}"
        args = self.make_args(kind, n)
        task = self.tasks[kind]
        t0 = time.perf_counter()
        for a in args:
            task.apply_async((a,), queue=QUEUE)
        self.mark.apply_async((batch,), queue=QUEUE)
        publish = time.perf_counter() - t0
        drain, cpu = self.drain(batch, n, measure_cpu=True)
        result = {"drain": drain, "publish": publish, "rate": n / drain, **cpu}
        if kind in STEP_KINDS:
            from django_app.workflows.models import Step

            done = Step.objects.filter(pk__in=args, status="done").count()
            if done != n:
                self.rec.note(f"{self.db} {kind}: only {done} of {n} steps reached 'done'")
            result["done"] = done
        return result

    def cpu_now(self) -> dict[str, float]:
        """CPU seconds used so far: the worker's processes, the lock-store Redis, and the
        PostgreSQL server's processes (0 on SQLite, which runs inside the worker)."""
        table = _proc_table()
        worker = tree_cpu(self.worker.pid, table)
        info = self.lock_client.info("cpu")
        pg = getattr(self, "pg", None)
        return {
            "cpu_worker": worker["total"],
            "cpu_worker_main": worker["root"],
            "cpu_worker_pool": worker["children"],
            "cpu_lockstore": float(info["used_cpu_user"]) + float(info["used_cpu_sys"]),
            "cpu_db": tree_cpu(pg.pid, table)["total"] if pg is not None else 0.0,
        }

    def drain(
        self, batch: str, n: int, measure_cpu: bool = False
    ) -> tuple[float, dict[str, float]]:
        key = f"bench:mark:{batch}"
        client = self.broker_client
        queued = client.llen(QUEUE)
        cpu0 = self.cpu_now() if measure_cpu else {}
        self.app.control.add_consumer(QUEUE, destination=[self.node], reply=True, timeout=5)
        deadline = time.monotonic() + max(120.0, n / 10.0)
        # The clock starts when the worker takes the first message: kombu's Redis transport
        # only adds the queue to its BRPOP after the one in flight returns (up to 1 s).
        while client.llen(QUEUE) >= queued:
            if time.monotonic() > deadline:
                raise TimeoutError(f"batch {batch}: the worker does not consume {QUEUE}")
            time.sleep(0.0005)
        t0 = time.perf_counter()
        # Block (no polling: the benchmark process must not eat the worker's CPU) until the
        # end marker ran; it is the last message, so at most one task of the batch is still
        # running then: wait for its acknowledgement.
        while not client.blpop([key], timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"batch {batch} not drained; worker log tail:\n"
                    + "\n".join(self.worker.log_text().splitlines()[-30:])
                )
        while client.hlen("unacked") or client.llen(QUEUE):
            if time.monotonic() > deadline:
                raise TimeoutError(f"batch {batch}: messages left unacknowledged")
            time.sleep(0.0005)
        elapsed = time.perf_counter() - t0
        cpu = {k: v - cpu0[k] for k, v in self.cpu_now().items()} if measure_cpu else {}
        self.app.control.cancel_consumer(QUEUE, destination=[self.node], reply=True, timeout=5)
        return elapsed, cpu

    # -- the measurement ----------------------------------------------------------------------

    #: (a, b) pairs compared by throughput and by CPU per task.
    RATE_PAIRS = (
        ("steplock", "handwritten"),
        ("steplock_noprecheck", "handwritten"),
        ("steplock_wait", "handwritten"),
        ("steplock", "steplock_wait"),
        ("steplock", "handwritten_full"),
        ("handwritten_full", "handwritten"),
        ("steplock", "plain"),
        ("handwritten", "plain"),
    )
    CPU_PAIRS = (
        ("steplock", "handwritten_full"),
        ("steplock", "handwritten"),
        ("steplock_noprecheck", "handwritten"),
        ("steplock", "steplock_wait"),
        ("handwritten_full", "handwritten"),
        ("steplock", "plain"),
    )

    def throughput(self, kinds: list[str], n: int, reps: int, warmup: int) -> None:
        for kind in kinds:
            self.run_batch(kind, warmup)
        per_rep: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
        for rep in range(reps):
            order = kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]
            for kind in order:
                per_rep[kind].append(self.run_batch(kind, n))
            self.rec.say(
                f"{self.db} rep {rep + 1}/{reps}: "
                + ", ".join(
                    f"{k} {per_rep[k][-1]['rate']:.0f}/s "
                    f"{per_rep[k][-1]['cpu_worker'] / n * 1e6:.0f}us"
                    for k in kinds
                )
            )
        db = self.db
        for kind in kinds:
            rows = per_rep[kind]
            labels = dict(db=db, kind=kind, label=KINDS[kind], tasks=n, reps=reps)
            rate = summary([r["rate"] for r in rows])
            self.rec.add(f"e2e.{db}.{kind}.rate", rate.pop("value"), "tasks/s", **labels, **rate)
            for key, what in (
                ("cpu_worker", "cpu"),
                ("cpu_worker_main", "cpu_main"),
                ("cpu_worker_pool", "cpu_pool"),
                ("cpu_lockstore", "cpu_lockstore"),
                ("cpu_db", "cpu_db"),
            ):
                if key == "cpu_db" and db != "postgresql":
                    continue
                stats = summary([r[key] / n * 1e6 for r in rows])
                self.rec.add(
                    f"e2e.{db}.{kind}.{what}", stats.pop("value"), "us CPU/task", **labels, **stats
                )
            total = summary(
                [(r["cpu_worker"] + r["cpu_lockstore"] + r["cpu_db"]) / n * 1e6 for r in rows]
            )
            self.rec.add(
                f"e2e.{db}.{kind}.cpu_total", total.pop("value"), "us CPU/task", **labels, **total
            )
            self.rec.add(
                f"e2e.{db}.{kind}.publish",
                round(median(r["publish"] / n * 1e6 for r in rows), 1),
                "us/task",
                **labels,
            )
            if "plain" in per_rep and kind != "plain":
                over = [
                    (r["drain"] - p["drain"]) / n * 1000.0 for r, p in zip(rows, per_rep["plain"])
                ]
                self.rec.add(
                    f"e2e.{db}.{kind}.overhead",
                    round(median(over), 3),
                    "ms/task",
                    **labels,
                    all=[round(o, 3) for o in over],
                )
            if kind in STEP_KINDS:
                self.rec.add(
                    f"e2e.{db}.{kind}.steps_done",
                    sum(r.get("done", 0) for r in rows),
                    "steps",
                    **labels,
                    expected=n * reps,
                )

        def ratio(name: str, key: str, a: str, b: str) -> None:
            va = [r[key] for r in per_rep[a]]
            vb = [r[key] for r in per_rep[b]]
            paired = [x / y for x, y in zip(va, vb) if y]
            self.rec.add(
                name,
                round(median(va) / median(vb), 3),
                "x",
                db=db,
                a=a,
                b=b,
                how="ratio of the medians",
                paired_median=round(median(paired), 3),
                paired=[round(r, 3) for r in paired],
            )

        for a, b in self.RATE_PAIRS:
            if a in per_rep and b in per_rep:
                ratio(f"e2e.{db}.ratio.{a}_vs_{b}", "rate", a, b)
        for a, b in self.CPU_PAIRS:
            if a in per_rep and b in per_rep:
                ratio(f"e2e.{db}.cpu_ratio.{a}_vs_{b}", "cpu_worker", a, b)
        if "steplock" in per_rep and "handwritten_full" in per_rep:
            for rows in per_rep.values():
                for r in rows:
                    r["cpu_all"] = r["cpu_worker"] + r["cpu_lockstore"] + r["cpu_db"]
            ratio(
                f"e2e.{db}.cpu_total_ratio.steplock_vs_handwritten_full",
                "cpu_all",
                "steplock",
                "handwritten_full",
            )
            if "plain" in per_rep:
                # Net of what Celery costs a plain task (fetch, ack, trace), common to all.
                base = median(r["cpu_worker"] for r in per_rep["plain"])
                a = median(r["cpu_worker"] for r in per_rep["steplock"]) - base
                c = median(r["cpu_worker"] for r in per_rep["handwritten_full"]) - base
                if c > 0:
                    self.rec.add(
                        f"e2e.{db}.cpu_net_ratio.steplock_vs_handwritten_full",
                        round(a / c, 3),
                        "x",
                        db=db,
                        how="(median(a) - median(plain)) / (median(c) - median(plain))",
                    )

    def counting(self, kinds: list[str], k: int) -> None:
        """Redis commands per task on the lock store (MONITOR) and SQL per task."""
        db = self.db
        with MonitorCapture(self.lockstore.url) as mon:
            for kind in kinds:
                self.batch_no += 1
                batch = f"{os.getpid()}-{self.batch_no}"
                args = self.make_args(kind, k)
                mon.phase(f"{kind}:publish")
                for a in args:
                    self.tasks[kind].apply_async((a,), queue=QUEUE, headers={"bench_sql": "1"})
                self.mark.apply_async((batch,), queue=QUEUE)
                mon.phase(f"{kind}:worker")
                self.drain(batch, k)
                mon.phase("idle")
        for kind in kinds:
            pub = mon.count(f"{kind}:publish")
            work = mon.count(f"{kind}:worker")
            inner = mon.count(f"{kind}:worker", lua=True)
            inner_pub = mon.count(f"{kind}:publish", lua=True)
            labels = dict(db=db, kind=kind, label=KINDS[kind], tasks=k)
            self.rec.add(
                f"e2e.{db}.{kind}.redis_publish",
                round(sum(pub.values()) / k, 2),
                "commands/task",
                **labels,
                detail={c: round(v / k, 2) for c, v in sorted(pub.items())},
            )
            self.rec.add(
                f"e2e.{db}.{kind}.redis_worker",
                round(sum(work.values()) / k, 2),
                "commands/task",
                **labels,
                detail={c: round(v / k, 2) for c, v in sorted(work.items())},
            )
            self.rec.add(
                f"e2e.{db}.{kind}.redis_round_trips",
                round((sum(pub.values()) + sum(work.values())) / k, 2),
                "round trips/task",
                **labels,
            )
            self.rec.add(
                f"e2e.{db}.{kind}.redis_script_inner",
                round((sum(inner.values()) + sum(inner_pub.values())) / k, 2),
                "commands/task",
                **labels,
                detail={c: round(v / k, 2) for c, v in sorted(inner.items())},
            )
        # A sample of what one StepLockedTask sends, in order.
        for kind in ("steplock", "steplock_noprecheck", "handwritten", "handwritten_full"):
            seq = [
                text[:90]
                for ph, ctype, _n, text in mon.commands
                if ph == f"{kind}:worker" and ctype != "lua"
            ][:6]
            if seq:
                self.rec.add(f"e2e.{db}.{kind}.redis_sample", seq, "commands", db=db, kind=kind)
        self.sql_counts(kinds)

    def sql_counts(self, kinds: list[str]) -> None:
        per_task: dict[str, list[Counter]] = {}
        for path in (self.workdir / "sql").glob("*.tsv"):
            for line in path.read_text().splitlines():
                name, *fields = line.split("\t")
                per_task.setdefault(name, []).append(
                    Counter({k: int(v) for k, v in (f.split("=") for f in fields if f)})
                )
        for kind in kinds:
            rows = per_task.get(f"bench.{kind}", [])
            if not rows:
                if kind in STEP_KINDS:
                    self.rec.note(f"{self.db} {kind}: no SQL statements were counted")
                continue
            # The most common per-task pattern (the first task of a process also connects).
            pattern, freq = Counter(tuple(sorted(c.items())) for c in rows).most_common(1)[0]
            typical = dict(pattern)
            statements = sum(v for k, v in typical.items() if k not in TXN_KINDS)
            labels = dict(db=self.db, kind=kind, label=KINDS[kind], tasks=len(rows))
            self.rec.add(
                f"e2e.{self.db}.{kind}.sql",
                statements,
                "statements/task",
                **labels,
                detail={k: v for k, v in typical.items() if k not in TXN_KINDS},
                share=round(freq / len(rows), 3),
            )
            txn = {k: typical.get(k, 0) for k in ("BEGIN", "COMMIT", "ROLLBACK")}
            implicit = self.db == "postgresql" and not txn["BEGIN"]
            if implicit:  # the driver sends BEGIN before a transaction's first statement
                txn["BEGIN"] = txn["COMMIT"] + txn["ROLLBACK"]
            self.rec.add(
                f"e2e.{self.db}.{kind}.sql_txn",
                sum(txn.values()),
                "transaction statements/task",
                **labels,
                detail=txn,
                begin_implicit=implicit,
            )
            self.rec.add(
                f"e2e.{self.db}.{kind}.sql_updates",
                typical.get("UPDATE", 0),
                "UPDATE/task",
                **labels,
            )
            self.rec.add(
                f"e2e.{self.db}.{kind}.sql_selects",
                typical.get("SELECT", 0),
                "SELECT/task",
                **labels,
            )
            connects = sum(c.get("CONNECT", 0) for c in rows)
            self.rec.add(f"e2e.{self.db}.{kind}.db_connects", connects, "connections", **labels)

    def inprocess(self, n: int, reps: int, profile: bool) -> None:
        """The same task bodies called directly in this process (no broker, no worker):
        wall and CPU time per execution, a cleaner view of the library's own cost than the
        drain rate on a loaded machine; plus StepLockedTask with the heartbeat thread kept
        alive by a parked lease (see the notes) and a pyinstrument profile."""
        from celery_steplock import get_lease_store

        try:
            from celery_steplock.heartbeat import get_heartbeat
        except ImportError as exc:  # the library's internals may move
            get_heartbeat = None
            self.rec.note(f"in-process: no parked-lease variant ({exc})")

        db = self.db
        kinds = [
            k
            for k in ("handwritten", "handwritten_full", "steplock", "steplock_noprecheck")
            if k in self.tasks
        ]
        variants = kinds + (
            ["steplock_parked"] if "steplock" in kinds and get_heartbeat is not None else []
        )

        def call_all(variant: str, ids: list[int]) -> tuple[list[float], float]:
            task = self.tasks["steplock" if variant == "steplock_parked" else variant]
            times = []
            cpu0 = time.process_time()
            for step_id in ids:
                t0 = time.perf_counter_ns()
                task(step_id)
                times.append((time.perf_counter_ns() - t0) / 1000.0)
            return times, (time.process_time() - cpu0) / len(ids) * 1e6

        def parked(flag: bool):
            if not flag:
                return None
            lock = get_lease_store(self.app)
            lease = lock.acquire(f"bench:park:{os.getpid()}", ttl=30.0)
            get_heartbeat().register(lease, lock)
            return lock, lease

        def unpark(state) -> None:
            if state is not None:
                lock, lease = state
                get_heartbeat().unregister(lease)
                lock.release(lease.name, lease.owner)

        for variant in variants:  # warm-up: scripts loaded, connections open, code paths hot
            state = parked(variant == "steplock_parked")
            call_all(variant, self.make_args(variant.replace("_parked", ""), 20))
            unpark(state)
        per_rep: dict[str, list[tuple[float, float, float]]] = {v: [] for v in variants}
        for rep in range(reps):
            order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
            for variant in order:
                self.batch_no += 1
                ids = self.make_args(variant.replace("_parked", ""), n)
                state = parked(variant == "steplock_parked")
                times, cpu = call_all(variant, ids)
                unpark(state)
                per_rep[variant].append((percentile(times, 50), percentile(times, 99), cpu))
        labels_of = {
            **KINDS,
            "steplock_parked": "StepLockedTask, heartbeat thread kept alive by a parked lease",
        }
        for variant, rows in per_rep.items():
            labels = dict(db=db, kind=variant, label=labels_of[variant], calls=n, reps=reps)
            self.rec.add(
                f"e2e.{db}.inproc.{variant}.p50",
                round(median(r[0] for r in rows), 1),
                "us",
                **labels,
            )
            self.rec.add(
                f"e2e.{db}.inproc.{variant}.p99",
                round(median(r[1] for r in rows), 1),
                "us",
                **labels,
            )
            self.rec.add(
                f"e2e.{db}.inproc.{variant}.cpu",
                round(median(r[2] for r in rows), 1),
                "us CPU/call",
                **labels,
            )
        for a in ("steplock", "steplock_noprecheck", "steplock_parked", "handwritten_full"):
            if a in per_rep and "handwritten" in per_rep:
                ratios = [ra[0] / rb[0] for ra, rb in zip(per_rep[a], per_rep["handwritten"])]
                self.rec.add(
                    f"e2e.{db}.inproc.ratio.{a}_vs_handwritten",
                    round(median(ratios), 3),
                    "x",
                    db=db,
                    all=[round(r, 3) for r in ratios],
                )
        if "steplock" in per_rep and "handwritten_full" in per_rep:
            cpu_a = median(r[2] for r in per_rep["steplock"])
            cpu_c = median(r[2] for r in per_rep["handwritten_full"])
            self.rec.add(
                f"e2e.{db}.inproc.cpu_ratio.steplock_vs_handwritten_full",
                round(cpu_a / cpu_c, 3),
                "x",
                db=db,
                how="ratio of the medians",
            )
        self.rec.say(
            f"{db} in-process p50: "
            + ", ".join(f"{v} {median(r[0] for r in per_rep[v]):.0f}us" for v in variants)
        )
        if profile:
            self.profile(["steplock", "handwritten_full"], n, call_all)

    def profile(self, kinds: list[str], n: int, call_all=None) -> dict[str, str]:
        """A pyinstrument profile of ``n`` in-process executions of each kind; the texts go
        to ``self.profiles`` (``e2e-<db>-<kind>``), StepLockedTask's breakdown to figures."""
        try:
            from pyinstrument import Profiler
        except ImportError as exc:
            self.rec.note(f"no profile: pyinstrument is not installed ({exc})")
            return {}
        if call_all is None:

            def call_all(kind: str, ids: list[int]) -> None:
                for step_id in ids:
                    self.tasks[kind](step_id)

            for kind in kinds:  # warm-up
                call_all(kind, self.make_args(kind, 20))
        db = self.db
        for kind in kinds:
            if kind not in self.tasks:
                continue
            ids = self.make_args(kind, n)
            profiler = Profiler(interval=0.0002)
            profiler.start()
            call_all(kind, ids)
            profiler.stop()
            self.profiles[f"e2e-{db}-{kind}"] = profile_text(profiler)
            if kind == "steplock":
                shares = profile_breakdown(profiler.last_session, TASK_PROFILE_CATEGORIES)
                for name, share in shares.items():
                    if name != "total_s":
                        self.rec.add(
                            f"e2e.{db}.profile.steplock.{name}",
                            round(share * 100, 1),
                            "% of time",
                            db=db,
                        )
        return self.profiles

    def steps(self, n: int) -> None:
        """What each step of one StepLockedTask execution costs on its own, µs per call
        (median of ``n``), next to the hand-written task's equivalents. It reaches into the
        library's internals, which are being rewritten: when they moved, the step timings
        are skipped with a note rather than failing the group."""
        try:
            self._steps(n)
        except (ImportError, AttributeError, TypeError) as exc:
            self.rec.note(
                f"{self.db}: per-step timings skipped, the library's internals "
                f"changed: {type(exc).__name__}: {exc}"
            )

    def _steps(self, n: int) -> None:
        import redis as redis_py
        from django.db import transaction

        from celery_steplock import signals
        from celery_steplock.events import emit, lease_fields
        from celery_steplock.heartbeat import Heartbeat
        from celery_steplock.keys import bind_arguments, name_from_arguments
        from celery_steplock.lock import holder_metadata
        from celery_steplock.lock import get_lease_store
        from django_app.workflows.models import Step

        task = self.tasks.get("steplock")
        if task is None:
            return
        app = task.app
        lock = get_lease_store(app)
        guard = task.steplock_plan.steps
        step_id = self.make_args("steplock", 1)[0]
        lease = lock.acquire(f"bench:steps:{os.getpid()}", ttl=30.0)
        fields = lease_fields(lease)
        raw = redis_py.Redis.from_url(self.lockstore.url, decode_responses=True)

        hb = Heartbeat()

        def hb_cycle():
            # The thread idles between two leases, as between two tasks of a pool process.
            t0 = time.perf_counter_ns()
            hb.register(lease, lock)
            hb.unregister(lease)
            return time.perf_counter_ns() - t0

        def timed(fn):
            def run():
                t0 = time.perf_counter_ns()
                fn()
                return time.perf_counter_ns() - t0

            return run

        name2 = f"bench:steps2:{os.getpid()}"

        def acquire_only():
            t0 = time.perf_counter_ns()
            held = lock.acquire(name2, ttl=30.0)
            elapsed = time.perf_counter_ns() - t0
            lock.release(held.name, held.owner)
            return elapsed

        def release_only():
            held = lock.acquire(name2, ttl=30.0)
            t0 = time.perf_counter_ns()
            lock.release(held.name, held.owner)
            return time.perf_counter_ns() - t0

        def atomic_cas():
            with transaction.atomic(durable=True):
                guard.transition(
                    step_id, "pending", "pending", owner=lease.owner, fence=lease.fence
                )

        def atomic_update():
            with transaction.atomic(durable=True):
                Step.objects.filter(pk=step_id, status="pending").update(
                    status="pending", lock_owner=lease.owner
                )

        library = {
            "steplock_plan (the cached execution plan)": timed(lambda: task.steplock_plan),
            "get_lease_store(app)": timed(lambda: get_lease_store(app)),
            "lock name (bind_arguments + lock_key template)": timed(
                lambda: name_from_arguments(
                    task.name, bind_arguments(task.run, (1,), {}), "bench:{step_id}"
                )
            ),
            "holder_metadata()": timed(
                lambda: holder_metadata(
                    "6f1c2a47-3b7e-4d1a-9a55-0c9d8e7f6a5b",
                    task.name,
                    0,
                    worker="w@h",
                    step="workflows.step:1",
                )
            ),
            "heartbeat register + unregister (its thread idling between leases)": hb_cycle,
            "emit(lock_acquired) (log line + signal)": timed(
                lambda: emit(signals.lock_acquired, task, **fields)
            ),
            "acquire round trip (ACQUIRE script)": acquire_only,
            "release round trip (RELEASE script)": release_only,
            "ownership check round trip (OWNED script)": timed(
                lambda: lock.owned(lease.name, lease.owner)
            ),
            "precheck SELECT (guard.status)": timed(lambda: guard.status(step_id)),
            "atomic(durable) + CAS UPDATE with fence (guard.transition)": timed(atomic_cas),
        }
        handwritten = {
            "SET NX PX round trip": timed(
                lambda: raw.set(f"bench:steps3:{os.getpid()}", "x", nx=False, px=30000)
            ),
            "GET round trip": timed(lambda: raw.get(f"bench:steps3:{os.getpid()}")),
            "atomic(durable) + UPDATE ... WHERE status='pending'": timed(atomic_update),
        }
        every = [
            (side, label, fn)
            for side, steps in (("steplock", library), ("handwritten", handwritten))
            for label, fn in steps.items()
        ]
        for _side, _label, fn in every:
            for _ in range(min(20, n)):
                fn()
        samples: dict[str, list[float]] = {label: [] for _s, label, _f in every}
        per_round = 25  # the steps take turns, 25 calls each, so load changes hit all alike
        for _ in range(max(1, n // per_round)):
            for _side, label, fn in every:
                samples[label] += [fn() / 1000.0 for _ in range(per_round)]
        for side, label, _fn in every:
            key = "_".join(
                "".join(c if c.isalnum() else " " for c in label.split(" (")[0].lower()).split()
            )
            self.rec.add(
                f"e2e.{self.db}.steps.{side}.{key}",
                round(percentile(samples[label], 50), 1),
                "us",
                db=self.db,
                side=side,
                label=label,
                calls=len(samples[label]),
            )
        lock.release(lease.name, lease.owner)
        raw.close()

        # How often one execution looks a steplock_* setting up in Celery's configuration
        # (``app.conf.get``: lookups through the Django-namespaced settings are not cheap)
        # and builds its execution plan: counted by wrapping them in this process for 10
        # executions, then restoring them.
        from celery_steplock import task as steplock_task

        counts = {"conf_lookups": 0, "plan_builds": 0}
        conf_cls = type(app.conf)
        orig_get = conf_cls.get
        orig_guard = steplock_task.build_plan

        def get_counted(self_, key, *a, **k):
            if isinstance(key, str) and key.startswith("steplock_"):
                counts["conf_lookups"] += 1
            return orig_get(self_, key, *a, **k)

        def guard_counted(self_, *a, **k):
            counts["plan_builds"] += 1
            return orig_guard(self_, *a, **k)

        conf_cls.get = get_counted
        steplock_task.build_plan = guard_counted
        try:
            for sid in self.make_args("steplock", 10):
                task(sid)
        finally:
            conf_cls.get = orig_get
            steplock_task.build_plan = orig_guard
        self.rec.add(
            f"e2e.{self.db}.steplock.conf_lookups",
            counts["conf_lookups"] / 10,
            "app.conf lookups/execution",
            db=self.db,
        )
        self.rec.add(
            f"e2e.{self.db}.steplock.plan_builds",
            counts["plan_builds"] / 10,
            "builds/execution",
            db=self.db,
        )

    def worker_errors(self) -> None:
        text = self.worker.log_text()
        errors = [
            line
            for line in text.splitlines()
            if " ERROR" in line or "CRITICAL" in line or "Traceback" in line
        ]
        self.rec.add(f"e2e.{self.db}.worker_error_lines", len(errors), "lines", db=self.db)
        if errors:
            self.rec.note(
                f"{self.db}: worker log has {len(errors)} error lines, first: {errors[0][:200]}"
            )


def run_db(
    db: str,
    quick: bool,
    tasks: int | None = None,
    reps: int | None = None,
    only: list[str] | None = None,
    lock_latency_ms: float = 0.0,
    throughput_only: bool = False,
) -> dict[str, Any]:
    rec = Recorder("e2e")
    kinds = installed_variants(rec, KINDS, PEER_OF)
    if only:
        kinds = [k for k in kinds if k in only]
    n = tasks or (200 if quick else 2000)
    r = reps or (3 if quick else 5)
    with tempfile.TemporaryDirectory(prefix=f"steplock-bench-e2e-{db}-") as tmp:
        bench = Bench(rec, db, Path(tmp), lock_latency_ms=lock_latency_ms)
        try:
            bench.start()
            if lock_latency_ms:
                rec.note(
                    f"{db}: {lock_latency_ms} ms of round-trip latency added to the lock store"
                )
            bench.throughput(kinds, n=n, reps=r, warmup=20 if quick else 50)
            if throughput_only:
                bench.worker_errors()
            elif quick:
                bench.counting(kinds, k=20)
                bench.inprocess(n=100, reps=2, profile=True)
                bench.steps(n=100)
            else:
                bench.counting(kinds, k=100)
                bench.inprocess(n=400, reps=5, profile=True)
                bench.steps(n=500)
            bench.worker_errors()
        finally:
            bench.stop()
    return rec.result(peers=peer_status(), profiles=bench.profiles)


def profile_only(db: str, kinds: list[str], calls: int, out_dir: Path) -> int:
    """Profile task bodies in this process (no worker); write ``e2e-<db>-<kind>.txt``."""
    rec = Recorder("e2e")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"steplock-bench-e2e-{db}-") as tmp:
        bench = Bench(rec, db, Path(tmp))
        try:
            bench.start(worker=False)
            unknown = [k for k in kinds if k not in bench.tasks]
            if unknown:
                raise SystemExit(f"unknown kinds {unknown}; known: {', '.join(bench.tasks)}")
            for name, text in bench.profile(kinds, calls).items():
                path = out_dir / f"{name}.txt"
                path.write_text(text)
                print(f"wrote {path}")
        finally:
            bench.stop()
            servers.stop_all()
    return 0


def run(quick: bool = False, tasks: int | None = None, reps: int | None = None) -> dict[str, Any]:
    """Both databases, each in a subprocess; merged into one group result."""
    rec = Recorder("e2e")
    profiles: dict[str, str] = {}
    dbs = ["sqlite"]
    if servers.PostgresServer.available():
        dbs.append("postgresql")
    else:
        rec.note("PostgreSQL not installed (initdb/postgres): the PostgreSQL run is skipped")
    for db in dbs:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
            out = fh.name
        cmd = [sys.executable, "-m", "benchmarks.e2e", "--db", db, "--out", out]
        if quick:
            cmd.append("--quick")
        if tasks:
            cmd += ["--tasks", str(tasks)]
        if reps:
            cmd += ["--reps", str(reps)]
        rec.say(f"{db}: {' '.join(cmd[1:])}")
        started = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT)
        try:
            part = json.loads(Path(out).read_text())
        except (OSError, ValueError):
            part = {"figures": [], "notes": [], "error": f"no result (exit {proc.returncode})"}
        finally:
            Path(out).unlink(missing_ok=True)
        rec.figures += part.get("figures", [])
        rec.add(f"e2e.{db}.wall", round(time.monotonic() - started, 1), "s", db=db)
        rec.notes += part.get("notes", [])
        profiles.update(part.get("profiles") or {})
        if part.get("error") or proc.returncode:
            rec.note(f"{db} run failed: {part.get('error') or f'exit {proc.returncode}'}")
    rec.note(
        "Settings: benchmarks/e2e_settings.py (django_app's, without a result backend, "
        "database connection kept between tasks, celery_steplock logging at WARNING); "
        "broker and lock store are two redis-servers on loopback; acks_late, prefetch "
        "multiplier 1, -O fair, as in django_app."
    )
    rec.note(
        "CPU per task: user + system CPU seconds of the worker's processes (the main "
        "process and its prefork children, from /proc, clock ticks of "
        f"{1000 // _CLK_TCK} ms) over a batch's drain, divided by its tasks; it includes "
        "the worker's share of Celery (fetching, acknowledging) common to every kind. "
        "'total' adds the lock-store Redis (INFO cpu) and, on PostgreSQL, the database "
        "server's processes. Ratios are ratios of the medians over the repetitions."
    )
    rec.note(
        "The hand-written task doing the default configuration's work (c) sets the same "
        "PostgreSQL deadline as the library (SELECT set_config('lock_timeout', ...), "
        "set_config('idle_in_transaction_session_timeout', ...) inside the transaction, "
        "before the CAS), so that both send the same statements; it leaves out holder "
        "metadata in the lease, events and signals, options and settings, and the "
        "waiters' wake-up on release: that difference is the abstraction's cost."
    )
    return rec.result(profiles=profiles)


def main() -> int:
    parser = argparse.ArgumentParser(description="celery-steplock benchmark group e2e")
    parser.add_argument("--db", choices=["sqlite", "postgresql"])
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--out", help="write the result JSON here (default: stdout)")
    parser.add_argument(
        "--tasks", type=int, default=None, help="tasks per batch (default 2000; 200 with --quick)"
    )
    parser.add_argument(
        "--reps",
        type=int,
        default=None,
        help="repetitions of each kind (default 5; 3 with --quick)",
    )
    parser.add_argument(
        "--profile",
        nargs="+",
        metavar="KIND",
        default=None,
        help="only profile these task kinds in-process (pyinstrument), "
        f"no worker: {', '.join(KINDS)} (needs --db, default sqlite)",
    )
    parser.add_argument("--calls", type=int, default=400, help="executions per profile")
    parser.add_argument(
        "--profile-dir",
        type=Path,
        default=ROOT / "var" / "profiles",
        help="where --profile writes its texts (default var/profiles)",
    )
    parser.add_argument(
        "--kinds", nargs="+", metavar="KIND", default=None, help="only these task kinds"
    )
    parser.add_argument(
        "--lock-latency-ms",
        type=float,
        default=0.0,
        help="round-trip latency added to the lock store by a userspace proxy (needs --db)",
    )
    parser.add_argument(
        "--throughput-only",
        action="store_true",
        help="only the interleaved batches (no counting, in-process or steps sections)",
    )
    args = parser.parse_args()
    if args.profile:
        return profile_only(args.db or "sqlite", args.profile, args.calls, args.profile_dir)
    if args.db is None:
        return write_result("e2e", lambda: run(args.quick, args.tasks, args.reps), args.out)
    return write_result(
        "e2e",
        lambda: run_db(
            args.db,
            args.quick,
            args.tasks,
            args.reps,
            only=args.kinds,
            lock_latency_ms=args.lock_latency_ms,
            throughput_only=args.throughput_only,
        ),
        args.out,
    )


if __name__ == "__main__":
    raise SystemExit(main())
