"""The effects outbox's write side (issue 28): the declared effects are rows of the outbox
table if and only if the step's fenced compare-and-swap committed.

Real Redis (the session's server), the real test database (SQLite, PostgreSQL, MariaDB
passes; transactions committed: ``transactional_db``). Tasks run in this process (eager
``apply``); the rows are read back with the ORM.
"""

from __future__ import annotations

import asyncio

import pytest
from django.db import transaction

from celery_steplock import effects
from celery_steplock.contrib.django.models import Effect
from celery_steplock.contrib.django.steps import aguarded_step, guarded_step
from celery_steplock.exceptions import EffectsUnavailable, LockLost, TransitionConflict
from celery_steplock.task import StepLockedTask
from django_app.celery import app as celery_app
from django_app.workflows.models import Step
from django_app.workflows.tasks import declare_effects
from helpers import closed_port_url

pytestmark = pytest.mark.django_db(transaction=True)

STEP_OPTIONS = dict(
    bind=True,
    base=StepLockedTask,
    lock_key="step:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
)


@celery_app.task(
    name="tests.effects.blind", transition=("pending", "done"), lock_precheck=False, **STEP_OPTIONS
)
def blind(self, step_id):
    """Declares effects with the precheck off: the body runs even when the step moved."""
    effects.publish("workflows.tasks.noop_effect", args=[step_id, 0])
    effects.call("workflows.effect_seen", step_id)
    return self.lease.fence


@celery_app.task(name="tests.effects.phases", **STEP_OPTIONS)
def phases(self, step_id):
    """Two transitions in the body, no plan transition: the key names the last one."""
    self.transition(step_id, "pending", "running")
    effects.publish("workflows.tasks.noop_effect", args=[step_id, 0])
    self.transition(step_id, "running", "done")
    return self.lease.fence


@celery_app.task(name="tests.effects.no_transition", **STEP_OPTIONS)
def no_transition(self, step_id):
    """A step model, no transition applied: nothing for the effects to belong to."""
    effects.publish("workflows.tasks.noop_effect", args=[step_id, 0])


@celery_app.task(bind=True, base=StepLockedTask, name="tests.effects.no_steps", lock_key="n:{n}")
def no_steps(self, n):
    """No step model: no transaction to write effects in."""
    effects.publish("workflows.tasks.noop_effect", args=[n, 0])


@celery_app.task(
    name="tests.effects.open",
    transition=("pending", "done"),
    on_store_error="fail_open",
    **STEP_OPTIONS,
)
def fail_open(self, step_id):
    """Runs without a lease when Redis does not answer (fail open)."""
    effects.publish("workflows.tasks.noop_effect", args=[step_id, 0])
    return self.lease


class LateDeclaring(StepLockedTask):
    def before_commit(self, lease, step_id):
        effects.publish("workflows.tasks.noop_effect", args=[step_id, 9])


@celery_app.task(
    bind=True,
    base=LateDeclaring,
    name="tests.effects.late",
    lock_key="step:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
)
def late(self, step_id):
    """Its before_commit hook declares an effect after they were written."""


@pytest.fixture
def effects_app(app, redis_client):
    app.conf.steplock_retry_backoff = 0.01
    return app


def ref(step) -> str:
    return f"workflows.step:{step.pk}"


def keys() -> list[str]:
    return sorted(Effect.objects.values_list("key", flat=True), key=lambda k: k[-1])


def seen(redis_client) -> list[str]:
    return [
        k if isinstance(k, str) else k.decode()
        for k in redis_client.lrange("tests:effects-seen", 0, -1)
    ]


