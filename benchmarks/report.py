"""Render the groups' figures: ``performance.json``, ``performance.md`` and the profiles.

The targets of issue 5 are evaluated here from the figures of the same run (ratios were taken
within each repetition by the groups). The commentary at the end of ``performance.md`` is
``benchmarks/commentary.md``, written by hand for the run it names; everything else is
generated.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


class Figures:
    def __init__(self, groups: dict[str, dict], previous: dict | None = None):
        #: The figures of the run this one replaced, by name (``performance.json``'s
        #: ``previous``), and when / which commit that was.
        self.prev: dict[str, Any] = dict((previous or {}).get("values") or {})
        self.prev_info = {k: v for k, v in (previous or {}).items() if k != "values"}
        self.by_name: dict[str, dict] = {}
        for group, result in groups.items():
            for fig in result.get("figures", []):
                self.by_name[fig["name"]] = {**fig, "group": group}

    def fig(self, name: str) -> dict | None:
        return self.by_name.get(name)

    def v(self, name: str) -> Any:
        fig = self.by_name.get(name)
        return None if fig is None else fig.get("value")

    def all(self) -> list[dict]:
        return list(self.by_name.values())


def fmt(value: Any, digits: int = 0, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        if digits == 0:
            return f"{value:,.0f}{suffix}"
        return f"{value:,.{digits}f}{suffix}"
    return f"{value}{suffix}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i == 0 else "--:" for i in range(len(header))) + "|",
    ]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


# -- targets ---------------------------------------------------------------------------------


def _target(
    tid: str, text: str, measured: Any, met: bool | None, by: str, figure: str | None = None
) -> dict[str, Any]:
    return {
        "id": tid,
        "target": text,
        "measured": measured,
        "met": met,
        "by": by,
        "figure": figure,
    }


def evaluate(F: Figures) -> list[dict[str, Any]]:
    t: list[dict[str, Any]] = []

    def ratio_target(tid, text, name, limit, lower_is_better=True):
        r = F.v(name)
        if r is None:
            t.append(_target(tid, text, None, None, "not measured", name))
            return
        met = r <= limit if lower_is_better else r >= limit
        rel = (r / limit - 1) * 100
        by = (
            f"{abs(rel):.1f}% {'under' if rel <= 0 else 'over'} the limit"
            if lower_is_better
            else f"{abs(rel):.1f}% {'over' if rel >= 0 else 'under'} the floor"
        )
        t.append(_target(tid, text, f"{r:.3f}x", met, by, name))

    ratio_target(
        "lock.floor",
        "Lock cycle p50 ≤ 1.10 × raw SET NX PX + EVALSHA",
        "lock.uncontended.ratio.ours_vs_raw",
        1.10,
    )
    ratio_target(
        "lock.redis_py",
        "Lock cycle p50 faster than redis-py Lock",
        "lock.uncontended.ratio.ours_vs_redis_py",
        1.0,
    )
    ratio_target(
        "lock.prl",
        "Lock cycle p50 faster than python-redis-lock",
        "lock.uncontended.ratio.ours_vs_prl",
        1.0,
    )
    ratio_target(
        "lock.ping2",
        "Lock cycle p50 ≤ 1.2 × two PINGs (the floor of two round trips)",
        "lock.uncontended.ratio.ours_vs_ping2",
        1.2,
    )
    ratio_target(
        "lock.ping2_meta",
        "Lock cycle with holder metadata (as StepLockedTask) p50 ≤ 1.2 × two PINGs",
        "lock.uncontended.ratio.ours_meta_vs_ping2",
        1.2,
    )
    ours_top = F.v("lock.uncontended.ours.server_us_top")
    raw_top = F.v("lock.uncontended.raw.server_us_top")
    if ours_top and raw_top:
        r = ours_top / raw_top
        per_core = F.v("lock.uncontended.ours.cycles_per_core_s")
        task_us = F.v("lock.uncontended.ours_task.server_us_top")
        t.append(
            _target(
                "lock.server",
                "Redis server time per lock cycle ≤ 2 × the raw SET NX PX "
                "+ EVALSHA pair (INFO commandstats, commands sent)",
                f"{r:.2f}x",
                r <= 2.0,
                f"{ours_top:.1f} vs {raw_top:.1f} µs; "
                f"{fmt(per_core)} cycles per Redis core-second; a default task's 3 "
                f"scripts {fmt(task_us, 1)} µs",
                "lock.uncontended.ours.server_us_top",
            )
        )
    overlaps = [
        f
        for f in F.all()
        if f["name"].startswith(("lock.contended.", "wait.")) and f["name"].endswith(".overlaps")
    ]
    if overlaps:
        total = sum(f["value"] or 0 for f in overlaps)
        t.append(
            _target(
                "lock.mutex",
                "Mutual exclusion under contention (8/64 processes, 1/32 waiters): 0 overlaps",
                total,
                total == 0,
                f"{total} overlaps in {len(overlaps)} runs",
            )
        )
    for db in ("sqlite", "postgresql"):
        name = f"e2e.{db}.ratio.steplock_vs_handwritten"
        if F.fig(name) is None:
            continue
        ratio_target(
            f"e2e.{db}.ratio",
            f"{db}: StepLockedTask ≥ 0.95 × minimal hand-written "
            f"lease + CAS (b) throughput (ratio of medians)",
            name,
            0.95,
            lower_is_better=False,
        )
        cpu = f"e2e.{db}.cpu_ratio.steplock_vs_handwritten_full"
        if F.fig(cpu) is not None:
            ratio_target(
                f"e2e.{db}.cpu",
                f"{db}: CPU per execution ≤ 1.15 × the hand-written "
                f"task doing the same work (c) (the abstraction tax)",
                cpu,
                1.15,
            )
        rt = F.v(f"e2e.{db}.steplock.redis_round_trips")
        t.append(
            _target(
                f"e2e.{db}.redis",
                f"{db}: ≤ 3 Redis round trips per StepLockedTask",
                rt,
                rt is not None and rt <= 3.0,
                f"{rt} (MONITOR: acquire, ownership check, release)",
                f"e2e.{db}.steplock.redis_round_trips",
            )
        )
        base = F.fig(f"e2e.{db}.handwritten.sql")
        for kind, text, allowed in (
            (
                "steplock",
                "default (lock_precheck=True): at most 1 SQL statement beyond "
                "(b)'s UPDATE (the precheck)",
                1,
            ),
            (
                "steplock_noprecheck",
                "lock_precheck=False: no SQL statement beyond (b)'s UPDATE",
                0,
            ),
        ):
            fig = F.fig(f"e2e.{db}.{kind}.sql")
            if fig is None or base is None:
                continue
            extra = fig["value"] - base["value"]
            detail = dict(fig.get("detail") or {})
            txn = (F.fig(f"e2e.{db}.{kind}.sql_txn") or {}).get("detail") or {}
            by = (
                ", ".join(f"{k} {v}" for k, v in sorted(detail.items()))
                + f" against (b)'s {', '.join(f'{k} {v}' for k, v in sorted((base.get('detail') or {}).items()))}"
                + (
                    f"; transaction control apart: {', '.join(f'{k} {v}' for k, v in txn.items() if v)}"
                    if txn
                    else ""
                )
            )
            t.append(
                _target(
                    f"e2e.{db}.sql.{kind}",
                    f"{db}: {text}",
                    f"{fig['value']} statements (+{extra})",
                    extra <= allowed,
                    by,
                    f"e2e.{db}.{kind}.sql",
                )
            )
    hb = sorted(
        {int(f["name"].split(".")[2]) for f in F.all() if f["name"].startswith("heartbeat.ours.")}
    )
    if hb:
        rts = {f"{n:,}": F.v(f"heartbeat.ours.{n}.round_trips_per_interval") for n in hb}
        for f in F.all():
            if f["name"].startswith("heartbeat.ours_spread.") and f["name"].endswith(
                ".round_trips_per_interval"
            ):
                rts[f"{f['leases']:,} taken over {f.get('acquired_over_s')} s"] = f["value"]
        worst = max(v for v in rts.values() if v is not None)
        t.append(
            _target(
                "heartbeat.rt",
                "Heartbeat: 1 pipelined round trip per interval whatever the number of leases",
                f"max {worst:.2f}",
                worst <= 1.05,
                ", ".join(f"{n}: {v}" for n, v in rts.items()),
                "heartbeat.ours.*.round_trips_per_interval",
            )
        )
        big = hb[-1]
        cyc = F.v(f"heartbeat.ours.{big}.cycle_p50")
        if big >= 10000 and cyc is not None:
            t.append(
                _target(
                    "heartbeat.cycle",
                    "Heartbeat: 10,000 leases renewed in < 50 ms per cycle",
                    f"{cyc:.1f} ms",
                    cyc < 50.0,
                    f"{(cyc / 50.0 - 1) * 100:+.0f}% vs 50 ms",
                    f"heartbeat.ours.{big}.cycle_p50",
                )
            )
        threads = {n: F.v(f"heartbeat.ours.{n}.threads") for n in hb}
        t.append(
            _target(
                "heartbeat.threads",
                "Heartbeat: no thread per lease",
                f"max {max(threads.values())} threads",
                max(threads.values()) <= 2,
                "one heartbeat thread + the main thread at every scale"
                if max(threads.values()) <= 2
                else str(threads),
            )
        )
    for waiters in (1, 32):
        p50 = F.v(f"wait.ours.{waiters}.p50")
        if p50 is not None:
            t.append(
                _target(
                    f"wait.{waiters}",
                    f"Blocking wait: waiter holds the lease "
                    f"≤ 5 ms p50 after the release ({waiters} waiter"
                    f"{'s' if waiters > 1 else ''})",
                    f"{p50:.2f} ms",
                    p50 <= 5.0,
                    f"{(p50 / 5.0 - 1) * 100:+.0f}% vs 5 ms; 100 ms polling peer: "
                    f"{fmt(F.v(f'wait.redis_py.{waiters}.p50'), 1)} ms",
                    f"wait.ours.{waiters}.p50",
                )
            )
    ops = sorted(
        {
            int(f["name"].split(".")[1])
            for f in F.all()
            if f["name"].startswith("operators.") and f["name"].split(".")[1].isdigit()
        }
    )
    if ops:
        big = ops[-1]
        for key, text, limit, unit in (
            ("admin_first", "admin first page", 1000.0, "ms"),
            ("ls_wall", "`celery steplock ls --limit 100`", 1000.0, "ms"),
            ("reap", "reaper", 10.0, "s"),
        ):
            val = F.v(f"operators.{big}.{key}")
            if val is None:
                continue
            t.append(
                _target(
                    f"operators.{key}",
                    f"{big:,} leases: {text} < {limit:g} {unit}",
                    f"{val:,.1f} {unit}" if unit == "s" else f"{val:,.0f} {unit}",
                    val < limit,
                    f"{(val / limit - 1) * 100:+.0f}% vs {limit:g} {unit}",
                    f"operators.{big}.{key}",
                )
            )
        small = ops[0]
        for key, text in (
            ("admin_peak_rss", "admin"),
            ("ls_peak_rss", "ls"),
            ("reap_peak_rss", "reaper"),
        ):
            a, b = F.v(f"operators.{small}.{key}"), F.v(f"operators.{big}.{key}")
            if a is None or b is None:
                continue
            growth = b - a
            t.append(
                _target(
                    f"operators.memory.{key}",
                    f"Memory flat: {text} peak RSS with {big:,} leases vs {small:,}",
                    f"+{growth:.1f} MiB",
                    growth <= 10.0,
                    f"{a:.0f} → {b:.0f} MiB (limit +10 MiB)",
                    f"operators.{big}.{key}",
                )
            )
    return t


# -- markdown ----------------------------------------------------------------------------------


def md_targets(targets: list[dict], F: Figures | None = None) -> list[str]:
    prev = F.prev if F is not None else {}
    rows = []
    for tg in targets:
        status = {True: "**met**", False: "**MISSED**", None: "n/a"}[tg["met"]]
        before = prev.get(f"target:{tg['id']}")
        rows.append(
            [
                tg["target"],
                str(tg["measured"]),
                status,
                tg["by"],
                "–" if before is None else str(before),
            ]
        )
    return table(["target", "measured", "", "margin / detail", "previous"], rows)


def md_lock(F: Figures, result: dict) -> list[str]:
    from .lock_primitive import CONTENDED, UNCONTENDED

    out = [
        "## 1. Lock primitive",
        "",
        "### Uncontended: one thread, one connection, acquire + release",
        "",
    ]
    rows = []
    for v, label in UNCONTENDED.items():
        if F.fig(f"lock.uncontended.{v}.p50") is None:
            continue
        raw = F.v("lock.uncontended.raw.p50")
        p50 = F.v(f"lock.uncontended.{v}.p50")
        detail = (F.fig(f"lock.uncontended.{v}.commands") or {}).get("detail") or {}
        rows.append(
            [
                label,
                fmt(p50),
                fmt(F.v(f"lock.uncontended.{v}.p99")),
                fmt(F.v(f"lock.uncontended.{v}.rate")),
                fmt(F.v(f"lock.uncontended.{v}.commands"), 0)
                + " ("
                + ", ".join(f"{k} {v_:g}" for k, v_ in detail.items())
                + ")",
                fmt(p50 / raw, 2, "x") if p50 and raw else "–",
            ]
        )
    out += table(
        ["variant", "p50 µs", "p99 µs", "cycles/s", "round trips / cycle", "p50 / raw"], rows
    )
    out += [
        "",
        "Medians over the repetitions; ratios of p50 taken within each repetition: "
        f"ours / raw {fmt(F.v('lock.uncontended.ratio.ours_vs_raw'), 3, 'x')} "
        f"(per repetition {(F.fig('lock.uncontended.ratio.ours_vs_raw') or {}).get('reps')}), "
        f"ours / redis-py {fmt(F.v('lock.uncontended.ratio.ours_vs_redis_py'), 3, 'x')}, "
        f"ours / python-redis-lock {fmt(F.v('lock.uncontended.ratio.ours_vs_prl'), 3, 'x')}, "
        f"ours / pottery {fmt(F.v('lock.uncontended.ratio.ours_vs_pottery'), 3, 'x')}.",
        "",
    ]
    rows = []
    for v, label in UNCONTENDED.items():
        if F.fig(f"lock.uncontended.{v}.server_us") is not None:
            rows.append(label)
    if rows:
        out += [
            "Redis server time per cycle (`INFO commandstats` usec, scripts included): "
            + ", ".join(
                f"{k} {fmt(F.v(f'lock.uncontended.{k}.server_us'), 1)} µs"
                for k in UNCONTENDED
                if F.fig(f"lock.uncontended.{k}.server_us")
            )
            + ".",
            "",
        ]
    shares = {
        f["name"].rsplit(".", 1)[1]: f["value"]
        for f in F.all()
        if f["name"].startswith("lock.profile.ours.")
    }
    if shares:
        out += [
            "Where one cycle of ours spends its time, client side (pyinstrument, "
            "`performance-profiles/lock-ours-cycle.txt`; categories overlap): "
            + ", ".join(f"{k.replace('_', ' ')} {v:g}%" for k, v in shares.items())
            + ".",
            "",
        ]
    out += ["### Contended: N processes on one name (hold 0.2 ms, 1 ms between attempts)", ""]
    rows = []
    for v, (label, waits) in CONTENDED.items():
        for n in (8, 64):
            if F.fig(f"lock.contended.{v}.{n}.rate") is None:
                continue
            rows.append(
                [
                    f"{label} ({waits})",
                    str(n),
                    fmt(F.v(f"lock.contended.{v}.{n}.rate")),
                    fmt(F.v(f"lock.contended.{v}.{n}.overlaps")),
                    fmt(F.v(f"lock.contended.{v}.{n}.max_share"), 2),
                    fmt(F.v(f"lock.contended.{v}.{n}.redis_cmds")),
                    fmt(F.v(f"lock.contended.{v}.{n}.errors")),
                ]
            )
    out += table(
        [
            "variant (how it waits)",
            "processes",
            "acquisitions/s",
            "overlaps",
            "busiest process's share",
            "Redis commands/s",
            "errors",
        ],
        rows,
    )
    return out + [""]


def _spread(fig: dict | None, digits: int = 0) -> str:
    if not fig or fig.get("min") is None:
        return "–"
    return (
        f"{fmt(fig['min'], digits)}..{fmt(fig['max'], digits)} "
        f"(IQR {fmt(fig.get('q1'), digits)}..{fmt(fig.get('q3'), digits)})"
    )


def _prev(F: Figures, name: str, digits: int = 0, suffix: str = "") -> str:
    value = F.prev.get(name)
    return fmt(value, digits, suffix) if isinstance(value, (int, float)) else "–"


def _sql_text(F: Figures, db: str, kind: str) -> str:
    sql = F.fig(f"e2e.{db}.{kind}.sql") or {}
    detail = ", ".join(f"{k} {v}" for k, v in sorted((sql.get("detail") or {}).items()))
    txn = F.fig(f"e2e.{db}.{kind}.sql_txn") or {}
    tdetail = txn.get("detail") or {}
    tx = ", ".join(f"{k} {v}" for k, v in tdetail.items() if v)
    if tx and txn.get("begin_implicit"):
        tx = tx.replace("BEGIN", "BEGIN (sent by the driver)")
    return (detail or "none") + (f"; {tx}" if tx else "")


def md_e2e(F: Figures, result: dict) -> list[str]:
    from .e2e import KINDS, SHORT

    out = [
        "## 2. End to end: a real `celery worker` (prefork, concurrency 2, Redis broker)",
        "",
        "CPU per task is the worker's user + system CPU time (main process and prefork "
        "children, from `/proc`) over a batch's drain, divided by its tasks: the primary "
        "figure, since it moves much less with the neighbours' load than the drain rate. "
        "Medians over interleaved repetitions, spread min..max and the interquartile "
        "range; a ratio is the ratio of the medians (its per-repetition values beside it)."
        + (
            f" *Previous*: the figure of the run this one replaced "
            f"({F.prev_info.get('time')}, commit {F.prev_info.get('git_commit')})."
            if F.prev
            else ""
        ),
        "",
    ]
    for db in ("sqlite", "postgresql"):
        if F.fig(f"e2e.{db}.plain.rate") is None and F.fig(f"e2e.{db}.steplock.rate") is None:
            continue
        head = F.fig(f"e2e.{db}.steplock.rate") or F.fig(f"e2e.{db}.plain.rate") or {}
        out += [
            f"### {'SQLite' if db == 'sqlite' else 'PostgreSQL'}: {fmt(head.get('tasks'))} "
            f"tasks drained per batch, {head.get('reps')} interleaved repetitions",
            "",
        ]
        rows = []
        for kind, label in KINDS.items():
            fig = F.fig(f"e2e.{db}.{kind}.rate")
            if fig is None:
                continue
            cpu = F.fig(f"e2e.{db}.{kind}.cpu")
            name = f"{SHORT[kind]} {label}" if kind in SHORT else label
            rows.append(
                [
                    name,
                    f"**{fmt(cpu.get('value') if cpu else None)}**",
                    _spread(cpu),
                    _prev(F, f"e2e.{db}.{kind}.cpu"),
                    f"{fmt(F.v(f'e2e.{db}.{kind}.cpu_main'))} + "
                    f"{fmt(F.v(f'e2e.{db}.{kind}.cpu_pool'))}",
                    fmt(F.v(f"e2e.{db}.{kind}.cpu_lockstore")),
                    fmt(F.v(f"e2e.{db}.{kind}.cpu_db")) if db == "postgresql" else "–",
                    fmt(fig["value"]),
                    _spread(fig),
                    _prev(F, f"e2e.{db}.{kind}.rate"),
                ]
            )
        out += table(
            [
                "task",
                "CPU µs / task",
                "spread",
                "previous",
                "main + pool µs",
                "lock-store Redis µs",
                "PostgreSQL server µs",
                "tasks/s",
                "spread",
                "previous tasks/s",
            ],
            rows,
        )
        rows = []
        for kind, label in KINDS.items():
            if F.fig(f"e2e.{db}.{kind}.redis_round_trips") is None:
                continue
            pub = F.v(f"e2e.{db}.{kind}.redis_publish")
            work = F.v(f"e2e.{db}.{kind}.redis_worker")
            detail = (F.fig(f"e2e.{db}.{kind}.redis_worker") or {}).get("detail") or {}
            rows.append(
                [
                    f"{SHORT[kind]} {label}" if kind in SHORT else label,
                    f"{fmt(pub, 1)} + {fmt(work, 1)}"
                    + (
                        f" ({', '.join(f'{k} {v:g}' for k, v in detail.items())})"
                        if detail
                        else ""
                    ),
                    fmt(F.v(f"e2e.{db}.{kind}.redis_script_inner"), 0),
                    _sql_text(F, db, kind),
                    fmt(F.v(f"e2e.{db}.{kind}.overhead"), 2) if kind != "plain" else "0",
                ]
            )
        out += [
            "",
            "Per task, counted in a separate pass (`MONITOR` on the lock store; SQL "
            "through an execute wrapper in the worker, transaction control apart):",
            "",
        ]
        out += table(
            [
                "task",
                "Redis round trips (publish + worker)",
                "commands inside scripts",
                "SQL statements; transaction control",
                "drain ms / task over plain",
            ],
            rows,
        )
        rows = []
        for name, text in (
            (
                f"e2e.{db}.cpu_ratio.steplock_vs_handwritten_full",
                "CPU / task: (a) StepLockedTask / (c) hand-written, same work "
                "(the abstraction tax; target ≤ 1.15x)",
            ),
            (
                f"e2e.{db}.cpu_net_ratio.steplock_vs_handwritten_full",
                "CPU / task over the plain Task's: (a) / (c) (Celery's own cost taken out)",
            ),
            (
                f"e2e.{db}.cpu_total_ratio.steplock_vs_handwritten_full",
                "CPU / task including lock-store Redis and database server: (a) / (c)",
            ),
            (
                f"e2e.{db}.cpu_ratio.steplock_vs_handwritten",
                "CPU / task: (a) / (b) minimal hand-written",
            ),
            (
                f"e2e.{db}.cpu_ratio.handwritten_full_vs_handwritten",
                "CPU / task: (c) / (b) (what the default's extra work costs by hand)",
            ),
            (
                f"e2e.{db}.cpu_ratio.steplock_noprecheck_vs_handwritten",
                "CPU / task: StepLockedTask lock_precheck=False / (b)",
            ),
            (f"e2e.{db}.ratio.steplock_vs_handwritten", "tasks/s: (a) / (b) (target ≥ 0.95x)"),
            (f"e2e.{db}.ratio.steplock_vs_handwritten_full", "tasks/s: (a) / (c)"),
            (f"e2e.{db}.ratio.handwritten_full_vs_handwritten", "tasks/s: (c) / (b)"),
            (
                f"e2e.{db}.ratio.steplock_noprecheck_vs_handwritten",
                "tasks/s: StepLockedTask lock_precheck=False / (b)",
            ),
            (f"e2e.{db}.ratio.handwritten_vs_plain", "tasks/s: (b) / plain Task"),
        ):
            fig = F.fig(name)
            if fig is None:
                continue
            per = fig.get("paired") if fig.get("paired") is not None else fig.get("all")
            rows.append(
                [
                    text,
                    f"**{fmt(fig['value'], 3, 'x')}**",
                    "–" if per is None else str(per),
                    _prev(F, name, 3, "x"),
                ]
            )
        if rows:
            out += ["", "Ratios of the medians:", ""]
            out += table(["figure", "ratio", "per repetition", "previous"], rows)
        out += [""]
        sample = F.v(f"e2e.{db}.steplock.redis_sample")
        inner = F.fig(f"e2e.{db}.steplock.redis_script_inner") or {}
        if sample:
            out += [
                f"One StepLockedTask's lock-store traffic (`MONITOR`, worker side): "
                f"{fmt(F.v(f'e2e.{db}.steplock.redis_worker'), 1)} commands, all `EVALSHA` "
                f"(acquire, ownership check, release), running "
                f"{fmt(inner.get('value'), 0)} commands inside the scripts "
                f"({', '.join(f'{k} {v:g}' for k, v in (inner.get('detail') or {}).items())}).",
                "",
            ]
        rows = []
        for kind in (
            "handwritten",
            "handwritten_full",
            "steplock",
            "steplock_noprecheck",
            "steplock_parked",
        ):
            p50 = F.fig(f"e2e.{db}.inproc.{kind}.p50")
            if p50 is None:
                continue
            rows.append(
                [
                    p50.get("label", kind),
                    fmt(p50["value"]),
                    fmt(F.v(f"e2e.{db}.inproc.{kind}.p99")),
                    fmt(F.v(f"e2e.{db}.inproc.{kind}.cpu")),
                    fmt(F.v(f"e2e.{db}.inproc.ratio.{kind}_vs_handwritten"), 2, "x")
                    if kind != "handwritten"
                    else "1.00x",
                ]
            )
        if rows:
            out += [
                "Called in-process (no broker, no worker; same Redis and database), "
                "µs per execution:",
                "",
            ]
            out += table(
                ["task body", "p50 µs", "p99 µs", "CPU µs / call", "p50 / hand-written"], rows
            )
            tax = F.v(f"e2e.{db}.inproc.cpu_ratio.steplock_vs_handwritten_full")
            if tax is not None:
                out += [
                    "",
                    f"In-process CPU per call, StepLockedTask / hand-written doing the "
                    f"same work: {fmt(tax, 3, 'x')}.",
                ]
            steps = [f for f in F.all() if f["name"].startswith(f"e2e.{db}.steps.")]
            if steps:
                out += ["", "Each step on its own, µs per call (median), in this process:", ""]
                out += table(
                    ["step", "task", "µs"],
                    [
                        [
                            f["label"],
                            "StepLockedTask" if f["side"] == "steplock" else "hand-written",
                            fmt(f["value"], 1),
                        ]
                        for f in steps
                    ],
                )
                lookups = F.v(f"e2e.{db}.steplock.conf_lookups")
                if lookups is not None:
                    out += [
                        "",
                        f"One StepLockedTask execution looks a `steplock_*` setting up "
                        f"in `app.conf` {fmt(lookups)} times and builds its execution plan "
                        f"{fmt(F.v(f'e2e.{db}.steplock.plan_builds'))} times (counted by "
                        f"wrapping both for 10 executions).",
                    ]
            shares = {
                f["name"].rsplit(".", 1)[1]: f["value"]
                for f in F.all()
                if f["name"].startswith(f"e2e.{db}.profile.steplock.")
            }
            if shares:
                out += [
                    "",
                    "Where a StepLockedTask execution spends its time (pyinstrument, "
                    f"`performance-profiles/e2e-{db}-steplock.txt`; categories overlap): "
                    + ", ".join(f"{k.replace('_', ' ')} {v:g}%" for k, v in shares.items())
                    + ".",
                ]
            out += [""]
    return out


def md_heartbeat(F: Figures, result: dict) -> list[str]:
    out = ["## 3. Heartbeat at scale: one `Heartbeat`, one process, renewal every 1 s", ""]
    counts = sorted(
        {int(f["name"].split(".")[2]) for f in F.all() if f["name"].startswith("heartbeat.ours.")}
    )
    rows = []
    for n in counts:
        p = f"heartbeat.ours.{n}"
        rows.append(
            [
                "celery-steplock Heartbeat",
                fmt(n),
                fmt(F.v(f"{p}.round_trips_per_interval"), 2),
                fmt(F.v(f"{p}.renewals_per_interval")),
                fmt(F.v(f"{p}.cycle_p50"), 1),
                fmt(F.v(f"{p}.cycle_max"), 1),
                fmt(F.v(f"{p}.cpu"), 3),
                fmt(F.v(f"{p}.threads")),
                fmt(F.v(f"{p}.lost")),
            ]
        )
    for n in sorted(
        {
            int(f["name"].split(".")[2])
            for f in F.all()
            if f["name"].startswith("heartbeat.ours_spread.")
        }
    ):
        p = f"heartbeat.ours_spread.{n}"
        over = (F.fig(f"{p}.round_trips_per_interval") or {}).get("acquired_over_s")
        rows.append(
            [
                f"celery-steplock Heartbeat, leases taken over {fmt(over, 1)} s",
                fmt(n),
                fmt(F.v(f"{p}.round_trips_per_interval"), 2),
                fmt(F.v(f"{p}.renewals_per_interval")),
                fmt(F.v(f"{p}.cycle_p50"), 1),
                fmt(F.v(f"{p}.cycle_max"), 1),
                fmt(F.v(f"{p}.cpu"), 3),
                fmt(F.v(f"{p}.threads")),
                fmt(F.v(f"{p}.lost")),
            ]
        )
    prl_rows = sorted(
        {
            (f["name"].split(".")[1], int(f["name"].split(".")[2]))
            for f in F.all()
            if f["name"].startswith("heartbeat.prl")
        }
    )
    for prl, n in prl_rows:
        p = f"heartbeat.{prl}.{n}"
        died = F.v(f"{p}.thread_errors")
        pool = (F.fig(f"{p}.cpu") or {}).get("pool")
        what = ", redis-py's default" if prl == "prl_default_pool" else ""
        rows.append(
            [
                f"python-redis-lock auto_renewal (every 2 s; pool of {fmt(pool)}{what})"
                + (f"; **{died} renewal threads died**" if died else ""),
                fmt(n),
                fmt(F.v(f"{p}.round_trips_per_interval"), 0),
                "–",
                "–",
                "–",
                fmt(F.v(f"{p}.cpu"), 3),
                fmt(F.v(f"{p}.threads")),
                fmt(F.v(f"{p}.lost")),
            ]
        )
    out += table(
        [
            "renewer",
            "leases",
            "round trips / interval",
            "EVALSHA / interval",
            "cycle p50 ms",
            "cycle max ms",
            "CPU s/s",
            "threads",
            "lost",
        ],
        rows,
    )
    shares = {
        f["name"].rsplit(".", 1)[1]: f["value"]
        for f in F.all()
        if ".profile." in f["name"] and f["name"].startswith("heartbeat.")
    }
    if shares and counts:
        out += [
            "",
            f"One {counts[-1]:,}-lease cycle under pyinstrument "
            f"(`performance-profiles/heartbeat-{counts[-1]}.txt`; categories overlap): "
            + ", ".join(f"{k.replace('_', ' ')} {v:g}%" for k, v in shares.items())
            + ".",
        ]
    return out + [""]


def md_wait(F: Figures, result: dict) -> list[str]:
    from .blocking_wait import VARIANTS

    out = ["## 4. Blocking wait: release → next waiter holds the lease", ""]
    rows = []
    for v, label in VARIANTS.items():
        for w in (1, 32):
            fig = F.fig(f"wait.{v}.{w}.p50")
            if fig is None:
                continue
            rows.append(
                [
                    label,
                    f"{w} thread{'s' if w > 1 else ''}",
                    fmt(fig["value"], 2),
                    fmt(F.v(f"wait.{v}.{w}.p99"), 2),
                    fmt(fig.get("samples")),
                    fmt(F.v(f"wait.{v}.{w}.overlaps")),
                    fmt(F.v(f"wait.{v}.32.idle_commands")) if w == 32 else "",
                ]
            )
        fig = F.fig(f"wait.{v}.32p.p50")
        if fig is not None:
            rows.append(
                [
                    label,
                    "32 processes",
                    fmt(fig["value"], 2),
                    fmt(F.v(f"wait.{v}.32p.p99"), 2),
                    fmt(fig.get("samples")),
                    fmt(F.v(f"wait.{v}.32p.overlaps")),
                    "",
                ]
            )
    out += table(
        [
            "waiter",
            "waiters",
            "p50 ms",
            "p99 ms",
            "samples",
            "overlaps",
            "Redis commands/s while 32 threads wait",
        ],
        rows,
    )
    return out + [""]


def md_operators(F: Figures, result: dict) -> list[str]:
    out = ["## 5. Operators' paths with many leases in Redis", ""]
    counts = sorted(
        {
            int(f["name"].split(".")[1])
            for f in F.all()
            if f["name"].startswith("operators.") and f["name"].split(".")[1].isdigit()
        }
    )
    rows = []
    for n in counts:
        p = f"operators.{n}"
        reap = F.fig(f"{p}.reap") or {}
        rows.append(
            [
                fmt(n),
                fmt(F.v(f"{p}.admin_first")),
                fmt(F.v(f"{p}.admin_warm")),
                fmt((F.fig(f"{p}.admin_first") or {}).get("rows")),
                fmt(F.v(f"{p}.admin_peak_rss"), 1),
                fmt(F.v(f"{p}.ls_wall")),
                fmt(F.v(f"{p}.ls_peak_rss"), 1),
                fmt(F.v(f"{p}.reap"), 2),
                f"{fmt(reap.get('reaped'))} / {fmt(reap.get('left'))}",
                fmt(F.v(f"{p}.reap_peak_rss"), 1),
            ]
        )
    out += table(
        [
            "leases",
            "admin first page ms",
            "admin warm ms",
            "rows shown",
            "admin peak RSS MiB",
            "`steplock ls --limit 100` ms (process)",
            "ls peak RSS MiB",
            "reaper s",
            "reaped / left",
            "reaper peak RSS MiB",
        ],
        rows,
    )
    shares = {
        f["name"].rsplit(".", 1)[1]: f["value"]
        for f in F.all()
        if f["name"].startswith("operators.profile.reap.")
    }
    if shares:
        n = (
            F.fig(
                next(f["name"] for f in F.all() if f["name"].startswith("operators.profile.reap."))
            )
            or {}
        ).get("leases")
        out += [
            "",
            f"The reaper on {fmt(n)} leases under pyinstrument "
            f"(`performance-profiles/reaper-{n}.txt`; categories overlap): "
            + ", ".join(f"{k.replace('_', ' ')} {v:g}%" for k, v in shares.items())
            + ".",
        ]
    return out + [""]


def md_wire(F: Figures, result: dict) -> list[str]:
    """Our hand-packed EVALSHA against redis-py's ``Script`` and pipelines (issue 23)."""
    out = [
        "## Wire: hand-packed EVALSHA against redis-py's Script and pipelines",
        "",
        "Per call, the same script and arguments on the same client; ratio ours / redis-py "
        "within each repetition (median), its verdict against the A/A control's band "
        "(`benchmarks/wire.py`).",
        "",
    ]
    rows = []
    for fig in F.all():
        name = fig["name"]
        if not (name.startswith("wire.") and name.endswith(".conclusion")):
            continue
        base = name.removesuffix(".conclusion")
        others = sorted(
            {
                f["variant"]
                for f in F.all()
                if f["name"].startswith(base + ".redis_py_") and f["name"].endswith(".p50")
            }
        )
        for other in ["redis_py", *others]:
            tag = "" if other == "redis_py" else f".vs_{other}"
            p50, cpu = F.fig(f"{base}.ratio{tag}.p50"), F.fig(f"{base}.ratio{tag}.cpu")
            if p50 is None or cpu is None:
                continue
            rows.append(
                [
                    fig.get("topology", ""),
                    fig.get("label", "") if other == "redis_py" else "",
                    (F.fig(f"{base}.{other}.p50") or {}).get("label", other),
                    f"{fmt(F.v(base + '.ours.p50'), 1)} / {fmt(F.v(f'{base}.{other}.p50'), 1)}",
                    f"{fmt(p50['value'], 3)} ({p50.get('verdict')})",
                    f"{fmt(F.v(base + '.ours.cpu'), 1)} / {fmt(F.v(f'{base}.{other}.cpu'), 1)}",
                    f"{fmt(cpu['value'], 3)} ({cpu.get('verdict')})",
                    f"{min(cpu['aa_reps']):.3f}..{max(cpu['aa_reps']):.3f}",
                    fig["value"] if other == "redis_py" else "",
                ]
            )
    out += table(
        [
            "topology",
            "call",
            "against",
            "p50 µs ours / theirs",
            "ratio",
            "client CPU µs ours / theirs",
            "ratio",
            "A/A CPU band",
            "conclusion",
        ],
        rows,
    )
    return out + [""]


