"""StepLockedTask executed in-process (``apply()``) against real Redis and the real DB.

Concurrency between real worker processes is in test_workers.py.
"""

import threading
import time

import pytest
from celery.exceptions import Retry

from celery_steplock import signals
from celery_steplock.exceptions import (
    ImproperlyConfigured,
    LockContended,
    LockLost,
    LockNameError,
    LockStoreUnavailable,
    TransitionConflict,
)
from celery_steplock.lock import get_lease_store
from celery_steplock.task import StepLockedTask, backoff
from django_app.celery import app as celery_app
from django_app.workflows.models import Step, TransitionRecord
from helpers import closed_port_url, set_settings

pytestmark = pytest.mark.django_db(transaction=True)

BODY_RUNS = []


def record(task, step_id, to):
    TransitionRecord.objects.create(
        step_id=step_id,
        from_status="pending",
        to_status=to,
        owner=task.lease.owner if task.lease else "",
        fence=task.lease.fence if task.lease else None,
        task_id=task.request.id or "",
    )


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.finish",
    lock_key="step:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
    on_contended="raise",
    max_retries=2,
)
def finish(self, step_id, hold=0.0, steal=False):
    BODY_RUNS.append(step_id)
    record(self, step_id, "done")
    if hold:
        deadline = time.monotonic() + hold
        while time.monotonic() < deadline:
            time.sleep(0.02)
            self.lease.check()
    if steal:
        get_lease_store(self.app).client.hset(
            self.lease.key, mapping={"owner": "thief", "task_id": "thief-task"}
        )
    return {"fence": self.lease.fence, "owner": self.lease.owner}


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.blind_finish",
    lock_key="step:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
    lock_precheck=False,
    on_conflict="raise",
)
def blind_finish(self, step_id):
    BODY_RUNS.append(step_id)
    record(self, step_id, "done")
    return "body done"


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.phases",
    lock_key="step:{step_id}",
    step_model="workflows.Step",
)
def phases(self, step_id, fail_between=False):
    first = self.transition(step_id, "pending", "running")
    if fail_between:
        raise RuntimeError("between phases")
    second = self.transition(step_id, "running", "done", attempts=1)
    return [first.applied, second.applied, self.lease.fence]


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.retrying",
    lock_key="step:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
    max_retries=3,
)
def retrying(self, step_id):
    BODY_RUNS.append((step_id, self.request.retries))
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    record(self, step_id, "done")
    return self.request.retries


@celery_app.task(bind=True, base=StepLockedTask, name="tests.hashed")
def hashed(self, a, b=1):
    return self.lease.name


@pytest.fixture(autouse=True)
def clean(app, redis_client):
    BODY_RUNS.clear()
    app.conf.steplock_retry_backoff = 0.01
    yield


def names(events):
    return [name for name, _ in events]


def test_commit_then_release(redis_client, events):
    step = Step.objects.create(name="s")
    result = finish.apply(args=(step.pk,))
    assert result.successful(), result.traceback
    step.refresh_from_db()
    assert step.status == "done"
    assert (step.lock_owner, step.lock_fence) == (result.result["owner"], result.result["fence"])
    assert TransitionRecord.objects.count() == 1
    assert redis_client.exists(f"steplock:lease:{{step:{step.pk}}}") == 0
    assert names(events) == ["lock_acquired", "transition_applied", "lock_released"]
    acquired = events[0][1]
    assert (
        acquired["task_name"] == "tests.finish"
        and acquired["key"] == f"steplock:lease:{{step:{step.pk}}}"
    )
    assert "step_id" not in acquired and "args" not in acquired


