"""The randomized fault run (``make nemesis``, ``scripts/nemesis.py``): a client sends step tasks
(duplicates, compensations, retries, resumes and the distributed patterns) to a few workers of
mixed pools while a nemesis injects random faults from the fault suite's catalogue, several at
once; at the end everything heals, the system settles, and the run directory holds what the
whole-run checker needs (history, steps, committed records, lock-store leftovers, run.json).

Reproducible from its seed *as far as the schedule goes*: one ``random.Random(seed)`` plans,
before anything starts, what the client sends when (:func:`plan_client`) and which fault kind
fires when with which parameters (:func:`plan_faults`). The interleavings of real processes
(which attempt a fault hits, which pid is a worker's second child, what the network delays)
are not reproducible, and neither are the outcomes that follow from them.

A planned target is an index (``target``), resolved at the moment of the fault against what
is alive then (``target % len(candidates)``), so the plan does not depend on pids.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.support import processes, servers
from tests.support.faults import checker, clock
from tests.support.faults.lab import KEY_PREFIX, ROOT, TERMINAL, Lab
from tests.support.faults.proxy import TcpProxy
from tests.support.faults import backends  # the broker and database choices

PATTERNS = "django_app.faults.patterns"
DEP_FAILING = "faults:dep:failing"
WORKER_APP_NAME = "steplock-nemesis-worker"
TARGET_WAIT = 2.0  # seconds a fault waits for a target to exist
#: Seconds a killed main process's prefork children are watched for their end (pdeathsig).
CHILDREN_WAIT = 1.0
SLOTS_BURST = 4  # concurrency-limited tasks sent at once by a burst of the "slots" action

#: (name, pool, concurrency): what two cores carry beside PostgreSQL, Redis and the proxies.
WORKERS = (
    ("n1", "prefork", 2),
    ("n2", "prefork", 2),
    ("n3", "prefork", 1),
    ("n4", "threads", 4),
)

#: Fault kinds (the names of the run directory's history) and their relative weights.
KINDS = {
    "kill_child": 3,
    "kill_main": 1,
    "pause": 2,
    "redis_restart": 1,
    "redis_failover": 1,
    "redis_latency": 2,
    "redis_blackhole": 1,
    "redis_drop": 2,
    "pg_latency": 2,
    "pg_blackhole": 1,
    "pg_drop": 2,
    "pg_terminate": 2,
    "lost_commit_reply": 1,
    "heartbeat_frozen": 2,
    "split_brain": 2,
    # stored times ahead after a failover (tests/support/faults/clock.py)
    "clock_ahead": 1,
}
LASTING = {
    "receiver_down",
    "pause",
    "redis_latency",
    "redis_blackhole",
    "pg_latency",
    "pg_blackhole",
    "lost_commit_reply",
    "heartbeat_frozen",
    "split_brain",
}

#: Client actions per new step and their relative weights.
ACTIONS = {
    "forward": 2,
    "dup_same_id": 3,
    "dup_new_id": 2,
    "compensate_race": 3,
    "forward_retry": 2,
    "rate": 2,
    "slots": 2,
    "breaker": 2,
    "idempotent": 2,
    "stage_reset": 3,
    "stale_aba": 1,
}

#: The effects outbox's workloads (``workload="outbox"``, its negative control
#: ``"outbox-in-body"``): one more client action and one more fault kind, added to the
#: catalogue only then, so the default plans of a seed do not change.
WORKLOADS = ("patterns", "outbox", "outbox-in-body")
#: The breaker task's modes: ``bypass`` is the negative control of the breaker invariants (a
#: refused call is made anyway; ``STEPLOCK_FAULTS_BREAKER``, django_app/faults/patterns.py).
BREAKER_MODES = ("guarded", "bypass")
OUTBOX_ACTIONS = {"outbox": 4}
OUTBOX_KINDS = {"receiver_down": 2}
EFFECTS = "django_app.faults.effects"

#: The lock store's topologies (``store=``, ``scripts/nemesis.py --store``): ``single``, one
#: redis-server behind the controller's proxies (the default), or ``sentinel``, a primary, a
#: replica and three sentinels (``tests/support/sentinel.py``) that the workers reach through
#: the library's ``sentinel://`` URL and ``master_name`` transport option, or ``cluster``, a
#: Redis Cluster of 3 primaries and 3 replicas (``tests/support/faults/cluster_store.py``)
#: reached with ``STEPLOCK_REDIS_CLUSTER=1`` and one node's URL.
STORES = ("single", "sentinel", "cluster")
#: Kinds that act on the single node's proxies or process, left out of the Sentinel plan: the
#: proxy retarget failover and split, and the faults of ``store_proxy`` (latency, blackhole,
#: drop), which is on no worker's path there; a restart of one node is Sentinel's own fault
#: detection, another trial than a forced failover.
SINGLE_STORE_KINDS = (
    "redis_restart",
    "redis_failover",
    "redis_latency",
    "redis_blackhole",
    "redis_drop",
    "split_brain",
)
#: The Sentinel topology's own kind: ``SENTINEL FAILOVER`` forced while leases are held.
SENTINEL_KINDS = {"sentinel_failover": 2}
SENTINEL_MASTER = "steplock-nemesis"
#: The cluster topology's own kinds (without :data:`SINGLE_STORE_KINDS`): a failover of the
#: primary serving a held lease's slot, and a migration of that slot to another primary.
CLUSTER_KINDS = {"cluster_failover": 2, "slot_migration": 2}


def actions_of(workload: str = "patterns") -> dict:
    """The client actions (name -> weight) of ``workload`` (one of :data:`WORKLOADS`)."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    return {**ACTIONS, **OUTBOX_ACTIONS} if workload != "patterns" else dict(ACTIONS)


def kinds_of(workload: str = "patterns", store: str = "single", broker: str = "redis") -> dict:
    """The fault kinds (name -> weight) of ``workload`` on the lock-store topology ``store``
    (one of :data:`STORES`): on ``"sentinel"``, :data:`KINDS` without
    :data:`SINGLE_STORE_KINDS`, plus :data:`SENTINEL_KINDS`; on ``"cluster"``, plus
    :data:`CLUSTER_KINDS` instead. Raises ValueError for an unknown
    ``store``."""
    if store not in STORES:
        raise ValueError(f"store must be one of {STORES}, got {store!r}")
    kinds = {**KINDS, **OUTBOX_KINDS} if workload != "patterns" else dict(KINDS)
    if store != "single":
        kinds = {k: w for k, w in kinds.items() if k not in SINGLE_STORE_KINDS}
        kinds.update(SENTINEL_KINDS if store == "sentinel" else CLUSTER_KINDS)
    # broker (backends.BROKERS): "rabbitmq" adds backends.BROKER_KINDS (broker_restart,
    # broker_channel_close); the database's kinds keep their pg_* names on MariaDB
    if broker not in backends.BROKERS:
        raise ValueError(f"broker must be one of {backends.BROKERS}, got {broker!r}")
    if broker == "rabbitmq":
        kinds.update(backends.BROKER_KINDS)
    return kinds


