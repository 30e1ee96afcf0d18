"""Invariants of a run of steps, checked from what the database committed, the attempts'
history and the lock store: the one checker of the fault trials (``lab``, ``scenarios``,
``scripts/soak.py``) and of ``scripts/demo.py``.

The claim under test: whatever happens to workers, Redis or the network, a step's transition
commits at most once and never goes backwards, and no lease is held forever. Per step
(:func:`check_step`, :func:`check_steps`):

- exactly one terminal transition committed (0: never completed; 2+: a duplicate commit);
- the committed transitions form one legal chain from ``pending`` (no transition out of a
  terminal state, none skipped or repeated) and the row's status is where the chain ends;
- fencing tokens never decrease along the chain: a stale holder never wrote after a newer one;
- no holder committed after a newer holder had been granted the lease (needs the history);
- when the body counts its committed runs on the row (``body_runs``: the example app's
  ``Step.attempts``), that count equals the terminal commits: a rolled-back body left no write;

and for the lock store (:func:`lease_keys`, :func:`keys_without_ttl`): no key without a TTL,
and no lease left once the system is quiet. ``overlap`` (two attempts holding the lease on one
step at once, as each of them saw it) is not a violation: after a pause or a failover it is
expected, and the checks above must hold anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TERMINAL = frozenset({"done", "cancelled", "failed"})
LEGAL = frozenset(
    {
        ("pending", "done"),
        ("pending", "cancelled"),
        ("pending", "running"),
        ("running", "done"),
        ("running", "pending"),
        ("running", "failed"),
    }
)


@dataclass
class Record:
    """One committed transition (a TransitionRecord row)."""

    step: int
    from_status: str
    to_status: str
    owner: str
    fence: int | None

    @classmethod
    def of(cls, row) -> Record:
        """The record of a row with ``step_id``, ``from_status``, ``to_status``, ``owner`` and
        ``fence`` attributes (``django_app.workflows.models.TransitionRecord``)."""
        return cls(
            step=row.step_id,
            from_status=row.from_status,
            to_status=row.to_status,
            owner=row.owner,
            fence=row.fence,
        )


@dataclass
class Verdict:
    steps: int = 0
    commits: int = 0
    violations: list[str] = field(default_factory=list)
    overlaps: int = 0  # steps on which two attempts held the lease at once
    leftover_leases: int = 0
    keys_without_ttl: int = 0
    stale_rejected: int = 0  # steps where a stale holder tried to commit and was refused
    recovery_s: float | None = None  # seconds from the fault until the system was quiet again
    resumes: int = 0  # steps the harness had to re-send (an operator's resume)
    attempts: int = 0  # task runs that took or met the lease (>= 2: a rival existed)

    @property
    def ok(self) -> bool:
        return not self.violations and not self.leftover_leases


def check_step(
    step: int, status: str, records: list[Record], body_runs: int | None = None
) -> list[str]:
    """Violations of one step's committed transitions (``records`` in commit order, ``status``
    the row's final status); ``body_runs``, when given, is the row's count of committed body
    runs, which must equal the terminal commits."""
    problems = []
    terminal = [r for r in records if r.to_status in TERMINAL]
    if not terminal:
        problems.append(f"step {step}: no terminal transition committed (status {status!r})")
    elif len(terminal) > 1:
        owners = ", ".join(f"{r.to_status} by {r.owner[:8]} fence {r.fence}" for r in terminal)
        problems.append(f"step {step}: {len(terminal)} terminal transitions committed ({owners})")
    current = "pending"
    for r in records:
        if r.from_status in TERMINAL:
            problems.append(
                f"step {step}: transition out of terminal {r.from_status!r} -> {r.to_status!r}"
            )
        elif r.from_status != current or (r.from_status, r.to_status) not in LEGAL:
            problems.append(
                f"step {step}: {r.from_status!r} -> {r.to_status!r} committed "
                f"while the chain was at {current!r}"
            )
        current = r.to_status
    if status != current:
        problems.append(
            f"step {step}: row status {status!r} but the committed chain ends at {current!r}"
        )
    fences = [r.fence for r in records if r.fence is not None]
    if any(b < a for a, b in zip(fences, fences[1:])):
        problems.append(f"step {step}: a stale holder wrote after a newer one (fences {fences})")
    if body_runs is not None and terminal and body_runs != len(terminal):
        problems.append(
            f"step {step}: {body_runs} committed body runs for {len(terminal)} "
            f"terminal commit(s) (a rolled-back body's write survived)"
        )
    return problems


def stale_commits(step: int, history: list[dict], excused=None) -> list[str]:
    """Commits by a holder after a newer holder (higher fence) had already been granted the
    lease: the stale holder's lease had expired before it committed. A live holder keeps its
    lease until it releases, after its commit, so this only happens to a holder that was
    paused or cut off past its TTL (Kleppmann 2016's case). ``excused(commit, grant)`` (two
    history entries), when given, says a newer grant orders nothing against that commit (a
    grant on the other primary of a split brain: ``runcheck``)."""
    acquired = [
        e
        for e in history
        if e.get("step") == step and e.get("ev") == "acquired" and e.get("owner")
    ]
    problems = []
    for e in history:
        if e.get("step") != step or e.get("ev") != "committed" or not e.get("owner"):
            continue
        fence = e.get("fence") or 0
        newer = [
            g
            for g in acquired
            if g["owner"] != e["owner"]
            and (g.get("fence") or 0) > fence
            and g["t"] < e["t"]
            and not (excused is not None and excused(e, g))
        ]
        if newer:
            problems.append(
                f"step {step}: holder {e['owner'][:8]} (fence {fence}) committed "
                f"after {newer[0]['owner'][:8]} (fence {newer[0].get('fence') or 0}) was "
                f"granted the lease"
            )
    return problems


def lease_intervals(
    history: list[dict], step: int, end_of_trial: float
) -> dict[str, tuple[float, float]]:
    """owner -> (acquired, ended) for ``step``: ended at its release or loss as the holder
    saw it, at the end of its task run in its process (``task_end``: an attempt that gave up
    after a Redis error holds nothing any more, whatever its key does), at a SIGKILL of its
    process, else at the end of the trial."""
    acquired, ended, pid_of = {}, {}, {}
    killed, task_ends = {}, {}
    for e in history:
        if e.get("ev") == "fault" and e.get("signal") in ("SIGKILL", "SIGQUIT") and e.get("pid"):
            for pid in e["pid"] if isinstance(e["pid"], list) else [e["pid"]]:
                killed.setdefault(pid, e["t"])
        if e.get("ev") == "task_end" and e.get("pid"):
            task_ends.setdefault(e["pid"], []).append(e["t"])
        if e.get("step") != step or not e.get("owner"):
            continue
        owner = e["owner"]
        if e["ev"] == "acquired":
            acquired.setdefault(owner, e["t"])
            pid_of[owner] = e.get("pid")
        elif e["ev"] in ("released", "lost", "conflict") and owner in acquired:
            ended.setdefault(owner, e["t"])
    intervals = {}
    for owner, start in acquired.items():
        pid = pid_of.get(owner)
        stops = [
            ended.get(owner),
            killed.get(pid),
            min((t for t in task_ends.get(pid, ()) if t >= start), default=None),
        ]
        stops = [t for t in stops if t is not None and t >= start]
        end = min(stops) if stops else None
        intervals[owner] = (start, end if end is not None else end_of_trial)
    return intervals


def overlapped(intervals: dict[str, tuple[float, float]]) -> bool:
    spans = sorted(intervals.values())
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))


def check_steps(
    steps: dict[int, str],
    records: list[Record],
    history: list[dict] = (),
    body_runs: dict[int, int] | None = None,
) -> list[str]:
    """Violations of every step: ``steps`` maps step id -> final status, ``records`` are the
    committed transitions (in commit order), ``history`` the probe's entries (none: the stale
    commit check finds nothing), ``body_runs`` maps step id -> the row's committed body runs
    (see :func:`check_step`)."""
    by_step: dict[int, list[Record]] = {}
    for r in records:
        by_step.setdefault(r.step, []).append(r)
    problems = []
    for step, status in sorted(steps.items()):
        problems.extend(
            check_step(
                step,
                status,
                by_step.get(step, []),
                None if body_runs is None else body_runs.get(step),
            )
        )
        problems.extend(stale_commits(step, history))
    return problems


def lease_keys(client, prefix: str = "steplock") -> list[str]:
    """The lease keys under the key prefix ``prefix`` (SCAN, not KEYS), sorted."""
    return sorted(client.scan_iter(match=f"{prefix}:lease:*", count=1000))


def keys_without_ttl(client, prefix: str = "steplock") -> list[str]:
    """The keys under ``prefix`` that never expire (PTTL -1; a key gone meanwhile is not one),
    sorted."""
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if not keys:
        return []
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.pttl(key)
    return sorted(k for k, pttl in zip(keys, pipe.execute()) if pttl == -1)


def check(
    steps: dict[int, str],
    records: list[Record],
    history: list[dict],
    leftover_leases: int = 0,
    keys_without_ttl: int = 0,
    end_of_trial: float | None = None,
) -> Verdict:
    """The verdict of a trial: ``steps`` maps step id -> final status, ``records`` are the
    committed transitions (in commit order), ``history`` the probe's entries."""
    end = end_of_trial if end_of_trial is not None else max((e["t"] for e in history), default=0.0)
    verdict = Verdict(
        steps=len(steps),
        commits=len(records),
        leftover_leases=leftover_leases,
        keys_without_ttl=keys_without_ttl,
    )
    if keys_without_ttl:
        verdict.violations.append(f"{keys_without_ttl} lock-store key(s) without a TTL")
    verdict.violations.extend(check_steps(steps, records, history))
    for step in sorted(steps):
        mine = [r for r in records if r.step == step]
        if overlapped(lease_intervals(history, step, end)):
            verdict.overlaps += 1
        fences = {
            e["owner"]: e.get("fence") or 0
            for e in history
            if e.get("step") == step and e.get("ev") == "acquired" and e.get("owner")
        }
        newest = max(fences.values(), default=0)
        committed = {r.owner for r in mine}
        refused = {
            e["owner"]
            for e in history
            if e.get("step") == step
            and e.get("ev") in ("conflict", "lost")
            and e.get("owner")
            and fences.get(e["owner"], newest) < newest
            and any(
                h.get("ev") == "point"
                and h.get("point") == "before_cas"
                and h.get("owner") == e["owner"]
                for h in history
            )
        }
        if committed and refused - committed:
            verdict.stale_rejected += 1
    return verdict


