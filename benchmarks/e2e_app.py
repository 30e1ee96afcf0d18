"""The Celery app of the end-to-end benchmark (``celery -A benchmarks.e2e_app worker``).

Django settings: :mod:`benchmarks.e2e_settings` (the example project's, results off). Lock
store: ``STEPLOCK_REDIS_URL`` (a Redis of its own, so that ``MONITOR`` on it sees lock traffic
only); every lock below uses it, the peers' too. Tasks, all on the ``workflows.Step`` model
of ``django_app`` where they touch the database:

``bench.plain``            a plain Task: the baseline
``bench.once``             celery-once ``QueueOnce`` (lock taken at publish, cleared after run)
``bench.singleton``        celery-singleton ``Singleton`` (same idea)
``bench.handwritten``      a minimal careful lease + ORM CAS written by hand: SET NX PX,
                           a shared per-process heartbeat thread, ``atomic()`` {UPDATE ...
                           WHERE status='pending'; GET: still ours?}, then a Lua
                           compare-and-delete: 3 Redis round trips + 1 UPDATE
``bench.handwritten_full`` the same work as ``StepLockedTask``'s default configuration, by
                           hand with redis-py and the ORM: a lease with a fencing token
                           (one small Lua script: SET NX PX + INCR of a counter), the shared
                           heartbeat, the precheck SELECT of the step's status, ``atomic()``
                           {on PostgreSQL the deadline ``SELECT set_config(lock_timeout,
                           idle_in_transaction_session_timeout)``; the fenced CAS UPDATE ...
                           WHERE status='pending' AND (lock_fence IS NULL OR lock_fence <=
                           token) SET status, lock_owner, lock_fence, updated_at; GET: still
                           ours?}, then the owner-checked release: 3 Redis round trips,
                           1 SELECT + 1 UPDATE (+ the deadline on PostgreSQL). What it leaves
                           out of the library's work: holder metadata in the lease, events
                           and signals, settings and options, waiters' wake-up on release
``bench.steplock``         ``StepLockedTask`` with ``transition=("pending", "done")``
``bench.steplock_noprecheck``  the same with ``lock_precheck=False``
``bench.steplock_wait``    ``bench.steplock`` waiting for its release's reply after COMMIT
                           (``steplock_release_wait=True``): 3 blocking round trips, not 2
``bench.mark``             end-of-batch marker (SET in the broker Redis)

Per task, the worker appends one line to ``$BENCH_SQL_DIR/<pid>.tsv``: task name, SQL
statements by kind (through a Django execute wrapper; ``SET_CONFIG`` for the PostgreSQL
deadline ``SELECT set_config(...)``, ``BEGIN`` when the backend sends it as a statement, as
SQLite's does), ``COMMIT``/``ROLLBACK`` of the connection (counted by wrapping
``connection.commit``/``rollback``: they are not statements through the cursor),
and database connections opened (``CONNECT``). On PostgreSQL the driver sends each
transaction's BEGIN itself, so there a transaction shows as its COMMIT or ROLLBACK only.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import Counter

from celery import Celery
from celery.signals import task_postrun, task_prerun, worker_process_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.e2e_settings")

app = Celery("benchmarks.e2e_app")
app.config_from_object("django.conf:settings", namespace="CELERY")

LOCK_URL = os.environ.get("STEPLOCK_REDIS_URL") or os.environ.get(
    "REDIS_URL", "redis://127.0.0.1:6379/0"
)
BROKER_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
LEASE_TTL = 30.0

# celery-once and celery-singleton keep their locks in the lock-store Redis too.
app.conf.ONCE = {
    "backend": "celery_once.backends.Redis",
    "settings": {"url": LOCK_URL, "default_timeout": 3600},
}
app.conf.singleton_backend_url = LOCK_URL
app.conf.task_default_queue = "bench.ctl"

try:
    from celery_once import QueueOnce
except Exception as exc:  # noqa: BLE001 - reported by the benchmark
    QueueOnce = None
    ONCE_ERROR = f"{type(exc).__name__}: {exc}"
else:
    ONCE_ERROR = None
try:
    from celery_singleton import Singleton
except Exception as exc:  # noqa: BLE001
    Singleton = None
    SINGLETON_ERROR = f"{type(exc).__name__}: {exc}"
else:
    SINGLETON_ERROR = None

from celery_steplock import StepLockedTask  # noqa: E402
from celery_steplock.lock import release_after_commit  # noqa: E402


@app.task(name="bench.plain")
def plain(i):
    return i


if QueueOnce is not None:

    @app.task(name="bench.once", base=QueueOnce, once={"graceful": True})
    def once(i):
        return i


if Singleton is not None:

    @app.task(name="bench.singleton", base=Singleton)
    def singleton(i):
        return i


_STEP = {
    "bind": True,
    "lock_key": "bench:{step_id}",
    "step_model": "workflows.Step",
    "step_id_arg": "step_id",
    "transition": ("pending", "done"),
    "lock_ttl": LEASE_TTL,
}


@app.task(name="bench.steplock", base=StepLockedTask, **_STEP)
def steplock(self, step_id):
    return step_id


@app.task(name="bench.steplock_noprecheck", base=StepLockedTask, lock_precheck=False, **_STEP)
def steplock_noprecheck(self, step_id):
    return step_id


class _WaitingRelease(StepLockedTask):
    """``StepLockedTask`` waiting for its release's reply after COMMIT, as before issue 26
    (``steplock_release_wait=True`` for this task alone): the third blocking round trip."""

    def _release(self, store, lease):
        release_after_commit(store, lease, self, wait=True)


@app.task(name="bench.steplock_wait", base=_WaitingRelease, **_STEP)
def steplock_wait(self, step_id):
    return step_id


@app.task(name="bench.mark")
def mark(batch):
    import redis

    with redis.Redis.from_url(BROKER_URL) as client:
        key = f"bench:mark:{batch}"
        client.rpush(key, time.time())
        client.expire(key, 3600)
    return batch


# -- diagnostics ---------------------------------------------------------------------------

_parked = []


@worker_process_init.connect
def _park_heartbeat(**kwargs):
    """``BENCH_PARK_HEARTBEAT=1``: hold one idle lease per pool process for its whole life, so
    the library's heartbeat thread never runs out of leases, never exits, and is not started
    again by every task (a workaround a user can apply; the default benchmark does not)."""
    if os.environ.get("BENCH_PARK_HEARTBEAT") != "1":
        return
    from celery_steplock import get_lease_store
    from celery_steplock.heartbeat import get_heartbeat

    lock = get_lease_store(app)
    lease = lock.acquire(f"bench:park:{os.getpid()}", ttl=LEASE_TTL)
    get_heartbeat().register(lease, lock)
    _parked.append(lease)


# -- the hand-written lease + CAS ---------------------------------------------------------

RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
EXTEND_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


class MiniHeartbeat:
    """One daemon thread per process renewing every held lease each ttl/3 in one pipeline."""

    def __init__(self, client, extend, ttl_ms: int):
        self.client = client
        self.extend = extend
        self.ttl_ms = ttl_ms
        self.leases: dict[str, str] = {}
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def add(self, key: str, owner: str) -> None:
        with self.lock:
            self.leases[key] = owner
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._run, daemon=True, name="bench-heartbeat"
                )
                self.thread.start()

    def discard(self, key: str) -> None:
        with self.lock:
            self.leases.pop(key, None)

    def _run(self) -> None:
        while True:
            time.sleep(self.ttl_ms / 3000.0)
            with self.lock:
                items = list(self.leases.items())
            if not items:
                continue
            try:
                pipe = self.client.pipeline(transaction=False)
                for key, owner in items:
                    pipe.evalsha(self.extend.sha, 1, key, owner, self.ttl_ms)
                pipe.execute(raise_on_error=False)
            except Exception:  # noqa: BLE001 - keep renewing
                pass


class _Handwritten:
    def __init__(self):
        import redis

        self.client = redis.Redis.from_url(LOCK_URL, decode_responses=True, socket_timeout=5)
        self.release = self.client.register_script(RELEASE_LUA)
        extend = self.client.register_script(EXTEND_LUA)
        extend.sha = self.client.script_load(EXTEND_LUA)
        self.heartbeat = MiniHeartbeat(self.client, extend, int(LEASE_TTL * 1000))


_hw: dict[int, _Handwritten] = {}


class _Conflict(Exception):
    pass


@app.task(name="bench.handwritten", bind=True)
def handwritten(self, step_id):
    from django.db import transaction

    from django_app.workflows.models import Step

    state = _hw.get(os.getpid())
    if state is None:
        state = _hw[os.getpid()] = _Handwritten()
    key = f"bench:hw:{{{step_id}}}"
    owner = uuid.uuid4().hex
    if not state.client.set(key, owner, nx=True, px=int(LEASE_TTL * 1000)):
        raise self.retry(countdown=1)
    state.heartbeat.add(key, owner)
    try:
        with transaction.atomic(durable=True):
            if (
                Step.objects.filter(pk=step_id, status="pending").update(
                    status="done", lock_owner=owner
                )
                != 1
            ):
                raise _Conflict(step_id)
            if state.client.get(key) != owner:
                raise _Conflict(f"lease {key} lost")
    except _Conflict:
        return None
    finally:
        state.heartbeat.discard(key)
        state.release(keys=[key], args=[owner])
    return step_id


# -- the hand-written task doing the default configuration's work ---------------------------

# KEYS[1] lease, KEYS[2] fencing counter; ARGV[1] owner token, ARGV[2] ttl ms, ARGV[3] counter
# ttl ms. Returns the fencing token when granted, else 0.
FENCED_ACQUIRE_LUA = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local fence = redis.call('INCR', KEYS[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  return fence
end
return 0
"""
FENCE_TTL_MS = 7 * 24 * 3600 * 1000


