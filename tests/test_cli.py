"""``celery -A django_app steplock ...`` (celery_steplock.cli) run as real subprocesses through
Celery's ``celery.commands`` entry point, against the session's Redis and the test database."""
import json
import subprocess
import sys

import pytest

from celery_steplock.lock import get_lease_store
from django_app.workflows.models import Step
from helpers import closed_port_url

pytestmark = pytest.mark.django_db(transaction=True)

GHOST = "ghost@nowhere.invalid"


@pytest.fixture
def cli(worker_env, app):
    """``cli(*args, **env) -> CompletedProcess`` of ``celery -A django_app steplock *args``."""

    def run(*args, **env):
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "django_app", "steplock", *args],
            env={**worker_env, **env}, cwd=worker_env["PYTHONPATH"], capture_output=True,
            text=True, timeout=120)

    return run


@pytest.fixture
def lease_store(app, redis_client):
    return get_lease_store(app)


def take(lock, name, **meta):
    lease = lock.acquire(name, ttl=60.0, metadata={"task_name": "proj.tasks.charge",
                                                    "task_id": "1234abcd-task", **meta})
    assert lease is not None
    return lease


def test_ls_lists_held_leases(cli, lease_store):
    empty = cli("ls")
    assert empty.returncode == 0, empty.stderr
    assert "no lease held" in empty.stdout
    first = take(lease_store, "order:1", worker="w1@host", pid=11, step="shop.order:1")
    take(lease_store, "order:2", worker="w2@host", pid=22)
    take(lease_store, "other:9")

    table = cli("ls")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["NAME", "OWNER", "FENCE"]
    assert [line.split()[0] for line in lines[1:4]] == ["order:1", "order:2", "other:9"]
    row = lines[1]
    assert first.owner[:12] in row and str(first.fence) in row and "charge" in row
    assert "w1@host" in row and "shop.order:1" in row and "1234abcd" in row
    assert lines[-1] == "3 lease(s)"

    listed = json.loads(cli("ls", "--json", "--match", "order:*").stdout)
    assert [lease["name"] for lease in listed] == ["order:1", "order:2"]
    assert listed[0]["owner"] == first.owner and listed[0]["fence"] == str(first.fence)
    assert 0 <= listed[0]["age"] < 60 and 0 < listed[0]["ttl"] <= 60

    limited = cli("ls", "--limit", "1")
    assert limited.returncode == 0
    assert len(limited.stdout.splitlines()) == 3  # header, one row, footer
    assert "more not shown (--limit 1)" in limited.stdout


def test_show_prints_one_lease(cli, lease_store):
    lease = take(lease_store, "order:1", worker="w1@host", pid=11)
    shown = cli("show", "order:1")
    assert shown.returncode == 0, shown.stderr
    fields = dict(line.split(None, 1) for line in shown.stdout.splitlines())
    assert fields["owner"] == lease.owner and fields["fence"] == str(lease.fence)
    assert fields["worker"] == "w1@host" and fields["key"] == "steplock:lease:{order:1}"
    as_json = json.loads(cli("show", "order:1", "--json").stdout)
    assert as_json["owner"] == lease.owner and as_json["pid"] == "11"
    missing = cli("show", "order:404")
    assert missing.returncode == 1 and "no lease named 'order:404'" in missing.stderr


def test_release_is_owner_checked(cli, lease_store):
    lease = take(lease_store, "order:1")
    refused = cli("release", "order:1", "--owner", "not-the-owner")
    assert refused.returncode == 1
    assert f"held by another owner ({lease.owner})" in refused.stderr
    assert lease_store.inspect("order:1")["owner"] == lease.owner  # untouched
    released = cli("release", "order:1", "--owner", lease.owner)
    assert released.returncode == 0, released.stderr
    assert f"released 'order:1' (owner {lease.owner}" in released.stdout
    assert lease_store.inspect("order:1") is None
    again = cli("release", "order:1", "--owner", lease.owner)
    assert again.returncode == 1 and "it is not held" in again.stderr
    assert cli("release", "order:1").returncode == 2  # --owner is required (usage error)


def test_reap_dry_run_then_reap(cli, lease_store, redis_client):
    dead = take(lease_store, "step:dead", worker=GHOST, hostname="elsewhere.invalid", pid=1)
    now_s, now_us = redis_client.time()
    redis_client.hset(lease_store.key("step:dead"), "renewed_ms",
                      now_s * 1000 + now_us // 1000 - 120_000)
    live = take(lease_store, "step:live", worker=GHOST, hostname="elsewhere.invalid", pid=1)
    orphan = Step.objects.create(name="orphan", status="running", lock_owner=dead.owner)
    held = Step.objects.create(name="held", status="running", lock_owner=live.owner)

    dry = cli("reap", "--dry-run", "--json", "--ping-timeout", "0.3")
    assert dry.returncode == 0, dry.stderr
    report = json.loads(dry.stdout)
    assert report["dry_run"] and report["ok"] and report["leases_scanned"] == 2
    assert [r["name"] for r in report["leases_reaped"]] == ["step:dead"]
    assert [r["pk"] for r in report["steps_recovered"]] == [orphan.pk]
    assert lease_store.inspect("step:dead") is not None
    orphan.refresh_from_db()
    assert orphan.status == "running"

    done = cli("reap", "--ping-timeout", "0.3")
    assert done.returncode == 0, done.stderr
    assert "reaped lease step:dead" in done.stdout
    assert f"recovered workflows.Step pk={orphan.pk}: running -> pending" in done.stdout
    for line in ("leases scanned: 2", "leases reaped: 1", "steps recovered: 1", "errors: 0"):
        assert line in done.stdout.splitlines()
    orphan.refresh_from_db()
    held.refresh_from_db()
    assert (orphan.status, orphan.lock_owner) == ("pending", "")
    assert (held.status, held.lock_owner) == ("running", live.owner)
    assert lease_store.inspect("step:live")["owner"] == live.owner

    again = cli("reap", "--json", "--ping-timeout", "0.3")
    assert again.returncode == 0
    report = json.loads(again.stdout)
    assert report["leases_reaped"] == [] and report["steps_recovered"] == []


def test_redis_down_exits_non_zero(cli):
    down = {"STEPLOCK_REDIS_URL": closed_port_url()}
    listing = cli("ls", **down)
    assert listing.returncode == 69 and "lock store unavailable" in listing.stderr
    reaping = cli("reap", "--json", **down)
    assert reaping.returncode == 1
    report = json.loads(reaping.stdout)
    assert not report["ok"] and "lease scan failed" in report["errors"][0]
    assert "error: lease scan failed" in reaping.stderr
