"""A writer outside Celery for the randomized fault run: an "operator" process that changes
step statuses while the step tasks run on the same steps.

The claim under test (docs/howto/external-writers.md): a writer that goes through
``guarded_step`` / ``guarded_transition`` (the step's lease, the fenced compare-and-swap, the
ownership check before COMMIT) takes part in the tasks' guard, so the mixed run keeps every
step rule of the checker (``checker.check_step``, ``checker.stale_commits``: one terminal
transition, a legal chain, fences never decreasing, no commit after a newer grant).

The writer (:func:`writer_loop`, run as its own process by :func:`start_writer` or
``python -m tests.support.faults.writers writer``) watches the run's history for the steps
the client publishes (``publish`` entries of :data:`WATCHED` tasks), and every
``mean_gap`` seconds (exponential) picks one of the newest ``window`` of them, reads its
status and:

- ``pending``: cancels it (``pending -> cancelled``, under ``compensate``'s lease name
  ``step:<id>`` and transition table), the operator's cancel;
- ``running``: resumes it (``running -> pending``, under ``reset``'s), as a recovery moves a
  stage back;
- a terminal status: nothing.

Every other change goes through the async API instead (``aguarded_step`` on one event loop
of the writer's, :func:`aguarded_change`): async holders of the same leases beside the
tasks' sync ones.

Each committed change writes a ``TransitionRecord`` in the guarded transaction (``task_name``
:data:`ACTOR`, the lease's owner and fence) and, on commit, a ``committed`` history entry
with ``by: "writer"``: the same records and entries as a task's (``django_app/faults/tasks.py``),
so the checker judges writer and tasks together. The library's signals reach the history
through the probe's receivers (``acquired``, ``applied``, ``released``, ``contended``,
``conflict``, ``lost``), as the process runs with the workers' environment
(``STEPLOCK_FAULTS=1``). A refused change writes ``writer_refused`` (``reason``: the
exception's type).

``mode="plain"`` is the negative control: the admin form of the how-to. It reads the status,
waits ``form_gap`` seconds (the form is open) and writes the target with
``Step.objects.filter(pk=...).update(status=...)``: no lease, no fence (its record's owner is
``plain-<uuid>``, fence None). A task that committed ``pending -> done`` meanwhile is
overwritten: two terminal transitions on one step, which the checker reports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

ACTOR = "faults-writer"
MODES = ("guarded", "plain")
#: The client's tasks whose steps the writer may change (the pattern and outbox steps keep
#: their own checks: a cancel there would only starve them).
WATCHED = frozenset({"forward", "compensate", "start", "reset", "forward_retry"})
HISTORY = "faults:history"


class StepFeed:
    """The steps of a run as the client publishes them: read incrementally from the control
    Redis's history list (``publish`` entries of a :data:`WATCHED` task), plus ``fixed``
    steps given up front. ``newest(n)`` is the last ``n`` seen, oldest first."""

    def __init__(self, client, fixed=(), watched=WATCHED):
        self.client = client
        self.offset = 0
        self.watched = frozenset(watched)
        self.steps: list[int] = []
        self.seen: set[int] = set()
        for step in fixed:
            self._add(int(step))

    def _add(self, step: int) -> None:
        if step not in self.seen:
            self.seen.add(step)
            self.steps.append(step)

    def poll(self) -> None:
        if self.client is None:
            return
        raw = self.client.lrange(HISTORY, self.offset, -1)
        self.offset += len(raw)
        for line in raw:
            if '"publish"' not in line:
                continue
            entry = json.loads(line)
            if entry.get("ev") == "publish" and entry.get("task") in self.watched:
                if entry.get("step") is not None:
                    self._add(int(entry["step"]))

    def newest(self, n: int) -> list[int]:
        return self.steps[-n:]


def _record_transition(step_id, from_, to, owner, fence, op_id) -> None:
    from django_app.workflows.models import TransitionRecord

    TransitionRecord.objects.create(
        step_id=step_id,
        from_status=from_,
        to_status=to,
        task_name=ACTOR,
        task_id=op_id,
        owner=owner,
        fence=fence,
        hostname=socket.gethostname(),
        pid=os.getpid(),
    )


def _committing(step_id, from_, to, owner, fence, op_id, **extra) -> None:
    """In the guarded transaction: the ``TransitionRecord``, the ``cas`` entry (``extra``:
    e.g. ``api="async"``) and the ``committed`` entry on commit."""
    from django_app.faults import probe

    _record_transition(step_id, from_, to, owner, fence, op_id)
    probe.record(
        "cas", step=step_id, owner=owner, fence=fence, task_id=op_id, to=to, by="writer", **extra
    )
    _record_on_commit(step_id, from_, to, owner, fence, op_id)


def _refused(step_id, op_id, to, exc, **extra) -> dict:
    """The ``writer_refused`` entry of a change nothing was written for; its return value."""
    from django_app.faults import probe

    reason = type(exc).__name__
    probe.record("writer_refused", step=step_id, task_id=op_id, to=to, reason=reason, **extra)
    return {"applied": False, "reason": reason}


def guarded_change(step_id: int, from_: str, to: str, wait: float = 1.0) -> dict:
    """Move ``step_id`` ``from_ -> to`` through ``guarded_step`` under the lease of the fault
    tasks (``compensate`` for ``-> cancelled``, ``reset`` for ``running -> pending``), with its
    ``TransitionRecord`` in the same transaction and a ``committed`` entry on commit. Returns
    ``{"applied": True, "owner", "fence"}`` or ``{"applied": False, "reason": <exception
    type>}`` (``LockContended``, ``TransitionConflict``, ``LockLost``, ``LockStoreUnavailable``
    or a database error: nothing written)."""
    from django.db import DatabaseError

    from celery_steplock.contrib.django.steps import guarded_step
    from celery_steplock.exceptions import LockError, TransitionError
    from django_app.faults import tasks
    from django_app.workflows.models import Step

    task = tasks.reset if from_ == "running" else tasks.compensate
    op_id = f"writer-{uuid.uuid4()}"
    try:
        with guarded_step(Step, step_id, task=task, wait=wait, actor=ACTOR) as step:
            step.transition(from_, to)
            owner, fence = step.lease.owner, step.lease.fence
            _committing(step_id, from_, to, owner, fence, op_id)
    except (LockError, TransitionError, DatabaseError) as exc:
        return _refused(step_id, op_id, to, exc)
    return {"applied": True, "owner": owner, "fence": fence}


async def aguarded_change(step_id: int, from_: str, to: str, wait: float = 1.0) -> dict:
    """:func:`guarded_change` through the async API (``aguarded_step``: the lease, its
    renewal and the ownership check on the event loop, the database in the block's thread),
    an async holder beside the tasks' sync ones. The record and the history entries are
    written in the block's transaction by a thread-sensitive hop; same return value."""
    from asgiref.sync import sync_to_async
    from django.db import DatabaseError

    from celery_steplock.contrib.django.steps import aguarded_step
    from celery_steplock.exceptions import LockError, TransitionError
    from django_app.faults import tasks
    from django_app.workflows.models import Step

    task = tasks.reset if from_ == "running" else tasks.compensate
    op_id = f"writer-{uuid.uuid4()}"
    try:
        async with aguarded_step(Step, step_id, task=task, wait=wait, actor=ACTOR) as step:
            await step.atransition(from_, to)
            owner, fence = step.lease.owner, step.lease.fence
            await sync_to_async(_committing, thread_sensitive=True)(
                step_id, from_, to, owner, fence, op_id, api="async"
            )
    except (LockError, TransitionError, DatabaseError) as exc:
        return _refused(step_id, op_id, to, exc, api="async")
    return {"applied": True, "owner": owner, "fence": fence}


def _record_on_commit(step_id, from_, to, owner, fence, op_id) -> None:
    """The writer's ``committed`` history entry, written once its transaction commits."""
    from django.db import transaction

    from django_app.faults import probe

    transaction.on_commit(
        lambda: probe.record(
            "committed",
            step=step_id,
            owner=owner,
            fence=fence,
            task_id=op_id,
            to=to,
            from_=from_,
            by="writer",
        )
    )


def plain_change(step_id: int, from_: str, to: str, form_gap: float = 0.2) -> dict:
    """The negative control: ``from_`` was read and the form stays open until the row
    changes under it (a task committed meanwhile: the lost update a plain writer makes) or
    ``form_gap`` seconds pass, then a plain ``UPDATE`` writes ``to`` whatever the row holds
    now, with its ``TransitionRecord`` (owner ``plain-<uuid>``, fence None) in the same
    transaction. Waiting for the change makes the collision the rule, not a race."""
    from django.db import DatabaseError, transaction

    from django_app.workflows.models import Step

    owner = f"plain-{uuid.uuid4()}"
    deadline = time.monotonic() + form_gap
    while time.monotonic() < deadline:
        try:
            now = Step.objects.filter(pk=step_id).values_list("status", flat=True).first()
        except DatabaseError:
            break
        if now != from_:
            break
        time.sleep(0.05)
    try:
        with transaction.atomic():
            Step.objects.filter(pk=step_id).update(status=to)
            _record_transition(step_id, from_, to, owner, None, owner)
            _record_on_commit(step_id, from_, to, owner, None, owner)
    except DatabaseError as exc:
        return {"applied": False, "reason": type(exc).__name__}
    return {"applied": True, "owner": owner, "fence": None}


def writer_loop(
    seconds: float,
    mode: str = "guarded",
    seed: int = 0,
    steps=(),
    control=None,
    window: int = 3,
    mean_gap: float = 0.25,
    cancel_share: float = 0.5,
    form_gap: tuple[float, float] = (2.0, 3.0),
    stop=None,
) -> dict:
    """Change steps for ``seconds`` (see the module docstring) and return the counts:
    ``{"mode", "tries", "committed", "cancelled", "resumed", "refused": {reason: n},
    "steps_seen", "async_tries", "async_committed"}`` (guarded: every other change goes
    through the async API, :func:`aguarded_change`). ``control`` is the control Redis client
    (``decode_responses=True``) whose history feeds the steps (None: only ``steps``); ``stop`` an optional
    ``threading.Event`` ending it early. A pending step is cancelled with probability
    ``cancel_share`` (else left to its tasks), a running one always resumed."""
    from django.db import DatabaseError, connection

    from django_app.faults import probe
    from django_app.workflows.models import Step

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    rng = random.Random(seed)
    feed = StepFeed(control, steps)
    counts: Counter = Counter()
    refused: Counter = Counter()
    deadline = time.monotonic() + seconds
    loop = None
    probe.record("writer_start", mode=mode, seconds=seconds, by="writer")
    while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
        time.sleep(min(rng.expovariate(1.0 / mean_gap), 2.0))
        try:
            feed.poll()
        except Exception:  # noqa: BLE001 - the control Redis is never faulted; go on anyway
            pass
        candidates = feed.newest(window)
        if not candidates:
            continue
        step_id = rng.choice(candidates)
        try:
            status = Step.objects.filter(pk=step_id).values_list("status", flat=True).first()
        except DatabaseError:
            connection.close()
            refused["DatabaseError"] += 1
            continue
        if status == "pending" and rng.random() < cancel_share:
            from_, to = "pending", "cancelled"
        elif status == "running" and mode == "guarded":
            from_, to = "running", "pending"
        else:
            continue
        counts["tries"] += 1
        if mode == "guarded" and counts["tries"] % 2 == 0:
            # every other change through the async API, on one event loop for the run
            loop = loop or asyncio.new_event_loop()
            outcome = loop.run_until_complete(aguarded_change(step_id, from_, to))
            counts["async_tries"] += 1
            counts["async_committed"] += bool(outcome["applied"])
        elif mode == "guarded":
            outcome = guarded_change(step_id, from_, to)
        else:
            outcome = plain_change(step_id, from_, to, rng.uniform(*form_gap))
        if outcome["applied"]:
            counts["committed"] += 1
            counts["cancelled" if to == "cancelled" else "resumed"] += 1
        else:
            refused[outcome["reason"]] += 1
            if outcome["reason"] in ("OperationalError", "InterfaceError", "DatabaseError"):
                connection.close()
    result = {
        "mode": mode,
        "tries": counts["tries"],
        "committed": counts["committed"],
        "cancelled": counts["cancelled"],
        "resumed": counts["resumed"],
        "refused": dict(sorted(refused.items())),
        "steps_seen": len(feed.steps),
        "async_tries": counts["async_tries"],
        "async_committed": counts["async_committed"],
    }
    if loop is not None:
        loop.close()
    probe.record("writer_done", by="writer", **result)
    connection.close()
    return result


def start_writer(
    lab, seconds: float, mode: str = "guarded", seed: int = 0, logfile: Path | None = None
) -> subprocess.Popen:
    """Start :func:`writer_loop` as a process of its own with the workers' environment
    (``lab.worker_env()``: the same lock store, database path and history); the caller waits
    for it (``proc.wait()``) and stops it by its pid. Its output goes to ``logfile``, its
    counts to the history's ``writer_done`` entry (:func:`writer_result`)."""
    from tests.support.faults.lab import ROOT

    env = {**os.environ, **lab.worker_env(), "PYTHONUNBUFFERED": "1"}
    log = open(logfile or os.devnull, "ab")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.faults.writers",
            "writer",
            "--seconds",
            str(seconds),
            "--mode",
            mode,
            "--seed",
            str(seed),
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def writer_counts(history: list[dict]) -> dict:
    """Commits by the writer and by the tasks, from a run's history: ``{"writer": n,
    "tasks": n}`` (``committed`` entries; a task's lost COMMIT reply has none)."""
    commits = Counter(
        "writer" if e.get("by") == "writer" else "tasks"
        for e in history
        if e.get("ev") == "committed"
    )
    return {"writer": commits["writer"], "tasks": commits["tasks"]}


def writer_result(history: list[dict]) -> dict:
    """The counts of the writer's last ``writer_done`` entry (see :func:`writer_loop`), or
    {} when it wrote none (it was killed, or is still running)."""
    done = [e for e in history if e.get("ev") == "writer_done"]
    if not done:
        return {}
    keep = (
        "mode",
        "tries",
        "committed",
        "cancelled",
        "resumed",
        "refused",
        "steps_seen",
        "async_tries",
        "async_committed",
    )
    return {k: done[-1].get(k) for k in keep}


def writer_commits(history: list[dict], records) -> int:
    """The committed records (``checker.Record``) that are the writer's: the owner of a
    ``committed`` entry ``by: "writer"``, or a plain write's ``plain-`` owner (its entry may
    be missing when the COMMIT reply was lost)."""
    owners = {
        e.get("owner") for e in history if e.get("ev") == "committed" and e.get("by") == "writer"
    }
    return sum(1 for r in records if r.owner in owners or str(r.owner).startswith("plain-"))


def _main_writer(args) -> int:
    import django
    import redis

    django.setup()
    control = redis.Redis.from_url(
        os.environ.get("STEPLOCK_FAULTS_URL") or os.environ["REDIS_URL"], decode_responses=True
    )
    steps = [int(s) for s in args.steps.split(",") if s] if args.steps else []
    result = writer_loop(args.seconds, args.mode, args.seed, steps, control)
    print(json.dumps(result), flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("writer", help="run the writer (the workers' environment)")
    w.add_argument("--seconds", type=float, default=60.0)
    w.add_argument("--mode", choices=MODES, default="guarded")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--steps", default="", help="comma-separated step ids besides the feed")
    live = sub.add_parser("live", help="a standalone live run (tests/support/faults/mixed.py)")
    live.add_argument("--seconds", type=float, default=60.0)
    live.add_argument("--mode", choices=MODES, default="guarded")
    live.add_argument("--seed", type=int, default=0)
    live.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.command == "writer":
        return _main_writer(args)
    from tests.support.faults import mixed

    return mixed.live_writers(Path(args.out), args.seconds, args.mode, args.seed)


if __name__ == "__main__":
    sys.exit(main())
