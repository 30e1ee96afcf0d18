"""The outbox checker (``checker.check_effects``) on hand-made runs, and the idempotent HTTP
receiver (``tests/support/faults/receiver.py``) on a real loopback port: the checker must
accept a clean run and name every kind of violation, the receiver must apply a key once and
count every receipt."""

import json
import urllib.error
import urllib.request

import pytest

from tests.support.faults.checker import Applied, EffectRow, Record, check_effects
from tests.support.faults.receiver import Receiver

pytestmark = pytest.mark.no_database

DECLARES = {"done": 2}


def rec(step=1, fence=5, to="done", owner="a"):
    return Record(step=step, from_status="pending", to_status=to, owner=owner, fence=fence)


def row(position, step=1, fence=5, to="done", status="dispatched", attempts=1):
    return EffectRow(
        key=f"step:{step}:{fence}:{to}:{position}",
        step=step,
        fence=fence,
        to=to,
        position=position,
        status=status,
        attempts=attempts,
    )


def got(position, step=1, fence=5, to="done", receipts=1, applied=1):
    return Applied(
        key=f"step:{step}:{fence}:{to}:{position}",
        step=step,
        fence=fence,
        to=to,
        position=position,
        receipts=receipts,
        applied=applied,
    )


def test_a_clean_run_with_a_redelivery():
    verdict = check_effects([rec()], [row(0), row(1)], [got(0, receipts=2), got(1)], DECLARES)
    assert verdict.violations == []
    assert (verdict.commits, verdict.expected, verdict.rows, verdict.dispatched) == (1, 2, 2, 2)
    assert (verdict.receipts, verdict.applied, verdict.redelivered) == (3, 2, 1)


def test_a_transition_that_declares_nothing_needs_no_rows():
    verdict = check_effects([rec(to="cancelled")], [], [], DECLARES)
    assert verdict.ok and verdict.commits == 0


def test_a_missing_row_and_a_row_of_a_refused_attempt():
    verdict = check_effects([rec()], [row(0), row(0, fence=4)], [got(0)], DECLARES)
    assert verdict.violations == [
        "step 1: -> 'done' (fence 5) committed with effect rows at positions [0], 2 declared",
        "step 1: effect step:1:4:done:0 written for fence 4 -> 'done', a transition that "
        "never committed",
        "step 1: effect step:1:4:done:0 dispatched, never received",
        "step 1: effect 1 of -> 'done' never applied",
    ]


def test_rows_left_pending_or_dead():
    rows = [row(0, status="pending", attempts=0), row(1, status="dead", attempts=10)]
    verdict = check_effects([rec()], rows, [], DECLARES)
    assert verdict.violations[:2] == [
        "step 1: effect step:1:5:done:0 left pending after the relay's period (0 attempts)",
        "step 1: effect step:1:5:done:1 left dead after the relay's period (10 attempts)",
    ]
    assert (verdict.pending, verdict.dead) == (1, 1)


def test_the_negative_control_applying_twice_is_caught():
    # the body performed its effects itself: a refused attempt (fence 4) sent them too
    applied = [got(0, fence=4), got(1, fence=4), got(0), got(1)]
    verdict = check_effects([rec()], [], applied, DECLARES, outbox=False)
    assert verdict.violations == [
        "step 1: effect step:1:4:done:0 of an attempt whose transition never committed "
        "(fence 4 -> 'done') received",
        "step 1: effect step:1:4:done:1 of an attempt whose transition never committed "
        "(fence 4 -> 'done') received",
        "step 1: effect 0 of -> 'done' applied 2 times (keys step:1:4:done:0, step:1:5:done:0)",
        "step 1: effect 1 of -> 'done' applied 2 times (keys step:1:4:done:1, step:1:5:done:1)",
    ]


def test_a_receiver_that_applies_a_key_twice():
    verdict = check_effects(
        [rec()], [row(0), row(1)], [got(0, receipts=2, applied=2), got(1)], DECLARES
    )
    assert "step 1: key step:1:5:done:0 applied 2 times" in verdict.violations


