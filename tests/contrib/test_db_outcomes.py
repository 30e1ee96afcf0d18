"""What a step task ends in when its database refuses or aborts the step's transaction:
a compare-and-swap refused under REPEATABLE READ, a deadlock, a serialization failure.

Real servers, real threads on their own connections; the interleavings are forced with
barriers, events and the server's own lock tables, never with sleeps. The rival of a test is
a second task on the same step under another lock name (the lease does not keep them apart:
the step's row and its compare-and-swap do), or a plain transaction of a thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import pytest
from django.db import InterfaceError, OperationalError, connection, connections, transaction
from django.db.models import F

from celery_steplock.contrib.django.steps import DjangoStepStore as StepStore
from celery_steplock.task import StepLockedTask
from django_app.celery import app as celery_app
from django_app.workflows.models import Step, TransitionRecord

pytestmark = pytest.mark.django_db(transaction=True)

RUNS: list[str] = []
# What the running test asks the bodies to do in the middle of their transaction.
HOOKS: dict[str, object] = {}

STEP = dict(
    bind=True,
    base=StepLockedTask,
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
)


def _record(task, step_id):
    TransitionRecord.objects.create(
        step_id=step_id,
        from_status="pending",
        to_status="done",
        task_name=task.name,
        task_id=task.request.id or "",
        owner=task.lease.owner,
        fence=task.lease.fence,
    )


def _body(task, step_id, name):
    RUNS.append(name)
    hook = HOOKS.get(name)
    if hook is not None:
        hook(task, step_id)
    return {"winner": task.request.id}


@celery_app.task(name="tests.dboutcomes.left", lock_key="dbo-left:{step_id}", **STEP)
def left(self, step_id):
    return _body(self, step_id, "left")


@celery_app.task(name="tests.dboutcomes.right", lock_key="dbo-right:{step_id}", **STEP)
def right(self, step_id):
    return _body(self, step_id, "right")


@pytest.fixture(autouse=True)
def clean(app, redis_client):
    RUNS.clear()
    HOOKS.clear()
    yield
    HOOKS.clear()
    for task in (left, right):
        for option in ("lock_retry_max", "on_contended"):
            task.__dict__.pop(option, None)


@pytest.fixture
def steplock_log(caplog):
    """The ``event=...`` lines of the ``celery_steplock`` logger, as ``(level, message)``
    (DEBUG included: ``retry_scheduled`` is a DEBUG line)."""
    caplog.set_level(logging.DEBUG, logger="celery_steplock")

    def lines(event=None):
        return [
            (r.levelname, r.getMessage())
            for r in caplog.records
            if r.name == "celery_steplock"
            and (event is None or r.getMessage().startswith(f"event={event} "))
        ]

    return lines


LEVELS = ["read committed", "repeatable read"]


@contextlib.contextmanager
def isolation(level: str, init_command: str | None = None):
    """Every connection to ``default`` opened inside the block runs at ``level`` (and runs
    ``init_command`` first, MySQL)."""
    options = connections.settings["default"].setdefault("OPTIONS", {})
    saved = {k: options[k] for k in ("isolation_level", "init_command") if k in options}
    if init_command:
        options["init_command"] = init_command
    if connection.vendor == "postgresql":
        from psycopg import IsolationLevel

        options["isolation_level"] = IsolationLevel[level.upper().replace(" ", "_")]
    else:
        options["isolation_level"] = level
    connection.close()
    try:
        yield
    finally:
        for key in ("isolation_level", "init_command"):
            options.pop(key, None)
        options.update(saved)
        connection.close()


def _isolation_now() -> str:
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SHOW transaction_isolation")
        elif connection.mysql_is_mariadb and connection.mysql_version < (11, 1):
            cursor.execute("SELECT @@SESSION.tx_isolation")
        else:  # MySQL 8 removed tx_isolation, MariaDB 11.1 added transaction_isolation
            cursor.execute("SELECT @@SESSION.transaction_isolation")
        return cursor.fetchone()[0].lower().replace("-", " ")


def in_thread(func, *args):
    """Run ``func(*args)`` in a thread of its own (its own database connection); returns a
    function that joins it and gives its result (or raises its exception)."""
    box: dict[str, object] = {}

    def run():
        try:
            box["result"] = func(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the joiner
            box["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()

    def join():
        thread.join(60)
        assert not thread.is_alive()
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box.get("result")

    return join


def duplicate(task, step, found="done", committed_by=None):
    return {
        "steplock": "duplicate",
        "task": task.name,
        "step_id": step.pk,
        "expected": "pending",
        "found": found,
        "committed_by": committed_by,
        "held_by": None,
    }


def _signals(events, *names):
    return [(name, kw) for name, kw in events if name in names]


# -- a compare-and-swap refused by a rival's commit ----------------------------------------------


def _rival_commits_during_the_body(step, level, events, steplock_log, init_command=None):
    """``left``'s body reads the step (a REPEATABLE READ transaction takes its snapshot
    there), then ``right`` (another lock name) moves it pending -> done and commits, then
    ``left`` writes its record and reaches its compare-and-swap, which the step's status
    refuses. Returns ``left``'s result."""

    def read_then_let_the_rival_commit(task, step_id):
        assert Step.objects.get(pk=step_id).status == "pending"  # the snapshot's
        assert _isolation_now() == level
        assert in_thread(lambda: right.apply(args=(step_id,), task_id="rival").state)() == (
            "SUCCESS"
        )
        _record(task, step_id)

    HOOKS["left"] = read_then_let_the_rival_commit
    HOOKS["right"] = _record
    with isolation(level, init_command):
        result = left.apply(args=(step.pk,), task_id="late")
    step.refresh_from_db()
    assert step.status == "done" and TransitionRecord.objects.get().task_id == "rival"
    assert result.state == "SUCCESS", result.result
    assert result.result == duplicate(left, step, committed_by="rival")  # the row's owner token
    # No lease was lost and no retry ran: left's body ran once, the refusal is a conflict
    # that names the status the rival committed.
    assert RUNS == ["left", "right"]
    assert _signals(events, "lock_lost", "fence_ahead") == []
    conflicts = [kw for name, kw in events if name == "transition_conflict"]
    assert [(kw["task_name"], kw["current"]) for kw in conflicts] == [(left.name, "done")]
    assert not [line for line in steplock_log() if line[0] in ("ERROR", "CRITICAL")]
    assert steplock_log("retry_scheduled") == []
    return result


