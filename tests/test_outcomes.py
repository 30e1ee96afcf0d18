"""celery_steplock.outcomes: the duplicate and skipped outcomes, and the same-id rule, in
process (``apply()``, and the module's functions under a pushed worker-like request) against
real Redis, the real database and django-celery-results' backend.

Real workers running group, chord and chain over duplicates: test_outcomes_workers.py.
"""

import json
import pickle
import threading
import time
import uuid

import pytest
from celery import states
from celery.app.task import Context
from django.db import connections
from kombu.serialization import dumps, loads

from celery_steplock import outcomes
from celery_steplock.exceptions import TransitionConflict
from celery_steplock.lease import _task_digest, new_owner_token, owner_has_task_id, owner_task_id
from celery_steplock.lock import get_lease_store
from celery_steplock.outcomes import DUPLICATE, SKIPPED, StepOutcome, is_outcome
from celery_steplock.task import StepLockedTask
from django_app.celery import app as celery_app
from django_app.workflows.models import Step, TransitionRecord
from helpers import set_settings

pytestmark = pytest.mark.django_db(transaction=True)

BODY_RUNS = []


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.outcomes.finish",
    lock_key="outcome:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
    on_contended="skip",
)
def finish(self, step_id):
    BODY_RUNS.append(step_id)
    TransitionRecord.objects.create(
        step_id=step_id,
        from_status="pending",
        to_status="done",
        owner=self.lease.owner,
        fence=self.lease.fence,
        task_id=self.request.id or "",
    )
    return {"winner": self.request.id, "fence": self.lease.fence}


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.outcomes.blind",
    lock_key="outcome:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
    lock_precheck=False,
)
def blind(self, step_id):
    BODY_RUNS.append(step_id)
    TransitionRecord.objects.create(
        step_id=step_id,
        from_status="pending",
        to_status="done",
        owner=self.lease.owner,
        fence=self.lease.fence,
    )
    return "body done"


@pytest.fixture(autouse=True)
def clean(app, redis_client):
    BODY_RUNS.clear()
    yield
    for task in (finish, blind):
        for option in ("on_conflict", "track_started"):
            task.__dict__.pop(option, None)


def duplicate(step, found="done", committed_by=None, task="tests.outcomes.finish"):
    return {
        "steplock": "duplicate",
        "task": task,
        "step_id": step.pk,
        "expected": "pending",
        "found": found,
        "committed_by": committed_by,
        "held_by": None,
    }


# -- the value ---------------------------------------------------------------------------


def test_outcome_is_a_stable_plain_dict_every_serializer_carries():
    outcome = StepOutcome(
        DUPLICATE,
        "shop.charge",
        step_id=uuid.UUID(int=5),
        expected="pending",
        found="charged",
        committed_by="t-1",
    )
    value = outcome.to_dict()
    assert value == {
        "steplock": "duplicate",
        "task": "shop.charge",
        "step_id": "00000000-0000-0000-0000-000000000005",
        "expected": "pending",
        "found": "charged",
        "committed_by": "t-1",
        "held_by": None,
    }
    for serializer in ("json", "pickle"):
        content_type, encoding, data = dumps(value, serializer=serializer)
        assert loads(data, content_type, encoding, accept=[content_type]) == value
    assert json.loads(json.dumps(value)) == value and pickle.loads(pickle.dumps(value)) == value
    assert StepOutcome.from_dict(value) == StepOutcome(
        DUPLICATE,
        "shop.charge",
        step_id="00000000-0000-0000-0000-000000000005",
        expected="pending",
        found="charged",
        committed_by="t-1",
    )
    assert is_outcome(value) and is_outcome(StepOutcome(SKIPPED, "t").to_dict())
    assert not is_outcome({"steplock": "duplicate"}) and not is_outcome({"fence": 1})
    with pytest.raises(ValueError):
        StepOutcome.from_dict({"winner": "x"})


def test_msgpack_carries_the_outcome():
    pytest.importorskip("msgpack")
    value = StepOutcome(DUPLICATE, "t", step_id=3, expected="a", found="b").to_dict()
    content_type, encoding, data = dumps(value, serializer="msgpack")
    assert loads(data, content_type, encoding, accept=[content_type]) == value


def legacy_token(task_id):
    """An owner token as earlier versions made it: 24 random hex digits and 8 of a digest
    of the task id."""
    return uuid.uuid4().hex[:24] + _task_digest(task_id)


