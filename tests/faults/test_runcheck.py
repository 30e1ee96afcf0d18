"""The whole-run checker (tests/support/faults/runcheck.py) on hand-made runs: it must accept a
clean run, name every kind of violation, count what happened, and give the stored verdict of
every recorded run directory under fixtures/nemesis-*/ again. Pure functions: no servers."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from tests.support.faults import runcheck
from tests.support.faults.checker import Record

FIXTURES = Path(__file__).parent / "fixtures"
RATE = {"rate": {"r:api": {"limit": 2, "window": 1.0}}, "concurrency": {"c:db": 2}}


class Builder:
    """A run made by hand: history entries, committed records, final statuses."""

    def __init__(self, limits=None, unguarded=False):
        self.history: list[dict] = []
        self.records: list[Record] = []
        self.steps: dict = {}
        self.store = {"keys_without_ttl": [], "leftover": []}
        self.meta = {"seed": 1, "duration_s": 10, "unguarded": unguarded, "limits": limits or {}}

    def ev(self, ev, t, pid=100, **fields):
        self.history.append({"ev": ev, "t": t, "pid": pid, **fields})
        return self

    def attempt(self, step, owner, fence, t, pid=100, to="done", commit=True, task_id=None):
        """One attempt that takes the lease at ``t``, commits ``pending -> to`` (if
        ``commit``) at t + 0.2 and releases at t + 0.3; its task run ends at t + 0.4."""
        task_id = task_id or f"task-{owner}"
        ids = {"step": step, "owner": owner, "fence": fence, "task_id": task_id}
        self.ev("acquired", t, pid, **ids)
        self.ev("point", t + 0.1, pid, point="before_cas", **ids)
        if commit:
            self.ev("committed", t + 0.2, pid, **ids)
            self.records.append(Record(step, "pending", to, owner, fence))
            self.steps[step] = to
        else:
            self.steps.setdefault(step, "pending")
        self.ev("released", t + 0.3, pid, **ids)
        self.ev("task_end", t + 0.4, pid, step=step, task_id=task_id)
        return self

    def grant(self, key, granted_at, owner="o"):
        return self.ev(
            "rate_granted", granted_at, key=key, granted_at=granted_at, limit="2/1s", owner=owner
        )

    def slot(self, ev, t, owner, slot=0, fence=1, key="c:db", pid=100, **fields):
        return self.ev(
            ev, t, pid, limit_key=key, limit=2, slot=slot, owner=owner, fence=fence, **fields
        )

    def run(self) -> runcheck.Run:
        return runcheck.Run(
            history=list(self.history),
            steps=dict(self.steps),
            records=list(self.records),
            store={k: list(v) for k, v in self.store.items()},
            meta=dict(self.meta),
        )

    def verdict(self) -> runcheck.RunVerdict:
        return runcheck.check_run(self.run())


def clean_example() -> Builder:
    """A small clean run with one of everything: faults with heals, a pause overlap, a stale
    holder refused by the fence, rates and slots within their limits, idempotency."""
    b = Builder(limits=RATE)
    b.attempt(1, "a1", 10, 0.0)
    b.ev("fault", 1.2, kind="kill_child", signal="SIGKILL", pid=101, by="controller")
    b.ev("acquired", 1.1, 101, step=2, owner="b1", fence=20, task_id="tb1")
    b.attempt(2, "b2", 21, 4.0, pid=102)  # b1 was killed at 1.2: no overlap
    b.ev("fault", 5.0, kind="pause", signal="SIGSTOP", pid=103, seconds=3, by="controller")
    b.ev("acquired", 4.9, 103, step=3, owner="c1", fence=30, task_id="tc1")
    b.ev("point", 4.95, 103, step=3, point="before_cas", owner="c1", fence=30, task_id="tc1")
    b.attempt(3, "c2", 31, 6.0, pid=104)
    b.ev("heal", 8.0, kind="pause", signal="SIGCONT", pid=103, fault_t=5.0, by="controller")
    b.ev(
        "conflict",
        8.1,
        103,
        step=3,
        owner="c1",
        fence=30,
        task_id="tc1",
        reason="the fence refused: the row carries a newer fencing token",
    )
    b.ev(
        "lost",
        8.15,
        103,
        step=3,
        owner="c1",
        fence=30,
        task_id="tc1",
        reason="the step row carries a newer fencing token than 30",
    )  # the same refusal, as the task reports it
    b.ev("task_end", 8.2, 103, step=3, task_id="tc1")
    b.ev("breaker", 8.5, name="dep", state="open", what="opened")
    b.ev("breaker", 8.6, name="dep", state="open", what="rejected")
    b.ev("breaker", 8.7, name="dep", state="open", what="rejected")
    b.ev("fault", 9.0, 1, kind="redis_latency", by="controller")
    b.ev("heal", 9.5, 1, kind="redis_latency", fault_t=9.0, by="controller")
    b.attempt(4, "d1", 40, 10.0)
    b.grant("r:api", 100.0).grant("r:api", 100.5).grant("r:api", 101.0).grant("r:api", 101.5)
    b.slot("slot_acquired", 10.0, "s1", slot=0)
    b.slot("slot_acquired", 10.1, "s2", slot=1, pid=105)
    b.slot("slot_released", 10.5, "s1", slot=0)
    b.slot("slot_acquired", 10.5, "s3", slot=0)  # at the instant s1 released
    b.slot("slot_expired", 11.0, "s2", slot=1, pid=105)
    b.slot("slot_released", 11.2, "s3", slot=0)
    b.ev("idem_body", 12.0, key="idem:k1", task_id="t-i1", step=4)
    b.ev("idem_completed", 12.3, key="idem:k1")
    b.ev("idem_replayed", 12.6, key="idem:k1")
    return b


def unguarded_example() -> Builder:
    """The clean example's negative control: a second terminal commit of step 1."""
    b = clean_example()
    b.meta["unguarded"] = True
    b.attempt(1, "a2", 11, 0.5, pid=106)
    b.steps[1] = "done"
    return b


EXAMPLES = {"nemesis-example": clean_example, "nemesis-example-unguarded": unguarded_example}


def test_a_clean_run_passes_and_is_counted():
    verdict = clean_example().verdict()
    assert (verdict.violations, verdict.leftovers, verdict.ok) == ([], [], True)
    assert verdict.counts == {
        "steps": 4,
        "terminal_steps": 4,
        "executions": 6,
        "acquired": 6,
        "commits": 4,
        "faults": {"kill_child": 1, "pause": 1, "redis_latency": 1},
        "overlaps": 1,
        "stale_rejected": 1,
        "fence_refusals": 1,
        "breaker": {"opened": 1, "rejected": 2},
        "rate_grants": 4,
        "rate_unjudged": 0,
        "slot_grants": 3,
        "idem_bodies": 1,
        "idem_completions": 1,
        "idem_replays": 1,
        "after_data_loss": 0,
        "leftovers": 0,
        "keys_without_ttl": 0,
        "history_entries": len(clean_example().history),
    }


def test_recovery_is_from_each_heal_to_the_next_commit():
    # heals at 8.0 and 9.5; commits at 0.2, 4.2, 6.2, 10.2
    assert clean_example().verdict().recovery == {
        "lasting_faults": 2,
        "unrecovered": 0,
        "p50_s": 0.7,
        "p95_s": 2.2,
        "max_s": 2.2,
    }
    b = Builder().attempt(1, "a", 1, 0.0)
    b.ev("heal", 5.0, kind="redis_blackhole", fault_t=4.0)
    assert b.verdict().recovery == {
        "lasting_faults": 1,
        "unrecovered": 1,
        "p50_s": None,
        "p95_s": None,
        "max_s": None,
    }


