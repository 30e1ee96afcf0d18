#!/usr/bin/env python3
"""Run the celery-steplock benchmark suite and write the report.

    python benchmarks/run.py                 # everything, ~15 min on 2 cores: docs/performance.*
    python benchmarks/run.py --quick         # a small smoke run: var/bench-quick/performance.*
    python benchmarks/run.py --only e2e wait # some groups; the others keep their last figures
    python benchmarks/run.py --render-only   # re-render performance.md, re-judge the targets
    python benchmarks/run.py --only ratelimit breaker idempotency   # the pattern groups
    python benchmarks/run.py --only e2e --e2e-tasks 500 --e2e-reps 5   # a shorter e2e run

Each group runs in a subprocess of its own (``python -m benchmarks.<module>``) that starts and
stops its own servers. The report (``performance.md``, every figure with name, unit and value
plus the run's context in ``performance.json``, profiles in ``performance-profiles/``) is
rendered by :mod:`benchmarks.report`. The figures of the groups that ran are kept from the
JSON this run replaces under ``previous`` (values, time and commit), so the report shows the
previous figure beside the new one.

The pattern groups (``ratelimit``, ``breaker``, ``idempotency``) also write their tables to
``docs/patterns/<group>.json``; their figures in ``performance.json`` are taken from those rows
(:func:`benchmarks.report.pattern_group`). A pattern file written since ``performance.json``
took it in (its sha256 differs; e.g. ``python -m benchmarks.ratelimit`` run alone) is taken in
by any run or ``--render-only``, its group's last figures moving to ``previous``.
"""

from __future__ import annotations

import argparse
import hashlib
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
    "aio": "benchmarks.aio",
    "outbox": "benchmarks.outbox",
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


def read_pattern(path: Path) -> tuple[dict | None, dict | None]:
    """A pattern group's ``docs/patterns/<group>.json`` and its source record (``{"path",
    "sha256"}``); ``(None, None)`` when it is missing or not JSON."""
    try:
        data = path.read_bytes()
        doc = json.loads(data)
    except (OSError, ValueError):
        return None, None
    try:
        shown = str(path.resolve().relative_to(ROOT))
    except ValueError:
        shown = str(path)
    return doc, {"path": shown, "sha256": hashlib.sha256(data).hexdigest()}


def file_state(path: Path) -> tuple[int, int, int, str] | None:
    """What identifies the content of ``path`` now: ``(inode, mtime in ns, size, sha256)``,
    or None when it cannot be read. Compared before and after a run, it tells whether the
    run wrote the file; a timestamp alone cannot, the file system's clock being coarser than
    ``time.time()`` (a file written just after a start can carry an earlier time)."""
    try:
        stat = path.stat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
    return (stat.st_ino, stat.st_mtime_ns, stat.st_size, digest)


def pattern_files(name: str, dirs: list[Path]) -> dict[Path, tuple[int, int, int, str] | None]:
    """The :func:`file_state` of ``<name>.json`` in each of ``dirs``."""
    return {folder / f"{name}.json": file_state(folder / f"{name}.json") for folder in dirs}


def adopt_pattern_run(
    name: str, result: dict, before: dict[Path, tuple[int, int, int, str] | None], dirs: list[Path]
) -> dict:
    """The entry of a pattern group that just ran: its result's figures merged with the rows
    of the ``<name>.json`` it wrote (in one of ``dirs``: a file whose state differs from
    ``before``, the :func:`pattern_files` taken before the run); the result's alone when it
    wrote none (``--quick`` for some groups, a failure), the file left in ``dirs[0]`` then
    marked as seen (``seen_sha256``) so that the next report does not take its older figures
    in."""
    for folder in dirs:
        path = folder / f"{name}.json"
        now = file_state(path)
        if now is None:
            continue
        fresh = now != before.get(path)
        if fresh:
            doc, source = read_pattern(path)
            if doc is not None:
                return report.pattern_group(name, doc, result, source)
    entry = report.pattern_group(name, None, result, None)
    _, stale = read_pattern(dirs[0] / f"{name}.json")
    if stale is not None:
        entry["seen_sha256"] = stale["sha256"]
    return entry


def sync_patterns(groups: dict, patterns_dir: Path, skip: list[str]) -> list[tuple[str, dict]]:
    """Take in the pattern files of ``patterns_dir`` whose content ``groups`` (the report's
    groups, figures included) does not hold yet (sha256), but for the groups in ``skip``;
    replaces their entries in ``groups``. Returns ``[(group, source)]`` taken in."""
    adopted = []
    for name in report.PATTERN_GROUPS:
        if name in skip:
            continue
        doc, source = read_pattern(patterns_dir / f"{name}.json")
        if doc is None or source is None:
            continue
        held = groups.get(name) or {}
        if source["sha256"] in ((held.get("source") or {}).get("sha256"), held.get("seen_sha256")):
            continue
        groups[name] = report.pattern_group(name, doc, None, source)
        adopted.append((name, source))
    return adopted


