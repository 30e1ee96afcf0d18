"""The invariant checker on hand-made histories: it must accept a clean trial and name every
kind of violation (scripts/faults/checker.py)."""
from scripts.faults.checker import Record, check, check_step, lease_intervals, overlapped


def rec(to, owner="a", fence=1, from_="pending", step=1):
    return Record(step=step, from_status=from_, to_status=to, owner=owner, fence=fence)


def ev(ev, t, owner, step=1, **kw):
    return {"ev": ev, "t": t, "owner": owner, "step": step, **kw}


def test_a_single_commit_is_clean():
    verdict = check({1: "done"}, [rec("done")], [ev("acquired", 0, "a"), ev("released", 1, "a")])
    assert (verdict.violations, verdict.commits, verdict.overlaps, verdict.ok) == ([], 1, 0, True)


def test_a_duplicate_commit_is_named_with_both_owners():
    problems = check_step(1, "cancelled", [rec("done", "aaaaaaaa1"),
                                           rec("cancelled", "bbbbbbbb2", 2)])
    assert problems[0] == ("step 1: 2 terminal transitions committed (done by aaaaaaaa fence 1, "
                           "cancelled by bbbbbbbb fence 2)")
    assert problems[1:] == ["step 1: 'pending' -> 'cancelled' committed while the chain was "
                            "at 'done'"]


def test_a_transition_out_of_a_terminal_state():
    problems = check_step(1, "pending", [rec("done"), rec("pending", "b", 2, from_="done")])
    assert "step 1: transition out of terminal 'done' -> 'pending'" in problems


def test_no_commit_at_all():
    assert check_step(1, "pending", []) == [
        "step 1: no terminal transition committed (status 'pending')"]


def test_row_status_must_match_the_chain():
    assert check_step(1, "pending", [rec("done")]) == [
        "step 1: row status 'pending' but the committed chain ends at 'done'"]


def test_a_stale_fence_writing_after_a_newer_one():
    chain = [rec("running", "new", 5), rec("done", "old", 3, from_="running")]
    assert check_step(1, "done", chain) == [
        "step 1: a stale holder wrote after a newer one (fences [5, 3])"]


def test_legal_multi_phase_chain():
    chain = [rec("running", "a", 1), rec("pending", "reaper", None, from_="running"),
             rec("running", "b", 2), rec("done", "b", 2, from_="running")]
    assert check_step(1, "done", chain) == []


def test_overlap_of_a_paused_holder_and_its_successor():
    history = [ev("acquired", 0.0, "a"), ev("acquired", 2.5, "b"), ev("released", 3.0, "b"),
               ev("lost", 4.0, "a")]
    intervals = lease_intervals(history, 1, end_of_trial=9)
    assert intervals == {"a": (0.0, 4.0), "b": (2.5, 3.0)}
    assert overlapped(intervals)


def test_a_sigkill_ends_the_victims_hold():
    history = [ev("acquired", 0.0, "a", pid=10), {"ev": "fault", "t": 1.0, "signal": "SIGKILL",
                                                   "pid": 10},
               ev("acquired", 2.5, "b", pid=11), ev("released", 3.0, "b")]
    intervals = lease_intervals(history, 1, end_of_trial=9)
    assert intervals == {"a": (0.0, 1.0), "b": (2.5, 3.0)}
    assert not overlapped(intervals)


def test_lock_store_findings_count():
    verdict = check({1: "done"}, [rec("done")], [], leftover_leases=2, keys_without_ttl=1)
    assert verdict.violations == ["1 lock-store key(s) without a TTL"]
    assert verdict.leftover_leases == 2 and not verdict.ok


def test_the_end_of_the_task_run_ends_a_hold_whose_release_failed():
    history = [ev("acquired", 0.0, "a", pid=10), ev("store_error", 0.5, "a", pid=10),
               {"ev": "task_end", "t": 0.6, "pid": 10, "step": 1},
               ev("acquired", 31.0, "b", pid=11), ev("released", 31.5, "b", pid=11)]
    intervals = lease_intervals(history, 1, end_of_trial=40)
    assert intervals == {"a": (0.0, 0.6), "b": (31.0, 31.5)}
    assert not overlapped(intervals)


def test_a_commit_after_a_newer_holder_was_granted_is_a_violation():
    history = [ev("acquired", 0.0, "old-owner", fence=1), ev("acquired", 2.5, "new-owner", fence=2),
               ev("committed", 3.0, "old-owner", fence=1), ev("conflict", 3.1, "new-owner")]
    verdict = check({1: "done"}, [rec("done", "old-owner", 1)], history)
    assert verdict.violations == ["step 1: holder old-owne (fence 1) committed after new-owne "
                                  "(fence 2) was granted the lease"]


def test_a_commit_before_the_next_grant_is_fine():
    history = [ev("acquired", 0.0, "a", fence=1), ev("committed", 0.5, "a", fence=1),
               ev("released", 0.6, "a"), ev("acquired", 1.0, "b", fence=2),
               ev("conflict", 1.1, "b")]
    assert check({1: "done"}, [rec("done", "a", 1)], history).violations == []
