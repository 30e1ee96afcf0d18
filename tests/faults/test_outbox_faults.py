"""The effects outbox under faults, against real workers, Redis, PostgreSQL, an idempotent HTTP
receiver on loopback and a step-locked receiver task (``tests/support/faults/outbox.py``).

Each trial ends when the step and its sink are terminal, the broker idle and no effect pending,
plus the relay's period; then the step invariants hold on both steps and every committed
transition's two effects were written, dispatched, received at least once and applied exactly
once, with no effect of an attempt whose CAS was refused. The negative control performs the
same effects in the body and must be caught applying one twice.
"""

import os

import pytest

from tests.support.faults import outbox
from tests.support.faults.outbox import CONTROLS, OUTBOX_SCENARIOS
from tests.support.faults.receiver import Receiver

pytestmark = [pytest.mark.faults, pytest.mark.workers, pytest.mark.django_db(transaction=True)]


#: The trials of the default ``make test`` (each 5 to 20 s); ``STEPLOCK_OUTBOX_FAULTS=all`` runs
#: every scenario and both controls.
DEFAULT = (
    "outbox-kill@after_commit",
    "outbox-pause@before_cas",
    "outbox-receiver-down",
    "outbox-lost-commit-reply",
)
EVERY = os.environ.get("STEPLOCK_OUTBOX_FAULTS") == "all"
SCENARIOS = list(OUTBOX_SCENARIOS) if EVERY else list(DEFAULT)
NEGATIVE = list(CONTROLS) if EVERY else list(CONTROLS[:1])


@pytest.fixture(scope="module")
def receiver():
    with Receiver() as running:
        yield running


@pytest.mark.parametrize("name", SCENARIOS)
def test_outbox_effects_go_out_once(lab, receiver, name):
    scenario = OUTBOX_SCENARIOS[name]
    outcome = outbox.run(lab, scenario, receiver)
    verdict, effects = outcome.verdict, outcome.effects
    print(f"{name}: {effects.as_dict()} relay {outcome.relay} in {outcome.seconds:.1f}s")
    assert verdict.violations == [] and effects.violations == []
    assert verdict.commits == 2  # the step's terminal transition and its sink's
    assert (effects.commits, effects.expected, effects.rows, effects.dispatched) == (1, 2, 2, 2)
    assert (effects.pending, effects.dead) == (0, 0)
    assert effects.keys_received == 2 and effects.applied == 2
    assert verdict.leftover_leases == 0 and verdict.keys_without_ttl == 0
    if name in ("outbox-kill@after_commit", "outbox-lost-commit-reply"):
        assert outcome.relay["dispatched"] == 2  # the committing process never sent them
    if name == "outbox-receiver-down":
        assert outcome.relay["dispatched"] >= 1  # the on-commit send failed: the relay's
    if scenario.overlap:
        assert verdict.overlaps == 1


@pytest.mark.parametrize("name", NEGATIVE)
def test_effects_performed_in_the_body_are_caught_applying_twice(lab, receiver, name):
    outcome = outbox.run(lab, OUTBOX_SCENARIOS[name], receiver, task="effect_in_body")
    effects = outcome.effects
    print(f"control {name}: {effects.as_dict()}")
    assert effects.rows == 0
    assert any("applied 2 times" in v for v in effects.violations)
    assert any("never committed" in v for v in effects.violations)