def test_signal_order_acquired_extended_released(app, events):
    """acquired first, released last, one transition_applied, renewals in between: the body
    holds the lease past its TTL, so it cannot have succeeded without a renewal. A renewal
    may land between the commit and the release (the heartbeat thread's own timing), never
    after the release (unregister waits for a cycle in flight)."""
    set_settings(app, steplock_default_ttl=1.5)
    finish.lock_ttl = None
    step = Step.objects.create(name="s")
    result = finish.apply(args=(step.pk,), kwargs={"hold": 2.0})
    assert result.successful(), result.traceback
    order = names(events)
    assert order[0] == "lock_acquired" and order[-1] == "lock_released"
    middle = order[1:-1]
    assert middle.count("transition_applied") == 1
    assert set(middle) - {"transition_applied"} == {"lock_extended"}
    assert middle.count("lock_extended") >= 1
    owners = {kw["owner"] for _, kw in events if kw.get("owner")}
    assert len(owners) == 1
    own_thread = [kw["monotonic"] for name, kw in events if name != "lock_extended"]
    assert own_thread == sorted(own_thread)


def test_duplicate_after_commit_skips_the_body(events):
    step = Step.objects.create(name="s")
    assert finish.apply(args=(step.pk,), task_id="same").successful()
    again = finish.apply(args=(step.pk,), task_id="same")
    assert again.state == "IGNORED"
    assert BODY_RUNS == [step.pk]
    assert TransitionRecord.objects.count() == 1
    assert names(events)[-3:] == ["lock_acquired", "transition_conflict", "lock_released"]
    assert events[-2][1]["current"] == "done"


def test_cas_conflict_rolls_back_the_body_and_never_overwrites(events):
    step = Step.objects.create(name="s", status="cancelled")
    result = blind_finish.apply(args=(step.pk,))
    assert isinstance(result.result, TransitionConflict)
    assert BODY_RUNS == [step.pk]  # the body ran (no precheck) ...
    assert TransitionRecord.objects.count() == 0  # ... and its writes rolled back
    step.refresh_from_db()
    assert step.status == "cancelled"
    assert "transition_conflict" in names(events) and "transition_applied" not in names(events)


def test_contended_lease_raises_without_running_the_body(redis_client, events):
    step = Step.objects.create(name="s")
    lock = get_lease_store(celery_app)
    holder = lock.acquire(
        f"step:{step.pk}",
        "other-owner",
        10.0,
        metadata={"task_id": "tid-1", "hostname": "h", "pid": 1},
    )
    result = finish.apply(args=(step.pk,))
    assert isinstance(result.result, LockContended)
    assert result.result.holder == "other-owner" and "tid-1" in str(result.result)
    assert BODY_RUNS == []
    assert names(events) == ["lock_contended"]
    assert events[0][1]["holder"] == "other-owner"
    assert lock.owned(holder.name, holder.owner) is not None  # untouched


def test_contended_skip_and_retry_policies(redis_client):
    step = Step.objects.create(name="s")
    get_lease_store(celery_app).acquire(f"step:{step.pk}", "other", 10.0)
    finish.on_contended = "skip"
    try:
        skipped = finish.apply(args=(step.pk,))
        assert (skipped.state, skipped.result["steplock"]) == ("SUCCESS", "skipped")
        finish.on_contended = "ignore"
        assert finish.apply(args=(step.pk,)).state == "IGNORED"
        finish.on_contended = "retry"
        result = finish.apply(args=(step.pk,))
        assert isinstance(result.result, LockContended)  # retried max_retries=2 times
        assert result.state == "FAILURE"
    finally:
        finish.on_contended = "raise"
    assert BODY_RUNS == []


def test_lost_lease_refuses_the_commit(redis_client, events):
    step = Step.objects.create(name="s")
    finish.on_contended = "raise"
    result = finish.apply(args=(step.pk,), kwargs={"steal": True})
    assert isinstance(result.result, LockLost), result.traceback
    step.refresh_from_db()
    assert step.status == "pending" and TransitionRecord.objects.count() == 0
    assert "lock_lost" in names(events) and "transition_applied" not in names(events)
    assert redis_client.hget(f"steplock:lease:{{step:{step.pk}}}", "owner") == "thief"


