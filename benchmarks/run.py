#!/usr/bin/env python3
"""Run the celery-steplock benchmark suite and write the report.

    python benchmarks/run.py                 # everything, ~15 min on 2 cores: docs/performance.*
    python benchmarks/run.py --quick         # a small smoke run: var/bench-quick/performance.*
    python benchmarks/run.py --only e2e wait # some groups; the others keep their last figures
    python benchmarks/run.py --render-only   # re-render performance.md, re-judge the targets
    python benchmarks/run.py --only e2e --e2e-tasks 500 --e2e-reps 5   # a shorter e2e run

Each group runs in a subprocess of its own (``python -m benchmarks.<module>``) that starts and
stops its own servers. The report (``performance.md``, every figure with name, unit and value
plus the run's context in ``performance.json``, profiles in ``performance-profiles/``) is
rendered by :mod:`benchmarks.report`. The figures of the groups that ran are kept from the
JSON this run replaces under ``previous`` (values, time and commit), so the report shows the
previous figure beside the new one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import report  # noqa: E402
from benchmarks.common import machine_context  # noqa: E402

#: group name -> module, in running order.
GROUPS = {
    "lock": "benchmarks.lock_primitive",
    "e2e": "benchmarks.e2e",
    "heartbeat": "benchmarks.heartbeat",
    "wait": "benchmarks.blocking_wait",
    "operators": "benchmarks.operators",
    "idempotency": "benchmarks.idempotency",
    "breaker": "benchmarks.breaker",
    "bulkhead": "benchmarks.bulkhead",
    "ratelimit": "benchmarks.ratelimit",
    "wire": "benchmarks.wire",
}


def run_group(name: str, quick: bool, extra: list[str] | None = None) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        out = Path(fh.name)
    cmd = [sys.executable, "-m", GROUPS[name], "--out", str(out)] + (["--quick"] if quick else [])
    cmd += extra or []
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT)
    try:
        result = json.loads(out.read_text())
    except (OSError, ValueError):
        result = {"group": name, "figures": [], "notes": []}
    finally:
        out.unlink(missing_ok=True)
    if proc.returncode and not result.get("error"):
        result["error"] = f"exit status {proc.returncode}"
    result["wall_s"] = round(time.monotonic() - started, 1)
    print(
        f"== {name}: {result['wall_s']}s"
        + (f", FAILED: {result['error']}" if result.get("error") else ""),
        flush=True,
    )
    return result


def previous_values(previous: dict, groups: list[str]) -> dict:
    """The figures of ``groups`` in the JSON about to be replaced: ``{"time", "git_commit",
    "values": {name: value}}`` (the targets' measured values under ``target:<id>``)."""
    ctx = previous.get("context") or {}
    times = [
        ((previous.get("groups") or {}).get(g) or {}).get("context", {}).get("time")
        for g in groups
    ]
    values = {
        f["name"]: f.get("value")
        for f in previous.get("figures", [])
        if f.get("group") in groups and not isinstance(f.get("value"), (list, dict))
    }
    for target in previous.get("targets", []):
        if target.get("id", "").split(".", 1)[0] in groups:
            values[f"target:{target['id']}"] = target.get("measured")
    commit = ctx.get("git_commit")
    for rerun in ctx.get("reruns") or []:
        if set(rerun.get("groups") or []) & set(groups):
            commit = rerun.get("git_commit") or commit
    return {
        "time": next((t for t in times if t), ctx.get("time")),
        "git_commit": commit,
        "groups": groups,
        "values": values,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small smoke run (written to var/bench-quick/ unless --out-dir)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=list(GROUPS),
        metavar="GROUP",
        help=f"run only these groups ({', '.join(GROUPS)})",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="where performance.md/.json go (default docs/, or var/bench-quick/ with --quick)",
    )
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="run nothing: re-render performance.md from performance.json "
        "(after editing benchmarks/commentary.md)",
    )
    parser.add_argument(
        "--e2e-tasks",
        type=int,
        default=None,
        metavar="N",
        help="e2e: tasks per batch (default 2000, 200 with --quick)",
    )
    parser.add_argument(
        "--e2e-reps",
        type=int,
        default=None,
        metavar="N",
        help="e2e: interleaved repetitions of each kind (default 5)",
    )
    args = parser.parse_args(argv)
    out_dir = args.out_dir or (ROOT / "var" / "bench-quick" if args.quick else ROOT / "docs")
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "performance.json"
    if args.render_only:
        doc = json.loads(json_path.read_text())
        doc["targets"] = report.evaluate(
            report.Figures(
                {
                    g: {"figures": [f for f in doc["figures"] if f["group"] == g]}
                    for g in doc["groups"]
                }
            )
        )  # targets added since the run are judged too
        json_path.write_text(json.dumps(doc, indent=1) + "\n")
        (out_dir / "performance.md").write_text(report.render(doc) + "\n")
        print(f"rendered {out_dir / 'performance.md'} from {json_path}")
        return 0

    previous: dict = {}
    if json_path.exists():
        try:
            previous = json.loads(json_path.read_text())
        except ValueError:
            previous = {}
    groups = (
        {
            name: {
                **g,
                "figures": [f for f in previous.get("figures", []) if f.get("group") == name],
            }
            for name, g in (previous.get("groups") or {}).items()
        }
        if args.only
        else {}
    )
    ran = args.only or list(GROUPS)
    earlier = previous_values(previous, ran)
    started = time.monotonic()
    context = machine_context()
    print(
        f"context: {context['cpu_count']} CPUs, Python {context['python']}, "
        f"{context['redis_server']}; {context['uptime']}",
        flush=True,
    )
    extra = {
        "e2e": ([f"--tasks={args.e2e_tasks}"] if args.e2e_tasks else [])
        + ([f"--reps={args.e2e_reps}"] if args.e2e_reps else [])
    }
    for name in ran:
        result = run_group(name, args.quick, extra.get(name))
        result["context"] = {
            "loadavg_start": result.get("loadavg_start"),
            "loadavg_end": result.get("loadavg_end"),
            "quick": args.quick,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        groups[name] = result
    wall = round(time.monotonic() - started, 1)
    if args.only and previous.get("context"):
        # A partial rerun: the report keeps the context of the run it updates and lists the
        # rerun (each group also carries its own time and load average).
        rerun = {
            "groups": args.only,
            "time": context["time"],
            "run_wall_s": wall,
            "git_commit": context["git_commit"],
            "loadavg": context["loadavg"],
            "loadavg_end": list(os.getloadavg()),
            "quick": args.quick,
        }
        context = previous["context"]
        context.setdefault("reruns", []).append(rerun)
    else:
        context["run_wall_s"] = wall
        context["quick"] = args.quick
        context["groups_run"] = args.only or list(GROUPS)
        context["loadavg_end"] = list(os.getloadavg())
    if not args.only:  # a full run replaces every profile of the last one
        for stale in (out_dir / "performance-profiles").glob("*.txt"):
            stale.unlink()
    doc = report.build(groups, context)
    # The groups that did not run keep the "previous" figures they had.
    kept = {
        k: v
        for k, v in (previous.get("previous") or {}).get("values", {}).items()
        if k.removeprefix("target:").split(".", 1)[0] not in ran
    }
    if earlier["values"] or kept:
        doc["previous"] = {**earlier, "values": {**kept, **earlier["values"]}}
    report.write(doc, out_dir)
    print(f"wrote {out_dir / 'performance.md'} and {json_path} ({wall:.0f}s)", flush=True)
    failed = [name for name, g in groups.items() if g.get("error")]
    for target in doc["targets"]:
        print(
            f"  {'met   ' if target['met'] else 'MISSED' if target['met'] is False else 'n/a   '}"
            f" {target['target']}: {target['measured']}",
            flush=True,
        )
    if failed:
        print(f"groups with errors: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
