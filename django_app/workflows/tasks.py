"""Tasks of the example workflow app.

``advance`` and ``compensate`` lock the same lease name (``step:<id>``) and try
opposite transitions out of ``pending``: whichever commits first wins, the other
finds the step no longer ``pending`` (pre-check or CAS conflict) and changes
nothing. Each writes a ``TransitionRecord`` inside its body, i.e. in the same
DB transaction as the CAS, so a rolled-back attempt leaves no record.
"""

import os
import socket
import time

from celery import shared_task
from django.db import transaction
from django.db.models import F

from celery_steplock import StepLockedTask, effects
from celery_steplock.lock import get_lease_store
from celery_steplock.exceptions import LockLost
from celery_steplock.contrib.django.steps import DjangoStepStore

from .models import Step, TransitionRecord

#: Sleep granularity of the ``delay``/``seconds`` loops: the lease is checked
#: between slices, so a lost lease stops the body within one slice.
SLICE = 0.05


def _hold(task, seconds):
    """Sleep ``seconds`` in small slices, raising LockLost as soon as the lease is lost."""
    deadline = time.monotonic() + float(seconds)
    task.lease.check()
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        time.sleep(min(SLICE, remaining))
        task.lease.check()


def _record(task, step_id, from_status, to_status):
    lease = task.lease
    return TransitionRecord.objects.create(
        step_id=step_id,
        from_status=from_status,
        to_status=to_status,
        task_name=task.name,
        task_id=task.request.id or "",
        owner=lease.owner,
        fence=lease.fence,
        hostname=task.request.hostname or socket.gethostname(),
        pid=os.getpid(),
    )


def _bump_attempts(step_id):
    Step.objects.filter(pk=step_id).update(attempts=F("attempts") + 1)


#: Options shared by the tasks that lock a step: they all take the lease ``step:<id>``.
STEP_TASK = dict(
    bind=True,
    base=StepLockedTask,
    acks_late=True,
    lock_key="step:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
)


def _move(task, step_id, delay, to):
    """The body of a one-transition step task: work for ``delay`` seconds, record it."""
    _hold(task, delay)
    _record(task, step_id, "pending", to)
    _bump_attempts(step_id)
    return {"step_id": step_id, "fence": task.lease.fence}


@shared_task(transition=("pending", "done"), **STEP_TASK)
def advance(self, step_id, delay=0.0):
    """Forward flow: ``pending -> done``, after ``delay`` seconds of "work"."""
    return _move(self, step_id, delay, "done")


@shared_task(transition=("pending", "cancelled"), **STEP_TASK)
def compensate(self, step_id, delay=0.0):
    """Compensation racing the forward flow on the same lease: ``pending -> cancelled``."""
    return _move(self, step_id, delay, "cancelled")


@shared_task(**STEP_TASK)
def multi_phase(self, step_id):
    """Two transitions in one body: ``pending -> running -> done`` (one DB transaction)."""
    self.transition(step_id, "pending", "running")
    _record(self, step_id, "pending", "running")
    self.transition(step_id, "running", "done")
    _record(self, step_id, "running", "done")
    _bump_attempts(step_id)
    return {"step_id": step_id, "fence": self.lease.fence}


@shared_task(transition=("pending", "done"), max_retries=3, **STEP_TASK)
def retry_once(self, step_id, countdown=1.0):
    """``pending -> done`` on its second attempt: the first calls ``self.retry()``.

    The retry leaves the body inside the lease (nothing commits, the lease is
    released), so a manual resume (``advance``) can race the retried attempt.
    """
    if not self.request.retries:
        raise self.retry(countdown=countdown)
    _record(self, step_id, "pending", "done")
    _bump_attempts(step_id)
    return {"step_id": step_id, "fence": self.lease.fence, "retries": self.request.retries}


def _spin(seconds):
    """Compute for ``seconds`` without any I/O or sleep: a green pool gets no chance to
    switch greenlets meanwhile."""
    deadline = time.monotonic() + float(seconds)
    spins = 0
    while time.monotonic() < deadline:
        spins += sum(range(200))
    return spins


