"""Tasks of the concurrency-limit evidence (tests/patterns/test_concurrency_workers.py), loaded by
the real workers with ``--include tests.patterns.concurrency_tasks``.

Each body works in units and records every unit it completed while holding its slot as
``[n, start, end, pid, fence]`` (Redis ``TIME`` seconds) in the list ``bk:runs:<group>``: a
unit counts only when the slot was still valid after it (``current_slot().check()``), as a
fenced effect would. ``unlimited`` is the negative control: the same body without the
limit, whose executions wait for each other at a barrier so that they overlap.
"""

import json
import os
import time

import redis

from celery_steplock import StepLockedTask
from celery_steplock.patterns.concurrency import current_slot
from celery_steplock.exceptions import LockLost
from django_app.celery import app

_client = None


def client():
    global _client
    if _client is None:
        _client = redis.Redis.from_url(os.environ["REDIS_URL"], decode_responses=True)
    return _client


def now(r):
    seconds, micros = r.time()
    return seconds + micros / 1e6


def work(group, n, units, unit_seconds, slot):
    r = client()
    if slot is not None:
        r.set(
            f"bk:holder:{group}:{n}",
            json.dumps({"pid": os.getpid(), "owner": slot.owner, "key": slot.lease.key}),
            ex=120,
        )
    try:
        for _ in range(units):
            start = now(r)
            time.sleep(unit_seconds)
            end = now(r)
            if slot is not None:
                slot.check()
            r.rpush(
                f"bk:runs:{group}",
                json.dumps([n, start, end, os.getpid(), slot.fence if slot else None]),
            )
    except LockLost:
        r.rpush(f"bk:lost:{group}", n)
        return "lost"
    r.rpush(f"bk:done:{group}", n)
    return "done"


@app.task(
    bind=True,
    base=StepLockedTask,
    name="bk.limited",
    lock_key="bk:{group}:{n}",
    concurrency_limit=2,
    concurrency_limit_key="bk:{group}",
)
def limited(self, group, n, units=1, unit_seconds=0.3):
    return work(group, n, units, unit_seconds, current_slot())


@app.task(
    bind=True,
    base=StepLockedTask,
    name="bk.single",
    lock_key="bk:{group}:{n}",
    concurrency_limit=1,
    concurrency_limit_key="bk:{group}",
)
def single(self, group, n, units=1, unit_seconds=0.3):
    return work(group, n, units, unit_seconds, current_slot())


@app.task(bind=True, base=StepLockedTask, name="bk.unlimited", lock_key="bk:{group}:{n}")
def unlimited(self, group, n, barrier=3, units=1, unit_seconds=0.3):
    r = client()
    r.incr(f"bk:barrier:{group}")
    deadline = time.monotonic() + 20
    while int(r.get(f"bk:barrier:{group}")) < barrier and time.monotonic() < deadline:
        time.sleep(0.01)
    return work(group, n, units, unit_seconds, None)