def test_owner_token_carries_its_task_id():
    task_id = str(uuid.uuid4())
    token = new_owner_token(task_id)
    assert len(token) == 61 and token[24] == ":" and int(token[:24], 16) >= 0
    assert owner_task_id(token) == task_id
    assert owner_has_task_id(token, task_id) and not owner_has_task_id(token, "task-b")
    assert new_owner_token(task_id) != token  # still unique per attempt (96 random bits)
    assert new_owner_token(task_id)[24:] == token[24:]
    assert not owner_has_task_id(None, "task-a") and not owner_has_task_id(token, None)
    assert not owner_has_task_id("short", "task-a")
    assert owner_task_id(new_owner_token()) is None and len(new_owner_token()) == 32
    longest = "i" * 39
    assert len(new_owner_token(longest)) == 64 and owner_task_id(new_owner_token(longest))


@pytest.mark.parametrize("task_id", ["i" * 40, "has space", "caf\u00e9", "tab\tid"])
def test_a_task_id_the_token_cannot_carry_gets_the_digest_form(task_id):
    token = new_owner_token(task_id)
    assert len(token) == 32 and int(token, 16) >= 0 and owner_task_id(token) is None
    assert owner_has_task_id(token, task_id) and not owner_has_task_id(token, "other")


def test_an_owner_column_sized_for_earlier_tokens_gets_the_short_form():
    """A user's own owner column of 32 characters (the earlier tokens' length) keeps working:
    the token is made to fit it, and only committed_by is lost."""
    task_id = str(uuid.uuid4())
    token = new_owner_token(task_id, max_length=32)
    assert len(token) == 32 and owner_task_id(token) is None
    assert owner_has_task_id(token, task_id)
    assert len(new_owner_token(task_id, max_length=61)) == 61  # just fits: carried
    assert len(new_owner_token(task_id, max_length=60)) == 32
    from celery_steplock.contrib.django.steps import DjangoStepStore

    assert DjangoStepStore(Step).owner_max_length == 64  # LeaseFencedStep.lock_owner


def test_tokens_of_earlier_versions_stay_readable():
    token = legacy_token("task-a")
    assert owner_has_task_id(token, "task-a") and not owner_has_task_id(token, "task-b")
    assert owner_task_id(token) is None  # committed_by unknown for them


# -- through the task (apply) ------------------------------------------------------------


def test_duplicate_with_its_own_task_id_succeeds_with_the_outcome(events):
    step = Step.objects.create(name="s")
    first = finish.apply(args=(step.pk,), task_id="winner-id")
    second = finish.apply(args=(step.pk,), task_id="loser-id")
    assert first.state == "SUCCESS" and first.result["winner"] == "winner-id"
    # The event log is off: committed_by comes from the row's owner token.
    assert second.state == "SUCCESS"
    assert second.result == duplicate(step, committed_by="winner-id")
    assert BODY_RUNS == [step.pk] and TransitionRecord.objects.count() == 1
    step.refresh_from_db()
    assert owner_task_id(step.lock_owner) == "winner-id"  # the row names its writer's id


def test_committed_by_comes_from_the_event_log_when_it_is_on(app):
    set_settings(app, steplock_event_log=True)
    step = Step.objects.create(name="s")
    assert finish.apply(args=(step.pk,), task_id="winner-id").successful()
    assert finish.apply(args=(step.pk,), task_id="loser-id").result == duplicate(
        step, committed_by="winner-id"
    )


def test_same_task_id_after_the_commit_ends_in_ignore():
    step = Step.objects.create(name="s")
    assert finish.apply(args=(step.pk,), task_id="same").successful()
    assert finish.apply(args=(step.pk,), task_id="same").state == "IGNORED"
    assert BODY_RUNS == [step.pk]


def test_refused_compare_and_swap_returns_the_outcome_and_rolls_the_body_back():
    step = Step.objects.create(name="s", status="cancelled")
    result = blind.apply(args=(step.pk,), task_id="late")
    assert result.state == "SUCCESS"
    assert result.result == duplicate(step, found="cancelled", task="tests.outcomes.blind")
    assert BODY_RUNS == [step.pk] and TransitionRecord.objects.count() == 0


def test_ignore_and_raise_keep_their_meaning(app):
    step = Step.objects.create(name="s", status="done")
    finish.on_conflict = "ignore"
    assert finish.apply(args=(step.pk,)).state == "IGNORED"
    finish.on_conflict = "raise"
    failed = finish.apply(args=(step.pk,))
    assert failed.state == "FAILURE" and isinstance(failed.result, TransitionConflict)
    del finish.on_conflict
    set_settings(app, steplock_on_conflict="ignore")  # the setting, for every task
    assert finish.apply(args=(step.pk,)).state == "IGNORED"
    assert BODY_RUNS == []


