"""The reaper (celery_steplock.reaper) against a real Redis, the test database and, in the last
test, real worker processes: one SIGKILLed next to one that keeps running."""

import os
import socket
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import pytest
from celery import Celery

from celery_steplock import signals
from celery_steplock.reaper import ReapReport, pid_alive, reap
from celery_steplock.lock import get_lease_store
from django_app.workflows.models import Step
from django_app.workflows.tasks import claim_and_hold, hold
from helpers import UNREADABLE_NAME, closed_port_url, wait_until, write_hostile_leases

pytestmark = pytest.mark.django_db(transaction=True)

GHOST = "ghost@nowhere.invalid"  # a worker node nobody runs: never answers a ping
ELSEWHERE = "elsewhere.invalid"  # a host other than this one: pids are not checked there
PING = 0.3  # seconds per ping attempt: keeps these tests quick


@pytest.fixture
def lease_store(app, redis_client):
    """The app's RedisLeaseStore on the flushed Redis (the reaper's default lock)."""
    return get_lease_store(app)


@pytest.fixture
def expired_events():
    """Every ``lock_expired`` sent in this process, as keyword dicts."""
    seen = []

    def receiver(sender=None, **kwargs):
        seen.append(dict(kwargs, sender=sender))

    signals.lock_expired.connect(receiver, weak=False, dispatch_uid="test-reaper-expired")
    yield seen
    signals.lock_expired.disconnect(dispatch_uid="test-reaper-expired")


def take(lock, name, ttl=30.0, **meta):
    """Acquire ``name`` with holder metadata ``meta`` (task_name defaults to a test name)."""
    meta.setdefault("task_name", "tests.fake")
    lease = lock.acquire(name, ttl=ttl, metadata=meta)
    assert lease is not None
    return lease


def age(redis_client, lock, name, seconds):
    """Pretend the lease was last renewed ``seconds`` ago (Redis server clock)."""
    now_s, now_us = redis_client.time()
    redis_client.hset(
        lock.key(name), "renewed_ms", now_s * 1000 + now_us // 1000 - int(seconds * 1000)
    )


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid is free again
    return proc.pid


def in_flight(name, owner, fence=7):
    return Step.objects.create(name=name, status="running", lock_owner=owner, lock_fence=fence)


# -- helpers -------------------------------------------------------------------------------


def test_pid_alive_tells_live_dead_and_zombie_processes():
    assert pid_alive(os.getpid())
    assert not pid_alive(dead_pid())
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while pid_alive(zombie.pid) and time.monotonic() < deadline:
        time.sleep(0.02)  # exited but not waited for: a zombie still owns its pid
    try:
        assert not pid_alive(zombie.pid)
    finally:
        zombie.wait()
    assert pid_alive(0) and pid_alive(-1)  # process-group addresses are never "dead"


def test_report_as_dict_is_json_ready():
    report = ReapReport(leases_scanned=3, errors=["boom"], dry_run=True, duration=0.5)
    data = report.as_dict()
    assert data == {
        "leases_scanned": 3,
        "leases_reaped": [],
        "leases_malformed": [],
        "steps_recovered": [],
        "errors": ["boom"],
        "dry_run": True,
        "duration": 0.5,
        "ok": False,
    }
    assert report.summary_lines()[:4] == [
        "leases scanned: 3",
        "leases to reap: 0 (dry run: nothing changed)",
        "steps to recover: 0",
        "errors: 1",
    ]


def test_invalid_arguments_raise(app):
    with pytest.raises(ValueError):
        reap(app, batch_size=0)
    with pytest.raises(ValueError):
        reap(app, older_than=-1)


# -- pass 1: leases ------------------------------------------------------------------------


def test_silent_worker_with_a_stale_heartbeat_is_reaped(
    app, lease_store, redis_client, expired_events
):
    lease = take(
        lease_store,
        "ghostly",
        worker=GHOST,
        hostname=ELSEWHERE,
        pid=4242,
        task_id="t-1",
        step="workflows.step:1",
    )
    age(redis_client, lease_store, "ghostly", 60)
    report = reap(app, ping_timeout=PING)
    assert report.ok, report.errors
    assert report.leases_scanned == 1
    [reaped] = report.leases_reaped
    assert reaped["name"] == "ghostly" and reaped["owner"] == lease.owner
    assert reaped["fence"] == lease.fence and reaped["worker"] == GHOST
    assert "did not answer a ping" in reaped["reason"] and "60." in reaped["reason"]
    assert lease_store.inspect("ghostly") is None
    [event] = expired_events
    assert event["owner"] == lease.owner and event["key"] == lease.key
    assert event["fence"] == lease.fence and event["task_id"] == "t-1"
    assert event["sender"] == "tests.fake" and event["reason"].startswith("reaped: worker")
    assert reap(app, ping_timeout=PING).leases_reaped == []  # idempotent


