#!/usr/bin/env python3
"""Run the celery-steplock benchmark suite and write the report.

    python benchmarks/run.py                 # everything, ~15 min on 2 cores: docs/performance.*
    python benchmarks/run.py --quick         # a small smoke run: var/bench-quick/performance.*
    python benchmarks/run.py --only e2e wait # some groups; the others keep their last figures
    python benchmarks/run.py --render-only   # re-render performance.md (commentary edited)

Each group runs in a subprocess of its own (``python -m benchmarks.<module>``) that starts and
stops its own servers. The report (``performance.md``, every figure with name, unit and value
plus the run's context in ``performance.json``, profiles in ``performance-profiles/``) is
rendered by :mod:`benchmarks.report`.
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
}


def run_group(name: str, quick: bool) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        out = Path(fh.name)
    cmd = [sys.executable, "-m", GROUPS[name], "--out", str(out)] + (["--quick"] if quick else [])
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
    print(f"== {name}: {result['wall_s']}s"
          + (f", FAILED: {result['error']}" if result.get("error") else ""), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a small smoke run (written to var/bench-quick/ unless --out-dir)")
    parser.add_argument("--only", nargs="+", choices=list(GROUPS), metavar="GROUP",
                        help=f"run only these groups ({', '.join(GROUPS)})")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where performance.md/.json go (default docs/, or "
                             "var/bench-quick/ with --quick)")
    parser.add_argument("--render-only", action="store_true",
                        help="run nothing: re-render performance.md from performance.json "
                             "(after editing benchmarks/commentary.md)")
    args = parser.parse_args(argv)
    out_dir = args.out_dir or (ROOT / "var" / "bench-quick" if args.quick else ROOT / "docs")
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "performance.json"
    if args.render_only:
        doc = json.loads(json_path.read_text())
        (out_dir / "performance.md").write_text(report.render(doc) + "\n")
        print(f"rendered {out_dir / 'performance.md'} from {json_path}")
        return 0

    previous: dict = {}
    if args.only and json_path.exists():
        try:
            previous = json.loads(json_path.read_text())
        except ValueError:
            previous = {}
    groups = {name: {**g, "figures": [f for f in previous.get("figures", [])
                                      if f.get("group") == name]}
              for name, g in (previous.get("groups") or {}).items()}
    started = time.monotonic()
    context = machine_context()
    print(f"context: {context['cpu_count']} CPUs, Python {context['python']}, "
          f"{context['redis_server']}; {context['uptime']}", flush=True)
    for name in (args.only or list(GROUPS)):
        result = run_group(name, args.quick)
        result["context"] = {"loadavg_start": result.get("loadavg_start"),
                             "loadavg_end": result.get("loadavg_end"),
                             "quick": args.quick, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
        groups[name] = result
    wall = round(time.monotonic() - started, 1)
    if args.only and previous.get("context"):
        # A partial rerun: the report keeps the context of the run it updates and lists the
        # rerun (each group also carries its own time and load average).
        rerun = {"groups": args.only, "time": context["time"], "run_wall_s": wall,
                 "git_commit": context["git_commit"], "loadavg": context["loadavg"],
                 "loadavg_end": list(os.getloadavg()), "quick": args.quick}
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
    report.write(doc, out_dir)
    print(f"wrote {out_dir / 'performance.md'} and {json_path} ({wall:.0f}s)", flush=True)
    failed = [name for name, g in groups.items() if g.get("error")]
    for target in doc["targets"]:
        print(f"  {'met   ' if target['met'] else 'MISSED' if target['met'] is False else 'n/a   '}"
              f" {target['target']}: {target['measured']}", flush=True)
    if failed:
        print(f"groups with errors: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
