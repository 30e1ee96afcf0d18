"""The fault scenarios: each publishes work for one fresh step, injects one fault at a
deterministic point (a probe barrier, see ``django_app/faults/probe.py``) and returns the
wall-clock time of the fault. :func:`run` then waits until the system is quiet and checks the
invariants (``checker``).

Most scenarios deliver the step's task twice with one task id (a duplicate delivery, as after a
broker redelivery): the first attempt stops at the barrier holding the lease, the second lands
on the other worker and contends, so after the fault there is always a second attempt ready
to take over, and a second chance to commit twice.

The fence-decides family (:data:`FENCE_SCENARIOS`, fault class "split brain: the fence
decides"; it needs ``Lab(worker_stores=True)``) is the one where only the fencing token can
refuse the stale writer: a split brain of the lock store leaves the stale holder's worker on
the old primary, where its lease lives on and its ownership check passes, while the other
worker, on a promoted replica that never saw that lease, takes a newer lease and moves the
step pending -> running, and a reset (or the reaper) moves it back to pending with a fence
at least as new. The stale holder's CAS then finds the status it expects: only the fence
condition refuses it. A guard without the fence (``Lab(guard="nofence")``) commits the stale
write, and the checker reports decreasing fences and a commit after a newer grant.
"""

from __future__ import annotations

import signal
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

from tests.support.faults.checker import Verdict

POINTS = ("after_acquire", "before_cas", "after_cas", "before_commit", "after_commit")


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: str  # the fault class, a row of docs/reliability.md
    inject: Callable  # inject(lab, step_id) -> wall-clock time of the fault
    overlap: bool = False  # two holders at once is expected (pause, failover)
    timeout: float = 90.0
    resume: bool = False  # the fault fails the task for good: an operator re-sends it


@dataclass
class Outcome:
    scenario: Scenario
    verdict: Verdict
    seconds: float


def run(lab, scenario: Scenario) -> Outcome:
    """One trial of ``scenario`` on a fresh step."""
    started = time.monotonic()
    lab.new_trial()
    step = lab.new_step(scenario.name)
    lab.note("trial", step=step, scenario=scenario.name)
    fault_at = scenario.inject(lab, step)
    settled_at = lab.settle([step], timeout=scenario.timeout)
    verdict = lab.verdict([step], fault_at, settled_at)
    return Outcome(scenario, verdict, time.monotonic() - started)


# -- building blocks ----------------------------------------------------------------------------


def held_pair(lab, step, point, task="forward", duplicate=True, **options) -> tuple[dict, str]:
    """Publish ``task`` for ``step``, stop its first attempt at ``point``, and (``duplicate``)
    deliver the same task id again; returns (the stopped attempt, task id)."""
    task_id = str(uuid.uuid4())
    lab.arm(step, point)
    lab.publish(task, step, task_id=task_id, **options)
    arrival = lab.wait_arrival(step, point)
    if duplicate:
        lab.publish(task, step, task_id=task_id, **options)
    return arrival, task_id


def other_owner(lab, step, victim, ev, history=None, **match):
    """The first history entry ``ev`` on ``step`` by an owner other than ``victim`` whose
    fields equal ``match``, in ``history`` (default: the lab's now)."""
    for entry in lab.history() if history is None else history:
        if (
            entry.get("ev") == ev
            and entry.get("step") == step
            and entry.get("owner") not in (None, victim)
            and all(entry.get(k) == v for k, v in match.items())
        ):
            return entry
    return None


@contextmanager
def frozen_heartbeat(lab, arrival):
    """Freeze the heartbeat of the process of a held attempt (``arrival``, from
    :func:`held_pair`): its ``lock_extended`` receiver blocks (``django_app/faults/probe.py``),
    so it renews nothing and reports no loss while its task goes on believing it holds the
    lease. Enters once the freeze has caught a renewal (that attempt's ``heartbeat_frozen``
    entry, at most TTL/3 away); thaws on leaving, also on an error."""
    key = f"faults:freeze:{arrival['pid']}"
    lab.r.set(key, uuid.uuid4().hex)
    try:
        lab.wait_event("heartbeat_frozen", 30, owner=arrival["owner"])
        yield
    finally:
        lab.r.delete(key)


