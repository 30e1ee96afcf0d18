"""docs/reliability.md and docs/reliability.json: one JSON document, one renderer.

The document::

    {"deterministic": <scripts/soak.py's result: started, commit, seconds, trials,
                       negative_trials, ttl, visibility_timeout, redis, postgres, python, cpus,
                       scenarios, negative_control> or None,
     "randomized": [<a run summary, see summarize()>, ...]}

``scripts/soak.py`` updates the deterministic part and ``scripts/nemesis.py`` adds randomized
runs, each with :func:`update` (load, :func:`merge`, write both files), so neither erases the
other's part. A ``reliability.json`` of the older flat shape (the soak result at the top
level) loads as ``{"deterministic": <it>, "randomized": []}``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.faults.scenarios import FENCE_CLASS

DOCS = Path(__file__).resolve().parents[3] / "docs"
MAX_EXAMPLES = 40  # of the deterministic soak, as before
MAX_RUN_EXAMPLES = 5  # per randomized run and per negative control


def empty() -> dict:
    return {"deterministic": None, "randomized": []}


def normalize(doc: dict) -> dict:
    """``doc`` in the current shape (a copy); the flat shape of older files is the
    deterministic part."""
    if "deterministic" not in doc and "scenarios" in doc:
        return {"deterministic": dict(doc), "randomized": []}
    return {
        "deterministic": doc.get("deterministic"),
        "randomized": list(doc.get("randomized") or []),
    }


def load(path: Path | str | None = None) -> dict:
    """The document of ``path`` (default docs/reliability.json); an absent file gives
    :func:`empty`."""
    path = Path(path) if path is not None else DOCS / "reliability.json"
    if not path.exists():
        return empty()
    return normalize(json.loads(path.read_text()))


def save(doc: dict, path: Path | str | None = None) -> Path:
    """Write ``doc`` as JSON to ``path`` (default docs/reliability.json); returns the path."""
    path = Path(path) if path is not None else DOCS / "reliability.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(normalize(doc), indent=2) + "\n")
    return path


def _same_run(a: dict, b: dict) -> bool:
    """One seed and duration on one deployment (lock store, broker, database, loads,
    workload): a rerun of it replaces it; the same seed on another topology is a row of its
    own."""

    def key(run):
        shape = tuple(
            tuple(run[k]) if isinstance(run.get(k), list) else run.get(k) for k in CONFIG_KEYS
        )
        return run.get("seed"), run.get("duration_s"), shape

    return key(a) == key(b)


#: The soak's settings a partial rerun must share with the soak it updates, or its rows would
#: sit in a table whose heading describes another timing.
RERUN_SETTINGS = ("trials", "negative_trials", "ttl", "visibility_timeout", "max_hold")


def check_rerun(previous: dict | None, rerun: dict) -> None:
    """Raise ValueError unless the rows of a soak with the settings of ``rerun`` can replace
    rows of the recorded soak ``previous``: one exists, with the same :data:`RERUN_SETTINGS`."""
    if not previous:
        raise ValueError("a partial soak (--only) needs a whole soak in the document to update")
    differ = [k for k in RERUN_SETTINGS if previous.get(k) != rerun.get(k)]
    if differ:
        raise ValueError(
            "the partial soak's settings differ from the recorded soak's: "
            + ", ".join(f"{k} {rerun.get(k)!r} != {previous.get(k)!r}" for k in differ)
        )


def merge_rows(previous: dict | None, rerun: dict) -> dict:
    """The deterministic part ``previous`` with the rows of a partial soak ``rerun`` (``soak.py
    --only``) in place of its own (new scenarios appended), each marked ``"rerun": {"started",
    "commit", "seconds"}``. Raises ValueError when there is no previous soak or when the
    settings of :data:`RERUN_SETTINGS` differ (the rows would not be comparable)."""
    check_rerun(previous, rerun)
    mark = {k: rerun[k] for k in ("started", "commit")}
    out = dict(previous)
    for part in ("scenarios", "negative_control"):
        rows = dict(previous.get(part) or {})
        for name, row in (rerun.get(part) or {}).items():
            rows[name] = {**row, "rerun": {**mark, "seconds": round(row.get("seconds") or 0, 1)}}
        out[part] = rows
    return out


def merge(
    doc: dict,
    deterministic: dict | None = None,
    randomized_run: dict | None = None,
    partial: bool = False,
):
    """A new document: ``doc`` with its deterministic part replaced by ``deterministic`` (with
    ``partial``, only the rows it holds: :func:`merge_rows`) and ``randomized_run`` added
    (replacing a run of the same seed and duration), when given."""
    out = normalize(doc)
    if deterministic is not None:
        out["deterministic"] = (
            merge_rows(out["deterministic"], deterministic) if partial else deterministic
        )
    if randomized_run is not None:
        runs = [r for r in out["randomized"] if not _same_run(r, randomized_run)]
        out["randomized"] = runs + [randomized_run]
    return out


def write(doc: dict, docs: Path | str | None = None) -> None:
    """Write ``reliability.json`` and ``reliability.md`` (:func:`render`) into ``docs``."""
    docs = Path(docs) if docs is not None else DOCS
    save(doc, docs / "reliability.json")
    (docs / "reliability.md").write_text(render(doc))


def update(
    deterministic: dict | None = None,
    randomized_run: dict | None = None,
    docs: Path | str | None = None,
    partial: bool = False,
) -> dict:
    """Load the document in ``docs`` (default docs/), :func:`merge` in what is given, write
    both files; returns the new document."""
    docs = Path(docs) if docs is not None else DOCS
    doc = merge(load(docs / "reliability.json"), deterministic, randomized_run, partial)
    write(doc, docs)
    return doc


# -- a randomized run's summary -----------------------------------------------------------


def _verdict_of(path: Path) -> dict:
    stored = path / "verdict.json"
    if stored.exists():
        return json.loads(stored.read_text())
    from tests.support.faults import runcheck

    return runcheck.check_run(runcheck.load(path)).as_dict()


#: A run's configuration in run.json and the value that is not a negative control.
CONTROL_DEFAULTS = {
    "unguarded": False,
    "guard": "fenced",
    "breaker": "guarded",
    "patterns": "guarded",
    "http": "guarded",
    "writers": "guarded",
    "periodic": "guarded",
}
#: The configuration keys that name a run's setting rather than a control.
CONFIG_KEYS = ("store", "broker", "database", "loads", "workload")


def control_label(meta: dict) -> str:
    """What a run of ``meta`` (run.json) turned off, e.g. ``"unguarded"``, ``"guard nofence"``,
    ``"breaker bypass"``, ``"workload outbox-in-body"``; ``""`` for a guarded run."""
    parts = []
    for key, default in CONTROL_DEFAULTS.items():
        value = meta.get(key, default)
        if value in (default, None):
            continue
        parts.append(key if value is True else f"{key} {value}")
    if meta.get("workload") == "outbox-in-body":
        parts.append("workload outbox-in-body")
    return ", ".join(parts)


#: The rule families of a verdict's violations, in the order the tables list them.
RULES = (
    "steps",
    "writers",
    "effects",
    "rate",
    "concurrency",
    "idempotency",
    "breaker",
    "http",
    "periodic",
)


def rule_of(message: str) -> str:
    """The rule family (:data:`RULES`) of one violation message of the run checker: by its
    prefix (``"rate "``, ``"concurrency "``, ``"idempotency"``, ``"breaker "``, ``"http "``;
    ``"step N: effect"``/``"step N: key"`` for the effects; another ``"step N:"`` for the step
    rules), and a periodic run's overlap (``"<task>: run ... while run ..."``)."""
    head = message.split(":", 1)
    for family in ("rate", "concurrency", "idempotency", "breaker", "http"):
        if message.startswith(family):
            return family
    if message.startswith("step ") and len(head) == 2:
        rest = head[1].lstrip()
        return "effects" if rest.startswith(("effect ", "key ")) else "steps"
    if " while run " in message or "overlapping run" in message:
        return "periodic"
    return "steps"