@pytest.mark.mysql
@pytest.mark.parametrize("level", LEVELS)
def test_mysql_a_refused_cas_is_a_conflict_at_every_isolation_level(level, events, steplock_log):
    """InnoDB's UPDATE reads the latest row, a plain SELECT of a REPEATABLE READ transaction
    its snapshot: the read after the refusal must not see the snapshot's ``pending`` and
    call it a newer fencing token (``lock_lost``, a wasted retry)."""
    step = Step.objects.create(name="s")
    _rival_commits_during_the_body(step, level, events, steplock_log)
    assert steplock_log("step_transaction_conflict") == []  # a plain refusal at both levels


@pytest.mark.mysql
def test_mariadb_snapshot_isolation_s_refusal_ends_in_the_duplicate_outcome(events, steplock_log):
    """MariaDB with ``innodb_snapshot_isolation`` (REPEATABLE READ): the compare-and-swap of
    a row changed after the snapshot fails with 1020 ("Record has changed since last
    read"), MariaDB's serialization failure: rolled back, read again, the duplicate
    outcome."""
    if "mariadb" not in connection.mysql_server_info.lower():
        pytest.skip("innodb_snapshot_isolation is MariaDB's")
    step = Step.objects.create(name="s")
    _rival_commits_during_the_body(
        step,
        "repeatable read",
        events,
        steplock_log,
        init_command="SET SESSION innodb_snapshot_isolation = ON",
    )
    [(levelname, line)] = steplock_log("step_transaction_conflict")
    assert levelname == "WARNING"
    assert "code=1020" in line and "current=done" in line and "decision=duplicate" in line


@pytest.mark.postgresql
@pytest.mark.parametrize("level", LEVELS)
def test_postgresql_a_refused_cas_is_a_conflict_at_every_isolation_level(
    level, events, steplock_log
):
    """On PostgreSQL at REPEATABLE READ the rival's commit after the snapshot makes the
    compare-and-swap fail with a serialization failure (40001): rolled back, the step is
    read again, and the task ends in the duplicate outcome, as at READ COMMITTED."""
    step = Step.objects.create(name="s")
    _rival_commits_during_the_body(step, level, events, steplock_log)
    lines = steplock_log("step_transaction_conflict")
    if level == "repeatable read":
        [(levelname, line)] = lines
        assert levelname == "WARNING"
        assert "code=40001" in line and "current=done" in line and "decision=duplicate" in line
    else:
        assert lines == []


# -- a deadlock between two lock names on one step ------------------------------------------------


def _insert_child_then_update_the_step(barrier):
    def body(task, step_id):
        _record(task, step_id)  # InnoDB: a shared lock on the step's row (the foreign key)
        barrier.wait(10)
        Step.objects.filter(pk=step_id).update(attempts=F("attempts") + 1)  # exclusive

    return body


