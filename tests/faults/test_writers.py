"""Writers outside Celery in the whole-run checker (tests/support/faults/writers.py): the
histories a guarded writer leaves beside the step tasks pass the step rules, and those of its
negative control (a plain ``UPDATE`` from a status read earlier) are caught. Hand-made runs,
judged by ``runcheck.check_run``; pure functions, no servers."""

from __future__ import annotations

import pytest

from tests.support.faults import runcheck, writers
from tests.support.faults.checker import Record

pytestmark = pytest.mark.no_database


class Mixed:
    """A run of tasks and a writer on a few steps, as the probe and the writer record it."""

    def __init__(self):
        self.history: list[dict] = []
        self.records: list[Record] = []
        self.steps: dict = {}

    def ev(self, ev, t, pid, **fields):
        self.history.append({"ev": ev, "t": t, "pid": pid, **fields})

    def holder(self, step, owner, fence, t, pid, frm, to, by=None, commit=True):
        """A lease holder (a task, or the guarded writer with ``by="writer"``) that takes the
        lease at ``t``, commits ``frm -> to`` at t + 0.2 (if ``commit``) and releases at
        t + 0.3."""
        ids = {"step": step, "owner": owner, "fence": fence, "task_id": f"id-{owner}"}
        extra = {"by": by} if by else {}
        self.ev("acquired", t, pid, **ids)
        self.ev("point", t + 0.1, pid, point="before_cas", **ids)
        if commit:
            self.records.append(Record(step, frm, to, owner, fence))
            self.ev("committed", t + 0.2, pid, to=to, **ids, **extra)
        else:
            self.ev("conflict", t + 0.2, pid, current=to, **ids)
        self.ev("released", t + 0.3, pid, **ids)

    def plain(self, step, owner, t, pid, frm, to):
        """The negative control's write: no lease, no fence."""
        self.records.append(Record(step, frm, to, owner, None))
        self.ev("committed", t, pid, step=step, owner=owner, fence=None, to=to, by="writer")

    def verdict(self):
        return runcheck.check_run(
            runcheck.Run(history=self.history, steps=self.steps, records=self.records)
        )


def test_a_guarded_writer_cancelling_and_resuming_beside_the_tasks_passes():
    run = Mixed()
    run.ev("writer_start", 0.5, 900, mode="guarded", by="writer")
    # step 1: the writer cancels it first; the forward task then finds it cancelled
    run.holder(1, "writer-a", 10, 1.0, 900, "pending", "cancelled", by="writer")
    run.holder(1, "task-b", 20, 1.5, 100, "pending", "done", commit=False)
    # step 2: a task moves it to running, the writer resumes it, the forward finishes it
    run.holder(2, "task-c", 30, 2.0, 100, "pending", "running")
    run.holder(2, "writer-d", 40, 2.5, 900, "running", "pending", by="writer")
    run.holder(2, "task-e", 50, 3.0, 101, "pending", "done")
    # step 3: the task wins; the writer's cancel conflicts and writes nothing
    run.holder(3, "task-f", 60, 4.0, 100, "pending", "done")
    run.holder(3, "writer-g", 70, 4.5, 900, "pending", "cancelled", by="writer", commit=False)
    run.steps = {1: "cancelled", 2: "done", 3: "done"}
    verdict = run.verdict()
    assert verdict.violations == []
    assert verdict.counts["commits"] == 5
    assert (verdict.counts["writer_commits"], verdict.counts["task_commits"]) == (2, 3)
    assert writers.writer_counts(run.history) == {"writer": 2, "tasks": 3}


def test_a_plain_cancel_over_a_task_commit_is_two_terminal_transitions():
    run = Mixed()
    run.holder(1, "task-a", 10, 1.0, 100, "pending", "done")
    # the writer read "pending" at 0.9, its form stayed open, it wrote at 1.4
    run.plain(1, "plain-b", 1.4, 900, "pending", "cancelled")
    run.steps = {1: "cancelled"}
    verdict = run.verdict()
    assert any("2 terminal transitions committed" in v for v in verdict.violations)
    assert any(
        "'pending' -> 'cancelled' committed while the chain was at 'done'" in v
        for v in verdict.violations
    )
    assert writers.writer_counts(run.history) == {"writer": 1, "tasks": 1}
    assert (verdict.counts["writer_commits"], verdict.counts["task_commits"]) == (1, 1)


def test_a_guarded_writer_that_commits_after_a_newer_grant_is_a_stale_commit():
    # what the guard prevents (the writer's lease expired while it was paused, a task took
    # the step, then the writer committed): the checker catches it when it happens
    run = Mixed()
    run.ev("acquired", 1.0, 900, step=1, owner="writer-a", fence=10)
    run.holder(1, "task-b", 20, 2.0, 100, "pending", "running")
    run.records.append(Record(1, "running", "pending", "writer-a", 10))
    run.ev("committed", 3.0, 900, step=1, owner="writer-a", fence=10, to="pending", by="writer")
    run.holder(1, "task-c", 30, 4.0, 100, "pending", "done")
    run.steps = {1: "done"}
    problems = run.verdict().violations
    assert any("stale holder wrote after a newer one (fences [20, 10, 30])" in p for p in problems)
    assert any("writer-a (fence 10) committed after task-b (fence 20)" in p for p in problems)


def test_writer_counts_separates_the_writer_from_the_tasks():
    history = [
        {"ev": "committed", "t": 1.0, "by": "writer"},
        {"ev": "committed", "t": 2.0},
        {"ev": "committed", "t": 3.0},
        {"ev": "cas", "t": 3.5, "by": "writer"},
    ]
    assert writers.writer_counts(history) == {"writer": 1, "tasks": 2}


def test_writer_result_is_the_last_writer_done_entry():
    history = [
        {"ev": "writer_start", "t": 0.0, "mode": "guarded"},
        {
            "ev": "writer_done",
            "t": 9.0,
            "mode": "guarded",
            "tries": 3,
            "committed": 2,
            "cancelled": 1,
            "resumed": 1,
            "refused": {"TransitionConflict": 1},
            "steps_seen": 7,
            "async_tries": 1,
            "async_committed": 1,
            "pid": 900,
        },
    ]
    assert writers.writer_result(history) == {
        "mode": "guarded",
        "tries": 3,
        "committed": 2,
        "cancelled": 1,
        "resumed": 1,
        "refused": {"TransitionConflict": 1},
        "steps_seen": 7,
        "async_tries": 1,
        "async_committed": 1,
    }
    assert writers.writer_result(history[:1]) == {}
