"""The concurrency limit (celery_steplock.patterns.concurrency) against a real Redis: at most N slots,
owner-keyed and fenced, expiring, renewed by the heartbeat, listed and reaped as leases,
fair to waiters; its gate in a real (eager) execution; its validation and outage policy."""

import socket
import threading
import time

import pytest
from redis.crc import key_slot

from celery_steplock.patterns import concurrency as bulkhead
from celery_steplock.patterns.concurrency import (
    ConcurrencyLimit,
    current_slot,
    parse_slot_name,
    slot_name,
)
from celery_steplock.exceptions import (
    ConcurrencyLimited,
    ImproperlyConfigured,
    LockLost,
    LockStoreUnavailable,
)
from celery_steplock.lock import RedisLeaseStore, make_client
from celery_steplock.task import StepLockedTask
from django_app.celery import app as celery_app
from tests.helpers import closed_port_url, set_settings

pytestmark = pytest.mark.no_database  # Redis only: runs once, in the SQLite pass


@pytest.fixture
def store(redis_client):
    return RedisLeaseStore(redis_client, prefix="bk")


def _meta(key, limit, **extra):
    return {"kind": "slot", "limit": limit, "limit_key": key, **extra}


def grant(limit, store, key, owner, ticket=None, ttl=5.0, **meta):
    return limit.try_acquire(
        store, key, owner=owner, ticket=ticket, ttl=ttl, metadata=_meta(key, limit.limit, **meta)
    )


def test_at_most_n_slots_each_fenced_and_the_next_refused(store):
    limit = ConcurrencyLimit(3)
    slots = [grant(limit, store, "api", f"owner{i}") for i in range(3)]
    assert sorted(s.index for s in slots) == [0, 1, 2]
    fences = [s.fence for s in slots]
    assert fences == sorted(fences) and len(set(fences)) == 3
    with pytest.raises(ConcurrencyLimited) as denied:
        grant(limit, store, "api", "owner3")
    assert denied.value.option == "concurrency_limit" and denied.value.key == "api"
    assert 0.05 <= denied.value.retry_after <= 0.5  # the default steplock_bulkhead_retry_after
    assert denied.value.context["free"] == 0
    # The same owner asking again gets its own slot back (a redelivery), not a second one.
    again = grant(limit, store, "api", "owner1")
    assert (again.index, again.fence) == (slots[1].index, slots[1].fence)
    # Another key has slots of its own.
    assert grant(limit, store, "other", "owner9").index == 0


def test_release_is_owner_keyed_and_frees_exactly_one_slot(store):
    limit = ConcurrencyLimit(1)
    held = grant(limit, store, "k", "a")
    assert store.release(held.lease.name, "someone-else") is False
    with pytest.raises(ConcurrencyLimited):
        grant(limit, store, "k", "b")
    assert held.release() is True
    assert held.release() is False  # twice is harmless
    assert grant(limit, store, "k", "b").owner == "b"


def test_a_slot_expires_with_its_ttl_and_a_taken_over_holder_frees_nothing(store, events):
    limit = ConcurrencyLimit(1)
    stopped = grant(limit, store, "k", "stopped", ttl=0.2)  # never renewed: as if SIGSTOPped
    time.sleep(0.35)
    taker = grant(limit, store, "k", "taker")
    assert taker.index == stopped.index and taker.fence > stopped.fence
    # The stopped holder, resumed, no longer counts as a holder...
    assert stopped.lost
    with pytest.raises(LockLost):
        stopped.check()
    # ...and its release cannot free the new holder's slot (owner-keyed).
    assert stopped.release() is False
    assert store.inspect(taker.lease.name)["owner"] == "taker"
    with pytest.raises(ConcurrencyLimited):
        grant(limit, store, "k", "third")
    expired = [kw for name, kw in events if name == "slot_expired"]
    assert [e["owner"] for e in expired] == ["stopped"]


