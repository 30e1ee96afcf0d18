"""Group 2: end to end through a real ``celery worker`` (prefork, concurrency 2, Redis broker).

For SQLite and PostgreSQL (each in a process of its own, since Django's database is chosen at
import): a broker redis-server and a lock-store redis-server, the database migrated, one
``celery -A benchmarks.e2e_app worker -c 2 -P prefork`` started with ``scripts.servers``.

A batch: N tasks of one kind are published to ``bench.q`` while the worker does not consume
it (plus an end marker), then ``add_consumer`` starts the clock and the batch counts as drained
when the marker ran and no message is left unacknowledged. The kinds are interleaved in a
rotating order and repeated; figures are medians over the repetitions, ratios are taken within
a repetition. Then a counting pass: K tasks of each kind under ``MONITOR`` on the lock store
(commands sent at publish and in the worker, and inside scripts), and the SQL statements per
task counted in the worker (``benchmarks.e2e_app``).
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
from collections import Counter
from pathlib import Path
from typing import Any

from .common import (
    ROOT,
    group_main,
    installed_variants,
    median,
    MonitorCapture,
    peer_status,
    percentile,
    profile_breakdown,
    profile_text,
    Recorder,
    servers,
    write_result,
)

KINDS = {
    "plain": "plain Task (baseline)",
    "once": "celery-once QueueOnce",
    "singleton": "celery-singleton Singleton",
    "handwritten": "hand-written lease + ORM CAS + shared heartbeat",
    "steplock": "StepLockedTask, transition pending->done",
    "steplock_noprecheck": "StepLockedTask, lock_precheck=False",
}
STEP_KINDS = ("handwritten", "steplock", "steplock_noprecheck")
PEER_OF = {"once": "celery-once", "singleton": "celery-singleton"}
QUEUE = "bench.q"

#: Where a StepLockedTask execution spends its time (profile categories; they may overlap).
TASK_PROFILE_CATEGORIES = {
    "settings": lambda f, fn: f.endswith("celery_steplock/conf.py"),
    "redis": lambda f, fn: "/redis/" in f,
    "django_orm": lambda f, fn: "/django/db/" in f,
    "heartbeat_thread_start": lambda f, fn: f.endswith("threading.py") and fn == "start",
    "events": lambda f, fn: f.endswith("celery_steplock/events.py"),
    "lock_name": lambda f, fn: f.endswith("celery_steplock/keys.py"),
}


class Bench:
    def __init__(self, rec: Recorder, db: str, workdir: Path):
        self.rec = rec
        self.db = db
        self.workdir = workdir
        self.batch_no = 0
        self.arg_base = 0
        self.profiles: dict[str, str] = {}

    # -- setup ----------------------------------------------------------------------------

    def start(self) -> None:
        self.broker = servers.RedisServer().start()
        self.lockstore = servers.RedisServer().start()
        env = {
            "DJANGO_SETTINGS_MODULE": "benchmarks.e2e_settings",
            "REDIS_URL": self.broker.url,
            "STEPLOCK_REDIS_URL": self.lockstore.url,
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
        self.tasks = {name: e2e_app.app.tasks[f"bench.{name}"] for name in KINDS
                      if f"bench.{name}" in e2e_app.app.tasks}
        self.mark = e2e_app.app.tasks["bench.mark"]
        import redis

        self.broker_client = redis.Redis.from_url(self.broker.url)
        self.lock_client = redis.Redis.from_url(self.lockstore.url)
        self.worker = servers.celery_worker(
            app="benchmarks.e2e_app", name="bench", concurrency=2, pool="prefork",
            env=env, logfile=self.workdir / "worker.log", extra_args=("-Q", "bench.ctl"),
            cwd=ROOT)
        self.node = f"bench@{socket.gethostname()}"
        self.rec.say(f"{self.db}: worker pid {self.worker.pid}, broker {self.broker.url}, "
                     f"lock store {self.lockstore.url}")

    def stop(self) -> None:
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.terminate()
        for name in ("pg", "lockstore", "broker"):
            server = getattr(self, name, None)
            if server is not None:
                server.stop()

    # -- one batch --------------------------------------------------------------------------

    def make_args(self, kind: str, n: int) -> list[Any]:
        if kind in STEP_KINDS:
            from django_app.workflows.models import Step

            steps = Step.objects.bulk_create(
                [Step(name=f"bench-{kind}-{self.batch_no}-{i}") for i in range(n)])
            ids = [s.pk for s in steps]
            if any(i is None for i in ids):  # a backend that returns no primary keys
                ids = list(Step.objects.filter(
                    name__startswith=f"bench-{kind}-{self.batch_no}-").values_list("pk",
                                                                                 flat=True))
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
        drain = self.drain(batch, n)
        result = {"drain": drain, "publish": publish, "rate": n / drain}
        if kind in STEP_KINDS:
            from django_app.workflows.models import Step

            done = Step.objects.filter(pk__in=args, status="done").count()
            if done != n:
                self.rec.note(f"{self.db} {kind}: only {done} of {n} steps reached 'done'")
            result["done"] = done
        return result

    def drain(self, batch: str, n: int) -> float:
        key = f"bench:mark:{batch}"
        client = self.broker_client
        queued = client.llen(QUEUE)
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
                raise TimeoutError(f"batch {batch} not drained; worker log tail:\n"
                                   + "\n".join(self.worker.log_text().splitlines()[-30:]))
        while client.hlen("unacked") or client.llen(QUEUE):
            if time.monotonic() > deadline:
                raise TimeoutError(f"batch {batch}: messages left unacknowledged")
            time.sleep(0.0005)
        elapsed = time.perf_counter() - t0
        self.app.control.cancel_consumer(QUEUE, destination=[self.node], reply=True, timeout=5)
        return elapsed

    # -- the measurement ----------------------------------------------------------------------

    def throughput(self, kinds: list[str], n: int, reps: int, warmup: int) -> None:
        for kind in kinds:
            self.run_batch(kind, warmup)
        per_rep: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
        for rep in range(reps):
            order = kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]
            for kind in order:
                per_rep[kind].append(self.run_batch(kind, n))
            self.rec.say(f"{self.db} rep {rep + 1}/{reps}: " + ", ".join(
                f"{k} {per_rep[k][-1]['rate']:.0f}/s" for k in kinds))
        db = self.db
        for kind in kinds:
            rows = per_rep[kind]
            labels = dict(db=db, kind=kind, label=KINDS[kind], tasks=n, reps=reps)
            self.rec.add(f"e2e.{db}.{kind}.rate", round(median(r["rate"] for r in rows), 1),
                         "tasks/s", **labels, all=[round(r["rate"], 1) for r in rows])
            self.rec.add(f"e2e.{db}.{kind}.publish", round(median(
                r["publish"] / n * 1e6 for r in rows), 1), "us/task", **labels)
            if "plain" in per_rep and kind != "plain":
                over = [(r["drain"] - p["drain"]) / n * 1000.0
                        for r, p in zip(rows, per_rep["plain"])]
                self.rec.add(f"e2e.{db}.{kind}.overhead", round(median(over), 3), "ms/task",
                             **labels, all=[round(o, 3) for o in over])
            if kind in STEP_KINDS:
                self.rec.add(f"e2e.{db}.{kind}.steps_done", sum(r.get("done", 0) for r in rows),
                             "steps", **labels, expected=n * reps)
        for a, b in (("steplock", "handwritten"), ("steplock_noprecheck", "handwritten"),
                     ("steplock", "plain"), ("handwritten", "plain")):
            if a in per_rep and b in per_rep:
                ratios = [ra["rate"] / rb["rate"] for ra, rb in zip(per_rep[a], per_rep[b])]
                self.rec.add(f"e2e.{db}.ratio.{a}_vs_{b}", round(median(ratios), 3), "x",
                             db=db, all=[round(r, 3) for r in ratios])

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
                    self.tasks[kind].apply_async((a,), queue=QUEUE)
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
            self.rec.add(f"e2e.{db}.{kind}.redis_publish", round(sum(pub.values()) / k, 2),
                         "commands/task", **labels,
                         detail={c: round(v / k, 2) for c, v in sorted(pub.items())})
            self.rec.add(f"e2e.{db}.{kind}.redis_worker", round(sum(work.values()) / k, 2),
                         "commands/task", **labels,
                         detail={c: round(v / k, 2) for c, v in sorted(work.items())})
            self.rec.add(f"e2e.{db}.{kind}.redis_round_trips",
                         round((sum(pub.values()) + sum(work.values())) / k, 2),
                         "round trips/task", **labels)
            self.rec.add(f"e2e.{db}.{kind}.redis_script_inner",
                         round((sum(inner.values()) + sum(inner_pub.values())) / k, 2),
                         "commands/task", **labels,
                         detail={c: round(v / k, 2) for c, v in sorted(inner.items())})
        # A sample of what one StepLockedTask sends, in order.
        for kind in ("steplock", "steplock_noprecheck", "handwritten"):
            seq = [text[:90] for ph, ctype, _n, text in mon.commands
                   if ph == f"{kind}:worker" and ctype != "lua"][:6]
            if seq:
                self.rec.add(f"e2e.{db}.{kind}.redis_sample", seq, "commands", db=db,
                             kind=kind)
        self.sql_counts(kinds)

    def sql_counts(self, kinds: list[str]) -> None:
        per_task: dict[str, list[Counter]] = {}
        for path in (self.workdir / "sql").glob("*.tsv"):
            for line in path.read_text().splitlines():
                name, *fields = line.split("\t")
                per_task.setdefault(name, []).append(
                    Counter({k: int(v) for k, v in (f.split("=") for f in fields if f)}))
        for kind in kinds:
            rows = per_task.get(f"bench.{kind}", [])
            if not rows:
                continue
            # The most common per-task pattern (the first task of a process also connects).
            pattern, freq = Counter(tuple(sorted(c.items())) for c in rows).most_common(1)[0]
            typical = dict(pattern)
            statements = sum(v for k, v in typical.items() if k != "CONNECT")
            labels = dict(db=self.db, kind=kind, label=KINDS[kind], tasks=len(rows))
            self.rec.add(f"e2e.{self.db}.{kind}.sql", statements, "statements/task",
                         **labels, detail=typical, share=round(freq / len(rows), 3))
            self.rec.add(f"e2e.{self.db}.{kind}.sql_updates", typical.get("UPDATE", 0),
                         "UPDATE/task", **labels)
            self.rec.add(f"e2e.{self.db}.{kind}.sql_selects", typical.get("SELECT", 0),
                         "SELECT/task", **labels)
            connects = sum(c.get("CONNECT", 0) for c in rows)
            self.rec.add(f"e2e.{self.db}.{kind}.db_connects", connects, "connections",
                         **labels)

    def inprocess(self, n: int, reps: int, profile: bool) -> None:
        """The same task bodies called directly in this process (no broker, no worker):
        wall and CPU time per execution, a cleaner view of the library's own cost than the
        drain rate on a loaded machine; plus StepLockedTask with the heartbeat thread kept
        alive by a parked lease (see the notes) and a pyinstrument profile."""
        from celery_steplock import get_lock
        from celery_steplock.heartbeat import get_heartbeat

        db = self.db
        kinds = [k for k in ("handwritten", "steplock", "steplock_noprecheck")
                 if k in self.tasks]
        variants = kinds + (["steplock_parked"] if "steplock" in kinds else [])

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
            lock = get_lock(self.app)
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
            order = variants[rep % len(variants):] + variants[:rep % len(variants)]
            for variant in order:
                self.batch_no += 1
                ids = self.make_args(variant.replace("_parked", ""), n)
                state = parked(variant == "steplock_parked")
                times, cpu = call_all(variant, ids)
                unpark(state)
                per_rep[variant].append((percentile(times, 50), percentile(times, 99), cpu))
        labels_of = {**KINDS, "steplock_parked": "StepLockedTask, heartbeat thread kept "
                                                 "alive by a parked lease"}
        for variant, rows in per_rep.items():
            labels = dict(db=db, kind=variant, label=labels_of[variant], calls=n, reps=reps)
            self.rec.add(f"e2e.{db}.inproc.{variant}.p50", round(median(r[0] for r in rows), 1),
                         "us", **labels)
            self.rec.add(f"e2e.{db}.inproc.{variant}.p99", round(median(r[1] for r in rows), 1),
                         "us", **labels)
            self.rec.add(f"e2e.{db}.inproc.{variant}.cpu", round(median(r[2] for r in rows), 1),
                         "us CPU/call", **labels)
        for a in ("steplock", "steplock_noprecheck", "steplock_parked"):
            if a in per_rep and "handwritten" in per_rep:
                ratios = [ra[0] / rb[0] for ra, rb in zip(per_rep[a], per_rep["handwritten"])]
                self.rec.add(f"e2e.{db}.inproc.ratio.{a}_vs_handwritten", round(median(ratios), 3),
                             "x", db=db, all=[round(r, 3) for r in ratios])
        self.rec.say(f"{db} in-process p50: " + ", ".join(
            f"{v} {median(r[0] for r in per_rep[v]):.0f}us" for v in variants))
        if profile and "steplock" in self.tasks:
            try:
                from pyinstrument import Profiler
            except ImportError as exc:
                self.rec.note(f"no profile: pyinstrument is not installed ({exc})")
                return
            ids = self.make_args("steplock", n)
            profiler = Profiler(interval=0.0002)
            profiler.start()
            call_all("steplock", ids)
            profiler.stop()
            self.profiles[f"e2e-{db}-steplock"] = profile_text(profiler)
            shares = profile_breakdown(profiler.last_session, TASK_PROFILE_CATEGORIES)
            for name, share in shares.items():
                if name != "total_s":
                    self.rec.add(f"e2e.{db}.profile.steplock.{name}", round(share * 100, 1),
                                 "% of time", db=db)

    def steps(self, n: int) -> None:
        """What each step of one StepLockedTask execution costs on its own, µs per call
        (median of ``n``), next to the hand-written task's equivalents."""
        import redis as redis_py
        from django.db import transaction

        from celery_steplock import signals
        from celery_steplock.events import emit, lease_fields
        from celery_steplock.heartbeat import Heartbeat
        from celery_steplock.keys import bind_arguments, name_from_arguments
        from celery_steplock.lock import holder_metadata
        from celery_steplock.task import get_lock
        from django_app.workflows.models import Step

        task = self.tasks.get("steplock")
        if task is None:
            return
        app = task.app
        lock = get_lock(app)
        guard = task.steplock_guard()
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
                guard.transition(step_id, "pending", "pending", owner=lease.owner,
                                 fence=lease.fence)

        def atomic_update():
            with transaction.atomic(durable=True):
                Step.objects.filter(pk=step_id, status="pending").update(
                    status="pending", lock_owner=lease.owner)

        library = {
            "steplock_options() (task options over settings)":
                timed(task.steplock_options),
            "get_lock(app)": timed(lambda: get_lock(app)),
            "steplock_guard()": timed(task.steplock_guard),
            "lock name (bind_arguments + lock_key template)": timed(
                lambda: name_from_arguments(task.name, bind_arguments(task.run, (1,), {}),
                                            "bench:{step_id}")),
            "holder_metadata()": timed(lambda: holder_metadata(
                "6f1c2a47-3b7e-4d1a-9a55-0c9d8e7f6a5b", task.name, 0, worker="w@h",
                step="workflows.step:1")),
            "heartbeat register + unregister (its thread idling between leases)": hb_cycle,
            "emit(lock_acquired) (log line + signal)": timed(
                lambda: emit(signals.lock_acquired, task, **fields)),
            "acquire round trip (ACQUIRE script)": acquire_only,
            "release round trip (RELEASE script)": release_only,
            "ownership check round trip (OWNED script)": timed(
                lambda: lock.owned(lease.name, lease.owner)),
            "precheck SELECT (guard.status)": timed(lambda: guard.status(step_id)),
            "atomic(durable) + CAS UPDATE with fence (guard.transition)": timed(atomic_cas),
        }
        handwritten = {
            "SET NX PX round trip": timed(lambda: raw.set(f"bench:steps3:{os.getpid()}", "x",
                                                          nx=False, px=30000)),
            "GET round trip": timed(lambda: raw.get(f"bench:steps3:{os.getpid()}")),
            "atomic(durable) + UPDATE ... WHERE status='pending'": timed(atomic_update),
        }
        every = [(side, label, fn) for side, steps in (("steplock", library),
                                                      ("handwritten", handwritten))
                 for label, fn in steps.items()]
        for _side, _label, fn in every:
            for _ in range(min(20, n)):
                fn()
        samples: dict[str, list[float]] = {label: [] for _s, label, _f in every}
        per_round = 25  # the steps take turns, 25 calls each, so load changes hit all alike
        for _ in range(max(1, n // per_round)):
            for _side, label, fn in every:
                samples[label] += [fn() / 1000.0 for _ in range(per_round)]
        for side, label, _fn in every:
            key = "_".join("".join(c if c.isalnum() else " " for c in
                                   label.split(" (")[0].lower()).split())
            self.rec.add(f"e2e.{self.db}.steps.{side}.{key}",
                         round(percentile(samples[label], 50), 1), "us", db=self.db,
                         side=side, label=label, calls=len(samples[label]))
        lock.release(lease.name, lease.owner)
        raw.close()

        # How often one execution looks a steplock_* setting up in Celery's configuration
        # (``app.conf.get``: lookups through the Django-namespaced settings are not cheap)
        # and resolves its guard: counted by wrapping the methods in this process for 10
        # executions, then restoring them.
        from celery_steplock import task as steplock_task

        counts = {"conf_lookups": 0, "guard_calls": 0}
        conf_cls = type(app.conf)
        orig_get = conf_cls.get
        orig_guard = steplock_task.StepLockedTask.steplock_guard

        def get_counted(self_, key, *a, **k):
            if isinstance(key, str) and key.startswith("steplock_"):
                counts["conf_lookups"] += 1
            return orig_get(self_, key, *a, **k)

        def guard_counted(self_, *a, **k):
            counts["guard_calls"] += 1
            return orig_guard(self_, *a, **k)

        conf_cls.get = get_counted
        steplock_task.StepLockedTask.steplock_guard = guard_counted
        try:
            for sid in self.make_args("steplock", 10):
                task(sid)
        finally:
            conf_cls.get = orig_get
            steplock_task.StepLockedTask.steplock_guard = orig_guard
        self.rec.add(f"e2e.{self.db}.steplock.conf_lookups", counts["conf_lookups"] / 10,
                     "app.conf lookups/execution", db=self.db)
        self.rec.add(f"e2e.{self.db}.steplock.guard_calls", counts["guard_calls"] / 10,
                     "calls/execution", db=self.db)

    def worker_errors(self) -> None:
        text = self.worker.log_text()
        errors = [line for line in text.splitlines()
                  if " ERROR" in line or "CRITICAL" in line or "Traceback" in line]
        self.rec.add(f"e2e.{self.db}.worker_error_lines", len(errors), "lines", db=self.db)
        if errors:
            self.rec.note(f"{self.db}: worker log has {len(errors)} error lines, first: "
                          f"{errors[0][:200]}")


def run_db(db: str, quick: bool) -> dict[str, Any]:
    rec = Recorder("e2e")
    kinds = installed_variants(rec, KINDS, PEER_OF)
    with tempfile.TemporaryDirectory(prefix=f"steplock-bench-e2e-{db}-") as tmp:
        bench = Bench(rec, db, Path(tmp))
        try:
            bench.start()
            if quick:
                bench.throughput(kinds, n=200, reps=2, warmup=20)
                bench.counting(kinds, k=20)
                bench.inprocess(n=100, reps=2, profile=True)
                bench.steps(n=100)
            else:
                bench.throughput(kinds, n=2000, reps=3, warmup=50)
                bench.counting(kinds, k=100)
                bench.inprocess(n=400, reps=5, profile=True)
                bench.steps(n=500)
            bench.worker_errors()
        finally:
            bench.stop()
    return rec.result(peers=peer_status(), profiles=bench.profiles)


def run(quick: bool = False) -> dict[str, Any]:
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
        rec.say(f"{db}: {' '.join(cmd[1:])}")
        proc = subprocess.run(cmd, cwd=ROOT)
        try:
            part = json.loads(Path(out).read_text())
        except (OSError, ValueError):
            part = {"figures": [], "notes": [], "error": f"no result (exit {proc.returncode})"}
        finally:
            Path(out).unlink(missing_ok=True)
        rec.figures += part.get("figures", [])
        rec.notes += part.get("notes", [])
        profiles.update(part.get("profiles") or {})
        if part.get("error") or proc.returncode:
            rec.note(f"{db} run failed: {part.get('error') or f'exit {proc.returncode}'}")
    rec.note("Settings: benchmarks/e2e_settings.py (django_app's, without a result backend, "
             "database connection kept between tasks, celery_steplock logging at WARNING); "
             "broker and lock store are two redis-servers on loopback; acks_late, prefetch "
             "multiplier 1, -O fair, as in django_app.")
    return rec.result(profiles=profiles)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", choices=["sqlite", "postgresql"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out")
    args, _ = parser.parse_known_args()
    if args.db is None:
        return group_main("e2e", run)
    return write_result("e2e", lambda: run_db(args.db, args.quick), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
