"""Reading held leases for people: the Celery app of the Django project, and bounded,
cursor-paginated pages of leases for the admin (and anything else that shows them).

A page is built from whole ``SCAN`` steps: a SCAN cursor can only resume *between* steps, so
stopping inside one would skip or repeat keys. Following ``next_cursor`` from 0 until it is 0
again visits every lease that was held for the whole walk (Redis's SCAN guarantee); a lease
acquired or released meanwhile may or may not appear, and Redis may return a key twice while
it rehashes. The work per page is bounded by ``max_steps`` SCAN round trips whatever the
number of leases, so the first page stays fast with 100,000 of them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ...exceptions import LockStoreUnavailable
from ...lock import STORE_ERRORS, RedisStepLock

__all__ = ["celery_app", "lease_lock", "steplock_task_names", "LeasePage", "lease_page",
           "matches", "redis_time_ms"]


def celery_app():
    """The project's Celery app: ``celery.current_app`` (a Django project's ``celery.py``
    creates it with ``set_as_current=True`` and imports it from the project package)."""
    from celery import current_app

    return current_app._get_current_object()


def lease_lock(app=None) -> RedisStepLock:
    """The process's :class:`RedisStepLock` for ``app`` (default :func:`celery_app`).

    Raises ImproperlyConfigured for an invalid ``steplock_redis_url``/prefix setting.
    """
    from ...task import get_lock

    return get_lock(app or celery_app())


def steplock_task_names(app=None) -> list[str]:
    """Sorted names of the app's registered :class:`StepLockedTask` tasks (finalizes the
    app, which imports the tasks modules of installed apps)."""
    from ...task import StepLockedTask

    app = app or celery_app()
    return sorted(name for name, task in app.tasks.items() if isinstance(task, StepLockedTask))


def redis_time_ms(lock: RedisStepLock) -> int:
    """The Redis server's clock in milliseconds: leases record Redis time, so ages are
    computed on the same clock. Raises LockStoreUnavailable."""
    try:
        seconds, micros = lock.client.time()
    except STORE_ERRORS as exc:
        raise LockStoreUnavailable(f"lock store unavailable: {exc}") from exc
    return int(seconds) * 1000 + int(micros) // 1000


def matches(info: Mapping[str, Any], q: str = "", task_name: str = "") -> bool:
    """Whether a lease dict passes the admin's search ``q`` and task name filter.

    ``task_name`` must equal the lease's task name. ``q`` is case-insensitive:

    * all digits: a step id, matched exactly against the step's primary key
      (``"workflows.step:42"``) or the last ``:`` part of the lock name (``"step:42"``), so
      ``42`` never finds step 142;
    * otherwise: a substring of the task name, the lock name or the step label
      (``"app_label.model:pk"``), or a prefix of the task id.
    """
    if task_name and info.get("task_name") != task_name:
        return False
    q = (q or "").strip().lower()
    if not q:
        return True
    step = (info.get("step") or "").lower()
    name = (info.get("name") or "").lower()
    if q.isdigit():
        return (bool(step) and step.rpartition(":")[2] == q) or name.rpartition(":")[2] == q
    if (info.get("task_id") or "").lower().startswith(q):
        return True
    return any(q in text for text in ((info.get("task_name") or "").lower(), name, step))


@dataclass
class LeasePage:
    """One page of leases.

    ``leases``: the lease dicts (as :meth:`RedisStepLock.scan` returns them) that passed the
    filter, oldest acquisition first; ``cursor``: the SCAN cursor this page started at;
    ``next_cursor``: where the next page starts (0: the walk is complete); ``examined``:
    lease keys read; ``steps``: SCAN round trips made; ``now_ms``: Redis server time.
    """

    cursor: int
    next_cursor: int
    leases: list[dict[str, Any]] = field(default_factory=list)
    examined: int = 0
    steps: int = 0
    now_ms: int | None = None
    elapsed: float = 0.0

    @property
    def complete(self) -> bool:
        return self.next_cursor == 0


def lease_page(lock: RedisStepLock, cursor: int = 0, per_page: int = 100, *,
               predicate: Callable[[Mapping[str, Any]], bool] | None = None,
               scan_count: int | None = None, max_steps: int = 10) -> LeasePage:
    """Read one page of leases starting at SCAN ``cursor``.

    Makes SCAN steps (``scan_count`` keys examined per step, default ``per_page``) until at
    least ``per_page`` leases passed ``predicate`` (default: all), the walk completed, or
    ``max_steps`` steps were made. A page can hold a few more than ``per_page`` leases (the
    last step is kept whole) or none at all (a filter that matched nothing within the
    budget: follow ``next_cursor``). Raises LockStoreUnavailable.
    """
    started = time.monotonic()
    count = scan_count or per_page
    page = LeasePage(cursor=cursor, next_cursor=cursor)
    seen: set[str] = set()
    next_cursor = cursor
    while True:
        next_cursor, leases = lock.scan(next_cursor, count)
        page.steps += 1
        page.examined += len(leases)
        for info in leases:
            # SCAN may return a key twice while Redis rehashes: show it once per page.
            if info["key"] in seen:
                continue
            seen.add(info["key"])
            if predicate is None or predicate(info):
                page.leases.append(info)
        if next_cursor == 0 or len(page.leases) >= per_page or page.steps >= max_steps:
            break
    page.next_cursor = next_cursor
    page.now_ms = redis_time_ms(lock)
    page.leases.sort(key=lambda info: (int(info.get("acquired_ms") or 0), info["name"]))
    page.elapsed = time.monotonic() - started
    return page