def duplicate_holds(lab, step, holder, task_id=None, task="forward"):
    """Wait until an attempt other than ``holder`` holds a lease on ``step``; with
    ``task_id``, deliver that task id again first (the duplicate)."""
    if task_id is not None:
        lab.publish(task, step, task_id=task_id)
    lab.wait_for(lambda: other_owner(lab, step, holder, "acquired"), 60, "the duplicate's lease")


def holder_refused(lab, step, arrival):
    """Wait until another attempt committed ``step`` and the held attempt's task ended."""

    def done():
        history = lab.history()
        return other_owner(lab, step, arrival["owner"], "committed", history) and any(
            e["ev"] == "task_end" and e.get("pid") == arrival["pid"] for e in history
        )

    lab.wait_for(done, 60, "a commit and the held attempt's end")


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks after boot) of process ``pid``, read from
    ``/proc/<pid>/stat`` (proc(5)), or None when no process has that pid.

    The process may be reaped between the open() and the read() (the pool SIGKILLs a child
    at its hard time limit and reaps it at once): Linux then fails the read with ESRCH,
    ProcessLookupError here. That is the same answer as a missing file, not an error of the
    controller."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            data = fh.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name may hold spaces and parentheses: the fields start after the last ')',
    # with field 3 (state); field 22 is the start time.
    fields = data.rsplit(")", 1)[1].split()
    return fields[0], int(fields[19])


def pid_gone(pid: int, started: int | None = None) -> bool:
    """True when process ``pid`` has exited: no such process, a zombie (exited, not yet
    reaped), or, given ``started`` (its :func:`proc_stat` start time), a process that is not
    the one that started then (the pid was reaped and given to another)."""
    stat = proc_stat(pid)
    if stat is None:
        return True
    state, start = stat
    return state == "Z" or (started is not None and start != started)


def wait_pid_gone(lab, pid, timeout=30.0, why="") -> dict:
    """Wait until process ``pid`` has exited (see :func:`pid_gone`; one that is gone already
    counts at once), then note the fault; TimeoutError after ``timeout`` seconds."""
    stat = proc_stat(pid)
    started = stat[1] if stat is not None else None
    lab.wait_for(lambda: stat is None or pid_gone(pid, started), timeout, f"pid {pid} to exit")
    return lab.note("fault", signal="SIGKILL", pid=pid, by=why or "pool")


# -- process faults -----------------------------------------------------------------------------


def kill_child(point):
    def inject(lab, step):
        arrival, _ = held_pair(lab, step, point)
        return lab.signal_pid(arrival["pid"], signal.SIGKILL)["t"]

    return inject


def kill_main(lab, step):
    arrival, _ = held_pair(lab, step, "before_cas")
    worker = lab.worker_of(arrival["pid"])
    children = worker.children_pids()
    fault = lab.kill_worker_main(worker)
    lab.go(step, "before_cas")  # the orphaned child goes on; its message waits for a redelivery
    for pid in children:  # an orphan that ends (or is ended) ends its hold there
        wait_pid_gone(lab, pid, why="orphaned by its main process")
    return fault["t"]


def pause(point):
    """SIGSTOP the holder past its TTL; SIGCONT only once another attempt committed. After its
    CAS the stopped holder owns the step's row lock: PostgreSQL ends its session when it has
    sat idle for its lease's remaining validity (the deadline of DjangoStepStore.transition), which
    frees the row for the next holder and makes the stale COMMIT fail."""

    def inject(lab, step):
        arrival, _ = held_pair(lab, step, point)
        fault = lab.signal_pid(arrival["pid"], signal.SIGSTOP)
        lab.go(step, point)
        lab.wait_for(
            lambda: other_owner(lab, step, arrival["owner"], "committed"),
            60,
            "another attempt to commit the paused holder's step",
        )
        lab.signal_pid(arrival["pid"], signal.SIGCONT)
        return fault["t"]

    return inject


