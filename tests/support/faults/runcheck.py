"""The checker of a whole randomized fault run (``scripts/nemesis.py``): reads a run directory
and judges every step, every limit and every idempotency key of it at once.

A run directory holds ``history.jsonl`` (or ``history.jsonl.gz``: the control Redis list
``faults:history``, one JSON object a line, in list order), ``steps.json`` (step id -> final
status), ``records.json`` (the committed transitions in id order), ``store.json`` (lock-store
keys without a TTL and lease or slot keys left once the run settled) and ``run.json`` (seed,
duration, workers, TTL, the configured limits, faults by kind). The checks:

- per step, those of :func:`checker.check_step` and :func:`checker.stale_commits` (one
  terminal commit, a legal chain, fences never decreasing, no commit after a newer holder's
  grant), on the step's own history entries (indexed once: a run has ~200k entries); a grant
  made while the lock store was split (``split_brain``: two primaries) orders nothing against
  a holder on the other side, so the grant-order check skips it, and the write order (fences
  never decreasing, one terminal commit) is what must hold;
- no lock-store key without a TTL; no lease or slot left (``leftovers``, apart from the
  violations, as the deterministic soak keeps them);
- per rate key, at most ``limit`` grants (by ``granted_at``, the Redis time of the grant) in
  any half-open window ``[x, x + window)``, exactly, over every ``x``;
- per concurrency key, at most ``N`` slots held at once, a hold ending at its release or
  expiry, at a SIGKILL or SIGSTOP of its process (a paused holder's slot may pass on: an
  overlap as the holder saw it, not a violation) or at the end of its task run;
- per idempotency key, no body started after a completion was recorded, and at most one
  completion;
- per circuit breaker (:func:`check_breakers`, on the ``dep_call`` / ``dep_done`` entries of
  the calls of its dependency and its ``breaker`` state changes): no call admitted once the
  breaker had opened, beyond what its state cache lets through (an admission of the closed
  generation the opening ended, starting ``state_cache`` seconds or more after the open was
  recorded, or at once in the process that opened it), no call without an admission while
  it was open, and at most ``half_open_probes`` probes at once (a probe holding its permit
  from its ``dep_call`` to its ``breaker_outcome``, the end of its task run, a kill of its
  process or ``probe_timeout`` after its admission began: its permit expired then).

A pattern limit exceeded with a lock-store data loss inside it (a Redis restart, a failover to
a replica that missed the latest writes, a split brain: a rate log, a slot or an idempotency
record lost with Redis's data lets more through; no limit kept in an asynchronously replicated
store can do better, and the patterns' pages say so) is not a violation of what the library
claims: it goes to ``data_loss`` (its message ends with ``; after <kind> at <t>``; counted in
``counts["after_data_loss"]``), reported beside the violations, never dropped. The step
checks have no such exception: a duplicate commit is a violation whatever Redis lost.

``python -m tests.support.faults.runcheck DIR [--write | --no-write]`` prints the verdict
(summary lines, then its JSON) and stores it as ``DIR/verdict.json`` (the run directory's
contract: the runner calls it without options; ``--write`` says so explicitly, ``--no-write``
only prints); exit status 1 on violations or leftovers.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.faults import clock
from tests.support.faults import loads
from tests.support.faults.checker import (
    TERMINAL,
    Applied,
    EffectRow,
    EffectVerdict,
    Record,
    check_effects,
    check_step,
    stale_commits,
)

KILL_SIGNALS = ("SIGKILL", "SIGQUIT")
STOP_SIGNALS = KILL_SIGNALS + ("SIGSTOP",)
MICRO = 1_000_000  # rate windows are compared in whole microseconds: no float rounding
#: History entries the heartbeat thread writes (django_app/faults/probe.py), not the task.
HEARTBEAT_NOTES = ("heartbeat_frozen", "heartbeat_thawed")
#: Seconds between the stall of a replica's feed and the ``lag`` its fault entry tells.
LAG_SLACK = 0.5
MAX_NAMED = 5  # owners or keys named in one message
# faults after which Redis may have lost data: a rate log, a slot or an idempotency record
# lost with it lets one more through (the patterns' documented limit); a message says so
DATA_LOSS = ("redis_restart", "redis_failover", "split_brain")


@dataclass
class Run:
    """A run directory's content; ``steps`` and the records' ``step`` are ints where the ids
    are numeric."""

    history: list[dict]
    steps: dict
    records: list[Record]
    store: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    path: Path | None = None
    effects: dict | None = (
        None  # effects.json of an outbox workload (tests/support/faults/outbox.py)
    )
    http: list | None = None  # http.jsonl: the HTTP load's responses (faults/loads.py)


@dataclass
class RunVerdict:
    """``violations`` and ``leftovers`` are messages (a leftover names one lease or slot key,
    ``leftover`` holds those keys); ``counts`` maps a name to an int or, for ``faults``, a dict kind -> int; ``recovery``
    holds seconds from each lasting fault's heal to the next committed transition."""

    violations: list[str] = field(default_factory=list)
    data_loss: list[str] = field(default_factory=list)  # limits exceeded after a data loss
    leftovers: list[str] = field(default_factory=list)
    leftover: list[str] = field(default_factory=list)
    counts: dict = field(default_factory=dict)
    recovery: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations and not self.leftovers

    def as_dict(self) -> dict:
        return {
            "ok": self.ok,
            "violations": list(self.violations),
            "data_loss": list(self.data_loss),
            "leftovers": list(self.leftovers),
            "leftover": list(self.leftover),
            "counts": dict(self.counts),
            "recovery": dict(self.recovery),
        }


def _id(value):
    """A step id as an int where it is one (JSON object keys are strings)."""
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return value
    return value


def _read_json(path: Path, default):
    return json.loads(path.read_text()) if path.exists() else default


def read_history(path: Path) -> list[dict]:
    """The entries of ``history.jsonl`` or, when only that exists, ``history.jsonl.gz``
    (``path`` is the directory)."""
    plain, packed = path / "history.jsonl", path / "history.jsonl.gz"
    if plain.exists():
        lines = plain.read_text().splitlines()
    elif packed.exists():
        with gzip.open(packed, "rt") as f:
            lines = f.read().splitlines()
    else:
        raise FileNotFoundError(f"{path}: no history.jsonl or history.jsonl.gz")
    return [json.loads(line) for line in lines if line.strip()]


def load(path) -> Run:
    """The :class:`Run` of a run directory (``str`` or ``Path``). Raises FileNotFoundError
    without a history or a ``steps.json``; a missing ``records.json``, ``store.json`` or
    ``run.json`` reads as empty."""
    path = Path(path)
    steps_file = path / "steps.json"
    if not steps_file.exists():
        raise FileNotFoundError(f"{path}: no steps.json")
    records = [
        Record(
            step=_id(r["step"]),
            from_status=r["from_status"],
            to_status=r["to_status"],
            owner=r["owner"],
            fence=r.get("fence"),
        )
        for r in _read_json(path / "records.json", [])
    ]
    return Run(
        history=read_history(path),
        steps={_id(k): v for k, v in json.loads(steps_file.read_text()).items()},
        records=records,
        store=_read_json(path / "store.json", {}),
        meta=_read_json(path / "run.json", {}),
        path=path,
        effects=_read_json(path / "effects.json", None),
        http=[json.loads(x) for x in (path / "http.jsonl").read_text().splitlines() if x.strip()]
        if (path / "http.jsonl").exists()
        else None,
    )