def test_a_newer_fence_in_the_row_is_a_lost_lease_not_a_silent_conflict(redis_client, events):
    """The status matches but the row carries a higher fence (a newer holder wrote it, or the
    fence source went backwards after a failover): LockLost, retried, never Ignore (tests/faults
    review: an ignored refusal would drop the step for good)."""
    step = Step.objects.create(name="s", lock_fence=2**62)
    result = finish.apply(args=(step.pk,))
    assert isinstance(result.result, LockLost), result.traceback
    assert "newer fencing token" in str(result.result)
    step.refresh_from_db()
    assert step.status == "pending" and TransitionRecord.objects.count() == 0
    assert names(events)[-3:] == ["transition_conflict", "lock_lost", "lock_released"]


def test_lost_lease_is_retried_with_the_retry_policy(redis_client):
    step = Step.objects.create(name="s")
    finish.on_contended = "retry"
    try:
        result = finish.apply(args=(step.pk,), kwargs={"steal": True})
    finally:
        finish.on_contended = "raise"
    # each retry finds the thief's lease: contended until max_retries, never committed
    assert isinstance(result.result, (LockContended, LockLost))
    step.refresh_from_db()
    assert step.status == "pending" and TransitionRecord.objects.count() == 0


def test_store_outage_on_acquire_does_not_run_the_body(app, events):
    app.conf.steplock_redis_url = closed_port_url()
    app.conf.steplock_socket_timeout = 0.3
    step = Step.objects.create(name="s")
    finish.on_contended = "retry"
    try:
        result = finish.apply(args=(step.pk,))
    finally:
        finish.on_contended = "raise"
    assert isinstance(result.result, LockStoreUnavailable)
    assert BODY_RUNS == []
    step.refresh_from_db()
    assert step.status == "pending"
    errors = [kw for name, kw in events if name == "lock_store_error"]
    assert len(errors) == 3 and errors[0]["policy"] == "fail_closed"  # 1 + max_retries=2


def test_store_outage_is_a_celery_retry_in_a_worker(app):
    app.conf.steplock_redis_url = closed_port_url()
    app.conf.steplock_socket_timeout = 0.3
    step = Step.objects.create(name="s")
    finish.on_contended = "retry"
    finish.push_request(
        id="tid",
        args=(step.pk,),
        kwargs={},
        retries=0,
        is_eager=True,
        called_directly=False,
        delivery_info={},
    )
    try:
        with pytest.raises(Retry) as info:
            finish(step.pk)
    finally:
        finish.pop_request()
        finish.on_contended = "raise"
    assert isinstance(info.value.exc, LockStoreUnavailable)
    assert 0.0 < info.value.when <= 60
    assert BODY_RUNS == []


def test_fail_open_runs_the_body_and_keeps_the_cas(app, events):
    app.conf.steplock_redis_url = closed_port_url()
    app.conf.steplock_socket_timeout = 0.3
    closed = Step.objects.create(name="closed")
    assert isinstance(blind_finish.apply(args=(closed.pk,)).result, LockStoreUnavailable)
    assert BODY_RUNS == []
    done = Step.objects.create(name="done", status="done")
    blind_finish.on_store_error = "fail_open"
    try:
        result = blind_finish.apply(args=(done.pk,))
    finally:
        blind_finish.on_store_error = None
    assert isinstance(result.result, TransitionConflict)  # ran unlocked, the CAS still refused
    assert BODY_RUNS == [done.pk]
    assert TransitionRecord.objects.count() == 0
    policies = [kw["policy"] for name, kw in events if name == "lock_store_error"]
    assert policies == ["fail_closed"] * 4 + ["fail_open"]  # 1 + max_retries=3, then open


def test_release_failure_never_masks_the_result(private_redis, app, events):
    app.conf.steplock_redis_url = private_redis.url
    app.conf.steplock_socket_timeout = 0.3
    step = Step.objects.create(name="s")

    def stop_redis(**kwargs):
        private_redis.stop()

    signals.transition_applied.connect(stop_redis, weak=False)
    try:
        result = finish.apply(args=(step.pk,))
    finally:
        signals.transition_applied.disconnect(stop_redis)
    assert result.successful(), result.traceback
    step.refresh_from_db()
    assert step.status == "done"
    assert "lock_released" not in names(events)


