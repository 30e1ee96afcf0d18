"""Every fault scenario once, against real workers, Redis and PostgreSQL (``tests/support/faults``).

Each trial ends only when the system is quiet again (step terminal, no message queued or
reserved, no lease held), then the checker's invariants must all hold.
"""

import pytest

from tests.support.faults import scenarios
from tests.support.faults.scenarios import SCENARIOS

pytestmark = [pytest.mark.faults, pytest.mark.workers, pytest.mark.django_db(transaction=True)]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_commits_once(lab, name):
    scenario = SCENARIOS[name]
    outcome = scenarios.run(lab, scenario)
    verdict = outcome.verdict
    print(f"{name}: {verdict} in {outcome.seconds:.1f}s")
    assert verdict.violations == []
    assert verdict.commits == 1  # one terminal transition, committed once
    assert verdict.attempts >= 2  # a second run was there to commit twice
    assert verdict.resumes == (1 if scenario.resume else 0)  # nothing lost that needed help
    assert verdict.leftover_leases == 0 and verdict.keys_without_ttl == 0
    if scenario.overlap:
        assert verdict.overlaps == 1  # two holders at once happened, and still one commit
    assert verdict.recovery_s is not None and verdict.recovery_s < scenario.timeout
