"""Worker tasks of the mixed sync/async evidence (tests/aio/test_mixed.py), loaded by the real
workers with ``-I tests.aio.mixed_tasks``.

Every body records what it did in the test's Redis (``REDIS_URL``) so the test reads what
every worker process did beside its own asyncio holders: the records are JSON lists
``[side, n, start, end, fence, key]`` (Redis ``TIME`` seconds) in ``mx:runs:<what>``, and
a gauge ``mx:in:<what>`` (INCR on entry, DECR on exit) whose value at entry is pushed to
``mx:gauge:<what>``, and a counter ``mx:count:<what>`` incremented by a read at entry and a
write at exit (so it loses updates whenever two holders overlap). The async holders of the test write the same records with ``side``
"async", through ``redis.asyncio``.

The pattern objects here are built without an app (Celery's current app, the workers'
``django_app``): the test builds equal ones on its own app, so sharing is by name and
figures, as between two processes.
"""

import json
import os
import random
import threading
import time

from celery_steplock import signals
from celery_steplock.exceptions import CircuitOpen
from celery_steplock.lock import make_client
from celery_steplock.patterns.breaker import CircuitBreaker
from celery_steplock.patterns.ratelimit import SlidingWindow
from celery_steplock.patterns.concurrency import current_slot
from celery_steplock.task import StepLockedTask
from django_app.celery import app

LEASE = "mx-lease"  # the one lease name
RATE_LIMIT, RATE_WINDOW = 5, 60.0  # admissions per (long) window
RATE_KEY = "mx-rate"
SLOTS, SLOTS_KEY = 2, "mx-slots"
BREAKER = dict(failure_threshold=3, window=3, recovery_timeout=60.0, state_cache=0)
IDEM_KEY = "mx-order:{order}"

_clients: dict[int, object] = {}
_guard = threading.Lock()


def client():
    pid = os.getpid()
    with _guard:
        if pid not in _clients:
            _clients[pid] = make_client(os.environ["REDIS_URL"])
        return _clients[pid]


def now(r) -> float:
    seconds, micros = r.time()
    return seconds + micros / 1e6


def held(what, n, fence, key, seconds):
    """The critical section of a worker holder: gauge in, read the counter, a timed sleep,
    write the counter + 1 (lost updates unless the holders exclude each other), gauge out."""
    r = client()
    r.rpush(f"mx:gauge:{what}", r.incr(f"mx:in:{what}"))
    count = int(r.get(f"mx:count:{what}") or 0)  # read-modify-write: exact only when alone
    start = now(r)
    time.sleep(seconds)
    end = now(r)
    r.set(f"mx:count:{what}", count + 1)
    r.decr(f"mx:in:{what}")
    r.rpush(f"mx:runs:{what}", json.dumps(["worker", n, start, end, fence, key]))
    return "done"


# -- 1. one lease ---------------------------------------------------------------------------


@app.task(bind=True, base=StepLockedTask, name="mx.leased", lock_key=LEASE, lock_wait=30)
def leased(self, n, seconds=0.1):
    return held("lease", n, self.lease.fence, self.lease.key, seconds)


# -- 2. one rate limit --------------------------------------------------------------------------


@app.task(
    bind=True,
    base=StepLockedTask,
    name="mx.rated",
    lock_key="mx-rated:{n}",
    cluster_rate_limit=SlidingWindow(RATE_LIMIT, RATE_WINDOW, key=RATE_KEY),
)
def rated(self, n):
    client().rpush("mx:rate:bodies", n)
    return n


def _decided(outcome):
    def receiver(sender=None, task_name=None, task_id=None, **fields):
        if task_name == "mx.rated":
            client().rpush("mx:rate:worker", json.dumps([outcome, task_id, fields.get("key")]))

    return receiver


if os.environ.get("MX_WORKER") == "1":  # the workers' decisions, counted in Redis
    signals.rate_limit_allowed.connect(_decided("allowed"), weak=False)
    signals.rate_limited.connect(_decided("denied"), weak=False)


# -- 3. one concurrency limit -------------------------------------------------------------------


@app.task(
    bind=True,
    base=StepLockedTask,
    name="mx.slotted",
    lock_key="mx-slotted:{n}",
    concurrency_limit=SLOTS,
    concurrency_limit_key=SLOTS_KEY,
)
def slotted(self, n, seconds=0.25, what="slots"):
    slot = current_slot()
    return held(what, n, slot.fence, slot.lease.key, seconds)


def _limited(sender=None, limit_key=None, free=None, **fields):
    if limit_key == SLOTS_KEY:  # a worker task refused a slot: when (Redis TIME), free slots
        r = client()
        r.rpush("mx:slots:refused", json.dumps([now(r), free]))


if os.environ.get("MX_WORKER") == "1":
    signals.concurrency_limited.connect(_limited, weak=False)


# -- 4. one breaker -------------------------------------------------------------------------------


def dependency(label):
    """The outbound call: counted; fails while ``mx:mode`` is "fail"."""
    r = client()
    r.incr(f"mx:calls:{label}")
    if (r.get("mx:mode") or "ok") == "fail":
        raise ConnectionError("the dependency is down")
    return "ok"


@app.task(name="mx.through_breaker")
def through_breaker(name):
    """A sync call through the breaker ``name`` (the plain API, in a worker process): its
    outcome or its refusal, as values."""
    try:
        return {"result": CircuitBreaker(name, **BREAKER).call(dependency, name)}
    except CircuitOpen as exc:
        return {"refused": type(exc).__name__, "state": exc.context.get("state")}
    except ConnectionError as exc:
        return {"failed": str(exc)}


@app.task(
    bind=True,
    base=StepLockedTask,
    name="mx.gated_breaker",
    lock_key="mx-gated:{n}",
    circuit_breaker=CircuitBreaker("mx-brk-gate", **BREAKER),
)
def gated_breaker(self, n):
    """The task option: the gate admits the execution; the body's failure is recorded."""
    return dependency("mx-brk-gate")


def _rejected(sender=None, name=None, **fields):
    client().rpush(f"mx:rejected:{name}", os.getpid())


if os.environ.get("MX_WORKER") == "1":
    signals.circuit_rejected.connect(_rejected, weak=False)


# -- 5. one idempotency key ------------------------------------------------------------------


def _fresh_lock_name(order, amount):
    # A lock name of its own per execution: the record, not the lease, keeps the deliveries
    # of one key apart.
    return f"mx-charge:{order}:{random.getrandbits(64)}"


@app.task(
    bind=True,
    base=StepLockedTask,
    name="mx.charge",
    lock_key=_fresh_lock_name,
    idempotency_key=IDEM_KEY,
)
def charge(self, order, amount):
    r = client()
    r.incr(f"mx:idem:starts:{order}")
    r.rpush(f"mx:idem:began:{order}", "worker")
    time.sleep(float(os.environ.get("MX_IDEM_SLEEP", "1.0")))
    r.incr(f"mx:idem:done:{order}")
    return {"order": order, "charged": amount, "by": "worker", "pid": os.getpid()}