def test_an_applied_transition_writes_one_row_per_effect_keyed_by_step_fence_to_position(
    effects_app, redis_client
):
    step = Step.objects.create(name="s")
    result = declare_effects.apply(args=(step.pk,), kwargs={"count": 3}, task_id="t-applied")
    assert result.successful(), result.traceback
    fence = result.result["fence"]
    step.refresh_from_db()
    assert step.status == "done" and step.lock_fence == fence

    rows = list(Effect.objects.order_by("position"))
    assert [r.key for r in rows] == [f"{ref(step)}:{fence}:done:{n}" for n in range(3)]
    assert [(r.kind, r.target, r.position) for r in rows] == [
        ("task", "workflows.tasks.noop_effect", 0),
        ("call", "workflows.effect_seen", 1),
        ("task", "workflows.tasks.noop_effect", 2),
    ]
    assert {(r.step, r.fence, r.task_id, r.task_name) for r in rows} == {
        (ref(step), fence, "t-applied", declare_effects.name)
    }
    assert rows[0].payload == {"args": [step.pk, 0], "kwargs": {}, "options": {}}
    assert rows[1].payload == {"args": [step.pk], "kwargs": {"position": 1}}
    # Dispatched on commit: the registered callable got the row's key.
    assert seen(redis_client) == [f"{ref(step)}:{fence}:done:1"]


def test_a_refused_compare_and_swap_leaves_no_row(effects_app, redis_client):
    step = Step.objects.create(name="s", status="cancelled")
    result = blind.apply(args=(step.pk,))
    # The default on_conflict ("return"): the duplicate outcome, nothing committed.
    assert result.successful(), result.traceback
    assert result.result["steplock"] == "duplicate" and result.result["found"] == "cancelled"
    assert Effect.objects.count() == 0
    assert seen(redis_client) == []
    step.refresh_from_db()
    assert step.status == "cancelled"


def test_a_lease_lost_at_the_ownership_check_leaves_no_row(effects_app, redis_client):
    step = Step.objects.create(name="s")
    result = declare_effects.apply(args=(step.pk,), kwargs={"lose_lease": True})
    assert result.failed() and isinstance(result.result, LockLost)
    assert Effect.objects.count() == 0
    assert seen(redis_client) == []
    step.refresh_from_db()
    assert step.status == "pending"


def test_a_body_that_raises_leaves_no_row(effects_app, redis_client):
    step = Step.objects.create(name="s")
    result = declare_effects.apply(args=(step.pk,), kwargs={"fail": True})
    assert result.failed() and isinstance(result.result, RuntimeError)
    assert Effect.objects.count() == 0
    step.refresh_from_db()
    assert step.status == "pending"


def test_the_key_names_the_last_transition_of_a_multi_phase_body(effects_app):
    step = Step.objects.create(name="s")
    result = phases.apply(args=(step.pk,))
    assert result.successful(), result.traceback
    assert keys() == [f"{ref(step)}:{result.result}:done:0"]


def test_effects_without_an_applied_transition_roll_the_transaction_back(effects_app):
    step = Step.objects.create(name="s")
    result = no_transition.apply(args=(step.pk,))
    assert result.failed() and isinstance(result.result, EffectsUnavailable)
    assert "no transition applied" in str(result.result)
    assert Effect.objects.count() == 0


def test_a_body_without_a_step_model_cannot_declare(effects_app):
    result = no_steps.apply(args=(1,))
    assert result.failed() and isinstance(result.result, EffectsUnavailable)
    assert "the task tests.effects.no_steps has no step_model (set step_model=" in str(
        result.result
    )
    assert Effect.objects.count() == 0


def test_nested_in_a_callers_transaction_the_rows_commit_or_roll_back_with_it(
    effects_app, redis_client
):
    kept, dropped = Step.objects.create(name="kept"), Step.objects.create(name="dropped")
    with transaction.atomic():
        result = declare_effects.apply(args=(kept.pk,), kwargs={"count": 2})
        assert result.successful(), result.traceback
        assert seen(redis_client) == []  # not before the caller's COMMIT
    fence = result.result["fence"]
    assert keys() == [f"{ref(kept)}:{fence}:done:{n}" for n in range(2)]
    assert seen(redis_client) == [f"{ref(kept)}:{fence}:done:1"]

    with pytest.raises(ZeroDivisionError):
        with transaction.atomic():
            assert declare_effects.apply(args=(dropped.pk,)).successful()
            1 / 0
    assert Effect.objects.filter(step=ref(dropped)).count() == 0
    dropped.refresh_from_db()
    assert dropped.status == "pending"