def violations_by_rule(verdict: dict) -> dict:
    """``{family: n}`` of a verdict's violations (:func:`rule_of`), with the step violations
    on steps the writer outside Celery changed (``counts["writer_step_violations"]``) moved to
    ``"writers"``; families without a violation are left out."""
    found: dict = {}
    for message in verdict.get("violations") or []:
        family = rule_of(str(message))
        found[family] = found.get(family, 0) + 1
    writers = (verdict.get("counts") or {}).get("writer_step_violations") or 0
    if writers:
        moved = min(writers, found.get("steps", 0))
        found["writers"] = found.get("writers", 0) + moved
        found["steps"] = found.get("steps", 0) - moved
    return {k: found[k] for k in RULES if found.get(k)}


def _negative(negative_dir, meta: dict) -> dict:
    negative_dir = Path(negative_dir)
    neg_meta = json.loads((negative_dir / "run.json").read_text())
    if neg_meta.get("seed") != meta.get("seed"):
        raise ValueError(
            f"the negative control {negative_dir} ran seed {neg_meta.get('seed')}, the run "
            f"seed {meta.get('seed')}: a control must replay the same schedule"
        )
    neg = _verdict_of(negative_dir)
    return {
        "seed": neg_meta.get("seed"),
        "duration_s": neg_meta.get("duration_s"),
        "control": control_label(neg_meta),
        "executions": neg["counts"].get("executions"),
        "faults": neg["counts"].get("faults", {}),
        "violations": len(neg["violations"]),
        "by_rule": violations_by_rule(neg),
        "examples": neg["violations"][:MAX_RUN_EXAMPLES],
    }


