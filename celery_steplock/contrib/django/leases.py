"""Reading held leases for people: the Celery app of the Django project and its task
modules, and bounded, cursor-paginated pages of leases for the admin (and anything else that
shows them).

Pages follow a ``SCAN`` walk: a SCAN cursor can only resume *between* steps, so a page is
made of whole steps and never stops inside one (that would skip or repeat keys). Following
``next_cursor`` from 0 until it is 0 again visits every lease that was held for the whole walk
(Redis's SCAN guarantee); a lease acquired or released meanwhile may or may not appear, and
Redis may return a key twice while it rehashes. A page's work is bounded by construction,
whatever the number of leases and whatever the sizes of SCAN's steps (whole hash buckets,
which vary with the Redis server's per-process hash seed): at most ``key_budget`` lease
hashes read (a step's key names come first, its hashes are read only when they fit in the
budget left, else the page ends before it with a "next" cursor), at most ``max_steps`` SCAN
round trips, and at most ``per_page`` rows (a step that would overflow the page is asked
again with a smaller ``COUNT``). See :func:`lease_page` for the one exception, which keeps
the walk moving.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ...events import log_event
from ...exceptions import LockStoreUnavailable
from ...lock import STORE_ERRORS, RedisLeaseStore, get_lease_store
from ...redact import redact

__all__ = [
    "celery_app",
    "import_task_modules",
    "task_import_error",
    "lease_lock",
    "steplock_task_names",
    "LeasePage",
    "lease_page",
    "matches",
    "redis_time_ms",
]

logger = logging.getLogger("celery_steplock")


def celery_app():
    """The project's Celery app: ``celery.current_app`` (a Django project's ``celery.py``
    creates it with ``set_as_current=True`` and imports it from the project package).

    Only the app: its task modules may not be imported yet (see :func:`import_task_modules`).
    """
    from celery import current_app

    return current_app._get_current_object()  # type: ignore[attr-defined]


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
            log_event(
                "task_modules_import_failed", logging.ERROR, exc_info=exc, app=app.main, error=exc
            )
        finally:
            set_script_prefix(prefix)
            _importing.discard(app)
            _imported.add(app)
        return _import_errors.get(app)


def task_import_error(app=None) -> BaseException | None:
    """The error :func:`import_task_modules` met for ``app`` in this process, if any."""
    return _import_errors.get(app or celery_app())


def lease_lock(app=None) -> RedisLeaseStore:
    """The process's :class:`RedisLeaseStore` for ``app`` (default :func:`celery_app`).

    Raises ImproperlyConfigured for an invalid ``steplock_redis_url``/prefix setting.
    """
    return get_lease_store(app or celery_app())


def steplock_task_names(app=None) -> list[str]:
    """Sorted names of the app's registered :class:`~celery_steplock.task.StepLockedTask`
    tasks.

    Imports the app's task modules first (:func:`import_task_modules`, once per process);
    reading ``app.tasks`` then finalizes the app, which registers the tasks those modules
    declared (finalizing alone imports nothing). The task module is never imported from
    here: when no module imported it, no task of the app can be a StepLockedTask.
    """
    app = app or celery_app()
    import_task_modules(app)
    task_module = sys.modules.get("celery_steplock.task")
    if task_module is None:
        return []
    base = task_module.StepLockedTask
    return sorted(name for name, task in app.tasks.items() if isinstance(task, base))


def redis_time_ms(lock: RedisLeaseStore) -> int:
    """The Redis server's clock in milliseconds: leases record Redis time, so ages are
    computed on the same clock. Raises LockStoreUnavailable."""
    try:
        seconds, micros = lock.client.time()
    except STORE_ERRORS as exc:
        raise LockStoreUnavailable(f"lock store unavailable: {redact(exc)}") from exc
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


#: Why a page ended (:attr:`LeasePage.stop`).
STOP_COMPLETE, STOP_FULL, STOP_NO_ROOM, STOP_BUDGET, STOP_STEPS = (
    "complete",
    "full",
    "no_room",
    "budget",
    "steps",
)


@dataclass
class LeasePage:
    """One page of leases (see :func:`lease_page` for its bounds).

    ``leases``: the lease dicts (as :meth:`RedisLeaseStore.scan` returns them) that passed the
    filter, oldest acquisition first; ``cursor``: the SCAN cursor this page started at;
    ``next_cursor``: where the next page starts (0: the walk is complete); ``key_budget``:
    the lease hashes this page was allowed to read; ``read``: lease hashes it read (at most
    ``key_budget``, see :attr:`overran`); ``examined``: lease keys of the SCAN steps this page
    covers (shown or left out by the filter; a step re-read after an overflow or left to the
    next page is not counted); ``declined``: lease keys of the SCAN step that did not fit in
    the budget left, so the page ended before it (0 when none); ``steps``: SCAN round trips
    made (``rescans`` of them re-read a step from the same cursor); ``stop``: why the page
    ended, one of ``"complete"`` (the walk is done), ``"full"`` (the page has its rows:
    ``per_page`` less 5%), ``"no_room"`` (the next step, one hash bucket, has more rows than
    the page has room left), ``"budget"`` (the next step's keys did not fit in the key
    budget left) and ``"steps"`` (``max_steps`` round trips made); ``overran``: the page's first
    step could not be made to fit (more keys than the whole budget or more rows than
    ``per_page``, even asked for one hash bucket, or no round trip was left to ask) and was
    kept whole so that the walk moves on: the only way ``read`` can exceed ``key_budget`` or
    the rows ``per_page``;
    ``now_ms``: Redis server time; ``db_keys``: the size of the Redis database (all keys,
    leases or not); ``elapsed``: seconds spent.
    """

    cursor: int
    next_cursor: int
    per_page: int = 100
    key_budget: int = 0
    leases: list[dict[str, Any]] = field(default_factory=list)
    examined: int = 0
    read: int = 0
    declined: int = 0
    steps: int = 0
    rescans: int = 0
    stop: str = ""
    overran: bool = False
    now_ms: int | None = None
    db_keys: int | None = None
    elapsed: float = 0.0

    @property
    def complete(self) -> bool:
        return self.next_cursor == 0

    @property
    def short(self) -> bool:
        """The page ended at its budget (keys or round trips) before it had its rows, and the
        walk goes on: later pages may hold more (a filter that matches few leases)."""
        return self.stop in (STOP_BUDGET, STOP_STEPS) and not self.complete


def _next_count(page: LeasePage, filtered: bool, max_count: int) -> int:
    """COUNT of the next SCAN step (before the budget caps it).

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


