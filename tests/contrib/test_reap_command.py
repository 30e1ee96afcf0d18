"""``manage.py reap_expired_leases`` and the ``celery_steplock.reap_expired_leases`` beat task
(celery_steplock.contrib.django.management.commands.reap_expired_leases, .tasks)."""

import json
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from celery_steplock.contrib.django.tasks import reap_expired_leases
from celery_steplock.lock import get_lease_store
from django_app.workflows.models import Step
from helpers import closed_port_url

pytestmark = pytest.mark.django_db(transaction=True)

GHOST = "ghost@nowhere.invalid"


@pytest.fixture
def orphaned(app, redis_client):
    """A dead worker's lease (silent worker, no renewal for 2 minutes), the step it left
    ``running``, and a live-looking lease that must survive."""
    lock = get_lease_store(app)
    dead = lock.acquire(
        "step:dead",
        ttl=60.0,
        metadata={
            "worker": GHOST,
            "hostname": "elsewhere.invalid",
            "pid": 1,
            "task_name": "t.claim",
        },
    )
    now_s, now_us = redis_client.time()
    redis_client.hset(lock.key("step:dead"), "renewed_ms", now_s * 1000 + now_us // 1000 - 120_000)
    live = lock.acquire("step:live", ttl=60.0, metadata={"task_name": "t.claim"})
    step = Step.objects.create(
        name="orphan", status="running", lock_owner=dead.owner, lock_fence=dead.fence
    )
    return lock, dead, live, step


def run(*args):
    out, err = StringIO(), StringIO()
    call_command("reap_expired_leases", *args, "--ping-timeout", "0.3", stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_dry_run_json_reports_and_changes_nothing(orphaned):
    lock, dead, live, step = orphaned
    out, _ = run("--dry-run", "--json")
    report = json.loads(out)
    assert report["dry_run"] and report["ok"] and report["errors"] == []
    assert report["leases_scanned"] == 2
    assert [(r["name"], r["owner"]) for r in report["leases_reaped"]] == [
        ("step:dead", dead.owner)
    ]
    assert [(r["pk"], r["from_"], r["to"]) for r in report["steps_recovered"]] == [
        (step.pk, "running", "pending")
    ]
    assert lock.inspect("step:dead")["owner"] == dead.owner
    step.refresh_from_db()
    assert step.status == "running" and step.lock_owner == dead.owner


def test_human_output_then_idempotent(orphaned):
    lock, dead, live, step = orphaned
    out, err = run()
    assert err == ""
    lines = out.splitlines()
    assert lines[0].startswith(f"reaped lease step:dead (owner {dead.owner[:12]}..")
    assert lines[1].startswith(f"recovered workflows.Step pk={step.pk}: running -> pending")
    # The summary of `celery steplock reap` too (ReapReport.human_lines): one format.
    summary = [line for line in lines[2:] if not line.startswith("effects ")]
    assert summary[:-1] == [
        "leases scanned: 2",
        "leases reaped: 1",
        "steps recovered: 1",
        "errors: 0",
    ]
    assert summary[-1].startswith("duration: ") and summary[-1].endswith("s")
    step.refresh_from_db()
    assert (step.status, step.lock_owner, step.lock_fence) == ("pending", "", dead.fence)
    assert lock.inspect("step:dead") is None and lock.inspect("step:live")["owner"] == live.owner
    out, _ = run("-v", "0")
    assert out == ""
    out, _ = run("--json")
    report = json.loads(out)
    assert report["leases_reaped"] == [] and report["steps_recovered"] == []


def test_older_than_and_batch_size_options(orphaned):
    lock, dead, live, step = orphaned
    out, _ = run("--json", "--older-than", "3600", "--batch-size", "1")
    report = json.loads(out)
    assert [r["name"] for r in report["leases_reaped"]] == ["step:dead"]
    assert report["steps_recovered"] == []  # in flight for less than an hour
    step.refresh_from_db()
    assert step.status == "running"


@pytest.mark.parametrize(
    "args",
    [
        ("--batch-size", "0"),
        ("--older-than", "-1"),
        ("--older-than", "soon"),
        ("--ping-timeout", "0"),
    ],
)
def test_invalid_options_are_usage_errors(app, args):
    with pytest.raises(CommandError):
        call_command("reap_expired_leases", *args)


def test_redis_down_raises_command_error_after_the_report(app, redis_client):
    app.conf.steplock_redis_url = closed_port_url()
    out, err = StringIO(), StringIO()
    with pytest.raises(CommandError, match="met 1 error"):
        call_command("reap_expired_leases", "--json", stdout=out, stderr=err)
    report = json.loads(out.getvalue())
    assert not report["ok"] and "lease scan failed" in report["errors"][0]
    assert "error: lease scan failed" in err.getvalue()


def test_beat_task_returns_the_report(orphaned, app):
    lock, dead, live, step = orphaned
    assert reap_expired_leases.name == "celery_steplock.reap_expired_leases"
    assert reap_expired_leases.name in app.tasks
    dry = reap_expired_leases.apply(kwargs={"dry_run": True, "ping_timeout": 0.3}).get()
    assert dry["dry_run"] and [r["name"] for r in dry["leases_reaped"]] == ["step:dead"]
    done = reap_expired_leases.apply(kwargs={"ping_timeout": 0.3}).get()
    assert done["ok"] and [r["pk"] for r in done["steps_recovered"]] == [step.pk]
    json.dumps(done)  # a JSON result backend can store it
    step.refresh_from_db()
    assert step.status == "pending"