def summarize(run_dir, negative_dir=None) -> dict:
    """The summary of a randomized run for the document, from its directory's ``run.json`` and
    ``verdict.json`` (checked now when absent), with its negative control's beside it
    (``negative_dir``: a directory, or a list of them, one control per pattern: then also
    ``negative_controls``, each with its ``control``, :func:`control_label`; each must have
    run the same seed, else ValueError); ``store``, ``broker``, ``database``, ``loads`` and
    ``workload`` are copied from run.json when it has them::

        {"seed", "duration_s", "started", "commit", "workers": [{"name", "pool",
         "concurrency"}], "executions", "faults": {kind: n}, "violations": int,
         "leftovers": int, "recovery_p50_s", "recovery_p95_s", "recovery_max_s",
         "examples": [str], "negative_control": {"seed", "duration_s", "executions",
         "faults", "violations", "examples"} or None}

    ``executions`` and ``faults`` are the checker's counts (history entries), not run.json's.
    """
    run_dir = Path(run_dir)
    meta = json.loads((run_dir / "run.json").read_text())
    verdict = _verdict_of(run_dir)
    counts, recovery = verdict["counts"], verdict.get("recovery", {})
    summary = {
        "seed": meta.get("seed"),
        "duration_s": meta.get("duration_s"),
        "started": meta.get("started"),
        "commit": meta.get("commit"),
        "workers": meta.get("workers", []),
        "executions": counts.get("executions"),
        "acquired": counts.get("acquired"),
        "commits": counts.get("commits"),
        "steps": counts.get("steps"),
        "faults": counts.get("faults", {}),
        "violations": len(verdict["violations"]),
        "data_loss": len(verdict.get("data_loss", [])),
        "data_loss_examples": verdict.get("data_loss", [])[:MAX_RUN_EXAMPLES],
        "leftovers": len(verdict["leftovers"]),
        "overlaps": counts.get("overlaps"),
        "fence_refusals": counts.get("fence_refusals"),
        "recovery_p50_s": recovery.get("p50_s"),
        "recovery_p95_s": recovery.get("p95_s"),
        "recovery_max_s": recovery.get("max_s"),
        "examples": (verdict["violations"] + verdict["leftovers"])[:MAX_RUN_EXAMPLES],
        "counts": {k: v for k, v in counts.items() if k != "faults"},
        "negative_control": None,
    }
    summary.update({k: meta[k] for k in CONFIG_KEYS if meta.get(k) is not None})
    dirs = [] if negative_dir is None else [negative_dir]
    if isinstance(negative_dir, (list, tuple)):
        dirs = list(negative_dir)
    controls = [_negative(d, meta) for d in dirs]
    summary["negative_control"] = controls[0] if controls else None
    if len(controls) > 1:
        summary["negative_controls"] = controls
    return summary