def post(url, key=None, body=None):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Idempotency-Key"] = key
    request = urllib.request.Request(
        url, data=json.dumps(body or {}).encode(), headers=headers, method="POST"
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.status


def test_the_receiver_applies_each_key_once_and_counts_receipts():
    with Receiver() as receiver:
        assert post(receiver.url, "k1", {"step": 1, "position": 0}) == 200
        assert post(receiver.url, "k1", {"step": 9}) == 200
        assert post(receiver.url, "k2") == 200
        assert post(receiver.url) == 200  # no key: applied every time
        seen = receiver.snapshot()
        assert (seen["k1"].count, seen["k1"].applied, seen["k1"].body) == (
            2,
            1,
            {"step": 1, "position": 0},
        )
        assert receiver.counts() == {
            "keys": 2,
            "receipts": 3,
            "applied": 3,
            "redelivered": 1,
            "anonymous": 1,
            "refused": 0,
        }


def test_the_receiver_down_refuses_connections_and_comes_back_on_its_port():
    receiver = Receiver().start()
    try:
        port = receiver.port
        receiver.stop()
        with pytest.raises(urllib.error.URLError):
            post(f"http://127.0.0.1:{port}/effects", "k")
        receiver.start()
        assert receiver.port == port and post(receiver.url, "k") == 200
        receiver.fail_next(1, 503)
        with pytest.raises(urllib.error.HTTPError) as failed:
            post(receiver.url, "k3")
        assert failed.value.code == 503
        assert receiver.counts()["refused"] == 1 and "k3" not in receiver.snapshot()
    finally:
        receiver.stop()


def test_the_outbox_workload_adds_to_the_plan_and_leaves_the_default_one_alone():
    from tests.support.faults import nemesis

    default = nemesis.plan(7, 60, 2.0)
    assert nemesis.plan(7, 60, 2.0, nemesis.kinds_of("patterns")) == default
    outbox = nemesis.plan(7, 60, 2.0, nemesis.kinds_of("outbox"), nemesis.actions_of("outbox"))
    kinds = {c["kind"] for c in outbox["client"] if c["action"] == "step"}
    assert "outbox" in kinds and "outbox" not in nemesis.ACTIONS
    longer = nemesis.plan(7, 600, 2.0, nemesis.kinds_of("outbox"), nemesis.actions_of("outbox"))
    assert "receiver_down" in {f["kind"] for f in longer["faults"]}
    with pytest.raises(ValueError):
        nemesis.actions_of("nope")


def test_runcheck_judges_a_run_directorys_effects(tmp_path):
    from tests.support.faults import runcheck

    (tmp_path / "history.jsonl").write_text("")
    (tmp_path / "steps.json").write_text(json.dumps({"1": "done", "2": "done"}))
    (tmp_path / "records.json").write_text(
        json.dumps([rec().__dict__, rec(step=2, fence=6).__dict__])
    )
    doc = {
        "declares": DECLARES,
        "outbox": True,
        "sources": [1],  # step 2 is a sink: its commit declares nothing
        "rows": [row(0).__dict__, row(1).__dict__],
        "applied": [got(0, receipts=2).__dict__],
    }
    (tmp_path / "effects.json").write_text(json.dumps(doc))
    verdict = runcheck.check_run(runcheck.load(tmp_path))
    assert verdict.violations == [
        "step 1: effect step:1:5:done:1 dispatched, never received",
        "step 1: effect 1 of -> 'done' never applied",
    ]
    assert verdict.counts["effects"]["receipts"] == 2
    assert verdict.counts["effects"]["rows"] == 2


def _lost_reply_run(gap_s: float, data_loss: bool = False, released: bool = True):
    """Owner a's COMMIT reply is lost (no ``committed`` entry; its record exists); its last
    entry, ``released``, is written after b was granted the lease ``gap_s`` seconds (by the
    lock store's clock: the fences) after a's own grant."""
    from tests.support.faults import runcheck

    base = 1_796_296_056_009_215
    history = [
        {"ev": "acquired", "t": 10.0, "step": 1, "owner": "a", "fence": base, "pid": 1},
        {"ev": "point", "t": 10.1, "step": 1, "owner": "a", "point": "before_commit", "pid": 1},
        {
            "ev": "acquired",
            "t": 10.13,
            "step": 1,
            "owner": "b",
            "pid": 2,
            "fence": base + int(gap_s * 1e6),
        },
        {
            "ev": "released" if released else "point",
            "t": 10.14,
            "step": 1,
            "owner": "a",
            "pid": 1,
            **({} if released else {"point": "after_commit"}),
        },
        {"ev": "conflict", "t": 10.15, "step": 1, "owner": "b", "pid": 2, "current": "done"},
        {"ev": "released", "t": 10.16, "step": 1, "owner": "b", "pid": 2},
    ]
    if data_loss:
        history.insert(1, {"ev": "fault", "t": 10.05, "kind": "redis_restart"})
    return runcheck.Run(
        history=history,
        steps={1: "done"},
        records=[rec(owner="a", fence=base)],
        meta={"ttl": 2.0},
    )


def test_a_lost_commit_reply_dated_by_its_release_is_no_stale_commit():
    # the nemesis run of seed 7 (120 s, workload outbox) reported this one: b's grant came
    # 0.13 s after a's, within a's TTL, so a had released its key, after its COMMIT
    from tests.support.faults import runcheck

    assert runcheck.check_run(_lost_reply_run(0.131)).violations == []


def test_a_grant_past_the_ttl_or_after_a_data_loss_still_judges_the_lost_reply():
    from tests.support.faults import runcheck

    # a's release deleted its key (``released``): no newer grant came before it, whatever the
    # gap, unless the store lost its data meanwhile; without it, a grant past the TTL may
    # have found a's key expired before a's COMMIT
    assert runcheck.check_run(_lost_reply_run(2.5)).violations == []
    for run in (_lost_reply_run(2.5, released=False), _lost_reply_run(0.131, data_loss=True)):
        assert [v for v in runcheck.check_run(run).violations if "granted" in v] == [
            "step 1: holder a (fence 1796296056009215) committed after b "
            f"(fence {run.history[-4]['fence']}) was granted the lease"
        ]