def test_silent_worker_whose_lease_is_still_renewed_is_kept(app, lease_store, redis_client):
    # A solo-pool worker busy in a long task answers no ping, yet its heartbeat renews.
    lease = take(lease_store, "busy", worker=GHOST, hostname=ELSEWHERE, pid=4242)
    age(redis_client, lease_store, "busy", 2)  # 30 s TTL renews every 10 s: 2 s is fresh
    report = reap(app, ping_timeout=PING)
    assert report.ok and report.leases_scanned == 1 and report.leases_reaped == []
    assert lease_store.inspect("busy")["owner"] == lease.owner


def test_leases_without_worker_or_local_pid_are_kept(app, lease_store, redis_client):
    take(lease_store, "bare")  # no worker, no pid
    take(lease_store, "remote-pid", hostname=ELSEWHERE, pid=dead_pid())  # not our pid space
    for name in ("bare", "remote-pid"):
        age(redis_client, lease_store, name, 600)
    report = reap(app, ping_timeout=PING)
    assert report.ok and report.leases_scanned == 2 and report.leases_reaped == []
    assert lease_store.inspect("bare") and lease_store.inspect("remote-pid")


def test_local_pid_decides_for_leases_taken_on_this_host(app, lease_store, redis_client):
    here = socket.gethostname()
    take(lease_store, "gone", hostname=here, pid=dead_pid(), worker=GHOST)
    # A silent worker whose holder process is alive here is never reaped.
    take(lease_store, "alive", hostname=here, pid=os.getpid(), worker=GHOST)
    for name in ("gone", "alive"):
        age(redis_client, lease_store, name, 600)
    report = reap(app, ping_timeout=PING)
    assert report.ok, report.errors
    assert [r["name"] for r in report.leases_reaped] == ["gone"]
    [gone] = report.leases_reaped
    assert gone["reason"] == (
        f"pid {gone['pid']} on {here} no longer exists and the lease was last renewed 600.0s ago"
    )
    assert lease_store.inspect("gone") is None and lease_store.inspect("alive")
    # check_pids=False: only the ping and the heartbeat judge, and "alive" is silent and stale.
    report = reap(app, ping_timeout=PING, check_pids=False)
    assert [r["name"] for r in report.leases_reaped] == ["alive"]


def test_one_malformed_lease_does_not_stop_the_run(app, lease_store, redis_client, expired_events):
    """An oversized pid (OverflowError in os.kill on the landed code) and an unreadable
    renewal time beside dead holders: the dead ones are reaped, the malformed ones are
    listed and left to their TTL, and the run is a success."""
    here = socket.gethostname()
    names = ("dead-1", "huge-pid", "dead-2", "bad-clock")
    for name in names:
        take(
            lease_store,
            name,
            hostname=here,
            worker=GHOST,
            pid="9" * 30 if name == "huge-pid" else dead_pid(),
        )
        age(redis_client, lease_store, name, 600)
    redis_client.hset(lease_store.key("bad-clock"), "renewed_ms", "later")
    report = reap(app, ping_timeout=PING)
    assert report.ok, report.errors
    assert sorted(r["name"] for r in report.leases_reaped) == ["dead-1", "dead-2"]
    assert sorted(e["name"] for e in expired_events) == ["dead-1", "dead-2"]
    malformed = {m["name"]: m["malformed"] for m in report.leases_malformed}
    assert sorted(malformed) == ["bad-clock", "huge-pid"]
    assert malformed["huge-pid"].startswith("pid: out of range")
    assert malformed["bad-clock"].startswith("renewed_ms: not an integer")
    assert report.leases_scanned == 4
    assert "leases malformed (skipped): 2" in report.summary_lines()
    assert any(
        line.startswith("skipped malformed lease huge-pid: pid: out of range")
        for line in report.detail_lines()
    )
    assert lease_store.inspect("huge-pid") and lease_store.inspect("bad-clock")
    assert lease_store.inspect("dead-1") is None and lease_store.inspect("dead-2") is None
    again = reap(app, ping_timeout=PING)
    assert again.ok and again.leases_reaped == [] and len(again.leases_malformed) == 2


