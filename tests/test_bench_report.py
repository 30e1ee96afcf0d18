"""The benchmark report (benchmarks/report.py, benchmarks/run.py): the pattern groups' rows as
figures, the issue-26 targets, the per-core summary, and ``previous`` when pattern files are
taken in. No benchmark runs here: the groups' JSON is written by the tests."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks import report, run

pytestmark = pytest.mark.no_database


def ratelimit_doc(window_us=20.0, extra=None):
    latency = {
        "ours_window": {"p50_us": 60.0, "p99_us": 200.0, "server_us": window_us, "commands": 1.0},
        "ours_bucket": {"p50_us": 64.0, "p99_us": 300.0, "server_us": 6.0, "commands": 1.0},
        "limits_moving": {"p50_us": 41.0, "p99_us": 120.0, "server_us": 5.0, "commands": 1.0},
        "limits_fixed": {"p50_us": 40.0, "p99_us": 500.0, "server_us": 4.0, "commands": 1.0},
    }
    for method, fields in (extra or {}).items():
        latency[method].update(fields)
    return {
        "context": {"time": "2026-12-01 18:35:31 UTC", "git_commit": "abc1234"},
        "methods": {
            "ours_window": "ours: SlidingWindow",
            "ours_bucket": "ours: TokenBucket",
            "limits_moving": "limits: moving",
            "limits_fixed": "limits: fixed",
        },
        "tables": {
            "latency": latency,
            "accuracy": {
                "ours_window": [
                    {"workers": 1, "proven_max_in_window": 20, "mean_rate": 20.0, "limit": 20},
                    {"workers": 8, "proven_max_in_window": 20, "mean_rate": 19.0, "limit": 20},
                ],
                "limits_fixed": [
                    {"workers": 1, "proven_max_in_window": 27, "mean_rate": 20.0, "limit": 20}
                ],
            },
            "edge": {"limits_fixed": {"workers": 2, "proven_max_in_window": 39, "limit": 20}},
        },
    }


def breaker_doc(closed_rt=1.0):
    rows = [
        ("bare call", "floor", 0.0, 0.0, 0.0),
        ("breaker, closed (success)", "celery-steplock", 41.0, closed_rt, 9.5),
        ("breaker, closed (success)", "pybreaker+redis", 68.0, 2.0, 10.0),
    ]
    return {
        "time": "2026-12-01T18:28:12Z",
        "rows": [
            {
                "scenario": s,
                "library": lib,
                "calls": 5000,
                "overhead_p50_us": p50,
                "overhead_p99_us": p50 * 2,
                "redis_commands_per_call": rt,
                "redis_server_us_per_call": rt * 4,
                "redis_cpu_us_per_call": cpu,
            }
            for s, lib, p50, rt, cpu in rows
        ],
    }


def idempotency_doc(db_first=400.0):
    def row(variant, first, replay, **extra):
        return {
            "variant": variant,
            "first_p50_us": first,
            "first_p99_us": first * 3,
            "replay_p50_us": replay,
            "replay_p99_us": replay * 3,
            "first_server_us": 30.0,
            "replay_server_us": 10.0,
            **extra,
        }

    return {
        "context": {"time": "2026-12-01 18:29:41 UTC", "database": "postgresql"},
        "rows": [
            row("bare", 0.1, 0.1),
            row("ours_redis", 300.0, 150.0, redis_cpu_us=None),
            row(
                "ours_database",
                db_first,
                95.0,
                # First call plain, replay prefixed (as benchmarks/idempotency.py writes).
                redis_cpu_us=20.0,
                decisions_per_redis_core_s=50000,
                replay_redis_cpu_us=5.0,
                replay_decisions_per_redis_core_s=200000,
                db_cpu_us=250.0,
                decisions_per_db_core_s=4000,
                replay_db_cpu_us=None,
                replay_decisions_per_db_core_s=None,
            ),
            row("handmade_table", 320.0, 220.0),
        ],
    }


def lease_groups():
    figures = [
        {
            "group": "lock",
            "name": "lock.uncontended.ours.server_us_top",
            "unit": "us",
            "value": 7.0,
        },
        {
            "group": "lock",
            "name": "lock.uncontended.raw.server_us_top",
            "unit": "us",
            "value": 4.0,
        },
        {
            "group": "lock",
            "name": "lock.uncontended.ours.cycles_per_core_s_cpu",
            "unit": "cycles/s",
            "value": 40000,
        },
        {
            "group": "e2e",
            "name": "e2e.postgresql.ratio.steplock_vs_handwritten",
            "unit": "x",
            "value": 0.97,
        },
        {"group": "e2e", "name": "e2e.postgresql.steplock.cpu_db", "unit": "us", "value": 800.0},
    ]
    return figures


def write_performance(out: Path) -> None:
    figures = lease_groups()
    groups: dict[str, dict[str, Any]] = {
        g: {"figures": [f for f in figures if f["group"] == g]} for g in ("lock", "e2e")
    }
    for g in groups.values():
        g["context"] = {"time": "2026-11-30 02:00:00"}
    doc = report.build(groups, {"time": "2026-11-30 02:00:00 UTC", "git_commit": "1111111"})
    (out / "performance.json").write_text(json.dumps(doc))


def write_patterns(folder: Path, **docs) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, doc in docs.items():
        (folder / f"{name}.json").write_text(json.dumps(doc))


def test_rows_become_figures_named_by_row_and_field():
    figures = report.pattern_figures(
        "breaker", report.pattern_rows("breaker", breaker_doc(closed_rt=0.0))
    )
    by_name = {f["name"]: f for f in figures}
    closed = by_name["breaker.closed.ours.redis_commands_per_call"]
    assert closed["value"] == 0.0
    assert closed["unit"] == "round trips"
    assert closed["library"] == "celery-steplock"
    assert by_name["breaker.closed.pybreaker.redis_cpu_us_per_call"]["value"] == 10.0
    assert "breaker.closed.ours.calls" not in by_name  # a label, not a figure

    figures = report.pattern_figures(
        "ratelimit", report.pattern_rows("ratelimit", ratelimit_doc())
    )
    names = {f["name"]: f["value"] for f in figures}
    assert names["ratelimit.ours_window.server_us"] == 20.0
    assert names["ratelimit.ours_window.proven_max_in_window_8w"] == 20
    assert names["ratelimit.limits_fixed.edge_proven_max_in_window"] == 39


def test_recorder_figures_give_the_same_names_and_the_document_wins():
    recorded = [
        {
            "name": "ratelimit.latency.server_us",
            "unit": "us",
            "value": 99.0,
            "method": "ours_window",
        },
        {
            "name": "ratelimit.accuracy.proven_max_in_window",
            "unit": "per window",
            "value": 21,
            "method": "ours_window",
            "workers": 8,
        },
        {"name": "ratelimit.edge.proven_max_in_window", "value": 20, "method": "ours_window"},
        {"name": "idempotency.first_p50_us", "unit": "us", "value": 5.0, "variant": "bare"},
    ]
    rows = report.recorder_rows("ratelimit", recorded)
    assert rows["ours_window"]["fields"] == {
        "server_us": 99.0,
        "proven_max_in_window_8w": 21,
        "edge_proven_max_in_window": 20,
    }
    entry = report.pattern_group("ratelimit", ratelimit_doc(), {"figures": recorded})
    values = {f["name"]: f["value"] for f in entry["figures"]}
    assert values["ratelimit.ours_window.server_us"] == 20.0  # the document's
    assert values["ratelimit.ours_window.edge_proven_max_in_window"] == 20  # the run's only
    assert entry["context"]["git_commit"] == "abc1234"


def evaluate(**docs):
    groups = {
        name: {"figures": report.pattern_group(name, doc)["figures"]} for name, doc in docs.items()
    }
    groups["lock"] = {"figures": [f for f in lease_groups() if f["group"] == "lock"]}
    groups["e2e"] = {"figures": [f for f in lease_groups() if f["group"] == "e2e"]}
    return {t["id"]: t for t in report.evaluate(report.Figures(groups))}


def test_issue_26_targets_met_and_missed_by_how_much():
    targets = evaluate(
        ratelimit=ratelimit_doc(window_us=20.0),
        breaker=breaker_doc(closed_rt=1.0),
        idempotency=idempotency_doc(db_first=400.0),
    )
    window = targets["ratelimit.window_server"]
    assert (window["measured"], window["met"]) == ("4.00x", False)
    assert "166.7% over the limit" in window["by"]
    bucket = targets["ratelimit.bucket_server"]
    assert (bucket["measured"], bucket["met"]) == ("1.50x", True)
    assert (targets["breaker.closed_rt"]["measured"], targets["breaker.closed_rt"]["met"]) == (
        "1",
        False,
    )
    assert targets["idempotency.db_first"]["measured"] == "1.25x"
    assert targets["idempotency.db_first"]["met"] is True
    assert targets["idempotency.redis_first"]["measured"] == "0.94x"
    assert targets["idempotency.redis_first"]["met"] is True
    assert targets["idempotency.replay_fastest"]["met"] is True
    assert targets["lock.server"]["issues"] == [5, 26]
    assert targets["lock.server"]["measured"] == "1.75x"
    assert targets["e2e.postgresql.ratio"]["issues"] == [5, 26]
    assert targets["e2e.postgresql.ratio"]["met"] is True
    for tid in ("ratelimit.window_server", "breaker.closed_rt", "idempotency.replay_fastest"):
        assert targets[tid]["issues"] == [26]


def test_targets_without_the_figures_are_absent_or_not_measured():
    doc = ratelimit_doc()
    del doc["tables"]["latency"]["limits_moving"]
    targets = evaluate(ratelimit=doc, breaker=breaker_doc(closed_rt=0.0))
    assert targets["ratelimit.window_server"]["met"] is None
    assert targets["ratelimit.window_server"]["by"] == "not measured"
    assert targets["breaker.closed_rt"]["met"] is True
    assert not any(tid.startswith("idempotency.") for tid in targets)


def test_render_only_takes_pattern_files_in_and_keeps_previous(tmp_path):
    out, patterns = tmp_path / "out", tmp_path / "patterns"
    out.mkdir()
    write_performance(out)
    write_patterns(
        patterns,
        ratelimit=ratelimit_doc(window_us=20.0),
        breaker=breaker_doc(),
        idempotency=idempotency_doc(),
    )
    argv = ["--render-only", "--out-dir", str(out), "--patterns-dir", str(patterns)]
    assert run.main(argv) == 0
    doc = json.loads((out / "performance.json").read_text())
    assert {"lock", "e2e", "ratelimit", "breaker", "idempotency"} <= set(doc["groups"])
    assert doc["groups"]["breaker"]["source"]["sha256"]
    md = (out / "performance.md").read_text()
    assert "## Targets (issue 26), from this run" in md
    assert "## 6. Rate limits" in md and "## 8. Idempotency records" in md
    # New fields: shown when present, "–" when missing or null.
    row = next(line for line in md.splitlines() if line.startswith("| ours: database store"))
    assert "| 20.0 / 5.0 | 50,000 / 200,000 | 250.0 / – | 4,000 / – |" in row
    row = next(line for line in md.splitlines() if line.startswith("| ours: Redis store"))
    assert row.endswith("| – | – | – | – |")
    summary = md.split("## Decisions per Redis core-second")[1].split("\n## ")[0]
    assert "| Lease cycle (acquire + release) | 25.0 | 40,000 | – | – |" in summary
    assert "| 800.0 | 1,250 (1e6 / CPU µs) |" in summary
    assert "store (Redis cache), first call | 20.0 | 50,000 | 250.0 | 4,000 |" in summary
    assert "store (Redis cache), replay | 5.0 | 200,000 | – | – |" in summary
    assert "ours: Redis store" not in summary  # no CPU figure at all

    # Nothing changed: a second render takes nothing in and writes the same report.
    before = (out / "performance.md").read_text(), (out / "performance.json").read_text()
    assert run.main(argv) == 0
    assert ((out / "performance.md").read_text(), (out / "performance.json").read_text()) == before

    # A pattern group rerun alone: its new figures in, the replaced ones as previous.
    write_patterns(patterns, ratelimit=ratelimit_doc(window_us=7.0))
    assert run.main(argv) == 0
    doc = json.loads((out / "performance.json").read_text())
    values = {f["name"]: f["value"] for f in doc["figures"]}
    assert values["ratelimit.ours_window.server_us"] == 7.0
    assert doc["previous"]["values"]["ratelimit.ours_window.server_us"] == 20.0
    assert doc["previous"]["values"]["target:ratelimit.window_server"] == "4.00x"
    assert "breaker.closed.ours.redis_commands_per_call" not in doc["previous"]["values"]
    assert doc["previous"]["by_group"]["ratelimit"]["time"] == "2026-12-01 18:35:31 UTC"
    md = (out / "performance.md").read_text()
    assert "| Sliding window: Redis server µs per decision ≤ 1.5 × `limits` moving window " in md
    assert "| 1.40x | **met** | 7.0 vs 5.0 µs; 6.7% under the limit | 4.00x |" in md


def test_a_partial_run_keeps_the_other_groups_and_marks_a_stale_file(tmp_path, monkeypatch):
    out, patterns = tmp_path / "out", tmp_path / "patterns"
    out.mkdir()
    write_performance(out)
    write_patterns(patterns, breaker=breaker_doc(closed_rt=1.0))

    def fake_run_group(name, quick, extra=None):
        if name == "ratelimit":  # wrote its file
            write_patterns(patterns, ratelimit=ratelimit_doc(window_us=6.0))
            return {"group": name, "figures": [], "notes": ["n"], "wall_s": 1.0}
        return {"group": name, "figures": [], "notes": [], "error": "ImportError: x"}

    monkeypatch.setattr(run, "run_group", fake_run_group)
    code = run.main(
        ["--only", "ratelimit", "breaker", "--out-dir", str(out), "--patterns-dir", str(patterns)]
    )
    assert code == 1  # breaker failed
    doc = json.loads((out / "performance.json").read_text())
    values = {f["name"]: f["value"] for f in doc["figures"]}
    assert values["lock.uncontended.ours.server_us_top"] == 7.0  # kept
    assert values["ratelimit.ours_window.server_us"] == 6.0
    assert doc["groups"]["ratelimit"]["source"]["path"].endswith("ratelimit.json")
    assert doc["groups"]["breaker"]["error"] == "ImportError: x"
    assert doc["groups"]["breaker"]["seen_sha256"]
    assert doc["context"]["reruns"][-1]["groups"] == ["ratelimit", "breaker"]
    # The breaker file older than the failed run is not taken in afterwards.
    time.sleep(0.01)
    assert run.main(["--render-only", "--out-dir", str(out), "--patterns-dir", str(patterns)]) == 0
    doc = json.loads((out / "performance.json").read_text())
    assert not [f for f in doc["figures"] if f["group"] == "breaker"]
    assert "## breaker: FAILED" in (out / "performance.md").read_text()


def test_a_quick_run_without_a_document_uses_the_rows_it_returned():
    result = {
        "group": "idempotency",
        "figures": [],
        "rows": idempotency_doc()["rows"],
        "table": "| ... |",
    }
    entry = report.pattern_group("idempotency", None, result)
    values = {f["name"]: f["value"] for f in entry["figures"]}
    assert values["idempotency.ours_database.replay_redis_cpu_us"] == 5.0
    assert values["idempotency.ours_database.replay_db_cpu_us"] is None
    assert "rows" not in entry and "table" not in entry
    doc = ratelimit_doc()
    entry = report.pattern_group("ratelimit", None, {"figures": [], "tables": doc["tables"]})
    labels = {f["row"]: f["label"] for f in entry["figures"]}
    assert labels["ours_window"] == "ours: SlidingWindow (exact log, Lua)"  # the group's own


def aio_group(ours: bool = True) -> dict[str, Any]:
    """An ``aio`` group's result as ``benchmarks/aio.py`` returns it (``ours`` False: the
    placeholder run, our side not importable yet)."""

    def fig(name, value, unit="x", **labels):
        return {"name": name, "unit": unit, "value": value, **labels}

    figures = [
        fig("aio.lease.raw.p50", 380.0, "us", variant="raw"),
        fig("aio.lease.redis_py.p50", 426.0, "us", variant="redis_py"),
        fig("aio.lease.raw.server_us", 9.7, "us", variant="raw"),
        fig("aio.lease.concurrent.raw.us_per_cycle", 273.6, "us", variant="raw"),
        fig("aio.decision.limits_moving.p50", 198.0, "us", variant="limits_moving"),
        fig("aio.decision.ours_window.p50", 310.0, "us", variant="ours_window"),
        fig("aio.decision.ratio.ours_window_vs_limits_moving", 1.586, reps=[1.528, 1.643]),
        fig("aio.decision.ratio.ours_window_vs_limits_moving_server", 1.2),
    ]
    missing = {}
    if ours:
        figures += [
            fig("aio.lease.ours.p50", 400.0, "us", variant="ours"),
            fig("aio.lease.ours.server_us", 12.0, "us", variant="ours"),
            fig("aio.lease.ratio.ours_vs_raw", 1.05, reps=[1.02, 1.08]),
            fig("aio.lease.ratio.ours_vs_redis_py", 0.94, reps=[0.93, 0.95]),
            fig("aio.lease.concurrent.ratio.ours_vs_raw", 1.2, rounds=[1.1, 1.3]),
            fig("aio.lease.concurrent.ratio.ours_vs_raw_cpu", 1.15, rounds=[1.1, 1.2]),
            fig("aio.lease.concurrent.ratio.ours_vs_redis_py_cpu", 1.0, rounds=[0.9, 1.1]),
            fig("aio.lease.ratio.ours_vs_raw_server", 1.24),
        ]
    else:
        missing = {"lease": "ModuleNotFoundError: No module named 'celery_steplock.aio.lock'"}
    return {"group": "aio", "figures": figures, "notes": [], "missing": missing}


def test_aio_targets_are_issue_27s_met_missed_or_not_measured():
    targets = {t["id"]: t for t in report.evaluate(report.Figures({"aio": aio_group()}))}
    assert (targets["aio.floor"]["measured"], targets["aio.floor"]["met"]) == ("1.050x", True)
    assert "4.5% under the limit; per repetition/round 1.020..1.080" == targets["aio.floor"]["by"]
    assert targets["aio.redis_py"]["met"] is True
    assert targets["aio.floor_concurrent"]["by"].endswith("; wall µs per cycle 1.200x")
    assert (targets["aio.floor_concurrent"]["met"], targets["aio.redis_py_concurrent"]["met"]) == (
        False,
        True,
    )
    # Reported without a bar (issue 27 sets none).
    assert (targets["aio.window"]["measured"], targets["aio.window"]["met"]) == ("1.586x", None)
    assert targets["aio.window_server"]["met"] is None
    assert {tuple(t["issues"]) for tid, t in targets.items() if tid.startswith("aio.")} == {(27,)}

    placeholder = {
        t["id"]: t for t in report.evaluate(report.Figures({"aio": aio_group(ours=False)}))
    }
    assert placeholder["aio.floor"]["met"] is None
    assert placeholder["aio.floor"]["by"] == "not measured"
    assert placeholder["aio.window"]["measured"] == "1.586x"  # the rate-limit side did run
    # No aio group at all: no aio target.
    assert not [t for t in report.evaluate(report.Figures({})) if t["id"].startswith("aio.")]


def test_aio_section_and_issue_27_targets_rendered(tmp_path):
    for ours in (True, False):
        group = aio_group(ours)
        doc = report.build({"aio": group}, {"time": "2026-12-03 04:00:00 UTC"})
        report.write(doc, tmp_path)
        md = (tmp_path / "performance.md").read_text()
        assert "## Targets (issue 27), from this run" in md
        assert "## 9. Async (issue 27)" in md
        row = next(line for line in md.splitlines() if line.startswith("| raw async SET NX"))
        assert row.startswith("| raw async SET NX PX + EVALSHA release | 380.0 | – | – | 273.6 |")
        assert ("**Placeholder: ours (lease) not measured" in md) is not ours
        ratios = next(
            line for line in md.splitlines() if line.startswith("| ours_window / limits_moving")
        )
        assert ratios == "| ours_window / limits_moving | 1.586 | 1.200 |"
        if ours:
            assert "| ours / raw | 1.050 | 1.200 | 1.150 | 1.240 |" in md
        else:
            assert "| ours / raw |" not in md


def test_aio_group_is_registered():
    assert run.GROUPS["aio"] == "benchmarks.aio"
