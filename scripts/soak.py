#!/usr/bin/env python3
"""Soak the fault scenarios: N trials of each against real workers, Redis and PostgreSQL, then
the same scenarios as a negative control (compare-and-swap disabled), and write the figures to
docs/reliability.md and docs/reliability.json (what `make soak` runs).

    make soak                                   # 200 trials per scenario (under 2 h, 2 cores)
    make soak ARGS="--labs 1 --ttl 2 --visibility-timeout 10 --max-hold 15"
                                                # one lab, the timing of tests/faults
    make soak ARGS="--trials 20 --negative 5"   # a shorter soak
    make soak ARGS="--only pause@before_commit redis-failover"
                                                # rerun some rows (same settings: they
                                                # replace those rows, marked as reruns)

Starts its own PostgreSQL (or uses DATABASE_URL) and its own Redis servers; stops them all.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.support.faults import lab as faults_lab  # noqa: E402

DOCS = REPO / "docs"

# Measured on 2 shared cores at TTL 1 s: lab-seconds per trial stayed flat up to 8 labs; 6 keeps
# a margin for a busier machine.
DEFAULT_LABS = 6
DEFAULT_TTL = 1.0
# kill-main, countdown-past-visibility and resume-then-retry wait for a redelivery after the
# broker's visibility_timeout; hung-body waits max_hold + 2 TTLs. max_hold stays above the
# visibility_timeout by MAX_HOLD_TTLS TTLs: an attempt held at a barrier while a redelivered
# copy comes to contend must keep its lease until then.
DEFAULT_VISIBILITY_TIMEOUT = 6
MAX_HOLD_TTLS = 3.0
# A worker main process SIGKILLed while it held the broker's restore mutex (kill-main) holds
# up every redelivery until the mutex expires: 30 s in tests/faults, 2 s here.
UNACKED_MUTEX_EXPIRE = 2


def say(message: str) -> None:
    print(f"soak: {message}", flush=True)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def new_row(fault: str) -> dict:
    return {
        "fault": fault,
        "trials": 0,
        "overlaps": 0,
        "commits": 0,
        "violations": 0,
        "violating_trials": 0,
        "leftover_leases": 0,
        "keys_without_ttl": 0,
        "stale_rejected": 0,
        "resumes": 0,
        "errors": 0,
        "recovery_s": [],
        "examples": [],
        "seconds": 0.0,
    }


def add_trial(row: dict, result: dict) -> None:
    """Fold one trial's result (see :func:`run_trial`) into its scenario's row."""
    row["seconds"] += result["seconds"]
    if "error" in result:
        row["errors"] += 1
        if len(row["examples"]) < 3:
            row["examples"].append(result["error"])
        return
    row["trials"] += 1
    for key in (
        "overlaps",
        "commits",
        "leftover_leases",
        "keys_without_ttl",
        "stale_rejected",
        "resumes",
    ):
        row[key] += result[key]
    row["violations"] += len(result["violations"])
    row["violating_trials"] += bool(result["violations"])
    if result["recovery_s"] is not None:
        row["recovery_s"].append(round(result["recovery_s"], 3))
    for problem in result["violations"]:
        if len(row["examples"]) < 3:
            row["examples"].append(problem)


def finish_row(row: dict) -> dict:
    recovery = row.pop("recovery_s")
    row["recovery_p50_s"] = percentile(recovery, 0.5)
    row["recovery_max_s"] = max(recovery) if recovery else None
    # lab-seconds spent on this scenario (summed over the labs), and per trial
    row["seconds"] = round(row["seconds"], 1)
    done = row["trials"] + row["errors"]
    row["trial_s"] = round(row["seconds"] / done, 2) if done else None
    return row


def run_trial(lab, name: str) -> dict:
    """One trial of scenario ``name`` on ``lab``, as a plain dict (it crosses processes)."""
    from tests.support.faults import scenarios

    started = time.monotonic()
    try:
        outcome = scenarios.run(lab, scenarios.ALL_SCENARIOS[name])
    except Exception as exc:  # noqa: BLE001 - a trial that could not finish is counted
        lab.recover()
        return {
            "seconds": time.monotonic() - started,
            "error": f"error: {type(exc).__name__}: {str(exc)[:300]}",
        }
    verdict = outcome.verdict
    return {
        "seconds": time.monotonic() - started,
        "overlaps": verdict.overlaps,
        "commits": verdict.commits,
        "violations": list(verdict.violations),
        "leftover_leases": verdict.leftover_leases,
        "keys_without_ttl": verdict.keys_without_ttl,
        "stale_rejected": verdict.stale_rejected,
        "resumes": verdict.resumes,
        "recovery_s": verdict.recovery_s,
    }


def lab_main(index: int, workdir: str, options: dict, items, results) -> None:
    """One lab in its own process: its own control and store Redis, proxies and workers, on
    the shared PostgreSQL database (every trial makes its own step rows). Takes (scenario,
    trial) items from ``items`` until ``None``; puts ("ready"|"begin"|"trial"|"failed"|"done",
    index, ...) tuples on ``results``."""
    import traceback

    try:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "django_app.settings")
        os.environ.pop("STEPLOCK_FAULTS", None)  # this process is a controller
        import django

        django.setup()
        from django.db import connection

        from tests.support.faults.lab import Lab

        lab = Lab(
            Path(workdir),
            dict(connection.settings_dict),
            log=lambda message: say(f"lab {index}: {message}"),
            **options,
        )
        with lab:
            lab.ensure_workers()
            results.put(("ready", index, lab.r.info("server")["redis_version"]))
            while (item := items.get()) is not None:
                results.put(("begin", index, item))
                results.put(("trial", index, item, run_trial(lab, item[0])))
            connection.close()
    except BaseException:  # noqa: BLE001 - reported to the parent, which counts the loss
        results.put(("failed", index, traceback.format_exc()[-2000:]))
    results.put(("done", index))


def duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"


def soak(
    names: list[str],
    trials: int,
    label: str,
    labs: int,
    workdir: Path,
    options: dict,
    later_trials: int = 0,
    progress_every: float = 60.0,
) -> tuple[dict[str, dict], dict]:
    """``trials`` trials of each scenario in ``names`` on ``labs`` labs side by side (one
    process each), from one shared queue ordered round by round, so a slow scenario spreads
    over the labs. Returns (rows by scenario, facts about the run). ``later_trials``: trials
    of a phase still to come, for the estimate of the time left."""
    import multiprocessing as mp
    import queue as queue_module

    from tests.support.faults import scenarios

    context = mp.get_context("spawn")
    negative = options.get("unguarded", False)  # violations are its point: print only errors
    items, results = context.Queue(), context.Queue()
    work = [(name, trial) for trial in range(trials) for name in names]
    for item in work:
        items.put(item)
    labs = max(1, min(labs, len(work))) if work else 0
    for _ in range(labs):
        items.put(None)
    rows = {name: new_row(scenarios.ALL_SCENARIOS[name].fault) for name in names}
    remaining = {name: trials for name in names}
    procs = {}
    for index in range(labs):
        proc = context.Process(
            target=lab_main,
            args=(index, str(workdir / f"lab{index}"), options, items, results),
            name=f"soak-lab-{index}",
        )
        proc.start()
        procs[index] = proc
    started = time.monotonic()
    last_progress = started
    busy: dict[int, tuple] = {}
    done_labs: set[int] = set()
    facts = {"redis": None, "lab_failures": []}
    finished = reported = 0
    bad = 0

    def settle_item(item, result):
        nonlocal finished, bad
        name = item[0]
        add_trial(rows[name], result)
        finished += 1
        bad += bool(result.get("error") or result.get("violations"))
        remaining[name] -= 1
        if remaining[name] == 0:
            row = rows[name]
            say(
                f"{label} {name}: trials={row['trials']} commits={row['commits']} "
                f"violations={row['violations']} (in {row['violating_trials']} trials) "
                f"overlaps={row['overlaps']} leftover_leases={row['leftover_leases']} "
                f"errors={row['errors']} lab_s={row['seconds']:.1f}"
            )
            for example in row["examples"]:
                if not negative or example.startswith("error:"):
                    say(f"{label} {name}: {example}")

    while len(done_labs) < labs:
        try:
            message = results.get(timeout=5)
        except queue_module.Empty:
            message = None
        if message is not None:
            kind, index = message[0], message[1]
            if kind == "ready":
                facts["redis"] = message[2]
            elif kind == "begin":
                busy[index] = message[2]
            elif kind == "trial":
                busy.pop(index, None)
                settle_item(message[2], message[3])
            elif kind == "failed":
                facts["lab_failures"].append(message[2])
                say(f"{label}: lab {index} failed:\n{message[2]}")
            elif kind == "done":
                done_labs.add(index)
        for index, proc in procs.items():  # a lab process that died without a word
            if index not in done_labs and not proc.is_alive() and results.empty():
                done_labs.add(index)
                facts["lab_failures"].append(f"lab {index} exited with {proc.exitcode}")
        for index in list(busy):
            if index in done_labs:  # its trial never reported: an error of that scenario
                settle_item(busy.pop(index), {"seconds": 0.0, "error": "error: lab died"})
        now = time.monotonic()
        final = finished == len(work) and reported != finished
        if finished and (now - last_progress >= progress_every or final):
            last_progress, reported = now, finished
            rate = (now - started) / finished
            left = len(work) - finished
            say(
                f"{label}: {finished}/{len(work)} trials on {labs} labs, {bad} with a "
                f"violation or error, {rate:.2f} s per trial; about "
                f"{duration(left * rate)} left"
                + (f" (+{duration(later_trials * rate)} after)" if later_trials else "")
            )
    for proc in procs.values():
        proc.join(30)
    unrun = []
    while True:  # items no lab took (every lab failed): errors, so the run is not green
        try:
            item = items.get_nowait()
        except queue_module.Empty:
            break
        if item is not None:
            unrun.append(item)
    for item in unrun:
        settle_item(item, {"seconds": 0.0, "error": "error: no lab ran this trial"})
    facts["seconds"] = time.monotonic() - started
    facts["trial_s"] = round(facts["seconds"] / len(work), 3) if work else None
    return {name: finish_row(row) for name, row in rows.items()}, facts


def write_report(result: dict, partial: bool = False) -> None:
    """The deterministic part of docs/reliability.md/.json (the randomized runs are kept);
    ``partial`` (a soak of ``--only`` scenarios) replaces only those rows."""
    from tests.support.faults import report

    report.update(deterministic=result, partial=partial)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200, help="trials per scenario")
    parser.add_argument(
        "--negative",
        type=int,
        default=None,
        help="trials per scenario for the negative control (default: a tenth "
        "of --trials, at least 1; 0 skips it)",
    )
    parser.add_argument("--only", nargs="*", default=None, help="scenario names")
    parser.add_argument(
        "--ttl", type=float, default=DEFAULT_TTL, help="lease TTL of the workers, s"
    )
    parser.add_argument(
        "--labs",
        type=int,
        default=DEFAULT_LABS,
        help="labs side by side (each its own Redis servers, proxies and two workers)",
    )
    parser.add_argument(
        "--max-hold",
        type=float,
        default=None,
        help="steplock_max_hold of the workers, s (default --visibility-timeout + "
        f"{MAX_HOLD_TTLS:g} x --ttl)",
    )
    parser.add_argument(
        "--visibility-timeout",
        type=int,
        default=DEFAULT_VISIBILITY_TIMEOUT,
        help="the broker's visibility_timeout, whole seconds",
    )
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument(
        "--json", type=Path, default=None, help="also write the result (JSON) to this file"
    )
    args = parser.parse_args(argv)
    if args.max_hold is None:
        args.max_hold = args.visibility_timeout + MAX_HOLD_TTLS * args.ttl
    negative_trials = max(1, args.trials // 10) if args.negative is None else args.negative
    if args.only is not None and not args.no_write:
        # checked before the soak, not after it: rows of another timing cannot join the table
        from tests.support.faults import report

        planned = {
            "trials": args.trials,
            "negative_trials": negative_trials,
            "ttl": args.ttl,
            "visibility_timeout": args.visibility_timeout,
            "max_hold": args.max_hold,
        }
        try:
            report.check_rerun(report.load()["deterministic"], planned)
        except ValueError as exc:
            parser.error(f"--only: {exc} (or pass --no-write)")

    started_wall = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="steplock-soak-") as tmp:
        with faults_lab.controller(say):
            from django.db import connection

            from tests.support.faults import scenarios

            names = args.only or list(scenarios.ALL_SCENARIOS)
            unknown = [n for n in names if n not in scenarios.ALL_SCENARIOS]
            if unknown:
                parser.error(
                    f"unknown scenario(s) {unknown}; known: {', '.join(scenarios.ALL_SCENARIOS)}"
                )
            options = {
                "ttl": args.ttl,
                "max_hold": args.max_hold,
                "visibility_timeout": args.visibility_timeout,
                "unacked_mutex_expire": UNACKED_MUTEX_EXPIRE,
            }
            # The fence-decides family runs on labs with a lock-store path per worker (the
            # split), and its negative control is the guard without the fence, not no CAS.
            plain = [n for n in names if n not in scenarios.FENCE_SCENARIOS]
            fenced = [n for n in names if n in scenarios.FENCE_SCENARIOS]
            phases = [
                (plain, "guarded", options, False),
                (fenced, "guarded (split brain)", {**options, "worker_stores": True}, False),
                (plain, "negative control", {**options, "unguarded": True}, True),
                (
                    fenced,
                    "negative control (no fence)",
                    {**options, "worker_stores": True, "guard": "nofence"},
                    True,
                ),
            ]
            phases = [p for p in phases if p[0] and (negative_trials or not p[3])]
            connection.close()  # the labs open their own
            guarded, negative = {}, {}
            facts = {"redis": None, "lab_failures": [], "seconds": 0.0, "trials": 0}
            negative_facts = {"lab_failures": []}
            for index, (phase_names, label, phase_options, is_negative) in enumerate(phases):
                later = sum(
                    len(p[0]) * (negative_trials if p[3] else args.trials)
                    for p in phases[index + 1 :]
                )
                rows, phase_facts = soak(
                    phase_names,
                    negative_trials if is_negative else args.trials,
                    label,
                    args.labs,
                    Path(tmp) / f"phase{index}",
                    phase_options,
                    later_trials=later,
                )
                (negative if is_negative else guarded).update(rows)
                if is_negative:
                    negative_facts["lab_failures"] += phase_facts["lab_failures"]
                else:
                    facts["redis"] = facts["redis"] or phase_facts["redis"]
                    facts["lab_failures"] += phase_facts["lab_failures"]
                    facts["seconds"] += phase_facts.get("seconds") or 0.0
                    facts["trials"] += len(phase_names) * args.trials
            facts["trial_s"] = (
                round(facts["seconds"] / facts["trials"], 3) if facts["trials"] else None
            )
            guarded = {n: guarded[n] for n in names if n in guarded}
            negative = {n: negative[n] for n in names if n in negative}
            redis_version = facts["redis"]
            with connection.cursor() as cursor:
                cursor.execute("SHOW server_version")
                pg_version = cursor.fetchone()[0]
    commit = (
        subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        or "unknown"
    )
    result = {
        "started": started_wall,
        "commit": commit,
        "seconds": time.monotonic() - started,
        "trials": args.trials,
        "negative_trials": negative_trials,
        "ttl": args.ttl,
        "visibility_timeout": args.visibility_timeout,
        "max_hold": args.max_hold,
        "labs": args.labs,
        "trial_s": facts["trial_s"],
        "redis": redis_version,
        "postgres": pg_version,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "scenarios": guarded,
        "negative_control": negative,
    }
    bad = sum(r["violations"] + r["leftover_leases"] + r["errors"] for r in guarded.values())
    bad += len(facts["lab_failures"]) + len(negative_facts["lab_failures"])
    caught = sum(r["violating_trials"] for r in negative.values())
    # Each control must bite on its own: the unguarded one (no CAS) on the plain scenarios,
    # the guard without the fence on the fence-decides family.
    for family, label in ((plain, "no CAS"), (fenced, "no fence")):
        rows = [negative[n] for n in family if n in negative]
        if rows and not sum(r["violating_trials"] for r in rows):
            say(f"the negative control ({label}) showed no violation: the checker proved nothing")
            bad += 1
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if not args.no_write:
        write_report(result, partial=args.only is not None)
        say(f"wrote {DOCS / 'reliability.md'} and reliability.json")
    say(
        f"{sum(r['trials'] for r in guarded.values())} trials, "
        f"{sum(r['violations'] for r in guarded.values())} violations, "
        f"{sum(r['leftover_leases'] for r in guarded.values())} leftover leases, "
        f"{sum(r['errors'] for r in guarded.values())} errors; negative control: violations "
        f"in {caught} of {sum(r['trials'] for r in negative.values())} trials"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