def dump(run: Run, path, packed: bool = False) -> Path:
    """Write ``run`` as a run directory at ``path`` (created; ``packed``: the history as
    ``history.jsonl.gz``); returns the directory. The inverse of :func:`load`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(e, sort_keys=True) + "\n" for e in run.history)
    if packed:
        with gzip.open(path / "history.jsonl.gz", "wt") as f:
            f.write(text)
    else:
        (path / "history.jsonl").write_text(text)
    files = {
        "steps.json": {str(k): v for k, v in run.steps.items()},
        "records.json": [
            {
                "step": r.step,
                "from_status": r.from_status,
                "to_status": r.to_status,
                "owner": r.owner,
                "fence": r.fence,
            }
            for r in run.records
        ],
        "store.json": {"keys_without_ttl": [], "leftover": [], **run.store},
        "run.json": run.meta,
    }
    for name, content in files.items():
        (path / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    if run.http is not None:
        (path / "http.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run.http))
    return path


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0 to 1) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _short(owner) -> str:
    return str(owner)[:8] if owner else "?"


def _pids(entry) -> list:
    pid = entry.get("pid")
    return pid if isinstance(pid, list) else [pid]


class _Index:
    """The history grouped once: per step, per pid's stops and task ends, per limit key."""

    def __init__(self, history: list[dict]):
        self.by_step: dict = defaultdict(list)
        self.stops: dict = defaultdict(list)  # pid -> times of a SIGKILL/SIGQUIT/SIGSTOP
        self.kills: dict = defaultdict(list)  # pid -> times of a SIGKILL/SIGQUIT
        self.ends_by_pid: dict = defaultdict(list)  # pid -> task_end times
        self.ends_by_task: dict = defaultdict(list)  # (task_id, pid) -> task_end times
        self.commits: list[float] = []
        self.heals: list[dict] = []
        self.faults: Counter = Counter()
        self.rate: dict = defaultdict(list)
        self.slots: dict = defaultdict(list)
        self.idem: dict = defaultdict(list)
        self.executions = 0
        self.acquired = 0
        self.breaker: Counter = Counter()
        self.breaker_states: dict = defaultdict(list)  # name -> opened/half_open/closed entries
        self.dep_calls: dict = defaultdict(list)  # name -> dep_call entries
        self.dep_done: dict = defaultdict(list)  # (task_id, pid) -> dep_done times
        self.outcomes: dict = defaultdict(list)  # (task_id, pid) -> breaker_outcome times
        self.split_notes: dict = {}  # split fault time -> its entry (minority/majority paths)
        self.continued: dict = defaultdict(list)  # pid -> SIGCONT times
        self.data_loss: list[tuple[float, str]] = []
        self.lost_at: dict = {}  # owner -> first "lost" (a slot's: the heartbeat found it gone)
        self.clock_ahead: list[tuple[float, float]] = []  # (t, skew s) of clock_ahead faults
        refusals: set = set()
        times_by_pid: dict = defaultdict(list)  # pid -> times of its own entries
        for i, e in enumerate(history):
            ev = e.get("ev")
            step = e.get("step")
            if isinstance(e.get("pid"), int) and ev not in ("fault", "heal"):
                times_by_pid[e["pid"]].append(e["t"])
            if step is not None:
                normal = _id(step)
                if normal != step:
                    e = {**e, "step": normal}
                self.by_step[normal].append(e)
                if ev in ("acquired", "contended"):
                    self.executions += 1
                if ev == "acquired":
                    self.acquired += 1
            if ev == "lost" and e.get("owner"):
                self.lost_at.setdefault(e["owner"], e["t"])
            if ev == "fault":
                if not e.get("follow_up") and not e.get("extends"):
                    # a supervisor's clean-up of one injection, or one made longer, is no new one
                    self.faults[e.get("kind") or e.get("signal") or "?"] += 1
                if e.get("kind") in DATA_LOSS:
                    self.data_loss.append((e["t"], e["kind"]))
                if e.get("kind") == "clock_ahead":
                    self.clock_ahead.append((e["t"], float(e.get("skew") or 0.0)))
                if e.get("kind") == "split_brain":
                    self.split_notes[e["t"]] = e
                if e.get("signal") in STOP_SIGNALS and e.get("pid"):
                    for pid in _pids(e):
                        self.stops[pid].append(e["t"])
                        if e["signal"] in KILL_SIGNALS:
                            self.kills[pid].append(e["t"])
            elif ev == "heal":
                self.heals.append(e)
                if e.get("signal") == "SIGCONT" and e.get("pid") is not None:
                    self.continued[e["pid"]].append(e["t"])
            elif ev == "committed":
                self.commits.append(e["t"])
            elif ev == "task_end":
                if e.get("pid") is not None:
                    self.ends_by_pid[e["pid"]].append(e["t"])
                if e.get("task_id"):
                    self.ends_by_task[(e["task_id"], e.get("pid"))].append(e["t"])
            elif ev in ("conflict", "lost") and _fence_refused(e):
                refusals.add((e.get("step"), e.get("owner")))
            elif ev == "rate_granted":
                self.rate[e.get("key")].append(e)
            elif ev in ("slot_acquired", "slot_released", "slot_expired"):
                self.slots[e.get("limit_key")].append((i, e))
            elif ev in ("idem_body", "idem_completed", "idem_replayed"):
                self.idem[e.get("key")].append((i, e))
            elif ev == "breaker":
                self.breaker[e.get("what") or "?"] += 1
                if e.get("what") in ("opened", "half_open", "closed"):
                    self.breaker_states[e.get("name")].append(e)
            elif ev == "dep_call":
                self.dep_calls[e.get("name")].append(e)
            elif ev == "dep_done":
                self.dep_done[(e.get("task_id"), e.get("pid"))].append(e["t"])
            elif ev == "breaker_outcome":
                self.outcomes[(e.get("task_id"), e.get("pid"))].append(e["t"])
        self.fence_refusals = len(refusals)
        # A kill is noted just before the signal is sent: on a loaded host the process may
        # still write entries after the note, so it died no earlier than its last entry.
        for pid, kills in self.kills.items():
            mine = sorted(times_by_pid.get(pid, []))
            moved = []
            ordered = sorted(kills)
            for n, t in enumerate(ordered):
                nxt = ordered[n + 1] if n + 1 < len(ordered) else float("inf")
                later = [x for x in mine[bisect.bisect_right(mine, t) :] if x < nxt]
                moved.append((t, max(later) if later else t))
            for old_t, new_t in moved:
                if new_t != old_t:
                    kills[kills.index(old_t)] = new_t
                    stops = self.stops[pid]
                    stops[stops.index(old_t)] = new_t
        for table in (
            self.stops,
            self.kills,
            self.ends_by_pid,
            self.ends_by_task,
            self.continued,
            self.dep_done,
            self.outcomes,
        ):
            for times in table.values():
                times.sort()
        self.commits.sort()
        self.data_loss.sort()
        # split-brain intervals: from the split to its heal; one never healed lasts to the
        # end of the history and is itself a violation (check_run)
        healed = {h.get("fault_t"): h["t"] for h in self.heals if h.get("kind") == "split_brain"}
        end = max((e.get("t", 0.0) for e in history), default=0.0)
        self.unhealed = [
            t for t, kind in self.data_loss if kind == "split_brain" and t not in healed
        ]
        # delays on the database path: a COMMIT sent inside one lands some time later
        self.db_delays = sorted(
            (h["fault_t"], h["t"])
            for h in self.heals
            if h.get("kind") in ("pg_latency", "pg_blackhole") and h.get("fault_t") is not None
        )
        self.lost_replies = self._lost_replies(history)
        self.splits = sorted(
            (t, healed.get(t, end)) for t, kind in self.data_loss if kind == "split_brain"
        )

    def _lost_replies(self, history: list[dict]) -> dict:
        """owner -> when it sent COMMIT, for the owners whose COMMIT reply a
        ``lost_commit_reply`` fault may have dropped: the proxy forwards each COMMIT at once
        and drops the next reply of every connection until the heal, so a commit sent in
        that window whose owner never noted its reply (``committed``) landed when it was
        sent, at its ``before_commit`` point."""
        replied = {e.get("owner") for e in history if e.get("ev") == "committed"}
        points = sorted(
            (e["t"], e.get("owner"))
            for e in history
            if e.get("ev") == "point" and e.get("point") == "before_commit" and e.get("owner")
        )
        times = [t for t, _ in points]
        found = {}
        for h in self.heals:
            if h.get("kind") != "lost_commit_reply" or h.get("fault_t") is None:
                continue
            begin = bisect.bisect_left(times, h["fault_t"])
            for t, owner in points[begin : bisect.bisect_right(times, h["t"])]:
                if owner not in replied:
                    found.setdefault(owner, t)
        return found

    def split_at(self, t: float) -> tuple[float, float] | None:
        """The split (start, heal) the lock store was in at ``t``, or None."""
        for start, end in self.splits:
            if start <= t <= end:
                return start, end
        return None

    def sides_differ(self, split_start: float, a: dict, b: dict) -> bool:
        """Whether grants ``a`` and ``b`` were made on different sides of the split that
        began at ``split_start``: by the lock-store path (``via``, the port of the worker's
        proxy) each grant records and the split's note of each side's paths. Without that
        information (an older history), assumed different."""
        note = self.split_notes.get(split_start) or {}
        minority = set(note.get("minority_via") or ())
        if not minority or a.get("via") is None or b.get("via") is None:
            return True
        return (a["via"] in minority) != (b["via"] in minority)

    def on_minority(self, split: tuple[float, float], grant: dict) -> bool | None:
        """Whether ``grant``'s lock-store path (its ``via``) is among the minority's paths of
        ``split`` (start, heal) (the split note's ``minority_via``): during the split it talks
        to the primary the heal discards. None without that information."""
        note = self.split_notes.get(split[0]) or {}
        if not note.get("minority_via") or grant.get("via") is None:
            return None
        return grant["via"] in set(note["minority_via"])

    def stopped_for(self, pid, start: float, at_least: float) -> float | None:
        """The first stop (SIGKILL/SIGQUIT/SIGSTOP) of ``pid`` at or after ``start`` that ended
        the hold: a kill, or a SIGSTOP that lasted ``at_least`` seconds (until its SIGCONT;
        never continued: it lasted). A shorter pause ended nothing: the holder went on with
        its lease or slot still valid."""
        for t in self.stops.get(pid, [])[bisect.bisect_left(self.stops.get(pid, []), start) :]:
            if t in self.kills.get(pid, []):
                return t
            cont = self.first_at_or_after(self.continued.get(pid, []), t)
            if cont is None or cont - t >= at_least:
                return t
        return None

    @staticmethod
    def first_at_or_after(times: list[float], start: float) -> float | None:
        i = bisect.bisect_left(times, start)
        return times[i] if i < len(times) else None

    def explained(self, times: list[float], limit: int, start: float, end: float) -> str:
        """A note naming the lock-store data loss that explains ``times`` (the grants or
        holders' starts of one window or peak, in ``[start, end]``) exceeding ``limit``, or
        "" when none does. A loss at ``t`` (restart, stale failover) makes the store forget
        what came before: each stretch between losses may hold up to ``limit``, no more; a
        split brain lets each of its two primaries hold ``limit``."""
        losses = [t for t, kind in self.data_loss if kind != "split_brain" and start <= t <= end]
        splits = [s for s, e in self.splits if s <= end and e >= start]
        if not losses and not splits:
            return ""
        cap = limit * (2 if splits else 1)
        cuts = [start] + losses + [end + 1e-9]
        for lo, hi in zip(cuts, cuts[1:]):
            if sum(1 for t in times if lo <= t < hi) > cap:
                return ""
        if losses:
            kind = next(k for t, k in self.data_loss if t == losses[-1])
            return f"; after {kind} at {losses[-1]:.3f}"
        return f"; after split_brain at {splits[-1]:.3f}"

    def data_loss_note(self, start: float, end: float) -> str:
        """ "" or a note naming the last Redis data-loss fault in ``[start, end]``, or a split
        brain that lasted into it."""
        i = bisect.bisect_right(self.data_loss, (end, "\uffff")) - 1
        if i >= 0 and self.data_loss[i][0] >= start:
            t, kind = self.data_loss[i]
            return f"; after {kind} at {t:.3f}"
        for split_start, split_end in self.splits:
            if split_start <= end and split_end >= start:
                return f"; after split_brain at {split_start:.3f}"
        return ""

    def task_end_after(self, entry: dict, start: float) -> float | None:
        """The end of the task run of ``entry`` at or after ``start``: by its task id and pid
        when it has a task id (a threads pool runs several tasks in one pid; a same-id
        duplicate runs in another process), else by its pid."""
        ident = (entry.get("task_id"), entry.get("pid"))
        if ident[0] and ident in self.ends_by_task:
            return self.first_at_or_after(self.ends_by_task[ident], start)
        return self.first_at_or_after(self.ends_by_pid.get(entry.get("pid"), []), start)


