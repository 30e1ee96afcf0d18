"""Standalone live runs of the writers and periodic workloads, without the nemesis's faults: real
``celery worker`` processes (a :class:`~tests.support.faults.lab.Lab`: two prefork workers,
concurrency 1), a real Redis (control and lock store) and PostgreSQL (started by
:func:`~tests.support.faults.lab.controller` unless ``DATABASE_URL`` names one).

- :func:`live_writers`: a client creates a step every ~0.3 s and sends it step tasks
  (``forward``; ``forward`` racing ``compensate``; a stage ``start`` / ``reset`` racing
  ``forward``) while the writer of :mod:`~tests.support.faults.writers` (its own process)
  changes the same steps; then the steps settle and ``runcheck.check_run`` judges the run.
- :func:`live_periodic`: two senders send the periodic task every second
  (:mod:`~tests.support.faults.periodic_load`), then
  :func:`~tests.support.faults.overlap_rules.check_periodic` judges the runs.

Each writes ``summary.json`` (and the run directory ``run/`` of the writers' run) under
``out`` and returns 0 when the verdict is what the mode expects (guarded: no violation;
the negative control: at least one), else 1. ``python -m tests.support.faults.writers live``
and ``python -m tests.support.faults.mixed periodic`` run them.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

from tests.support.faults import lab as faults_lab


def _say(message: str) -> None:
    print(f"mixed: {message}", flush=True)


def _fresh(lab) -> None:
    for key in lab.r.scan_iter(match="faults:*", count=1000):
        lab.r.delete(key)
    lab.store_client().flushdb()


def _settle(lab, steps: list[int], timeout: float = 180.0) -> bool:
    """Wait until every step is terminal and the broker idle; a step left idle is resumed
    (``reset`` for a running one, ``forward`` for a pending one), as an operator would."""
    deadline = time.monotonic() + timeout
    idle_since = None
    while time.monotonic() < deadline:
        if lab.quiet(steps):
            grace = time.monotonic() + lab.ttl + 1.0
            while lab.leases() and time.monotonic() < grace:
                time.sleep(0.05)
            return True
        if lab.broker_idle() and not lab.leases():
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since > 1.0:
                for step, status in lab.statuses(steps).items():
                    if status == "running":
                        lab.note("resume", step=step, phase="settle", task="reset")
                        lab.publish("reset", step)
                    elif status not in faults_lab.TERMINAL:
                        lab.note("resume", step=step, phase="settle", task="forward")
                        lab.publish("forward", step)
                idle_since = None
        else:
            idle_since = None
        time.sleep(0.1)
    return False


def _client(lab, rng: random.Random, seconds: float, steps: list[int]) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        step = lab.new_step("mixed")
        steps.append(step)
        work = {"work": round(rng.uniform(0.0, 0.3), 3)}
        kind = rng.choices(("forward", "race", "stage"), (3, 2, 2))[0]
        if kind == "forward":
            lab.publish("forward", step, kwargs=work)
        elif kind == "race":
            lab.publish("forward", step, kwargs=work)
            time.sleep(rng.uniform(0.0, 0.2))
            lab.publish("compensate", step, kwargs=work)
        else:
            lab.publish("start", step, kwargs=work)
            time.sleep(rng.uniform(0.0, 0.2))
            lab.publish("forward", step, kwargs={"work": round(rng.uniform(0.3, 1.0), 3)})
        time.sleep(rng.expovariate(1.0 / 0.3))


def writers_trial(lab, seconds: float, mode: str = "guarded", seed: int = 0, out=None) -> dict:
    """On a started ``lab`` (its workers up): the client and the writer for ``seconds``, the
    settle, then ``runcheck.check_run``. Returns the summary (``violations`` the messages);
    with ``out`` the run directory goes to ``out/run``."""
    from django_app.workflows.models import TransitionRecord
    from tests.support.faults import checker, runcheck, writers

    lab.ensure_workers()
    _fresh(lab)
    steps: list[int] = []
    started = time.monotonic()
    log = Path(out) / "writer.log" if out is not None else None
    proc = writers.start_writer(lab, seconds, mode, seed, logfile=log)
    try:
        _client(lab, random.Random(seed), seconds, steps)
        proc.wait(timeout=seconds + 120)
    finally:
        if proc.poll() is None:
            proc.kill()  # the writer this trial started, by its pid
    settled = _settle(lab, steps)
    history = [json.loads(x) for x in lab.r.lrange("faults:history", 0, -1)]
    records = [
        checker.Record.of(r)
        for r in TransitionRecord.objects.filter(step_id__in=steps).order_by("id")
    ]
    store = lab.store_client()
    run = runcheck.Run(
        history=history,
        steps=lab.statuses(steps),
        records=records,
        store={
            "keys_without_ttl": checker.keys_without_ttl(store, faults_lab.KEY_PREFIX),
            "leftover": checker.lease_keys(store, faults_lab.KEY_PREFIX),
        },
        meta={"ttl": lab.ttl, "workload": f"writers-{mode}", "seed": seed},
    )
    if out is not None:
        runcheck.dump(run, Path(out) / "run")
    verdict = runcheck.check_run(run)
    by_writer = writers.writer_commits(history, records)
    statuses = list(run.steps.values())
    return {
        "mode": mode,
        "seconds": round(time.monotonic() - started, 1),
        "settled": settled,
        "steps": len(steps),
        "statuses": {s: statuses.count(s) for s in sorted(set(statuses))},
        "commits": len(records),
        "commits_by_writer": by_writer,
        "commits_by_tasks": len(records) - by_writer,
        "writer": writers.writer_result(history),
        "violations": list(verdict.violations),
        "leftovers": list(verdict.leftovers),
    }


def periodic_trial(lab, seconds: float, guarded: bool = True, out=None) -> dict:
    """On a started ``lab``: two senders for ``seconds``, the queue dropped once they stop,
    the runs in progress waited for, then ``overlap_rules.check_periodic``. Returns the
    summary (its counts; ``violations`` the messages); with ``out`` the history goes to
    ``out/history.jsonl``."""
    from tests.support.faults import overlap_rules, periodic_load

    lab.ensure_workers()
    _fresh(lab)
    stop = threading.Event()
    errors: list[str] = []
    threads = periodic_load.start_senders(
        lab.publisher, lab.note, seconds, stop, guarded=guarded, errors=errors
    )
    for thread in threads:
        thread.join(seconds + 30)
    # the senders stopped: drop what is still queued, let the runs in progress end
    purged = lab.r.llen("celery")
    lab.r.delete("celery")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        entries = [json.loads(x) for x in lab.r.lrange("faults:history", 0, -1)]
        running = sum(e["ev"] == "periodic_start" for e in entries) - sum(
            e["ev"] == "periodic_end" for e in entries
        )
        if running <= 0 and lab.broker_idle():
            break
        lab.r.delete("celery")
        time.sleep(0.5)
    history = [json.loads(x) for x in lab.r.lrange("faults:history", 0, -1)]
    if out is not None:
        (Path(out) / "history.jsonl").write_text("".join(json.dumps(e) + "\n" for e in history))
    verdict = overlap_rules.check_periodic(history)
    return {
        "guarded": guarded,
        "seconds": seconds,
        "purged_after": purged,
        **verdict.counts,
        "violations": list(verdict.violations),
        "data_loss": list(verdict.data_loss),
        "errors": errors[:5],
    }


def _live(out: Path, trial, **kw) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with faults_lab.controller(_say):
        from django.db import connection

        lab = faults_lab.Lab(out / "lab", dict(connection.settings_dict), ttl=2.0, log=_say)
        with lab:
            summary = trial(lab, out=out, **kw)
        connection.close()
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({**summary, "violations": summary["violations"][:5]}, indent=1))
    return summary


def live_writers(out: Path, seconds: float = 60.0, mode: str = "guarded", seed: int = 0) -> int:
    """The writers' live run (see the module docstring); returns the exit status."""
    summary = _live(out, writers_trial, seconds=seconds, mode=mode, seed=seed)
    return 0 if bool(summary["violations"]) == (mode == "plain") else 1


def live_periodic(out: Path, seconds: float = 60.0, guarded: bool = True) -> int:
    """The periodic live run (see the module docstring); returns the exit status."""
    summary = _live(out, periodic_trial, seconds=seconds, guarded=guarded)
    return 0 if bool(summary["violations"]) != guarded else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=("writers", "periodic"))
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--negative", action="store_true", help="the negative control")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.workload == "writers":
        mode = "plain" if args.negative else "guarded"
        return live_writers(Path(args.out), args.seconds, mode, args.seed)
    return live_periodic(Path(args.out), args.seconds, guarded=not args.negative)


if __name__ == "__main__":
    sys.exit(main())
