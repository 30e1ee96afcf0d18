#!/usr/bin/env python
"""End-to-end demo of celery-steplock: duplicates, races and a SIGKILLed worker.

What it does (``make demo`` runs it):

1. starts a throwaway Redis (or uses ``REDIS_URL`` with a private key prefix), a fresh SQLite
   database under ``var/`` (or ``DATABASE_URL``), migrated with ``manage.py migrate``;
2. starts two real ``celery worker`` processes (prefork, concurrency 2 each) with a 5 s lease
   TTL and a 10 s broker visibility timeout;
3. creates N steps and, for every step, publishes ``advance`` three times: twice with the same
   task id (a duplicate delivery) and once with a fresh id; about a quarter of the steps also
   get a racing ``compensate`` (pending -> cancelled); some tasks sleep 0.05-0.5 s inside the
   lease so that contention is real;
4. once ~30 % of the steps are terminal, freezes one worker, records the leases it holds and
   SIGKILLs its whole process group: its leases must expire by TTL, and its unacknowledged
   messages must be redelivered by Redis (acks_late + visibility_timeout) to the survivor;
5. waits until every step is terminal and the queues are drained, then checks the invariants
   with the fault suite's checker (``tests/support/faults/checker.py``): exactly one terminal
   transition committed per step, a legal chain from ``pending`` ending at the step's status,
   fences never decreasing, the body's own write committed once (``attempts``), the killed
   worker's leases expired by TTL, no lease left behind, every steplock key has a TTL;
6. runs the reaper (``celery -A django_app steplock reap``) and prints its summary: after a
   clean run it scans no lease, reaps none and recovers no step.

The last line is machine-readable; the exit status is 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from celery_steplock.redact import redact, url_secrets  # noqa: E402
from tests.support import servers  # noqa: E402  (needs REPO on sys.path)
from tests.support.faults import checker  # noqa: E402

VAR = REPO / "var"
LOG_ROOT = VAR / "demo-logs"
DEMO_SQLITE = VAR / "demo.sqlite3"

LEASE_TTL = 5  # seconds: STEPLOCK_TTL of the workers
VISIBILITY_TIMEOUT = 10  # seconds: broker visibility_timeout of the workers
LONG_DELAY = LEASE_TTL + 1.0  # body time of the --long steps: outlives the TTL, heartbeat renews
RESTORE_INTERVAL = 2  # seconds between kombu's sweeps for unacked messages of dead workers
KEEP_LOG_RUNS = 10  # demo-log directories kept under var/demo-logs
TERMINAL = tuple(sorted(checker.TERMINAL))
STATS_EVENTS = (
    "lock_acquired",
    "lock_contended",
    "lock_extended",
    "lock_released",
    "lock_expired",
    "lock_lost",
    "transition_applied",
    "transition_conflict",
    "lock_store_error",
    "redelivered",
)
# kombu's Redis transport keeps priorities 3/6/9 in sibling lists named queue + sep + priority.
KOMBU_PRIORITY_SEP = "\x06\x16"
KOMBU_PRIORITY_STEPS = (0, 3, 6, 9)


def safe(text: str) -> str:
    """``text`` with the passwords of ``REDIS_URL`` and ``DATABASE_URL`` masked: what the demo
    prints about its servers (their URLs, their errors) shows no secret."""
    return redact(
        text, url_secrets([os.environ.get("REDIS_URL", ""), os.environ.get("DATABASE_URL", "")])
    )


class DemoError(RuntimeError):
    pass


def _on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


class Clock:
    def __init__(self):
        self.t0 = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self.t0


class Demo:
    def __init__(self, args):
        self.args = args
        self.clock = Clock()
        self.run_id = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
        self.log_dir = LOG_ROOT / self.run_id
        self.redis_server = None
        self.workers: dict[str, servers.WorkerProcess] = {}
        self.killed: str | None = None
        self.replacement: str | None = None
        self.notes: list[str] = []
        self.failed_reasons: list[str] = []
        self.shared_redis = bool(os.environ.get("REDIS_URL"))
        self.use_sqlite = not os.environ.get("DATABASE_URL")
        if self.shared_redis:
            # A private namespace on somebody else's Redis: lease keys, broker keys, stats.
            ns = f"steplock-demo-{self.run_id}"
            self.key_prefix = ns
            self.broker_prefix = f"{ns}-broker:"
            self.stats_prefix = f"{ns}-stats"
        else:
            self.key_prefix = "steplock"
            self.broker_prefix = ""
            self.stats_prefix = "demo:stats"
        self.step_prefix = f"demo-{self.run_id}-"
        self.redis = None
        self.redis_url = None

    # -- output ----------------------------------------------------------------------------

    def say(self, message: str) -> None:
        print(safe(f"[{self.clock():6.1f}s] {message}"), flush=True)

    # -- setup -----------------------------------------------------------------------------

    def prepare_dirs(self) -> None:
        VAR.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        runs = sorted(p for p in LOG_ROOT.iterdir() if p.is_dir())
        for old in runs[:-KEEP_LOG_RUNS]:
            shutil.rmtree(old, ignore_errors=True)

    def start_redis(self) -> None:
        import redis

        if self.shared_redis:
            self.redis_url = os.environ["REDIS_URL"]
            self.say(
                f"using REDIS_URL={self.redis_url} (key prefix {self.key_prefix!r}, "
                f"broker key prefix {self.broker_prefix!r})"
            )
        else:
            self.redis_server = servers.RedisServer(workdir=self.log_dir / "redis")
            self.redis_server.start()
            self.redis_url = self.redis_server.url
            self.say(f"started redis-server pid {self.redis_server.pid} at {self.redis_url}")
        self.redis = redis.Redis.from_url(
            self.redis_url, decode_responses=True, socket_timeout=10, socket_connect_timeout=5
        )
        self.redis.ping()

    def configure_env(self) -> None:
        """Environment shared by this process, manage.py and the workers (read by settings)."""
        env = {
            "DJANGO_SETTINGS_MODULE": "django_app.settings",
            "REDIS_URL": self.redis_url,
            "STEPLOCK_TTL": str(LEASE_TTL),
            "STEPLOCK_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT),
            # kombu >= 5.6 sweeps for unacked messages every interval * throttle seconds
            # (100 s by default): make it every RESTORE_INTERVAL seconds.
            "STEPLOCK_UNACKED_RESTORE_INTERVAL": str(RESTORE_INTERVAL),
            "STEPLOCK_UNACKED_RESTORE_THROTTLE": "1",
            "STEPLOCK_UNACKED_MUTEX_EXPIRE": "30",
            "STEPLOCK_KEY_PREFIX": self.key_prefix,
            "STEPLOCK_DEMO_STATS_PREFIX": self.stats_prefix,
            "STEPLOCK_DEMO_STATS_URL": self.redis_url,
        }
        if self.broker_prefix:
            env["STEPLOCK_BROKER_KEYPREFIX"] = self.broker_prefix
        if self.use_sqlite:
            env["STEPLOCK_SQLITE"] = str(DEMO_SQLITE)
        os.environ.update(env)
        os.environ.pop("STEPLOCK_DEMO_STATS", None)  # this process sends no task signals
        self.worker_env = {"STEPLOCK_DEMO_STATS": "1"}

    def prepare_database(self) -> None:
        if self.use_sqlite:
            for suffix in ("", "-wal", "-shm", "-journal"):
                Path(f"{DEMO_SQLITE}{suffix}").unlink(missing_ok=True)
            where = f"SQLite {DEMO_SQLITE.relative_to(REPO)}"
        else:
            where = "DATABASE_URL"
        log = self.log_dir / "migrate.log"
        with open(log, "wb") as fh:
            result = subprocess.run(
                [sys.executable, str(REPO / "manage.py"), "migrate", "--noinput"],
                cwd=REPO,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                timeout=300,
            )
        if result.returncode != 0:
            raise DemoError(f"manage.py migrate failed (exit {result.returncode}); see {log}")
        self.say(f"migrated {where}")

        import django

        django.setup()
        from django.conf import settings

        self.settings = settings
        from django_app import celery_app

        self.celery_app = celery_app

    def start_worker(self, name: str) -> servers.WorkerProcess:
        worker = servers.celery_worker(
            name=name,
            concurrency=2,
            pool="prefork",
            env=self.worker_env,
            logfile=self.log_dir / f"{name}.log",
            timeout=90,
        )
        self.workers[name] = worker
        self.say(f"worker {name} ready (pid {worker.pid}, prefork x2)")
        return worker

    # -- Redis helpers ---------------------------------------------------------------------

    def scan(self, pattern: str) -> list[str]:
        return list(self.redis.scan_iter(match=pattern, count=500))

    def leases(self) -> dict[str, dict]:
        """Every lease hash under our prefix, with its PTTL."""
        keys = self.scan(f"{self.key_prefix}:lease:*")
        if not keys:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
            pipe.pttl(key)
        values = pipe.execute()
        found = {}
        for i, key in enumerate(keys):
            fields, pttl = values[2 * i], values[2 * i + 1]
            if fields:
                from celery_steplock.lock import unpack_fields

                fields = unpack_fields(fields)
                fields["pttl"] = pttl
                found[key] = fields
        return found

    def stats(self) -> Counter:
        keys = [f"{self.stats_prefix}:{event}" for event in STATS_EVENTS]
        values = self.redis.mget(keys)
        return Counter({event: int(v or 0) for event, v in zip(STATS_EVENTS, values)})

    def queue_depth(self) -> tuple[int, int]:
        """(messages waiting in the queue, messages delivered but not acknowledged)."""
        queue = self.celery_app.conf.task_default_queue
        pipe = self.redis.pipeline(transaction=False)
        for pri in KOMBU_PRIORITY_STEPS:
            name = queue if pri == 0 else f"{queue}{KOMBU_PRIORITY_SEP}{pri}"
            pipe.llen(f"{self.broker_prefix}{name}")
        pipe.hlen(f"{self.broker_prefix}unacked")
        values = pipe.execute()
        return sum(values[:-1]), values[-1]

    # -- the workload ------------------------------------------------------------------------

    def create_steps(self) -> list[int]:
        from django_app.workflows.models import Step

        Step.objects.bulk_create(
            [Step(name=f"{self.step_prefix}{i:05d}") for i in range(self.args.steps)],
            batch_size=500,
        )
        ids = list(
            Step.objects.filter(name__startswith=self.step_prefix)
            .order_by("id")
            .values_list("id", flat=True)
        )
        if len(ids) != self.args.steps:
            raise DemoError(f"created {len(ids)} steps, expected {self.args.steps}")
        self.say(f"created {len(ids)} steps (pending)")
        return ids

    def plan(self, ids: list[int]) -> list[tuple]:
        """Messages to publish: (task name, step id, delay, task id), grouped per step."""
        rng = random.Random(self.args.seed)

        def task_id() -> str:
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))

        def work() -> float:
            return round(rng.uniform(0.05, 0.5), 3) if rng.random() < 0.3 else 0.0

        messages = []
        self.compensated = 0
        long_steps = set(rng.sample(ids, min(self.args.long, len(ids))))
        for step_id in ids:
            long = step_id in long_steps
            duplicate, d1, d2 = task_id(), work(), work()
            if long:  # whichever advance wins works past the TTL: the heartbeat must renew
                d1 = d2 = LONG_DELAY
            group = [
                ("advance", step_id, d1, duplicate),
                ("advance", step_id, d1, duplicate),
                ("advance", step_id, d2, task_id()),
            ]
            if rng.random() < 0.25 and not long:
                self.compensated += 1
                delay = round(rng.uniform(0.02, 0.2), 3) if rng.random() < 0.5 else 0.0
                group.append(("compensate", step_id, delay, task_id()))
            rng.shuffle(group)
            messages.extend(group)
        return messages

    def publish(self, messages: list[tuple]) -> None:
        from django_app.workflows.tasks import advance, compensate

        tasks = {"advance": advance, "compensate": compensate}
        for name, step_id, delay, tid in messages:
            tasks[name].apply_async(args=(step_id,), kwargs={"delay": delay}, task_id=tid)
        self.published = len(messages)
        counts = Counter(m[0] for m in messages)
        self.say(
            f"published {len(messages)} messages: {counts['advance']} advance "
            f"({self.args.steps} duplicate pairs sharing a task id), "
            f"{counts['compensate']} compensate"
        )

    def progress(self) -> tuple[int, int]:
        from django_app.workflows.models import Step

        qs = Step.objects.filter(name__startswith=self.step_prefix)
        terminal = qs.filter(status__in=TERMINAL).count()
        return terminal, qs.count()

    # -- the kill ----------------------------------------------------------------------------

    def worker_pids(self, worker: servers.WorkerProcess) -> set[int]:
        return {worker.pid, *worker.children_pids(recursive=True), *worker.group_pids()}

    def leases_of(self, worker: servers.WorkerProcess) -> dict[str, dict]:
        pids = {str(p) for p in self.worker_pids(worker)}
        return {k: v for k, v in self.leases().items() if v.get("pid") in pids}

    def kill_one_worker(self) -> dict[str, dict]:
        """Freeze the worker holding the most leases, snapshot its leases, SIGKILL it."""
        deadline = time.monotonic() + 5
        victim, held = None, {}
        while True:
            for name in ("w1", "w2"):
                worker = self.workers[name]
                mine = self.leases_of(worker)
                if victim is None or len(mine) > len(held):
                    victim, held = name, mine
            if held or time.monotonic() > deadline:
                break
            victim = None
            time.sleep(0.02)
        worker = self.workers[victim]
        # SIGSTOP first: a frozen worker can neither commit nor release, so the snapshot
        # below is exactly what it holds when the SIGKILL lands.
        worker.signal(signal.SIGSTOP, group=True)
        held = self.leases_of(worker)
        _, unacked = self.queue_depth()
        worker.kill()
        self.killed = victim
        self.kill_at = time.monotonic()
        self.say(
            f"SIGKILL worker {victim} (process group {worker.pid}) while it held "
            f"{len(held)} lease(s); {unacked} message(s) were unacknowledged broker-wide"
        )
        for key, info in sorted(held.items()):
            self.say(
                f"    {key} owner={info.get('owner', '?')[:12]}.. fence={info.get('fence')} "
                f"task={info.get('task_name', '?').rsplit('.', 1)[-1]}"
                f"[{info.get('task_id', '?')[:8]}] pid={info.get('pid')} "
                f"ttl_left={info['pttl'] / 1000:.1f}s"
            )
        return held

    # -- main loop ---------------------------------------------------------------------------

    def run(self) -> int:
        args = self.args
        self.prepare_dirs()
        self.say(
            f"celery-steplock demo: {args.steps} steps, seed {args.seed}, "
            f"logs in {self.log_dir.relative_to(REPO)}"
        )
        self.start_redis()
        self.configure_env()
        self.prepare_database()
        self.clear_stats()
        self.start_worker("w1")
        self.start_worker("w2")

        ids = self.create_steps()
        messages = self.messages = self.plan(ids)
        work_t0 = time.monotonic()
        self.publish(messages)

        held: dict[str, dict] = {}
        orphans: dict[str, dict] = {}  # lease key -> info, still held by the dead owner
        expired: dict[str, float] = {}  # lease key -> seconds after the kill it vanished
        kill_threshold = max(1, int(args.steps * args.kill_at))
        deadline = time.monotonic() + args.timeout
        last_report = 0.0
        terminal = 0
        redelivery_seen_at = None
        while True:
            terminal, total = self.progress()
            now = time.monotonic()
            if self.killed is None and terminal >= kill_threshold:
                self.say(f"{terminal}/{total} steps terminal (>= {args.kill_at:.0%})")
                held = self.kill_one_worker()
                orphans = dict(held)
            if orphans:
                self.track_orphans(orphans, expired)
            stats = self.stats() if self.killed else Counter()
            if self.killed and redelivery_seen_at is None and stats["redelivered"]:
                redelivery_seen_at = now
                self.say(
                    f"a message Redis redelivered (visibility_timeout "
                    f"{VISIBILITY_TIMEOUT}s) started on a live worker "
                    f"{now - self.kill_at:.1f}s after the kill"
                )
            waiting, unacked = self.queue_depth()
            if now - last_report >= 2.0:
                last_report = now
                self.say(
                    f"progress: {terminal}/{total} terminal, queue {waiting}, unacked {unacked}"
                )
            if (
                self.killed
                and self.replacement is None
                and redelivery_seen_at is None
                and now - self.kill_at > args.redelivery_grace
                and unacked > 0
            ):
                self.replacement = "w3"
                note = (
                    f"kombu had not redelivered the dead worker's messages "
                    f"{args.redelivery_grace:.0f}s after the kill: started a replacement "
                    f"worker w3"
                )
                self.notes.append(note)
                self.say(note)
                self.start_worker("w3")
            if terminal == total and waiting == 0 and unacked == 0 and not orphans and self.killed:
                break
            if now > deadline:
                self.failed_reasons.append(
                    f"timeout after {args.timeout:.0f}s: {terminal}/{total} terminal, queue "
                    f"{waiting}, unacked {unacked}, {len(orphans)} orphan lease(s)"
                )
                self.say(self.failed_reasons[-1])
                break
            time.sleep(0.2)
        work_s = time.monotonic() - work_t0
        if not self.failed_reasons:
            self.say(f"all steps terminal and queues drained after {work_s:.1f}s of work")

        leaked, no_ttl = self.leak_check()
        return self.report(held, expired, leaked, no_ttl, work_s)

    def clear_stats(self) -> None:
        keys = [f"{self.stats_prefix}:{event}" for event in STATS_EVENTS]
        self.redis.delete(*keys)

    def track_orphans(self, orphans: dict[str, dict], expired: dict[str, float]) -> None:
        """Move the dead worker's leases that vanished (or changed owner) to ``expired``."""
        pipe = self.redis.pipeline(transaction=False)
        keys = list(orphans)
        for key in keys:
            pipe.hget(key, "owner")
        owners = pipe.execute()
        for key, owner in zip(keys, owners):
            if owner == orphans[key].get("owner"):
                continue
            info = orphans.pop(key)
            after = time.monotonic() - self.kill_at
            ttl_left = info["pttl"] / 1000
            if after + 0.5 < ttl_left:
                self.failed_reasons.append(
                    f"lease {key} of the dead worker vanished {after:.1f}s after the kill, "
                    f"before its TTL ({ttl_left:.1f}s left): somebody deleted it"
                )
                continue
            expired[key] = after
            self.say(
                f"lease {key} of the dead worker expired {after:.1f}s after the kill "
                f"(TTL left at the kill {ttl_left:.1f}s; nobody released it)"
            )

    def leak_check(self) -> tuple[list[str], list[str]]:
        """Lease keys left once all work drained (+ one TTL); steplock keys without a TTL."""
        leftover = checker.lease_keys(self.redis, self.key_prefix)
        if leftover:
            self.say(
                f"{len(leftover)} lease(s) still present; waiting one TTL "
                f"({LEASE_TTL}s) before calling them leaked"
            )
            time.sleep(LEASE_TTL + 1)
            leftover = checker.lease_keys(self.redis, self.key_prefix)
        return leftover, checker.keys_without_ttl(self.redis, self.key_prefix)

    # -- checks and report ---------------------------------------------------------------------

    def report(self, held, expired, leaked, no_ttl, work_s) -> int:
        from django_app.workflows.models import Step, TransitionRecord

        steps = list(Step.objects.filter(name__startswith=self.step_prefix))
        rows = list(
            TransitionRecord.objects.filter(step__name__startswith=self.step_prefix).order_by("id")
        )
        records = {}
        for rec in rows:
            records.setdefault(rec.step_id, []).append(rec)
        committed = len(rows)
        # No probe history here (the fault suite's receivers are off): the stale-commit
        # check has nothing to look at; the fences along each chain are still checked.
        violations = checker.check_steps(
            {s.id: s.status for s in steps},
            [checker.Record.of(r) for r in rows],
            body_runs={s.id: s.attempts for s in steps},
        )
        fence_mismatch = sum(
            1
            for s in steps
            if s.id in records
            and (s.lock_owner, s.lock_fence) != (records[s.id][-1].owner, records[s.id][-1].fence)
        )
        by_status = Counter(s.status for s in steps)
        stats = self.stats()
        expired_n = len(expired)
        orphaned = len(held)
        for key in held:
            if key not in expired:
                violations.append(f"lease {key} of the killed worker never expired")
        for key in leaked:
            self.failed_reasons.append(f"leaked lease {key}")
        for key in no_ttl:
            self.failed_reasons.append(f"steplock key without a TTL: {key}")
        outcomes = self.task_outcomes()
        winners = self.winner_outcomes([r.task_id for recs in records.values() for r in recs])
        fences = [r.fence for recs in records.values() for r in recs if r.fence is not None]
        per_worker = Counter(r.hostname.split("@")[0] for recs in records.values() for r in recs)
        wall_s = self.clock()

        rows = [
            (
                "steps",
                len(steps),
                f"{by_status['done']} done, {by_status['cancelled']} "
                f"cancelled, {self.compensated} had a racing compensate",
            ),
            (
                "messages published",
                self.published,
                "3 advance per step (one duplicate id) + compensations",
            ),
            (
                "committed transitions",
                committed,
                "TransitionRecord rows (written in the CAS transaction)",
            ),
            ("  by worker", ", ".join(f"{w}={n}" for w, n in sorted(per_worker.items())), ""),
            (
                "task results",
                " ".join(f"{k}={v}" for k, v in sorted(outcomes.items())) or "-",
                "stored states (an Ignore()d run stores none; FAILURE: retries exhausted)",
            ),
            (
                "winners' results",
                f"{winners['SUCCESS']}/{committed} SUCCESS",
                "stored state of each committing task id"
                + (
                    f"; {committed - winners['SUCCESS']} not SUCCESS "
                    f"({' '.join(f'{k}={v}' for k, v in sorted(winners.items()) if k != 'SUCCESS')}"
                    f"): a same-id duplicate stored over it"
                    if winners["SUCCESS"] != committed
                    else ""
                ),
            ),
            ("locks acquired", stats["lock_acquired"], "lock_acquired signals"),
            ("contended", stats["lock_contended"], "lock_contended: lease busy -> retried"),
            (
                "conflicts",
                stats["transition_conflict"],
                "transition_conflict: step already left 'pending' -> skipped, rolled back",
            ),
            (
                "leases renewed",
                stats["lock_extended"],
                f"heartbeat lock_extended signals (every {LEASE_TTL / 3:.1f}s while held)",
            ),
            ("leases released", stats["lock_released"], "released after commit"),
            ("leases lost", stats["lock_lost"], "lock_lost signals"),
            (
                "killed worker",
                self.killed or "-",
                f"SIGKILL; held {orphaned} lease(s) at the time",
            ),
            (
                "leases expired",
                expired_n,
                "dead worker's leases that vanished by TTL (never released)"
                + (
                    f", {min(expired.values()):.1f}-{max(expired.values()):.1f}s after the kill"
                    if expired
                    else ""
                ),
            ),
            (
                "redelivered",
                stats["redelivered"],
                f"messages run again after kombu restored them (visibility_timeout "
                f"{VISIBILITY_TIMEOUT}s, acks_late)",
            ),
            (
                "replacement worker",
                self.replacement or "none",
                "survivor finished alone"
                if not self.replacement
                else "kombu did not redeliver in time",
            ),
            (
                "invariant violations",
                len(violations),
                "checker: 1 terminal commit per step, "
                "legal chain == status, fences rising, "
                "attempts == commits; killed leases "
                "expired",
            ),
            (
                "owner/fence columns",
                "match" if not fence_mismatch else f"{fence_mismatch} differ",
                "step.lock_owner/lock_fence == committing lease",
            ),
            (
                "fencing tokens",
                f"{len(set(fences))} distinct" if fences else "-",
                "fence of each committed grant (Redis-issued, per lease name)",
            ),
            ("leaked leases", len(leaked), "lease keys left after drain + one TTL"),
            ("keys without TTL", len(no_ttl), f"under {self.key_prefix}:*"),
            ("work time", f"{work_s:.1f}s", "publish -> all terminal and drained"),
            ("wall time", f"{wall_s:.1f}s", "whole demo incl. Redis, migrate, workers"),
        ]
        print()
        width = max(len(r[0]) for r in rows)
        vwidth = max(len(str(r[1])) for r in rows)
        print(f"{'check'.ljust(width)}  {'value'.rjust(vwidth)}  notes")
        print(f"{'-' * width}  {'-' * vwidth}  {'-' * 40}")
        for label, value, note in rows:
            print(f"{label.ljust(width)}  {str(value).rjust(vwidth)}  {note}")
        # Notes, violations and the reaper's lines may quote an error, and an error a URL.
        for note in self.notes:
            print(safe(f"note: {note}"))
        for line in violations[:20]:
            print(safe(f"VIOLATION: {line}"))
        if len(violations) > 20:
            print(f"... and {len(violations) - 20} more violations")
        for line in self.failed_reasons:
            print(safe(f"FAILED: {line}"))
        ok = (
            committed == len(steps) == self.args.steps
            and not violations
            and not leaked
            and not no_ttl
            and not self.failed_reasons
        )
        # The invariants above are settled: the reaper runs last, so it cannot change them,
        # and it does not change the exit status either (it has nothing to do after a clean
        # run: no lease is left and no step is in flight).
        for line in self.run_reaper():
            print(safe(line))
        print()
        print(
            f"steps={len(steps)} committed={committed} contended={stats['lock_contended']} "
            f"conflicts={stats['transition_conflict']} expired={expired_n} "
            f"violations={len(violations)} leaked={len(leaked) + len(no_ttl)} "
            f"wall_s={wall_s:.1f}",
            flush=True,
        )
        return 0 if ok else 1

    def run_reaper(self) -> list[str]:
        """Run ``celery -A django_app steplock reap --json`` with the demo's environment and
        return its summary lines (``reaper: ...``).

        On a shared Redis (a private key prefix) or a shared database, other people's leases
        are invisible to this run while their steps are not, so it only looks (``--dry-run``).
        """
        import json

        argv = [sys.executable, "-m", "celery", "-A", "django_app", "steplock", "reap", "--json"]
        shared = self.shared_redis or not self.use_sqlite
        if shared:
            argv.append("--dry-run")
        started = time.monotonic()
        try:
            result = subprocess.run(
                argv,
                cwd=REPO,
                capture_output=True,
                text=True,
                stdin=subprocess.DEVNULL,
                timeout=120,
            )
        except subprocess.TimeoutExpired:
            return ["reaper: timed out after 120s"]
        took = time.monotonic() - started
        try:
            report = json.loads(result.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
            return [f"reaper: exit {result.returncode}, no report ({tail})"]
        mode = " --dry-run (shared Redis or database)" if shared else ""
        lines = [
            f"reaper: celery -A django_app steplock reap{mode}: exit {result.returncode} "
            f"in {took:.1f}s",
            f"reaper: leases scanned {report['leases_scanned']}, "
            f"{'to reap' if report['dry_run'] else 'reaped'} "
            f"{len(report['leases_reaped'])}, steps "
            f"{'to recover' if report['dry_run'] else 'recovered'} "
            f"{len(report['steps_recovered'])}, errors {len(report['errors'])}",
        ]
        reaped, recovered = (
            ("would reap", "would recover") if report["dry_run"] else ("reaped", "recovered")
        )
        lines += [f"reaper: {reaped} {r['name']}: {r['reason']}" for r in report["leases_reaped"]]
        lines += [
            f"reaper: {recovered} step {r['pk']}: {r['from_']} -> {r['to']}"
            for r in report["steps_recovered"]
        ]
        lines += [f"reaper: error: {e}" for e in report["errors"]]
        return lines

    def task_outcomes(self) -> Counter:
        """Stored task states (django-celery-results) of the messages we published."""
        from django_celery_results.models import TaskResult

        ids = sorted({m[3] for m in self.messages})
        found = Counter()
        for i in range(0, len(ids), 500):
            found.update(
                TaskResult.objects.filter(task_id__in=ids[i : i + 500]).values_list(
                    "status", flat=True
                )
            )
        return found

    def winner_outcomes(self, task_ids) -> Counter:
        """Stored state of the task ids that committed a transition (SUCCESS expected)."""
        from django_celery_results.models import TaskResult

        ids = sorted(set(task_ids))
        states = {}
        for i in range(0, len(ids), 500):
            states.update(
                TaskResult.objects.filter(task_id__in=ids[i : i + 500]).values_list(
                    "task_id", "status"
                )
            )
        return Counter(states.get(tid, "none") for tid in task_ids)

    # -- teardown -----------------------------------------------------------------------------

    def cleanup(self, failed: bool) -> None:
        for name, worker in reversed(list(self.workers.items())):
            if worker.alive():
                try:
                    worker.terminate(timeout=15)
                except Exception as exc:  # noqa: BLE001
                    print(safe(f"demo: could not stop worker {name}: {exc}"), file=sys.stderr)
        if self.redis is not None and self.shared_redis:
            try:
                for pattern in (
                    f"{self.key_prefix}:*",
                    f"{self.broker_prefix}*",
                    f"{self.stats_prefix}:*",
                ):
                    keys = self.scan(pattern)
                    for i in range(0, len(keys), 500):
                        self.redis.delete(*keys[i : i + 500])
            except Exception as exc:  # noqa: BLE001
                print(safe(f"demo: could not clean up Redis keys: {exc}"), file=sys.stderr)
        if self.redis_server is not None:
            self.redis_server.stop()
        if not self.args.keep:
            if self.use_sqlite:
                for suffix in ("", "-wal", "-shm", "-journal"):
                    Path(f"{DEMO_SQLITE}{suffix}").unlink(missing_ok=True)
            elif hasattr(self, "settings"):
                try:
                    from django_app.workflows.models import Step

                    from django_celery_results.models import TaskResult

                    Step.objects.filter(name__startswith=self.step_prefix).delete()
                    ids = sorted({m[3] for m in getattr(self, "messages", ())})
                    for i in range(0, len(ids), 500):
                        TaskResult.objects.filter(task_id__in=ids[i : i + 500]).delete()
                except Exception as exc:  # noqa: BLE001
                    print(safe(f"demo: could not delete the demo steps: {exc}"), file=sys.stderr)
        elif self.use_sqlite:
            print(f"demo: kept the database {DEMO_SQLITE}")
        if failed:
            print(f"demo: worker logs are in {self.log_dir}", file=sys.stderr)
            for name in self.workers:
                print(f"    {self.log_dir / (name + '.log')}", file=sys.stderr)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="number of steps (default 200)")
    parser.add_argument("--seed", type=int, default=42, help="RNG seed of the workload")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the demo database (var/demo.sqlite3, or the demo rows)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=180.0,
        help="seconds to wait for every step to be terminal (default 180)",
    )
    parser.add_argument(
        "--long",
        type=int,
        default=1,
        help=f"steps whose advance works {LONG_DELAY:g}s, longer than "
        f"the {LEASE_TTL}s lease TTL, so the heartbeat must renew (1)",
    )
    parser.add_argument(
        "--kill-at",
        type=float,
        default=0.3,
        help="share of terminal steps at which a worker is killed (0.3)",
    )
    parser.add_argument(
        "--redelivery-grace",
        type=float,
        default=30.0,
        help="seconds to wait for kombu to redeliver the killed worker's "
        "messages before starting a replacement worker (30)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    demo = Demo(args)
    status = 1
    try:
        status = demo.run()
    except KeyboardInterrupt:
        print("\ndemo: interrupted, stopping everything", file=sys.stderr)
        status = 130
    except Exception as exc:
        import traceback

        print(safe(f"demo: FAILED: {type(exc).__name__}: {exc}"), file=sys.stderr)
        # A traceback may quote REDIS_URL or DATABASE_URL (a connection error, a parser's).
        print(safe(traceback.format_exc()), end="", file=sys.stderr)
        status = 1
    finally:
        try:
            # Let the cleanup finish: a second Ctrl-C / SIGTERM must not leave servers behind.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            demo.cleanup(failed=status != 0)
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            servers.stop_all()
    return status


if __name__ == "__main__":
    sys.exit(main())
