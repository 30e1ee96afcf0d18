"""Reading held leases for people: the Celery app of the Django project and its task
modules, and bounded, cursor-paginated pages of leases for the admin (and anything else that
shows them).

Pages follow a ``SCAN`` walk: a SCAN cursor can only resume *between* steps, so a page is
made of whole steps and never stops inside one (that would skip or repeat keys). Following
``next_cursor`` from 0 until it is 0 again visits every lease that was held for the whole walk
(Redis's SCAN guarantee); a lease acquired or released meanwhile may or may not appear, and
Redis may return a key twice while it rehashes. A page is bounded twice, whatever the number
of leases: at most ``per_page`` rows (the ``COUNT`` of each step is sized so that its rows fit,
and a step that would overflow the page is read again with a smaller ``COUNT``), and at most
``max_steps`` SCAN round trips of at most ``max_count`` keys each.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ...exceptions import LockStoreUnavailable
from ...lock import STORE_ERRORS, RedisStepLock

__all__ = ["celery_app", "import_task_modules", "task_import_error", "lease_lock",
           "steplock_task_names", "LeasePage", "lease_page", "matches", "redis_time_ms"]

logger = logging.getLogger("celery_steplock")


def celery_app():
    """The project's Celery app: ``celery.current_app`` (a Django project's ``celery.py``
    creates it with ``set_as_current=True`` and imports it from the project package).

    Only the app: its task modules may not be imported yet (see :func:`import_task_modules`).
    """
    from celery import current_app

    return current_app._get_current_object()


# Apps whose task modules this process imported (or tried to), the import errors, and the
# apps being imported right now (Celery's Django fix-up runs the system checks while the
# modules are imported, and the checks come back here: that re-entry must return at once).
_imported: weakref.WeakSet[Any] = weakref.WeakSet()
_import_errors: weakref.WeakKeyDictionary[Any, BaseException] = weakref.WeakKeyDictionary()
_importing: weakref.WeakSet[Any] = weakref.WeakSet()
_import_lock = threading.RLock()


def import_task_modules(app=None) -> BaseException | None:
    """Import the task modules of ``app`` (default :func:`celery_app`) once per process.

    ``app.autodiscover_tasks()`` is lazy: it only connects to Celery's ``import_modules``
    signal, which a worker sends at startup. A web process or a ``manage.py`` command never
    sends it, so the tasks of ``tasks.py`` modules that nothing else imports are not
    registered there (finalizing the app does not import modules either). This sends it the
    public way, ``app.loader.import_default_modules()``: the autodiscovery runs, then the
    ``imports``/``include`` modules are imported.

    That call is idempotent but not cheap to repeat (Celery's Django fix-up also runs
    ``django.setup()`` and all of Django's system checks each time), hence once per process
    and app. It is skipped in a worker (the worker imported them at startup) and while the
    app registry is not ready (the autodiscovery lists the installed apps). Thread-safe; a
    call made while the modules are being imported (from a system check run by the fix-up)
    returns at once. An import error is logged and returned, then and on every later call
    (no retry: it would re-run the partial import and the checks at each request).
    """
    from django.apps import apps as django_apps
    from django.urls import get_script_prefix, set_script_prefix

    app = app or celery_app()
    with _import_lock:
        if app in _imported or app in _importing:
            return _import_errors.get(app)
        loader = app.loader
        if getattr(loader, "worker_initialized", False):
            _imported.add(app)  # a worker: init_worker imported them already
            return None
        if not django_apps.ready:
            return None  # too early; a later call imports them
        _importing.add(app)
        # The fix-up's django.setup() resets the thread's URL script prefix to "/" (or
        # FORCE_SCRIPT_NAME): keep the current request's (SCRIPT_NAME) prefix.
        prefix = get_script_prefix()
        try:
            loader.import_default_modules()
        except Exception as exc:  # noqa: BLE001 - reported (log, W003), never a crash here
            _import_errors[app] = exc
            logger.error("event=task_modules_import_failed app=%s error=%r", app.main, exc,
                         exc_info=exc)
        finally:
            set_script_prefix(prefix)
            _importing.discard(app)
            _imported.add(app)
        return _import_errors.get(app)


def task_import_error(app=None) -> BaseException | None:
    """The error :func:`import_task_modules` met for ``app`` in this process, if any."""
    return _import_errors.get(app or celery_app())


def lease_lock(app=None) -> RedisStepLock:
    """The process's :class:`RedisStepLock` for ``app`` (default :func:`celery_app`).

    Raises ImproperlyConfigured for an invalid ``steplock_redis_url``/prefix setting.
    """
    from ...task import get_lock

    return get_lock(app or celery_app())


def steplock_task_names(app=None) -> list[str]:
    """Sorted names of the app's registered :class:`StepLockedTask` tasks.

    Imports the app's task modules first (:func:`import_task_modules`, once per process);
    reading ``app.tasks`` then finalizes the app, which registers the tasks those modules
    declared (finalizing alone imports nothing).
    """
    from ...task import StepLockedTask

    app = app or celery_app()
    import_task_modules(app)
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
    filter, oldest acquisition first, at most ``per_page`` of them; ``cursor``: the SCAN
    cursor this page started at; ``next_cursor``: where the next page starts (0: the walk is
    complete); ``examined``: lease keys of the SCAN steps this page covers (those shown and
    those the filter left out); ``read``: lease keys read, ``examined`` plus those of steps
    that would have overflowed the page (read again with a smaller COUNT, or left to the
    next page); ``steps``: SCAN round trips made (``rescans`` of them re-read a step);
    ``now_ms``: Redis server time;
    ``db_keys``: the size of the Redis database (all keys, leases or not).
    """

    cursor: int
    next_cursor: int
    per_page: int = 100
    leases: list[dict[str, Any]] = field(default_factory=list)
    examined: int = 0
    read: int = 0
    steps: int = 0
    rescans: int = 0
    now_ms: int | None = None
    db_keys: int | None = None
    elapsed: float = 0.0

    @property
    def complete(self) -> bool:
        return self.next_cursor == 0

    @property
    def short(self) -> bool:
        """The page stopped (at its budget of round trips) before it had its leases, and the
        walk goes on: later pages may hold more (a filter that matches few leases)."""
        return not self.complete and len(self.leases) < self.per_page


def _next_count(page: LeasePage, filtered: bool, max_count: int) -> int:
    """COUNT of the next SCAN step.

    SCAN returns whole hash buckets, so a step usually returns a key or two more than its
    COUNT: ask for the rows still missing less a small margin. With a filter, ask for the
    keys that should hold 80% of the missing rows at the match rate seen so far (counting
    one match more than seen, so a filter that matched nothing yet reads ``max_count``).
    """
    remaining = page.per_page - len(page.leases)
    count = max(1, remaining - 2 - remaining // 20)
    if filtered:
        rate = (len(page.leases) + 1) / (page.examined + 1)
        count = max(count, min(max_count, int(0.8 * remaining / rate)))
    return count


def _full(page: LeasePage) -> bool:
    """The page has its rows: ``per_page`` less 5% (chasing the last few would cost round
    trips of a key or two)."""
    return len(page.leases) >= page.per_page - page.per_page // 20


def lease_page(lock: RedisStepLock, cursor: int = 0, per_page: int = 100, *,
               predicate: Callable[[Mapping[str, Any]], bool] | None = None,
               max_count: int | None = None, max_steps: int = 10) -> LeasePage:
    """Read one page of at most ``per_page`` leases starting at SCAN ``cursor``.

    Makes SCAN steps until the page has its rows (``per_page`` less 5%) that passed
    ``predicate`` (default: all), the walk completed, or ``max_steps`` round trips were made.
    Each step asks for the missing rows (with a predicate: for the keys that should hold
    them at the match rate seen so far, at most ``max_count``, default ``10 * per_page``).
    A step whose rows would overflow the page is read again from the same cursor with a
    smaller COUNT (Redis allows a different COUNT at each call), or, when no round trip is
    left, ends the page before it. So a page holds at most ``per_page`` leases (a first step
    that cannot be read again, with ``max_steps=1`` or COUNT 1, is kept whole so the walk
    moves on: it may exceed ``per_page`` by the key or two of a hash bucket), and reads
    at most about ``max_steps * max_count`` keys. With a rare filter a page can hold few
    leases or none: follow ``next_cursor``. Raises LockStoreUnavailable.
    """
    started = time.monotonic()
    filtered = predicate is not None
    per_page = max(1, per_page)
    max_count = max(per_page, max_count or 10 * per_page)
    page = LeasePage(cursor=cursor, next_cursor=cursor, per_page=per_page)
    seen: set[str] = set()
    position, count = cursor, _next_count(page, False, max_count)
    accepted = 0  # steps whose rows are on the page
    while page.steps < max_steps:
        next_position, leases = lock.scan(position, count)
        page.steps += 1
        page.read += len(leases)
        step_keys: set[str] = set()
        rows = []
        for info in leases:
            # SCAN may return a key twice while Redis rehashes: show it once per page.
            if info["key"] in seen or info["key"] in step_keys:
                continue
            step_keys.add(info["key"])
            if predicate is None or predicate(info):
                rows.append(info)
        remaining = per_page - len(page.leases)
        if len(rows) > remaining:
            if count > 1 and page.steps < max_steps:
                # Read the same step again, asking for fewer keys than would overflow.
                page.rescans += 1
                count = max(1, min(remaining, count * remaining // len(rows)) - 1)
                continue
            if accepted:
                break  # the next page starts with this step
            # A first step that cannot be read again: keep it, or the walk never moves on.
        accepted += 1
        seen.update(step_keys)
        page.leases.extend(rows)
        page.examined += len(leases)
        position = next_position
        if position == 0 or _full(page):
            break
        count = _next_count(page, filtered, max_count)
    page.next_cursor = position
    page.now_ms, page.db_keys = _time_and_size(lock)
    page.leases.sort(key=lambda info: (int(info.get("acquired_ms") or 0), info["name"]))
    page.elapsed = time.monotonic() - started
    return page


def _time_and_size(lock: RedisStepLock) -> tuple[int, int]:
    """Redis server time (ms) and DBSIZE, in one round trip. Raises LockStoreUnavailable."""
    try:
        pipe = lock.client.pipeline(transaction=False)
        pipe.time()
        pipe.dbsize()
        (seconds, micros), size = pipe.execute()
    except STORE_ERRORS as exc:
        raise LockStoreUnavailable(f"lock store unavailable: {exc}") from exc
    return int(seconds) * 1000 + int(micros) // 1000, int(size)