def test_release_failure_never_masks_the_exception(private_redis, app):
    app.conf.steplock_redis_url = private_redis.url
    app.conf.steplock_socket_timeout = 0.3
    step = Step.objects.create(name="s")

    @celery_app.task(bind=True, base=StepLockedTask, name="tests.boom", lock_key="b:{step_id}")
    def boom(self, step_id):
        private_redis.stop()
        raise ValueError("the body's own error")

    result = boom.apply(args=(step.pk,))
    assert isinstance(result.result, ValueError) and "own error" in str(result.result)


def test_body_exception_rolls_back_and_releases(redis_client):
    step = Step.objects.create(name="s")
    result = phases.apply(args=(step.pk,), kwargs={"fail_between": True})
    assert isinstance(result.result, RuntimeError)
    step.refresh_from_db()
    assert step.status == "pending"
    assert redis_client.exists(f"steplock:lease:{{step:{step.pk}}}") == 0


def test_multi_phase_transitions_inside_the_body():
    step = Step.objects.create(name="s")
    applied_first, applied_second, fence = phases.apply(args=(step.pk,)).get()
    step.refresh_from_db()
    assert (applied_first, applied_second) == (True, True)
    assert (step.status, step.attempts, step.lock_fence) == ("done", 1, fence)


def test_retry_inside_the_body_does_not_deadlock_on_its_own_lease(redis_client):
    step = Step.objects.create(name="s")
    result = retrying.apply(args=(step.pk,))
    assert result.get(timeout=10) == 1  # the retry got the lease: its own was let go first
    assert BODY_RUNS == [(step.pk, 0), (step.pk, 1)]
    assert TransitionRecord.objects.count() == 1


def test_default_lock_name_hashes_the_bound_arguments():
    first = hashed.apply(args=(1,)).get()
    assert first == hashed.apply(kwargs={"a": 1}).get() == hashed.apply(args=(1, 1)).get()
    assert first != hashed.apply(args=(2,)).get()
    assert first.startswith("tests.hashed:")
    assert "self" not in first


def test_unserialisable_argument_fails_clearly():
    result = hashed.apply(args=(object(),))
    assert isinstance(result.result, LockNameError) and "'a'" in str(result.result)


@pytest.mark.parametrize(
    "options, setting",
    [
        ({"lock_ttl": 0}, "lock_ttl"),
        ({"lock_ttl": -3}, "lock_ttl"),
        ({"on_contended": "wait"}, "on_contended"),
        ({"on_conflict": "clobber"}, "on_conflict"),
        ({"step_model": "workflows.Missing"}, "step_model"),
        ({"step_id_arg": "nope"}, "step_id_arg"),
        ({"step_transition": ("pending",)}, "transition"),
    ],
)
def test_invalid_task_options_name_the_option(options, setting):
    step = Step.objects.create(name="s")
    saved = {k: finish.__dict__.get(k) for k in options}
    for key, value in options.items():
        setattr(finish, key, value)
    try:
        result = finish.apply(args=(step.pk,))
    finally:
        for key, value in saved.items():
            if value is None:
                delattr(finish, key) if key in finish.__dict__ else None
            else:
                setattr(finish, key, value)
    assert isinstance(result.result, ImproperlyConfigured), result.result
    assert result.result.setting == setting
    assert str(result.result).startswith("tests.finish: ")
    assert BODY_RUNS == []


def test_unknown_step_model_fails_before_any_lease(redis_client, events):
    finish.step_model = "workflows.Missing"
    try:
        result = finish.apply(args=(1,))
    finally:
        finish.step_model = "workflows.Step"
    assert isinstance(result.result, ImproperlyConfigured)
    assert events == [] and list(redis_client.scan_iter("steplock:*")) == []


def test_invalid_setting_names_the_setting(app):
    app.conf.steplock_renewal_ratio = 1.5
    step = Step.objects.create(name="s")
    result = finish.apply(args=(step.pk,))
    assert isinstance(result.result, ImproperlyConfigured)
    assert result.result.setting == "steplock_renewal_ratio"


def test_transition_option_does_not_shadow_the_method():
    assert finish.step_transition == ("pending", "done")
    assert callable(finish.transition)