# -- rendering --------------------------------------------------------------------------------


def fmt(value, digits=1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return f"{value:,}"


def _deterministic_lines(result: dict) -> list[str]:
    guarded, negative = result["scenarios"], result["negative_control"]
    lines = [
        f"Run: {result['started']} UTC, commit {result['commit']}, {result['seconds']:.0f} s; "
        f"{result['trials']} trials per scenario, {result['negative_trials']} per scenario for "
        f"the negative control; lease TTL {result['ttl']} s, broker visibility_timeout "
        f"{result['visibility_timeout']} s; {_labs(result)}two prefork workers (concurrency 1), Redis "
        f"{result['redis']}, PostgreSQL {result['postgres']}, Python {result['python']}, "
        f"{result['cpus']} CPUs.",
        "",
        "Each trial: one fresh step, its task delivered (usually twice with one task id), one "
        "fault at a fixed point of the attempt, then wait until the step is terminal, no "
        "message is queued or reserved and no lease is held. Checked per trial: exactly one "
        "terminal transition committed, a legal chain from `pending` matching the row, fences "
        "never decreasing, no lock-store key without a TTL, no lease left behind. *Overlaps* "
        "counts trials where two attempts held the lease on the step at once (as each saw "
        "it): expected after a pause, a frozen heartbeat or a failover, harmless to the step "
        "because the compare-and-swap refuses the second commit (the body itself can run "
        "twice: its side effects need the effects outbox or an idempotency key). The pause, "
        "heartbeat-frozen, failover and fence-split rows make the overlap in every trial (a "
        "stopped holder, or one whose heartbeat is frozen, goes on only once another attempt "
        "holds the lease; a split leaves two primaries): they test the guard under it, not how "
        "often a fault causes it; in the other rows it comes when it comes. *Recovery*: "
        "seconds from the fault until the system was quiet again.",
        "",
        "| scenario | fault | trials | overlaps | commits | violations | leases left "
        "behind | recovery p50 s | recovery max s | errors | negative control: trials with "
        "violations |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    reruns = {}
    for name, row in guarded.items():
        neg = negative.get(name)
        neg_text = f"{neg['violating_trials']} / {neg['trials']}" if neg else "-"
        if neg and neg.get("errors"):
            neg_text += f", {fmt(neg['errors'])} errors"
        if row.get("rerun"):
            reruns[name] = row["rerun"]
        lines.append(
            f"| {name}{' (*)' if row.get('rerun') else ''} | {row['fault']} | {fmt(row['trials'])} | {fmt(row['overlaps'])} | "
            f"{fmt(row['commits'])} | **{fmt(row['violations'])}** | "
            f"{fmt(row['leftover_leases'])} | {fmt(row['recovery_p50_s'])} | "
            f"{fmt(row['recovery_max_s'])} | {fmt(row['errors'])} | {neg_text} |"
        )
    totals = {
        k: sum(r[k] for r in guarded.values())
        for k in ("trials", "commits", "violations", "leftover_leases", "errors", "overlaps")
    }
    neg_trials = sum(r["trials"] for r in negative.values())
    neg_bad = sum(r["violating_trials"] for r in negative.values())
    neg_errors = {name: r for name, r in negative.items() if r.get("errors")}
    neg_error_text = (
        f", {fmt(sum(r['errors'] for r in neg_errors.values()))} errors" if neg_errors else ""
    )
    lines += [
        f"| **all** | | {fmt(totals['trials'])} | {fmt(totals['overlaps'])} | "
        f"{fmt(totals['commits'])} | **{fmt(totals['violations'])}** | "
        f"{fmt(totals['leftover_leases'])} | | | {fmt(totals['errors'])} | "
        f"{neg_bad} / {neg_trials}{neg_error_text} |",
        "",
        "The negative control runs the same scenarios with `STEPLOCK_FAULTS_UNGUARDED=1`: the "
        "transition is a plain `UPDATE ... WHERE pk = ?` and the pre-check is off (the lease, "
        "its heartbeat and the pre-commit ownership check stay). Violations there show that "
        "the checker bites and that the lease alone does not prevent a second commit.",
    ]
    if neg_errors:
        lines[-1] += (
            " A control trial that ended in an error is neither counted in its row's trials "
            "nor caught: "
            + "; ".join(
                f"{name}, {fmt(r['errors'])} ({_error_of(r)})" for name, r in neg_errors.items()
            )
            + "."
        )
        if "pause@after_cas" in neg_errors:
            lines[-1] += (
                " After its plain `UPDATE` the paused holder's open transaction keeps the "
                "row locked and, without the guard's deadline, nothing ends its session: no "
                "other attempt can commit while it is stopped, so the trial waits out the "
                "controller's timeout."
            )
    if reruns:
        lines += [
            "",
            "(*) Rerun apart from the whole soak, with its settings (`scripts/soak.py "
            "--only`), after a fix to the scenario or the library; the row replaces the whole "
            "soak's (rows rerun together share a start): "
            + "; ".join(
                f"{name} at {r['started']} UTC, commit {r['commit']}, "
                f"{fmt(r.get('seconds'))} lab-seconds"
                for name, r in reruns.items()
            )
            + ". Lab-seconds are the row's trials' durations summed over the labs running "
            "side by side, not wall-clock time.",
        ]
    if any(row.get("fault") == FENCE_CLASS for row in guarded.values()):
        lines += [
            "",
            "*Split brain: the fence decides* (the `fence-split` rows). A partition leaves one "
            "worker on the old Redis primary, where its lease lives and its heartbeat keeps "
            "renewing it, while the other moves to a promoted replica that never saw that "
            "lease. There a newer holder (a later, Redis-time fencing token) moves the step "
            "pending -> running, and a reset task or the reaper moves it back to pending. When "
            "the stale holder goes on, the status it expects is back and its own Redis still "
            "says it owns the lease: only the fence condition of the compare-and-swap "
            "(`lock_fence <= token`) refuses it, and its retry commits once the split heals "
            "(three commits per trial: running, pending, the terminal one). The fencing tokens "
            "come from Redis `TIME`: both primaries share this host's clock here; a promoted "
            "primary whose clock is behind would hand out lower tokens, and the fence would "
            "then refuse the new holder instead (safe, not live). Their negative "
            "control is the guard without the fence (`STEPLOCK_FAULTS_GUARD=nofence`: the "
            "status CAS, the pre-check and the ownership check stay): the stale write commits, "
            "and the checker reports decreasing fences and a commit after a newer grant.",
        ]
    return lines


def _labs(result: dict) -> str:
    labs = result.get("labs")
    return f"{labs} labs side by side, each " if labs and labs > 1 else ""


def _deterministic_examples(result: dict) -> list[str]:
    guarded, negative = result["scenarios"], result["negative_control"]
    examples = [
        (name, ex)
        for name, row in {
            **guarded,
            **{f"{k} (negative control)": v for k, v in negative.items()},
        }.items()
        for ex in row["examples"]
    ]
    return [f"- {name}: {ex}" for name, ex in examples[:MAX_EXAMPLES]]


def _seconds(value) -> str:
    """A duration: whole seconds without a fraction (1,800, not 1800.0)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return fmt(value)


def _workers(run: dict) -> str:
    workers = run.get("workers") or []
    if not workers:
        return "-"
    return f"{len(workers)}: " + ", ".join(
        f"{w.get('pool', '?')} x{w.get('concurrency', '?')}" for w in workers
    )


def _faults_total(faults: dict) -> str:
    return f"{fmt(sum(faults.values()))} ({len(faults)} kinds)" if faults else "0"


def _randomized_lines(runs: list[dict]) -> list[str]:
    lines = [
        "## Randomized runs",
        "",
        "Generated by `make nemesis` (`scripts/nemesis.py`; reproducible from its seed as far "
        "as the schedule goes: what the client sends and which fault fires when; the "
        "interleavings of real processes are not). Worker processes of mixed pools run step "
        "tasks with duplicates, compensations, retries and resumes, and the distributed "
        "patterns, while a nemesis injects random faults, several at once. The whole history "
        "is checked by `tests/support/faults/runcheck.py`: per step one terminal commit, a "
        "legal chain, fences never decreasing and no commit after a newer holder's grant; no "
        "lock-store key without a TTL; rate limits never exceeded in any window; concurrency "
        "limits never exceeded (a paused holder's slot may pass on); no idempotent body run "
        "after its completion. *Limits after data loss*: a rate, concurrency or idempotency "
        "limit exceeded with a lock-store data loss inside the window (a Redis restart, a "
        "failover to a replica that missed the latest writes, a split brain): what the "
        "patterns' pages document, no limit kept in an asynchronously replicated store can do "
        "better, listed apart, never dropped; the step checks have no such exception. "
        "*Leftovers*: leases or slots still held once the run healed. "
        "*Recovery*: seconds from a lasting fault's heal to the next committed transition of "
        "any step (how long the system stayed stuck, not a per-step figure). *Step "
        "executions*: task runs that took or met a step lease (of them, the lease grants in "
        "the faults list below). *Fence refusals*: commits the fencing token alone refused "
        "in the database (the status matched again: a holder paused between its check and "
        "its UPDATE while newer holders moved the step away and back). Without the fence "
        "(`--guard nofence`) the pre-commit ownership check in Redis still refuses those "
        "holders, so that control shows no step violation in a randomized run; the fence "
        "alone deciding is the deterministic `fence-split` rows' proof. Since December 2026 "
        "a run also judges the circuit breaker (no call while open beyond the state cache, at most `half_open_probes` "
        "probes at once), the effects outbox (each committed transition's effects applied "
        "exactly once, none of a refused attempt), the HTTP idempotency layer (one body per "
        "key and principal, no replay across principals), a writer outside Celery through "
        "the guarded transition, and periodic runs under the overlap guard (never two at "
        "once), on the lock-store topology named in the table. "
        "The negative control is the same seed with that pattern's guard turned off "
        "(`STEPLOCK_FAULTS_UNGUARDED=1` for the step guard in the older rows); each must be "
        "caught by its own rule.",
        "",
    ]
    if not runs:
        return lines + ["No randomized run recorded yet."]
    lines += [
        "| seed | duration s | started | commit | lock store | workers | step executions | "
        "faults | violations | limits after data loss | leftovers | fence refusals | "
        "recovery p50 s | recovery max s | negative control: seed, duration s, violations |",
        "|--:|--:|---|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for run in runs:
        neg = run.get("negative_control")
        controls = run.get("negative_controls")
        if controls:
            caught = sum(1 for c in controls if c.get("violations"))
            neg_text = f"{len(controls)} controls, {caught} caught (below)"
        elif neg:
            neg_text = (
                f"{neg.get('seed')}, {_seconds(neg.get('duration_s'))}, "
                f"**{fmt(neg.get('violations'))}**"
            )
        else:
            neg_text = "-"
        lines.append(
            f"| {run.get('seed')} | {_seconds(run.get('duration_s'))} | {run.get('started') or '-'} | "
            f"{run.get('commit') or '-'} | {_topology(run)} | {_workers(run)} | "
            f"{fmt(run.get('executions'))} | "
            f"{_faults_total(run.get('faults') or {})} | **{fmt(run.get('violations'))}** | "
            f"{fmt(run.get('data_loss', 0))} | {fmt(run.get('leftovers'))} | "
            f"{fmt(run.get('fence_refusals'))} | {fmt(run.get('recovery_p50_s'))} | "
            f"{fmt(run.get('recovery_max_s'))} | {neg_text} |"
        )
    with_controls = [r for r in runs if _controls(r)]
    if with_controls:
        lines += [
            "",
            "Negative controls, one per pattern, each on its run's seed (the run with that "
            "pattern's guard turned off; the checker must report violations):",
            "",
            "| run seed | lock store | control | duration s | step executions | violations | "
            "by rule |",
            "|--:|---|---|--:|--:|--:|---|",
        ]
        for run in with_controls:
            for c in _controls(run):
                by_rule = ", ".join(f"{k} {fmt(v)}" for k, v in (c.get("by_rule") or {}).items())
                lines.append(
                    f"| {run.get('seed')} | {_topology(run)} | {c.get('control') or '-'} | "
                    f"{_seconds(c.get('duration_s'))} | {fmt(c.get('executions'))} | "
                    f"**{fmt(c.get('violations'))}** | {by_rule or '-'} |"
                )
    lines += ["", "Faults by kind:", ""]
    for run in runs:
        kinds = ", ".join(f"{k} {fmt(v)}" for k, v in sorted((run.get("faults") or {}).items()))
        grants = f"; {fmt(run['acquired'])} lease grants" if run.get("acquired") else ""
        lines.append(
            f"- seed {run.get('seed')}, {_seconds(run.get('duration_s'))} s: {kinds or 'none'}"
            f"{grants}"
        )
        neg = run.get("negative_control")
        if neg and neg.get("faults"):
            kinds = ", ".join(f"{k} {fmt(v)}" for k, v in sorted(neg["faults"].items()))
            lines.append(
                f"- seed {neg.get('seed')}, {_seconds(neg.get('duration_s'))} s (negative control): "
                f"{kinds}"
            )
    return lines


def _controls(run: dict) -> list[dict]:
    """The negative controls of a run to list per rule: all of ``negative_controls``, else its
    one ``negative_control`` when that was judged per rule (older runs' were not)."""
    if run.get("negative_controls"):
        return run["negative_controls"]
    neg = run.get("negative_control") or {}
    return [neg] if neg.get("by_rule") else []


def _topology(run: dict) -> str:
    """The lock store's topology, with the broker and step database when not the default."""
    parts = [run.get("store") or "single"]
    if run.get("broker") not in (None, "redis"):
        parts.append(f"{run['broker']} broker")
    if run.get("database") not in (None, "postgresql"):
        parts.append(run["database"])
    return ", ".join(parts)


def _randomized_examples(runs: list[dict]) -> list[str]:
    lines = []
    for run in runs:
        store = f", {run['store']}" if run.get("store") else ""
        label = f"nemesis seed {run.get('seed')}, {_seconds(run.get('duration_s'))} s{store}"
        lines += [f"- {label}: {ex}" for ex in (run.get("examples") or [])[:MAX_RUN_EXAMPLES]]
        lines += [
            f"- {label} (a limit after a data loss): {ex}"
            for ex in (run.get("data_loss_examples") or [])[:MAX_RUN_EXAMPLES]
        ]
        controls = run.get("negative_controls") or [run.get("negative_control") or {}]
        per_control = MAX_RUN_EXAMPLES if len(controls) == 1 else 2
        for neg in controls:
            what = (
                f"negative control: {neg['control']}" if neg.get("control") else "negative control"
            )
            # the control's own duration: it may be shorter than the guarded run's
            seconds = neg.get("duration_s") or run.get("duration_s")
            neg_label = f"nemesis seed {run.get('seed')}, {_seconds(seconds)} s{store}"
            lines += [
                f"- {neg_label} ({what}): {ex}" for ex in (neg.get("examples") or [])[:per_control]
            ]
    return lines


def _error_of(row: dict) -> str:
    """The first error of a soak row's examples, without the lab state it ends with."""
    for example in row.get("examples") or ():
        if example.startswith("error: "):
            return example[len("error: ") :].split(" (queue ", 1)[0]
    return "no message kept"


def render(doc: dict) -> str:
    """docs/reliability.md of ``doc`` (either shape): the deterministic table, the randomized
    runs with their negative controls, then examples of what the checkers reported."""
    doc = normalize(doc)
    result, runs = doc["deterministic"], doc["randomized"]
    lines = [
        "# Reliability under faults",
        "",
        "Generated by `make soak` (`scripts/soak.py`; the scenarios are in "
        "`tests/support/faults/scenarios.py`, the invariants in "
        "`tests/support/faults/checker.py`, and "
        "`tests/faults` runs each once in `make test`). Every figure is also in "
        "`reliability.json` beside this file.",
        "",
    ]
    if result is None:
        lines.append("No deterministic soak recorded yet.")
    else:
        lines += _deterministic_lines(result)
    lines += ["", *_randomized_lines(runs)]
    examples = (_deterministic_examples(result) if result else []) + _randomized_examples(runs)
    if examples:
        lines += ["", "## Examples of what the checker reported", "", *examples]
    return "\n".join(lines) + "\n"


def headline(doc: dict) -> str:
    """One sentence of the figures (for the README): trials and violations of the
    deterministic soak, and of the latest randomized run with its negative control."""
    doc = normalize(doc)
    parts = []
    result = doc["deterministic"]
    if result:
        rows = result["scenarios"].values()
        neg = result["negative_control"].values()
        parts.append(
            f"{len(result['scenarios'])} deterministic fault scenarios x {result['trials']} "
            f"trials: {fmt(sum(r['trials'] for r in rows))} trials, "
            f"{fmt(sum(r['violations'] for r in rows))} violations (negative control: "
            f"violations in {sum(r['violating_trials'] for r in neg)} of "
            f"{sum(r['trials'] for r in neg)} trials)"
        )
    if doc["randomized"]:
        run = doc["randomized"][-1]
        faults = run.get("faults") or {}
        text = (
            f"a {_seconds(run.get('duration_s'))} s randomized run (seed {run.get('seed')}): "
            f"{fmt(run.get('executions'))} step executions, {fmt(sum(faults.values()))} faults "
            f"of {len(faults)} kinds, {fmt(run.get('violations'))} violations, "
            f"{fmt(run.get('leftovers'))} leftovers"
        )
        if run.get("data_loss"):
            text += f", {fmt(run['data_loss'])} limits exceeded after a lock-store data loss"
        neg = run.get("negative_control")
        if neg:
            text += f" (negative control: {fmt(neg.get('violations'))} violations)"
        parts.append(text)
    return "; ".join(parts) + "." if parts else "No reliability figures recorded yet."


def main(argv=None) -> int:
    """``python -m tests.support.faults.report --run DIR [--negative DIR ...]``: add a
    randomized run (and its negative controls) to docs/reliability.md/.json, keeping the
    rest."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="the guarded run's directory")
    parser.add_argument(
        "--negative",
        type=Path,
        action="append",
        default=None,
        help="a negative control's directory (repeatable: one per pattern, same seed)",
    )
    parser.add_argument("--docs", type=Path, default=None, help="default: the repository's docs/")
    args = parser.parse_args(argv)
    doc = update(randomized_run=summarize(args.run, args.negative), docs=args.docs)
    print(headline(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
