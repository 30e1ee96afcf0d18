"""The circuit breaker's scripts on a real Redis Cluster (3 primaries, tests/support): both
keys of a breaker in one slot, breakers of several names spread over the primaries, the
whole cycle CLOSED -> OPEN -> HALF_OPEN (one probe) -> CLOSED, and an override."""

import time

import pytest

from celery_steplock.patterns.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from celery_steplock.exceptions import CircuitOpen
from celery_steplock.lock import make_client
from tests.support.cluster import RedisCluster

pytestmark = pytest.mark.redis_shape


@pytest.fixture(scope="module")
def cluster_client():
    with RedisCluster(primaries=3, replicas_per_primary=0, node_timeout=1000) as cluster:
        cluster.wait_ok()
        client = make_client(cluster.url, cluster=True)
        yield client
        client.close()


def test_the_breaker_cycle_on_a_cluster(cluster_client):
    names = [f"dep-{i}" for i in range(12)]
    slots = set()
    for name in names:
        breaker = CircuitBreaker(
            name,
            failure_threshold=1,
            window=1,
            recovery_timeout=0.2,
            success_threshold=1,
            client=cluster_client,
            prefix="cb",
        )
        with pytest.raises(ConnectionError):
            breaker.call(lambda: (_ for _ in ()).throw(ConnectionError("down")))
        assert breaker.state().state == OPEN
        keys = [f"cb:breaker:{{{name}}}", f"cb:breaker-probes:{{{name}}}"]
        assert len({cluster_client.keyslot(k) for k in keys}) == 1
        slots.add(cluster_client.keyslot(keys[0]))
    nodes = {cluster_client.nodes_manager.get_node_from_slot(s).name for s in slots}
    assert len(nodes) > 1  # the names reach more than one primary
    time.sleep(0.25)
    breaker = CircuitBreaker(
        names[0],
        failure_threshold=1,
        window=1,
        recovery_timeout=0.2,
        success_threshold=1,
        client=cluster_client,
        prefix="cb",
    )
    probe = breaker.admit(owner="p1")
    assert probe.probe and breaker.state().state == HALF_OPEN
    with pytest.raises(CircuitOpen):
        breaker.admit(owner="p2")
    probe.success()
    assert breaker.state().state == CLOSED
    assert breaker.override("open") == (CLOSED, False)
    assert breaker.state().forced