def test_a_double_terminal_commit():
    b = Builder().attempt(1, "aaaaaaaa1", 1, 0.0).attempt(1, "bbbbbbbb2", 2, 1.0)
    assert b.verdict().violations == [
        "step 1: 2 terminal transitions committed (done by aaaaaaaa fence 1, "
        "done by bbbbbbbb fence 2)",
        "step 1: 'pending' -> 'done' committed while the chain was at 'done'",
    ]


def test_an_illegal_chain():
    b = Builder().attempt(1, "a", 1, 0.0, to="running")
    b.records.append(Record(1, "running", "cancelled", "a", 1))
    b.steps[1] = "cancelled"
    assert b.verdict().violations == [
        "step 1: 'running' -> 'cancelled' committed while the chain was at 'running'"
    ]


def test_a_fence_decrease():
    b = Builder().attempt(1, "new", 5, 0.0, to="running")
    b.records.append(Record(1, "running", "done", "old", 3))
    b.steps[1] = "done"
    assert b.verdict().violations == [
        "step 1: a stale holder wrote after a newer one (fences [5, 3])"
    ]


def test_a_stale_commit_after_a_newer_grant():
    b = Builder()
    b.ev("acquired", 0.0, step=1, owner="old-owner", fence=1)
    b.ev("acquired", 2.5, step=1, owner="new-owner", fence=2)
    b.ev("committed", 3.0, step=1, owner="old-owner", fence=1)
    b.records.append(Record(1, "pending", "done", "old-owner", 1))
    b.steps[1] = "done"
    verdict = b.verdict()
    assert verdict.violations == [
        "step 1: holder old-owne (fence 1) committed after new-owne (fence 2) was granted "
        "the lease"
    ]
    assert verdict.counts["overlaps"] == 1


def split(b: Builder, start: float, end: float | None) -> Builder:
    b.ev("fault", start, 1, kind="split_brain", minority=["n1"], by="controller")
    if end is not None:
        b.ev("heal", end, 1, kind="split_brain", fault_t=start, by="controller")
    return b


def test_a_grant_made_while_the_store_was_split_orders_no_commit():
    # the newer holder was granted on the other primary: the old holder's lease was valid on
    # its own, and its write came first (fences [1]); only the write order is judged
    b = split(Builder(), 1.0, 4.0)
    b.ev("acquired", 0.0, step=1, owner="old-owner", fence=1)
    b.ev("acquired", 2.5, step=1, owner="new-owner", fence=2)
    b.ev("committed", 3.0, step=1, owner="old-owner", fence=1)
    b.records.append(Record(1, "pending", "done", "old-owner", 1))
    b.steps[1] = "done"
    assert b.verdict().violations == []


def test_a_split_does_not_excuse_a_stale_write_or_a_grant_outside_it():
    b = split(Builder(), 1.0, 2.0)
    b.ev("acquired", 0.0, step=1, owner="old-owner", fence=1)
    b.ev("acquired", 1.5, step=1, owner="new-owner", fence=2)  # during the split
    b.ev("committed", 1.8, step=1, owner="new-owner", fence=2)
    b.records.append(Record(1, "pending", "running", "new-owner", 2))
    b.ev("committed", 3.0, step=1, owner="old-owner", fence=1)
    b.records.append(Record(1, "running", "done", "old-owner", 1))
    b.ev("acquired", 2.5, step=2, owner="s2-old", fence=3)
    b.ev("acquired", 2.6, step=2, owner="s2-new", fence=4)  # after the heal
    b.ev("committed", 2.7, step=2, owner="s2-old", fence=3)
    b.records.append(Record(2, "pending", "done", "s2-old", 3))
    b.steps.update({1: "done", 2: "done"})
    assert b.verdict().violations == [
        "step 1: a stale holder wrote after a newer one (fences [2, 1])",
        # committed after the heal: its lease on the old primary was gone by then
        "step 1: holder old-owne (fence 1) committed after new-owne (fence 2) was granted the "
        "lease",
        "step 2: holder s2-old (fence 3) committed after s2-new (fence 4) was granted the lease",
    ]


def test_a_split_never_healed_is_a_violation_and_bounds_nothing():
    b = split(Builder(limits=RATE), 1.0, None)
    b.attempt(1, "a1", 10, 2.0)
    assert b.verdict().violations == ["the split brain at 1.000 was never healed"]


def test_a_split_excuses_only_grants_on_the_other_side():
    # both holders went through the same lock-store path (via 7001, the minority's): the
    # newer grant was on the stale holder's own primary, so the commit is stale
    b = split(Builder(), 1.0, 4.0)
    b.history[-2]["minority_via"] = [7001]
    b.ev("acquired", 0.0, step=1, owner="old-owner", fence=1, via=7001)
    b.ev("acquired", 2.5, step=1, owner="new-owner", fence=2, via=7001)
    b.ev("committed", 3.0, step=1, owner="old-owner", fence=1)
    b.records.append(Record(1, "pending", "done", "old-owner", 1))
    b.steps[1] = "done"
    assert b.verdict().violations == [
        "step 1: holder old-owne (fence 1) committed after new-owne (fence 2) was granted the "
        "lease"
    ]
    b.history[-3]["via"] = 7002  # the newer grant on the majority's path: excused
    assert b.verdict().violations == []


def test_a_commit_missing_from_the_history_is_still_judged():
    # a lost COMMIT reply: the record exists, no committed entry; the commit came no earlier
    # than the owner's last entry (its before_commit point), after a newer grant
    b = Builder()
    b.ev("acquired", 0.0, step=1, owner="old-owner", fence=1)
    b.ev("acquired", 2.5, step=1, owner="new-owner", fence=2)
    b.ev("point", 3.0, step=1, point="before_commit", owner="old-owner", fence=1)
    b.records.append(Record(1, "pending", "done", "old-owner", 1))
    b.steps[1] = "done"
    assert b.verdict().violations == [
        "step 1: holder old-owne (fence 1) committed after new-owne (fence 2) was granted the "
        "lease"
    ]


def test_a_commit_whose_reply_was_lost_is_dated_when_it_was_sent():
    # COMMIT went out at 3.0 and landed; its reply was dropped (lost_commit_reply), so the
    # owner waited, and its heartbeat noted the lease lost at 6.0, after a newer grant at
    # 5.0 (which found the step done): the commit came before that grant
    b = Builder()
    b.ev("acquired", 0.0, step=1, owner="old-owner", fence=1)
    b.ev("fault", 2.0, kind="lost_commit_reply", by="controller")
    b.ev("point", 3.0, step=1, point="before_commit", owner="old-owner", fence=1)
    b.ev("acquired", 5.0, step=1, owner="new-owner", fence=2)
    b.ev("conflict", 5.1, step=1, owner="new-owner", fence=2, current="done")
    b.ev("lost", 6.0, step=1, owner="old-owner", fence=1)
    b.ev("heal", 7.0, kind="lost_commit_reply", fault_t=2.0, by="controller")
    b.records.append(Record(1, "pending", "done", "old-owner", 1))
    b.steps[1] = "done"
    assert b.verdict().violations == []
    stale = [
        "step 1: holder old-owne (fence 1) committed after new-owne (fence 2) was granted the "
        "lease"
    ]
    history = b.history
    b.history = [e for e in history if e["ev"] not in ("fault", "heal")]  # no lost reply
    assert b.verdict().violations == stale
    # COMMIT sent before the fault: its reply was not the one dropped
    b.history = [{**e, "t": 1.5} if e.get("point") == "before_commit" else e for e in history]
    assert b.verdict().violations == stale
    # a commit whose reply came (its committed entry) is dated by that reply
    b.history = [
        *history,
        {"ev": "committed", "t": 5.5, "step": 1, "owner": "old-owner", "fence": 1},
    ]
    assert b.verdict().violations == stale