def test_an_early_waiter_gets_the_slot_before_later_newcomers(store):
    limit = ConcurrencyLimit(1)
    holder = grant(limit, store, "fair", "holder")
    for ticket in ("early", "late"):  # both denied, queued in this order
        with pytest.raises(ConcurrencyLimited) as denied:
            grant(limit, store, "fair", f"o-{ticket}", ticket=ticket)
        assert denied.value.context["free"] == 0
    holder.release()
    # A free slot now: a newcomer (no ticket, or a ticket never queued) and the later
    # waiter are refused; the slot is kept for the earliest waiter.
    for owner, ticket in (("newcomer", None), ("newcomer2", "new"), ("o-late", "late")):
        with pytest.raises(ConcurrencyLimited) as denied:
            grant(limit, store, "fair", owner, ticket=ticket)
        assert denied.value.context["free"] == 1
    assert grant(limit, store, "fair", "o-early", ticket="early").owner == "o-early"
    store.release(slot_name("fair", 0), "o-early")
    # Then the next oldest waiter: "late" was queued before "new".
    with pytest.raises(ConcurrencyLimited):
        grant(limit, store, "fair", "newcomer2", ticket="new")
    assert grant(limit, store, "fair", "o-late", ticket="late").owner == "o-late"
    store.release(slot_name("fair", 0), "o-late")
    assert grant(limit, store, "fair", "newcomer2", ticket="new").owner == "newcomer2"


def test_a_waiter_that_stops_coming_back_leaves_the_queue(store):
    limit = ConcurrencyLimit(1, waiter_ttl=0.2)
    holder = grant(limit, store, "gone", "holder")
    with pytest.raises(ConcurrencyLimited):
        grant(limit, store, "gone", "o-w", ticket="w")
    holder.release()
    with pytest.raises(ConcurrencyLimited):  # kept for the waiter while its entry lives
        grant(limit, store, "gone", "newcomer")
    time.sleep(0.3)
    assert grant(limit, store, "gone", "newcomer").owner == "newcomer"


def test_two_free_slots_serve_the_waiter_and_one_newcomer(store):
    limit = ConcurrencyLimit(2)
    a, b = grant(limit, store, "two", "a"), grant(limit, store, "two", "b")
    with pytest.raises(ConcurrencyLimited):
        grant(limit, store, "two", "o-w", ticket="w")
    a.release()
    b.release()
    assert grant(limit, store, "two", "newcomer").owner == "newcomer"  # 2 free, 1 waiting
    with pytest.raises(ConcurrencyLimited):
        grant(limit, store, "two", "newcomer2")  # 1 free, kept for the waiter
    assert grant(limit, store, "two", "o-w", ticket="w").owner == "o-w"


def test_the_context_manager_is_renewed_by_the_heartbeat_and_released(redis_client, events):
    limit = ConcurrencyLimit(1, ttl=0.3)
    with limit.acquire("hb", client=redis_client, prefix="bk") as slot:
        assert current_slot() is slot
        time.sleep(0.9)  # three TTLs: only renewals keep it
        assert not slot.lost
        assert redis_client.hget(slot.lease.key, "owner") == slot.owner
        with pytest.raises(ConcurrencyLimited):
            with limit.acquire("hb", client=redis_client, prefix="bk"):
                pass
    assert current_slot() is None
    assert redis_client.exists(slot.lease.key) == 0
    names = [name for name, _ in events]
    assert names.count("slot_acquired") == 1 and names.count("slot_released") == 1
    assert "lock_extended" in names  # the heartbeat renewed the slot as a lease
    assert names.count("concurrency_limited") == 1


def test_acquire_with_wait_gets_the_slot_once_it_is_freed(redis_client):
    limit = ConcurrencyLimit(1, retry_after=0.05)
    got = []
    with limit.acquire("w", client=redis_client, prefix="bk"):

        def waiter():
            with limit.acquire("w", client=redis_client, prefix="bk", wait=5) as slot:
                got.append((time.monotonic(), slot.index))

        thread = threading.Thread(target=waiter)
        thread.start()
        time.sleep(0.3)
        freed_at = time.monotonic()
    thread.join(10)
    assert len(got) == 1 and got[0][0] >= freed_at
    # A waiter that gives up leaves the queue at once.
    with limit.acquire("w2", client=redis_client, prefix="bk"):
        with pytest.raises(ConcurrencyLimited):
            with limit.acquire("w2", client=redis_client, prefix="bk", wait=0.2):
                pass
    assert redis_client.zcard("bk:bulkhead:{w2}:queue") == 0


def test_the_decorator_limits_calls_per_rendered_key(redis_client):
    limit = ConcurrencyLimit(1, key="tenant:{tenant}")
    inside = []

    @limit.using(client=redis_client, prefix="bk")
    def call(tenant, n):
        inside.append(current_slot().key)
        if n:
            return call(tenant, n - 1)  # the same key again, from inside: refused
        return "done"

    assert call("a", 0) == "done"
    with pytest.raises(ConcurrencyLimited) as denied:
        call("a", 1)
    assert denied.value.key == "tenant:a"
    assert inside == ["tenant:a", "tenant:a"]


