"""Tasks of the idempotency worker tests (loaded by the workers with ``--include``).

Every body start and completion is counted in the test's Redis (``REDIS_URL``), so the test
sees what ran in every worker process. ``IDEM_VERSION`` sets the policy version and
``IDEM_LOCK_TTL`` the record's lock TTL of this worker process, ``IDEM_SLEEP`` how long
``charge`` sleeps when its ``sleep`` argument is 0.
"""

import os
import random
import time

from celery_steplock.lock import make_client
from celery_steplock.task import StepLockedTask
from django_app.celery import app
from tests.helpers import set_settings

if os.environ.get("IDEM_LOCK_TTL"):
    set_settings(app, steplock_idempotency_lock_ttl=float(os.environ["IDEM_LOCK_TTL"]))

_client = None


def counters():
    global _client
    if _client is None:
        _client = make_client(os.environ["REDIS_URL"])
    return _client


def _fresh_lock_name(order_id, amount, sleep=0.0):
    # A lock name of its own per execution: the record, not the lease, must keep the
    # concurrent deliveries of one key apart.
    return f"idem-charge:{order_id}:{random.getrandbits(64)}"


@app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.idem.charge",
    lock_key=_fresh_lock_name,
    idempotency_key="order:{order_id}",
    idempotency_version=os.environ.get("IDEM_VERSION", "1"),
)
def charge(self, order_id, amount, sleep=0.0):
    client = counters()
    client.incr(f"idem:starts:{order_id}")
    time.sleep(sleep or float(os.environ.get("IDEM_SLEEP", 0)))
    client.incr(f"idem:done:{order_id}")
    return {
        "order": order_id,
        "charged": amount,
        "pid": os.getpid(),
        "version": self.idempotency_version,
    }


@app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.idem.flaky",
    lock_key="flaky:{order_id}",
    idempotency_key="flaky:{order_id}",
)
def flaky(self, order_id):
    attempt = counters().incr(f"idem:flaky:{order_id}")
    if attempt == 1:
        raise ValueError("first attempt fails")
    return {"order": order_id, "attempt": attempt}
