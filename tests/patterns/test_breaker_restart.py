"""Fault scenario: Redis restarts while a half-open probe runs (a redis-server of the test's
own, tests/support). With persistence (appendonly) the probe permit survives the restart:
no second probe is admitted while it lives, callers meeting the outage are refused (fail
closed: the dependency is not called), the probe's outcome, if it cannot be recorded, is
logged and never raised, and the permit expires so another probe can close the breaker.
Without persistence the restarted Redis has forgotten the breaker: it is CLOSED again."""

import time

import pytest

from celery_steplock.patterns.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from celery_steplock.exceptions import CircuitOpen, LockStoreUnavailable
from celery_steplock.lock import make_client
from tests.support import servers

pytestmark = pytest.mark.no_database  # runs once, in the SQLite pass


def breaker(client):
    return CircuitBreaker(
        "dep",
        failure_threshold=1,
        window=1,
        recovery_timeout=0.2,
        success_threshold=1,
        probe_timeout=1.5,
        client=client,
        prefix="t",
    )


def opened_then_probing(client):
    b = breaker(client)
    with pytest.raises(ConnectionError):
        b.call(lambda: (_ for _ in ()).throw(ConnectionError("down")))
    time.sleep(0.25)
    probe = b.admit(owner="prober")
    assert probe.probe and b.state().state == HALF_OPEN
    return b, probe


@pytest.fixture
def persistent_redis(tmp_path):
    server = servers.RedisServer(
        workdir=tmp_path / "redis", args=("--appendonly", "yes", "--appendfsync", "always")
    ).start()
    yield server
    server.stop()


def test_restart_during_a_probe_keeps_one_probe_and_never_calls_in_the_outage(
    persistent_redis, caplog
):
    client = make_client(persistent_redis.url, socket_timeout=0.5)
    b, probe = opened_then_probing(client)
    persistent_redis.kill()  # the probe is running when Redis goes away
    called = []
    with pytest.raises(LockStoreUnavailable):  # fail closed: refused, not called
        b.call(called.append, "during the outage")
    probe.success()  # its outcome cannot be recorded: logged, not raised
    assert [r for r in caplog.records if "circuit_record_failed" in r.getMessage()]
    persistent_redis.start()
    state = b.state()
    assert (state.state, state.probes) == (HALF_OPEN, 1)  # the permit survived
    with pytest.raises(CircuitOpen) as refused:  # still exactly one probe
        b.call(called.append, "a second probe")
    assert called == []
    time.sleep(refused.value.retry_after + 0.05)  # the lost probe's permit expires
    assert b.call(lambda: "probe 2") == "probe 2"
    assert b.state().state == CLOSED
    client.close()


def test_restart_without_persistence_forgets_the_breaker(private_redis):
    client = make_client(private_redis.url, socket_timeout=0.5)
    b, probe = opened_then_probing(client)
    private_redis.restart()
    probe.failure()  # recorded against a breaker Redis no longer has: ignored
    assert b.state().state == CLOSED
    assert b.call(lambda: "through") == "through"
    with pytest.raises(ConnectionError):
        b.call(lambda: (_ for _ in ()).throw(ConnectionError("down")))
    assert b.state().state == OPEN  # and it works as before
    client.close()
