"""The writers and periodic workloads live, without faults (tests/support/faults/mixed.py): real
workers, Redis and PostgreSQL. A writer outside Celery going through ``guarded_step`` beside
the step tasks (every other change through the async ``aguarded_step``) leaves a run the
checker accepts, and its plain-``UPDATE`` negative control is
caught; the periodic task under ``overlap="skip"`` never runs twice at once, and without the
guard it does. ``MIXED_LIVE_SECONDS`` (15) seconds a trial; ``python -m
tests.support.faults.mixed`` runs them longer."""

from __future__ import annotations

import os

import pytest

from tests.support.faults import mixed

pytestmark = [pytest.mark.faults, pytest.mark.workers, pytest.mark.django_db(transaction=True)]

SECONDS = float(os.environ.get("MIXED_LIVE_SECONDS", "15"))


def test_a_guarded_writer_beside_the_tasks_keeps_every_step_rule(lab, tmp_path):
    summary = mixed.writers_trial(lab, SECONDS, "guarded", seed=31, out=tmp_path)
    assert summary["settled"]
    assert summary["violations"] == [] and summary["leftovers"] == []
    assert summary["commits_by_writer"] == summary["writer"]["committed"] > 0
    assert summary["commits_by_tasks"] > 0
    # every other change went through the async API (aguarded_step): async holders beside
    # the tasks' sync ones, judged by the same rules
    assert summary["writer"]["async_tries"] == summary["writer"]["tries"] // 2
    assert summary["writer"]["async_committed"] > 0


def test_a_plain_writer_is_caught(lab, tmp_path):
    # the plain writer keeps its form open until a task commits under it (writers.plain_change)
    summary = mixed.writers_trial(lab, SECONDS, "plain", seed=31, out=tmp_path)
    assert summary["commits_by_writer"] > 0
    assert any("terminal transitions committed" in v for v in summary["violations"])


def test_periodic_runs_under_skip_never_overlap(lab, tmp_path):
    summary = mixed.periodic_trial(lab, SECONDS, guarded=True, out=tmp_path)
    assert summary["violations"] == [] and summary["data_loss"] == []
    assert summary["runs"] >= 2 and summary["skips"] >= 1
    assert summary["max_concurrent"] == 1


def test_periodic_runs_without_the_guard_overlap_and_are_caught(lab, tmp_path):
    summary = mixed.periodic_trial(lab, SECONDS, guarded=False, out=tmp_path)
    assert summary["max_concurrent"] == 2 and summary["skips"] == 0
    assert summary["violations"]
