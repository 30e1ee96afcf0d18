from celery import shared_task

from celery_steplock import DjangoStepLockedTask

from .models import Charge


@shared_task(
    bind=True,
    base=DjangoStepLockedTask,
    acks_late=True,
    reject_on_worker_lost=True,
    lock_key="order:{order_id}",
    step_model="orders.Order",
    step_id_arg="order_id",
    transition=("pending", "charged"),
    lock_retry_max=2,
)
def charge(self, order_id, fail=False):
    Charge.objects.create(
        order_id=order_id, idempotency_key=self.lease.idempotency_key, fence=self.lease.fence
    )
    if fail:
        raise RuntimeError("the gateway said no")
    return {"order": order_id, "key": self.lease.key}
