"""The invariant checker on hand-made histories: it must accept a clean trial and name every
kind of violation (tests/support/faults/checker.py, shared by the fault trials and the demo)."""

from types import SimpleNamespace

from tests.support.faults.checker import (
    Record,
    check,
    check_step,
    check_steps,
    keys_without_ttl,
    lease_intervals,
    lease_keys,
    overlapped,
)


def rec(to, owner="a", fence=1, from_="pending", step=1):
    return Record(step=step, from_status=from_, to_status=to, owner=owner, fence=fence)


def ev(ev, t, owner, step=1, **kw):
    return {"ev": ev, "t": t, "owner": owner, "step": step, **kw}


def test_a_single_commit_is_clean():
    verdict = check({1: "done"}, [rec("done")], [ev("acquired", 0, "a"), ev("released", 1, "a")])
    assert (verdict.violations, verdict.commits, verdict.overlaps, verdict.ok) == ([], 1, 0, True)


def test_a_duplicate_commit_is_named_with_both_owners():
    problems = check_step(
        1, "cancelled", [rec("done", "aaaaaaaa1"), rec("cancelled", "bbbbbbbb2", 2)]
    )
    assert problems[0] == (
        "step 1: 2 terminal transitions committed (done by aaaaaaaa fence 1, "
        "cancelled by bbbbbbbb fence 2)"
    )
    assert problems[1:] == [
        "step 1: 'pending' -> 'cancelled' committed while the chain was at 'done'"
    ]


def test_a_transition_out_of_a_terminal_state():
    problems = check_step(1, "pending", [rec("done"), rec("pending", "b", 2, from_="done")])
    assert "step 1: transition out of terminal 'done' -> 'pending'" in problems


def test_no_commit_at_all():
    assert check_step(1, "pending", []) == [
        "step 1: no terminal transition committed (status 'pending')"
    ]


def test_row_status_must_match_the_chain():
    assert check_step(1, "pending", [rec("done")]) == [
        "step 1: row status 'pending' but the committed chain ends at 'done'"
    ]


def test_a_stale_fence_writing_after_a_newer_one():
    chain = [rec("running", "new", 5), rec("done", "old", 3, from_="running")]
    assert check_step(1, "done", chain) == [
        "step 1: a stale holder wrote after a newer one (fences [5, 3])"
    ]


def test_legal_multi_phase_chain():
    chain = [
        rec("running", "a", 1),
        rec("pending", "reaper", None, from_="running"),
        rec("running", "b", 2),
        rec("done", "b", 2, from_="running"),
    ]
    assert check_step(1, "done", chain) == []


def test_overlap_of_a_paused_holder_and_its_successor():
    history = [
        ev("acquired", 0.0, "a"),
        ev("acquired", 2.5, "b"),
        ev("released", 3.0, "b"),
        ev("lost", 4.0, "a"),
    ]
    intervals = lease_intervals(history, 1, end_of_trial=9)
    assert intervals == {"a": (0.0, 4.0), "b": (2.5, 3.0)}
    assert overlapped(intervals)


def test_a_sigkill_ends_the_victims_hold():
    history = [
        ev("acquired", 0.0, "a", pid=10),
        {"ev": "fault", "t": 1.0, "signal": "SIGKILL", "pid": 10},
        ev("acquired", 2.5, "b", pid=11),
        ev("released", 3.0, "b"),
    ]
    intervals = lease_intervals(history, 1, end_of_trial=9)
    assert intervals == {"a": (0.0, 1.0), "b": (2.5, 3.0)}
    assert not overlapped(intervals)


def test_lock_store_findings_count():
    verdict = check({1: "done"}, [rec("done")], [], leftover_leases=2, keys_without_ttl=1)
    assert verdict.violations == ["1 lock-store key(s) without a TTL"]
    assert verdict.leftover_leases == 2 and not verdict.ok


def test_the_end_of_the_task_run_ends_a_hold_whose_release_failed():
    history = [
        ev("acquired", 0.0, "a", pid=10),
        ev("store_error", 0.5, "a", pid=10),
        {"ev": "task_end", "t": 0.6, "pid": 10, "step": 1},
        ev("acquired", 31.0, "b", pid=11),
        ev("released", 31.5, "b", pid=11),
    ]
    intervals = lease_intervals(history, 1, end_of_trial=40)
    assert intervals == {"a": (0.0, 0.6), "b": (31.0, 31.5)}
    assert not overlapped(intervals)


