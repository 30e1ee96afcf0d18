#!/usr/bin/env python3
"""The randomized fault run: a client sends step tasks to workers of mixed pools while a
nemesis injects random faults, several at once; then everything heals, settles, and the run's
history is checked as a whole (what `make nemesis` runs).

    make nemesis                                      # 30 minutes, a random seed (printed)
    make nemesis ARGS="--duration 1800 --seed 7"
    make nemesis ARGS="--duration 120 --seed 7 --unguarded"   # the negative control
    make nemesis ARGS="--duration 120 --kinds split_brain,pause"  # some kinds only
    make nemesis ARGS="--duration 120 --seed 7 --workload outbox"          # the effects outbox
    make nemesis ARGS="--duration 120 --seed 7 --workload outbox-in-body"  # and its control
    make nemesis ARGS="--duration 120 --seed 7 --breaker bypass"  # the breaker's control
    make nemesis ARGS="--duration 300 --seed 7 --store sentinel"  # primary+replica+3 sentinels
    make nemesis ARGS="--duration 120 --seed 7 --broker rabbitmq"  # RabbitMQ as the broker
    make nemesis ARGS="--duration 120 --seed 7 --database mysql"   # MariaDB as the step database
    make nemesis ARGS="--duration 300 --seed 7 --store cluster"   # a 3+3 Redis Cluster
    make nemesis ARGS="--duration 120 --seed 7 --loads all"  # + HTTP, writers, periodic loads
    make nemesis ARGS="--duration 120 --seed 7 --patterns bypass"  # rate/slots/idempotency control
    make nemesis ARGS="--duration 300 --seed 7 --loads all --unguarded --breaker bypass \
        --patterns bypass --http unguarded --writers plain --periodic unguarded"
                                                  # every pattern's control in one run

The run directory (default var/nemesis/<seed>-<guarded|unguarded>) holds the history and
the checker's verdict.json; to add a run and its control to docs/reliability.md/.json:

    python -m tests.support.faults.report --run var/nemesis/7-guarded \
        --negative var/nemesis/7-unguarded [--negative DIR ...]

Reproducible from its seed as far as the schedule goes (what the client sends and which fault
fires when, with which parameters), not the interleavings of the real processes. Starts its
own PostgreSQL (or uses DATABASE_URL) and every server; stops them all by PID on exit and on
Ctrl-C. Exit status 1 on violations or leftovers (guarded) or on no violation (--unguarded,
--guard nofence, --workload outbox-in-body, --breaker bypass, --patterns bypass, a load's
control).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.support import processes  # noqa: E402
from tests.support.faults import lab as faults_lab  # noqa: E402


def say(message: str) -> None:
    print(f"nemesis: {message}", flush=True)


def load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def interrupted(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv=None) -> int:
    # SIGTERM (and SIGINT, ignored in a background job) end the run like Ctrl-C: every server
    # and worker is stopped by its PID on the way out.
    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of faults")
    parser.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    parser.add_argument(
        "--unguarded", action="store_true", help="negative control: STEPLOCK_FAULTS_UNGUARDED=1"
    )
    parser.add_argument("--out", type=Path, default=None, help="the run directory")
    parser.add_argument("--ttl", type=float, default=2.0, help="lease TTL of the workers, s")
    parser.add_argument(
        "--kinds",
        default=None,
        help="comma-separated fault kinds to draw from, equally weighted (default: all, "
        "weighted as nemesis.KINDS)",
    )
    parser.add_argument(
        "--guard",
        choices=("fenced", "nofence"),
        default="fenced",
        help="nofence: the compare-and-swap without its fence condition (a negative control "
        "for the split_brain kind)",
    )
    parser.add_argument(
        "--workload",
        choices=("patterns", "outbox", "outbox-in-body"),
        default="patterns",
        help="outbox: the client also sends steps whose bodies declare effects (an HTTP call to "
        "a receiver on loopback, a publication), a relay runs in the controller and the "
        "fault kinds gain receiver_down; outbox-in-body: its negative control (the body "
        "performs them)",
    )
    parser.add_argument(
        "--patterns",
        choices=("guarded", "bypass"),
        default="guarded",
        help="bypass: the rate-limited, concurrency-limited and idempotent tasks run without "
        "their limit or key and record what such a worker would have done: the negative "
        "control of the rate, concurrency and idempotency rules",
    )
    parser.add_argument(
        "--breaker",
        choices=("guarded", "bypass"),
        default="guarded",
        help="bypass: the breaker task calls its dependency when the breaker refuses (while "
        "open without an admission, while half-open as one more probe): the negative control "
        "of the breaker invariants",
    )
    parser.add_argument(
        "--store",
        choices=("single", "sentinel", "cluster"),
        default="single",
        help="the lock store's topology: single (one redis-server behind proxies; failovers "
        "and splits retarget a proxy), sentinel (a primary, a replica and 3 sentinels, "
        "reached through a sentinel:// URL; the fault kinds gain sentinel_failover, a forced "
        "SENTINEL FAILOVER, and lose the single node's proxy and restart kinds) or cluster "
        "(a Redis Cluster of 3 primaries and 3 replicas, STEPLOCK_REDIS_CLUSTER=1; the fault "
        "kinds gain cluster_failover, a coordinated or killed-primary failover of a held "
        "lease's shard, and slot_migration, its slot moved to another primary, and lose the "
        "single node's kinds)",
    )
    parser.add_argument(
        "--broker",
        choices=("redis", "rabbitmq"),
        default="redis",
        help="the Celery broker: redis (the control Redis) or rabbitmq (a throwaway "
        "rabbitmq-server, the workers through a proxy; the fault kinds gain broker_restart and "
        "broker_channel_close; tests/support/faults/backends.py)",
    )
    parser.add_argument(
        "--database",
        choices=("postgresql", "mysql"),
        default="postgresql",
        help="the step database: postgresql or mysql (a throwaway MariaDB; the pg_* kinds keep "
        "their names: proxy faults, the COMMIT's lost reply, pg_terminate as KILL CONNECTION)",
    )
    parser.add_argument(
        "--loads",
        default=None,
        help="comma-separated extra workloads run with the faults: http (the HTTP idempotency "
        "load on a uvicorn server), writers (a writer outside Celery), periodic (the overlap "
        "guard's senders), or all (default: none)",
    )
    parser.add_argument(
        "--http",
        choices=("guarded", "shared", "unguarded"),
        default="guarded",
        help="the HTTP load's views: shared (one scope for every principal) and unguarded "
        "(no guard) are negative controls (with --loads http)",
    )
    parser.add_argument(
        "--writers",
        choices=("guarded", "plain"),
        default="guarded",
        help="plain: the writer's negative control, a plain UPDATE (with --loads writers)",
    )
    parser.add_argument(
        "--periodic",
        choices=("guarded", "unguarded"),
        default="guarded",
        help="unguarded: the periodic task without its lease (with --loads periodic)",
    )
    args = parser.parse_args(argv)
    from tests.support.faults.loads import parse as parse_loads

    try:
        load_names = parse_loads(args.loads)
    except ValueError as exc:
        parser.error(f"--loads: {exc}")
    load_modes = {"http": args.http, "writers": args.writers, "periodic": args.periodic}
    load_controls = [f"{n}-{load_modes[n]}" for n in load_names if load_modes[n] != "guarded"]
    from tests.support.faults.nemesis import kinds_of

    KINDS = kinds_of(args.workload, args.store, args.broker)  # noqa: N806 - this run's catalogue

    kinds = None
    if args.kinds:
        asked = {k.strip() for k in args.kinds.split(",") if k.strip()}
        unknown = sorted(asked - set(KINDS))
        if unknown:
            parser.error(f"--kinds: unknown kind(s) {unknown}; known: {', '.join(KINDS)}")
        kinds = {k: 1 for k in KINDS if k in asked}  # the catalogue's order: same seed, same plan
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    label = "unguarded" if args.unguarded else "nofence" if args.guard == "nofence" else "guarded"
    if args.workload != "patterns":
        label += f"-{args.workload}"
    if args.breaker != "guarded":
        label += f"-breaker-{args.breaker}"
    if args.patterns != "guarded":
        label += f"-patterns-{args.patterns}"
    if args.store != "single":
        label += f"-{args.store}"
    if args.broker != "redis":
        label += f"-{args.broker}"
    if args.database != "postgresql":
        label += f"-{args.database}"
    if load_names:
        label += "-loads" + "".join(f"-{c}" for c in load_controls)
    control = (
        args.unguarded
        or args.guard == "nofence"
        or args.workload == "outbox-in-body"
        or args.breaker == "bypass"
        or args.patterns == "bypass"
        or bool(load_controls)
    )
    out = args.out or REPO / "var" / "nemesis" / f"{seed}-{label}"
    say(f"seed {seed}, {label}, duration {args.duration:g}s, ttl {args.ttl:g}s, out {out}")

    began = time.monotonic()
    cpu_before = os.times()
    loads = []
    try:
        with (
            tempfile.TemporaryDirectory(prefix="steplock-nemesis-") as tmp,
            faults_lab.controller(say, args.database),
        ):
            from django.db import connection

            from tests.support.faults import nemesis

            def log(message):
                loads.append(load())
                say(message)

            lab = nemesis.NemesisLab(
                Path(tmp) / "lab",
                dict(connection.settings_dict),
                seed=seed,
                duration=args.duration,
                out=out,
                ttl=args.ttl,
                unguarded=args.unguarded,
                guard=args.guard,
                kinds=kinds,
                log=log,
                workload=args.workload,
                breaker=args.breaker,
                patterns=args.patterns,
                store=args.store,
                broker=args.broker,
                loads=load_names,
                load_modes=load_modes,
            )
            try:
                lab.start()
                run = lab.run()
            finally:
                lab.stop()
                # the workers' logs outlive the lab's temporary directory: what a violation's
                # task did is in them
                logs = out / "worker-logs"
                for log_file in sorted((Path(tmp) / "lab").glob("*.log")):
                    logs.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(log_file, logs / log_file.name)
            verdict = nemesis.check(out)
    except KeyboardInterrupt:
        say("interrupted: every server stopped")
        return 130
    finally:
        processes.stop_all()
    wall = time.monotonic() - began
    violations = verdict.get("violations", [])
    leftover = verdict.get("leftover", run["settle"]["leftover"])
    if isinstance(violations, int):
        n_violations = violations
    else:
        n_violations = len(violations)
        for problem in violations[:10]:
            say(f"violation: {problem}")
    n_leftover = leftover if isinstance(leftover, int) else len(leftover)
    loads = [x for x in loads if x is not None]
    summary = {
        "seed": seed,
        "unguarded": args.unguarded,
        "duration_s": args.duration,
        "wall_s": round(wall, 1),
        "steps": run["steps"],
        "executions": run["executions"],
        "faults": sum(run["faults"].values()),
        "kinds": len(run["faults"]),
        "violations": n_violations,
        "leftover": n_leftover,
        "settled": run["settle"]["settled"],
        "load_avg_1m_mean": round(sum(loads) / len(loads), 2) if loads else None,
        "controller_cpu_s": round(sum(os.times()[:4]) - sum(cpu_before[:4]), 1),
        "checker": verdict.get("checker"),
        "workload": args.workload,
        "effects": (verdict.get("counts") or {}).get("effects"),
        "breaker": args.breaker,
        "patterns": args.patterns,
        "breaker_calls": (verdict.get("counts") or {}).get("breaker_calls"),
        "store": args.store,
        "broker": args.broker,
        "database": args.database,
        "loads": list(load_names),
        "load_controls": load_controls,
        "http": (verdict.get("counts") or {}).get("http"),
        "writer_commits": (verdict.get("counts") or {}).get("writer_commits"),
        "periodic": (verdict.get("counts") or {}).get("periodic"),
        "fence_refusals": (verdict.get("counts") or {}).get("fence_refusals"),
        "out": str(out),
    }
    say("faults by kind: " + json.dumps(run["faults"]))
    if run.get("faults_skipped"):
        say("faults skipped (no target): " + json.dumps(run["faults_skipped"]))
    errors = run.get("errors") or []
    for problem in errors[:10]:
        say(f"run error: {problem}")
    # a fault that could not be healed (or a replica that could not be prepared: the later
    # failovers and splits were skipped) makes the run's figures untrustworthy
    broken = [e for e in errors if e.startswith(("heal ", "replica:", "split_brain:"))]
    summary["errors"] = len(errors)
    summary["faults_skipped"] = sum((run.get("faults_skipped") or {}).values())
    say("summary " + json.dumps(summary))
    if broken:
        say(f"{len(broken)} fault(s) not healed or a replica not prepared: the run is not valid")
        return 1
    if control:
        if not n_violations:
            say("the negative control showed no violation: the checker proved nothing")
            return 1
        from tests.support.faults.report import violations_by_rule

        # each control turned on must be caught by its own pattern's rules
        by_rule = violations_by_rule(verdict)
        say("violations by rule: " + json.dumps(by_rule))
        expected = {
            "steps": args.unguarded or args.guard == "nofence",
            "breaker": args.breaker == "bypass",
            "rate": args.patterns == "bypass",
            "concurrency": args.patterns == "bypass",
            "idempotency": args.patterns == "bypass",
            "effects": args.workload == "outbox-in-body",
        }
        missed = [rule for rule, on in expected.items() if on and not by_rule.get(rule)]
        if load_controls:  # each load's control caught by its own rules
            from tests.support.faults.loads import controls_caught

            caught = controls_caught(verdict.get("counts") or {}, load_controls)
            say("load controls caught: " + json.dumps(caught))
            missed += [name for name, ok in caught.items() if not ok]
        if missed:
            say(f"controls not caught by their own rules: {missed}")
            return 1
        return 0
    return 1 if (n_violations or n_leftover or not run["settle"]["settled"]) else 0


if __name__ == "__main__":
    sys.exit(main())