def test_one_fencing_token_written_by_two_owners():
    b = Builder().attempt(1, "a", 5, 0.0, to="running")
    b.records.append(Record(1, "running", "done", "b", 5))
    b.steps[1] = "done"
    assert b.verdict().violations == ["step 1: one fencing token 5 written by 2 owners (a, b)"]


def test_records_of_a_step_missing_from_steps_json_are_judged():
    b = Builder()
    b.records += [Record(9, "pending", "done", "a", 1), Record(9, "pending", "done", "b", 2)]
    violations = b.verdict().violations
    assert violations[0] == "step 9: committed transitions but not in steps.json"
    assert any("2 terminal transitions committed" in v for v in violations)


def test_a_data_loss_explains_no_more_than_one_limit_per_stretch():
    # limit 2 per 1 s: 2 before a restart and 2 after it are what a lost log allows; a third
    # after it (a fresh log counts from the restart) is not
    b = Builder(limits=RATE)
    for t in (100.0, 100.1):
        b.grant("r:api", t)
    b.ev("fault", 100.2, kind="redis_restart", by="controller")
    for t in (100.3, 100.4):
        b.grant("r:api", t)
    verdict = b.verdict()
    assert (verdict.violations, len(verdict.data_loss)) == ([], 1)
    b.grant("r:api", 100.5)
    verdict = b.verdict()
    assert len(verdict.violations) == 1 and verdict.data_loss == []
    assert verdict.violations[0].startswith("rate r:api: 5 grants in [100.000000, +1 s)")


def test_an_excess_far_from_a_data_loss_is_a_violation():
    b = Builder(limits=RATE)
    for t in (0.0, 0.1, 0.2):  # no fault near: a violation
        b.grant("r:api", t)
    b.ev("fault", 5.0, kind="redis_restart", by="controller")
    for t in (5.1, 5.2, 5.3):  # all after the restart: the fresh log should have held
        b.grant("r:api", t)
    verdict = b.verdict()
    assert [v.split(" for ")[0] for v in verdict.violations] == [
        "rate r:api: 3 grants in [0.000000, +1 s)",
        "rate r:api: 3 grants in [5.100000, +1 s)",
    ]
    assert verdict.data_loss == []


def test_a_short_pause_does_not_end_a_slot_hold():
    b = Builder(limits=RATE)
    b.meta["ttl"] = 2.0
    b.slot("slot_acquired", 1.0, "s1", pid=1)
    b.ev("fault", 1.5, kind="pause", signal="SIGSTOP", pid=1, by="controller")
    b.ev("heal", 1.55, kind="pause", signal="SIGCONT", pid=1, fault_t=1.5, by="controller")
    b.slot("slot_acquired", 2.0, "s2", slot=1, pid=2)
    b.slot("slot_acquired", 2.1, "s3", slot=0, pid=3)
    verdict = b.verdict()
    assert [v.split(" (")[0] for v in verdict.violations] == [
        "concurrency c:db: 3 slots held at 2.100 for a limit of 2"
    ]


def test_a_limit_exceeded_during_a_split_is_reported_apart():
    b = split(Builder(limits=RATE), 99.0, 104.0)  # began before the window, lasted into it
    for t in (100.0, 100.2, 100.4):
        b.grant("r:api", t)
    verdict = b.verdict()
    assert verdict.violations == []
    assert len(verdict.data_loss) == 1
    assert verdict.data_loss[0].endswith("; after split_brain at 99.000")
    assert verdict.counts["after_data_loss"] == 1


def test_every_step_of_steps_json_is_judged_even_without_history():
    b = Builder()
    b.steps.update({2: "pending", "x-9": "pending"})
    assert b.verdict().violations == [
        "step 2: no terminal transition committed (status 'pending')",
        "step x-9: no terminal transition committed (status 'pending')",
    ]


def test_keys_without_ttl():
    b = Builder().attempt(1, "a", 1, 0.0)
    b.store["keys_without_ttl"] = ["steplock:fence:step:1", "steplock:lease:step:2"]
    verdict = b.verdict()
    assert verdict.violations == [
        "2 lock-store key(s) without a TTL (steplock:fence:step:1, steplock:lease:step:2)"
    ]
    assert verdict.counts["keys_without_ttl"] == 2 and not verdict.ok


def test_a_leftover_lease_and_a_leftover_slot():
    b = Builder().attempt(1, "a", 1, 0.0)
    b.store["leftover"] = ["steplock:lease:step:1", "steplock:lease:limit:c:db:1"]
    verdict = b.verdict()
    assert verdict.violations == []
    assert verdict.leftovers == [
        "left in the lock store: steplock:lease:limit:c:db:1",
        "left in the lock store: steplock:lease:step:1",
    ]
    assert verdict.as_dict()["leftover"] == [
        "steplock:lease:limit:c:db:1",
        "steplock:lease:step:1",
    ]
    assert (verdict.counts["leftovers"], verdict.ok) == (2, False)


def test_a_rate_limit_exceeded():
    b = Builder(limits=RATE)
    for t in (10.0, 10.2, 10.4, 10.6, 12.0):
        b.grant("r:api", t, owner=f"own{t}")
    verdict = b.verdict()
    # the windows from 10.0 (4 grants) and 10.2 (3) are one burst, named by its fullest
    assert verdict.violations == [
        "rate r:api: 4 grants in [10.000000, +1 s) for a limit of 2 "
        "(own10.0, own10.2, own10.4, own10.6)"
    ]
    assert verdict.counts["rate_grants"] == 5


def test_a_grant_without_its_redis_time_is_counted_not_judged():
    b = Builder(limits=RATE)
    for t in (1.0, 1.1):
        b.grant("r:api", t)
    b.ev("rate_granted", 1.2, key="r:api", granted_at=None, limit="2/1s window")
    verdict = b.verdict()
    assert (verdict.violations, verdict.counts["rate_grants"]) == ([], 3)
    assert verdict.counts["rate_unjudged"] == 1


def test_the_rate_window_is_half_open():
    exact = Builder(limits=RATE)
    for t in (1796006667.068929, 1796006667.5, 1796006668.068929):
        exact.grant("r:api", t)  # the third is exactly one window after the first: allowed
    assert exact.verdict().violations == []
    inside = Builder(limits=RATE)
    for t in (1796006667.068929, 1796006667.5, 1796006668.068928):
        inside.grant("r:api", t)  # one microsecond inside the window
    assert inside.verdict().violations == [
        "rate r:api: 3 grants in [1796006667.068929, +1 s) for a limit of 2 (o, o, o)"
    ]


