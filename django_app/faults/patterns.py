"""Step tasks of the randomized fault run (``tests/support/faults/nemesis.py``) that use the
distributed patterns on the fault suite's step model: a cluster-wide rate limit, a
concurrency limit, a circuit breaker around a fake dependency and an idempotency key.

Each moves its step ``pending -> done`` through :class:`~django_app.faults.tasks.FaultTask`
(the probe's barriers, a ``TransitionRecord`` per committed transition), so the run's checker
sees them as it sees ``forward``. The limits are module constants: the controller writes them
into the run's description (``run.json``, ``limits``) and the checker holds the history to
them.

The fake dependency fails while the control Redis key ``faults:dep:failing`` exists (the
controller sets it, with an expiry, for bursts): its failures open the breaker, its recovery
lets the half-open probes close it again.
"""

import os

from celery import current_app, shared_task

from celery_steplock import CircuitBreaker, SlidingWindow

from . import probe
from .tasks import OPTIONS, _body

RATE_NAME = "nemesis"
RATE = "5/s"
RATE_LIMIT = 5  # grants
RATE_WINDOW = 1.0  # seconds
SLOTS_KEY = "nemesis-slots"
SLOTS = 2
BREAKER_NAME = "nemesis-dep"
DEP_FAILING = "faults:dep:failing"

# A killed idempotent holder keeps its record locked for this long (600 s by default): a run
# that must settle within a bound needs it short (a live body's record is renewed by its
# heartbeat, so it need not outlast the longest body).
if probe.enabled():
    current_app.conf.steplock_idempotency_lock_ttl = float(
        os.environ.get("STEPLOCK_FAULTS_IDEMPOTENCY_LOCK_TTL", "8")
    )

breaker = CircuitBreaker(
    BREAKER_NAME,
    failure_threshold=2,
    window=4,
    recovery_timeout=1.5,
    half_open_probes=1,
    success_threshold=1,
    probe_timeout=15.0,
)


class DependencyDown(Exception):
    """The fake dependency failed (the controller's burst)."""


def rate_key(prefix: str = "steplock") -> str:
    """The lock-store key of the rate limit (the ``key`` of its ``rate_limit_allowed``)."""
    return SlidingWindow(RATE).redis_key(prefix, RATE_NAME)[0]


def limits(prefix: str = "steplock") -> dict:
    """The configured limits, in the shape of the run description's ``limits``."""
    return {
        "rate": {rate_key(prefix): {"limit": RATE_LIMIT, "window": RATE_WINDOW}},
        "concurrency": {SLOTS_KEY: SLOTS},
    }


@shared_task(
    transition=("pending", "done"),
    cluster_rate_limit=RATE,
    cluster_rate_limit_key=RATE_NAME,
    **OPTIONS,
)
def rate_forward(self, step_id, work=0.0):
    """pending -> done, at most ``RATE`` across the cluster."""
    return _body(self, step_id, work)


@shared_task(
    transition=("pending", "done"),
    concurrency_limit=SLOTS,
    concurrency_limit_key=SLOTS_KEY,
    **OPTIONS,
)
def slot_forward(self, step_id, work=0.5):
    """pending -> done holding one of ``SLOTS`` slots for ``work`` seconds."""
    return _body(self, step_id, work)


@shared_task(transition=("pending", "done"), circuit_breaker=breaker, **OPTIONS)
def breaker_forward(self, step_id, work=0.0):
    """pending -> done after calling the fake dependency, which fails while the controller
    says so: ``DependencyDown`` fails the task (a Celery retry would be a control exception
    the breaker does not count), the step stays pending until it is sent again."""
    probe.barrier("after_acquire", self, step_id)
    if probe._redis().exists(DEP_FAILING):
        raise DependencyDown("the fake dependency is failing")
    probe.work(self, work)
    return {"step_id": step_id, "owner": self.lease.owner, "fence": self.lease.fence}


@shared_task(transition=("pending", "done"), idempotency_key="idem:{step_id}", **OPTIONS)
def idem_forward(self, step_id, work=0.0):
    """pending -> done with an idempotency record per step: the body runs once per key."""
    probe.record(
        "idem_body",
        key=probe.idempotency_key_of(self.request.id),
        task_id=self.request.id,
        step=step_id,
        owner=self.lease.owner if self.lease else None,
    )
    return _body(self, step_id, work)