def _fence_refused(entry: dict) -> bool:
    """A conflict whose reason (or ``stale_fence``) says the fenced compare-and-swap refused,
    or the loss the task reports after it ("... carries a newer fencing token ...")."""
    reason = str(entry.get("reason") or "").lower()
    if entry.get("ev") == "conflict":
        return bool(entry.get("stale_fence")) or "fence" in reason
    return "newer fencing token" in reason


def _earliest(*times):
    present = [t for t in times if t is not None]
    return min(present) if present else None


def _lease_spans(index: _Index, group: list[dict], end_of_run: float) -> list[tuple]:
    """(start, end) of each owner's hold of one step, as :func:`checker.lease_intervals`
    defines it (a SIGSTOP does not end it: a paused holder still believes it holds)."""
    started, first, ended = {}, {}, {}
    for e in group:
        owner = e.get("owner")
        if not owner:
            continue
        if e.get("ev") == "acquired" and owner not in started:
            started[owner] = e["t"]
            first[owner] = e
        elif e.get("ev") in ("released", "lost", "conflict") and owner in started:
            ended.setdefault(owner, e["t"])
    spans = []
    for owner, start in started.items():
        entry = first[owner]
        stop = _earliest(
            ended.get(owner),
            index.first_at_or_after(index.kills.get(entry.get("pid"), []), start),
            index.task_end_after(entry, start),
        )
        spans.append((start, stop if stop is not None else end_of_run))
    return sorted(spans)


