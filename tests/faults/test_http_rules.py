"""The rules of the HTTP idempotency workload (tests/support/faults/http_rules.py) on hand-written
histories: each passes a clean history and names its violation; then a short run of the
workload against a real server (uvicorn, redis-servers it starts) for the normal load and both
negative controls (tests/support/faults/http_load.py)."""

from __future__ import annotations

import pytest

from tests.support.faults import http_load
from tests.support.faults.http_rules import check, executions_from_history

V = "guarded/sync"


def execution(body, principal="user:alice", key="k1", start=0.0, end=1.0, outcome="ok", view=V):
    payload = {"body": body, "principal": principal, "key": key, "amount": 5}
    return {
        "view": view,
        "key": key,
        "principal": principal,
        "body": body,
        "start": start,
        "end": end,
        "outcome": outcome,
        "status": 201 if outcome == "ok" else None,
        "payload": payload if outcome == "ok" else None,
    }


def response(body, principal="user:alice", key="k1", replayed=False, status=201, view=V, **kw):
    payload = kw.pop("payload", None) or {
        "body": body,
        "principal": kw.pop("produced_for", principal),
        "key": key,
        "amount": kw.pop("amount", 5),
    }
    return {
        "view": view,
        "key": key,
        "principal": principal,
        "status": status,
        "payload": payload if body else None,
        "replayed": replayed,
        "retry_after": kw.pop("retry_after", None),
        **kw,
    }


def rules(verdict):
    return sorted(v["rule"] for v in verdict.violations)


