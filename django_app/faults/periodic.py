"""A periodic task of the randomized fault run under the overlap guard: several
senders send it every interval, its run lasts longer than the interval, and under
``overlap="skip"`` no two runs of it may run at once (``tests/support/faults/overlap_rules.py``
judges the history; ``tests/support/faults/periodic_load.py`` sends it).

``periodic_skip`` is the guarded task (``lock_key`` :data:`LOCK_NAME`: one lease for every
send). ``periodic_unguarded`` is its negative control: the same body as a plain Celery task,
no lease, so two sends run at once whenever two workers are free.

Each run writes two history entries through the probe (``STEPLOCK_FAULTS=1``):
``periodic_start`` when the body begins and ``periodic_end`` when it ends (normally, or with
``LockLost`` when its lease was found lost: the body checks it every
:data:`~django_app.faults.probe.SLICE` seconds), each with ``rt``, the control Redis's
``TIME`` in seconds (one clock for every process), ``name`` (:data:`NAME`), ``task_id``,
``owner`` and ``fence`` of its lease (None unguarded), ``sent_by`` (the sender's index);
the end carries ``start_rt`` and ``outcome`` ("done" or "lost"). A send that found the lease
held writes ``periodic_skipped`` (from the ``overlap_skipped`` signal: ``holder``,
``reason``).
"""

from __future__ import annotations

import time

from celery import shared_task

from celery_steplock import StepLockedTask, signals
from celery_steplock.exceptions import LockLost

from . import probe

NAME = "faults-periodic"
LOCK_NAME = "faults-periodic"
RUN = 2.5  # seconds a run lasts by default: longer than the senders' interval

PERIODIC_OPTIONS = dict(bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True)


def redis_time() -> float:
    """The control Redis's TIME, seconds."""
    seconds, micros = probe._redis().time()
    return seconds + micros / 1_000_000


def _run(task, run: float, name: str, sent_by) -> dict:
    lease = getattr(task, "lease", None)
    ident = {
        "name": name,
        "task_id": task.request.id,
        "owner": lease.owner if lease is not None else None,
        "fence": lease.fence if lease is not None else None,
        "sent_by": sent_by,
    }
    start = redis_time()
    probe.record("periodic_start", rt=start, **ident)
    outcome = "done"
    try:
        deadline = time.monotonic() + run
        while (left := deadline - time.monotonic()) > 0:
            if lease is not None:
                lease.check()
            time.sleep(min(probe.SLICE, left))
    except LockLost:
        outcome = "lost"
        raise
    finally:
        probe.record("periodic_end", rt=redis_time(), start_rt=start, outcome=outcome, **ident)
    return {"name": name, "start": start}


@shared_task(
    base=StepLockedTask,
    name="django_app.faults.periodic.periodic_skip",
    lock_key=LOCK_NAME,
    overlap="skip",
    **PERIODIC_OPTIONS,
)
def periodic_skip(self, run=RUN, name=NAME, sent_by=None):
    """The guarded periodic run: a send that finds the previous run holding the lease ends
    "skipped"."""
    return _run(self, run, name, sent_by)


@shared_task(name="django_app.faults.periodic.periodic_unguarded", **PERIODIC_OPTIONS)
def periodic_unguarded(self, run=RUN, name=NAME, sent_by=None):
    """The negative control: the same body without a lease."""
    return _run(self, run, name, sent_by)


def periodic_skipped(sender=None, **kw):
    record_name = getattr(sender, "name", None)
    if record_name != periodic_skip.name:
        return
    probe.record(
        "periodic_skipped",
        name=NAME,
        rt=redis_time(),
        task_id=getattr(getattr(sender, "request", None), "id", None),
        holder=kw.get("holder"),
        reason=kw.get("reason"),
    )


def connect() -> bool:
    """Connect the skip receiver (idempotent); nothing unless STEPLOCK_FAULTS=1."""
    if not probe.enabled():
        return False
    signals.overlap_skipped.connect(
        periodic_skipped, weak=False, dispatch_uid="faults-periodic-skipped"
    )
    return True