def _commits_in_history(
    group: list[dict], records: list[Record], index: _Index | None = None
) -> list[dict]:
    """The step's history with a ``committed`` entry for every record that has none (a lost
    COMMIT reply, a kill after COMMIT: the on-commit callback never ran), dated at the
    owner's last entry on the step: the commit came no earlier than that. A ``committed``
    entry is written when COMMIT's reply came back; with a delay on the database path between
    the owner's ``before_commit`` point (its ownership check passed, COMMIT sent next) and
    that reply, the commit landed somewhere in between: it is dated at the point, the
    earliest it can have been (a grant after it orders nothing against it). So is the commit
    whose reply a ``lost_commit_reply`` fault dropped (``_Index.lost_replies``): the owner's
    later entries, such as its heartbeat's loss of a lease it could not release, came while
    it waited for that reply."""
    lost_replies = index.lost_replies if index is not None else {}
    if index is not None and index.db_delays:
        points = {
            e.get("owner"): e["t"]
            for e in group
            if e.get("ev") == "point" and e.get("point") == "before_commit"
        }
        dated = []
        for e in group:
            sent = points.get(e.get("owner")) if e.get("ev") == "committed" else None
            if sent is not None and any(a <= e["t"] and b >= sent for a, b in index.db_delays):
                e = {**e, "t": sent, "reply_t": e["t"]}
            dated.append(e)
        group = dated
    seen = {e.get("owner") for e in group if e.get("ev") == "committed"}
    added = []
    for r in records:
        if r.owner and r.owner not in seen:
            # the heartbeat thread's own notes (a frozen renewal thawed long after the task
            # ended) say nothing of when the task committed
            mine = [
                e
                for e in group
                if e.get("owner") == r.owner and e.get("ev") not in HEARTBEAT_NOTES
            ]
            if mine:
                last = min(
                    max(e.get("t", 0.0) for e in mine), lost_replies.get(r.owner, float("inf"))
                )
                added.append(
                    {
                        "ev": "committed",
                        "t": last,
                        "step": r.step,
                        "owner": r.owner,
                        "fence": r.fence,
                        "synthetic": True,
                    }
                )
            seen.add(r.owner)
    return group + added


def _check_group(index: _Index, step, status, records: list[Record], group, end_of_run, ttl=0.0):
    problems = check_step(step, status, records)
    fences_by_owner: dict = {}
    for r in records:
        if r.fence is not None:
            fences_by_owner.setdefault(r.fence, set()).add(r.owner)
    for fence, owners in sorted(fences_by_owner.items()):
        if len(owners) > 1:
            problems.append(
                f"step {step}: one fencing token {fence} written by {len(owners)} owners "
                f"({', '.join(sorted(_short(o) for o in owners))})"
            )
    history = _commits_in_history(group, records, index)
    # A grant made while the store was split happened on one of two primaries: it orders
    # nothing against a holder on the other side, whose lease was valid there, until the
    # heal (plus a TTL: the minority's lease ran out by then). What the fence guarantees
    # then is the write order (fences never decrease, one terminal commit: check_step).
    first_grant: dict = {}
    for g in history:
        if g.get("ev") == "acquired" and g.get("owner"):
            first_grant.setdefault(g["owner"], g)

    def on_the_other_primary(commit: dict, grant: dict) -> bool:
        split = index.split_at(grant["t"])
        mine = first_grant.get(commit["owner"])
        return (
            split is not None
            and commit["t"] <= split[1] + ttl
            and (mine is None or index.sides_differ(split[0], mine, grant))
        )

    def discarded_at_the_heal(commit: dict, grant: dict) -> bool:
        # A grant made during a split on a minority path lived on the primary the heal
        # discards: it orders nothing, at any time, against a holder whose lease lives on the
        # primary the heal keeps: renewed there during the split (a majority path), granted
        # there during the split or before it early enough to have been replicated (before
        # the replica's feed stalled).
        split = index.split_at(grant["t"])
        mine = first_grant.get(commit["owner"])
        if split is None or mine is None or index.on_minority(split, grant) is not True:
            return False
        if index.on_minority(split, mine) is not False:
            return False
        lag = float((index.split_notes.get(split[0]) or {}).get("lag") or 0.0)
        return mine["t"] >= split[0] or mine["t"] < split[0] - lag - LAG_SLACK

    released_at = {e.get("owner"): e["t"] for e in history if e.get("ev") == "released"}

    def freed_by_its_release(commit: dict, grant: dict) -> bool:
        # A commit without its ``committed`` entry (a lost COMMIT reply) is dated at its
        # owner's last entry, which may be the ``released`` entry, written after the release.
        # A newer grant less than a TTL after the owner's own grant, by the lock store's clock
        # (fences are its microseconds), found the key free before it could expire: the owner
        # had released it, after its transaction ended, so the commit came first (unless the
        # store lost its data meanwhile).
        mine = first_grant.get(commit["owner"])
        if not commit.get("synthetic") or mine is None or ttl <= 0:
            return False
        # A ``released`` entry is written only when the owner-checked delete deleted the key:
        # the owner held it without a break until then, so every newer grant on that store
        # came after the delete, which came after the commit (barring a data loss or split).
        freed = released_at.get(commit["owner"])
        if (
            freed is not None
            and grant["t"] <= freed
            and index.split_at(grant["t"]) is None
            and not any(mine["t"] - ttl <= t <= freed for t, _ in index.data_loss)
        ):
            return True
        own, newer = mine.get("fence") or 0, grant.get("fence") or 0
        if not own or not 0 < newer - own < ttl * 1e6:
            return False
        return not any(mine["t"] - ttl <= t <= grant["t"] for t, _ in index.data_loss)

    problems.extend(
        stale_commits(
            step,
            history,
            excused=lambda c, g: (
                on_the_other_primary(c, g)
                or discarded_at_the_heal(c, g)
                or freed_by_its_release(c, g)
            ),
        )
    )
    spans = _lease_spans(index, group, end_of_run)
    overlap = any(b[0] < a[1] for a, b in zip(spans, spans[1:]))
    fences = {
        e["owner"]: e.get("fence") or 0
        for e in group
        if e.get("ev") == "acquired" and e.get("owner")
    }
    newest = max(fences.values(), default=0)
    reached_cas = {
        e.get("owner")
        for e in group
        if e.get("ev") == "point" and e.get("point") == "before_cas" and e.get("owner")
    }
    refused = {
        e["owner"]
        for e in group
        if e.get("ev") in ("conflict", "lost")
        and e.get("owner")
        and fences.get(e["owner"], newest) < newest
        and e["owner"] in reached_cas
    }
    committed = {r.owner for r in records}
    stale_rejected = bool(committed and refused - committed)
    return problems, overlap, stale_rejected


