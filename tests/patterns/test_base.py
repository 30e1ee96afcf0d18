"""The patterns' shared base (celery_steplock.patterns._base), the jitter helper
(celery_steplock._jitter) and the gate registry (celery_steplock.patterns)."""

import sys

import pytest

from celery_steplock import _jitter, patterns
from celery_steplock.exceptions import (
    ImproperlyConfigured,
    InvalidArgument,
    LockStoreUnavailable,
)
from celery_steplock.lock import make_client
from celery_steplock.patterns import _base
from celery_steplock.patterns.breaker import CircuitBreaker
from celery_steplock.patterns.concurrency import ConcurrencyLimit
from celery_steplock.patterns.idempotency import Idempotency
from celery_steplock.patterns.ratelimit import SlidingWindow
from tests.helpers import closed_port_url, set_settings

pytestmark = pytest.mark.no_database

#: What the lease's outage sends (task.py), besides the event and the clocks.
LEASE_FIELDS = {"key", "name", "owner", "fence", "task_id", "task_name", "ttl", "reason", "policy"}


# -- jitter ----------------------------------------------------------------------------------


def test_full_jitter_spreads_over_its_span_past_its_floor():
    draws = [_jitter.full_jitter(2.0, after=1.0) for _ in range(500)]
    assert all(1.0 <= d <= 3.0 for d in draws)
    assert min(draws) < 1.2 and max(draws) > 2.8  # the whole span, not bunched
    assert _jitter.full_jitter(0.0, after=0.5) == 0.5