def test_a_commit_after_a_newer_holder_was_granted_is_a_violation():
    history = [
        ev("acquired", 0.0, "old-owner", fence=1),
        ev("acquired", 2.5, "new-owner", fence=2),
        ev("committed", 3.0, "old-owner", fence=1),
        ev("conflict", 3.1, "new-owner"),
    ]
    verdict = check({1: "done"}, [rec("done", "old-owner", 1)], history)
    assert verdict.violations == [
        "step 1: holder old-owne (fence 1) committed after new-owne "
        "(fence 2) was granted the lease"
    ]


def test_a_commit_before_the_next_grant_is_fine():
    history = [
        ev("acquired", 0.0, "a", fence=1),
        ev("committed", 0.5, "a", fence=1),
        ev("released", 0.6, "a"),
        ev("acquired", 1.0, "b", fence=2),
        ev("conflict", 1.1, "b"),
    ]
    assert check({1: "done"}, [rec("done", "a", 1)], history).violations == []


def test_the_body_must_have_committed_once_per_terminal_commit():
    assert check_step(1, "done", [rec("done")], body_runs=1) == []
    assert check_step(1, "done", [rec("done")], body_runs=2) == [
        "step 1: 2 committed body runs for 1 terminal commit(s) (a rolled-back body's write "
        "survived)"
    ]


def test_body_runs_are_not_judged_without_a_terminal_commit():
    # the missing commit is the violation; a count of 0 runs says nothing more
    assert check_step(1, "pending", [], body_runs=0) == [
        "step 1: no terminal transition committed (status 'pending')"
    ]


def test_a_multi_phase_chain_has_one_body_run():
    chain = [rec("running", "a", 1), rec("done", "a", 1, from_="running")]
    assert check_step(1, "done", chain, body_runs=1) == []


def test_check_steps_groups_records_by_step_in_commit_order():
    records = [
        rec("running", "a", 1, step=2),
        rec("done", "b", 4, step=1),
        rec("done", "a", 1, from_="running", step=2),
    ]
    assert check_steps({1: "done", 2: "done"}, records, body_runs={1: 1, 2: 1}) == []


def test_check_steps_names_every_broken_step_in_step_order():
    records = [rec("cancelled", "b", 2, step=3), rec("done", "a", 1, step=3)]
    problems = check_steps({3: "done", 1: "pending"}, records, body_runs={3: 2})
    assert problems == [
        "step 1: no terminal transition committed (status 'pending')",
        "step 3: 2 terminal transitions committed (cancelled by b fence 2, done by a fence 1)",
        "step 3: 'pending' -> 'done' committed while the chain was at 'cancelled'",
        "step 3: a stale holder wrote after a newer one (fences [2, 1])",
    ]


def test_check_steps_uses_the_history_for_stale_commits():
    history = [
        ev("acquired", 0.0, "old", fence=1),
        ev("acquired", 2.0, "new", fence=2),
        ev("committed", 3.0, "old", fence=1),
    ]
    assert check_steps({1: "done"}, [rec("done", "old", 1)], history) == [
        "step 1: holder old (fence 1) committed after new (fence 2) was granted the lease"
    ]
    assert check_steps({1: "done"}, [rec("done", "old", 1)]) == []


def test_check_reports_the_step_violations_of_check_steps_after_the_lock_store():
    records = [rec("done", "a", 1), rec("done", "b", 2)]
    verdict = check({1: "done"}, records, [], keys_without_ttl=3)
    assert verdict.violations == [
        "3 lock-store key(s) without a TTL",
        *check_steps({1: "done"}, records),
    ]
    assert (verdict.commits, verdict.keys_without_ttl, verdict.ok) == (2, 3, False)


def test_a_record_of_a_row():
    row = SimpleNamespace(
        step_id=7, from_status="pending", to_status="done", owner="o", fence=12, task_id="ignored"
    )
    assert Record.of(row) == Record(
        step=7, from_status="pending", to_status="done", owner="o", fence=12
    )


def test_lease_keys_and_keys_without_ttl_on_a_real_redis(redis_client):
    redis_client.hset("p:lease:step:1", mapping={"owner": "a"})
    redis_client.pexpire("p:lease:step:1", 60_000)
    redis_client.hset("p:lease:step:2", mapping={"owner": "b"})  # no TTL: a lease held forever
    redis_client.set("p:fence:step:1", 3)  # no TTL either
    redis_client.set("p:other", 1, px=60_000)
    redis_client.set("q:lease:step:9", 1)  # another prefix
    assert lease_keys(redis_client, "p") == ["p:lease:step:1", "p:lease:step:2"]
    assert keys_without_ttl(redis_client, "p") == ["p:fence:step:1", "p:lease:step:2"]
    assert lease_keys(redis_client, "none") == [] and keys_without_ttl(redis_client, "none") == []