def heartbeat_frozen(lab, step):
    """Only the heartbeat thread stops (a stuck lock_extended receiver); the body works on
    without looking at its lease until its lease has expired and the duplicate holds a newer
    one, then tries to commit.

    The body goes on once the duplicate holds its lease, not after a fixed time: the
    duplicate retries its contended lease with a jittered backoff, and a busy machine could
    leave its retry after a fixed wait, with no overlap in the trial."""
    arrival, _ = held_pair(lab, step, "before_cas")
    with frozen_heartbeat(lab, arrival):
        fault = lab.note("fault", kind="heartbeat_frozen", pid=arrival["pid"])
        duplicate_holds(lab, step, arrival["owner"])
        lab.go(step, "before_cas")
        holder_refused(lab, step, arrival)
    return fault["t"]


def hung_body(lab, step):
    """The body hangs (no time limit, never looks at its lease): after ``steplock_max_hold``
    the heartbeat stops renewing, the lease expires, the duplicate commits; the hung body
    wakes later and its commit is refused."""
    arrival, _ = held_pair(lab, step, "before_cas")
    fault = lab.note("fault", kind="hung_body", pid=arrival["pid"])
    lab.go(step, "before_cas", f"sleep:{lab.max_hold + 2 * lab.ttl}")
    lab.wait_event("task_end", lab.max_hold + 30, pid=arrival["pid"])
    return fault["t"]


def time_limit(soft: bool):
    """The body overruns its soft (SoftTimeLimitExceeded in the body) or hard (the pool kills
    the child) time limit inside the critical section."""

    def inject(lab, step):
        limits = {"soft_time_limit": 1.0, "time_limit": 10.0} if soft else {"time_limit": 1.5}
        arrival, _ = held_pair(lab, step, "before_cas", duplicate=False, **limits)
        lab.go(step, "before_cas", "sleep:4")
        if soft:
            return lab.wait_event("task_end", 30, pid=arrival["pid"])["t"]
        return wait_pid_gone(lab, arrival["pid"], why="hard time limit")["t"]

    return inject


def shutdown(sig):
    """SIGTERM (warm: the task finishes) or SIGQUIT (cold: the pool is killed) to the worker
    whose child holds the lease in its critical section."""

    def inject(lab, step):
        arrival, _ = held_pair(lab, step, "before_cas")
        worker = lab.worker_of(arrival["pid"])
        fault = lab.signal_pid(worker.pid, sig)
        lab.go(step, "before_cas")
        if sig == signal.SIGQUIT:
            wait_pid_gone(lab, arrival["pid"], why="cold shutdown")
        lab.wait_for(lambda: not worker.alive(), 60, f"{worker!r} to shut down")
        return fault["t"]

    return inject


# -- lock-store faults --------------------------------------------------------------------------


def redis_restart(lab, step):
    held_pair(lab, step, "before_cas")
    lab.store.restart()
    fault = lab.note("fault", kind="redis_restart")
    lab.go(step, "before_cas")
    return fault["t"]


def redis_outage(factor):
    """The lock store is down for ``factor`` x TTL (longer than the TTL: no renewal lands
    before the holder's lease would have expired) while the holder works on and its duplicate
    contends."""

    def inject(lab, step):
        held_pair(lab, step, "before_cas")
        lab.store.kill()
        seconds = factor * lab.ttl
        fault = lab.note("fault", kind="redis_outage", seconds=seconds)
        lab.go(step, "before_cas")
        time.sleep(seconds)
        lab.store.start()
        return fault["t"]

    return inject