_WINDOW = re.compile(r"^(\d+)/(\d+(?:\.\d+)?)s window$")


def _window_of(description) -> dict | None:
    """The limit of a sliding window's description (``"10/1s window"``); None for another
    kind (a token bucket bounds no fixed window)."""
    match = _WINDOW.match(str(description or ""))
    return {"limit": int(match[1]), "window": float(match[2])} if match else None


def check_rates(grants: dict, limits: dict, index: _Index | None = None) -> tuple[list[str], int]:
    """Violations of the rate limits and the number of grants: ``grants`` maps a rate key to
    its ``rate_granted`` entries, ``limits`` a rate key to ``{"limit": N, "window": s}``; a
    key without a configured limit is judged by its entries' sliding-window description
    (``limit``: ``"10/1s window"``), else not at all. One message per burst (a run of window
    starts each holding more than ``limit`` grants), naming its fullest window and (with
    ``index``) a Redis data-loss fault inside it."""
    problems, total = [], 0
    for key in sorted(grants, key=str):
        entries = grants[key]
        total += len(entries)
        conf = limits.get(key) or _window_of(entries[0].get("limit"))
        if not conf:
            continue
        limit, width = int(conf["limit"]), round(float(conf["window"]) * MICRO)
        timed = sorted(
            (round(float(e["granted_at"]) * MICRO), n)
            for n, e in enumerate(entries)
            if e.get("granted_at") is not None  # a grant without its Redis time: unjudged
        )
        times = [t for t, _ in timed]
        burst = None  # (first start index, fullest start index, its count)
        bursts = []
        for i in range(len(times) - limit):
            if times[i + limit] - times[i] < width:
                count = bisect.bisect_left(times, times[i] + width) - i
                if burst is None:
                    burst = [i, i, count]
                elif count > burst[2]:
                    burst[1:] = [i, count]
            elif burst is not None:
                bursts.append(burst)
                burst = None
        if burst is not None:
            bursts.append(burst)
        for first, best, count in bursts:
            note = ""
            if index is not None:
                last = first
                while last + limit < len(times) and times[last + limit] - times[last] < width:
                    last += 1
                notes = []
                for i in range(first, last):
                    n_in = bisect.bisect_left(times, times[i] + width) - i
                    window = [t / MICRO for t in times[i : i + n_in]]
                    notes.append(
                        index.explained(
                            window, limit, times[i] / MICRO, (times[i] + width) / MICRO
                        )
                    )
                note = notes[0] if notes and all(notes) else ""
            inside = [entries[n] for _, n in timed[best : best + count]]
            owners = ", ".join(_short(e.get("owner") or e.get("task_id")) for e in inside)
            if count > MAX_NAMED:
                owners = ", ".join(owners.split(", ")[:MAX_NAMED]) + ", ..."
            problems.append(
                f"rate {key}: {count} grants in [{times[best] / MICRO:.6f}, "
                f"+{width / MICRO:g} s) for a limit of {limit} ({owners}){note}"
            )
    return problems, total


def _slot_ident(e: dict) -> tuple:
    # every grant has a fresh owner token; a reaped slot's slot_expired names no slot
    return (e["owner"],) if e.get("owner") else (e.get("slot"), e.get("fence"))


def check_concurrency(index: _Index, limits: dict, ttl: float = 0.0) -> tuple[list[str], int]:
    """Violations of the concurrency limits and the number of slot grants. A hold starts at
    ``slot_acquired`` and ends at the first of its ``slot_released``/``slot_expired``, the
    ``lost`` of its owner (the heartbeat found the slot gone: its expiry as the holder learnt
    it), for a hold its owner found lost the next grant of the same slot index to another
    owner (the store had let it expire by then), a SIGKILL/SIGQUIT/SIGSTOP of its pid or the
    end of its task run (else it lasts). The
    limit is ``limits[key]``, else the events' ``limit``. One message per episode above the
    limit, naming the holders at its peak."""
    problems, grants = [], 0
    for key in sorted(index.slots, key=str):
        events = index.slots[key]
        holds, done = {}, {}
        limit = limits.get(key)
        for _, e in events:
            ident = _slot_ident(e)
            if e.get("ev") == "slot_acquired":
                grants += 1
                holds.setdefault(ident, e)
                if limit is None and e.get("limit") is not None:
                    limit = e["limit"]
            elif ident in holds:
                done.setdefault(ident, e["t"])
        if limit is None:
            continue
        limit = int(limit)
        # A slot index is one Redis key: the store grants it again only once the last grant
        # expired there, at least a TTL after it (the grant set the TTL), so the next grant's
        # fencing token (Redis microseconds) is a TTL past the holder's, less the skew of a
        # clock_ahead between them. A holder that finds its slot expired had lost it by such a
        # next grant of its index, whenever it learnt it (a renewal stuck behind a slow store
        # past the TTL: "a paused holder loses its slot", docs/patterns/bulkhead.md). A next
        # grant sooner than that is the same slot granted twice: never passed on.
        expired = {_slot_ident(e) for _, e in events if e.get("ev") == "slot_expired"}
        regrants: dict = {}
        for _, e in events:
            if e.get("ev") == "slot_acquired" and e.get("slot") is not None:
                regrants.setdefault(e["slot"], []).append(e)
        marks = []
        for ident, e in holds.items():
            start = e["t"]
            lost = index.lost_at.get(e.get("owner"))
            passed_on = None
            if ident in expired and e.get("slot") is not None and e.get("fence"):
                for other in regrants[e["slot"]]:
                    if other["t"] <= start or _slot_ident(other) == ident:
                        continue
                    skew = max(
                        (k for t, k in index.clock_ahead if start <= t <= other["t"]),
                        default=0.0,
                    )
                    if (other.get("fence") or 0) - e["fence"] >= (ttl - skew) * MICRO:
                        passed_on = other["t"]
                    break
            stop = _earliest(
                done.get(ident),
                lost if lost is not None and lost >= start else None,
                passed_on,
                index.stopped_for(e.get("pid"), start, ttl),
                index.task_end_after(e, start),
            )
            # a hold that never ended in the history lasts past its end
            stop = float("inf") if stop is None else max(stop, start)
            if stop > start:
                # half-open [start, stop): at one instant a release counts before a grant
                marks.append((stop, 0, ident))
                marks.append((start, 1, ident))
        marks.sort(key=lambda m: (m[0], m[1]))
        held: dict = {}
        peak = None  # (count, time, holders) of the current episode above the limit
        for t, kind, ident in marks:
            if kind == 0:
                held.pop(ident, None)
                if peak is not None and len(held) <= limit:
                    problems.append(_concurrency_message(index, key, limit, peak))
                    peak = None
                continue
            held[ident] = holds[ident]
            if len(held) > limit and (peak is None or len(held) > peak[0]):
                peak = (len(held), t, list(held.values()))
        if peak is not None:
            problems.append(_concurrency_message(index, key, limit, peak))
    return problems, grants