def _scan_keys(lock: RedisLeaseStore, cursor: int, count: int) -> tuple[int, list[str]]:
    """One SCAN step over the lease keys: ``(next_cursor, keys)``, names only."""
    return lock.scan_keys(cursor, count)


def _read_leases(lock: RedisLeaseStore, keys: list[str]) -> dict[str, dict[str, Any] | None]:
    """The lease dicts of ``keys`` (None for a key gone since the SCAN or not a lease hash),
    in one round trip."""
    return lock.read_leases(keys)


def lease_page(
    lock: RedisLeaseStore,
    cursor: int = 0,
    per_page: int = 100,
    *,
    predicate: Callable[[Mapping[str, Any]], bool] | None = None,
    key_budget: int | None = None,
    max_count: int | None = None,
    max_steps: int = 10,
) -> LeasePage:
    """Read one page of leases starting at SCAN ``cursor``; returns a :class:`LeasePage`.

    ``per_page``: rows at most (default 100); ``predicate``: the filter (default: every
    lease); ``key_budget``: lease hashes read at most (default ``50 * per_page``);
    ``max_count``: the largest SCAN ``COUNT`` of one step (default ``10 * per_page``, and
    never above the budget); ``max_steps``: SCAN round trips at most (default 10).

    Each SCAN step first returns key names only; their hashes are read (one more round trip)
    only when they fit in what is left of ``key_budget``. A step that does not fit is not
    read and the page ends before it (``stop="budget"``: the next page starts with it), so a
    page never reads more than ``key_budget`` hashes, however many keys SCAN's steps return
    (whole hash buckets: their sizes depend on the server's per-process hash seed). The one
    exception keeps the walk moving: when the page's *first* step does not fit, it is asked
    again with ``COUNT 1`` (one hash bucket, a few keys), and a first step that still does
    not fit (a bucket larger than the budget, or no round trip left) is read whole
    (``overran``). Hashes read once are not read (nor charged) again when a step is re-read.

    Steps go on until the page has its rows (``per_page`` less 5% that passed
    ``predicate``), the walk completed, the budget or ``max_steps`` round trips were spent.
    Each step asks for the missing rows (with a predicate, for the keys that should hold them
    at the match rate seen so far). A step whose rows would overflow the page is asked again
    from the same cursor with a smaller ``COUNT`` (Redis allows a different COUNT at each
    call) or, when no round trip is left, ends the page before it; so a page holds at most
    ``per_page`` leases, except a first step that cannot be asked again (``COUNT 1`` or
    ``max_steps=1``), kept whole so the walk moves on (a bucket's key or two more;
    ``overran``).

    Pages are made of whole steps (a SCAN cursor resumes only between steps). Following
    ``next_cursor`` from 0 until it is 0 again visits every lease held for the whole walk
    (Redis's SCAN guarantee). Per page: at most ``max_steps`` SCAN round trips, as many
    reads, and one for the server time. With a rare filter a page can hold few leases or
    none: follow ``next_cursor``. Raises LockStoreUnavailable.
    """
    started = time.monotonic()
    filtered = predicate is not None
    per_page = max(1, per_page)
    key_budget = max(1, key_budget if key_budget is not None else 50 * per_page)
    max_count = max(1, min(key_budget, max(per_page, max_count or 10 * per_page)))
    page = LeasePage(cursor=cursor, next_cursor=cursor, per_page=per_page, key_budget=key_budget)
    seen: set[str] = set()  # keys of the steps on this page
    fetched: dict[str, dict[str, Any] | None] = {}  # hashes this page read, by key
    position, count = cursor, min(max_count, _next_count(page, False, max_count))
    accepted = 0  # steps whose rows are on the page
    while True:
        if page.steps >= max_steps:
            page.stop = STOP_STEPS
            break
        left = key_budget - page.read
        if accepted and left <= 0:
            page.stop = STOP_BUDGET
            break
        count = max(1, min(count, left))
        next_position, keys = _scan_keys(lock, position, count)
        page.steps += 1
        # SCAN may return a key twice while Redis rehashes: show it once per page.
        keys = [key for key in dict.fromkeys(keys) if key not in seen]
        unread = [key for key in keys if key not in fetched]
        if len(unread) > left:
            if not accepted and count > 1 and page.steps < max_steps:
                page.rescans += 1
                count = 1  # the first step: one bucket, so that the walk moves on
                continue
            if accepted:
                page.declined = len(unread)
                page.stop = STOP_BUDGET
                break  # the next page starts with this step
            page.overran = True  # a first step that cannot be asked again: read it whole
        fetched.update(_read_leases(lock, unread))
        page.read += len(unread)
        leases = [info for info in (fetched[key] for key in keys) if info is not None]
        rows = [info for info in leases if predicate is None or predicate(info)]
        remaining = per_page - len(page.leases)
        if len(rows) > remaining:
            if count > 1 and page.steps < max_steps:
                # Ask for the same step again, with fewer keys than would overflow.
                page.rescans += 1
                count = max(1, min(remaining, count * remaining // len(rows)) - 1)
                continue
            if accepted:
                page.stop = STOP_STEPS if page.steps >= max_steps else STOP_NO_ROOM
                break  # the next page starts with this step
            # A first step that cannot be asked again: keep it, or the walk never moves on.
            page.overran = True
        accepted += 1
        seen.update(keys)
        page.leases.extend(rows)
        page.examined += len(leases)
        position = next_position
        if position == 0:
            page.stop = STOP_COMPLETE
            break
        if _full(page):
            page.stop = STOP_FULL
            break
        count = min(max_count, _next_count(page, filtered, max_count))
    page.next_cursor = position
    page.now_ms, page.db_keys = _time_and_size(lock)
    page.leases.sort(key=_acquired_order)
    page.elapsed = time.monotonic() - started
    return page


def _acquired_order(info: Mapping[str, Any]) -> tuple[int, str]:
    """Sort key of a page: acquisition time, then name; a malformed lease (see
    :func:`celery_steplock.lease.parse_lease`) without a readable time sorts first."""
    acquired = str(info.get("acquired_ms") or "0")
    return (int(acquired) if acquired.isdigit() else 0, str(info.get("name") or ""))


def _time_and_size(lock: RedisLeaseStore) -> tuple[int, int]:
    """Redis server time (ms) and DBSIZE, in one round trip. Raises LockStoreUnavailable."""
    if hasattr(lock, "time_and_size"):  # a cluster store: the DBSIZE of every primary
        return lock.time_and_size()
    try:
        pipe = lock.client.pipeline(transaction=False)
        pipe.time()
        pipe.dbsize()
        (seconds, micros), size = pipe.execute()
    except STORE_ERRORS as exc:
        raise LockStoreUnavailable(f"lock store unavailable: {redact(exc)}") from exc
    return int(seconds) * 1000 + int(micros) // 1000, int(size)