def redis_failover(lab, step):
    """The holder's lease exists only on the primary; a replica that never saw it is promoted
    and every client is moved to it while the holder works, and its duplicate takes a lease on
    the promoted replica: two holders at once, and still one commit.

    The overlap is made, as the pause rows make theirs: the holder's heartbeat is frozen from
    before the failover until the holder's attempt ended, and the duplicate is delivered only
    after the failover. The holder goes on believing it holds its lease (its local validity
    has not run out) and is refused: its compare-and-swap finds the step the duplicate moved,
    or its ownership check finds another owner or none on the promoted replica. Left to
    race, the holder's
    next renewal (at most TTL/3 after the failover) could report the loss before the duplicate
    came, and a loaded machine gave trials with no overlap. The randomized run
    (``make nemesis``) fails the store over under live heartbeats."""
    lab.start_replica()
    arrival, task_id = held_pair(lab, step, "after_acquire", duplicate=False)
    with frozen_heartbeat(lab, arrival):
        fault = lab.failover()
        duplicate_holds(lab, step, arrival["owner"], task_id)
        lab.go(step, "after_acquire")
        holder_refused(lab, step, arrival)
    return fault["t"]


# -- network faults (TCP proxy on the Redis or the PostgreSQL path) -----------------------------


def latency(path, factor):
    """One-way latency of ``factor`` x TTL on the path for max(3 x latency, 2 x TTL) seconds,
    while the holder works for one TTL and its duplicate contends."""

    def inject(lab, step):
        point = "after_acquire" if path == "redis" else "before_cas"
        proxy = lab.store_proxy if path == "redis" else lab.pg_proxy
        held_pair(lab, step, point)
        delay = factor * lab.ttl
        proxy.set_latency(delay)
        fault = lab.note("fault", kind=f"{path}_latency", seconds=delay)
        lab.go(step, point, f"sleep:{lab.ttl}")
        time.sleep(max(3 * delay, 2 * lab.ttl))
        proxy.set_latency(0)
        return fault["t"]

    return inject


def blackhole(path, factor=1.5):
    def inject(lab, step):
        point = "after_acquire" if path == "redis" else "before_cas"
        proxy = lab.store_proxy if path == "redis" else lab.pg_proxy
        held_pair(lab, step, point)
        proxy.blackhole()
        fault = lab.note("fault", kind=f"{path}_blackhole", seconds=factor * lab.ttl)
        lab.go(step, point)
        time.sleep(factor * lab.ttl)
        proxy.unblackhole()
        return fault["t"]

    return inject


# -- PostgreSQL faults --------------------------------------------------------------------------


def pg_terminate(point):
    """No duplicate: the attempt whose connection died must finish the step itself (the
    library retries a COMMIT lost with its connection)."""

    def inject(lab, step):
        arrival, _ = held_pair(lab, step, point, duplicate=False)
        fault = lab.pg_terminate(arrival["backend_pid"])
        lab.go(step, point)
        return fault["t"]

    return inject


def lost_commit_reply(lab, step):
    """COMMIT reaches PostgreSQL and commits; its reply never comes back (connection cut)."""
    arrival, _ = held_pair(lab, step, "before_commit", duplicate=False)
    lab.pg_proxy.drop_next_reply(match=b"COMMIT")
    fault = lab.note("fault", kind="lost_commit_reply")
    lab.go(step, "before_commit")
    lab.wait_event("task_end", 30, pid=arrival["pid"])
    lab.pg_proxy.disarm()
    return fault["t"]


# -- deliveries and races -----------------------------------------------------------------------


def duplicate_delivery(lab, step):
    arrival, task_id = held_pair(lab, step, "after_acquire")
    fault = lab.note("fault", kind="duplicate_delivery", task_id=task_id)
    lab.wait_event("contended", 30, step=step)
    lab.go(step, "after_acquire")
    return fault["t"]


