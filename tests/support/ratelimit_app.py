"""The example project's Celery app with cluster-rate-limited tasks, for real workers
(``celery -A tests.support.ratelimit_app worker``): each execution appends one JSON record
to the Redis list ``RL_HISTORY`` (default ``rl:history``): the task's kind and index, the
Redis time its rate limit granted it (``granted``, from the ``rate_limit_allowed`` signal;
None for Celery's own ``rate_limit``), the Redis time its body started (``start``), its
process, its lease retries and the rate-limit ticket it was admitted with. The limits come
from the environment: ``RL_LIMIT`` grants per ``RL_WINDOW`` seconds (sliding window; tickets
for turns up to 30 s away; Celery's per-worker ``rate_limit`` of the same figures for the
negative control), ``RL_RATE`` per second with ``RL_CAPACITY`` (bucket)."""

import json
import os
import threading

from celery import Task

from celery_steplock import SlidingWindow, StepLockedTask, TokenBucket, signals
from django_app.celery import app

__all__ = ["app"]

HISTORY = os.environ.get("RL_HISTORY", "rl:history")
LIMIT = int(os.environ.get("RL_LIMIT", "5"))
WINDOW = float(os.environ.get("RL_WINDOW", "1"))
RATE = float(os.environ.get("RL_RATE", "5"))
CAPACITY = int(os.environ.get("RL_CAPACITY", "2"))

_granted = threading.local()


@signals.rate_limit_allowed.connect
def _remember(sender=None, granted_at=None, ticket=None, **kwargs):
    _granted.value = granted_at
    _granted.ticket = ticket


def _record(task, kind, index):
    client = task.steplock_plan.store.client if hasattr(task, "steplock_plan") else _client()
    seconds, micros = client.time()
    request = task.request
    retries = int(
        (request.headers or {}).get("steplock_retries")
        or getattr(request, "steplock_retries", 0)
        or 0
    )
    client.rpush(
        HISTORY,
        json.dumps(
            {
                "kind": kind,
                "i": index,
                "granted": getattr(_granted, "value", None),
                "start": seconds + micros / 1e6,
                "pid": os.getpid(),
                "retries": retries,
                "worker": request.hostname,
                "ticket": getattr(_granted, "ticket", None),
            }
        ),
    )
    _granted.value = _granted.ticket = None


_clients = []


def _client():
    if not _clients:
        from celery_steplock.lock import make_client

        _clients.append(make_client(os.environ["REDIS_URL"]))
    return _clients[0]


@app.task(
    bind=True,
    base=StepLockedTask,
    name="rl.window",
    lock_key="rl:w:{index}",
    cluster_rate_limit=SlidingWindow(LIMIT, WINDOW, max_wait=30),
    acks_late=True,
    reject_on_worker_lost=True,
)
def window(self, index):
    _record(self, "window", index)


@app.task(
    bind=True,
    base=StepLockedTask,
    name="rl.bucket",
    lock_key="rl:b:{index}",
    cluster_rate_limit=TokenBucket(RATE, CAPACITY, max_wait=30),
    acks_late=True,
    reject_on_worker_lost=True,
)
def bucket(self, index):
    _record(self, "bucket", index)


def _celery_rate(limit: int, window: float) -> str:
    return f"{limit / window:g}/s"


@app.task(bind=True, base=Task, name="rl.celery", rate_limit=_celery_rate(LIMIT, WINDOW))
def celery_limited(self, index):
    _record(self, "celery", index)