def test_separate_bursts_and_keys_judged_by_their_window_only():
    b = Builder(limits=RATE)
    for t in (0.0, 0.1, 0.2, 5.0, 5.1, 5.2, 5.3):
        b.grant("r:api", t)
    for t in (0.0, 0.0, 0.0):
        b.grant("r:other", t)  # "2/1s": neither configured nor a sliding window's description
    for t in (0.0, 0.5, 0.9):
        b.ev("rate_granted", t, key="r:bucket", granted_at=t, limit="2/s bucket of 2", owner="b")
    for t in (7.0, 7.5, 7.9):
        b.ev("rate_granted", t, key="r:described", granted_at=t, limit="2/1s window", owner="d")
    assert b.verdict().violations == [
        "rate r:api: 3 grants in [0.000000, +1 s) for a limit of 2 (o, o, o)",
        "rate r:api: 4 grants in [5.000000, +1 s) for a limit of 2 (o, o, o, o)",
        "rate r:described: 3 grants in [7.000000, +1 s) for a limit of 2 (d, d, d)",
    ]


def test_a_concurrency_limit_exceeded():
    b = Builder(limits=RATE)
    b.slot("slot_acquired", 1.0, "s1", slot=0, fence=1, pid=1)
    b.slot("slot_acquired", 1.1, "s2", slot=1, fence=2, pid=2)
    b.slot("slot_acquired", 1.2, "s3", slot=0, fence=3, pid=3)
    b.slot("slot_released", 2.0, "s1", slot=0, fence=1, pid=1)
    b.slot("slot_released", 2.0, "s2", slot=1, fence=2, pid=2)
    b.slot("slot_released", 2.0, "s3", slot=0, fence=3, pid=3)
    verdict = b.verdict()
    assert verdict.violations == [
        "concurrency c:db: 3 slots held at 1.200 for a limit of 2 "
        "(s1 slot 0 fence 1, s2 slot 1 fence 2, s3 slot 0 fence 3)"
    ]
    assert verdict.counts["slot_grants"] == 3


def test_a_release_and_a_grant_at_one_instant_do_not_overlap():
    b = Builder(limits=RATE)
    b.slot("slot_acquired", 1.0, "s1", slot=0, pid=1)
    b.slot("slot_acquired", 1.1, "s2", slot=1, pid=2)
    b.slot("slot_released", 2.0, "s1", slot=0, pid=1)
    b.slot("slot_acquired", 2.0, "s3", slot=0, fence=2, pid=3)
    b.slot("slot_released", 3.0, "s2", slot=1, pid=2)
    b.slot("slot_released", 3.0, "s3", slot=0, fence=2, pid=3)
    assert b.verdict().violations == []
    b.history[2]["t"] = 2.000001  # released just after the next grant: three at once
    assert b.verdict().violations == [
        "concurrency c:db: 3 slots held at 2.000 for a limit of 2 "
        "(s1 slot 0 fence 1, s2 slot 1 fence 1, s3 slot 0 fence 2)"
    ]


def test_the_limit_of_the_events_is_used_when_run_json_has_none():
    b = Builder()
    for owner in ("s1", "s2", "s3"):
        b.slot("slot_acquired", 1.0, owner, key="c:other")
    assert b.verdict().violations == [
        "concurrency c:other: 3 slots held at 1.000 for a limit of 2 "
        "(s1 slot 0 fence 1, s2 slot 0 fence 1, s3 slot 0 fence 1)"
    ]


def test_a_paused_holder_is_not_counted_past_its_sigstop():
    b = Builder(limits=RATE)
    b.slot("slot_acquired", 1.0, "s1", slot=0, pid=1)
    b.slot("slot_acquired", 1.1, "s2", slot=1, pid=2)
    b.ev("fault", 1.5, kind="pause", signal="SIGSTOP", pid=1, seconds=4)
    b.slot("slot_acquired", 3.5, "s3", slot=0, fence=2, pid=3)  # s1's slot expired meanwhile
    b.ev("heal", 5.5, kind="pause", signal="SIGCONT", pid=1, fault_t=1.5)
    b.slot("slot_expired", 5.6, "s1", slot=0, pid=1)
    b.slot("slot_released", 6.0, "s2", slot=1, pid=2)
    b.slot("slot_released", 6.0, "s3", slot=0, fence=2, pid=3)
    assert b.verdict().violations == []


def killed_and_finished_holders(kill: bool) -> Builder:
    b = Builder(limits=RATE)
    b.slot("slot_acquired", 1.0, "s1", pid=1)
    b.slot("slot_acquired", 1.1, "s2", slot=1, pid=2, task_id="t2")
    if kill:
        b.ev("fault", 1.2, kind="kill_main", signal="SIGKILL", pid=[7, 1])
    b.ev("task_end", 1.3, 2, task_id="t2")
    b.slot("slot_acquired", 1.4, "s3", pid=3)
    b.slot("slot_acquired", 1.5, "s4", slot=1, pid=4)
    b.slot("slot_released", 2.0, "s3", pid=3)
    b.slot("slot_released", 2.0, "s4", slot=1, pid=4)
    return b


def test_a_hold_ends_when_its_holder_learns_the_slot_is_gone():
    b = Builder(limits=RATE)
    b.slot("slot_acquired", 1.0, "s1", pid=1)
    b.slot("slot_acquired", 1.1, "s2", slot=1, pid=2)
    b.ev("lost", 1.5, 1, owner="s1", fence=1, reason="renewal refused")  # step None: a slot
    b.slot("slot_acquired", 1.6, "s3", pid=3)
    b.ev("slot_expired", 2.0, None, limit_key="c:db", limit=2, owner="s1", reason="reaped")
    assert b.verdict().violations == []


def slow_store_holder(learns_lost: bool, regrant_fence: int = 3_500_000) -> Builder:
    # s1's renewal is stuck behind a slow store past the TTL (2 s): the store lets slot 0
    # expire and grants it to s3 (its token 2.5 s of Redis time later) before s1 hears back
    # and finds it expired
    b = Builder(limits=RATE)
    b.meta["ttl"] = 2.0
    b.slot("slot_acquired", 1.0, "s1", slot=0, fence=1_000_000, pid=1)
    b.slot("slot_acquired", 1.1, "s2", slot=1, fence=1_100_000, pid=2)
    b.slot("slot_acquired", 3.5, "s3", slot=0, fence=regrant_fence, pid=3)
    if learns_lost:
        b.ev("lost", 4.6, 1, owner="s1", fence=1_000_000, reason="local validity ran out")
        b.slot("slot_expired", 4.7, "s1", slot=0, fence=1_000_000, pid=1)
    else:
        b.slot("slot_released", 4.7, "s1", slot=0, fence=1_000_000, pid=1)
    b.slot("slot_released", 6.0, "s2", slot=1, fence=1_100_000, pid=2)
    b.slot("slot_released", 6.0, "s3", slot=0, fence=regrant_fence, pid=3)
    return b


def test_a_slot_found_expired_was_gone_by_the_next_grant_of_its_index():
    assert slow_store_holder(learns_lost=True).verdict().violations == []
    # still holding it (released, not expired): the store granted slot 0 twice
    [problem] = slow_store_holder(learns_lost=False).verdict().violations
    assert problem.startswith("concurrency c:db: 3 slots held at 3.500 for a limit of 2")