def _concurrency_message(index: _Index, key, limit, peak) -> str:
    count, t, holders = peak
    note = index.explained([e["t"] for e in holders], limit, min(e["t"] for e in holders), t)
    named = ", ".join(
        f"{_short(e.get('owner'))} slot {e.get('slot')} fence {e.get('fence')}"
        for e in holders[:MAX_NAMED]
    )
    more = ", ..." if len(holders) > MAX_NAMED else ""
    return (
        f"concurrency {key}: {count} slots held at {t:.3f} for a limit of {limit} "
        f"({named}{more}){note}"
    )


def check_idempotency(index: _Index) -> tuple[list[str], dict]:
    """Violations of the idempotency keys (a body without a key: it ran without a record; two
    bodies of one key at once; a body started after a completion was recorded; two
    completions) and the counts of bodies, completions and replays. A body runs from its
    ``idem_body`` to the key's next completion, the end of its task run or a kill of its
    process, whichever comes first."""
    problems = []
    counts = {"idem_bodies": 0, "idem_completions": 0, "idem_replays": 0}
    for key in sorted(index.idem, key=str):
        entries = sorted(index.idem[key], key=lambda p: (p[1]["t"], p[0]))
        completions = [e["t"] for _, e in entries if e["ev"] == "idem_completed"]
        running = []  # (end, body) of the bodies started so far
        completed = None
        for _, e in entries:
            ev = e["ev"]
            if ev == "idem_body":
                counts["idem_bodies"] += 1
                if key is None:
                    problems.append(
                        f"idempotency: body of task {_short(e.get('task_id'))} (step "
                        f"{e.get('step')}) at {e['t']:.3f} ran with no idempotency record"
                    )
                    continue
                if completed is not None:
                    problems.append(
                        f"idempotency {key}: body of task {_short(e.get('task_id'))} "
                        f"(step {e.get('step')}) started at {e['t']:.3f}, after the completion "
                        f"recorded at {completed['t']:.3f}"
                        f"{index.data_loss_note(completed['t'], e['t'])}"
                    )
                for end, body in running:
                    if end > e["t"]:
                        problems.append(
                            f"idempotency {key}: body of task {_short(e.get('task_id'))} "
                            f"started at {e['t']:.3f} while the body of task "
                            f"{_short(body.get('task_id'))} (started at {body['t']:.3f}) ran"
                            f"{index.data_loss_note(body['t'], e['t'])}"
                        )
                        break
                kill = index.first_at_or_after(index.kills.get(e.get("pid"), []), e["t"])
                end = _earliest(
                    index.first_at_or_after(completions, e["t"]),
                    index.task_end_after(e, e["t"]),
                    kill,
                )
                running.append((float("inf") if end is None else end, e))
            elif ev == "idem_completed":
                counts["idem_completions"] += 1
                if completed is not None:
                    problems.append(
                        f"idempotency {key}: completed again at {e['t']:.3f} "
                        f"(first at {completed['t']:.3f})"
                        f"{index.data_loss_note(completed['t'], e['t'])}"
                    )
                else:
                    completed = e
            else:
                counts["idem_replays"] += 1
    return problems, counts


def _breaker_call(e: dict) -> str:
    return (
        f"call of task {_short(e.get('task_id'))} (step {e.get('step')}, pid {e.get('pid')}) "
        f"at {e['t']:.3f}"
    )


def check_breakers(
    index: _Index, limits: dict | None = None, end_of_run: float = 0.0
) -> tuple[list[str], dict]:
    """Violations of the circuit breakers' guarantees (docs/patterns/breaker.md) and their
    counts, from each breaker's ``dep_call`` entries (a call of its dependency, with what the
    admission said), ``dep_done`` entries (the call returned) and ``breaker`` state changes
    (``opened``, ``half_open``, ``closed``: the probe's record of the library's signals, dated
    when the process that made the change received Redis's reply, so after the change).
    ``limits`` maps a breaker name to ``{"half_open_probes", "probe_timeout"}`` (else the
    calls' own fields).

    (a) No call admitted while open. An opening ends the closed generation of the call whose
    failure opened it (the latest ``dep_call`` of its task id in its pid before the open);
    a process may admit in that generation from its cached state for ``state_cache`` seconds
    counted from the request that read it (so before the open was recorded): a call of that
    generation whose admission began ``state_cache`` seconds or more after the open, or at or
    after it in the process that opened it (its copy is updated at once), was admitted by an
    open breaker. A call with no admission at all that starts while the breaker is open (from
    ``opened`` to its next state change) went round it.

    (b) At most ``half_open_probes`` probe calls at once, cluster-wide. A probe holds its
    permit at least from its ``dep_call`` (granted before) to the first of its
    ``breaker_outcome`` (written before the outcome goes to Redis and gives the permit back;
    without one, its ``dep_done``), the end of its task run, a kill of its process and
    ``probe_timeout`` after its admission began (its permit expired: the next probe is
    admitted then, documented).

    A Redis data loss (restart, stale failover, split brain) between the two events of a
    problem forgets the breaker (its generation, its probe permits): the message gets its
    ``; after <kind> at <t>`` note (reported apart, :func:`check_run`)."""
    limits = limits or {}
    problems: list[str] = []
    counts = {
        "calls": 0,
        "unadmitted_calls": 0,
        "probes": 0,
        "opens": 0,
        "opens_unlinked": 0,
        "admitted_after_open": 0,
        "admitted_from_cache_window": 0,
    }
    for name in sorted(set(index.dep_calls) | set(index.breaker_states), key=str):
        calls = sorted(index.dep_calls.get(name, []), key=lambda e: e["t"])
        states = sorted(index.breaker_states.get(name, []), key=lambda e: e["t"])
        conf = limits.get(name) or {}
        counts["calls"] += len(calls)
        counts["opens"] += sum(1 for s in states if s.get("what") == "opened")
        # (a) admissions of a generation an opening ended
        by_task: dict = defaultdict(list)
        for c in calls:
            by_task[(c.get("task_id"), c.get("pid"))].append(c)
        for i, s in enumerate(states):
            if s.get("what") != "opened":
                continue
            mine = [
                c for c in by_task.get((s.get("task_id"), s.get("pid")), []) if c["t"] <= s["t"]
            ]
            ended = mine[-1].get("generation") if mine and mine[-1].get("admitted") else None
            if ended is None:
                counts["opens_unlinked"] += 1
            later = states[i + 1]["t"] if i + 1 < len(states) else None  # the next change
            for c in calls:
                if not c.get("admitted"):
                    if s["t"] <= c["t"] and (later is None or c["t"] < later):
                        problems.append(
                            f"breaker {name}: {_breaker_call(c)} made with no admission while "
                            f"the breaker was open (opened at {s['t']:.3f})"
                            f"{index.data_loss_note(s['t'], c['t'])}"
                        )
                    continue
                if ended is None or c.get("probe") or c.get("generation") != ended:
                    continue
                if not c.get("guarded", True):
                    continue  # admitted unguarded by the outage policy (fail_open)
                began = c.get("admit_t0", c["t"])
                if began < s["t"]:
                    continue
                cache = float(c.get("state_cache") or 0.0)
                allowance = 0.0 if c.get("pid") == s.get("pid") else cache
                if began < s["t"] + allowance:
                    counts["admitted_from_cache_window"] += 1
                    continue
                counts["admitted_after_open"] += 1
                where = (
                    "in the process that opened it"
                    if not allowance
                    else (f"{began - s['t']:.3f} s after it, state cache {cache:g} s")
                )
                problems.append(
                    f"breaker {name}: {_breaker_call(c)} admitted in generation {ended} at "
                    f"{began:.3f}, which the open at {s['t']:.3f} (task "
                    f"{_short(s.get('task_id'))}) had ended ({where})"
                    f"{index.data_loss_note(s['t'], began)}"
                )
        counts["unadmitted_calls"] += sum(1 for c in calls if not c.get("admitted"))
        # (b) probes at once
        probes = [c for c in calls if c.get("admitted") and c.get("probe")]
        counts["probes"] += len(probes)
        if not probes:
            continue
        allowed = int(conf.get("half_open_probes") or probes[0].get("half_open_probes") or 1)
        marks = []
        for n, c in enumerate(probes):
            pid = c.get("pid")
            timeout = conf.get("probe_timeout") or c.get("probe_timeout")
            ident = (c.get("task_id"), pid)
            outcome = index.first_at_or_after(index.outcomes.get(ident, []), c["t"])
            stop = _earliest(
                outcome,
                # without its outcome's entry, the call itself is all it surely held
                index.first_at_or_after(index.dep_done.get(ident, []), c["t"])
                if outcome is None
                else None,
                index.task_end_after(c, c["t"]),
                index.first_at_or_after(index.kills.get(pid, []), c["t"]),
                c.get("admit_t0", c["t"]) + float(timeout) if timeout else None,
            )
            stop = end_of_run if stop is None else stop
            if stop > c["t"]:
                marks.append((stop, 0, n))
                marks.append((c["t"], 1, n))
        marks.sort(key=lambda m: (m[0], m[1]))
        held: dict = {}
        for t, kind, n in marks:
            if kind == 0:
                held.pop(n, None)
                continue
            if len(held) >= allowed:
                c = probes[n]
                others = sorted(held.values(), key=lambda e: e["t"])
                named = ", ".join(_breaker_call(o) for o in others[:MAX_NAMED])
                problems.append(
                    f"breaker {name}: probe {_breaker_call(c)} while {len(others)} probe(s) "
                    f"ran, for {allowed} at once ({named})"
                    f"{index.data_loss_note(others[0]['t'], c['t'])}"
                )
            held[n] = probes[n]
    return problems, counts