def test_slots_are_listed_inspected_and_force_released_as_leases(app, redis_client):
    from celery_steplock.lock import get_lease_store
    from celery_steplock.ops import LogAudit, force_release

    store = get_lease_store(app)
    limit = ConcurrencyLimit(2)
    slot = grant(limit, store, "listed", "o1", task_name="tasks.charge")
    listed = {lease["name"]: lease for lease in store.iter_leases()}
    assert set(listed) == {"listed}#0"}
    lease = listed["listed}#0"]
    assert (lease["kind"], lease["limit"], lease["limit_key"]) == ("slot", "2", "listed")
    assert lease["owner"] == "o1" and int(lease["fence"]) == slot.fence
    assert store.inspect("listed}#0")["owner"] == "o1"
    released = force_release(
        store,
        "listed}#0",
        "o1",
        actor="tester",
        actor_host="here",
        via="cli",
        reason="test",
        auditor=LogAudit(),
    )
    assert released is not None
    assert store.inspect("listed}#0") is None


@pytest.mark.django_db(transaction=True)  # the reaper's step pass reads the database
def test_the_reaper_frees_the_slot_of_a_dead_holder(app, redis_client, events):
    from celery_steplock.lock import get_lease_store
    from celery_steplock.reaper import reap

    store = get_lease_store(app)
    limit = ConcurrencyLimit(1)
    dead_pid = _dead_pid()
    grant(
        limit,
        store,
        "reaped",
        "dead-owner",
        ttl=60.0,
        renew_ms=10,
        pid=dead_pid,
        hostname=socket.gethostname(),
    )
    time.sleep(1.2)  # past 1.5 renewal intervals and the reaper's grace (1 s): not renewed
    report = reap(app, ping_timeout=0.2)
    assert [r["name"] for r in report.leases_reaped] == ["reaped}#0"]
    assert grant(limit, store, "reaped", "next").owner == "next"
    expired = [kw for name, kw in events if name == "slot_expired"]
    assert [(e["owner"], e["limit_key"]) for e in expired] == [("dead-owner", "reaped")]


def _dead_pid():
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_every_key_of_one_limit_is_in_one_cluster_slot():
    keys = ConcurrencyLimit.redis_keys("steplock", "tenant:42", 50)
    assert len({key_slot(k.encode()) for k in keys}) == 1
    assert {parse_slot_name(slot_name("tenant:42", 7))} == {("tenant:42", 7)}
    assert parse_slot_name("tenant:42") is None and parse_slot_name("a}#x") is None


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "2", None, bulkhead.MAX_LIMIT + 1])
def test_a_bad_limit_names_the_option(value):
    with pytest.raises(ImproperlyConfigured) as bad:
        ConcurrencyLimit(value)
    assert bad.value.setting == "concurrency_limit"


@pytest.mark.parametrize("template", ["{x.y}", "{0}", "{}", "{x", 7, ""])
def test_a_bad_key_template_names_the_option(template):
    with pytest.raises(ImproperlyConfigured) as bad:
        ConcurrencyLimit(1, key=template)
    assert bad.value.setting == "concurrency_limit_key"


@pytest.mark.parametrize(
    "extra", [{"ttl": 0}, {"on_store_error": "maybe"}, {"retry_after": -1}, {"waiter_ttl": "x"}]
)
def test_bad_arguments_name_the_option(extra):
    with pytest.raises(ImproperlyConfigured) as bad:
        ConcurrencyLimit(1, **extra)
    assert bad.value.setting == "concurrency_limit"


def test_task_options_are_validated_by_the_plan_and_the_validator(redis_server_url):
    from celery import Celery

    from celery_steplock.validate import problems

    own = Celery("bk-validate", set_as_current=False)  # the example app's registry stays clean
    own.conf.update(broker_url=redis_server_url, steplock_redis_url=redis_server_url)

    def body(n):
        return n

    for name, options in (
        ("bad_key", {"concurrency_limit": 2, "concurrency_limit_key": "t:{missing}"}),
        ("zero", {"concurrency_limit": 0}),
        ("lonely", {"concurrency_limit_key": "t:{n}"}),
        ("fine", {"concurrency_limit": 3, "concurrency_limit_key": "t:{n}"}),
    ):
        own.task(
            base=StepLockedTask,
            name=f"tests.bk.{name}",
            lock_key="bk:{n}",
            shared=False,
            **options,
        )(body)
    own.finalize()
    found = {
        p.obj.rsplit(".", 1)[-1]: p for p in problems(own) if str(p.obj).startswith("tests.bk.")
    }
    assert set(found) == {"bad_key", "zero", "lonely"}
    assert all(p.is_error for p in found.values())
    assert "concurrency_limit_key" in found["bad_key"].message
    assert "'missing'" in found["bad_key"].message
    assert "concurrency_limit must be an int from 1" in found["zero"].message
    assert "concurrency_limit is not" in found["lonely"].message