class _HandwrittenFull(_Handwritten):
    def __init__(self):
        super().__init__()
        self.acquire = self.client.register_script(FENCED_ACQUIRE_LUA)


_hwf: dict[int, _HandwrittenFull] = {}


@app.task(name="bench.handwritten_full", bind=True)
def handwritten_full(self, step_id):
    from django.db import connection, transaction
    from django.db.models import Q
    from django.utils import timezone

    from django_app.workflows.models import Step

    state = _hwf.get(os.getpid())
    if state is None:
        state = _hwf[os.getpid()] = _HandwrittenFull()
    key = f"bench:hwf:{{{step_id}}}"
    owner = uuid.uuid4().hex
    sent = time.monotonic()
    fence = state.acquire(
        keys=[key, f"bench:hwf:fence:{{{step_id}}}"],
        args=[owner, int(LEASE_TTL * 1000), FENCE_TTL_MS],
    )
    if not fence:
        raise self.retry(countdown=1)
    valid_until = sent + LEASE_TTL * 0.99  # the library's clock-drift allowance
    state.heartbeat.add(key, owner)
    try:
        found = list(Step.objects.filter(pk=step_id).values_list("status", flat=True)[:1])
        if not found or found[0] != "pending":
            return None
        with transaction.atomic(durable=True):
            if connection.vendor == "postgresql":
                ms = str(max(1, int((valid_until - time.monotonic()) * 1000)))
                with connection.cursor() as cursor:
                    cursor.execute(
                        "SELECT set_config('lock_timeout', %s, true), "
                        "set_config('idle_in_transaction_session_timeout', %s, "
                        "true)",
                        [ms, ms],
                    )
            cas = Q(pk=step_id, status="pending") & (
                Q(lock_fence__isnull=True) | Q(lock_fence__lte=fence)
            )
            if (
                Step.objects.filter(cas).update(
                    status="done", lock_owner=owner, lock_fence=fence, updated_at=timezone.now()
                )
                != 1
            ):
                raise _Conflict(step_id)
            if time.monotonic() >= valid_until or state.client.get(key) != owner:
                raise _Conflict(f"lease {key} lost")
    except _Conflict:
        return None
    finally:
        state.heartbeat.discard(key)
        state.release(keys=[key], args=[owner])
    return step_id