# -- the effects outbox -------------------------------------------------------------------------
#
# The claim under test (issue 28): a committed transition's declared effects are written in its
# transaction, dispatched after COMMIT (on commit, or by the relay for a process that died
# first) and applied exactly once by an idempotent receiver; an attempt whose CAS was refused
# leaves no effect. An effect's identity for the business is (step, to, position): the same
# effect of the same transition, whatever attempt sent it. Its key is the receiver's dedupe.


@dataclass
class EffectRow:
    """One row of the outbox (``Effect``) after the run: ``step`` the Step id it belongs to
    (the workload puts it in the payload), ``fence`` and ``to`` those of the transition that
    wrote it, ``position`` its index among that transition's effects, ``status`` pending /
    dispatched / dead / discarded, ``attempts`` dispatch attempts."""

    key: str
    step: int
    fence: int | None
    to: str
    position: int
    status: str
    attempts: int = 0


@dataclass
class Applied:
    """What a receiver did with one key: ``receipts`` deliveries seen (>= 1), ``applied``
    times it applied the effect (1 for an idempotent receiver); ``step``, ``fence``, ``to``,
    ``position`` the sender's description (its body, or the receiving task's arguments)."""

    key: str
    step: int
    fence: int | None
    to: str
    position: int
    receipts: int = 1
    applied: int = 1


