"""Step tasks of the fault-injection suite: the example project's step model and lease name
(``step:<id>``), with the probe's barriers around the library's own compare-and-swap.

``forward`` (pending -> done) and ``compensate`` (pending -> cancelled) race on one lease;
``forward_retry`` calls ``self.retry()`` inside the lease on its first attempt. Each commits a
``TransitionRecord`` in the CAS's transaction, so the records are exactly the committed
transitions. A database connection error is retried by Celery (``autoretry_for``): the
transaction did not commit, or (a lost COMMIT reply) committed and the retry finds the step
done.

With ``STEPLOCK_FAULTS_UNGUARDED=1`` (the negative control) the transition is a plain
``UPDATE ... WHERE pk=?`` and the pre-check is off: what the suite must catch.

``start`` (pending -> running) and ``reset`` (running -> pending, as a recovery moves a step
back) build the fence-decides family's chain. With ``STEPLOCK_FAULTS_GUARD=nofence`` (its
negative control) the workers' ``steplock_fence_field`` names a column the step model does not
have, so the CAS keeps its status condition (and the pre-check and the ownership check stay)
but neither checks nor writes the fence.
"""

import os
import socket

from celery import shared_task
from django.db import InterfaceError, OperationalError, transaction

from celery_steplock import StepLockedTask
from celery_steplock.exceptions import LockLost, TransitionConflict
from django_app.workflows.models import Step, TransitionRecord

from . import probe

NO_FENCE_FIELD = "faults_no_fence_column"  # not a field of Step: the CAS drops its fence

if probe.guard() == "nofence":
    from django_app.celery import app as _app

    _app.conf.steplock_fence_field = NO_FENCE_FIELD


class FaultTask(StepLockedTask):
    """StepLockedTask with barriers at before_cas, after_cas, before_commit, after_commit."""

    def transition(self, step_id, from_, to, **updates):
        probe.barrier("before_cas", self, step_id)
        lease = self.lease
        if probe.unguarded():
            Step.objects.filter(pk=step_id).update(
                status=to, lock_owner=lease.owner, lock_fence=lease.fence
            )
            result = None
        else:
            try:
                result = super().transition(step_id, from_, to, **updates)
            except LockLost as exc:
                cause = exc.__cause__
                if isinstance(cause, TransitionConflict) and cause.stale_fence:
                    row = Step.objects.filter(pk=step_id).values("status", "lock_fence").first()
                    probe.record(
                        "fence_refused",
                        step=step_id,
                        owner=lease.owner,
                        fence=lease.fence,
                        task_id=self.request.id,
                        from_=from_,
                        to=to,
                        current=cause.current,
                        row_fence=(row or {}).get("lock_fence"),
                    )
                raise
        TransitionRecord.objects.create(
            step_id=step_id,
            from_status=from_,
            to_status=to,
            task_name=self.name,
            task_id=self.request.id or "",
            owner=lease.owner,
            fence=lease.fence,
            hostname=self.request.hostname or socket.gethostname(),
            pid=os.getpid(),
        )
        probe.record(
            "cas",
            step=step_id,
            owner=lease.owner,
            fence=lease.fence,
            task_id=self.request.id,
            to=to,
        )

        def committed():
            probe.record(
                "committed",
                step=step_id,
                owner=lease.owner,
                fence=lease.fence,
                task_id=self.request.id,
                to=to,
            )
            probe.barrier("after_commit", self, step_id)

        transaction.on_commit(committed)
        probe.barrier("after_cas", self, step_id)
        return result

    def before_commit(self, lease, step_id):
        probe.barrier("before_commit", self, probe.step_of(lease.name))


DB_ERRORS = (OperationalError, InterfaceError)

OPTIONS = dict(
    bind=True,
    base=FaultTask,
    acks_late=True,
    reject_on_worker_lost=True,
    lock_key="step:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    lock_precheck=not probe.unguarded(),
    autoretry_for=DB_ERRORS,
    retry_backoff=1,
    retry_backoff_max=4,
    retry_jitter=True,
    max_retries=20,
)