# -- SQL statement counting in the worker --------------------------------------------------

_sql = Counter()
_wrapped: set[int] = set()
_fds: dict[int, int] = {}
_SQL_DIR = os.environ.get("BENCH_SQL_DIR")


def _count_sql(execute, sql, params, many, context):
    kind = sql.lstrip().split(None, 1)[0].upper() if sql else "?"
    if kind == "SELECT" and "set_config(" in sql:
        kind = "SET_CONFIG"
    _sql[kind] += 1
    return execute(sql, params, many, context)


def _counted(method, kind: str):
    def call(*args, **kwargs):
        _sql[kind] += 1
        return method(*args, **kwargs)

    return call


def _on_connection_created(sender=None, connection=None, **kwargs):
    _sql["CONNECT"] += 1


def _counting(task) -> bool:
    """Only the tasks of the counting pass are counted (published with the ``bench_sql``
    header): the throughput batches run without the wrappers, whose cost would land in the
    CPU time measured per task."""
    request = getattr(task, "request", None)
    if request is None:
        return False
    return bool(
        getattr(request, "bench_sql", None)
        or (getattr(request, "headers", None) or {}).get("bench_sql")
    )


_installed: list = []


@task_prerun.connect
def _sql_prerun(sender=None, **kwargs):
    if not _SQL_DIR or not _counting(sender):
        return
    from django.db import DEFAULT_DB_ALIAS, connections
    from django.db.backends.signals import connection_created

    wrapper = connections[DEFAULT_DB_ALIAS]
    if id(wrapper) not in _wrapped:
        connection_created.connect(
            _on_connection_created, weak=False, dispatch_uid="bench-connections"
        )
        _wrapped.add(id(wrapper))
    wrapper.execute_wrappers.append(_count_sql)
    # Instance attributes shadow the methods (atomic() calls them to end a transaction);
    # the postrun handler deletes them again.
    wrapper.commit = _counted(type(wrapper).commit.__get__(wrapper), "COMMIT")
    wrapper.rollback = _counted(type(wrapper).rollback.__get__(wrapper), "ROLLBACK")
    _installed.append(sender)
    _sql.clear()


@task_postrun.connect
def _sql_postrun(sender=None, **kwargs):
    if not _installed:
        return
    _installed.clear()
    from django.db import DEFAULT_DB_ALIAS, connections

    wrapper = connections[DEFAULT_DB_ALIAS]
    if _count_sql in wrapper.execute_wrappers:
        wrapper.execute_wrappers.remove(_count_sql)
    for name in ("commit", "rollback"):
        wrapper.__dict__.pop(name, None)
    line = (
        "\t".join([getattr(sender, "name", "?")] + [f"{k}={v}" for k, v in sorted(_sql.items())])
        + "\n"
    )
    fd = _fds.get(os.getpid())
    if fd is None:
        fd = _fds[os.getpid()] = os.open(
            os.path.join(_SQL_DIR, f"{os.getpid()}.tsv"),
            os.O_WRONLY | os.O_APPEND | os.O_CREAT,
            0o644,
        )
    os.write(fd, line.encode())