def test_pid_alive_answers_alive_for_a_pid_beyond_the_os_range():
    assert pid_alive(2**70) is True  # doubt never reaps (was OverflowError)


def test_a_renewing_lease_survives_a_pid_that_looks_dead(app, lease_store, redis_client):
    # The reaper runs in another PID namespace under the same hostname (a pod's sidecar):
    # the pid lookup fails, but the holder's heartbeat keeps renewing, so it is alive.
    here = socket.gethostname()
    lease = take(
        lease_store, "sidecar", hostname=here, pid=dead_pid(), worker=GHOST, renew_ms=10000
    )
    age(redis_client, lease_store, "sidecar", 5)
    report = reap(app, ping_timeout=PING)
    assert report.ok and report.leases_reaped == []
    assert lease_store.inspect("sidecar")["owner"] == lease.owner


def test_the_holders_own_renewal_interval_decides(app, lease_store, redis_client):
    # renew_ms recorded by the holder wins over the reaper's own renewal_ratio setting.
    take(lease_store, "slow-renewer", worker=GHOST, hostname=ELSEWHERE, renew_ms=20000)
    age(redis_client, lease_store, "slow-renewer", 15)  # 15 s < 1.5 x 20 s + 1 s
    assert reap(app, ping_timeout=PING).leases_reaped == []
    age(redis_client, lease_store, "slow-renewer", 40)
    assert [r["name"] for r in reap(app, ping_timeout=PING).leases_reaped] == ["slow-renewer"]


def test_a_hung_broker_bounds_the_run(app, lease_store, redis_client, private_redis):
    from celery import Celery

    hung = Celery("hung-broker", set_as_current=False)
    hung.conf.update(
        broker_url=private_redis.url,
        steplock_redis_url=app.conf.broker_url,
        broker_connection_timeout=60,
        broker_connection_retry=False,
    )
    take(lease_store, "remote", worker=GHOST, hostname=ELSEWHERE)
    age(redis_client, lease_store, "remote", 600)
    private_redis.pause()  # accepts connections, never answers
    try:
        started = time.monotonic()
        report = reap(hung, ping_timeout=PING)
        took = time.monotonic() - started
    finally:
        private_redis.resume()
    assert not report.ok and "broker did not answer" in " ".join(report.errors)
    assert report.leases_reaped == [] and lease_store.inspect("remote")
    # The bound is the ping thread's join (2 pings + BROKER_GRACE), which the message names;
    # without it kombu would wait for the 60 s connection timeout. The wall clock only has
    # to tell the two apart, with room for a loaded machine.
    assert f"within {2 * PING + 5:g}s" in " ".join(report.errors)
    assert took < 30


def test_a_lease_reacquired_after_the_scan_survives(
    app, lease_store, redis_client, monkeypatch, expired_events
):
    old = take(lease_store, "flip", worker=GHOST, hostname=ELSEWHERE, pid=1)
    age(redis_client, lease_store, "flip", 60)
    real_ping = app.control.ping

    def ping_then_flip(*args, **kwargs):
        # Between the scan and the delete: the dead owner's lease goes, a new owner takes it.
        if lease_store.release("flip", old.owner):  # the first ping only (silent ones: twice)
            take(lease_store, "flip", worker=GHOST, hostname=ELSEWHERE, pid=1)
        return real_ping(*args, **kwargs)

    monkeypatch.setattr(app.control, "ping", ping_then_flip)
    report = reap(app, ping_timeout=PING)
    assert report.ok and report.leases_reaped == [] and expired_events == []
    holder = lease_store.inspect("flip")
    assert holder and holder["owner"] != old.owner  # compare-and-delete spared the new owner