SECTIONS = {
    "lock": md_lock,
    "e2e": md_e2e,
    "heartbeat": md_heartbeat,
    "wait": md_wait,
    "operators": md_operators,
    "wire": md_wire,
}


def build(groups: dict[str, dict], context: dict[str, Any]) -> dict[str, Any]:
    F = Figures(groups)
    targets = evaluate(F)
    figures = [
        {"group": f["group"], **{k: v for k, v in f.items() if k != "group"}} for f in F.all()
    ]
    return {
        "context": context,
        "targets": targets,
        "figures": figures,
        "groups": {
            name: {k: v for k, v in g.items() if k not in ("figures",)}
            for name, g in groups.items()
        },
    }


def render(doc: dict[str, Any]) -> str:
    ctx = doc["context"]
    groups_full = doc["groups"]
    F = Figures(
        {
            name: {"figures": [f for f in doc["figures"] if f["group"] == name]}
            for name in groups_full
        },
        doc.get("previous"),
    )
    lines = [
        "# Performance",
        "",
        "Generated by `make bench` (`benchmarks/run.py`; see `benchmarks/README.md`). "
        "Every figure, with its unit and this run's context, is in "
        "`performance.json` beside this file; profiles are in `performance-profiles/`.",
        "",
        f"Run: {ctx.get('time')}, commit {ctx.get('git_commit')}"
        + (
            " (library files modified in the work tree: "
            + ", ".join(ctx["git_dirty_library"].split()[1::2])
            + ")"
            if ctx.get("git_dirty_library")
            else ""
        )
        + f"; {'**quick smoke run**' if ctx.get('quick') else 'full run'} of "
        f"{', '.join(ctx.get('groups_run') or [])} in {fmt(ctx.get('run_wall_s'))} s. "
        f"Machine: {ctx.get('cpu_count')} CPUs, {ctx.get('platform')}, Python "
        f"{ctx.get('python')}, {ctx.get('redis_server')}; load average at the start "
        f"{', '.join(f'{x:.2f}' for x in ctx.get('loadavg') or [])}, at the end "
        f"{', '.join(f'{x:.2f}' for x in ctx.get('loadavg_end') or [])} (other jobs "
        f"share this machine: compare figures within the run, not across runs).",
        "",
        *(
            [
                (
                    "Groups rerun since: "
                    + "; ".join(
                        f"{', '.join(r['groups'])} at {r['time']} (commit {r['git_commit']}, load "
                        f"{', '.join(f'{x:.2f}' for x in r['loadavg'])})"
                        for r in ctx["reruns"]
                    )
                    + "."
                ),
                "",
            ]
            if ctx.get("reruns")
            else []
        ),
        "Libraries: "
        + ", ".join(f"{k} {v}" for k, v in (ctx.get("libraries") or {}).items() if v)
        + ".",
        "",
    ]
    lines += ["## Targets (issue 5), from this run", ""]
    lines += md_targets(doc["targets"], F) + [""]
    for name, render_section in SECTIONS.items():
        if name not in groups_full:
            continue
        g = groups_full[name]
        if g.get("error"):
            lines += [f"## {name}: FAILED", "", f"`{g['error']}`", ""]
        lines += render_section(F, g)
        gctx = g.get("context") or {}
        load = gctx.get("loadavg_start")
        lines += [
            f"<sub>{name}: {fmt(g.get('wall_s'))} s, load average "
            f"{', '.join(f'{x:.2f}' for x in load) if load else '–'} at its start"
            f"{', quick run' if gctx.get('quick') else ''}, {gctx.get('time', '')}.</sub>",
            "",
        ]
    notes = [(name, n) for name, g in groups_full.items() for n in g.get("notes", [])]
    commentary = HERE / "commentary.md"
    if commentary.exists():
        lines += [commentary.read_text().rstrip(), ""]
    if notes:
        lines += ["## Method notes", ""]
        seen = set()
        for name, n in notes:
            if n not in seen:
                seen.add(n)
                lines.append(f"- {name}: {n}")
        lines.append("")
    peers = next((g.get("peers") for g in groups_full.values() if g.get("peers")), None)
    if peers:
        lines += ["## Peers", ""]
        lines += table(
            ["package", "version", "imports with this Celery/redis-py"],
            [
                [k, str(v.get("version")), "yes" if v.get("ok") else f"**no**: {v.get('error')}"]
                for k, v in peers.items()
            ],
        )
        lines.append("")
    return "\n".join(lines)


def write(doc: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    prof_dir = out_dir / "performance-profiles"
    for name, g in doc["groups"].items():
        profiles = g.pop("profiles", None) or {}
        if profiles:
            prof_dir.mkdir(exist_ok=True)
        g["profile_files"] = sorted(set(g.get("profile_files") or []) | set(profiles))
        for pname, text in profiles.items():
            (prof_dir / f"{pname}.txt").write_text(text)
    (out_dir / "performance.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (out_dir / "performance.md").write_text(render(doc) + "\n")