def countdown_past_visibility(lab, step):
    """A countdown longer than the broker's visibility_timeout: Redis hands the reserved
    message out again while the first worker still waits for its ETA, so it runs twice."""
    countdown = lab.visibility_timeout + 2
    lab.publish("forward", step, countdown=countdown, kwargs={"work": 0.5})
    return time.time() + countdown


def retry_then_resume(lab, step):
    """The task retries from inside its lease; an operator's resume races the retried run."""
    lab.publish("forward_retry", step)
    retry = lab.wait_event("retry", 30, step=step)
    lab.publish("forward", step)
    return retry["t"]


def resume_then_retry(lab, step):
    """The resume holds the lease when the retried attempt comes due."""
    lab.arm(step, "after_acquire")
    lab.publish("forward_retry", step, kwargs={"countdown": 0.2})
    first = lab.wait_arrival(step, "after_acquire")
    lab.arm(step, "after_acquire")
    lab.go(step, "after_acquire")  # first attempt retries and releases
    lab.wait_event("retry", 30, step=step)
    lab.publish("forward", step)
    resumed = lab.wait_arrival(step, "after_acquire")  # the resume or the retried run holds it
    lab.wait_event("contended", 30, step=step)
    lab.go(step, "after_acquire")
    return max(first["t"], resumed["t"])


def compensation(first):
    """``first`` ("forward"/"compensate") holds the lease before its CAS while the other
    contends; "both" publishes them together with no barrier."""

    def inject(lab, step):
        if first == "both":
            lab.publish("forward", step)
            lab.publish("compensate", step)
            return time.time()
        other = "compensate" if first == "forward" else "forward"
        lab.arm(step, "before_cas")
        lab.publish(first, step)
        lab.wait_arrival(step, "before_cas")
        lab.publish(other, step)
        fault = lab.wait_event("contended", 30, step=step)
        lab.go(step, "before_cas")
        return fault["t"]

    return inject


def _scenarios() -> list[Scenario]:
    s = []
    for point in POINTS:
        s.append(Scenario(f"kill-child@{point}", "SIGKILL worker child", kill_child(point)))
    s.append(Scenario("kill-main@before_cas", "SIGKILL worker main process", kill_main))
    for point in ("before_cas", "after_cas", "before_commit"):
        s.append(
            Scenario(f"pause@{point}", "SIGSTOP past TTL, SIGCONT", pause(point), overlap=True)
        )
    s.append(
        Scenario("heartbeat-frozen", "heartbeat thread frozen", heartbeat_frozen, overlap=True)
    )
    s.append(Scenario("hung-body", "hung body past steplock_max_hold", hung_body))
    s.append(Scenario("redis-restart", "Redis restart (data lost)", redis_restart))
    s.append(Scenario("redis-outage-3xttl", "Redis outage 3 x ttl", redis_outage(3)))
    s.append(
        Scenario(
            "redis-failover", "Redis failover to a stale replica", redis_failover, overlap=True
        )
    )
    for factor, label in ((0, "0"), (1 / 3, "ttl/3"), (1, "ttl"), (2, "2xttl")):
        s.append(
            Scenario(f"redis-latency-{label}", f"Redis latency {label}", latency("redis", factor))
        )
    s.append(Scenario("redis-blackhole", "Redis black hole 1.5 x ttl", blackhole("redis")))
    for factor, label in ((0, "0"), (1 / 3, "ttl/3"), (1, "ttl"), (2, "2xttl")):
        s.append(
            Scenario(f"pg-latency-{label}", f"PostgreSQL latency {label}", latency("pg", factor))
        )
    s.append(Scenario("pg-blackhole", "PostgreSQL black hole 1.5 x ttl", blackhole("pg")))
    for point in ("before_cas", "before_commit"):
        s.append(Scenario(f"pg-terminate@{point}", "pg_terminate_backend", pg_terminate(point)))
    s.append(Scenario("pg-lost-commit-reply", "lost COMMIT reply", lost_commit_reply))
    s.append(
        Scenario("duplicate-task-id", "duplicate delivery (same task id)", duplicate_delivery)
    )
    s.append(
        Scenario(
            "countdown-past-visibility",
            "countdown > visibility_timeout",
            countdown_past_visibility,
        )
    )
    s.append(Scenario("retry-then-resume", "retry racing a resume", retry_then_resume))
    s.append(Scenario("resume-then-retry", "retry racing a resume", resume_then_retry))
    for first in ("forward", "compensate", "both"):
        s.append(
            Scenario(
                f"compensation-{first}-first" if first != "both" else "compensation-simultaneous",
                "compensation racing the forward flow",
                compensation(first),
            )
        )
    s.append(
        Scenario(
            "soft-time-limit",
            "soft time limit in the critical section",
            time_limit(soft=True),
            resume=True,
        )
    )
    s.append(
        Scenario(
            "hard-time-limit",
            "hard time limit in the critical section",
            time_limit(soft=False),
            resume=True,
        )
    )
    s.append(Scenario("warm-shutdown", "warm shutdown (SIGTERM)", shutdown(signal.SIGTERM)))
    s.append(Scenario("cold-shutdown", "cold shutdown (SIGQUIT)", shutdown(signal.SIGQUIT)))
    return s