def _recovery(index: _Index) -> dict:
    waits, unrecovered = [], 0
    for heal in index.heals:
        nxt = index.first_at_or_after(index.commits, heal["t"])
        if nxt is None:
            unrecovered += 1
        else:
            waits.append(round(nxt - heal["t"], 3))
    return {
        "lasting_faults": len(index.heals),
        "unrecovered": unrecovered,
        "p50_s": percentile(waits, 0.5),
        "p95_s": percentile(waits, 0.95),
        "max_s": max(waits) if waits else None,
    }


def _key_list(keys) -> str:
    keys = sorted(str(k) for k in keys)
    return ", ".join(keys[:MAX_NAMED]) + (", ..." if len(keys) > MAX_NAMED else "")


def check_run(run: Run) -> RunVerdict:
    """The verdict of a run: every check of the module docstring, in the order lock store,
    steps (by id), rates, concurrency, idempotency (by key)."""
    index = _Index(loads.task_history(run.history))  # the HTTP server's records apart
    end_of_run = max((e.get("t", 0.0) for e in run.history), default=0.0)
    verdict = RunVerdict()
    no_ttl = list(run.store.get("keys_without_ttl", []))
    if no_ttl:
        verdict.violations.append(
            f"{len(no_ttl)} lock-store key(s) without a TTL ({_key_list(no_ttl)})"
        )
    verdict.leftover = sorted(run.store.get("leftover", []))
    verdict.leftovers = [f"left in the lock store: {k}" for k in verdict.leftover]
    by_step: dict = defaultdict(list)
    for r in run.records:
        by_step[r.step].append(r)
    overlaps = stale_rejected = 0
    reissued: list[str] = []
    ttl = float(run.meta.get("ttl") or 0.0)
    for start in index.unhealed:
        verdict.violations.append(f"the split brain at {start:.3f} was never healed")
    unlisted = set(by_step) - set(run.steps)
    for step in sorted(unlisted, key=lambda s: (isinstance(s, str), s)):
        verdict.violations.append(f"step {step}: committed transitions but not in steps.json")
    for step in sorted(set(run.steps) | unlisted, key=lambda s: (isinstance(s, str), s)):
        problems, overlap, stale = _check_group(
            index,
            step,
            run.steps.get(step, "?"),
            by_step.get(step, []),
            index.by_step.get(step, []),
            end_of_run,
            ttl,
        )
        # a token given twice by a counter a clock_ahead left ahead, after a data loss
        excused = clock.reissued_tokens(problems, run.history)
        reissued += excused
        verdict.violations.extend(p for p in problems if not any(e.startswith(p) for e in excused))
        overlaps += overlap
        stale_rejected += stale
    limits = run.meta.get("limits") or {}
    rate_problems, rate_grants = check_rates(index.rate, limits.get("rate") or {}, index)
    slot_problems, slot_grants = check_concurrency(index, limits.get("concurrency") or {}, ttl)
    idem_problems, idem_counts = check_idempotency(index)
    breaker_problems, breaker_counts = check_breakers(
        index, limits.get("breaker") or {}, end_of_run
    )
    pattern_problems = rate_problems + slot_problems + idem_problems + breaker_problems
    verdict.data_loss = [p for p in pattern_problems if "; after " in p] + reissued
    verdict.violations += [p for p in pattern_problems if "; after " not in p]
    verdict.counts = {
        "steps": len(run.steps),
        "terminal_steps": sum(1 for s in run.steps.values() if s in TERMINAL),
        "executions": index.executions,
        "acquired": index.acquired,
        "commits": len(run.records),
        "faults": dict(sorted(index.faults.items())),
        "overlaps": overlaps,
        "stale_rejected": stale_rejected,
        "fence_refusals": index.fence_refusals,
        "breaker": dict(sorted(index.breaker.items())),
        "rate_grants": rate_grants,
        # grants the window check could not judge (no Redis time, no known limit): should be 0
        "rate_unjudged": sum(
            1
            for key, entries in index.rate.items()
            for e in entries
            if e.get("granted_at") is None
            or not ((limits.get("rate") or {}).get(key) or _window_of(entries[0].get("limit")))
        ),
        "slot_grants": slot_grants,
        **idem_counts,
        "after_data_loss": len(verdict.data_loss),
        "leftovers": len(verdict.leftovers),
        "keys_without_ttl": len(no_ttl),
        "history_entries": len(run.history),
    }
    if index.dep_calls:  # a history that records its breaker's calls (older ones do not)
        verdict.counts["breaker_calls"] = breaker_counts
    # the breakers' liveness after a clock_ahead fault (tests/support/faults/clock.py)
    clock_problems, clock_counts = clock.check_breakers_after(run.history, index.stops)
    verdict.violations += clock_problems
    if clock_counts["clock_ahead_faults"]:
        verdict.counts["clock_ahead"] = clock_counts
    if run.effects is not None:
        effects = check_run_effects(run)
        verdict.violations += effects.violations
        verdict.counts["effects"] = {
            k: v for k, v in effects.as_dict().items() if k != "violations"
        }
        verdict.counts["effects"]["receiver"] = run.effects.get("receiver")
    _check_writers_and_periodic(run, verdict)
    verdict.recovery = _recovery(index)
    return verdict