def test_concurrent_threads_commit_once(redis_client):
    """Eight threads run the task on one step at once: one commit, the rest contended."""
    step = Step.objects.create(name="s")
    barrier = threading.Barrier(8)
    outcomes = []

    def run():
        barrier.wait()
        result = finish.apply(args=(step.pk,), kwargs={"hold": 0.3})
        outcomes.append(type(result.result).__name__ if result.failed() else result.state)
        from django.db import connection

        connection.close()

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes).count("SUCCESS") == 1
    assert sorted(outcomes).count("LockContended") == 7
    assert TransitionRecord.objects.count() == 1


def test_direct_calls_in_threads_each_see_their_own_lease():
    @celery_app.task(bind=True, base=StepLockedTask, name="tests.whose", lock_key="w:{n}")
    def whose(self, n):
        time.sleep(0.01)
        first = self.lease.name
        time.sleep(0.02)
        return first, self.lease.name

    results, errors = [], []

    def run(n):
        try:
            results.append((n, whose(n)))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(seen == (f"w:{n}", f"w:{n}") for n, seen in results) and len(results) == 20


def test_nested_call_restores_the_outer_lease():
    @celery_app.task(bind=True, base=StepLockedTask, name="tests.nested", lock_key="k:{n}")
    def nested(self, n):
        if n == 1:
            inner = nested(2)
            return self.lease.name, inner
        return self.lease.name

    assert nested(1) == ("k:1", "k:2")


def test_inside_an_outer_transaction_is_refused_before_any_lease(redis_client):
    from django.db import transaction

    from celery_steplock.exceptions import OuterTransactionError

    step = Step.objects.create(name="s")
    with pytest.raises(OuterTransactionError, match="inside transaction.atomic"):
        with transaction.atomic():
            finish(step.pk)
    assert BODY_RUNS == [] and list(redis_client.scan_iter("steplock:*")) == []


def test_outage_at_the_ownership_check_rolls_back_and_retries(private_redis, app, events):
    app.conf.steplock_redis_url = private_redis.url
    app.conf.steplock_socket_timeout = 0.3
    step = Step.objects.create(name="s")

    @celery_app.task(
        bind=True,
        base=StepLockedTask,
        name="tests.outage_at_check",
        lock_key="step:{step_id}",
        step_model="workflows.Step",
        step_id_arg="step_id",
        transition=("pending", "done"),
        lock_retry_max=0,
    )
    def outage_at_check(self, step_id):
        record(self, step_id, "done")
        private_redis.stop()

    result = outage_at_check.apply(args=(step.pk,))
    assert isinstance(result.result, LockStoreUnavailable) and "ownership" in str(result.result)
    step.refresh_from_db()
    assert step.status == "pending" and TransitionRecord.objects.count() == 0
    assert [kw["policy"] for n, kw in events if n == "lock_store_error"] == ["fail_closed"]


def test_backoff_has_full_jitter_and_a_cap():
    import random

    state = random.getstate()
    random.seed(20240611)  # the same 200 draws on every run
    try:
        values = [backoff(1.0, 3, 5.0) for _ in range(200)]
        capped = [backoff(1.0, 100, 60.0) for _ in range(200)]
    finally:
        random.setstate(state)
    assert all(0.05 <= v <= 5.0 for v in values)  # min(5.0, 1.0 * 2**3) caps it at 5 s
    # Full jitter: spread over the whole of [0, cap], not bunched near the cap.
    assert max(values) > 4.5 and min(values) < 0.5
    assert sum(v < 2.5 for v in values) > 60 and sum(v >= 2.5 for v in values) > 60
    assert all(0.05 <= v <= 60.0 for v in capped) and max(capped) > 50.0