@dataclass
class EffectVerdict:
    commits: int = 0  # committed transitions that declare effects
    expected: int = 0  # effects they declared
    rows: int = 0
    dispatched: int = 0
    pending: int = 0
    dead: int = 0
    keys_received: int = 0
    receipts: int = 0  # deliveries, redeliveries included
    applied: int = 0
    redelivered: int = 0  # keys received more than once (and applied once)
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def check_effects(
    records: list[Record],
    rows: list[EffectRow],
    applied: list[Applied],
    declares: dict[str, int],
    outbox: bool = True,
) -> EffectVerdict:
    """The effects of a run. ``records`` the committed transitions, ``rows`` the outbox after
    the relay's period, ``applied`` what the receivers saw (one entry per key, every receiver
    together), ``declares`` maps a transition's ``to`` status -> the number of effects its body
    declares (a status not in it declares none). ``outbox=False`` (the negative control: the
    body performs its effects itself) judges the receivers only.

    Violations: a committed transition whose rows are not exactly its declared effects; a row
    of a (step, fence, to) that never committed (an effect of an attempt whose CAS was
    refused); a row not ``dispatched`` (left pending, or dead); a dispatched row no receiver
    got; a key applied more than once; a key received whose transition never committed; an
    effect of a committed transition applied under two keys or more (twice for the business)
    or never."""
    verdict = EffectVerdict()
    problems = verdict.violations
    commits = {
        (r.step, r.fence, r.to_status): declares[r.to_status]
        for r in records
        if declares.get(r.to_status)
    }
    verdict.commits = len(commits)
    verdict.expected = sum(commits.values())
    verdict.rows = len(rows)
    by_commit: dict[tuple, list[EffectRow]] = {}
    for row in rows:
        by_commit.setdefault((row.step, row.fence, row.to), []).append(row)
    verdict.dispatched = sum(1 for r in rows if r.status == "dispatched")
    verdict.pending = sum(1 for r in rows if r.status == "pending")
    verdict.dead = sum(1 for r in rows if r.status == "dead")
    got = {a.key: a for a in applied}
    verdict.keys_received = len(got)
    verdict.receipts = sum(a.receipts for a in applied)
    verdict.applied = sum(a.applied for a in applied)
    verdict.redelivered = sum(1 for a in applied if a.receipts > 1)
    if outbox:
        for (step, fence, to), n in sorted(commits.items(), key=lambda kv: str(kv[0])):
            positions = sorted(r.position for r in by_commit.get((step, fence, to), []))
            if positions != list(range(n)):
                problems.append(
                    f"step {step}: -> {to!r} (fence {fence}) committed with effect rows at "
                    f"positions {positions}, {n} declared"
                )
        for row in sorted(rows, key=lambda r: r.key):
            if (row.step, row.fence, row.to) not in commits:
                problems.append(
                    f"step {row.step}: effect {row.key} written for fence {row.fence} -> "
                    f"{row.to!r}, a transition that never committed"
                )
            if row.status != "dispatched":
                problems.append(
                    f"step {row.step}: effect {row.key} left {row.status} after the relay's "
                    f"period ({row.attempts} attempts)"
                )
            elif row.key not in got:
                problems.append(f"step {row.step}: effect {row.key} dispatched, never received")
    business: dict[tuple, list[Applied]] = {}
    for a in sorted(applied, key=lambda a: a.key):
        if a.applied > 1:
            problems.append(f"step {a.step}: key {a.key} applied {a.applied} times")
        if (a.step, a.fence, a.to) not in commits:
            problems.append(
                f"step {a.step}: effect {a.key} of an attempt whose transition never committed "
                f"(fence {a.fence} -> {a.to!r}) received"
            )
        business.setdefault((a.step, a.to, a.position), []).append(a)
    for (step, _fence, to), n in sorted(commits.items(), key=lambda kv: str(kv[0])):
        for position in range(n):
            mine = business.get((step, to, position), [])
            times = sum(a.applied for a in mine)
            if times == 0:
                problems.append(f"step {step}: effect {position} of -> {to!r} never applied")
            elif times > 1:
                keys = ", ".join(a.key for a in mine)
                problems.append(
                    f"step {step}: effect {position} of -> {to!r} applied {times} times "
                    f"(keys {keys})"
                )
    return verdict
