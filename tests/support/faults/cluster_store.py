"""The Redis Cluster lock store of the randomized fault run (``scripts/nemesis.py --store
cluster``): a :class:`~tests.support.cluster.RedisCluster` (3 primaries, 3 replicas) that the
workers reach with ``STEPLOCK_REDIS_CLUSTER=1`` and one node's URL, and its two fault kinds.

- ``cluster_failover``: the primary serving the slot of a held step lease fails over,
  alternately by ``CLUSTER FAILOVER`` on its replica (coordinated: nothing acknowledged is
  lost) and by a SIGKILL of the primary (its replica takes over after ``node_timeout``; what
  the primary acknowledged and had not yet replicated is lost, so that window is noted as a
  ``split_brain`` follow-up, the checker's data-loss window, from the kill to rest). The
  killed node is started again and rejoins as a replica of the new primary.
- ``slot_migration``: the slot of a held step lease moves to another primary in its three
  stages (IMPORTING/MIGRATING, MIGRATE of its keys, SETSLOT NODE) with a pause between them,
  so the holder's renewals meet the ``ASK``/``TRYAGAIN`` window and then ``MOVED``.

One topology change at a time: each runs in a thread of its own (the fault entry is noted
before it begins, its ``heal`` entry once the cluster is at rest again), and a fault that
finds one under way has no target yet (the nemesis tries again, then counts it skipped).
"""

from __future__ import annotations

import threading
import time

import redis
from redis.crc import key_slot

from tests.support.cluster import RedisCluster

#: ``cluster-node-timeout`` of the run's cluster (ms): how long a killed primary takes to be
#: replaced. Above the lease TTL's default (2 s) and well above what a loaded two-core host
#: stalls a node for, so no failover happens that the nemesis did not cause.
NODE_TIMEOUT_MS = 3000
REST_TIMEOUT = 60.0  # seconds a topology change may take to come to rest


class ClusterClient:
    """What the lab uses a lock-store client for, on a cluster: keyed commands (``exists``,
    ``zcard``, ``pipeline(transaction=False)`` with ``pttl``) go through a
    :class:`redis.RedisCluster`; ``scan_iter`` scans every live primary of the current slot
    table (keys seen twice mid-migration are yielded once) and ``flushdb`` empties every
    primary (their replicas follow)."""

    def __init__(self, store: ClusterStore):
        self.store = store
        self._rc: redis.RedisCluster | None = None

    @property
    def rc(self) -> redis.RedisCluster:
        rc = self._rc
        if rc is None:
            last = None
            for node in self.store.cluster.live():
                try:
                    rc = self._rc = redis.RedisCluster(
                        host="127.0.0.1",
                        port=node.port,
                        decode_responses=True,
                        socket_timeout=5,
                        socket_connect_timeout=2,
                    )
                    break
                except redis.RedisError as exc:
                    last = exc
            else:
                raise redis.ConnectionError(f"no cluster node answers: {last}")
        return rc

    def reset(self) -> None:
        """Forget the cluster client (a topology change it may have cached wrong). Not
        closed: another thread may be using it; its pools go with it."""
        self._rc = None

    def __getattr__(self, name):
        attr = getattr(self.rc, name)
        if name == "pipeline" or not callable(attr):
            return attr

        def call(*args, **kwargs):
            # a RedisCluster client that lost a node mid-command can be left without a
            # default node for good ("no default node to resolve the keys"), and reset()
            # from a fault's thread may close it under another thread: a fresh one, once
            try:
                return getattr(self.rc, name)(*args, **kwargs)
            except (redis.RedisError, redis.exceptions.RedisClusterException):
                self.reset()
                return getattr(self.rc, name)(*args, **kwargs)

        return call

    def primary_clients(self) -> list[redis.Redis]:
        """Plain clients on the live primaries of the current slot table (a killed one that
        still serves slots until its replica takes over is left out)."""
        nodes = [n for n in self.store.cluster.primaries() if n.alive()]
        return [self.store.cluster.client(node) for node in nodes]

    def scan_iter(self, match: str | None = None, count: int | None = None):
        seen: set[str] = set()
        for client in self.primary_clients():
            try:
                for key in client.scan_iter(match=match, count=count):
                    if key not in seen:
                        seen.add(key)
                        yield key
            finally:
                client.close()

    def flushdb(self) -> None:
        for client in self.primary_clients():
            try:
                client.flushdb()
            finally:
                client.close()


