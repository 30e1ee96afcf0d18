"""The periodic-overlap rule (tests/support/faults/overlap_rules.py) on hand-made histories:
runs one after another pass, two runs at once are caught (the negative control), and the
overlaps every lease allows (a holder paused or cut off past its TTL, a lock store that lost
its data) are told apart. Pure functions, no servers."""

from __future__ import annotations

import pytest

from tests.support.faults.overlap_rules import check_periodic, max_concurrent, runs_of

pytestmark = pytest.mark.no_database


def run(history, task_id, start, end, pid=100, owner="o", name="faults-periodic", ended=True):
    ident = {"name": name, "task_id": task_id, "owner": owner}
    history.append({"ev": "periodic_start", "t": start, "rt": start, "pid": pid, **ident})
    if ended:
        history.append(
            {"ev": "periodic_end", "t": end, "rt": end, "start_rt": start, "pid": pid, **ident}
        )


def test_runs_one_after_another_with_skips_pass():
    history = []
    for i in range(4):
        history.append({"ev": "periodic_send", "t": 3.0 * i, "task_id": f"s{i}"})
        run(history, f"r{i}", 3.0 * i + 0.1, 3.0 * i + 2.6, owner=f"o{i}")
        history.append({"ev": "periodic_skipped", "t": 3.0 * i + 1.0, "rt": 3.0 * i + 1.0})
    verdict = check_periodic(history)
    assert verdict.ok and verdict.data_loss == []
    assert verdict.counts == {
        "sends": 4,
        "runs": 4,
        "skips": 4,
        "unfinished": 0,
        "lost": 0,
        "overlapping": 0,
        "excused": 0,
        "max_concurrent": 1,
    }


def test_a_run_starting_as_the_previous_ends_is_no_overlap():
    history = []
    run(history, "a", 1.0, 2.0)
    run(history, "b", 2.0, 3.0)
    assert check_periodic(history).ok
    assert max_concurrent(runs_of(history)) == 1


def test_two_runs_at_once_are_caught():
    history = []
    run(history, "aaaaaaaa-1", 1.0, 3.5, pid=100, owner=None)
    run(history, "bbbbbbbb-2", 2.0, 4.5, pid=101, owner=None)
    run(history, "cccccccc-3", 5.0, 6.0, pid=100, owner=None)
    verdict = check_periodic(history)
    assert verdict.violations == [
        "faults-periodic: run bbbbbbbb (pid 101) started at 2.000 while run aaaaaaaa "
        "(pid 100) ran [1.000, 3.500]"
    ]
    assert verdict.counts["overlapping"] == 1
    assert verdict.counts["max_concurrent"] == 2


def test_other_names_do_not_overlap_each_other():
    history = []
    run(history, "a", 1.0, 3.0, name="x")
    run(history, "b", 2.0, 4.0, name="y")
    assert check_periodic(history).ok


def test_a_run_without_an_end_lasts_to_its_kill_or_the_end_of_the_history():
    history = []
    run(history, "a", 1.0, None, pid=100, ended=False)
    history.append({"ev": "fault", "t": 2.0, "signal": "SIGKILL", "pid": [100]})
    run(history, "b", 2.5, 4.0, pid=101)  # after the kill: fine
    run(history, "c", 5.0, None, pid=102, ended=False)
    run(history, "d", 6.0, 7.0, pid=103)  # c never ended: it still ran
    verdict = check_periodic(history)
    assert [r.end for r in runs_of(history)] == [2.0, 4.0, 7.0, 7.0]
    assert len(verdict.violations) == 1 and "run d " in verdict.violations[0]
    assert "(no end)" in verdict.violations[0]
    assert verdict.counts["unfinished"] == 2


def test_a_holder_paused_or_lost_past_its_ttl_is_excused():
    history = []
    run(history, "a", 1.0, 5.0, pid=100, owner="oa")
    history.append({"ev": "fault", "t": 1.5, "signal": "SIGSTOP", "pid": 100})
    run(history, "b", 4.0, 7.5, pid=101, owner="ob")  # a was paused past its TTL: excused
    history.append({"ev": "lost", "t": 6.5, "owner": "ob", "pid": 101})
    run(history, "c", 7.0, 9.0, pid=102, owner="oc")  # b lost its lease before c started
    run(history, "d", 8.0, 10.0, pid=103, owner="od")  # c lost nothing: a violation
    verdict = check_periodic(history)
    assert verdict.counts["overlapping"] == 3 and verdict.counts["excused"] == 2
    assert len(verdict.violations) == 1 and "run d " in verdict.violations[0]