def test_skip_returns_the_holder_unless_it_is_the_same_task_id():
    step = Step.objects.create(name="s")
    store = get_lease_store(celery_app)
    store.acquire(f"outcome:{step.pk}", "holder-owner", 10.0, metadata={"task_id": "holder"})
    skipped = finish.apply(args=(step.pk,), task_id="other")
    assert skipped.state == "SUCCESS"
    assert skipped.result == {
        "steplock": "skipped",
        "task": "tests.outcomes.finish",
        "step_id": step.pk,
        "expected": "pending",
        "found": None,
        "committed_by": None,
        "held_by": "holder",
    }
    assert finish.apply(args=(step.pk,), task_id="holder").state == "IGNORED"
    finish.on_contended = "ignore"
    try:
        assert finish.apply(args=(step.pk,), task_id="other").state == "IGNORED"
    finally:
        finish.on_contended = "skip"
    assert BODY_RUNS == []


# -- the same-id rule against the result backend ---------------------------------------------


@pytest.fixture
def worker_request():
    """``finish`` under a request as a worker's (not eager, results stored in the database
    through django-celery-results); yields a function that pushes one."""
    pushed = []

    def push(task_id, **extra):
        finish.push_request(
            id=task_id,
            called_directly=False,
            is_eager=False,
            ignore_result=False,
            args=[],
            kwargs={},
            **extra,
        )
        pushed.append(1)
        return finish.request

    yield push
    for _ in pushed:
        finish.pop_request()


def conflict(step):
    return TransitionConflict(
        "moved on", step_id=step.pk, from_="pending", to="done", current="done"
    )


def steps():
    return finish.steplock_plan.steps


def committed_step(task_id):
    return Step.objects.create(
        name="s", status="done", lock_owner=new_owner_token(task_id), lock_fence=7
    )


def test_a_stored_result_of_the_same_id_is_never_overwritten(worker_request):
    step = committed_step("x")
    celery_app.backend.store_result("x", {"winner": "x"}, states.SUCCESS)
    worker_request("x")
    assert outcomes.conflict_outcome(finish, conflict(step), steps()) is None
    worker_request("y")  # another id: the row says "x" wrote it, "y" has nothing stored
    assert outcomes.conflict_outcome(finish, conflict(step), steps()) == duplicate(
        step, committed_by="x"
    )


def test_same_id_waits_for_the_winner_s_result_then_ignores(worker_request):
    step = committed_step("x")
    worker_request("x")

    def store():
        try:
            celery_app.backend.store_result("x", {"winner": "x"}, states.SUCCESS)
        finally:
            connections.close_all()  # this thread's connection, before the test DB goes

    storer = threading.Timer(0.2, store)
    storer.start()
    try:
        assert outcomes.conflict_outcome(finish, conflict(step), steps()) is None
    finally:
        storer.join()


def test_same_id_whose_winner_never_stores_ends_with_its_own_outcome(worker_request):
    """The winner committed and died before storing (SIGKILL after COMMIT): after
    STORE_WAIT the delivery stores the outcome, so the id still ends."""
    step = committed_step("x")
    worker_request("x")
    started = time.monotonic()
    outcome = outcomes.conflict_outcome(finish, conflict(step), steps())
    assert time.monotonic() - started >= outcomes.STORE_WAIT - 0.1  # it waited
    assert outcome == duplicate(step, committed_by="x")


def test_a_same_id_lease_retry_without_owner_column_evidence_waits_too(worker_request):
    step = Step.objects.create(name="s", status="done")  # no owner written
    worker_request("x", **{outcomes.SAME_ID_HEADER: 1})
    celery_app.backend.store_result("x", {"winner": "x"}, states.SUCCESS)
    assert outcomes.conflict_outcome(finish, conflict(step), steps()) is None


def test_started_written_over_the_winner_s_success_is_put_back(worker_request):
    finish.track_started = True
    celery_app.backend.store_result("x", {"winner": "x"}, states.SUCCESS)
    request = worker_request("x", delivery_info={"redelivered": True})
    outcomes._remember_stored_state(sender=finish, task=finish)
    assert request.steplock_stored_state["result"] == {"winner": "x"}
    celery_app.backend.store_result("x", {"pid": 1}, states.STARTED)  # what Celery writes
    assert outcomes.restore_stored_state(finish) is True
    meta = celery_app.backend.get_task_meta("x", cache=False)
    assert (meta["status"], meta["result"]) == ("SUCCESS", {"winner": "x"})
    assert outcomes.restore_stored_state(finish) is False  # nothing to put back now