SCENARIOS = {s.name: s for s in _scenarios()}


# -- split brain: the fence decides -------------------------------------------------------------

TASKS = "django_app.faults.tasks"
FENCE_CLASS = "split brain: the fence decides"


def _by_owner(lab, step, owner, *events):
    for entry in lab.history():
        if entry.get("step") == step and entry.get("owner") == owner and entry["ev"] in events:
            return entry
    return None


def _reaper_moves_back(lab, step) -> dict:
    """The library's reaper, run on the majority side of the split (the promoted replica),
    moves the orphaned running step back to pending (its fence column left as it is); its
    move is recorded as a transition, as the fault tasks record theirs."""
    import os
    import socket

    from celery import Celery
    from django.db import transaction

    from celery_steplock.contrib.django.recovery import StepRecovery, recover_steps
    from celery_steplock.reaper import reap
    from django_app.workflows.models import TransitionRecord

    app = Celery("faults-reaper", broker=lab.control.url, set_as_current=False)
    app.conf.update(
        steplock_redis_url=f"redis://127.0.0.1:{lab.replica.port}/0",
        steplock_reaper_recover={"workflows.Step": {"running": "pending"}},
    )

    def this_step_only(run):
        # Labs side by side (scripts/soak.py) share the database: recover this trial's step
        # and leave another lab's in-flight rows (leased in that lab's store) alone.
        found = recover_steps(run)
        if found is not None:
            for group in found.candidates:
                group.rows = [row for row in group.rows if int(row[0]) == step]
            found = StepRecovery(run, found.candidates)
        return found

    with transaction.atomic():
        report = reap(app, ping_timeout=0.3, step_recovery=this_step_only)
        moved = [r for r in report.steps_recovered if int(r["pk"]) == step]
        if moved:
            TransitionRecord.objects.create(
                step_id=step,
                from_status=moved[0]["from_"],
                to_status=moved[0]["to"],
                task_name="reaper",
                hostname=socket.gethostname(),
                pid=os.getpid(),
            )
    if report.errors or not moved:
        raise AssertionError(f"the reaper did not move step {step} back: {report.as_dict()}")
    return lab.note("recovered", step=step, by="reaper", to=moved[0]["to"])