def test_ping_failure_is_an_error_and_judges_nobody(app, lease_store, redis_client, monkeypatch):
    take(lease_store, "ghostly", worker=GHOST, hostname=ELSEWHERE, pid=1)
    age(redis_client, lease_store, "ghostly", 60)

    def broken(*args, **kwargs):
        raise OSError("broker unreachable")

    monkeypatch.setattr(app.control, "ping", broken)
    report = reap(app, ping_timeout=PING)
    assert not report.ok and "broker unreachable" in report.errors[0]
    assert report.leases_reaped == [] and lease_store.inspect("ghostly")


# -- pass 2: steps -------------------------------------------------------------------------


def test_orphaned_steps_are_recovered_once_by_cas(app, lease_store, redis_client, expired_events):
    live = take(lease_store, "step:live", worker=GHOST, hostname=ELSEWHERE, pid=1)
    dead = take(
        lease_store,
        "step:dead",
        worker=GHOST,
        hostname=ELSEWHERE,
        pid=1,
        task_id="dead-task",
        task_name="tests.dead",
    )
    age(redis_client, lease_store, "step:dead", 60)
    newcomer = take(lease_store, "step:retaken", worker=GHOST, hostname=ELSEWHERE, pid=1)
    orphan = in_flight("orphan", "f" * 32)  # owner holds no lease at all
    of_reaped = in_flight("of-reaped", dead.owner, fence=dead.fence)
    held = in_flight("held", live.owner)  # owner's lease is live
    retaken = in_flight("retaken", "e" * 32)  # a live lease names the step
    redis_client.hset(lease_store.key("step:retaken"), "step", f"workflows.step:{retaken.pk}")
    unowned = in_flight("unowned", "")  # written outside the library
    pending = Step.objects.create(name="pending", lock_owner="f" * 32)

    report = reap(app, ping_timeout=PING)
    assert report.ok, report.errors
    assert [r["name"] for r in report.leases_reaped] == ["step:dead"]
    recovered = {r["pk"]: r for r in report.steps_recovered}
    assert sorted(recovered) == sorted([orphan.pk, of_reaped.pk])
    assert recovered[of_reaped.pk]["lease"] == "step:dead"
    assert recovered[orphan.pk] == {
        "model": "workflows.Step",
        "pk": orphan.pk,
        "from_": "running",
        "to": "pending",
        "owner": "f" * 32,
        "lease": None,
        "reason": "no live lease is held by its owner",
    }
    for step in (orphan, of_reaped):
        before_fence = step.lock_fence
        step.refresh_from_db()
        assert (step.status, step.lock_owner, step.lock_fence) == ("pending", "", before_fence)
    for step, owner in ((held, live.owner), (retaken, "e" * 32), (unowned, "")):
        step.refresh_from_db()
        assert (step.status, step.lock_owner) == ("running", owner)
    pending.refresh_from_db()
    assert pending.status == "pending" and pending.lock_owner == "f" * 32
    step_events = {e["step_id"]: e for e in expired_events if e.get("step_id")}
    assert sorted(step_events) == sorted([orphan.pk, of_reaped.pk])
    assert step_events[of_reaped.pk]["task_id"] == "dead-task"
    assert step_events[of_reaped.pk]["sender"] == "tests.dead"
    assert (step_events[orphan.pk]["from_"], step_events[orphan.pk]["to"]) == (
        "running",
        "pending",
    )
    assert lease_store.inspect("step:live") and lease_store.inspect("step:retaken")
    assert newcomer.owner == lease_store.inspect("step:retaken")["owner"]

    again = reap(app, ping_timeout=PING)
    assert again.ok and again.leases_reaped == [] and again.steps_recovered == []


def test_older_than_spares_recent_steps(app, lease_store, redis_client):
    step = in_flight("recent", "f" * 32)
    assert reap(app, older_than=3600).steps_recovered == []
    step.refresh_from_db()
    assert step.status == "running"
    app.conf.steplock_reaper_older_than = 3600  # the setting is the default
    assert reap(app).steps_recovered == []
    later = datetime.now(timezone.utc) + timedelta(hours=2)
    assert [r["pk"] for r in reap(app, now=later).steps_recovered] == [step.pk]