# -- the plan (pure functions of the seed) ------------------------------------------------------


def plan_client(
    rng: random.Random, duration: float, mean_gap: float = 0.6, actions: dict | None = None
) -> list[dict]:
    """What the client does when: ``{"at": seconds from the start, "action", ...}``, sorted
    by ``at``. Each ``step`` action creates a step (``n``: its index in the run) and sends its
    tasks; ``resume`` re-sends ``forward`` to step ``n`` if it is then idle and not terminal;
    ``dep_burst`` makes the breaker's fake dependency fail for ``seconds``. A breaker step is
    called again (``task``) a few times while it is not done: its calls fail in a burst."""
    plan = []
    names, weights = zip(*(actions or ACTIONS).items())
    at, n = 0.5, 0
    while at < duration:
        action = rng.choices(names, weights)[0]
        burst = 6 if action == "rate" and rng.random() < 0.2 else 1
        for _ in range(burst):
            plan.append(
                {
                    "at": round(at, 3),
                    "action": "step",
                    "kind": action,
                    "n": n,
                    "work": round(rng.uniform(0.0, 0.3), 3),
                    "slot_work": round(rng.uniform(0.3, 1.2), 3),
                    "gap": round(rng.uniform(0.0, 0.3), 3),
                }
            )
            if action == "breaker":  # a failed call is called again, breaker permitting
                for delay in (2.0, 5.0, 10.0, 20.0):
                    plan.append(
                        {
                            "at": round(at + delay * rng.uniform(0.8, 1.2), 3),
                            "action": "resume",
                            "n": n,
                            "task": "breaker_forward",
                        }
                    )
            elif rng.random() < 0.25:
                plan.append(
                    {
                        "at": round(at + rng.uniform(4.0, 15.0), 3),
                        "action": "resume",
                        "n": n,
                    }
                )
            n += 1
        if rng.random() < 0.02:
            plan.append(
                {
                    "at": round(at, 3),
                    "action": "dep_burst",
                    "seconds": round(rng.uniform(4, 10), 3),
                }
            )
        at += rng.expovariate(1.0 / mean_gap)
    plan = [p for p in plan if p["at"] < duration]
    plan.sort(key=lambda p: p["at"])  # stable: equal times keep their planned order
    return plan


def plan_faults(
    rng: random.Random,
    duration: float,
    ttl: float,
    mean_gap: float = 3.0,
    kinds: dict | None = None,
    start: float = 2.0,
) -> list[dict]:
    """When which fault fires: ``{"at", "kind", "target", "target2", "seconds"}`` sorted by
    ``at``; ``seconds`` is how long a lasting fault lasts (0.5 to 3 TTLs; a pause 1.2 to 3
    TTLs, past the TTL) or its latency's size for the latency kinds (``latency``). With
    probability 0.2 a second fault fires at the same moment."""
    kinds = dict(kinds or KINDS)
    names, weights = zip(*kinds.items())
    plan = []
    at = start + rng.expovariate(1.0 / mean_gap)
    while at < duration:
        for _ in range(2 if rng.random() < 0.2 else 1):
            kind = rng.choices(names, weights)[0]
            low = 1.2 if kind == "pause" else 0.5
            fault = {
                "at": round(at, 3),
                "kind": kind,
                "target": rng.randrange(1 << 16),
                "target2": rng.randrange(1 << 16),
                "seconds": round(rng.uniform(low, 3.0) * ttl, 3),
                "latency": round(rng.uniform(0.05, 1.0) * ttl, 3),
                "lag": round(rng.uniform(0.0, 1.0), 3),
            }
            plan.append(fault)
        at += rng.expovariate(1.0 / mean_gap)
    return plan


def plan(
    seed: int,
    duration: float,
    ttl: float,
    kinds: dict | None = None,
    actions: dict | None = None,
    **gaps,
) -> dict:
    """The whole schedule of a run: ``{"client": [...], "faults": [...]}``, the same for the
    same arguments; on one seed, the schedule of a shorter ``duration`` is the part of a
    longer one's before that time."""
    rng = random.Random(seed)
    # One stream each, drawn from the seed's: a shorter run's schedule is a prefix of a
    # longer one's on the same seed (the client's draws do not shift the nemesis's).
    client_rng, fault_rng = random.Random(rng.getrandbits(64)), random.Random(rng.getrandbits(64))
    client = plan_client(client_rng, duration, gaps.get("client_gap", 0.6), actions)
    faults = plan_faults(fault_rng, duration, ttl, gaps.get("fault_gap", 3.0), kinds)
    return {"client": client, "faults": faults}


# -- the lab ------------------------------------------------------------------------------------


@dataclass
class Active:
    """A lasting fault being applied: healed at ``until`` (wall seconds)."""

    kind: str
    key: str
    fault_t: float
    until: float
    heal: object = field(repr=False)


