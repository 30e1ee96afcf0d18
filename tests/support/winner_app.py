"""The example project's Celery app with step tasks whose duplicates return the winner's
result (``on_conflict="return_winner"``), for real workers
(``celery -A tests.support.winner_app worker``) and the tests that send to them
(tests/test_outcomes_winner_workers.py).

All of them move a ``workflows.Step`` from ``pending`` to ``done`` under the lease
``winner:<step id>``: ``charge`` (``return_winner``), ``charge_plain`` (the default
``on_conflict="return"``) and ``charge_quietly`` (``return_winner`` with ``ignore_result``:
a winner whose result is never stored). ``echo`` is a plain task a chain passes the
previous task's return value to.
"""

import time

from celery import shared_task

from celery_steplock import StepLockedTask
from django_app.celery import app

__all__ = ["app", "charge", "charge_plain", "charge_quietly", "echo"]

# A duplicate returns the winner's result only when the stored state names the task
# (celery_steplock.W012): the workers of these tasks store extended results.
app.conf.result_extended = True

STEP = dict(
    bind=True,
    base=StepLockedTask,
    acks_late=True,
    lock_key="winner:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
)


def _body(task, step_id, delay):
    time.sleep(float(delay))
    return {"step_id": step_id, "by": task.request.id, "fence": task.lease.fence}


@shared_task(name="tests.winner.charge", on_conflict="return_winner", **STEP)
def charge(self, step_id, delay=0.0):
    return _body(self, step_id, delay)


@shared_task(name="tests.winner.charge_plain", **STEP)
def charge_plain(self, step_id, delay=0.0):
    return _body(self, step_id, delay)


@shared_task(
    name="tests.winner.charge_quietly", on_conflict="return_winner", ignore_result=True, **STEP
)
def charge_quietly(self, step_id, delay=0.0):
    return _body(self, step_id, delay)


@shared_task(name="tests.winner.echo")
def echo(value):
    return {"got": value}