def test_a_row_changed_after_it_was_read_is_not_touched(
    app, lease_store, redis_client, monkeypatch
):
    step = in_flight("moving", "f" * 32)
    take(lease_store, "ghostly", worker=GHOST, hostname=ELSEWHERE, pid=1)
    age(redis_client, lease_store, "ghostly", 600)  # stale, so its worker gets pinged
    real_ping = app.control.ping

    def ping_and_reclaim(*args, **kwargs):
        # The rows were read before the scan; a new attempt claims this one meanwhile.
        Step.objects.filter(pk=step.pk).update(lock_owner="a" * 32, lock_fence=99)
        return real_ping(*args, **kwargs)

    monkeypatch.setattr(app.control, "ping", ping_and_reclaim)
    report = reap(app, ping_timeout=PING)
    assert report.ok and report.steps_recovered == []
    step.refresh_from_db()
    assert (step.status, step.lock_owner, step.lock_fence) == ("running", "a" * 32, 99)


def test_dry_run_changes_nothing_and_finds_the_same(
    app, lease_store, redis_client, expired_events
):
    dead = take(lease_store, "step:dead", worker=GHOST, hostname=ELSEWHERE, pid=1)
    age(redis_client, lease_store, "step:dead", 60)
    step = in_flight("orphan", dead.owner)
    dry = reap(app, dry_run=True, ping_timeout=PING)
    assert dry.ok and dry.dry_run
    assert lease_store.inspect("step:dead")["owner"] == dead.owner
    step.refresh_from_db()
    assert step.status == "running" and step.lock_owner == dead.owner
    assert expired_events == []
    assert any(line.startswith("would reap lease step:dead") for line in dry.detail_lines())
    real = reap(app, ping_timeout=PING)
    assert not real.dry_run

    def strip(report):  # seconds left and idle times move on between the two runs
        return (
            [
                {k: v for k, v in r.items() if k not in ("ttl", "reason")}
                for r in report.leases_reaped
            ],
            [{k: v for k, v in r.items() if k != "reason"} for r in report.steps_recovered],
        )

    assert strip(dry) == strip(real) and len(real.steps_recovered) == 1
    assert len(expired_events) == 2  # one lease, one step


def test_redis_down_is_reported_and_nothing_is_recovered(app, redis_client):
    step = in_flight("orphan", "f" * 32)
    app.conf.steplock_redis_url = closed_port_url()
    report = reap(app, ping_timeout=PING)
    assert not report.ok and "lease scan failed" in report.errors[0]
    assert report.leases_scanned == 0 and report.steps_recovered == []
    step.refresh_from_db()
    assert step.status == "running"  # without the live owners nobody is called orphaned


def test_bad_recover_setting_is_an_error(app, redis_client):
    # An app of its own: the shared one's Django-provided setting must stay as it is.
    other = Celery("reaper-test", set_as_current=False)
    other.conf.update(
        broker_url=app.conf.broker_url,
        steplock_redis_url=app.conf.broker_url,
        steplock_reaper_recover={"workflows.Nope": {"running": "pending"}},
    )
    report = reap(other, ping_timeout=PING)
    assert not report.ok and "workflows.Nope" in report.errors[0]


# -- real workers ----------------------------------------------------------------------------