def _body(task, step_id, work):
    probe.barrier("after_acquire", task, step_id)
    probe.work(task, work)
    return {"step_id": step_id, "owner": task.lease.owner, "fence": task.lease.fence}


@shared_task(transition=("pending", "done"), **OPTIONS)
def forward(self, step_id, work=0.0):
    """The forward flow: pending -> done after ``work`` seconds."""
    return _body(self, step_id, work)


@shared_task(transition=("pending", "cancelled"), **OPTIONS)
def compensate(self, step_id, work=0.0):
    """The compensation racing the forward flow: pending -> cancelled."""
    return _body(self, step_id, work)


@shared_task(transition=("pending", "done"), **OPTIONS)
def forward_retry(self, step_id, countdown=0.5):
    """pending -> done on the second attempt; the first retries from inside the lease."""
    probe.barrier("after_acquire", self, step_id)
    if not self.request.retries:
        probe.record("retry", step=step_id, owner=self.lease.owner, task_id=self.request.id)
        raise self.retry(countdown=countdown)
    return {"step_id": step_id, "owner": self.lease.owner, "fence": self.lease.fence}


@shared_task(transition=("pending", "running"), **OPTIONS)
def start(self, step_id, work=0.0):
    """The first phase of a two-phase flow: pending -> running."""
    return _body(self, step_id, work)


@shared_task(transition=("running", "pending"), **OPTIONS)
def reset(self, step_id, work=0.0):
    """A running step moved back to pending under the lease (as a recovery would)."""
    return _body(self, step_id, work)


class StaleTask(FaultTask):
    """FaultTask whose holder stalls after its last ownership check (``stall`` kwarg,
    seconds): the fence-decides shape of the randomized run (``stale_aba``,
    tests/support/faults/loads.py).

    Before its compare-and-swap the holder checks its lease (valid) and reads its remaining
    validity, as the library does right before the statement, then stops renewing it (this
    lease only: the process's heartbeat renews its other leases) and stalls, as a process
    paused between those reads and its ``UPDATE`` would, until a ``reset`` has committed on
    the step (``running -> pending``: newer holders moved it away and back) or ``stall``
    seconds have passed. The library's check and its reading of the remaining validity were
    made before the pause, so for this lease they answer what they answered then (a valid
    lease, the time it had left). The status condition then matches again and only the
    fence condition can refuse the stale ``pending -> done``. Only the first execution of a
    task id stalls (not its retries nor a redelivery: ``faults:stalled:<task id>``)."""

    def transition(self, step_id, from_, to, **updates):
        stall = float((self.request.kwargs or {}).get("stall") or 0.0)
        lease = self.lease
        if stall <= 0 or lease is None or self.request.retries:
            return super().transition(step_id, from_, to, **updates)
        if not probe._redis().set(f"faults:stalled:{self.request.id}", "1", nx=True, ex=600):
            return super().transition(step_id, from_, to, **updates)
        import time

        from celery_steplock.heartbeat import get_heartbeat

        lease.check()
        left = lease.remaining()
        get_heartbeat().unregister(lease)
        probe.record(
            "stale_stall",
            step=step_id,
            owner=lease.owner,
            fence=lease.fence,
            task_id=self.request.id,
            seconds=stall,
            left=left,
        )
        deadline = time.monotonic() + stall
        moved_back = False
        while time.monotonic() < deadline:
            moved_back = TransitionRecord.objects.filter(
                step_id=step_id, from_status="running", to_status="pending"
            ).exists()
            if moved_back:
                break
            time.sleep(probe.SLICE)
        probe.record(
            "stale_resume",
            step=step_id,
            owner=lease.owner,
            fence=lease.fence,
            task_id=self.request.id,
            moved_back=moved_back,
        )
        lease.check = lambda: None  # what it answered before the pause
        lease.remaining = lambda: left
        try:
            return super().transition(step_id, from_, to, **updates)
        finally:
            del lease.check, lease.remaining


@shared_task(transition=("pending", "done"), **{**OPTIONS, "base": StaleTask})
def stale_forward(self, step_id, work=0.0, stall=0.0):
    """pending -> done by a holder that stalls past its lease before its CAS (StaleTask)."""
    return _body(self, step_id, work)
