"""The negative control: the same scenarios with the compare-and-swap (and its pre-check)
disabled must show violations, or the checker proves nothing."""

import pytest

from tests.support.faults import scenarios
from tests.support.faults.scenarios import SCENARIOS

pytestmark = [pytest.mark.faults, pytest.mark.workers, pytest.mark.django_db(transaction=True)]

CONTROLS = (
    "duplicate-task-id",
    "pause@before_commit",
    "kill-child@after_commit",
    "compensation-forward-first",
)


@pytest.fixture(scope="module")
def unguarded_lab(make_lab):
    return make_lab(unguarded=True)


@pytest.mark.parametrize("name", CONTROLS)
def test_without_the_cas_the_checker_reports_a_double_commit(unguarded_lab, name):
    outcome = scenarios.run(unguarded_lab, SCENARIOS[name])
    assert outcome.verdict.commits >= 2
    assert any("terminal transitions committed" in v for v in outcome.verdict.violations)