@pytest.mark.row_locks
@pytest.mark.parametrize("level", LEVELS)
def test_a_deadlock_between_two_lock_names_ends_in_the_duplicate_outcome(
    level, events, steplock_log
):
    """Two tasks on one step under two lock names both insert a child row, then update the
    step's row. InnoDB: each holds a shared lock the other's update waits for, a deadlock
    (1213) that rolls one back; PostgreSQL: the second update waits for the first commit
    (READ COMMITTED) or fails to serialize (REPEATABLE READ, 40001). The loser ends in the
    duplicate outcome, never FAILURE."""
    step = Step.objects.create(name="s")
    barrier = threading.Barrier(2)
    HOOKS["left"] = HOOKS["right"] = _insert_child_then_update_the_step(barrier)
    with isolation(level):
        joins = [
            in_thread(lambda t=task: t.apply(args=(step.pk,), task_id=t.name.split(".")[-1]))
            for task in (left, right)
        ]
        results = [join() for join in joins]
    step.refresh_from_db()
    [record] = TransitionRecord.objects.all()
    assert step.status == "done" and step.attempts == 1
    winner = left if record.task_name == left.name else right
    loser = right if winner is left else left
    by_task = dict(zip((left, right), results))
    assert [r.state for r in results] == ["SUCCESS", "SUCCESS"], [r.result for r in results]
    assert by_task[winner].result == {"winner": winner.name.split(".")[-1]}
    assert by_task[loser].result == duplicate(loser, step, committed_by=winner.name.split(".")[-1])
    assert _signals(events, "lock_lost", "fence_ahead") == []
    conflicts = [
        (kw["task_name"], kw["current"]) for n, kw in events if n == "transition_conflict"
    ]
    assert conflicts == [(loser.name, "done")]
    assert not [line for line in steplock_log() if line[0] in ("ERROR", "CRITICAL")]
    assert steplock_log("commit_failed") == []
    lines = steplock_log("step_transaction_conflict")
    if connection.vendor == "mysql":
        [(levelname, line)] = lines
        assert levelname == "WARNING" and "code=1213" in line and "decision=duplicate" in line
    elif level == "repeatable read":
        [(levelname, line)] = lines
        assert levelname == "WARNING" and "code=40001" in line and "decision=duplicate" in line
    else:
        assert lines == []  # the plain refusal of the compare-and-swap


# -- PostgreSQL: a deadlock detected in the body ----------------------------------------------


def _until(condition, what, timeout=10.0):
    """Poll the server's own state until ``condition()`` holds (a forced interleaving's
    step), failing the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


def _waiting_for_a_lock() -> bool:
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_locks WHERE NOT granted")
        return cursor.fetchone()[0] > 0


def _deadlock_in_the_body(step, rival_status):
    """Set ``left``'s body up to be PostgreSQL's deadlock victim (40P01): it updates the
    step's row; a rival transaction updates another row, then waits for the step's row;
    the body then updates that other row. The body's ``deadlock_timeout`` is the short
    one, so its backend detects the cycle and is the one rolled back; the rival then
    writes ``rival_status`` on the step and commits. Returns the rival's join."""
    other = Step.objects.create(name="other")
    joins = []

    def rival():
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL deadlock_timeout = '10s'")
            Step.objects.filter(pk=other.pk).update(name="rival")
            Step.objects.filter(pk=step.pk).update(status=rival_status, name="rival")

    def body(task, step_id):
        if len(RUNS) > 1:
            return  # the lease retry's run: no rival any more
        Step.objects.filter(pk=step_id).update(attempts=F("attempts") + 1)
        joins.append(in_thread(rival))
        _until(_waiting_for_a_lock, "the rival waits for the step's row")
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL deadlock_timeout = '50ms'")
        Step.objects.filter(pk=other.pk).update(name="body")  # closes the cycle

    HOOKS["left"] = body
    return lambda: [join() for join in joins]


