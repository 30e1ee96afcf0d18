"""DjangoStepStore: the compare-and-swap UPDATE (celery_steplock.contrib.django.steps)."""

import contextlib
import threading
import time

import pytest
from django.db import transaction

from celery_steplock.exceptions import (
    ImproperlyConfigured,
    InvalidTransition,
    StepNotFound,
    TransitionConflict,
)
from celery_steplock.contrib.django.steps import DjangoStepStore, resolve_model
from celery_steplock.steps import StepStore, TransitionResult
from django_app.workflows.models import Step, TransitionRecord

pytestmark = pytest.mark.django_db(transaction=True)


@contextlib.contextmanager
def row_held_elsewhere(step):
    """Another transaction (a thread's) holds ``step``'s row lock inside the block; yields a
    function telling whether it still does."""
    from django.db import connections

    locked, done = threading.Event(), threading.Event()

    def holder():
        with transaction.atomic():
            Step.objects.filter(pk=step.pk).update(name="held")
            locked.set()
            done.wait(30)
        connections.close_all()

    thread = threading.Thread(target=holder)
    thread.start()
    assert locked.wait(10)
    try:
        yield lambda: not done.is_set()
    finally:
        done.set()
        thread.join()


@pytest.fixture
def guard():
    return DjangoStepStore("workflows.Step")


def test_applied_transition_updates_one_row(guard):
    step = Step.objects.create(name="s")
    result = guard.transition(step.pk, "pending", "done", owner="o1", fence=10)
    assert result == TransitionResult(True, step.pk, "pending", "done", fence=10)
    assert bool(result) is True
    step.refresh_from_db()
    assert (step.status, step.lock_owner, step.lock_fence) == ("done", "o1", 10)


def test_conflict_when_status_moved_on(guard):
    step = Step.objects.create(name="s", status="cancelled")
    with pytest.raises(TransitionConflict) as info:
        guard.transition(step.pk, "pending", "done")
    assert (info.value.current, info.value.from_, info.value.to) == (
        "cancelled",
        "pending",
        "done",
    )
    assert "'cancelled'" in str(info.value)
    step.refresh_from_db()
    assert step.status == "cancelled"


def test_conflict_without_raising(guard):
    step = Step.objects.create(name="s", status="done")
    result = guard.transition(step.pk, "pending", "done", raise_on_conflict=False)
    assert not result and result.current == "done"


def test_missing_row_is_not_a_conflict(guard):
    with pytest.raises(StepNotFound):
        guard.transition(987654, "pending", "done")


def test_stale_fence_cannot_write_after_a_newer_one(guard):
    step = Step.objects.create(name="s")
    guard.transition(step.pk, "pending", "running", owner="new", fence=200)
    with pytest.raises(TransitionConflict, match="newer fencing token"):
        guard.transition(step.pk, "running", "done", owner="stale", fence=100)
    step.refresh_from_db()
    assert (step.status, step.lock_owner, step.lock_fence) == ("running", "new", 200)
    assert guard.transition(step.pk, "running", "done", owner="new", fence=200).applied


def test_extra_updates_go_in_the_same_statement(guard):
    step = Step.objects.create(name="s")
    guard.transition(step.pk, "pending", "done", updates={"attempts": 5})
    step.refresh_from_db()
    assert (step.status, step.attempts) == ("done", 5)


def test_rollback_undoes_the_transition_and_the_body(guard):
    step = Step.objects.create(name="s")
    with pytest.raises(RuntimeError):
        with transaction.atomic():
            TransitionRecord.objects.create(step=step, from_status="pending", to_status="done")
            guard.transition(step.pk, "pending", "done")
            raise RuntimeError("after the CAS")
    step.refresh_from_db()
    assert step.status == "pending" and TransitionRecord.objects.count() == 0


def test_allowed_transition_table():
    table = DjangoStepStore(
        Step, transitions={"pending": ["running", "cancelled"], "running": ["done"]}
    )
    step = Step.objects.create(name="s")
    with pytest.raises(InvalidTransition, match="'pending' -> 'done'"):
        table.transition(step.pk, "pending", "done")
    assert table.transition(step.pk, "pending", "running").applied
    step.refresh_from_db()
    assert step.status == "running"


def test_models_without_guard_columns_still_cas():
    guard = DjangoStepStore(TransitionRecord, status_field="to_status")
    assert guard.fence_field is None and guard.owner_field is None
    step = Step.objects.create(name="s")
    record = TransitionRecord.objects.create(step=step, from_status="a", to_status="b")
    assert guard.transition(record.pk, "b", "c", fence=5).applied


def test_unknown_model_and_field_name_the_setting():
    with pytest.raises(ImproperlyConfigured) as info:
        resolve_model("workflows.Nope")
    assert info.value.setting == "step_model" and "workflows.Nope" in str(info.value)
    with pytest.raises(ImproperlyConfigured) as info:
        DjangoStepStore(Step, status_field="state")
    assert info.value.setting == "steplock_status_field"
    with pytest.raises(ImproperlyConfigured):
        resolve_model(42)


