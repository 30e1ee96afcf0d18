"""The lock-store topologies for pytest: one node, Sentinel, Cluster and a least-privilege ACL
user, each a :class:`Topology` that points a Celery app's lease store at it.

A pytest plugin (``pytest_plugins`` in ``tests/conftest.py``): its fixtures start the
servers once per session, whichever module asks first (``sentinel_group``: a primary, a
replica and three sentinels, passwords on both; ``redis_cluster``: 3 primaries and 3
replicas; ``acl_server``: a redis-server whose users the tests create and change), so a
parametrization over the topologies, or another module on the same shape, adds no start-up.
:func:`build` makes the :class:`Topology` of a name on a flushed database.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.support import acl, servers
from tests.support.cluster import RedisCluster
from tests.support.sentinel import SentinelGroup

__all__ = [
    "TOPOLOGIES",
    "PRIMARY_PASSWORD",
    "SENTINEL_PASSWORD",
    "Topology",
    "build",
    "sentinel_group",
    "redis_cluster",
    "acl_server",
]

#: Every topology a pattern runs on, in the order of the parametrization.
TOPOLOGIES = ("single", "sentinel", "cluster", "acl")
#: The Sentinel group's passwords: the data nodes' (in the URL), the sentinels' own.
PRIMARY_PASSWORD = "primary-secret"
SENTINEL_PASSWORD = "sentinel-secret"


@pytest.fixture(scope="session")
def sentinel_group(tmp_path_factory):
    """One primary, one replica, three sentinels, for the session. A test that fails the
    primary over starts a group of its own."""
    group = SentinelGroup(
        password=PRIMARY_PASSWORD,
        sentinel_password=SENTINEL_PASSWORD,
        workdir=tmp_path_factory.mktemp("sentinel"),
    ).start()
    yield group
    group.stop()


@pytest.fixture(scope="session")
def redis_cluster():
    """3 primaries and 3 replicas (``cluster-node-timeout`` 1 s), for the session. Tests may
    fail a primary over to its replica or migrate a slot: it still covers every slot after."""
    with RedisCluster(primaries=3, replicas_per_primary=1, node_timeout=1000) as started:
        yield started


@pytest.fixture(scope="session")
def acl_server():
    """A redis-server of its own for the ACL users (created and changed by the tests)."""
    server = servers.RedisServer().start()
    yield server
    server.stop()


@dataclass
class Topology:
    """One topology: ``settings`` point a Celery app's lease store at it; ``admin`` is a
    client with every right (text replies) that reads what the patterns wrote."""

    name: str
    settings: dict[str, Any]
    admin: Any
    cluster: bool = False
    closers: list = field(default_factory=list, repr=False)
    #: The configured app's lease store, once a test has configured one (its client and
    #: prefix are what the patterns given ``app=`` use).
    store: Any = None

    def configure(self, app) -> None:
        """Point ``app``'s lease store (and so every pattern given ``app=``) here.

        Args:
            app: a Celery app; restore its settings after the test (the ``app`` fixture).
        """
        from tests.helpers import set_settings

        set_settings(app, **self.settings)

    def keys(self) -> list[str]:
        """Every key of the topology.

        Returns:
            The keys, sorted (every primary's, on a cluster).
        """
        if not self.cluster:
            return sorted(self.admin.keys("*"))
        found: list[str] = []
        for node in self.admin.get_primaries():
            found += [_text(k) for k in self.admin.get_redis_connection(node).keys("*")]
        return sorted(found)

    def nodes_of(self, keys) -> set[str]:
        """The nodes serving ``keys``.

        Args:
            keys: Redis keys.

        Returns:
            The names of the primaries serving them on a cluster; elsewhere the topology's
            name alone (one node serves every key).
        """
        if not self.cluster:
            return {self.name}
        manager = self.admin.nodes_manager
        return {manager.get_node_from_slot(self.admin.keyslot(k)).name for k in keys}

    def close(self) -> None:
        for close in self.closers:
            close()


def build(name: str, request) -> Topology:
    """The :class:`Topology` ``name`` on a flushed database (the ACL user created anew).

    Its servers come from the session fixtures (``request.getfixturevalue``), so only the
    topologies a run selects are started.

    Args:
        name: one of :data:`TOPOLOGIES`.
        request: the test's pytest ``request``.

    Returns:
        The topology; close it after the test.

    Raises:
        ValueError: for an unknown name.
    """
    from celery_steplock.lock import make_client

    if name == "single":
        url = request.getfixturevalue("redis_server_url")
        admin = make_client(url)
        admin.flushdb()
        return Topology(name, {"steplock_redis_url": url}, admin, closers=[admin.close])
    if name == "sentinel":
        group = request.getfixturevalue("sentinel_group")
        admin = group.node_client(group.primary_port())
        admin.flushdb()
        settings = {
            "steplock_redis_url": group.url,
            "steplock_redis_transport_options": group.transport_options,
        }
        return Topology(name, settings, admin, closers=[admin.close])
    if name == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        cluster.wait_ok()
        admin = make_client(cluster.url, cluster=True)
        for node in admin.get_primaries():
            admin.get_redis_connection(node).flushdb()
        settings = {"steplock_redis_url": cluster.url, "steplock_redis_cluster": True}
        return Topology(name, settings, admin, cluster=True, closers=[admin.close])
    if name == "acl":
        server = request.getfixturevalue("acl_server")
        admin = make_client(server.url)
        admin.flushdb()
        settings = {"steplock_redis_url": acl.create_user(server)}
        return Topology(name, settings, admin, closers=[admin.close])
    raise ValueError(f"unknown topology {name!r}; known: {', '.join(TOPOLOGIES)}")


def _text(value):
    return value.decode() if isinstance(value, bytes) else value