def test_a_guarded_step_block_writes_its_effects_after_its_transitions(effects_app, redis_client):
    step = Step.objects.create(name="s")
    with guarded_step(Step, step.pk, lock_name=f"step:{step.pk}", actor="admin:alice") as guarded:
        guarded.transition("pending", "running")
        effects.call("workflows.effect_seen", "from-admin")
        guarded.transition("running", "done")
        effects.publish("workflows.tasks.noop_effect", args=[step.pk, 1])
        fence = guarded.lease.fence
    rows = list(Effect.objects.order_by("position"))
    assert [r.key for r in rows] == [f"{ref(step)}:{fence}:done:{n}" for n in range(2)]
    assert {(r.task_id, r.task_name) for r in rows} == {("", "admin:alice")}
    assert seen(redis_client) == [f"{ref(step)}:{fence}:done:0"]
    assert effects.current_outbox() is None


def test_a_guarded_step_block_that_raises_or_conflicts_leaves_no_row(effects_app):
    step = Step.objects.create(name="s")
    with pytest.raises(RuntimeError):
        with guarded_step(Step, step.pk, lock_name=f"step:{step.pk}") as guarded:
            guarded.transition("pending", "done")
            effects.publish("workflows.tasks.noop_effect", args=[step.pk, 0])
            raise RuntimeError("after the transition")
    with pytest.raises(TransitionConflict):
        with guarded_step(Step, step.pk, lock_name=f"step:{step.pk}") as guarded:
            effects.publish("workflows.tasks.noop_effect", args=[step.pk, 0])
            guarded.transition("running", "done")
    with pytest.raises(EffectsUnavailable, match="no transition applied"):
        with guarded_step(Step, step.pk, lock_name=f"step:{step.pk}"):
            effects.publish("workflows.tasks.noop_effect", args=[step.pk, 0])
    assert Effect.objects.count() == 0
    step.refresh_from_db()
    assert step.status == "pending"
    assert effects.current_outbox() is None


def test_an_async_guarded_step_block_writes_its_effects(effects_app, redis_client):
    step = Step.objects.create(name="s")

    async def block():
        async with aguarded_step(
            Step, step.pk, lock_name=f"step:{step.pk}", actor="api"
        ) as guarded:
            await guarded.atransition("pending", "done")
            effects.call("workflows.effect_seen", "async")
            return guarded.lease.fence

    fence = asyncio.run(block())
    assert keys() == [f"{ref(step)}:{fence}:done:0"]
    assert seen(redis_client) == [f"{ref(step)}:{fence}:done:0"]


def test_a_fail_open_execution_keys_its_effects_by_the_task_id(effects_app):
    effects_app.conf.steplock_redis_url = closed_port_url()
    effects_app.conf.steplock_socket_timeout = 0.3
    step = Step.objects.create(name="s")
    result = fail_open.apply(args=(step.pk,), task_id="open-1")
    assert result.successful() and result.result is None, result.traceback  # no lease
    (row,) = Effect.objects.all()
    assert (row.key, row.fence, row.owner != "") == (f"{ref(step)}:topen-1:done:0", None, True)


def test_an_effect_declared_once_they_were_written_is_refused(effects_app):
    step = Step.objects.create(name="s")
    result = late.apply(args=(step.pk,))
    assert result.failed() and isinstance(result.result, EffectsUnavailable)
    assert "already written" in str(result.result)
    assert Effect.objects.count() == 0
    step.refresh_from_db()
    assert step.status == "pending"


LEASE_AT_SEND: list = []