def test_with_track_started_every_delivery_reads_the_backend_before_it_starts(worker_request):
    """A message re-sent by hand with a finished id is neither redelivered nor a retry: every
    delivery remembers a stored SUCCESS before Celery's STARTED overwrites it."""
    celery_app.backend.store_result("x", {"winner": "x"}, states.SUCCESS)
    finish.track_started = False
    plain = worker_request("x", delivery_info={"redelivered": False})
    outcomes._remember_stored_state(sender=finish, task=finish)
    assert getattr(plain, "steplock_stored_state", None) is None  # no track_started: no read
    finish.track_started = True
    resent = worker_request("x", delivery_info={"redelivered": False})
    outcomes._remember_stored_state(sender=finish, task=finish)
    assert resent.steplock_stored_state["status"] == "SUCCESS"
    assert resent.steplock_stored_state["result"] == {"winner": "x"}


def test_the_row_s_writer_outweighs_a_retry_s_same_id_header(worker_request):
    """The same-id holder a retry met may have died; the row says another id committed."""
    step = committed_step("y")
    worker_request("x", **{outcomes.SAME_ID_HEADER: 1})
    assert outcomes.conflict_outcome(finish, conflict(step), steps()) == duplicate(
        step, committed_by="y"
    )


def test_a_row_written_by_an_earlier_version_keeps_the_same_id_rule(worker_request):
    """A token with only a digest of its task id: the same id still ends in Ignore, another
    id's outcome has committed_by None (unless the event log names it)."""
    step = Step.objects.create(name="s", status="done", lock_owner=legacy_token("x"))
    celery_app.backend.store_result("x", {"winner": "x"}, states.SUCCESS)
    worker_request("x")
    assert outcomes.conflict_outcome(finish, conflict(step), steps()) is None
    worker_request("y")
    assert outcomes.conflict_outcome(finish, conflict(step), steps()) == duplicate(step)


# -- on_conflict="return_winner" -------------------------------------------------------------


def store_winner(task_id, result, name="tests.outcomes.finish"):
    """Store ``result`` for ``task_id`` as a worker with ``result_extended`` does (the
    stored state names the task)."""
    celery_app.backend.store_result(
        task_id, result, states.SUCCESS, request=Context(task=name, args=[])
    )


def test_return_winner_returns_the_winner_s_stored_result(app, worker_request):
    set_settings(app, result_extended=True)
    step = committed_step("x")
    store_winner("x", {"winner": "x", "n": [1, 2]})
    worker_request("y")
    outcome = outcomes.conflict_outcome(finish, conflict(step), steps())
    assert outcome == duplicate(step, committed_by="x")
    value = outcomes.winner_result(finish, conflict(step), outcome)
    assert value == {"winner": "x", "n": [1, 2]}
    assert outcomes.outcome_kind(finish, value) == DUPLICATE  # logged as a duplicate


def test_return_winner_needs_a_stored_state_naming_this_task(app, worker_request):
    """Without result_extended the stored state names no task: it could be another task's
    (here "shop.refund", which wrote the same transition), so the outcome dict."""
    set_settings(app, result_extended=False)
    step = committed_step("other-task-id")
    store_winner("other-task-id", {"card": "4111-xxxx", "refund_of": 9}, name="shop.refund")
    worker_request("y")
    outcome = outcomes.conflict_outcome(finish, conflict(step), steps())
    assert outcome == duplicate(step, committed_by="other-task-id")
    assert outcomes.winner_result(finish, conflict(step), outcome) == outcome


def test_a_row_written_with_a_chosen_owner_hands_over_no_result_without_a_name(
    app, worker_request
):
    """committed_by is read from whatever lock_owner holds (an external writer, a
    caller-chosen owner of the carrying form): a stored state that names no task is never
    returned."""
    set_settings(app, result_extended=False)
    celery_app.backend.store_result("victim-id", {"secret": 1}, states.SUCCESS)
    step = Step.objects.create(name="s", status="done", lock_owner="0" * 24 + ":victim-id")
    worker_request("y")
    outcome = outcomes.conflict_outcome(finish, conflict(step), steps())
    assert outcome["committed_by"] == "victim-id"
    assert outcomes.winner_result(finish, conflict(step), outcome) == outcome