def test_settings_are_read_once_per_change_and_the_heartbeat_thread_is_kept(app, redis_client):
    from celery_steplock.heartbeat import get_heartbeat

    conf_type = type(app.conf)
    real_get = conf_type.get
    read = []

    def counting(self_, key, *args, **kwargs):
        if isinstance(key, str) and key.startswith("steplock_"):
            read.append(key)
        return real_get(self_, key, *args, **kwargs)

    def run(name):
        step = Step.objects.create(name=name)
        read.clear()
        conf_type.get = counting
        try:
            finish(step.pk)
        finally:
            conf_type.get = real_get
        step.refresh_from_db()
        assert step.status == "done"
        return list(read)

    run("warm")
    thread = get_heartbeat().thread
    assert thread is not None and thread.is_alive()  # idles after the lease is gone
    assert run("unchanged") == []  # nothing changed: nothing is looked up again
    assert get_heartbeat().thread is thread  # the same thread served both executions
    ttls = []
    signals.lock_acquired.connect(
        lambda sender=None, **kw: ttls.append(kw["ttl"]), weak=False, dispatch_uid="test-ttl"
    )
    try:
        set_settings(app, steplock_default_ttl=7.5)  # a change applies to the next execution
        changed = run("changed")
        assert changed and len(changed) == len(set(changed)), sorted(changed)
        assert "steplock_default_ttl" in changed
        assert run("again") == []
    finally:
        signals.lock_acquired.disconnect(dispatch_uid="test-ttl")
    assert ttls == [7.5, 7.5]


class HookedTask(StepLockedTask):
    """Public hooks overridden, each recording that it ran."""

    calls: list = []

    def handle_contended(self, exc):
        self.calls.append(("contended", exc.name, exc.holder))
        return "busy"

    def handle_conflict(self, exc):
        self.calls.append(("conflict", exc.current))
        return "already"

    def handle_store_error(self, exc, lease):
        self.calls.append(("store_error", lease))
        return None  # go on unlocked (fail open)

    def handle_lost_lease(self, exc):
        self.calls.append(("lost", exc.name, exc.fence))
        return "lost"

    def before_commit(self, lease, step_id):
        self.calls.append(("before_commit", step_id, lease.fence if lease else None))
        if Step.objects.filter(pk=step_id, name="veto").exists():
            raise RuntimeError("vetoed before the commit")


@celery_app.task(
    bind=True,
    base=HookedTask,
    name="tests.hooked",
    lock_key="step:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
)
def hooked(self, step_id, steal=False):
    BODY_RUNS.append(step_id)
    record(self, step_id, "done")
    if steal:
        get_lease_store(self.app).client.hset(self.lease.key, mapping={"owner": "thief"})
    return "body"


@pytest.fixture
def hook_calls():
    HookedTask.calls = []
    yield HookedTask.calls


def test_hooks_replace_the_string_policies(redis_client, hook_calls):
    busy = Step.objects.create(name="busy")
    get_lease_store(celery_app).acquire(f"step:{busy.pk}", "other-owner", 10.0)
    assert hooked.apply(args=(busy.pk,)).get() == "busy"
    assert hook_calls == [("contended", f"step:{busy.pk}", "other-owner")]
    assert BODY_RUNS == []

    done = Step.objects.create(name="done", status="done")
    hook_calls.clear()
    assert hooked.apply(args=(done.pk,)).get() == "already"
    assert hook_calls == [("conflict", "done")]

    stolen = Step.objects.create(name="stolen")
    hook_calls.clear()
    assert hooked.apply(args=(stolen.pk,), kwargs={"steal": True}).get() == "lost"
    assert [c[0] for c in hook_calls] == ["lost"] and hook_calls[0][1] == f"step:{stolen.pk}"
    stolen.refresh_from_db()
    assert stolen.status == "pending" and TransitionRecord.objects.count() == 0


def test_before_commit_runs_after_the_cas_and_can_veto(redis_client, hook_calls, events):
    ok = Step.objects.create(name="ok")
    assert hooked.apply(args=(ok.pk,)).get() == "body"
    [(hook, step_id, fence)] = hook_calls
    assert (hook, step_id) == ("before_commit", ok.pk) and fence > 0
    ok.refresh_from_db()
    assert ok.status == "done" and ok.lock_fence == fence

    veto = Step.objects.create(name="veto")
    result = hooked.apply(args=(veto.pk,))
    assert isinstance(result.result, RuntimeError)
    veto.refresh_from_db()
    assert veto.status == "pending"  # the CAS and the body's record rolled back together
    assert TransitionRecord.objects.filter(step_id=veto.pk).count() == 0
    assert list(redis_client.scan_iter("steplock:lease:*")) == []  # released all the same