class ClusterStore:
    """The cluster of ``lab`` (a :class:`~tests.support.faults.nemesis.NemesisLab`: its
    ``note``, ``errors``, ``ttl``, ``held`` are used) and its faults; see the module
    docstring. ``node_timeout`` is in ms."""

    def __init__(self, lab, node_timeout: int = NODE_TIMEOUT_MS):
        self.lab = lab
        self.cluster = RedisCluster(node_timeout=node_timeout)
        self.thread: threading.Thread | None = None
        self.failovers = 0  # cluster_failover faults so far: even ones coordinated, odd kills
        self._client: ClusterClient | None = None

    # -- life cycle -----------------------------------------------------------------------------

    def start(self) -> ClusterStore:
        self.cluster.start(timeout=60)
        self._client = ClusterClient(self)
        return self

    def stop(self) -> None:
        self.join(60)
        if self._client is not None:
            self._client.reset()
        self.cluster.stop()

    def url(self) -> str:
        """A live node's URL (the workers' ``STEPLOCK_REDIS_URL``: their entry point)."""
        return self.cluster.url

    def client(self) -> ClusterClient:
        return self._client

    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def join(self, timeout: float = 120.0) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def heal(self) -> None:
        """At the end of the run: the change under way ends, every node killed and not yet
        back is started again, and the cluster is at rest (every node ``cluster_state:ok``,
        one slot table, every replica attached). A failure goes to the lab's ``errors`` (the run
        is not valid)."""
        self.join(REST_TIMEOUT * 2)
        try:
            for node in self.cluster.nodes:
                if not node.alive():
                    node.start()
                    self.cluster.stopped.discard(node.port)
            self.cluster.wait_ok(REST_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - the run is not valid then
            self.lab.errors.append(f"heal cluster: {type(exc).__name__}: {exc}")
        self._client.reset()

    # -- targets --------------------------------------------------------------------------------

    def held_lease(self, target: int) -> tuple[str, int, int] | None:
        """A held step lease, chosen by ``target`` among those held now (sorted):
        ``(key, slot, port of the primary serving it)``; None when none is held."""
        from tests.support.faults.lab import KEY_PREFIX

        keys = sorted(self._client.scan_iter(match=f"{KEY_PREFIX}:lease:{{step:*", count=1000))
        if not keys:
            return None
        key = keys[target % len(keys)]
        slot = key_slot(key.encode())
        return key, slot, self.cluster.slot_owners()[slot]

    def _run(self, name: str, body, entry: dict) -> None:
        self.thread = threading.Thread(target=body, args=(entry,), name=name, daemon=True)
        self.thread.start()

    # -- cluster_failover -----------------------------------------------------------------------

    def failover(self, fault: dict) -> dict | None:
        """The ``cluster_failover`` fault: the primary serving a held step lease's slot fails
        over, by ``CLUSTER FAILOVER`` (``how="coordinated"``) or a SIGKILL (``how="kill"``),
        alternately. Returns the fault entry (``how``, ``key``, ``slot``, ``from_port``,
        ``held``), or None while no step lease is held or another change is under way."""
        if self.busy():
            return None
        found = self.held_lease(fault["target"])
        if found is None:
            return None
        key, slot, port = found
        how = "coordinated" if self.failovers % 2 == 0 else "kill"
        self.failovers += 1
        entry = self.lab.note(
            "fault",
            kind="cluster_failover",
            how=how,
            key=key,
            slot=slot,
            from_port=port,
            held=self.lab.held(),
        )
        if how == "kill":  # the data-loss window opens with the kill
            entry["split"] = self.lab.note(
                "fault",
                kind="split_brain",
                follow_up=True,
                cause="cluster_failover",
                failover_t=entry["t"],
                primaries=[port],
            )
        self._run("cluster-failover", self._failover, entry)
        return entry

    def _failover(self, entry: dict) -> None:
        """The failover of ``entry`` (in its thread); its ``heal`` entry carries ``to_port``,
        ``promoted_s`` (seconds to the replica serving the slot), ``restarted_s`` (the killed
        node back as a replica) and ``settled_s`` (the cluster at rest), or ``error`` (then
        also in the lab's ``errors``: the run is not valid)."""
        began = time.monotonic()
        fields: dict = {"how": entry["how"], "from_port": entry["from_port"]}
        split = entry.pop("split", None)
        try:
            primary = self.cluster.node_by_port(entry["from_port"])
            if entry["how"] == "coordinated":
                new = self.cluster.failover(primary, timeout=REST_TIMEOUT)
                fields["promoted_s"] = round(time.monotonic() - began, 3)
            else:
                new = self.cluster.kill_primary(primary, timeout=REST_TIMEOUT)
                fields["promoted_s"] = round(time.monotonic() - began, 3)
                primary.start()
                self.cluster.stopped.discard(primary.port)
                fields["restarted_s"] = round(time.monotonic() - began, 3)
            self.cluster.wait_ok(REST_TIMEOUT)
            self._client.reset()
            fields.update(to_port=new.port, settled_s=round(time.monotonic() - began, 3))
        except Exception as exc:  # noqa: BLE001 - noted, and the run is not valid
            self.lab.errors.append(f"heal cluster_failover: {type(exc).__name__}: {exc}")
            fields["error"] = f"{type(exc).__name__}: {exc}"
        if split is not None and "error" not in fields:
            self.lab.note(
                "heal",
                kind="split_brain",
                follow_up=True,
                cause="cluster_failover",
                fault_t=split["t"],
            )
        self.lab.note("heal", kind="cluster_failover", fault_t=entry["t"], **fields)

    # -- slot_migration -------------------------------------------------------------------------

    def migrate(self, fault: dict) -> dict | None:
        """The ``slot_migration`` fault: the slot of a held step lease moves to another
        primary (chosen by ``target2``), pausing ``pause`` seconds (``ttl * (0.25 + lag)``,
        0.5 to 2.5 s at the default TTL) after IMPORTING/MIGRATING and again after the keys
        moved. Returns the fault entry (``key``, ``slot``, ``from_port``, ``to_port``,
        ``pause``, ``held``), or None while no step lease is held or another change is under
        way."""
        if self.busy():
            return None
        found = self.held_lease(fault["target"])
        if found is None:
            return None
        key, slot, port = found
        others = [n for n in self.cluster.primaries() if n.port != port]
        if not others:
            return None
        to = others[fault["target2"] % len(others)]
        pause = round(self.lab.ttl * (0.25 + fault["lag"]), 3)
        entry = self.lab.note(
            "fault",
            kind="slot_migration",
            key=key,
            slot=slot,
            from_port=port,
            to_port=to.port,
            pause=pause,
            held=self.lab.held(),
        )
        self._run("slot-migration", self._migrate, entry)
        return entry

    def _migrate(self, entry: dict) -> None:
        """The migration of ``entry`` (in its thread); its ``heal`` entry carries ``moved``
        (keys moved), ``settled_s``, or ``error`` (then also in ``errors``). A migration that
        failed half-way is finished towards its target, so no slot stays MIGRATING."""
        began = time.monotonic()
        slot, pause = entry["slot"], entry["pause"]
        target = self.cluster.node_by_port(entry["to_port"])
        fields: dict = {"slot": slot, "from_port": entry["from_port"], "to_port": target.port}
        source = None
        try:
            source = self.cluster.begin_migration(slot, target)
            time.sleep(pause)
            moved = self.cluster.move_keys(slot, source, target)
            fields["moved"] = len(moved)
            time.sleep(pause)
            self.cluster.finish_migration(slot, target, timeout=REST_TIMEOUT)
            self.cluster.wait_ok(REST_TIMEOUT)
            fields["settled_s"] = round(time.monotonic() - began, 3)
        except Exception as exc:  # noqa: BLE001 - noted, and the run is not valid
            fields["error"] = f"{type(exc).__name__}: {exc}"
            self.lab.errors.append(f"heal slot_migration: {fields['error']}")
            if source is not None:
                try:
                    self.cluster.move_keys(slot, source, target)
                    self.cluster.finish_migration(slot, target, timeout=REST_TIMEOUT)
                except Exception as again:  # noqa: BLE001
                    fields["finish_error"] = f"{type(again).__name__}: {again}"
        self._client.reset()
        self.lab.note("heal", kind="slot_migration", fault_t=entry["t"], **fields)


__all__ = ["ClusterClient", "ClusterStore", "NODE_TIMEOUT_MS"]