def test_status_read(guard):
    step = Step.objects.create(name="s", status="running")
    assert guard.status(step.pk) == "running"
    with pytest.raises(StepNotFound):
        guard.status(-1)


def test_the_cas_sets_auto_now_columns_as_save_would(guard):
    step = Step.objects.create(name="s")
    Step.objects.filter(pk=step.pk).update(updated_at=step.updated_at.replace(year=2000))
    guard.transition(step.pk, "pending", "done")
    step.refresh_from_db()
    assert step.updated_at.year > 2000


def test_set_deadline_ends_an_idle_transaction_on_postgresql(guard):
    """PostgreSQL ends a transaction left idle past the deadline (its COMMIT then fails);
    other databases are left alone (returns False)."""

    from django.db import DatabaseError, connection

    step = Step.objects.create(name="s")
    if connection.vendor != "postgresql":
        with transaction.atomic():
            assert guard.set_deadline(0.2) is False
            guard.transition(step.pk, "pending", "done")
        step.refresh_from_db()
        assert step.status == "done"
        return
    with pytest.raises(DatabaseError) as info:  # Django: InternalError
        with transaction.atomic():
            assert guard.set_deadline(0.2) is True
            guard.transition(step.pk, "pending", "done")
            time.sleep(0.6)  # a stopped holder, idle inside its transaction
    assert info.value.__cause__.sqlstate == "25P03"  # idle_in_transaction_session_timeout
    connection.close()
    step.refresh_from_db()
    assert step.status == "pending"  # the stale COMMIT never happened


def test_set_deadline_bounds_the_wait_for_a_locked_row(guard):

    from django.db import OperationalError, connection

    step = Step.objects.create(name="s")
    if connection.vendor != "postgresql":
        return  # SQLite: one writer at a time, no row locks to bound (set_deadline is a no-op)
    with row_held_elsewhere(step) as still_held:
        started = time.monotonic()
        with pytest.raises(OperationalError) as info:
            with transaction.atomic():
                guard.set_deadline(0.3)
                guard.transition(step.pk, "pending", "done")
        assert getattr(info.value.__cause__, "sqlstate", None) == "55P03"
        assert time.monotonic() - started >= 0.3 and still_held()


def test_the_store_is_a_step_store(guard):
    assert isinstance(guard, StepStore)
    assert guard.label == "workflows.step" and guard.using == "default"


def test_the_deprecated_guard_name_still_works_and_warns():
    from celery_steplock.guard import StepTransitionGuard

    with pytest.warns(DeprecationWarning, match="DjangoStepStore"):
        old = StepTransitionGuard("workflows.Step")
    step = Step.objects.create(name="s")
    assert old.transition(step.pk, "pending", "done", owner="o", fence=3).applied
    step.refresh_from_db()
    assert (step.status, step.lock_owner, step.lock_fence) == ("done", "o", 3)


def _statements(captured) -> list[str]:
    """The statements of a capture, transaction control (BEGIN, SAVEPOINT...) left out."""
    return [
        q["sql"]
        for q in captured.captured_queries
        if not q["sql"].upper().startswith(("BEGIN", "SAVEPOINT", "RELEASE", "COMMIT"))
    ]


