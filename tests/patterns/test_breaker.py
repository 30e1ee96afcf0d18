"""The shared circuit breaker (celery_steplock.patterns.breaker) against a real redis-server: its
states, the rolling window, the cluster-wide half-open probe permits, generations, the
classifier, operators' overrides, outage policy, signals. Cross-worker evidence is in
test_breaker_workers.py, the Redis restart in test_breaker_restart.py."""

import threading
import time

import pytest
import redis

from celery_steplock import signals
from celery_steplock.patterns.breaker import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    CircuitBreaker,
    default_classifier,
)
from celery_steplock.exceptions import (
    CircuitOpen,
    ImproperlyConfigured,
    LockContended,
    LockStoreUnavailable,
)
from celery_steplock.lock import make_client
from celery_steplock.patterns.retry import NonRetryable
from tests.helpers import closed_port_url

pytestmark = pytest.mark.no_database  # runs once, in the SQLite pass


class HTTPError(Exception):
    def __init__(self, status):
        super().__init__(f"HTTP {status}")
        self.status_code = status


def make(client, name="dep", **kwargs):
    kwargs.setdefault("failure_threshold", 3)
    kwargs.setdefault("window", 5)
    kwargs.setdefault("recovery_timeout", 0.3)
    kwargs.setdefault("success_threshold", 1)
    return CircuitBreaker(name, client=client, prefix="t", **kwargs)


def fail(exc=None):
    raise exc if exc is not None else ConnectionError("down")


def failures(breaker, n, exc=None):
    for _ in range(n):
        with pytest.raises(Exception):
            breaker.call(fail, exc or ConnectionError("down"))


def test_opens_at_the_threshold_and_then_never_calls(redis_client):
    breaker = make(redis_client)
    failures(breaker, 2)
    assert breaker.state().state == CLOSED and breaker.state().failures == 2
    failures(breaker, 1)
    state = breaker.state()
    assert (state.state, state.forced) == (OPEN, False)
    assert 0 < state.retry_after <= 0.3
    called = []
    with pytest.raises(CircuitOpen) as caught:
        breaker.call(called.append, 1)
    assert called == []
    assert caught.value.option == "circuit_breaker" and 0 < caught.value.retry_after <= 0.3
    assert caught.value.key == "t:breaker:{dep}"
    assert caught.value.context["state"] == OPEN


def test_successes_in_the_window_dilute_failures(redis_client):
    breaker = make(redis_client)
    for _ in range(3):
        failures(breaker, 1)
        breaker.call(lambda: None)
        breaker.call(lambda: None)
    # Never 3 failures among the last 5 calls.
    state = breaker.state()
    assert state.state == CLOSED and state.calls == 5 and state.failures == 1


def test_a_failure_rate_over_a_full_window(redis_client):
    breaker = make(redis_client, failure_threshold=0.5, window=4)
    failures(breaker, 3)
    assert breaker.state().state == CLOSED  # 3 calls: fewer than minimum_calls (window)
    breaker.call(lambda: None)
    assert breaker.state().state == OPEN  # 3 of 4 failed >= 50 %


def test_half_open_after_recovery_then_a_success_closes(redis_client, events):
    breaker = make(redis_client, success_threshold=2)
    failures(breaker, 3)
    time.sleep(0.35)
    probe = breaker.admit(owner="a")
    assert probe.probe and breaker.state().state == HALF_OPEN and breaker.state().probes == 1
    with pytest.raises(CircuitOpen) as caught:  # the one permit is taken
        breaker.admit(owner="b")
    assert caught.value.context["state"] == HALF_OPEN
    probe.success()
    assert breaker.state().state == HALF_OPEN and breaker.state().successes == 1
    breaker.admit(owner="c").success()
    assert breaker.state().state == CLOSED
    names = [name for name, _ in events if name.startswith("circuit_")]
    assert names == ["circuit_opened", "circuit_half_opened", "circuit_rejected", "circuit_closed"]
    opened = dict(events)["circuit_opened"]
    assert (opened["name"], opened["failures"], opened["calls"]) == ("dep", 3, 3)


def test_a_failed_probe_opens_it_again(redis_client):
    breaker = make(redis_client)
    failures(breaker, 3)
    time.sleep(0.35)
    with pytest.raises(ConnectionError):
        breaker.call(fail)
    state = breaker.state()
    assert state.state == OPEN and state.retry_after > 0.2  # a new recovery period