@pytest.mark.workers
def test_only_the_sigkilled_workers_leases_and_steps_are_reaped(
    app, start_worker, redis_client, expired_events
):
    # TTL 30 s: the dead worker's leases are still far from expiring when the reaper runs,
    # so whatever disappears was removed by the reaper, not by Redis. Renewals every 1.5 s
    # (ratio 0.05), so a dead holder's missed renewals show within 1.5 x 1.5 s + 1 s.
    env = {"STEPLOCK_TTL": 30, "STEPLOCK_RENEWAL_RATIO": 0.05}
    doomed = start_worker("doomed", concurrency=2, extra_args=("-Q", "doomed"), **env)
    alive = start_worker("alive", concurrency=2, extra_args=("-Q", "alive"), **env)
    steps = {
        name: Step.objects.create(name=name)
        for name in ("dead-hold", "dead-claim", "live-hold", "live-claim")
    }
    hold.apply_async((steps["dead-hold"].pk, 60), queue="doomed")
    claim_and_hold.apply_async((steps["dead-claim"].pk, 60), queue="doomed")
    hold.apply_async((steps["live-hold"].pk, 60), queue="alive")
    claim_and_hold.apply_async((steps["live-claim"].pk, 60), queue="alive")
    lock = get_lease_store(app)
    names = {key: f"step:{step.pk}" for key, step in steps.items()}
    held = wait_until(
        lambda: (lambda found: found if len(found) == 4 else None)(
            {key: lock.inspect(name) for key, name in names.items() if lock.inspect(name)}
        ),
        what="four leases",
    )
    wait_until(
        lambda: Step.objects.filter(status="running").count() == 2, what="both claims to commit"
    )
    for key in ("dead-hold", "dead-claim"):
        assert held[key]["worker"].startswith("doomed@")
    for key in ("live-hold", "live-claim"):
        assert held[key]["worker"].startswith("alive@")

    # A lease whose recorded worker answers the ping is kept however stale it looks.
    answering = take(
        lock, "answering", worker=held["live-hold"]["worker"], hostname=ELSEWHERE, pid=1
    )
    age(redis_client, lock, "answering", 600)

    # Kill the doomed worker right after its heartbeat renewed both leases.
    renewed = {k: held[k].get("renewed_ms") for k in ("dead-hold", "dead-claim")}
    wait_until(
        lambda: all(
            lock.inspect(names[k]).get("renewed_ms") not in (None, renewed[k]) for k in renewed
        ),
        what="a renewal of the doomed leases",
    )
    last_renewal = min(int(lock.inspect(names[k])["renewed_ms"]) for k in renewed)
    doomed.kill()

    # The dead worker's leases were renewed a moment ago: nothing is reaped yet, neither by
    # pid nor by ping (a heartbeat that renews proves its holder alive; doubt never reaps).
    cautious = reap(app, dry_run=True)
    now_s, now_us = redis_client.time()
    idle_ms = now_s * 1000 + now_us // 1000 - last_renewal
    assert cautious.ok and cautious.leases_scanned == 5
    if idle_ms < 1.5 * 1500 + 1000:  # the guarantee; a machine stalled that long proves none
        assert cautious.leases_reaped == []
    time.sleep(1.5 * 1.5 + 1 + 0.5)

    dry = reap(app, dry_run=True)
    assert dry.ok, dry.errors
    assert sorted(r["name"] for r in dry.leases_reaped) == sorted(
        [names["dead-hold"], names["dead-claim"]]
    )
    assert [r["pk"] for r in dry.steps_recovered] == [steps["dead-claim"].pk]
    assert all(lock.inspect(names[k])["owner"] == held[k]["owner"] for k in names)
    assert Step.objects.get(pk=steps["dead-claim"].pk).status == "running"

    report = reap(app)
    assert report.ok, report.errors
    reaped = {r["name"]: r for r in report.leases_reaped}
    assert sorted(reaped) == sorted([names["dead-hold"], names["dead-claim"]])
    for key in ("dead-hold", "dead-claim"):
        info = reaped[names[key]]
        assert info["owner"] == held[key]["owner"]
        assert info["ttl"] > 10  # far from its TTL: the reaper, not Redis, removed it
        assert "no longer exists" in info["reason"] or "did not answer" in info["reason"]
        assert lock.inspect(names[key]) is None
    for key in ("live-hold", "live-claim"):
        now = lock.inspect(names[key])
        assert now["owner"] == held[key]["owner"] and now["fence"] == held[key]["fence"]
        assert 0 < now["ttl"] <= 30  # untouched: same owner, TTL still counting
    [recovered] = report.steps_recovered
    assert recovered["pk"] == steps["dead-claim"].pk
    assert recovered["owner"] == held["dead-claim"]["owner"]
    dead_claim = Step.objects.get(pk=steps["dead-claim"].pk)
    assert (dead_claim.status, dead_claim.lock_owner) == ("pending", "")
    assert dead_claim.lock_fence == int(held["dead-claim"]["fence"])  # fence kept
    live_claim = Step.objects.get(pk=steps["live-claim"].pk)
    assert (live_claim.status, live_claim.lock_owner) == ("running", held["live-claim"]["owner"])
    assert Step.objects.get(pk=steps["dead-hold"].pk).status == "pending"  # never claimed
    lease_events = [e for e in expired_events if not e.get("step_id")]
    step_events = [e for e in expired_events if e.get("step_id")]
    assert sorted(e["owner"] for e in lease_events) == sorted(
        held[k]["owner"] for k in ("dead-hold", "dead-claim")
    )
    assert [e["step_id"] for e in step_events] == [steps["dead-claim"].pk]

    assert lock.inspect("answering")["owner"] == answering.owner

    again = reap(app)
    assert again.ok and again.leases_reaped == [] and again.steps_recovered == []
    assert Step.objects.get(pk=steps["dead-claim"].pk).status == "pending"
    alive.kill()  # its 60 s holds would make a warm shutdown wait


