"""A Celery app (no Django) with one periodic StepLockedTask under an overlap guard, for real
``celery beat`` and ``celery worker`` processes (``celery -A tests.support.overlap_app ...``).

Environment: ``REDIS_URL`` (broker and lock store), ``OVERLAP_POLICY`` (the task's
``overlap``: skip, coalesce, queue; empty: None), ``OVERLAP_RUN`` (seconds a run lasts, 3.5),
``OVERLAP_EVERY`` (seconds between a beat's sends, 1), ``OVERLAP_PREFIX`` (the key prefix of
the records, ``ovl``).

Records, in Redis (times are Redis ``TIME``, seconds as floats):

- ``<prefix>:sends``: one JSON ``{"id", "t"}`` per send of a beat (``after_task_publish``
  in the beat process: the message is in the broker; a lease retry is not a send);
- ``<prefix>:runs``: one JSON ``{"id", "start", "end", "pid"}`` per run of the body;
- ``<prefix>:skipped`` / ``<prefix>:coalesced``: counters of the ``overlap_skipped`` and
  ``overlap_coalesced`` signals (in the worker);
- ``<prefix>:running``: the runs in progress (INCR at the start, DECR at the end), and
  ``<prefix>:max_running``: the most seen at once.
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery
from celery.signals import after_task_publish

from celery_steplock import StepLockedTask, signals

__all__ = ["app", "periodic"]

URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
POLICY = os.environ.get("OVERLAP_POLICY") or None
RUN = float(os.environ.get("OVERLAP_RUN", "3.5"))
EVERY = float(os.environ.get("OVERLAP_EVERY", "1"))
PREFIX = os.environ.get("OVERLAP_PREFIX", "ovl")
NAME = "overlap.periodic"

app = Celery("overlap_app", broker=URL, set_as_current=False)
app.conf.update(
    steplock_redis_url=URL,
    steplock_key_prefix=f"{PREFIX}lock",
    steplock_default_ttl=2.0,
    steplock_retry_backoff=0.2,
    task_ignore_result=True,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    beat_schedule={"periodic": {"task": NAME, "schedule": EVERY}},
    beat_max_loop_interval=0.2,
)

_clients: dict[int, redis.Redis] = {}


def _client() -> redis.Redis:
    pid = os.getpid()  # one per process: prefork children do not share sockets
    if pid not in _clients:
        _clients[pid] = redis.Redis.from_url(URL)
    return _clients[pid]


def _now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1_000_000


@app.task(base=StepLockedTask, bind=True, name=NAME, lock_key="overlap-periodic", overlap=POLICY)
def periodic(self):
    client = _client()
    start = _now(client)
    running = client.incr(f"{PREFIX}:running")
    client.eval(
        "if tonumber(redis.call('GET', KEYS[1]) or '0') < tonumber(ARGV[1]) then "
        "redis.call('SET', KEYS[1], ARGV[1]) end",
        1,
        f"{PREFIX}:max_running",
        running,
    )
    try:
        time.sleep(RUN)
    finally:
        client.decr(f"{PREFIX}:running")
        end = _now(client)
        client.rpush(
            f"{PREFIX}:runs",
            json.dumps({"id": self.request.id, "start": start, "end": end, "pid": os.getpid()}),
        )
    return "ran"


@after_task_publish.connect(weak=False)
def _count_send(sender=None, headers=None, **kwargs):
    headers = headers or {}
    if sender != NAME or headers.get("steplock_retries"):
        return  # a lease retry re-publishes the same send
    client = _client()
    client.rpush(f"{PREFIX}:sends", json.dumps({"id": headers.get("id"), "t": _now(client)}))


@signals.overlap_skipped.connect(weak=False)
def _count_skipped(sender=None, **kwargs):
    _client().incr(f"{PREFIX}:skipped")


@signals.overlap_coalesced.connect(weak=False)
def _count_coalesced(sender=None, **kwargs):
    _client().incr(f"{PREFIX}:coalesced")