def test_exactly_one_probe_among_many_concurrent_callers(redis_server_url, redis_client):
    make(redis_client).override("open")
    make(redis_client).override("close")
    breaker = make(redis_client, recovery_timeout=0.2)
    failures(breaker, 3)
    time.sleep(0.25)
    clients = [make_client(redis_server_url) for _ in range(24)]
    start = threading.Barrier(len(clients))
    admitted, refused = [], []

    def caller(client, i):
        own = make(client, recovery_timeout=0.2)
        start.wait()
        try:
            admitted.append(own.admit(owner=f"caller-{i}"))
        except CircuitOpen:
            refused.append(i)

    threads = [threading.Thread(target=caller, args=(c, i)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in clients:
        c.close()
    assert len(admitted) == 1 and len(refused) == 23
    assert admitted[0].probe


def test_a_dead_probers_permit_expires(redis_client):
    breaker = make(redis_client, probe_timeout=0.3)
    failures(breaker, 3)
    time.sleep(0.35)
    breaker.admit(owner="dies")  # never records
    with pytest.raises(CircuitOpen) as caught:
        breaker.admit(owner="next")
    assert 0 < caught.value.retry_after <= 0.3
    time.sleep(caught.value.retry_after + 0.02)
    second = breaker.admit(owner="next")
    assert second.probe
    second.success()
    assert breaker.state().state == CLOSED


def test_outcomes_of_an_earlier_generation_are_ignored(redis_client):
    breaker = make(redis_client)
    late = breaker.admit()  # admitted while CLOSED
    failures(breaker, 3)
    time.sleep(0.35)
    probe = breaker.admit()
    late.success()  # ends after the breaker opened: must not close it or count as a probe
    assert breaker.state().state == HALF_OPEN and breaker.state().successes == 0
    probe.success()
    assert breaker.state().state == CLOSED
    stale = breaker.admit()
    breaker.override("close")  # a new generation
    stale.failure()
    assert breaker.state().failures == 0


def test_outcomes_while_open_never_count(redis_client):
    breaker = make(redis_client, recovery_timeout=5)
    failures(breaker, 3)
    generation = breaker.state().generation
    for _ in range(5):
        with pytest.raises(CircuitOpen):
            breaker.call(fail)
    state = breaker.state()
    assert (state.state, state.generation, state.calls) == (OPEN, generation, 0)


def test_a_probe_that_never_reached_the_dependency_gives_its_permit_back(redis_client):
    breaker = make(redis_client)
    failures(breaker, 3)
    time.sleep(0.35)
    breaker.admit(owner="a").release()
    assert breaker.state().probes == 0
    assert breaker.admit(owner="b").probe


@pytest.mark.parametrize(
    "exc,counts",
    [
        (ConnectionError("x"), True),
        (TimeoutError("x"), True),
        (HTTPError(503), True),
        (HTTPError(429), True),
        (HTTPError(408), True),
        (RuntimeError("unknown"), True),
        (HTTPError(404), False),
        (HTTPError(422), False),
        (ValueError("bad input"), False),
        (PermissionError("no"), False),
        (NonRetryable("card declined"), False),
        (LockContended("busy", key="k"), False),
        (CircuitOpen("open", retry_after=1), False),
    ],
)
def test_the_default_classifier(exc, counts):
    assert default_classifier(exc) is counts


def test_business_errors_and_control_exceptions_never_open_it(redis_client):
    breaker = make(redis_client)
    failures(breaker, 1)  # from here on successes are written (a clean window's are not)
    for exc in (
        ValueError("bad"),
        HTTPError(404),
        NonRetryable("declined"),
        LockContended("busy", key="k"),
    ):
        for _ in range(3):
            with pytest.raises(type(exc)):
                breaker.call(fail, exc)
    state = breaker.state()
    assert state.state == CLOSED and state.failures == 0 and state.calls == 5  # answers: successes


def test_a_custom_classifier(redis_client):
    breaker = make(redis_client, classifier=lambda exc: isinstance(exc, KeyError))
    failures(breaker, 3, exc=ConnectionError("ignored"))
    assert breaker.state().failures == 0
    failures(breaker, 3, exc=KeyError("counted"))
    assert breaker.state().state == OPEN


def test_decorator_and_context_manager(redis_client):
    breaker = make(redis_client)

    @breaker
    def flaky(n):
        if n:
            raise ConnectionError("down")
        return "ok"

    assert flaky(0) == "ok"
    with pytest.raises(ConnectionError):
        flaky(1)
    with pytest.raises(ConnectionError):
        with breaker:
            raise ConnectionError("down")
    assert breaker.state().failures == 2
    with breaker:
        pass
    assert (breaker.state().failures, breaker.state().calls) == (2, 3)  # the 1st: clean
    with pytest.raises(ConnectionError):
        flaky(1)
    with pytest.raises(CircuitOpen):
        with breaker:
            pytest.fail("the block runs while open")


def test_forced_open_stays_open_until_closed(redis_client):
    breaker = make(redis_client)
    assert breaker.override("open") == (CLOSED, False)
    time.sleep(0.35)  # past the recovery timeout: still refused, no probe
    with pytest.raises(CircuitOpen) as caught:
        breaker.admit()
    assert caught.value.context["forced"] is True
    assert redis_client.pttl("t:breaker:{dep}") == -1  # no TTL while forced
    assert breaker.state().forced
    assert breaker.override("close") == (OPEN, True)
    assert breaker.admit().probe is False and breaker.state().state == CLOSED
    assert redis_client.pttl("t:breaker:{dep}") > 0


def test_a_success_in_a_clean_window_costs_no_write(redis_client):
    # Without a state cache (each outcome written at once); the cached path is in
    # test_breaker_cache.py.
    breaker = make(redis_client, state_cache=0)
    for _ in range(3):
        breaker.call(lambda: None)
    assert redis_client.exists("t:breaker:{dep}") == 0  # nothing written for a healthy call
    failures(breaker, 1)
    breaker.call(lambda: None)
    assert redis_client.hget("t:breaker:{dep}", "ring") == "10"
    rate = make(redis_client, name="rate", failure_threshold=0.5, window=4, state_cache=0)
    rate.call(lambda: None)  # a rate counts every call
    assert redis_client.hget("t:breaker:{rate}", "ring") == "0"


def test_keys_share_one_slot_and_expire(redis_client):
    breaker = make(redis_client)
    failures(breaker, 3)
    time.sleep(0.35)
    breaker.admit()
    keys = sorted(k for k in redis_client.scan_iter(match="t:breaker*"))
    assert keys == ["t:breaker-probes:{dep}", "t:breaker:{dep}"]
    assert all(redis_client.pttl(k) > 0 for k in keys)
    assert (
        len(
            {
                redis_client.cluster_keyslot(k)
                if hasattr(redis_client, "cluster_keyslot")
                else k.split("{")[1]
                for k in keys
            }
        )
        == 1
    )


def test_store_outage_fails_closed_by_default_and_open_when_asked():
    client = redis.Redis.from_url(
        closed_port_url(), socket_connect_timeout=0.2, decode_responses=True
    )
    called = []
    with pytest.raises(LockStoreUnavailable):
        make(client).call(called.append, 1)
    assert called == []
    assert make(client, on_store_error="fail_open").call(lambda: "unguarded") == "unguarded"
    client.close()


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"failure_threshold": 0}, "failure_threshold"),
        ({"failure_threshold": 11, "window": 10}, "failure_threshold"),
        ({"window": 0}, "window"),
        ({"recovery_timeout": -1}, "recovery_timeout"),
        ({"half_open_probes": 0}, "half_open_probes"),
        ({"success_threshold": 0}, "success_threshold"),
        ({"classifier": 3}, "classifier"),
        ({"on_store_error": "maybe"}, "on_store_error"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, fragment):
    with pytest.raises(ImproperlyConfigured) as caught:
        CircuitBreaker("dep", **kwargs)
    assert fragment in str(caught.value)