def test_the_backoff_ceiling_doubles_up_to_its_cap():
    assert [_jitter.backoff_ceiling(1.0, n, 5.0) for n in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert _jitter.backoff_ceiling(1e-9, 10_000, 1e9, max_exponent=32) == 1e-9 * 2**32


# -- the outage policy -------------------------------------------------------------------------


def test_the_outage_policy_sends_one_signal_and_fails_open_or_closed(events):
    exc = LockStoreUnavailable("lock store unavailable during x: down", key="k")
    assert _base.outage(exc, "fail_open", "value", pattern="a pattern", key="k", n=1) == "value"
    undone = []
    with pytest.raises(LockStoreUnavailable) as raised:
        _base.outage(exc, "fail_closed", pattern="a pattern", cleanup=lambda: undone.append(1))
    assert raised.value is exc and undone == [1]
    sent = [kw for name, kw in events if name == "lock_store_error"]
    assert [kw["policy"] for kw in sent] == ["fail_open", "fail_closed"]
    assert all(LEASE_FIELDS <= set(kw) for kw in sent)
    assert sent[0]["reason"] == "a pattern: lock store unavailable during x: down"
    assert (sent[0]["key"], sent[0]["n"], sent[0]["owner"]) == ("k", 1, None)


def test_an_outage_choice_is_checked_in_one_style():
    assert _base.check_on_store_error(None, "x") is None
    assert _base.check_on_store_error("fail_open", "x") == "fail_open"
    with pytest.raises(ImproperlyConfigured) as bad:
        _base.check_on_store_error("maybe", "opt on_store_error", setting="opt")
    assert bad.value.setting == "opt" and "'fail_closed', 'fail_open'" in str(bad.value)


def test_every_pattern_sends_the_same_signal_in_an_outage_open_or_closed(events):
    dead = make_client(closed_port_url(), socket_timeout=0.2)
    calls = {
        "circuit breaker": lambda policy: CircuitBreaker(
            "dep", client=dead, on_store_error=policy
        ).call(lambda: None),
        "concurrency limit": lambda policy: (
            ConcurrencyLimit(1, on_store_error=policy).acquire("k", client=dead).__enter__()
        ),
        "rate limit": lambda policy: SlidingWindow(
            1, 1, client=dead, on_store_error=policy
        ).try_acquire("k"),
        "idempotency": lambda policy: Idempotency("ns", client=dead, on_store_error=policy).begin(
            "r", {}
        ),
    }
    for pattern, run in calls.items():
        run("fail_open")
        with pytest.raises(LockStoreUnavailable):
            run("fail_closed")
        sent = [kw for name, kw in events if name == "lock_store_error"]
        assert [kw["policy"] for kw in sent] == ["fail_open", "fail_closed"], pattern
        assert all(LEASE_FIELDS <= set(kw) for kw in sent), pattern
        assert all(kw["reason"].startswith(f"{pattern}: ") for kw in sent), pattern
        assert [name for name, _kw in events if "store_error" in name] == ["lock_store_error"] * 2
        events.clear()
    dead.close()


# -- the client and prefix ------------------------------------------------------------------------


def test_the_target_is_looked_up_once_per_configuration_version(app):
    first = _base.target(app)
    assert _base.target(app) is first and first.store is not None
    assert _base.target(app, prefix="other").prefix == "other"
    set_settings(app, steplock_breaker_on_store_error="fail_open")
    again = _base.target(app)
    assert again is not first and again.store is first.store  # the store is shared
    bare = _base.target(client=first.client)
    assert (bare.prefix, bare.store, bare.settings) == ("steplock", None, None)


# -- the gate registry ----------------------------------------------------------------------------


def test_the_registry_declares_each_gate_modules_options_in_entry_order():
    import importlib

    assert list(patterns.GATE_REGISTRY) == ["idempotency", "breaker", "concurrency", "ratelimit"]
    for module, options in patterns.GATE_REGISTRY.values():
        assert importlib.import_module(module).OPTIONS == options, module
    assert patterns.GATES == tuple(m for m, _o in patterns.GATE_REGISTRY.values())


def test_the_gate_options_need_no_gate_module(monkeypatch):
    patterns.gate_options()  # the entry points are read once, before

    def refused(name, *args, **kwargs):
        raise AssertionError(f"{name} imported")

    monkeypatch.setattr(patterns.importlib, "import_module", refused)
    assert {"circuit_breaker", "cluster_rate_limit", "idempotency_key"} <= patterns.gate_options()


def test_register_gate_adds_moves_and_refuses(monkeypatch):
    monkeypatch.setattr(patterns, "GATE_REGISTRY", dict(patterns.GATE_REGISTRY))
    # Stand-in gate modules: any importable module (they are imported only when a plan is built).
    patterns.register_gate("quota", "tests.support.oracles", {"quota"}, before="concurrency")
    assert list(patterns.GATE_REGISTRY) == [
        "idempotency",
        "breaker",
        "quota",
        "concurrency",
        "ratelimit",
    ]
    assert "quota" in patterns.gate_options()
    patterns.register_gate("quota", "tests.support.servers", ["quota"])  # replaced in place
    assert list(patterns.GATE_REGISTRY)[2] == "quota"
    assert patterns.GATE_REGISTRY["quota"][0] == "tests.support.servers"
    for kwargs, argument in (
        ({"name": "x-y"}, "name"),
        ({"module": "not a module"}, "module"),
        ({"module": "tests.no_such_gate_module"}, "module"),  # would fail every task later
        ({"options": {"circuit_breaker"}}, "options"),  # the breaker's already
        ({"options": 5}, "options"),
        ({"options": None}, "options"),
        ({"before": "nowhere"}, "before"),
    ):
        call = {"name": "other", "module": "tests.support.oracles", "options": {"other"}}
        call.update(kwargs)
        with pytest.raises(InvalidArgument) as bad:
            patterns.register_gate(**call)
        assert bad.value.argument == argument


def test_an_entry_point_registers_its_gate_once(monkeypatch):
    import types
    from importlib.metadata import EntryPoint

    module = types.ModuleType("tests_quota_gate")
    module.OPTIONS = frozenset({"quota"})
    module.GATE_BEFORE = "breaker"
    monkeypatch.setitem(sys.modules, "tests_quota_gate", module)
    monkeypatch.setattr(patterns, "GATE_REGISTRY", dict(patterns.GATE_REGISTRY))
    monkeypatch.setattr(patterns, "_entry_points_read", False)
    points = [EntryPoint("quota", "tests_quota_gate", patterns.ENTRY_POINT_GROUP)]
    reads = []

    def entry_points(group):
        reads.append(group)
        return points

    monkeypatch.setattr(patterns.metadata, "entry_points", entry_points)
    assert "quota" in patterns.gate_options() and "quota" in patterns.gate_options()
    assert reads == [patterns.ENTRY_POINT_GROUP]
    assert list(patterns.GATE_REGISTRY)[:3] == ["idempotency", "quota", "breaker"]
    monkeypatch.setattr(patterns, "_entry_points_read", False)
    points[:] = [EntryPoint("broken", "tests_no_such_gate", patterns.ENTRY_POINT_GROUP)]
    with pytest.raises(ImproperlyConfigured) as bad:
        patterns.gate_options()
    assert bad.value.setting == patterns.ENTRY_POINT_GROUP and "broken" in str(bad.value)


def test_a_gate_registered_after_import_joins_the_plans_options(monkeypatch, app):
    from celery_steplock import plan as plan_module
    from celery_steplock.task import StepLockedTask

    monkeypatch.setattr(patterns, "GATE_REGISTRY", dict(patterns.GATE_REGISTRY))

    @app.task(base=StepLockedTask, shared=False)
    def quota_task():
        return None

    first = quota_task.steplock_plan
    assert "quota" not in plan_module.option_names()
    # A real gate module: the breaker's gate() finds no breaker on this task and adds none.
    patterns.register_gate("quota", "celery_steplock.patterns.breaker", {"quota"})
    assert "quota" in plan_module.option_names() and "quota" in plan_module.OPTION_NAMES
    # Assigning the new option drops the plan built before the registration.
    quota_task.quota = 3
    assert quota_task.steplock_plan is not first