@effects.register("tests.effects.lease_at_send")
def lease_at_send(task_name, name, *, idempotency_key):
    """Records whether the declaring execution's lease was still held when it was sent."""
    store = celery_app.tasks[task_name].steplock_plan.store if task_name else None
    LEASE_AT_SEND.append((idempotency_key, store.inspect(name) if store else "no store"))


@celery_app.task(
    name="tests.effects.after_release", transition=("pending", "done"), **STEP_OPTIONS
)
def after_release(self, step_id):
    effects.call("tests.effects.lease_at_send", self.name, self.lease.name)
    return self.lease.fence


def test_a_task_sends_its_effects_after_it_released_its_lease(effects_app):
    """A slow receiver never keeps the step's other deliveries waiting on a finished lease:
    the effect is sent once the lease is gone from Redis."""
    LEASE_AT_SEND.clear()
    step = Step.objects.create(name="s")
    result = after_release.apply(args=(step.pk,))
    assert result.successful(), result.traceback
    assert LEASE_AT_SEND == [(f"{ref(step)}:{result.result}:done:0", None)]
    assert Effect.objects.get().status == "dispatched"


def test_a_guarded_step_sends_its_effects_after_its_release(effects_app):
    LEASE_AT_SEND.clear()
    step = Step.objects.create(name="s")
    name = f"step:{step.pk}"
    with guarded_step(Step, step.pk, lock_name=name, task=after_release) as guarded:
        guarded.transition("pending", "done")
        effects.call("tests.effects.lease_at_send", after_release.name, name)
        fence = guarded.lease.fence
        assert after_release.steplock_plan.store.inspect(name) is not None
    assert LEASE_AT_SEND == [(f"{ref(step)}:{fence}:done:0", None)]
    assert Effect.objects.get().status == "dispatched"


@celery_app.task(
    name="tests.effects.raising_on_commit", transition=("pending", "done"), **STEP_OPTIONS
)
def raising_on_commit(self, step_id):
    """Its body registers an on-commit callback that raises, before the effects' send."""
    effects.call("workflows.effect_seen", step_id)
    transaction.on_commit(lambda: (_ for _ in ()).throw(RuntimeError("the body's on-commit")))
    return self.lease.fence


def test_a_bodys_raising_on_commit_callback_does_not_skip_the_send(effects_app, redis_client):
    step = Step.objects.create(name="s")
    result = raising_on_commit.apply(args=(step.pk,))
    step.refresh_from_db()
    assert step.status == "done"
    row = Effect.objects.get()
    assert (row.status, row.attempts) == ("dispatched", 1), repr(result.result)
    assert seen(redis_client) == [row.key]


MANY_RUNS: list = []


@celery_app.task(name="tests.effects.many", transition=("pending", "done"), **STEP_OPTIONS)
def many(self, step_id, n):
    MANY_RUNS.append(step_id)
    for position in range(n):
        effects.publish("workflows.tasks.noop_effect", args=[step_id, position])
    return self.lease.fence


def test_more_effects_than_one_statement_takes_are_written_in_batches(effects_app):
    """SQLite before 3.32 takes 999 variables a statement (18 a row: 55 rows); the rows go
    in as many INSERTs as that takes, and the body runs once."""
    import sqlite3

    from django.db import connection
    from django.db.backends.signals import connection_created

    if connection.vendor == "sqlite":

        def pin(sender, connection, **kwargs):
            connection.connection.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)

        connection_created.connect(pin, weak=False, dispatch_uid="pin-999")
        connection.close()
    try:
        MANY_RUNS.clear()
        step = Step.objects.create(name="s")
        result = many.apply(args=(step.pk, 120))
        assert result.successful(), repr(result.result)
    finally:
        connection_created.disconnect(dispatch_uid="pin-999")
        connection.close()
    assert MANY_RUNS == [step.pk]
    fence = result.result
    assert sorted(Effect.objects.values_list("position", flat=True)) == list(range(120))
    assert Effect.objects.filter(key=f"{ref(step)}:{fence}:done:119").exists()