def test_return_winner_falls_back_to_the_outcome(app, worker_request):
    set_settings(app, result_extended=True)
    step = committed_step("x")
    worker_request("y")
    outcome = outcomes.conflict_outcome(finish, conflict(step), steps())
    # A winner whose stored state is a failure.
    celery_app.backend.store_result("x", ValueError("boom"), states.FAILURE)
    assert outcomes.winner_result(finish, conflict(step), outcome) == outcome
    # The step is not in the task's own "to": a later writer's result is not this task's.
    celery_app.backend.store_result("x", {"winner": "x"}, states.SUCCESS)
    later = TransitionConflict(
        "moved on", step_id=step.pk, from_="pending", to="done", current="shipped"
    )
    assert outcomes.winner_result(finish, later, outcome) == outcome
    # A stored state naming another task (result_extended).
    celery_app.backend.store_result(
        "x", {"winner": "x"}, states.SUCCESS, request=Context(task="tests.other", args=[])
    )
    meta = celery_app.backend.get_task_meta("x", cache=False)
    assert (meta.get("name") or meta.get("task_name")) == "tests.other"
    assert outcomes.winner_result(finish, conflict(step), outcome) == outcome
    # The winner unknown (committed_by None).
    unknown = duplicate(step)
    assert outcomes.winner_result(finish, conflict(step), unknown) == unknown
    assert outcomes.outcome_kind(finish, outcome) == DUPLICATE


def test_return_winner_waits_at_most_store_wait_for_a_missing_result(worker_request):
    step = committed_step("never-stored")
    worker_request("y")
    outcome = outcomes.conflict_outcome(finish, conflict(step), steps())
    began = time.monotonic()
    assert outcomes.winner_result(finish, conflict(step), outcome) == outcome
    assert outcomes.STORE_WAIT - 0.1 <= time.monotonic() - began < outcomes.STORE_WAIT + 1


def test_return_winner_through_the_task(app, worker_request):
    """apply() stores no result: the winner's is put in the backend as a worker would."""
    step = Step.objects.create(name="s")
    winner = finish.apply(args=(step.pk,), task_id="winner-id")
    set_settings(app, result_extended=True)
    store_winner("winner-id", winner.result)
    set_settings(app, steplock_on_conflict="return_winner")  # the setting, for every task
    again = finish.apply(args=(step.pk,), task_id="loser-id")
    assert again.state == "SUCCESS" and again.result == winner.result
    assert again.result == {"winner": "winner-id", "fence": winner.result["fence"]}
    assert BODY_RUNS == [step.pk]


# -- the same-id rule: owner tokens, not the holder's display metadata --------------------------


@pytest.mark.parametrize(
    "task_id",
    [
        "a:b:c",
        "0123456789abcdef01234567:x",
        "x" * 39,
        "x" * 40,
        "with space",
        "ünïcödé",
        "tab\tid",
        "",
    ],
)
def test_unusual_task_ids_keep_the_same_id_rule(task_id):
    token = new_owner_token(task_id)
    assert len(token) <= 64
    if task_id:
        assert owner_has_task_id(token, task_id)
        assert not owner_has_task_id(token, task_id + "x")
        assert owner_task_id(token) in (task_id, None)


@pytest.mark.parametrize("task_id", ["tab\tid", "n" * 300])
def test_a_same_id_holder_is_found_by_its_token_when_the_metadata_escapes_or_cuts_the_id(
    worker_request, task_id
):
    """The holder's metadata escapes control characters and cuts a task id over 255
    characters: the holder's owner token decides (skip: Ignore, not a "skipped" dict)."""
    from celery_steplock.exceptions import LockContended
    from celery_steplock.lease import holder_metadata

    holder = new_owner_token(task_id)
    shown = holder_metadata(task_id=task_id, task_name=finish.name)["task_id"]
    assert shown != task_id
    exc = LockContended("held", holder=holder, holder_task_id=shown)
    worker_request(task_id)
    assert outcomes.holder_has_task_id(exc, task_id)
    assert outcomes.contended_outcome(finish, exc, step_id=1, expected="pending") is None
    # Another id that reads alike in the metadata is another task.
    other = LockContended("held", holder=new_owner_token(shown), holder_task_id=shown)
    assert not outcomes.holder_has_task_id(other, task_id)
    skipped = outcomes.contended_outcome(finish, other, step_id=1, expected="pending")
    assert skipped["steplock"] == SKIPPED and skipped["held_by"] == shown
    # No owner token known: the metadata's id, compared exactly.
    assert outcomes.holder_has_task_id(LockContended("held", holder_task_id="t"), "t")
    assert not outcomes.holder_has_task_id(LockContended("held", holder_task_id="t"), "u")
    # A caller-chosen owner (not a token of new_owner_token): the metadata decides.
    chosen = LockContended("held", holder="holder-owner", holder_task_id="t")
    assert outcomes.holder_has_task_id(chosen, "t")