def test_store_error_hook_can_fail_open(app, hook_calls):
    app.conf.steplock_redis_url = closed_port_url()
    app.conf.steplock_socket_timeout = 0.3
    step = Step.objects.create(name="s")
    assert hooked.apply(args=(step.pk,)).get() == "body"
    assert hook_calls == [("store_error", None), ("before_commit", step.pk, None)]
    step.refresh_from_db()
    assert step.status == "done"  # ran unlocked; the CAS still applied it once


def test_an_impossible_step_id_fails_before_any_lease(redis_client, events):
    from celery_steplock.exceptions import InvalidStepId

    result = finish.apply(args=("abc",))
    assert isinstance(result.result, InvalidStepId)
    assert result.result.argument == "step_id" and "step_id='abc'" in str(result.result)
    assert events == [] and BODY_RUNS == []
    assert list(redis_client.scan_iter("steplock:*")) == []


# -- one execution object, one table from exception to hook, the plan's CAS on its own path --

from celery_steplock.contrib.django.steps import DjangoStepStore  # noqa: E402
from celery_steplock.exceptions import AdmissionDenied  # noqa: E402
from celery_steplock.execution import HOOKS, Execution, hook_for  # noqa: E402


def test_one_table_names_the_hook_of_every_ending():
    class Refused(AdmissionDenied):
        pass

    assert hook_for(LockContended("busy")) == "handle_contended"
    assert hook_for(TransitionConflict("left from_")) == "handle_conflict"
    assert hook_for(LockLost("lost")) == "handle_lost_lease"
    assert hook_for(LockStoreUnavailable("down")) == "steplock_retry"
    refused = Refused("later", retry_after=1.0)
    assert hook_for(refused, gate=True) == "handle_denied"
    assert hook_for(refused) is None  # the body's own AdmissionDenied is the body's outcome
    assert hook_for(RuntimeError("the body's")) is None
    assert all(callable(getattr(StepLockedTask, row.method)) for row in HOOKS.values())


class SeeingTask(StepLockedTask):
    """Records the execution each hook and the body see."""

    seen = []

    def handle_conflict(self, exc):
        SeeingTask.seen.append(("conflict", self.steplock_execution))
        return "already"

    def before_commit(self, lease, step_id):
        SeeingTask.seen.append(("before_commit", self.steplock_execution))


@celery_app.task(
    bind=True,
    base=SeeingTask,
    name="tests.seeing",
    lock_key="step:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
)
def seeing(self, step_id, note="n"):
    SeeingTask.seen.append(("body", self.steplock_execution))
    return "body"


def test_the_body_and_the_hooks_share_one_execution(redis_client):
    SeeingTask.seen = []
    step = Step.objects.create(name="s")
    assert seeing.apply(args=(step.pk,)).get() == "body"
    [(first, in_body), (second, in_hook)] = SeeingTask.seen
    assert (first, second) == ("body", "before_commit")
    assert isinstance(in_body, Execution) and in_hook is in_body
    assert in_body.arguments == {"step_id": step.pk, "note": "n"}
    assert (in_body.name, in_body.step_id, in_body.step) == (
        f"step:{step.pk}",
        step.pk,
        f"workflows.step:{step.pk}",
    )
    assert in_body.lease.owner == in_body.owner and in_body.steps is not None
    assert in_body.wait.seconds >= 0 and in_body.held.seconds >= 0
    assert seeing.steplock_execution is None  # none outside a call

    SeeingTask.seen = []
    done = Step.objects.create(name="d", status="done")
    assert seeing.apply(args=(done.pk,)).get() == "already"
    [(hook, in_conflict)] = SeeingTask.seen
    assert hook == "conflict"
    assert in_conflict.step_id == done.pk and in_conflict.lease is not None


