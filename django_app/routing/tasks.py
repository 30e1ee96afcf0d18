"""Tasks of the routing tests: one per step model, each a one-transition step.

The bodies write the step row through the router (``Model.objects``), as application code
does: those writes commit with the compare-and-swap only when they go to the step's write
database, which is what the tests assert. ``Ledger``'s task names its database with
``step_database``; its body writes there with ``.using()``.
"""

import os
import time

from celery import shared_task
from django.db.models import F

from celery_steplock import StepLockedTask

from .models import Invoice, Ledger, Parcel

SLICE = 0.05

OPTIONS = dict(bind=True, base=StepLockedTask, acks_late=True, reject_on_worker_lost=True)


def _work(task, manager, step_id, delay):
    deadline = time.monotonic() + float(delay)
    task.lease.check()
    while time.monotonic() < deadline:
        time.sleep(min(SLICE, max(0.0, deadline - time.monotonic())))
        task.lease.check()
    manager.filter(pk=step_id).update(
        attempts=F("attempts") + 1, note=f"{os.getpid()}:{task.lease.owner}"
    )
    return {
        "step_id": step_id,
        "owner": task.lease.owner,
        "fence": task.lease.fence,
        "pid": os.getpid(),
        "database": task.steplock_plan.steps.using,
    }


@shared_task(
    lock_key="invoice:{invoice_id}",
    step_model="routing.Invoice",
    step_id_arg="invoice_id",
    transition=("pending", "paid"),
    **OPTIONS,
)
def pay_invoice(self, invoice_id, delay=0.0):
    return _work(self, Invoice.objects, invoice_id, delay)


@shared_task(
    lock_key="parcel:{parcel_id}",
    step_model="routing.Parcel",
    step_id_arg="parcel_id",
    transition=("pending", "shipped"),
    **OPTIONS,
)
def ship_parcel(self, parcel_id, delay=0.0):
    return _work(self, Parcel.objects, parcel_id, delay)


@shared_task(
    lock_key="ledger:{ledger_id}",
    step_model="routing.Ledger",
    step_id_arg="ledger_id",
    transition=("pending", "posted"),
    step_database="other",
    **OPTIONS,
)
def post_ledger(self, ledger_id, delay=0.0):
    return _work(self, Ledger.objects.using("other"), ledger_id, delay)