def import_reruns(groups: dict, adopted: list[tuple[str, dict]]) -> list[dict]:
    """The ``reruns`` entries (one per group) of pattern files taken in without running
    their groups."""
    out = []
    for name, source in adopted:
        ctx = groups[name].get("context") or {}
        out.append(
            {
                "groups": [name],
                "time": ctx.get("time"),
                "git_commit": ctx.get("git_commit"),
                "loadavg": ctx.get("loadavg_start") or [],
                "imported": [source["path"]],
            }
        )
    return out


def merge_previous(doc: dict, previous: dict, replaced: list[str]) -> None:
    """Set ``doc["previous"]``: the figures ``previous`` (the JSON being replaced) had for the
    groups in ``replaced``, and the ``previous`` values it kept for the other groups."""
    held = previous.get("previous") or {}
    if not replaced:
        if held:
            doc["previous"] = held
        return
    earlier = previous_values(previous, replaced)
    kept = {
        k: v
        for k, v in (held.get("values") or {}).items()
        if k.removeprefix("target:").split(".", 1)[0] not in replaced
    }
    if not (earlier["values"] or kept):
        return
    by_group = dict(held.get("by_group") or {})
    for g in replaced:
        one = previous_values(previous, [g])
        if one["values"]:
            by_group[g] = {"time": one["time"], "git_commit": one["git_commit"]}
    top = earlier
    if held and "e2e" not in replaced:
        # The time and commit of the top "previous" are the ones the end-to-end section
        # shows for its previous figures: kept unless e2e ran again (each group's own are
        # under "by_group").
        top = {**earlier, "time": held.get("time"), "git_commit": held.get("git_commit")}
    doc["previous"] = {
        **top,
        "groups": sorted(set(held.get("groups") or []) | set(replaced)),
        "values": {**kept, **earlier["values"]},
        "by_group": by_group,
    }


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
    own = [(((previous.get("groups") or {}).get(g) or {}).get("context") or {}) for g in groups]
    commit = next((c["git_commit"] for c in own if c.get("git_commit")), commit)
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
    parser.add_argument(
        "--patterns-dir",
        type=Path,
        default=None,
        help="where the pattern groups' <group>.json are read (default docs/patterns, or "
        "var/bench-quick/ with --quick)",
    )
    args = parser.parse_args(argv)
    out_dir = args.out_dir or (ROOT / "var" / "bench-quick" if args.quick else ROOT / "docs")
    out_dir.mkdir(parents=True, exist_ok=True)
    patterns_dir = args.patterns_dir or (
        ROOT / "var" / "bench-quick" if args.quick else ROOT / "docs" / "patterns"
    )
    json_path = out_dir / "performance.json"
    if args.render_only:
        held = json.loads(json_path.read_text())
        groups = {
            name: {**g, "figures": [f for f in held["figures"] if f.get("group") == name]}
            for name, g in (held.get("groups") or {}).items()
        }
        adopted = sync_patterns(groups, patterns_dir, skip=[])
        context = held.get("context") or {}
        if adopted:
            context.setdefault("reruns", []).extend(import_reruns(groups, adopted))
        # Rebuilt from the figures: targets added since the run are judged too.
        doc = report.build(groups, context)
        merge_previous(doc, held, [name for name, _ in adopted])
        report.write(doc, out_dir)
        for name, source in adopted:
            print(f"took in {source['path']} ({name})")
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
    pattern_dirs = list(
        dict.fromkeys([patterns_dir, ROOT / "docs" / "patterns", ROOT / "var" / "bench-quick"])
    )
    for name in ran:
        before = pattern_files(name, pattern_dirs) if name in report.PATTERN_GROUPS else {}
        result = run_group(name, args.quick, extra.get(name))
        result["context"] = {
            "loadavg_start": result.get("loadavg_start"),
            "loadavg_end": result.get("loadavg_end"),
            "quick": args.quick,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        if name in report.PATTERN_GROUPS:
            result = adopt_pattern_run(name, result, before, pattern_dirs)
        groups[name] = result
    # Pattern files written since the last report by a group run alone are taken in too.
    adopted = sync_patterns(groups, patterns_dir, skip=ran) if args.only else []
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
        if adopted:
            context["reruns"].extend(import_reruns(groups, adopted))
    else:
        context["run_wall_s"] = wall
        context["quick"] = args.quick
        context["groups_run"] = args.only or list(GROUPS)
        context["loadavg_end"] = list(os.getloadavg())
    if not args.only:  # a full run replaces every profile of the last one
        for stale in (out_dir / "performance-profiles").glob("*.txt"):
            stale.unlink()
    doc = report.build(groups, context)
    # The groups that ran (or were taken in) get the figures they replaced as "previous"; the
    # others keep the "previous" figures they had.
    merge_previous(doc, previous, [*ran, *(name for name, _ in adopted)])
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