def test_self_lease_is_the_body_s_window_not_the_signals_around_it(redis_client):
    seen = []

    def receiver(sender=None, signal=None, **kw):
        seen.append((signal.name, sender.lease))

    for signal in (signals.lock_acquired, signals.lock_released):
        signal.connect(receiver, weak=False)
    try:
        step = Step.objects.create(name="s")
        finish.apply(args=(step.pk,)).get()
    finally:
        for signal in (signals.lock_acquired, signals.lock_released):
            signal.disconnect(receiver)
    assert seen == [("lock_acquired", None), ("lock_released", None)]


class DeadlineStore(DjangoStepStore):
    """The Django store, recording the deadline of every CAS and every set_deadline."""

    calls = []

    def transition(self, step_id, from_, to, **kwargs):
        DeadlineStore.calls.append(("cas", to, kwargs.get("deadline") is not None))
        return super().transition(step_id, from_, to, **kwargs)

    def set_deadline(self, seconds):
        DeadlineStore.calls.append(("set_deadline", seconds > 0))
        return super().set_deadline(seconds)


class WrappingTask(StepLockedTask):
    """Wraps the library's CAS, as the fault suite's barriers do."""

    def transition(self, step_id, from_, to, **updates):
        DeadlineStore.calls.append(("wrapped", to))
        return super().transition(step_id, from_, to, **updates)


class WritingTask(StepLockedTask):
    """A transition() that writes by itself, without the library's CAS."""

    def transition(self, step_id, from_, to, **updates):
        DeadlineStore.calls.append(("wrote", to))
        Step.objects.filter(pk=step_id, status=from_).update(status=to)


STEP_OPTIONS = dict(
    bind=True,
    lock_key="step:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("running", "done"),
    lock_precheck=False,  # the body moves the step to from_
)


@celery_app.task(base=StepLockedTask, name="tests.deadline_plain", **STEP_OPTIONS)
def deadline_plain(self, step_id):
    self.transition(step_id, "pending", "running")  # the body's own: no deadline


@celery_app.task(base=WrappingTask, name="tests.deadline_wrapped", **STEP_OPTIONS)
def deadline_wrapped(self, step_id):
    Step.objects.filter(pk=step_id).update(status="running")


@celery_app.task(base=WritingTask, name="tests.deadline_written", **STEP_OPTIONS)
def deadline_written(self, step_id):
    Step.objects.filter(pk=step_id).update(status="running")


@pytest.fixture
def deadline_calls(app):
    set_settings(app, steplock_step_store=DeadlineStore)
    DeadlineStore.calls = []
    yield DeadlineStore.calls


@pytest.mark.parametrize(
    "task, expected",
    [
        # The plan's CAS (after the body) carries the deadline; the body's own does not.
        (deadline_plain, [("cas", "running", False), ("cas", "done", True)]),
        # Through a subclass's transition() calling the library's: still carried by the CAS.
        (deadline_wrapped, [("wrapped", "done"), ("cas", "done", True)]),
        # A transition() that writes by itself: the deadline is its own statement.
        (deadline_written, [("wrote", "done"), ("set_deadline", True)]),
    ],
    ids=["plain", "wrapped", "written"],
)
def test_the_plan_s_cas_carries_the_deadline(redis_client, deadline_calls, task, expected):
    step = Step.objects.create(name="s")
    assert task.apply(args=(step.pk,)).get() is None
    assert deadline_calls == expected
    step.refresh_from_db()
    assert step.status == "done"
    assert list(redis_client.scan_iter("steplock:lease:*")) == []


def test_without_a_transition_the_deadline_is_its_own_statement(redis_client, deadline_calls, app):
    step = Step.objects.create(name="s")
    assert phases.apply(args=(step.pk,)).get()[:2] == [True, True]
    assert deadline_calls == [
        ("cas", "running", False),
        ("cas", "done", False),
        ("set_deadline", True),
    ]
    set_settings(app, steplock_db_deadline=False)
    DeadlineStore.calls.clear()
    other = Step.objects.create(name="o")
    deadline_plain.apply(args=(other.pk,)).get()
    assert deadline_calls == [("cas", "running", False), ("cas", "done", False)]