@pytest.mark.no_database
class TestRules:
    def test_a_clean_history_passes(self):
        """alice and bob send the same key: one body each; a timed-out first attempt, a 409
        while the body runs, then the replay; the anonymous scope shares its body."""
        executions = [
            execution("a1", "user:alice"),
            execution("b1", "user:bob"),
            execution("n1", "anonymous", start=2.0, end=3.0),
        ]
        responses = [
            response(None, "user:alice", status=None),  # timed out
            response(None, "user:alice", status=409, retry_after="1", t0=0.2, t1=0.21),
            response("a1", "user:alice", replayed=True),
            response("b1", "user:bob"),
            response("b1", "user:bob", replayed=True),
            response("n1", "anonymous"),
            response("n1", "anonymous", replayed=True),  # another anonymous client
        ]
        verdict = check(executions, responses)
        assert verdict.violations == []
        assert verdict.ok
        assert verdict.counts == {
            "requests": 7,
            "timeouts": 1,
            "status_409": 1,
            "conflicts": 1,
            "status_201": 5,
            "replays": 3,
            "bodies": 3,
            "ok_bodies": 3,
        }

    def test_a_replay_to_another_principal_is_caught(self):
        verdict = check(
            [execution("a1", "user:alice")],
            [
                response("a1", "user:alice"),
                response("a1", "user:bob", replayed=True, produced_for="user:alice"),
            ],
        )
        assert rules(verdict) == ["cross_principal"]
        (found,) = verdict.violations
        assert (found["produced_for"], found["served_to"], found["differs"]) == (
            "user:alice",
            "user:bob",
            "principal",
        )

    def test_an_anonymous_body_served_to_a_user_is_caught(self):
        verdict = check(
            [execution("n1", "anonymous")],
            [response("n1", "user:alice", replayed=True, produced_for="anonymous")],
        )
        assert rules(verdict) == ["cross_principal"]

    def test_a_replay_of_another_key_or_view_is_caught(self):
        a1, a2 = execution("a1", key="k1"), execution("a2", key="k1", view="guarded/async")
        verdict = check(
            [a1, a2],
            [
                response("a1", key="k2", replayed=True, payload=a1["payload"]),
                response("a2", replayed=True, payload=a2["payload"]),
            ],
        )
        assert [(v["rule"], v["differs"]) for v in verdict.violations] == [
            ("cross_principal", "key"),
            ("cross_principal", "view"),
        ]

    def test_a_body_no_execution_recorded_is_caught(self):
        verdict = check([], [response("zz")])
        assert rules(verdict) == ["unknown_body"]

    def test_a_second_body_for_one_key_and_principal_is_caught(self):
        verdict = check(
            [execution("a1", start=0.0, end=1.0), execution("a2", start=2.0, end=3.0)],
            [response("a1"), response("a2")],
        )
        assert rules(verdict) == ["second_body"]
        assert verdict.violations[0]["bodies"] == ["a1", "a2"]

    def test_one_body_per_principal_and_per_view_is_not_a_second_body(self):
        verdict = check(
            [
                execution("a1", "user:alice"),
                execution("b1", "user:bob"),
                execution("a2", "user:alice", view="guarded/async"),
                execution("a3", "user:alice", key="k2"),
            ],
            [],
        )
        assert verdict.violations == []

    def test_a_cancelled_body_lets_the_key_run_again(self):
        """A view Django cancelled released its record (docs: async views): the retry runs."""
        verdict = check(
            [
                execution("a1", start=0.0, end=0.4, outcome="cancelled"),
                execution("a2", start=0.5, end=1.5),
            ],
            [response(None, status=None), response("a2")],
        )
        assert verdict.violations == []
        assert verdict.counts["cancelled_bodies"] == 1

    def test_overlapping_bodies_are_caught_whatever_their_outcome(self):
        verdict = check(
            [
                execution("a1", start=0.0, end=1.0, outcome="cancelled"),
                execution("a2", start=0.5, end=1.5),
                execution("a3", start=2.0, end=None, outcome=None),  # no end: still running
                execution("a4", start=3.0, end=3.5, outcome="cancelled"),
            ],
            [],
        )
        assert rules(verdict) == ["concurrent_bodies", "concurrent_bodies"]
        assert [v["bodies"] for v in verdict.violations] == [["a1", "a2"], ["a3", "a4"]]

    def test_a_store_loss_excuses_a_rerun_and_only_then(self):
        """Docs: a record lost with a Redis restart (no persistence) lets its key run once
        more. A loss before both bodies, or after both, excuses nothing."""
        executions = [
            execution("a1", start=0.0, end=2.0),
            execution("a2", start=1.5, end=3.0),
        ]
        excused = check(executions, [], store_lost_at=[1.0])
        assert excused.violations == []
        assert sorted(f["rule"] for f in excused.excused) == ["concurrent_bodies", "second_body"]
        for lost in ([-1.0], [5.0]):
            verdict = check(executions, [], store_lost_at=lost)
            assert rules(verdict) == ["concurrent_bodies", "second_body"]
            assert verdict.excused == []

    def test_a_loss_window_excuses_what_starts_inside_it(self):
        """A split brain loses from its split to its heal: a window, not an instant."""
        executions = [
            execution("a1", start=0.0, end=1.0),
            execution("a2", start=3.0, end=4.0),
        ]
        assert check(executions, [], store_lost_at=[(0.5, 2.0)]).violations == []
        assert check(executions, [], store_lost_at=[(1.0, 2.5)]).violations == []
        verdict = check(executions, [], store_lost_at=[(3.5, 9.0)])
        assert rules(verdict) == ["second_body"]

    def test_an_outage_excuses_a_rerun_of_a_body_it_overlapped(self):
        """An outage while a body ran or was being recorded may refuse its completion: the
        key runs again after the lock TTL, and answers 409 until then. An outage after the
        record completed excuses nothing (the record is intact)."""
        executions = [execution("a1", start=0.0, end=1.0), execution("a2", start=9.0, end=10.0)]
        late = response(None, status=409, retry_after="1", t0=5.0, t1=5.01)
        verdict = check(executions, [late], store_down=[(0.8, 1.2)], lock_ttl=8.0)
        assert verdict.violations == []
        assert sorted(f["rule"] for f in verdict.excused) == [
            "conflict_without_runner",
            "second_body",
        ]
        verdict = check(executions, [late], store_down=[(3.0, 4.0)], lock_ttl=8.0)
        assert rules(verdict) == ["second_body"]
        assert [f["rule"] for f in verdict.excused] == ["conflict_without_runner"]

    def test_a_killed_server_ends_its_bodies(self):
        """A body of a SIGKILLed server has no end entry: it ended at the kill, completed
        nothing, and the key runs again (after the lock TTL) lawfully."""
        executions = [
            {**execution("a1", start=0.0, end=None, outcome=None), "pid": 11},
            {**execution("a2", start=9.0, end=10.0), "pid": 12},
        ]
        assert rules(check(executions, [])) == ["concurrent_bodies"]
        assert check(executions, [], killed_at={11: 0.5}).violations == []
        assert rules(check(executions, [], killed_at={12: 0.5})) == ["concurrent_bodies"]

    def test_a_replay_unlike_the_original_is_caught(self):
        verdict = check(
            [execution("a1")],
            [response("a1"), response("a1", replayed=True, amount=6)],
        )
        assert rules(verdict) == ["replay_mismatch"]
        assert verdict.violations[0]["replayed"] is True

    def test_a_replay_with_another_status_is_caught(self):
        verdict = check([execution("a1")], [response("a1", replayed=True, status=200)])
        assert rules(verdict) == ["replay_mismatch"]

    def test_a_replay_of_a_body_that_did_not_complete_is_caught(self):
        ran = execution("a1", outcome="cancelled")
        verdict = check([ran], [response("a1", replayed=True)])
        assert rules(verdict) == ["replay_mismatch"]
        assert verdict.violations[0]["original"] == ("cancelled", None, None)

    def test_a_409_without_retry_after_is_caught(self):
        ok = check([], [response(None, status=409, retry_after="1")])
        assert ok.violations == []
        verdict = check([], [response(None, status=409)])
        assert rules(verdict) == ["conflict_without_retry_after"]

    def test_a_409_while_nothing_runs_is_caught(self):
        """A 409 must meet a body of its key and principal that runs (or ended within the
        grace, its record being completed); one of another principal's bodies does not
        count."""
        executions = [
            execution("a1", start=0.0, end=1.0),
            execution("b1", "user:bob", start=5.0, end=None, outcome=None),
        ]

        def conflict(t0, principal="user:alice"):
            return response(None, principal, status=409, retry_after="1", t0=t0, t1=t0 + 0.01)

        fine = [conflict(0.5), conflict(1.3), conflict(-0.005), conflict(6.0, "user:bob")]
        assert check(executions, fine).violations == []
        verdict = check(executions, [conflict(1.6), conflict(5.5)])  # b1 is bob's
        assert rules(verdict) == ["conflict_without_runner", "conflict_without_runner"]
        verdict = check(executions, [conflict(-1.0)])  # before a1 began
        assert rules(verdict) == ["conflict_without_runner"]

    def test_a_409_after_a_store_loss_is_excused_for_a_lock_ttl(self):
        """A completion the outage refused leaves the key locked until the lock TTL."""
        executions = [execution("a1", start=0.0, end=1.0)]
        late = response(None, status=409, retry_after="1", t0=7.0, t1=7.01)
        verdict = check(executions, [late], store_lost_at=[0.9], lock_ttl=8.0)
        assert (verdict.violations, [f["rule"] for f in verdict.excused]) == (
            [],
            ["conflict_without_runner"],
        )
        verdict = check(executions, [late], store_lost_at=[0.9], lock_ttl=5.0)
        assert rules(verdict) == ["conflict_without_runner"]

    def test_error_answers_are_counted_not_checked(self):
        verdict = check(
            [], [response(None, status=503, retry_after="1"), response(None, status=403)]
        )
        assert verdict.violations == []
        assert (verdict.counts["unavailable"], verdict.counts["status_403"]) == (1, 1)

    def test_executions_come_from_the_history_entries(self):
        entries = [
            {"ev": "acquired", "t": 0.0, "owner": "x"},  # another workload's entry
            {
                "ev": "http_body_start",
                "t": 1.0,
                "body": "a1",
                "view": V,
                "key": "k1",
                "principal": "user:alice",
            },  # fmt: skip
            {
                "ev": "http_body_end",
                "t": 2.0,
                "body": "a1",
                "view": V,
                "key": "k1",
                "principal": "user:alice",
                "outcome": "ok",
                "status": 201,
                "payload": {"body": "a1"},
            },  # fmt: skip
            {
                "ev": "http_body_start",
                "t": 3.0,
                "body": "a2",
                "view": V,
                "key": "k1",
                "principal": "user:alice",
            },  # fmt: skip
        ]
        found = executions_from_history(entries)
        assert found == {
            "a1": {
                "view": V,
                "key": "k1",
                "principal": "user:alice",
                "body": "a1",
                "pid": None,
                "start": 1.0,
                "end": 2.0,
                "outcome": "ok",
                "status": 201,
                "payload": {"body": "a1"},
            },
            "a2": {
                "view": V,
                "key": "k1",
                "principal": "user:alice",
                "body": "a2",
                "pid": None,
                "start": 3.0,
                "end": None,
                "outcome": None,
                "status": None,
                "payload": None,
            },
        }


#: Seconds of load per variant in the test (the standalone run uses 60).
SECONDS = 8.0


@pytest.mark.db_incidental
@pytest.mark.parametrize(
    "variant, expected",
    [
        ("guarded", set()),
        ("shared", {"cross_principal"}),
        ("unguarded", {"second_body", "concurrent_bodies"}),
    ],
)
def test_the_load_against_a_real_server(variant, expected, tmp_path):
    """A real uvicorn on the example project, its own store and control redis-servers: the
    guarded views pass every rule with bodies, replays and timeouts seen; each negative
    control is caught by its rule."""
    summary = http_load.run(SECONDS, variant, threads=4, seed=1, workdir=tmp_path)
    counts = summary["counts"]
    assert counts["requests"] > 30, summary
    assert counts["bodies"] > 5, summary
    assert counts.get("timeouts", 0) > 0, summary
    if variant == "guarded":
        assert summary["by_rule"] == {}, summary
        assert counts["replays"] > 0, summary
    else:
        assert expected <= set(summary["by_rule"]), summary