def _note_both_sides(lab, step) -> dict:
    """A history entry of who holds the step's lease on each side of the split (owner,
    fence, PTTL in ms; None where no lease is): the minority's is the old primary."""
    import redis

    from celery_steplock.keys import lease_key

    key = lease_key("steplock", f"step:{step}")
    sides = {}
    for side, port in (("minority", lab.store_proxy.target[1]), ("majority", lab.replica.port)):
        client = redis.Redis(host="127.0.0.1", port=port, decode_responses=True, socket_timeout=5)
        try:
            owner, fence = client.hmget(key, "owner", "fence")
            pttl = client.pttl(key)
        finally:
            client.close()
        sides[side] = {
            "owner": owner,
            "fence": int(fence) if fence is not None else None,
            "pttl_ms": pttl if owner is not None else None,
        }
    return lab.note("split_view", step=step, **sides)


def fence_split(point, stale="forward", back="reset"):
    """The stale holder (``stale``, pending -> done/cancelled) stops at ``point`` holding its
    lease (fence f1); the lock store splits with its worker in the minority. On the majority
    side ``start`` takes a newer lease (f2 > f1) and commits pending -> running, then ``back``
    ("reset": a task under a lease f3 > f2; "reaper": the library's reaper) moves the step
    back to pending with a fence >= f2. The stale holder goes on: its CAS finds ``pending``
    and, its own Redis still renewing its lease, only the fence can refuse it. Its retry is
    stopped at after_acquire until the split is healed; it (or the one after it) commits."""

    def inject(lab, step):
        lab.start_replica()
        arrival, _ = held_pair(lab, step, point, task=stale, duplicate=False)
        holder = lab.worker_of(arrival["pid"])
        minority = [name for name, worker in lab.workers.items() if worker is holder]
        fault = lab.split_store(minority=minority)
        lab.publish("start", step)
        lab.wait_event("committed", 30, step=step, to="running")
        if back == "reaper":
            lab.wait_event("released", 30, step=step, task=f"{TASKS}.start")
            _reaper_moves_back(lab, step)
        else:
            lab.publish("reset", step)
            lab.wait_event("committed", 30, step=step, to="pending")
        lab.arm(step, "after_acquire")  # the stale holder's retry waits for the heal
        _note_both_sides(lab, step)
        lab.go(step, point)
        outcome = lab.wait_for(
            lambda: _by_owner(lab, step, arrival["owner"], "fence_refused", "committed"),
            30,
            "the stale holder's CAS to be refused or to commit",
        )
        if outcome["ev"] == "fence_refused":
            lab.wait_arrival(step, "after_acquire")
        lab.heal_split()
        lab.go(step, "after_acquire")
        return fault["t"]

    return inject


def _fence_scenarios() -> list[Scenario]:
    return [
        Scenario(
            "fence-split@after_acquire", FENCE_CLASS, fence_split("after_acquire"), overlap=True
        ),
        Scenario("fence-split@before_cas", FENCE_CLASS, fence_split("before_cas"), overlap=True),
        Scenario(
            "fence-split-reaper@after_acquire",
            FENCE_CLASS,
            fence_split("after_acquire", back="reaper"),
            overlap=True,
        ),
        Scenario(
            "fence-split-compensate@before_cas",
            FENCE_CLASS,
            fence_split("before_cas", stale="compensate"),
            overlap=True,
        ),
    ]


#: The fence-decides family; its trials need ``Lab(worker_stores=True)`` (see the module
#: docstring). Not in :data:`SCENARIOS`: each commits three transitions, not one.
FENCE_SCENARIOS = {s.name: s for s in _fence_scenarios()}

#: Every deterministic scenario, both families (what ``scripts/soak.py`` runs).
ALL_SCENARIOS = {**SCENARIOS, **FENCE_SCENARIOS}


# -- a failover from a clock that ran ahead -----------------------------------------------------

