"""Step recovery out of the core: the reaper loads it by a qualified name
(celery_steplock.reaper.DEFAULT_STEP_RECOVERY -> celery_steplock.contrib.django.recovery)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery

from celery_steplock.contrib.django import recovery
from celery_steplock.lock import get_lease_store
from celery_steplock.reaper import DEFAULT_STEP_RECOVERY, Reaper, reap
from django_app.workflows.models import Step
from tests.helpers import set_settings

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
GHOST = "ghost@nowhere.invalid"
PING = 0.3


@pytest.fixture
def lease_store(app, redis_client):
    return get_lease_store(app)


def stale(store, redis_client, name):
    """A lease of a silent worker, last renewed two minutes ago: the reaper reaps it."""
    lease = store.acquire(
        name,
        ttl=60.0,
        metadata={
            "worker": GHOST,
            "hostname": "elsewhere.invalid",
            "pid": 1,
            "task_name": "t.claim",
        },
    )
    now_s, now_us = redis_client.time()
    redis_client.hset(store.key(name), "renewed_ms", now_s * 1000 + now_us // 1000 - 120_000)
    return lease


def test_the_default_is_the_django_recovery():
    assert DEFAULT_STEP_RECOVERY == "celery_steplock.contrib.django.recovery:recover_steps"
    from celery.utils.imports import symbol_by_name

    assert symbol_by_name(DEFAULT_STEP_RECOVERY) is recovery.recover_steps


def test_the_core_reaper_imports_no_django(redis_server_url, redis_client):
    """reaper.py itself imports no Django: importing it adds no ``django`` module to those
    the package already loaded, nor the Django recovery, and it imports (and reaps leases)
    where Django cannot be imported at all (on a flushed Redis: nothing to scan)."""
    script = """if True:
        import json, sys
        import celery_steplock
        before = set(sys.modules)
        import celery_steplock.reaper, celery_steplock.cli, celery_steplock.ops
        added = sorted(m for m in set(sys.modules) - before
                       if m.split(".")[0] == "django" or "contrib.django" in m)
        print(json.dumps(added))
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []

    no_django = """if True:
        import json, sys
        sys.modules["django"] = None  # "import django" raises ImportError
        from celery import Celery
        from celery_steplock.reaper import reap
        app = Celery("no-django", set_as_current=False)
        app.conf.update(broker_url=sys.argv[1], steplock_redis_url=sys.argv[1])
        report = reap(app, ping_timeout=0.3)
        print(json.dumps([report.ok, report.leases_scanned, report.errors,
                          sorted(m for m in sys.modules if m.startswith("django."))]))
    """
    url = redis_server_url
    result = subprocess.run(
        [sys.executable, "-c", no_django, url],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [True, 0, [], []]


def test_step_recovery_none_skips_pass_two(app, lease_store, redis_client):
    dead = stale(lease_store, redis_client, "step:dead")
    step = Step.objects.create(name="orphan", status="running", lock_owner=dead.owner)
    report = reap(app, ping_timeout=PING, step_recovery=None)
    assert report.ok and [r["name"] for r in report.leases_reaped] == ["step:dead"]
    assert report.steps_recovered == []
    step.refresh_from_db()
    assert step.status == "running"


def test_a_custom_step_recovery_gets_the_run_and_the_scan_outcome(app, lease_store, redis_client):
    dead = stale(lease_store, redis_client, "step:dead")
    live = lease_store.acquire("step:live", ttl=60.0, metadata={"step": "shop.order:9"})
    calls = {}

    class Plan:
        owners = {dead.owner, live.owner, "f" * 32}
        steps = {"shop.order:9", "shop.order:10"}

        def recover(self, live_owners, live_steps, dead_leases):
            calls["recover"] = (live_owners, live_steps, sorted(dead_leases))

    def custom(run):
        assert isinstance(run, Reaper)
        calls["run"] = (run.app, run.dry_run, run.batch_size, run.older_than, sorted(run.recover))
        return Plan()

    report = reap(app, ping_timeout=PING, batch_size=7, older_than=5, step_recovery=custom)
    assert report.ok, report.errors
    assert calls["run"] == (app, False, 7, 5, sorted(app.conf.steplock_reaper_recover))
    # only what the plan watches: the live lease's owner and step; the reaped owner is dead
    assert calls["recover"] == ({live.owner}, {"shop.order:9"}, [dead.owner])


def test_a_step_recovery_that_cannot_be_loaded_is_an_error(app, lease_store, redis_client):
    dead = stale(lease_store, redis_client, "step:dead")
    report = reap(app, ping_timeout=PING, step_recovery="no.such.module:recover")
    assert not report.ok
    assert report.errors[0].startswith(
        "step recovery 'no.such.module:recover' could not be loaded, no step recovered"
    )
    assert [r["name"] for r in report.leases_reaped] == ["step:dead"]  # pass 1 still ran
    assert dead.owner == report.leases_reaped[0]["owner"]


def test_nothing_is_loaded_without_models_to_recover(redis_client, app):
    other = Celery("no-recover", set_as_current=False)
    other.conf.update(
        broker_url=app.conf.broker_url,
        steplock_redis_url=app.conf.broker_url,
        steplock_reaper_recover={},
    )
    report = reap(other, ping_timeout=PING, step_recovery="no.such.module:recover")
    assert report.ok and report.errors == []


def test_recover_steps_reads_rows_before_the_scan(app, lease_store, redis_client):
    """The Django recovery on its own: the rows it watches, then the CAS of the orphans."""
    dead = stale(lease_store, redis_client, "step:dead")
    orphan = Step.objects.create(
        name="orphan", status="running", lock_owner=dead.owner, lock_fence=dead.fence
    )
    held = Step.objects.create(name="held", status="running", lock_owner="a" * 32)
    Step.objects.create(name="idle", status="pending", lock_owner="b" * 32)
    from celery_steplock.reaper import ReapReport

    run = Reaper(
        app,
        ReapReport(),
        dry_run=False,
        batch_size=100,
        older_than=None,
        now=None,
        ping_timeout=PING,
        check_pids=True,
        lock=lease_store,
    )
    plan = run.start_recovery()
    assert isinstance(plan, recovery.StepRecovery)
    assert plan.owners == {dead.owner, "a" * 32}
    assert plan.steps == {f"workflows.step:{orphan.pk}", f"workflows.step:{held.pk}"}
    plan.recover({"a" * 32}, set(), {})
    assert [(r["pk"], r["from_"], r["to"]) for r in run.report.steps_recovered] == [
        (orphan.pk, "running", "pending")
    ]
    orphan.refresh_from_db()
    held.refresh_from_db()
    assert (orphan.status, orphan.lock_owner, orphan.lock_fence) == ("pending", "", dead.fence)
    assert (held.status, held.lock_owner) == ("running", "a" * 32)


def test_a_grace_without_an_age_column_recovers_nothing_and_says_so(app, redis_client):
    """``steplock_reaper_older_than`` needs ``updated_at``: without it a step between two
    phases of a live flow would be moved back at once, so the model is refused instead."""
    from django_app.workflows.models import ArchivableStep

    step = ArchivableStep.objects.create(status="running", lock_owner="f" * 32)
    set_settings(
        app,
        steplock_reaper_recover={"workflows.ArchivableStep": {"running": "pending"}},
        steplock_reaper_older_than=60,
    )
    report = reap(app, ping_timeout=PING)
    assert not report.ok and report.steps_recovered == []
    assert "needs an 'updated_at' column" in report.errors[0]
    step.refresh_from_db()
    assert step.status == "running"