def test_a_holder_whose_heartbeat_was_frozen_is_excused_if_it_stopped_at_its_next_check():
    # a's heartbeat froze, its lease ran out unrenewed and b was granted it at 4.0; a's body
    # found the lease lost at its next check (4.01) and stopped
    history = [{"ev": "fault", "t": 0.5, "kind": "heartbeat_frozen", "pid": 100, "seconds": 5}]
    run(history, "a", 1.0, 4.01, pid=100, owner="oa")
    history[-1]["outcome"] = "lost"
    run(history, "b", 4.0, 6.0, pid=101, owner="ob")
    verdict = check_periodic(history, ttl=3.0)
    assert verdict.ok and verdict.counts["excused"] == 1

    # a body that ran on long after the lease ran out, or said nothing of the loss; a frozen
    # heartbeat elsewhere, thawed before a began, or too late for the lease to have run out
    # by b's start (a's own TTL, or two thirds of it after the freeze): violations
    for change in (
        lambda h: h[2].update(rt=5.0, t=5.0),
        lambda h: h[2].update(outcome="done"),
        lambda h: h[0].update(pid=999),
        lambda h: h.append({"ev": "heal", "t": 0.9, "kind": "heartbeat_frozen", "fault_t": 0.5}),
        lambda h: h[0].update(t=3.0),
        lambda h: h[1].update(rt=1.5, t=1.5) or h[2].update(start_rt=1.5),
    ):
        copy = [dict(e) for e in history]
        change(copy)
        assert len(check_periodic(copy, ttl=3.0).violations) == 1, copy


def test_an_overlap_after_a_lock_store_data_loss_is_reported_apart():
    history = []
    run(history, "a", 1.0, 4.0, pid=100, owner="oa")
    history.append({"ev": "fault", "t": 2.0, "kind": "redis_restart"})
    run(history, "b", 3.0, 5.0, pid=101, owner="ob")
    verdict = check_periodic(history)
    assert verdict.ok
    assert len(verdict.data_loss) == 1
    assert verdict.data_loss[0].endswith("; after redis_restart at 2.000")


def test_many_overlaps_are_named_up_to_the_limit():
    history = []
    for i in range(8):
        run(history, f"r{i}", 1.0 + 0.1 * i, 10.0, pid=100 + i, owner=None)
    verdict = check_periodic(history, limit=3)
    assert len(verdict.violations) == 4
    assert verdict.violations[-1] == "faults-periodic: 25 more overlapping run(s)"
    assert verdict.counts["max_concurrent"] == 8


def test_the_run_checker_judges_the_periodic_runs_with_the_steps():
    from tests.support.faults import runcheck

    history = []
    run(history, "aaaaaaaa", 1.0, 3.5, pid=100, owner=None)
    run(history, "bbbbbbbb", 2.0, 4.5, pid=101, owner=None)
    verdict = runcheck.check_run(runcheck.Run(history=history, steps={}, records=[]))
    assert not verdict.ok
    assert verdict.violations[0].startswith("faults-periodic: run bbbbbbbb (pid 101)")
    assert verdict.counts["periodic"]["runs"] == 2
    assert verdict.counts["periodic"]["max_concurrent"] == 2
    # a history without periodic entries keeps its verdict's shape (the stored fixtures)
    assert "periodic" not in runcheck.check_run(runcheck.Run([], {}, [])).counts


def test_a_run_started_during_a_split_excuses_overlaps_only_until_the_heal_and_a_ttl():
    from tests.support.faults.loads import periodic_history

    history = [
        {"ev": "fault", "t": 10.0, "kind": "split_brain"},
        {"ev": "heal", "t": 12.0, "kind": "split_brain", "fault_t": 10.0},
    ]
    run(history, "aaaaaaaa-1", 11.0, 60.0, pid=100, owner="a")  # started in the split
    run(history, "bbbbbbbb-2", 11.5, 13.0, pid=101, owner="b")  # the other side, meanwhile
    run(history, "cccccccc-3", 50.0, 52.0, pid=102, owner="c")  # 38 s after the heal
    verdict = check_periodic(periodic_history(history, ttl=2.0))
    assert [m.split(";")[0] for m in verdict.data_loss] == [
        "faults-periodic: run bbbbbbbb (pid 101) started at 11.500 while run aaaaaaaa "
        "(pid 100) ran [11.000, 60.000]"
    ]
    assert verdict.violations == [
        "faults-periodic: run cccccccc (pid 102) started at 50.000 while run aaaaaaaa "
        "(pid 100) ran [11.000, 60.000]"
    ]