@shared_task(transition=("pending", "done"), lock_ttl=3, **STEP_TASK)
def spin(self, step_id, seconds):
    """``pending -> done`` after a CPU-bound body of ``seconds`` (no I/O) under a 3 s TTL:
    the lease must outlive the body by renewals alone (the pools tests)."""
    fence = self.lease.fence
    # Told before the computing starts (its last I/O): a test sends its next tasks once the
    # body blocks its worker, not while a green pool may still start one beside it.
    get_lease_store(self.app).client.set(f"tests:spin-body:{step_id}", "1", ex=120)
    _spin(seconds)
    self.lease.check()
    _record(self, step_id, "pending", "done")
    _bump_attempts(step_id)
    return {
        "step_id": step_id,
        "fence": fence,
        "owner": self.lease.owner,
        "retries": self.request.retries,
        "pid": os.getpid(),
    }


@shared_task
def plain(x):
    """A plain Celery task without any lock (baseline for benchmarks)."""
    return x


#: A lease on ``step:<id>`` without a step model: no transaction around the body.
LEASE_ONLY = dict(bind=True, base=StepLockedTask, acks_late=True, lock_key="step:{step_id}")


@shared_task(**LEASE_ONLY)
def hold(self, step_id, seconds):
    """Hold the ``step:<step_id>`` lease for ``seconds``, checking it between slices.

    No step row is touched: used by the heartbeat / SIGKILL tests.
    """
    _hold(self, seconds)
    lease = self.lease
    return {"step_id": step_id, "owner": lease.owner, "fence": lease.fence, "pid": os.getpid()}


@shared_task(**LEASE_ONLY)
def claim_and_hold(self, step_id, seconds):
    """Claim the step (``pending -> running``, committed at once), hold the lease for
    ``seconds``, then finish it (``running -> done``).

    Without ``step_model`` StepLockedTask opens no transaction around the body, so each phase
    commits on its own: the claim is visible while the lease is held, which is what a worker
    killed during the hold leaves behind (a ``running`` step whose ``lock_owner`` is the dead
    attempt's owner token) and what the reaper recovers. Both transitions are fenced by the
    lease's owner/fence; the last one commits only if the lease is still ours.
    """
    lease = self.lease
    guard = DjangoStepStore(Step)
    with transaction.atomic():
        guard.transition(step_id, "pending", "running", owner=lease.owner, fence=lease.fence)
    _hold(self, seconds)
    with transaction.atomic():
        guard.transition(step_id, "running", "done", owner=lease.owner, fence=lease.fence)
        if get_lease_store(self.app).owned(lease.name, lease.owner) is None:
            raise LockLost(
                f"lease {lease.key} lost before the commit",
                key=lease.key,
                owner=lease.owner,
                fence=lease.fence,
            )
    return {"step_id": step_id, "owner": lease.owner, "fence": lease.fence, "pid": os.getpid()}


@effects.register("workflows.effect_seen")
def effect_seen(*args, idempotency_key, **kwargs):
    """A registered effect callable (``effects.call``): records the key it was called with
    in Redis, so a test sees the dispatch and its key."""
    from celery import current_app

    get_lease_store(current_app).client.rpush("tests:effects-seen", idempotency_key)


@shared_task(transition=("pending", "done"), **STEP_TASK)
def declare_effects(self, step_id, count=2, fail=False, lose_lease=False):
    """``pending -> done`` declaring ``count`` effects (a published task and registered
    calls) in its body: they are written with the transition, or not at all. ``fail``
    raises after declaring; ``lose_lease`` deletes the lease's key, so the ownership check
    before COMMIT finds it gone."""
    for position in range(count):
        if position % 2:
            effects.call("workflows.effect_seen", step_id, position=position)
        else:
            effects.publish("workflows.tasks.noop_effect", args=[step_id, position])
    if lose_lease:
        get_lease_store(self.app).client.delete(self.lease.key)
    if fail:
        raise RuntimeError("the body failed after declaring its effects")
    return {"step_id": step_id, "fence": self.lease.fence}


@shared_task(name="workflows.tasks.noop_effect")
def noop_effect(step_id, position):
    """The task ``declare_effects`` publishes (does nothing)."""
    return [step_id, position]
