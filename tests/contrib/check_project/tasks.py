"""A StepLockedTask with mistakes in its options (imported by check_project.settings only)."""

from celery import shared_task

from celery_steplock import StepLockedTask


@shared_task(
    bind=True,
    base=StepLockedTask,
    acks_late=True,
    lock_tll=5,  # unknown option: W005, did you mean lock_ttl?
    lock_ttl=-1,  # E004
    on_conflict="clobber",  # E004
    lock_key="order:{order}",  # E004: no argument named order
    step_id_arg="id",  # E004: no argument named id
    step_model="workflows.Step",
    transition=("pending", "done"),
)
def charge(self, order_id):
    return order_id
