"""The controller of the fault suite: real servers, real ``celery worker`` processes, faults.

A :class:`Lab` owns a control Redis (the workers' broker and the probe's history), a lock-store
Redis reached through a :class:`~tests.support.faults.proxy.TcpProxy`, a proxy in front of the
PostgreSQL database the caller gives it, and two prefork workers (concurrency 1) running the
example project with the probe on (``django_app/faults``). The caller's process must have Django
set up on the same database (the test database under pytest, a fresh one under
``scripts/soak.py``): the lab reads steps and transition records through the ORM, directly, not
through the proxy.

With ``worker_stores=True`` each worker reaches the lock store through a proxy of its own in
front of ``store_proxy``, so :meth:`Lab.split_store` can split the lock store's brain (one side
on the old primary, the other on a promoted replica) and :meth:`Lab.heal_split` end it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import uuid
from pathlib import Path

import redis

from tests.support import processes, servers
from tests.support.faults import backends, checker
from tests.support.faults.proxy import TcpProxy

ROOT = servers.ROOT
TERMINAL = checker.TERMINAL
TASKS = "django_app.faults.tasks"
KEY_PREFIX = "steplock"  # the workers' STEPLOCK_KEY_PREFIX (the default)


@contextlib.contextmanager
def controller(say=print, database: str = "postgresql"):
    """The set-up of a fault run's controller process (``scripts/soak.py``,
    ``scripts/nemesis.py``): a server of ``database`` (``"postgresql"`` or ``"mysql"``, a
    MariaDB) of its own unless ``DATABASE_URL`` names one of that kind (stopped by PID on the
    way out; :func:`backends.start_database`), Django on the example project, migrated, with
    the probe off in this process. Yields the started server, or None."""
    pg = None
    try:
        pg = backends.start_database(database, say)
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "django_app.settings")
        os.environ.pop("STEPLOCK_FAULTS", None)  # this process is the controller
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        yield pg
    finally:
        if pg is not None:
            pg.stop()


def database_url(settings_dict, host: str | None = None, port: int | None = None) -> str:
    """A postgresql:// (or, on MariaDB, mysql://) URL for Django's ``settings_dict``,
    optionally at another host/port (:func:`backends.database_url`)."""
    return backends.database_url(settings_dict, host, port)


class Lab:
    """Servers, proxies and workers for fault trials; see the module docstring.

    ``ttl`` (seconds) is the workers' lease TTL, ``visibility_timeout`` (seconds) the broker's,
    ``max_hold`` (seconds) the longest a lease is renewed (``steplock_max_hold``);
    ``unguarded=True`` starts the workers as the negative control (no CAS, no pre-check);
    ``guard="nofence"`` keeps the CAS, the pre-check and the ownership check but drops the
    fence condition from the CAS (the fence-decides family's negative control; default
    ``"fenced"``). ``worker_stores=True`` gives each worker its own proxy on the lock-store
    path, chained in front of ``store_proxy`` (so every fault on ``store_proxy`` still reaches
    every worker): :meth:`split_store` needs it.
    ``unacked_mutex_expire`` (whole seconds) bounds how long a worker main process killed while
    it held the broker's restore mutex delays every redelivery.
    """

    def __init__(
        self,
        workdir: Path,
        db_settings: dict,
        ttl: float = 2.0,
        visibility_timeout: int = 10,
        max_hold: float = 15.0,
        unguarded: bool = False,
        log=print,
        guard: str = "fenced",
        worker_stores: bool = False,
        unacked_mutex_expire: int = 30,
        broker: str = "redis",
    ):
        self.workdir = Path(workdir)
        # the Celery broker (backends.BROKERS); the control Redis keeps the history anyway
        self.broker = backends.make_broker(broker, self.workdir / "broker")
        self.db_settings = dict(db_settings)
        self.ttl = ttl
        self.visibility_timeout = visibility_timeout
        self.max_hold = max_hold
        self.unguarded = unguarded
        self.log = log
        self.unacked_mutex_expire = unacked_mutex_expire
        self.workers: dict[str, servers.WorkerProcess] = {}
        self.replica: servers.RedisServer | None = None
        self.repl_proxy: TcpProxy | None = None
        if guard not in ("fenced", "nofence"):
            raise ValueError(f"guard must be 'fenced' or 'nofence', got {guard!r}")
        self.guard = guard
        self.worker_stores = worker_stores
        self.worker_proxies: dict[str, TcpProxy] = {}  # worker name -> its lock-store proxy
        self.split: tuple[frozenset, frozenset] | None = None  # (minority, majority) names

    # -- set-up ------------------------------------------------------------------------------

    def start(self) -> Lab:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.control = servers.RedisServer(workdir=self.workdir / "control").start()
        self.start_lock_store()
        pg_host = self.db_settings.get("HOST") or "127.0.0.1"
        self.database = backends.Database(self.db_settings)
        pg_port = int(self.db_settings.get("PORT") or 5432)
        self.pg_proxy = TcpProxy(pg_host, pg_port).start()
        self.database.prepare()
        self.broker.start(self.control)
        self.r = redis.Redis.from_url(self.control.url, decode_responses=True, socket_timeout=30)
        from celery import Celery

        self.publisher = Celery(
            "faults-controller", broker=self.broker.publisher_url, set_as_current=False
        )
        self.publisher.conf.broker_connection_retry_on_startup = True
        return self

    def start_lock_store(self) -> None:
        """The lock store (:meth:`start`'s part that differs by topology): one redis-server
        behind ``store_proxy``."""
        self.store = servers.RedisServer(workdir=self.workdir / "store").start()
        self.store_proxy = TcpProxy("127.0.0.1", self.store.port).start()

    def stop(self) -> None:
        for worker in list(self.workers.values()):
            worker.kill()
        self.workers.clear()
        self.broker.stop()
        for thing in (
            *self.worker_proxies.values(),
            self.replica,
            self.repl_proxy,
            getattr(self, "store_proxy", None),
            getattr(self, "pg_proxy", None),
            getattr(self, "store", None),
            getattr(self, "control", None),
        ):
            if thing is not None:
                thing.stop()

    def __enter__(self) -> Lab:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def store_client(self) -> redis.Redis:
        """A client on the lock store the workers use now (the proxy's target: the promoted
        replica after a failover), directly, not through the proxy."""
        host, port = self.store_proxy.target
        return redis.Redis(host=host, port=port, decode_responses=True, socket_timeout=5)

    def lock_store_url(self) -> str:
        """The lock-store URL the workers are given (``STEPLOCK_REDIS_URL``): the store
        proxy's."""
        return self.store_proxy.url()

    def worker_env(self) -> dict:
        env = {
            "DJANGO_SETTINGS_MODULE": "django_app.settings",
            "PYTHONPATH": str(ROOT),
            "DATABASE_URL": database_url(self.db_settings, "127.0.0.1", self.pg_proxy.port),
            "REDIS_URL": self.broker.worker_url,
            "STEPLOCK_REDIS_URL": self.lock_store_url(),
            "STEPLOCK_FAULTS": "1",
            "STEPLOCK_FAULTS_URL": self.control.url,
            "STEPLOCK_TTL": str(self.ttl),
            "STEPLOCK_RETRY_BACKOFF": "0.25",
            "STEPLOCK_RETRY_BACKOFF_MAX": "2",
            "STEPLOCK_VISIBILITY_TIMEOUT": str(self.visibility_timeout),
            "STEPLOCK_MAX_HOLD": str(self.max_hold),
            "STEPLOCK_UNACKED_RESTORE_INTERVAL": "1",
            "STEPLOCK_UNACKED_RESTORE_THROTTLE": "1",
            "STEPLOCK_UNACKED_MUTEX_EXPIRE": str(self.unacked_mutex_expire),
            "STEPLOCK_LOG_LEVEL": "INFO",
        }
        if self.unguarded:
            env["STEPLOCK_FAULTS_UNGUARDED"] = "1"
        if self.guard != "fenced":
            env["STEPLOCK_FAULTS_GUARD"] = self.guard
        return env

    def worker_store_proxy(self, name: str) -> TcpProxy:
        """The proxy on worker ``name``'s lock-store path (``worker_stores=True``), created on
        first use, in front of ``store_proxy``."""
        if not self.worker_stores:
            raise RuntimeError("this lab shares store_proxy between its workers (worker_stores)")
        proxy = self.worker_proxies.get(name)
        if proxy is None:
            proxy = TcpProxy("127.0.0.1", self.store_proxy.port).start()
            self.worker_proxies[name] = proxy
        return proxy

    def ensure_workers(self, names=("w1", "w2")) -> None:
        """Start the named workers that are not running (killed by an earlier trial)."""
        env = {**os.environ, **self.worker_env()}
        for name in names:
            worker = self.workers.get(name)
            if worker is not None and worker.alive() and worker.children_pids():
                continue
            if worker is not None:
                worker.kill()
            if self.worker_stores:
                env = {**env, "STEPLOCK_REDIS_URL": self.worker_store_proxy(name).url()}
            self.workers[name] = servers.celery_worker(
                app="django_app",
                name=name,
                concurrency=1,
                env=env,
                logfile=self.workdir / f"{name}.log",
                cwd=ROOT,
            )

    def worker_of(self, pid: int) -> servers.WorkerProcess:
        for worker in self.workers.values():
            if pid == worker.pid or pid in worker.children_pids(recursive=True):
                return worker
        raise LookupError(f"no worker has pid {pid}")

    # -- trials ------------------------------------------------------------------------------

    def new_trial(self) -> None:
        """Forget the previous trial's control keys, heal the network and the lock store."""
        for key in self.r.scan_iter(match="faults:*", count=1000):
            self.r.delete(key)
        self.store_proxy.set_latency(0)
        self.store_proxy.unstall()
        self.store_proxy.unblackhole()
        self.store_proxy.disarm()
        self.pg_proxy.set_latency(0)
        self.pg_proxy.unstall()
        self.pg_proxy.unblackhole()
        self.pg_proxy.disarm()
        if self.split is not None:
            self.heal_split()
        if self.replica is not None:  # a failover trial moved the store: back to a fresh one
            self.heal_failover()
        if not self.store.alive():
            self.store.start()
        self.store_client().flushdb()
        for worker in self.workers.values():  # nothing stays stopped by an unfinished trial
            worker.signal(signal.SIGCONT, group=True)
        self.ensure_workers()

    def recover(self) -> None:
        """After a trial that could not finish: kill every worker (stopped ones too) and
        empty the broker, so the next trial starts clean."""
        for worker in self.workers.values():
            worker.kill()
        self.workers.clear()
        self.r.delete("celery", "unacked", "unacked_index", "unacked_mutex")

    def new_step(self, name: str = "fault") -> int:
        from django_app.workflows.models import Step

        return Step.objects.create(name=name).pk

    def publish(self, task: str, step_id: int, task_id: str | None = None, **options) -> str:
        """Send ``django_app.faults.tasks.<task>(step_id)``; returns the task id."""
        kwargs = options.pop("kwargs", {})
        task_id = task_id or str(uuid.uuid4())
        self.publisher.send_task(
            f"{TASKS}.{task}", args=(step_id,), kwargs=kwargs, task_id=task_id, **options
        )
        self.note("publish", step=step_id, task=task, task_id=task_id)
        return task_id

    def note(self, event: str, **fields) -> dict:
        """Add a controller entry (a fault, a publish) to the history; returns it."""
        entry = {"ev": event, "t": time.time(), "by": "controller", **fields}
        self.r.rpush("faults:history", json.dumps(entry, default=str))
        return entry

    def arm(self, step_id: int, point: str) -> None:
        self.r.set(f"faults:arm:{step_id}:{point}", "1")

    def wait_arrival(self, step_id: int, point: str, timeout: float = 60.0) -> dict:
        """Block until an attempt stops at the armed barrier; returns its description (pid,
        owner, fence, backend_pid, task_id)."""
        item = self.r.blpop(f"faults:arrived:{step_id}:{point}", timeout=timeout)
        if item is None:
            raise TimeoutError(
                f"no attempt reached {point} of step {step_id} in {timeout}s ({self.describe()})"
            )
        return json.loads(item[1])

    def go(self, step_id: int, point: str, instruction: str = "") -> None:
        self.r.rpush(f"faults:go:{step_id}:{point}", instruction)

    def history(self) -> list[dict]:
        return [json.loads(x) for x in self.r.lrange("faults:history", 0, -1)]

    def wait_for(self, predicate, timeout: float, what: str, interval: float = 0.05):
        """processes.wait_until, describing the lab's state on a timeout."""
        return processes.wait_until(predicate, timeout, interval, what, self.describe)

    def wait_event(self, ev: str, timeout: float = 30.0, **match) -> dict:
        """The first history entry ``ev`` whose fields equal ``match``, once it exists."""

        def find():
            for entry in self.history():
                if entry.get("ev") == ev and all(entry.get(k) == v for k, v in match.items()):
                    return entry
            return None

        return self.wait_for(find, timeout, f"history event {ev} {match}")

    def statuses(self, step_ids) -> dict[int, str]:
        from django_app.workflows.models import Step

        return dict(Step.objects.filter(pk__in=list(step_ids)).values_list("pk", "status"))

    def broker_idle(self) -> bool:
        """No task message queued or delivered unacknowledged, on the run's broker."""
        return self.broker.idle(self.r)

    def leases(self) -> list[str]:
        try:
            return checker.lease_keys(self.store_client(), KEY_PREFIX)
        except redis.RedisError:
            return ["<lock store unreachable>"]

    def quiet(self, step_ids) -> bool:
        statuses = self.statuses(step_ids)
        return all(s in TERMINAL for s in statuses.values()) and self.broker_idle()

    def settle(self, step_ids, timeout: float = 90.0, resume: bool = True) -> float:
        """Wait until every step is terminal and the broker holds no message, then up to one
        TTL more for the leases to go; returns the time.time() the last one went (or the wait
        ended). Leases still held then are left in ``self.leftover``. A step that stays
        ``pending`` with nothing queued (its attempt failed for good, e.g. a time limit) is
        resumed once by an operator re-sending ``forward`` (noted as ``resume``)."""
        deadline = time.monotonic() + timeout
        resumed = set()
        idle_since = None
        self.leftover = []
        while time.monotonic() < deadline:
            if self.quiet(step_ids):
                grace = time.monotonic() + self.ttl + 1.0
                while (held := self.leases()) and time.monotonic() < grace:
                    time.sleep(0.05)
                self.leftover = held
                return time.time()
            if not any(w.alive() for w in self.workers.values()):
                self.note("restart_workers")  # as a process supervisor would
                self.ensure_workers()
            if resume and self.broker_idle() and not self.leases():
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > 1.0:
                    for step, status in self.statuses(step_ids).items():
                        if status not in TERMINAL and step not in resumed:
                            resumed.add(step)
                            self.note("resume", step=step)
                            self.publish("forward", step)
                    idle_since = None
            else:
                idle_since = None
            time.sleep(0.05)
        raise TimeoutError(
            f"steps {list(step_ids)} did not settle in {timeout}s ({self.describe(step_ids)})"
        )

    def describe(self, step_ids=()) -> str:
        try:
            return (
                f"{self.broker.describe(self.r)}, "
                f"leases {self.leases()}, statuses {self.statuses(step_ids)}, workers "
                f"{ {n: (w.alive(), w.children_pids()) for n, w in self.workers.items()} }"
            )
        except Exception as exc:  # noqa: BLE001
            return f"state unavailable: {exc}"

    def verdict(
        self, step_ids, fault_at: float | None = None, settled_at: float | None = None
    ) -> checker.Verdict:
        """Check the invariants for ``step_ids`` after :meth:`settle`; leftover leases are
        counted after one more TTL."""
        from django_app.workflows.models import TransitionRecord

        records = [
            checker.Record.of(r)
            for r in TransitionRecord.objects.filter(step_id__in=list(step_ids)).order_by("id")
        ]
        without_ttl = len(checker.keys_without_ttl(self.store_client(), KEY_PREFIX))
        history = self.history()
        verdict = checker.check(
            self.statuses(step_ids),
            records,
            history,
            leftover_leases=len(getattr(self, "leftover", [])),
            keys_without_ttl=without_ttl,
            end_of_trial=settled_at,
        )
        steps = set(step_ids)
        verdict.resumes = sum(1 for e in history if e["ev"] == "resume" and e["step"] in steps)
        verdict.attempts = sum(
            1 for e in history if e["ev"] in ("acquired", "contended") and e.get("step") in steps
        )
        if fault_at and settled_at:
            verdict.recovery_s = max(0.0, settled_at - fault_at)
        return verdict

    # -- faults ------------------------------------------------------------------------------

    def signal_pid(self, pid: int, sig: int) -> dict:
        os.kill(pid, sig)
        return self.note("fault", signal=signal.Signals(sig).name, pid=pid)

    def kill_worker_main(self, worker: servers.WorkerProcess) -> dict:
        """SIGKILL the worker's main process only; its pool children are left running."""
        entry = self.signal_pid(worker.pid, signal.SIGKILL)
        worker.proc.wait()
        return entry

    def failover(self) -> dict:
        """Promote a replica that lacks the latest writes and point the store proxy at it.

        The replica followed the store through ``repl_proxy``, which :meth:`start_replica`
        stalled before the trial's lease was taken, so the replica never saw it."""
        client = redis.Redis(host="127.0.0.1", port=self.replica.port, socket_timeout=5)
        client.execute_command("REPLICAOF", "NO", "ONE")
        client.close()
        self.store_proxy.retarget("127.0.0.1", self.replica.port, drop=True)
        return self.note("fault", kind="failover", to_port=self.replica.port)

    def start_replica(self) -> None:
        """A replica of the lock store, fed through a proxy; returns once it is in sync, with
        the feed stalled (writes from now on don't reach it)."""
        self.repl_proxy = TcpProxy("127.0.0.1", self.store.port).start()
        self.replica = servers.RedisServer(
            workdir=self.workdir / "replica",
            args=("--replicaof", "127.0.0.1", self.repl_proxy.port),
        ).start()
        client = redis.Redis(
            host="127.0.0.1", port=self.replica.port, decode_responses=True, socket_timeout=5
        )
        self.wait_for(
            lambda: client.info("replication").get("master_link_status") == "up",
            30,
            "the replica to sync",
        )
        client.close()
        self.repl_proxy.stall()

    def heal_failover(self) -> None:
        self.replica.stop()
        self.repl_proxy.stop()
        self.replica = self.repl_proxy = None
        self.store_proxy.retarget("127.0.0.1", self.store.port, drop=True)

    def pg_terminate(self, backend_pid: int) -> dict:
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [backend_pid])
            done = cursor.fetchone()[0]
        return self.note(
            "fault", kind="pg_terminate_backend", backend_pid=backend_pid, terminated=done
        )

    # -- split brain of the lock store ---------------------------------------------------------

    def split_store(self, minority=("w1",)) -> dict:
        """Split brain of the lock store: the replica is promoted and every worker not named in
        ``minority`` (worker names) is moved to it, while the ``minority`` workers stay on the
        old primary, where their leases live and their heartbeats go on renewing them.

        Needs ``worker_stores=True`` and a stalled replica (:meth:`start_replica`, before the
        leases the promoted side must not see are taken). Fencing tokens are Redis-time based
        and both servers share this host's clock, so a lease granted on the promoted side
        after the split carries a newer fence than one granted before it on the old primary.
        The majority's connections are reset (as a failover does); ``store_proxy`` and
        :meth:`store_client` still mean the old primary until :meth:`heal_split`. A worker
        restarted meanwhile (:meth:`ensure_workers`) stays on its side; one first started
        under a new name joins the old primary's. Returns the
        history entry (``kind="split_store"``, ``minority``, ``majority``). Raises
        RuntimeError without ``worker_stores``, without a replica, or when already split.
        """
        if not self.worker_stores:
            raise RuntimeError("split_store needs Lab(worker_stores=True)")
        if self.replica is None:
            raise RuntimeError("split_store needs a replica: call start_replica() first")
        if self.split is not None:
            raise RuntimeError("the lock store is split already: heal_split() first")
        minority = frozenset(minority)
        majority = frozenset(self.workers) - minority
        client = redis.Redis(host="127.0.0.1", port=self.replica.port, socket_timeout=5)
        client.execute_command("REPLICAOF", "NO", "ONE")
        client.close()
        for name in sorted(majority):
            self.worker_store_proxy(name).retarget("127.0.0.1", self.replica.port, drop=True)
        self.split = (minority, majority)
        return self.note(
            "fault",
            kind="split_store",
            minority=sorted(minority),
            majority=sorted(majority),
            to_port=self.replica.port,
        )

    def heal_split(self) -> dict:
        """End :meth:`split_store`: the promoted side wins (as Sentinel decides), so
        ``store_proxy`` moves to it and every worker goes back through ``store_proxy``; what
        the minority wrote on the old primary since the split is lost. Every worker's
        lock-store connections are reset. The replica stays the store until the next trial
        (``new_trial`` heals the failover). Returns the history entry
        (``kind="heal_split"``). Raises RuntimeError when the store is not split."""
        if self.split is None:
            raise RuntimeError("the lock store is not split")
        self.store_proxy.retarget("127.0.0.1", self.replica.port, drop=True)
        for proxy in self.worker_proxies.values():
            proxy.retarget("127.0.0.1", self.store_proxy.port, drop=True)
        minority, majority = self.split
        self.split = None
        return self.note(
            "fault", kind="heal_split", minority=sorted(minority), majority=sorted(majority)
        )