def test_one_statement_per_cas_built_once(guard):
    """The CAS is one UPDATE (its SQL built once per database and shape), the precheck one
    SELECT; with a deadline on PostgreSQL still one UPDATE (set_config rides in it)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    step = Step.objects.create(name="s")
    with CaptureQueriesContext(connection) as captured:
        assert guard.status(step.pk) == "pending"
    [sql] = _statements(captured)
    assert sql.startswith("SELECT")
    with CaptureQueriesContext(connection) as captured:
        with transaction.atomic():
            guard.transition(step.pk, "pending", "running", owner="o", fence=7, deadline=5.0)
    [sql] = _statements(captured)
    assert sql.startswith("UPDATE")
    assert ("set_config" in sql) is (connection.vendor == "postgresql")
    shapes = len(guard._sql)
    guard.transition(step.pk, "running", "done", owner="o", fence=7, deadline=5.0)
    assert len(guard._sql) == shapes  # no new statement built for the same shape


def test_deadline_in_the_cas_bounds_the_wait_for_a_locked_row(guard):
    """``transition(deadline=)`` bounds the wait for a row another transaction holds, with no
    statement of its own (PostgreSQL; elsewhere the deadline is ignored)."""

    from django.db import OperationalError, connection

    step = Step.objects.create(name="s")
    if connection.vendor != "postgresql":
        with transaction.atomic():
            assert guard.transition(step.pk, "pending", "done", deadline=0.3).applied
        return
    with row_held_elsewhere(step) as still_held:
        started = time.monotonic()
        with pytest.raises(OperationalError) as info:
            with transaction.atomic():
                guard.transition(step.pk, "pending", "done", deadline=0.3)
        assert guard.is_lock_timeout(info.value)
        assert time.monotonic() - started >= 0.3 and still_held()
    step.refresh_from_db()
    assert step.status == "pending" and step.name == "held"


def test_deadline_in_the_cas_ends_an_idle_transaction(guard):
    """After a CAS with a deadline, a transaction left idle past it cannot COMMIT
    (PostgreSQL ends the session, SQLSTATE 25P03)."""

    from django.db import DatabaseError, connection

    step = Step.objects.create(name="s")
    if connection.vendor != "postgresql":
        return
    with pytest.raises(DatabaseError) as info:
        with transaction.atomic():
            guard.transition(step.pk, "pending", "done", deadline=0.2)
            time.sleep(0.6)  # a stopped holder, idle inside its transaction
    assert guard.is_lost_connection(info.value)
    connection.close()
    step.refresh_from_db()
    assert step.status == "pending"


def test_every_call_goes_to_the_write_database(guard):
    """A router that sends reads to another alias moves neither the precheck nor the CAS."""
    from django.test import override_settings

    class ReadsElsewhere:
        def db_for_read(self, model, **hints):
            return "replica"

        def db_for_write(self, model, **hints):
            return "default"

    step = Step.objects.create(name="s")
    with override_settings(DATABASE_ROUTERS=[ReadsElsewhere()]):
        from django.db import router

        router.routers  # noqa: B018 - the property caches; override_settings resets it
        assert guard.using == "default"
        assert guard.status(step.pk) == "pending"
        assert guard.transition(step.pk, "pending", "done").applied


def test_multi_table_inheritance_writes_the_parent_table():
    """``status`` and the guard columns live in the parent's table: the statements go there
    (the child's key is the parent's), as the ORM's update would."""
    from django_app.workflows.models import ChildStep

    child = ChildStep.objects.create(name="c")
    store = DjangoStepStore(ChildStep)
    assert store.status(child.pk) == "pending"
    assert store.transition(child.pk, "pending", "done", owner="o", fence=9).applied
    child.refresh_from_db()
    assert (child.status, child.lock_owner, child.lock_fence) == ("done", "o", 9)
    with pytest.raises(TransitionConflict):
        store.transition(child.pk, "pending", "done", owner="o", fence=9)
    assert store.step_ref(str(child.pk)) == f"workflows.childstep:{child.pk}"


def test_rows_a_default_manager_hides_are_seen_alike_by_every_path():
    """A soft-delete default manager: the precheck, the statement CAS and the ORM CAS (with
    ``updates``) all see the row (the base manager's view), so they never disagree, and a
    conflict without a fence is never reported as a newer fencing token."""
    from django_app.workflows.models import ArchivableStep

    store = DjangoStepStore(ArchivableStep, fence_field="no_such_field")
    first = ArchivableStep.all_objects.create(archived=True)
    assert store.status(first.pk) == "pending"
    assert store.transition(first.pk, "pending", "running").applied
    second = ArchivableStep.all_objects.create(archived=True)
    assert store.transition(second.pk, "pending", "running", updates={"archived": False}).applied
    assert ArchivableStep.all_objects.get(pk=second.pk).status == "running"
    with pytest.raises(TransitionConflict) as info:
        store.transition(second.pk, "pending", "done", updates={"archived": True})
    assert info.value.stale_fence is False and info.value.current == "running"


def test_step_ref_is_canonical_and_refuses_impossible_keys(guard):

    from celery_steplock.exceptions import InvalidStepId, StepLockError

    step = Step.objects.create(name="s")
    assert guard.step_ref(step.pk) == guard.step_ref(str(step.pk)) == f"workflows.step:{step.pk}"
    for bad in ("abc", [1]):
        with pytest.raises(InvalidStepId) as info:
            guard.step_ref(bad)
        assert isinstance(info.value, StepLockError) and "workflows.Step" in str(info.value)
    with pytest.raises(InvalidStepId):
        guard.status("abc")
    with pytest.raises(InvalidStepId):
        guard.transition("abc", "pending", "done")


def test_a_fence_refusal_is_marked_stale_fence(guard):
    step = Step.objects.create(name="s")
    guard.transition(step.pk, "pending", "running", owner="new", fence=200)
    with pytest.raises(TransitionConflict) as info:
        guard.transition(step.pk, "running", "done", owner="old", fence=100)
    assert info.value.stale_fence is True
    with pytest.raises(TransitionConflict) as info:
        guard.transition(step.pk, "pending", "done", owner="new", fence=200)
    assert info.value.stale_fence is False and info.value.current == "running"


@pytest.mark.parametrize("table", [["pending"], {"pending": "done"}, {"pending": [1]}])
def test_a_malformed_transition_table_names_the_option(table):
    with pytest.raises(ImproperlyConfigured) as info:
        DjangoStepStore(Step, transitions=table)
    assert info.value.setting == "step_transitions"