# -- streaming ----------------------------------------------------------------------------


def test_batches_are_judged_as_they_come_and_the_report_keeps_a_sample(
    app, lease_store, redis_client, expired_events, monkeypatch, caplog
):
    import logging

    from celery_steplock import reaper as reaper_module

    monkeypatch.setattr(reaper_module, "MAX_RECORDS", 4)
    here = socket.gethostname()
    gone = dead_pid()
    for i in range(9):
        take(lease_store, f"dead:{i}", hostname=here, pid=gone, worker=GHOST)
        age(redis_client, lease_store, f"dead:{i}", 600)
    for i in range(3):
        take(lease_store, f"live:{i}", hostname=here, pid=os.getpid(), worker=GHOST)
    with caplog.at_level(logging.INFO, logger="celery_steplock"):
        report = reap(app, batch_size=2, ping_timeout=PING)
    assert report.ok, report.errors
    assert report.leases_scanned == 12 and report.reaped_count == 9
    assert len(report.leases_reaped) == 4
    assert [r["name"] for r in report.leases_reaped] == sorted(
        r["name"] for r in report.leases_reaped
    )
    assert len(expired_events) == 9
    assert [i for i in range(9) if lease_store.inspect(f"dead:{i}")] == []
    assert all(lease_store.inspect(f"live:{i}") for i in range(3))
    data = report.as_dict()
    assert data["leases_reaped_total"] == 9 and len(data["leases_reaped"]) == 4
    assert "leases reaped: 9" in report.summary_lines()
    assert report.detail_lines()[-1] == "... and 5 more lease(s) not listed"
    lines = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert [r.getMessage().split()[0] for r in lines] == ["event=reaper_run"]


def test_workers_are_pinged_once_for_all_batches(app, lease_store, redis_client, monkeypatch):
    for i in range(6):
        take(
            lease_store,
            f"remote:{i}",
            worker=f"ghost{i % 2}@nowhere.invalid",
            hostname=ELSEWHERE,
            pid=4242,
        )
        age(redis_client, lease_store, f"remote:{i}", 60)
    pinged = []
    real_ping = app.control.ping

    def counting(*args, **kwargs):
        pinged.append(sorted(kwargs["destination"]))
        return real_ping(*args, **kwargs)

    monkeypatch.setattr(app.control, "ping", counting)
    report = reap(app, batch_size=1, ping_timeout=PING)
    assert report.ok and report.reaped_count == 6
    # one broadcast for both silent nodes, one more for those that stayed silent
    assert pinged == [["ghost0@nowhere.invalid", "ghost1@nowhere.invalid"]] * 2


def test_a_hostile_meta_or_key_is_skipped_and_the_run_goes_on(
    app, lease_store, redis_client, expired_events
):
    """A ``meta`` of 1200 ``[`` (RecursionError on the landed code: the whole run aborted)
    and a lease key that is not UTF-8 (not counted on the landed code) beside dead holders:
    the dead ones are reaped, the two others counted, listed as malformed and left alone."""
    here = socket.gethostname()
    for name in ("dead-1", "dead-2"):
        take(lease_store, name, hostname=here, worker=GHOST, pid=dead_pid())
        age(redis_client, lease_store, name, 600)
    raw, odd = write_hostile_leases(redis_client, lease_store, "deep")
    report = reap(app, ping_timeout=PING)
    assert report.ok, report.errors
    assert sorted(r["name"] for r in report.leases_reaped) == ["dead-1", "dead-2"]
    assert report.leases_scanned == 4
    malformed = {m["name"]: m["malformed"] for m in report.leases_malformed}
    assert sorted(malformed) == ["deep", UNREADABLE_NAME]
    assert malformed["deep"].startswith("meta: not a JSON object (")
    assert malformed[UNREADABLE_NAME] == "key: not UTF-8 (cannot be read back)"
    assert lease_store.inspect("deep")["owner"] == "b" * 32 and raw.exists(odd) == 1
    raw.close()