@pytest.mark.postgresql
def test_postgresql_a_deadlock_in_the_body_ends_in_the_duplicate_outcome(events, steplock_log):
    """The body is rolled back by a deadlock (40P01) whose winner moved the step: the step
    is read again once the winner committed, and the task ends in the duplicate outcome."""
    step = Step.objects.create(name="s")
    join = _deadlock_in_the_body(step, "done")
    result = left.apply(args=(step.pk,), task_id="late")
    join()
    assert result.state == "SUCCESS", result.result
    assert result.result == duplicate(left, step)
    step.refresh_from_db()
    assert (step.status, step.name, step.attempts) == ("done", "rival", 0)
    assert RUNS == ["left"]
    assert _signals(events, "lock_lost", "fence_ahead") == []
    conflicts = [
        (kw["task_name"], kw["current"]) for n, kw in events if n == "transition_conflict"
    ]
    assert conflicts == [(left.name, "done")]
    [(levelname, line)] = steplock_log("step_transaction_conflict")
    assert levelname == "WARNING" and "code=40P01" in line and "decision=duplicate" in line
    assert steplock_log("commit_failed") == [] and steplock_log("retry_scheduled") == []


@pytest.mark.postgresql
@pytest.mark.parametrize("retry_max", [None, 0])
def test_postgresql_a_deadlock_whose_winner_left_the_step_is_a_bounded_lease_retry(
    retry_max, events, steplock_log
):
    """The deadlock's winner left the step in ``from_``: the execution is contended, and
    goes through the lease retry (``lock_retry_max``); the retry's body runs in a new
    transaction and commits. With no retries left, the task fails with LockContended,
    nothing committed."""
    from celery_steplock.exceptions import LockContended

    if retry_max is not None:
        left.lock_retry_max = retry_max
    step = Step.objects.create(name="s")
    join = _deadlock_in_the_body(step, "pending")
    result = left.apply(args=(step.pk,), task_id="late")
    join()
    step.refresh_from_db()
    [(levelname, line)] = steplock_log("step_transaction_conflict")
    assert levelname == "WARNING" and "code=40P01" in line and "decision=contended" in line
    assert "current=pending" in line
    assert _signals(events, "lock_lost", "fence_ahead", "transition_conflict") == []
    if retry_max == 0:
        assert result.state == "FAILURE" and isinstance(result.result, LockContended)
        assert RUNS == ["left"]
        assert (step.status, step.name, step.attempts) == ("pending", "rival", 0)
        assert steplock_log("retry_scheduled") == []
        return
    assert result.state == "SUCCESS" and result.result == {"winner": "late"}
    assert RUNS == ["left", "left"]
    assert (step.status, step.name, step.attempts) == ("done", "rival", 0)
    [(_, retried)] = steplock_log("retry_scheduled")
    assert "reason=LockContended" in retried


# -- the classifier -------------------------------------------------------------------------------


@pytest.mark.mysql
def test_mysql_a_lock_wait_timeout_is_a_lock_timeout_not_a_lost_connection():
    """InnoDB's lock wait timeout (1205) is the row lock wait running out, like PostgreSQL's
    55P03: neither a broken connection nor a deadlock. The read after a rollback waits for
    a held row at most its bound, then reads without the lock, and gives the session its
    own bound back."""
    from django.db import OperationalError

    from celery_steplock.contrib.django.steps import DjangoStepStore

    store = DjangoStepStore("workflows.Step")
    step = Step.objects.create(name="s")
    locked, done = threading.Event(), threading.Event()

    def holder():
        with transaction.atomic():
            Step.objects.filter(pk=step.pk).update(name="held")
            locked.set()
            done.wait(30)

    join = in_thread(holder)
    try:
        assert locked.wait(10)
        with connection.cursor() as cursor:
            cursor.execute("SET SESSION innodb_lock_wait_timeout = 1")
        with pytest.raises(OperationalError) as info:
            with transaction.atomic():
                store.transition(step.pk, "pending", "done")
        error = info.value
        assert store.error_code(error) == "1205"
        assert store.is_lock_timeout(error)
        assert not store.is_transient_conflict(error) and not store.is_lost_connection(error)
        with connection.cursor() as cursor:
            cursor.execute("SET SESSION innodb_lock_wait_timeout = 7")
        started = time.monotonic()
        assert store.settled_status(step.pk, 1.0) == "pending"  # the holder has not committed
        assert 1.0 <= time.monotonic() - started < 5.0
        with connection.cursor() as cursor:
            cursor.execute("SELECT @@SESSION.innodb_lock_wait_timeout")
            assert cursor.fetchone()[0] == 7
    finally:
        done.set()
        join()
        connection.close()  # the session's bound back to the server's default
    assert store.settled_status(step.pk, 1.0) == "pending"
    assert Step.objects.get(pk=step.pk).name == "held"


def _waiting_for_a_row_lock() -> int:
    """Statements of the test database waiting for a row lock, as the server sees them."""
    with connections["default"].cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT count(*) FROM pg_locks WHERE NOT granted")
        else:
            cursor.execute(
                "SELECT count(*) FROM information_schema.processlist "
                "WHERE state = 'Updating' AND info LIKE 'UPDATE %%'"
            )
        return cursor.fetchone()[0]


