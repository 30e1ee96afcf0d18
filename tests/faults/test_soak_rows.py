"""The soak's per-scenario rows (``scripts/soak.py``): trial results from the labs fold into the
row shape that docs/reliability.json has always had, whatever lab ran which trial."""

import importlib.util

from tests.support.servers import ROOT

_spec = importlib.util.spec_from_file_location("soak_script", ROOT / "scripts" / "soak.py")
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)

ROW_FIELDS = {
    "fault",
    "trials",
    "overlaps",
    "commits",
    "violations",
    "violating_trials",
    "leftover_leases",
    "keys_without_ttl",
    "stale_rejected",
    "resumes",
    "errors",
    "examples",
    "recovery_p50_s",
    "recovery_max_s",
    "seconds",
}


def trial(seconds, recovery_s, violations=(), overlaps=0):
    return {
        "seconds": seconds,
        "overlaps": overlaps,
        "commits": 1 + len(violations),
        "violations": list(violations),
        "leftover_leases": 0,
        "keys_without_ttl": 0,
        "stale_rejected": 1,
        "resumes": 0,
        "recovery_s": recovery_s,
    }


def test_trials_fold_into_the_rows_fields():
    row = soak.new_row("SIGKILL worker child")
    soak.add_trial(row, trial(2.0, 1.5, overlaps=1))
    soak.add_trial(row, trial(3.0, 2.5, violations=["step 7: 2 terminal transitions committed"]))
    soak.add_trial(row, trial(1.0, 0.5))
    soak.add_trial(row, {"seconds": 4.0, "error": "error: TimeoutError: no attempt"})
    row = soak.finish_row(row)
    assert ROW_FIELDS <= set(row)
    assert (row["trials"], row["errors"]) == (3, 1)
    assert (row["commits"], row["violations"], row["violating_trials"]) == (4, 1, 1)
    assert (row["overlaps"], row["stale_rejected"]) == (1, 3)
    assert (row["recovery_p50_s"], row["recovery_max_s"]) == (1.5, 2.5)
    assert row["seconds"] == 10.0  # lab-seconds, summed over the labs that ran them
    assert row["trial_s"] == 2.5  # per trial, errors included
    assert row["examples"] == [
        "step 7: 2 terminal transitions committed",
        "error: TimeoutError: no attempt",
    ]


def test_a_row_without_trials_has_no_figures():
    row = soak.finish_row(soak.new_row("Redis outage 3 x ttl"))
    assert (row["trials"], row["recovery_p50_s"], row["recovery_max_s"], row["trial_s"]) == (
        0,
        None,
        None,
        None,
    )


def test_the_time_left_reads_as_hours_minutes_seconds():
    assert soak.duration(7199.6) == "1h59m59s"
    assert soak.duration(-3) == "0h00m00s"
