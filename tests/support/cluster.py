"""A throwaway Redis Cluster on loopback: 3 primaries and 3 replicas by default, for tests.

Each node is a :class:`~tests.support.servers.RedisServer` started with ``--cluster-enabled
yes`` on a free port (its cluster bus on another free port, ``cluster-port``). The cluster is
built by hand: slots assigned with ``CLUSTER ADDSLOTSRANGE``, nodes introduced with ``CLUSTER
MEET``, replicas attached with ``CLUSTER REPLICATE``; ready when every node reports
``cluster_state:ok`` and agrees on the slot table. Helpers drive a failover (``CLUSTER
FAILOVER`` on a replica, or a killed primary) and a slot migration in its three stages.
Nodes are stopped by PID.

``python -m tests.support.cluster`` starts one, prints a node URL and runs until Ctrl-C.
"""

from __future__ import annotations

import signal
import time

import redis

from tests.support.servers import RedisServer, free_port, wait_until

__all__ = ["RedisCluster", "SLOTS"]

SLOTS = 16384


class RedisCluster:
    """``primaries`` primaries with ``replicas_per_primary`` replicas each.

    ``node_timeout`` (ms) is ``cluster-node-timeout``: how long a silent primary takes to be
    failed over by its replica. ``full_coverage`` is ``cluster-require-full-coverage``
    (default False: while one shard fails over, the others keep serving).
    """

    def __init__(
        self,
        primaries: int = 3,
        replicas_per_primary: int = 1,
        node_timeout: int = 1000,
        full_coverage: bool = False,
    ):
        self.full_coverage = full_coverage
        self.n_primaries = primaries
        self.n_replicas = replicas_per_primary
        self.node_timeout = node_timeout
        self.nodes: list[RedisServer] = []
        self.stopped: set[int] = set()

    def __repr__(self) -> str:
        return f"<RedisCluster {[n.port for n in self.nodes]}>"

    # -- life cycle -------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> RedisCluster:
        total = self.n_primaries * (1 + self.n_replicas)
        try:
            for _ in range(total):
                bus = free_port()
                node = RedisServer(
                    args=(
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        str(self.node_timeout),
                        "--cluster-port",
                        str(bus),
                        "--cluster-require-full-coverage",
                        "yes" if self.full_coverage else "no",
                    )
                )
                node.bus_port = bus
                self.nodes.append(node.start())
            self._build(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _build(self, timeout: float) -> None:
        primaries = self.nodes[: self.n_primaries]
        per = SLOTS // self.n_primaries
        for n, node in enumerate(primaries):
            first = n * per
            last = SLOTS - 1 if n == self.n_primaries - 1 else first + per - 1
            self.client(node).execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
        first = self.client(self.nodes[0])
        for node in self.nodes[1:]:
            first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, node.bus_port)
        ids = [self.node_id(node) for node in self.nodes]
        wait_until(
            lambda: all(self._known(node) >= len(self.nodes) for node in self.nodes),
            timeout,
            what="every cluster node to know every other",
        )
        for r in range(self.n_replicas):
            for n in range(self.n_primaries):
                replica = self.nodes[self.n_primaries * (1 + r) + n]
                self.client(replica).execute_command("CLUSTER", "REPLICATE", ids[n])
        self.wait_ok(timeout)

    def _known(self, node: RedisServer) -> int:
        lines = self.client(node).execute_command("CLUSTER", "NODES")
        return len([line for line in _text(lines).splitlines() if line.strip()])

    def stop(self) -> None:
        """Stop every node (by PID) and remove its directory."""
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- inspection -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """URL of the first live node (a cluster client's entry point)."""
        return self.live()[0].url

    def live(self) -> list[RedisServer]:
        return [node for node in self.nodes if node.alive()]

    @staticmethod
    def client(node: RedisServer) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1", port=node.port, socket_timeout=5, decode_responses=True
        )

    def node_id(self, node: RedisServer) -> str:
        return _text(self.client(node).execute_command("CLUSTER", "MYID"))

    def node_by_port(self, port: int) -> RedisServer:
        return next(node for node in self.nodes if node.port == port)

    def slot_owners(self, via: RedisServer | None = None) -> dict[int, int]:
        """slot -> port of its primary, as ``via`` (default: the first live node) sees it."""
        owners: dict[int, int] = {}
        table = self.client(via or self.live()[0]).execute_command("CLUSTER", "SLOTS")
        for first, last, primary, *_replicas in table:
            for slot in range(int(first), int(last) + 1):
                owners[slot] = int(primary[1])
        return owners

    def primaries(self) -> list[RedisServer]:
        """The live nodes serving slots, by their lowest slot."""
        owners = self.slot_owners()
        ports = sorted(
            set(owners.values()), key=lambda p: min(s for s, o in owners.items() if o == p)
        )
        return [self.node_by_port(port) for port in ports]

    def replica_of(self, primary: RedisServer) -> RedisServer:
        pid = self.node_id(primary)
        for node in self.live():
            if node is primary:
                continue
            info = _text(self.client(node).execute_command("CLUSTER", "NODES"))
            for line in info.splitlines():
                fields = line.split()
                if "myself" in fields[2] and "slave" in fields[2] and fields[3] == pid:
                    return node
        raise LookupError(f"no live replica of {primary!r}")

    def _state_ok(self, node: RedisServer) -> bool:
        try:
            info = _text(self.client(node).execute_command("CLUSTER", "INFO"))
        except redis.RedisError:
            return False
        return "cluster_state:ok" in info

    def _agreed(self) -> bool:
        tables = []
        for node in self.live():
            try:
                tables.append(self.slot_owners(node))
            except redis.RedisError:
                return False
        return bool(tables) and all(t == tables[0] for t in tables) and len(tables[0]) == SLOTS

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node reports ``cluster_state:ok`` and all agree on the slots, with
        every replica attached."""

        def ready() -> bool:
            if not all(self._state_ok(n) for n in self.live()) or not self._agreed():
                return False
            for node in self.live():
                role = self.client(node).execute_command("ROLE")
                if _text(role[0]) == "slave" and _text(role[3]) != "connected":
                    return False
            return True

        wait_until(ready, timeout, interval=0.1, what="cluster_state:ok on every node")

    # -- faults -----------------------------------------------------------------------------

    def failover(self, primary: RedisServer, timeout: float = 30.0) -> RedisServer:
        """``CLUSTER FAILOVER`` on ``primary``'s replica (a coordinated failover: the replica
        catches up first, nothing acknowledged is lost). Returns the new primary once every
        node sees it serving the old primary's slots."""
        replica = self.replica_of(primary)
        slots = [s for s, p in self.slot_owners().items() if p == primary.port]
        self.client(replica).execute_command("CLUSTER", "FAILOVER")
        wait_until(
            lambda: (
                self._agreed()
                and all(self.slot_owners().get(s) == replica.port for s in slots[:1])
            ),
            timeout,
            interval=0.1,
            what="the replica to take over",
        )
        self.wait_ok(timeout)
        return replica

    def kill_primary(self, primary: RedisServer, timeout: float = 30.0) -> RedisServer:
        """SIGKILL ``primary`` (by PID) and wait until its replica serves its slots (after
        ``node_timeout``). Returns the new primary; the killed node stays down."""
        replica = self.replica_of(primary)
        slots = [s for s, p in self.slot_owners().items() if p == primary.port]
        primary.kill()
        self.stopped.add(primary.port)
        wait_until(
            lambda: (
                self._state_ok(replica) and self.slot_owners(replica).get(slots[0]) == replica.port
            ),
            timeout,
            interval=0.1,
            what="the replica to be promoted",
        )
        wait_until(
            lambda: all(self._state_ok(n) for n in self.live()) and self._agreed(),
            timeout,
            interval=0.1,
            what="every live node to see the promotion",
        )
        return replica

    def begin_migration(self, slot: int, target: RedisServer) -> RedisServer:
        """Stage 1 of moving ``slot`` to ``target``: IMPORTING on the target, MIGRATING on the
        source (keys stay on the source; a command on a missing key is sent ASK). Returns the
        source."""
        source = self.node_by_port(self.slot_owners()[slot])
        self.client(target).execute_command(
            "CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(source)
        )
        self.client(source).execute_command(
            "CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(target)
        )
        return source

    def move_keys(self, slot: int, source: RedisServer, target: RedisServer) -> list[str]:
        """Stage 2: MIGRATE every key of ``slot`` from ``source`` to ``target``. Returns the
        keys moved."""
        src = self.client(source)
        moved: list[str] = []
        while True:
            keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
            if not keys:
                return moved
            src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
            moved.extend(_text(k) for k in keys)

    def finish_migration(self, slot: int, target: RedisServer, timeout: float = 30.0) -> None:
        """Stage 3: ``SETSLOT NODE`` on every primary (a command on the source now gets
        MOVED), then wait until every node agrees."""
        tid = self.node_id(target)
        self.client(target).execute_command("CLUSTER", "SETSLOT", slot, "NODE", tid)
        for node in self.primaries():
            if node is not target:
                self.client(node).execute_command("CLUSTER", "SETSLOT", slot, "NODE", tid)
        wait_until(
            lambda: self._agreed() and self.slot_owners().get(slot) == target.port,
            timeout,
            interval=0.1,
            what=f"slot {slot} to be served by {target!r}",
        )

    def migrate_slot(self, slot: int, target: RedisServer) -> list[str]:
        """All three stages at once. Returns the keys moved."""
        source = self.begin_migration(slot, target)
        moved = self.move_keys(slot, source, target)
        self.finish_migration(slot, target)
        return moved


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


def main() -> int:
    cluster = RedisCluster().start()
    print(cluster.url, flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    try:
        while not stop:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
