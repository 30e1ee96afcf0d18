"""The reliability report (tests/support/faults/report.py): one JSON document rendered into
docs/reliability.md, updated in parts by the deterministic soak and the randomized runs. Pure
functions and temporary files: no servers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.faults.test_runcheck import clean_example, unguarded_example
from tests.support.faults import report, runcheck

DOCS = Path(__file__).resolve().parents[2] / "docs"


def row(fault="SIGKILL worker child", trials=2, violations=0, violating=0, examples=()):
    return {
        "fault": fault,
        "trials": trials,
        "overlaps": 1,
        "commits": trials,
        "violations": violations,
        "violating_trials": violating,
        "leftover_leases": 0,
        "keys_without_ttl": 0,
        "stale_rejected": 0,
        "resumes": 0,
        "errors": 0,
        "examples": list(examples),
        "recovery_p50_s": 2.5,
        "recovery_max_s": 4.25,
        "seconds": 9.0,
    }


def soak_result():
    return {
        "started": "2026-12-01 10:00:00",
        "commit": "abc1234",
        "seconds": 100.4,
        "trials": 2,
        "negative_trials": 1,
        "ttl": 2.0,
        "visibility_timeout": 10,
        "redis": "7.0.15",
        "postgres": "15.18",
        "python": "3.11.7",
        "cpus": 2,
        "scenarios": {"kill-child@before_cas": row()},
        "negative_control": {
            "kill-child@before_cas": row(
                trials=1, violations=2, violating=1, examples=["step 9: 2 terminal"]
            )
        },
    }


def randomized(seed=7, duration=1800, violations=0, negative=3):
    return {
        "seed": seed,
        "duration_s": duration,
        "started": "2026-12-01 11:00:00",
        "commit": "def5678",
        "workers": [
            {"name": "w1", "pool": "prefork", "concurrency": 2},
            {"name": "w2", "pool": "threads", "concurrency": 4},
        ],
        "executions": 5321,
        "faults": {"kill_child": 300, "pause": 250},
        "violations": violations,
        "leftovers": 0,
        "recovery_p50_s": 0.4,
        "recovery_max_s": 6.25,
        "examples": [],
        "negative_control": {
            "seed": seed,
            "duration_s": 120,
            "executions": 400,
            "faults": {"kill_child": 20},
            "violations": negative,
            "examples": ["step 5: 2 terminal transitions committed"],
        },
    }


def test_render_has_both_tables_and_the_examples():
    text = report.render({"deterministic": soak_result(), "randomized": [randomized()]})
    lines = text.splitlines()
    assert (
        "| kill-child@before_cas | SIGKILL worker child | 2 | 1 | 2 | **0** | 0 | 2.5 | 4.2 | 0 "
        "| 1 / 1 |" in lines
    )
    assert "| **all** | | 2 | 1 | 2 | **0** | 0 | | | 0 | 1 / 1 |" in lines
    assert "## Randomized runs" in lines
    assert (
        "| 7 | 1,800 | 2026-12-01 11:00:00 | def5678 | single | 2: prefork x2, threads x4 | "
        "5,321 | 550 (2 kinds) | **0** | 0 | 0 | - | 0.4 | 6.2 | 7, 120, **3** |" in lines
    )
    assert "- seed 7, 1,800 s: kill_child 300, pause 250" in lines
    assert "- seed 7, 120 s (negative control): kill_child 20" in lines
    assert "- kill-child@before_cas (negative control): step 9: 2 terminal" in lines
    assert (
        "- nemesis seed 7, 120 s (negative control): step 5: 2 terminal transitions committed"
        in lines
    )
    assert lines.index("## Randomized runs") < lines.index(
        "## Examples of what the checker reported"
    )
    # a run on another topology names it in its examples
    clustered = report.render({"randomized": [{**randomized(), "store": "cluster"}]})
    assert (
        "- nemesis seed 7, 120 s, cluster (negative control): step 5: 2 terminal transitions "
        "committed" in clustered.splitlines()
    )


def test_durations_render_in_whole_seconds():
    run = dict(randomized(), duration_s=1800.0)
    run["negative_control"] = dict(run["negative_control"], duration_s=120.5)
    lines = report.render({"deterministic": None, "randomized": [run]}).splitlines()
    assert "- seed 7, 1,800 s: kill_child 300, pause 250" in lines
    assert "- seed 7, 120.5 s (negative control): kill_child 20" in lines


def test_a_control_row_that_ended_in_errors_says_so_and_names_the_error():
    soak = soak_result()
    soak["scenarios"]["pause@after_cas"] = row(fault="SIGSTOP past TTL, SIGCONT")
    failed = row(fault="SIGSTOP past TTL, SIGCONT", trials=0)
    failed["errors"] = 2
    failed["examples"] = [
        "error: TimeoutError: timed out after 60s waiting for a commit (queue 2, unacked 0)"
    ]
    soak["negative_control"]["pause@after_cas"] = failed
    lines = report.render({"deterministic": soak, "randomized": []}).splitlines()
    expected = (
        "| pause@after_cas | SIGSTOP past TTL, SIGCONT | 2 | 1 | 2 | **0** | 0 | 2.5 | 4.2 | 0 |"
    )
    assert f"{expected} 0 / 0, 2 errors |" in lines
    assert lines[lines.index(f"{expected} 0 / 0, 2 errors |") + 1].endswith("| 1 / 1, 2 errors |")
    control = next(line for line in lines if line.startswith("The negative control runs"))
    assert (
        "neither counted in its row's trials nor caught: pause@after_cas, 2 (TimeoutError: "
        "timed out after 60s waiting for a commit)." in control
    )
    assert "keeps the row locked" in control
    clean = report.render({"deterministic": soak_result(), "randomized": []})
    assert "| 1 / 1 |" in clean and "1 / 1, " not in clean and "neither counted" not in clean


def test_render_of_an_empty_document():
    text = report.render(report.empty())
    assert "No deterministic soak recorded yet." in text.splitlines()
    assert "No randomized run recorded yet." in text.splitlines()
    assert "## Examples" not in text


def test_the_deterministic_part_renders_as_the_soak_wrote_it():
    # today's docs/reliability.md was written by scripts/soak.py from today's
    # reliability.json (flat shape): the same text, with the randomized section inserted
    stored = json.loads((DOCS / "reliability.json").read_text())
    if "deterministic" in stored:  # already the new shape: render is the writer now
        assert report.render(stored) == (DOCS / "reliability.md").read_text()
        return
    text = report.render(report.load(DOCS / "reliability.json")).splitlines()
    start = text.index("## Randomized runs")
    end = text.index("No randomized run recorded yet.")
    assert (
        text[: start - 1] + text[end + 1 :] == (DOCS / "reliability.md").read_text().splitlines()
    )


def test_the_old_flat_shape_loads_as_the_deterministic_part(tmp_path):
    path = tmp_path / "reliability.json"
    path.write_text(json.dumps(soak_result()))
    assert report.load(path) == {"deterministic": soak_result(), "randomized": []}
    assert report.load(tmp_path / "absent.json") == {"deterministic": None, "randomized": []}


def test_merge_keeps_the_other_part():
    doc = report.merge(report.empty(), deterministic=soak_result())
    doc = report.merge(doc, randomized_run=randomized(seed=7))
    assert doc["deterministic"] == soak_result()
    assert doc["randomized"] == [randomized(seed=7)]
    newer = dict(soak_result(), commit="fff0000")
    doc = report.merge(doc, deterministic=newer)
    assert (doc["deterministic"]["commit"], doc["randomized"]) == ("fff0000", [randomized(seed=7)])


def test_merge_replaces_a_run_of_the_same_seed_and_duration_and_adds_others():
    doc = report.merge(report.empty(), randomized_run=randomized(seed=7))
    doc = report.merge(doc, randomized_run=randomized(seed=8))
    doc = report.merge(doc, randomized_run=randomized(seed=7, violations=2))
    assert [(r["seed"], r["violations"]) for r in doc["randomized"]] == [(8, 0), (7, 2)]
    doc = report.merge(doc, randomized_run=randomized(seed=7, duration=300))
    assert [(r["seed"], r["duration_s"]) for r in doc["randomized"]] == [
        (8, 1800),
        (7, 1800),
        (7, 300),
    ]
    # the same seed and duration on another lock store is a row of its own; its rerun
    # replaces it
    for violations in (3, 0):
        doc = report.merge(
            doc, randomized_run={**randomized(seed=7, violations=violations), "store": "cluster"}
        )
    assert [(r["seed"], r.get("store"), r["violations"]) for r in doc["randomized"]] == [
        (8, None, 0),
        (7, None, 2),
        (7, None, 0),
        (7, "cluster", 0),
    ]


def test_merge_of_the_old_shape_keeps_it_as_the_deterministic_part():
    doc = report.merge(soak_result(), randomized_run=randomized())
    assert doc == {"deterministic": soak_result(), "randomized": [randomized()]}


def test_update_writes_both_files_and_keeps_the_other_part(tmp_path):
    (tmp_path / "reliability.json").write_text(json.dumps(soak_result()))  # old shape
    doc = report.update(randomized_run=randomized(), docs=tmp_path)
    assert json.loads((tmp_path / "reliability.json").read_text()) == doc
    assert doc == {"deterministic": soak_result(), "randomized": [randomized()]}
    assert (tmp_path / "reliability.md").read_text() == report.render(doc)
    doc = report.update(deterministic=dict(soak_result(), trials=200), docs=tmp_path)
    assert doc["randomized"] == [randomized()] and doc["deterministic"]["trials"] == 200


def test_summarize_a_run_and_its_negative_control(tmp_path):
    guarded = runcheck.dump(clean_example().run(), tmp_path / "guarded")
    negative = runcheck.dump(unguarded_example().run(), tmp_path / "negative")
    (negative / "verdict.json").write_text(
        json.dumps(runcheck.check_run(runcheck.load(negative)).as_dict())
    )
    summary = report.summarize(guarded, negative)  # guarded: checked now, no verdict.json
    assert {k: summary[k] for k in ("seed", "duration_s", "executions", "violations")} == {
        "seed": 1,
        "duration_s": 10,
        "executions": 6,
        "violations": 0,
    }
    assert summary["faults"] == {"kill_child": 1, "pause": 1, "redis_latency": 1}
    assert (summary["recovery_p50_s"], summary["recovery_max_s"]) == (0.7, 2.2)
    assert summary["negative_control"] == {
        "seed": 1,
        "duration_s": 10,
        "control": "unguarded",
        "executions": 7,
        "faults": {"kill_child": 1, "pause": 1, "redis_latency": 1},
        "violations": 2,
        "by_rule": {"steps": 2},
        "examples": [
            "step 1: 2 terminal transitions committed (done by a1 fence 10, done by a2 fence 11)",
            "step 1: 'pending' -> 'done' committed while the chain was at 'done'",
        ],
    }
    assert report.summarize(guarded)["negative_control"] is None


def test_headline():
    doc = {"deterministic": soak_result(), "randomized": [randomized()]}
    assert report.headline(doc) == (
        "1 deterministic fault scenarios x 2 trials: 2 trials, 0 violations (negative "
        "control: violations in 1 of 1 trials); a 1,800 s randomized run (seed 7): 5,321 "
        "step executions, 550 faults of 2 kinds, 0 violations, 0 leftovers (negative "
        "control: 3 violations)."
    )
    assert report.headline(report.empty()) == "No reliability figures recorded yet."


def test_a_partial_soak_replaces_only_its_rows_and_marks_them():
    whole = soak_result()
    whole["scenarios"]["pause@before_cas"] = row()
    name = "kill-child@before_cas"
    rerun = {
        **soak_result(),
        "started": "2026-12-04 16:30:00",
        "commit": "fed9876",
        "scenarios": {name: {**whole["scenarios"][name], "trials": 200, "errors": 0}},
        "negative_control": {},
    }
    doc = report.merge(
        report.merge(report.empty(), deterministic=whole), deterministic=rerun, partial=True
    )
    rows = doc["deterministic"]["scenarios"]
    assert list(rows) == list(whole["scenarios"])
    assert rows[name]["rerun"]["commit"] == "fed9876"
    assert rows[name]["trials"] == 200
    assert "rerun" not in rows["pause@before_cas"]
    assert doc["deterministic"]["commit"] == whole["commit"] == "abc1234"
    text = report.render(doc)
    assert f"| {name} (*) |" in text
    assert "| pause@before_cas |" in text
    assert "commit fed9876" in text


def test_a_partial_soak_of_other_settings_is_refused():
    whole = soak_result()
    rerun = {**whole, "ttl": whole["ttl"] * 2}
    with pytest.raises(ValueError, match="ttl"):
        report.merge_rows(whole, rerun)
    with pytest.raises(ValueError, match="needs a whole soak"):
        report.merge_rows(None, rerun)
    report.check_rerun(whole, {k: whole[k] for k in report.RERUN_SETTINGS if k in whole})


def test_a_run_with_a_control_per_pattern(tmp_path):
    guarded = runcheck.dump(clean_example().run(), tmp_path / "guarded")
    negative = runcheck.dump(unguarded_example().run(), tmp_path / "negative")
    bypass = runcheck.dump(unguarded_example().run(), tmp_path / "bypass")
    meta = json.loads((bypass / "run.json").read_text())
    meta.update(unguarded=False, breaker="bypass", store="cluster")
    (bypass / "run.json").write_text(json.dumps(meta))
    summary = report.summarize(guarded, [negative, bypass])
    assert [c["control"] for c in summary["negative_controls"]] == ["unguarded", "breaker bypass"]
    assert summary["negative_control"]["control"] == "unguarded"
    lines = report.render({"deterministic": None, "randomized": [summary]}).splitlines()
    assert "| 1 | single | unguarded | 10 | 7 | **2** | steps 2 |" in lines
    assert "| 1 | single | breaker bypass | 10 | 7 | **2** | steps 2 |" in lines
    assert any(line.endswith("| 2 controls, 2 caught (below) |") for line in lines)


def test_a_control_of_another_seed_is_refused(tmp_path):
    guarded = runcheck.dump(clean_example().run(), tmp_path / "guarded")
    other = runcheck.dump(unguarded_example().run(), tmp_path / "other")
    meta = json.loads((other / "run.json").read_text())
    (other / "run.json").write_text(json.dumps({**meta, "seed": 99}))
    with pytest.raises(ValueError, match="same schedule"):
        report.summarize(guarded, [other])


def test_control_labels():
    assert report.control_label({"unguarded": False, "guard": "fenced"}) == ""
    assert report.control_label({"guard": "nofence"}) == "guard nofence"
    assert report.control_label({"patterns": "bypass", "http": "unguarded"}) == (
        "patterns bypass, http unguarded"
    )
    assert report.control_label({"workload": "outbox-in-body"}) == "workload outbox-in-body"


def test_violations_by_rule():
    verdict = {
        "violations": [
            "step 4: 2 terminal transitions committed (done by a fence 1, done by b fence 2)",
            "step 5: effect e1 written for fence 3 -> 'done'",
            "step 6: key k applied 2 times",
            "rate steplock:rl:{x}: 6 grants in [1.0, +1 s) for a limit of 5 (a, b)",
            "concurrency nemesis-slots: 3 slots held at 2.000 for a limit of 2",
            "idempotency idem:1: completed again at 3.000",
            "breaker dep: call c made with no admission while open",
            'http replay_across_principals: {"key": "k"}',
            "tick: run 1a2b3c4d (pid 7) started at 1.000 while run 5e6f (pid 8) ran [0.5, 2.0]",
            "step 9: 'pending' -> 'done' committed while the chain was at 'done'",
        ],
        "counts": {"writer_step_violations": 1},
    }
    assert report.violations_by_rule(verdict) == {
        "steps": 1,
        "writers": 1,
        "effects": 2,
        "rate": 1,
        "concurrency": 1,
        "idempotency": 1,
        "breaker": 1,
        "http": 1,
        "periodic": 1,
    }
    assert report.violations_by_rule({"violations": []}) == {}