@pytest.mark.parametrize("name", ["a\x00b", "line\nbreak", "esc\x1b[31m", "x}y", "{tag}"])
def test_a_name_that_could_not_be_a_lock_name_is_refused(name, redis_client):
    before = set(redis_client.scan_iter("steplock:breaker*"))
    with pytest.raises(ImproperlyConfigured) as caught:
        CircuitBreaker(name, client=redis_client)
    assert caught.value.setting == "CircuitBreaker(name=)"
    assert "printable and without braces" in str(caught.value)
    assert set(redis_client.scan_iter("steplock:breaker*")) == before


def test_every_breaker_signal_is_declared():
    assert {s.name for s in signals.ALL_SIGNALS} >= {
        "circuit_opened",
        "circuit_half_opened",
        "circuit_closed",
        "circuit_rejected",
        "circuit_override_audit",
        "retry_policy_decided",
    }


def test_prometheus_counts_transitions_rejections_and_decisions(redis_client):
    from prometheus_client import CollectorRegistry  # requirements/test.txt: never skipped

    from celery_steplock.contrib import prometheus
    from celery_steplock.patterns.retry import RetryPolicy

    prometheus.uninstall()
    metrics = prometheus.install(registry=CollectorRegistry())
    try:
        breaker = make(redis_client)
        failures(breaker, 3)
        with pytest.raises(CircuitOpen):
            breaker.call(lambda: None)
        time.sleep(0.35)
        breaker.call(lambda: None)
        breaker.override("open")  # unaudited: no signal; the audited path emits circuit_opened
        with pytest.raises(ValueError):
            RetryPolicy(sleep=lambda s: None).call(fail, ValueError("bad"))

        def sample(name, **labels):
            return metrics.registry.get_sample_value(name, labels) or 0.0

        assert [
            sample("steplock_circuit_transitions_total", breaker="dep", state=s, manual="false")
            for s in (OPEN, HALF_OPEN, CLOSED)
        ] == [1.0, 1.0, 1.0]
        assert sample("steplock_circuit_rejected_total", breaker="dep") == 1.0
        assert sample("steplock_retry_decisions_total", task="fail", decision="never") == 1.0
    finally:
        prometheus.uninstall()


def test_the_outage_setting_is_validated_and_used(app, redis_client):
    from celery_steplock.conf import Settings
    from tests.helpers import set_settings

    assert Settings(app).breaker_on_store_error == "fail_closed"
    set_settings(app, steplock_breaker_on_store_error="fail_open")
    assert Settings(app).breaker_on_store_error == "fail_open"
    dead = CircuitBreaker("dep", app=app)
    assert dead._policy() == "fail_open"
    set_settings(app, steplock_breaker_on_store_error="sometimes")
    problems = [p.setting for p in Settings(app).problems()]
    assert problems == ["steplock_breaker_on_store_error"]
