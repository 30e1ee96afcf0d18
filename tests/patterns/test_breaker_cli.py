"""``celery -A django_app steplock breaker show|open|close NAME`` as real subprocesses, and the
audited override they share with the admin (celery_steplock.ops.override_breaker): the
LeaseEvent row is committed before Redis is written, and a forced-open breaker refuses calls
in every process until it is closed."""

import json
import os
import socket
import subprocess
import sys

import pytest

from celery_steplock import ops
from celery_steplock.patterns.breaker import CLOSED, OPEN, CircuitBreaker
from celery_steplock.exceptions import AuditRecordFailed, CircuitOpen

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def cli(worker_env, app):
    def run(*args, **env):
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "django_app", "steplock", "breaker", *args],
            env={**worker_env, **env},
            cwd=worker_env["PYTHONPATH"],
            capture_output=True,
            text=True,
            timeout=120,
        )

    return run


def os_account():
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def test_open_show_close_from_the_command_line_are_audited(cli, app, redis_client):
    from celery_steplock.contrib.django.models import LeaseEvent

    breaker = CircuitBreaker("payments", app=app)
    opened = cli("open", "payments", "--reason", "provider incident 42")
    assert opened.returncode == 0, opened.stderr
    assert "closed -> open (forced, until closed)" in opened.stdout
    with pytest.raises(CircuitOpen) as refused:
        breaker.call(lambda: "never")
    assert refused.value.context["forced"] is True
    shown = cli("show", "payments", "--json")
    assert shown.returncode == 0, shown.stderr
    state = json.loads(shown.stdout)
    assert (state["state"], state["forced"], state["name"]) == (OPEN, True, "payments")
    closed = cli("close", "payments")
    assert closed.returncode == 0, closed.stderr
    assert breaker.call(lambda: "through") == "through"
    rows = list(LeaseEvent.objects.filter(event="circuit_override").order_by("id"))
    assert [(r.name, r.outcome, r.via, r.actor_host) for r in rows] == [
        ("payments", "done", "cli", socket.gethostname())
    ] * 2
    assert rows[0].reason == "open: provider incident 42"
    assert rows[0].actor.split(" ")[0] == os_account()
    assert rows[1].reason.startswith("close: close by ")
    assert f"audit: LeaseEvent {rows[0].pk}" in opened.stdout


def test_show_on_a_breaker_never_used(cli):
    shown = cli("show", "unknown-dependency")
    assert shown.returncode == 0, shown.stderr
    lines = dict(line.split(None, 1) for line in shown.stdout.splitlines())
    assert (lines["state"], lines["forced"], lines["calls"]) == ("closed", "False", "0")


def test_no_record_no_override(app, redis_client, events):
    class Refusing(ops.BreakerAudit):
        def requested(self, record):
            raise RuntimeError("database down")

    breaker = CircuitBreaker("payments", app=app)
    with pytest.raises(AuditRecordFailed):
        ops.override_breaker(breaker, "open", actor="alice", auditor=Refusing())
    assert breaker.state().state == CLOSED
    record = ops.override_breaker(
        breaker, "open", actor="alice", via="api", auditor=ops.BreakerAudit()
    )
    assert (record.previous, record.outcome, breaker.state().forced) == (CLOSED, "done", True)
    audits = [kw["outcome"] for name, kw in events if name == "circuit_override_audit"]
    assert audits == ["requested", "requested", "done"]
    opened = [kw for name, kw in events if name == "circuit_opened"]
    assert len(opened) == 1 and opened[0]["manual"] is True and opened[0]["actor"] == "alice"