def test_bad_settings_name_the_setting(app):
    from celery_steplock.conf import Settings

    set_settings(app, steplock_bulkhead_retry_after=0, steplock_bulkhead_on_store_error="x")
    named = {p.setting for p in Settings(app).problems()}
    assert {"steplock_bulkhead_retry_after", "steplock_bulkhead_on_store_error"} <= named


def test_an_outage_fails_closed_by_default_and_open_when_asked():
    client = make_client(closed_port_url(), socket_timeout=0.5)
    with pytest.raises(LockStoreUnavailable):
        with ConcurrencyLimit(1).acquire("down", client=client):
            pass
    ran = []
    with ConcurrencyLimit(1, on_store_error="fail_open").acquire("down", client=client) as slot:
        ran.append(slot)
    assert ran == [None]


# -- the gate in an execution -------------------------------------------------------------

SEEN = []


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.bk.limited",
    lock_key="bkt:{n}",
    concurrency_limit=1,
    concurrency_limit_key="tenant:{tenant}",
    lock_retry_max=0,
)
def limited(self, tenant, n):
    slot = current_slot()
    SEEN.append(slot and (slot.key, slot.index, slot.lease.task_id, self.request.id))
    return "ran"


def test_the_gate_holds_a_slot_around_the_body_and_releases_it(app, redis_client, events):
    SEEN.clear()
    result = limited.apply(args=("acme", 1), task_id="t-1")
    assert result.get() == "ran"
    assert SEEN == [("tenant:acme", 0, "t-1", "t-1")]
    assert not list(redis_client.scan_iter(match="steplock:lease:{tenant:acme}*"))
    order = [name for name, kw in events if name.startswith(("slot_", "lock_acq", "lock_rel"))]
    assert order == ["lock_acquired", "slot_acquired", "slot_released", "lock_released"]


def test_a_denied_execution_is_re_queued_past_retry_after_without_its_body(
    app, redis_client, monkeypatch
):
    from celery_steplock.lock import get_lease_store

    SEEN.clear()
    store = get_lease_store(app)
    grant(ConcurrencyLimit(1), store, "tenant:busy", "other")
    countdowns = []
    real = StepLockedTask.steplock_retry

    def spy(self, exc, headers=None, countdown=None):
        countdowns.append((type(exc).__name__, countdown))
        return real(self, exc, headers=headers, countdown=countdown)

    monkeypatch.setattr(StepLockedTask, "steplock_retry", spy)
    result = limited.apply(args=("busy", 2), task_id="t-2")
    assert isinstance(result.result, ConcurrencyLimited)  # lock_retry_max=0: budget used up
    assert SEEN == []
    assert len(countdowns) == 1 and countdowns[0][0] == "ConcurrencyLimited"
    assert 0.05 <= countdowns[0][1] <= 1.0
    # The denied task keeps its place: it is the queue's only waiter, under its task id.
    assert [m for m in redis_client.zrange("steplock:bulkhead:{tenant:busy}:queue", 0, -1)] == [
        "t-2"
    ]


def test_the_gate_fails_closed_in_an_outage_and_open_when_asked(app):
    SEEN.clear()
    # Redis down, the task's own lease run fail-open: the gate's policy decides alone.
    set_settings(
        app,
        steplock_redis_url=closed_port_url(),
        steplock_socket_timeout=0.5,
        steplock_on_store_error="fail_open",
    )
    result = limited.apply(args=("down", 3))
    assert isinstance(result.result, LockStoreUnavailable)  # retried, budget 0: used up
    assert SEEN == []
    set_settings(app, steplock_bulkhead_on_store_error="fail_open")
    assert limited.apply(args=("down", 4)).get() == "ran"
    assert SEEN == [None]  # ran without a slot