def test_a_slot_granted_again_sooner_than_its_ttl_is_granted_twice():
    # s3's token is 0.5 s of Redis time after s1's: s1's key could not have expired by then
    # (a script that overwrote a held slot), however s1 learnt of it afterwards
    [problem] = slow_store_holder(learns_lost=True, regrant_fence=1_500_000).verdict().violations
    assert problem.startswith("concurrency c:db: 3 slots held at 3.500 for a limit of 2")


def test_a_killed_holder_and_a_finished_task_hold_no_slot():
    assert killed_and_finished_holders(kill=True).verdict().violations == []
    # without the SIGKILL, s1 holds on (no release, no task end): s2's task end still counts
    assert killed_and_finished_holders(kill=False).verdict().violations == [
        "concurrency c:db: 3 slots held at 1.500 for a limit of 2 "
        "(s1 slot 0 fence 1, s3 slot 0 fence 1, s4 slot 1 fence 1)"
    ]


def test_an_idempotent_body_after_its_completion():
    b = Builder()
    b.ev("idem_body", 1.0, key="idem:k", task_id="t-first", step=7)
    b.ev("idem_completed", 1.5, key="idem:k")
    b.ev("idem_body", 2.0, key="idem:k", task_id="t-second", step=8)
    verdict = b.verdict()
    assert verdict.violations == [
        "idempotency idem:k: body of task t-second (step 8) started at 2.000, after the "
        "completion recorded at 1.500"
    ]
    assert (verdict.counts["idem_bodies"], verdict.counts["idem_completions"]) == (2, 1)


def test_a_limit_exceeded_after_a_redis_data_loss_is_reported_apart():
    b = Builder(limits=RATE)
    b.ev("idem_body", 1.0, key="idem:k", task_id="t-first", step=7)
    b.ev("idem_completed", 1.5, key="idem:k")
    b.ev("fault", 1.7, kind="redis_restart", by="controller")
    b.ev("idem_body", 2.0, key="idem:k", task_id="t-second", step=7)
    b.ev("idem_completed", 2.5, key="idem:k")
    b.slot("slot_acquired", 3.0, "s1", pid=1)
    b.slot("slot_acquired", 3.1, "s2", slot=1, pid=2)
    b.ev("fault", 3.2, kind="redis_failover", by="controller")
    b.slot("slot_acquired", 3.3, "s3", pid=3)
    for owner, slot, pid in (("s1", 0, 1), ("s2", 1, 2), ("s3", 0, 3)):
        b.slot("slot_released", 4.0, owner, slot=slot, pid=pid)
    for owner, pid in (("s4", 4), ("s5", 5), ("s6", 6)):
        b.slot("slot_acquired", 9.0, owner, pid=pid)  # no Redis fault since they started
    b.ev("fault", 20.0, kind="redis_restart", by="controller")
    verdict = b.verdict()
    assert verdict.violations == [
        "concurrency c:db: 3 slots held at 9.000 for a limit of 2 (s4 slot 0 fence 1, s5 slot 0 "
        "fence 1, s6 slot 0 fence 1)",
    ]
    assert verdict.data_loss == [
        "concurrency c:db: 3 slots held at 3.300 for a limit of 2 (s1 slot 0 fence 1, s2 slot 1 "
        "fence 1, s3 slot 0 fence 1); after redis_failover at 3.200",
        "idempotency idem:k: body of task t-second (step 7) started at 2.000, after the "
        "completion recorded at 1.500; after redis_restart at 1.700",
        "idempotency idem:k: completed again at 2.500 (first at 1.500); after redis_restart at "
        "1.700",
    ]
    assert not verdict.ok and verdict.as_dict()["data_loss"] == verdict.data_loss
    assert verdict.counts["after_data_loss"] == 3


def test_two_completions_of_one_key():
    b = Builder()
    b.ev("idem_body", 1.0, key="idem:k", task_id="t1", step=1)
    b.ev("idem_body", 1.1, key="idem:k", task_id="t2", step=1)
    b.ev("idem_completed", 1.5, key="idem:k")
    b.ev("idem_completed", 1.6, key="idem:k")
    b.ev("idem_replayed", 2.0, key="idem:k")
    verdict = b.verdict()
    assert verdict.violations == [
        "idempotency idem:k: body of task t2 started at 1.100 while the body of task t1 "
        "(started at 1.000) ran",
        "idempotency idem:k: completed again at 1.600 (first at 1.500)",
    ]
    assert verdict.counts["idem_replays"] == 1


def test_fence_refusals_are_counted_once_per_attempt():
    b = Builder()
    b.ev("conflict", 1.0, step=1, owner="x", fence=3, stale_fence=True)
    b.ev(
        "lost",
        1.1,
        step=1,
        owner="x",
        fence=3,
        reason="the step row carries a newer fencing token than 3",
    )
    b.ev(
        "lost",
        1.2,
        step=1,
        owner="y",
        fence=4,
        reason="the step row carries a newer fencing token than 4",
    )
    b.ev("conflict", 1.3, step=1, owner="z", fence=5, reason=None)  # the status had moved on
    b.ev("lost", 1.4, step=1, owner="w", fence=6, reason="renewal refused: the lease is gone")
    assert b.verdict().counts["fence_refusals"] == 2


def test_a_threads_worker_ends_a_hold_at_its_own_task_end():
    # one pid, two tasks: the end of t-other says nothing about t-mine's hold
    b = Builder()
    b.ev("acquired", 0.0, 50, step=1, owner="mine", fence=1, task_id="t-mine")
    b.ev("task_end", 0.5, 50, step=9, task_id="t-other")
    b.ev("acquired", 1.0, 51, step=1, owner="next", fence=2, task_id="t-next")
    b.ev("task_end", 1.5, 51, step=1, task_id="t-next")
    b.ev("task_end", 2.0, 50, step=1, task_id="t-mine")
    b.steps[1] = "pending"
    verdict = b.verdict()
    assert verdict.counts["overlaps"] == 1


def test_a_same_id_duplicate_in_another_process_keeps_its_own_hold():
    b = Builder()
    b.ev("acquired", 0.0, 60, step=1, owner="first", fence=1, task_id="same")
    b.ev("task_end", 0.5, 61, step=1, task_id="same")  # the duplicate gave up in pid 61
    b.ev("acquired", 1.0, 62, step=1, owner="second", fence=2, task_id="other")
    b.ev("task_end", 1.5, 62, step=1, task_id="other")
    b.ev("task_end", 2.0, 60, step=1, task_id="same")
    b.steps[1] = "pending"
    assert b.verdict().counts["overlaps"] == 1


def test_load_reads_a_run_directory_and_a_gzipped_history(tmp_path):
    run = clean_example().run()
    plain = runcheck.load(runcheck.dump(run, tmp_path / "plain"))
    packed_dir = runcheck.dump(run, tmp_path / "packed", packed=True)
    assert not (packed_dir / "history.jsonl").exists()
    with gzip.open(packed_dir / "history.jsonl.gz", "rt") as f:
        assert len(f.read().splitlines()) == len(run.history)
    packed = runcheck.load(packed_dir)
    for loaded in (plain, packed):
        assert loaded.steps == run.steps and loaded.records == run.records
        assert loaded.history == run.history and loaded.meta == run.meta
        assert runcheck.check_run(loaded).as_dict() == runcheck.check_run(run).as_dict()