def _the_body_loses_a_deadlock_and_swallows_it(a, b, fillers):
    """A hook for ``left``'s first run: it writes its record and row ``a``; a rival writes
    ``fillers`` (heavier, so InnoDB never picks it) and ``b``; the body asks for ``b`` and
    waits first (so PostgreSQL's detector, which runs in the longest waiter, picks it too);
    the rival asks for ``a``: a deadlock the body loses, catches and ignores."""
    ready = threading.Event()
    rival_done: list = []

    def rival():
        with transaction.atomic():
            Step.objects.filter(pk__in=fillers).update(name="rival")
            Step.objects.filter(pk=b).update(name="rival")
            ready.set()
            deadline = time.monotonic() + 20
            while not _waiting_for_a_row_lock():
                assert time.monotonic() < deadline, "the body never waited for b"
                time.sleep(0.01)
            Step.objects.filter(pk=a).update(name="rival")

    def hook(task, step_id):
        _record(task, step_id)
        if rival_done:
            return  # the retry: only its record
        Step.objects.filter(pk=a).update(name="body")
        rival_done.append(in_thread(rival))
        assert ready.wait(20)
        try:  # a plain cursor: Django's ORM would mark the block for rollback on its own
            with connection.cursor() as cursor:
                cursor.execute("UPDATE workflows_step SET name = 'body' WHERE id = %s", [b])
        except OperationalError as exc:
            HOOKS["swallowed"] = StepStore.error_code(exc)

    return hook, rival_done


@pytest.mark.row_locks
def test_a_body_that_swallows_a_deadlock_commits_nothing_of_that_transaction(steplock_log):
    """The deadlock already rolled the step's transaction back (MySQL: all of it; PostgreSQL
    aborted it). A body that catches the error and goes on must not commit the rest: on
    MySQL the compare-and-swap would run in a new transaction and commit without the body's
    record. The transaction ends there; the lease retry runs the body again and commits."""
    step = Step.objects.create(name="s")
    a, b = (Step.objects.create(name=n).pk for n in ("a", "b"))
    Step.objects.bulk_create([Step(name=f"f{i}") for i in range(200)])
    fillers = list(Step.objects.filter(name__startswith="f").values_list("pk", flat=True))
    hook, rival_done = _the_body_loses_a_deadlock_and_swallows_it(a, b, fillers)
    HOOKS["left"] = hook
    result = left.apply(args=(step.pk,), task_id="swallow")
    for join in rival_done:
        join()
    assert HOOKS["swallowed"] in ("1213", "40P01")
    step.refresh_from_db()
    assert result.state == "SUCCESS" and result.result == {"winner": "swallow"}
    assert RUNS == ["left", "left"]  # the first run's transaction ended at the deadlock
    assert step.status == "done"
    # All or nothing: the record of the run that committed, none of the first run's.
    assert TransitionRecord.objects.filter(step_id=step.pk).count() == 1
    [line] = [m for _, m in steplock_log("step_transaction_conflict")]
    assert "decision=contended" in line and f"code={HOOKS['swallowed']}" in line


def _kill_my_own_session() -> None:
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        else:
            cursor.execute("SELECT CONNECTION_ID()")
            cursor.execute(f"KILL CONNECTION {cursor.fetchone()[0]}")


@pytest.mark.row_locks
def test_an_on_commit_callback_that_fails_after_the_commit_never_reruns_the_step(
    events, steplock_log
):
    """Django runs on-commit callbacks after the COMMIT, inside the block's exit: their
    errors leave the step's ``with`` block. One whose connection breaks there is neither a
    broken COMMIT (``commit_failed``, a retry) nor a rolled-back transaction: the step
    committed once, ``transition_applied`` is sent, and the error is the task's."""
    step = Step.objects.create(name="s")
    HOOKS["left"] = lambda task, step_id: transaction.on_commit(_kill_my_own_session)
    result = left.apply(args=(step.pk,), task_id="committed")
    connection.close()
    step.refresh_from_db()
    assert result.state == "FAILURE"
    assert isinstance(result.result, (OperationalError, InterfaceError)), repr(result.result)
    assert RUNS == ["left"] and step.status == "done"
    assert [kw["current"] for _, kw in _signals(events, "transition_conflict")] == []
    assert len(_signals(events, "transition_applied")) == 1
    assert steplock_log("commit_failed") == [] and steplock_log("retry_scheduled") == []
    assert steplock_log("step_transaction_conflict") == []
