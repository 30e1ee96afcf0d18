"""The overlap guard's rule for a run's history: no two runs of the same periodic
task at once. A pure function of the history entries (:func:`check_periodic`); the entries
come from ``django_app/faults/periodic.py`` (runs, skips) and
``tests/support/faults/periodic_load.py`` (sends), and the nemesis's ``fault`` / ``heal``
entries.

A run is a ``periodic_start`` entry and its ``periodic_end`` (same ``task_id``, ``pid`` and
``start_rt``), both in the control Redis's ``TIME`` (``rt``, seconds: one clock for every
process). A run without an end (its process was killed, or the history ended first) lasts
until the first kill (SIGKILL / SIGQUIT) of its process at or after its start, else to the
end of the history (both by the entries' wall clock ``t``, which the controller's machine
shares with the control Redis: the lab runs them on one host).

A run B that starts while an earlier run A of the same ``name`` is still running is:

- excused (counted in ``counts["excused"]``, not a violation) when A's holder had lost its
  lease (a ``lost`` entry of A's ``owner``) or A's process was stopped (SIGSTOP, SIGKILL,
  SIGQUIT) between A's start and B's: a paused holder past its TTL is the overlap every lease
  allows (``checker``'s module docstring says the same of steps); so is a holder whose
  heartbeat was frozen (a ``heartbeat_frozen`` fault of A's process, from the fault to its
  heal, overlapping A's run before B's start): its lease ran out unrenewed, which with
  ``ttl`` given cannot be before ``max(freeze + 2/3 ttl, A's start + ttl)`` (renewals every
  third of the TTL; :data:`GRANT_SLACK` for the grant before A's start note), and its body
  learns it at its next check, so A must have ended with ``outcome="lost"`` within
  :data:`LOST_SLACK` of B's start;
- a data loss (``data_loss``, apart from the violations, as ``runcheck`` reports the limits)
  when the lock store lost data between A's start and B's (``redis_restart``,
  ``redis_failover``, ``split_brain`` faults): the lease went with it;
- otherwise a violation.

A run of the negative control has no lease (``owner`` None): nothing excuses its overlaps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DATA_LOSS = ("redis_restart", "redis_failover", "split_brain")
STOPS = ("SIGSTOP", "SIGKILL", "SIGQUIT")
KILLS = ("SIGKILL", "SIGQUIT")
#: Seconds a holder whose heartbeat was frozen may run on past a newer run's start: its
#: body checks the lease every 0.05 s (django_app.faults.probe.SLICE), on a loaded machine.
LOST_SLACK = 0.5
#: Seconds between a run's lease grant and its ``periodic_start`` entry (a loaded machine).
GRANT_SLACK = 0.25


@dataclass
class PeriodicRun:
    """One run of a periodic task: ``start`` / ``end`` seconds (control Redis TIME; ``end``
    estimated when ``ended`` is False)."""

    name: str
    task_id: str | None
    pid: int | None
    owner: str | None
    start: float
    end: float
    ended: bool = True
    outcome: str | None = None


@dataclass
class PeriodicVerdict:
    violations: list[str] = field(default_factory=list)
    data_loss: list[str] = field(default_factory=list)
    counts: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations


def _pids(entry) -> list:
    pid = entry.get("pid")
    return pid if isinstance(pid, list) else [pid]


def runs_of(history: list[dict]) -> list[PeriodicRun]:
    """The periodic runs of ``history``, sorted by start (see the module docstring)."""
    end_of_history = max((e.get("t", 0.0) for e in history), default=0.0)
    kills: dict = {}
    for e in history:
        if e.get("ev") == "fault" and e.get("signal") in KILLS:
            for pid in _pids(e):
                kills.setdefault(pid, []).append(e["t"])
    ends = {}
    for e in history:
        if e.get("ev") == "periodic_end":
            ends[(e.get("task_id"), e.get("pid"), e.get("start_rt"))] = e
    runs = []
    for e in history:
        if e.get("ev") != "periodic_start":
            continue
        end = ends.get((e.get("task_id"), e.get("pid"), e.get("rt")))
        if end is not None:
            stop, ended, outcome = end["rt"], True, end.get("outcome")
        else:
            # no end: a kill of its process (wall clock), else the end of the history
            after = [t for t in kills.get(e.get("pid"), []) if t >= e.get("t", e["rt"])]
            stop, ended, outcome = (min(after) if after else end_of_history), False, None
        runs.append(
            PeriodicRun(
                name=e.get("name") or "?",
                task_id=e.get("task_id"),
                pid=e.get("pid"),
                owner=e.get("owner"),
                start=e["rt"],
                end=max(stop, e["rt"]),
                ended=ended,
                outcome=outcome,
            )
        )
    runs.sort(key=lambda r: (r.start, r.end))
    return runs


def max_concurrent(runs: list[PeriodicRun]) -> int:
    """The most runs in progress at once (an end at the instant of a start comes first)."""
    points = sorted([(r.start, 1) for r in runs] + [(r.end, -1) for r in runs])
    now = peak = 0
    for _, delta in points:
        now += delta
        peak = max(peak, now)
    return peak


def _freezes(history: list[dict]) -> dict:
    """pid -> [(start, end)] of the ``heartbeat_frozen`` faults: to their heal, else to their
    planned end."""
    healed = {
        h.get("fault_t"): h["t"]
        for h in history
        if h.get("ev") == "heal" and h.get("kind") == "heartbeat_frozen"
    }
    out: dict = {}
    for e in history:
        if e.get("ev") == "fault" and e.get("kind") == "heartbeat_frozen":
            end = healed.get(e["t"], e["t"] + float(e.get("seconds") or 0.0))
            for pid in _pids(e):
                out.setdefault(pid, []).append((e["t"], end))
    return out


def _frozen_past_ttl(a: PeriodicRun, b: PeriodicRun, freezes: list, ttl) -> bool:
    """Whether ``a``'s lease can have run out unrenewed under a frozen heartbeat by ``b``'s
    start, ``a`` stopping at its next check (the module docstring)."""
    if a.outcome != "lost" or a.end > b.start + LOST_SLACK:
        return False
    for start, end in freezes:
        if start > b.start or end < a.start:
            continue
        if ttl is None or b.start >= max(start + 2 * ttl / 3, a.start + ttl) - GRANT_SLACK:
            return True
    return False


def check_periodic(
    history: list[dict], limit: int = 5, ttl: float | None = None
) -> PeriodicVerdict:
    """The verdict of the periodic runs of ``history`` (``ttl``: the leases' TTL, seconds,
    bounding the frozen-heartbeat excuse): violations (at most ``limit`` named
    per task name, then a count), data losses, and ``counts``: ``sends``, ``runs``,
    ``skips``, ``unfinished`` (runs without an end), ``overlapping`` (pairs of runs at once),
    ``excused``, ``max_concurrent`` (over every name: the most of one name at once)."""
    verdict = PeriodicVerdict()
    runs = runs_of(history)
    lost: dict = {}
    stops: dict = {}
    frozen = _freezes(history)
    losses = []
    for e in history:
        ev = e.get("ev")
        if ev == "lost" and e.get("owner"):
            lost.setdefault(e["owner"], e["t"])
        elif ev == "fault":
            if e.get("signal") in STOPS:
                for pid in _pids(e):
                    stops.setdefault(pid, []).append(e["t"])
            if e.get("kind") in DATA_LOSS:
                losses.append((e["t"], e["kind"], e.get("until", float("inf"))))
    by_name: dict = {}
    for r in runs:
        by_name.setdefault(r.name, []).append(r)
    overlapping = excused = 0
    peak = 0
    for name, mine in sorted(by_name.items()):
        peak = max(peak, max_concurrent(mine))
        named = 0
        for i, a in enumerate(mine):
            for b in mine[i + 1 :]:
                if b.start >= a.end:
                    break  # sorted by start: no later run starts inside a either
                overlapping += 1
                if a.owner and (
                    lost.get(a.owner, float("inf")) <= b.start
                    or any(a.start <= t <= b.start for t in stops.get(a.pid, []))
                    or _frozen_past_ttl(a, b, frozen.get(a.pid, []), ttl)
                ):
                    excused += 1
                    continue
                loss = [(t, k) for t, k, until in losses if a.start <= t <= b.start <= until]
                message = (
                    f"{name}: run {str(b.task_id)[:8]} (pid {b.pid}) started at {b.start:.3f} "
                    f"while run {str(a.task_id)[:8]} (pid {a.pid}) ran "
                    f"[{a.start:.3f}, {a.end:.3f}{'' if a.ended else ' (no end)'}]"
                )
                if loss:
                    verdict.data_loss.append(
                        f"{message}; after {loss[-1][1]} at {loss[-1][0]:.3f}"
                    )
                    continue
                named += 1
                if named <= limit:
                    verdict.violations.append(message)
        if named > limit:
            verdict.violations.append(f"{name}: {named - limit} more overlapping run(s)")
    verdict.counts = {
        "sends": sum(1 for e in history if e.get("ev") == "periodic_send"),
        "runs": len(runs),
        "skips": sum(1 for e in history if e.get("ev") == "periodic_skipped"),
        "unfinished": sum(1 for r in runs if not r.ended),
        "lost": sum(1 for r in runs if r.outcome == "lost"),
        "overlapping": overlapping,
        "excused": excused,
        "max_concurrent": peak,
    }
    return verdict