class NemesisLab(Lab):
    """A :class:`Lab` with the workers of ``workers`` (name, pool, concurrency), a replica to
    fail over to, a client and a nemesis; see the module docstring. ``seed`` and ``duration``
    (seconds) fix the plan; ``kinds`` restricts or reweights the fault kinds; ``out`` is the
    run directory. ``store`` is the lock store's topology (:data:`STORES`): ``"sentinel"``
    runs it as :class:`~tests.support.sentinel.SentinelGroup` (``self.sentinel``), reached by
    the workers through the sentinels, with the kinds of :func:`kinds_of` for it."""

    def __init__(
        self,
        workdir: Path,
        db_settings: dict,
        seed: int,
        duration: float,
        out: Path,
        ttl: float = 2.0,
        unguarded: bool = False,
        guard: str = "fenced",
        workers=WORKERS,
        kinds: dict | None = None,
        client_gap: float = 0.6,
        fault_gap: float = 3.0,
        restart_delay: float = 1.0,
        log=print,
        workload: str = "patterns",
        breaker: str = "guarded",
        patterns: str = "guarded",
        store: str = "single",
        broker: str = "redis",
        loads=(),
        load_modes: dict | None = None,
    ):
        if store not in STORES:
            raise ValueError(f"store must be one of {STORES}, got {store!r}")
        super().__init__(
            workdir,
            db_settings,
            ttl=ttl,
            visibility_timeout=10,
            unguarded=unguarded,
            log=log,
            guard=guard,
            # a lock-store path per worker: the split_brain fault (single node only)
            worker_stores=store == "single",
            broker=broker,  # backends.BROKERS; the database is db_settings' engine
        )
        self.store_kind = store
        self.sentinel = None  # the SentinelGroup of store="sentinel", once started
        self.sentinel_thread: threading.Thread | None = None  # a failover under way
        self.primary_port: int | None = None  # the last primary the sentinels agreed on
        self.cluster_store = None  # the ClusterStore of store="cluster", once started
        self.seed = seed
        self.duration = float(duration)
        self.out = Path(out)
        self.spec = {name: (pool, concurrency) for name, pool, concurrency in workers}
        self.workload = workload
        # "bypass": the breaker invariants' negative control (django_app/faults/patterns.py)
        if breaker not in BREAKER_MODES:
            raise ValueError(f"breaker must be one of {BREAKER_MODES}, got {breaker!r}")
        self.breaker = breaker
        # "bypass": the rate, concurrency and idempotency rules' negative control
        if patterns not in BREAKER_MODES:
            raise ValueError(f"patterns must be one of {BREAKER_MODES}, got {patterns!r}")
        self.patterns = patterns
        self.actions = actions_of(workload)
        self.kinds = dict(kinds or kinds_of(workload, store, broker))
        self.restart_delay = restart_delay
        self.client_gap, self.fault_gap = client_gap, fault_gap
        self.schedule = plan(
            seed,
            self.duration,
            ttl,
            self.kinds,
            self.actions if workload != "patterns" else None,
            client_gap=client_gap,
            fault_gap=fault_gap,
        )
        # the outbox workloads: step -> its sink step, the HTTP receiver, the relay
        self.sinks: dict[int, int] = {}
        self.receiver = None
        self.relay = None
        self.steps: list[int] = []
        self.faults: dict[str, int] = {}
        self.skipped: dict[str, int] = {}
        self.active: list[Active] = []
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        self.errors: list[str] = []
        self.replicas = 0
        self.replica_ready = threading.Event()
        self.dead_since: dict[str, float] = {}
        self.orphaned: dict[str, list[int]] = {}  # worker -> its children when its main was killed
        # --loads (tests/support/faults/loads.py): http, writers, periodic and their modes
        from tests.support.faults.loads import Loads

        self.loads = Loads(self, loads, seed=seed, **(load_modes or {}))

    # -- workers: mixed pools, a supervisor ---------------------------------------------------

    def ensure_workers(self, names=None) -> None:
        """Start every worker of the spec that is not running (a killed main process: its
        orphaned children are SIGKILLed with the group and noted as such)."""
        env = {**os.environ, **self.worker_env()}
        for name in names or self.spec:
            pool, concurrency = self.spec[name]
            worker = self.workers.get(name)
            if worker is not None and worker.alive():
                continue
            if worker is not None:
                orphans = worker.group_pids()
                worker.kill()
                if orphans:
                    self.note(
                        "fault",
                        kind="kill_main",
                        follow_up=True,
                        signal="SIGKILL",
                        pid=orphans,
                        why="orphans of a killed main process, ended by the supervisor",
                    )
                gone = [p for p in self.orphaned.pop(name, []) if p not in orphans]
                if gone:
                    self.note(
                        "fault",
                        kind="kill_main",
                        follow_up=True,
                        signal="SIGKILL",
                        pid=gone,
                        why="children of a killed main process, gone by its restart",
                    )
            self.note("restart_workers", worker=name)
            if self.worker_stores:  # a restarted worker stays on its side of a split
                env = {**env, "STEPLOCK_REDIS_URL": self.worker_store_proxy(name).url()}
            self.workers[name] = processes.celery_worker(
                app="django_app",
                name=name,
                concurrency=concurrency,
                pool=pool,
                env=env,
                logfile=self.workdir / f"{name}.log",
                cwd=ROOT,
            )

    def worker_env(self) -> dict:
        env = super().worker_env()
        env["STEPLOCK_FAULTS_IDEMPOTENCY_LOCK_TTL"] = str(max(8.0, 4 * self.ttl))
        if self.breaker != "guarded":
            env["STEPLOCK_FAULTS_BREAKER"] = self.breaker
        if self.patterns != "guarded":
            env["STEPLOCK_FAULTS_PATTERNS"] = self.patterns
        # pg_terminate picks among the workers' sessions, never the controller's own.
        env["DATABASE_URL"] = self.database.worker_url(self.pg_proxy.port, WORKER_APP_NAME)
        if self.sentinel is not None:  # the library's Sentinel configuration (docs/redis.md)
            env["STEPLOCK_REDIS_TRANSPORT_OPTIONS"] = json.dumps(self.sentinel.transport_options)
        if self.cluster_store is not None:  # the library's cluster client (docs/cluster.md)
            env["STEPLOCK_REDIS_CLUSTER"] = "1"
        return env

    def lock_store_url(self) -> str:
        """The sentinels' ``sentinel://`` URL on Sentinel, a live node's on a cluster, else
        the store proxy's."""
        if self.cluster_store is not None:
            return self.cluster_store.url()
        return self.sentinel.url if self.sentinel is not None else super().lock_store_url()

    # -- the Sentinel topology ----------------------------------------------------------------

    def start_lock_store(self) -> None:
        """With ``store="sentinel"`` the lock store is a
        :class:`~tests.support.sentinel.SentinelGroup` (a primary, a replica, three
        sentinels) instead of the single node and its proxy."""
        if self.store_kind == "single":
            super().start_lock_store()
            return
        if self.store_kind == "cluster":
            from tests.support.faults.cluster_store import ClusterStore

            self.cluster_store = ClusterStore(self).start()
            return
        from tests.support.sentinel import SentinelGroup

        self.sentinel = SentinelGroup(SENTINEL_MASTER, workdir=self.workdir / "sentinel").start()
        self.primary_port = self.sentinel.primary_port()

    def stop(self) -> None:
        # a run ended early (Ctrl-C, an error): its loads' processes go by their pids too
        if self.loads.writer is not None and self.loads.writer.poll() is None:
            self.loads.writer.kill()
            self.loads.writer.wait(10)
        if self.loads.server is not None:
            self.loads.server.stop()
            self.loads.server = None
        if self.sentinel_thread is not None:
            self.sentinel_thread.join(60)
        super().stop()
        if self.sentinel is not None:
            self.sentinel.stop()
        if self.cluster_store is not None:
            self.cluster_store.stop()

    def store_client(self) -> redis.Redis:
        """A client on the lock store's primary: on Sentinel, the one the sentinels agree on
        (the last one they agreed on while they disagree, mid-failover); on a cluster, a
        :class:`~tests.support.faults.cluster_store.ClusterClient` (scans every primary)."""
        if self.cluster_store is not None:
            return self.cluster_store.client()
        if self.sentinel is None:
            return super().store_client()
        try:
            self.primary_port = self.sentinel.primary_port()
        except Exception:  # noqa: BLE001 - mid-failover: the last agreed primary
            pass
        return redis.Redis(
            host="127.0.0.1", port=self.primary_port, decode_responses=True, socket_timeout=5
        )

    def held(self) -> dict:
        """What the lock store holds now: ``{"leases": step leases, "slots": concurrency
        slots, "probes": the breaker's half-open probe permits}`` (counts; keys
        ``<prefix>:lease:{step:<id>}``, ``<prefix>:lease:{<limit key>}#<i>}`` and the sorted
        set ``<prefix>:breaker-probes:{<name>}``, celery_steplock/lock.py, patterns/)."""
        from django_app.faults import patterns

        client = self.store_client()
        keys = list(client.scan_iter(match=f"{KEY_PREFIX}:lease:*", count=1000))
        probes = client.zcard(f"{KEY_PREFIX}:breaker-probes:{{{patterns.BREAKER_NAME}}}")
        return {
            "leases": sum(1 for k in keys if k.startswith(f"{KEY_PREFIX}:lease:{{step:")),
            "slots": sum(1 for k in keys if "}#" in k),
            "probes": probes,
        }

    def do_sentinel_failover(self) -> dict | None:
        """Force ``SENTINEL FAILOVER`` while at least one step lease is held; None (no target
        yet) while none is or while the previous failover is still under way. The failover
        runs in a thread (:meth:`_sentinel_failover`): the fault entry is noted before the
        command is sent (``from_port``, ``held``: what the store held then, :meth:`held`)."""
        if self.sentinel_thread is not None and self.sentinel_thread.is_alive():
            return None
        held = self.held()
        if not held["leases"]:
            return None
        entry = self.note(
            "fault", kind="sentinel_failover", from_port=self.primary_port, held=held
        )
        self.sentinel_thread = threading.Thread(
            target=self._sentinel_failover, args=(entry,), name="sentinel-failover", daemon=True
        )
        self.sentinel_thread.start()
        return entry

    def _sentinel_failover(self, entry: dict, promote_wait: float = 30.0) -> None:
        """The failover of ``entry``: send ``SENTINEL FAILOVER``, watch the replica's role
        every 20 ms until it is promoted, then wait until the group is at rest again
        (:meth:`SentinelGroup.converged`: one primary, the other node its replica).

        From the promotion until then the group has two primaries: the promoted replica,
        which clients reach as soon as a sentinel reports it, and the old one, which goes on
        taking the writes of the connections still open to it until the sentinels turn it
        into a replica (about 15 s; docs/redis.md, "Sentinel's own split-brain window"),
        when what it took meanwhile is lost. That window is noted as what it is in the
        checker's terms: a ``split_brain`` fault entry marked ``follow_up`` (not counted as a
        fault of its own) with ``cause="sentinel_failover"``, at the promotion, healed at rest.
        The end is a ``heal`` entry of ``sentinel_failover`` with ``from_port``, ``to_port``,
        ``aborted`` (the old primary is the primary again) and the seconds to the promotion
        (``promoted_s``) and to rest (``settled_s``), or its ``error`` (then also in
        ``errors``: the run is not valid)."""
        began = time.monotonic()
        old = entry["from_port"]
        fields: dict = {"from_port": old}
        split = None
        try:
            self.sentinel.request_failover(promote_wait)
            others = [n.port for n in self.sentinel.nodes if n.port != old]
            deadline = time.monotonic() + promote_wait
            promoted = None
            while promoted is None and time.monotonic() < deadline:
                roles = self.sentinel.roles()
                promoted = next((p for p in others if roles[p][0] == "master"), None)
                if promoted is None:
                    time.sleep(0.02)
            if promoted is not None:
                fields["promoted_s"] = round(time.monotonic() - began, 3)
                split = self.note(
                    "fault",
                    kind="split_brain",
                    follow_up=True,
                    cause="sentinel_failover",
                    failover_t=entry["t"],
                    primaries=[old, promoted],
                )
            deadline = time.monotonic() + 90.0
            while (primary := self.sentinel.converged()) is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the group is not at rest 90 s on: {self.sentinel.roles()}"
                    )
                time.sleep(0.1)
            self.primary_port = primary
            fields.update(
                to_port=primary,
                aborted=primary == old,
                settled_s=round(time.monotonic() - began, 3),
            )
        except Exception as exc:  # noqa: BLE001 - noted, and the run is not valid
            self.errors.append(f"heal sentinel_failover: {type(exc).__name__}: {exc}")
            fields["error"] = f"{type(exc).__name__}: {exc}"
        if split is not None and "error" not in fields:
            self.note(
                "heal",
                kind="split_brain",
                follow_up=True,
                cause="sentinel_failover",
                fault_t=split["t"],
            )
        self.note("heal", kind="sentinel_failover", fault_t=entry["t"], **fields)

    def supervise(self) -> None:
        """A process supervisor: a worker whose main process died is started again after
        ``restart_delay`` seconds."""
        while not self.stopping.is_set():
            for name in list(self.spec):
                worker = self.workers.get(name)
                if worker is None or worker.alive():
                    self.dead_since.pop(name, None)
                    continue
                since = self.dead_since.setdefault(name, time.monotonic())
                if time.monotonic() - since >= self.restart_delay:
                    try:
                        self.ensure_workers([name])
                    except Exception as exc:  # noqa: BLE001 - try again next round
                        self.errors.append(f"restart {name}: {exc}")
                    self.dead_since.pop(name, None)
            self.stopping.wait(0.2)

    # -- the lock store's replica -------------------------------------------------------------

    def prepare_replica(self) -> None:
        """A replica following the current store through a proxy (not stalled), ready for the
        next failover."""
        self.replica_ready.clear()
        self.replicas += 1
        repl_proxy = TcpProxy("127.0.0.1", self.store.port).start()
        # REPLICAOF at run time, not in its arguments: once promoted it stays a primary
        # across a restart.
        replica = servers.RedisServer(workdir=self.workdir / f"replica{self.replicas}").start()
        client = redis.Redis(
            host="127.0.0.1", port=replica.port, decode_responses=True, socket_timeout=5
        )
        try:
            client.execute_command("REPLICAOF", "127.0.0.1", repl_proxy.port)
            processes.wait_until(
                lambda: client.info("replication").get("master_link_status") == "up",
                30,
                what="the replica to sync",
            )
        finally:
            client.close()
        self.repl_proxy, self.replica = repl_proxy, replica
        self.replica_ready.set()

    def do_failover(self, lag: float) -> dict | None:
        """Stall the replication feed ``lag`` seconds (the replica misses those writes),
        promote the replica, move every client to it; the old primary is stopped and a fresh
        replica of the new one is prepared in the background."""
        if not self.replica_ready.is_set():
            return None
        self.replica_ready.clear()
        self.repl_proxy.stall()
        time.sleep(lag)
        client = redis.Redis(host="127.0.0.1", port=self.replica.port, socket_timeout=5)
        client.execute_command("REPLICAOF", "NO", "ONE")
        client.close()
        self.store_proxy.retarget("127.0.0.1", self.replica.port, drop=True)
        entry = self.note("fault", kind="redis_failover", to_port=self.replica.port, lag=lag)
        old, old_proxy = self.store, self.repl_proxy
        self.store, self.replica, self.repl_proxy = self.replica, None, None
        old_proxy.stop()
        old.stop()
        threading.Thread(target=self._prepare_quietly, daemon=True).start()
        return entry

    def do_split(self, fault: dict, seconds: float) -> dict | None:
        """Split brain of the lock store for ``seconds``: the replica (its feed stalled
        ``lag`` seconds first, so it misses those writes) is promoted and every worker but one
        (``target``) moves to it; the one left on the old primary keeps its leases there and
        renews them. The heal lets the promoted side win (as Sentinel would): every worker
        moves to it, what the old primary took since the split is lost, and a fresh replica
        is prepared in the background. See :meth:`Lab.split_store`."""
        if self.split is not None or not self.replica_ready.is_set():
            return None
        self.replica_ready.clear()
        self.repl_proxy.stall()
        time.sleep(fault["lag"])
        names = sorted(self.workers)
        minority = [names[fault["target"] % len(names)]]
        majority = [n for n in names if n not in minority]
        replica = self.replica
        client = redis.Redis(host="127.0.0.1", port=replica.port, socket_timeout=5)
        client.execute_command("REPLICAOF", "NO", "ONE")
        client.close()
        for name in majority:
            self.worker_store_proxy(name).retarget("127.0.0.1", replica.port, drop=True)
        self.split = (frozenset(minority), frozenset(majority))

        def heal():
            self.store_proxy.retarget("127.0.0.1", replica.port, drop=True)
            for proxy in self.worker_proxies.values():
                proxy.retarget("127.0.0.1", self.store_proxy.port, drop=True)
            self.split = None
            old, old_proxy = self.store, self.repl_proxy
            self.store, self.replica, self.repl_proxy = replica, None, None
            old_proxy.stop()
            old.stop()
            threading.Thread(target=self._prepare_quietly, daemon=True).start()
            return {"minority": minority, "to_port": replica.port}

        return self._last(
            "split_brain",
            "split_brain",
            seconds,
            heal,
            minority=minority,
            majority=majority,
            # the store proxy (the writer, the HTTP server, the controller) stays on the old
            # primary until the heal: the minority's side
            minority_via=[self.worker_store_proxy(n).port for n in minority]
            + [self.store_proxy.port],
            to_port=replica.port,
            lag=fault["lag"],
        )

    def _prepare_quietly(self) -> None:
        try:
            self.prepare_replica()
        except Exception as exc:  # noqa: BLE001 - the next failover is skipped then
            self.errors.append(f"replica: {exc}")

    # -- faults -------------------------------------------------------------------------------

    def prefork_children(self) -> list[int]:
        pids = []
        for name in sorted(self.workers):
            worker = self.workers[name]
            if self.spec[name][0] == "prefork" and worker.alive():
                pids += worker.children_pids()
        return pids

    def task_processes(self) -> list[int]:
        """The processes that run task bodies: prefork children and threads workers' mains."""
        pids = self.prefork_children()
        for name in sorted(self.workers):
            if self.spec[name][0] != "prefork" and self.workers[name].alive():
                pids.append(self.workers[name].pid)
        return pids

    def worker_backends(self) -> list[int]:
        """The workers' database sessions (backend pids; MariaDB: processlist ids)."""
        return self.database.worker_sessions(WORKER_APP_NAME)

    def _last(self, kind: str, key: str, seconds: float, heal, **fields) -> dict:
        """Note a lasting fault and schedule its heal; the same fault on a target already
        under it extends the running one (one heal, at the later end)."""
        now = time.time()
        for active in self.active:
            if active.key == key:
                active.until = max(active.until, now + seconds)
                return self.note(
                    "fault", kind=kind, seconds=seconds, extends=active.fault_t, **fields
                )
        entry = self.note("fault", kind=kind, seconds=seconds, **fields)
        self.active.append(Active(kind, key, entry["t"], entry["t"] + seconds, heal))
        return entry

    def heal_due(self, force: bool = False) -> None:
        now = time.time()
        for active in list(self.active):
            if force or active.until <= now:
                self.active.remove(active)
                try:
                    fields = active.heal() or {}
                except Exception as exc:  # noqa: BLE001 - heal_all() heals everything again
                    self.errors.append(f"heal {active.kind}: {type(exc).__name__}: {exc}")
                    fields = {"error": f"{type(exc).__name__}: {exc}"}
                self.note("heal", kind=active.kind, fault_t=active.fault_t, **fields)

    def inject(self, fault: dict) -> dict | None:
        """Apply one planned fault; returns its history entry, or None when it had no target
        (no child alive, no replica ready yet): counted in ``skipped``."""
        kind, target, seconds = fault["kind"], fault["target"], fault["seconds"]
        if kind == "receiver_down":
            if self.receiver is None:
                return None
            self.receiver.stop()
            receiver = self.receiver
            return self._last(kind, kind, seconds, lambda: receiver.start() and None)
        if kind == "kill_child":
            pids = self.prefork_children()
            if not pids:
                return None
            pid = pids[target % len(pids)]
            # noted once sent: every entry of the process comes before its fault's
            processes._signal_pid(pid, signal.SIGKILL)
            return self.note("fault", kind=kind, signal="SIGKILL", pid=pid)
        if kind == "kill_main":
            alive = [self.workers[n] for n in sorted(self.workers) if self.workers[n].alive()]
            if not alive:
                return None
            worker = alive[target % len(alive)]
            # its children, to note when they are gone (a prefork child whose parent died
            # may exit without a word: its holds end by then, not never)
            children = worker.children_pids()
            processes._signal_pid(worker.pid, signal.SIGKILL)
            entry = self.note(
                "fault", kind=kind, signal="SIGKILL", pid=worker.pid, worker=worker.name
            )
            # Celery's prefork children ask for SIGKILL at their parent's death (pdeathsig):
            # those seen gone within CHILDREN_WAIT are noted then, the rest at the restart
            deadline = time.monotonic() + CHILDREN_WAIT
            while children and time.monotonic() < deadline:
                live = set(worker.group_pids())
                if not live.intersection(children):
                    break
                time.sleep(0.02)
            live = set(worker.group_pids())
            gone = [p for p in children if p not in live]
            if gone:
                self.note(
                    "fault",
                    kind=kind,
                    follow_up=True,
                    signal="SIGKILL",
                    pid=gone,
                    why="children of a killed main process, ended with it (parent-death signal)",
                )
            self.orphaned[worker.name] = [p for p in children if p in live]
            return entry
        if kind in ("pause", "heartbeat_frozen"):
            pids = self.task_processes()
            if fault["target2"] % 4 == 0 and kind == "pause":  # now and then a main process
                pids = [
                    self.workers[n].pid for n in sorted(self.workers) if self.workers[n].alive()
                ]
            if not pids:
                return None
            pid = pids[target % len(pids)]
            if kind == "pause":
                processes._signal_pid(pid, signal.SIGSTOP)

                def heal(pid=pid):
                    processes._signal_pid(pid, signal.SIGCONT)
                    return {"signal": "SIGCONT", "pid": pid}

                return self._last(kind, f"pause:{pid}", seconds, heal, signal="SIGSTOP", pid=pid)
            # nx: a freeze that extends a running one keeps its token (a new one would let the
            # waiting receiver go, and one renewal through, before it froze again)
            self.r.set(f"faults:freeze:{pid}", uuid.uuid4().hex, nx=True)

            def thaw(pid=pid):
                self.r.delete(f"faults:freeze:{pid}")
                return {"pid": pid}

            return self._last(kind, f"freeze:{pid}", seconds, thaw, pid=pid)
        if kind == "redis_restart":
            self.store.restart()
            return self.note("fault", kind=kind, port=self.store.port)
        if kind == "redis_failover":
            return self.do_failover(fault["lag"])
        if kind == "split_brain":
            return self.do_split(fault, seconds)
        if kind == "sentinel_failover":
            return self.do_sentinel_failover()
        if kind == "clock_ahead":
            return clock.inject_clock_ahead(self, fault)
        if kind == "cluster_failover":
            return self.cluster_store.failover(fault)
        if kind == "slot_migration":
            return self.cluster_store.migrate(fault)
        if kind in backends.BROKER_KINDS:
            return backends.inject_broker(self, fault)
        path, _, what = kind.partition("_")
        proxy = self.store_proxy if path == "redis" else self.pg_proxy
        if what == "latency":
            proxy.set_latency(fault["latency"])
            return self._last(
                kind, kind, seconds, lambda: proxy.set_latency(0), latency=fault["latency"]
            )
        if what == "blackhole":
            proxy.blackhole()
            return self._last(kind, kind, seconds, proxy.unblackhole)
        if what == "drop":
            dropped = proxy.drop_connections()
            return self.note("fault", kind=kind, dropped=dropped)
        if kind == "pg_terminate":  # on MariaDB too (KILL CONNECTION): the kind keeps its name
            sessions = self.worker_backends()
            if not sessions:
                return None
            backend = sessions[target % len(sessions)]
            done = self.database.terminate(backend)
            return self.note(
                "fault", kind=kind, backend_pid=backend, terminated=done, db=self.database.engine
            )
        if kind == "lost_commit_reply":
            self.pg_proxy.drop_next_reply(match=self.database.commit_match)
            return self._last(kind, kind, seconds, self.pg_proxy.disarm)
        raise ValueError(f"unknown fault kind {kind!r}")

    def nemesis(self, started: float) -> None:
        """Apply the planned faults at their times; heal lasting ones when due. A fault with
        no target at its time (no worker session open, no replica ready yet) is tried again
        for up to ``TARGET_WAIT`` seconds, then counted in ``skipped``."""
        from django.db import connection

        todo = list(self.schedule["faults"])
        waiting: list[dict] = []
        try:
            while not self.stopping.is_set():
                now = time.time()
                with self.lock:
                    self.heal_due()
                    due = []
                    while todo and started + todo[0]["at"] <= now:
                        due.append(todo.pop(0))
                    for fault in waiting + due:
                        try:
                            entry = self.inject(fault)
                        except Exception as exc:  # noqa: BLE001 - a fault that failed is noted
                            self.errors.append(f"{fault['kind']}: {type(exc).__name__}: {exc}")
                            entry = False
                        if fault in waiting:
                            waiting.remove(fault)
                        kind = fault["kind"]
                        if entry:
                            self.faults[kind] = self.faults.get(kind, 0) + 1
                        elif entry is None and now < started + fault["at"] + TARGET_WAIT:
                            waiting.append(fault)
                        else:
                            self.skipped[kind] = self.skipped.get(kind, 0) + 1
                self.stopping.wait(0.05)
        finally:
            connection.close()

    # -- the client ---------------------------------------------------------------------------

    def send(self, task: str, step: int, task_id: str | None = None, module: str = "", **kw):
        name = f"{module or 'django_app.faults.tasks'}.{task}"
        task_id = task_id or str(uuid.uuid4())
        kwargs = kw.pop("kwargs", {})
        self.publisher.send_task(name, args=(step,), kwargs=kwargs, task_id=task_id, **kw)
        self.note("publish", step=step, task=task, task_id=task_id)
        return task_id

    def act(self, item: dict, by_n: dict) -> None:
        action = item["action"]
        if action == "dep_burst":
            self.r.set(DEP_FAILING, "1", px=int(item["seconds"] * 1000))
            self.note("dep_burst", seconds=item["seconds"])
            return
        if action == "resume":
            step = by_n.get(item["n"])
            if step is None:
                return
            status = self.statuses([step]).get(step)
            if status in TERMINAL or self.step_leased(step):
                return
            if step in self.sinks:
                self.note("resume", step=step, task=self.effect_task)
                self.send_effect(step)
                return
            task = item.get("task", "forward")
            if status == "running":
                task = "reset"  # a stage left behind: back to pending first (the reaper's job)
            self.note("resume", step=step, task=task)
            self.send(task, step, module=PATTERNS if task not in ("forward", "reset") else "")
            return
        step = self.new_step(f"nemesis-{item['kind']}")
        by_n[item["n"]] = step
        self.steps.append(step)
        kind, work = item["kind"], {"work": item["work"]}
        if kind == "forward":
            self.send("forward", step, kwargs=work)
        elif kind == "dup_same_id":
            task_id = self.send("forward", step, kwargs=work)
            time.sleep(item["gap"])
            self.send("forward", step, task_id=task_id, kwargs=work)
        elif kind == "dup_new_id":
            self.send("forward", step, kwargs=work)
            time.sleep(item["gap"])
            self.send("forward", step, kwargs=work)
        elif kind == "compensate_race":
            self.send("forward", step, kwargs=work)
            time.sleep(item["gap"])
            self.send("compensate", step, kwargs=work)
        elif kind == "forward_retry":
            self.send("forward_retry", step, kwargs={"countdown": 0.5})
        elif kind == "rate":
            self.send("rate_forward", step, module=PATTERNS, kwargs=work)
        elif kind == "slots":
            self.send("slot_forward", step, module=PATTERNS, kwargs={"work": item["slot_work"]})
            # a third of them come SLOTS_BURST at once: more demand than slots, so the limit
            # refuses (and its negative control runs more than SLOTS at once)
            if item["gap"] < 0.1:
                for _ in range(SLOTS_BURST - 1):
                    extra = self.new_step("nemesis-slots")
                    self.steps.append(extra)
                    self.send(
                        "slot_forward", extra, module=PATTERNS, kwargs={"work": item["slot_work"]}
                    )
        elif kind == "breaker":
            self.send("breaker_forward", step, module=PATTERNS, kwargs=work)
        elif kind == "stage_reset":
            # a slow forward racing a stage and its reset (as the reaper would move a step
            # back): under a split brain only the fence refuses the stale forward
            self.send("forward", step, kwargs={"work": item["slot_work"]})
            time.sleep(item["gap"])
            self.send("start", step, kwargs=work)
            time.sleep(item["gap"])
            self.send("reset", step, kwargs=work)
        elif kind == "outbox":
            # a step whose body declares an HTTP call and a publication (its sink), sent
            # twice with one task id (a duplicate delivery)
            sink = self.new_step("nemesis-sink")
            self.sinks[step] = sink
            self.steps.append(sink)
            task_id = self.send_effect(step, work=item["work"])
            time.sleep(item["gap"])
            self.send_effect(step, task_id=task_id, work=item["work"])
        elif kind == "idempotent":
            task_id = self.send("idem_forward", step, module=PATTERNS, kwargs=work)
            time.sleep(item["gap"])
            self.send("idem_forward", step, task_id=task_id, module=PATTERNS, kwargs=work)
        elif kind == "stale_aba":
            # a holder stalled past its lease while newer ones move the step away and back:
            # the status matches again, only the fence refuses (tests/support/faults/loads.py)
            from tests.support.faults.loads import stale_aba

            stale_aba(self, step, work=item["work"])
        else:
            raise ValueError(f"unknown client action {kind!r}")

    @property
    def effect_task(self) -> str:
        return "effect_in_body" if self.workload == "outbox-in-body" else "effect_forward"

    def send_effect(self, step: int, task_id: str | None = None, work: float = 0.0) -> str:
        """Send the outbox workload's task for ``step`` (and its sink)."""
        kwargs = {"url": self.receiver.url, "sink": self.sinks[step], "work": work}
        return self.send(self.effect_task, step, task_id=task_id, module=EFFECTS, kwargs=kwargs)

    def client(self, started: float) -> None:
        from django.db import connection

        by_n: dict[int, int] = {}
        try:
            for item in self.schedule["client"]:
                while not self.stopping.is_set() and time.time() < started + item["at"]:
                    self.stopping.wait(min(0.05, started + item["at"] - time.time()))
                if self.stopping.is_set():
                    return
                try:
                    self.act(item, by_n)
                except Exception as exc:  # noqa: BLE001 - the database path may be faulted
                    self.errors.append(f"client {item['action']}: {type(exc).__name__}: {exc}")
                    connection.close()
        finally:
            connection.close()

    def step_leased(self, step: int) -> bool:
        try:
            return bool(self.store_client().exists(f"{KEY_PREFIX}:lease:{{step:{step}}}"))
        except redis.RedisError:
            return True

    # -- the run ------------------------------------------------------------------------------

    def executions(self) -> int:
        count = 0
        for raw in self.r.lrange("faults:history", 0, -1):
            if '"ev": "acquired"' in raw or '"ev": "contended"' in raw:
                count += 1
        return count

    def run(self, progress_every: float = 30.0) -> dict:
        """Start everything, run the client and the nemesis for ``duration`` seconds, heal,
        settle and write the run directory; returns the run description (run.json) with the
        settle outcome (``settled``, ``leftover``)."""
        self.started_wall = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
            ).stdout.strip()
            or "unknown"
        )
        for key in self.r.scan_iter(match="faults:*", count=1000):
            self.r.delete(key)
        self.store_client().flushdb()
        self.ensure_workers()
        if self.store_kind == "single":
            self.prepare_replica()
        if self.workload != "patterns":
            from tests.support.faults import outbox
            from tests.support.faults.receiver import Receiver

            self.receiver = Receiver().start()
            self.relay = outbox.Relay(self.publisher).start()
        started = time.time()
        self.note("run", seed=self.seed, duration_s=self.duration, unguarded=self.unguarded)
        if self.loads.names:
            self.loads.start()
        threads = [
            threading.Thread(target=self.client, args=(started,), name="client", daemon=True),
            threading.Thread(target=self.nemesis, args=(started,), name="nemesis", daemon=True),
            threading.Thread(target=self.supervise, name="supervisor", daemon=True),
        ]
        for thread in threads:
            thread.start()
        next_progress = started + progress_every
        while time.time() < started + self.duration:
            time.sleep(0.2)
            if time.time() >= next_progress:
                next_progress += progress_every
                self.progress(started)
        self.stopping.set()
        for thread in threads:
            thread.join(120)
        self.loads.stop()
        self.run_seconds = time.time() - started
        self.heal_all()
        try:
            settled = self.settle_all()
            if self.relay is not None:
                settled["effects_pending"] = self.settle_effects()
        finally:
            if self.relay is not None:
                self.relay.stop()
        try:
            return self.write(settled)
        finally:
            if self.receiver is not None:
                self.receiver.stop()

    def progress(self, started: float) -> None:
        faults = ", ".join(f"{k}={v}" for k, v in sorted(self.faults.items()))
        self.log(
            f"{time.time() - started:.0f}s: steps {len(self.steps)}, executions "
            f"{self.executions()}, faults {sum(self.faults.values())} ({faults})"
        )

    def settle_effects(self, timeout: float = 120.0) -> int:
        """With the relay running: wait until no effect of the run is pending, then the
        relay's period more; returns the effects still pending then."""
        from tests.support.faults import outbox

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not any(r.status == "pending" for r in outbox.rows_of(self.sinks)):
                break
            time.sleep(0.5)
        time.sleep(outbox.RELAY_DELAY + 2 * outbox.RELAY_PERIOD)
        return sum(1 for r in outbox.rows_of(self.sinks) if r.status == "pending")

    def heal_all(self) -> None:
        """End every fault: heal the lasting ones, resume every stopped process, bring the
        store and the workers back."""
        with self.lock:
            self.heal_due(force=True)
            if self.split is not None:  # its heal raised: one primary for everyone anyway
                self.errors.append("split_brain: healed by heal_all after its heal failed")
                for proxy in self.worker_proxies.values():
                    proxy.retarget("127.0.0.1", self.store_proxy.port, drop=True)
                self.split = None
                self.note("heal", kind="split_brain", forced=True)
        self.r.delete(DEP_FAILING)
        if self.receiver is not None and not self.receiver.up:
            self.receiver.start()
        for key in self.r.scan_iter(match="faults:freeze:*"):
            self.r.delete(key)
        if self.sentinel_thread is not None:  # a failover under way ends first
            self.sentinel_thread.join(120)
        if self.cluster_store is not None:  # a change under way ends, every node back
            self.cluster_store.heal()
        single = self.store_kind == "single"
        for proxy in (self.store_proxy, self.pg_proxy) if single else (self.pg_proxy,):
            proxy.set_latency(0)
            proxy.unstall()
            proxy.unblackhole()
            proxy.disarm()
        if single and not self.store.alive():
            self.store.start()
        for worker in self.workers.values():
            worker.signal(signal.SIGCONT, group=True)
        self.ensure_workers()

    def settle_all(self, timeout: float = 240.0) -> dict:
        """Wait until every step is terminal and the broker idle, re-sending ``forward`` (an
        operator's resume; "reset" first for a step left "running") to a step that stays idle and
        not terminal, at most 6 times each;
        then up to one TTL more for the leases to go. Returns ``{"settled": bool, "seconds",
        "leftover": [keys]}``."""
        from django.db import DatabaseError, connection

        began = time.monotonic()
        deadline = began + timeout
        resumed: dict[int, int] = {}
        idle_since = None
        settled = False
        while time.monotonic() < deadline:
            try:
                if self.quiet(self.steps):
                    settled = True
                    break
            except DatabaseError:  # a session ended under it: open another
                connection.close()
                time.sleep(0.2)
                continue
            if not all(w.alive() for w in self.workers.values()):
                self.ensure_workers()
            if self.broker_idle() and not self.leases():
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > 1.5:
                    for step, status in self.statuses(self.steps).items():
                        if step in self.sinks.values():
                            continue  # a sink is sent by its step's effect, never resumed
                        if status not in TERMINAL and resumed.get(step, 0) < 6:
                            resumed[step] = resumed.get(step, 0) + 1
                            if step in self.sinks:
                                self.note("resume", step=step, phase="settle")
                                self.send_effect(step)
                                continue
                            task = "reset" if status == "running" else "forward"
                            self.note("resume", step=step, phase="settle", task=task)
                            self.send(task, step)
                    idle_since = None
            else:
                idle_since = None
            time.sleep(0.2)
        grace = time.monotonic() + self.ttl + 1.0
        while (held := self.leases()) and time.monotonic() < grace:
            time.sleep(0.05)
        return {
            "settled": settled,
            "seconds": round(time.monotonic() - began, 3),
            "leftover": held,
            "resumed": len(resumed),
        }

    def write(self, settled: dict) -> dict:
        """Write the run directory (history.jsonl, steps.json, records.json, store.json,
        run.json); returns run.json's content plus ``settle`` (not written)."""
        from django_app.faults import patterns
        from django_app.workflows.models import TransitionRecord

        self.out.mkdir(parents=True, exist_ok=True)
        for stale in ("verdict.json", "history.jsonl.gz", "verdict-fallback.json"):
            (self.out / stale).unlink(missing_ok=True)  # a reused directory: this run's only
        history = self.r.lrange("faults:history", 0, -1)
        (self.out / "history.jsonl").write_text("".join(line + "\n" for line in history))
        statuses = self.statuses(self.steps)
        (self.out / "steps.json").write_text(
            json.dumps({str(k): v for k, v in sorted(statuses.items())}, indent=0) + "\n"
        )
        records = [
            checker.Record.of(r).__dict__
            for r in TransitionRecord.objects.filter(step_id__in=self.steps).order_by("id")
        ]
        (self.out / "records.json").write_text(json.dumps(records) + "\n")
        (self.out / "effects.json").unlink(missing_ok=True)
        if self.workload != "patterns":
            from tests.support.faults import outbox

            (self.out / "effects.json").write_text(
                json.dumps(outbox.run_effects(self, self.sinks, self.receiver, self.workload))
                + "\n"
            )
        store = self.store_client()
        (self.out / "store.json").write_text(
            json.dumps(
                {
                    "keys_without_ttl": checker.keys_without_ttl(store, KEY_PREFIX),
                    "leftover": checker.lease_keys(store, KEY_PREFIX),
                },
                indent=1,
            )
            + "\n"
        )
        run = {
            "seed": self.seed,
            "duration_s": self.duration,
            "unguarded": self.unguarded,
            "guard": self.guard,
            "workload": self.workload,
            "breaker": self.breaker,
            "patterns": self.patterns,
            "store": self.store_kind,
            "broker": self.broker.name,
            "database": self.database.engine,
            "workers": [
                {"name": n, "pool": p, "concurrency": c} for n, (p, c) in self.spec.items()
            ],
            "ttl": self.ttl,
            "kinds": self.kinds,
            "gaps": {"client": self.client_gap, "fault": self.fault_gap},
            "limits": patterns.limits(KEY_PREFIX),
            "faults": dict(sorted(self.faults.items())),
            "executions": sum(
                1 for line in history if json.loads(line).get("ev") in ("acquired", "contended")
            ),
            "started": self.started_wall,
            "commit": self.commit,
            "steps": len(self.steps),
            "faults_skipped": dict(sorted(self.skipped.items())),
            "run_seconds": round(self.run_seconds, 3),
            "settle": settled,
            "errors": self.errors[:50],
        }
        loads = self.loads.write(self.out, [json.loads(x) for x in history])  # http.jsonl
        if self.loads.names:
            run["loads"] = loads
        (self.out / "run.json").write_text(json.dumps(run, indent=1) + "\n")
        return run


def check(out: Path) -> dict:
    """The verdict of a run directory by the whole-run checker
    (``python -m tests.support.faults.runcheck <dir>``, which writes its verdict.json).
    Returns that verdict plus ``checker`` and ``runcheck_returncode``; a checker that crashed
    (no verdict written, or an exit status other than 0/1) gives a verdict with that as its
    violation, never an older run's verdict."""
    out = Path(out)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.faults.runcheck", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    verdict_file = out / "verdict.json"
    if proc.returncode in (0, 1) and verdict_file.exists():
        verdict = json.loads(verdict_file.read_text())
    else:
        print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
        verdict = {
            "violations": [f"the checker failed (exit {proc.returncode}): {proc.stderr[-300:]}"],
            "leftover": [],
        }
    verdict["checker"] = "runcheck"
    verdict["runcheck_returncode"] = proc.returncode
    return verdict


__all__ = [
    "NemesisLab",
    "plan",
    "plan_client",
    "plan_faults",
    "check",
    "actions_of",
    "kinds_of",
    "KINDS",
    "STORES",
    "WORKERS",
    "WORKLOADS",
]