def test_load_without_a_history_raises(tmp_path):
    (tmp_path / "steps.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no history.jsonl"):
        runcheck.load(tmp_path)


def test_the_command_line_prints_and_writes_the_verdict(tmp_path, capsys):
    good = runcheck.dump(clean_example().run(), tmp_path / "good")
    bad = runcheck.dump(unguarded_example().run(), tmp_path / "bad")
    assert runcheck.main([str(good), "--no-write"]) == 0
    assert not (good / "verdict.json").exists()
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "OK: 0 violation(s), 0 leftover(s)"
    assert runcheck.main([str(good)]) == 0  # the runner's call: writes verdict.json
    assert json.loads((good / "verdict.json").read_text())["ok"] is True
    capsys.readouterr()
    assert runcheck.main([str(bad), "--write"]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "FAILED: 2 violation(s), 0 leftover(s)"
    stored = json.loads((bad / "verdict.json").read_text())
    assert stored["ok"] is False and len(stored["violations"]) == 2
    assert json.loads(out[out.index("{") :]) == stored


def fixture_dirs() -> list[Path]:
    return sorted(p for p in FIXTURES.glob("nemesis-*") if p.is_dir())


def test_the_example_fixtures_are_what_the_builders_make():
    for name, build in EXAMPLES.items():
        stored = runcheck.load(FIXTURES / name)
        built = build().run()
        assert (stored.history, stored.steps, stored.records) == (
            built.history,
            built.steps,
            built.records,
        )
        assert stored.meta == built.meta


@pytest.mark.parametrize("path", fixture_dirs(), ids=lambda p: p.name)
def test_a_recorded_run_gives_its_stored_verdict(path):
    run = runcheck.load(path)
    verdict = runcheck.check_run(run)
    stored = json.loads((path / "verdict.json").read_text())
    assert verdict.violations == stored["violations"]
    assert (verdict.leftovers, verdict.leftover) == (stored["leftovers"], stored["leftover"])
    assert verdict.counts == stored["counts"]
    assert verdict.data_loss == stored["data_loss"]
    if run.meta.get("unguarded"):
        assert verdict.violations, "a negative control must show violations"
    else:
        assert (verdict.violations, verdict.leftovers) == ([], [])


def test_the_fixture_directories_include_the_examples():
    names = {p.name for p in fixture_dirs()}
    assert set(EXAMPLES) <= names
    # and a recorded run of every fault kind (split brain included) with its negative control
    # on the same seed
    assert {"nemesis-seed21-120s", "nemesis-seed21-60s-unguarded"} <= names
    guarded = json.loads((FIXTURES / "nemesis-seed21-120s" / "verdict.json").read_text())
    control = json.loads((FIXTURES / "nemesis-seed21-60s-unguarded" / "run.json").read_text())
    assert len(guarded["counts"]["faults"]) == 15 and guarded["counts"]["faults"]["split_brain"]
    assert (control["seed"], control["unguarded"]) == (21, True)


def test_two_bodies_of_one_key_at_once():
    b = Builder()
    b.ev("idem_body", 1.0, key="idem:k", task_id="t-first", step=7, pid=1)
    b.ev("idem_body", 1.2, key="idem:k", task_id="t-second", step=7, pid=2)
    b.ev("idem_completed", 2.0, key="idem:k")
    assert b.verdict().violations == [
        "idempotency idem:k: body of task t-second started at 1.200 while the body of task "
        "t-first (started at 1.000) ran"
    ]


def test_a_body_after_its_predecessor_was_killed_is_no_violation_and_one_without_a_key_is():
    b = Builder()
    b.ev("idem_body", 1.0, key="idem:k", task_id="t-first", step=7, pid=1)
    b.ev("fault", 1.1, kind="kill_child", signal="SIGKILL", pid=1, by="controller")
    b.ev("idem_body", 9.0, key="idem:k", task_id="t-second", step=7, pid=2)
    b.ev("idem_completed", 9.5, key="idem:k")
    b.ev("idem_body", 10.0, key=None, task_id="t-third", step=8, pid=3)
    assert b.verdict().violations == [
        "idempotency: body of task t-third (step 8) at 10.000 ran with no idempotency record"
    ]


def test_a_commit_in_flight_on_a_delayed_database_path_is_dated_when_it_was_sent():
    # the ownership check passed at 3.0 and COMMIT went out; the database path was slow
    # until 7.0, so the reply (the committed entry) came at 8.0, after a newer grant at 5.0:
    # the commit may have landed before it, which orders nothing
    b = Builder()
    b.ev("acquired", 0.0, step=1, owner="old-owner", fence=1)
    b.ev("point", 3.0, step=1, point="before_commit", owner="old-owner", fence=1)
    b.ev("fault", 2.5, kind="pg_latency", by="controller")
    b.ev("acquired", 5.0, step=1, owner="new-owner", fence=2)
    b.ev("heal", 7.0, kind="pg_latency", fault_t=2.5, by="controller")
    b.ev("committed", 8.0, step=1, owner="old-owner", fence=1)
    b.records.append(Record(1, "pending", "done", "old-owner", 1))
    b.steps[1] = "done"
    assert b.verdict().violations == []
    b.history = [e for e in b.history if e["ev"] not in ("fault", "heal")]  # no delay: stale
    assert b.verdict().violations == [
        "step 1: holder old-owne (fence 1) committed after new-owne (fence 2) was granted the "
        "lease"
    ]


# -- the circuit breaker's invariants (runcheck.check_breakers) ---------------------------------

BREAKER = {"breaker": {"dep": {"half_open_probes": 1, "probe_timeout": 15.0}}}


def dep_call(
    b: Builder, t, task, pid=100, generation=1, probe=False, admitted=True, took=0.05, **fields
):
    """One call of the breaker's dependency by task ``task`` at ``t``, admitted (its admission
    began 0.01 s earlier) in ``generation``, returning after ``took`` s (None: never)."""
    admission = (
        {
            "admitted": True,
            "probe": probe,
            "generation": generation,
            "guarded": True,
            "admit_t0": t - 0.01,
            "admit_t1": t - 0.005,
            "state_cache": 1.0,
            "probe_timeout": 15.0,
            "half_open_probes": 1,
        }
        if admitted
        else {"admitted": False, "probe": False, "generation": None, "guarded": False}
    )
    admission.update(fields)
    b.ev("dep_call", t, pid, name="dep", step=1, task_id=task, **admission)
    if took is not None:
        b.ev("dep_done", t + took, pid, name="dep", step=1, task_id=task, failed=False)
    return b


def opened(b: Builder, t, task, pid=100):
    return b.ev("breaker", t, pid, name="dep", state="open", what="opened", task_id=task)


def test_a_call_admitted_by_the_generation_an_open_ended_is_a_violation_past_the_cache():
    b = Builder(limits=BREAKER)
    dep_call(b, 1.0, "t-fail", pid=1, generation=4)  # its failure opens generation 4
    opened(b, 1.1, "t-fail", pid=1)
    dep_call(b, 1.8, "t-cached", pid=2, generation=4)  # another process's copy: 0.7 s < 1 s
    dep_call(b, 2.0, "t-new", pid=2, generation=6)  # a later closed generation
    assert b.verdict().violations == []
    assert b.verdict().counts["breaker_calls"] == {
        "calls": 3,
        "unadmitted_calls": 0,
        "probes": 0,
        "opens": 1,
        "opens_unlinked": 0,
        "admitted_after_open": 0,
        "admitted_from_cache_window": 1,
    }
    dep_call(b, 2.3, "t-late", pid=2, generation=4)  # 1.19 s after the open: past the cache
    dep_call(b, 1.3, "t-same", pid=1, generation=4)  # the opener's process refuses at once
    assert b.verdict().violations == [
        "breaker dep: call of task t-same (step 1, pid 1) at 1.300 admitted in generation 4 at "
        "1.290, which the open at 1.100 (task t-fail) had ended (in the process that opened it)",
        "breaker dep: call of task t-late (step 1, pid 2) at 2.300 admitted in generation 4 at "
        "2.290, which the open at 1.100 (task t-fail) had ended (1.190 s after it, state cache "
        "1 s)",
    ]


def test_a_call_without_an_admission_while_open_is_a_violation_and_apart_after_a_data_loss():
    b = Builder(limits=BREAKER)
    dep_call(b, 1.0, "t-fail", pid=1)
    opened(b, 1.1, "t-fail", pid=1)
    b.ev("breaker", 2.6, 1, name="dep", state="half_open", what="half_open", task_id="t-p")
    dep_call(b, 0.5, "t-before", admitted=False)  # before the open and after its end: not
    dep_call(b, 3.0, "t-after", admitted=False)  # judged by this rule
    assert b.verdict().violations == []
    dep_call(b, 1.5, "t-bypass", pid=2, admitted=False)
    assert b.verdict().violations == [
        "breaker dep: call of task t-bypass (step 1, pid 2) at 1.500 made with no admission "
        "while the breaker was open (opened at 1.100)"
    ]
    b.ev("fault", 1.2, 0, kind="redis_restart")
    verdict = b.verdict()
    assert verdict.violations == []
    assert verdict.data_loss == [
        "breaker dep: call of task t-bypass (step 1, pid 2) at 1.500 made with no admission "
        "while the breaker was open (opened at 1.100); after redis_restart at 1.200"
    ]


def test_sequential_probes_pass_and_two_at_once_are_a_violation():
    b = Builder(limits=BREAKER)
    dep_call(b, 1.0, "t-p1", pid=1, generation=5, probe=True, took=0.5)
    dep_call(b, 1.5, "t-p2", pid=2, generation=5, probe=True)  # after p1 returned
    # a probe that never returned frees its permit probe_timeout after its admission began
    dep_call(b, 3.0, "t-p3", pid=3, generation=7, probe=True, took=None)
    dep_call(b, 18.0, "t-p4", pid=4, generation=7, probe=True)
    verdict = b.verdict()
    assert verdict.violations == []
    assert verdict.counts["breaker_calls"]["probes"] == 4
    dep_call(b, 1.2, "t-extra", pid=5, generation=None, probe=True)
    assert b.verdict().violations == [
        "breaker dep: probe call of task t-extra (step 1, pid 5) at 1.200 while 1 probe(s) "
        "ran, for 1 at once (call of task t-p1 (step 1, pid 1) at 1.000)"
    ]


def probes_that_never_returned(end: bool) -> Builder:
    b = Builder(limits=BREAKER)
    dep_call(b, 1.0, "t-p1", pid=1, probe=True, took=None)
    dep_call(b, 2.0, "t-p2", pid=2, probe=True, took=None)
    if end:
        b.ev("task_end", 1.1, 1, task_id="t-p1")
        b.ev("fault", 2.1, 2, signal="SIGKILL")
    return dep_call(b, 3.0, "t-p3", pid=3, probe=True)


def test_a_probe_ends_at_its_task_end_or_its_kill():
    assert probes_that_never_returned(end=True).verdict().violations == []
    assert probes_that_never_returned(end=False).verdict().violations == [
        "breaker dep: probe call of task t-p2 (step 1, pid 2) at 2.000 while 1 probe(s) ran, "
        "for 1 at once (call of task t-p1 (step 1, pid 1) at 1.000)",
        "breaker dep: probe call of task t-p3 (step 1, pid 3) at 3.000 while 2 probe(s) ran, "
        "for 1 at once (call of task t-p1 (step 1, pid 1) at 1.000, call of task t-p2 (step 1, "
        "pid 2) at 2.000)",
    ]


def test_a_probe_holds_its_permit_until_its_outcome_is_written():
    def run(second_at: float) -> runcheck.RunVerdict:
        b = Builder(limits=BREAKER)
        dep_call(b, 1.0, "t-p1", pid=1, probe=True, took=0.05)  # returned at 1.05
        b.ev("breaker_outcome", 1.3, 1, name="dep", task_id="t-p1", how="record")
        return dep_call(b, second_at, "t-p2", pid=2, probe=True).verdict()

    assert run(1.3).violations == []
    assert run(1.2).violations == [
        "breaker dep: probe call of task t-p2 (step 1, pid 2) at 1.200 while 1 probe(s) ran, "
        "for 1 at once (call of task t-p1 (step 1, pid 1) at 1.000)"
    ]


# -- the HTTP load of --loads http (tests/support/faults/loads.py) ----------------------------


def _http_body(b: Builder, body, t, key="k1", principal="user:alice", view="guarded/sync"):
    ids = {"view": view, "key": key, "principal": principal, "body": body}
    payload = {"body": body, "principal": principal, "key": key, "amount": 1}
    b.ev("http_body_start", t, 300, **ids)
    b.ev("http_body_end", t + 0.2, 300, outcome="ok", status=201, payload=payload, **ids)
    return {
        "view": view,
        "key": key,
        "principal": principal,
        "status": 201,
        "payload": payload,
        "replayed": False,
        "retry_after": None,
        "t0": t - 0.01,
        "t1": t + 0.21,
    }


def test_the_http_load_is_judged_from_the_run_directory(tmp_path):
    """http.jsonl beside the history: a replay served to another principal and a second body
    of one key are violations named ``http <rule>``; counted under ``counts["http"]``."""
    b = Builder().attempt(1, "a", 1, 0.0)
    first = _http_body(b, "b1", 1.0)
    replay = {**first, "principal": "user:bob", "replayed": True, "t0": 1.5, "t1": 1.6}
    second = _http_body(b, "b2", 2.0)
    run = b.run()
    run.http = [first, replay, second]
    run.meta["loads"] = {"http": {"lock_ttl": 8.0}}
    verdict = runcheck.check_run(runcheck.load(runcheck.dump(run, tmp_path / "run")))
    rules = sorted(v.split(":")[0] for v in verdict.violations)
    assert rules == ["http cross_principal", "http second_body"], verdict.violations
    assert verdict.counts["http"]["requests"] == 3
    assert verdict.counts["http"]["by_rule"] == {"cross_principal": 1, "second_body": 1}


def test_a_second_http_body_after_a_store_restart_is_excused():
    b = Builder().attempt(1, "a", 1, 0.0)
    first = _http_body(b, "b1", 1.0)
    b.ev("fault", 1.5, kind="redis_restart")
    second = _http_body(b, "b2", 2.0)
    run = b.run()
    run.http = [first, second]
    verdict = runcheck.check_run(run)
    assert verdict.ok, verdict.violations
    assert verdict.counts["http"]["excused"] == {"second_body": 1}


def test_a_run_without_http_jsonl_has_no_http_counts():
    assert "http" not in Builder().attempt(1, "a", 1, 0.0).verdict().counts


def _clock_ahead_run(*refusals, opened=()):
    """A run with a clock_ahead fault at 10.0 (breaker "dep", recovery_timeout 1.5 s), its
    first admission after it at 12.0, and the breaker's refusals as open at ``refusals``."""
    b = Builder().attempt(1, "a", 1, 0.0)
    b.ev(
        "fault",
        10.0,
        kind="clock_ahead",
        skew=4.0,
        changed={"breaker_opened_ms": 1},
        breakers={"dep": {"recovery_timeout": 1.5}},
    )
    b.ev("breaker", 12.0, 201, name="dep", state="open", what="rejected", reason="open")
    for t in opened:
        b.ev("breaker", t, 202, name="dep", state="open", what="opened")
    for t in refusals:
        b.ev("breaker", t, 203, name="dep", state="open", what="rejected", reason="open")
    return b


def test_a_breaker_held_open_past_its_recovery_after_clock_ahead_is_a_violation():
    """docs/patterns/breaker.md (clock_skew): the admission after the fault clamps
    ``opened_ms`` to now, so the breaker half-opens recovery_timeout later, never after the
    skew. Bound: first admission + recovery 1.5 + state cache 1 + tolerance 1 + slack 1."""
    ok = _clock_ahead_run(13.0, 16.4).verdict()
    assert ok.ok, ok.violations
    assert ok.counts["clock_ahead"]["refusals_judged"] == 3
    assert ok.counts["clock_ahead"]["changed"] == {"breaker_opened_ms": 1}
    late = _clock_ahead_run(13.0, 17.0).verdict()
    assert [v.split(":")[0] for v in late.violations] == ["breaker dep"], late.violations
    assert "held open past recovery_timeout 1.5 s" in late.violations[0]
    # a genuine re-open at 16.0 starts a new recovery; a paused refuser's entry is not judged
    assert _clock_ahead_run(17.0, opened=(16.0,)).verdict().ok
    paused = _clock_ahead_run(17.0)
    paused.ev("fault", 14.0, kind="pause", signal="SIGSTOP", pid=203)
    assert paused.verdict().ok
    # before the fault's first admission (a copy read before it), nothing is judged
    assert "clock_ahead" not in Builder().attempt(1, "a", 1, 0.0).verdict().counts


def test_a_token_given_twice_after_clock_ahead_and_a_lagged_failover_is_reported_apart():
    """A clock_ahead leaves step 1's counter ahead of the clock: its grants are counter + 1,
    ahead of their Redis time. A lagged failover loses a grant and the promoted replica gives
    the same counter + 1 again (docs/design.md: tokens increase "as long as the Redis clock
    moves forward"): reported after the data loss, not as a violation. Without the data
    loss, or with a token of the clock's own time, it stays a violation."""

    def reissue(failover=True, ahead=True):
        t0 = 1_000_000.0
        fence = int((t0 + (9.0 if ahead else 0.0)) * 1_000_000)
        b = Builder()
        b.ev("fault", t0, kind="clock_ahead", skew=9.0, changed={"fence": 1})
        b.attempt(1, "a", fence, t0 + 1.0, to="running")
        if failover:
            b.ev("fault", t0 + 1.5, kind="redis_failover", lag=0.5)
        b.attempt(1, "b", fence, t0 + 2.0, pid=101, to="done")
        b.records[-1] = Record(1, "running", "done", "b", fence)
        return b.verdict()

    verdict = reissue()
    assert verdict.ok, verdict.violations
    assert len(verdict.data_loss) == 1 and "after clock_ahead at" in verdict.data_loss[0]
    assert "one fencing token" in verdict.data_loss[0]
    for other in (reissue(failover=False), reissue(ahead=False)):
        assert any("one fencing token" in v for v in other.violations), other.violations


def test_a_plain_writers_overwrite_counts_as_a_writer_step_violation():
    b = Builder().attempt(1, "task-owner", 1, 0.0)
    b.ev("writer_start", 0.0, 400, mode="plain", by="writer")
    b.records.append(Record(1, "pending", "cancelled", "plain-1234", None))
    b.steps[1] = "cancelled"
    verdict = b.verdict()
    assert verdict.counts["writer_commits"] == 1
    assert verdict.counts["writer_step_violations"] >= 1, verdict.violations


def test_a_grant_on_the_minority_orders_no_commit_on_the_majority_even_after_the_heal():
    # the newer grant was made on a minority path during the split: the heal discarded that
    # primary, so a holder on a majority path may commit any time later; one on the
    # minority's own path may not
    b = split(Builder(), 1.0, 2.0)
    b.history[-2]["minority_via"] = [7001]
    b.ev("acquired", 1.2, step=1, owner="major-owner", fence=1, via=7002)
    b.ev("acquired", 1.5, step=1, owner="minor-owner", fence=2, via=7001)
    b.ev("committed", 9.0, step=1, owner="major-owner", fence=1)
    b.records.append(Record(1, "pending", "done", "major-owner", 1))
    b.steps[1] = "done"
    assert b.verdict().violations == []
    b.history[-3]["via"] = 7001  # the committer on the minority's path too: stale
    assert len(b.verdict().violations) == 1


def test_a_majority_holder_granted_in_the_replication_lag_is_not_excused_after_the_heal():
    # the committer's grant came 0.2 s before the split, inside the 1 s the replica's feed
    # was stalled: it never reached the primary the heal keeps, so a minority grant during
    # the split may well have been the newer holder there too
    b = split(Builder(), 1.0, 2.0)
    b.history[-2]["minority_via"] = [7001]
    b.history[-2]["lag"] = 1.0
    b.ev("acquired", 0.8, step=1, owner="major-owner", fence=1, via=7002)
    b.ev("acquired", 1.5, step=1, owner="minor-owner", fence=2, via=7001)
    b.ev("committed", 9.0, step=1, owner="major-owner", fence=1)
    b.records.append(Record(1, "pending", "done", "major-owner", 1))
    b.steps[1] = "done"
    assert len(b.verdict().violations) == 1
    b.history[-3]["t"] = -5.0  # granted long before the stall: replicated, excused
    assert b.verdict().violations == []


def test_a_periodic_run_started_during_a_split_may_be_overlapped_as_a_data_loss():
    b = split(Builder(), 1.0, 3.0)
    for task_id, start, pid in (("p1", 1.5, 201), ("p2", 2.5, 202)):
        ident = {"name": "faults-periodic", "task_id": task_id, "owner": f"o-{task_id}"}
        b.ev("periodic_start", start, pid, rt=start, **ident)
        b.ev("periodic_end", start + 2.0, pid, rt=start + 2.0, start_rt=start, **ident)
    verdict = b.verdict()
    assert verdict.violations == []
    assert len(verdict.data_loss) == 1 and "after split_brain" in verdict.data_loss[0]
    assert verdict.counts["periodic"]["overlapping"] == 1


def test_the_http_servers_records_are_not_judged_as_tasks():
    b = Builder().attempt(1, "a", 1, 0.0)
    b.ev("load_start", 0.0, 300, load="http")
    for t in (1.0, 2.0):  # a key run again after its lock TTL: the HTTP rules' business
        b.ev("idem_completed", t, 300, key="http-record")
    verdict = b.verdict()
    assert verdict.violations == [] and verdict.counts["idem_completions"] == 0