def _check_writers_and_periodic(run: Run, verdict: RunVerdict) -> None:
    """The writers and periodic workloads, when the history has them (older runs' verdicts stay as
    they were): a writer outside Celery (``writers.py``; its commits are judged with the
    tasks' by the step checks above, here only counted) and periodic runs under the overlap
    guard (``overlap_rules.check_periodic``: no two runs of one periodic task at once)."""
    from tests.support.faults import overlap_rules, writers

    events = {e.get("ev") for e in run.history}
    if "writer_start" in events or any(str(r.owner).startswith("plain-") for r in run.records):
        mine = writers.writer_commits(run.history, run.records)
        verdict.counts["writer_commits"] = mine
        verdict.counts["task_commits"] = len(run.records) - mine
    if events & {"periodic_start", "periodic_send", "periodic_skipped"}:
        ttl = float(run.meta.get("ttl") or 2.0)
        periodic = overlap_rules.check_periodic(loads.periodic_history(run.history, ttl), ttl=ttl)
        verdict.violations += periodic.violations
        verdict.data_loss += periodic.data_loss
        verdict.counts["periodic"] = {**periodic.counts, "violations": len(periodic.violations)}
    if "writer_commits" in verdict.counts:  # the step violations on steps the writer changed
        steps = {str(r.step) for r in run.records if r.owner and _is_writer(run, r.owner)}
        verdict.counts["writer_step_violations"] = sum(
            1 for v in verdict.violations if v.startswith("step ") and v[5:].split(":")[0] in steps
        )
    if run.http is not None:  # the HTTP load of --loads http (tests/support/faults/loads.py)
        ttl = ((run.meta.get("loads") or {}).get("http") or {}).get("lock_ttl") or 8.0
        http = loads.judge_http(run.history, run.http, float(ttl))
        verdict.violations += http["violations"]
        verdict.counts["http"] = http["counts"]


def _is_writer(run: Run, owner) -> bool:
    """Whether ``owner`` is the writer's (a ``committed`` entry ``by: "writer"``, or a plain
    write's ``plain-`` owner)."""
    if str(owner).startswith("plain-"):
        return True
    if not hasattr(run, "_writer_owners"):
        run._writer_owners = {
            e.get("owner")
            for e in run.history
            if e.get("ev") == "committed" and e.get("by") == "writer"
        }
    return owner in run._writer_owners


def check_run_effects(run: Run) -> EffectVerdict:
    """The effects outbox's checks (``checker.check_effects``) on a run's ``effects.json``:
    the committed transitions of its source steps against the outbox's rows and what the
    receivers saw."""
    doc = run.effects or {}
    sources = {_id(s) for s in doc.get("sources", [])}
    return check_effects(
        [r for r in run.records if r.step in sources],
        [EffectRow(**r) for r in doc.get("rows", [])],
        [Applied(**a) for a in doc.get("applied", [])],
        doc.get("declares") or {},
        outbox=bool(doc.get("outbox", True)),
    )


def summary_lines(verdict: RunVerdict, limit: int = 20) -> list[str]:
    c, rec = verdict.counts, verdict.recovery
    faults = ", ".join(f"{k} {v}" for k, v in c.get("faults", {}).items()) or "none"
    lines = [
        f"{'OK' if verdict.ok else 'FAILED'}: {len(verdict.violations)} violation(s), "
        f"{len(verdict.leftovers)} leftover(s)",
        f"steps {c.get('steps')}, executions {c.get('executions')}, commits {c.get('commits')}, "
        f"overlaps {c.get('overlaps')}, stale rejected {c.get('stale_rejected')}, "
        f"fence refusals {c.get('fence_refusals')}",
        f"faults: {faults}",
        f"rate grants {c.get('rate_grants')}, slot grants {c.get('slot_grants')}, idempotent "
        f"bodies {c.get('idem_bodies')}, completions {c.get('idem_completions')}, replays "
        f"{c.get('idem_replays')}",
        f"recovery after {rec.get('lasting_faults')} lasting fault(s): p50 {rec.get('p50_s')} s, "
        f"p95 {rec.get('p95_s')} s, max {rec.get('max_s')} s, unrecovered "
        f"{rec.get('unrecovered')}",
    ]
    calls = c.get("breaker_calls")
    if calls:
        lines.append(
            f"breaker calls {calls['calls']} ({calls['probes']} probes, "
            f"{calls['unadmitted_calls']} without an admission), opens {calls['opens']} "
            f"({calls['opens_unlinked']} unlinked), admitted within the state cache's window "
            f"{calls['admitted_from_cache_window']}, after it {calls['admitted_after_open']}"
        )
    if c.get("http") or c.get("periodic") or "writer_commits" in c:  # --loads
        h, p = c.get("http") or {}, c.get("periodic") or {}
        lines.append(
            f"loads: http requests {h.get('requests')}, bodies {h.get('bodies')}, violations "
            f"{h.get('violations')} {h.get('by_rule')}; writer commits "
            f"{c.get('writer_commits')}; periodic sends {p.get('sends')}, runs {p.get('runs')}, "
            f"overlapping {p.get('overlapping')}, violations {p.get('violations')}"
        )
    shown = verdict.violations + verdict.leftovers
    lines += [f"  {p}" for p in shown[:limit]]
    if len(shown) > limit:
        lines.append(f"  ... and {len(shown) - limit} more")
    if verdict.data_loss:
        lines.append(
            f"{len(verdict.data_loss)} limit(s) exceeded after a lock-store data loss "
            f"(the patterns' documented limit, not a violation):"
        )
        lines += [f"  {p}" for p in verdict.data_loss[:limit]]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Check a randomized fault run's directory.")
    parser.add_argument("dir", help="the run directory")
    parser.add_argument(
        "--write",
        action="store_true",
        default=True,
        help="write DIR/verdict.json (the default)",
    )
    parser.add_argument(
        "--no-write", dest="write", action="store_false", help="print the verdict only"
    )
    args = parser.parse_args(argv)
    verdict = check_run(load(args.dir))
    document = json.dumps(verdict.as_dict(), indent=2) + "\n"
    if args.write:
        (Path(args.dir) / "verdict.json").write_text(document)
    print("\n".join(summary_lines(verdict)))
    print(document, end="")
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