#: The skew of :func:`clock_ahead_after_failover` (seconds): above CLOCK_SKEW_TOLERANCE (1 s),
#: so the breaker's ``opened_ms`` is clamped, and at most the lab's
#: ``steplock_retry_backoff_max`` (2 s), so the library retries the FenceAhead by itself after
#: the skew (docs/howto/deployment.md): no operator's resend.
CLOCK_SKEW_S = 1.5
#: The scenario breaker's recovery_timeout (seconds), and how much later than that after the
#: fault its first probe may come (a loaded machine's margin; below the skew, so a breaker
#: that waited out the skew fails the scenario).
CLOCK_RECOVERY_S = 0.5
CLOCK_SLACK_S = 0.75


def clock_ahead_after_failover(lab, step):
    """The old primary's clock ran ``CLOCK_SKEW_S`` ahead: its holder's row fence is ahead of
    every token the promoted replica grants (that replica never saw the grant: its counter
    is behind), and a breaker it opened has ``opened_ms`` ahead. The duplicate's commit is
    refused (FenceAhead, retried after the skew) and must commit exactly once; the breaker
    must half-open within its recovery_timeout (+ ``CLOCK_SLACK_S``) of the first admission,
    never after the skew (a ``breaker_half_open`` entry with ``seconds``; RuntimeError past
    the bound)."""
    import random

    from celery_steplock.exceptions import CircuitOpen
    from celery_steplock.keys import breaker_keys
    from celery_steplock.patterns.breaker import CircuitBreaker
    from tests.support.faults import clock
    from tests.support.faults.lab import KEY_PREFIX

    lab.start_replica()
    arrival, task_id = held_pair(lab, step, "after_acquire", duplicate=False)
    # the row the old primary's holder left (the database is no lock store: no failover)
    rows = clock.leave_clock_ahead(
        lab.store_client(),
        CLOCK_SKEW_S,
        [step],
        KEY_PREFIX,
        rng=random.Random(0),
        rows=1.0,
        skip_held=False,  # its holder is the old primary's, about to lose its lease
    )
    # As in redis_failover: the holder's heartbeat cannot report the loss, and the duplicate
    # comes only after the failover and the clock's state, so the two overlap in every trial.
    with frozen_heartbeat(lab, arrival):
        fault = lab.failover()
        store = lab.store_client()
        dep = CircuitBreaker(
            "clock-scenario",
            failure_threshold=1,
            window=1,
            recovery_timeout=CLOCK_RECOVERY_S,
            state_cache=0,
            client=store,
            prefix=KEY_PREFIX,
        )
        try:
            dep.call(lambda: 1 / 0)  # opened on the promoted primary
        except ZeroDivisionError:
            pass
        done = clock.leave_clock_ahead(store, CLOCK_SKEW_S, prefix=KEY_PREFIX)
        lab.note(
            "fault",
            kind="clock_ahead",
            skew=CLOCK_SKEW_S,
            rows=rows["rows"],
            changed={**done["changed"], "row_fence": len(rows["rows"])},
        )
        began = time.monotonic()
        # unclamped it would half-open skew + recovery (2.0 s) after the fault
        bound = CLOCK_RECOVERY_S + CLOCK_SLACK_S
        while True:
            try:
                dep.admit(owner="clock-probe").release()
                break
            except CircuitOpen:
                if time.monotonic() - began > bound:
                    raise RuntimeError(
                        f"the breaker stayed open {bound} s after the clock_ahead"
                    ) from None
                time.sleep(0.02)
        lab.note("breaker_half_open", name=dep.name, seconds=round(time.monotonic() - began, 3))
        store.delete(*breaker_keys(KEY_PREFIX, dep.name))
        duplicate_holds(lab, step, arrival["owner"], task_id)
    lab.go(step, "after_acquire", f"sleep:{lab.ttl}")
    return fault["t"]


CLOCK_SCENARIO = Scenario(
    "clock-ahead-after-failover",
    "Redis failover from a clock that ran ahead",
    clock_ahead_after_failover,
    overlap=True,
)
SCENARIOS[CLOCK_SCENARIO.name] = CLOCK_SCENARIO
ALL_SCENARIOS[CLOCK_SCENARIO.name] = CLOCK_SCENARIO
